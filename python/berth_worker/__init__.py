"""Write berth workers in Python.

A worker offers backends; the berth supervisor starts it, loads one model in
it and sends it requests over the stream wire (docs/wire.md)::

    import berth_worker

    class Upper(berth_worker.Backend):
        def handle(self, request, ctx):
            ctx.progress()
            return {"text": request.body["text"].upper()}

    if __name__ == "__main__":
        berth_worker.serve({"upper": Upper})

``python3 -m berth_worker`` serves the test backends ``echo``, ``hog`` and
``fault``.
"""

from __future__ import annotations

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
from .errors import (
    KINDS,
    BackendError,
    BadRequest,
    Cancelled,
    InputTooLarge,
    Internal,
    LoadFailed,
    NotLoaded,
    UnknownBackend,
    WireError,
)
from .options import Options
from .serve import serve
from .version import WIRE_VERSION, __version__

__all__ = [
    "KINDS",
    "WIRE_VERSION",
    "Backend",
    "BackendError",
    "BadRequest",
    "Batching",
    "Cancelled",
    "InputTooLarge",
    "Internal",
    "LoadContext",
    "LoadFailed",
    "LoadSpec",
    "NotLoaded",
    "Options",
    "Request",
    "RequestContext",
    "Response",
    "Stepping",
    "UnknownBackend",
    "WireError",
    "__version__",
    "serve",
]
