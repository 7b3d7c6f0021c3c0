"""``echo``: answers with the request's body and bulk bytes unchanged. The
baseline for what the process boundary costs.

Option ``chunks`` (default 0): first stream that many chunks, each
carrying the request's body (no bulk), then the answer. Option ``batch``
(default 1): take up to that many waiting requests at once.
"""

from __future__ import annotations

from typing import Any, Optional

from ..backend import (
    Backend,
    Batching,
    LoadContext,
    LoadSpec,
    Request,
    RequestContext,
    Response,
)
from ..options import Options


class Echo(Backend):
    """Returns what it was given."""

    def __init__(self) -> None:
        self.chunks = 0
        self.batch = 1

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(["chunks", "batch"])
        self.chunks = opts.int("chunks", 0, minimum=0)
        self.batch = opts.int("batch", 1, minimum=1)

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
