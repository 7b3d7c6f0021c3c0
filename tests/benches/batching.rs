//! Throughput under concurrency: the shipped MiniLM through `berth serve`
//! with 1, 4, 16 and 64 clients sending one text per request, batched
//! inside the worker; beside it the same backend in-process at batch 1 and
//! 32, an established embedding server (`infinity-emb`, from a pinned venv
//! of its own, on the same weights) under the same clients, and one client
//! against the same model with batching impossible (`max_concurrency = 1`).
//! The comparisons run in alternating rounds. docs/performance.md's "Batching"
//! table. Clients ask for base64 vectors (what OpenAI's own client does by
//! default), the in-process side for `f32` bulk: neither formats or parses
//! floats as text.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench batching`;
//! sections alone: `-- clients | goals | infinity`; `-- --without-infinity`
//! leaves infinity out, and with it its ~6 GB venv.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use berth::Body;
use berth_tests::bench::{alternate, machine, pct_ms};
use berth_tests::infinity::Infinity;
use berth_tests::{Server, cosine, default_model, local_backend};
use berth_worker::RequestContext;
use serde_json::{Value, json};

/// Texts of ordinary, slightly varying length, one per request.
fn text(i: usize) -> String {
    format!(
        "request {i}: berth runs every model in a worker process of its own{}",
        ", and batches".repeat(i % 3)
    )
}

/// Where the clients send: berth's sidecar or infinity.
#[derive(Clone, Copy)]
enum Target<'a> {
    Berth(&'a Server, &'a str),
    Infinity(&'a Infinity),
}

impl Target<'_> {
    /// Asks for `input`'s vectors: clients ask for base64, as OpenAI's
    /// own client does (no float text on either side, like the in-process
    /// side's `f32` bulk).
    fn embed(&self, input: Value, encoding: &str) -> (u16, Value) {
        match *self {
            Target::Berth(server, model) => server.post(
                "/v1/embeddings",
                json!({ "model": model, "input": input, "encoding_format": encoding }),
            ),
            Target::Infinity(inf) => inf.embeddings(
                json!({ "model": inf.model, "input": input, "encoding_format": encoding }),
            ),
        }
    }
}

/// `clients` threads sending `per_client` requests each, one text a
/// request; latencies and the wall time.
fn load(target: Target, clients: usize, per_client: usize) -> (Vec<Duration>, Duration) {
    let samples = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for c in 0..clients {
            let samples = &samples;
            scope.spawn(move || {
                let mut mine = Vec::with_capacity(per_client);
                for i in 0..per_client {
                    let t = Instant::now();
                    let (status, v) = target.embed(json!(text(c * per_client + i)), "base64");
                    assert_eq!(status, 200, "{v}");
                    mine.push(t.elapsed());
                }
                samples.lock().unwrap().extend(mine);
            });
        }
    });
    (samples.into_inner().unwrap(), started.elapsed())
}

/// How long a throughput figure is measured, after how long a warm-up.
const WARM_UP: Duration = Duration::from_millis(500);
const WINDOW: Duration = Duration::from_secs(3);

/// `clients` threads sending one text per request without pause for
/// [`WARM_UP`] and [`WINDOW`]: the requests per second completed within
/// the window, and their latencies. Throughput under steady load, not
/// counting the ramp when all clients start at once (an idle worker runs
/// the first request alone) nor the tail when they stop.
fn steady(target: Target, clients: usize) -> (f64, Vec<Duration>) {
    let start = Instant::now();
    let (from, until) = (start + WARM_UP, start + WARM_UP + WINDOW);
    let samples = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for c in 0..clients {
            let samples = &samples;
            scope.spawn(move || {
                let mut mine = Vec::new();
                // The in-process side's 32 texts, in turn.
                let mut i = c;
                while Instant::now() < until {
                    let t = Instant::now();
                    let (status, v) = target.embed(json!(text(i % 32)), "base64");
                    assert_eq!(status, 200, "{v}");
                    let done = Instant::now();
                    if done >= from && done < until {
                        mine.push(done - t);
                    }
                    i += 1;
                }
                samples.lock().unwrap().extend(mine);
            });
        }
    });
    let samples = samples.into_inner().unwrap();
    (samples.len() as f64 / WINDOW.as_secs_f64(), samples)
}

/// Requests per second of `clients` clients under steady load.
fn rate(target: Target, clients: usize) -> f64 {
    steady(target, clients).0
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

/// The vectors `target` gives for `texts`, as JSON numbers.
fn vectors(target: Target, texts: &[String]) -> Vec<Vec<f32>> {
    let (status, v) = target.embed(json!(texts), "float");
    assert_eq!(status, 200, "{v}");
    v["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .expect("a vector")
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

/// A row of the clients table.
fn clients_row(what: &str, target: Target, clients: usize, batch32: f64) {
    let (rate, mut samples) = steady(target, clients);
    println!(
        "| {what}, {clients} client(s) | {rate:.1} | {:.1} ms | {:.1} ms | {:.2}× |",
        pct_ms(&mut samples, 0.5),
        pct_ms(&mut samples, 0.99),
        rate / batch32
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let run = berth_tests::bench::sections();
    let with_infinity = !std::env::args().any(|a| a == "--without-infinity");
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{0}\"\n\n\
         [[model]]\nname = \"minilm-serial\"\nbackend = \"embed\"\nmodel = \"{0}\"\nmax_concurrency = 1\n",
        minilm.display()
    ));
    let berth = Target::Berth(&server, "minilm");
    let serial = Target::Berth(&server, "minilm-serial");
    load(berth, 1, 20);
    load(serial, 1, 20);
    let infinity =
        (with_infinity && (run("clients") || run("infinity"))).then(|| Infinity::start(&minilm));
    let infinity = infinity.as_ref().map(Target::Infinity);
    if let Some(inf) = infinity {
        load(inf, 4, 10);
    }
    println!("Batching ({})\n", machine());
    let mut local = local_backend("embed", Some(&minilm), &[]);
    let p50 = |target: Target| {
        let (mut s, _) = load(target, 1, 30);
        pct_ms(&mut s, 0.5)
    };

    if run("clients") {
        let batch1 = in_process(&mut local, 1, 200);
        let batch32 = in_process(&mut local, 32, 20);
        println!(
            "| `minilm`, 1 text per request | requests/s | p50 | p99 | vs in-process batch 32 |"
        );
        println!("|---|---|---|---|---|");
        for clients in [1, 4, 16, 64] {
            clients_row("through `berth serve`", berth, clients, batch32);
        }
        if let Some(inf) = infinity {
            for clients in [1, 4, 16, 64] {
                clients_row("`infinity-emb` 0.0.78", inf, clients, batch32);
            }
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
            println!("\n`ps` after the runs: {}\n", m["batching"]);
        }
    }

    println!("| what | through berth | baseline | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    if run("goals") {
        // One client: does batching cost a lone request anything? The same
        // model with max_concurrency = 1 cannot batch.
        alternate(21, || p50(berth), || p50(serial)).print(
            "1 client, p50 latency",
            "batching on",
            "batching impossible (`max_concurrency = 1`)",
            "ms",
            1.0,
        );
        // 16 clients through the sidecar against the backend in-process at
        // batch 32 (the goal), and at batch 16, the most 16 clients with a
        // request each can make: what berth itself costs.
        alternate(11, || rate(berth, 16), || in_process(&mut local, 32, 10)).print(
            "texts/s",
            "16 clients × 1 text",
            "in-process, batch 32",
            "texts/s",
            1.0,
        );
        alternate(11, || rate(berth, 16), || in_process(&mut local, 16, 20)).print(
            "texts/s",
            "16 clients × 1 text",
            "in-process, batch 16",
            "texts/s",
            1.0,
        );
    }
    let Some(inf) = infinity.filter(|_| run("infinity")) else {
        return;
    };
    // Against what users would run instead, on the same weights.
    alternate(11, || rate(berth, 16), || rate(inf, 16)).print(
        "requests/s, 16 clients × 1 text",
        "",
        "`infinity-emb`",
        "requests/s",
        1.0,
    );
    alternate(21, || p50(berth), || p50(inf)).print(
        "1 client, p50 latency",
        "",
        "`infinity-emb`",
        "ms",
        1.0,
    );
    // The same weights give the same vectors.
    let texts: Vec<String> = (0..8).map(|i| text(i * 7)).collect();
    let ours = vectors(berth, &texts);
    let theirs = vectors(inf, &texts);
    let worst = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| cosine(a, b))
        .fold(f32::INFINITY, f32::min);
    println!("\nberth's and infinity's vectors for 8 texts: lowest cosine {worst:.6}");
}
