//! An in-place upgrade under steady load: the longest time a request
//! waited, and its p99, in rounds with an upgrade (`POST /api/upgrade` in
//! the middle of the round) and without, taking turns on the same server.
//! Four clients send requests back to back, two to an `ipc-channel`
//! worker's echo and two relayed to an HTTP server
//! (`tests/python/fake_upstream.py`); every upgrade is to the binary the
//! server runs (the handover is the same whatever the new binary).
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench upgrade`

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth_tests::bench::{Rounds, machine, pct_ms};
use berth_tests::{Server, StopOnDrop, wait_for};
use serde_json::{Value, json};

const ROUNDS: usize = 8;
const ROUND: Duration = Duration::from_secs(3);
const CLIENTS: [&str; 4] = ["ipc", "fake", "ipc", "fake"];

fn request(server: &Server, model: &str, n: u64) -> u16 {
    match model {
        "fake" => server
            .post(
                "/v1/chat/completions",
                json!({"model": "fake", "messages": [{"role": "user", "content": format!("{n}")}]}),
            )
            .0,
        _ => server.post("/api/models/ipc/infer", json!({"n": n})).0,
    }
}

fn upgrades(server: &Server) -> usize {
    server
        .events()
        .iter()
        .filter(|e| e["type"] == "upgraded")
        .count()
}

/// One round: every request's wait, how many failed, and (with an
/// upgrade) how long the handover held new connections.
fn round(server: &Server, upgrade: bool) -> (Vec<Duration>, usize, Option<u64>) {
    let stop = AtomicBool::new(false);
    let before = upgrades(server);
    let (waits, failed) = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let clients: Vec<_> = CLIENTS
            .iter()
            .map(|model| {
                let (server, stop) = (server, &stop);
                scope.spawn(move || {
                    let (mut waits, mut failed, mut n) = (Vec::new(), 0, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        n += 1;
                        let t = Instant::now();
                        if request(server, model, n) != 200 {
                            failed += 1;
                        }
                        waits.push(t.elapsed());
                    }
                    (waits, failed)
                })
            })
            .collect();
        std::thread::sleep(ROUND / 2);
        if upgrade {
            let (status, reply) = server.post("/api/upgrade", json!({}));
            assert_eq!(status, 202, "{reply}");
        }
        std::thread::sleep(ROUND / 2);
        stop.store(true, Ordering::Relaxed);
        let mut waits = Vec::new();
        let mut failed = 0;
        for client in clients {
            let (w, f) = client.join().unwrap();
            waits.extend(w);
            failed += f;
        }
        (waits, failed)
    });
    let held = upgrade.then(|| {
        assert!(
            wait_for(Duration::from_secs(30), || upgrades(server) > before),
            "no upgrade"
        );
        let event: Value = server
            .events()
            .into_iter()
            .rev()
            .find(|e| e["type"] == "upgraded")
            .unwrap();
        assert_eq!(event["lost"], json!([]), "{event}");
        event["held_ms"].as_u64().unwrap_or(0)
    });
    (waits, failed, held)
}

fn main() {
    println!("{}", machine());
    let server = Server::start(&berth_tests::upgrade::three_wires());
    for model in ["ipc", "fake"] {
        let (status, reply) = server.post(&format!("/api/models/{model}/load"), json!({}));
        assert_eq!(status, 200, "{reply}");
    }
    let pids: Vec<u64> = server
        .ps()
        .iter()
        .filter_map(|m| m["pid"].as_u64())
        .collect();
    let (mut max, mut p99, mut p50) = (Rounds::new(), Rounds::new(), Rounds::new());
    let (mut sent, mut failed, mut held) = ([0usize; 2], [0usize; 2], Vec::new());
    for n in 0..ROUNDS {
        // The order flips each round.
        let order = if n % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        let mut figures = [(0.0, 0.0, 0.0); 2];
        for upgrade in order {
            let (mut waits, lost, handover) = round(&server, upgrade);
            let side = usize::from(!upgrade);
            sent[side] += waits.len();
            failed[side] += lost;
            held.extend(handover);
            figures[side] = (
                pct_ms(&mut waits, 1.0),
                pct_ms(&mut waits, 0.99),
                pct_ms(&mut waits, 0.5),
            );
        }
        max.push(figures[0].0, figures[1].0);
        p99.push(figures[0].1, figures[1].1);
        p50.push(figures[0].2, figures[1].2);
    }
    let after: Vec<u64> = server
        .ps()
        .iter()
        .filter_map(|m| m["pid"].as_u64())
        .collect();
    assert_eq!(pids, after, "every worker kept");
    println!(
        "\n{ROUNDS} rounds a side of {} s, 4 clients back to back; {} upgrades, every worker kept",
        ROUND.as_secs(),
        upgrades(&server)
    );
    println!(
        "requests: with an upgrade {} ({} failed), without {} ({} failed)",
        sent[0], failed[0], sent[1], failed[1]
    );
    held.sort();
    println!(
        "new connections held by the handover: {:?} ms (median {} ms)",
        held,
        held[held.len() / 2]
    );
    println!("\n| a round's requests | with an upgrade | without | ratio (p10–p90) | rounds |");
    println!("|---|---|---|---|---|");
    max.print("longest wait", "", "", "ms", 1.0);
    p99.print("p99", "", "", "ms", 1.0);
    p50.print("p50", "", "", "ms", 1.0);
}
