//! Models served by unmodified HTTP servers, against a small stdlib server
//! (`tests/python/fake_upstream.py`) that commits on cue the faults a real
//! one does not: requests pass through unchanged, streams piece by piece,
//! and every lifecycle guarantee holds as for berth's own workers.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use berth_tests::python::{repo_root, test_python};
use berth_tests::*;
use serde_json::{Value, json};

/// A config whose worker kind `fake` runs the fake server with `modes`
/// (and `args`), and a model `fake` on it with `extra` keys. (Each test's
/// server is told apart from the others' by the pids its own `ps` gives.)
fn config(modes: &str, args: &str, extra: &str) -> String {
    let python = test_python();
    let script = repo_root().join("tests/python/fake_upstream.py");
    format!(
        r#"
[workers.fake]
command = ["{}", "{}", "--port", "{{port}}", "--mode", "{modes}"{args}]
http = {{ health = "/health", stop_grace = "2s", unhealthy_after = "3s", headers = {{ "X-Upstream-Key" = "k1" }} }}

[[model]]
name = "fake"
worker = "fake"
{extra}
"#,
        python.display(),
        script.display()
    )
}

fn ps_of(server: &Server, model: &str) -> Value {
    server
        .ps()
        .into_iter()
        .find(|m| m["name"] == model)
        .unwrap_or(Value::Null)
}

/// Every field, every route and the status pass through; berth's token
/// does not, the operator's headers do.
#[test]
fn requests_and_answers_pass_through_unchanged() {
    let server = Server::start_with(&config("", "", ""), &["--token", "s3cret"]);
    let (status, reply) = server.post(
        "/v1/chat/completions",
        json!({
            "model": "fake",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "response_format": {"type": "json_object"},
            "logprobs": true
        }),
    );
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["choices"][0]["message"]["content"], "hello from fake");
    let received = &reply["received"];
    assert_eq!(received["tools"][0]["function"]["name"], "f", "{reply}");
    assert_eq!(received["response_format"]["type"], "json_object");
    assert_eq!(received["logprobs"], true);
    let headers = &reply["headers"];
    assert!(
        headers.get("authorization").is_none(),
        "berth's token leaked: {headers}"
    );
    assert_eq!(headers["x-upstream-key"], "k1", "{headers}");
    // Routes berth does not serve itself, and the server's own status.
    for path in ["/v1/completions", "/v1/rerank", "/v1/anything/else"] {
        let (status, reply) = server.post(path, json!({"model": "fake", "query": "q"}));
        assert_eq!(status, 200, "{path}: {reply}");
        assert_eq!(reply["path"], path);
        assert_eq!(reply["received"]["query"], "q");
    }
    let (status, reply) = server.post("/v1/rerank", json!({"model": "fake", "status": 418}));
    assert_eq!(status, 418, "{reply}");
    // Only plain /v1 paths reach it: not its other routes by `..`.
    for path in ["/v1/../slots", "/v1/%2e%2e/props", "/v1//x"] {
        let reply = server.raw(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            Some(br#"{"model": "fake"}"#),
        );
        assert_eq!(reply.status, 400, "{path}: {}", reply.text());
    }
    // The server's own error, in its own shape (text, not berth's JSON).
    let reply = server.raw(
        "POST",
        "/v1/rerank",
        &[("Content-Type", "application/json")],
        Some(br#"{"model": "fake", "status": 500, "plain": "engine exploded"}"#),
    );
    assert_eq!(reply.status, 500);
    assert_eq!(reply.text(), "engine exploded");
    assert_eq!(reply.header("content-type"), Some("text/plain"));
    // It is a model like any other in ps, the catalogue and /metrics.
    let ps = ps_of(&server, "fake");
    assert_eq!(ps["backend"], "http", "{ps}");
    assert_eq!(ps["state"], "ready");
    let (_, metrics) = server.get("/metrics");
    let metrics = metrics.as_str().unwrap_or_default().to_string();
    assert!(
        metrics.contains("berth_requests_total{model=\"fake\"} 6"),
        "{metrics}"
    );
}

/// Each piece of a stream reaches the client before the server sends the
/// next: nothing is buffered on the way (the server stamps each piece with
/// when it sent it; the client notes when it came).
#[test]
fn a_stream_is_relayed_piece_by_piece() {
    let server = Server::start(&config("", "", ""));
    let port = server.port();
    let body =
        json!({"model": "fake", "stream": true, "chunks": 6, "interval_ms": 300}).to_string();
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let now = || {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
    };
    let mut pieces: Vec<(f64, Value)> = Vec::new();
    let mut done = false;
    for line in BufReader::new(stream).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            break;
        }
        pieces.push((now(), serde_json::from_str(data).unwrap()));
    }
    assert!(done, "the stream ended with [DONE]");
    assert_eq!(pieces.len(), 6);
    for (i, (_, piece)) in pieces.iter().enumerate() {
        assert_eq!(piece["i"], i, "in order");
    }
    for pair in pieces.windows(2) {
        let (arrived, _) = &pair[0];
        let next_sent = pair[1].1["sent_at"].as_f64().unwrap();
        assert!(
            *arrived < next_sent,
            "piece {} arrived at {arrived}, after piece {} was sent at {next_sent}",
            pair[0].1["i"],
            pair[1].1["i"]
        );
    }
}

/// A server that never answers its health fails its load with the load
/// timeout; one that exits first fails it with its exit and stderr.
#[test]
fn a_server_that_is_never_ready_fails_its_load_saying_why() {
    let server = Server::start(&config("never-ready", "", "load_timeout = \"2s\""));
    let (status, reply) = server.post("/api/models/fake/load", json!({}));
    assert_eq!(status, 504, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ready"),
        "{reply}"
    );
    assert!(server.ps().is_empty(), "nothing was left running");
    drop(server);
    let server = Server::start(&config("exit-at-start", "", ""));
    let (status, reply) = server.post("/api/models/fake/load", json!({}));
    assert_eq!(status, 502, "{reply}");
    assert_eq!(reply["error"]["code"], "server_failed", "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("code 3") && message.contains("exiting at start as asked"),
        "{message}"
    );
}

/// A server that dies mid-stream ends its streams at once with the cause,
/// and is restarted.
#[test]
fn a_crash_mid_stream_fails_the_stream_at_once_and_restarts_the_server() {
    let server = Server::start(&config("crash-mid-stream", "", ""));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let first = ps_of(&server, "fake")["pid"].as_u64().unwrap();
    let started = Instant::now();
    let (status, text) = server.post_text(
        "/v1/chat/completions",
        json!({"model": "fake", "stream": true, "chunks": 10, "interval_ms": 100}),
    );
    assert_eq!(status, 200, "{text}");
    assert!(started.elapsed() < Duration::from_secs(5), "at once");
    assert!(
        text.contains("tok1"),
        "the pieces before the crash came: {text}"
    );
    assert!(!text.contains("tok3"), "{text}");
    assert!(
        text.contains("SIGKILL") && text.contains("crashing mid-stream as asked"),
        "the cause and stderr came as the last event: {text}"
    );
    assert!(
        wait_for(Duration::from_secs(15), || {
            let ps = ps_of(&server, "fake");
            ps["state"] == "ready" && ps["pid"].as_u64() != Some(first)
        }),
        "restarted"
    );
    let (status, _) = server.post("/v1/rerank", json!({"model": "fake"}));
    assert_eq!(status, 200, "the new server serves");
}

/// A server whose health stops answering is declared lost, stopped and
/// restarted.
#[test]
fn a_server_that_stops_answering_its_health_is_restarted() {
    let server = Server::start(&config("hang-health-after", ", \"--after\", \"2\"", ""));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let first = ps_of(&server, "fake")["pid"].as_u64().unwrap();
    assert!(
        wait_for(Duration::from_secs(30), || {
            let ps = ps_of(&server, "fake");
            ps["restarts"].as_u64() >= Some(1) && ps["pid"].as_u64() != Some(first)
        }),
        "declared lost and restarted: {}",
        ps_of(&server, "fake")
    );
    let last = ps_of(&server, "fake")["last_exit"].clone();
    assert!(
        last.to_string().to_lowercase().contains("heartbeat"),
        "the cause is named: {last}"
    );
    assert!(!alive(first as u32));
}

/// A request's `timeout` (berth's, as its own routes take it) bounds a
/// relayed request: an answer that does not come in time gets berth's
/// deadline error, and a stream past it ends with a last event saying so.
#[test]
fn a_request_timeout_bounds_a_relayed_request() {
    let server = Server::start(&config("", "", ""));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let started = Instant::now();
    let (status, reply) = server.post(
        "/v1/rerank",
        json!({"model": "fake", "delay_ms": 5000, "timeout": "500ms"}),
    );
    assert!(started.elapsed() < Duration::from_secs(3), "{reply}");
    assert_eq!(
        reply["error"]["code"], "deadline_exceeded",
        "{status}: {reply}"
    );
    let started = Instant::now();
    let (status, text) = server.post_text(
        "/v1/chat/completions",
        json!({"model": "fake", "stream": true, "chunks": 40, "interval_ms": 100, "timeout": "1s"}),
    );
    assert_eq!(status, 200, "{text}");
    assert!(started.elapsed() < Duration::from_secs(3), "{text}");
    assert!(text.contains("tok1") && !text.contains("tok30"), "{text}");
    assert!(
        text.contains("deadline_exceeded"),
        "the last event says why: {text}"
    );
    // The server serves on.
    assert_eq!(server.post("/v1/rerank", json!({"model": "fake"})).0, 200);
}

/// A server that closes idle connections (as uvicorn does after 5 s):
/// requests spaced around its keep-alive, when berth's pooled connection
/// may be closing under it, all get their answer.
#[test]
fn a_server_closing_idle_connections_loses_no_request() {
    let server = Server::start(&config("", ", \"--keepalive-s\", \"0.3\"", ""));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let mut failed = Vec::new();
    for i in 0..24u64 {
        // 0.25 to 0.36 s apart: around the server's 0.3 s.
        std::thread::sleep(Duration::from_millis(250 + (i % 4) * 37));
        let (status, reply) = server.post("/v1/rerank", json!({"model": "fake", "i": i}));
        if status != 200 {
            failed.push(format!("{i}: {status} {reply}"));
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}

/// A few failed health checks inside `unhealthy_after` (a busy server
/// answering 503) do not make a server lost: it keeps its pid.
#[test]
fn a_few_failed_health_checks_within_the_window_are_not_a_lost_server() {
    // A window well past the two failed checks, however late a tick comes.
    let server = Server::start(
        &config("health-503-after", ", \"--after\", \"2\"", "")
            .replace("unhealthy_after = \"3s\"", "unhealthy_after = \"6s\""),
    );
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let first = ps_of(&server, "fake")["pid"].as_u64().unwrap();
    // Two checks, a second apart, answer 503 (inside the 6 s window), then
    // 200 again.
    std::thread::sleep(Duration::from_secs(7));
    let ps = ps_of(&server, "fake");
    assert_eq!(ps["pid"].as_u64(), Some(first), "{ps}");
    assert_eq!(ps["restarts"], 0, "{ps}");
    assert_eq!(server.post("/v1/rerank", json!({"model": "fake"})).0, 200);
}

/// A server that closes its listening socket at SIGTERM (as uvicorn does)
/// and finishes what it is answering: its health fails from then on, which
/// during a stop is no reason to kill it; the stream in flight ends whole
/// and the server exits on its own.
#[test]
fn a_server_draining_after_sigterm_is_not_killed_for_its_health() {
    // Its health may fail for 1 s before it is lost; its stop takes longer.
    let server = Server::start(&format!(
        "drain_timeout = \"200ms\"\n{}",
        config("drain-on-sigterm", "", "")
            .replace("unhealthy_after = \"3s\"", "unhealthy_after = \"1s\"")
            .replace("stop_grace = \"2s\"", "stop_grace = \"10s\"")
    ));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    std::thread::scope(|scope| {
        let stream = scope.spawn(|| {
            server.post_text(
                "/v1/chat/completions",
                json!({"model": "fake", "stream": true, "chunks": 30, "interval_ms": 100}),
            )
        });
        // The unload's drain gives up after 200 ms: SIGTERM comes with
        // about 2.5 s of the stream left.
        std::thread::sleep(Duration::from_millis(300));
        let (status, report) = server.post("/api/models/fake/unload", json!({}));
        assert_eq!(status, 200, "{report}");
        assert_eq!(report["stop"], "sigterm", "{report}");
        assert_eq!(report["exit"]["code"], 0, "it exited on its own: {report}");
        let (status, text) = stream.join().unwrap();
        assert_eq!(status, 200, "{text}");
        assert!(
            text.contains("tok29") && text.contains("[DONE]"),
            "the stream ended whole: {text}"
        );
    });
}

/// A server that crashes takes what it forked with it, even a child that
/// left its group: nothing of the dead server lives on beside the new one.
#[test]
fn a_crashed_server_leaves_nothing_it_started() {
    let server = Server::start(&config(
        "crash-mid-stream,fork-escape",
        ", \"--child-mib\", \"16\"",
        "",
    ));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let first = ps_of(&server, "fake")["pid"].as_u64().unwrap() as u32;
    let tree = marked_with_the_mark_of(first);
    assert!(tree.len() >= 2, "the server and its child: {tree:?}");
    let (status, _) = server.post_text(
        "/v1/chat/completions",
        json!({"model": "fake", "stream": true, "chunks": 10}),
    );
    assert_eq!(status, 200);
    assert!(
        wait_for(Duration::from_secs(15), || {
            let ps = ps_of(&server, "fake");
            ps["state"] == "ready" && ps["pid"].as_u64() != Some(u64::from(first))
        }),
        "restarted"
    );
    for p in tree {
        assert!(!alive(p), "pid {p} of the crashed server {first} lives on");
    }
}

/// The processes carrying the mark of worker `pid` (itself included).
fn marked_with_the_mark_of(pid: u32) -> Vec<u32> {
    let mark_of = |p: &procfs::process::Process| {
        p.environ()
            .ok()
            .and_then(|env| env.get(std::ffi::OsStr::new("BERTH_WORKER_MARK")).cloned())
    };
    let mark = mark_of(&procfs::process::Process::new(pid as i32).unwrap()).unwrap();
    procfs::process::all_processes()
        .unwrap()
        .filter_map(Result::ok)
        .filter(|p| mark_of(p).as_ref() == Some(&mark))
        .map(|p| p.pid as u32)
        .collect()
}

/// A server that ignores SIGTERM and forks a child that leaves its group
/// and holds memory: the group's memory is counted in ps, and the unload
/// stops everything (SIGKILL after the grace) and says so.
#[test]
fn an_unload_stops_a_server_that_ignores_sigterm_and_everything_it_forked() {
    let server = Server::start(&config(
        "ignore-sigterm,fork-escape",
        ", \"--child-mib\", \"96\"",
        "",
    ));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let pid = ps_of(&server, "fake")["pid"].as_u64().unwrap() as u32;
    // The server and the child it forked (which left its group): the
    // processes carrying the server's mark.
    let tree = marked_with_the_mark_of(pid);
    assert!(tree.len() >= 2, "the server and its child: {tree:?}");
    assert!(
        wait_for(Duration::from_secs(10), || {
            ps_of(&server, "fake")["rss_bytes"].as_u64().unwrap_or(0) >= 96 << 20
        }),
        "the child's memory counts as the model's: {}",
        ps_of(&server, "fake")
    );
    let (status, report) = server.post("/api/models/fake/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["stop"], "sigkill", "{report}");
    assert_eq!(report["leftover_processes"], 0, "{report}");
    assert!(report["escaped_processes"].as_u64() >= Some(1), "{report}");
    assert!(
        report["rss_at_stop_bytes"].as_u64() >= Some(96 << 20),
        "{report}"
    );
    for p in tree {
        assert!(!alive(p), "pid {p} (server {pid}) outlived the unload");
    }
}

/// A server past its memory_limit ends as memory_limit_exceeded.
#[test]
fn a_server_past_its_memory_limit_is_stopped_and_named() {
    let server = Server::start(&config(
        "",
        ", \"--hold-mib\", \"300\"",
        "memory_limit = \"200MiB\"",
    ));
    let (status, reply) = server.post("/api/models/fake/load", json!({}));
    assert_ne!(status, 200, "{reply}");
    assert_eq!(reply["error"]["code"], "memory_limit_exceeded", "{reply}");
}

/// Swaps while clients stream: the new server is ready on its own port
/// before routing moves, the old one drains, no request fails.
#[test]
fn swaps_under_load_fail_no_request() {
    let server = Server::start(&config("", "", ""));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let first = ps_of(&server, "fake")["pid"].as_u64().unwrap();
    let (_, catalogue) = server.get("/api/models");
    let spec = catalogue["models"][0]["spec"].clone();
    let stop = std::sync::atomic::AtomicBool::new(false);
    /// Stops the clients however the scope ends (an assertion included).
    struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
    impl Drop for Stop<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
    let (failures, total) = std::thread::scope(|scope| {
        let _stop = Stop(&stop);
        let clients: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    let (mut failed, mut sent) = (Vec::new(), 0);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        sent += 1;
                        let (status, text) = server.post_text(
                            "/v1/chat/completions",
                            json!({"model": "fake", "stream": true, "chunks": 5, "interval_ms": 20}),
                        );
                        if status != 200 || !text.contains("[DONE]") || text.contains("error") {
                            failed.push(format!("{status}: {text}"));
                        }
                    }
                    (failed, sent)
                })
            })
            .collect();
        for _ in 0..3 {
            let (status, reply) = server.post("/api/models/fake/swap", spec.clone());
            assert_eq!(status, 200, "{reply}");
            assert_ne!(reply["old_pid"], reply["new_pid"]);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        clients.into_iter().fold((Vec::new(), 0), |(mut f, n), c| {
            let (failed, sent) = c.join().unwrap();
            f.extend(failed);
            (f, n + sent)
        })
    });
    assert!(total > 4, "{total} requests");
    assert!(
        failures.is_empty(),
        "{} of {total} failed: {failures:?}",
        failures.len()
    );
    assert_ne!(ps_of(&server, "fake")["pid"].as_u64(), Some(first));
    assert!(!alive(first as u32), "the old server was stopped");
}

/// The CLI drives a server model as any other: load, ps, swap (the
/// operator's command and `http` kept), unload with its proof.
#[test]
fn the_cli_loads_swaps_and_unloads_a_server() {
    let server = Server::start(&config("", "", ""));
    let (ok, load, stderr) = server.cli(&["load", "fake"]);
    assert!(ok, "load: {load} {stderr}");
    let first = load["pid"].as_u64().unwrap();
    let (ok, ps, stderr) = server.cli(&["ps"]);
    assert!(ok, "ps: {ps} {stderr}");
    assert!(ps.to_string().contains("\"http\""), "{ps}");
    let (ok, swap, stderr) = server.cli(&["swap", "fake"]);
    assert!(ok, "swap: {swap} {stderr}");
    assert_eq!(swap["old_pid"].as_u64(), Some(first), "{swap}");
    assert_eq!(swap["unload"]["leftover_processes"], 0, "{swap}");
    assert!(!alive(first as u32));
    let (status, reply) = server.post("/v1/rerank", json!({"model": "fake"}));
    assert_eq!(status, 200, "the new server serves: {reply}");
    assert_eq!(
        reply["headers"]["x-upstream-key"], "k1",
        "its http table was kept"
    );
    let (ok, unload, stderr) = server.cli(&["unload", "fake"]);
    assert!(ok, "unload: {unload} {stderr}");
    assert_eq!(unload["leftover_processes"], 0, "{unload}");
    assert!(!alive(swap["new_pid"].as_u64().unwrap() as u32));
}

/// `max_concurrency` bounds what reaches the server: four clients at
/// once, a limit of one, and the server never sees two requests at a time
/// (it counts what it is answering); the rest queue and are all answered.
#[test]
fn max_concurrency_bounds_what_reaches_the_server() {
    let server = Server::start(&config("", "", "max_concurrency = 1"));
    assert_eq!(server.post("/api/models/fake/load", json!({})).0, 200);
    let replies: Vec<(u16, Value)> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    (0..3)
                        .map(|_| {
                            server.post("/v1/rerank", json!({"model": "fake", "delay_ms": 100}))
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        clients
            .into_iter()
            .flat_map(|c| c.join().unwrap())
            .collect()
    });
    assert_eq!(replies.len(), 12);
    for (status, reply) in &replies {
        assert_eq!(*status, 200, "{reply}");
        assert_eq!(
            reply["active"], 1,
            "two at once reached the server: {reply}"
        );
    }
}

/// Keep-alive unloads an idle server like any model.
#[test]
fn keep_alive_unloads_an_idle_server() {
    let server = Server::start(&config("", "", "keep_alive = \"1s\""));
    assert_eq!(server.post("/v1/rerank", json!({"model": "fake"})).0, 200);
    let pid = ps_of(&server, "fake")["pid"].as_u64().unwrap() as u32;
    assert!(wait_for(Duration::from_secs(10), || server.ps().is_empty()));
    assert!(!alive(pid));
}

/// The embedded supervisor leases a server's model: its address, held as a
/// request in flight until the lease is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_leases_a_server_and_talks_to_it() {
    let sup = supervisor();
    let spec = berth::ModelSpec {
        http: Some(berth::HttpSpec::new("/health")),
        ..berth::ModelSpec::new("fake", "").command([
            test_python().display().to_string(),
            repo_root()
                .join("tests/python/fake_upstream.py")
                .display()
                .to_string(),
            "--port".into(),
            "{port}".into(),
        ])
    };
    let load = sup.load(spec).await.unwrap();
    assert_eq!(load.backend, "http");
    let lease = sup
        .lease("fake", berth::RequestOptions::default())
        .await
        .unwrap();
    assert_eq!(lease.pid(), load.pid);
    let berth::child::upstream::Address::Tcp(addr) = lease.address().clone() else {
        panic!("{}", lease.address())
    };
    assert_eq!(sup.stats()[0].in_flight, 1, "held as a request in flight");
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "GET /v1/models HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reply = String::new();
    std::io::Read::read_to_string(&mut stream, &mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    drop(lease);
    assert_eq!(sup.stats()[0].in_flight, 0);
    // A berth worker is not leased.
    sup.load(berth::ModelSpec::new("e", "echo")).await.unwrap();
    let err = sup
        .lease("e", berth::RequestOptions::default())
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "bad_request", "{err}");
    sup.shutdown().await;
}
