"""The preloader (preloader.py): workers forked from a preloaded interpreter,
driven end to end through the real interpreter, this process standing in
for the supervisor (a child subreaper, as berth serve is)."""

from __future__ import annotations

import array
import ctypes
import json
import os
import signal
import socket
import struct
import tempfile
import time
import unittest
from typing import Any, Dict, List, Optional, Tuple

from fake_supervisor import PACKAGE_ROOT, TESTS_DIR, TIMEOUT, FakeSupervisor, _written

_PR_SET_CHILD_SUBREAPER = 36


def _subreaper(on: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, ctypes.c_ulong(1 if on else 0), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _frame(header: Dict[str, Any]) -> bytes:
    head = json.dumps(header).encode("utf-8")
    return struct.pack("<II", 4 + len(head), len(head)) + head


class _Process:
    """A forked worker, our child once re-parented: enough of Popen's face
    for FakeSupervisor."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.status = None

    def poll(self):
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = status
        return self.status

    def wait(self, timeout: float = TIMEOUT):
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("worker {} did not exit".format(self.pid))
            time.sleep(0.01)
        return self.status


class PreloadTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        _subreaper(True)

    @classmethod
    def tearDownClass(cls) -> None:
        _subreaper(False)

    def setUp(self) -> None:
        self.sups: List[FakeSupervisor] = []

    def tearDown(self) -> None:
        for sup in self.sups:
            sup.close()

    def preloader(self, modules: List[str]) -> FakeSupervisor:
        env = {
            "BERTH_PRELOAD": json.dumps(modules),
            "PYTHONPATH": PACKAGE_ROOT + os.pathsep + TESTS_DIR,
            "BERTH_WORKER_MARK": "preloader-mark-0",
            "BERTH_ENV_SPACE": " " * 8192,
        }
        sup = FakeSupervisor(env=env)
        self.sups.append(sup)
        return sup

    def fork(
        self,
        preloader: FakeSupervisor,
        request_id: int,
        model: str,
        extra: Optional[Dict[str, str]] = None,
    ) -> Tuple[FakeSupervisor, Dict[str, Any]]:
        """Asks for a worker; returns it, spoken to like a cold one."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        env = {
            "BERTH_MODEL": model,
            "BERTH_PARENT_PID": str(os.getpid()),
            "PYTHONPATH": PACKAGE_ROOT,
            "BERTH_WORKER_MARK": "worker-mark-{:04}".format(request_id),
        }
        env.update(extra or {})
        frame = _frame({"type": "fork", "id": request_id, "env": env, "cwd": "/", "cgroup_procs": None})
        fds = array.array("i", [theirs.fileno(), out.fileno(), err.fileno()])
        preloader.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        theirs.close()
        answer = preloader.expect("forked").header
        self.assertEqual(answer["id"], request_id)
        worker = FakeSupervisor.__new__(FakeSupervisor)
        worker.proc = _Process(answer["pid"])  # type: ignore[assignment]
        worker.sock = ours
        worker.sock.settimeout(TIMEOUT)
        worker.stderr, worker.stdout = err, out
        worker._buf = bytearray()
        worker._fds = []
        self.sups.append(worker)
        return worker, answer

    def test_forked_workers_serve_each_in_its_own_session_environment_and_folder(self) -> None:
        preloader = self.preloader(["json", "berth_worker.backends.echo"])
        ready = preloader.expect("preloaded").header
        self.assertEqual(ready["modules"], ["json", "berth_worker.backends.echo"])
        self.assertEqual(ready["pid"], preloader.proc.pid)
        control = os.readlink("/proc/{}/fd/3".format(preloader.proc.pid))
        for n in (1, 2):
            worker, answer = self.fork(preloader, n, "forked-{}".format(n))
            pid = answer["pid"]
            worker.welcome()
            # Its name comes from the environment the fork gave it.
            worker.request(1, {"n": n})
            self.assert_named(worker.expect("done"), "forked-{}".format(n))
            self.assertEqual(worker.load("echo").type, "loaded")
            worker.request(1, {"n": n})
            self.assertEqual(worker.expect("done").header["body"], {"n": n})
            # The supervisor's child, leading its own session and group.
            with open("/proc/{}/stat".format(pid)) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            self.assertEqual(ppid, os.getpid())
            self.assertEqual(os.getsid(pid), pid)
            self.assertEqual(os.getpgid(pid), pid)
            # Its mark, where berth reads it (the initial environment
            # block), and its environment as its own code sees it.
            with open("/proc/{}/environ".format(pid), "rb") as f:
                environ = dict(
                    item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item
                )
            self.assertEqual(environ[b"BERTH_WORKER_MARK"], "worker-mark-{:04}".format(n).encode())
            self.assertEqual(environ[b"BERTH_MODEL"], "forked-{}".format(n).encode())
            self.assertNotIn(b"BERTH_PRELOAD", environ)
            self.assertEqual(os.readlink("/proc/{}/cwd".format(pid)), "/")
            # Nothing of the preloader's: not its control socket, not any
            # descriptor beyond the worker's own (or /dev/null in its place).
            links = {}
            for name in os.listdir("/proc/{}/fd".format(pid)):
                try:
                    links[int(name)] = os.readlink("/proc/{}/fd/{}".format(pid, name))
                except OSError:
                    continue
            self.assertNotIn(control, links.values())
            self.assertTrue(links[3].startswith("socket:"), links)
            for fd, target in links.items():
                if fd > 3:
                    self.assertFalse(target.startswith("socket:"), links)
            # Its output is its own.
            worker.send({"type": "shutdown"})
            status = worker.proc.wait()
            self.assertTrue(os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status)
            self.assertIn("shutting down", worker.stderr_text())
            self.assertNotIn("shutting down", preloader.stderr_text())
        # The preloader is still there, ready for more.
        self.assertIsNone(preloader.proc.poll())

    def assert_named(self, frame, model: str) -> None:
        self.assertEqual(frame.header["error"]["kind"], "not_loaded", frame)
        self.assertIn("model `{}`".format(model), frame.header["error"]["message"])

    def test_without_room_in_the_environment_block_the_mark_alone_is_rewritten(self) -> None:
        sup = FakeSupervisor(env={
            "BERTH_PRELOAD": json.dumps(["json"]),
            "PYTHONPATH": PACKAGE_ROOT,
            "BERTH_WORKER_MARK": "preloader-mark-0",
        })
        self.sups.append(sup)
        sup.expect("preloaded")
        worker, answer = self.fork(sup, 3, "m", {"BERTH_TEST_BIG": "x" * 30_000})
        worker.welcome()
        with open("/proc/{}/environ".format(answer["pid"]), "rb") as f:
            raw = f.read()
        self.assertIn(b"BERTH_WORKER_MARK=worker-mark-0003\0", raw)
        self.assertIn("does not fit", worker.stderr_text())

    def test_a_killed_forked_worker_is_reaped_with_its_signal(self) -> None:
        preloader = self.preloader(["json"])
        preloader.expect("preloaded")
        worker, answer = self.fork(preloader, 7, "m")
        worker.welcome()
        os.kill(answer["pid"], signal.SIGKILL)
        status = worker.proc.wait()
        self.assertTrue(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status)

    def test_a_preload_that_starts_a_thread_is_refused_naming_the_module(self) -> None:
        preloader = self.preloader(["json", "preload_starts_a_thread"])
        refused = preloader.expect("refused").header
        self.assertEqual(refused["module"], "preload_starts_a_thread")
        self.assertIn("threads are running", refused["reason"])
        self.assertIn("started-on-import", refused["reason"])
        self.assertEqual(preloader.wait(), 3)
        self.assertIn("preload refused", preloader.stderr_text())

    def test_a_module_that_cannot_be_imported_is_refused(self) -> None:
        preloader = self.preloader(["json", "no_such_module_anywhere"])
        refused = preloader.expect("refused").header
        self.assertEqual(refused["module"], "no_such_module_anywhere")
        self.assertIn("ModuleNotFoundError", refused["reason"])
        self.assertEqual(preloader.wait(), 3)

    def test_a_fork_without_its_three_descriptors_fails_and_the_preloader_goes_on(self) -> None:
        preloader = self.preloader(["json"])
        preloader.expect("preloaded")
        preloader.send({"type": "fork", "id": 1, "env": {}, "cwd": None, "cgroup_procs": None})
        failed = preloader.expect("fork_failed").header
        self.assertEqual(failed["id"], 1)
        self.assertIn("takes 3", failed["reason"])
        worker, _ = self.fork(preloader, 2, "m")
        worker.start("echo")


if __name__ == "__main__":
    unittest.main()
