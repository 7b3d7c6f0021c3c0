"""End to end: ``python3 -m berth_worker`` in a subprocess, driven by a fake
supervisor over a socketpair at descriptor 3.

Run all the Python tests from the repository root with:

    python3 -m unittest discover -s python/tests -v

with `berth_worker` installed (`pip install ./python`), or with
`PYTHONPATH=python` to test the source tree without installing it.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import signal
import tempfile
import time
import unittest

from fake_supervisor import SEALS, FakeSupervisor, wait_gone

MIB = 1 << 20


def without_run(header: dict) -> dict:
    """A ``done`` header without the batch it ran in and its compute time."""
    return {k: v for k, v in header.items() if k not in ("batch", "compute_us")}


class WorkerCase(unittest.TestCase):
    """Starts workers that are killed (whole group) after each test."""

    def setUp(self) -> None:
        self.sups = []

    def tearDown(self) -> None:
        for sup in self.sups:
            sup.close()

    def worker(self, **kwargs) -> FakeSupervisor:
        sup = FakeSupervisor(**kwargs)
        self.sups.append(sup)
        return sup

    def started(self, backend: str, options=None) -> FakeSupervisor:
        sup = self.worker()
        sup.start(backend, options)
        return sup

    def assert_error(self, frame, kind: str, *fragments: str) -> dict:
        self.assertEqual(frame.type, "done", frame)
        self.assertNotIn("body", frame.header)
        error = frame.header["error"]
        self.assertEqual(error["kind"], kind, error)
        for fragment in fragments:
            self.assertIn(fragment, error["message"])
        return error


class HandshakeTests(WorkerCase):
    def test_hello_then_load(self) -> None:
        sup = self.worker()
        hello = sup.welcome()
        self.assertEqual(hello["versions"], [1])
        self.assertEqual(hello["pid"], sup.proc.pid)
        self.assertEqual(hello["worker_version"], "0.1.0")
        self.assertEqual(hello["backends"], ["echo", "hog", "fault"])
        self.assertTrue(hello["runtime"].startswith("CPython 3."), hello["runtime"])
        loaded = sup.load("echo").header
        self.assertEqual(loaded["type"], "loaded")
        self.assertEqual(loaded["details"], {})
        self.assertIsInstance(loaded["load_micros"], int)
        self.assertGreaterEqual(loaded["load_micros"], 0)

    def test_refused_exits_1(self) -> None:
        sup = self.worker()
        sup.expect("hello")
        sup.send({"type": "refused", "reason": "the worker speaks wire versions 1; this supervisor speaks 2"})
        self.assertEqual(sup.wait(), 1)
        self.assertIn("this supervisor speaks 2", sup.stderr_text())

    def test_welcome_to_an_unknown_version_exits_1(self) -> None:
        sup = self.worker()
        sup.expect("hello")
        sup.send({"type": "welcome", "version": 9})
        self.assertEqual(sup.wait(), 1)
        self.assertIn("version 9", sup.stderr_text())

    def test_end_of_file_exits_at_once_even_while_working(self) -> None:
        sup = self.started("hog", {"work_ms": "30000"})
        sup.request(1, {})
        sup.ping(1)  # the request is queued or running
        sup.sock.close()
        started = time.monotonic()
        self.assertEqual(sup.wait(), 1)
        self.assertLess(time.monotonic() - started, 5)
        self.assertIn("closed the connection", sup.stderr_text())

    def test_malformed_frame_exits_1(self) -> None:
        sup = self.started("echo")
        sup.send_raw(b"\x05\x00\x00\x00\x02\x00\x00\x00{}")  # length 5 < 6
        self.assertEqual(sup.wait(), 1)
        self.assertIn("frame length 5", sup.stderr_text())

    def test_unknown_message_type_exits_1(self) -> None:
        sup = self.started("echo")
        sup.send({"type": "reload"})
        self.assertEqual(sup.wait(), 1)
        self.assertIn("reload", sup.stderr_text())

    def test_shutdown_exits_0(self) -> None:
        sup = self.started("echo")
        sup.send({"type": "shutdown"})
        self.assertEqual(sup.wait(), 0)

    def test_shutdown_stops_a_fork_pool(self) -> None:
        sup = self.worker()
        details = sup.start("hog", {"pool_processes": "2"})["details"]
        pids = details["pool_pids"]
        self.assertEqual(len(pids), 2, details)
        for pid in pids:
            self.assertTrue(os.path.exists("/proc/{}".format(pid)))
        sup.send({"type": "shutdown"})
        self.assertEqual(sup.wait(), 0)
        for pid in pids:
            self.assertTrue(wait_gone(pid), "pool process {} outlived the worker".format(pid))

    def test_pool_processes_do_not_hold_the_connection(self) -> None:
        sup = self.started("hog", {"pool_processes": "1", "work_ms": "30000"})
        os.kill(sup.proc.pid, signal.SIGKILL)  # the worker alone, not its pool
        sup.wait()
        with self.assertRaises(EOFError):
            sup.recv()

    def test_wrong_parent_exits_2(self) -> None:
        sup = self.worker(env={"BERTH_PARENT_PID": "1"})
        self.assertEqual(sup.wait(), 2)
        self.assertIn("supervisor (pid 1) is gone", sup.stderr_text())


class CommandLineTests(WorkerCase):
    def test_version(self) -> None:
        sup = self.worker(args=["-m", "berth_worker", "--version"])
        self.assertEqual(sup.wait(), 0)
        self.assertEqual(sup.stdout_text(), "berth_worker 0.1.0 (wire 1)\n")

    def test_backends(self) -> None:
        sup = self.worker(args=["-m", "berth_worker", "--backends"])
        self.assertEqual(sup.wait(), 0)
        lines = sup.stdout_text().splitlines()
        self.assertEqual([line.split(":")[0] for line in lines], ["echo", "hog", "fault"])
        # Each declares its options.
        self.assertEqual(lines[0], "echo: chunks, batch, stepping")

    def test_unknown_argument_exits_2(self) -> None:
        sup = self.worker(args=["-m", "berth_worker", "--serve"])
        self.assertEqual(sup.wait(), 2)
        self.assertIn("unknown argument `--serve`", sup.stderr_text())

    def test_missing_berth_fd_exits_2(self) -> None:
        sup = self.worker(berth_fd=None)
        self.assertEqual(sup.wait(), 2)
        self.assertIn("started by the berth supervisor", sup.stderr_text())


class LoadTests(WorkerCase):
    def test_request_before_load_is_not_loaded(self) -> None:
        sup = self.worker()
        sup.welcome()
        sup.request(1, {"x": 1})
        self.assert_error(sup.expect("done"), "not_loaded", "test-model", "before a successful load")
        self.assertEqual(sup.load("echo").type, "loaded")

    def test_unknown_option_names_it_and_the_known_ones(self) -> None:
        sup = self.worker()
        sup.welcome()
        failed = sup.load("hog", {"alloc_mb": "1"}, name="big")
        self.assertEqual(failed.type, "load_failed")
        error = failed.header["error"]
        self.assertEqual(error["kind"], "bad_request")
        self.assertIn("model `big`", error["message"])
        self.assertIn("`alloc_mb`", error["message"])
        self.assertIn("alloc_mib", error["message"])

    def test_bad_option_value(self) -> None:
        sup = self.worker()
        sup.welcome()
        error = sup.load("echo", {"chunks": "many"}).header["error"]
        self.assertEqual(error["kind"], "bad_request")
        self.assertIn("`chunks=many`", error["message"])

    def test_unknown_backend(self) -> None:
        sup = self.worker()
        sup.welcome()
        error = sup.load("llama").header["error"]
        self.assertEqual(error["kind"], "unknown_backend")
        self.assertIn("echo, hog, fault", error["message"])

    def test_unknown_fault_mode_lists_the_modes(self) -> None:
        sup = self.worker()
        sup.welcome()
        error = sup.load("fault", {"mode": "explode"}).header["error"]
        self.assertEqual(error["kind"], "load_failed")
        self.assertIn("`explode`", error["message"])
        self.assertIn("crash-on-request", error["message"])

    def test_second_load_is_internal(self) -> None:
        sup = self.started("echo")
        error = sup.load("echo").header["error"]
        self.assertEqual(error["kind"], "internal")

    def test_load_delay_advances_progress(self) -> None:
        sup = self.worker()
        sup.welcome()
        sup.send({"type": "load", "name": "m", "backend": "fault", "model": None,
                  "options": {"load_delay_ms": "400"}})
        time.sleep(0.1)
        sup.send({"type": "ping", "seq": 1})  # answered during the load
        got = {frame.type: frame.header for frame in (sup.recv(), sup.recv())}
        self.assertEqual(set(got), {"pong", "loaded"})
        self.assertGreaterEqual(got["loaded"]["load_micros"], 400_000)
        self.assertGreaterEqual(sup.ping(2)["progress"], 40)  # one per 10 ms step

    def test_hang_on_load_still_answers_pings(self) -> None:
        sup = self.worker()
        sup.welcome()
        sup.send({"type": "load", "name": "m", "backend": "fault", "model": None,
                  "options": {"mode": "hang-on-load"}})
        first = sup.ping(1)
        time.sleep(0.1)
        second = sup.ping(2)
        self.assertEqual(first["progress"], second["progress"])

    def test_crash_on_load(self) -> None:
        sup = self.worker()
        sup.welcome()
        sup.send({"type": "load", "name": "m", "backend": "fault", "model": None,
                  "options": {"mode": "crash-on-load"}})
        self.assertEqual(sup.wait(), -signal.SIGSEGV)

    def test_crash_on_load_if_exists(self) -> None:
        with tempfile.TemporaryDirectory() as scratch:
            marker = os.path.join(scratch, "broken")
            sup = self.started("fault", {"crash_on_load_if_exists": marker})
            sup.request(1, {"ok": True})
            self.assertEqual(sup.expect("done").header["body"], {"ok": True})
            open(marker, "w").close()
            again = self.worker()
            again.welcome()
            again.send({"type": "load", "name": "m", "backend": "fault", "model": None,
                        "options": {"crash_on_load_if_exists": marker}})
            self.assertEqual(again.wait(), -signal.SIGSEGV)
            self.assertIn("exists; crashing on load", again.stderr_text())

    def test_spawn_grandchild_is_in_the_workers_group(self) -> None:
        sup = self.worker()
        pid = sup.start("fault", {"spawn_grandchild": "true"})["details"]["grandchild_pid"]
        self.assertIsInstance(pid, int)
        self.assertEqual(os.getpgid(pid), sup.proc.pid)
        sup.close()  # kills the group, as the supervisor does
        self.assertTrue(wait_gone(pid), "the grandchild outlived its group")


class EchoTests(WorkerCase):
    def test_body(self) -> None:
        sup = self.started("echo")
        body = {"texts": ["hello", "héllo ✓"], "n": [1, 2.5, None, True]}
        sup.request(1, body)
        done = sup.expect("done")
        self.assertEqual(without_run(done.header), {"type": "done", "id": 1, "body": body})
        self.assertEqual(done.header["batch"], 1)
        self.assertGreaterEqual(done.header["compute_us"], 0)

    def test_inline_bulk(self) -> None:
        sup = self.started("echo")
        data = bytes(range(256)) * 100
        sup.request(7, {"k": "v"}, data)
        done = sup.expect("done")
        self.assertEqual(done.header["bulk"], {"inline": len(data)})
        self.assertEqual(done.bulk(), data)
        self.assertIsNone(done.fd)

    def test_64_mib_bulk_through_memfds(self) -> None:
        sup = self.started("echo")
        data = bytes(range(256)) * (256 * 1024)  # 64 MiB
        sup.send_with_memfd({"type": "request", "id": 2, "body": {"shape": [64, MIB]}}, data)
        done = sup.expect("done")
        self.assertEqual(done.header["body"], {"shape": [64, MIB]})
        self.assertEqual(done.header["bulk"], {"memfd": len(data)})
        self.assertEqual(fcntl.fcntl(done.fd, fcntl.F_GET_SEALS), SEALS)
        self.assertGreaterEqual(os.fstat(done.fd).st_size, len(data))
        with mmap.mmap(done.fd, len(data), prot=mmap.PROT_READ) as region:
            self.assertTrue(region[:] == data)
        os.close(done.fd)
        done.fd = None

    def test_chunks_then_done(self) -> None:
        sup = self.started("echo", {"chunks": "3"})
        sup.request(5, {"delta": "Hel"})
        for _ in range(3):
            self.assertEqual(sup.expect("chunk").header, {"type": "chunk", "id": 5, "body": {"delta": "Hel"}})
        self.assertEqual(sup.expect("done").header["body"], {"delta": "Hel"})

    def test_cancel_after_done_is_ignored(self) -> None:
        sup = self.started("echo")
        sup.request(1, "x")
        sup.expect("done")
        sup.send({"type": "cancel", "id": 1})
        sup.send({"type": "cancel", "id": 99})
        stats = sup.ping(3)
        self.assertEqual(stats["in_flight"], 0)
        self.assertEqual(stats["requests_done"], 1)


class HogTests(WorkerCase):
    def test_pings_answered_while_working(self) -> None:
        sup = self.started("hog", {"work_ms": "2000"})
        sup.request(1, {})
        first = sup.ping(1)
        self.assertEqual(first["in_flight"], 1)
        self.assertEqual(first["requests_done"], 0)
        time.sleep(0.3)
        second = sup.ping(2)
        self.assertGreater(second["progress"], first["progress"])
        for key in ("rss_bytes", "peak_rss_bytes"):
            self.assertGreater(second[key], 0)
        self.assertGreaterEqual(second["peak_rss_bytes"], second["rss_bytes"])
        done = sup.expect("done")
        self.assertEqual(without_run(done.header), {"type": "done", "id": 1, "body": {"held_bytes": 0}})
        # It worked ~2 s, and says so.
        self.assertGreater(done.header["compute_us"], 1_500_000)
        self.assertEqual(sup.ping(3)["requests_done"], 1)

    def test_the_socket_goes_back_and_forth_between_long_and_quick_requests(self) -> None:
        # A long request: the watch reads for the main thread (the pong
        # comes while it works); then the main thread is idle and reads
        # again. Each turn of the duty, several times over.
        sup = self.started("hog", {"work_ms": "100"})
        for round_ in range(4):
            request_id = 10 * round_ + 1
            sup.request(request_id, {})
            stats = sup.ping(request_id)
            self.assertEqual(stats["in_flight"], 1)
            self.assertEqual(sup.expect("done").header["id"], request_id)
            self.assertEqual(sup.ping(request_id + 1)["in_flight"], 0)
            # Idle again: three quick frames in a row, each answered in turn.
            sup.send({"type": "cancel", "id": 999})
            self.assertEqual(sup.ping(request_id + 2)["requests_done"], round_ + 1)

    def test_cancel_while_working_gives_one_done(self) -> None:
        sup = self.started("hog", {"work_ms": "30000"})
        sup.request(1, {})
        sup.ping(1)
        started = time.monotonic()
        sup.send({"type": "cancel", "id": 1})
        self.assert_error(sup.expect("done"), "cancelled", "while working")
        self.assertLess(time.monotonic() - started, 5)
        # Exactly one done: the next frame is the pong.
        self.assertEqual(sup.ping(2)["in_flight"], 0)

    def test_cancel_before_start(self) -> None:
        sup = self.started("hog", {"work_ms": "500"})
        sup.request(1, {})
        sup.request(2, {})
        sup.send({"type": "cancel", "id": 2})
        first = sup.expect("done")
        self.assertEqual(first.header["id"], 1)
        self.assertIn("body", first.header)
        second = sup.expect("done")
        self.assertEqual(second.header["id"], 2)
        self.assert_error(second, "cancelled", "before it started")
        self.assertEqual(sup.ping(3)["requests_done"], 2)

    def test_memory_is_resident_and_leaks_grow(self) -> None:
        sup = self.started("hog", {"alloc_mib": "64", "leak_kib_per_request": "1024"})
        self.assertGreaterEqual(sup.ping(1)["rss_bytes"], 64 * MIB)
        for i, expected in ((1, 65 * MIB), (2, 66 * MIB)):
            sup.request(i, {})
            self.assertEqual(sup.expect("done").header["body"], {"held_bytes": expected})


class FaultTests(WorkerCase):
    def test_crash_on_request_is_a_real_sigsegv(self) -> None:
        sup = self.started("fault", {"mode": "crash-on-request"})
        sup.request(1, {})
        self.assertEqual(sup.wait(), -signal.SIGSEGV)
        self.assertIn("fault: raising SIGSEGV as asked", sup.stderr_text())

    def test_abort_on_request(self) -> None:
        sup = self.started("fault", {"mode": "abort-on-request"})
        sup.request(1, {})
        self.assertEqual(sup.wait(), -signal.SIGABRT)

    def test_exit_on_request(self) -> None:
        sup = self.started("fault", {"mode": "exit-on-request", "exit_code": "7"})
        sup.request(1, {})
        self.assertEqual(sup.wait(), 7)
        self.assertIn("exiting with status 7", sup.stderr_text())

    def test_poison_input(self) -> None:
        sup = self.started("fault", {"crash_on": "poison"})
        sup.request(1, {"text": "fine"})
        self.assertEqual(sup.expect("done").header["body"], {"text": "fine"})
        sup.request(2, {"text": "a poison pill"})
        self.assertEqual(sup.wait(), -signal.SIGSEGV)

    def test_hang_on_request_answers_pings_without_progress(self) -> None:
        sup = self.started("fault", {"mode": "hang-on-request"})
        sup.request(1, {})
        first = sup.ping(1)
        time.sleep(0.1)
        second = sup.ping(2)
        self.assertEqual(second["in_flight"], 1)
        self.assertEqual(first["progress"], second["progress"])

    def test_ignore_shutdown_needs_sigkill(self) -> None:
        sup = self.started("fault", {"mode": "ignore-shutdown"})
        sup.send({"type": "shutdown"})
        os.kill(sup.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while "ignoring the shutdown" not in sup.stderr_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.assertIn("ignoring the shutdown", sup.stderr_text())
        time.sleep(0.2)
        self.assertIsNone(sup.proc.poll())
        os.kill(sup.proc.pid, signal.SIGKILL)
        self.assertEqual(sup.wait(), -signal.SIGKILL)

    def test_stderr_flood_is_one_line(self) -> None:
        sup = self.started("fault", {"stderr_bytes": "100000"})
        sup.request(1, {"a": 1})
        self.assertEqual(sup.expect("done").header["body"], {"a": 1})
        self.assertIn("x" * 100000 + "\n", sup.stderr_text())

    def test_response_bytes(self) -> None:
        sup = self.started("fault", {"response_bytes": "200000"})
        sup.request(1, {})
        body = sup.expect("done").header["body"]
        self.assertEqual(set(body), {"pad"})
        self.assertAlmostEqual(len(body["pad"]), 200000, delta=16)


if __name__ == "__main__":
    unittest.main()
