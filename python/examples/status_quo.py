"""The status quo berth replaces, measured: a model loaded in this Python
process, used for a fixed workload, then dropped the way its framework's
users are told to (``del``, ``gc.collect()``, and the framework's own cache
release), ``cycles`` times over. Prints one JSON object: this process's
resident memory before the first load and after each drop.

    python3 status_quo.py torch --model ~/.cache/berth/models/all-MiniLM-L6-v2
    python3 status_quo.py jax --cycles 20

The workloads are the examples' own backends (``berth_examples``) called
in-process, request for request what the berth side of the bench sends
through a worker, so the two sides differ only by the process boundary:

- ``torch``: ``torch_embed`` (all-MiniLM-L6-v2), 16 batches of 32 texts;
- ``jax``: ``eqx_stack`` (24 blocks, ``init=blocks``), 8 passes of 64 rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from berth_worker import LoadContext, LoadSpec, Request, RequestContext  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def workload(framework: str) -> Tuple[str, Dict[str, str], List[Dict[str, Any]]]:
    """The backend, its options and the requests of one cycle; the berth
    side of the bench sends the same (tests/benches/python_models.rs)."""
    if framework == "torch":
        texts = ["sentence {} of the status-quo workload, about ships and ports".format(i) for i in range(32)]
        return "torch_embed", {}, [{"input": texts, "encoding": "f32"}] * 16
    return "eqx_stack", {"init": "blocks"}, [{"rows": 64, "seed": i} for i in range(8)]


def release(framework: str) -> Callable[[], None]:
    """The framework's own cache release, as its documentation advises."""
    if framework == "torch":
        import torch

        def torch_release() -> None:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

        return torch_release
    import jax

    return jax.clear_caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("framework", choices=["torch", "jax"])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--model", default=os.path.expanduser("~/.cache/berth/models/all-MiniLM-L6-v2"))
    args = parser.parse_args()

    rss_bare = rss_bytes()
    backend_name, options, requests = workload(args.framework)
    from berth_examples import BACKENDS

    make = BACKENDS[backend_name]
    free = release(args.framework)
    model = args.model if args.framework == "torch" else None
    # The framework imported, nothing loaded: what "before" means.
    if args.framework == "torch":
        import torch  # noqa: F401
    else:
        import equinox  # noqa: F401
        import jax  # noqa: F401
    before = rss_bytes()
    after: List[int] = []
    loaded: List[int] = []
    for cycle in range(args.cycles):
        backend = make()
        backend.load(LoadSpec(backend_name, backend_name, model, options), LoadContext.standalone())
        for i, body in enumerate(requests):
            backend.handle(Request(i, body), RequestContext.standalone())
        loaded.append(rss_bytes())
        del backend
        gc.collect()
        free()
        gc.collect()
        after.append(rss_bytes())
    print(
        json.dumps(
            {
                "framework": args.framework,
                "cycles": args.cycles,
                "rss_bare_bytes": rss_bare,
                "rss_before_bytes": before,
                "rss_loaded_bytes": loaded,
                "rss_after_bytes": after,
            }
        )
    )


if __name__ == "__main__":
    main()
