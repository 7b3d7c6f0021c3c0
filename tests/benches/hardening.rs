//! What hostile or careless clients cost `berth serve`, printed as the
//! README's hardening tables: slow-header connections held and shed, the
//! supervisor's memory after a large answer, and request latency while a
//! client polls `/api/ps` against 64 loaded models.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench hardening`

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use berth_tests::bench::pct_ms;
use berth_tests::{Server, default_model};
use serde_json::json;

fn rss_mib(pid: u32) -> f64 {
    berth::child::memory::resident_bytes(pid).unwrap_or(0) as f64 / (1u64 << 20) as f64
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
/// while it polls as fast as it can; with the supervisor's CPU use.
fn ps_polling() {
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
        for _ in 0..50 {
            server.post("/api/models/e0/infer", json!({ "input": 1 }));
        }
        let (cpu, t) = (cpu_s(pid), Instant::now());
        for _ in 0..2000 {
            let t = Instant::now();
            let (status, _) = server.post("/api/models/e0/infer", json!({ "input": 1 }));
            assert_eq!(status, 200);
            samples.push(t.elapsed());
        }
        let share = (cpu_s(pid) - cpu) / t.elapsed().as_secs_f64();
        (samples, share)
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
    let (mut idle, idle_cpu) = measure(&server);
    let (idle50, idle99) = (pct_ms(&mut idle, 0.5), pct_ms(&mut idle, 0.99));
    println!(
        "| echo through `berth serve`, 64 models loaded, 2000 requests | p50 | p99 | p50 ratio | p99 ratio | supervisor CPU |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| idle | {idle50:.2} ms | {idle99:.2} ms | 1.00 | 1.00 | {:.0}% |",
        idle_cpu * 100.0
    );
    for (what, pause) in [
        (
            "a client polls `/api/ps` 10 times a second",
            Some(Duration::from_millis(100)),
        ),
        ("a client polls `/api/ps` back to back", None),
    ] {
        let ((mut samples, cpu), polls) = polled(pause);
        let (p50, p99) = (pct_ms(&mut samples, 0.5), pct_ms(&mut samples, 0.99));
        println!(
            "| {what} ({polls} polls) | {p50:.2} ms | {p99:.2} ms | {:.2} | {:.2} | {:.0}% |",
            p50 / idle50,
            p99 / idle99,
            cpu * 100.0
        );
    }
    println!();
}

fn main() {
    berth::server::listen::raise_descriptor_limit();
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
