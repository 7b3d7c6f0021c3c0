//! `berth serve` against a hostile client and a hostile worker: no client
//! chooses what runs, nothing from outside panics a handler, the daemon
//! always stops, and nothing a client or a worker sends exhausts it.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use berth_tests::*;
use serde_json::{Value, json};

/// A raw HTTP/1.1 exchange, for what an HTTP client library would not send
/// (a foreign Host, a form body, a half-sent head).
fn raw(port: u16, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out);
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// A JSON POST on a connection of its own, as any client sends it.
fn post_json(port: u16, path: &str, body: &str) -> (u16, String) {
    raw(
        port,
        &format!(
            "POST {path} HTTP/1.1\r\nHost: localhost:{port}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    )
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("berth-hardening-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `berth serve` with `config`, its stderr in a file, in a process group of
/// its own (so a bug that signals "its own group" cannot reach the tests).
struct Daemon {
    child: Child,
    stderr: PathBuf,
}

impl Daemon {
    fn start(dir: &Path, config: &str, args: &[&str]) -> Daemon {
        use std::os::unix::process::CommandExt;
        let config_path = dir.join("berth.toml");
        std::fs::write(&config_path, config).unwrap();
        let stderr = dir.join(format!("stderr-{}.log", free_port()));
        let child = Command::new(berth_bin())
            .arg("serve")
            .arg("--config")
            .arg(&config_path)
            .args(args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .process_group(0)
            .spawn()
            .unwrap();
        Daemon { child, stderr }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn exited_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    fn signal(&self, signal: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.child.id() as i32), signal);
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal(nix::sys::signal::Signal::SIGTERM);
            if self.exited_within(Duration::from_secs(15)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

fn wait_healthy(port: u16) -> bool {
    wait_for(Duration::from_secs(20), || {
        TcpStream::connect(("127.0.0.1", port)).is_ok_and(|mut s| {
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.write_all(
                b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
            );
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out.starts_with("HTTP/1.1 200")
        })
    })
}

fn rss_of(pid: u32) -> u64 {
    berth::child::memory::resident_bytes(pid).unwrap_or(0)
}

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
        raw(
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
    let (status, out) = raw(
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
        let (status, out) = raw(
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
        let (status, out) = raw(
            port,
            &format!(
                "GET /api/ps HTTP/1.1\r\nHost: localhost:{port}\r\nAuthorization: {scheme} s3cret\r\nConnection: close\r\n\r\n"
            ),
        );
        assert_eq!(status, 200, "{scheme}: {out}");
    }
    let (status, _) = raw(
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

// ----- 3. shutdown always ends -----

#[test]
fn sigterm_ends_despite_a_hung_request_and_a_half_sent_head() {
    let dir = temp_dir("sigterm");
    let port = free_port();
    let mut daemon = Daemon::start(
        &dir,
        "drain_timeout = \"1s\"\n[[model]]\nname = \"hang\"\nbackend = \"fault\"\noptions = { mode = \"hang-on-request\" }\n",
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    assert!(wait_healthy(port));
    let hung = std::thread::spawn(move || post_json(port, "/api/models/hang/infer", "{}"));
    let workers = || {
        children_of(daemon.child.id())
            .into_iter()
            .filter(|(_, s)| *s != 'Z')
            .count()
    };
    assert!(
        wait_for(Duration::from_secs(20), || workers() == 1),
        "the worker runs"
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
    half.write_all(b"POST /v1/embeddings HTTP/1.1\r\nHost: local")
        .unwrap();

    let started = Instant::now();
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    // Drain 1 s, then the hung worker's stop (Shutdown, 5 s, SIGTERM).
    let status = daemon.exited_within(Duration::from_secs(20));
    assert!(
        status.is_some(),
        "berth serve did not exit; stderr:\n{}",
        daemon.stderr()
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    let (code, out) = hung.join().unwrap();
    assert!(
        code == 502 || code == 503 || code == 0,
        "the hung request ended: {code} {out}"
    );
}

#[test]
fn a_second_signal_stops_at_once() {
    let dir = temp_dir("second-signal");
    let port = free_port();
    let mut daemon = Daemon::start(
        &dir,
        "drain_timeout = \"60s\"\n[[model]]\nname = \"hang\"\nbackend = \"fault\"\noptions = { mode = \"ignore-shutdown\" }\n",
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    assert!(wait_healthy(port));
    let (status, out) = post_json(port, "/api/models/hang/load", "{}");
    assert_eq!(status, 200, "{out}");
    let worker: u32 = children_of(daemon.child.id())[0].0;
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let status = daemon
        .exited_within(Duration::from_secs(5))
        .expect("exits at once");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(status.code(), Some(130));
    assert!(
        wait_for(Duration::from_secs(5), || !alive(worker)),
        "its worker was killed"
    );
}

// ----- 4. connection hygiene -----

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
    let (status, out) = raw(
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

// ----- 5. one writer for the state file; sockets never removed -----

#[test]
fn a_second_server_on_the_same_state_file_refuses_and_touches_nothing() {
    let dir = temp_dir("state");
    let state = dir.join("state.json");
    let config = format!(
        "state_file = \"{}\"\n[[model]]\nname = \"e\"\nbackend = \"echo\"\n",
        state.display()
    );
    let first_port = free_port();
    let first = Daemon::start(
        &dir,
        &config,
        &["--listen", &format!("127.0.0.1:{first_port}")],
    );
    assert!(wait_healthy(first_port));
    let (status, out) = post_json(first_port, "/api/models/e/load", "{}");
    assert_eq!(status, 200, "{out}");
    let before = std::fs::read_to_string(&state).unwrap();
    assert!(before.contains("\"model\": \"e\""), "{before}");

    let mut second = Daemon::start(
        &dir,
        &config,
        &["--listen", &format!("127.0.0.1:{}", free_port())],
    );
    assert!(
        !second
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    let said = second.stderr();
    assert!(
        said.contains(&format!("pid {}", first.child.id())),
        "names the first: {said}"
    );
    assert_eq!(
        std::fs::read_to_string(&state).unwrap(),
        before,
        "the state is untouched"
    );
}

#[test]
fn unix_socket_paths_in_use_or_not_sockets_are_never_removed() {
    let dir = temp_dir("sockets");
    let socket = dir.join("berth.sock");
    let listen = format!("unix:{}", socket.display());
    let first = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", dir.join("a.json").display()),
        &["--listen", &listen],
    );
    assert!(wait_for(Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    }));
    let mut second = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", dir.join("b.json").display()),
        &["--listen", &listen],
    );
    assert!(
        !second
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    assert!(
        second.stderr().contains("another server is listening"),
        "{}",
        second.stderr()
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_ok(),
        "the first still serves"
    );

    let file = dir.join("precious.txt");
    std::fs::write(&file, "keep me").unwrap();
    let mut third = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", dir.join("c.json").display()),
        &["--listen", &format!("unix:{}", file.display())],
    );
    assert!(
        !third
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    assert!(
        third.stderr().contains("is not a socket"),
        "{}",
        third.stderr()
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    drop(first);
    assert!(!socket.exists(), "the first removed its own socket at exit");
}

#[test]
fn stale_entries_are_acted_on_only_when_provably_the_recorded_worker() {
    let dir = temp_dir("stale");
    let state = dir.join("state.json");
    // Live strangers leading their own groups, whose pids stale entries
    // name: one with a different start time (a reused pid), one where no
    // start time was recorded.
    let spawn_leader = || {
        use std::os::unix::process::CommandExt;
        Command::new("sleep")
            .arg("60")
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let (mut stranger, mut unproven) = (spawn_leader(), spawn_leader());
    let (stranger_pid, unproven_pid) = (stranger.id(), unproven.id());
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let record = |pid: u32, pgid: u32, start: u64| json!({ "pid": pid, "pgid": pgid, "start_time": start, "model": "old" });
    let stale = json!({
        "supervisor_pid": 999_999_999u32,
        "boot_id": boot_id.trim(),
        "workers": [
            record(stranger_pid, 0, 1),             // group 0: "my own group"
            record(stranger_pid, stranger_pid, 1),  // a reused pid: start time differs
            record(unproven_pid, unproven_pid, 0),  // no start time: proves nothing
        ],
    });
    std::fs::write(&state, stale.to_string()).unwrap();
    let port = free_port();
    let daemon = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", state.display()),
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    assert!(wait_healthy(port), "{}", daemon.stderr());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        matches!(stranger.try_wait(), Ok(None)),
        "the stranger lives"
    );
    assert!(
        matches!(unproven.try_wait(), Ok(None)),
        "the unproven one lives"
    );
    assert!(
        alive(daemon.child.id()),
        "the daemon did not signal its own group"
    );
    for mut child in [stranger, unproven] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[test]
fn concurrent_workers_leave_a_consistent_state_file() {
    let dir = temp_dir("many");
    let state = dir.join("state.json");
    let mut config = format!("state_file = \"{}\"\n", state.display());
    for i in 0..32 {
        config.push_str(&format!("[[model]]\nname = \"e{i}\"\nbackend = \"echo\"\n"));
    }
    let port = free_port();
    let mut daemon = Daemon::start(&dir, &config, &["--listen", &format!("127.0.0.1:{port}")]);
    assert!(wait_healthy(port));
    let loads: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || post_json(port, &format!("/api/models/e{i}/load"), "{}").0)
        })
        .collect();
    for load in loads {
        assert_eq!(load.join().unwrap(), 200);
    }
    let listed: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(listed["workers"].as_array().unwrap().len(), 32);
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(
        daemon
            .exited_within(Duration::from_secs(30))
            .is_some_and(|s| s.success())
    );
    let listed: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(listed["workers"], json!([]), "no dead worker left listed");
    assert!(
        !daemon.stderr().contains("cannot write the state file"),
        "{}",
        daemon.stderr()
    );
}

// ----- 6. bounded everything a worker sends -----

#[test]
fn a_worker_flooding_stderr_does_not_grow_the_supervisor() {
    let server = Server::start(
        "[[model]]\nname = \"loud\"\nbackend = \"fault\"\noptions = { stderr_bytes = 104857600 }\n",
    );
    let (status, _) = server.post("/api/models/loud/load", json!({}));
    assert_eq!(status, 200);
    let before = rss_of(server.pid());
    let (status, reply) = server.post("/api/models/loud/infer", json!({ "input": 1 }));
    assert_eq!(status, 200, "{reply}");
    // The line is written before the answer; give the reader a moment.
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_of(server.pid());
    assert!(
        after < before + (24 << 20),
        "supervisor RSS {} MiB -> {} MiB after a 100 MB stderr line",
        before >> 20,
        after >> 20
    );
    let ps = serde_json::to_string(&server.ps()).unwrap();
    assert!(ps.len() < 64 << 10, "ps stays small: {} bytes", ps.len());
}

#[test]
fn answers_and_inputs_past_their_limits_are_refused_and_memory_comes_back() {
    let server = Server::start(
        "max_response = \"8MiB\"\nmax_inputs = 100\n\
         [[model]]\nname = \"big\"\nbackend = \"fault\"\noptions = { response_bytes = 16777216 }\n\
         [[model]]\nname = \"fits\"\nbackend = \"fault\"\noptions = { response_bytes = 6291456 }\n\
         [[model]]\nname = \"e\"\nbackend = \"echo\"\n",
    );
    let (status, reply) = server.post("/api/models/big/infer", json!({}));
    assert_eq!(
        status,
        400,
        "{}",
        &reply.to_string()[..200.min(reply.to_string().len())]
    );
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_response"),
        "{reply}"
    );
    let texts: Vec<String> = (0..101).map(|i| format!("text {i}")).collect();
    let (status, reply) = server.post("/v1/embeddings", json!({ "model": "e", "input": texts }));
    assert_eq!(status, 413, "{reply}");
    assert_eq!(reply["error"]["code"], "too_many_inputs");

    let (status, _) = server.post("/api/models/fits/infer", json!({}));
    assert_eq!(status, 200);
    let baseline = rss_of(server.pid());
    for _ in 0..5 {
        let (status, _) = server.post("/api/models/fits/infer", json!({}));
        assert_eq!(status, 200);
    }
    assert!(
        wait_for(Duration::from_secs(5), || rss_of(server.pid())
            < baseline + (8 << 20)),
        "supervisor RSS {} MiB after 6 MiB answers, from {} MiB",
        rss_of(server.pid()) >> 20,
        baseline >> 20
    );
}
