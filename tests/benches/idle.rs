//! What idle workers cost the supervisor: for 1, 16 and 64 loaded `echo`
//! workers receiving nothing, the supervisor's CPU (heartbeats, readers,
//! procfs sampling), its RSS and its threads, and the workers' own CPU.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench idle`

use std::time::{Duration, Instant};

use berth::{ModelSpec, Supervisor};
use berth_tests::bench::{cpu_nanos, machine, median, percentile, runtime};
use berth_tests::test_config;

/// utime + stime of `pid` (or this process), in seconds.
fn cpu_seconds(pid: Option<u32>) -> f64 {
    let process = match pid {
        Some(pid) => procfs::process::Process::new(pid as i32),
        None => procfs::process::Process::myself(),
    };
    process
        .and_then(|p| p.stat())
        .map(|s| (s.utime + s.stime) as f64 / procfs::ticks_per_second() as f64)
        .unwrap_or(0.0)
}

fn own_status() -> (u64, u64) {
    procfs::process::Process::myself()
        .and_then(|p| p.status())
        .map(|s| (s.vmrss.unwrap_or(0) * 1024, s.threads))
        .unwrap_or((0, 0))
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runtime = runtime();
    println!("Idle workers ({})\n", machine());
    println!(
        "| idle `echo` workers | supervisor CPU, 20 s | 2 s windows: median (p10–p90) | per worker | supervisor RSS | supervisor threads | workers' CPU, all together |"
    );
    println!("|---|---|---|---|---|---|---|");
    runtime.block_on(async {
        let sup = Supervisor::new(test_config());
        let mut loaded = 0;
        for n in [1usize, 16, 64] {
            while loaded < n {
                sup.load(ModelSpec::new(format!("idle-{loaded}"), "echo"))
                    .await
                    .unwrap();
                loaded += 1;
            }
            // Let the loads' own work settle, then watch 20 s of nothing.
            tokio::time::sleep(Duration::from_secs(3)).await;
            let pids: Vec<u32> = sup.stats().iter().filter_map(|m| m.pid).collect();
            let own = cpu_seconds(None);
            let workers: f64 = pids.iter().map(|p| cpu_seconds(Some(*p))).sum();
            let started = Instant::now();
            // Ten windows of 2 s: the spread of the supervisor's CPU.
            let mut windows = Vec::new();
            for _ in 0..10 {
                let (t, before) = (Instant::now(), cpu_nanos(std::process::id()));
                tokio::time::sleep(Duration::from_secs(2)).await;
                let used = cpu_nanos(std::process::id()).saturating_sub(before) as f64 / 1e9;
                windows.push(used / t.elapsed().as_secs_f64() * 100.0);
            }
            let wall = started.elapsed().as_secs_f64();
            let own = (cpu_seconds(None) - own) / wall * 100.0;
            let workers = (pids.iter().map(|p| cpu_seconds(Some(*p))).sum::<f64>() - workers)
                / wall
                * 100.0;
            let spread = format!(
                "{:.2}% ({:.2}–{:.2}%)",
                median(&mut windows),
                percentile(&mut windows, 0.1),
                percentile(&mut windows, 0.9)
            );
            let (rss, threads) = own_status();
            println!(
                "| {n} | {own:.2}% of a core | {spread} | {:.3}% | {:.1} MiB | {threads} | {workers:.2}% of a core |",
                own / n as f64,
                rss as f64 / (1 << 20) as f64,
            );
        }
        sup.shutdown().await;
    });
}
