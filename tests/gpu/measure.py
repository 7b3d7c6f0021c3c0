"""Re-measures what `docs/gpu.md` says, on a GPU machine, in one call:
berth's binaries built elsewhere (`tests/gpu/prepare.sh`), the machine's own
PyTorch, JAX and Equinox, weights made here with the shapes of real ones,
no network. Prints, section by section, the tables for `docs/gpu.md`.

    python3 tests/gpu/measure.py --carry target/gpu-carry
    python3 tests/gpu/measure.py --carry target/gpu-carry --only budget,candle

Sections (each beside its baseline, measured in the same run):

- `unload`: a 4 GiB `gpu-hog` loaded and unloaded through berth, against a
  bare process holding as much killed with SIGKILL (the device's own
  floor), in alternating rounds;
- `bench`: what `cargo bench --bench gpu` measures (in one process: 4 GiB
  kept in a pool, then freed with the context alive; berth's unload; 50
  load/unload cycles of 512 MiB);
- `torch`, `jax`: the status quo in one process (load, work, drop as the
  framework advises) beside the same model through berth, BERT-large in
  PyTorch and the 24-block `eqx_stack` in JAX;
- `sharing`: JAX models with a declared share on one card; both on the
  GPU (no `gpu_unused` warning, `jax.devices()` a GPU);
- `seed003`: `init = "vmap"` in a 1 GiB share fails its load as
  `gpu_out_of_memory` while a neighbour answers; `init = "blocks"` loads;
- `warm`: cold and forked loads of BERT-large;
- `budget`: three 20 GiB models under a 48 GiB per-GPU budget;
- `candle`: the CUDA worker's loads, first and second requests, how its
  kernels were loaded, and cosines against the CPU and PyTorch;
- `compare`: `generate`'s logits on CUDA against the CPU's on the cut GGUF;
- `throughput`: `/v1/embeddings` through `berth serve` against the backend
  in one process, at 1 and 32 texts, 1 and 8 clients, alternating rounds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

import devices  # noqa: E402

MIB = 1 << 20
TEXTS = ["sentence {} of the GPU workload, about ships, ports and the sea".format(i) for i in range(64)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Berth:
    """`berth serve` with a config of its own, spoken to over HTTP."""

    def __init__(self, binary: str, config: str, env: Dict[str, str], log: str) -> None:
        self.port = free_port()
        path = tempfile.mktemp(suffix=".toml", dir=os.path.dirname(log))
        with open(path, "w") as f:
            f.write(config)
        self.log = open(log, "a")
        self.proc = subprocess.Popen(
            [binary, "serve", "--config", path, "--listen", "127.0.0.1:{}".format(self.port)],
            env=env, stdout=self.log, stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.call("GET", "/healthz")[0] == 200:
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("berth serve exited with {} (log: {})".format(self.proc.returncode, log))
            time.sleep(0.1)
        raise RuntimeError("berth serve did not come up (log: {})".format(log))

    def call(self, method: str, path: str, body: Any = None, timeout: float = 300) -> Tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            raw = r.read()
            try:
                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw.decode(errors="replace")
        finally:
            conn.close()

    def load(self, model: str) -> Dict[str, Any]:
        status, report = self.call("POST", "/api/models/{}/load".format(model), {})
        if status != 200:
            raise RuntimeError("load {}: {} {}".format(model, status, report))
        return report

    def unload(self, model: str) -> Dict[str, Any]:
        status, report = self.call("POST", "/api/models/{}/unload".format(model), {})
        if status != 200:
            raise RuntimeError("unload {}: {} {}".format(model, status, report))
        return report

    def infer(self, model: str, body: Any) -> Tuple[int, Any]:
        return self.call("POST", "/api/models/{}/infer".format(model), body)

    def ps(self) -> List[Dict[str, Any]]:
        return self.call("GET", "/api/ps")[1]["models"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def table(header: List[str], rows: List[List[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return "{:.1f}".format(v)
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def mib(b: Optional[float]) -> str:
    return "-" if b is None else "{:.0f} MiB".format(b / MIB)


def spread(values: List[float], unit: str = "ms") -> str:
    if not values:
        return "-"
    return "{:.0f}–{:.0f} {}".format(min(values), max(values), unit)


class Run:
    """Everything a section needs: paths, the machine's python, settings."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.carry = os.path.abspath(args.carry)
        self.berth = os.path.join(self.carry, "berth")
        self.cuda_worker = os.path.join(self.carry, "berth-worker-cuda")
        self.work = args.work
        os.makedirs(self.work, exist_ok=True)
        # Absolute: workers start in python/examples.
        self.python = os.path.abspath(args.python) if os.sep in args.python else args.python
        self.fake = args.fake
        self.nvml = devices.Nvml()
        self.libs = devices.nvidia_lib_dirs(self.python)
        self.env = dict(os.environ)
        self.env["BERTH_LOG"] = "info"
        self.pythonpath = "{}:{}:{}".format(os.path.join(REPO, "python"), os.path.join(REPO, "python", "examples"), HERE)
        self.tokenizer = os.path.join(self.carry, "models", "minilm-tokenizer.json")
        self.gguf = os.path.join(self.carry, "models", "smollm2-cut.gguf")
        self.device = "cpu" if self.fake else "cuda"

    def torch_options(self) -> str:
        """PyTorch on the GPU berth placed it on; with `--fake`, the CPU."""
        return '{ device = "cpu" }' if self.fake else "{ }"

    def log(self, name: str) -> str:
        return os.path.join(self.work, name + ".log")

    def model_dir(self, shape: str) -> str:
        """The folder of a model of `shape`, made by the machine's python
        (numpy) the first time."""
        dest = os.path.join(self.work, shape)
        subprocess.run([self.python, os.path.join(HERE, "weights.py"), shape, dest, self.tokenizer],
                       check=True, capture_output=True, timeout=300)
        return dest

    def kinds(self) -> str:
        examples = 'command = ["{py}", "-m", "berth_examples"]\ncwd = "{cwd}"\nenv = {{ OMP_WAIT_POLICY = "PASSIVE", PYTHONPATH = "{pp}" }}\n'.format(
            py=self.python, cwd=os.path.join(REPO, "python", "examples"), pp=self.pythonpath
        )
        kinds = (
            "test_backends = true\nload_timeout = \"300s\"\n\n"
            "[workers.examples]\n" + examples + "\n"
            "[workers.warm]\n" + examples + 'preload = ["torch", "berth_examples.torch_embed"]\n\n'
        )
        if not self.fake:
            # CUDA's libraries from the machine's PyTorch wheels, before
            # whatever the machine has on its path (the driver's).
            libs = ":".join(self.libs + [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p])
            kinds += '[workers.cuda]\nbinary = "{}"\nenv = {{ LD_LIBRARY_PATH = "{}" }}\n\n'.format(
                self.cuda_worker, libs)
        return kinds

    def inprocess(self, *argv: str, timeout: float = 600) -> Dict[str, Any]:
        env = dict(self.env, PYTHONPATH=self.pythonpath)
        out = subprocess.run(
            [self.python, os.path.join(HERE, "inprocess.py"), *argv],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        if out.returncode != 0:
            raise RuntimeError("inprocess.py {} failed: {}".format(" ".join(argv), out.stderr[-2000:]))
        return json.loads(out.stdout.strip().splitlines()[-1])


def model(name: str, **fields: Any) -> str:
    lines = ["[[model]]", 'name = "{}"'.format(name)]
    for k, v in fields.items():
        lines.append("{} = {}".format(k, json.dumps(v) if not isinstance(v, str) or not v.startswith("{") else v))
    return "\n".join(lines) + "\n\n"


# ---- sections -------------------------------------------------------------


def s_unload(run: Run) -> str:
    """berth's unload of 4 GiB against a bare process killed, alternating."""
    config = run.kinds() + model("hog4", backend="gpu-hog", gpus=[0], options="{ alloc_mib = 4096 }")
    b = Berth(run.berth, config, run.env, run.log("unload"))
    rows, floor, ours = [], [], []
    try:
        for i in range(3):
            bare = devices.bare_kill(run.nvml, 4096 * MIB + 512 * MIB)
            floor.append(bare["memory_back_ms"])
            loaded = b.load("hog4")
            report = b.unload("hog4")
            ours.append(report.get("gpu_reclaim_ms") or -1.0)
            rows.append([i + 1, "{:.0f} MiB, back in {:.0f} ms (pid gone {:.0f} ms)".format(
                bare["held_mib"], bare["memory_back_ms"], bare["pid_gone_ms"]),
                "{} at load; {} back in {:.0f} ms, pid gone: {}, unload {:.0f} ms".format(
                mib(loaded.get("vram_bytes")), mib(report.get("gpu_reclaimed_bytes")),
                report.get("gpu_reclaim_ms") or -1, report.get("gpu_pid_gone"), report["took_ms"])])
    finally:
        b.stop()
    return table(["round", "bare process, SIGKILL", "berth unload of gpu-hog 4 GiB"], rows) + \
        "\n\nfloor {}, berth {}".format(spread(floor), spread(ours))


def s_bench(run: Run) -> str:
    """4 GiB in one process that keeps running (kept in a pool, freed with
    the context alive) against berth's unload; 50 load/unload cycles."""
    one = devices.in_one_process(run.nvml, 4096 * MIB)
    config = run.kinds() + model("hog4", backend="gpu-hog", gpus=[0], options="{ alloc_mib = 4096 }")
    config += model("cycle", backend="gpu-hog", gpus=[0], options="{ alloc_mib = 512 }")
    b = Berth(run.berth, config, run.env, run.log("bench"))
    try:
        loaded = b.load("hog4")
        report = b.unload("hog4")
        before, _ = run.nvml.memory()
        started, unloads = time.monotonic(), []
        for _ in range(50):
            b.load("cycle")
            b.infer("cycle", {})
            t = time.monotonic()
            b.unload("cycle")
            unloads.append((time.monotonic() - t) * 1e3)
        took = time.monotonic() - started
        time.sleep(0.5)
        after, _ = run.nvml.memory()
    finally:
        b.stop()
    unloads.sort()
    return table(["after \"unloading\" a 4 GiB model", "VRAM still held"], [
        ["in one process, blocks kept in a pool (a caching allocator)",
         "{:.0f} MiB of {:.0f}".format(one["pooled_mib"], one["loaded_mib"])],
        ["in one process, blocks freed, context alive", "{:.0f} MiB".format(one["freed_mib"])],
        ["berth, worker stopped", "0 ({} reclaimed in {:.0f} ms of a {:.0f} ms unload, pid gone: {})".format(
            mib(report.get("gpu_reclaimed_bytes")), report.get("gpu_reclaim_ms") or -1, report["took_ms"],
            report.get("gpu_pid_gone"))],
        ["50 load/unload cycles of 512 MiB ({:.1f} s)".format(took),
         "device used {} → {}; unload p50 {:.0f} ms, max {:.0f} ms".format(
             mib(before), mib(after), unloads[len(unloads) // 2], unloads[-1])],
    ]) + "\n\nberth held {} at load (pid {})".format(mib(loaded.get("vram_bytes")), loaded["pid"])


def status_quo(run: Run, backend: str, berth_model: str, b: Berth, argv: List[str], request: Dict[str, Any],
               work: int) -> str:
    one = run.inprocess("drop", backend, *argv, timeout=400)
    loaded = b.load(berth_model)
    for _ in range(work):
        status, reply = b.infer(berth_model, request)
        if status != 200:
            raise RuntimeError("infer {}: {} {}".format(berth_model, status, reply))
    held = next(m for m in b.ps() if m["name"] == berth_model)
    report = b.unload(berth_model)
    rows = [["in one process, cycle {}".format(i + 1), "{:.0f} MiB".format(c["loaded_mib"]),
             "{:.0f} MiB".format(c["worked_mib"]), "{:.0f} MiB".format(c["dropped_mib"])]
            for i, c in enumerate(one["cycles"])]
    rows.append(["berth (pid {})".format(loaded["pid"]), mib(loaded.get("vram_bytes")), mib(held.get("vram_bytes")),
                 "0 (reclaimed {} in {:.0f} ms, pid gone: {})".format(
                     mib(report.get("gpu_reclaimed_bytes")), report.get("gpu_reclaim_ms") or -1,
                     report.get("gpu_pid_gone"))])
    versions = {k: v for k, v in one.items() if k != "cycles"}
    return table(["", "after load", "after work", "after drop / unload"], rows) + "\n\n" + json.dumps(versions) + \
        "\nberth's load: {}".format(json.dumps({k: loaded.get(k) for k in ("load_ms", "warnings", "details")}))


def s_torch(run: Run) -> str:
    bert = run.model_dir("bert-large")
    config = run.kinds() + model("bert-large", backend="torch_embed", worker="examples", model=bert, gpus=[0],
                                 options=run.torch_options())
    b = Berth(run.berth, config, run.env, run.log("torch"))
    try:
        return status_quo(run, "torch_embed", "bert-large", b,
                          ["--model", bert, "--cycles", "3", "--batches", "16", "--texts", "64",
                           "--option", "device=" + run.device],
                          {"input": TEXTS, "encoding": "f32"}, 16)
    finally:
        b.stop()


def s_jax(run: Run) -> str:
    config = run.kinds() + model("eqx", backend="eqx_stack", worker="examples", gpus=[0], load_timeout="300s")
    b = Berth(run.berth, config, run.env, run.log("jax"))
    try:
        return status_quo(run, "eqx_stack", "eqx", b, ["--cycles", "3", "--batches", "8", "--texts", "64"],
                          {"rows": 64, "seed": 1}, 8)
    finally:
        b.stop()


def s_sharing(run: Run) -> str:
    config = run.kinds()
    for name in ("eqx-a", "eqx-b"):
        config += model(name, backend="eqx_stack", worker="examples", gpus=[0], vram="20GiB", load_timeout="300s")
    b = Berth(run.berth, config, run.env, run.log("sharing"))
    rows = []
    try:
        for name in ("eqx-a", "eqx-b"):
            report = b.load(name)
            status, reply = b.infer(name, {"rows": 64, "seed": 2})
            rows.append([name, mib(report.get("vram_bytes")), report.get("warnings", "none"),
                         report["details"].get("devices"), status])
        for name in ("eqx-a", "eqx-b"):
            b.unload(name)
    finally:
        b.stop()
    return table(["model (vram = 20GiB)", "held at load", "warnings", "jax.devices()", "request"], rows)


def s_seed003(run: Run) -> str:
    config = run.kinds() + model("neighbour", backend="gpu-hog", gpus=[0], options="{ alloc_mib = 1024 }")
    config += model("vmap", backend="eqx_stack", worker="examples", gpus=[0], vram="1GiB",
                    options='{ init = "vmap" }', load_timeout="300s")
    config += model("blocks", backend="eqx_stack", worker="examples", gpus=[0], vram="1GiB",
                    options='{ init = "blocks" }', load_timeout="300s")
    b = Berth(run.berth, config, run.env, run.log("seed003"))
    try:
        b.load("neighbour")
        import threading

        outcome: Dict[str, Any] = {}

        def failing() -> None:
            started = time.monotonic()
            outcome["reply"] = b.call("POST", "/api/models/vmap/load", {})
            outcome["s"] = time.monotonic() - started

        t = threading.Thread(target=failing)
        t.start()
        latencies = []
        while t.is_alive():
            started = time.monotonic()
            b.infer("neighbour", {})
            latencies.append((time.monotonic() - started) * 1e3)
            time.sleep(0.2)
        t.join()
        status, body = outcome["reply"]
        blocks = b.load("blocks")
        b.unload("blocks")
        error = body.get("error", {}) if isinstance(body, dict) else {}
        return table(["", "outcome"], [
            ["`init = \"vmap\"` in a 1 GiB share", "{} `{}` after {:.1f} s: {}".format(
                status, error.get("code"), outcome["s"], str(error.get("message"))[:300])],
            ["neighbour meanwhile", "{} requests, median {:.1f} ms, max {:.1f} ms".format(
                len(latencies), statistics.median(latencies) if latencies else -1, max(latencies or [-1]))],
            ["`init = \"blocks\"` in a 1 GiB share", "loaded, {} held, {:.0f} ms".format(
                mib(blocks.get("vram_bytes")), blocks["load_ms"])],
        ])
    finally:
        b.stop()


def s_warm(run: Run) -> str:
    bert = run.model_dir("bert-large")
    config = run.kinds()
    config += model("cold", backend="torch_embed", worker="examples", model=bert, gpus=[0],
                    options=run.torch_options())
    config += model("forked", backend="torch_embed", worker="warm", model=bert, gpus=[0],
                    options=run.torch_options())
    b = Berth(run.berth, config, run.env, run.log("warm"))
    rows = []
    try:
        for name in ("cold", "forked", "cold", "forked"):
            report = b.load(name)
            status = b.call("GET", "/api/ps")[1]
            preloaders = status.get("preloaders", [])
            preloader_vram = [run.nvml.held_by([p["pid"]]) for p in preloaders if p.get("pid")]
            out = b.unload(name)
            rows.append([name, "{:.0f} ms".format(report["load_ms"]), report.get("start", {}).get("kind"),
                         mib(report.get("vram_bytes")), mib(out.get("gpu_reclaimed_bytes")),
                         mib(sum(preloader_vram)) if preloader_vram else "-"])
    finally:
        b.stop()
    return table(["BERT-large", "load", "start", "held", "back at unload", "preloader holds"], rows)


def s_budget(run: Run) -> str:
    config = 'gpu_memory_budget = "48GiB"\n' + run.kinds()
    for name in ("a", "b", "c"):
        config += model(name, backend="gpu-hog", gpus=[0], options="{ alloc_mib = 20480 }")
    b = Berth(run.berth, config, run.env, run.log("budget"))
    rows = []
    try:
        for name in ("a", "b", "c"):
            report = b.load(name)
            ps = b.ps()
            held = sum(run.nvml.held_by([m["pid"]]) for m in ps if m.get("pid"))
            rows.append([name, mib(report.get("vram_bytes")), ", ".join(m["name"] for m in ps), mib(held)])
        evicted = [e for e in events(b) if e.get("type") == "evicted"]
    finally:
        b.stop()
    return table(["load (20 GiB each, budget 48 GiB)", "held", "loaded after", "berth's total"], rows) + \
        "\n\nevicted: {}".format(json.dumps([(e.get("model"), e.get("for_model")) for e in evicted]))


def events(b: Berth) -> List[Dict[str, Any]]:
    status, text = b.call("GET", "/api/events?follow=false")
    if not isinstance(text, str):
        return []
    return [json.loads(l[6:]) for l in text.splitlines() if l.startswith("data: ")]


def cosine(a: List[float], b: List[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def s_candle(run: Run) -> str:
    if run.fake:
        return "(not with --fake: the CUDA worker needs a GPU)"
    minilm = run.model_dir("minilm")
    config = run.kinds()
    config += model("embed-cuda", backend="embed", worker="cuda", model=minilm, gpus=[0])
    config += model("embed-cpu", backend="embed", model=minilm, options='{ device = "cpu" }')
    config += model("torch-gpu", backend="torch_embed", worker="examples", model=minilm, gpus=[0],
                    options=run.torch_options())
    config += model("smol-cuda", backend="generate", worker="cuda", model=run.gguf, gpus=[0])
    b = Berth(run.berth, config, run.env, run.log("candle"))
    rows = []
    try:
        first: Dict[str, List[float]] = {}
        for name in ("embed-cuda", "embed-cpu", "torch-gpu"):
            report = b.load(name)
            times = []
            for _ in range(2):
                started = time.monotonic()
                status, reply = b.call("POST", "/v1/embeddings", {"model": name, "input": TEXTS[:4]})
                times.append((time.monotonic() - started) * 1e3)
                if status != 200:
                    raise RuntimeError("{}: {} {}".format(name, status, reply))
            first[name] = reply["data"][0]["embedding"]
            held = next(m for m in b.ps() if m["name"] == name).get("vram_bytes")
            out = b.unload(name)
            d = report.get("details", {})
            rows.append([name, "{:.0f} ms (warm-up {} ms)".format(report["load_ms"], d.get("warmup_ms")),
                         json.dumps(d.get("cuda_modules")), "{:.1f} / {:.1f} ms".format(*times),
                         "{} / {}".format(mib(report.get("vram_bytes")), mib(held)),
                         mib(out.get("gpu_reclaimed_bytes"))])
        report = b.load("smol-cuda")
        chats = []
        for _ in range(2):
            started = time.monotonic()
            status, reply = b.call("POST", "/v1/chat/completions", {
                "model": "smol-cuda", "max_tokens": 48,
                "messages": [{"role": "user", "content": "Write a short story about a lighthouse."}]})
            chats.append((time.monotonic() - started) * 1e3)
        out = b.unload("smol-cuda")
        d = report.get("details", {})
        rows.append(["smol-cuda (48 tokens)", "{:.0f} ms (warm-up {} ms)".format(report["load_ms"], d.get("warmup_ms")),
                     json.dumps(d.get("cuda_modules")), "{:.0f} / {:.0f} ms".format(*chats),
                     mib(report.get("vram_bytes")), mib(out.get("gpu_reclaimed_bytes"))])
    finally:
        b.stop()
    cos = "cosine CUDA/CPU {:.14f}, CUDA/PyTorch {:.14f}".format(
        cosine(first["embed-cuda"], first["embed-cpu"]), cosine(first["embed-cuda"], first["torch-gpu"]))
    return table(["model", "load", "kernels loaded as", "1st / 2nd request", "held at load / after", "back"],
                 rows) + "\n\n" + cos


def s_compare(run: Run) -> str:
    if run.fake:
        return "(not with --fake: the CUDA worker needs a GPU)"
    env = dict(run.env, LD_LIBRARY_PATH=":".join(run.libs))
    out = subprocess.run([run.cuda_worker, "--compare-devices", run.gguf, "--device",
                          "cpu" if run.fake else "cuda:0", "--steps", "32"],
                         capture_output=True, text=True, timeout=120, env=env)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return "```json\n" + out.stdout.strip() + "\n```"


def client(port: int, model: str, texts: int, seconds: float, go: float) -> int:
    """One HTTP client on a kept-alive connection: requests until the time
    is up. The cheapest client the standard library makes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"model": model, "input": TEXTS[:texts], "encoding_format": "base64"})
    headers = {"Content-Type": "application/json"}
    while time.time() < go:
        time.sleep(0.001)
    stop, n = time.time() + seconds, 0
    while time.time() < stop:
        conn.request("POST", "/v1/embeddings", body=body, headers=headers)
        r = conn.getresponse()
        r.read()
        if r.status != 200:
            raise RuntimeError("status {}".format(r.status))
        n += 1
    return n


def berth_round(run: Run, b: Berth, name: str, texts: int, clients: int, seconds: float) -> float:
    go = time.time() + 0.5
    procs = [subprocess.Popen([sys.executable, __file__, "--client", str(b.port), name, str(texts), str(seconds),
                               str(go)], stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    total = 0
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 60)
        total += int(out.strip() or 0)
    return total / seconds


def s_throughput(run: Run) -> str:
    # BERT-large on a CPU (--fake) takes seconds a request: MiniLM alone there.
    bert = "" if run.fake else run.model_dir("bert-large")
    minilm = run.model_dir("minilm")
    config = run.kinds()
    config += model("minilm-t", backend="torch_embed", worker="examples", model=minilm, gpus=[0],
                    options=run.torch_options())
    if bert:
        config += model("bert-t", backend="torch_embed", worker="examples", model=bert, gpus=[0],
                        options=run.torch_options())
    b = Berth(run.berth, config, run.env, run.log("throughput"))
    rows = []
    seconds = 1.5
    try:
        shapes = [("minilm-t", minilm)] + ([] if run.fake else [("bert-t", bert)])
        for name, path in shapes:
            b.load(name)
            for texts in ((1, 32) if name == "minilm-t" else (32,)):
                for clients in (1, 8):
                    env = dict(run.env, PYTHONPATH=run.pythonpath)
                    child = subprocess.Popen(
                        [run.python, "-c", RATE_CHILD, path, str(texts), str(clients), str(seconds), run.device],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                    assert child.stdin is not None and child.stdout is not None
                    if child.stdout.readline().strip() != "ready":
                        raise RuntimeError("the in-process side did not load")
                    ours, theirs = [], []
                    for _ in range(3):
                        berth_round(run, b, name, texts, clients, 0.3)  # warm the connections
                        ours.append(berth_round(run, b, name, texts, clients, seconds))
                        child.stdin.write("go\n")
                        child.stdin.flush()
                        theirs.append(float(child.stdout.readline()))
                    child.stdin.close()
                    child.wait(30)
                    rows.append([name, texts, clients, "{:.0f}".format(statistics.median(ours)),
                                 "{:.0f}".format(statistics.median(theirs)),
                                 "{:.2f}x".format(statistics.median(ours) / statistics.median(theirs))])
            b.unload(name)
    finally:
        b.stop()
    return table(["model", "texts", "clients", "berth req/s", "in one process req/s", "berth / in-process"], rows)


RATE_CHILD = r"""
import sys, threading, time
from berth_worker import LoadContext, LoadSpec, Request, RequestContext
from berth_examples import BACKENDS
path, texts, clients, seconds, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
b = BACKENDS["torch_embed"]()
b.load(LoadSpec("t", "torch_embed", path, {"device": device}), LoadContext.standalone())
body = {"input": ["sentence {} of the GPU workload, about ships, ports and the sea".format(i) for i in range(texts)], "encoding": "f32"}
for i in range(3):
    b.handle(Request(i, body), RequestContext.standalone())
print("ready", flush=True)
for line in sys.stdin:
    counts = [0] * clients
    stop = time.monotonic() + seconds
    def run(c):
        while time.monotonic() < stop:
            b.handle(Request(c, body), RequestContext.standalone())
            counts[c] += 1
    started = time.monotonic()
    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(sum(counts) / (time.monotonic() - started), flush=True)
"""

def sleep_rows(b: Berth, name: str, request: Any, rounds: int = 3) -> List[Any]:
    """`name` put to sleep and woken `rounds` times against an unload and a
    cold load of the same model, alternating: one row."""
    loaded = b.load(name)
    pid = loaded["pid"]
    _, before = b.infer(name, request)
    sleeps, wakes, colds, asleep, same = [], [], [], [], True
    for i in range(rounds):
        if i % 2 == 1:
            b.unload(name)
            colds.append(b.load(name)["load_ms"])
            pid = b.ps()[0]["pid"]
            _, before = b.infer(name, request)
        status, slept = b.call("POST", "/api/models/{}/sleep".format(name), {})
        if status != 200:
            message = slept["error"]["message"] if isinstance(slept, dict) else slept
            return [name, mib(loaded.get("vram_bytes")), "not put to sleep: {}".format(message), "", "", "", ""]
        sleeps.append(slept["checkpoint_ms"])
        asleep.append(slept["vram_after_bytes"])
        status, woke = b.call("POST", "/api/models/{}/wake".format(name), {})
        if status != 200:
            return [name, mib(loaded.get("vram_bytes")), "wake failed: {}".format(woke), "", "", "", ""]
        wakes.append(woke["restore_ms"])
        _, after = b.infer(name, request)
        same = same and after == before and woke["pid"] == pid
        if i % 2 == 0:
            b.unload(name)
            colds.append(b.load(name)["load_ms"])
    b.unload(name)
    ratio = statistics.median(colds) / max(statistics.median(wakes), 1e-3)
    return [name, mib(loaded.get("vram_bytes")), mib(max(asleep)), spread(sleeps), spread(wakes),
            "{} ({:.1f}x the wake)".format(spread(colds), ratio), "yes" if same else "NO"]


def s_sleep(run: Run) -> str:
    """Sleep by the driver's checkpoint API: gpu-hog at 4 and 20 GiB,
    PyTorch (BERT-large), JAX (eqx_stack), candle's CUDA worker: sleep
    time, what NVML reads asleep, wake time against a cold load, and the
    answers after each wake against those before."""
    rows = []
    try:
        bert = run.model_dir("bert-large")
    except Exception as e:  # no numpy for this python: that row says so
        bert = None
        rows.append(["bert-large", "", "its weights could not be made: {}".format(e), "", "", "", ""])
    config = run.kinds()
    config += model("hog4", backend="gpu-hog", gpus=[0], sleep="driver", options="{ alloc_mib = 4096 }")
    config += model("hog20", backend="gpu-hog", gpus=[0], sleep="driver", options="{ alloc_mib = 20480 }")
    if bert:
        config += model("bert-large", backend="torch_embed", worker="examples", model=bert, gpus=[0],
                        sleep="driver", options=run.torch_options())
    config += model("eqx", backend="eqx_stack", worker="examples", gpus=[0], sleep="driver",
                    load_timeout="300s")
    if not run.fake:
        config += model("minilm-cuda", backend="embed", worker="cuda", gpus=[0], sleep="driver",
                        model=run.model_dir("minilm"))
    b = Berth(run.berth, config, run.env, run.log("sleep"))
    try:
        for name, request in [("hog4", {}), ("hog20", {})] + \
                ([("bert-large", {"input": TEXTS[:8], "encoding": "f32"})] if bert else []) + \
                [("eqx", {"rows": 8, "seed": 1})] + \
                ([] if run.fake else [("minilm-cuda", {"input": TEXTS[:8], "encoding": "f32"})]):
            try:
                rows.append(sleep_rows(b, name, request))
            except Exception as e:  # one model's failure is its row
                rows.append([name, "", "failed: {}".format(e), "", "", "", ""])
    finally:
        b.stop()
    return table(["model", "VRAM loaded", "VRAM asleep (NVML)", "sleep", "wake", "cold load", "same answers, pid"],
                 rows)


SECTIONS: List[Tuple[str, str, Callable[[Run], str]]] = [
    ("unload", "Unload proof against the device's own floor", s_unload),
    ("bench", "4 GiB in one process against berth, and 50 cycles", s_bench),
    ("torch", "PyTorch, BERT-large: in one process against berth", s_torch),
    ("jax", "JAX, eqx_stack (24 blocks): in one process against berth", s_jax),
    ("sharing", "JAX models sharing a card", s_sharing),
    ("seed003", "Seed 003: init=vmap in a 1 GiB share", s_seed003),
    ("warm", "Warm starts", s_warm),
    ("budget", "The per-GPU budget once loads are measured", s_budget),
    ("candle", "candle's CUDA worker: loads and first requests", s_candle),
    ("compare", "generate on CUDA against the CPU (cut GGUF)", s_compare),
    ("throughput", "Throughput beside in-process", s_throughput),
    ("sleep", "Sleep by the driver's checkpoint API", s_sleep),
]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        port, name, texts, seconds, go = sys.argv[2:7]
        print(client(int(port), name, int(texts), float(seconds), float(go)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--carry", default=os.path.join(REPO, "target", "gpu-carry"))
    parser.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "berth-gpu"))
    parser.add_argument("--python", default="python3", help="the python with the machine's torch and jax")
    parser.add_argument("--only", default="", help="comma-separated sections")
    parser.add_argument("--fake", action="store_true",
                        help="a machine without a GPU, on tests/fake-gpu: frameworks on the CPU (checks the script)")
    args = parser.parse_args()
    only = [s for s in args.only.split(",") if s]
    started = time.monotonic()
    run = Run(args)
    machine = devices.describe()
    print("# berth on {gpu} (driver {driver}, CUDA {cuda}), {date}\n".format(
        gpu=machine.get("gpu"), driver=machine.get("driver"), cuda=machine.get("cuda"),
        date=time.strftime("%Y-%m-%d")), flush=True)
    if not run.fake:
        version = subprocess.run([run.cuda_worker, "--version"], capture_output=True, text=True,
                                 env=dict(run.env, LD_LIBRARY_PATH=":".join(run.libs)))
        print("CUDA worker: {}; CUDA libraries from {}\n".format(
            (version.stdout or version.stderr).strip(), ", ".join(run.libs) or "the system"), flush=True)
    failed = 0
    for key, title, section in SECTIONS:
        if only and key not in only:
            continue
        t = time.monotonic()
        print("## {} (`{}`)\n".format(title, key), flush=True)
        try:
            print(section(run), flush=True)
        except Exception as e:  # one section's failure does not end the run
            failed += 1
            print("FAILED: {}\n```\n{}```".format(e, traceback.format_exc()[-3000:]), flush=True)
        print("\n_{:.1f} s_\n".format(time.monotonic() - t), flush=True)
    print("all sections in {:.1f} s, {} failed".format(time.monotonic() - started, failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
