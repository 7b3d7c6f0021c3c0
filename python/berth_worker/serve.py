"""``serve()``: a Python program becomes a berth worker.

Arguments, the connection from ``BERTH_FD``, the hello and the welcome;
then :class:`~berth_worker.worker.Worker` serves until shutdown.
"""

from __future__ import annotations

import os
import platform
import sys
import traceback
from typing import Dict, List, NoReturn, Optional, Sequence, Type

from . import messages
from .backend import Backend
from .connection import Connection
from .preloader import ENV_PRELOAD, become_preloader
from .process import arm_parent_death, die, flush_and_exit, keep_out_of_forks, parent_gone, say
from .version import WIRE_VERSION, __version__
from .wire import FrameError
from .worker import Worker

_HOW_TO_RUN = (
    "it is started by the berth supervisor and is not meant to be run by hand; "
    "point a model's worker command at this program and let berth start it"
)


def runtime() -> str:
    """What the hello reports as the runtime, e.g. ``CPython 3.11.7``."""
    return "{} {}".format(platform.python_implementation(), platform.python_version())


def backends_lines(backends: Dict[str, Type[Backend]]) -> List[str]:
    """What ``--backends`` prints: a line per backend, its name and, where
    its class declares them (:attr:`Backend.options`), ``: `` and its
    options (docs/wire.md)."""
    lines = []
    for name, cls in backends.items():
        options = getattr(cls, "options", None)
        lines.append(name if options is None else "{}: {}".format(name, ", ".join(options)))
    return lines


def _handle_arguments(lines: List[str], argv: Sequence[str]) -> None:
    """``--version`` and ``--backends`` print and exit 0; anything else exits 2."""
    if not argv:
        return
    arg = argv[0]
    if arg == "--version" and len(argv) == 1:
        print("berth_worker {} (wire {})".format(__version__, WIRE_VERSION))
        sys.stdout.flush()
        sys.exit(0)
    if arg == "--backends" and len(argv) == 1:
        for line in lines:
            print(line)
        sys.stdout.flush()
        sys.exit(0)
    sys.stderr.write(
        "berth_worker: unknown argument `{}` (it takes --version or --backends alone; "
        "otherwise {})\n".format(" ".join(argv), _HOW_TO_RUN)
    )
    sys.exit(2)


def _connection_fd() -> int:
    raw = os.environ.get("BERTH_FD")
    if raw is None:
        say("BERTH_FD is not set: {}".format(_HOW_TO_RUN))
        sys.exit(2)
    try:
        fd = int(raw)
    except ValueError:
        say("BERTH_FD={} is not a descriptor number: {}".format(raw, _HOW_TO_RUN))
        sys.exit(2)
    return fd


def _check_backends(backends: Dict[str, Type[Backend]]) -> List[str]:
    names = []
    for name, cls in backends.items():
        if not isinstance(name, str) or not name:
            raise TypeError("serve(): backend names must be non-empty strings, not {!r}".format(name))
        if not callable(cls):
            raise TypeError(
                "serve(): backend `{}` must be a Backend class, not {!r}".format(name, cls)
            )
        names.append(name)
    return names


def _handshake(conn: Connection, names: List[str]) -> None:
    """Sends the hello and reads the welcome; exits 1 on anything else."""
    conn.send(messages.hello(os.getpid(), __version__, names, runtime()))
    try:
        frame = conn.read()
        messages.check_supervisor_message(frame)
    except EOFError:
        die("the supervisor closed the connection before welcoming this worker; exiting")
    except FrameError as e:
        die("the supervisor broke the wire in its first message: {}; exiting".format(e))
    if frame.type == "refused":
        die("the supervisor refused this worker: {}".format(frame.header["reason"]))
    if frame.type != "welcome":
        die("the supervisor's first message is `{}`, not `welcome`; exiting".format(frame.type))
    version = frame.header["version"]
    if version not in messages.WIRE_VERSIONS:
        die(
            "the supervisor chose wire version {}; this worker speaks {}; exiting".format(
                version, ", ".join(str(v) for v in messages.WIRE_VERSIONS)
            )
        )


def serve(backends: Dict[str, Type[Backend]], argv: Optional[Sequence[str]] = None) -> NoReturn:
    """Runs this process as a berth worker offering ``backends`` (name to
    :class:`~berth_worker.backend.Backend` class). Never returns: the
    process exits 0 after the supervisor's shutdown, and 1 at once when the
    supervisor goes away or breaks the wire.

    ``argv`` defaults to ``sys.argv[1:]``: ``--version`` and ``--backends``
    print what they say and exit 0; any other argument exits 2.
    """
    names = _check_backends(backends)
    _handle_arguments(backends_lines(backends), sys.argv[1:] if argv is None else list(argv))
    if os.environ.get(ENV_PRELOAD) is not None:
        # A preloader: returns only in a worker it forked, set up as if
        # started cold (preloader.py).
        become_preloader()
    fd = _connection_fd()
    arm_parent_death()
    gone = parent_gone()
    if gone is not None:
        die(gone, 2)
    try:
        keep_out_of_forks(fd)
        conn = Connection.from_fd(fd)
    except OSError as e:
        say("BERTH_FD={}: cannot use it as the connection ({}): {}".format(fd, e, _HOW_TO_RUN))
        sys.exit(2)
    # The supervisor shows a dead worker's last lines: have them written.
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True)
            except (ValueError, OSError):
                pass
    _handshake(conn, names)
    worker = Worker(backends, conn, os.environ.get("BERTH_MODEL", "?"))
    worker.start_watch()
    try:
        worker.run()
    except SystemExit as e:
        # A backend called sys.exit(): honour it without waiting on threads.
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            say(str(e.code))
        say("a backend called sys.exit({}); exiting".format(code))
        flush_and_exit(code)
    except BaseException as e:
        say("the serve loop failed: {}: {}".format(type(e).__name__, e))
        traceback.print_exc()
        die("exiting", 1)
    die("the serve loop returned; exiting", 1)
