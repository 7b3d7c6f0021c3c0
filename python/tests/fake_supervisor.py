"""A tiny supervisor for the end-to-end tests: starts a worker with one end
of a socketpair at descriptor 3 and speaks the wire with it.

It packs and parses frames itself (struct, sendmsg, recvmsg), independent
of ``berth_worker.wire``, so the tests check the package against the spec
rather than against itself.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import berth_worker

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(berth_worker.__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
TIMEOUT = 10.0


def pack(header: Dict[str, Any], payload: bytes = b"") -> bytes:
    """A frame, packed by hand."""
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return struct.pack("<II", 4 + len(head) + len(payload), len(head)) + head + payload


def sealed_memfd(data: bytes) -> int:
    """A memfd holding ``data``, sealed as the spec says."""
    fd = os.memfd_create("test-bulk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.write(fd, view[written:])
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd


class Received:
    """A frame the worker sent: header, payload and descriptor (if any)."""

    def __init__(self, header: Dict[str, Any], payload: bytes, fd: Optional[int]) -> None:
        self.header = header
        self.payload = payload
        self.fd = fd

    @property
    def type(self) -> str:
        return self.header["type"]

    def bulk(self) -> Optional[bytes]:
        """The bulk bytes, read from the payload or the memfd (then closed)."""
        declared = self.header.get("bulk")
        if declared is None:
            return None
        if "inline" in declared:
            return self.payload
        assert self.fd is not None
        try:
            size = declared["memfd"]
            return os.pread(self.fd, size, 0) if size < (1 << 20) else _read_all(self.fd, size)
        finally:
            os.close(self.fd)
            self.fd = None

    def __repr__(self) -> str:
        return "Received({!r}, {} payload bytes, fd={})".format(self.header, len(self.payload), self.fd)


def _read_all(fd: int, size: int) -> bytes:
    out = bytearray(size)
    view = memoryview(out)
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:]], got)
        if n == 0:
            raise AssertionError("memfd shorter than declared")
        got += n
    return bytes(out)


def _written(file: Any) -> str:
    """What the worker wrote to ``file`` so far, read with ``pread``: the
    worker shares the file's offset, and a seek here would make its next
    write land over what it wrote before."""
    fd = file.fileno()
    size = os.fstat(fd).st_size
    data = b""
    while len(data) < size:
        got = os.pread(fd, size - len(data), len(data))
        if not got:
            break
        data += got
    return data.decode("utf-8", "replace")


class FakeSupervisor:
    """Starts ``python -m berth_worker`` (or ``args``) and talks to it."""

    def __init__(
        self,
        args: Optional[List[str]] = None,
        env: Optional[Dict[str, str]] = None,
        berth_fd: Optional[str] = "3",
    ) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.stderr = tempfile.TemporaryFile()
        self.stdout = tempfile.TemporaryFile()
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = PACKAGE_ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env["BERTH_MODEL"] = "test-model"
        full_env["BERTH_PARENT_PID"] = str(os.getpid())
        full_env.pop("BERTH_FD", None)
        if berth_fd is not None:
            full_env["BERTH_FD"] = berth_fd
        full_env.update(env or {})
        child_fd = theirs.fileno()

        def at_descriptor_3() -> None:
            if child_fd == 3:
                os.set_inheritable(3, True)
            else:
                os.dup2(child_fd, 3)  # dup2 leaves 3 inheritable

        cmd = [sys.executable] + (args if args is not None else ["-m", "berth_worker"])
        self.proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=self.stdout,
            stderr=self.stderr,
            close_fds=False,  # every other descriptor of ours is close-on-exec
            preexec_fn=at_descriptor_3,
            start_new_session=True,  # its own group, killed whole by close()
        )
        theirs.close()
        self.sock = ours
        self.sock.settimeout(TIMEOUT)
        self._buf = bytearray()
        self._fds: List[int] = []

    # -- sending -------------------------------------------------------------

    def send(self, header: Dict[str, Any], payload: bytes = b"") -> None:
        self.sock.sendall(pack(header, payload))

    def send_with_memfd(self, header: Dict[str, Any], data: bytes) -> None:
        """Sends ``header`` with ``data`` in a sealed memfd."""
        fd = sealed_memfd(data)
        try:
            frame = pack(dict(header, bulk={"memfd": len(data)}))
            sent = self.sock.sendmsg(
                [frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            )
            if sent < len(frame):
                self.sock.sendall(frame[sent:])
        finally:
            os.close(fd)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    # -- receiving -----------------------------------------------------------

    def _receive_more(self) -> None:
        data, ancdata, _flags, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(16 * 4))
        for level, kind, raw in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                self._fds.extend(fds)
        if not data:
            raise EOFError("the worker closed the connection")
        self._buf += data

    def recv(self) -> Received:
        """The next frame from the worker."""
        while len(self._buf) < 8:
            self._receive_more()
        length, header_length = struct.unpack_from("<II", self._buf, 0)
        assert 6 <= length <= 64 << 20, length
        assert 2 <= header_length <= length - 4, (header_length, length)
        while len(self._buf) < 4 + length:
            self._receive_more()
        header = json.loads(bytes(self._buf[8 : 8 + header_length]).decode("utf-8"))
        payload = bytes(self._buf[8 + header_length : 4 + length])
        del self._buf[: 4 + length]
        assert isinstance(header, dict) and isinstance(header.get("type"), str), header
        declared = header.get("bulk")
        fd = None
        if declared is not None and "memfd" in declared:
            assert payload == b"", "a memfd frame with a payload"
            assert self._fds, "a memfd frame without a descriptor"
            fd = self._fds.pop(0)
        elif declared is not None:
            assert len(payload) == declared["inline"], (declared, len(payload))
        else:
            assert payload == b"", "an undeclared payload"
        return Received(header, payload, fd)

    def expect(self, kind: str) -> Received:
        frame = self.recv()
        if frame.type != kind:
            raise AssertionError(
                "expected `{}`, got {!r}; worker stderr:\n{}".format(kind, frame, self.stderr_text())
            )
        return frame

    # -- the conversation ----------------------------------------------------

    def welcome(self) -> Dict[str, Any]:
        """Reads the hello and welcomes the worker; returns the hello."""
        hello = self.expect("hello").header
        self.send({"type": "welcome", "version": 1})
        return hello

    def load(self, backend: str, options: Optional[Dict[str, str]] = None, name: str = "m") -> Received:
        """Sends a load and returns the answer (loaded or load_failed)."""
        self.send(
            {"type": "load", "name": name, "backend": backend, "model": None, "options": options or {}}
        )
        frame = self.recv()
        assert frame.type in ("loaded", "load_failed"), frame
        return frame

    def start(self, backend: str, options: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """Welcome and a successful load; returns the `loaded` header."""
        self.welcome()
        frame = self.load(backend, options)
        if frame.type != "loaded":
            raise AssertionError("load failed: {!r}\n{}".format(frame.header, self.stderr_text()))
        return frame.header

    def request(self, request_id: int, body: Any, payload: Optional[bytes] = None) -> None:
        header: Dict[str, Any] = {"type": "request", "id": request_id, "body": body}
        if payload is None:
            self.send(header)
        else:
            self.send(dict(header, bulk={"inline": len(payload)}), payload)

    def ping(self, seq: int) -> Dict[str, Any]:
        """Pings and returns the pong's stats (the next frame must be the pong)."""
        self.send({"type": "ping", "seq": seq})
        pong = self.expect("pong").header
        assert pong["seq"] == seq, pong
        return pong["stats"]

    # -- the process ---------------------------------------------------------

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.proc.wait(timeout)

    def stderr_text(self) -> str:
        return _written(self.stderr)

    def stdout_text(self) -> str:
        return _written(self.stdout)

    def close(self) -> None:
        """Kills the worker's whole process group and releases everything
        (once; later calls do nothing)."""
        if self.sock.fileno() == -1 and self.stderr.closed:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self.stderr.close()
        self.stdout.close()


def wait_gone(pid: int, timeout: float = 5.0) -> bool:
    """True once ``pid`` no longer exists (or is a zombie) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open("/proc/{}/stat".format(pid)) as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False
