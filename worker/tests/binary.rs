//! The `berth-worker` binary on its own, and the built-in backends in-process.

use std::process::Command;

use berth_worker::protocol::{Body, ErrorKind, LoadSpec};
use berth_worker::{LoadContext, Registry, RequestContext};

fn worker() -> Command {
    Command::new(env!("CARGO_BIN_EXE_berth-worker"))
}

#[test]
fn run_by_hand_it_explains_itself_and_exits() {
    let out = worker().env_remove("BERTH_BOOTSTRAP").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("started by the berth supervisor") && stderr.contains("berth run"),
        "{stderr}"
    );
}

#[test]
fn it_refuses_to_outlive_a_supervisor_it_does_not_have() {
    // The parent is this test, not the pid it names: the worker must not run on.
    let out = worker()
        .env("BERTH_BOOTSTRAP", "/nonexistent")
        .env("BERTH_PARENT_PID", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("supervisor (pid 1) is gone"));
}

#[test]
fn it_lists_its_backends_and_version() {
    let out = worker().arg("--backends").output().unwrap();
    let names = String::from_utf8_lossy(&out.stdout);
    for backend in ["echo", "hog", "fault"] {
        assert!(
            names.lines().any(|l| l.split(':').next() == Some(backend)),
            "{names}"
        );
    }
    // Each built-in backend declares its options.
    assert!(
        names.lines().any(|l| l == "echo: chunks, batch, stepping"),
        "{names}"
    );
    let out = worker().arg("--version").output().unwrap();
    let version = String::from_utf8_lossy(&out.stdout);
    assert!(version.contains(&format!(
        "protocol {}",
        berth_worker::protocol::PROTOCOL_VERSION
    )));
    assert!(
        !worker()
            .arg("--frobnicate")
            .output()
            .unwrap()
            .status
            .success()
    );
}

fn spec(backend: &str, options: &[(&str, &str)]) -> LoadSpec {
    LoadSpec {
        name: "m".into(),
        backend: backend.into(),
        model: None,
        options: options
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

#[test]
fn backends_run_in_process_for_comparisons() {
    let registry = Registry::builtin();
    let ctx = LoadContext::standalone();
    let mut hog = registry
        .load(
            &spec("hog", &[("alloc_mib", "1"), ("leak_kib_per_request", "64")]),
            &ctx,
        )
        .unwrap();
    let req = RequestContext::standalone();
    let first = hog.handle(Body::json("{}"), &req).unwrap();
    let second = hog.handle(Body::json("{}"), &req).unwrap();
    assert_eq!(
        first.json,
        format!("{{\"held_bytes\":{}}}", (1 << 20) + (64 << 10))
    );
    assert_eq!(
        second.json,
        format!("{{\"held_bytes\":{}}}", (1 << 20) + (128 << 10))
    );
    assert_eq!(req.progress().get(), 2, "each request advances progress");

    let err = registry
        .load(&spec("fault", &[("mode", "nope")]), &ctx)
        .err()
        .unwrap();
    assert_eq!(err.kind, ErrorKind::LoadFailed);
    assert!(
        err.message.contains("`nope`") && err.message.contains("crash-on-request"),
        "{err}"
    );
    let err = registry.load(&spec("missing", &[]), &ctx).err().unwrap();
    assert_eq!(err.kind, ErrorKind::UnknownBackend);
}
