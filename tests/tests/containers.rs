//! Models whose server runs in a container, under Debian's podman with an
//! image built on the machine (`tests/src/podman.rs`): the container's
//! processes are measured, stopped in order and proven gone; a swap under
//! load fails no request; a server that ignores SIGTERM, a container killed
//! from outside and a berth killed by SIGKILL leave no container behind.
//! Where podman cannot run, these tests fail and say why.

use std::time::{Duration, Instant};

use berth_tests::podman::{command_config, config, containers, podman};
use berth_tests::upstream::{ps_of, streaming_while};
use berth_tests::*;
use serde_json::json;

/// The fake server's processes in the container (by their command line,
/// which names the port berth gave): host pids, outside berth's tree.
fn payload_pids(port: u64) -> Vec<u32> {
    let wanted = format!("fake_upstream.py --port {port} ");
    procfs::process::all_processes()
        .unwrap()
        .filter_map(Result::ok)
        .filter(|p| {
            p.cmdline()
                .map(|c| format!("{} ", c.join(" ")).contains(&wanted))
                .unwrap_or(false)
        })
        .map(|p| p.pid as u32)
        .collect()
}

/// The port a model's server listens on, from its load report.
fn port_of(report: &serde_json::Value) -> u64 {
    let address = report["details"]["address"]
        .as_str()
        .unwrap_or_else(|| panic!("no address in {report}"));
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// A process's resident memory, from /proc.
fn rss_of(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib << 10
}

/// A load runs the container in the model's cgroup (its server's memory is
/// the model's, and its listener is checked as the server's own); requests
/// are served; the unload stops it through the engine and proves it gone:
/// the engine no longer knows it, its cgroup is empty, its processes are
/// dead and `podman ps -a` shows nothing of the model.
#[test]
fn a_container_loads_serves_and_its_unload_proves_it_gone() {
    let server = Server::start(&config("boxed", "", "memory_limit = \"512MiB\""));
    let (status, report) = server.post("/api/models/boxed/load", json!({}));
    assert_eq!(status, 200, "{report}");
    let names = containers("boxed");
    assert_eq!(names.len(), 1, "{names:?}");
    assert_eq!(
        report["details"]["container"]["name"],
        names[0].as_str(),
        "{report}"
    );
    assert_eq!(
        report["details"]["container"]["engine"], "podman",
        "{report}"
    );
    let port = port_of(&report);
    let payload = payload_pids(port);
    assert!(!payload.is_empty(), "the container's server runs");
    // The server is no child of berth's: it hangs from conmon.
    let client = ps_of(&server, "boxed")["pid"].as_u64().unwrap() as u32;
    assert!(payload.iter().all(|p| *p != client));
    // Its memory is counted: more than the podman client's alone.
    let client_rss = rss_of(client);
    let rss = report["rss_bytes"].as_u64().unwrap();
    assert!(
        rss > client_rss + (4 << 20),
        "the container's processes count: {rss} vs the client's {client_rss}"
    );
    for _ in 0..3 {
        let (status, reply) = server.post(
            "/v1/chat/completions",
            json!({"model": "boxed", "messages": [{"role": "user", "content": "hi"}]}),
        );
        assert_eq!(status, 200, "{reply}");
    }
    let (status, report) = server.post("/api/models/boxed/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["stop"], "container_stop", "{report}");
    assert_eq!(report["container"]["name"], names[0].as_str(), "{report}");
    assert_eq!(report["container"]["removed"], true, "{report}");
    assert_eq!(report["container"]["cgroup_empty"], true, "{report}");
    assert_eq!(report["leftover_processes"], 0, "{report}");
    assert!(
        report["rss_at_stop_bytes"].as_u64() > Some(client_rss),
        "{report}"
    );
    for p in payload {
        assert!(!alive(p), "the container's pid {p} outlived the unload");
    }
    assert!(containers("boxed").is_empty(), "{:?}", containers("boxed"));
}

/// Swaps while clients send: each start is a new container (a new name and
/// port) ready before routing moves; the old one is stopped and removed;
/// no request fails.
#[test]
fn a_swap_under_load_fails_no_request_and_leaves_one_container() {
    let server = Server::start(&config("swapped", "", ""));
    assert_eq!(server.post("/api/models/swapped/load", json!({})).0, 200);
    let before = containers("swapped");
    let (_, catalogue) = server.get("/api/models");
    let spec = catalogue["models"][0]["spec"].clone();
    let ((), failures, total) = streaming_while(&server, "swapped", (3, 4), || {
        let (status, reply) = server.post("/api/models/swapped/swap", spec.clone());
        assert_eq!(status, 200, "{reply}");
        assert_ne!(reply["old_pid"], reply["new_pid"]);
    });
    assert!(total > 3, "{total} requests");
    assert!(
        failures.is_empty(),
        "{} of {total} failed: {failures:?}",
        failures.len()
    );
    let after = containers("swapped");
    assert_eq!(after.len(), 1, "{after:?}");
    assert_ne!(before, after, "the swap's container has a name of its own");
}

/// A server that ignores SIGTERM is killed by the engine after the grace;
/// the unload still proves the container gone.
#[test]
fn a_server_ignoring_sigterm_is_stopped_by_the_engine_after_its_grace() {
    let server = Server::start(&config("stubborn", "ignore-sigterm", ""));
    let (status, report) = server.post("/api/models/stubborn/load", json!({}));
    assert_eq!(status, 200, "{report}");
    let payload = payload_pids(port_of(&report));
    let started = Instant::now();
    let (status, report) = server.post("/api/models/stubborn/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "the grace was given"
    );
    assert_eq!(report["container"]["removed"], true, "{report}");
    assert_eq!(report["container"]["cgroup_empty"], true, "{report}");
    assert_eq!(report["leftover_processes"], 0, "{report}");
    for p in payload {
        assert!(!alive(p), "pid {p} outlived the unload");
    }
    assert!(containers("stubborn").is_empty());
}

/// A container killed from outside (`podman kill`) is a crash: berth starts
/// the model again in a new container, and the dead one is removed. (Its
/// kind is a `podman run` command line with a name and a `stop_command` of
/// its own, as llama-swap's `cmd` gives: run as berth's own container.)
#[test]
fn a_container_killed_from_outside_is_restarted_in_a_new_one() {
    let server = Server::start(&command_config("killed", ""));
    assert_eq!(server.post("/api/models/killed/load", json!({})).0, 200);
    let first = containers("killed");
    assert_eq!(first.len(), 1);
    let status = std::process::Command::new(podman())
        .args(["kill", &first[0]])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        wait_for(Duration::from_secs(30), || {
            let now = containers("killed");
            now.len() == 1
                && now != first
                && server
                    .ps()
                    .iter()
                    .any(|m| m["name"] == "killed" && m["state"] == "ready")
        }),
        "restarted in a new container: {:?}, {:?}",
        containers("killed"),
        server.ps()
    );
    let (status, reply) = server.post(
        "/v1/chat/completions",
        json!({"model": "killed", "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(status, 200, "{reply}");
    let (status, report) = server.post("/api/models/killed/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["stop"], "container_stop", "{report}");
    assert_eq!(report["container"]["removed"], true, "{report}");
    assert!(containers("killed").is_empty());
}

/// berth killed by SIGKILL leaves its container running (its monitor is no
/// child of berth's); the next start of berth removes it and says so, and
/// `berth reap` does the same for a unit's `ExecStopPost=`.
#[test]
fn containers_of_a_killed_berth_are_swept_at_the_next_start_and_by_reap() {
    let toml = config("orphan", "", "");
    // A server removes its config file when it goes: written for each.
    let config_file =
        std::env::temp_dir().join(format!("berth-orphan-{}.toml", std::process::id()));
    let kill_with_a_container = || {
        std::fs::write(&config_file, &toml).unwrap();
        let mut server = Server::start_file(&config_file, None, &[], &[]);
        assert_eq!(server.post("/api/models/orphan/load", json!({})).0, 200);
        let left = containers("orphan");
        assert_eq!(left.len(), 1, "{left:?}");
        server.child.kill().unwrap();
        server.child.wait().unwrap();
        std::thread::sleep(Duration::from_millis(500));
        assert_eq!(containers("orphan"), left, "the container outlived berth");
        left
    };
    let left = kill_with_a_container();
    // The model's cgroup the dead berth made, as the container's label says.
    let label = std::process::Command::new(podman())
        .args([
            "inspect",
            "--format",
            "{{index .Config.Labels \"berth.cgroup\"}}",
            &left[0],
        ])
        .output()
        .unwrap();
    let cgroup = String::from_utf8_lossy(&label.stdout).trim().to_string();
    let cgroup_dirs = [
        format!("/sys/fs/cgroup{cgroup}"),
        format!("/sys/fs/cgroup/memory{cgroup}"),
    ];
    assert!(
        cgroup.starts_with('/') && cgroup_dirs.iter().any(|d| std::path::Path::new(d).is_dir()),
        "{cgroup:?}"
    );
    let log = std::env::temp_dir().join(format!("berth-orphan-{}.log", std::process::id()));
    let log_file = std::fs::File::create(&log).unwrap();
    std::fs::write(&config_file, &toml).unwrap();
    let next = Server::start_custom(&config_file, None, &[], &[], &mut |command| {
        command.stderr(log_file.try_clone().unwrap());
    });
    assert!(
        containers("orphan").is_empty(),
        "{:?}",
        containers("orphan")
    );
    let said = std::fs::read_to_string(&log).unwrap();
    assert!(
        said.contains("removed 1 container(s)") && said.contains(&left[0]),
        "{said}"
    );
    for dir in &cgroup_dirs {
        assert!(!std::path::Path::new(dir).exists(), "{dir} was left");
    }
    drop(next);
    let left = kill_with_a_container();
    let out = std::process::Command::new(berth_bin())
        .args(["reap", "--engine"])
        .arg(podman())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains(&left[0]), "{said}");
    assert!(containers("orphan").is_empty());
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_file(&config_file);
}

/// A container's VRAM is what NVML lists for its processes by their host
/// pids: counted in `ps` as the model's, and the unload waits until none
/// of them is in NVML's list and the device's used memory came back (the
/// fake driver stands for NVML; the server's pid holds 2 GiB on it).
#[test]
fn a_containers_vram_is_counted_by_its_host_pids_and_proven_back() {
    use berth_tests::fake_gpu::{FakeGpu, GIB, u};
    let fake = FakeGpu::new();
    let server = Server::start_env(&config("gpuboxed", "", ""), &[], &fake.env());
    let (status, report) = server.post("/api/models/gpuboxed/load", json!({}));
    assert_eq!(status, 200, "{report}");
    let payload = payload_pids(port_of(&report));
    fake.hold(payload[0], 0, 2 * GIB);
    assert!(
        wait_for(Duration::from_secs(10), || {
            ps_of(&server, "gpuboxed")["vram_bytes"].as_u64() == Some(2 * GIB)
        }),
        "{}",
        ps_of(&server, "gpuboxed")
    );
    let (status, report) = server.post("/api/models/gpuboxed/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(u(&report["vram_at_stop_bytes"]), 2 * GIB, "{report}");
    assert_eq!(u(&report["gpu_reclaimed_bytes"]), 2 * GIB, "{report}");
    assert_eq!(report["gpu_pid_gone"], true, "{report}");
    assert_eq!(report["container"]["removed"], true, "{report}");
}

/// SIGTERM while a container model loads (its server not ready yet): the
/// start is called off, and berth exits with the container stopped and
/// removed, as its shutdown promises for every container.
#[test]
fn sigterm_during_a_containers_load_leaves_no_container() {
    let mut server = Server::start(&config("midload", "never-ready", "load_timeout = \"5m\""));
    let url = server.url.clone();
    let _loading = std::thread::spawn(move || {
        let _ = ureq::post(format!("{url}/api/models/midload/load"))
            .header("Content-Type", "application/json")
            .send("{}");
    });
    assert!(
        wait_for(Duration::from_secs(60), || containers("midload").len() == 1),
        "the container did not start"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(server.pid() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(
        server.wait_exit(Duration::from_secs(60)).is_some(),
        "berth did not exit"
    );
    assert!(
        wait_for(Duration::from_secs(10), || containers("midload").is_empty()),
        "left: {:?}",
        containers("midload")
    );
}
