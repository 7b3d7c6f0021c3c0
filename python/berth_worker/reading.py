"""Who reads the supervisor's socket: the model thread while it is idle,
a watch thread while a job keeps the model thread away.

An idle worker's model thread reads the next frame itself and runs a
request at once, so a round trip wakes one thread in the worker, as a bare
socket echo does. Handing every frame from a reader thread to the model
thread cost a wake and a GIL hand-over per request (the round trip fell
from ~110 to ~35 µs through berth on a 2-vCPU VM without it; see
docs/performance.md).

After a quick job the idle model thread polls the socket for the next
frame a little while (:data:`SPIN`) before it blocks, as the supervisor's
caller spins for an answer: requests sent back to back then find this
thread's vCPU awake.

What the hand-off bought is kept: pings answered and cancels recorded
while a model computes for seconds. While the model thread runs a job:

- it looks at the socket itself where a backend gives it the chance
  (:meth:`Reading.take`, between steps and batches and at every streamed
  chunk: a ``poll`` that never blocks), so a streaming request sees its
  cancel at the next chunk;
- once it has not looked for :data:`WATCH` seconds, the watch thread takes
  the socket over: it answers pings, records cancels and queues jobs as
  the reader thread did, until the model thread is idle again and the
  socket goes back to it.

The watch never runs model code. It costs nothing while the worker is
idle: :data:`LINGER` seconds after the last job it sleeps until the next
job wakes it (one wake, for the first request after a quiet spell); in
between it checks every :data:`WATCH` seconds, which is how it notices a
long job without a timer armed per request.
"""

from __future__ import annotations

import math
import os
import queue
import select
import threading
import time
from typing import Callable, Optional

from .connection import Connection
from .errors import describe_exception
from .process import die
from .wire import Frame, FrameError

#: How long the model thread may go without looking at the socket during a
#: job before the watch takes it over, in seconds: the most a pong or a
#: cancel waits beyond that is one more period.
WATCH = 0.025

#: How long after the last job the watch keeps checking every WATCH
#: seconds before it sleeps until woken, in seconds.
LINGER = 2.0

#: After a job this quick, in seconds, the idle model thread polls the
#: socket for the next frame this long before it blocks, yielding its CPU
#: between polls, as the supervisor's caller spins for an answer: a
#: client sending requests back to back then finds this vCPU awake (a
#: halted one costs the hypervisor's wake-up, ~10 µs on a 2-vCPU VM, on
#: every request), and an idle worker costs nothing more once it blocks.
SPIN = 0.00005

#: Queued to wake the model thread when the watch gives the socket back.
RESUME = Frame({"type": "resume"}, None)

_MODEL, _WATCH = "model thread", "watch"


def _readable(poller: "select.poll", timeout: float) -> bool:
    """Whether the one descriptor ``poller`` watches has bytes (or its end)
    within ``timeout`` seconds."""
    return bool(poller.poll(math.ceil(timeout * 1000) if timeout > 0 else 0))


class Reading:
    """The socket's reading duty, shared by the model thread and the watch.

    ``dispatch`` handles a frame read by either thread: it answers a ping,
    records a cancel and returns ``None``, or returns a job (a request, a
    load, a shutdown) for the model thread. ``jobs`` holds the jobs the
    watch read, and those the model thread read while it was busy.
    """

    def __init__(
        self,
        conn: Optional[Connection],
        dispatch: Callable[[Frame], Optional[Frame]],
        jobs: "queue.Queue[Frame]",
    ) -> None:
        self.conn = conn
        self.jobs = jobs
        self._dispatch = dispatch
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Held by whichever thread is reading a frame (or, for the watch,
        # waiting for one): two threads never read the stream at once.
        self._read_lock = threading.Lock()
        self._reader = _MODEL
        # When the busy model thread last looked at the socket; None while
        # it is idle (and then only it reads).
        self._busy_since: Optional[float] = None
        self._last_busy = time.monotonic()
        self._asleep = False
        self._asked_back = False
        # The model thread's own poller on the socket (a poll object is
        # not shared between threads).
        self._model_poller = select.poll()
        if conn is not None:
            self._model_poller.register(conn.fileno(), select.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # -- the model thread ------------------------------------------------------

    def next_job(self) -> Frame:
        """The model thread's next job, read from the socket while it holds
        it, or from the queue. Blocks; marks the model thread busy."""
        while True:
            job = self._queued()
            if job is not None:
                if job is not RESUME:
                    self.busy()
                    return job
                continue
            quick = False
            with self._lock:
                if self._busy_since is not None:
                    now = time.monotonic()
                    quick = now - self._busy_since < SPIN
                    self._busy_since = None
                    self._last_busy = now
                mine = self._reader == _MODEL
                ask = not mine and not self._asked_back
                if ask:
                    self._asked_back = True
            if mine:
                if quick:
                    self._spin()
                with self._read_lock:
                    frame = self._read()
                job = self._dispatch(frame)
                if job is not None:
                    self.busy()
                    return job
                continue
            if ask:
                # The watch holds the socket: ask for it back, then wait
                # for a job or for the socket.
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:
                    pass
            job = self.jobs.get()
            if job is not RESUME:
                self.busy()
                return job

    def _spin(self) -> None:
        """Polls the socket for up to SPIN seconds, yielding between polls."""
        assert self.conn is not None
        deadline = time.monotonic() + SPIN
        poller = self._model_poller
        while not self.conn.buffered() and not poller.poll(0):
            if time.monotonic() >= deadline:
                return
            os.sched_yield()

    def busy(self) -> None:
        """The model thread starts a job (or looked at the socket during one)."""
        with self._lock:
            self._busy_since = time.monotonic()
            if self._asleep:
                self._asleep = False
                self._changed.notify()

    def take(self) -> Optional[Frame]:
        """A job waiting now, if any: what the socket holds is read first
        (without blocking) while the model thread holds it."""
        self._pump(0.0)
        while True:
            job = self._queued()
            if job is not RESUME:
                return job

    def _queued(self) -> Optional[Frame]:
        """The next queued job, RESUME included, or None; without the
        exception an empty queue's ``get_nowait`` raises (the common case).
        The queue's deque is looked at without the queue's lock, as
        ``qsize`` would: one atomic read under the GIL, as current as
        ``qsize``'s answer once its lock is released."""
        if not self.jobs.queue:
            return None
        try:
            return self.jobs.get_nowait()
        except queue.Empty:
            return None

    def wait(self, timeout: float) -> Optional[Frame]:
        """A job within ``timeout`` seconds, or ``None``."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.take()
            if job is not None:
                return job
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not self._holds_socket():
                try:
                    job = self.jobs.get(timeout=left)
                except queue.Empty:
                    return None
                if job is not RESUME:
                    return job
                continue
            self._pump(left)

    def look(self) -> None:
        """Reads what the socket holds now, if the model thread holds it (a
        streamed chunk calls this): pings are answered and cancels seen."""
        self._pump(0.0)

    def _holds_socket(self) -> bool:
        with self._lock:
            return self._reader == _MODEL

    def _pump(self, timeout: float) -> None:
        """Reads every frame the socket holds (waiting up to ``timeout``
        seconds for the first), queuing jobs, while the model thread holds
        the socket; does nothing once the watch has it."""
        if self.conn is None or not self._holds_socket():
            return
        if not self._read_lock.acquire(blocking=False):
            return
        try:
            wait = timeout
            while self.conn.buffered() or _readable(self._model_poller, wait):
                wait = 0.0
                frame = self._read()
                job = self._dispatch(frame)
                if job is not None:
                    self.jobs.put(job)
        finally:
            self._read_lock.release()
        self.busy()

    def _read(self) -> Frame:
        assert self.conn is not None
        try:
            return self.conn.read()
        except EOFError as e:
            die("the supervisor closed the connection ({}); exiting".format(e))
        except FrameError as e:
            die("the supervisor broke the wire: {}; exiting".format(e))

    # -- the watch -------------------------------------------------------------

    def start_watch(self) -> threading.Thread:
        """Starts the watch (a daemon: it never holds up an exit)."""
        thread = threading.Thread(target=self._watch_loop, name="berth-watch", daemon=True)
        thread.start()
        return thread

    def _watch_loop(self) -> None:
        try:
            while True:
                self._wait_for_a_long_job()
                self._hold_socket()
        except BaseException as e:  # a bug here must not leave a deaf worker
            die("the watch thread failed ({}); exiting".format(describe_exception(e)))

    def _wait_for_a_long_job(self) -> None:
        """Returns once the model thread has been busy WATCH seconds without
        looking at the socket; the socket is then the watch's."""
        with self._lock:
            while True:
                now = time.monotonic()
                timeout: Optional[float]
                if self._busy_since is not None:
                    due = self._busy_since + WATCH
                    if now >= due:
                        self._reader = _WATCH
                        self._asked_back = False
                        return
                    timeout = due - now
                elif now - self._last_busy < LINGER:
                    timeout = WATCH
                else:
                    self._asleep = True
                    timeout = None
                self._changed.wait(timeout)
                self._asleep = False

    def _hold_socket(self) -> None:
        """Reads frames for the busy model thread until it is idle, then
        gives the socket back to it."""
        assert self.conn is not None
        sock = self.conn.fileno()
        alone = select.poll()
        alone.register(sock, select.POLLIN)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        with self._read_lock:
            while True:
                with self._lock:
                    if self._busy_since is None:
                        self._reader = _MODEL
                        break
                if self.conn.buffered() or _readable(alone, 0.0):
                    job = self._dispatch(self._read())
                    if job is not None:
                        self.jobs.put(job)
                    continue
                for fd, _ in poller.poll():
                    if fd == self._wake_r:
                        self._drain_wake()
        self.jobs.put(RESUME)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass
