//! The `berth` binary's own surface (the end-to-end behaviour is in `tests/`).

use std::process::Command;

fn berth() -> Command {
    Command::new(env!("CARGO_BIN_EXE_berth"))
}

#[test]
fn version_and_help() {
    let out = berth().arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("berth "));
    let out = berth().args(["run", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--backend",
        "--model",
        "--option",
        "--input",
        "--load-timeout",
        "--json",
    ] {
        assert!(help.contains(flag), "{flag} in: {help}");
    }
}

#[test]
fn usage_errors_exit_2_with_a_message() {
    let out = berth().arg("run").output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--backend"));
    let out = berth()
        .args(["run", "--backend", "echo", "--load-timeout", "soon"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("`soon` is not a duration"));
}
