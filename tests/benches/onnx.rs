//! One client's embeddings: berth's `embed` at batch 1 against ONNX Runtime
//! on the same weights, texts and threads, both in-process, in alternating
//! rounds; and one client's `/v1/embeddings` p50 through `berth serve`
//! beside them. Printed as docs/performance.md's "One text at a time,
//! against ONNX Runtime".
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench onnx`
//!
//! ONNX Runtime's side is `tests/python/onnx_embed.py` in a pinned venv
//! (`tests/python/requirements-onnx.txt` beside the examples' PyTorch,
//! built by pip the first time): it exports all-MiniLM-L6-v2 from the
//! PyTorch example's BERT over the same safetensors file berth's `embed`
//! reads (pooling and normalisation in the graph) and times its own calls,
//! tokenizer included, as the Rust side times `embed`'s `handle`.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use berth::Body;
use berth_tests::bench::{Rounds, machine, pct_ms};
use berth_tests::python::{onnx_python, repo_root};
use berth_tests::{Server, cosine, default_model, local_backend};
use berth_worker::RequestContext;
use serde_json::{Value, json};

const ROUNDS: usize = 24;
const PER_ROUND: usize = 100;
const SETTLE: std::time::Duration = std::time::Duration::from_millis(100);

/// The texts both sides embed (`onnx_embed.py` makes the same).
fn text(i: usize) -> String {
    format!("text {i} of the throughput bench, a sentence of ordinary length")
}

/// ONNX Runtime in its own Python process, timing itself.
struct Ort {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Ort {
    fn start(threads: usize) -> Ort {
        let mut child = Command::new(onnx_python())
            .arg(repo_root().join("tests/python/onnx_embed.py"))
            .arg(default_model("minilm"))
            .arg(threads.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("onnx_embed.py starts");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready", "onnx_embed.py: {line}");
        Ort {
            child,
            stdin,
            stdout,
        }
    }

    fn ask(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        let mut answer = String::new();
        self.stdout.read_line(&mut answer).unwrap();
        answer
    }

    /// Seconds `n` requests of `batch` texts took.
    fn time(&mut self, batch: usize, n: usize) -> f64 {
        self.ask(&format!("BATCH {batch} {n}"))
            .trim()
            .parse()
            .unwrap()
    }

    fn vector(&mut self, i: usize) -> Vec<f32> {
        serde_json::from_str(&self.ask(&format!("VECTOR {i}"))).unwrap()
    }
}

impl Drop for Ort {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A pause before each side's round. Both sides' thread pools spin for a
/// while after their last call (ONNX Runtime's for ~20 ms on the 2-vCPU
/// VM, seen with `perf sched`): without it, a round began with the other
/// side's threads still holding the CPUs.
fn settle() {
    std::thread::sleep(SETTLE);
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = default_model("minilm");
    let mut embed = local_backend("embed", Some(&model), &[("threads", &threads.to_string())]);
    let ctx = RequestContext::standalone();
    let mut ask = |i: usize| -> Value {
        let body = embed
            .handle(Body::json(json!({ "input": text(i) }).to_string()), &ctx)
            .unwrap();
        serde_json::from_str(&body.json).unwrap()
    };
    let mut ort = Ort::start(threads);
    // The same weights: each text's vector from both.
    let agreement = (0..8)
        .map(|i| {
            let ours: Vec<f32> = serde_json::from_value(ask(i)["embeddings"][0].clone()).unwrap();
            cosine(&ours, &ort.vector(i))
        })
        .fold(f32::INFINITY, f32::min);
    let mut berth_side = |n: usize| {
        let started = Instant::now();
        for i in 0..n {
            ask(i % 16);
        }
        started.elapsed().as_secs_f64()
    };
    berth_side(PER_ROUND);
    ort.time(1, PER_ROUND);
    let mut rounds = Rounds::new();
    for round in 0..ROUNDS {
        let (a, b) = if round % 2 == 0 {
            settle();
            let a = berth_side(PER_ROUND);
            settle();
            (a, ort.time(1, PER_ROUND))
        } else {
            settle();
            let b = ort.time(1, PER_ROUND);
            settle();
            (berth_side(PER_ROUND), b)
        };
        rounds.push(PER_ROUND as f64 / a, PER_ROUND as f64 / b);
    }
    drop(ort);

    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        model.display()
    ));
    let mut served = Vec::new();
    for i in 0..(PER_ROUND * 3) {
        let started = Instant::now();
        let (status, reply) = server.post(
            "/v1/embeddings",
            json!({ "model": "minilm", "input": text(i % 16) }),
        );
        assert_eq!(status, 200, "{reply}");
        if i >= PER_ROUND {
            served.push(started.elapsed());
        }
    }

    println!(
        "### One text at a time: `embed` against ONNX Runtime, {threads} threads each ({})\n",
        machine()
    );
    println!("| what | `embed` | ONNX Runtime | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    rounds.print("in-process, batch 1, texts/s", "", "", "texts/s", 1.0);
    println!(
        "| one client, `/v1/embeddings` through `berth serve`, p50 | {:.2} ms | | | {} requests |",
        pct_ms(&mut served, 0.5),
        served.len()
    );
    println!("\n(the two sides' vectors agree to a cosine of at least {agreement:.6})");
}
