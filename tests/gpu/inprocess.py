"""The status quo beside berth, on a GPU: the examples' own backends
(`berth_examples`) called in this process, the way a framework's users run
a model without berth. Run by `measure.py` with the machine's python, one
process per measurement; prints one JSON object.

    inprocess.py drop torch_embed --model DIR --cycles 5 --batches 16 --texts 64
    inprocess.py drop eqx_stack --cycles 3
    inprocess.py rate torch_embed --model DIR --texts 32 --clients 8 --seconds 2 --rounds 1
    inprocess.py vectors torch_embed --model DIR

`drop`: load, work, then drop it as the framework's documentation advises
(`del`, `gc.collect()`, `torch.cuda.empty_cache()` or `jax.clear_caches()`),
`cycles` times; what NVML says this process holds after each step.
`rate`: requests per second of `clients` threads calling the backend.
`vectors`: the vectors of the fixed texts, for comparing devices.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import devices  # noqa: E402
from berth_worker import LoadContext, LoadSpec, Request, RequestContext  # noqa: E402

TEXTS = ["sentence {} of the GPU workload, about ships, ports and the sea".format(i) for i in range(64)]


def backend(name: str, model: str, options: Dict[str, str]) -> Any:
    from berth_examples import BACKENDS

    b = BACKENDS[name]()
    b.load(LoadSpec(name, name, model or None, options), LoadContext.standalone())
    return b


def body(name: str, texts: int, i: int) -> Dict[str, Any]:
    if name == "torch_embed":
        return {"input": TEXTS[:texts], "encoding": "f32"}
    return {"rows": texts, "seed": i}


def release(name: str) -> None:
    if name == "torch_embed":
        import torch

        torch.cuda.empty_cache()
    else:
        import jax

        jax.clear_caches()


def drop(args: argparse.Namespace, options: Dict[str, str]) -> Dict[str, Any]:
    nvml = devices.Nvml()
    if args.backend == "torch_embed":
        import torch  # noqa: F401
    else:
        import equinox  # noqa: F401
        import jax  # noqa: F401
    cycles: List[Dict[str, float]] = []
    for cycle in range(args.cycles):
        b = backend(args.backend, args.model, options)
        loaded = devices.own_vram(nvml)
        for i in range(args.batches):
            b.handle(Request(i, body(args.backend, args.texts, i)), RequestContext.standalone())
        worked = devices.own_vram(nvml)
        del b
        gc.collect()
        release(args.backend)
        gc.collect()
        cycles.append({"loaded_mib": loaded, "worked_mib": worked, "dropped_mib": devices.own_vram(nvml)})
    out: Dict[str, Any] = {"cycles": cycles}
    if args.backend == "torch_embed":
        import torch

        out["torch"] = torch.__version__
    else:
        import jax

        out["jax"] = jax.__version__
        out["jax_devices"] = [str(d) for d in jax.devices()]
    return out


def rate(args: argparse.Namespace, options: Dict[str, str]) -> Dict[str, Any]:
    b = backend(args.backend, args.model, options)
    lock = threading.Lock()
    request = body(args.backend, args.texts, 0)
    for i in range(3):  # warm
        b.handle(Request(i, request), RequestContext.standalone())
    rounds = []
    for _ in range(args.rounds):
        done = [0]
        stop = time.monotonic() + args.seconds

        def client(c: int) -> None:
            i = 0
            while time.monotonic() < stop:
                b.handle(Request(c * 1_000_000 + i, request), RequestContext.standalone())
                i += 1
            with lock:
                done[0] += i

        started = time.monotonic()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rounds.append(done[0] / (time.monotonic() - started))
    return {"per_s": rounds}


def vectors(args: argparse.Namespace, options: Dict[str, str]) -> Dict[str, Any]:
    b = backend(args.backend, args.model, options)
    reply = b.handle(Request(0, {"input": TEXTS[:4]}), RequestContext.standalone())
    answer = getattr(reply, "body", reply)
    return {"embeddings": answer["embeddings"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["drop", "rate", "vectors"])
    parser.add_argument("backend", choices=["torch_embed", "eqx_stack"])
    parser.add_argument("--model", default="")
    parser.add_argument("--option", action="append", default=[])
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    out = {"drop": drop, "rate": rate, "vectors": vectors}[args.what](args, options)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
