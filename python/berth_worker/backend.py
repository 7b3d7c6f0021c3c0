"""The API a Python backend is written against, mirroring the Rust
``berth-worker`` crate: :class:`Backend`, what it is loaded from
(:class:`LoadSpec`, :class:`LoadContext`) and what it serves
(:class:`Request`, :class:`RequestContext`, :class:`Response`)."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .errors import Internal
from .options import Options
from .spec import LoadSpec
from .state import Progress, WorkerState

#: What :meth:`RequestContext.chunk` hands to the connection:
#: ``(request id, body, bulk)``.
ChunkSink = Callable[[int, Any, Optional[Any]], None]


def gpus_from_env() -> List[int]:
    """The GPUs in ``BERTH_GPUS`` (physical indices); empty when unset."""
    out: List[int] = []
    for item in os.environ.get("BERTH_GPUS", "").split(","):
        item = item.strip()
        if item.isdigit():
            out.append(int(item))
    return out


class LoadContext:
    """What a backend gets while loading."""

    def __init__(self, name: str, progress: Optional[Progress] = None) -> None:
        self.name = name
        self._progress = progress if progress is not None else Progress()

    @classmethod
    def standalone(cls, name: str = "standalone") -> "LoadContext":
        """A context for loading outside a worker (tests, benchmarks)."""
        return cls(name)

    def progress(self, steps: int = 1) -> None:
        """Advance after each load step (a tensor read, a layer built): a
        load that keeps advancing is slow, one that stops is stuck."""
        self._progress.advance(steps)

    @property
    def progress_value(self) -> int:
        """The shared counter's value."""
        return self._progress.get()

    @property
    def gpus(self) -> List[int]:
        """The GPUs the supervisor placed this worker on (physical indices,
        from ``BERTH_GPUS``; CUDA numbers them from 0 through
        ``CUDA_VISIBLE_DEVICES``). Empty when it placed it on none."""
        return gpus_from_env()


class Request:
    """One request: its ``id``, its ``body`` (the parsed JSON value) and its
    ``bulk`` bytes (a read-only :class:`memoryview`, or ``None``).

    Bulk bytes that came in a memfd are a read-only mapping, not a copy:
    ``numpy.frombuffer(request.bulk, dtype=...)`` reads the supervisor's pages.
    """

    __slots__ = ("id", "body", "bulk")

    def __init__(self, id: int, body: Any, bulk: Optional[memoryview] = None) -> None:
        self.id = id
        self.body = body
        self.bulk = bulk

    def __repr__(self) -> str:
        bulk = "None" if self.bulk is None else "<{} bytes>".format(self.bulk.nbytes)
        return "Request(id={!r}, body={!r}, bulk={})".format(self.id, self.body, bulk)


class Response:
    """An answer with bulk bytes: ``body`` (any JSON value) and ``bulk``
    (anything with the buffer protocol: bytes, memoryview, a numpy array).

    A backend that has no bulk bytes may return the body itself instead.
    """

    __slots__ = ("body", "bulk")

    def __init__(self, body: Any, bulk: Optional[Any] = None) -> None:
        self.body = body
        self.bulk = bulk

    def __repr__(self) -> str:
        bulk = "None" if self.bulk is None else "<{} bytes>".format(memoryview(self.bulk).nbytes)
        return "Response(body={!r}, bulk={})".format(self.body, bulk)


class RequestContext:
    """What a backend gets while serving one request."""

    def __init__(
        self,
        request_id: int,
        name: str,
        state: WorkerState,
        sink: Optional[ChunkSink] = None,
    ) -> None:
        self.id = request_id
        self.name = name
        self._state = state
        self._sink = sink
        self._lock = threading.Lock()
        self._finished = False
        self._collected: List[Tuple[Any, Optional[Any]]] = []

    @classmethod
    def standalone(cls, request_id: int = 0, name: str = "standalone") -> "RequestContext":
        """A context for serving outside a worker: chunks are collected and
        returned by :meth:`take_chunks`."""
        return cls(request_id, name, WorkerState())

    @property
    def cancelled(self) -> bool:
        """True once the supervisor cancelled this request. Long loops check
        it and raise ``Cancelled(...)`` (kind ``cancelled``)."""
        return self._state.is_cancelled(self.id)

    def progress(self, steps: int = 1) -> None:
        """Advance per unit of work (token, batch)."""
        self._state.progress.advance(steps)

    def chunk(self, body: Any, bulk: Optional[Any] = None) -> None:
        """Sends a streamed piece of the answer at once.

        Raises ``TypeError``/``ValueError`` if ``body`` is not JSON, and
        :class:`~berth_worker.errors.Internal` once the request is done (a
        chunk after the ``done`` would break the wire).
        """
        with self._lock:
            if self._finished:
                raise Internal(
                    "model `{}`: a chunk for request {} after its answer was sent".format(
                        self.name, self.id
                    )
                )
            if self._sink is None:
                self._collected.append((body, bulk))
            else:
                self._sink(self.id, body, bulk)

    def take_chunks(self) -> List[Tuple[Any, Optional[Any]]]:
        """Chunks collected by a standalone context, as ``(body, bulk)``."""
        out, self._collected = self._collected, []
        return out

    def finish(self) -> None:
        """Marks the request done: later chunks are refused. Called by the
        worker before it sends the ``done``."""
        with self._lock:
            self._finished = True


class Batching:
    """How a backend takes requests in batches (see :meth:`Backend.batching`):
    at most ``max_batch`` requests whose :meth:`Backend.cost` adds up to at
    most ``max_cost`` (a token budget); a request over the budget on its own
    still runs, alone."""

    __slots__ = ("max_batch", "max_cost")

    def __init__(self, max_batch: int, max_cost: int = 1 << 62) -> None:
        if max_batch < 1 or max_cost < 1:
            raise ValueError("Batching needs max_batch >= 1 and max_cost >= 1")
        self.max_batch = max_batch
        self.max_cost = max_cost

    def __repr__(self) -> str:
        return "Batching(max_batch={!r}, max_cost={!r})".format(self.max_batch, self.max_cost)


class Backend:
    """A loaded model inside a worker. Subclass it and register the class
    with :func:`berth_worker.serve`; the worker makes one instance (with no
    arguments) and calls :meth:`load` once.

    The worker calls :meth:`handle` for one request at a time (or
    :meth:`handle_batch` for a batch, see :meth:`batching`), on its main
    thread, so a backend needs no locking. Pings are answered by another
    thread; advance the progress counter (``ctx.progress()``) from the code
    doing the work, so the supervisor can tell a slow model from a stuck one.

    A class that sets :attr:`options` declares the options it takes: the
    worker says so in its ``--backends`` answer, and the supervisor refuses
    a model naming any other when it is registered, before a worker starts
    (the load should still refuse them, with ``Options(spec).only(...)``).
    """

    #: The options this backend takes, or ``None`` where it does not say.
    options: Optional[Sequence[str]] = None

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        """Loads the model. Raise a :class:`~berth_worker.errors.WireError`
        to fail the load with its kind; any other exception fails it with
        kind ``load_failed``. The default refuses every option."""
        Options(spec).only([])

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        """Serves one request: returns a :class:`Response`, or a plain
        JSON value taken as the body. Stream partial results with
        ``ctx.chunk(...)``. Raise a
        :class:`~berth_worker.errors.WireError` to fail the request with its
        kind; any other exception fails it with kind ``backend_error``."""
        raise NotImplementedError(
            "backend class `{}` does not implement handle()".format(type(self).__name__)
        )

    def describe(self) -> Any:
        """What the load report shows about the loaded model (dimensions,
        context length, ...): any JSON value. Empty by default."""
        return {}

    def shutdown(self) -> None:
        """Called once when the supervisor asks the worker to exit: flush or
        release what needs it. The default does nothing."""

    def batching(self) -> Optional[Batching]:
        """Whether this backend serves several requests at once. When it
        returns a :class:`Batching`, the worker gathers the requests that
        arrived while the previous batch ran (never waiting for more when it
        is idle) and calls :meth:`handle_batch`. ``None`` (the default): one
        at a time."""
        return None

    def cost(self, request: Request) -> int:
        """What ``request`` counts against :attr:`Batching.max_cost` (a
        token estimate, say). 1 by default."""
        return 1

    def stepping(self) -> "Optional[Stepping]":
        """For a backend whose work on a request is a loop of steps (a
        decoder, a token at a time): the worker then batches continuously.
        Requests begin as they arrive (within :meth:`batching`'s limits),
        each :meth:`Stepping.step` advances all that have begun, and each is
        answered the moment it ends. ``None`` (the default):
        :meth:`handle_batch`."""
        return None

    def handle_batch(self, requests: List[Request], contexts: List[RequestContext]) -> List[Any]:
        """Serves a batch: one result per request, in order. A result is
        what :meth:`handle` returns, or an exception (a
        :class:`~berth_worker.errors.WireError` to fail that request with
        its kind): each request succeeds or fails on its own. The default
        calls :meth:`handle` for each."""
        out: List[Any] = []
        for request, ctx in zip(requests, contexts):
            try:
                out.append(self.handle(request, ctx))
            except Exception as e:  # this request's failure, not the batch's
                out.append(e)
        return out


class Stepping:
    """Continuous batching: see :meth:`Backend.stepping`."""

    def begin(self, request: Request, ctx: RequestContext) -> None:
        """Takes a request on (parsing it, feeding its prompt). An exception
        answers it at once; the requests already begun go on."""
        raise NotImplementedError

    def step(self) -> List[Tuple[int, Any]]:
        """Advances every request begun and not ended by one step; returns
        those that ended as ``(request id, result)``, a result being what
        :meth:`Backend.handle` returns or an exception (which fails only its
        own request)."""
        raise NotImplementedError

    def active(self) -> int:
        """Requests begun and not ended."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Drops every request begun: after an exception out of
        :meth:`step` the worker fails them all."""
        raise NotImplementedError
