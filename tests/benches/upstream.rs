//! Models served by HTTP servers: what berth's relay costs against the same
//! server reached directly (same run, alternating rounds), what swaps cost
//! clients streaming through them, and how fast an unload stops a server
//! holding 1 GiB against the kernel's own SIGKILL→reaped. Printed as
//! docs/performance.md's "Servers you already run" tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench upstream`
//! (sections alone: `-- proxy | chat | swaps | stop`)
//!
//! The trivial server is `tests/python/fake_upstream.py` (standard library
//! only); the real one is llama.cpp's through `llama-cpp-python[server]`
//! (the tests' pinned venv, built by pip the first time) on the SmolLM2
//! GGUF `berth fetch smollm2` installs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth_tests::bench::{Rounds, kernel_kill_1gib, machine, median, pct_ms, percentile};
use berth_tests::python::{repo_root, test_python};
use berth_tests::{Server, default_model, json_reply};
use serde_json::{Value, json};

/// A config serving the stdlib fake server as `fake` (with `args` added to
/// its command line) and, with `llama`, llama.cpp's server as `smol`.
fn config(args: &str, llama: bool) -> String {
    let mut text = format!(
        r#"
[workers.fake]
command = ["{}", "{}", "--port", "{{port}}"{args}]
http = {{ health = "/health", stop_grace = "5s" }}

[[model]]
name = "fake"
worker = "fake"
"#,
        test_python().display(),
        repo_root().join("tests/python/fake_upstream.py").display()
    );
    if llama {
        let gguf = default_model("smollm2");
        text = format!(
            r#"models_dir = "{}"
{text}
{}
{}"#,
            gguf.parent().unwrap().display(),
            berth_tests::upstream::llamacpp_worker(""),
            berth_tests::upstream::llamacpp_model("smol"),
        );
    }
    text
}

/// The loopback address the server of `model` listens on, read from its
/// command line (`--port N`).
fn direct_url(server: &Server, model: &str) -> String {
    let ps = server.ps();
    let pid = ps.iter().find(|m| m["name"] == model).expect("loaded")["pid"]
        .as_u64()
        .expect("a pid");
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("the server's cmdline");
    let args: Vec<String> = cmdline
        .split(|b| *b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let port = args
        .windows(2)
        .find(|w| w[0] == "--port")
        .map(|w| w[1].clone())
        .expect("--port on its command line");
    format!("http://127.0.0.1:{port}")
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .new_agent()
}

/// One POST of `body` to `url`, timed; panics on anything but 200.
fn timed_post(agent: &ureq::Agent, url: &str, body: &Value) -> (Duration, Value) {
    let started = Instant::now();
    let (status, reply) = json_reply(agent.post(url).send_json(body));
    let took = started.elapsed();
    assert_eq!(status, 200, "{url}: {reply}");
    (took, reply)
}

/// A trivial request to the stdlib server, through berth and straight to
/// it, 200 a round in alternating rounds: the p50 each, and what berth adds.
fn proxy() {
    const ROUNDS: usize = 12;
    const PER_ROUND: usize = 200;
    let server = Server::start(&config("", false));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let direct = format!("{}/v1/chat/completions", direct_url(&server, "fake"));
    let through = format!("{}/v1/chat/completions", server.url);
    let body = json!({"model": "fake", "messages": [{"role": "user", "content": "hi"}]});
    let (a_agent, b_agent) = (agent(), agent());
    let side = |agent: &ureq::Agent, url: &str| {
        let mut samples: Vec<Duration> = (0..PER_ROUND)
            .map(|_| timed_post(agent, url, &body).0)
            .collect();
        pct_ms(&mut samples, 0.5) / 1e3
    };
    side(&a_agent, &through);
    side(&b_agent, &direct);
    let rounds = berth_tests::bench::alternate(
        ROUNDS,
        || side(&a_agent, &through),
        || side(&b_agent, &direct),
    );
    // berth's own HTTP hop, for scale: its cheapest route, with no model.
    let healthz = format!("{}/healthz", server.url);
    let mut hop: Vec<Duration> = (0..PER_ROUND * 4)
        .map(|_| {
            let started = Instant::now();
            let status = a_agent.get(&healthz).call().map(|r| r.status().as_u16());
            assert_eq!(status.ok(), Some(200));
            started.elapsed()
        })
        .collect();
    let mut added: Vec<f64> = rounds
        .a
        .iter()
        .zip(&rounds.b)
        .map(|(a, b)| (a - b) * 1e6)
        .collect();
    println!(
        "| trivial server (stdlib), one client | through berth | direct | ratio of p50s, median (p10–p90) | added p50, median (p10–p90) | samples |"
    );
    println!("|---|---|---|---|---|---|");
    let (p10, p50, p90) = rounds.ratio();
    println!(
        "| chat, not streamed, p50 | {:.0} µs | {:.0} µs | {p50:.2}× ({p10:.2}–{p90:.2}) | {:.0} µs ({:.0}–{:.0}) | {ROUNDS} rounds × {PER_ROUND} |",
        median(&mut rounds.a.clone()) * 1e6,
        median(&mut rounds.b.clone()) * 1e6,
        median(&mut added),
        percentile(&mut added, 0.1),
        percentile(&mut added, 0.9),
    );
    println!(
        "\nberth's own HTTP hop, for scale: GET /healthz p50 {:.0} µs, same client",
        pct_ms(&mut hop, 0.5) * 1e3
    );
}

/// A 64-token chat from llama.cpp's server, through berth and straight to
/// it, in alternating rounds: tokens per second each.
fn chat() {
    const ROUNDS: usize = 10;
    let server = Server::start(&config("", true));
    assert_eq!(server.post("/api/models/smol/load", json!({})).0, 200);
    let direct = format!("{}/v1/chat/completions", direct_url(&server, "smol"));
    let through = format!("{}/v1/chat/completions", server.url);
    let body = json!({
        "model": "smol",
        "messages": [{"role": "user", "content": "Count from one to one hundred in words, separated by commas."}],
        "max_tokens": 64,
        "temperature": 0,
    });
    let (a_agent, b_agent) = (agent(), agent());
    let tokens = Mutex::new(Vec::new());
    let side = |agent: &ureq::Agent, url: &str| {
        let (took, reply) = timed_post(agent, url, &body);
        let n = reply["usage"]["completion_tokens"].as_u64().expect("usage");
        tokens.lock().unwrap().push(n);
        n as f64 / took.as_secs_f64()
    };
    side(&a_agent, &through);
    side(&b_agent, &direct);
    let rounds = berth_tests::bench::alternate(
        ROUNDS,
        || side(&a_agent, &through),
        || side(&b_agent, &direct),
    );
    let tokens = tokens.into_inner().unwrap();
    println!(
        "| llama.cpp's server, SmolLM2-135M Q4_1 | through berth | direct | ratio, median (p10–p90) | samples |"
    );
    println!("|---|---|---|---|---|");
    rounds.print(
        &format!(
            "chat of {}–{} tokens, not streamed, tokens/s",
            tokens.iter().min().unwrap(),
            tokens.iter().max().unwrap()
        ),
        "",
        "",
        "tokens/s",
        1.0,
    );
}

/// Four clients streaming chats while the model is swapped, in windows
/// that take turns with windows of no swap of the same length: failures,
/// p50 and p99 of each, and the time from each swap call to the new server
/// serving.
fn swaps(model: &str, ask: &Value, swaps_per_window: usize, server: &Server) {
    const WINDOWS: usize = 4;
    assert_eq!(
        server
            .post(&format!("/api/models/{model}/load"), json!({}))
            .0,
        200
    );
    let (_, catalogue) = server.get("/api/models");
    let spec = catalogue["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["spec"]["name"] == model)
        .expect("registered")["spec"]
        .clone();
    let stop = AtomicBool::new(false);
    let swapping = AtomicBool::new(false);
    let (with, without) = (Mutex::new(Vec::new()), Mutex::new(Vec::new()));
    let failed = Mutex::new(Vec::new());
    let mut switch = Vec::new();
    let url = format!("{}/v1/chat/completions", server.url);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                let agent = agent();
                while !stop.load(Ordering::Relaxed) {
                    let during = swapping.load(Ordering::Relaxed);
                    let started = Instant::now();
                    let answer = agent.post(&url).send_json(ask);
                    let text = match answer {
                        Ok(mut r) if r.status() == 200 => {
                            r.body_mut().read_to_string().unwrap_or_default()
                        }
                        Ok(r) => format!("status {}", r.status()),
                        Err(e) => e.to_string(),
                    };
                    let took = started.elapsed();
                    if !text.contains("[DONE]") || text.contains("\"error\"") {
                        failed.lock().unwrap().push(text);
                    } else if during && swapping.load(Ordering::Relaxed) {
                        with.lock().unwrap().push(took);
                    } else if !during && !swapping.load(Ordering::Relaxed) {
                        without.lock().unwrap().push(took);
                    }
                }
            });
        }
        std::thread::sleep(Duration::from_secs(1));
        // Each window of no swaps lasts as long as the window of swaps before it.
        let mut length = Duration::ZERO;
        for window in 0..WINDOWS * 2 {
            if window % 2 == 0 {
                swapping.store(true, Ordering::Relaxed);
                let started = Instant::now();
                for _ in 0..swaps_per_window {
                    let (status, reply) =
                        server.post(&format!("/api/models/{model}/swap"), spec.clone());
                    assert_eq!(status, 200, "{reply}");
                    switch.push(reply["switch_ms"].as_f64().expect("switch_ms"));
                }
                // The window ends once the last swap has drained the old server.
                swapping.store(false, Ordering::Relaxed);
                length = started.elapsed();
            } else {
                std::thread::sleep(length);
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    let failed = failed.into_inner().unwrap();
    let (mut with, mut without) = (with.into_inner().unwrap(), without.into_inner().unwrap());
    switch.sort_by(f64::total_cmp);
    println!(
        "| {model}, 4 clients streaming, {} swaps | {} of {} failed | {:.0} ms / {:.0} ms | {:.0} ms / {:.0} ms | {:.0} ms (max {:.0} ms) |",
        switch.len(),
        failed.len(),
        with.len() + without.len() + failed.len(),
        pct_ms(&mut with, 0.5),
        pct_ms(&mut with, 0.99),
        pct_ms(&mut without, 0.5),
        pct_ms(&mut without, 0.99),
        median(&mut switch.clone()),
        switch.last().copied().unwrap_or(0.0),
    );
    if let Some(first) = failed.first() {
        println!("\nfirst failure: {first}\n");
    }
}

/// An unload of the stdlib server holding 1 GiB (through `berth serve`'s
/// management API; the report's own time) against a plain process of the
/// same size SIGKILLed and reaped, in alternating rounds.
fn stop() {
    const ROUNDS: usize = 10;
    let server = Server::start(&config(r#", "--hold-mib", "1024""#, false));
    let mut reclaimed = Vec::new();
    let mut rounds = Rounds::new();
    for round in 0..ROUNDS {
        assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
        std::thread::sleep(Duration::from_millis(200));
        let mut unload = || {
            let (status, report) = server.post("/api/models/fake/unload", json!({}));
            assert_eq!(status, 200, "{report}");
            assert_eq!(report["leftover_processes"], 0, "{report}");
            reclaimed.push(report["reclaimed_bytes"].as_f64().unwrap() / f64::from(1 << 20));
            report["took_ms"].as_f64().unwrap() / 1e3
        };
        let (a, b) = if round % 2 == 0 {
            let a = unload();
            (a, kernel_kill_1gib())
        } else {
            let b = kernel_kill_1gib();
            (unload(), b)
        };
        rounds.push(a, b);
    }
    println!("| what | berth | baseline | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    rounds.print(
        "stop a server holding 1 GiB",
        "unload of the stdlib server (SIGTERM, reaped, group and cgroup swept, measured)",
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
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let run = berth_tests::bench::sections();
    println!("Servers you already run ({})\n", machine());
    if run("proxy") {
        proxy();
        println!();
    }
    if run("chat") {
        chat();
        println!();
    }
    if run("swaps") {
        let server = Server::start(&config("", true));
        println!(
            "| swaps under load | failed | with swaps p50 / p99 | without p50 / p99 | swap call → new server serving, median |"
        );
        println!("|---|---|---|---|---|");
        swaps(
            "fake",
            &json!({"model": "fake", "stream": true, "chunks": 8, "interval_ms": 10}),
            5,
            &server,
        );
        assert_eq!(server.post("/api/models/fake/unload", json!({})).0, 200);
        swaps(
            "smol",
            &json!({
                "model": "smol",
                "messages": [{"role": "user", "content": "What is 2 + 3?"}],
                "max_tokens": 16,
                "temperature": 0,
                "stream": true,
            }),
            5,
            &server,
        );
        println!();
    }
    if run("stop") {
        stop();
    }
}
