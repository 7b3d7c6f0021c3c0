//! berth upgraded in place to a new binary (`berth upgrade`, `SIGUSR2`,
//! `POST /api/upgrade`): under load, with a model on each wire (an
//! `ipc-channel` worker, a stream-wire Python worker, an HTTP server), no
//! request fails, no model loads again, every worker keeps its pid and
//! berth its own; a binary that fails its check changes nothing; a SIGKILL
//! of berth at any moment of a handover leaves no worker alive.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth_tests::daemon::temp_dir;
use berth_tests::upgrade::{marked_berth, three_wires};
use berth_tests::*;
use serde_json::{Value, json};

const MODELS: [&str; 3] = ["ipc", "stream", "fake"];

/// `berth serve` of `program` over `config`.
fn start(program: &std::path::Path, config: &str) -> Server {
    let path = std::env::temp_dir().join(format!(
        "berth-upgrade-{}-{}.toml",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::write(&path, config).unwrap();
    Server::start_program(program, &path, None, &[], &[], &mut |_| {})
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(Instant::now().elapsed().as_nanos() as u64);
    h.finish()
}

/// One request to `model`, as a client of its kind sends it.
fn request(server: &Server, model: &str, n: u64) -> (u16, Value) {
    match model {
        "fake" => server.post(
            "/v1/chat/completions",
            json!({"model": "fake", "messages": [{"role": "user", "content": format!("{n}")}]}),
        ),
        _ => server.post(&format!("/api/models/{model}/infer"), json!({"n": n})),
    }
}

/// Each model's worker pid and uptime in seconds.
fn workers(server: &Server) -> Vec<(String, u64, f64)> {
    let mut all: Vec<(String, u64, f64)> = server
        .ps()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().to_string(),
                m["pid"].as_u64().unwrap_or(0),
                m["uptime_s"].as_f64().unwrap_or(-1.0),
            )
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

fn build(server: &Server) -> String {
    let (status, version) = server.get("/api/version");
    assert_eq!(status, 200, "{version}");
    version["build"].as_str().unwrap().to_string()
}

/// Waits until `n` upgrades are done (`upgraded` events).
fn wait_for_upgrades(server: &Server, n: usize) {
    assert!(
        wait_for(Duration::from_secs(30), || server
            .events_of("upgraded")
            .len()
            == n),
        "{:?}",
        server.events()
    );
}

/// Under a steady load on every model, `berth upgrade --binary` moves the
/// daemon from build A to build B: 0 requests fail, 0 models load again,
/// every worker keeps its pid (and its uptime goes on), berth keeps its
/// pid; then `SIGUSR2` and `POST /api/upgrade` upgrade it again (to the
/// binary it runs, as replaced on disk: B).
#[test]
fn an_upgrade_under_load_fails_no_request_and_keeps_every_worker() {
    let (a, b) = (marked_berth("build-a"), marked_berth("build-b"));
    let server = start(&a, &three_wires());
    for model in MODELS {
        let (status, reply) = server.post(&format!("/api/models/{model}/load"), json!({}));
        assert_eq!(status, 200, "{model}: {reply}");
    }
    assert_eq!(build(&server), "build-a");
    let before = workers(&server);
    assert_eq!(before.len(), 3, "{before:?}");
    let loads_before = server.events_of("loaded").len();
    let pid = server.pid();

    // A follower of the events, across the upgrades to come.
    let follower_out = temp_dir("upgrade-events").join("events.jsonl");
    let mut follower = std::process::Command::new(berth_bin())
        .args(["events", "--json", "--url", &server.url])
        .stdout(std::fs::File::create(&follower_out).unwrap())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stop = AtomicBool::new(false);
    let (results, upgraded) = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let clients: Vec<_> = MODELS
            .iter()
            .map(|model| {
                let (server, stop) = (&server, &stop);
                scope.spawn(move || {
                    let (mut failed, mut sent) = (Vec::new(), 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        sent += 1;
                        let (status, reply) = request(server, model, sent);
                        if status != 200 {
                            failed.push(format!("{model} #{sent}: {status} {reply}"));
                        }
                    }
                    (sent, failed)
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let upgraded = server.cli(&["upgrade", "--binary", b.to_str().unwrap()]);
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, Ordering::Relaxed);
        let results: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
        (results, upgraded)
    });
    let (ok, reply, said) = upgraded;
    assert!(ok, "berth upgrade failed: {reply} {said}");
    assert_eq!(reply["type"], "upgraded", "{reply}");
    for (model, (sent, failed)) in MODELS.iter().zip(&results) {
        assert!(*sent > 5, "{model}: only {sent} requests");
        assert!(
            failed.is_empty(),
            "{model}: {} of {sent} failed: {failed:?}",
            failed.len()
        );
    }
    assert_eq!(server.pid(), pid);
    assert_eq!(build(&server), "build-b");
    let after = workers(&server);
    for ((name, pid, uptime), (_, pid_after, uptime_after)) in before.iter().zip(&after) {
        assert_eq!(pid, pid_after, "{name}: {before:?} -> {after:?}");
        assert!(
            uptime_after >= uptime,
            "{name}: its uptime went on: {before:?} -> {after:?}"
        );
    }
    assert_eq!(
        server.events_of("loaded").len(),
        loads_before,
        "no model loaded again"
    );
    let event = &server.events_of("upgraded")[0];
    assert_eq!(
        event["from"],
        format!("{} (build-a)", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(
        event["to"],
        format!("{} (build-b)", env!("CARGO_PKG_VERSION"))
    );
    assert_eq!(event["adopted"].as_array().unwrap().len(), 3, "{event}");
    assert_eq!(event["lost"], json!([]), "{event}");

    // Again, by SIGUSR2: to the binary it runs (B); the kept workers are
    // kept once more (they are now the new program's children).
    // SAFETY: a signal to the child this test started.
    unsafe { libc::kill(server.pid() as i32, libc::SIGUSR2) };
    wait_for_upgrades(&server, 2);
    // And by the API, which names no binary of its own.
    let (status, reply) = server.post("/api/upgrade", json!({}));
    assert_eq!(status, 202, "{reply}");
    wait_for_upgrades(&server, 3);
    assert_eq!(
        workers(&server).iter().map(|w| w.1).collect::<Vec<_>>(),
        before.iter().map(|w| w.1).collect::<Vec<_>>()
    );
    for model in MODELS {
        assert_eq!(request(&server, model, 0).0, 200, "{model}");
    }
    // `berth events` followed the three upgrades without a gap.
    let followed = || -> Vec<Value> {
        std::fs::read_to_string(&follower_out)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    assert!(
        wait_for(Duration::from_secs(10), || followed()
            .iter()
            .filter(|e| e["type"] == "upgraded")
            .count()
            == 3),
        "{:?}",
        followed()
    );
    assert_eq!(
        follower.try_wait().unwrap(),
        None,
        "berth events still follows"
    );
    let _ = follower.kill();
    let _ = follower.wait();
    let ids: Vec<u64> = followed().iter().filter_map(|e| e["id"].as_u64()).collect();
    assert!(
        ids.windows(2).all(|w| w[1] == w[0] + 1),
        "numbered without a gap or a repeat: {ids:?}"
    );
}

/// A binary that fails its check (it does not run, or is no berth) is
/// refused before anything stops: the daemon serves on as it was. A client
/// cannot name a binary.
#[test]
fn an_upgrade_to_a_binary_that_fails_changes_nothing() {
    let a = marked_berth("build-c");
    let server = start(&a, "[[model]]\nname = \"ipc\"\nbackend = \"echo\"\n");
    assert_eq!(server.post("/api/models/ipc/load", json!({})).0, 200);
    let pids = |server: &Server| -> Vec<(String, u64)> {
        workers(server)
            .into_iter()
            .map(|(n, p, _)| (n, p))
            .collect()
    };
    let before = pids(&server);
    let dir = temp_dir("upgrade-bad");
    let failing = dir.join("exits-3");
    std::fs::write(&failing, "#!/bin/sh\necho 'cannot start' >&2\nexit 3\n").unwrap();
    let silent = dir.join("says-nothing");
    std::fs::write(&silent, "#!/bin/sh\nexit 0\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    for script in [&failing, &silent] {
        std::fs::set_permissions(script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let missing = dir.join("not-there");
    for (binary, says) in [
        (&failing, "cannot start"),
        (&silent, "not a berth that upgrades in place"),
        (&missing, "cannot find"),
    ] {
        let (ok, reply, said) = server.cli(&["upgrade", "--binary", binary.to_str().unwrap()]);
        let all = format!("{reply} {said}");
        assert!(!ok, "{all}");
        assert!(all.contains(says), "{binary:?}: {all}");
        assert_eq!(build(&server), "build-c");
        assert_eq!(pids(&server), before);
        assert_eq!(request(&server, "ipc", 1).0, 200);
    }
    assert!(!server.events_of("upgrade_failed").is_empty());
    assert!(server.events_of("upgraded").is_empty());

    let (status, reply) = server.post("/api/upgrade", json!({"binary": "/bin/sh"}));
    assert_eq!(status, 403, "{reply}");
    assert_eq!(reply["error"]["code"], "binary_not_allowed", "{reply}");
}

/// A SIGKILL of berth at any moment of a handover (during the check, while
/// connections drain, at the exec, while the new program adopts) leaves
/// no worker alive: every worker's parent-death signal is armed on the
/// process's main thread, which only the process's death ends.
#[test]
fn a_sigkill_at_any_step_of_an_upgrade_leaves_no_worker() {
    let a = marked_berth("build-d");
    for delay_ms in [0u64, 5, 20, 60, 150, 300, 330, 360, 400] {
        let mut server = start(&a, &three_wires());
        for model in MODELS {
            let (status, reply) = server.post(&format!("/api/models/{model}/load"), json!({}));
            assert_eq!(status, 200, "{model}: {reply}");
        }
        let mut pids: Vec<u32> = workers(&server).iter().map(|w| w.1 as u32).collect();
        for pid in pids.clone() {
            pids.extend(berth_tests::upstream::marked_with_the_mark_of(pid));
        }
        // SAFETY: signals to the child this test started.
        unsafe { libc::kill(server.pid() as i32, libc::SIGUSR2) };
        std::thread::sleep(Duration::from_millis(delay_ms));
        unsafe { libc::kill(server.pid() as i32, libc::SIGKILL) };
        server.wait_exit(Duration::from_secs(10));
        let alive = |pid: &u32| {
            procfs::process::Process::new(*pid as i32)
                .and_then(|p| p.stat())
                .is_ok_and(|s| s.state != 'Z')
        };
        assert!(
            wait_for(Duration::from_secs(10), || !pids.iter().any(alive)),
            "killed {delay_ms} ms into an upgrade, left alive: {:?}",
            pids.iter().filter(|p| alive(p)).collect::<Vec<_>>()
        );
    }
}
