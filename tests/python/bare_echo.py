"""The baseline of the Python round-trip bench: the same kind of socket
(one end of a socket pair at BERTH_FD) and the same framing as the stream
wire, but no berth_worker and no supervisor: read a frame, write it back."""

import os
import socket
import struct

sock = socket.socket(fileno=int(os.environ["BERTH_FD"]))
buf = bytearray(1 << 16)
view = memoryview(buf)
while True:
    got = 0
    while got < 8:
        n = sock.recv_into(view[got:8])
        if n == 0:
            raise SystemExit(0)
        got += n
    length = struct.unpack_from("<I", buf, 0)[0]
    total = 4 + length
    while got < total:
        n = sock.recv_into(view[got:total])
        if n == 0:
            raise SystemExit(0)
        got += n
    sock.sendall(view[:total])
