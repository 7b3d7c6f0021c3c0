//! Worker programs the operator names are still untrusted in what they do:
//! the `--backends` probe cannot hang `berth serve` at start, nor flood it.

use std::process::Command;
use std::time::{Duration, Instant};

use berth_tests::*;

/// `berth serve` with a worker kind running `script`: its exit status and
/// stderr once it refuses to start.
fn serve_with_worker(name: &str, script: &str) -> (Option<i32>, String, Duration) {
    let dir = std::env::temp_dir().join(format!("berth-programs-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let program = dir.join("worker.sh");
    std::fs::write(&program, format!("#!/bin/sh\n{script}\n")).unwrap();
    std::fs::set_permissions(
        &program,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!("[workers.odd]\ncommand = [\"{}\"]\n", program.display()),
    )
    .unwrap();
    let started = Instant::now();
    let out = Command::new(berth_bin())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--config",
        ])
        .arg(&config)
        .output()
        .unwrap();
    let took = started.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).to_string(),
        took,
    )
}

/// A program that prints its backends, leaves a child holding its stdout
/// and exits: serve refuses to start after the probe's bound, saying why
/// (it used to wait for ever and never listen).
#[test]
fn a_probe_that_never_ends_its_output_cannot_hang_serve() {
    let (code, err, took) = serve_with_worker("held", "echo echo\nsetsid sleep 15 &\nexit 0");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("did not end within 10 s"), "{err}");
    assert!(took < Duration::from_secs(30), "{took:?}");
}

#[test]
fn a_probe_that_floods_is_named_as_such() {
    let (code, err, _) = serve_with_worker("flood", "yes x | head -c 10000000");
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("more than 64 KiB"), "{err}");
}
