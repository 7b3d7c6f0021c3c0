"""The worker's view of its own memory, for pongs (from procfs)."""

from __future__ import annotations

import os
from typing import Tuple

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """Resident set size now: the second field of /proc/self/statm, in pages."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def peak_rss_bytes() -> int:
    """The resident set's high-water mark: ``VmHWM`` in /proc/self/status."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def self_memory() -> Tuple[int, int]:
    """``(rss_bytes, peak_rss_bytes)``; zeros where procfs cannot be read
    (never fatal: the figures are advisory)."""
    return rss_bytes(), peak_rss_bytes()
