//! Models served by unmodified HTTP servers, what the relay does with
//! their requests, against a small stdlib server
//! (`tests/python/fake_upstream.py`) that commits on cue what a real one
//! does not: requests and answers pass through unchanged, streams piece by
//! piece, paths, timeouts, pooled connections, concurrency, the CLI and an
//! embedding host's lease. Their lifecycle is in `upstream_lifecycle.rs`.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use berth_tests::python::{repo_root, test_python};
use berth_tests::upstream::{config, ps_of};
use berth_tests::*;
use serde_json::{Value, json};

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
    let berth::Address::Tcp(addr) = lease.address().clone() else {
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

/// A relayed answer is served from berth's origin: the server's cookies
/// and CORS grants do not pass, `nosniff` is added; a server that switches
/// protocols gets the client a 502 that says so, not a bare 101 and a
/// dead connection.
#[test]
fn a_server_s_cookies_cors_and_protocol_switches_stop_at_berth() {
    let server = Server::start(&config("", "", ""));
    let reply = server.raw(
        "POST",
        "/v1/anything",
        &[("Content-Type", "application/json")],
        Some(
            json!({
                "model": "fake",
                "answer_headers": {
                    "Set-Cookie": "session=stolen",
                    "Access-Control-Allow-Origin": "*",
                    "Access-Control-Allow-Credentials": "true",
                    "X-Served-By": "fake"
                }
            })
            .to_string()
            .as_bytes(),
        ),
    );
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply.header("x-served-by"),
        Some("fake"),
        "its own headers pass"
    );
    assert_eq!(reply.header("set-cookie"), None);
    assert_eq!(reply.header("access-control-allow-origin"), None);
    assert_eq!(reply.header("access-control-allow-credentials"), None);
    assert_eq!(reply.header("x-content-type-options"), Some("nosniff"));

    let (status, reply) = server.post("/v1/anything", json!({ "model": "fake", "switch": true }));
    assert_eq!(status, 502, "{reply}");
    assert_eq!(reply["error"]["code"], "upstream_bad_answer", "{reply}");
    // The server serves on.
    let (status, _) = server.post("/v1/anything", json!({ "model": "fake" }));
    assert_eq!(status, 200);
}

/// A server that promises an answer's length, sends part of it and dies:
/// the client gets berth's error for the server's death, whole, never a
/// head promising bytes that do not come.
#[test]
fn an_answer_cut_off_by_the_servers_death_is_an_error_never_a_cut_body() {
    let server = Server::start(&config("", "", ""));
    let (status, reply) = server.post(
        "/v1/embeddings",
        json!({"model": "fake", "input": "x", "die_mid_body": true}),
    );
    assert_eq!(status, 502, "{reply}");
    let code = reply["error"]["code"].as_str().unwrap_or_default();
    assert!(
        code == "upstream_broke_off" || code == "worker_died",
        "{reply}"
    );
}
