"""The backend API: options, errors, contexts in process, and a worker with
backends of its own (custom_worker.py) end to end.

Run: python3 -m unittest discover -s python/tests -v  (see test_worker.py)
"""

from __future__ import annotations

import os
import signal
import time
import unittest

import numpy

import berth_worker
from berth_worker import (
    BadRequest,
    LoadContext,
    LoadSpec,
    Options,
    Request,
    RequestContext,
    Response,
    WireError,
)
from berth_worker.backends import Echo, Fault, Hog

from fake_supervisor import TESTS_DIR, FakeSupervisor


def spec(**options: str) -> LoadSpec:
    return LoadSpec("mini", "tensors", None, options)


class OptionsTests(unittest.TestCase):
    def test_only_names_the_model_the_unknown_and_the_known(self) -> None:
        with self.assertRaises(WireError) as caught:
            Options(spec(sacle="2", verbose="true")).only(["scale", "verbose"])
        error = caught.exception
        self.assertEqual(error.kind, "bad_request")
        self.assertEqual(
            error.message,
            "model `mini`: backend `tensors` has no option `sacle` (it takes: scale, verbose)",
        )
        with self.assertRaisesRegex(WireError, "it takes: none"):
            Options(spec(x="1")).only([])
        Options(spec(scale="2")).only(["scale"])

    def test_typed_getters(self) -> None:
        opts = Options(spec(n=" 12 ", f="2.5", yes="true", no="false", s="text"))
        self.assertEqual(opts.int("n", 0), 12)
        self.assertEqual(opts.int("missing", 7), 7)
        self.assertEqual(opts.float("f", 0.0), 2.5)
        self.assertIs(opts.bool("yes", False), True)
        self.assertIs(opts.bool("no", True), False)
        self.assertIs(opts.bool("missing", True), True)
        self.assertEqual(opts.str("s"), "text")
        self.assertIsNone(opts.str("missing"))
        self.assertEqual(opts.str("missing", "d"), "d")

    def test_getter_errors_name_the_model_and_the_option(self) -> None:
        opts = Options(spec(n="ten", f="fast", b="yes", neg="-1", inf="inf"))
        cases = [
            (lambda: opts.int("n", 0), "option `n=ten` is not a valid integer"),
            (lambda: opts.float("f", 0.0), "option `f=fast` is not a valid number"),
            (lambda: opts.float("inf", 0.0), "option `inf=inf` is not a valid finite number"),
            (lambda: opts.bool("b", False), "option `b=yes` is not a valid bool"),
            (lambda: opts.int("neg", 0, minimum=0), "option `neg=-1` must be at least 0"),
        ]
        for call, fragment in cases:
            with self.assertRaises(BadRequest) as caught:
                call()
            self.assertIn("model `mini`", caught.exception.message)
            self.assertIn(fragment, caught.exception.message)


class ErrorTests(unittest.TestCase):
    def test_kinds(self) -> None:
        self.assertEqual(
            berth_worker.KINDS,
            ("bad_request", "unknown_backend", "load_failed", "not_loaded", "cancelled",
             "input_too_large", "backend_error", "internal"),
        )
        self.assertEqual(WireError(WireError.CANCELLED, "x").to_wire(), {"kind": "cancelled", "message": "x"})
        self.assertEqual(berth_worker.InputTooLarge("big").kind, "input_too_large")
        self.assertEqual(berth_worker.BackendError("b").kind, "backend_error")
        self.assertIsInstance(BadRequest("x"), WireError)

    def test_unknown_kind_is_refused_when_made(self) -> None:
        with self.assertRaisesRegex(ValueError, "not one of the wire's kinds"):
            WireError("oops", "x")

    def test_lone_surrogates_stay_sendable(self) -> None:
        error = WireError("internal", "bad \udcff byte")
        error.message.encode("utf-8")


class InProcessTests(unittest.TestCase):
    def test_echo_with_chunks(self) -> None:
        echo = Echo()
        echo.load(LoadSpec("e", "echo", None, {"chunks": "2"}), LoadContext.standalone())
        ctx = RequestContext.standalone()
        self.assertEqual(echo.handle(Request(1, {"a": 1}), ctx), {"a": 1})
        self.assertEqual(ctx.take_chunks(), [({"a": 1}, None), ({"a": 1}, None)])
        out = echo.handle(Request(2, None, memoryview(b"xyz")), ctx)
        self.assertIsInstance(out, Response)
        self.assertEqual(bytes(out.bulk), b"xyz")

    def test_hog_touches_and_reports(self) -> None:
        hog = Hog()
        ctx = LoadContext.standalone()
        hog.load(LoadSpec("h", "hog", None, {"alloc_mib": "32", "leak_kib_per_request": "4"}), ctx)
        self.assertGreater(ctx.progress_value, 0)
        self.assertEqual(hog.describe(), {"held_bytes": 32 << 20, "leak_bytes_per_request": 4096, "pool_pids": []})
        block = hog.held[0]
        self.assertEqual(block.count(1), (32 << 20) // 4096)
        self.assertEqual(hog.handle(Request(1, {}), RequestContext.standalone()), {"held_bytes": (32 << 20) + 4096})

    def test_fault_ok_mode_echoes(self) -> None:
        fault = Fault()
        fault.load(LoadSpec("f", "fault", None, {}), LoadContext.standalone())
        self.assertEqual(fault.handle(Request(1, [1, 2]), RequestContext.standalone()), [1, 2])
        self.assertEqual(fault.describe(), {"grandchild_pid": None})

    def test_chunk_after_finish_is_refused(self) -> None:
        ctx = RequestContext.standalone()
        ctx.finish()
        with self.assertRaisesRegex(WireError, "after its answer was sent"):
            ctx.chunk({"late": True})

    def test_gpus_from_the_environment(self) -> None:
        saved = os.environ.get("BERTH_GPUS")
        try:
            os.environ["BERTH_GPUS"] = "2, 5"
            self.assertEqual(LoadContext.standalone().gpus, [2, 5])
            del os.environ["BERTH_GPUS"]
            self.assertEqual(LoadContext.standalone().gpus, [])
        finally:
            if saved is not None:
                os.environ["BERTH_GPUS"] = saved


class GatherTests(unittest.TestCase):
    """How a batch is gathered, on the worker's own queue (no process)."""

    class Costly(berth_worker.Backend):
        def handle(self, request, ctx):
            return request.body

        def cost(self, request) -> int:
            return 1

    def worker(self, pace) -> "berth_worker.worker.Worker":
        from berth_worker.worker import Worker

        w = Worker({}, conn=None, model_name="m")  # type: ignore[arg-type]
        w.backend = self.Costly()
        w.pace = pace
        return w

    @staticmethod
    def frame(request_id: int):
        from berth_worker.wire import Frame

        return Frame({"type": "request", "id": request_id, "body": {}}, None)

    def test_an_idle_worker_takes_what_waits_and_never_waits(self) -> None:
        w = self.worker((1, 1.0, 5))
        w.jobs.put(self.frame(2))
        batch = [self.frame(1)]
        started = time.monotonic()
        w._gather(berth_worker.Batching(8), batch)
        self.assertEqual([f.header["id"] for f in batch], [1, 2])
        self.assertLess(time.monotonic() - started, 0.5)

    def test_a_busy_worker_waits_for_every_request_that_was_outstanding(self) -> None:
        from berth_worker.worker import MAX_LINGER

        # The last batch answered two while one more waited: three clients.
        # Two are here, as many as the last batch held; it still waits for
        # the third client's, at most MAX_LINGER.
        w = self.worker((2, 1.0, 1))
        w.jobs.put(self.frame(2))
        batch = [self.frame(1)]
        started = time.monotonic()
        w._gather(berth_worker.Batching(8), batch)
        self.assertEqual([f.header["id"] for f in batch], [1, 2])
        self.assertGreaterEqual(time.monotonic() - started, MAX_LINGER)
        # One that comes in time joins.
        w.jobs.put(self.frame(4))
        batch = [self.frame(3)]
        w._gather(berth_worker.Batching(8), batch)
        self.assertEqual([f.header["id"] for f in batch], [3, 4])


class CustomWorkerTests(unittest.TestCase):
    """A worker written against the package, served end to end."""

    def setUp(self) -> None:
        self.sups = []

    def tearDown(self) -> None:
        for sup in self.sups:
            sup.close()

    def worker(self, env=None) -> FakeSupervisor:
        sup = FakeSupervisor(args=[os.path.join(TESTS_DIR, "custom_worker.py")], env=env)
        self.sups.append(sup)
        return sup

    def tensors(self, **options: str) -> FakeSupervisor:
        sup = self.worker(env={"BERTH_GPUS": "1,3"})
        sup.start("tensors", options)
        return sup

    def call(self, sup: FakeSupervisor, request_id: int, body, payload=None):
        sup.request(request_id, body, payload)
        return sup.expect("done")

    def test_hello_lists_backends_in_the_given_order(self) -> None:
        hello = self.worker().welcome()
        self.assertEqual(
            hello["backends"], ["tensors", "batcher", "broken", "bad-describe", "no-handle"]
        )

    def test_requests_waiting_during_a_batch_run_together_each_answered_alone(self) -> None:
        sup = self.worker()
        sup.welcome()
        self.assertEqual(sup.load("batcher").header["max_batch"], 4)
        # The first runs alone (nothing waits: no waiting for company) and
        # holds the worker while the rest arrive.
        sup.request(1, {"text": "a", "sleep": 0.5})
        time.sleep(0.2)
        for i, text in enumerate(["b", "cc", "ddd", "x", "eeee"], start=2):
            sup.request(i, {"text": text})
        sup.request(7, {"text": "f", "bad": True})
        sup.request(8, {"text": "g"})
        done = {}
        for _ in range(8):
            frame = sup.expect("done")
            done[frame.header["id"]] = frame.header
        self.assertEqual(done[1]["batch"], 1)
        self.assertGreater(done[1]["compute_us"], 400_000)
        # Then at most 4 together, within the 10-character budget, in order.
        self.assertEqual([done[i]["batch"] for i in (2, 3, 4, 5)], [4, 4, 4, 4])
        for i, text in [(2, "B"), (3, "CC"), (4, "DDD"), (5, "X"), (6, "EEEE")]:
            self.assertEqual(done[i]["body"]["text"], text)
            self.assertEqual(done[i]["body"]["id"], i)
        # "eeee" would pass the budget with the first four: next batch.
        self.assertEqual(done[6]["batch"], 3)
        self.assertEqual(done[7]["error"]["kind"], "bad_request")
        self.assertIn("request 7", done[7]["error"]["message"])
        self.assertEqual(done[8]["body"]["text"], "G")

    def test_a_batch_that_raises_fails_its_requests_and_the_worker_goes_on(self) -> None:
        sup = self.worker()
        sup.welcome()
        sup.load("batcher")
        sup.request(1, {"text": "a", "sleep": 0.3})
        time.sleep(0.1)
        sup.request(2, {"text": "b", "crash_batch": True})
        sup.request(3, {"text": "c"})
        frames = [sup.expect("done") for _ in range(3)]
        by_id = {f.header["id"]: f.header for f in frames}
        self.assertEqual(by_id[1]["body"]["text"], "A")
        for i in (2, 3):
            self.assertEqual(by_id[i]["error"]["kind"], "backend_error")
            self.assertIn("the whole batch broke", by_id[i]["error"]["message"])
        sup.request(4, {"text": "d"})
        self.assertEqual(sup.expect("done").header["body"]["text"], "D")

    def test_describe_goes_into_loaded_details(self) -> None:
        sup = self.worker(env={"BERTH_GPUS": "1,3"})
        sup.welcome()
        loaded = sup.load("tensors", {"scale": "0.5", "verbose": "true"}, name="mini").header
        self.assertEqual(
            loaded["details"],
            {"scale": 0.5, "verbose": True, "label": "none", "gpus": [1, 3], "name": "mini"},
        )

    def test_memfd_bulk_reaches_numpy_without_a_copy(self) -> None:
        sup = self.tensors()
        values = numpy.arange(1 << 20, dtype=numpy.float32)
        sup.send_with_memfd({"type": "request", "id": 1, "body": {"op": "sum"}}, values.tobytes())
        body = sup.expect("done").header["body"]
        self.assertEqual(body, {"sum": float(values.sum()), "zero_copy": True, "readonly": True})

    def test_numpy_response_comes_back_as_bulk(self) -> None:
        sup = self.tensors(scale="2")
        done = self.call(sup, 1, {"op": "arange", "n": 100000})
        self.assertEqual(done.header["body"], {"dtype": "float32", "shape": [100000]})
        self.assertEqual(done.header["bulk"], {"memfd": 400000})
        got = numpy.frombuffer(done.bulk(), dtype=numpy.float32)
        self.assertTrue(numpy.array_equal(got, numpy.arange(100000, dtype=numpy.float32) * 2))

    def test_chunks_with_bulk(self) -> None:
        sup = self.tensors()
        sup.request(1, {"op": "chunk_bulk"})
        first = sup.expect("chunk")
        self.assertEqual(first.header["bulk"], {"inline": 2})
        self.assertEqual(first.bulk(), b"\x01\x02")
        second = sup.expect("chunk")
        self.assertEqual(second.header["bulk"], {"memfd": 160000})
        self.assertEqual(second.bulk(), numpy.ones(40000, dtype=numpy.float32).tobytes())
        self.assertEqual(sup.expect("done").header["body"], {"parts": 2})

    def test_a_failing_request_fails_alone(self) -> None:
        sup = self.tensors()
        error = self.call(sup, 1, {"op": "raise"}).header["error"]
        self.assertEqual(error["kind"], "backend_error")
        self.assertIn("model `m`", error["message"])
        self.assertIn("KeyError: 'no such thing'", error["message"])
        self.assertIn("Traceback", sup.stderr_text())
        self.assertEqual(self.call(sup, 2, {"op": "echo", "x": 1}).header["body"], {"op": "echo", "x": 1})

    def test_wire_errors_keep_their_kind(self) -> None:
        sup = self.tensors()
        for request_id, op, kind in ((1, "bad_request", "bad_request"), (2, "too_large", "input_too_large")):
            error = self.call(sup, request_id, {"op": op}).header["error"]
            self.assertEqual(error["kind"], kind)

    def test_answers_json_cannot_carry(self) -> None:
        sup = self.tensors()
        for request_id, op in ((1, "nan"), (2, "not_json")):
            error = self.call(sup, request_id, {"op": op}).header["error"]
            self.assertEqual(error["kind"], "backend_error")
            self.assertIn("cannot be sent", error["message"])
        self.assertEqual(sup.ping(1)["requests_done"], 2)

    def test_a_chunk_after_done_is_refused(self) -> None:
        sup = self.tensors()
        self.assertEqual(self.call(sup, 1, {"op": "keep_ctx"}).header["body"], "kept")
        error = self.call(sup, 2, {"op": "late_chunk"}).header["error"]
        self.assertEqual(error["kind"], "internal")
        self.assertIn("request 1 after its answer was sent", error["message"])

    def test_sys_exit_in_a_backend_exits_with_its_code(self) -> None:
        sup = self.tensors()
        sup.request(1, {"op": "exit", "code": 4})
        self.assertEqual(sup.wait(), 4)

    def test_load_exception_is_load_failed(self) -> None:
        sup = self.worker()
        sup.welcome()
        sup.send({"type": "load", "name": "m", "backend": "broken", "model": "/w.safetensors", "options": {}})
        error = sup.expect("load_failed").header["error"]
        self.assertEqual(error["kind"], "load_failed")
        self.assertIn("model `m`", error["message"])
        self.assertIn("RuntimeError: weights file /w.safetensors is truncated", error["message"])

    def test_describe_that_is_not_json_fails_the_load(self) -> None:
        sup = self.worker()
        sup.welcome()
        error = sup.load("bad-describe").header["error"]
        self.assertEqual(error["kind"], "load_failed")
        self.assertIn("describe() must return JSON", error["message"])

    def test_default_load_refuses_options_and_missing_handle_fails_the_request(self) -> None:
        sup = self.worker()
        sup.welcome()
        self.assertEqual(sup.load("no-handle", {"x": "1"}).header["error"]["kind"], "bad_request")
        other = self.worker()
        other.start("no-handle")
        error = self.call(other, 1, {}).header["error"]
        self.assertEqual(error["kind"], "backend_error")
        self.assertIn("does not implement handle()", error["message"])

    def test_sigterm_ends_a_worker(self) -> None:
        sup = self.tensors()
        os.kill(sup.proc.pid, signal.SIGTERM)
        self.assertEqual(sup.wait(), -signal.SIGTERM)


if __name__ == "__main__":
    unittest.main()
