//! Model benchmarks, printed as docs/performance.md's tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench models`
//! (fetches the default models first if they are missing). The status quo
//! beside berth is also drawn: `docs/status-quo-candle.svg`.
//!
//! `... --bench models -- status-quo` runs only that part (the cycles
//! always run; `speed` adds the rest).

use std::time::{Duration, Instant};

use berth::{Body, ModelSpec, Supervisor};
use berth_tests::bench::{Rounds, machine, own_rss};
use berth_tests::{default_model, local_backend, test_config};
use berth_worker::{Backend, RequestContext};
use serde_json::json;

fn sentences(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            format!(
                "This is sentence number {i}, about {} things.",
                ["cats", "markets", "rivers", "code"][i % 4]
            )
        })
        .collect()
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

fn local_embed(options: &[(&str, &str)]) -> Box<dyn Backend> {
    local_backend("embed", Some(&default_model("minilm")), options)
}

/// Load / use / drop cycles, in-process and through berth.
const CYCLES: usize = 10;

/// The status quo: load in-process, work, drop everything, `CYCLES` times;
/// the process's RSS before, after each load-and-use and after each drop,
/// and after a last `malloc_trim(0)`.
fn in_process_cycles() -> (u64, Vec<u64>, Vec<u64>, u64) {
    let before = own_rss();
    let (mut loaded, mut dropped) = (Vec::new(), Vec::new());
    for _ in 0..CYCLES {
        {
            let mut backend = local_embed(&[("load_mode", "read")]);
            let ctx = RequestContext::standalone();
            for chunk in sentences(256).chunks(32) {
                backend
                    .handle(Body::json(json!({ "input": chunk }).to_string()), &ctx)
                    .unwrap();
            }
            loaded.push(own_rss());
        }
        dropped.push(own_rss());
    }
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe { libc::malloc_trim(0) };
    (before, loaded, dropped, own_rss())
}

/// Sentences per second of `calls` calls of `call` on `batch` sentences each.
fn throughput(
    call: &mut impl FnMut(&[String]),
    texts: &[String],
    batch: usize,
    calls: usize,
) -> f64 {
    let started = Instant::now();
    for i in 0..calls {
        let at = (i * batch) % (texts.len() - batch + 1);
        call(&texts[at..at + batch]);
    }
    (calls * batch) as f64 / started.elapsed().as_secs_f64()
}

/// Through a worker and in-process, both loaded, in alternating rounds (the
/// order flips each round): the ratio comes from figures taken seconds
/// apart, never from two runs of the machine's noise.
async fn embed_speed(sup: &Supervisor) {
    sup.load(ModelSpec::new("minilm", "embed").model(default_model("minilm")))
        .await
        .unwrap();
    let worker = sup.worker("minilm").unwrap();
    let handle = tokio::runtime::Handle::current();
    let mut local = local_embed(&[]);
    let ctx = RequestContext::standalone();
    let texts = sentences(256);
    let mut remote = |texts: &[String]| {
        handle
            .block_on(worker.call(Body::json(json!({ "input": texts }).to_string())))
            .unwrap();
    };
    let mut here = |texts: &[String]| {
        local
            .handle(Body::json(json!({ "input": texts }).to_string()), &ctx)
            .unwrap();
    };
    println!(
        "| batch | through a worker | in-process | worker / in-process, median (p10–p90) | samples |"
    );
    println!("|---|---|---|---|---|");
    // (batch, calls per side per round, rounds): about 0.2 s a side a round.
    for (batch, calls, rounds_n) in [(1, 16, 25), (32, 2, 21)] {
        let mut rounds = Rounds::new();
        tokio::task::block_in_place(|| {
            // Warm-up, both sides.
            throughput(&mut remote, &texts, batch, calls);
            throughput(&mut here, &texts, batch, calls);
            for round in 0..rounds_n {
                let (a, b) = if round % 2 == 0 {
                    let a = throughput(&mut remote, &texts, batch, calls);
                    (a, throughput(&mut here, &texts, batch, calls))
                } else {
                    let b = throughput(&mut here, &texts, batch, calls);
                    (throughput(&mut remote, &texts, batch, calls), b)
                };
                rounds.push(a, b);
            }
        });
        rounds.print(&format!("{batch}"), "", "", "sentences/s", 1.0);
    }
    sup.unload("minilm").await.unwrap();
}

async fn load_modes(sup: &Supervisor, name: &str, backend: &str) {
    for mode in ["mmap", "read"] {
        let mut times = Vec::new();
        let mut peaks = Vec::new();
        let mut rss = Vec::new();
        for _ in 0..3 {
            let spec = ModelSpec::new(name, backend)
                .model(default_model(name))
                .option("load_mode", mode);
            let report = sup.load(spec).await.unwrap();
            times.push(Duration::from_secs_f64(report.load_ms / 1e3));
            peaks.push(report.peak_rss_bytes);
            rss.push(report.rss_bytes);
            sup.unload(name).await.unwrap();
        }
        times.sort();
        println!(
            "| {name} | {mode} | {:.0} ms | {} | {} |",
            times[1].as_secs_f64() * 1e3,
            mib(*rss.iter().max().unwrap()),
            mib(*peaks.iter().max().unwrap())
        );
    }
}

/// The same cycles through a worker: the host's RSS before, the host's
/// plus its worker's after each load-and-use, the host's (and whatever
/// the worker left: nothing) after each unload.
async fn berth_cycles(sup: &Supervisor) -> (u64, Vec<u64>, Vec<u64>, u64) {
    let before = own_rss();
    let spec = ModelSpec::new("minilm", "embed")
        .model(default_model("minilm"))
        .option("load_mode", "read");
    let (mut loaded, mut dropped, mut worker_left) = (Vec::new(), Vec::new(), 0);
    for _ in 0..CYCLES {
        sup.load(spec.clone()).await.unwrap();
        for chunk in sentences(256).chunks(32) {
            sup.request("minilm", Body::json(json!({ "input": chunk }).to_string()))
                .await
                .unwrap();
        }
        let report = sup.unload("minilm").await.unwrap();
        loaded.push(own_rss() + report.rss_at_stop_bytes);
        worker_left = berth::memory::process_memory(report.pid)
            .map(|m| m.rss_bytes)
            .unwrap_or(0);
        dropped.push(own_rss() + worker_left);
    }
    (before, loaded, dropped, worker_left)
}

/// The two sides' cycles as `docs/status-quo-candle.svg`, in MiB above
/// each process's RSS before its first load.
fn draw(in_process: (u64, &[u64], &[u64]), through_berth: (u64, &[u64], &[u64])) {
    use berth_tests::chart::{BERTH, Cycles, IN_PROCESS, write_cycles_chart};
    let line = |label: &str, color, (before, loaded, dropped): (u64, &[u64], &[u64])| {
        let over = |v: &u64| v.saturating_sub(before) as f64 / (1 << 20) as f64;
        Cycles {
            label: label.into(),
            color,
            before: 0.0,
            loaded: loaded.iter().map(over).collect(),
            dropped: dropped.iter().map(over).collect(),
        }
    };
    write_cycles_chart(
        "status-quo-candle.svg",
        "all-MiniLM-L6-v2 (candle): load, 256 embeddings, drop, 10 times",
        &format!(
            "Memory above the host's own RSS before the first load; berth's line is the host's plus its worker's.\n`cargo bench -p berth-tests --bench models -- status-quo`, {}",
            machine()
        ),
        &[
            line("in one process", IN_PROCESS, in_process),
            line("berth: host + worker", BERTH, through_berth),
        ],
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    default_model("minilm");
    let run = berth_tests::bench::sections();
    // First, in a fresh process: the status quo's residue.
    let (before, loaded, dropped, after_trim) = in_process_cycles();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let sup = Supervisor::new(test_config());
        let (sup_before, sup_loaded, sup_dropped, worker_left) = berth_cycles(&sup).await;
        println!("### Memory left after load (read) + 256 embeddings + unload, {CYCLES} times\n");
        println!("| where | left behind after the 1st cycle | after the {CYCLES}th |");
        println!("|---|---|---|");
        println!(
            "| in-process, after dropping everything | {} | {} |",
            mib(dropped[0].saturating_sub(before)),
            mib(dropped[CYCLES - 1].saturating_sub(before))
        );
        println!(
            "| in-process, after also calling `malloc_trim(0)` | | {} |",
            mib(after_trim.saturating_sub(before))
        );
        println!(
            "| berth: the worker after unload | | {} (process gone) |",
            mib(worker_left)
        );
        println!(
            "| berth: the supervisor's own RSS change | {} | {} |\n",
            mib(sup_dropped[0].saturating_sub(sup_before)),
            mib(sup_dropped[CYCLES - 1].saturating_sub(sup_before))
        );
        draw(
            (before, &loaded, &dropped),
            (sup_before, &sup_loaded, &sup_dropped),
        );
        if !run("speed") {
            return;
        }
        println!(
            "### Embeddings: all-MiniLM-L6-v2, sentences/s ({})\n",
            machine()
        );
        embed_speed(&sup).await;
        println!("\n### Load time and memory by load mode (median of 3 loads, max memory)\n");
        println!("| model | load_mode | load | rss after load | peak rss |");
        println!("|---|---|---|---|---|");
        load_modes(&sup, "minilm", "embed").await;
        if std::env::var_os("BERTH_BENCH_SKIP_GENERATE").is_none() {
            load_modes(&sup, "smollm2", "generate").await;
        }
    });
}
