//! The core's "must hold" list, against the real `berth-worker` binary.

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth::{
    Body, Bulk, Error, ExitStatus, ModelSpec, ModelState, StopKind, Supervisor, SupervisorConfig,
};
use berth_tests::*;
use ipc_channel::ipc::IpcSharedMemory;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_round_trips_json_inline_and_shared_bytes() {
    let sup = supervisor();
    let load = sup.load(ModelSpec::new("echo", "echo")).await.unwrap();
    assert!(alive(load.pid));
    assert!(load.rss_bytes > 0 && load.peak_rss_bytes >= load.rss_bytes);

    let reply = sup
        .request("echo", Body::json(r#"{"input":"hi"}"#))
        .await
        .unwrap();
    assert_eq!(reply.json, r#"{"input":"hi"}"#);

    let bytes: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
    let inline = Body {
        json: "{}".into(),
        bulk: Bulk::Inline(bytes.clone()),
    };
    assert_eq!(
        sup.request("echo", inline).await.unwrap().bulk_bytes(),
        &bytes[..]
    );
    let shared = Body {
        json: "{}".into(),
        bulk: Bulk::Shared(IpcSharedMemory::from_bytes(&bytes)),
    };
    let reply = sup.request("echo", shared).await.unwrap();
    assert!(
        matches!(reply.bulk, Bulk::Shared(_)),
        "bulk stays in shared memory"
    );
    assert_eq!(reply.bulk_bytes(), &bytes[..]);

    let unload = sup.unload("echo").await.unwrap();
    assert_eq!(unload.pid, load.pid);
    assert_eq!(unload.stop, StopKind::Graceful);
    assert_eq!(unload.exit, ExitStatus::Code(0));
    assert_eq!(unload.requests, 3);
    assert_eq!(unload.leftover_processes, 0);
    assert!(!alive(load.pid));
    // The model stays registered: the next request loads it again, in a new worker.
    assert_eq!(
        sup.request("echo", Body::json("{}")).await.unwrap().json,
        "{}"
    );
    let again = sup.stats();
    assert_eq!(again.len(), 1);
    assert_ne!(again[0].pid, Some(load.pid));
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_ignoring_shutdown_and_sigterm_is_killed() {
    let sup = supervisor();
    let load = sup
        .load(ModelSpec::new("stubborn", "fault").option("mode", "ignore-shutdown"))
        .await
        .unwrap();
    sup.request("stubborn", Body::json("{}")).await.unwrap();
    let started = Instant::now();
    let unload = sup.unload("stubborn").await.unwrap();
    assert_eq!(unload.stop, StopKind::Sigkill, "{unload}");
    assert_eq!(unload.exit, ExitStatus::Signal("SIGKILL".into()));
    assert_eq!(unload.leftover_processes, 0);
    let graces = test_config().stop_graces;
    assert!(
        started.elapsed() >= graces.shutdown + graces.term,
        "both graces were given"
    );
    assert!(!alive(load.pid));
}

async fn crash_then_recover(mode: &str, expect: &str) {
    let sup = supervisor();
    let name = format!("crash-{mode}");
    let load = sup
        .load(ModelSpec::new(&name, "fault").option("mode", mode))
        .await
        .unwrap();
    let started = Instant::now();
    let err = sup.request(&name, Body::json("{}")).await.unwrap_err();
    let elapsed = started.elapsed();
    assert!(
        elapsed < Duration::from_secs(1),
        "{mode}: failed after {elapsed:?}, not at once"
    );
    assert_eq!(err.kind(), "worker_died", "{err}");
    let message = err.to_string();
    assert!(
        message.contains(expect),
        "{mode}: `{message}` names {expect}"
    );
    assert!(
        message.contains(&name) && message.contains(&load.pid.to_string()),
        "{message}"
    );
    assert!(
        message.contains("fault:"),
        "stderr tail is in the error: {message}"
    );
    assert!(wait_for(Duration::from_secs(1), || !alive(load.pid)));

    // The supervisor carries on: the crash policy restarts the model in a new
    // worker after its backoff, and it can be unloaded and loaded anew.
    assert!(
        eventually(Duration::from_secs(20), || {
            let stats = sup.stats();
            stats.len() == 1
                && stats[0].state == ModelState::Ready
                && stats[0].pid != Some(load.pid)
        })
        .await,
        "restarted: {:?}",
        sup.stats()
    );
    let stats = sup.stats();
    assert_eq!(stats[0].restarts, 1);
    assert!(
        stats[0]
            .last_exit
            .as_ref()
            .is_some_and(|e| e.description.contains(expect)),
        "{stats:?}"
    );
    let unload = sup.unload(&name).await.unwrap();
    assert_eq!(unload.stop, StopKind::Graceful);
    sup.load(ModelSpec::new(&name, "fault").option("mode", "ok"))
        .await
        .unwrap();
    assert_eq!(
        sup.request(&name, Body::json("{\"a\":1}"))
            .await
            .unwrap()
            .json,
        "{\"a\":1}"
    );
    sup.unload(&name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_on_request_fails_at_once_naming_the_signal() {
    crash_then_recover("crash-on-request", "SIGSEGV").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_on_request_fails_at_once_naming_the_signal() {
    crash_then_recover("abort-on-request", "SIGABRT").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exit_on_request_fails_at_once_naming_the_code() {
    crash_then_recover("exit-on-request", "exited with code 3").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_on_load_is_a_load_error_naming_the_signal() {
    let sup = supervisor();
    let err = sup
        .load(ModelSpec::new("bad", "fault").option("mode", "crash-on-load"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "worker_died");
    assert!(
        err.to_string().contains("SIGSEGV") && err.to_string().contains("during load"),
        "{err}"
    );
    assert!(sup.stats().is_empty(), "a failed load leaves no slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_on_load_times_out_and_the_worker_is_gone() {
    let sup = supervisor();
    let spec = ModelSpec::new("hung", "fault")
        .option("mode", "hang-on-load")
        .load_timeout(Duration::from_secs(2));
    let started = Instant::now();
    let err = sup.load(spec).await.unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "bounded by the load timeout"
    );
    let Error::LoadTimeout { pid, phase, .. } = &err else {
        panic!("expected a time-out, got {err}")
    };
    assert_eq!(*phase, "load");
    assert!(
        err.to_string().contains("2s") && err.to_string().contains("killed"),
        "{err}"
    );
    assert!(!alive(*pid), "the worker is gone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_options_and_backends_are_clear_load_errors() {
    let sup = supervisor();
    let err = sup
        .load(ModelSpec::new("h", "hog").option("alloc_mb", 5))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("`alloc_mb`") && err.to_string().contains("alloc_mib"),
        "{err}"
    );
    let err = sup
        .load(ModelSpec::new("h", "hog").option("alloc_mib", "lots"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("alloc_mib=lots"), "{err}");
    let err = sup.load(ModelSpec::new("h", "nope")).await.unwrap_err();
    assert!(
        err.to_string().contains("no backend `nope`") && err.to_string().contains("echo"),
        "{err}"
    );
    let err = sup
        .load(ModelSpec::new("f", "fault").option("mode", "explode"))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("explode") && err.to_string().contains("hang-on-load"),
        "{err}"
    );
    assert!(sup.stats().is_empty());
    sup.load(ModelSpec::new("h", "echo")).await.unwrap();
    let err = sup.load(ModelSpec::new("h", "echo")).await.unwrap_err();
    assert_eq!(err.kind(), "already_loaded");
    sup.unload("h").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_protocol_version_is_refused_and_stopped() {
    let sup = supervisor();
    let mut spec = ModelSpec::new("old", "echo").worker_binary(test_worker_bin());
    spec.env
        .push(("BERTH_TEST_WORKER_MODE".into(), "wrong-version".into()));
    let err = sup.load(spec).await.unwrap_err();
    let Error::ProtocolMismatch { pid, mismatch, .. } = &err else {
        panic!("got {err}")
    };
    assert_eq!(
        (mismatch.worker.as_str(), mismatch.supervisor.as_str()),
        (
            "999",
            berth::protocol::PROTOCOL_VERSION.to_string().as_str()
        )
    );
    // The program is named, with advice for a Rust worker, not Python's.
    let text = err.to_string();
    assert!(text.contains("999"), "{err}");
    assert!(text.contains("berth-test-worker"), "{err}");
    assert!(text.contains("rebuild the worker binary"), "{err}");
    assert!(!text.contains("berth_worker"), "{err}");
    assert!(
        wait_for(Duration::from_secs(1), || !alive(*pid)),
        "the worker was stopped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_that_is_no_worker_is_refused_promptly() {
    let sup = supervisor();
    // Exits at once without connecting.
    let spec = ModelSpec::new("true", "echo").worker_binary("/bin/true");
    let started = Instant::now();
    let err = sup.load(spec).await.unwrap_err();
    assert_eq!(err.kind(), "handshake_failed", "{err}");
    assert!(err.to_string().contains("before saying hello"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(2));

    // Never connects: bounded by the load timeout, then killed.
    let mut spec = ModelSpec::new("mute", "echo")
        .worker_binary(test_worker_bin())
        .load_timeout(Duration::from_secs(2));
    spec.env
        .push(("BERTH_TEST_WORKER_MODE".into(), "never-connect".into()));
    let started = Instant::now();
    let err = sup.load(spec).await.unwrap_err();
    let Error::LoadTimeout { pid, phase, .. } = &err else {
        panic!("got {err}")
    };
    assert_eq!(*phase, "handshake");
    assert!(started.elapsed() < Duration::from_secs(6));
    assert!(!alive(*pid));

    // Speaks, but not a hello.
    let mut spec = ModelSpec::new("rude", "echo").worker_binary(test_worker_bin());
    spec.env.push((
        "BERTH_TEST_WORKER_MODE".into(),
        "wrong-first-message".into(),
    ));
    let err = sup.load(spec).await.unwrap_err();
    assert_eq!(err.kind(), "unexpected_message", "{err}");
    assert!(
        err.to_string().contains("Pong") && err.to_string().contains("Hello"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_each_get_their_own_answer() {
    let sup = supervisor();
    sup.load(ModelSpec::new("echo-c", "echo")).await.unwrap();
    let worker = sup.worker("echo-c").unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for task in 0..8u32 {
        let worker = Arc::clone(&worker);
        tasks.spawn(async move {
            let mut calls = tokio::task::JoinSet::new();
            for i in 0..1000u32 {
                let worker = Arc::clone(&worker);
                calls.spawn(async move {
                    let body = format!("{{\"task\":{task},\"i\":{i}}}");
                    let bulk = Bulk::Inline(format!("{task}-{i}").into_bytes());
                    let reply = worker
                        .call(Body {
                            json: body.clone(),
                            bulk,
                        })
                        .await
                        .unwrap();
                    assert_eq!(reply.json, body);
                    assert_eq!(reply.bulk_bytes(), format!("{task}-{i}").as_bytes());
                });
            }
            let mut n = 0;
            while let Some(r) = calls.join_next().await {
                r.unwrap();
                n += 1;
            }
            n
        });
    }
    let mut total = 0;
    while let Some(n) = tasks.join_next().await {
        total += n.unwrap();
    }
    assert_eq!(total, 8000);
    assert_eq!(worker.in_flight(), 0);
    sup.unload("echo-c").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_stream_cancels_and_unload_drains() {
    let sup = supervisor();
    sup.load(ModelSpec::new("e", "echo")).await.unwrap();
    let worker = sup.worker("e").unwrap();
    let stream = sup.request_stream("e", Body::json("{}")).await.unwrap();
    assert_eq!(worker.in_flight(), 1);
    drop(stream);
    assert_eq!(
        worker.in_flight(),
        0,
        "an abandoned request is no longer in flight"
    );
    // The worker is still fine afterwards.
    assert_eq!(
        sup.request("e", Body::json("{\"x\":1}"))
            .await
            .unwrap()
            .json,
        "{\"x\":1}"
    );
    let stats = sup.stats();
    assert_eq!(stats.len(), 1);
    assert_eq!(stats[0].pid, Some(worker.pid()));
    assert!(stats[0].rss_bytes > 0);
    let reports = sup.shutdown().await;
    assert_eq!(reports.len(), 1);
    assert!(
        reports[0]
            .as_ref()
            .is_ok_and(|r| r.stop == StopKind::Graceful)
    );
    let err = sup.load(ModelSpec::new("e", "echo")).await.unwrap_err();
    assert_eq!(err.kind(), "shutting_down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_worker_binary_says_how_to_build_it() {
    let sup = Supervisor::new(SupervisorConfig {
        worker_binary: Some("/nonexistent/berth-worker".into()),
        ..test_config()
    });
    let err = sup.load(ModelSpec::new("x", "echo")).await.unwrap_err();
    assert_eq!(err.kind(), "spawn_failed");
    assert!(
        err.to_string().contains("/nonexistent/berth-worker"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_at_max_loaded_replaces_the_model_in_place() {
    let sup = Supervisor::new(SupervisorConfig {
        max_loaded: Some(1),
        ..test_config()
    });
    let first = sup.load(ModelSpec::new("only", "echo")).await.unwrap();
    // The model being replaced does not count against the limit twice.
    let swap = sup.swap(ModelSpec::new("only", "hog")).await.unwrap();
    assert_eq!(swap.old_pid, Some(first.pid));
    assert!(!alive(first.pid));
    assert_eq!(sup.stats().len(), 1);
    assert_eq!(sup.stats()[0].backend, "hog");
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_swap_leaves_no_worker() {
    let model = format!("swapped-at-shutdown-{}", std::process::id());
    let sup = supervisor();
    let first = sup.load(ModelSpec::new(&model, "echo")).await.unwrap();
    let swap = {
        let (sup, spec) = (
            sup.clone(),
            ModelSpec::new(&model, "fault").option("load_delay_ms", 4000),
        );
        tokio::spawn(async move { sup.swap(spec).await })
    };
    // Shut down while the new worker is still loading.
    assert!(
        eventually(Duration::from_secs(5), || workers_of_model(&model).len()
            == 2)
        .await,
        "the new worker started"
    );
    let reports = sup.shutdown().await;
    assert!(
        workers_of_model(&model).is_empty(),
        "shutdown returned with a worker alive: {:?}",
        workers_of_model(&model)
    );
    assert!(!alive(first.pid));
    let err = swap.await.unwrap().unwrap_err();
    assert_eq!(err.kind(), "shutting_down", "{err}");
    assert!(
        reports
            .iter()
            .any(|r| r.as_ref().is_ok_and(|r| r.pid == first.pid)),
        "the old worker's unload is reported: {reports:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_waits_for_a_model_being_unloaded_instead_of_refusing() {
    let sup = Supervisor::new(SupervisorConfig {
        max_loaded: Some(1),
        ..test_config()
    });
    sup.load(ModelSpec::new("leaving", "hog").option("work_ms", 3000))
        .await
        .unwrap();
    let request = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.request("leaving", Body::json("{}")).await })
    };
    assert!(eventually(Duration::from_secs(5), || sup.stats()[0].in_flight == 1).await);
    let unload = {
        let sup = sup.clone();
        tokio::spawn(async move { sup.unload("leaving").await })
    };
    assert!(
        eventually(Duration::from_secs(5), || sup
            .stats()
            .first()
            .is_some_and(|s| s.state == ModelState::Draining))
        .await
    );
    // The only slot is draining: the load waits for it rather than fail.
    sup.load(ModelSpec::new("arriving", "echo")).await.unwrap();
    request.await.unwrap().unwrap();
    unload.await.unwrap().unwrap();
    let names: Vec<String> = sup.stats().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["arriving"]);
    sup.shutdown().await;
}

/// A host that drops its runtime while a worker runs (no unload) still has
/// the worker reaped when it exits: the task that watched its pidfd is
/// gone, and a thread takes over the wait, so no zombie is left.
#[test]
fn a_worker_outliving_its_runtime_is_still_reaped() {
    let sup = supervisor();
    let runtime = berth_tests::bench::runtime();
    let load = runtime
        .block_on(sup.load(ModelSpec::new("outlives", "echo")))
        .unwrap();
    drop(runtime);
    assert!(alive(load.pid));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(load.pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let me = std::process::id();
    assert!(
        wait_for(Duration::from_secs(10), || !children_of(me)
            .iter()
            .any(|(pid, _)| *pid == load.pid)),
        "worker {} left as {:?}",
        load.pid,
        children_of(me)
            .into_iter()
            .find(|(pid, _)| *pid == load.pid)
    );
    drop(sup);
}
