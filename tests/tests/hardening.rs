//! `berth serve` against a hostile client: no client chooses what runs,
//! nothing from outside panics a handler or is taken unchecked, and no
//! connection holds the daemon. Its own safety (stopping, the state file,
//! sockets, what a worker sends) is in `hardening_daemon.rs`.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use berth_tests::daemon::{Daemon, post_json, temp_dir};
use berth_tests::*;
use serde_json::json;

// ----- 1. what runs is the operator's decision -----

#[test]
fn no_http_client_chooses_the_program_or_its_environment() {
    let marker = temp_dir("exec").join("ran");
    let server = Server::start(&format!(
        "[workers.declared]\nbinary = \"{}\"\n\n[[model]]\nname = \"e\"\nbackend = \"echo\"\n",
        worker_bin().display()
    ));
    // The finding: bash as the worker, a command in BASH_ENV.
    let attack = json!({
        "backend": "echo",
        "worker_binary": "/usr/bin/bash",
        "env": [["BASH_ENV", format!("$(touch {})", marker.display())]],
    });
    for (path, body) in [
        ("/api/models/x", attack.clone()),
        (
            "/api/models/x",
            json!({ "backend": "echo", "env": [["LD_PRELOAD", "/tmp/x.so"]] }),
        ),
        (
            "/api/models/x",
            json!({ "backend": "echo", "command": ["/usr/bin/bash"] }),
        ),
        ("/api/models/x", json!({ "backend": "echo", "cwd": "/" })),
    ] {
        let (status, reply) = server.put(path, body);
        assert_eq!(status, 403, "{reply}");
        assert_eq!(reply["error"]["code"], "operator_only");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains("[workers.NAME]"),
            "{reply}"
        );
    }
    let (status, reply) = server.post("/api/models/e/swap", attack);
    assert_eq!(status, 403, "{reply}");
    let (status, _) = server.post("/api/models/x/load", json!({}));
    assert_eq!(status, 404, "nothing was registered");
    assert!(!marker.exists(), "no program of the client's ran");

    // A misspelt or unknown field is refused, not silently ignored.
    let (status, reply) = server.put(
        "/api/models/x",
        json!({ "backend": "echo", "workerbinary": "/bin/sh" }),
    );
    assert_eq!(status, 400, "{reply}");

    // Naming a worker kind the operator declared is how a client picks one.
    let (status, reply) = server.put(
        "/api/models/k",
        json!({ "backend": "echo", "worker": "nope" }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("declared: declared"),
        "{reply}"
    );
    let (status, reply) = server.put(
        "/api/models/k",
        json!({ "backend": "echo", "worker": "declared" }),
    );
    assert_eq!(status, 201, "{reply}");
    let (status, reply) = server.post("/api/models/k/infer", json!({ "input": "hi" }));
    assert_eq!(
        (status, reply["input"].as_str()),
        (200, Some("hi")),
        "{reply}"
    );
}

#[test]
fn loader_and_interpreter_variables_are_refused_in_a_model_but_allowed_on_a_worker_kind() {
    let dir = temp_dir("env");
    let mut refused = Daemon::start(
        &dir,
        "[[model]]\nname = \"e\"\nbackend = \"echo\"\nenv = [[\"LD_PRELOAD\", \"/tmp/x.so\"]]\n",
        &["--listen", &format!("127.0.0.1:{}", free_port())],
    );
    let status = refused
        .exited_within(Duration::from_secs(10))
        .expect("refused at start");
    assert!(!status.success());
    assert!(
        refused.stderr().contains("LD_PRELOAD"),
        "{}",
        refused.stderr()
    );

    // The operator's worker kind may set them: its env reaches the worker.
    let server = Server::start(&format!(
        "[workers.traced]\nbinary = \"{}\"\nenv = {{ PYTHONPATH = \"/opt/operator\" }}\n\n\
         [[model]]\nname = \"e\"\nbackend = \"echo\"\nworker = \"traced\"\n",
        worker_bin().display()
    ));
    let (status, reply) = server.post("/api/models/e/load", json!({}));
    assert_eq!(status, 200, "{reply}");
    let pid = reply["pid"].as_u64().unwrap() as i32;
    let environ = procfs::process::Process::new(pid)
        .unwrap()
        .environ()
        .unwrap();
    assert_eq!(
        environ
            .get(std::ffi::OsStr::new("PYTHONPATH"))
            .map(|v| v.to_str().unwrap()),
        Some("/opt/operator")
    );
    let status = procfs::process::Process::new(pid)
        .unwrap()
        .status()
        .unwrap();
    assert_eq!(status.nonewprivs, Some(1), "workers run with no_new_privs");
}

#[test]
fn a_web_page_cannot_reach_the_api() {
    let server = Server::start("[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    let port = server.port();
    let post = |headers: &str, body: &str| {
        raw_http(
            port,
            &format!(
                "POST /api/models/e/load HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    let host = format!("Host: 127.0.0.1:{port}\r\n");
    // A cross-site form post or `fetch` with a text body: no JSON type.
    for content_type in ["text/plain", "application/x-www-form-urlencoded"] {
        let (status, out) = post(&format!("{host}Content-Type: {content_type}\r\n"), "{}");
        assert_eq!(status, 415, "{out}");
        assert!(out.contains("unsupported_media_type"), "{out}");
    }
    // A body-less POST needs no type (nothing to type: issue 26), but the
    // one a page can send without a preflight carries its Origin.
    let (status, out) = post(&format!("{host}Origin: https://evil.example\r\n"), "");
    assert_eq!(status, 403, "a POST without a body from a page: {out}");
    assert!(out.contains("forbidden_origin"), "{out}");
    // A page on another origin, even with the JSON type (after a preflight
    // berth never approves, or from a browser that skipped one).
    let (status, out) = post(
        &format!("{host}Origin: https://evil.example\r\nContent-Type: application/json\r\n"),
        "{}",
    );
    assert_eq!(status, 403, "{out}");
    assert!(out.contains("forbidden_origin"), "{out}");
    // DNS rebinding: the page's own name, resolved to 127.0.0.1.
    let (status, out) = raw_http(
        port,
        &format!("GET /api/ps HTTP/1.1\r\nHost: evil.example:{port}\r\nConnection: close\r\n\r\n"),
    );
    assert_eq!(status, 403, "{out}");
    assert!(out.contains("forbidden_host"), "{out}");
    assert!(server.ps().is_empty(), "nothing was loaded");
    // The real clients still get through.
    let (status, out) = post(
        &format!("Host: localhost:{port}\r\nContent-Type: application/json\r\n"),
        "{}",
    );
    assert_eq!(status, 200, "{out}");
}

// ----- 2. checked arithmetic for everything from outside -----

#[test]
fn extreme_durations_and_sizes_are_400s_and_nothing_sticks() {
    let server = Server::start("[[model]]\nname = \"e\"\nbackend = \"echo\"\n");
    let port = server.port();
    let extremes = [
        "1e19",
        "1e20",
        "1e308",
        "-1",
        "NaN",
        "inf",
        "18446744073709551616",
        "99999999999h",
    ];
    for value in extremes {
        for field in ["keep_alive", "timeout"] {
            let (status, out) =
                post_json(port, &format!("/api/models/e/infer?{field}={value}"), "{}");
            assert_eq!(status, 400, "{field}={value}: {out}");
            assert!(
                out.contains(field),
                "{field}={value} names the field: {out}"
            );
        }
        let number: Option<f64> = value.parse().ok().filter(|n: &f64| n.is_finite());
        let as_json = number.map_or(json!(value), |n| json!(n));
        let (status, reply) = server.post(
            "/v1/embeddings",
            json!({ "model": "e", "input": "x", "keep_alive": as_json }),
        );
        assert_eq!(status, 400, "keep_alive {value}: {reply}");
        for field in [
            "keep_alive",
            "load_timeout",
            "stall_timeout",
            "restart_window",
            "memory_limit",
            "max_rss",
        ] {
            let (status, reply) = server.put(
                "/api/models/r",
                json!({ "backend": "echo", field: as_json }),
            );
            assert_eq!(status, 400, "{field} = {value}: {reply}");
            assert!(
                reply["error"]["message"].as_str().unwrap().contains(field),
                "{reply}"
            );
        }
    }
    for (field, value) in [
        ("max_concurrency", json!(u64::MAX)),
        ("max_queue", json!(u64::MAX)),
        ("max_concurrency", json!(0)),
    ] {
        let (status, reply) =
            server.put("/api/models/r", json!({ "backend": "echo", field: value }));
        assert_eq!(status, 400, "{field}: {reply}");
    }
    // Nothing stuck to the model, and the handler is alive.
    let (status, reply) = server.post("/api/models/e/infer", json!({ "input": "still here" }));
    assert_eq!(status, 200, "{reply}");
    let (status, _) = server.post("/api/models/e/infer?keep_alive=3e7", json!({}));
    assert_eq!(status, 200, "the largest keep-alive in range is fine");
}

#[test]
fn bad_option_values_and_names_are_400s() {
    // (It registers `hog` models over HTTP: test doubles are allowed.)
    let server = Server::start("test_backends = true\n");
    let port = server.port();
    for value in [json!(-5), json!(1e308), json!("lots")] {
        let (status, reply) = server.put(
            "/api/models/h",
            json!({ "backend": "hog", "options": { "alloc_mib": value } }),
        );
        assert_eq!(status, 201, "{reply}");
        let (status, reply) = server.post("/api/models/h/load", json!({}));
        assert_eq!(status, 400, "alloc_mib = {value}: {reply}");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains("alloc_mib"),
            "{reply}"
        );
    }
    let body = r#"{"backend":"echo"}"#;
    for name in ["%2E", "%2E%2E", ".hidden"] {
        let (status, out) = raw_http(
            port,
            &format!(
                "PUT /api/models/{name} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        );
        assert_eq!(status, 400, "{name}: {out}");
    }
    let (status, reply) = server.put("/api/models/u", json!({ "backend": "nope" }));
    assert_eq!(status, 400, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no backend `nope`") && message.contains("echo"),
        "{message}"
    );
}

#[test]
fn a_request_for_the_other_kind_of_model_is_refused_before_anything_runs() {
    let smollm2 = default_model("smollm2");
    let server = Server::start(&format!(
        "[[model]]\nname = \"chat\"\nbackend = \"generate\"\nmodel = \"{}\"\n",
        smollm2.display()
    ));
    let started = Instant::now();
    let (status, reply) = server.post(
        "/v1/embeddings",
        json!({ "model": "chat", "input": "hello" }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("/v1/chat/completions"),
        "{reply}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(server.ps().is_empty(), "the chat model was not even loaded");
}

#[test]
fn the_token_is_never_blank_and_the_bearer_scheme_is_any_case() {
    let dir = temp_dir("token");
    let mut blank = Daemon::start(
        &dir,
        "",
        &[
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--token",
            "   ",
        ],
    );
    assert!(
        !blank
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    assert!(blank.stderr().contains("blank"), "{}", blank.stderr());

    let server = Server::start_with("", &["--token", "s3cret"]);
    let port = server.port();
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let (status, out) = raw_http(
            port,
            &format!(
                "GET /api/ps HTTP/1.1\r\nHost: localhost:{port}\r\nAuthorization: {scheme} s3cret\r\nConnection: close\r\n\r\n"
            ),
        );
        assert_eq!(status, 200, "{scheme}: {out}");
    }
    let (status, _) = raw_http(
        port,
        &format!(
            "GET /api/ps HTTP/1.1\r\nHost: localhost:{port}\r\nAuthorization: Bearer s3cre\r\nConnection: close\r\n\r\n"
        ),
    );
    assert_eq!(status, 401);
}

#[test]
fn a_model_directory_swapped_for_a_symlink_is_refused_at_load() {
    let dir = temp_dir("symlink");
    let models = dir.join("models");
    std::fs::create_dir_all(models.join("m")).unwrap();
    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let server = Server::start(&format!("models_dir = \"{}\"\n", models.display()));
    let (status, reply) = server.put(
        "/api/models/m",
        json!({ "backend": "echo", "model": models.join("m") }),
    );
    assert_eq!(status, 201, "{reply}");
    std::fs::remove_dir(models.join("m")).unwrap();
    std::os::unix::fs::symlink(&outside, models.join("m")).unwrap();
    let (status, reply) = server.post("/api/models/m/load", json!({}));
    assert_eq!(status, 400, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("outside the models directory"),
        "{message}"
    );
    assert!(server.ps().is_empty());
}

// ----- 3. connection hygiene -----

#[test]
fn slow_header_connections_are_capped_and_shed() {
    let server = Server::start(
        "header_timeout = \"1s\"\nmax_connections = 8\n[[model]]\nname = \"e\"\nbackend = \"echo\"\n",
    );
    let port = server.port();
    // The start-up probe's kept-alive connection is shed first.
    std::thread::sleep(Duration::from_millis(1500));
    let slow: Vec<TcpStream> = (0..8)
        .map(|_| {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"GET /api/ps HTTP/1.1\r\nHost: loc").unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let (status, out) = raw_http(
        port,
        &format!("GET /api/ps HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n"),
    );
    assert_eq!(status, 503, "past the cap: {out}");
    assert!(out.contains("too_many_connections"), "{out}");
    // Shed after the header timeout: each slow connection is closed.
    let started = Instant::now();
    for mut s in slow {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 256];
        let n = s.read(&mut buf).unwrap_or(0);
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(n == 0 || text.starts_with("HTTP/1.1 408"), "closed: {text}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "shed in {:?}",
        started.elapsed()
    );
    let (status, reply) = server.post("/api/models/e/infer", json!({ "input": 1 }));
    assert_eq!(status, 200, "served again: {reply}");
    // An idle kept-alive connection is closed the same way.
    let mut idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
    idle.write_all(format!("GET /healthz HTTP/1.1\r\nHost: localhost:{port}\r\n\r\n").as_bytes())
        .unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut all = Vec::new();
    let started = Instant::now();
    let _ = idle.read_to_end(&mut all);
    assert!(String::from_utf8_lossy(&all).starts_with("HTTP/1.1 200"));
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "idle closed in {:?}",
        started.elapsed()
    );
}
