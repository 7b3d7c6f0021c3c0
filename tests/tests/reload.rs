//! The config reloaded in place (`SIGHUP`, `berth reload`,
//! `--watch-config`): models added, removed, changed (swapped) and kept
//! under load, with no request of a kept model failing and its worker the
//! same; settings applied live; a config that fails changes nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use berth_tests::*;
use serde_json::{Value, json};

fn model(name: &str, extra: &str) -> String {
    format!("[[model]]\nname = \"{name}\"\nbackend = \"echo\"\n{extra}\n")
}

fn pid_of(server: &Server, name: &str) -> Option<u64> {
    server
        .ps()
        .into_iter()
        .find(|m| m["name"] == name)
        .and_then(|m| m["pid"].as_u64())
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

/// The `config_reloaded` events so far.
fn reloads(server: &Server) -> Vec<Value> {
    server
        .events()
        .into_iter()
        .filter(|e| e["type"] == "config_reloaded")
        .collect()
}

/// Under a steady load on `kept`: SIGHUP applies a config that adds one
/// model, removes one, changes one (swapped: a new worker) and keeps one
/// (the same worker, no request failed), and raises the memory budget
/// live; `berth reload` with a broken config changes nothing and says why.
#[test]
fn a_reload_adds_removes_changes_and_keeps_models_under_load() {
    let before = format!(
        "memory_budget = \"8GiB\"\n{}{}{}",
        model("kept", ""),
        model("gone", ""),
        model("changed", "options = { chunks = \"1\" }")
    );
    let server = Server::start(&before);
    for name in ["kept", "gone", "changed"] {
        assert_eq!(
            server
                .post(&format!("/api/models/{name}/load"), json!({}))
                .0,
            200
        );
    }
    let (kept, changed) = (pid_of(&server, "kept"), pid_of(&server, "changed"));
    let after = format!(
        "memory_budget = \"16GiB\"\n{}{}{}",
        model("kept", ""),
        model("changed", "options = { chunks = \"2\" }"),
        model("added", "")
    );
    let stop = AtomicBool::new(false);
    let (failures, sent) = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let client = scope.spawn(|| {
            let (mut failed, mut sent) = (Vec::new(), 0);
            while !stop.load(Ordering::Relaxed) {
                sent += 1;
                let (status, reply) = server.post("/api/models/kept/infer", json!({"n": sent}));
                if status != 200 {
                    failed.push(format!("{status}: {reply}"));
                }
            }
            (failed, sent)
        });
        std::fs::write(&server.config, &after).unwrap();
        // SAFETY: a signal to the child this test started.
        unsafe {
            libc::kill(server.pid() as i32, libc::SIGHUP);
        }
        assert!(
            wait_for(Duration::from_secs(30), || !reloads(&server).is_empty()),
            "no reload: {:?}",
            server.events()
        );
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        client.join().unwrap()
    });
    assert!(sent > 10, "{sent} requests");
    assert!(
        failures.is_empty(),
        "{} of {sent} failed: {failures:?}",
        failures.len()
    );
    let event = &reloads(&server)[0];
    assert_eq!(event["trigger"], "SIGHUP", "{event}");
    let report = &event["report"];
    assert_eq!(report["added"], json!(["added"]), "{report}");
    assert_eq!(report["removed"], json!(["gone"]), "{report}");
    assert_eq!(report["changed"], json!(["changed"]), "{report}");
    assert_eq!(report["unchanged"], json!(["kept"]), "{report}");
    assert_eq!(report["settings"], json!(["memory_budget"]), "{report}");
    assert_eq!(report["failed"], json!([]), "{report}");
    assert_eq!(
        pid_of(&server, "kept"),
        kept,
        "the kept model's worker is the same"
    );
    let now = pid_of(&server, "changed");
    assert!(
        now.is_some() && now != changed,
        "the changed model was swapped: {now:?}"
    );
    assert_eq!(names(&server), ["added", "changed", "kept"]);
    assert_eq!(pid_of(&server, "gone"), None);

    // A config that does not read changes nothing, and says why.
    std::fs::write(&server.config, "memory_budget = \"a lot\"\n").unwrap();
    let (ok, reply, said) = server.cli(&["reload"]);
    assert!(!ok, "{reply} {said}");
    let all = format!("{reply} {said}");
    assert!(
        all.contains("nothing changed") && all.contains("memory_budget"),
        "{all}"
    );
    assert_eq!(names(&server), ["added", "changed", "kept"]);
    assert_eq!(pid_of(&server, "kept"), kept);
    assert!(
        server
            .events()
            .iter()
            .any(|e| e["type"] == "config_rejected"),
        "{:?}",
        server.events()
    );
    // Written back as it was: `berth reload` says nothing changed.
    std::fs::write(&server.config, &after).unwrap();
    let (ok, reply, said) = server.cli(&["reload"]);
    assert!(ok, "{reply} {said}");
    assert_eq!(
        reply["unchanged"],
        json!(["kept", "changed", "added"]),
        "{reply}"
    );
    assert_eq!(reply["changed"], json!([]), "{reply}");
}

/// `--watch-config`: writing the file reloads it, models and the front
/// door's settings alike.
#[test]
fn watch_config_reloads_when_the_file_changes() {
    let server = Server::start_with(&model("first", ""), &["--watch-config"]);
    std::fs::write(
        &server.config,
        format!("{}{}", model("first", ""), model("second", "")),
    )
    .unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || names(&server)
            == ["first", "second"]),
        "{:?}",
        names(&server)
    );
    let event = &reloads(&server)[0];
    assert_eq!(event["report"]["added"], json!(["second"]), "{event}");
    // A token set by a reload guards the next request, on a connection
    // already open too.
    std::fs::write(
        &server.config,
        format!(
            "token = \"s3cret\"\n{}{}",
            model("first", ""),
            model("second", "")
        ),
    )
    .unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || server.get("/api/ps").0 == 401),
        "the new token is asked for"
    );
}
