//! The reload under hostile conditions (issue "hardening, fourth round"):
//! a save that truncates first keeps every model, a config path that is a
//! link to `/dev/zero` or a FIFO is refused at once and reads nothing, a
//! bad line of megabytes is quoted a few hundred bytes long, a step that
//! fails leaves its model pending for the next reload, and a config with
//! no models never replaces one with some unless asked.

use std::time::{Duration, Instant};

use berth_tests::*;
use serde_json::json;

fn model(name: &str) -> String {
    format!("[[model]]\nname = \"{name}\"\nbackend = \"echo\"\n")
}

fn signal(server: &Server, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(server.pid() as i32), signal).unwrap();
}

fn names(server: &Server) -> Vec<String> {
    let (_, catalogue) = server.get("/api/models");
    let mut names: Vec<String> = catalogue["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["spec"]["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

fn pids(server: &Server) -> Vec<(String, u64)> {
    let mut pids: Vec<(String, u64)> = server
        .ps()
        .iter()
        .filter_map(|m| Some((m["name"].as_str()?.to_string(), m["pid"].as_u64()?)))
        .collect();
    pids.sort();
    pids
}

/// With `--watch-config`, a save that truncates the file, then writes it
/// 1.6 s later (`open(…, "w")`, a slow writer), and a save cut at a line
/// boundary and finished 1 s later: no model is removed, unloaded or
/// loaded again, every worker keeps its pid; the whole file, once it has
/// settled, is applied once (a model added at the end is registered).
#[test]
fn a_truncate_then_write_save_keeps_every_model() {
    let config = format!("{}{}{}", model("a"), model("b"), model("c"));
    let server = Server::start_with(&config, &["--watch-config"]);
    for name in ["a", "b", "c"] {
        assert_eq!(
            server
                .post(&format!("/api/models/{name}/load"), json!({}))
                .0,
            200
        );
    }
    let before = pids(&server);
    assert_eq!(before.len(), 3);
    // Truncated, then written 1.6 s later with one model more.
    std::fs::write(&server.config, "").unwrap();
    std::thread::sleep(Duration::from_millis(1600));
    std::fs::write(&server.config, format!("{config}{}", model("d"))).unwrap();
    assert!(
        wait_for(Duration::from_secs(15), || names(&server)
            .contains(&"d".to_string())),
        "the whole file was not applied: {:?}",
        server.events()
    );
    // Cut after the first model, then finished.
    let cut = model("a");
    std::fs::write(&server.config, &cut).unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    std::fs::write(
        &server.config,
        format!("{config}{}{}", model("d"), model("e")),
    )
    .unwrap();
    assert!(
        wait_for(Duration::from_secs(15), || names(&server)
            .contains(&"e".to_string())),
        "{:?}",
        server.events()
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(names(&server), ["a", "b", "c", "d", "e"]);
    assert_eq!(pids(&server), before, "a worker was replaced or lost");
    for kind in ["unloaded", "deregistered"] {
        assert!(
            server.events_of(kind).is_empty(),
            "{kind}: {:?}",
            server.events_of(kind)
        );
    }
    let reloaded = server.events_of("config_reloaded");
    assert_eq!(reloaded.len(), 2, "one reload a whole save: {reloaded:?}");
}

/// A config with no models (a file emptied on purpose or caught between
/// its truncation and its write) replaces one with models only when
/// asked: `berth reload` refuses it and changes nothing, `berth reload
/// --allow-empty` applies it.
#[test]
fn an_empty_config_replaces_models_only_when_asked() {
    let server = Server::start(&format!("{}{}", model("a"), model("b")));
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    std::fs::write(&server.config, "# nothing\n").unwrap();
    let (ok, _, stderr) = server.cli(&["reload"]);
    assert!(!ok, "an emptying reload was applied");
    assert!(
        stderr.contains("no models") && stderr.contains("--allow-empty"),
        "{stderr}"
    );
    assert_eq!(names(&server), ["a", "b"]);
    let (ok, reply, stderr) = server.cli(&["reload", "--allow-empty"]);
    assert!(ok, "{stderr}");
    assert_eq!(reply["removed"], json!(["a", "b"]), "{reply}");
    assert!(names(&server).is_empty());
}

/// The config path a link to `/dev/zero`, then a FIFO: `SIGHUP`, `berth
/// reload` and the watcher refuse it at once, berth reads nothing of it
/// (its memory stays under 256 MiB) and keeps its models; once the path is
/// a file again, a reload applies it. The same for `--llama-swap`'s file.
#[test]
fn a_config_that_is_a_device_or_a_fifo_is_refused_at_once() {
    let config = format!("{}{}", model("a"), model("b"));
    let server = Server::start_with(&config, &["--watch-config"]);
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let pid = pids(&server);
    let path = server.config.clone();
    let saved = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
    signal(&server, nix::sys::signal::Signal::SIGHUP);
    let started = Instant::now();
    let (ok, _, stderr) = server.cli(&["reload"]);
    assert!(!ok);
    assert!(stderr.contains("a device"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    std::thread::sleep(Duration::from_secs(3));
    let rss = berth::memory::resident_bytes(server.pid()).unwrap_or(0);
    assert!(rss < 256 << 20, "berth holds {} MiB", rss >> 20);
    // A FIFO with no writer: refused at once, and no later reload waits.
    std::fs::remove_file(&path).unwrap();
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for _ in 0..3 {
        let started = Instant::now();
        let (ok, _, stderr) = server.cli(&["reload"]);
        assert!(!ok && stderr.contains("a FIFO"), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(5));
    }
    std::fs::remove_file(&path).unwrap();
    std::fs::write(&path, format!("{saved}{}", model("c"))).unwrap();
    let (ok, reply, stderr) = server.cli(&["reload"]);
    assert!(ok, "{stderr}");
    assert_eq!(reply["added"], json!(["c"]));
    assert_eq!(names(&server), ["a", "b", "c"]);
    assert_eq!(pids(&server), pid);
    for event in server.events_of("config_rejected") {
        let error = event["error"].as_str().unwrap();
        assert!(error.len() < 2000, "{} bytes", error.len());
    }
}

/// A config whose bad line is 5 MB: refused with the line quoted a few
/// hundred bytes long in the answer and the event; a hundred such reloads
/// leave berth's memory where it was and the event history small.
#[test]
fn a_megabyte_bad_line_is_quoted_short() {
    let config = model("a");
    let server = Server::start(&config);
    let bad = format!("{config}name = \"{}\n", "x".repeat(5 << 20));
    std::fs::write(&server.config, &bad).unwrap();
    let rss_before = berth::memory::resident_bytes(server.pid()).unwrap_or(0);
    for _ in 0..100 {
        let (status, reply) = server.post("/api/reload", json!({}));
        assert_eq!(status, 422, "{reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.len() < 4000, "{} bytes", message.len());
    }
    let (status, events) = server.raw_get("/api/events?follow=false");
    assert_eq!(status, 200);
    assert!(
        events.len() < 1 << 20,
        "/api/events answered {} bytes",
        events.len()
    );
    let rss_after = berth::memory::resident_bytes(server.pid()).unwrap_or(0);
    assert!(
        rss_after < rss_before + (128 << 20),
        "{} MiB before, {} MiB after",
        rss_before >> 20,
        rss_after >> 20
    );
}

/// A reload during a model's load: the load is waited for, and the model
/// removed from the file is then removed (not left loaded for good, with
/// later reloads saying "unchanged").
#[test]
fn a_reload_during_a_load_waits_and_removes_the_model() {
    let slow = "[[model]]\nname = \"slow\"\nbackend = \"fault\"\noptions = { mode = \"ok\", load_delay_ms = \"3000\" }\n";
    let server = Server::start(&format!("test_backends = true\n{slow}{}", model("a")));
    let loading = {
        let url = server.url.clone();
        std::thread::spawn(move || {
            ureq::post(format!("{url}/api/models/slow/load"))
                .header("Content-Type", "application/json")
                .send("{}")
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        })
    };
    assert!(wait_for(Duration::from_secs(10), || {
        server.ps().iter().any(|m| m["name"] == "slow")
    }));
    std::fs::write(
        &server.config,
        format!("test_backends = true\n{}", model("a")),
    )
    .unwrap();
    let (status, reply) = server.post("/api/reload", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["removed"], json!(["slow"]), "{reply}");
    assert_eq!(reply["failed"], json!([]), "{reply}");
    let _ = loading.join();
    assert_eq!(names(&server), ["a"]);
    assert!(server.ps().iter().all(|m| m["name"] != "slow"));
}

/// A step that fails (a swap to a model that cannot load) keeps the model
/// as it was and pending: `berth reload` exits non-zero and says so, and
/// the next reload tries the step again.
#[test]
fn a_failed_step_stays_pending_for_the_next_reload() {
    let server = Server::start(&format!("test_backends = true\n{}", model("a")));
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let broken = "test_backends = true\n[[model]]\nname = \"a\"\nbackend = \"fault\"\noptions = { mode = \"ok\", fail_load_with = \"no such weights\" }\n";
    std::fs::write(&server.config, broken).unwrap();
    let (ok, reply, _) = server.cli(&["reload"]);
    assert!(!ok, "a reload with a failed step exits 0");
    assert_eq!(reply["pending"], json!(["a"]), "{reply}");
    // Tried again, not called unchanged.
    let (_, again) = server.post("/api/reload", json!({}));
    assert_eq!(again["changed"], json!(["a"]), "{again}");
    assert_eq!(again["pending"], json!(["a"]), "{again}");
    // The file fixed: the model's entry in force is the old one, so the
    // fixed file (the same as the old) is unchanged, and nothing pends.
    std::fs::write(
        &server.config,
        format!("test_backends = true\n{}", model("a")),
    )
    .unwrap();
    let (_, fixed) = server.post("/api/reload", json!({}));
    assert_eq!(fixed["pending"], json!([]), "{fixed}");
    assert_eq!(fixed["unchanged"], json!(["a"]), "{fixed}");
    let (status, _) = server.post("/api/models/a/infer", json!({"x": 1}));
    assert_eq!(status, 200);
}

trait RawGet {
    fn raw_get(&self, path: &str) -> (u16, String);
}

impl RawGet for Server {
    fn raw_get(&self, path: &str) -> (u16, String) {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .build()
            .into();
        let reply = agent.get(format!("{}{path}", self.url)).call().unwrap();
        let status = reply.status().as_u16();
        let mut body = reply.into_body();
        let text = body
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .unwrap_or_default();
        (status, text)
    }
}
