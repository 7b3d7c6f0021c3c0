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

A load's worker is usually forked ahead, as a spare (``spare.py``); the
fork itself and the worker's setup are ``forking.py``'s, the control
socket's frames ``control.py``'s, the environment block ``environ_block.py``'s.
"""

from __future__ import annotations

import enum
import importlib
import json
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from .control import FORK_FDS, Control, send
from .environ_block import ENV_PRELOAD, ENV_SPARE_CGROUP, MARK, mark_address
from .forking import SecondForkFailed, become_worker, double_fork, open_fds, unsafe_to_fork
from .process import arm_parent_death, die, flush_and_exit, keep_out_of_forks, parent_gone, say
from .spare import IN_SPARE, Spare, hand_to_spare
from .wire import FrameError

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


def become_preloader() -> None:
    """Runs the preloader until the supervisor goes away; returns only in a
    forked worker, set up to go on as one."""
    mark = (mark_address(), os.environ.get(MARK, ""))
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
    control = Control(sock)
    started = time.monotonic()
    culprit, why = _preload(modules)
    micros = int((time.monotonic() - started) * 1_000_000)
    if culprit is not None:
        say("preload refused: module `{}`: {}".format(culprit, why))
        send(sock, {"type": "refused", "module": culprit, "reason": why})
        flush_and_exit(3)
    send(
        sock,
        {
            "type": "preloaded",
            "pid": os.getpid(),
            "modules": modules,
            "import_us": micros,
            "open_files": sorted(set(open_fds().values()) - {"/dev/null"}),
        },
    )
    say("preloaded {} in {:.0f} ms; forking workers".format(", ".join(modules), micros / 1000))
    spare: Optional[Spare] = None
    spare_cgroup = os.environ.pop(ENV_SPARE_CGROUP, None)
    while True:
        if spare is None:
            # The next load's worker, forked now, while nobody waits for it.
            made = Spare.make(sock, mark, spare_cgroup)
            if made is IN_SPARE:
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
            if hand_to_spare(sock, spare, header, fds):
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
    if len(fds) != FORK_FDS:
        for extra in fds:
            os.close(extra)
        send(sock, {"type": "fork_failed", "id": request_id,
                     "reason": "{} descriptors came with the fork; it takes 3".format(len(fds))})
        return _Forked.FAILED
    why = unsafe_to_fork()
    if why is not None:
        # Something the preload started has since made forking unsafe.
        send(sock, {"type": "refused", "module": "(after the preload)", "reason": why})
        flush_and_exit(3)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        worker_pid = double_fork()
    except SecondForkFailed as e:
        for extra in fds:
            os.close(extra)
        send(sock, {"type": "fork_failed", "id": request_id, "reason": str(e)})
        return _Forked.FAILED
    if worker_pid == 0:
        become_worker(sock, header, fds, mark)
        return _Forked.WORKER
    for extra in fds:
        os.close(extra)
    send(sock, {"type": "forked", "id": request_id, "pid": worker_pid, "spare_kept": spare_kept})
    return _Forked.ANSWERED
