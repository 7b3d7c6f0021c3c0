//! `berth serve` end to end: a real daemon, plain HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use berth_tests::*;
use serde_json::{Value, json};

const FOX: &str = "The quick brown fox jumps over the lazy dog.";

#[test]
fn embeddings_match_berth_run_and_ps_shows_the_real_worker() {
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        minilm.display()
    ));
    let (status, models) = server.get("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(models["data"][0]["id"], "minilm");

    let (status, body) = server.post("/v1/embeddings", json!({ "model": "minilm", "input": FOX }));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "list");
    assert_eq!(body["data"][0]["object"], "embedding");
    // Compared as the f32s they are: the sidecar prints each in its
    // shortest form, `berth run` as the f64 it widens to.
    let via_http: Vec<f32> = serde_json::from_value(body["data"][0]["embedding"].clone()).unwrap();
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    let out = std::process::Command::new(berth_bin())
        .args([
            "run",
            "--backend",
            "embed",
            "--json",
            "--input",
            FOX,
            "--model",
        ])
        .arg(&minilm)
        .output()
        .unwrap();
    let run: Value = serde_json::from_slice(&out.stdout).unwrap();
    let via_run: Vec<f32> =
        serde_json::from_value(run["responses"][0]["embeddings"][0].clone()).unwrap();
    assert_eq!(
        via_http, via_run,
        "the sidecar and berth run give the same vector"
    );

    // Array input and base64 (what the official OpenAI clients send by default).
    let (status, body) = server.post(
        "/v1/embeddings",
        json!({ "model": "minilm", "input": [FOX, "hello"], "encoding_format": "base64" }),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["data"].as_array().unwrap().len(), 2);
    // 384 little-endian f32s = 1536 bytes = 2048 base64 characters.
    assert_eq!(body["data"][0]["embedding"].as_str().unwrap().len(), 2048);

    let ps = server.ps();
    assert_eq!(ps.len(), 1);
    let pid = ps[0]["pid"].as_u64().unwrap() as u32;
    assert!(
        alive(pid) && server.workers().contains(&pid),
        "ps shows the real worker pid"
    );
    assert!(
        ps[0]["rss_bytes"].as_u64().unwrap() > 50 << 20,
        "and its real RSS: {}",
        ps[0]
    );
    for field in [
        "name",
        "backend",
        "state",
        "peak_rss_bytes",
        "uptime_s",
        "requests",
        "in_flight",
        "keep_alive_left_s",
    ] {
        assert!(ps[0].get(field).is_some(), "ps has `{field}`: {}", ps[0]);
    }

    let (status, report) = server.post("/api/models/minilm/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["pid"].as_u64(), Some(pid as u64));
    assert_eq!(report["leftover_processes"], 0);
    // What the system confirms coming back is tested alone, in reclaim.rs:
    // here other tests' workers come and go during the stop.
    assert!(
        report["anon_at_stop_bytes"].as_u64().unwrap() > 50 << 20,
        "{report}"
    );
    assert!(report["reclaimed_bytes"].is_u64(), "{report}");
    assert!(!alive(pid), "the unloaded worker is gone");
    assert!(server.ps().is_empty());
}

#[test]
fn bad_requests_get_openai_shaped_errors() {
    let server =
        Server::start("max_body = \"64KiB\"\n[[model]]\nname = \"echo\"\nbackend = \"echo\"\n");
    let cases: [(&str, &str, u16, &str); 5] = [
        (
            "/v1/embeddings",
            r#"{"model": "nope", "input": "x"}"#,
            404,
            "model_not_found",
        ),
        ("/v1/embeddings", r#"{"model": "echo""#, 400, "bad_request"),
        (
            "/v1/embeddings",
            r#"{"model": "echo", "input": 5}"#,
            400,
            "bad_request",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "echo", "messages": []}"#,
            400,
            "bad_request",
        ),
        ("/api/models/nope/unload", "{}", 404, "model_not_found"),
    ];
    for (path, body, status, code) in cases {
        let (got, body) = server.post_raw(path, body);
        assert_eq!(got, status, "{path}: {body}");
        assert_eq!(body["error"]["code"], code, "{path}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert!(body["error"]["type"].is_string());
    }
    let (status, body) = server.post_raw(
        "/api/models/echo/infer",
        &format!("{{\"x\": \"{}\"}}", "a".repeat(100 << 10)),
    );
    assert_eq!(status, 413, "bodies are size-limited: {body}");
    assert_eq!(body["error"]["code"], "body_too_large", "{body}");
    let (status, body) = server.get("/v1/embeddings");
    assert_eq!(status, 405);
    assert_eq!(body["error"]["code"], "method_not_allowed", "{body}");
    // Any backend through infer.
    let (status, body) = server.post("/api/models/echo/infer", json!({ "hello": [1, 2] }));
    assert_eq!((status, body), (200, json!({ "hello": [1, 2] })));
}

#[test]
fn keep_alive_unloads_an_idle_model() {
    let server =
        Server::start("[[model]]\nname = \"echo\"\nbackend = \"echo\"\nkeep_alive = \"1s\"\n");
    assert_eq!(server.post("/api/models/echo/infer", json!({})).0, 200);
    let pid = server.ps()[0]["pid"].as_u64().unwrap() as u32;
    assert!(
        wait_for(Duration::from_secs(4), || server.ps().is_empty()),
        "unloaded after 1 s idle"
    );
    assert!(!alive(pid));
    // keep_alive 0 on a request unloads right after it.
    assert_eq!(
        server
            .post("/api/models/echo/infer?keep_alive=0", json!({}))
            .0,
        200
    );
    assert!(
        wait_for(Duration::from_secs(5), || server.ps().is_empty()),
        "unloaded right after"
    );
}

#[test]
fn the_budget_evicts_the_idle_model_but_never_one_in_flight() {
    let server = Server::start(
        "memory_budget = \"700MiB\"\n\
         [[model]]\nname = \"a\"\nbackend = \"hog\"\noptions = { alloc_mib = 400, work_ms = 3000 }\n\
         [[model]]\nname = \"b\"\nbackend = \"hog\"\noptions = { alloc_mib = 400 }\n",
    );
    // Let b's footprint be measured once.
    assert_eq!(server.post("/api/models/b/load", json!({})).0, 200);
    assert_eq!(server.post("/api/models/b/unload", json!({})).0, 200);

    // a is busy for 3 s: b cannot evict it. b's request waits for a's
    // turn to end (the scheduler: wait, don't refuse), and a's request in
    // flight finishes first, whole.
    let busy = std::thread::scope(|scope| {
        let a = scope.spawn(|| {
            let answer = server.post("/api/models/a/infer", json!({}));
            (answer, std::time::Instant::now())
        });
        assert!(wait_for(Duration::from_secs(10), || server
            .ps()
            .iter()
            .any(|m| m["in_flight"] == 1)));
        let (status, body) = server.post("/api/models/b/infer", json!({}));
        let b_done = std::time::Instant::now();
        assert_eq!(status, 200, "{body}");
        let (answer, a_done) = a.join().unwrap();
        assert!(a_done <= b_done, "a's request finished before b ran");
        answer
    });
    assert_eq!(busy.0, 200, "the request in flight finished: {}", busy.1);

    // a gave b its room once its request was done: b alone holds it.
    let ps = server.ps();
    assert_eq!(ps.len(), 1, "{ps:?}");
    assert_eq!(ps[0]["name"], "b");
    // And the other way: b idle now, a evicts it.
    let b_pid = ps[0]["pid"].as_u64().unwrap() as u32;
    let (status, body) = server.post("/api/models/a/load", json!({}));
    assert_eq!(status, 200, "{body}");
    assert!(!alive(b_pid), "the idle model was evicted");
}

#[test]
fn a_full_queue_answers_429_at_once() {
    let server = Server::start(
        "[[model]]\nname = \"slow\"\nbackend = \"hog\"\nmax_concurrency = 1\nmax_queue = 1\noptions = { work_ms = 4000 }\n",
    );
    assert_eq!(server.post("/api/models/slow/load", json!({})).0, 200);
    std::thread::scope(|scope| {
        let running = scope.spawn(|| server.post("/api/models/slow/infer", json!({})));
        assert!(wait_for(
            Duration::from_secs(5),
            || server.ps()[0]["in_flight"] == 1
        ));
        let queued = scope.spawn(|| server.post("/api/models/slow/infer", json!({})));
        assert!(wait_for(
            Duration::from_secs(5),
            || server.ps()[0]["queued"] == 1
        ));
        let started = Instant::now();
        let response = ureq::post(format!("{}/api/models/slow/infer", server.url))
            .config()
            .http_status_as_error(false)
            .build()
            .send_json(json!({}))
            .unwrap();
        assert_eq!(response.status().as_u16(), 429);
        assert!(started.elapsed() < Duration::from_millis(500), "at once");
        let retry = response
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        assert_eq!(
            retry.as_deref(),
            Some("1"),
            "tells the client when to retry"
        );
        assert_eq!(running.join().unwrap().0, 200);
        assert_eq!(queued.join().unwrap().0, 200);
    });
}

#[test]
fn swaps_under_load_drop_no_request() {
    let server = Server::start("[[model]]\nname = \"echo\"\nbackend = \"echo\"\n");
    assert_eq!(server.post("/api/models/echo/load", json!({})).0, 200);
    let stop = AtomicBool::new(false);
    let sent = AtomicU64::new(0);
    let failed = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut old_pids = Vec::new();
    std::thread::scope(|scope| {
        for client in 0..4 {
            let (server, stop, sent, failed) = (&server, &stop, &sent, Arc::clone(&failed));
            scope.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let body = json!({ "client": client, "i": i });
                    let (status, reply) = server.post("/api/models/echo/infer", body.clone());
                    if status != 200 || reply != body {
                        failed.lock().unwrap().push(format!("{status}: {reply}"));
                    }
                    sent.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            });
        }
        for _ in 0..10 {
            std::thread::sleep(Duration::from_millis(100));
            let (status, report) =
                server.post("/api/models/echo/swap", json!({ "backend": "echo" }));
            assert_eq!(status, 200, "{report}");
            assert_ne!(report["old_pid"], report["new_pid"]);
            assert_eq!(report["unload"]["pid"], report["old_pid"]);
            assert_eq!(report["unload"]["leftover_processes"], 0);
            old_pids.push(report["old_pid"].as_u64().unwrap() as u32);
        }
        std::thread::sleep(Duration::from_millis(100));
        stop.store(true, Ordering::Relaxed);
    });
    let failed = failed.lock().unwrap();
    assert!(
        failed.is_empty(),
        "{} of {} requests failed: {:?}",
        failed.len(),
        sent.load(Ordering::Relaxed),
        &failed[..failed.len().min(5)]
    );
    assert!(sent.load(Ordering::Relaxed) > 100, "the clients were busy");
    assert!(
        old_pids.iter().all(|pid| !alive(*pid)),
        "every old worker is gone"
    );
    assert_eq!(server.workers().len(), 1);
}

#[test]
fn a_swap_that_fails_to_load_leaves_the_old_worker_serving() {
    let server =
        Server::start("test_backends = true\n[[model]]\nname = \"echo\"\nbackend = \"echo\"\n");
    assert_eq!(server.post("/api/models/echo/load", json!({})).0, 200);
    let pid = server.ps()[0]["pid"].clone();
    let (status, body) = server.post(
        "/api/models/echo/swap",
        json!({ "backend": "fault", "options": { "mode": "crash-on-load" } }),
    );
    assert_eq!(status, 502, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("SIGSEGV"),
        "{body}"
    );
    assert_eq!(server.ps()[0]["pid"], pid, "the old worker still serves");
    assert_eq!(
        server
            .post("/api/models/echo/infer", json!({ "still": "here" }))
            .1,
        json!({ "still": "here" })
    );
    let (_, catalogue) = server.get("/api/models");
    assert_eq!(
        catalogue["models"][0]["spec"]["backend"], "echo",
        "the catalogue keeps the old spec"
    );
}

#[test]
fn register_and_remove_models_at_run_time() {
    let server = Server::start("");
    let (status, body) = server.put("/api/models/e2", json!({ "backend": "echo" }));
    assert_eq!(status, 201, "{body}");
    assert_eq!(
        server.post("/api/models/e2/infer", json!({ "a": 1 })).1,
        json!({ "a": 1 })
    );
    let (status, body) = server.put(
        "/api/models/e3",
        json!({ "backend": "embed", "model": "/etc" }),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("outside the models directory"),
        "{body}"
    );
    let pid = server.ps()[0]["pid"].as_u64().unwrap() as u32;
    let (status, body) = server.delete("/api/models/e2");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["unload"]["pid"].as_u64(), Some(pid as u64));
    assert!(!alive(pid));
    assert_eq!(server.post("/api/models/e2/infer", json!({})).0, 404);
}

#[test]
fn sigterm_stops_every_worker_and_exits_0() {
    let mut server = Server::start(
        "[[model]]\nname = \"a\"\nbackend = \"echo\"\n[[model]]\nname = \"b\"\nbackend = \"hog\"\n",
    );
    server.post("/api/models/a/load", json!({}));
    server.post("/api/models/b/load", json!({}));
    let workers = server.workers();
    assert_eq!(workers.len(), 2);
    let status = server
        .terminate(Duration::from_secs(15))
        .expect("exits on SIGTERM");
    assert_eq!(status.code(), Some(0));
    assert!(workers.iter().all(|pid| !alive(*pid)), "no worker left");
}

#[test]
fn sigkill_of_the_server_leaves_no_worker() {
    let mut server = Server::start("[[model]]\nname = \"a\"\nbackend = \"echo\"\n");
    server.post("/api/models/a/load", json!({}));
    let workers = server.workers();
    assert_eq!(workers.len(), 1);
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(1), || workers
            .iter()
            .all(|pid| !alive(*pid))),
        "workers died with it"
    );
}

#[test]
fn exposure_needs_a_token_and_a_wrong_one_gets_401() {
    let config = std::env::temp_dir().join(format!("berth-open-{}.toml", std::process::id()));
    std::fs::write(&config, "").unwrap();
    let out = std::process::Command::new(berth_bin())
        .args([
            "serve",
            "--listen",
            &format!("0.0.0.0:{}", free_port()),
            "--config",
        ])
        .arg(&config)
        .env_remove("BERTH_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("without a token"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let server = Server::start_with(
        "[[model]]\nname = \"echo\"\nbackend = \"echo\"\n",
        &["--token", "s3cret"],
    );
    assert_eq!(server.get("/api/ps").0, 200, "the right token works");
    let (status, body) = ureq::get(format!("{}/api/ps", server.url))
        .header("Authorization", "Bearer wrong")
        .config()
        .http_status_as_error(false)
        .build()
        .call()
        .map(|mut r| (r.status().as_u16(), r.body_mut().read_to_string().unwrap()))
        .unwrap();
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("unauthorized"));
    assert_eq!(
        ureq::get(format!("{}/healthz", server.url))
            .call()
            .unwrap()
            .status()
            .as_u16(),
        200
    );
}

#[test]
fn metrics_count_requests_loads_and_unloads() {
    let server = Server::start("[[model]]\nname = \"echo\"\nbackend = \"echo\"\n");
    for _ in 0..3 {
        server.post("/api/models/echo/infer", json!({}));
    }
    server.post("/api/models/echo/unload", json!({}));
    let text = ureq::get(format!("{}/metrics", server.url))
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    for line in [
        "berth_requests_total{model=\"echo\"} 3",
        "berth_loads_total{model=\"echo\"} 1",
        "berth_unloads_total{model=\"echo\"} 1",
        "berth_request_duration_seconds_count{model=\"echo\"} 3",
    ] {
        assert!(text.lines().any(|l| l == line), "`{line}` in:\n{text}");
    }
}

/// One raw request on its own connection: its status and body.
fn raw_http(port: u16, head: &str) -> (u16, String) {
    let (status, out) = berth_tests::raw_http(port, head);
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string());
    (status, body.unwrap_or_default())
}

/// `curl -X POST .../load` sends no body and no type: there is nothing to
/// type, so it is not refused with 415; the Origin check still applies, and
/// a body without its type is still refused.
#[test]
fn a_post_without_a_body_needs_no_content_type() {
    let server = Server::start("[[model]]\nname = \"echo\"\nbackend = \"echo\"\n");
    let port = server.port();
    let host = format!("Host: 127.0.0.1:{port}\r\nConnection: close\r\n");
    let (status, body) = raw_http(
        port,
        &format!("POST /api/models/echo/load HTTP/1.1\r\n{host}\r\n"),
    );
    assert_eq!(status, 200, "no Content-Length: {body}");
    let (status, body) = raw_http(
        port,
        &format!("POST /api/models/echo/unload HTTP/1.1\r\n{host}Content-Length: 0\r\n\r\n"),
    );
    assert_eq!(status, 200, "Content-Length: 0: {body}");
    let (status, body) = raw_http(
        port,
        &format!(
            "POST /api/models/echo/load HTTP/1.1\r\n{host}Origin: https://evil.example\r\n\r\n"
        ),
    );
    assert_eq!(status, 403, "a foreign origin: {body}");
    assert!(body.contains("forbidden_origin"), "{body}");
    // A host name a DNS-rebinding page would send: refused too.
    let (status, body) = raw_http(
        port,
        "POST /api/models/echo/load HTTP/1.1\r\nHost: attacker.example:7733\r\n\
         Connection: close\r\n\r\n",
    );
    assert_eq!(status, 403, "a foreign host: {body}");
    assert!(body.contains("forbidden_host"), "{body}");
    let (status, body) = raw_http(
        port,
        &format!("POST /api/models/echo/load HTTP/1.1\r\n{host}Content-Length: 2\r\n\r\n{{}}"),
    );
    assert_eq!(status, 415, "a body without its type: {body}");
    let (status, body) = raw_http(
        port,
        &format!(
            "POST /api/models/echo/load HTTP/1.1\r\n{host}Content-Type: text/plain\r\n\
             Content-Length: 2\r\n\r\n{{}}"
        ),
    );
    assert_eq!(status, 415, "a form-like body: {body}");
}
