//! The Python examples on the real frameworks: the status quo beside berth,
//! and PyTorch embeddings through a worker beside the same code in-process;
//! docs/performance.md's "Python models" tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench python_models`
//!
//! 1. For PyTorch (MiniLM embeddings) and JAX (the 24-block Equinox stack):
//!    `python/examples/status_quo.py` loads, uses and drops the model in one
//!    Python process 20 times, dropping it as users are told to (`del`,
//!    `gc.collect()`, the framework's cache release). Beside it this process
//!    hosts a `Supervisor` that loads, uses and unloads the same model
//!    through a worker 20 times, with the same requests. Printed: the
//!    Python process's RSS before the first load and after the first and
//!    last drop; the host's RSS before and after, what each unload reclaimed
//!    and the processes left. Drawn too: `docs/status-quo-torch.svg` and
//!    `docs/status-quo-jax.svg`.
//! 2. The Equinox stack's two initialisations, each loaded without a cap:
//!    the load reports' peak and settled RSS.
//! 3. Texts per second of `torch_embed` at batch 1 and 32 through berth and
//!    in-process (`tests/python/inprocess_embed.py`), in interleaved rounds,
//!    both with `OMP_WAIT_POLICY=PASSIVE` as `serve.toml` sets it.
//!
//! Arguments pick sections by name (`status-quo`, `init`, `throughput`);
//! none runs all three.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use berth::{Body, ModelSpec, Supervisor};
use berth_tests::bench::own_rss;
use berth_tests::bench::{Rounds, machine, median};
use berth_tests::python::{example_spec, examples_dir, examples_python, repo_root};
use berth_tests::{default_model, test_config};

const MIB: f64 = (1 << 20) as f64;
const CYCLES: usize = 20;

/// The backend, options and requests of one cycle, as `status_quo.py`'s
/// `workload()` has them.
fn workload(framework: &str) -> (ModelSpec, Vec<String>) {
    if framework == "torch" {
        let texts: Vec<String> = (0..32)
            .map(|i| format!("sentence {i} of the status-quo workload, about ships and ports"))
            .collect();
        let body = serde_json::json!({ "input": texts, "encoding": "f32" }).to_string();
        let spec = example_spec("sq-torch", "torch_embed").model(default_model("minilm"));
        (spec, vec![body; 16])
    } else {
        let spec = example_spec("sq-jax", "eqx_stack").option("init", "blocks");
        let bodies = (0..8)
            .map(|i| serde_json::json!({ "rows": 64, "seed": i }).to_string())
            .collect();
        (spec, bodies)
    }
}

async fn status_quo_beside_berth(sup: &Supervisor, framework: &str) {
    let out = Command::new(examples_python())
        .arg(examples_dir().join("status_quo.py"))
        .arg(framework)
        .args(["--cycles", &CYCLES.to_string(), "--model"])
        .arg(default_model("minilm"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "status_quo.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sq: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mib = |v: &serde_json::Value| v.as_f64().unwrap() / MIB;
    let before = mib(&sq["rss_before_bytes"]);
    let first = mib(&sq["rss_after_bytes"][0]);
    let last = mib(&sq["rss_after_bytes"][CYCLES - 1]);
    let bare = mib(&sq["rss_bare_bytes"]);

    let (mut spec, bodies) = workload(framework);
    spec.load_timeout = Some(Duration::from_secs(300));
    let host_before = own_rss() as f64 / MIB;
    let mut reclaimed = Vec::new();
    let mut at_stop = Vec::new();
    let mut leftover = 0;
    let (mut loaded, mut dropped) = (Vec::new(), Vec::new());
    for _ in 0..CYCLES {
        sup.load(spec.clone()).await.unwrap();
        for body in &bodies {
            sup.request(&spec.name, Body::json(body.clone()))
                .await
                .unwrap();
        }
        let report = sup.unload(&spec.name).await.unwrap();
        reclaimed.push(report.reclaimed_bytes as f64 / MIB);
        at_stop.push(report.rss_at_stop_bytes as f64 / MIB);
        leftover = leftover.max(report.leftover_processes);
        let host = own_rss() as f64 / MIB;
        loaded.push(host + report.rss_at_stop_bytes as f64 / MIB - host_before);
        dropped.push(host - host_before);
    }
    let host_after = own_rss() as f64 / MIB;
    let series = |key: &str| -> Vec<f64> {
        sq[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| mib(v) - bare)
            .collect()
    };
    use berth_tests::chart::{BERTH, Cycles, IN_PROCESS, write_cycles_chart};
    let (what, name) = if framework == "torch" {
        (
            "all-MiniLM-L6-v2 (PyTorch): load, 16 requests of 32 texts, drop",
            "torch",
        )
    } else {
        (
            "The 24-block Equinox stack (JAX): load, 8 requests, drop",
            "jax",
        )
    };
    write_cycles_chart(
        &format!("status-quo-{name}.svg"),
        &format!("{what}, {CYCLES} times"),
        &format!(
            "Memory above each host's RSS before it loaded anything (the Python process: before importing the\nframework, so its first step is the import) while it loads, uses and drops the model as users are told\nto (del, gc.collect(), the cache release); berth's line is its host plus the worker.\n`cargo bench -p berth-tests --bench python_models -- status-quo`, {}",
            machine()
        ),
        &[
            Cycles {
                label: "in one Python process".into(),
                color: IN_PROCESS,
                before: before - bare,
                loaded: series("rss_loaded_bytes"),
                dropped: series("rss_after_bytes"),
            },
            Cycles {
                label: "berth: host + worker".into(),
                color: BERTH,
                before: 0.0,
                loaded,
                dropped,
            },
        ],
    );
    println!(
        "| {framework} | {before:.0} → {first:.0} → {last:.0} MiB: **{:+.0} MiB** left after 1 cycle, **{:+.0} MiB** after {CYCLES} (+{:.0} MiB of imports, from {bare:.0}) | {host_before:.0} → {host_after:.0} MiB (**{:+.0} MiB**); worker RSS at stop {:.0} MiB, reclaimed {:.0} MiB per unload (median); {leftover} processes left |",
        first - before,
        last - before,
        before - bare,
        host_after - host_before,
        median(&mut at_stop),
        median(&mut reclaimed),
    );
}

async fn init_peaks(sup: &Supervisor) {
    println!("| `eqx_stack` init | load | peak RSS | RSS after load | parameters |");
    println!("|---|---|---|---|---|");
    for init in ["vmap", "blocks"] {
        let mut spec = example_spec("eqx-init", "eqx_stack").option("init", init);
        spec.load_timeout = Some(Duration::from_secs(300));
        let report = sup.load(spec).await.unwrap();
        println!(
            "| `{init}` | {:.1} s | **{:.0} MiB** | {:.0} MiB | {} MB ({}) |",
            report.load_ms / 1e3,
            report.peak_rss_bytes as f64 / MIB,
            report.rss_bytes as f64 / MIB,
            report.details["parameter_bytes"].as_u64().unwrap_or(0) / 1_000_000,
            report.details["dtype"].as_str().unwrap_or("?"),
        );
        sup.unload("eqx-init").await.unwrap();
    }
}

/// As `python/examples/serve.toml` runs the examples, on both sides: OpenMP
/// threads that sleep when idle instead of spinning for a while, which on a
/// small machine steal cores from everything else (here, from the supervisor
/// between requests; in-process, from nothing). Measured with PyTorch's
/// default (spinning) too: batch 1 0.94x (0.86-1.02), batch 32 0.97x.
const OMP_WAIT: (&str, &str) = ("OMP_WAIT_POLICY", "PASSIVE");

/// `inprocess_embed.py`: the same backend, called in its own process.
struct InProcess {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl InProcess {
    fn start() -> InProcess {
        let mut child = Command::new(examples_python())
            .arg(repo_root().join("tests/python/inprocess_embed.py"))
            .arg(default_model("minilm"))
            .env(OMP_WAIT.0, OMP_WAIT.1)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        InProcess {
            child,
            stdin,
            stdout,
        }
    }

    /// Seconds for `n` requests of `batch` texts.
    fn run(&mut self, batch: usize, n: usize) -> f64 {
        writeln!(self.stdin, "{batch} {n}").unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim().parse().unwrap()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bench_texts(batch: usize) -> Vec<String> {
    (0..batch)
        .map(|i| format!("text {i} of the throughput bench, a sentence of ordinary length"))
        .collect()
}

async fn throughput(sup: &Supervisor) {
    let mut spec = example_spec("tp-torch", "torch_embed").model(default_model("minilm"));
    spec.env.push((OMP_WAIT.0.into(), OMP_WAIT.1.into()));
    sup.load(spec).await.unwrap();
    let mut local = InProcess::start();
    for (batch, n, rounds_n) in [(1usize, 40usize, 21usize), (32, 4, 21)] {
        let body =
            serde_json::json!({ "input": bench_texts(batch), "encoding": "f32" }).to_string();
        // Warm both sides.
        local.run(batch, n);
        for _ in 0..n {
            sup.request("tp-torch", Body::json(body.clone()))
                .await
                .unwrap();
        }
        let mut rounds = Rounds::new();
        for round in 0..rounds_n {
            let berth_side = async || {
                let t = Instant::now();
                for _ in 0..n {
                    sup.request("tp-torch", Body::json(body.clone()))
                        .await
                        .unwrap();
                }
                (batch * n) as f64 / t.elapsed().as_secs_f64()
            };
            // A B, then B A: neither side always goes first.
            let (a, b) = if round % 2 == 0 {
                let a = berth_side().await;
                (a, (batch * n) as f64 / local.run(batch, n))
            } else {
                let b = (batch * n) as f64 / local.run(batch, n);
                (berth_side().await, b)
            };
            rounds.push(a, b);
        }
        rounds.print(
            &format!("texts/s, batch {batch}"),
            "through berth",
            "in-process",
            "texts/s",
            1.0,
        );
    }
    sup.unload("tp-torch").await.unwrap();
}

fn main() {
    let runtime = berth_tests::bench::runtime();
    let _ = examples_python();
    println!("Python models ({})\n", machine());
    let run = berth_tests::bench::sections();
    runtime.block_on(async {
        let sup = Supervisor::new(test_config());
        if run("status-quo") {
            println!(
                "| framework | in one Python process: RSS before load → after 1st drop → after {CYCLES}th | berth: host RSS before → after {CYCLES} cycles; per unload |"
            );
            println!("|---|---|---|");
            status_quo_beside_berth(&sup, "torch").await;
            status_quo_beside_berth(&sup, "jax").await;
            println!();
        }
        if run("init") {
            init_peaks(&sup).await;
            println!();
        }
        if run("throughput") {
            println!("| what | berth | in-process | ratio, median (p10–p90) | samples |");
            println!("|---|---|---|---|---|");
            throughput(&sup).await;
        }
        sup.shutdown().await;
    });
}
