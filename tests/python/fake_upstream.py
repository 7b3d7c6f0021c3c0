"""A small OpenAI-style HTTP server, standard library only, for the faults a
real inference server does not commit on cue. berth runs it as a model's
server (`[workers.NAME] http = ...`), the way it runs llama.cpp's server.

    fake_upstream.py --port PORT [--mode MODE[,MODE...]] [--hold-mib N] [--keepalive-s S]
                     [--health PATH] [--tls-cert PEM --tls-key PEM]

`--port 0`: a port of its own. Routes: GET /health (or `--health`), GET /v1/models, POST /v1/chat/completions (with
"stream": true, server-sent events: `chunks` pieces, `interval_ms` apart,
each carrying the time it was sent), and any other POST under /v1/, which
answers what it received: the body, the path and the headers. A body's
"status" field sets the answer's status; its "plain" field makes the answer
that text, as text/plain; its "delay_ms" delays the answer; its
"answer_headers" (an object) are added to the answer's headers; its
"switch": true answers `101 Switching Protocols` and closes. With
--gpu-state (the fake driver's state folder) it holds --gpu-bytes on device
0, and vLLM's POST /sleep?level=N and /wake_up leave --residue held, or
all of it again.

Modes:
  never-ready        /health answers 503 for ever
  exit-at-start      exits with status 3 before it listens, saying why
  hang-health-after  /health stops answering after N checks (--after N)
  health-503-after   /health answers 503 for 2 checks after N (--after N), then 200 again
  drain-on-sigterm   SIGTERM closes the listening socket at once (as uvicorn
                     does), lets running requests finish, then exits 0
  crash-mid-stream   a stream exits the process (SIGKILL itself) after 2 pieces
  sleep-fails        POST /sleep and /wake_up answer 500 (with --gpu-state)
  ignore-sigterm     SIGTERM is ignored
  fork-child         forks a child holding --child-mib MiB, in its group
  fork-escape        ... and the child leaves the group and session (setsid)
"""

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGS = None
HEALTH_CHECKS = 0
HELD = []
# POSTs being answered, for drain-on-sigterm.
ACTIVE = 0
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet: berth logs stderr
        pass

    def setup(self):
        super().setup()
        # As uvicorn and llama.cpp's server do: no Nagle delay on answers.
        if isinstance(self.connection, socket.socket) and self.connection.family != socket.AF_UNIX:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send_json(self, status, value):
        # Head and body in one write, as real servers send a small answer.
        body = json.dumps(value).encode()
        head = "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (
            status, self.responses.get(status, ("",))[0], len(body))
        self.wfile.write(head.encode() + body)

    def do_GET(self):
        global HEALTH_CHECKS
        if self.path == ARGS.health:
            HEALTH_CHECKS += 1
            if "never-ready" in ARGS.mode:
                return self.send_json(503, {"status": "loading"})
            if "hang-health-after" in ARGS.mode and HEALTH_CHECKS > ARGS.after:
                time.sleep(3600)
            if "health-503-after" in ARGS.mode and ARGS.after < HEALTH_CHECKS <= ARGS.after + 2:
                return self.send_json(503, {"status": "busy"})
            return self.send_json(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self.send_json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        if self.path.startswith("/props"):
            # llama.cpp's server's own GET route, the query as it came.
            return self.send_json(200, {"path": self.path, "pid": os.getpid()})
        return self.send_json(404, {"error": "no such route"})

    def do_POST(self):
        global ACTIVE
        with LOCK:
            ACTIVE += 1
        try:
            self.post()
        finally:
            with LOCK:
                ACTIVE -= 1

    def post(self):
        length = int(self.headers.get("Content-Length", "0"))
        raw = self.rfile.read(length)
        # vLLM's sleep and wake, on the fake driver's books (--gpu-state).
        if self.path.startswith("/sleep") or self.path == "/wake_up":
            if not ARGS.gpu_state:
                return self.send_json(404, {"error": "no such route"})
            if "sleep-fails" in ARGS.mode:
                return self.send_json(500, {"error": "cannot sleep now"})
            asleep = self.path.startswith("/sleep")
            hold_gpu(ARGS.residue if asleep else ARGS.gpu_bytes)
            return self.send_json(200, {"is_sleeping": asleep})
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if self.path == "/v1/chat/completions" and isinstance(body, dict) and body.get("stream"):
            return self.stream(body)
        if self.path == "/v1/chat/completions":
            return self.send_json(200, {
                "object": "chat.completion",
                "model": body.get("model") if isinstance(body, dict) else None,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hello from fake"}}],
                "received": body,
                "headers": {k.lower(): v for k, v in self.headers.items()},
            })
        with LOCK:
            active = ACTIVE
        if isinstance(body, dict) and body.get("delay_ms"):
            time.sleep(float(body["delay_ms"]) / 1000)
        status = body.get("status", 200) if isinstance(body, dict) else 200
        if isinstance(body, dict) and body.get("die_mid_body"):
            # Promises 257 bytes, sends 100, and dies: an answer cut off.
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "257")
            self.end_headers()
            self.wfile.write(b"{" + b" " * 99)
            self.wfile.flush()
            os._exit(1)
        if isinstance(body, dict) and body.get("switch"):
            self.wfile.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                             b"Connection: Upgrade\r\n\r\n")
            self.wfile.flush()
            self.close_connection = True
            return
        if isinstance(body, dict) and isinstance(body.get("answer_headers"), dict):
            value = {"path": self.path, "received": body}
            data = json.dumps(value).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in body["answer_headers"].items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
            return
        if isinstance(body, dict) and "plain" in body:
            text = body["plain"].encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)
            return
        self.send_json(status, {
            "path": self.path,
            "received": body if body is not None else raw.decode("latin-1"),
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "pid": os.getpid(),
            # POSTs being answered when this one came in, itself included.
            "active": active,
        })

    def stream(self, body):
        chunks = int(body.get("chunks", 5))
        interval = float(body.get("interval_ms", 0)) / 1000
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def piece(text):
            data = text.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        try:
            for i in range(chunks):
                if "crash-mid-stream" in ARGS.mode and i == 2:
                    sys.stderr.write("fake_upstream: crashing mid-stream as asked\n")
                    sys.stderr.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                event = {"choices": [{"index": 0, "delta": {"content": "tok%d " % i}}],
                         "sent_at": time.time(), "i": i}
                piece("data: %s\n\n" % json.dumps(event))
                if interval:
                    time.sleep(interval)
            piece("data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


def hold_gpu(nbytes):
    """What this process holds on the fake driver's device 0, as its
    `state/<pid>.0` file says (none: no file)."""
    os.makedirs(ARGS.gpu_state, exist_ok=True)
    path = os.path.join(ARGS.gpu_state, "%d.0" % os.getpid())
    if nbytes:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("%d\n" % nbytes)
        os.rename(tmp, path)
    elif os.path.exists(path):
        os.remove(path)


def fork_child(escape):
    pid = os.fork()
    if pid:
        return
    if escape:
        os.setsid()
    held = bytearray(ARGS.child_mib << 20)
    for i in range(0, len(held), 4096):
        held[i] = 1
    HELD.append(held)
    while True:
        time.sleep(3600)


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--socket")
    parser.add_argument("--mode", default="")
    parser.add_argument("--health", default="/health")
    parser.add_argument("--after", type=int, default=3)
    parser.add_argument("--hold-mib", type=int, default=0)
    parser.add_argument("--child-mib", type=int, default=64)
    parser.add_argument("--model")
    parser.add_argument("--gpu-state",
                        help="the fake driver's state folder: hold --gpu-bytes on device 0 there")
    parser.add_argument("--gpu-bytes", type=int, default=0)
    parser.add_argument("--residue", type=int, default=0,
                        help="what POST /sleep leaves held")
    parser.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate")
    parser.add_argument("--tls-key", help="... and this PEM key")
    parser.add_argument("--keepalive-s", type=float, default=0,
                        help="close a connection idle this long (uvicorn's is 5 s)")
    ARGS = parser.parse_known_args()[0]
    ARGS.mode = set(filter(None, ARGS.mode.split(",")))
    if ARGS.keepalive_s:
        Handler.timeout = ARGS.keepalive_s
    if "exit-at-start" in ARGS.mode:
        sys.stderr.write("fake_upstream: exiting at start as asked\n")
        sys.exit(3)
    if "ignore-sigterm" in ARGS.mode:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if ARGS.hold_mib:
        held = bytearray(ARGS.hold_mib << 20)
        for i in range(0, len(held), 4096):
            held[i] = 1
        HELD.append(held)
    if ARGS.gpu_state:
        hold_gpu(ARGS.gpu_bytes)
    if "fork-child" in ARGS.mode or "fork-escape" in ARGS.mode:
        fork_child("fork-escape" in ARGS.mode)
    if ARGS.socket:
        class UnixServer(ThreadingHTTPServer):
            address_family = socket.AF_UNIX

            def server_bind(self):
                self.socket.bind(self.server_address)
                self.server_name, self.server_port = "localhost", 0

        server = UnixServer(ARGS.socket, Handler)
    else:
        server = ThreadingHTTPServer((ARGS.host, ARGS.port), Handler)
    server.daemon_threads = True
    if ARGS.tls_cert:
        import ssl
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(ARGS.tls_cert, ARGS.tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    if "drain-on-sigterm" in ARGS.mode:
        # serve_forever runs in this thread: stop it from another.
        signal.signal(signal.SIGTERM,
                      lambda *_: threading.Thread(target=server.shutdown).start())
    sys.stderr.write("fake_upstream: listening\n")
    sys.stderr.flush()
    server.serve_forever()
    # Only drain-on-sigterm gets here: no new connections, the running
    # requests finish, then a clean exit.
    server.server_close()
    sys.stderr.write("fake_upstream: SIGTERM, draining\n")
    sys.stderr.flush()
    while True:
        with LOCK:
            if ACTIVE == 0:
                break
        time.sleep(0.02)
    sys.exit(0)


if __name__ == "__main__":
    main()
