"""What the reader thread and the model thread share: the progress counter,
request counts and cancellations. Every change takes a lock; none is held
while model code runs."""

from __future__ import annotations

import threading
from typing import Dict, Set


class Progress:
    """A counter the model code advances as it works; read by pings.

    A request whose worker answers pings but whose progress stops moving is
    stalled, so advance it from the code doing the work (per token, per
    batch, per load step), never from a timer.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def advance(self, steps: int = 1) -> None:
        """Adds ``steps`` (default 1)."""
        with self._lock:
            self._value += steps

    def get(self) -> int:
        """The counter's value."""
        with self._lock:
            return self._value


class WorkerState:
    """Counters for pongs and the cancellation registry.

    A request is *in flight* from the moment the reader thread queues it
    until its ``done`` is about to be sent. A cancel is recorded only for a
    request in flight; one for a finished (or unknown) request is ignored,
    so the registry never grows past the requests in flight.
    """

    def __init__(self) -> None:
        self.progress = Progress()
        self._lock = threading.Lock()
        self._in_flight: Set[int] = set()
        self._cancelled: Set[int] = set()
        self._requests_done = 0

    def started(self, request_id: int) -> bool:
        """The reader thread queued this request; False if one with this id
        is already in flight."""
        with self._lock:
            if request_id in self._in_flight:
                return False
            self._in_flight.add(request_id)
            return True

    def cancel(self, request_id: int) -> bool:
        """Records a cancel; False if the request is not in flight."""
        with self._lock:
            if request_id not in self._in_flight:
                return False
            self._cancelled.add(request_id)
            return True

    def is_cancelled(self, request_id: int) -> bool:
        """True once a cancel for this in-flight request arrived.

        No lock: one membership test of a set of ints is atomic (under the
        GIL, or the set's own lock without one) and sees the set before or
        after a change, which is all the lock gave a reader; it runs once a
        request and at every check a long loop makes."""
        return request_id in self._cancelled

    def finished(self, request_id: int) -> None:
        """The request's ``done`` is about to be sent."""
        with self._lock:
            self._in_flight.discard(request_id)
            self._cancelled.discard(request_id)
            self._requests_done += 1

    def in_flight(self) -> int:
        """Requests received and not yet answered."""
        with self._lock:
            return len(self._in_flight)

    def counts(self) -> Dict[str, int]:
        """``progress``, ``requests_done`` and ``in_flight``, for a pong."""
        progress = self.progress.get()
        with self._lock:
            return {
                "progress": progress,
                "requests_done": self._requests_done,
                "in_flight": len(self._in_flight),
            }
