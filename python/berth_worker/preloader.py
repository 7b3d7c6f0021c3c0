"""The preloaded interpreter: imports a worker kind's heavy modules once,
then forks a worker for each model of that kind (docs/wire.md, "Preloaded
workers").

The supervisor starts the kind's own program with ``BERTH_PRELOAD`` (a JSON
list of module names) and a control socket at ``BERTH_FD``. The program
reaches :func:`~berth_worker.serve.serve` as usual, which hands over to
:func:`become_preloader`: it imports the modules one by one, checking after
each that the process is still safe to fork (one thread, no GPU device
open), says ``preloaded`` (or ``refused``, naming the module at fault), and
then answers ``fork`` frames. Each fork is double: an intermediate child
forks the worker and exits at once, so the worker is re-parented to the
supervisor (a child subreaper), which reaps it and reads its exit status
like any worker's. In the worker, :func:`become_preloader` returns: its
environment, working folder, cgroup, stdout, stderr and wire socket are
the ones the fork frame gave, every other descriptor the preloader held
points at ``/dev/null``, and ``serve`` goes on as for a cold start.
"""

from __future__ import annotations

import array
import ctypes
import enum
import importlib
import json
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Dict, List, NoReturn, Optional, Tuple

from .process import arm_parent_death, die, flush_and_exit, keep_out_of_forks, parent_gone, say
from .wire import PREFIX, FrameError, check_prefix, decode_header, encode_frame

#: The environment variable that makes ``serve`` a preloader.
ENV_PRELOAD = "BERTH_PRELOAD"

_MAX_FRAME = 1 << 20
#: A fork frame carries three descriptors: the wire, stdout, stderr.
_FORK_FDS = 3
_FD_SIZE = array.array("i").itemsize

#: Device files whose being open means a GPU context (or a driver handle a
#: fork cannot share): NVIDIA, AMD's KFD, DRM render nodes, accel.
_DEVICE_PREFIXES = ("/dev/nvidia", "/dev/kfd", "/dev/dri/", "/dev/accel")

#: The ``cgroup.procs`` the first spare worker joins (each fork frame's
#: ``spare_cgroup_procs`` names the next one's).
ENV_SPARE_CGROUP = "BERTH_SPARE_CGROUP"

#: How long a forked worker waits to be re-parented to the supervisor.
_REPARENT_WAIT = 2.0


def _threads() -> int:
    """This process's threads, as the kernel counts them (C threads too)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _open_fds() -> Dict[int, str]:
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
    devices = sorted({path for path in _open_fds().values() if path.startswith(_DEVICE_PREFIXES)})
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


# -- the control socket's frames ---------------------------------------------


def _send(sock: socket.socket, header: Dict[str, Any]) -> None:
    sock.sendall(encode_frame(header))


class _Control:
    """Reads frames (with up to three descriptors each) from the supervisor."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.fds: List[int] = []

    def read(self) -> Tuple[Dict[str, Any], List[int]]:
        """The next frame's header and the descriptors that came with it."""
        while True:
            if len(self.buf) >= 8:
                length, head_length = PREFIX.unpack_from(self.buf, 0)
                if length > _MAX_FRAME:
                    raise ValueError("a control frame of {} bytes is too long".format(length))
                check_prefix(length, head_length)
                if len(self.buf) >= 4 + length:
                    head = bytes(self.buf[8 : 8 + head_length])
                    del self.buf[: 4 + length]
                    fds, self.fds = self.fds, []
                    return decode_header(head), fds
            data, ancdata, flags, _ = self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(_FORK_FDS * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
            )
            for level, kind, raw in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(raw[: len(raw) - len(raw) % _FD_SIZE])
                    self.fds.extend(got)
            if flags & int(socket.MSG_CTRUNC):
                raise ValueError("more descriptors came with a control frame than it takes")
            if not data:
                raise EOFError("the supervisor closed the control socket")
            self.buf += data


# -- the preloader -----------------------------------------------------------


def _modules() -> List[str]:
    raw = os.environ.get(ENV_PRELOAD, "")
    try:
        modules = json.loads(raw)
    except ValueError:
        die("{}={!r} is not a JSON list of module names".format(ENV_PRELOAD, raw), 2)
    if not isinstance(modules, list) or not all(isinstance(m, str) and m for m in modules):
        die("{}={!r} is not a JSON list of module names".format(ENV_PRELOAD, raw), 2)
    return modules


def _preload(modules: List[str]) -> Tuple[Optional[str], Optional[str]]:
    """Imports ``modules`` in order; the first that fails or leaves the
    process unsafe to fork, and why."""
    why = unsafe_to_fork()
    if why is not None:
        return "(before any preload)", why
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # SystemExit from a module too: it is refused, not obeyed
            return name, "importing it failed: {}: {}".format(type(e).__name__, e)
        why = unsafe_to_fork()
        if why is not None:
            return name, "after importing it, " + why
    return None, None


_MARK = "BERTH_WORKER_MARK"


def _mark_address() -> Optional[int]:
    """Where this process's initial environment block holds its mark's
    value: ``/proc/<pid>/environ`` shows that block, not ``os.environ``, and
    berth finds what a worker started by the mark it reads there. Taken
    before anything changes the environment."""
    if _MARK not in os.environ:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        libc.getenv.argtypes = [ctypes.c_char_p]
        address = libc.getenv(_MARK.encode())
    except (OSError, AttributeError):
        return None
    return int(address) if address else None


#: A variable of spaces the supervisor gives the preloader, so that its
#: initial environment block has room for each forked worker's own.
_SPACE = "BERTH_ENV_SPACE"


def _environ_block() -> Optional[Tuple[int, int]]:
    """Where the kernel keeps this process's initial environment
    (``/proc/self/stat`` fields 50 and 51): what ``/proc/<pid>/environ``
    and ``ps e`` show, whatever ``os.environ`` says."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[47]), int(fields[48])
    except (OSError, IndexError, ValueError):
        return None


def _rewrite_environ(env: Dict[str, str]) -> bool:
    """Writes ``env`` over the initial environment block, padded with one
    variable of spaces, so that ``/proc/<pid>/environ`` tells the forked
    worker's environment (its model, its mark: berth finds what a worker
    started by the mark it reads there). False if it does not fit. Called
    after ``os.environ`` was cleared: nothing in libc's environment points
    into the block then."""
    block = _environ_block()
    if block is None:
        return False
    start, end = block
    size = end - start
    data = b"".join("{}={}".format(k, v).encode("utf-8") + b"\0" for k, v in env.items())
    rest = size - len(data)
    pad = (_SPACE + "=").encode("ascii")
    if rest == 0:
        pass
    elif rest >= len(pad) + 1:
        data += pad + b" " * (rest - len(pad) - 1) + b"\0"
    else:
        return False
    ctypes.memmove(start, data, size)
    return True


def _rewrite_mark(address: Optional[int], old: str, new: str) -> None:
    """Writes the forked worker's mark over the preloader's, in place in the
    initial environment block (marks are of one length): where the whole
    environment did not fit, at least the processes it forks without exec
    are known for its own."""
    if address is None or len(old) != len(new) or not new.isascii():
        say("cannot carry this worker's mark in its process environment; its descendants are "
            "found by its cgroup only")
        return
    ctypes.memmove(address, new.encode("ascii"), len(new))


def become_preloader() -> None:
    """Runs the preloader until the supervisor goes away; returns only in a
    forked worker, set up to go on as one."""
    mark = (_mark_address(), os.environ.get(_MARK, ""))
    modules = _modules()
    raw_fd = os.environ.get("BERTH_FD")
    if raw_fd is None or not raw_fd.isdigit():
        die("{} is set but BERTH_FD is not: a preloader is started by berth".format(ENV_PRELOAD), 2)
    fd = int(raw_fd)
    arm_parent_death()
    gone = parent_gone()
    if gone is not None:
        die(gone, 2)
    # In every child, the control socket's number points at /dev/null.
    keep_out_of_forks(fd)
    sock = socket.socket(fileno=fd)
    control = _Control(sock)
    started = time.monotonic()
    culprit, why = _preload(modules)
    micros = int((time.monotonic() - started) * 1_000_000)
    if culprit is not None:
        say("preload refused: module `{}`: {}".format(culprit, why))
        _send(sock, {"type": "refused", "module": culprit, "reason": why})
        flush_and_exit(3)
    _send(
        sock,
        {
            "type": "preloaded",
            "pid": os.getpid(),
            "modules": modules,
            "import_us": micros,
            "open_files": sorted(set(_open_fds().values()) - {"/dev/null"}),
        },
    )
    say("preloaded {} in {:.0f} ms; forking workers".format(", ".join(modules), micros / 1000))
    spare: Optional[_Spare] = None
    spare_cgroup = os.environ.pop(ENV_SPARE_CGROUP, None)
    while True:
        if spare is None:
            # The next load's worker, forked now, while nobody waits for it.
            made = _Spare.make(sock, mark, spare_cgroup)
            if made is _IN_SPARE:
                # This process is that spare, and has been handed its load.
                return
            spare = made
        try:
            header, fds = control.read()
        except EOFError:
            flush_and_exit(0)
        except (OSError, ValueError, FrameError) as e:
            die("the control socket broke: {}; exiting".format(e))
        if header["type"] != "fork":
            for extra in fds:
                os.close(extra)
            die("the supervisor sent `{}` to a preloader; exiting".format(header["type"]))
        given = header.get("spare_cgroup_procs")
        if spare is not None and spare.fits(header, fds):
            if _hand_to_spare(sock, spare, header, fds):
                spare = None
                spare_cgroup = given if isinstance(given, str) else None
                continue
            spare = None  # it was gone
        outcome = _fork(sock, header, fds, mark, spare_kept=spare is not None)
        if outcome is _Forked.WORKER:
            # The forked worker: its setup is done; serve() goes on.
            return
        if spare is None:
            # The next spare goes where this frame says; after a failed
            # fork nowhere (the supervisor dropped that cgroup, and the
            # frame's own is the cold worker's now): the next load moves it.
            ok = outcome is _Forked.ANSWERED and isinstance(given, str)
            spare_cgroup = given if ok else None


class _Spare:
    """A worker forked ahead of its load (as a fork frame's would be), so
    that a load does not wait for the fork: already the supervisor's child,
    waiting on a socket pair of its own for the fork frame the preloader
    hands on to it. One at a time; it shares all but a few pages with the
    preloader, and goes with it (it stays in the preloader's process group
    and sees its socket close)."""

    def __init__(self, pid: int, link: socket.socket, joined: Optional[Tuple[int, int]]) -> None:
        self.pid = pid
        self.link: Optional[socket.socket] = link
        #: The cgroup folder it joined (device, inode), if it joined one.
        self.joined = joined

    def fits(self, header: Dict[str, Any], fds: List[int]) -> bool:
        """Whether a fork frame is one to hand this spare: one a fork takes,
        naming the cgroup the spare joined (the supervisor made that one
        this worker's) or none. A frame naming another cgroup (two loads at
        once, the other took this spare's) is forked afresh and the spare
        kept for the frame that names its cgroup."""
        if len(fds) != _FORK_FDS:
            return False
        procs = header.get("cgroup_procs")
        return not isinstance(procs, str) or self.joined is None or _already_in(procs, self.joined)

    @staticmethod
    def make(sock: socket.socket, mark: Tuple[Optional[int], str], cgroup: Optional[str]) -> Any:
        """Forks a spare, which joins the cgroup whose ``cgroup.procs`` is
        ``cgroup`` (made for it by the supervisor, which makes it the
        worker's at the fork), and waits until it is the supervisor's child:
        the spare (``None`` if that failed, said why) in the preloader, and
        :data:`_IN_SPARE` in the spare once it has been handed its load."""
        if unsafe_to_fork() is not None:
            return None  # the next fork frame says why
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = _double_fork()
        except ChildProcessError:
            # Something reaps this process's children (a preloaded module
            # ignoring SIGCHLD): it cannot tell a worker's fork worked, and
            # ends here, as it would at a fork frame.
            raise
        except OSError as e:
            ours.close()
            theirs.close()
            say("no spare worker: forking it failed: {}".format(e))
            return None
        if pid == 0:
            ours.close()
            _serve_as_spare(sock, theirs, mark, cgroup)
            return _IN_SPARE
        theirs.close()
        spare = _Spare(pid, ours, None)
        try:
            ours.settimeout(_REPARENT_WAIT + 1.0)
            ready = ours.recv(1)
            ours.settimeout(None)
        except OSError as e:
            ready, why = b"", str(e)
        else:
            why = "it exited"
        if ready not in (b"r", b"j"):
            say("no spare worker: pid {} did not get ready ({})".format(pid, why))
            spare.close()
            return None
        if ready == b"j" and cgroup is not None:
            # It joined `cgroup`: that folder is its, whatever its name later.
            try:
                st = os.stat(os.path.dirname(cgroup))
                spare.joined = (st.st_dev, st.st_ino)
            except OSError:
                pass
        return spare

    def close(self) -> None:
        """Lets it go: it sees its socket close and exits."""
        if self.link is not None:
            self.link.close()
            self.link = None


#: What :meth:`_Spare.make` returns in the spare itself.
_IN_SPARE = object()


def _hand_to_spare(sock: socket.socket, spare: _Spare, header: Dict[str, Any], fds: List[int]) -> bool:
    """Hands a fork frame (one it :meth:`~_Spare.fits`) and its descriptors
    on to the spare and answers it with the spare's pid. False, nothing
    handed, if the spare is gone (then closed)."""
    if spare.link is None:
        return False
    try:
        socket.send_fds(spare.link, [encode_frame(header)], fds)
    except OSError:
        spare.close()
        return False
    spare.close()
    for extra in fds:
        os.close(extra)
    _send(sock, {"type": "forked", "id": header.get("id"), "pid": spare.pid, "spare_kept": False})
    return True


class _SecondForkFailed(OSError):
    """The intermediate child could not fork: no worker, nothing left."""


def _double_fork() -> int:
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
        raise _SecondForkFailed("the second fork failed")
    return struct.unpack("<i", raw)[0]


def _serve_as_spare(
    sock: socket.socket,
    link: socket.socket,
    mark: Tuple[Optional[int], str],
    cgroup: Optional[str],
) -> None:
    """In the spare: waits to be the supervisor's child, joins its cgroup,
    says so, then waits for the fork frame the preloader hands on, and sets
    up as that worker. Exits (0) when the preloader goes without
    handing it one."""
    _wait_for_the_supervisor()
    arm_parent_death()
    if parent_gone() is not None:
        os._exit(0)
    # Joined once it is the supervisor's child: the supervisor finds its
    # spare by its cgroup's members.
    joined = _join(cgroup) if cgroup is not None else None
    mark = _name_as_spare(mark)
    try:
        # Ready, and whether it is in the cgroup it was given.
        link.sendall(b"r" if joined is None else b"j")
        header, fds = _Control(link).read()
    except (OSError, ValueError, EOFError, FrameError):
        os._exit(0)
    link.close()
    if len(fds) != _FORK_FDS:
        os._exit(1)
    _become_worker(sock, header, fds, mark, joined)


class _Forked(enum.Enum):
    """How :func:`_fork` ended, where it returns."""

    WORKER = "in the forked worker"
    ANSWERED = "forked, and answered with its pid"
    FAILED = "answered with why not"


def _fork(
    sock: socket.socket,
    header: Dict[str, Any],
    fds: List[int],
    mark: Tuple[Optional[int], str],
    spare_kept: bool = False,
) -> "_Forked":
    """Answers one fork frame by forking its worker now (no spare was
    ready, or the one waiting is kept for the frame naming its cgroup:
    ``spare_kept``, said in the answer)."""
    request_id = header.get("id")
    if len(fds) != _FORK_FDS:
        for extra in fds:
            os.close(extra)
        _send(sock, {"type": "fork_failed", "id": request_id,
                     "reason": "{} descriptors came with the fork; it takes 3".format(len(fds))})
        return _Forked.FAILED
    why = unsafe_to_fork()
    if why is not None:
        # Something the preload started has since made forking unsafe.
        _send(sock, {"type": "refused", "module": "(after the preload)", "reason": why})
        flush_and_exit(3)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        worker_pid = _double_fork()
    except _SecondForkFailed as e:
        for extra in fds:
            os.close(extra)
        _send(sock, {"type": "fork_failed", "id": request_id, "reason": str(e)})
        return _Forked.FAILED
    if worker_pid == 0:
        _become_worker(sock, header, fds, mark)
        return _Forked.WORKER
    for extra in fds:
        os.close(extra)
    _send(sock, {"type": "forked", "id": request_id, "pid": worker_pid, "spare_kept": spare_kept})
    return _Forked.ANSWERED


def _name_as_spare(mark: Tuple[Optional[int], str]) -> Tuple[Optional[int], str]:
    """Shows the spare for what it is where processes are told apart by
    their environment (``/proc/<pid>/environ``, ``ps e``): its preloader's,
    with ``BERTH_MODEL`` ending in ``-spare``, the mark kept (it goes with
    the preloader). Returns where the mark now lies in the block."""
    env = {k: v for k, v in os.environ.items() if k != _SPACE}
    model = env.get("BERTH_MODEL")
    if model is None:
        return mark
    env["BERTH_MODEL"] = model + "-spare"
    os.environ.clear()
    rewritten = _rewrite_environ(env)
    os.environ.update(env)
    if not rewritten:
        return mark
    return _mark_in_block(), mark[1]


def _mark_in_block() -> Optional[int]:
    """Where the mark's value lies in the initial environment block, read
    from the block itself (after a rewrite moved it)."""
    block = _environ_block()
    if block is None:
        return None
    start, end = block
    data = ctypes.string_at(start, end - start)
    key = b"\0" + _MARK.encode("ascii") + b"="
    at = data.find(key)
    if at >= 0:
        return start + at + len(key)
    return start + len(key) - 1 if data.startswith(key[1:]) else None


def _join(procs: str) -> Optional[Tuple[int, int]]:
    """Moves this process into the cgroup whose ``cgroup.procs`` is
    ``procs``; that cgroup's folder (device, inode: the supervisor may
    rename it), or ``None`` if the move failed (said why)."""
    try:
        with open(procs, "w") as f:
            f.write("0")
        st = os.stat(os.path.dirname(procs))
    except OSError as e:
        say("the spare worker could not join its cgroup {}: {}".format(procs, e))
        return None
    return st.st_dev, st.st_ino


def _already_in(procs: str, joined: Optional[Tuple[int, int]]) -> bool:
    """Whether the cgroup of ``procs`` is the one this process joined ahead
    (its folder the same, whatever its name now)."""
    if joined is None:
        return False
    try:
        st = os.stat(os.path.dirname(procs))
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == joined


def _become_worker(
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
        if isinstance(procs, str) and not _already_in(procs, joined):
            with open(procs, "w") as f:
                f.write("0")
        _null_all_but(3)
        given = header.get("env")
        env = {str(k): str(v) for k, v in given.items()} if isinstance(given, dict) else {}
        env["BERTH_FD"] = "3"
        env.pop(ENV_PRELOAD, None)
        os.environ.clear()
        if not _rewrite_environ(env):
            _rewrite_mark(mark[0], mark[1], env.get(_MARK, ""))
            say("this worker's environment does not fit the preloader's environment block; "
                "/proc/<pid>/environ shows the preloader's but for the mark")
        os.environ.update(env)
        cwd = header.get("cwd")
        if isinstance(cwd, str):
            os.chdir(cwd)
    except BaseException as e:
        _fail("setting up the forked worker failed: {}: {}".format(type(e).__name__, e))
    _wait_for_the_supervisor()


def _null_all_but(keep_up_to: int) -> None:
    """Points every descriptor above ``keep_up_to`` at /dev/null: nothing
    the preloader held reaches the worker, and the numbers stay taken, so a
    Python object that closes its old number later closes nothing else."""
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in _open_fds():
            if fd > keep_up_to and fd != null:
                try:
                    os.dup2(null, fd, inheritable=False)
                except OSError:
                    pass
    finally:
        os.close(null)


def _wait_for_the_supervisor() -> None:
    """Returns once the intermediate child has exited and this process is
    the supervisor's (``BERTH_PARENT_PID``) child."""
    raw = os.environ.get("BERTH_PARENT_PID", "")
    if not raw.isdigit():
        return
    supervisor = int(raw)
    deadline = time.monotonic() + _REPARENT_WAIT
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
