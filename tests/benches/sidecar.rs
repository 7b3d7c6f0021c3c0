//! Sidecar and recycling benchmarks, printed as docs/performance.md's tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench sidecar`
//! (`-- --recycling`: the recycling section alone)

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth::{Body, ModelSpec, Supervisor};
use berth_tests::bench::{Rounds, machine, pct_ms, runtime};
use berth_tests::{Server, default_model, local_backend, test_config};
use berth_worker::RequestContext;
use serde_json::json;

fn row(what: &str, samples: &mut [Duration], wall: Option<Duration>) {
    let rate = wall
        .map(|w| format!("{:.1}", samples.len() as f64 / w.as_secs_f64()))
        .unwrap_or_else(|| "-".into());
    println!(
        "| {what} | {rate} | {:.2} ms | {:.2} ms | {:.2} ms |",
        pct_ms(samples, 0.5),
        pct_ms(samples, 0.99),
        pct_ms(samples, 1.0)
    );
}

const TEXT: &str = "berth runs every model in a worker process of its own.";

/// One client through `berth serve` against the same backend in-process,
/// in alternating rounds (the per-round p50s give the ratio and its
/// spread); then 4 clients, for the queueing.
fn sidecar(server: &Server) {
    const ROUNDS: usize = 20;
    const PER_ROUND: usize = 20;
    let body = json!({ "model": "minilm", "input": TEXT });
    let mut local = local_backend("embed", Some(&default_model("minilm")), &[]);
    let ctx = RequestContext::standalone();
    let mut served = || {
        let t = Instant::now();
        let (status, _) = server.post("/v1/embeddings", body.clone());
        assert_eq!(status, 200);
        t.elapsed()
    };
    let mut here = || {
        let t = Instant::now();
        local
            .handle(Body::json(json!({ "input": TEXT }).to_string()), &ctx)
            .unwrap();
        t.elapsed()
    };
    for _ in 0..20 {
        served();
        here();
    }
    let (mut all_served, mut all_here) = (Vec::new(), Vec::new());
    let (mut wall_served, mut wall_here) = (Duration::ZERO, Duration::ZERO);
    let mut rounds = Rounds::new();
    for round in 0..ROUNDS {
        let side =
            |f: &mut dyn FnMut() -> Duration, all: &mut Vec<Duration>, wall: &mut Duration| {
                let started = Instant::now();
                let mut mine: Vec<Duration> = (0..PER_ROUND).map(|_| f()).collect();
                *wall += started.elapsed();
                all.extend(&mine);
                pct_ms(&mut mine, 0.5)
            };
        let (a, b) = if round % 2 == 0 {
            let a = side(&mut served, &mut all_served, &mut wall_served);
            (a, side(&mut here, &mut all_here, &mut wall_here))
        } else {
            let b = side(&mut here, &mut all_here, &mut wall_here);
            (side(&mut served, &mut all_served, &mut wall_served), b)
        };
        rounds.push(a, b);
    }
    println!("| embeddings, 1 text per request | requests/s | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    row(
        "through `berth serve`, 1 client",
        &mut all_served,
        Some(wall_served),
    );
    row(
        "the same backend in-process",
        &mut all_here,
        Some(wall_here),
    );
    let clients = 4;
    let samples = Mutex::new(Vec::new());
    let started = Instant::now();
    std::thread::scope(|scope| {
        for _ in 0..clients {
            scope.spawn(|| {
                let mut mine = Vec::new();
                for _ in 0..(200 / clients) {
                    let t = Instant::now();
                    let (status, _) = server.post("/v1/embeddings", body.clone());
                    assert_eq!(status, 200);
                    mine.push(t.elapsed());
                }
                samples.lock().unwrap().extend(mine);
            });
        }
    });
    let wall = started.elapsed();
    row(
        &format!("through `berth serve`, {clients} clients"),
        &mut samples.into_inner().unwrap(),
        Some(wall),
    );
    println!("\n| what | berth | baseline | ratio of p50s, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    rounds.print(
        "embedding latency, 1 client, p50",
        "through `berth serve`",
        "in-process",
        "ms",
        1.0,
    );
    println!();
}

fn swaps(server: &Server) {
    let body = json!({ "model": "minilm", "input": TEXT });
    let mut steady = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        server.post("/v1/embeddings", body.clone());
        steady.push(t.elapsed());
    }
    let during = Mutex::new(Vec::new());
    let switches = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let (status, _) = server.post("/v1/embeddings", body.clone());
                assert_eq!(status, 200, "no request fails during a swap");
                during.lock().unwrap().push(t.elapsed());
            }
        });
        let spec = json!({ "backend": "embed", "model": default_model("minilm") });
        for _ in 0..5 {
            std::thread::sleep(Duration::from_millis(300));
            let t = Instant::now();
            let (status, report) = server.post("/api/models/minilm/swap", spec.clone());
            assert_eq!(status, 200, "{report}");
            switches.lock().unwrap().push((
                Duration::from_secs_f64(report["switch_ms"].as_f64().unwrap() / 1e3),
                t.elapsed(),
            ));
        }
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
    });
    let switches = switches.into_inner().unwrap();
    let mut to_serving: Vec<Duration> = switches.iter().map(|s| s.0).collect();
    let mut whole: Vec<Duration> = switches.iter().map(|s| s.1).collect();
    println!("\n| swap of `minilm` (5 swaps) | p50 | max |");
    println!("|---|---|---|");
    println!(
        "| swap call → new worker serving | {:.1} ms | {:.1} ms |",
        pct_ms(&mut to_serving, 0.5),
        pct_ms(&mut to_serving, 1.0)
    );
    println!(
        "| whole swap (old worker drained and stopped) | {:.1} ms | {:.1} ms |",
        pct_ms(&mut whole, 0.5),
        pct_ms(&mut whole, 1.0)
    );
    println!("\n| embedding latency, 1 client | requests/s | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    row("steady state", &mut steady, None);
    row(
        "while swapping 5 times",
        &mut during.into_inner().unwrap(),
        None,
    );
}

/// Recycling against never recycling, in the same run: three `hog`
/// models that leak alike take turns (each side in each place in turn),
/// 150 requests a side a round; the per-round p50s give the ratio and its
/// spread. Every recycle of the `max_requests` model falls inside some
/// round.
async fn recycling() {
    const ROUNDS: usize = 20;
    const PER_ROUND: usize = 150;
    let sup = Supervisor::new(test_config());
    let leak = |name: &str| {
        ModelSpec::new(name, "hog")
            .option("alloc_mib", 64)
            .option("leak_kib_per_request", 256)
    };
    sup.load(leak("steady")).await.unwrap();
    let mut recycled = leak("recycled");
    recycled.max_requests = Some(500);
    sup.load(recycled).await.unwrap();
    let mut held = leak("held");
    held.max_rss = Some(96 << 20);
    sup.load(held).await.unwrap();
    let models = ["steady", "recycled", "held"];
    let mut all: [Vec<Duration>; 3] = Default::default();
    let (mut by_requests, mut by_rss) = (Rounds::new(), Rounds::new());
    let mut i = 0u64;
    for round in 0..ROUNDS {
        let mut p50 = [0.0; 3];
        for k in 0..3 {
            let side = (round + k) % 3;
            let mut samples = Vec::with_capacity(PER_ROUND);
            for _ in 0..PER_ROUND {
                i += 1;
                let t = Instant::now();
                sup.request(models[side], Body::json(format!("{{\"i\":{i}}}")))
                    .await
                    .unwrap();
                samples.push(t.elapsed());
            }
            p50[side] = pct_ms(&mut samples, 0.5);
            all[side].extend(samples);
        }
        by_requests.push(p50[1], p50[0]);
        by_rss.push(p50[2], p50[0]);
    }
    println!(
        "\n| `hog` 64 MiB leaking 256 KiB per request, 1 client, {} requests each | recycles | p50 | p99 | max |",
        ROUNDS * PER_ROUND
    );
    println!("|---|---|---|---|---|");
    for (side, what) in [
        "never recycled (steady state)",
        "`max_requests = 500`: swap-style, old worker serves until the new one is ready",
        "`max_rss = 96MiB`: past the limit, requests wait for the new worker",
    ]
    .into_iter()
    .enumerate()
    {
        let recycles = berth_tests::counters_of(&sup, models[side])
            .recycles
            .load(Ordering::Relaxed);
        let samples = &mut all[side];
        println!(
            "| {what} | {recycles} | {:.2} ms | {:.2} ms | {:.2} ms |",
            pct_ms(samples, 0.5),
            pct_ms(samples, 0.99),
            pct_ms(samples, 1.0)
        );
    }
    println!("\n| what | berth | baseline | ratio of p50s, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    by_requests.print(
        "request latency, p50",
        "recycled by `max_requests`",
        "never recycled",
        "µs",
        1e3,
    );
    by_rss.print(
        "request latency, p50",
        "recycled by `max_rss`",
        "never recycled",
        "µs",
        1e3,
    );
    sup.shutdown().await;
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if std::env::args().any(|a| a == "--recycling") {
        println!("Recycling ({})", machine());
        return runtime().block_on(recycling());
    }
    println!("Sidecar ({})\n", machine());
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        minilm.display()
    ));
    sidecar(&server);
    swaps(&server);
    drop(server);
    runtime().block_on(recycling());
}
