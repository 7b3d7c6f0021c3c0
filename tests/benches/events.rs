//! What following the event stream costs `berth serve`: its RSS and CPU
//! with 0 and with 100 open `/api/events` streams while a model is loaded
//! and unloaded, in alternating rounds; printed as docs/http-api.md's
//! figures (and the README's).
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench events`

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use berth_tests::Server;
use berth_tests::bench::{cpu_nanos, machine, median};
use serde_json::json;

const CYCLES: usize = 20;
const ROUNDS: usize = 3;

fn rss_mib(pid: u32) -> f64 {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.status())
        .map(|s| s.vmrss.unwrap_or(0) as f64 / 1024.0)
        .unwrap_or(0.0)
}

/// The last event's number.
fn last_id(server: &Server) -> u64 {
    let reply = server.raw("GET", "/api/events?follow=false", &[], None);
    reply
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("id: "))
        .filter_map(|id| id.parse().ok())
        .max()
        .unwrap_or(0)
}

/// `n` followers reading the stream after event `since`, each counting.
fn follow(port: u16, n: usize, since: u64) -> (Vec<TcpStream>, Arc<AtomicU64>) {
    let seen = Arc::new(AtomicU64::new(0));
    let mut streams = Vec::new();
    for _ in 0..n {
        let mut conn = TcpStream::connect(("127.0.0.1", port)).unwrap();
        write!(
            conn,
            "GET /api/events?since={since} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n"
        )
        .unwrap();
        let reader = conn.try_clone().unwrap();
        let seen = Arc::clone(&seen);
        std::thread::spawn(move || {
            for line in BufReader::new(reader).lines() {
                match line {
                    Ok(l) if l.starts_with("data: ") => {
                        seen.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
        });
        streams.push(conn);
    }
    (streams, seen)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let server = Server::start("[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    let (pid, port) = (server.pid(), server.port());
    let cycles = || {
        for _ in 0..CYCLES {
            assert_eq!(server.post("/api/models/e/load", json!({})).0, 200);
            assert_eq!(server.post("/api/models/e/unload", json!({})).0, 200);
        }
    };
    cycles(); // warm
    let (mut cpu, mut rss) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    let mut delivered = Vec::new();
    for _ in 0..ROUNDS {
        for (side, followers) in [(0, 0usize), (1, 100)] {
            let (streams, seen) = follow(port, followers, last_id(&server));
            std::thread::sleep(Duration::from_millis(500));
            rss[side].push(rss_mib(pid));
            let before = cpu_nanos(pid);
            cycles();
            let used = cpu_nanos(pid) - before;
            cpu[side].push(used as f64 / 1e6 / CYCLES as f64);
            std::thread::sleep(Duration::from_millis(300));
            if followers > 0 {
                delivered.push(seen.load(Ordering::Relaxed) as f64 / followers as f64);
            }
            for conn in &streams {
                // The reader threads hold clones: close the connection itself.
                let _ = conn.shutdown(std::net::Shutdown::Both);
            }
            drop(streams);
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    println!("### Following the event stream ({})\n", machine());
    println!(
        "| open `/api/events` streams | `berth serve` RSS | its CPU per load + unload (3 events), median of {ROUNDS} rounds | events each stream got |"
    );
    println!("|---|---|---|---|");
    for (side, n) in [(0, 0), (1, 100)] {
        println!(
            "| {n} | {:.1} MiB | {:.2} ms | {} |",
            median(&mut rss[side]),
            median(&mut cpu[side]),
            if n == 0 {
                "".to_string()
            } else {
                format!("{:.0} of {}", median(&mut delivered), 3 * CYCLES)
            }
        );
    }
}
