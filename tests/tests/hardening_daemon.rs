//! `berth serve`'s own safety against what goes wrong around it: it always
//! stops, one writer owns its state file, no socket path is ever removed
//! that is not its own, and nothing a worker sends exhausts it. Hostile
//! clients are `hardening.rs`'s.

use std::io::Write;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use berth_tests::daemon::{Daemon, post_json, temp_dir, wait_healthy};
use berth_tests::*;
use serde_json::{Value, json};

fn rss_of(pid: u32) -> u64 {
    berth::memory::resident_bytes(pid).unwrap_or(0)
}

// ----- 1. shutdown always ends -----

#[test]
fn sigterm_ends_despite_a_hung_request_and_a_half_sent_head() {
    let dir = temp_dir("sigterm");
    let port = free_port();
    let mut daemon = Daemon::start(
        &dir,
        "drain_timeout = \"1s\"\n[[model]]\nname = \"hang\"\nbackend = \"fault\"\noptions = { mode = \"hang-on-request\" }\n",
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    assert!(wait_healthy(port));
    let hung = std::thread::spawn(move || post_json(port, "/api/models/hang/infer", "{}"));
    let workers = || {
        children_of(daemon.child.id())
            .into_iter()
            .filter(|(_, s)| *s != 'Z')
            .count()
    };
    assert!(
        wait_for(Duration::from_secs(20), || workers() == 1),
        "the worker runs"
    );
    std::thread::sleep(Duration::from_millis(300));
    let mut half = TcpStream::connect(("127.0.0.1", port)).unwrap();
    half.write_all(b"POST /v1/embeddings HTTP/1.1\r\nHost: local")
        .unwrap();

    let started = Instant::now();
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    // Drain 1 s, then the hung worker's stop (Shutdown, 5 s, SIGTERM).
    let status = daemon.exited_within(Duration::from_secs(20));
    assert!(
        status.is_some(),
        "berth serve did not exit; stderr:\n{}",
        daemon.stderr()
    );
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "took {:?}",
        started.elapsed()
    );
    let (code, out) = hung.join().unwrap();
    assert!(
        code == 502 || code == 503 || code == 0,
        "the hung request ended: {code} {out}"
    );
}

#[test]
fn a_second_signal_stops_at_once() {
    let dir = temp_dir("second-signal");
    let port = free_port();
    let mut daemon = Daemon::start(
        &dir,
        "drain_timeout = \"60s\"\n[[model]]\nname = \"hang\"\nbackend = \"fault\"\noptions = { mode = \"ignore-shutdown\" }\n",
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    assert!(wait_healthy(port));
    let (status, out) = post_json(port, "/api/models/hang/load", "{}");
    assert_eq!(status, 200, "{out}");
    let worker: u32 = children_of(daemon.child.id())[0].0;
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    let status = daemon
        .exited_within(Duration::from_secs(5))
        .expect("exits at once");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(status.code(), Some(130));
    assert!(
        wait_for(Duration::from_secs(5), || !alive(worker)),
        "its worker was killed"
    );
}

// ----- 2. one writer for the state file; sockets never removed -----

#[test]
fn a_second_server_on_the_same_state_file_refuses_and_touches_nothing() {
    let dir = temp_dir("state");
    let state = dir.join("state.json");
    let config = format!(
        "state_file = \"{}\"\n[[model]]\nname = \"e\"\nbackend = \"echo\"\n",
        state.display()
    );
    let first_port = free_port();
    let first = Daemon::start(
        &dir,
        &config,
        &["--listen", &format!("127.0.0.1:{first_port}")],
    );
    assert!(wait_healthy(first_port));
    let (status, out) = post_json(first_port, "/api/models/e/load", "{}");
    assert_eq!(status, 200, "{out}");
    let before = std::fs::read_to_string(&state).unwrap();
    assert!(before.contains("\"model\": \"e\""), "{before}");

    let mut second = Daemon::start(
        &dir,
        &config,
        &["--listen", &format!("127.0.0.1:{}", free_port())],
    );
    assert!(
        !second
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    let said = second.stderr();
    assert!(
        said.contains(&format!("pid {}", first.child.id())),
        "names the first: {said}"
    );
    assert_eq!(
        std::fs::read_to_string(&state).unwrap(),
        before,
        "the state is untouched"
    );
}

#[test]
fn unix_socket_paths_in_use_or_not_sockets_are_never_removed() {
    let dir = temp_dir("sockets");
    let socket = dir.join("berth.sock");
    let listen = format!("unix:{}", socket.display());
    let first = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", dir.join("a.json").display()),
        &["--listen", &listen],
    );
    assert!(wait_for(Duration::from_secs(20), || {
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    }));
    let mut second = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", dir.join("b.json").display()),
        &["--listen", &listen],
    );
    assert!(
        !second
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    assert!(
        second.stderr().contains("another server is listening"),
        "{}",
        second.stderr()
    );
    assert!(
        std::os::unix::net::UnixStream::connect(&socket).is_ok(),
        "the first still serves"
    );

    let file = dir.join("precious.txt");
    std::fs::write(&file, "keep me").unwrap();
    let mut third = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", dir.join("c.json").display()),
        &["--listen", &format!("unix:{}", file.display())],
    );
    assert!(
        !third
            .exited_within(Duration::from_secs(10))
            .expect("refused")
            .success()
    );
    assert!(
        third.stderr().contains("is not a socket"),
        "{}",
        third.stderr()
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
    drop(first);
    assert!(!socket.exists(), "the first removed its own socket at exit");
}

#[test]
fn stale_entries_are_acted_on_only_when_provably_the_recorded_worker() {
    let dir = temp_dir("stale");
    let state = dir.join("state.json");
    // Live strangers leading their own groups, whose pids stale entries
    // name: one with a different start time (a reused pid), one where no
    // start time was recorded.
    let spawn_leader = || {
        use std::os::unix::process::CommandExt;
        Command::new("sleep")
            .arg("60")
            .process_group(0)
            .spawn()
            .unwrap()
    };
    let (mut stranger, mut unproven) = (spawn_leader(), spawn_leader());
    let (stranger_pid, unproven_pid) = (stranger.id(), unproven.id());
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let record = |pid: u32, pgid: u32, start: u64| json!({ "pid": pid, "pgid": pgid, "start_time": start, "model": "old" });
    let stale = json!({
        "supervisor_pid": 999_999_999u32,
        "boot_id": boot_id.trim(),
        "workers": [
            record(stranger_pid, 0, 1),             // group 0: "my own group"
            record(stranger_pid, stranger_pid, 1),  // a reused pid: start time differs
            record(unproven_pid, unproven_pid, 0),  // no start time: proves nothing
        ],
    });
    std::fs::write(&state, stale.to_string()).unwrap();
    let port = free_port();
    let daemon = Daemon::start(
        &dir,
        &format!("state_file = \"{}\"\n", state.display()),
        &["--listen", &format!("127.0.0.1:{port}")],
    );
    assert!(wait_healthy(port), "{}", daemon.stderr());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        matches!(stranger.try_wait(), Ok(None)),
        "the stranger lives"
    );
    assert!(
        matches!(unproven.try_wait(), Ok(None)),
        "the unproven one lives"
    );
    assert!(
        alive(daemon.child.id()),
        "the daemon did not signal its own group"
    );
    for mut child in [stranger, unproven] {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[test]
fn concurrent_workers_leave_a_consistent_state_file() {
    let dir = temp_dir("many");
    let state = dir.join("state.json");
    let mut config = format!("state_file = \"{}\"\n", state.display());
    for i in 0..32 {
        config.push_str(&format!("[[model]]\nname = \"e{i}\"\nbackend = \"echo\"\n"));
    }
    let port = free_port();
    let mut daemon = Daemon::start(&dir, &config, &["--listen", &format!("127.0.0.1:{port}")]);
    assert!(wait_healthy(port));
    let loads: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || post_json(port, &format!("/api/models/e{i}/load"), "{}").0)
        })
        .collect();
    for load in loads {
        assert_eq!(load.join().unwrap(), 200);
    }
    let listed: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(listed["workers"].as_array().unwrap().len(), 32);
    daemon.signal(nix::sys::signal::Signal::SIGTERM);
    assert!(
        daemon
            .exited_within(Duration::from_secs(30))
            .is_some_and(|s| s.success())
    );
    let listed: Value = serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(listed["workers"], json!([]), "no dead worker left listed");
    assert!(
        !daemon.stderr().contains("cannot write the state file"),
        "{}",
        daemon.stderr()
    );
}

// ----- 3. bounded everything a worker sends -----

#[test]
fn a_worker_flooding_stderr_does_not_grow_the_supervisor() {
    let server = Server::start(
        "[[model]]\nname = \"loud\"\nbackend = \"fault\"\noptions = { stderr_bytes = 104857600 }\n",
    );
    let (status, _) = server.post("/api/models/loud/load", json!({}));
    assert_eq!(status, 200);
    let before = rss_of(server.pid());
    let (status, reply) = server.post("/api/models/loud/infer", json!({ "input": 1 }));
    assert_eq!(status, 200, "{reply}");
    // The line is written before the answer; give the reader a moment.
    std::thread::sleep(Duration::from_millis(500));
    let after = rss_of(server.pid());
    assert!(
        after < before + (24 << 20),
        "supervisor RSS {} MiB -> {} MiB after a 100 MB stderr line",
        before >> 20,
        after >> 20
    );
    let ps = serde_json::to_string(&server.ps()).unwrap();
    assert!(ps.len() < 64 << 10, "ps stays small: {} bytes", ps.len());
}

#[test]
fn answers_and_inputs_past_their_limits_are_refused_and_memory_comes_back() {
    let server = Server::start(
        "max_response = \"8MiB\"\nmax_inputs = 100\n\
         [[model]]\nname = \"big\"\nbackend = \"fault\"\noptions = { response_bytes = 16777216 }\n\
         [[model]]\nname = \"fits\"\nbackend = \"fault\"\noptions = { response_bytes = 6291456 }\n\
         [[model]]\nname = \"e\"\nbackend = \"echo\"\n",
    );
    let (status, reply) = server.post("/api/models/big/infer", json!({}));
    assert_eq!(
        status,
        400,
        "{}",
        &reply.to_string()[..200.min(reply.to_string().len())]
    );
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_response"),
        "{reply}"
    );
    let texts: Vec<String> = (0..101).map(|i| format!("text {i}")).collect();
    let (status, reply) = server.post("/v1/embeddings", json!({ "model": "e", "input": texts }));
    assert_eq!(status, 413, "{reply}");
    assert_eq!(reply["error"]["code"], "too_many_inputs");

    let (status, _) = server.post("/api/models/fits/infer", json!({}));
    assert_eq!(status, 200);
    let baseline = rss_of(server.pid());
    for _ in 0..5 {
        let (status, _) = server.post("/api/models/fits/infer", json!({}));
        assert_eq!(status, 200);
    }
    assert!(
        wait_for(Duration::from_secs(5), || rss_of(server.pid())
            < baseline + (8 << 20)),
        "supervisor RSS {} MiB after 6 MiB answers, from {} MiB",
        rss_of(server.pid()) >> 20,
        baseline >> 20
    );
}
