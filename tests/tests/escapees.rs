//! Processes that leave a worker's process group (`setsid`, a double fork)
//! are stopped with it: found in its cgroup or by its mark, killed, and
//! counted in the unload report; after a SIGKILLed `berth serve`, the next
//! one on the same state file stops them.

use std::time::Duration;

use berth::ModelSpec;
use berth_tests::*;
use serde_json::json;

fn escaping(name: &str, mib: u32) -> ModelSpec {
    ModelSpec::new(name, "fault").option("escape_mib", mib)
}

fn escaped_pid(details: &serde_json::Value) -> u32 {
    details["escaped_pid"]
        .as_u64()
        .unwrap_or_else(|| panic!("no escaped pid in {details}")) as u32
}

/// The worker is in a cgroup berth made for it (this machine lets berth
/// make them; the fallbacks are tested under BERTH_NO_CGROUPS=1 below).
fn in_berth_cgroup(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|c| c.contains("/berth/"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unload_kills_what_left_the_group_and_says_so() {
    let sup = supervisor();
    for (model, clear_mark) in [("escape", false), ("escape-unmarked", true)] {
        let mut spec = escaping(model, 200);
        if clear_mark {
            spec = spec.option("escape_clear_mark", true);
        }
        let load = sup.load(spec).await.unwrap();
        let escaped = escaped_pid(&load.details);
        assert!(alive(escaped), "{model}: the escaped process runs");
        assert!(
            in_berth_cgroup(load.pid),
            "{model}: the worker has a cgroup"
        );
        let stat = procfs::process::Process::new(escaped as i32)
            .unwrap()
            .stat()
            .unwrap();
        assert_ne!(stat.pgrp as u32, load.pid, "{model}: it left the group");
        assert_ne!(stat.session as u32, load.pid, "{model}: and the session");
        let rss = berth::memory::resident_bytes(escaped).unwrap_or(0);
        assert!(rss >= 190 << 20, "{model}: it holds 200 MiB: {rss}");

        let unload = sup.unload(model).await.unwrap();
        assert_eq!(unload.escaped_processes, 1, "{model}: {unload}");
        assert_eq!(unload.leftover_processes, 0, "{model}: {unload}");
        assert!(
            unload.to_string().contains("left its process group"),
            "{unload}"
        );
        assert!(!alive(escaped), "{model}: the escaped process is gone");
    }
    sup.shutdown().await;
}

/// Without cgroups (a container whose cgroup filesystem is read-only),
/// `berth serve` still finds what a worker started by its mark, and kills
/// what it adopted as a subreaper when it exits.
#[test]
fn without_cgroups_the_mark_finds_them() {
    let server = Server::start_env(
        "[[model]]\nname = \"escape\"\nbackend = \"fault\"\noptions = { escape_mib = 64 }\n",
        &[],
        &[("BERTH_NO_CGROUPS", "1")],
    );
    let (status, load) = server.post("/api/models/escape/load", json!({}));
    assert_eq!(status, 200, "{load}");
    assert!(!in_berth_cgroup(load["pid"].as_u64().unwrap() as u32));
    let escaped = escaped_pid(&load["details"]);
    let (status, unload) = server.post("/api/models/escape/unload", json!({}));
    assert_eq!(status, 200, "{unload}");
    assert_eq!(unload["escaped_processes"], 1, "{unload}");
    assert_eq!(unload["leftover_processes"], 0, "{unload}");
    assert!(!alive(escaped));
}

/// A `berth serve` killed with SIGKILL takes its workers with it
/// (parent-death signal) but not what they started outside their group:
/// the next `berth serve` on the same state file stops it, before it
/// serves.
#[test]
fn the_next_server_stops_what_a_killed_one_left() {
    let dir = std::env::temp_dir().join(format!("berth-escapees-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "state_file = \"{}\"\n[[model]]\nname = \"escape\"\nbackend = \"fault\"\n\
             options = {{ escape_mib = 64 }}\n",
            dir.join("state.json").display()
        ),
    )
    .unwrap();
    let mut first = Server::start_file(&config, None, &[], &[]);
    let (status, load) = first.post("/api/models/escape/load", json!({}));
    assert_eq!(status, 200, "{load}");
    let escaped = escaped_pid(&load["details"]);
    let worker = load["pid"].as_u64().unwrap() as u32;
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || !alive(worker)),
        "the worker died with its supervisor"
    );
    assert!(alive(escaped), "what it started outside its group lives on");
    // (`first` is kept: dropping a Server removes a config under /tmp.)
    let second = Server::start_file(&config, None, &[], &[]);
    assert!(
        !alive(escaped),
        "the next server stopped pid {escaped} first"
    );
    drop((second, first));
    let _ = std::fs::remove_dir_all(&dir);
}
