"""The serve loop after the welcome.

The main thread runs the backend, one job (load, request, shutdown) at a
time, in the order they arrived; for a backend that batches, the requests
that arrived while the last batch ran go together. While it is idle it
reads the socket itself; while a job keeps it away, the watch thread reads
for it, answering pings and recording cancels, so pongs flow while a
request runs (reading.py). The watch never runs model code.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
import traceback
from typing import Any, Deque, Dict, List, Optional, Tuple, Type

from . import messages
from .backend import (
    Backend,
    Batching,
    LoadContext,
    LoadSpec,
    Request,
    RequestContext,
    Response,
    Stepping,
)
from .connection import Connection
from .errors import (
    BackendError,
    Cancelled,
    Internal,
    LoadFailed,
    NotLoaded,
    UnknownBackend,
    WireError,
    describe_exception,
)
from .process import die, flush_and_exit, say
from .reading import Reading
from .state import WorkerState
from .stats import self_memory
from .wire import Frame, FrameError, OutgoingFrame, frame_of_head


def _log_traceback(what: str) -> None:
    """The current exception's traceback on stderr, under one heading."""
    try:
        sys.stderr.write("berth_worker: {}\n".format(what))
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


#: The longest a batch waits for company, in seconds, and then only under load.
MAX_LINGER = 0.010


def _micros_since(started: float) -> int:
    return int((time.monotonic() - started) * 1_000_000)


class Worker:
    """A worker that has been welcomed: serves until shutdown or end of file."""

    def __init__(self, backends: Dict[str, Type[Backend]], conn: Connection, model_name: str) -> None:
        self.backends = backends
        self.conn = conn
        self.state = WorkerState()
        self.jobs: "queue.Queue[Frame]" = queue.Queue()
        self.reading = Reading(conn, self._dispatch, self.jobs)
        self.backend: Optional[Backend] = None
        self.policy: Optional[Batching] = None
        # Jobs taken while gathering a batch that did not join it: run next.
        self.held: Deque[Frame] = collections.deque()
        # The last batch: its size, its compute seconds, and the requests
        # waiting when it was answered (see _gather).
        self.pace: Tuple[int, float, int] = (0, 0.0, 0)
        self.spec: Optional[LoadSpec] = None
        self.load_asked = False
        # For messages before a load names the model (BERTH_MODEL).
        self.model_name = model_name

    # -- either thread --------------------------------------------------------

    def start_watch(self) -> threading.Thread:
        """Starts the thread that reads for the main thread while it is busy."""
        return self.reading.start_watch()

    def _dispatch(self, frame: Frame) -> Optional[Frame]:
        """Answers a ping or records a cancel (and returns None); returns a
        job for the main thread. Exits on a message the wire does not allow
        here."""
        try:
            messages.check_supervisor_message(frame)
            return self._sort(frame)
        except FrameError as e:
            die("the supervisor broke the wire: {}; exiting".format(e))

    def _sort(self, frame: Frame) -> Optional[Frame]:
        kind = frame.type
        h = frame.header
        if kind == "request":
            if not self.state.started(h["id"]):
                raise FrameError("request id {} is already in flight".format(h["id"]))
            return frame
        if kind == "ping":
            memory = self_memory()
            stats: Dict[str, int] = {"rss_bytes": memory[0], "peak_rss_bytes": memory[1]}
            stats.update(self.state.counts())
            self.conn.send(messages.pong(h["seq"], stats))
            return None
        if kind == "cancel":
            self.state.cancel(h["id"])
            return None
        if kind in ("load", "shutdown"):
            return frame
        raise FrameError("the supervisor sent `{}` after the welcome".format(kind))

    # -- main thread -----------------------------------------------------------

    def run(self) -> None:
        """Runs jobs until a shutdown (which exits the process)."""
        while True:
            if self.held:
                frame = self.held.popleft()
                self.reading.busy()
            else:
                frame = self.reading.next_job()
            kind = frame.type
            if kind == "request":
                stepping = self.backend.stepping() if self.backend is not None else None
                if stepping is not None:
                    self._run_stepping(stepping, frame)
                    del frame
                    continue
                if self.policy is None:
                    self._request(frame)
                else:
                    batch = [frame]
                    self._gather(self.policy, batch)
                    if len(batch) == 1:
                        self._request(frame)
                    else:
                        self._request_batch(batch)
                    del batch
            elif kind == "load":
                self._load(frame)
            else:
                self._shutdown()
            # Drop the frame now: its bulk mapping is freed while idle.
            del frame

    def _gather(self, policy: Batching, batch: List[Frame]) -> None:
        """Adds the requests already waiting to ``batch``, within ``policy``;
        a job that does not join is held. An idle worker never waits; under
        load (the last batch held more than one request) it waits a little,
        a twentieth of the last batch's compute time and at most
        :data:`MAX_LINGER` seconds, for the batch to fill to the requests
        that were outstanding when the last batch was answered (those it
        answered, whose clients are sending their next, and those already
        waiting), as the Rust worker does."""
        last_batch, last_compute, waiting = self.pace
        fill_to = min(last_batch + waiting, policy.max_batch)
        until = time.monotonic() + min(last_compute / 20, MAX_LINGER) if last_batch > 1 else None
        total: Optional[int] = None  # costs only once a second request is there
        while len(batch) < policy.max_batch:
            if self.held:
                frame = self.held.popleft()
            else:
                taken = self.reading.take()
                if taken is None:
                    if until is None or len(batch) >= fill_to:
                        break
                    taken = self.reading.wait(until - time.monotonic())
                    if taken is None:
                        break
                frame = taken
            if frame.type != "request":
                self.held.appendleft(frame)
                break
            if total is None:
                total = sum(self._cost(f) for f in batch)
            cost = self._cost(frame)
            if total + cost > policy.max_cost:
                self.held.appendleft(frame)
                break
            total += cost
            batch.append(frame)

    def _cost(self, frame: Frame) -> int:
        assert self.backend is not None
        try:
            cost = self.backend.cost(self._request_of(frame))
            return cost if isinstance(cost, int) and cost >= 0 else 1
        except Exception:  # the request fails on its own when it runs
            return 1

    @staticmethod
    def _request_of(frame: Frame) -> Request:
        return Request(frame.header["id"], frame.header.get("body"), frame.bulk)

    def _name(self) -> str:
        return self.spec.name if self.spec is not None else self.model_name

    def _load(self, frame: Frame) -> None:
        h = frame.header
        spec = LoadSpec(h["name"], h["backend"], h.get("model"), messages.options_of(frame))
        error: WireError
        if self.load_asked:
            error = Internal(
                "model `{}`: this worker was already asked to load a model; "
                "the supervisor sends one load per worker".format(spec.name)
            )
            self.conn.send(messages.load_failed(error.to_wire()))
            return
        self.load_asked = True
        self.spec = spec
        started = time.monotonic()
        try:
            backend = self._instantiate(spec)
            details = backend.describe()
        except WireError as e:
            self.conn.send(messages.load_failed(e.to_wire()))
            return
        except Exception as e:
            _log_traceback("loading model `{}` failed".format(spec.name))
            error = LoadFailed(
                "model `{}`: backend `{}` failed to load: {}".format(
                    spec.name, spec.backend, describe_exception(e)
                )
            )
            self.conn.send(messages.load_failed(error.to_wire()))
            return
        micros = int((time.monotonic() - started) * 1_000_000)
        try:
            policy = backend.batching()
            if policy is not None and not isinstance(policy, Batching):
                raise TypeError("batching() returned {!r}, not a Batching or None".format(policy))
        except Exception as e:
            error = LoadFailed(
                "model `{}`: backend `{}` cannot say how it batches: {}".format(
                    spec.name, spec.backend, describe_exception(e)
                )
            )
            self.conn.send(messages.load_failed(error.to_wire()))
            return
        max_batch = policy.max_batch if policy is not None else 1
        try:
            out = self.conn.build(messages.loaded(details, micros, max_batch))
        except Exception as e:
            error = LoadFailed(
                "model `{}`: backend `{}` describes itself with what the wire cannot carry "
                "(describe() must return JSON): {}".format(spec.name, spec.backend, describe_exception(e))
            )
            self.conn.send(messages.load_failed(error.to_wire()))
            return
        self.backend = backend
        self.policy = policy
        self.conn.send_built(out)

    def _instantiate(self, spec: LoadSpec) -> Backend:
        cls = self.backends.get(spec.backend)
        if cls is None:
            raise UnknownBackend(
                "model `{}`: this worker has no backend `{}` (it has: {})".format(
                    spec.name, spec.backend, ", ".join(self.backends) or "none"
                )
            )
        backend = cls()
        backend.load(spec, LoadContext(spec.name, self.state.progress))
        return backend

    def _request(self, frame: Frame) -> None:
        request_id: int = frame.header["id"]
        out = self._answer(request_id, frame)
        del frame
        self.state.finished(request_id)
        self.conn.send_built(out)

    def _answer(self, request_id: int, frame: Frame) -> OutgoingFrame:
        """Runs the request and encodes its ``done``, result or error."""
        if self.backend is None:
            return self._encode(
                request_id,
                NotLoaded(
                    "model `{}`: request {} came before a successful load; "
                    "no model is loaded".format(self._name(), request_id)
                ),
            )
        if self.state.is_cancelled(request_id):
            return self._encode(request_id, self._cancelled_early(request_id))
        started = time.monotonic()
        name = self._name()
        ctx = RequestContext(request_id, name, self.state, self._send_chunk)
        request = Request(request_id, frame.header.get("body"), frame.bulk)
        result: Any
        try:
            result = self.backend.handle(request, ctx)
        except WireError as e:
            result = e
        except Exception as e:
            _log_traceback("model `{}`: request {} failed".format(name, request_id))
            result = BackendError(
                "model `{}`: request {} failed: {}".format(name, request_id, describe_exception(e))
            )
        finally:
            ctx.finish()
        run = (1, _micros_since(started))
        self.pace = (1, run[1] / 1e6, 0)
        return self._encode(request_id, result, run)

    def _cancelled_early(self, request_id: int) -> WireError:
        return Cancelled(
            "model `{}`: request {} was cancelled before it started".format(self._name(), request_id)
        )

    def _encode(
        self, request_id: int, result: Any, run: Optional[Tuple[int, int]] = None
    ) -> OutgoingFrame:
        """The ``done`` of a result, or of an error (an exception)."""
        if isinstance(result, BaseException):
            if not isinstance(result, WireError):
                result = BackendError(
                    "model `{}`: request {} failed: {}".format(
                        self._name(), request_id, describe_exception(result)
                    )
                )
            return self.conn.build(messages.done_error(request_id, result.to_wire(), run))
        body, bulk = (result.body, result.bulk) if isinstance(result, Response) else (result, None)
        try:
            if bulk is None:
                # The usual answer: its header encoded without the dict.
                head = messages.done_head(request_id, body, run)
                return OutgoingFrame(frame_of_head(head, "done"), None)
            return self.conn.build(messages.done(request_id, body, run), bulk)
        except Exception as e:
            error = BackendError(
                "model `{}`: the answer to request {} cannot be sent: {}".format(
                    self._name(), request_id, describe_exception(e)
                )
            )
            return self.conn.build(messages.done_error(request_id, error.to_wire(), run))

    def _request_batch(self, frames: List[Frame]) -> None:
        """Runs ``frames`` as one batch and answers each on its own. Those
        cancelled while they waited are answered at once and do not run."""
        assert self.backend is not None
        name = self._name()
        live: List[Frame] = []
        for frame in frames:
            request_id = frame.header["id"]
            if self.state.is_cancelled(request_id):
                out = self._encode(request_id, self._cancelled_early(request_id))
                self.state.finished(request_id)
                self.conn.send_built(out)
            else:
                live.append(frame)
        if not live:
            return
        requests = [self._request_of(f) for f in live]
        contexts = [RequestContext(r.id, name, self.state, self._send_chunk) for r in requests]
        n = len(live)
        started = time.monotonic()
        results: List[Any]
        try:
            results = list(self.backend.handle_batch(requests, contexts))
            if len(results) != n:
                results = [
                    Internal(
                        "model `{}`: the backend answered a batch of {} requests with {} "
                        "results".format(name, n, len(results))
                    )
                ] * n
        except WireError as e:
            results = [e] * n
        except Exception as e:
            _log_traceback("model `{}`: a batch of {} requests failed".format(name, n))
            results = [
                BackendError("model `{}`: the batch failed: {}".format(name, describe_exception(e)))
            ] * n
        finally:
            for ctx in contexts:
                ctx.finish()
        run = (n, _micros_since(started))
        del requests
        for frame, result in zip(live, results):
            request_id = frame.header["id"]
            out = self._encode(request_id, result, run)
            self.state.finished(request_id)
            self.conn.send_built(out)
        # Received and not answered: every one of them is waiting.
        self.pace = (n, run[1] / 1e6, self.state.in_flight())

    def _run_stepping(self, stepping: Stepping, first: Frame) -> None:
        """Continuous batching, as the Rust worker does it: begins ``first``
        and every request that arrives while others run (within the
        backend's batch size and token budget), steps them all together and
        answers each as it ends; returns once none is left. A job that is
        not a request (a shutdown) waits, held, until the running requests
        have ended."""
        name = self._name()
        policy = self.policy or Batching(1)
        # request id -> (context, began at, cost)
        active: Dict[int, Tuple[RequestContext, float, int]] = {}
        pending: Optional[Frame] = first
        blocked = False
        while True:
            while not blocked and len(active) < policy.max_batch:
                if pending is not None:
                    frame, pending = pending, None
                elif self.held:
                    frame = self.held.popleft()
                else:
                    taken = self.reading.take()
                    if taken is None:
                        break
                    frame = taken
                if frame.type != "request":
                    self.held.appendleft(frame)
                    blocked = True
                    break
                cost = self._cost(frame)
                used = sum(c for _, _, c in active.values())
                if active and used + cost > policy.max_cost:
                    self.held.appendleft(frame)
                    break
                request_id = frame.header["id"]
                if self.state.is_cancelled(request_id):
                    self._finish_stepped(request_id, None, self._cancelled_early(request_id), None)
                    continue
                ctx = RequestContext(request_id, name, self.state, self._send_chunk)
                try:
                    stepping.begin(self._request_of(frame), ctx)
                except Exception as e:
                    if not isinstance(e, WireError):
                        _log_traceback("model `{}`: request {} failed".format(name, request_id))
                    self._finish_stepped(request_id, ctx, e, None)
                    continue
                active[request_id] = (ctx, time.monotonic(), cost)
                del frame
            if not active:
                return
            running = len(active)
            try:
                ended = [(request_id, result) for request_id, result in stepping.step()]
            except Exception as e:
                error: WireError
                if isinstance(e, WireError):
                    error = e
                else:
                    _log_traceback("model `{}`: a step of {} requests failed".format(name, running))
                    error = BackendError(
                        "model `{}`: a step of {} requests failed: {}".format(
                            name, running, describe_exception(e)
                        )
                    )
                try:
                    stepping.abandon()
                except Exception:
                    _log_traceback("model `{}`: abandon() failed".format(name))
                ended = [(request_id, error) for request_id in active]
            for request_id, result in ended:
                # An id the backend never began, or answered already, is ignored.
                entry = active.pop(request_id, None)
                if entry is not None:
                    ctx, began, _ = entry
                    self._finish_stepped(request_id, ctx, result, (running, _micros_since(began)))
            try:
                left = stepping.active()
            except Exception:
                _log_traceback("model `{}`: active() failed".format(name))
                left = 0
            if active and left == 0:
                lost = Internal("model `{}`: the backend dropped the request".format(name))
                for request_id, (ctx, _, _) in list(active.items()):
                    self._finish_stepped(request_id, ctx, lost, None)
                active.clear()

    def _finish_stepped(
        self,
        request_id: int,
        ctx: Optional[RequestContext],
        result: Any,
        run: Optional[Tuple[int, int]],
    ) -> None:
        if ctx is not None:
            ctx.finish()
        out = self._encode(request_id, result, run)
        self.state.finished(request_id)
        self.conn.send_built(out)

    def _send_chunk(self, request_id: int, body: Any, bulk: Optional[Any]) -> None:
        self.conn.send_built(self.conn.build(messages.chunk(request_id, body), bulk))
        # A streaming request sees its cancel at its next chunk.
        self.reading.look()

    def _shutdown(self) -> None:
        if self.backend is not None:
            try:
                self.backend.shutdown()
            except Exception:
                _log_traceback("model `{}`: the backend's shutdown() failed".format(self._name()))
        say("shutting down as the supervisor asked")
        flush_and_exit(0)
