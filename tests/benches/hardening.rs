//! What hostile or careless clients cost `berth serve`, printed as the
//! hardening tables of docs/performance.md: slow-header connections held and shed, the
//! supervisor's memory after a large answer, and request latency while a
//! client polls `/api/ps` against 64 loaded models.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench hardening`

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use berth_tests::bench::{Rounds, machine, pct_ms};
use berth_tests::{Server, default_model};
use serde_json::json;

fn rss_mib(pid: u32) -> f64 {
    berth::memory::resident_bytes(pid).unwrap_or(0) as f64 / (1u64 << 20) as f64
}

/// 1,000 clients each send half a request head and stop.
fn slow_headers() {
    const SLOW: usize = 1000;
    let server = Server::start("[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    let port = server.port();
    std::thread::sleep(Duration::from_millis(100));
    let opened = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..SLOW {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            let _ = s.write_all(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ");
            slow.push(s);
        }
    }
    // Those past the cap were answered 503 at once; count them.
    std::thread::sleep(Duration::from_millis(300));
    let mut refused = 0;
    for s in &mut slow {
        s.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        if let Ok(n) = s.read(&mut buf)
            && buf[..n].starts_with(b"HTTP/1.1 503")
        {
            refused += 1;
        }
        s.set_nonblocking(false).unwrap();
    }
    let held = slow.len() - refused;
    // Meanwhile: a client already connected (the harness's kept-alive
    // connection) is still served, and a new one is refused at once.
    let t = Instant::now();
    let (status, _) = server.post("/api/models/e/infer", json!({ "input": 1 }));
    let during = t.elapsed();
    let t = Instant::now();
    let mut fresh = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _ = fresh
        .write_all(format!("GET /healthz HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n").as_bytes());
    let mut answer = String::new();
    let _ = fresh.read_to_string(&mut answer);
    let refused_in = t.elapsed();
    let fresh_status = answer
        .split_whitespace()
        .nth(1)
        .unwrap_or("none")
        .to_string();
    // Time until every held connection was shed by the header timeout.
    for s in &mut slow {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    }
    let shed = opened.elapsed();
    let t = Instant::now();
    let (after, _) = server.post("/api/models/e/infer", json!({ "input": 1 }));
    println!("| slow-header clients ({SLOW}, default limits) | figure |");
    println!("|---|---|");
    println!("| held at once (`max_connections`) | {held} |");
    println!("| refused at once with 503 `too_many_connections` | {refused} |");
    println!(
        "| a client already connected, while they are held | HTTP {status} in {:.1} ms |",
        during.as_secs_f64() * 1e3
    );
    println!(
        "| a new connection while they are held | HTTP {fresh_status}, closed in {:.1} ms |",
        refused_in.as_secs_f64() * 1e3
    );
    println!(
        "| all held ones shed (`header_timeout` 10 s) after | {:.1} s |",
        shed.as_secs_f64()
    );
    println!(
        "| a real request afterwards | HTTP {after} in {:.1} ms |",
        t.elapsed().as_secs_f64() * 1e3
    );
    println!();
}

/// One 2,000-text embeddings request (~15 MB of JSON), and what the
/// supervisor holds before, at its peak and after.
fn large_answer() {
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        minilm.display()
    ));
    let (status, _) = server.post(
        "/v1/embeddings",
        json!({ "model": "minilm", "input": "warm" }),
    );
    assert_eq!(status, 200);
    std::thread::sleep(Duration::from_secs(2));
    let pid = server.pid();
    let before = rss_mib(pid);
    let texts: Vec<String> = (0..2000)
        .map(|i| format!("sentence number {i} about ports and berths"))
        .collect();
    let peak = std::sync::Mutex::new(before);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (status, bytes) = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let now = rss_mib(pid);
                let mut p = peak.lock().unwrap();
                *p = p.max(now);
                drop(p);
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let body = json!({ "model": "minilm", "input": texts }).to_string();
        let port = server.port();
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let head = format!(
            "POST /v1/embeddings HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        stream.write_all(head.as_bytes()).unwrap();
        stream.write_all(body.as_bytes()).unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).unwrap();
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        let status: u16 = String::from_utf8_lossy(&answer[..12.min(answer.len())])
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        (status, answer.len())
    });
    assert_eq!(status, 200);
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_mib(pid);
    println!(
        "| supervisor RSS, one 2,000-text embeddings request ({:.1} MB answer) | MiB |",
        bytes as f64 / 1e6
    );
    println!("|---|---|");
    println!("| before | {before:.1} |");
    println!(
        "| peak while answering | {:.1} |",
        peak.into_inner().unwrap()
    );
    println!("| 2 s after | {after:.1} |");
    println!();
}

/// CPU seconds a process has used.
fn cpu_s(pid: u32) -> f64 {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .map(|s| (s.utime + s.stime) as f64 / procfs::ticks_per_second() as f64)
        .unwrap_or(0.0)
}

/// Echo latency through the sidecar with 64 models loaded: idle, while
/// another client polls `/api/ps` ten times a second (a dashboard), and
/// while it polls as fast as it can; with the supervisor's CPU use. The
/// three take turns, 200 requests a side a round, each side in each place
/// in turn; the ratios are of per-round p50s and p99s against idle.
fn ps_polling() {
    const ROUNDS: usize = 12;
    const PER_ROUND: usize = 200;
    let mut config = String::new();
    for i in 0..64 {
        config.push_str(&format!("[[model]]\nname = \"e{i}\"\nbackend = \"echo\"\n"));
    }
    let server = Server::start(&config);
    for i in 0..64 {
        let (status, _) = server.post(&format!("/api/models/e{i}/load"), json!({}));
        assert_eq!(status, 200);
    }
    let pid = server.pid();
    let measure = |server: &Server| {
        let mut samples = Vec::new();
        let (cpu, t) = (cpu_s(pid), Instant::now());
        for _ in 0..PER_ROUND {
            let t = Instant::now();
            let (status, _) = server.post("/api/models/e0/infer", json!({ "input": 1 }));
            assert_eq!(status, 200);
            samples.push(t.elapsed());
        }
        (samples, cpu_s(pid) - cpu, t.elapsed().as_secs_f64())
    };
    let polled = |pause: Option<Duration>| {
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|scope| {
            let poller = scope.spawn(|| {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (status, body) = server.get("/api/ps");
                    assert_eq!(status, 200);
                    assert_eq!(body["models"].as_array().unwrap().len(), 64);
                    n += 1;
                    if let Some(pause) = pause {
                        std::thread::sleep(pause);
                    }
                }
                n
            });
            let result = measure(&server);
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            (result, poller.join().unwrap())
        })
    };
    for _ in 0..50 {
        server.post("/api/models/e0/infer", json!({ "input": 1 }));
    }
    let sides: [(&str, Option<Option<Duration>>); 3] = [
        ("idle", None),
        (
            "a client polls `/api/ps` 10 times a second",
            Some(Some(Duration::from_millis(100))),
        ),
        ("a client polls `/api/ps` back to back", Some(None)),
    ];
    let mut all: [Vec<Duration>; 3] = Default::default();
    let mut cpu = [(0.0, 0.0); 3];
    let mut polls = [0u64; 3];
    let mut per_round = [
        (Vec::new(), Vec::new()),
        (Vec::new(), Vec::new()),
        (Vec::new(), Vec::new()),
    ];
    for round in 0..ROUNDS {
        for k in 0..3 {
            let side = (round + k) % 3;
            let ((mut samples, used, wall), n) = match sides[side].1 {
                None => (measure(&server), 0),
                Some(pause) => polled(pause),
            };
            polls[side] += n;
            cpu[side].0 += used;
            cpu[side].1 += wall;
            per_round[side].0.push(pct_ms(&mut samples, 0.5));
            per_round[side].1.push(pct_ms(&mut samples, 0.99));
            all[side].extend(samples);
        }
    }
    println!(
        "| echo through `berth serve`, 64 models loaded, {} requests a side | p50 | p99 | p50 / idle, median (p10–p90) | p99 / idle, median (p10–p90) | supervisor CPU |",
        ROUNDS * PER_ROUND
    );
    println!("|---|---|---|---|---|---|");
    for (side, (what, _)) in sides.iter().enumerate() {
        let ratio = |i: usize| {
            let mut rounds = Rounds::new();
            let (mine, idle) = if i == 0 {
                (&per_round[side].0, &per_round[0].0)
            } else {
                (&per_round[side].1, &per_round[0].1)
            };
            for (a, b) in mine.iter().zip(idle) {
                rounds.push(*a, *b);
            }
            let (p10, p50, p90) = rounds.ratio();
            format!("{p50:.2}× ({p10:.2}–{p90:.2})")
        };
        let polled = if side == 0 {
            String::new()
        } else {
            format!(" ({} polls)", polls[side])
        };
        println!(
            "| {what}{polled} | {:.2} ms | {:.2} ms | {} | {} | {:.0}% |",
            pct_ms(&mut all[side], 0.5),
            pct_ms(&mut all[side], 0.99),
            ratio(0),
            ratio(1),
            cpu[side].0 / cpu[side].1 * 100.0
        );
    }
    println!();
}

fn main() {
    berth::raise_descriptor_limit();
    println!("Hostile clients and workers ({})\n", machine());
    let which = std::env::args().nth(1).filter(|a| !a.starts_with('-'));
    let run = |name: &str| which.as_deref().is_none_or(|w| w == name);
    if run("connections") {
        slow_headers();
    }
    if run("memory") {
        large_answer();
    }
    if run("ps") {
        ps_polling();
    }
}
