//! What an inference gateway's endpoint picker costs a berth: it scrapes
//! `/metrics` every 50 ms by default (20 a second, per pod). A scrape's
//! time and berth's CPU for it (`schedstat` of berth's own threads; the
//! workers' are not counted), with 16 models loaded, against `/healthz`,
//! the cheapest answer berth gives, in rounds taking turns on one server.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench metrics`

use std::time::{Duration, Instant};

use berth_tests::Server;
use berth_tests::bench::{Rounds, cpu_nanos, machine, pct_ms};
use serde_json::json;

const MODELS: usize = 16;
const ROUNDS: usize = 10;
const PER_ROUND: usize = 400;

/// One round of `PER_ROUND` GETs of `path`, one after the other: the
/// median time (ms) and berth's CPU per request (µs).
fn round(server: &Server, path: &str) -> (f64, f64) {
    let cpu = cpu_nanos(server.pid());
    let mut waits: Vec<Duration> = (0..PER_ROUND)
        .map(|_| {
            let t = Instant::now();
            let reply = server.raw("GET", path, &[], None);
            assert_eq!(reply.status, 200, "{path}");
            t.elapsed()
        })
        .collect();
    let cpu_us = (cpu_nanos(server.pid()) - cpu) as f64 / 1e3 / PER_ROUND as f64;
    (pct_ms(&mut waits, 0.5), cpu_us)
}

fn main() {
    println!("{}", machine());
    let config: String = (0..MODELS)
        .map(|i| format!("[[model]]\nname = \"m{i}\"\nbackend = \"echo\"\n"))
        .collect();
    let server = Server::start(&format!("public_metrics = true\n{config}"));
    for i in 0..MODELS {
        let (status, reply) = server.post(&format!("/api/models/m{i}/load"), json!({}));
        assert_eq!(status, 200, "{reply}");
    }
    let bytes = server.raw("GET", "/metrics", &[], None).body.len();
    let (mut time, mut cpu) = (Rounds::new(), Rounds::new());
    for n in 0..ROUNDS {
        let order = if n % 2 == 0 {
            ["/metrics", "/healthz"]
        } else {
            ["/healthz", "/metrics"]
        };
        let mut figures = [(0.0, 0.0); 2];
        for path in order {
            figures[usize::from(path == "/healthz")] = round(&server, path);
        }
        time.push(figures[0].0, figures[1].0);
        cpu.push(figures[0].1, figures[1].1);
    }
    let mut per_scrape = cpu.a.clone();
    let median_us = berth_tests::bench::median(&mut per_scrape);
    println!(
        "\n{MODELS} models loaded, /metrics {bytes} bytes; {ROUNDS} rounds a side of {PER_ROUND} \
         requests one after the other"
    );
    println!("\n| a request | /metrics | /healthz | ratio (p10–p90) | rounds |");
    println!("|---|---|---|---|---|");
    time.print("time (median)", "", "", "µs", 1e3);
    cpu.print("berth's CPU", "", "", "µs", 1.0);
    println!(
        "\nat the endpoint picker's 20 scrapes a second: {:.2}% of a core",
        median_us * 20.0 / 1e4
    );
}
