"""Process-level chores of a worker: exiting without waiting on anything,
not outliving the supervisor, keeping the connection out of forked helpers,
and crashing without a core dump."""

from __future__ import annotations

import ctypes
import faulthandler
import os
import resource
import signal
import sys
from typing import NoReturn, Optional

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4

#: Prefix of every line the worker itself writes to stderr.
PREFIX = "berth_worker"


def _prctl(option: int, value: int) -> None:
    """``prctl(option, value)``, best effort (no libc, no prctl: nothing)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass


def say(message: str) -> None:
    """Writes one line to stderr directly (no Python buffer, no lock that a
    stuck thread could hold)."""
    data = "{}: {}\n".format(PREFIX, message).encode("utf-8", "replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


def die(message: str, code: int = 1) -> NoReturn:
    """Says why and exits at once, whatever the other threads are doing."""
    say(message)
    os._exit(code)


def flush_and_exit(code: int) -> NoReturn:
    """Flushes stdout and stderr, then exits without running atexit handlers
    (a multiprocessing pool's can hang) or waiting for threads."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def arm_parent_death() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (the
    supervisor arms it too; doing it again covers a host that starts workers
    its own way)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def parent_gone() -> Optional[str]:
    """Why not to run on when ``BERTH_PARENT_PID`` names a process that is
    no longer our parent (the supervisor died before the death signal was
    armed), or ``None``."""
    expected = os.environ.get("BERTH_PARENT_PID")
    if expected is None:
        return None
    try:
        pid = int(expected)
    except ValueError:
        return "BERTH_PARENT_PID={} is not a pid".format(expected)
    actual = os.getppid()
    if actual != pid:
        return "the supervisor (pid {}) is gone (parent is now pid {}); exiting".format(pid, actual)
    return None


def keep_out_of_forks(fd: int) -> None:
    """Makes ``fd`` close-on-exec, and points it at /dev/null in every child
    this process forks without exec (a multiprocessing pool), so that no
    helper holds the connection open after the worker is gone. The number
    stays taken in the child, so nothing else reuses it by accident."""
    os.set_inheritable(fd, False)

    def detach() -> None:
        try:
            null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            os.dup2(null, fd, inheritable=False)
            os.close(null)
        except OSError:
            pass

    os.register_at_fork(after_in_child=detach)


def no_core_dump() -> None:
    """A deliberate crash writes no core dump: with systemd-coredump or
    apport a dump takes seconds, and the crash would no longer show how fast
    the supervisor notices a death."""
    try:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (OSError, ValueError):
        pass
    _prctl(_PR_SET_DUMPABLE, 0)


def default_disposition(signum: int) -> None:
    """Restores ``signum``'s default action and turns faulthandler off, so
    the signal kills the process as a real fault would."""
    faulthandler.disable()
    try:
        signal.signal(signum, signal.SIG_DFL)
    except (ValueError, OSError):
        # Not the main thread: Python installs no handler of its own for
        # SIGSEGV or SIGABRT, so the default is already in place.
        pass
