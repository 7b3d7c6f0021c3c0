//! The event stream (`/api/events`, `berth events`): every lifecycle step
//! of real workers arrives typed, numbered and in order, with the same pids
//! and reports the API gives; a follower resumes with `since`; bad input
//! gets a clear error; the stream ends when the daemon stops.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use berth_tests::*;
use serde_json::{Value, json};

const CONFIG: &str = r#"
test_backends = true
restart_backoff = "50ms"

[[model]]
name = "e"
backend = "echo"

[[model]]
name = "f"
backend = "fault"
options = { crash_on = "poison" }
"#;

/// `berth events --json` against `server`, its lines read on a thread.
struct Follower {
    child: Child,
    lines: mpsc::Receiver<Value>,
}

impl Follower {
    fn start(server: &Server, extra: &[&str]) -> Follower {
        let mut child = Command::new(berth_bin())
            .arg("events")
            .args(extra)
            .args([
                "--json",
                "--url",
                &format!("http://127.0.0.1:{}", server.port()),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("berth events runs");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("`berth events --json` printed {line:?}: {e}"));
                if tx.send(value).is_err() {
                    break;
                }
            }
        });
        Follower { child, lines }
    }

    /// Events up to and including the first of type `kind` (for `model`,
    /// if given); fails the test if it does not come within 30 s.
    fn until(&self, kind: &str, model: Option<&str>) -> Vec<Value> {
        let mut seen = Vec::new();
        loop {
            let event = self
                .lines
                .recv_timeout(Duration::from_secs(30))
                .unwrap_or_else(|_| panic!("no `{kind}` event; saw {seen:#?}"));
            let hit = event["type"] == kind && model.is_none_or(|m| event["model"] == m);
            seen.push(event);
            if hit {
                return seen;
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("?").to_string())
        .collect()
}

#[test]
fn lifecycle_events_arrive_typed_in_order_with_the_apis_pids_and_reports() {
    let mut server = Server::start(CONFIG);
    let follower = Follower::start(&server, &[]);
    // What happened before it connected comes first: the registrations,
    // then the server's start.
    let start = follower.until("server_started", None);
    assert_eq!(
        types(&start),
        ["registered", "registered", "server_started"]
    );
    assert_eq!(start[0]["model"], "e");
    assert_eq!(start[0]["id"], 1);

    let (status, load) = server.post("/api/models/e/load", json!({}));
    assert_eq!(status, 200, "{load}");
    let loaded = follower.until("loaded", Some("e"));
    assert_eq!(types(&loaded), ["loading", "loaded"]);
    let pid = loaded[1]["report"]["pid"].as_u64().unwrap();
    assert_eq!(pid, load["pid"].as_u64().unwrap(), "{load}");
    let ps = server.ps();
    assert_eq!(ps[0]["pid"].as_u64(), Some(pid));

    let (status, unload) = server.post("/api/models/e/unload", json!({}));
    assert_eq!(status, 200, "{unload}");
    let unloaded = follower.until("unloaded", Some("e"));
    assert_eq!(types(&unloaded), ["unloaded"]);
    let report = &unloaded[0]["report"];
    assert_eq!(report["pid"].as_u64(), Some(pid));
    assert_eq!(
        report["reclaimed_bytes"], unload["reclaimed_bytes"],
        "{unload}"
    );
    assert_eq!(report["leftover_processes"], 0);

    // A crash: the death, then the restart policy at work.
    let (status, _) = server.post("/api/models/f/load", json!({}));
    assert_eq!(status, 200);
    let first = follower.until("loaded", Some("f"))[1]["report"]["pid"]
        .as_u64()
        .unwrap();
    let (status, _) = server.post("/api/models/f/infer", json!({"x": "poison"}));
    assert_ne!(status, 200);
    let restarted = follower.until("restarted", Some("f"));
    assert_eq!(
        types(&restarted),
        ["crashed", "restarting", "loading", "loaded", "restarted"]
    );
    assert_eq!(restarted[0]["pid"].as_u64(), Some(first));
    assert!(
        restarted[0]["description"]
            .as_str()
            .unwrap()
            .contains(&first.to_string()),
        "{:#}",
        restarted[0]
    );
    assert_eq!(restarted[2]["restart"], true);
    let second = restarted[4]["pid"].as_u64().unwrap();
    assert_ne!(second, first);

    // Resuming: after the `loaded` of `e`, the kept events that follow,
    // and nothing before.
    let after = loaded[1]["id"].as_u64().unwrap();
    let reply = server.raw(
        "GET",
        &format!("/api/events?since={after}&follow=false"),
        &[],
        None,
    );
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("content-type"), Some("text/event-stream"));
    let resumed = sse_events(&reply.text());
    assert_eq!(resumed[0]["id"].as_u64(), Some(after + 1));
    assert_eq!(resumed[0]["type"], "unloaded");
    let ids: Vec<u64> = resumed.iter().map(|e| e["id"].as_u64().unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    // The header a browser's EventSource sends on reconnecting works alike.
    let by_header = server.raw(
        "GET",
        "/api/events?follow=false",
        &[("Last-Event-ID", &after.to_string())],
        None,
    );
    assert_eq!(sse_events(&by_header.text()), resumed);

    // The daemon drains: followers see it, the last unload, and the end.
    server.terminate(Duration::from_secs(30));
    let end = follower.until("server_stopped", None);
    let kinds = types(&end);
    assert_eq!(
        kinds.first().map(String::as_str),
        Some("server_draining"),
        "{kinds:?}"
    );
    assert!(
        end.iter()
            .any(|e| e["type"] == "unloaded" && e["report"]["pid"].as_u64() == Some(second)),
        "{end:#?}"
    );
}

#[test]
fn bad_input_gets_a_clear_error_and_a_swap_is_told_both_ways() {
    let server = Server::start(CONFIG);
    for (path, needle) in [
        ("/api/events?since=last", "`since` must be an event number"),
        ("/api/events?follow=maybe", "`follow` is `true` or `false`"),
    ] {
        let reply = server.raw("GET", path, &[], None);
        assert_eq!(reply.status, 400, "{path}: {}", reply.text());
        assert!(reply.text().contains(needle), "{path}: {}", reply.text());
    }
    let reply = server.raw("GET", "/api/events", &[("Last-Event-ID", "x")], None);
    assert_eq!(reply.status, 400);
    assert!(reply.text().contains("Last-Event-ID"), "{}", reply.text());

    let follower = Follower::start(&server, &[]);
    follower.until("server_started", None);
    let (status, _) = server.post("/api/models/e/load", json!({}));
    assert_eq!(status, 200);
    follower.until("loaded", Some("e"));
    // A swap whose new worker loads: begun, completed with its report.
    let (status, swap) = server.post(
        "/api/models/e/swap",
        json!({"backend": "echo", "options": {"chunks": "1"}}),
    );
    assert_eq!(status, 200, "{swap}");
    let swapped = follower.until("swap_completed", Some("e"));
    assert!(
        types(&swapped).contains(&"swap_begun".to_string()),
        "{swapped:#?}"
    );
    let report = &swapped.last().unwrap()["report"];
    assert_eq!(report["new_pid"], swap["new_pid"], "{swap}");
    // One whose new worker cannot load: rolled back, the old one serving.
    let (status, _) = server.post(
        "/api/models/e/swap",
        json!({"backend": "fault", "options": {"mode": "crash-on-load"}}),
    );
    assert_ne!(status, 200);
    let rolled = follower.until("swap_rolled_back", Some("e"));
    assert!(
        !rolled.last().unwrap()["error"].as_str().unwrap().is_empty(),
        "{rolled:#?}"
    );
    assert_eq!(server.ps()[0]["pid"], swap["new_pid"]);
}
