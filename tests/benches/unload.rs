//! The unload of a worker holding 1 GiB beside the kernel's own cost of
//! the same: a plain process holding 1 GiB, SIGKILLed and reaped. Both in
//! the same run, in alternating rounds, with the ratio's spread: berth's
//! stop (Shutdown, wait, reap, sweep the group, measure) against the floor
//! no supervisor can go below.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench unload`

use std::time::Duration;

use berth::{ModelSpec, Supervisor};
use berth_tests::bench::{Rounds, kernel_kill_1gib, machine, runtime};
use berth_tests::test_config;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runtime = runtime();
    println!("Unload ({})\n", machine());
    println!("| what | berth | baseline | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    runtime.block_on(async {
        let sup = Supervisor::new(test_config());
        let spec = ModelSpec::new("hog", "hog").option("alloc_mib", 1024);
        let mut rounds = Rounds::new();
        let mut reclaimed = Vec::new();
        for round in 0..12 {
            sup.load(spec.clone()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut unload = async || {
                let report = sup.unload("hog").await.unwrap();
                reclaimed.push(report.reclaimed_bytes as f64 / (1u64 << 20) as f64);
                report.took_ms / 1e3
            };
            let (a, b) = if round % 2 == 0 {
                let a = unload().await;
                (a, kernel_kill_1gib())
            } else {
                let b = kernel_kill_1gib();
                (unload().await, b)
            };
            rounds.push(a, b);
        }
        rounds.print(
            "stop a process holding 1 GiB",
            "unload of `hog` at 1 GiB (graceful)",
            "SIGKILL → reaped, plain process",
            "ms",
            1e3,
        );
        reclaimed.sort_by(f64::total_cmp);
        println!(
            "\nreclaimed per unload: min {:.1} MiB, median {:.1} MiB",
            reclaimed[0],
            reclaimed[reclaimed.len() / 2]
        );
        sup.shutdown().await;
    });
}
