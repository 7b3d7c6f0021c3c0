"""A worker that breaks the stream wire on purpose, for the tests that check
the supervisor stops it with an error naming what it sent.

Written from docs/wire.md alone, with the standard library only (no
berth_worker), the way a third language would. `ROGUE_MODE` picks the
offence; it behaves until the first request, then commits it (modes that
break the handshake do so at once). One mode breaks no rule but is a fault
all the same: `deaf` stops reading for a second at its first request, then
reads slowly, in small pieces, and answers each request with its body, the order it came in and the number
of descriptors that came with it (the supervisor must queue what the
socket does not take, without blocking its callers, and deliver it whole
and in order).
"""

import array
import json
import os
import socket
import struct
import sys
import time

MODE = os.environ.get("ROGUE_MODE", "")
# Requests answered as a plain echo before the offence (the supervisor's
# caller then spins for answers and reads them itself).
AFTER = int(os.environ.get("ROGUE_AFTER", "0"))
ANSWERED = []
SOCK = socket.socket(fileno=int(os.environ["BERTH_FD"]))
DEAF_DONE = []
FDS = []


def frame(header, payload=b""):
    h = json.dumps(header).encode() if isinstance(header, dict) else header
    return struct.pack("<II", 4 + len(h) + len(payload), len(h)) + h + payload


def send(header, payload=b"", fds=()):
    data = frame(header, payload)
    if fds:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
        sent = SOCK.sendmsg([data], ancillary)
        SOCK.sendall(data[sent:])
    else:
        SOCK.sendall(data)


def recv_exact(n):
    """Exactly n bytes; descriptors that came with them go to FDS (a frame
    is read in exact pieces, so they came with the frame being read)."""
    buf = b""
    while len(buf) < n:
        want = n - len(buf)
        if MODE == "deaf" and DEAF_DONE:
            # Hard of hearing after: reads in small pieces, slowly, so that
            # the supervisor still has frames queued when more are sent.
            want = min(want, 65536)
            time.sleep(0.0005)
        got, ancillary, _, _ = SOCK.recvmsg(want, socket.CMSG_SPACE(16))
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                FDS.extend(fds)
        if not got:
            sys.exit(0)
        buf += got
    return buf


def read():
    length, hlen = struct.unpack("<II", recv_exact(8))
    rest = recv_exact(length - 4)
    return json.loads(rest[:hlen])


def memfd(data, seal=True):
    fd = os.memfd_create("rogue", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seal:
        import fcntl

        fcntl.fcntl(
            fd,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
        )
    return fd


def hello(versions=(1,)):
    send({"type": "hello", "versions": list(versions), "pid": os.getpid(),
          "worker_version": "rogue", "backends": ["echo"]})


def offend(request_id):
    done = {"type": "done", "id": request_id, "body": {}}
    if MODE == "oversized":
        SOCK.sendall(struct.pack("<II", 0xFFFFFFF0, 2) + b"{}")
    elif MODE == "bad-json":
        send(b'{"type":"done","id":')
    elif MODE == "not-an-object":
        send(b"[1,2,3]")
    elif MODE == "unknown-message":
        send({"type": "launch", "id": request_id})
    elif MODE == "unknown-error-kind":
        send({"type": "done", "id": request_id,
              "error": {"kind": "on_fire", "message": "?"}})
    elif MODE == "no-such-request":
        send(dict(done, id=request_id + 1000))
    elif MODE == "double-done":
        send(done)
        send(done)
    elif MODE == "unasked-fd":
        send(done, fds=[memfd(b"x" * 16)])
    elif MODE == "unsealed-memfd":
        send(dict(done, bulk={"memfd": 16}), fds=[memfd(b"x" * 16, seal=False)])
    elif MODE == "short-memfd":
        send(dict(done, bulk={"memfd": 1 << 20}), fds=[memfd(b"x" * 16)])
    elif MODE == "not-a-memfd":
        r, w = os.pipe()
        send(dict(done, bulk={"memfd": 16}), fds=[r])
    elif MODE == "undeclared-payload":
        send(done, payload=b"surprise")
    elif MODE == "unsolicited-loaded":
        send({"type": "loaded", "details": {}, "load_micros": 1})
    elif MODE == "many-fds":
        fds = [memfd(b"x") for _ in range(12)]
        send(done, fds=fds)
    else:
        sys.exit("unknown ROGUE_MODE " + MODE)


def main():
    if MODE == "not-hello":
        send({"type": "pong", "seq": 0,
              "stats": {"rss_bytes": 1, "peak_rss_bytes": 1, "progress": 0,
                        "requests_done": 0, "in_flight": 0}})
    elif MODE == "garbage-hello":
        SOCK.sendall(b"GET / HTTP/1.1\r\n\r\n")
    elif MODE == "wrong-version":
        hello(versions=(2, 3))
    else:
        hello()
    while True:
        msg = read()
        kind = msg["type"]
        if kind == "refused":
            sys.stderr.write("rogue: refused: %s\n" % msg["reason"])
            sys.exit(1)
        if kind == "load":
            send({"type": "loaded", "details": {"rogue": MODE}, "load_micros": 1})
        elif kind == "ping":
            send({"type": "pong", "seq": msg["seq"],
                  "stats": {"rss_bytes": 1, "peak_rss_bytes": 1, "progress": 0,
                            "requests_done": 0, "in_flight": 0}})
        elif kind == "request" and MODE == "deaf":
            if not DEAF_DONE:
                time.sleep(1.0)
            DEAF_DONE.append(True)
            fds = len(FDS)
            for fd in FDS:
                os.close(fd)
            FDS.clear()
            body = {"seen": len(DEAF_DONE), "fds": fds, "body": msg.get("body")}
            send({"type": "done", "id": msg["id"], "body": body})
        elif kind == "request" and len(ANSWERED) < AFTER:
            ANSWERED.append(True)
            send({"type": "done", "id": msg["id"], "body": msg.get("body")})
        elif kind == "request":
            offend(msg["id"])
        elif kind == "shutdown":
            sys.exit(0)


main()
