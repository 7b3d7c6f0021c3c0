//! The conformance suite, faults and lifecycle: crashes, hangs, a wrong
//! protocol version, a worker ignoring shutdown, memory limits, leaks,
//! unloads and a SIGKILLed `berth serve`, each against the three workers of
//! `berth_tests::conformance` (Rust, Python cold, Python forked from a
//! preloaded interpreter). Requests are in `conformance.rs`.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth::{Body, Error, ExitStatus, ModelSpec, StopKind};
use berth_tests::conformance::{Worker, assert_forked};
use berth_tests::python::{python_worker_command, rogue_worker};
use berth_tests::*;

berth_tests::conformance!(
    a_crash_mid_request_fails_in_flight_requests_at_once,
    another_protocol_version_is_refused,
    a_hang_at_load_times_out_and_the_worker_is_gone,
    a_hang_in_a_request_is_found_stalled,
    a_worker_ignoring_shutdown_is_escalated,
    a_load_past_its_memory_limit_is_memory_limit_exceeded,
    a_leak_is_recycled_by_max_rss_without_a_failed_request,
    unload_reclaims_the_memory_and_leaves_no_process,
    sigkill_of_berth_serve_leaves_no_worker,
);

async fn a_crash_mid_request_fails_in_flight_requests_at_once(w: Worker) {
    let sup = w.supervisor();
    sup.load(
        w.spec("x", "fault")
            .option("crash_on", "poison")
            .option("crash_delay_ms", 300),
    )
    .await
    .unwrap();
    let started = Instant::now();
    // The poison first; the second request waits behind it in the worker
    // and is in flight when the worker dies, 300 ms later (a poison that
    // killed the worker at once could be mourned before the second was
    // even sent, which then waited for the restart): both fail, at once.
    let mut poison = sup
        .request_stream("x", Body::json(r#"{"input":"poison"}"#))
        .await
        .unwrap();
    let mut bystander = sup
        .request_stream("x", Body::json(r#"{"input":"fine"}"#))
        .await
        .unwrap();
    for stream in [&mut poison, &mut bystander] {
        let err = match stream.next().await {
            Some(Err(e)) => e,
            other => panic!("a failure, not {other:?}"),
        };
        let Error::WorkerDied {
            exit, stderr_tail, ..
        } = &err
        else {
            panic!("{err}")
        };
        assert_eq!(*exit, ExitStatus::Signal("SIGSEGV".into()), "{err}");
        assert!(
            stderr_tail.iter().any(|l| l.contains("raising SIGSEGV")),
            "the stderr tail names it: {stderr_tail:?}"
        );
    }
    assert!(started.elapsed() < Duration::from_secs(3), "at once");
    sup.shutdown().await;
}

async fn another_protocol_version_is_refused(w: Worker) {
    let sup = w.supervisor();
    let mut spec = match w {
        Worker::Rust => ModelSpec::new("old", "echo").worker_binary(test_worker_bin()),
        // Not a berth_worker program: no preloader can fork it; a forked
        // worker's handshake is the same code as a cold one's.
        Worker::Python | Worker::PythonForked => {
            ModelSpec::new("old", "echo").command(rogue_worker())
        }
    };
    let mode = match w {
        Worker::Rust => "BERTH_TEST_WORKER_MODE",
        Worker::Python | Worker::PythonForked => "ROGUE_MODE",
    };
    spec.env.push((mode.into(), "wrong-version".into()));
    let err = sup.load(spec).await.unwrap_err();
    let Error::ProtocolMismatch { pid, mismatch, .. } = &err else {
        panic!("{err}")
    };
    let (worker, supervisor) = (&mismatch.worker, &mismatch.supervisor);
    // The ipc wire's version, or the stream wire's (optional members such
    // as a done's `batch` did not change it).
    let (expected, ours) = match w {
        Worker::Rust => ("999", berth::protocol::PROTOCOL_VERSION.to_string()),
        Worker::Python | Worker::PythonForked => ("2, 3", "1".to_string()),
    };
    assert_eq!(
        (worker.as_str(), supervisor.as_str()),
        (expected, ours.as_str()),
        "{err}"
    );
    assert!(err.to_string().contains(expected), "{err}");
    assert!(
        wait_for(Duration::from_secs(2), || !alive(*pid)),
        "the worker was stopped"
    );
}

async fn a_hang_at_load_times_out_and_the_worker_is_gone(w: Worker) {
    let sup = w.supervisor();
    let spec = w
        .spec("h", "fault")
        .option("mode", "hang-on-load")
        .load_timeout(Duration::from_secs(2));
    let started = Instant::now();
    let err = sup.load(spec).await.unwrap_err();
    assert_eq!(err.kind(), "load_timeout", "{err}");
    assert!(started.elapsed() < Duration::from_secs(8));
    assert!(
        eventually(Duration::from_secs(5), || workers_of_model("h").is_empty()).await,
        "no worker is left"
    );
}

async fn a_hang_in_a_request_is_found_stalled(w: Worker) {
    let sup = w.supervisor();
    let mut spec = w.spec("hr", "fault").option("mode", "hang-on-request");
    spec.stall_timeout = Some(Duration::from_secs(2));
    assert_forked(w, &sup.load(spec).await.unwrap());
    let started = Instant::now();
    let err = sup.request("hr", Body::json("{}")).await.unwrap_err();
    assert_eq!(err.kind(), "stalled", "{err}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(8),
        "{took:?}"
    );
    // While it hung, it answered heartbeats: stalled, not silent.
    sup.shutdown().await;
}

async fn a_worker_ignoring_shutdown_is_escalated(w: Worker) {
    let sup = w.supervisor();
    assert_forked(
        w,
        &sup.load(w.spec("i", "fault").option("mode", "ignore-shutdown"))
            .await
            .unwrap(),
    );
    let report = sup.unload("i").await.unwrap();
    assert_eq!(report.stop, StopKind::Sigkill, "{report:?}");
    assert_eq!(report.leftover_processes, 0);
}

async fn a_load_past_its_memory_limit_is_memory_limit_exceeded(w: Worker) {
    let _guard = memory_lock().await;
    let sup = w.supervisor();
    assert_forked(w, &sup.load(w.spec("bystander", "echo")).await.unwrap());
    let mut spec = w.spec("greedy", "hog").option("alloc_mib", 400);
    spec.memory_limit = Some(160 << 20);
    let err = sup.load(spec).await.unwrap_err();
    let Error::MemoryLimitExceeded { limit, during, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!((*limit, *during), (160 << 20, "load"));
    assert_eq!(
        sup.request("bystander", Body::json(r#"{"ok":1}"#))
            .await
            .unwrap()
            .json
            .replace(' ', ""),
        r#"{"ok":1}"#
    );
    sup.shutdown().await;
}

async fn a_leak_is_recycled_by_max_rss_without_a_failed_request(w: Worker) {
    let _guard = memory_lock().await;
    let sup = w.supervisor();
    let mut spec = w
        .spec("leaky", "hog")
        .option("alloc_mib", 8)
        .option("leak_kib_per_request", 1024);
    spec.max_rss = Some(96 << 20);
    assert_forked(w, &sup.load(spec).await.unwrap());
    let mut failed = Vec::new();
    for i in 0..400u32 {
        if let Err(e) = sup
            .request("leaky", Body::json(format!("{{\"i\":{i}}}")))
            .await
        {
            failed.push(e.to_string());
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
    let counters = berth_tests::counters_of(&sup, "leaky");
    let recycles = counters.recycles.load(Ordering::Relaxed);
    assert!(recycles >= 2, "recycled: {recycles}");
    sup.shutdown().await;
}

async fn unload_reclaims_the_memory_and_leaves_no_process(w: Worker) {
    let _guard = memory_lock().await;
    let sup = w.supervisor();
    let mut spec = w.spec("held", "hog").option("alloc_mib", 256);
    if w.is_python() {
        // The worker's own children (a multiprocessing pool) go with it.
        spec = spec.option("pool_processes", 2);
    }
    let load = sup.load(spec).await.unwrap();
    assert_forked(w, &load);
    assert!(load.rss_bytes >= 256 << 20, "{load:?}");
    let before = workers_of_model("held");
    assert_eq!(
        before.len(),
        if w.is_python() { 3 } else { 1 },
        "{before:?}"
    );
    let report = sup.unload("held").await.unwrap();
    assert_eq!(report.stop, StopKind::Graceful);
    assert_eq!(report.leftover_processes, 0);
    assert!(
        report.reclaimed_bytes >= 200 << 20,
        "reclaimed {} bytes",
        report.reclaimed_bytes
    );
    assert!(
        eventually(Duration::from_secs(3), || workers_of_model("held")
            .is_empty())
        .await,
        "left: {:?}",
        workers_of_model("held")
    );
}

async fn sigkill_of_berth_serve_leaves_no_worker(w: Worker) {
    let (worker_kind, options) = match w {
        Worker::Rust => (String::new(), ""),
        Worker::Python => (
            format!("[workers.py]\ncommand = {:?}\n\n", python_worker_command()),
            "worker = \"py\"\noptions = { pool_processes = 2 }\n",
        ),
        Worker::PythonForked => (
            format!(
                "[workers.py]\ncommand = {:?}\npreload = [\"berth_worker.backends\"]\n\n",
                python_worker_command()
            ),
            "worker = \"py\"\noptions = { pool_processes = 2 }\n",
        ),
    };
    let model = format!(
        "killed-{}",
        match w {
            Worker::Rust => "rs",
            Worker::Python => "py",
            Worker::PythonForked => "pyf",
        }
    );
    let config =
        format!("{worker_kind}[[model]]\nname = \"{model}\"\nbackend = \"hog\"\n{options}");
    let mut server = Server::start(&config);
    let (status, body) = server.post(&format!("/api/models/{model}/load"), serde_json::json!({}));
    assert_eq!(status, 200, "{body}");
    let workers = workers_of_model(&model);
    assert!(!workers.is_empty());
    // The preloaded interpreter (`preload-<kind>`) must go too.
    let preloader = "preload-py";
    if w == Worker::PythonForked {
        assert_eq!(body["start"]["kind"], "forked", "{body}");
        assert_eq!(workers_of_model(preloader).len(), 1);
    }
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || workers_of_model(&model)
            .is_empty()
            && workers_of_model(preloader).is_empty()),
        "left behind: {:?} {:?}",
        workers_of_model(&model),
        workers_of_model(preloader)
    );
}
