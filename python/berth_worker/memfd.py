"""Sealed memfds: how bulk bytes of 64 KiB or more cross the wire
(docs/wire.md §3). Nothing is named in /dev/shm or anywhere else, so a crash
leaves nothing behind."""

from __future__ import annotations

import fcntl
import mmap
import os
import sys

#: The seals a memfd carries before it is sent.
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
#: The seals a received memfd must carry (F_SEAL_SEAL is not required).
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_WRITE_STEP = 1 << 30


class MemfdRefused(ValueError):
    """A received descriptor that is not a sealed memfd of the declared size."""


def make_memfd(data: memoryview, name: str = "berth-bulk") -> int:
    """A sealed memfd holding ``data``; the caller closes it after sending."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        written = 0
        total = data.nbytes
        while written < total:
            written += os.write(fd, data[written : written + _WRITE_STEP])
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_memfd(fd: int, size: int) -> memoryview:
    """Maps a received memfd read-only and returns a view of its first
    ``size`` bytes. Checks it is sealed and large enough first (a smaller or
    shrinkable file would make reading the mapping a SIGBUS). Does not close
    ``fd``."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        raise MemfdRefused("the descriptor sent with a memfd frame is not a memfd ({})".format(e)) from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise MemfdRefused(
            "the memfd is not sealed against shrinking, growing and writing (seals {:#x})".format(seals)
        )
    actual = os.fstat(fd).st_size
    if actual < size:
        raise MemfdRefused("the memfd holds {} bytes, fewer than the {} declared".format(actual, size))
    if size == 0:
        return memoryview(b"")
    extra = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    region = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **extra)
    return memoryview(region)
