//! The in-place upgrade under hostile conditions (issue "hardening, fourth
//! round"): signals at the exec, models registered over the API, a binary
//! replaced between its check and its exec or hanging on its way to
//! serving, a hostile request file, attempts that would black out new
//! connections, and a client waiting with a deadline.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth_tests::upgrade::marked_berth;
use berth_tests::*;
use serde_json::{Value, json};

fn start(program: &std::path::Path, config: &str, env: &[(&str, &str)]) -> Server {
    let path = std::env::temp_dir().join(format!(
        "berth-hupgrade-{}-{}.toml",
        std::process::id(),
        free_port()
    ));
    std::fs::write(&path, config).unwrap();
    Server::start_program(program, &path, None, &[], env, &mut |_| {})
}

fn build(server: &Server) -> String {
    let (status, version) = server.get("/api/version");
    assert_eq!(status, 200, "{version}");
    version["build"].as_str().unwrap().to_string()
}

fn worker_pids(server: &Server) -> Vec<(String, u64)> {
    let mut pids: Vec<(String, u64)> = server
        .ps()
        .iter()
        .filter_map(|m| Some((m["name"].as_str()?.to_string(), m["pid"].as_u64()?)))
        .collect();
    pids.sort();
    pids
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal);
}

fn echo(name: &str) -> String {
    format!("[[model]]\nname = \"{name}\"\nbackend = \"echo\"\n")
}

/// `SIGUSR2` every 10 ms, 600 times: each may start an upgrade (one at a
/// time, at most one attempt every 2 s); the signals that land while the
/// program is exec'd are held across the exec, never its end. berth lives
/// through it with every worker, and serves.
#[test]
fn six_hundred_sigusr2_at_10_ms_leave_berth_alive_with_every_worker() {
    let server = start(
        &marked_berth("storm-a"),
        &format!("{}{}", echo("a"), echo("b")),
        &[],
    );
    for name in ["a", "b"] {
        assert_eq!(
            server
                .post(&format!("/api/models/{name}/load"), json!({}))
                .0,
            200
        );
    }
    let before = worker_pids(&server);
    let pid = server.pid();
    for _ in 0..600 {
        signal(pid, nix::sys::signal::Signal::SIGUSR2);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(alive(pid), "berth died");
    // The last upgrade ends (its outcome said), and berth serves on.
    assert!(wait_for(Duration::from_secs(60), || server
        .get("/healthz")
        .0
        == 200));
    std::thread::sleep(Duration::from_secs(3));
    assert!(wait_for(Duration::from_secs(60), || server
        .get("/healthz")
        .0
        == 200));
    assert!(alive(pid), "berth died");
    assert!(
        !server.events_of("upgraded").is_empty(),
        "no upgrade went through: {:?}",
        server.events_of("upgrade_failed").last()
    );
    assert_eq!(worker_pids(&server), before, "a worker was lost");
    for name in ["a", "b"] {
        assert_eq!(
            server
                .post(&format!("/api/models/{name}/infer"), json!({"x": 1}))
                .0,
            200
        );
    }
}

/// An upgrade hands over the catalogue, not the file: a model registered
/// over the API (loaded), one registered and not loaded, and one swapped
/// over the API to another spec are, after it, exactly as before; so is
/// the state file, though a reload changed the file's (that waits for a
/// restart).
#[test]
fn an_upgrade_keeps_api_models_unloaded_ones_and_swaps_exactly() {
    let dir = berth_tests::daemon::temp_dir("hupgrade-catalogue");
    let state_a = dir.join("a.json");
    let config = format!(
        "test_backends = true\nstate_file = {:?}\n{}",
        state_a.display().to_string(),
        echo("filed")
    );
    let server = start(&marked_berth("cat-a"), &config, &[]);
    assert_eq!(
        server.put("/api/models/api", json!({"backend": "echo"})).0,
        201
    );
    assert_eq!(server.post("/api/models/api/load", json!({})).0, 200);
    assert_eq!(
        server
            .put(
                "/api/models/idle",
                json!({"backend": "hog", "options": {"alloc_mib": 1}})
            )
            .0,
        201
    );
    assert_eq!(server.post("/api/models/filed/load", json!({})).0, 200);
    let (status, swapped) = server.post(
        "/api/models/filed/swap",
        json!({"options": {"chunks": "3"}}),
    );
    assert_eq!(status, 200, "{swapped}");
    // A reload that changes the state file: applied only at a restart.
    let state_b = dir.join("b.json");
    std::fs::write(
        &server.config,
        config.replace(
            &state_a.display().to_string(),
            &state_b.display().to_string(),
        ),
    )
    .unwrap();
    let (_, reloaded) = server.post("/api/reload", json!({}));
    assert_eq!(
        reloaded["restart_needed"],
        json!(["state_file"]),
        "{reloaded}"
    );
    let catalogue = |server: &Server| -> Vec<Value> {
        let (_, c) = server.get("/api/models");
        let mut models: Vec<Value> = c["models"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| json!({"spec": m["spec"], "state": m["state"], "pid": m["pid"]}))
            .collect();
        models.sort_by_key(|m| m["spec"]["name"].as_str().unwrap().to_string());
        models
    };
    let before = catalogue(&server);
    let b = marked_berth("cat-b");
    let (ok, outcome, stderr) = server.cli(&["upgrade", "--binary", b.to_str().unwrap()]);
    assert!(ok, "{stderr} {outcome}");
    assert_eq!(build(&server), "cat-b");
    assert_eq!(catalogue(&server), before);
    let (_, version) = server.get("/api/version");
    assert_eq!(version["state_file"], json!(state_a.display().to_string()));
    assert!(
        server.events_of("upgraded")[0]["lost"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}

/// The binary checked is the binary run: replaced on disk between its
/// check and its exec (a slow request holds the handover a moment), the
/// file opened for the check is what runs.
#[test]
fn the_binary_checked_is_the_binary_exec_d() {
    let config = format!(
        "test_backends = true\n{}[[model]]\nname = \"slow\"\nbackend = \"fault\"\noptions = {{ mode = \"ok\", load_delay_ms = \"2500\" }}\n",
        echo("a")
    );
    let server = start(&marked_berth("swap-a"), &config, &[]);
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let path = berth_tests::target_dir().join(format!("berth-replaced-{}", std::process::id()));
    std::fs::copy(marked_berth("swap-b"), &path).unwrap();
    // A load in flight: its connection holds the handover.
    let url = server.url.clone();
    let slow = std::thread::spawn(move || {
        ureq::post(format!("{url}/api/models/slow/load"))
            .header("Content-Type", "application/json")
            .send("{}")
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    });
    std::thread::sleep(Duration::from_millis(300));
    let asking = {
        let (url, path) = (server.url.clone(), path.clone());
        std::thread::spawn(move || {
            std::process::Command::new(berth_bin())
                .args(["upgrade", "--binary", path.to_str().unwrap(), "--url", &url])
                .output()
                .unwrap()
        })
    };
    assert!(wait_for(Duration::from_secs(30), || !server
        .events_of("upgrade_started")
        .is_empty()));
    // Replaced by another build, as a package manager would.
    let other = path.with_extension("new");
    std::fs::copy(marked_berth("swap-c"), &other).unwrap();
    std::fs::rename(&other, &path).unwrap();
    let _ = slow.join();
    let out = asking.join().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(build(&server), "swap-b");
    let _ = std::fs::remove_file(&path);
}

/// A program that passed its check but hangs on its way to serving: its
/// watchdog execs the previous binary, which takes every worker back.
/// `berth upgrade --wait` ends at its deadline, not later.
#[test]
fn a_takeover_that_hangs_goes_back_to_the_previous_binary() {
    let env = [
        ("BERTH_FAULT_TAKEOVER_HANG", "hang-b"),
        ("BERTH_UPGRADE_SERVE_WITHIN", "4s"),
    ];
    let server = start(&marked_berth("hang-a"), &echo("a"), &env);
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let before = worker_pids(&server);
    let b = marked_berth("hang-b");
    let asked = Instant::now();
    let (ok, _, stderr) = server.cli(&["upgrade", "--binary", b.to_str().unwrap(), "--wait", "2s"]);
    assert!(!ok, "the upgrade said it went through");
    assert!(
        stderr.contains("did not say how the upgrade went"),
        "{stderr}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(6),
        "--wait 2s took {:?}",
        asked.elapsed()
    );
    assert!(wait_for(Duration::from_secs(30), || server
        .get("/healthz")
        .0
        == 200));
    assert!(wait_for(Duration::from_secs(10), || !server
        .events_of("upgraded")
        .is_empty()));
    let upgraded = &server.events_of("upgraded")[0];
    assert!(
        upgraded["fell_back"]
            .as_str()
            .unwrap()
            .contains("did not serve within"),
        "{upgraded}"
    );
    assert_eq!(build(&server), "hang-a");
    assert_eq!(worker_pids(&server), before);
}

/// A request file that is a FIFO, or a link to `/dev/zero`: `SIGUSR2`
/// refuses it at once (an `upgrade_failed` event), reads nothing of it,
/// and berth serves on.
#[test]
fn a_hostile_request_file_is_refused_at_once() {
    let dir = berth_tests::daemon::temp_dir("hupgrade-request");
    let state = dir.join("state.json");
    let config = format!(
        "state_file = {:?}\n{}",
        state.display().to_string(),
        echo("a")
    );
    let server = start(&marked_berth("req-a"), &config, &[]);
    let request = state.with_extension("upgrade");
    let c = std::ffi::CString::new(request.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo with a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    signal(server.pid(), nix::sys::signal::Signal::SIGUSR2);
    assert!(wait_for(Duration::from_secs(5), || !server
        .events_of("upgrade_failed")
        .is_empty()));
    assert_eq!(server.get("/healthz").0, 200);
    std::thread::sleep(Duration::from_millis(2100));
    std::os::unix::fs::symlink("/dev/zero", &request).unwrap();
    signal(server.pid(), nix::sys::signal::Signal::SIGUSR2);
    assert!(wait_for(Duration::from_secs(5), || server
        .events_of("upgrade_failed")
        .len()
        == 2));
    assert_eq!(server.get("/healthz").0, 200);
    let rss = berth::memory::resident_bytes(server.pid()).unwrap_or(0);
    assert!(rss < 256 << 20, "{} MiB", rss >> 20);
    assert_eq!(build(&server), "req-a");
}

/// A long request open and `POST /api/upgrade` asked again and again:
/// each attempt waits for it while still accepting (then gives up), so a
/// client with a 2 s timeout is answered every time.
#[test]
fn upgrade_attempts_under_a_long_request_do_not_black_out_new_connections() {
    let config = format!(
        "test_backends = true\ndrain_timeout = \"3s\"\n{}[[model]]\nname = \"hang\"\nbackend = \"fault\"\noptions = {{ mode = \"hang-on-request\" }}\n",
        echo("a")
    );
    let server = start(&marked_berth("black-a"), &config, &[]);
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let url = server.url.clone();
    let _hung = std::thread::spawn(move || {
        let _ = ureq::post(format!("{url}/api/models/hang/infer"))
            .header("Content-Type", "application/json")
            .send("{}");
    });
    std::thread::sleep(Duration::from_millis(500));
    let stop = AtomicBool::new(false);
    let failures = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let asker = scope.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let _ = server.post("/api/upgrade", json!({}));
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(2)))
            .build()
            .into();
        let mut failures = Vec::new();
        let until = Instant::now() + Duration::from_secs(12);
        while Instant::now() < until {
            let sent = Instant::now();
            match agent
                .post(format!("{}/api/models/a/infer", server.url))
                .header("Content-Type", "application/json")
                .send("{\"x\": 1}")
            {
                Ok(r) if r.status() == 200 => {}
                other => failures.push(format!(
                    "after {:?}: {:?}",
                    sent.elapsed(),
                    other.map(|r| r.status())
                )),
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        stop.store(true, Ordering::Relaxed);
        let _ = asker.join();
        failures
    });
    assert!(
        failures.is_empty(),
        "{} failed: {failures:?}",
        failures.len()
    );
    assert!(!server.events_of("upgrade_failed").is_empty());
    assert_eq!(build(&server), "black-a");
}

/// The new program accepts before it has adopted the workers (held back
/// 1.5 s here by a fault): it answers at once what needs no worker, a
/// request for a handed-over model waits for its worker and is answered
/// by it, and no second worker starts.
#[test]
fn a_request_during_the_adoption_waits_for_its_worker() {
    let env = [("BERTH_FAULT_ADOPT_SLOW", "adopt-b")];
    let server = start(&marked_berth("adopt-a"), &echo("a"), &env);
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let before = worker_pids(&server);
    let b = marked_berth("adopt-b");
    std::thread::scope(|scope| {
        let upgrade = scope.spawn(|| server.cli(&["upgrade", "--binary", b.to_str().unwrap()]));
        // Serving, the workers not yet adopted.
        assert!(wait_for(Duration::from_secs(30), || {
            let (status, version) = server.get("/api/version");
            status == 200 && version["build"] == "adopt-b"
        }));
        assert!(
            server.events_of("upgraded").is_empty(),
            "the workers were adopted before the new program served"
        );
        // Answered by the worker handed over (no load below), so after
        // its adoption.
        let (status, answer) = server.post("/api/models/a/infer", json!({"x": 1}));
        assert_eq!(status, 200, "{answer}");
        let (ok, outcome, stderr) = upgrade.join().unwrap();
        assert!(ok, "{stderr} {outcome}");
    });
    let upgraded = &server.events_of("upgraded")[0];
    assert_eq!(upgraded["lost"], json!([]), "{upgraded}");
    assert_eq!(worker_pids(&server), before, "no second worker");
    let loads = server
        .events_of("loaded")
        .iter()
        .filter(|e| e["model"] == "a")
        .count();
    assert_eq!(loads, 1, "a second worker was loaded");
}
