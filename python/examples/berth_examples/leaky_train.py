"""``leaky_train``: a PyTorch training step with the classic autodiff leak
(the Burn and PyTorch field reports): every step's loss is appended to a
list for logging *with its graph*. The backward pass runs with
``retain_graph=True`` (as code that calls backward on several heads does),
so each kept loss holds its step's saved activations, and the process grows
by roughly ``3 x batch x hidden x 4`` bytes a step, for ever.

Served with ``max_rss``, berth recycles the worker before it outgrows its
budget: a fresh worker is made ready first, requests move to it, none fails.

Options:

- ``hidden`` (512), ``batch`` (64), ``inputs`` (256): the MLP's shape and
  the batch each step trains on;
- ``leak``: ``true`` (default) keeps every step's loss with its graph;
  ``false`` keeps ``loss.item()``, the fix;
- ``threads``: PyTorch's intra-op threads (default: PyTorch's choice).

Request: ``{"steps": N}`` (default 1, at most 10000) trains N steps;
answers ``{"steps", "loss", "kept_graphs", "total_steps"}``.
"""

from __future__ import annotations

from typing import Any, List

import torch

from berth_worker import (
    Backend,
    BadRequest,
    Cancelled,
    LoadContext,
    LoadSpec,
    Options,
    Request,
    RequestContext,
)


class LeakyTrain(Backend):
    """A small MLP regressor trained one request at a time."""

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(["hidden", "batch", "inputs", "leak", "threads"])
        self.hidden = opts.int("hidden", 512, minimum=1)
        self.batch = opts.int("batch", 64, minimum=1)
        self.inputs = opts.int("inputs", 256, minimum=1)
        self.leak = opts.bool("leak", True)
        threads = opts.int("threads", 0, minimum=0)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(self.inputs, self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, self.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(self.hidden, 1),
        )
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.target = torch.nn.Linear(self.inputs, 1)  # a fixed function to learn
        self.losses: List[Any] = []
        self.steps = 0
        ctx.progress()

    def step(self) -> float:
        x = torch.randn(self.batch, self.inputs)
        with torch.no_grad():
            y = self.target(x)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward(retain_graph=self.leak)
        self.optimizer.step()
        # The leak: the tensor, not its value, goes into the log.
        self.losses.append(loss if self.leak else loss.item())
        self.steps += 1
        return float(loss.detach())

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        body = request.body if isinstance(request.body, dict) else {}
        steps = body.get("steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 10000:
            raise BadRequest(
                'model `{}`: the request must be {{"steps": N}} with N from 1 to 10000'.format(
                    ctx.name
                )
            )
        loss = 0.0
        for _ in range(steps):
            if ctx.cancelled:
                raise Cancelled("cancelled")
            loss = self.step()
            ctx.progress()
        return {
            "steps": steps,
            "loss": loss,
            "kept_graphs": sum(1 for x in self.losses if isinstance(x, torch.Tensor)),
            "total_steps": self.steps,
        }

    def describe(self) -> Any:
        return {
            "hidden": self.hidden,
            "batch": self.batch,
            "inputs": self.inputs,
            "leak": self.leak,
            "leak_bytes_per_step": 3 * self.batch * self.hidden * 4 if self.leak else 0,
            "framework": "torch " + torch.__version__,
        }
