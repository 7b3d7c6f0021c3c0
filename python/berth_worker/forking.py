"""Forking a worker from the preloaded interpreter: whether the process is
safe to fork, the double fork that makes the worker the supervisor's child,
and the worker's own setup in the child (its session, cgroup, descriptors,
environment and folder).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Dict, List, NoReturn, Optional, Tuple

from .environ_block import ENV_PRELOAD, MARK, rewrite_environ, rewrite_mark
from .process import say

#: Device files whose being open means a GPU context (or a driver handle a
#: fork cannot share): NVIDIA, AMD's KFD, DRM render nodes, accel.
_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/", "/dev/accel")


#: How long a forked worker waits to be re-parented to the supervisor.
REPARENT_WAIT = 2.0


def _threads() -> int:
    """This process's threads, as the kernel counts them (C threads too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def open_fds() -> Dict[int, str]:
    """Every open descriptor and what it points at."""
    out: Dict[int, str] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            fd = int(name)
            out[fd] = os.readlink("/proc/self/fd/{}".format(fd))
        except (ValueError, OSError):
            continue
    return out


def _quiesce_openblas() -> None:
    """Stops OpenBLAS's thread pool (numpy starts one when imported), as
    OpenBLAS's own fork handler does; it starts again at the first product
    after the fork, in the worker. Only the pool's own shutdown entry point
    is called, in libraries already loaded."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower() and ".so" in line}
    except OSError:
        return
    for path in sorted(paths):
        try:
            shutdown = getattr(ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0)), "blas_thread_shutdown_", None)
        except OSError:
            continue
        if shutdown is not None:
            shutdown()


def unsafe_to_fork() -> Optional[str]:
    """Why this process cannot be forked safely now, or ``None``: a second
    thread (its locks and state would be copied mid-flight, the thread
    itself not), or an open GPU device (a CUDA context does not survive a
    fork)."""
    _quiesce_openblas()
    threads = _threads()
    if threads > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        named = " (Python threads: {})".format(", ".join(names)) if names else ""
        return "{} threads are running{}; a process is forked safely only with one".format(
            threads, named
        )
    devices = sorted({path for path in open_fds().values() if path.startswith(_DEVICE_PREFIXES)})
    if devices:
        return "a GPU device is open ({}): a device context cannot be forked".format(", ".join(devices))
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None) if torch is not None else None
    try:
        if cuda is not None and cuda.is_initialized():
            return "CUDA is initialised: a CUDA context cannot be forked"
    except Exception:  # an odd torch build: the device check above stands
        pass
    return None


class SecondForkFailed(OSError):
    """The intermediate child could not fork: no worker, nothing left."""


def double_fork() -> int:
    """Forks a process whose parent exits at once, so that it is re-parented
    to the supervisor (a child subreaper): its pid in the caller, 0 in it."""
    pid_r, pid_w = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        os.close(pid_r)
        try:
            worker = os.fork()
        except OSError:
            os._exit(1)
        if worker == 0:
            os.close(pid_w)
            return 0
        os.write(pid_w, struct.pack("<i", worker))
        try:
            # Its exit tears its copy of the interpreter down (milliseconds
            # of the kernel's work): behind the worker just handed its load.
            os.nice(19)
        except OSError:
            pass
        os._exit(0)
    os.close(pid_w)
    raw = b""
    try:
        while len(raw) < 4:
            got = os.read(pid_r, 4 - len(raw))
            if not got:
                break
            raw += got
    finally:
        os.close(pid_r)
    # Reaped before the answer: the worker is then the supervisor's child.
    os.waitpid(intermediate, 0)
    if len(raw) != 4:
        raise SecondForkFailed("the second fork failed")
    return struct.unpack("<i", raw)[0]


def join_cgroup(procs: str) -> Optional[Tuple[int, int]]:
    """Moves this process into the cgroup whose ``cgroup.procs`` is
    ``procs``; that cgroup's folder (device, inode: the supervisor may
    rename it), or ``None`` if the move failed (said why)."""
    try:
        with open(procs, "w") as f:
            f.write("0")
    except OSError as e:
        say("the spare worker could not join its cgroup {}: {}".format(procs, e))
        return None
    return cgroup_folder(procs)


def cgroup_folder(procs: str) -> Optional[Tuple[int, int]]:
    """The folder of the cgroup whose ``cgroup.procs`` is ``procs``, as
    (device, inode): the same whatever the supervisor renames it to;
    ``None`` if it cannot be read."""
    try:
        st = os.stat(os.path.dirname(procs))
    except OSError:
        return None
    return st.st_dev, st.st_ino


def already_in(procs: str, joined: Optional[Tuple[int, int]]) -> bool:
    """Whether the cgroup of ``procs`` is the one this process joined ahead
    (its folder the same, whatever its name now)."""
    return joined is not None and cgroup_folder(procs) == joined


def become_worker(
    sock: socket.socket,
    header: Dict[str, Any],
    fds: List[int],
    mark: Tuple[Optional[int], str],
    joined: Optional[Tuple[int, int]] = None,
) -> None:
    """In the forked worker: its own session, cgroup (unless it ``joined``
    that one ahead, as a spare), descriptors, environment and folder, then
    waits to be the supervisor's child."""
    wire, out, err = fds
    try:
        # Its own output first, so that whatever fails below is its own.
        sock.detach()  # its number is the wire's next
        os.dup2(wire, 3)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.setsid()
        procs = header.get("cgroup_procs")
        if isinstance(procs, str) and not already_in(procs, joined):
            with open(procs, "w") as f:
                f.write("0")
        _null_all_but(3)
        given = header.get("env")
        env = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
        env["BERTH_FD"] = "3"
        env.pop(ENV_PRELOAD, None)
        os.environ.clear()
        if not rewrite_environ(env):
            rewrite_mark(mark[0], mark[1], env.get(MARK, ""))
            say("this worker's environment does not fit the preloader's environment block; "
                "/proc/<pid>/environ shows the preloader's but for the mark")
        os.environ.update(env)
        cwd = header.get("cwd")
        if isinstance(cwd, str):
            os.chdir(cwd)
    except BaseException as e:
        _fail("setting up the forked worker failed: {}: {}".format(type(e).__name__, e))
    wait_for_the_supervisor()


def _null_all_but(keep_up_to: int) -> None:
    """Points every descriptor above ``keep_up_to`` at /dev/null: nothing
    the preloader held reaches the worker, and the numbers stay taken, so a
    Python object that closes its old number later closes nothing else."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in open_fds():
            if fd > keep_up_to and fd != null:
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:
                    pass
    finally:
        os.close(null)


def wait_for_the_supervisor() -> None:
    """Returns once the intermediate child has exited and this process is
    the supervisor's (``BERTH_PARENT_PID``) child."""
    raw = os.environ.get("BERTH_PARENT_PID", "")
    if not raw.isdigit():
        return
    supervisor = int(raw)
    deadline = time.monotonic() + REPARENT_WAIT
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            _fail(
                "this forked worker was not re-parented to the supervisor (pid {}; parent is pid "
                "{}): the supervisor must be a child subreaper".format(supervisor, os.getppid())
            )
        time.sleep(0.0005)


def _fail(message: str) -> NoReturn:
    say(message)
    os._exit(1)
