//! The CLI as a client of a real `berth serve`: what the README's tour does.

use berth_tests::python::python_worker_command;
use berth_tests::*;
use serde_json::Value;

fn options_of(server: &Server, model: &str) -> Value {
    let (_, catalogue) = server.get("/api/models");
    catalogue["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["spec"]["name"] == model)
        .map(|m| m["spec"]["options"].clone())
        .unwrap()
}

/// `berth swap` works for every kind of model a server serves: a built-in
/// backend on the default worker, a declared worker kind, and a model
/// whose `command` the operator wrote; `--option` merges into the current
/// options unless `--replace-options` is given.
#[test]
fn swap_from_the_cli_works_for_every_kind_of_model() {
    let command = python_worker_command();
    let argv = serde_json::to_string(&command).unwrap();
    let server = Server::start(&format!(
        r#"
        [workers.py]
        command = {argv}

        [[model]]
        name = "builtin"
        backend = "echo"
        options = {{ chunks = 1, batch = 2 }}

        [[model]]
        name = "kind"
        backend = "echo"
        worker = "py"
        options = {{ chunks = 1, batch = 2 }}

        [[model]]
        name = "own"
        backend = "echo"
        command = {argv}
        env = [["BERTH_TEST_MARK", "kept"]]
        options = {{ chunks = 1, batch = 2 }}
        "#
    ));
    for model in ["builtin", "kind", "own"] {
        let (ok, load, stderr) = server.cli(&["load", model]);
        assert!(ok, "{model}: load: {load} {stderr}");
        let old_pid = load["pid"].as_u64().unwrap();

        let (ok, swap, stderr) = server.cli(&["swap", model, "--option", "chunks=3"]);
        assert!(ok, "{model}: swap: {swap} {stderr}");
        let new_pid = swap["new_pid"].as_u64().unwrap();
        assert_eq!(swap["old_pid"].as_u64(), Some(old_pid), "{swap}");
        assert_ne!(new_pid, old_pid);
        assert!(!alive(old_pid as u32), "{model}: the old worker is gone");
        assert_eq!(
            options_of(&server, model),
            serde_json::json!({"chunks": "3", "batch": "2"}),
            "{model}: --option merges"
        );
        // The new worker serves, with the new option (3 chunks streamed).
        let reply = server.raw(
            "POST",
            &format!("/api/models/{model}/infer"),
            &[
                ("content-type", "application/json"),
                ("accept", "application/x-ndjson"),
            ],
            Some(br#"{"x": 1}"#),
        );
        assert_eq!(reply.status, 200, "{model}: {}", reply.text());
        let lines: Vec<Value> = reply
            .text()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 4, "{model}: 3 chunks and done: {lines:?}");
        assert_eq!(lines[3]["done"], serde_json::json!({"x": 1}), "{lines:?}");

        let (ok, swap, stderr) =
            server.cli(&["swap", model, "--option", "batch=4", "--replace-options"]);
        assert!(ok, "{model}: swap --replace-options: {swap} {stderr}");
        assert_eq!(
            options_of(&server, model),
            serde_json::json!({"batch": "4"}),
            "{model}: --replace-options replaces"
        );
    }
    // The operator's own environment went with the `command` model's swaps.
    let own = server
        .ps()
        .into_iter()
        .find(|m| m["name"] == "own")
        .unwrap();
    let pid = own["pid"].as_u64().unwrap() as i32;
    let env = procfs::process::Process::new(pid)
        .unwrap()
        .environ()
        .unwrap();
    assert_eq!(
        env.get(std::ffi::OsStr::new("BERTH_TEST_MARK"))
            .map(|v| v.to_string_lossy().to_string()),
        Some("kept".into())
    );
}

/// A swap over HTTP may repeat the registered program as it is (a spec
/// read from `/api/models` and posted back) but never change it.
#[test]
fn a_swap_over_http_keeps_the_operators_program() {
    let server = Server::start(
        r#"
        [[model]]
        name = "e"
        backend = "echo"
        "#,
    );
    assert_eq!(
        server.post("/api/models/e/load", serde_json::json!({})).0,
        200
    );
    let (_, catalogue) = server.get("/api/models");
    let spec = catalogue["models"][0]["spec"].clone();
    let (status, reply) = server.post("/api/models/e/swap", spec.clone());
    assert_eq!(status, 200, "the spec as read swaps: {reply}");
    let mut changed = spec;
    changed["worker_binary"] = serde_json::json!("/bin/sh");
    let (status, reply) = server.post("/api/models/e/swap", changed);
    assert_eq!(status, 403, "{reply}");
    assert_eq!(reply["error"]["code"], "operator_only", "{reply}");
}

/// `berth swap` of a model that is registered but not loaded changes what
/// its next load runs, checked as a registration is, and says nothing was
/// running; `--load` (`"load": true` over HTTP) loads it with the new spec
/// too; a failed model's swap clears its failure.
#[test]
fn swap_of_a_model_that_is_not_loaded_updates_its_spec() {
    let server = Server::start(
        r#"
        test_backends = true

        [[model]]
        name = "idle"
        backend = "echo"
        options = { chunks = 1 }

        [[model]]
        name = "other"
        backend = "echo"

        [[model]]
        name = "broken"
        backend = "fault"
        options = { mode = "crash-on-load" }
        max_restarts = 0
        "#,
    );
    let (ok, swap, stderr) = server.cli(&["swap", "idle", "--option", "chunks=3"]);
    assert!(ok, "{swap} {stderr}");
    assert_eq!(swap["old_pid"], Value::Null, "{swap}");
    assert_eq!(swap["new_pid"], Value::Null, "{swap}");
    assert!(server.ps().is_empty(), "nothing was loaded");
    assert_eq!(
        options_of(&server, "idle"),
        serde_json::json!({"chunks": "3"})
    );
    // The text says what happened.
    let out = std::process::Command::new(berth_bin())
        .args(["swap", "idle", "--option", "chunks=2", "--url", &server.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("updated `idle`: nothing was running; its next load uses the new spec"),
        "{text}"
    );
    // The next load uses it: 2 chunks streamed.
    let (ok, load, _) = server.cli(&["load", "idle"]);
    assert!(ok, "{load}");
    let reply = server.raw(
        "POST",
        "/api/models/idle/infer",
        &[
            ("content-type", "application/json"),
            ("accept", "application/x-ndjson"),
        ],
        Some(br#"{"x": 1}"#),
    );
    assert_eq!(reply.text().lines().count(), 3, "{}", reply.text());

    // Checked as a registration: a bad option is refused, nothing changes.
    let (status, reply) = server.post(
        "/api/models/other/swap",
        serde_json::json!({ "backend": "echo", "options": { "no_such": 1 } }),
    );
    assert_eq!(status, 400, "{reply}");
    // `--load` / `"load": true`: loaded with the new spec.
    let (ok, swap, stderr) = server.cli(&["swap", "other", "--option", "chunks=2", "--load"]);
    assert!(ok, "{swap} {stderr}");
    let pid = swap["new_pid"].as_u64().expect("loaded");
    assert_eq!(swap["load"]["pid"].as_u64(), Some(pid), "{swap}");
    assert!(
        server
            .ps()
            .iter()
            .any(|m| m["name"] == "other" && m["pid"] == pid)
    );

    // A failed model: its swap is how it is fixed.
    let (status, _) = server.post("/api/models/broken/load", serde_json::json!({}));
    assert!(status >= 500);
    let (status, reply) = server.post("/api/models/broken/infer", serde_json::json!({}));
    assert_eq!(reply["error"]["code"], "model_failed", "{status} {reply}");
    let (status, swap) = server.post(
        "/api/models/broken/swap",
        serde_json::json!({ "backend": "fault", "options": { "mode": "ok" }, "load": true }),
    );
    assert_eq!(status, 200, "{swap}");
    let (status, reply) = server.post("/api/models/broken/infer", serde_json::json!({ "y": 2 }));
    assert_eq!(status, 200, "{reply}");
}
