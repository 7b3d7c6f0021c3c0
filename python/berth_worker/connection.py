"""The worker's end of the stream: one socket, frames read by one thread
at a time (see reading.py), frames written by any thread under one lock."""

from __future__ import annotations

import socket
import threading
from typing import Any, Dict, Optional

from .process import die
from .wire import BulkLike, Frame, FrameReader, OutgoingFrame


class Connection:
    """The socket to the supervisor.

    :meth:`build` encodes a frame (and fills its memfd) in the caller's
    thread, without the lock; :meth:`send_built` writes it under the lock,
    so a pong never waits for a large memfd to be written. A failed write
    means the supervisor is gone (or the stream is now cut mid-frame): the
    worker exits at once.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(sock)
        self._write_lock = threading.Lock()

    @classmethod
    def from_fd(cls, fd: int) -> "Connection":
        """Wraps an inherited ``socketpair`` end."""
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or sock.family != socket.AF_UNIX:
            raise OSError("descriptor {} is not an AF_UNIX stream socket".format(fd))
        sock.setblocking(True)
        return cls(sock)

    def read(self) -> Frame:
        """The next frame (one reading thread at a time)."""
        return self.reader.read()

    def buffered(self) -> bool:
        """True if received bytes wait to be read as (part of) a frame."""
        return self.reader.buffered()

    def fileno(self) -> int:
        """The socket's descriptor."""
        return self.sock.fileno()

    @staticmethod
    def build(header: Dict[str, Any], bulk: Optional[BulkLike] = None) -> OutgoingFrame:
        """Encodes a frame. Raises what :meth:`OutgoingFrame.build` raises
        (JSON errors, :class:`~berth_worker.wire.FrameTooLarge`, ``OSError``
        making the memfd), for the caller to turn into a failed request."""
        return OutgoingFrame.build(header, bulk)

    def send_built(self, frame: OutgoingFrame) -> None:
        """Writes a built frame; exits the process if the write fails."""
        with self._write_lock:
            try:
                frame.send(self.sock)
            except OSError as e:
                die("cannot write to the supervisor ({}); exiting".format(e))

    def send(self, header: Dict[str, Any], bulk: Optional[BulkLike] = None) -> None:
        """Builds and writes a frame."""
        self.send_built(self.build(header, bulk))
