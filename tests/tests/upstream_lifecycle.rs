//! Models served by unmodified HTTP servers, their lifecycle, against the
//! same stdlib server on cue: never ready, crashes, health that hangs or
//! falters, draining at SIGTERM, SIGTERM ignored, children that leave the
//! group, memory caps, swaps under load and keep-alive; every guarantee
//! berth gives its own workers.

use std::time::{Duration, Instant};

use berth_tests::upstream::{config, marked_with_the_mark_of, ps_of, streaming_while};
use berth_tests::*;
use serde_json::json;

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
    let ((), failures, total) = streaming_while(&server, "fake", (4, 5), || {
        for _ in 0..3 {
            let (status, reply) = server.post("/api/models/fake/swap", spec.clone());
            assert_eq!(status, 200, "{reply}");
            assert_ne!(reply["old_pid"], reply["new_pid"]);
        }
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

/// Keep-alive unloads an idle server like any model.
#[test]
fn keep_alive_unloads_an_idle_server() {
    let server = Server::start(&config("", "", "keep_alive = \"1s\""));
    assert_eq!(server.post("/v1/rerank", json!({"model": "fake"})).0, 200);
    let pid = ps_of(&server, "fake")["pid"].as_u64().unwrap() as u32;
    assert!(wait_for(Duration::from_secs(10), || server.ps().is_empty()));
    assert!(!alive(pid));
}
