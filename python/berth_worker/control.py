"""The preloader's control socket: frames as on the stream wire (a header,
no payload), with up to three descriptors each (docs/wire.md §8).
"""

from __future__ import annotations

import array
import socket
from typing import Any, Dict, List, Tuple

from .wire import PREFIX, check_prefix, decode_header, descriptors, encode_frame

_MAX_FRAME = 1 << 20


#: A fork frame carries three descriptors: the wire, stdout, stderr.
FORK_FDS = 3


_FD_SIZE = array.array("i").itemsize


def send(sock: socket.socket, header: Dict[str, Any]) -> None:
    sock.sendall(encode_frame(header))


class Control:
    """Reads frames (with up to three descriptors each) from the supervisor."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.fds: List[int] = []

    def read(self) -> Tuple[Dict[str, Any], List[int]]:
        """The next frame's header and the descriptors that came with it."""
        while True:
            if len(self.buf) >= 8:
                length, head_length = PREFIX.unpack_from(self.buf, 0)
                if length > _MAX_FRAME:
                    raise ValueError("a control frame of {} bytes is too long".format(length))
                check_prefix(length, head_length)
                if len(self.buf) >= 4 + length:
                    head = bytes(self.buf[8 : 8 + head_length])
                    del self.buf[: 4 + length]
                    fds, self.fds = self.fds, []
                    return decode_header(head), fds
            data, ancdata, flags, _ = self.sock.recvmsg(
                1 << 16, socket.CMSG_SPACE(FORK_FDS * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
            )
            self.fds.extend(descriptors(ancdata))
            if flags & int(socket.MSG_CTRUNC):
                raise ValueError("more descriptors came with a control frame than it takes")
            if not data:
                raise EOFError("the supervisor closed the control socket")
            self.buf += data
