"""``eqx_stack``: a stack of MLP blocks in JAX/Equinox, the shape of the
field report in which initialising a model with ``eqx.filter_vmap`` in
float32 and casting to float16 afterwards ran out of memory at init.

Each block is ``x + Linear(hidden -> width)(gelu(Linear(width -> hidden)(x)))``;
the blocks' parameters are stacked along a leading axis and run with
``jax.lax.scan``, the way Equinox models of many identical layers are built.

Options:

- ``init``: ``blocks`` (default) builds one block at a time and casts it to
  ``dtype`` at once, so at most one block is ever in float32; ``vmap`` builds
  every block at once with ``eqx.filter_vmap`` in float32 and casts the
  whole stack afterwards, which needs the float32 stack, its random
  temporaries and the cast copy together: about five times the final
  model at its peak.
- ``blocks`` (24), ``width`` (1024), ``hidden`` (4096): the model's shape;
  24 x (1024 -> 4096 -> 1024) is 201 M parameters, 403 MB in float16.
- ``dtype``: ``float16`` (default), ``bfloat16`` or ``float32``.
- ``seed``: the initialisation's seed (default 0).

Request: ``{"rows": N, "seed": S}`` runs N random rows through the stack;
answers ``{"rows", "width", "mean", "std"}`` of the output. With bulk bytes
(``N x width`` little-endian float32) it runs those rows and answers the
output rows as bulk float32, body ``{"rows", "width"}``.
"""

from __future__ import annotations

import time
from typing import Any, List

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from berth_worker import (
    Backend,
    BadRequest,
    LoadContext,
    LoadSpec,
    Options,
    Request,
    RequestContext,
    Response,
)

DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32}


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, hidden: int, key: Any, dtype: Any = jnp.float32) -> None:
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(width, hidden, key=k1, dtype=dtype)
        self.down = eqx.nn.Linear(hidden, width, key=k2, dtype=dtype)

    def __call__(self, x: Any) -> Any:
        return x + self.down(jax.nn.gelu(self.up(x)))


def cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating array in ``dtype``."""
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, tree
    )


def init_vmap(n: int, width: int, hidden: int, key: Any, dtype: Any) -> Block:
    """All blocks at once in float32, then the cast: the report's way."""
    keys = jax.random.split(key, n)
    stack = eqx.filter_vmap(lambda k: Block(width, hidden, k))(keys)
    stack = cast(stack, dtype)
    jax.block_until_ready(stack)
    return stack


def init_blocks(n: int, width: int, hidden: int, key: Any, dtype: Any, progress: Any) -> Block:
    """One block at a time, each cast as it is made, then stacked."""
    blocks: List[Block] = []
    for k in jax.random.split(key, n):
        block = cast(Block(width, hidden, k), dtype)
        jax.block_until_ready(block)
        blocks.append(block)
        progress()
    dynamic = [eqx.filter(b, eqx.is_array) for b in blocks]
    static = eqx.partition(blocks[0], eqx.is_array)[1]
    del blocks
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *dynamic)
    del dynamic
    stack = eqx.combine(stacked, static)
    jax.block_until_ready(stack)
    return stack


@eqx.filter_jit
def run_stack(stack: Block, x: Any) -> Any:
    dynamic, static = eqx.partition(stack, eqx.is_array)

    def step(h: Any, layer: Any) -> Any:
        block = eqx.combine(layer, static)
        return jax.vmap(block)(h), None

    out, _ = jax.lax.scan(step, x.astype(dynamic.up.weight.dtype), dynamic)
    return out.astype(jnp.float32)


class EqxStack(Backend):
    """The stacked-blocks model, initialised as the ``init`` option says."""

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(["init", "blocks", "width", "hidden", "dtype", "seed"])
        self.init = opts.str("init", "blocks")
        if self.init not in ("vmap", "blocks"):
            raise BadRequest(
                "model `{}`: option `init={}` is not `vmap` or `blocks`".format(spec.name, self.init)
            )
        self.blocks = opts.int("blocks", 24, minimum=1)
        self.width = opts.int("width", 1024, minimum=1)
        self.hidden = opts.int("hidden", 4096, minimum=1)
        dtype_name = opts.str("dtype", "float16")
        if dtype_name not in DTYPES:
            raise BadRequest(
                "model `{}`: option `dtype={}` is not one of {}".format(
                    spec.name, dtype_name, ", ".join(DTYPES)
                )
            )
        self.dtype_name = dtype_name
        dtype = DTYPES[dtype_name]
        key = jax.random.PRNGKey(opts.int("seed", 0, minimum=0))
        started = time.perf_counter()
        if self.init == "vmap":
            ctx.progress()
            self.stack = init_vmap(self.blocks, self.width, self.hidden, key, dtype)
        else:
            self.stack = init_blocks(
                self.blocks, self.width, self.hidden, key, dtype, ctx.progress
            )
        self.init_ms = (time.perf_counter() - started) * 1e3
        leaves = jax.tree_util.tree_leaves(eqx.filter(self.stack, eqx.is_array))
        self.parameters = int(sum(x.size for x in leaves))
        self.parameter_bytes = int(sum(x.size * x.dtype.itemsize for x in leaves))
        ctx.progress()

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        body = request.body if isinstance(request.body, dict) else None
        if body is None:
            raise BadRequest(
                'model `{}`: the request must be {{"rows": N, "seed": S}}, or '
                '{{}} with N x {} float32 bulk bytes'.format(ctx.name, self.width)
            )
        if request.bulk is not None:
            data = np.frombuffer(request.bulk, dtype="<f4")
            if data.size == 0 or data.size % self.width:
                raise BadRequest(
                    "model `{}`: {} bulk bytes are not rows of {} float32 values".format(
                        ctx.name, request.bulk.nbytes, self.width
                    )
                )
            x = jnp.asarray(data.reshape(-1, self.width))
            out = np.asarray(run_stack(self.stack, x))
            ctx.progress()
            return Response({"rows": int(out.shape[0]), "width": self.width}, out.astype("<f4"))
        rows = body.get("rows", 1)
        seed = body.get("seed", 0)
        if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= 4096:
            raise BadRequest("model `{}`: `rows` must be an integer from 1 to 4096".format(ctx.name))
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise BadRequest("model `{}`: `seed` must be a non-negative integer".format(ctx.name))
        x = jax.random.normal(jax.random.PRNGKey(seed), (rows, self.width))
        out = run_stack(self.stack, x)
        ctx.progress()
        return {
            "rows": rows,
            "width": self.width,
            "mean": float(jnp.mean(out)),
            "std": float(jnp.std(out)),
        }

    def describe(self) -> Any:
        return {
            "init": self.init,
            "blocks": self.blocks,
            "width": self.width,
            "hidden": self.hidden,
            "dtype": self.dtype_name,
            "parameters": self.parameters,
            "parameter_bytes": self.parameter_bytes,
            "init_ms": round(self.init_ms, 1),
            "framework": "jax {} / equinox {}".format(jax.__version__, eqx.__version__),
            # Where JAX runs: a CUDA plugin that refused its settings runs on
            # the CPU without a word (docs/gpu.md).
            "devices": [str(d) for d in jax.devices()],
        }
