"""``hog``: holds memory the way a caching allocator does, and optionally
leaks a little more on every request, the way an autodiff graph that is
never freed does. Unloading it is the demonstration that a process boundary
gets every byte back.

Options:

- ``alloc_mib``: held from load on, every page resident (default 0);
- ``leak_kib_per_request``: each request allocates and keeps this much
  more, touched (default 0);
- ``work_ms``: each request takes this long, sleeping in steps of at most
  10 ms and advancing progress each step, and stops with kind ``cancelled``
  when cancelled (default 0);
- ``pool_processes`` (Python only): at load, starts a ``multiprocessing``
  pool of this many processes (start method ``fork``) and keeps it, the way
  a data loader does; ``describe()`` lists their pids (default 0);
- ``batch``: take up to that many waiting requests at once (default 1).

Answers ``{"held_bytes": N}``.
"""

from __future__ import annotations

import multiprocessing
import time
from typing import Any, Callable, List, Optional

from ..backend import Backend, Batching, LoadContext, LoadSpec, Request, RequestContext
from ..errors import BadRequest, Cancelled
from ..options import Options

PAGE = 4096
# Progress is advanced once per this many bytes touched (as the Rust hog
# does every 4096 pages).
_TOUCH_STEP = 4096 * PAGE
_STEP_SECONDS = 0.010


def touched(size: int, progress: Callable[[], None] = lambda: None) -> bytearray:
    """``size`` bytes with every page written, so they are resident, not
    merely reserved."""
    block = bytearray(size)
    ones = b"\x01" * (_TOUCH_STEP // PAGE)
    for start in range(0, size, _TOUCH_STEP):
        end = min(start + _TOUCH_STEP, size)
        block[start:end:PAGE] = ones[: len(range(start, end, PAGE))]
        progress()
    return block


class Hog(Backend):
    """Holds, leaks and works on command."""

    options = ("alloc_mib", "leak_kib_per_request", "work_ms", "pool_processes", "batch")

    def __init__(self) -> None:
        self.held: List[bytearray] = []
        self.leak_bytes = 0
        self.work_seconds = 0.0
        self.name = ""
        self.pool: Optional[Any] = None
        self.pool_pids: List[int] = []

    def load(self, spec: LoadSpec, ctx: LoadContext) -> None:
        opts = Options(spec)
        opts.only(self.options)
        self.batch = opts.int("batch", 1, minimum=1)
        self.name = spec.name
        alloc_mib = opts.int("alloc_mib", 0, minimum=0)
        leak_kib = opts.int("leak_kib_per_request", 0, minimum=0)
        work_ms = opts.int("work_ms", 0, minimum=0)
        processes = opts.int("pool_processes", 0, minimum=0)
        for key, value in (("alloc_mib", alloc_mib << 20), ("leak_kib_per_request", leak_kib << 10)):
            if value > 1 << 48:
                raise BadRequest(
                    "model `{}`: option `{}` is too large for this machine".format(spec.name, key)
                )
        self.leak_bytes = leak_kib << 10
        self.work_seconds = work_ms / 1000.0
        self.held.append(touched(alloc_mib << 20, ctx.progress))
        if processes:
            self._start_pool(processes)
            ctx.progress()

    def batching(self) -> Optional[Batching]:
        return Batching(self.batch) if self.batch > 1 else None

    def _start_pool(self, processes: int) -> None:
        before = {p.pid for p in multiprocessing.active_children()}
        self.pool = multiprocessing.get_context("fork").Pool(processes)
        self.pool_pids = sorted(
            p.pid for p in multiprocessing.active_children() if p.pid not in before and p.pid is not None
        )

    def held_bytes(self) -> int:
        """What the backend holds now."""
        return sum(len(block) for block in self.held)

    def handle(self, request: Request, ctx: RequestContext) -> Any:
        deadline = time.monotonic() + self.work_seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if ctx.cancelled:
                raise Cancelled(
                    "model `{}`: request {} was cancelled while working".format(self.name, ctx.id)
                )
            time.sleep(min(_STEP_SECONDS, left))
            ctx.progress()
        if self.leak_bytes:
            self.held.append(touched(self.leak_bytes))
        ctx.progress()
        return {"held_bytes": self.held_bytes()}

    def describe(self) -> Any:
        return {
            "held_bytes": self.held_bytes(),
            "leak_bytes_per_request": self.leak_bytes,
            "pool_pids": list(self.pool_pids),
        }

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None
        self.held.clear()
