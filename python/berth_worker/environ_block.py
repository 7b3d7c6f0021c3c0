"""The preloader's environment: the variables berth gives it, and its initial
environment block, which ``/proc/<pid>/environ`` and ``ps e`` show whatever
``os.environ`` says, and which a forked worker (or the spare) overwrites
with its own so that berth finds it by its model and mark there.
"""

from __future__ import annotations

import ctypes
import os
from typing import Dict, Optional, Tuple

from .process import say

#: The environment variable that makes ``serve`` a preloader.
ENV_PRELOAD = "BERTH_PRELOAD"


#: The ``cgroup.procs`` the first spare worker joins (each fork frame's
#: ``spare_cgroup_procs`` names the next one's).
ENV_SPARE_CGROUP = "BERTH_SPARE_CGROUP"


MARK = "BERTH_WORKER_MARK"


def mark_address() -> Optional[int]:
    """Where this process's initial environment block holds its mark's
    value: ``/proc/<pid>/environ`` shows that block, not ``os.environ``, and
    berth finds what a worker started by the mark it reads there. Taken
    before anything changes the environment."""
    if MARK not in os.environ:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        libc.getenv.argtypes = [ctypes.c_char_p]
        address = libc.getenv(MARK.encode())
    except (OSError, AttributeError):
        return None
    return int(address) if address else None


#: A variable of spaces the supervisor gives the preloader, so that its
#: initial environment block has room for each forked worker's own.
SPACE = "BERTH_ENV_SPACE"


def environ_block() -> Optional[Tuple[int, int]]:
    """Where the kernel keeps this process's initial environment
    (``/proc/self/stat`` fields 50 and 51): what ``/proc/<pid>/environ``
    and ``ps e`` show, whatever ``os.environ`` says."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def rewrite_environ(env: Dict[str, str]) -> bool:
    """Writes ``env`` over the initial environment block, padded with one
    variable of spaces, so that ``/proc/<pid>/environ`` tells the forked
    worker's environment (its model, its mark: berth finds what a worker
    started by the mark it reads there). False if it does not fit. Called
    after ``os.environ`` was cleared: nothing in libc's environment points
    into the block then."""
    block = environ_block()
    if block is None:
        return False
    start, end = block
    size = end - start
    data = b"".join("{}={}".format(k, v).encode("utf-8") + b"\0" for k, v in env.items())
    rest = size - len(data)
    pad = (SPACE + "=").encode("ascii")
    if rest == 0:
        pass
    elif rest >= len(pad) + 1:
        data += pad + b" " * (rest - len(pad) - 1) + b"\0"
    else:
        return False
    ctypes.memmove(start, data, size)
    return True


def rewrite_mark(address: Optional[int], old: str, new: str) -> None:
    """Writes the forked worker's mark over the preloader's, in place in the
    initial environment block (marks are of one length): where the whole
    environment did not fit, at least the processes it forks without exec
    are known for its own."""
    if address is None or len(old) != len(new) or not new.isascii():
        say("cannot carry this worker's mark in its process environment; its descendants are "
            "found by its cgroup only")
        return
    ctypes.memmove(address, new.encode("ascii"), len(new))


def mark_in_block() -> Optional[int]:
    """Where the mark's value lies in the initial environment block, read
    from the block itself (after a rewrite moved it)."""
    block = environ_block()
    if block is None:
        return None
    start, end = block
    data = ctypes.string_at(start, end - start)
    key = b"\0" + MARK.encode("ascii") + b"="
    at = data.find(key)
    if at >= 0:
        return start + at + len(key)
    return start + len(key) - 1 if data.startswith(key[1:]) else None
