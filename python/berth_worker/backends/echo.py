"""``echo``: answers with the request's body and bulk bytes unchanged. The
baseline for what the process boundary costs.

Option ``chunks`` (default 0): first stream that many chunks, each
carrying the request's body (no bulk), then the answer. Option ``batch``
(default 1): take up to that many waiting requests at once. Option
``stepping`` (default false): batch continuously (see
:meth:`~berth_worker.Backend.stepping`): each step streams one chunk to
every request running, and a request ends after its chunks. A request may
ask for its own number of steps (``{"steps": N}``), and
``{"panic_in_step": true}`` raises inside a step: the fault path of
continuous batching. As the Rust ``echo``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ..backend import (
    Backend,
    Batching,
    LoadContext,
    LoadSpec,
    Request,
    RequestContext,
    Response,
    Stepping,
)
from ..errors import Cancelled
from ..options import Options


class Echo(Backend):
    """Returns what it was given."""

    options = ("chunks", "batch", "stepping")

    def __init__(self) -> None:
        self.chunks = 0
        self.batch = 1
        self.steps: Optional[_Steps] = None

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(self.options)
        self.chunks = opts.int("chunks", 0, minimum=0)
        self.batch = opts.int("batch", 1, minimum=1)
        if opts.bool("stepping", False):
            self.steps = _Steps(self.chunks)

    def stepping(self) -> Optional[Stepping]:
        return self.steps

    def batching(self) -> Optional[Batching]:
        return Batching(self.batch) if self.batch > 1 else None

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        for _ in range(self.chunks):
            ctx.chunk(request.body)
            ctx.progress()
        ctx.progress()
        if request.bulk is None:
            return request.body
        return Response(request.body, request.bulk)


class _Steps(Stepping):
    """Echo, a chunk per step."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        # request id -> [request, context, steps left, panics]
        self.running: Dict[int, List[Any]] = {}

    def begin(self, request: Request, ctx: RequestContext) -> None:
        body = request.body if isinstance(request.body, dict) else {}
        steps = body.get("steps", self.chunks)
        self.running[request.id] = [
            request,
            ctx,
            steps if isinstance(steps, int) and steps >= 0 else self.chunks,
            body.get("panic_in_step") is True,
        ]

    def step(self) -> List[Tuple[int, Any]]:
        if any(r[3] for r in self.running.values()):
            raise RuntimeError("echo: a panic in a step, as the request asked")
        ended: List[Tuple[int, Any]] = []
        for request_id, r in list(self.running.items()):
            request, ctx = r[0], r[1]
            if ctx.cancelled:
                ended.append((request_id, Cancelled("the request was cancelled")))
            elif r[2] > 0:
                r[2] -= 1
                ctx.progress()
                ctx.chunk(request.body)
                if r[2] > 0:
                    continue
                ended.append((request_id, _answer(request)))
            else:
                ended.append((request_id, _answer(request)))
            del self.running[request_id]
        return ended

    def active(self) -> int:
        return len(self.running)

    def abandon(self) -> None:
        self.running.clear()


def _answer(request: Request) -> Any:
    if request.bulk is None:
        return request.body
    return Response(request.body, request.bulk)
