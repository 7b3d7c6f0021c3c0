//! `berth run`, as a user runs it.

use std::process::{Command, Stdio};
use std::time::Duration;

use berth_tests::*;
use serde_json::Value;

fn run_json(args: &[&str]) -> (bool, Value, String) {
    let out = Command::new(berth_bin())
        .arg("run")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let value: Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is one JSON object ({e}): {stdout}"));
    (
        out.status.success(),
        value,
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn run_json_prints_load_responses_and_unload() {
    let (ok, v, _) = run_json(&["--backend", "echo", "--input", "one", "--input", "two"]);
    assert!(ok, "{v}");
    assert_eq!(
        v["responses"],
        serde_json::json!([{"input": "one"}, {"input": "two"}])
    );
    let pid = v["load"]["pid"].as_u64().unwrap();
    assert_eq!(v["unload"]["pid"].as_u64(), Some(pid));
    for field in ["load_ms", "rss_bytes", "peak_rss_bytes"] {
        assert!(v["load"][field].is_number(), "load.{field}: {v}");
    }
    for field in [
        "took_ms",
        "rss_at_stop_bytes",
        "reclaimed_bytes",
        "leftover_processes",
    ] {
        assert!(v["unload"][field].is_number(), "unload.{field}: {v}");
    }
    assert_eq!(v["unload"]["stop"], "graceful");
    assert_eq!(v["unload"]["exit"], serde_json::json!({"code": 0}));
    assert_eq!(v["unload"]["leftover_processes"], 0);
    assert!(!alive(pid as u32));
}

#[test]
fn run_reports_a_crash_as_one_line_and_a_json_error() {
    let (ok, v, stderr) = run_json(&[
        "--backend",
        "fault",
        "-o",
        "mode=crash-on-request",
        "--input",
        "x",
    ]);
    assert!(!ok);
    assert_eq!(v["error"]["kind"], "worker_died", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("SIGSEGV"),
        "{v}"
    );
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("berth:")).collect();
    assert_eq!(lines.len(), 1, "one error line: {stderr}");
}

#[test]
fn run_refuses_bad_input_with_the_fix_named() {
    let (ok, v, _) = run_json(&["--backend", "nope"]);
    assert!(!ok);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no backend `nope`"),
        "{v}"
    );
    let (ok, v, _) = run_json(&["--backend", "echo", "--model", "/nonexistent/weights"]);
    assert!(!ok);
    assert_eq!(v["error"]["kind"], "invalid_spec");
    let out = Command::new(berth_bin())
        .args(["run", "--backend", "echo", "-o", "novalue"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("KEY=VALUE"));
}

#[test]
fn a_killed_supervisor_leaves_no_worker_behind() {
    let mut berth = Command::new(berth_bin())
        .args([
            "run",
            "--backend",
            "fault",
            "-o",
            "mode=hang-on-request",
            "--input",
            "x",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let supervisor_pid = berth.id();
    let mut worker = None;
    assert!(
        wait_for(Duration::from_secs(10), || {
            worker = children_of(supervisor_pid).first().map(|(pid, _)| *pid);
            worker.is_some()
        }),
        "the worker started"
    );
    let worker = worker.unwrap();
    // Let it reach its hanging request, then kill the supervisor outright.
    std::thread::sleep(Duration::from_millis(300));
    berth.kill().unwrap();
    berth.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(1), || !alive(worker)),
        "worker {worker} outlived its supervisor"
    );
}
