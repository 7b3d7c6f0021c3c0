//! Warm starts: a worker kind's preloaded interpreter forks its workers
//! (python/berth_worker/preloader.py, supervisor/src/child/preload.rs), driven
//! through the real `berth serve` and the real interpreter. The guarantees
//! every worker gives run against forked workers in the conformance suite;
//! this file holds what is the preloader's own: a refused preload, a dead
//! preloader, its keep-alive, its start with the server, restarts.

use std::time::Duration;

use berth_tests::python::{python_worker_command, repo_root};
use berth_tests::*;
use serde_json::{Value, json};

/// A config with a `py` kind preloading `modules`, `extra` kind settings,
/// and models `a` and `b` of that kind (`hog`, 1 MiB).
fn config(modules: &[&str], extra: &str) -> String {
    config_of("py", modules, extra)
}

/// [`config`] with the kind named `kind` (its preloader is `preload-<kind>`).
fn config_of(kind: &str, modules: &[&str], extra: &str) -> String {
    format!(
        "[workers.{kind}]\ncommand = {:?}\nenv = {{ PYTHONPATH = {:?} }}\npreload = {:?}\n{extra}\n\
         [[model]]\nname = \"a\"\nbackend = \"hog\"\nworker = \"{kind}\"\n\n\
         [[model]]\nname = \"b\"\nbackend = \"hog\"\nworker = \"{kind}\"\n",
        python_worker_command(),
        repo_root().join("python/tests").display().to_string(),
        modules,
    )
}

/// `berth serve` with its log in a file, read by [`log`].
fn serve(config_toml: &str) -> (Server, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "berth-preload-{}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("berth.toml");
    std::fs::write(&path, config_toml).unwrap();
    let log = dir.join("serve.log");
    let file = std::fs::File::create(&log).unwrap();
    let server = Server::start_custom(&path, None, &[], &[], &mut |command| {
        command.stderr(file.try_clone().unwrap());
    });
    (server, log)
}

fn log(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn load(server: &Server, model: &str) -> Value {
    let (status, body) = server.post(&format!("/api/models/{model}/load"), json!({}));
    assert_eq!(status, 200, "{body}");
    body
}

fn preloaders(server: &Server) -> Vec<Value> {
    let (status, body) = server.get("/api/ps");
    assert_eq!(status, 200, "{body}");
    body["preloaders"].as_array().cloned().unwrap_or_default()
}

fn signal(pid: u32, signal: nix::sys::signal::Signal) {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), signal).unwrap();
}

fn preloader_pid(report: &Value) -> u32 {
    assert_eq!(report["start"]["kind"], "forked", "{report}");
    report["start"]["preloader_pid"].as_u64().unwrap() as u32
}

#[test]
fn workers_are_forked_from_one_preloader_and_ps_tells_what_each_owns() {
    let (server, _log) = serve(&config(&["json", "berth_worker.backends"], ""));
    let a = load(&server, "a");
    let b = load(&server, "b");
    let preloader = preloader_pid(&a);
    assert_eq!(preloader_pid(&b), preloader, "one preloader for the kind");
    for report in [&a, &b] {
        let pid = report["pid"].as_u64().unwrap() as u32;
        // The supervisor's own child, in a session of its own.
        let stat = procfs::process::Process::new(pid as i32)
            .unwrap()
            .stat()
            .unwrap();
        assert_eq!(stat.ppid as u32, server.pid(), "{report}");
        assert_eq!(stat.session, pid as i32);
        assert!(report["private_bytes"].as_u64().unwrap() > 0, "{report}");
        assert!(report["shared_bytes"].as_u64().unwrap() > 0, "{report}");
    }
    let (_, ps) = server.get("/api/ps");
    for model in ps["models"].as_array().unwrap() {
        assert_eq!(model["start"]["kind"], "forked", "{model}");
        assert!(model["private_bytes"].as_u64().unwrap() < model["rss_bytes"].as_u64().unwrap());
    }
    let listed = preloaders(&server);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["kind"], "py");
    assert_eq!(listed[0]["state"], "ready");
    assert_eq!(listed[0]["pid"], preloader);
    assert_eq!(listed[0]["forks"], 2);
    assert!(listed[0]["rss_bytes"].as_u64().unwrap() > 0);
    assert!(
        listed[0]["keep_alive_left_s"].is_null(),
        "its models are loaded"
    );
    let (_, metrics) = server.get("/metrics");
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(
        metrics.contains(&format!(
            "berth_preloader_forks{{kind=\"py\",pid=\"{preloader}\"}} 2"
        )),
        "{metrics}"
    );
    // An unload's proof counts what the worker owned.
    let (status, unload) = server.post("/api/models/a/unload", json!({}));
    assert_eq!(status, 200, "{unload}");
    assert_eq!(unload["leftover_processes"], 0);
    assert!(
        unload["private_at_stop_bytes"].as_u64().unwrap() > 0,
        "{unload}"
    );
}

/// The memory cgroup a process is in (this machine lets berth make them)
/// and the file that caps it: (`/sys/fs/cgroup/...`, `memory.max` on v2 or
/// `memory.limit_in_bytes` on v1).
fn memory_cgroup(pid: u32) -> (std::path::PathBuf, &'static str) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let line = |prefix: &str| {
        text.lines()
            .find_map(|l| l.split_once(prefix).map(|(_, path)| path.to_string()))
    };
    match line(":memory:") {
        Some(path) => (
            std::path::PathBuf::from(format!("/sys/fs/cgroup/memory{path}")),
            "memory.limit_in_bytes",
        ),
        None => (
            std::path::PathBuf::from(format!("/sys/fs/cgroup{}", line("0::").unwrap())),
            "memory.max",
        ),
    }
}

/// The spare cgroups `server`'s preloaders of kind `py` have now, beside
/// the worker cgroup `beside` (all of berth's are in one folder).
fn spare_cgroups(server: &Server, beside: &std::path::Path) -> usize {
    let prefix = format!("preload-py-spare-{}-", server.pid());
    std::fs::read_dir(beside.parent().unwrap())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .count()
}

/// The preloader forks the next load's worker ahead: a spare, already the
/// supervisor's child, shown in `ps`, waiting in a cgroup made for it. The
/// next fork hands it its load: it is that worker, its cgroup renamed for
/// the model and capped at the model's `memory_limit`, and another spare
/// takes its place.
#[test]
fn a_spare_worker_waits_forked_and_becomes_the_next_loads_in_its_own_cgroup() {
    let mut config = config(&["json", "berth_worker.backends"], "");
    config.push_str("memory_limit = \"300MiB\"\n");
    let (server, _log) = serve(&config);
    let a = load(&server, "a");
    let preloader = preloader_pid(&a);
    let spare = || {
        preloaders(&server)
            .first()
            .and_then(|p| p["spare_pid"].as_u64())
            .map(|p| p as u32)
    };
    assert!(
        wait_for(Duration::from_secs(10), || spare().is_some()),
        "no spare worker in {:?}",
        preloaders(&server)
    );
    let waiting = spare().unwrap();
    let stat = procfs::process::Process::new(waiting as i32)
        .unwrap()
        .stat()
        .unwrap();
    assert_eq!(stat.ppid as u32, server.pid(), "the supervisor's child");
    assert_eq!(stat.pgrp as u32, preloader, "in its preloader's group");
    // Told apart from its preloader by its environment, as `ps e` shows it.
    assert_eq!(workers_of_model("preload-py-spare"), vec![waiting]);
    assert!(
        memory_cgroup(waiting)
            .0
            .display()
            .to_string()
            .contains("/berth/preload-py-spare-"),
        "{:?}",
        memory_cgroup(waiting)
    );
    // `b` (the last model in the file) is capped at 300 MiB.
    let b = load(&server, "b");
    assert_eq!(preloader_pid(&b), preloader);
    assert_eq!(b["pid"].as_u64().unwrap() as u32, waiting, "{b}");
    assert!(workers_of_model("b").contains(&waiting));
    let (dir, cap) = memory_cgroup(waiting);
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("b-"),
        "named for its model: {}",
        dir.display()
    );
    let limit = std::fs::read_to_string(dir.join(cap)).unwrap();
    assert_eq!(
        limit.trim(),
        (300u64 << 20).to_string(),
        "{}",
        dir.display()
    );
    assert_eq!(b["memory_limit_bytes"], 300u64 << 20, "{b}");
    // Its session is its own; a new spare waits for the next load.
    let stat = procfs::process::Process::new(waiting as i32)
        .unwrap()
        .stat()
        .unwrap();
    assert_eq!(stat.session as u32, waiting);
    assert!(
        wait_for(Duration::from_secs(10), || spare()
            .is_some_and(|p| p != waiting)),
        "no new spare in {:?}",
        preloaders(&server)
    );
    let (status, body) = server.post("/api/models/b/infer", json!({}));
    assert_eq!(status, 200, "{body}");
    // The spare goes with its preloader, and its cgroup after it.
    let next = spare().unwrap();
    assert_eq!(spare_cgroups(&server, &dir), 1);
    signal(preloader, nix::sys::signal::Signal::SIGKILL);
    assert!(
        wait_for(Duration::from_secs(10), || !alive(next)),
        "the spare {next} outlived its preloader"
    );
    assert!(
        wait_for(Duration::from_secs(5), || spare_cgroups(&server, &dir) == 0),
        "the spare's cgroup outlived it"
    );
    let (status, body) = server.post("/api/models/b/infer", json!({}));
    assert_eq!(status, 200, "{body}");
}

/// Two loads of a kind at once: one is handed the spare (its frame names
/// the spare's cgroup), the other forked then, each worker in a cgroup
/// named for its own model; a spare waits again afterwards and the next
/// load is that spare.
#[test]
fn two_loads_at_once_each_get_a_worker_in_their_own_cgroup_and_a_spare_waits_after() {
    let mut config = config(&["json", "berth_worker.backends"], "");
    for model in ["c", "d"] {
        config.push_str(&format!(
            "\n[[model]]\nname = \"{model}\"\nbackend = \"hog\"\nworker = \"py\"\n"
        ));
    }
    let (server, _log) = serve(&config);
    let spare = || {
        preloaders(&server)
            .first()
            .and_then(|p| p["spare_pid"].as_u64())
            .map(|p| p as u32)
    };
    load(&server, "a");
    for _ in 0..3 {
        assert!(wait_for(Duration::from_secs(10), || spare().is_some()));
        let reports: Vec<Value> = std::thread::scope(|scope| {
            let loads: Vec<_> = ["b", "c"]
                .into_iter()
                .map(|model| scope.spawn(|| load(&server, model)))
                .collect();
            loads.into_iter().map(|l| l.join().unwrap()).collect()
        });
        for (model, report) in ["b", "c"].into_iter().zip(&reports) {
            preloader_pid(report);
            let pid = report["pid"].as_u64().unwrap() as u32;
            let (dir, _) = memory_cgroup(pid);
            let name = dir.file_name().unwrap().to_string_lossy().into_owned();
            assert!(
                name.starts_with(&format!("{model}-")),
                "{model}'s worker {pid} is in {}",
                dir.display()
            );
            let (status, body) = server.post(&format!("/api/models/{model}/infer"), json!({}));
            assert_eq!(status, 200, "{body}");
        }
        for model in ["b", "c"] {
            let (status, body) = server.post(&format!("/api/models/{model}/unload"), json!({}));
            assert_eq!(status, 200, "{body}");
        }
    }
    assert!(
        wait_for(Duration::from_secs(10), || spare().is_some()),
        "no spare after the loads at once: {:?}",
        preloaders(&server)
    );
    let waiting = spare().unwrap();
    let d = load(&server, "d");
    assert_eq!(d["pid"].as_u64().unwrap() as u32, waiting, "{d}");
}

#[test]
fn a_preload_that_starts_a_thread_is_refused_naming_the_module_and_loads_start_cold() {
    let (server, log_file) = serve(&config_of(
        "refusing",
        &["json", "preload_starts_a_thread"],
        "",
    ));
    for model in ["a", "b"] {
        let report = load(&server, model);
        assert_eq!(report["start"]["kind"], "cold_fallback", "{report}");
        let reason = report["start"]["reason"].as_str().unwrap();
        assert!(reason.contains("preload_starts_a_thread"), "{reason}");
        assert!(reason.contains("threads are running"), "{reason}");
    }
    let listed = preloaders(&server);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["state"], "refused");
    assert!(
        listed[0]["reason"]
            .as_str()
            .unwrap()
            .contains("preload_starts_a_thread")
    );
    assert!(listed[0]["pid"].is_null());
    assert!(log(&log_file).contains("preload was refused: module `preload_starts_a_thread`"));
    assert!(
        wait_for(Duration::from_secs(2), || workers_of_model(
            "preload-refusing"
        )
        .is_empty()),
        "the refused preloader is gone"
    );
}

#[test]
fn a_dead_preloader_is_replaced_at_the_next_load_and_its_workers_serve_on() {
    let (server, log_file) = serve(&config(&["berth_worker.backends"], ""));
    let a = load(&server, "a");
    let first = preloader_pid(&a);
    signal(first, nix::sys::signal::Signal::SIGKILL);
    assert!(wait_for(Duration::from_secs(5), || !alive(first)));
    // Its worker is the supervisor's, not the preloader's: it serves on.
    let (status, body) = server.post("/api/models/a/infer", json!({}));
    assert_eq!(status, 200, "{body}");
    let b = load(&server, "b");
    let second = preloader_pid(&b);
    assert_ne!(second, first);
    assert!(
        log(&log_file).contains("starting a new one"),
        "{}",
        log(&log_file)
    );
}

#[test]
fn an_idle_preloader_is_stopped_after_its_keep_alive_and_not_before() {
    let (server, log_file) = serve(&config(&["json"], "preload_keep_alive = \"1s\""));
    let a = load(&server, "a");
    let preloader = preloader_pid(&a);
    let (worker_cgroup, _) = memory_cgroup(a["pid"].as_u64().unwrap() as u32);
    // While a model of its kind is loaded it stays, keep-alive or not.
    std::thread::sleep(Duration::from_millis(2500));
    assert!(alive(preloader));
    assert_eq!(spare_cgroups(&server, &worker_cgroup), 1, "its spare's");
    let (status, _) = server.post("/api/models/a/unload", json!({}));
    assert_eq!(status, 200);
    assert!(
        wait_for(Duration::from_secs(10), || !alive(preloader)),
        "still running: {:?}",
        preloaders(&server)
    );
    assert!(wait_for(Duration::from_secs(2), || preloaders(&server).is_empty()));
    assert!(log(&log_file).contains("stopping its preloaded interpreter"));
    assert!(
        wait_for(Duration::from_secs(5), || spare_cgroups(
            &server,
            &worker_cgroup
        ) == 0),
        "its spare's cgroup outlived it"
    );
    // The next load starts a new one.
    let b = load(&server, "b");
    assert_ne!(preloader_pid(&b), preloader);
}

#[test]
fn preload_at_start_starts_the_preloader_with_the_server() {
    let (server, _log) = serve(&config(&["json"], "preload_at_start = true"));
    assert!(
        wait_for(Duration::from_secs(20), || preloaders(&server)
            .first()
            .is_some_and(|p| p["state"] == "ready")),
        "{:?}",
        preloaders(&server)
    );
    let pid = preloaders(&server)[0]["pid"].as_u64().unwrap() as u32;
    assert_eq!(preloaders(&server)[0]["forks"], 0);
    let a = load(&server, "a");
    assert_eq!(preloader_pid(&a), pid);
}

#[test]
fn a_crashed_forked_worker_is_restarted_forked() {
    let toml = format!(
        "[workers.py]\ncommand = {:?}\npreload = [\"berth_worker.backends\"]\n\n\
         [[model]]\nname = \"f\"\nbackend = \"fault\"\nworker = \"py\"\noptions = {{ crash_on = \"poison\" }}\n",
        python_worker_command()
    );
    let (server, _log) = serve(&toml);
    let report = load(&server, "f");
    let preloader = preloader_pid(&report);
    let first = report["pid"].as_u64().unwrap();
    let (status, _) = server.post("/api/models/f/infer", json!({"input": "poison"}));
    assert_ne!(status, 200);
    let restarted = || {
        let (_, ps) = server.get("/api/ps");
        ps["models"]
            .as_array()
            .and_then(|m| m.first())
            .cloned()
            .unwrap_or_default()
    };
    assert!(
        wait_for(Duration::from_secs(20), || {
            let m = restarted();
            m["state"] == "ready" && m["pid"].as_u64().is_some_and(|p| p != first)
        }),
        "{}",
        restarted()
    );
    let m = restarted();
    assert_eq!(m["start"]["kind"], "forked", "{m}");
    assert_eq!(m["start"]["preloader_pid"], preloader, "{m}");
    assert_eq!(m["restarts"], 1, "{m}");
}

#[test]
fn a_wedged_preloader_is_stopped_and_the_worker_starts_cold_on_a_wire_of_its_own() {
    let toml = format!(
        "[workers.wedged]\ncommand = {:?}\npreload = [\"json\"]\n\n\
         [[model]]\nname = \"a\"\nbackend = \"echo\"\nworker = \"wedged\"\nload_timeout = \"9s\"\n\n\
         [[model]]\nname = \"b\"\nbackend = \"echo\"\nworker = \"wedged\"\n",
        python_worker_command()
    );
    let (server, _log) = serve(&toml);
    // Start the preloader with a first load, then freeze it.
    let b = load(&server, "b");
    let frozen = preloader_pid(&b);
    signal(frozen, nix::sys::signal::Signal::SIGSTOP);
    let a = load(&server, "a");
    assert_eq!(a["start"]["kind"], "cold_fallback", "{a}");
    assert!(
        a["start"]["reason"]
            .as_str()
            .unwrap()
            .contains("did not answer a fork"),
        "{a}"
    );
    let (status, body) = server.post("/api/models/a/infer", json!({"x": 1}));
    assert_eq!((status, &body["x"]), (200, &json!(1)), "{body}");
    assert!(
        wait_for(Duration::from_secs(5), || !alive(frozen)),
        "stopped"
    );
    // The next load starts a new preloader.
    let (status, _) = server.post("/api/models/b/unload", json!({}));
    assert_eq!(status, 200);
    let b = load(&server, "b");
    assert_ne!(preloader_pid(&b), frozen);
}

#[test]
fn a_preloader_that_dies_before_it_is_ready_is_tried_again_only_after_a_wait() {
    let (server, log_file) = serve(&config_of("dying", &["json", "preload_exits"], ""));
    let a = load(&server, "a");
    assert_eq!(a["start"]["kind"], "cold_fallback", "{a}");
    let reason = a["start"]["reason"].as_str().unwrap();
    assert!(reason.contains("exited"), "{reason}");
    // The next load starts cold at once, without a second try.
    let b = load(&server, "b");
    let reason = b["start"]["reason"].as_str().unwrap();
    assert!(reason.contains("the next try is in"), "{reason}");
    let listed = preloaders(&server);
    assert_eq!(listed[0]["state"], "failed", "{listed:?}");
    assert_eq!(
        log(&log_file)
            .matches("the preloaded interpreter failed")
            .count(),
        1,
        "{}",
        log(&log_file)
    );
    let (status, body) = server.post("/api/models/b/infer", json!({}));
    assert_eq!(status, 200, "{body}");
}

/// A preloaded module that starts a helper in its own session and stops
/// reaping children: the preloader fails at its first fork (the load
/// starts cold, as it must), and the helper, listed nowhere, used to run
/// until berth stopped. What a preloader started goes when it ends, as
/// what a worker started does at its unload.
#[test]
fn what_a_dead_preloader_started_goes_with_it() {
    let pid_file = std::env::temp_dir().join(format!("berth-helper-{}", free_port()));
    let config = format!(
        "[workers.py]\ncommand = {:?}\nenv = {{ PYTHONPATH = {:?}, BERTH_TEST_PID_FILE = {:?} }}\n\
         preload = [\"preload_leaves_a_helper\"]\n\n\
         [[model]]\nname = \"a\"\nbackend = \"hog\"\nworker = \"py\"\n",
        python_worker_command(),
        repo_root().join("python/tests").display().to_string(),
        pid_file.display().to_string(),
    );
    let (server, _log) = serve(&config);
    let a = load(&server, "a");
    assert_eq!(a["start"]["kind"], "cold_fallback", "{a}");
    let helper: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || !alive(helper)),
        "the helper pid {helper} outlived its preloader"
    );
    let (status, body) = server.post("/api/models/a/infer", json!({}));
    assert_eq!(status, 200, "{body}");
    let _ = std::fs::remove_file(&pid_file);
}

/// A worker kind with a relative `cwd` (as python/examples/serve.toml has)
/// forks its workers into that folder, resolved against berth's own once
/// (the preloader is already in it); and a forked worker that dies before
/// its hello, after a fork that worked, is started again cold: no load
/// fails for a preloader's sake.
#[test]
fn a_relative_cwd_works_forked_and_a_failed_fork_falls_back_cold() {
    let root = std::env::temp_dir().join(format!("berth-cwd-{}", free_port()));
    std::fs::create_dir_all(root.join("models/here")).unwrap();
    let kind = |name: &str, modules: &[&str]| {
        format!(
            "[workers.{name}]\ncommand = {:?}\ncwd = \"models/here\"\nenv = {{ PYTHONPATH = {:?} }}\n\
             preload = {modules:?}\n\n[[model]]\nname = \"{name}-a\"\nbackend = \"hog\"\nworker = \"{name}\"\n\n\
             [[model]]\nname = \"{name}-b\"\nbackend = \"hog\"\nworker = \"{name}\"\n\n",
            python_worker_command(),
            repo_root().join("python/tests").display().to_string(),
        )
    };
    let config = root.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "{}{}",
            kind("warm", &["json"]),
            kind("dies", &["forked_worker_dies"])
        ),
    )
    .unwrap();
    let server = Server::start_file(&config, Some(&root), &[], &[]);
    for model in ["warm-a", "warm-b"] {
        let report = load(&server, model);
        preloader_pid(&report);
        let pid = report["pid"].as_u64().unwrap();
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap();
        assert_eq!(cwd, root.join("models/here").canonicalize().unwrap());
    }
    let report = load(&server, "dies-a");
    assert_eq!(report["start"]["kind"], "cold_fallback", "{report}");
    let reason = report["start"]["reason"].as_str().unwrap();
    assert!(
        reason.contains("forked from the preloaded interpreter failed"),
        "{reason}"
    );
    let (status, body) = server.post("/api/models/dies-a/infer", json!({}));
    assert_eq!(status, 200, "{body}");
    let _ = std::fs::remove_dir_all(&root);
}
