//! Core benchmarks, printed as the README's table.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench core`
//!
//! - echo round trip through a worker vs the same backend called in-process;
//! - a 64 MiB payload through the worker in shared memory vs inside the
//!   message, next to a plain memcpy;
//! - spawn → ready for `echo`;
//! - unload time and reclaimed bytes for `hog` at 1 GiB.

use std::time::{Duration, Instant};

use berth::{Body, Bulk, ModelSpec, Supervisor};
use berth_protocol::LoadSpec;
use berth_tests::test_config;
use berth_worker::{LoadContext, Registry, RequestContext};
use ipc_channel::ipc::IpcSharedMemory;

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize]
}

fn us(d: Duration) -> String {
    format!("{:.2} µs", d.as_secs_f64() * 1e6)
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn row(what: &str, p50: String, p99: String) {
    println!("| {what} | {p50} | {p99} |");
}

async fn round_trips(sup: &Supervisor) {
    const N: usize = 5000;
    let body = || Body::json(r#"{"input":"hello"}"#);
    sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
    let worker = sup.worker("echo").unwrap();
    for _ in 0..500 {
        worker.call(body()).await.unwrap();
    }
    let mut ipc = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        worker.call(body()).await.unwrap();
        ipc.push(t.elapsed());
    }
    sup.unload("echo").await.unwrap();

    let spec = LoadSpec {
        name: "echo".into(),
        backend: "echo".into(),
        model: None,
        options: Default::default(),
    };
    let mut backend = Registry::builtin()
        .load(&spec, &LoadContext::standalone())
        .unwrap();
    let ctx = RequestContext::standalone();
    let mut local = Vec::with_capacity(N);
    for _ in 0..N {
        let t = Instant::now();
        std::hint::black_box(backend.handle(body(), &ctx).unwrap());
        local.push(t.elapsed());
    }
    row(
        "echo round trip, through a worker",
        us(percentile(&mut ipc, 0.5)),
        us(percentile(&mut ipc, 0.99)),
    );
    row(
        "echo call, in-process",
        us(percentile(&mut local, 0.5)),
        us(percentile(&mut local, 0.99)),
    );
}

async fn bulk(sup: &Supervisor) {
    const SIZE: usize = 64 << 20;
    const N: usize = 10;
    sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
    let worker = sup.worker("echo").unwrap();
    let data: Vec<u8> = (0..SIZE).map(|i| (i % 253) as u8).collect();

    let mut fresh = Vec::new();
    for _ in 0..N {
        let t = Instant::now();
        let shm = IpcSharedMemory::from_bytes(&data);
        let reply = worker
            .call(Body {
                json: String::new(),
                bulk: Bulk::Shared(shm),
            })
            .await
            .unwrap();
        assert_eq!(reply.bulk_bytes().len(), SIZE);
        fresh.push(t.elapsed());
    }
    let region = IpcSharedMemory::from_bytes(&data);
    let mut reused = Vec::new();
    for _ in 0..N {
        let t = Instant::now();
        let reply = worker
            .call(Body {
                json: String::new(),
                bulk: Bulk::Shared(region.clone()),
            })
            .await
            .unwrap();
        assert_eq!(reply.bulk_bytes().len(), SIZE);
        reused.push(t.elapsed());
    }
    let mut inline = Vec::new();
    for _ in 0..N {
        let t = Instant::now();
        let reply = worker
            .call(Body {
                json: String::new(),
                bulk: Bulk::Inline(data.clone()),
            })
            .await
            .unwrap();
        assert_eq!(reply.bulk_bytes().len(), SIZE);
        inline.push(t.elapsed());
    }
    sup.unload("echo").await.unwrap();
    let mut copy = Vec::new();
    let mut dst = vec![0u8; SIZE];
    for _ in 0..N {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&data));
        std::hint::black_box(&dst);
        copy.push(t.elapsed());
    }
    row(
        "64 MiB round trip, new shared region each time",
        ms(percentile(&mut fresh, 0.5)),
        ms(percentile(&mut fresh, 0.99)),
    );
    row(
        "64 MiB round trip, reused shared region",
        ms(percentile(&mut reused, 0.5)),
        ms(percentile(&mut reused, 0.99)),
    );
    row(
        "64 MiB round trip, copied inside the message",
        ms(percentile(&mut inline, 0.5)),
        ms(percentile(&mut inline, 0.99)),
    );
    row(
        "64 MiB plain memcpy, in-process (one way)",
        ms(percentile(&mut copy, 0.5)),
        ms(percentile(&mut copy, 0.99)),
    );
}

async fn spawn_to_ready(sup: &Supervisor) {
    const N: usize = 50;
    let mut loads = Vec::new();
    let mut unloads = Vec::new();
    for _ in 0..N {
        let t = Instant::now();
        sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
        loads.push(t.elapsed());
        let t = Instant::now();
        sup.unload("echo").await.unwrap();
        unloads.push(t.elapsed());
    }
    row(
        "spawn → ready, `echo`",
        ms(percentile(&mut loads, 0.5)),
        ms(percentile(&mut loads, 0.99)),
    );
    row(
        "unload (graceful), `echo`",
        ms(percentile(&mut unloads, 0.5)),
        ms(percentile(&mut unloads, 0.99)),
    );
}

async fn hog_unload(sup: &Supervisor) {
    const N: usize = 3;
    let mut took = Vec::new();
    let mut reclaimed = Vec::new();
    for _ in 0..N {
        sup.load(ModelSpec::new("hog", "hog").option("alloc_mib", 1024))
            .await
            .unwrap();
        let report = sup.unload("hog").await.unwrap();
        took.push(Duration::from_secs_f64(report.took_ms / 1e3));
        reclaimed.push(report.reclaimed_bytes);
    }
    row(
        "unload `hog` at 1 GiB",
        ms(percentile(&mut took, 0.5)),
        ms(percentile(&mut took, 0.99)),
    );
    let min = reclaimed.iter().min().unwrap();
    println!(
        "| reclaimed by that unload (min of {N}) | {:.1} MiB ({:.1}% of 1 GiB) | |",
        *min as f64 / (1 << 20) as f64,
        *min as f64 / (1u64 << 30) as f64 * 100.0
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let sup = Supervisor::new(test_config());
        println!("| what | p50 | p99 |");
        println!("|---|---|---|");
        round_trips(&sup).await;
        bulk(&sup).await;
        spawn_to_ready(&sup).await;
        hog_unload(&sup).await;
    });
}
