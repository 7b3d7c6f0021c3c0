"""Real models served by berth's Python worker (``berth_worker``).

- ``torch_embed``: sentence embeddings (all-MiniLM-L6-v2) in plain PyTorch;
- ``eqx_stack``: a stack of MLP blocks in JAX/Equinox, initialised all at
  once (``init=vmap``) or block by block (``init=blocks``);
- ``leaky_train``: a PyTorch training step that keeps every step's graph,
  the classic autodiff leak, for ``max_rss`` to recycle.

``python3 -m berth_examples`` serves them. Each framework is imported only
when a model of its backend is loaded, so a worker serving the JAX model
never pays for PyTorch.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Dict


def _lazy(module: str, name: str) -> Callable[[], Any]:
    def make() -> Any:
        return getattr(importlib.import_module("." + module, __name__), name)()

    make.__name__ = name
    return make


BACKENDS: Dict[str, Callable[[], Any]] = {
    "torch_embed": _lazy("torch_embed", "TorchEmbed"),
    "eqx_stack": _lazy("eqx_stack", "EqxStack"),
    "leaky_train": _lazy("leaky_train", "LeakyTrain"),
}
