//! Sidecar and recycling benchmarks, printed as the README's tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench sidecar`

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth::{Body, ModelSpec, Supervisor};
use berth_tests::bench::pct_ms;
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

fn sidecar(server: &Server) {
    let body = json!({ "model": "minilm", "input": TEXT });
    for _ in 0..20 {
        server.post("/v1/embeddings", body.clone());
    }
    println!("| embeddings, 1 text per request | requests/s | p50 | p99 | max |");
    println!("|---|---|---|---|---|");
    for clients in [1usize, 4] {
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
            &format!("through `berth serve`, {clients} client(s)"),
            &mut samples.into_inner().unwrap(),
            Some(wall),
        );
    }
    let mut local = local_backend("embed", Some(&default_model("minilm")), &[]);
    let ctx = RequestContext::standalone();
    let mut samples = Vec::new();
    let started = Instant::now();
    for _ in 0..200 {
        let t = Instant::now();
        local
            .handle(Body::json(json!({ "input": TEXT }).to_string()), &ctx)
            .unwrap();
        samples.push(t.elapsed());
    }
    row(
        "the same backend in-process",
        &mut samples,
        Some(started.elapsed()),
    );
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

async fn recycling() {
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
    println!(
        "\n| `hog` 64 MiB leaking 256 KiB per request, 3000 requests, 1 client | recycles | p50 | p99 | max |"
    );
    println!("|---|---|---|---|---|");
    for (model, what) in [
        ("steady", "never recycled (steady state)"),
        (
            "recycled",
            "`max_requests = 500`: swap-style, old worker serves until the new one is ready",
        ),
        (
            "held",
            "`max_rss = 96MiB`: past the limit, requests wait for the new worker",
        ),
    ] {
        let mut samples = Vec::new();
        for i in 0..3000 {
            let t = Instant::now();
            sup.request(model, Body::json(format!("{{\"i\":{i}}}")))
                .await
                .unwrap();
            samples.push(t.elapsed());
        }
        let recycles = berth_tests::counters_of(&sup, model)
            .recycles
            .load(Ordering::Relaxed);
        println!(
            "| {what} | {recycles} | {:.2} ms | {:.2} ms | {:.2} ms |",
            pct_ms(&mut samples, 0.5),
            pct_ms(&mut samples, 0.99),
            pct_ms(&mut samples, 1.0)
        );
    }
    sup.shutdown().await;
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        minilm.display()
    ));
    sidecar(&server);
    swaps(&server);
    drop(server);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(recycling());
}
