"""``fault``: fails on command. Every failure path of the supervisor is
tested against this backend in a real process, never against a mock; it
takes the same options as the Rust worker's ``fault``.

Option ``mode``:

- ``ok``: behaves like ``echo`` (the default);
- ``crash-on-load``, ``crash-on-request``: the process dies of SIGSEGV;
- ``abort-on-request``: the process aborts (SIGABRT);
- ``exit-on-request``: the process exits with ``exit_code`` (default 3);
- ``hang-on-load``, ``hang-on-request``: blocks forever without progress;
- ``ignore-shutdown``: serves like ``echo``, but ignores SIGTERM and never
  finishes the shutdown, so only SIGKILL ends it.

Other options:

- ``load_delay_ms``: sleeps during load in 10 ms steps, advancing progress
  (a slow but progressing load);
- ``crash_on``: a request whose body, as compact JSON text, contains this
  text crashes the worker (a poison input); others are echoed;
  ``crash_delay_ms`` first works on it that long (so requests sent after it
  are surely in flight when it dies);
- ``crash_on_load_if_exists``: crashes at load while this file exists (a
  model broken until someone fixes it);
- ``fail_load_with``: the load raises ``RuntimeError`` with this message,
  after ``load_delay_ms`` (a framework's exception at load, in its own
  words: JAX's ``RESOURCE_EXHAUSTED: Out of memory ...``);
- ``spawn_grandchild``: at load, starts a process that ignores SIGTERM (a
  helper that would outlive the worker); ``describe()`` gives its pid;
- ``stderr_bytes``: each request first writes this many bytes to stderr as
  one line (a worker flooding its output);
- ``response_bytes``: each request is answered with ``{"pad": "xx…"}``
  padded to about this many bytes (a worker answering too much).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, NoReturn, Optional

from ..backend import Backend, LoadContext, LoadSpec, Request, RequestContext, Response
from ..errors import LoadFailed
from ..options import Options
from ..process import default_disposition, no_core_dump

MODES = (
    "ok",
    "crash-on-load",
    "hang-on-load",
    "crash-on-request",
    "hang-on-request",
    "abort-on-request",
    "exit-on-request",
    "ignore-shutdown",
)

OPTIONS = (
    "mode",
    "exit_code",
    "load_delay_ms",
    "crash_on",
    "crash_delay_ms",
    "crash_on_load_if_exists",
    "fail_load_with",
    "spawn_grandchild",
    "stderr_bytes",
    "response_bytes",
)


def _say(message: str) -> None:
    sys.stderr.write("fault: {}\n".format(message))
    sys.stderr.flush()


def crash() -> NoReturn:
    """Dies of a real SIGSEGV, without a core dump."""
    no_core_dump()
    _say("raising SIGSEGV as asked")
    default_disposition(signal.SIGSEGV)
    os.kill(os.getpid(), signal.SIGSEGV)
    while True:  # the signal may land on another thread first
        time.sleep(1)


def hang() -> NoReturn:
    """Blocks forever without progress."""
    _say("hanging as asked")
    while True:
        time.sleep(3600)


class Fault(Backend):
    """Fails as its options say."""

    options = OPTIONS

    def __init__(self) -> None:
        self.mode = "ok"
        self.exit_code = 3
        self.crash_on: Optional[str] = None
        self.crash_delay_ms = 0
        self.grandchild: "Optional[subprocess.Popen[bytes]]" = None
        self.stderr_bytes = 0
        self.response_bytes = 0

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(OPTIONS)
        marker = opts.str("crash_on_load_if_exists")
        if marker is not None and os.path.exists(marker):
            _say("{} exists; crashing on load as asked".format(marker))
            crash()
        mode = opts.str("mode", "ok")
        if mode not in MODES:
            raise LoadFailed(
                "model `{}`: fault mode `{}` does not exist (modes: {})".format(
                    spec.name, mode, ", ".join(MODES)
                )
            )
        self.mode = mode
        delay_ms = opts.int("load_delay_ms", 0, minimum=0)
        self.exit_code = opts.int("exit_code", 3)
        self.crash_on = opts.str("crash_on")
        self.crash_delay_ms = opts.int("crash_delay_ms", 0, minimum=0)
        self.stderr_bytes = opts.int("stderr_bytes", 0, minimum=0)
        self.response_bytes = opts.int("response_bytes", 0, minimum=0)
        spawn = opts.bool("spawn_grandchild", False)
        for _ in range(delay_ms // 10):
            time.sleep(0.010)
            ctx.progress()
        failure = opts.str("fail_load_with")
        if failure is not None:
            raise RuntimeError(failure)
        if mode == "crash-on-load":
            crash()
        if mode == "hang-on-load":
            hang()
        if mode == "ignore-shutdown":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if spawn:
            self._spawn_grandchild(spec)

    def _spawn_grandchild(self, spec: LoadSpec) -> None:
        try:
            self.grandchild = subprocess.Popen(
                ["sh", "-c", "trap '' TERM; while :; do sleep 1; done"],
                stdin=subprocess.DEVNULL,
            )
        except OSError as e:
            raise LoadFailed(
                "model `{}`: cannot start the grandchild: {}".format(spec.name, e)
            ) from None
        _say("started grandchild pid {} that ignores SIGTERM".format(self.grandchild.pid))

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        if self.stderr_bytes:
            self._flood_stderr()
        if self.response_bytes:
            ctx.progress()
            return {"pad": "x" * max(0, self.response_bytes - 12)}
        if self.crash_on is not None:
            text = json.dumps(request.body, separators=(",", ":"), ensure_ascii=False)
            if self.crash_on in text:
                time.sleep(self.crash_delay_ms / 1000)
                crash()
        if self.mode == "crash-on-request":
            crash()
        if self.mode == "hang-on-request":
            hang()
        if self.mode == "abort-on-request":
            _say("aborting as asked")
            no_core_dump()
            default_disposition(signal.SIGABRT)
            os.abort()
        if self.mode == "exit-on-request":
            _say("exiting with status {} as asked".format(self.exit_code))
            sys.stdout.flush()
            os._exit(self.exit_code)
        ctx.progress()
        if request.bulk is None:
            return request.body
        return Response(request.body, request.bulk)

    def _flood_stderr(self) -> None:
        block = b"x" * min(self.stderr_bytes, 1 << 20)
        left = self.stderr_bytes
        stream = sys.stderr.buffer if hasattr(sys.stderr, "buffer") else None
        sys.stderr.flush()
        while left > 0:
            n = min(left, len(block))
            if stream is not None:
                stream.write(block[:n])
            else:
                sys.stderr.write("x" * n)
            left -= n
        if stream is not None:
            stream.write(b"\n")
            stream.flush()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def describe(self) -> Any:
        return {"grandchild_pid": self.grandchild.pid if self.grandchild is not None else None}

    def shutdown(self) -> None:
        if self.mode == "ignore-shutdown":
            _say("ignoring the shutdown command as asked")
            hang()
