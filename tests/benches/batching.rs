//! Throughput under concurrency: the shipped MiniLM through `berth serve`
//! with 1, 4, 16 and 64 clients sending one text per request, batched
//! inside the worker; beside it the same backend in-process at batch 1 and
//! 32, and one client against the same model with batching impossible
//! (`max_concurrency = 1`), in alternating rounds. The README's "Batching"
//! table. Clients ask for base64 vectors (what OpenAI's own client does by
//! default), the in-process side for `f32` bulk: neither formats or parses
//! floats as text.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench batching`

use std::sync::Mutex;
use std::time::{Duration, Instant};

use berth::Body;
use berth_tests::bench::pct_ms;
use berth_tests::bench::{Rounds, machine};
use berth_tests::{Server, default_model, local_backend};
use berth_worker::RequestContext;
use serde_json::json;

/// Texts of ordinary, slightly varying length, one per request.
fn text(i: usize) -> String {
    format!(
        "request {i}: berth runs every model in a worker process of its own{}",
        ", and batches".repeat(i % 3)
    )
}

/// `clients` threads sending `per_client` requests each to `model`;
/// latencies and the wall time.
fn load(
    server: &Server,
    model: &str,
    clients: usize,
    per_client: usize,
) -> (Vec<Duration>, Duration) {
    let samples = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for c in 0..clients {
            let samples = &samples;
            scope.spawn(move || {
                let mut mine = Vec::with_capacity(per_client);
                for i in 0..per_client {
                    // base64, as OpenAI's own client asks by default: no
                    // float text on either side, like the in-process side's
                    // `f32` bulk.
                    let body = json!({
                        "model": model,
                        "input": text(c * per_client + i),
                        "encoding_format": "base64",
                    });
                    let t = Instant::now();
                    let (status, v) = server.post("/v1/embeddings", body);
                    assert_eq!(status, 200, "{v}");
                    mine.push(t.elapsed());
                }
                samples.lock().unwrap().extend(mine);
            });
        }
    });
    (samples.into_inner().unwrap(), started.elapsed())
}

/// Texts per second of the backend in this process at `batch` texts a call.
fn in_process(local: &mut Box<dyn berth_worker::Backend>, batch: usize, calls: usize) -> f64 {
    let ctx = RequestContext::standalone();
    let texts: Vec<String> = (0..batch).map(text).collect();
    let body = json!({ "input": texts, "encoding": "f32" }).to_string();
    local.handle(Body::json(body.clone()), &ctx).unwrap();
    let started = Instant::now();
    for _ in 0..calls {
        local.handle(Body::json(body.clone()), &ctx).unwrap();
    }
    (batch * calls) as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{0}\"\n\n\
         [[model]]\nname = \"minilm-serial\"\nbackend = \"embed\"\nmodel = \"{0}\"\nmax_concurrency = 1\n",
        minilm.display()
    ));
    for model in ["minilm", "minilm-serial"] {
        load(&server, model, 1, 20);
    }
    println!("Batching ({})\n", machine());
    let mut local = local_backend("embed", Some(&minilm), &[]);
    let batch1 = in_process(&mut local, 1, 200);
    let batch32 = in_process(&mut local, 32, 20);
    println!("| `minilm`, 1 text per request | requests/s | p50 | p99 | vs in-process batch 32 |");
    println!("|---|---|---|---|---|");
    for (clients, per_client) in [(1usize, 200usize), (4, 60), (16, 25), (64, 8)] {
        let (mut samples, wall) = load(&server, "minilm", clients, per_client);
        let rate = samples.len() as f64 / wall.as_secs_f64();
        println!(
            "| through `berth serve`, {clients} client(s) | {rate:.1} | {:.1} ms | {:.1} ms | {:.2}× |",
            pct_ms(&mut samples, 0.5),
            pct_ms(&mut samples, 0.99),
            rate / batch32
        );
    }
    println!(
        "| the backend in-process, batch 1 | {batch1:.1} texts/s | | | {:.2}× |",
        batch1 / batch32
    );
    println!("| the backend in-process, batch 32 | {batch32:.1} texts/s | | | 1.00× |");
    let (_, server_status) = server.get("/api/ps");
    if let Some(m) = server_status["models"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["name"] == "minilm"))
    {
        println!("\n`ps` after the runs: {}", m["batching"]);
    }

    // The goal's comparison in alternating rounds: 16 clients through the
    // sidecar against the backend in-process at batch 32.
    let mut rounds = Rounds::new();
    for round in 0..11 {
        let clients = || {
            let (samples, wall) = load(&server, "minilm", 16, 10);
            samples.len() as f64 / wall.as_secs_f64()
        };
        let (a, b) = if round % 2 == 0 {
            let a = clients();
            (a, in_process(&mut local, 32, 5))
        } else {
            let b = in_process(&mut local, 32, 5);
            (clients(), b)
        };
        rounds.push(a, b);
    }
    println!();
    println!("| what | through berth | in-process | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    rounds.print("texts/s", "16 clients × 1 text", "batch 32", "texts/s", 1.0);

    // One client: does batching cost a lone request anything? The same
    // model with max_concurrency = 1 cannot batch; rounds alternate.
    let mut rounds = Rounds::new();
    for round in 0..15 {
        let p50 = |model: &str| {
            let (mut s, _) = load(&server, model, 1, 20);
            pct_ms(&mut s, 0.5)
        };
        let (a, b) = if round % 2 == 0 {
            let a = p50("minilm");
            (a, p50("minilm-serial"))
        } else {
            let b = p50("minilm-serial");
            (p50("minilm"), b)
        };
        rounds.push(a, b);
    }
    rounds.print(
        "1 client, p50 latency",
        "batching on",
        "batching impossible (`max_concurrency = 1`)",
        "ms",
        1.0,
    );
}
