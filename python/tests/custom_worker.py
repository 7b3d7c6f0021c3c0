"""A worker with backends of its own, the way a user of the package writes
one; started by test_api.py's end-to-end tests."""

from __future__ import annotations

import mmap
import sys

import numpy

import berth_worker
from berth_worker import Backend, BadRequest, InputTooLarge, Options, Response


class Tensors(Backend):
    """Exercises bodies, bulk bytes, chunks and failures on command."""

    def __init__(self) -> None:
        self.scale = 1.0
        self.kept_ctx = None

    def load(self, spec, ctx):
        opts = Options(spec)
        opts.only(["scale", "verbose", "label"])
        self.scale = opts.float("scale", 1.0)
        self.verbose = opts.bool("verbose", False)
        self.label = opts.str("label", "none")
        ctx.progress()
        self.gpus = ctx.gpus
        self.name = ctx.name

    def describe(self):
        return {"scale": self.scale, "verbose": self.verbose, "label": self.label,
                "gpus": self.gpus, "name": self.name}

    def handle(self, request, ctx):
        op = request.body.get("op") if isinstance(request.body, dict) else None
        ctx.progress()
        if op == "sum":
            values = numpy.frombuffer(request.bulk, dtype=numpy.float32)
            return {
                "sum": float(values.sum()),
                "zero_copy": isinstance(request.bulk.obj, mmap.mmap) and not values.flags.owndata,
                "readonly": request.bulk.readonly,
            }
        if op == "arange":
            n = request.body["n"]
            out = numpy.arange(n, dtype=numpy.float32) * self.scale
            return Response({"dtype": "float32", "shape": [n]}, out)
        if op == "chunk_bulk":
            ctx.chunk({"part": 1}, b"\x01\x02")
            ctx.chunk({"part": 2}, numpy.ones(40000, dtype=numpy.float32))
            return {"parts": 2}
        if op == "raise":
            raise KeyError("no such thing")
        if op == "bad_request":
            raise BadRequest("model `{}`: `texts` must be a list of strings".format(self.name))
        if op == "too_large":
            raise InputTooLarge("model `{}`: 9000 tokens, the context holds 4096".format(self.name))
        if op == "nan":
            return {"value": float("nan")}
        if op == "not_json":
            return {"value": object()}
        if op == "keep_ctx":
            self.kept_ctx = ctx
            return "kept"
        if op == "late_chunk":
            self.kept_ctx.chunk({"late": True})
            return "unreachable"
        if op == "exit":
            sys.exit(request.body["code"])
        return request.body


class Batcher(Backend):
    """Batches up to 4 requests of at most 10 characters in all; a request
    ``{"text": ..., "sleep": s}`` holds its batch ``s`` seconds, ``{"bad":
    true}`` fails alone, ``{"crash_batch": true}`` raises from the whole
    batch."""

    def load(self, spec, ctx):
        Options(spec).only([])

    def batching(self):
        return berth_worker.Batching(max_batch=4, max_cost=10)

    def cost(self, request):
        return len(request.body.get("text", ""))

    def handle(self, request, ctx):
        return self.handle_batch([request], [ctx])[0]

    def handle_batch(self, requests, contexts):
        import time

        if any(r.body.get("crash_batch") for r in requests):
            raise RuntimeError("the whole batch broke")
        time.sleep(max(r.body.get("sleep", 0) for r in requests))
        out = []
        for r, ctx in zip(requests, contexts):
            ctx.progress()
            if r.body.get("bad"):
                out.append(BadRequest("request {} is bad".format(r.id)))
            else:
                out.append({"text": r.body["text"].upper(), "id": r.id, "batch": len(requests)})
        return out


class BrokenLoad(Backend):
    """Fails its load with a plain exception."""

    def load(self, spec, ctx):
        raise RuntimeError("weights file {} is truncated".format(spec.model))


class BadDescribe(Backend):
    """Describes itself with what JSON cannot carry."""

    def describe(self):
        return {"when": object()}


class NoHandle(Backend):
    """Forgets to implement handle()."""


if __name__ == "__main__":
    berth_worker.serve(
        {"tensors": Tensors, "batcher": Batcher, "broken": BrokenLoad, "bad-describe": BadDescribe, "no-handle": NoHandle}
    )
