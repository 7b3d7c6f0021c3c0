//! One conformance suite, three workers: every scenario that proves a
//! worker's guarantees runs against the Rust worker (`berth-worker` on
//! `ipc-channel`), the Python worker (`python3 -m berth_worker` on the
//! stream wire, in the test venv) started cold, and the same Python worker
//! forked from its kind's preloaded interpreter, from one definition.
//! `both!` makes a `rust`, a `python` and a `python_forked` test of each.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth::protocol::Bulk;
use berth::{Body, Error, ExitStatus, ModelSpec, StopKind};
use berth_tests::python::{python_worker_command, rogue_worker};
use berth_tests::*;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Worker {
    Rust,
    Python,
    /// The Python worker, forked from the `py-forked` kind's preloader.
    PythonForked,
}

/// The worker kind whose workers are forked from a preloaded interpreter.
const FORKED_KIND: &str = "py-forked";

impl Worker {
    fn spec(self, name: &str, backend: &str) -> ModelSpec {
        let spec = ModelSpec::new(name, backend);
        match self {
            Worker::Rust => spec,
            Worker::Python => spec.command(python_worker_command()),
            Worker::PythonForked => {
                let mut spec = spec;
                spec.worker = Some(FORKED_KIND.into());
                spec
            }
        }
    }

    fn is_python(self) -> bool {
        self != Worker::Rust
    }

    /// The tests' settings, with the preloading kind declared (and this
    /// process a child subreaper, as `berth serve` is) for a forked worker.
    fn config(self) -> berth::SupervisorConfig {
        let mut config = test_config();
        if self == Worker::PythonForked {
            berth::orphans::become_subreaper().expect("a child subreaper");
            let mut kind = berth::WorkerKind::command(python_worker_command());
            kind.preload = vec!["berth_worker.backends".into()];
            config.workers.insert(FORKED_KIND.into(), kind);
        }
        config
    }

    fn supervisor(self) -> berth::Supervisor {
        berth::Supervisor::new(self.config())
    }
}

/// Every forked scenario's worker came from the preloader, not a cold start.
fn assert_forked(w: Worker, report: &berth::LoadReport) {
    if w == Worker::PythonForked {
        assert!(
            matches!(report.start, berth::WorkerStart::Forked { .. }),
            "{:?}",
            report.start
        );
    }
}

macro_rules! both {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rust() {
                super::$scenario(super::Worker::Rust).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn python() {
                super::$scenario(super::Worker::Python).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn python_forked() {
                super::$scenario(super::Worker::PythonForked).await
            }
        }
    )*};
}

both!(
    json_and_bulk_round_trip,
    streaming_chunks_arrive_in_order,
    cancel_stops_the_work_and_the_worker_goes_on,
    a_crash_mid_request_fails_in_flight_requests_at_once,
    another_protocol_version_is_refused,
    a_hang_at_load_times_out_and_the_worker_is_gone,
    a_hang_in_a_request_is_found_stalled,
    a_worker_ignoring_shutdown_is_escalated,
    a_load_past_its_memory_limit_is_memory_limit_exceeded,
    a_leak_is_recycled_by_max_rss_without_a_failed_request,
    unload_reclaims_the_memory_and_leaves_no_process,
    sigkill_of_berth_serve_leaves_no_worker,
    a_swap_is_make_before_break,
    a_worker_streaming_faster_than_its_reader_is_refused_not_queued,
    continuous_batching_answers_each_request_as_it_ends,
    a_failed_step_fails_its_batch_and_the_worker_goes_on,
);

/// Reads a stream to its end: the chunks and the final body's JSON.
async fn drain(mut stream: berth::RequestStream) -> (usize, serde_json::Value) {
    let mut chunks = 0;
    while let Some(piece) = stream.next().await {
        match piece.unwrap() {
            berth::Piece::Chunk(_) => chunks += 1,
            berth::Piece::Done(body) => return (chunks, serde_json::from_str(&body.json).unwrap()),
        }
    }
    panic!("the stream ended without a final body");
}

/// A stepping backend (`echo` with `stepping`): requests join a running
/// batch between steps, each streams its own chunks and is answered when
/// its own steps are done, while a longer one goes on; one cancelled
/// mid-way leaves alone.
async fn continuous_batching_answers_each_request_as_it_ends(w: Worker) {
    let sup = w.supervisor();
    let report = sup
        .load(
            w.spec("steps", "echo")
                .option("stepping", true)
                .option("batch", 8),
        )
        .await
        .unwrap();
    assert_eq!(report.max_batch, 8);
    let mut long = sup
        .request_stream("steps", Body::json(r#"{"steps":100000,"n":0}"#))
        .await
        .unwrap();
    assert!(matches!(
        long.next().await,
        Some(Ok(berth::Piece::Chunk(_)))
    ));
    let mut dropped = sup
        .request_stream("steps", Body::json(r#"{"steps":100000,"n":-1}"#))
        .await
        .unwrap();
    assert!(matches!(
        dropped.next().await,
        Some(Ok(berth::Piece::Chunk(_)))
    ));
    drop(dropped);
    let mut short = Vec::new();
    for n in 1..=5 {
        let stream = sup
            .request_stream(
                "steps",
                Body::json(format!(r#"{{"steps":{},"n":{n}}}"#, n * 3)),
            )
            .await
            .unwrap();
        short.push(tokio::spawn(drain(stream)));
    }
    for (i, task) in short.into_iter().enumerate() {
        let n = i + 1;
        let (chunks, done) = task.await.unwrap();
        assert_eq!(chunks, n * 3, "request {n} streamed its own steps");
        assert_eq!(done["n"], n, "request {n} got its own answer");
    }
    // The long one is still running: the short ones were answered as they
    // ended, not when the batch did.
    assert!(matches!(
        long.next().await,
        Some(Ok(berth::Piece::Chunk(_)))
    ));
    let status = sup.stats().into_iter().find(|m| m.name == "steps").unwrap();
    assert!(
        status.batching.mean_batch_size.unwrap() > 1.0,
        "{:?}",
        status.batching
    );
    drop(long);
    assert!(
        eventually(Duration::from_secs(10), || sup.stats()[0].in_flight == 0).await,
        "the cancelled ones left the batch"
    );
    sup.shutdown().await;
}

/// A step that fails (a panic in Rust, an exception in Python) fails every
/// request in that step with a clear error; the worker goes on serving.
async fn a_failed_step_fails_its_batch_and_the_worker_goes_on(w: Worker) {
    let sup = w.supervisor();
    sup.load(
        w.spec("steps", "echo")
            .option("stepping", true)
            .option("batch", 8),
    )
    .await
    .unwrap();
    let pid = sup.worker("steps").unwrap().pid();
    let mut running = sup
        .request_stream("steps", Body::json(r#"{"steps":100000}"#))
        .await
        .unwrap();
    assert!(matches!(
        running.next().await,
        Some(Ok(berth::Piece::Chunk(_)))
    ));
    // Its chunks are read as they come while the poison is sent: the steps
    // are unthrottled, and a stream left unread past its backlog would be
    // cut (cancelled) before the poison's step on a loaded machine.
    let reader = tokio::spawn(async move {
        loop {
            match running.next().await {
                Some(Ok(berth::Piece::Chunk(_))) => continue,
                Some(Err(e)) => break Ok(e),
                other => break Err(format!("{other:?}")),
            }
        }
    });
    let err = sup
        .request("steps", Body::json(r#"{"panic_in_step":true}"#))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("a panic in a step"), "{err}");
    let err = reader
        .await
        .unwrap()
        .unwrap_or_else(|other| panic!("the running request fails with the step, not {other}"));
    assert!(err.to_string().contains("a panic in a step"), "{err}");
    let done = sup
        .request("steps", Body::json(r#"{"steps":2,"ok":1}"#))
        .await
        .unwrap();
    let done: serde_json::Value = serde_json::from_str(&done.json).unwrap();
    assert_eq!(done, serde_json::json!({"steps": 2, "ok": 1}));
    assert_eq!(
        ready_pid(&sup, "steps"),
        Some(pid),
        "the same worker serves on"
    );
    sup.shutdown().await;
}

async fn a_worker_streaming_faster_than_its_reader_is_refused_not_queued(w: Worker) {
    let sup = berth::Supervisor::new(berth::SupervisorConfig {
        max_response: 1 << 20,
        ..w.config()
    });
    assert_forked(
        w,
        &sup.load(w.spec("flood", "echo").option("chunks", 200))
            .await
            .unwrap(),
    );
    let body = format!("{{\"pad\":\"{}\"}}", "x".repeat(100_000));
    let mut stream = sup.request_stream("flood", Body::json(body)).await.unwrap();
    // Nobody reads while the worker streams 20 MB of chunks.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut read = 0;
    let err = loop {
        match stream.next().await {
            Some(Ok(berth::Piece::Chunk(_))) => read += 1,
            Some(Err(e)) => break e,
            other => panic!("refused before the end, not {other:?}"),
        }
    };
    assert_eq!(err.kind(), "input_too_large", "{err}");
    assert!(err.to_string().contains("has not read yet"), "{err}");
    assert!(read <= 11, "at most 1 MiB was queued: {read} chunks");
    drop(stream);
    // The worker carries on.
    assert!(sup.request("flood", Body::json("{}")).await.is_ok());
    sup.shutdown().await;
}

async fn a_swap_is_make_before_break(w: Worker) {
    let sup = std::sync::Arc::new(w.supervisor());
    // Batching on: concurrent requests run together in both workers.
    assert_forked(
        w,
        &sup.load(w.spec("sw", "echo").option("batch", 8))
            .await
            .unwrap(),
    );
    let old = sup.worker("sw").unwrap().pid();
    // Requests keep coming from four clients during the swap; none fails.
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let sup = std::sync::Arc::clone(&sup);
            tokio::spawn(async move {
                let mut failed = 0;
                for i in 0..100 {
                    let body = Body::json(format!("{{\"c\":{c},\"i\":{i}}}"));
                    match sup.request("sw", body.clone()).await {
                        Ok(out) if out.json == body.json => {}
                        _ => failed += 1,
                    }
                }
                failed
            })
        })
        .collect();
    let traffic = tokio::spawn(async move {
        let mut failed = 0;
        for c in clients {
            failed += c.await.unwrap();
        }
        failed
    });
    let report = sup
        .swap(w.spec("sw", "echo").option("chunks", 1).option("batch", 8))
        .await
        .unwrap();
    assert_eq!(report.old_pid, old);
    assert_ne!(report.new_pid, old);
    assert_eq!(report.unload.leftover_processes, 0);
    assert_eq!(
        traffic.await.unwrap(),
        0,
        "no request failed during the swap"
    );
    assert!(!alive(old), "the old worker is gone");
    sup.shutdown().await;
}

async fn json_and_bulk_round_trip(w: Worker) {
    let sup = w.supervisor();
    assert_forked(w, &sup.load(w.spec("e", "echo")).await.unwrap());
    let reply = sup
        .request("e", Body::json(r#"{"input":"héllo","n":[1,2,3]}"#))
        .await
        .unwrap();
    let value: serde_json::Value = serde_json::from_str(&reply.json).unwrap();
    assert_eq!(value, serde_json::json!({"input": "héllo", "n": [1, 2, 3]}));

    // Small bulk bytes travel inside the message, 64 MiB through shared
    // memory (a sealed memfd on the stream wire).
    for size in [1000usize, 64 << 20] {
        let bytes: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
        let started = Instant::now();
        let reply = sup
            .request(
                "e",
                Body {
                    json: "{}".into(),
                    bulk: Bulk::Inline(bytes.clone()),
                },
            )
            .await
            .unwrap();
        assert!(
            reply.bulk_bytes() == bytes.as_slice(),
            "{size} bytes came back intact"
        );
        if size > 1 << 20 {
            assert!(
                matches!(
                    reply.bulk,
                    Bulk::Shared(_) | Bulk::Mapped(_) | Bulk::Inline(_)
                ),
                "{:?}",
                reply.bulk
            );
            if w.is_python() {
                assert!(matches!(reply.bulk, Bulk::Mapped(_)), "{:?}", reply.bulk);
            }
            eprintln!("{w:?}: 64 MiB echoed in {:?}", started.elapsed());
        }
    }
    sup.shutdown().await;
}

async fn streaming_chunks_arrive_in_order(w: Worker) {
    let sup = w.supervisor();
    assert_forked(
        w,
        &sup.load(w.spec("s", "echo").option("chunks", 3))
            .await
            .unwrap(),
    );
    let mut stream = sup
        .request_stream("s", Body::json(r#"{"k":"v"}"#))
        .await
        .unwrap();
    let mut chunks = 0;
    let done = loop {
        match stream.next().await.expect("a piece").unwrap() {
            berth::Piece::Chunk(body) => {
                let v: serde_json::Value = serde_json::from_str(&body.json).unwrap();
                assert_eq!(v, serde_json::json!({"k": "v"}));
                chunks += 1;
            }
            berth::Piece::Done(body) => break body,
        }
    };
    assert_eq!(chunks, 3);
    assert!(stream.next().await.is_none(), "nothing after done");
    let v: serde_json::Value = serde_json::from_str(&done.json).unwrap();
    assert_eq!(v, serde_json::json!({"k": "v"}));
    sup.shutdown().await;
}

async fn cancel_stops_the_work_and_the_worker_goes_on(w: Worker) {
    let sup = w.supervisor();
    assert_forked(
        w,
        &sup.load(w.spec("c", "hog").option("work_ms", 20_000))
            .await
            .unwrap(),
    );
    let worker = sup.worker("c").unwrap();
    let stream = sup.request_stream("c", Body::json("{}")).await.unwrap();
    assert!(
        eventually(Duration::from_secs(5), || sup.stats()[0].in_flight == 1).await,
        "the request is running"
    );
    drop(stream);
    // The worker stops working and sends its one `done` (dropped on
    // arrival): its own in-flight count falls to zero well before 20 s.
    let started = Instant::now();
    let mut idle = false;
    while started.elapsed() < Duration::from_secs(10) {
        if worker
            .ping(Duration::from_secs(2))
            .await
            .is_some_and(|s| s.in_flight == 0)
        {
            idle = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(idle, "the worker stopped the cancelled request");
    assert!(worker.is_alive(), "and is still serving");
    assert_eq!(ready_pid(&sup, "c"), Some(worker.pid()));
    sup.shutdown().await;
}

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
