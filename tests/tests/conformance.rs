//! The conformance suite, requests: round trips with bulk bytes, streams,
//! cancels, swaps, a reader too slow for its stream, batching and its
//! faults, each against the three workers of `berth_tests::conformance`
//! (Rust, Python cold, Python forked from a preloaded interpreter). The
//! faults and the lifecycle are in `conformance_faults.rs`.

use std::time::{Duration, Instant};

use berth::Body;
use berth::protocol::Bulk;
use berth_tests::conformance::{Worker, assert_forked};
use berth_tests::*;

berth_tests::conformance!(
    json_and_bulk_round_trip,
    streaming_chunks_arrive_in_order,
    cancel_stops_the_work_and_the_worker_goes_on,
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
    assert_eq!(report.old_pid, Some(old));
    assert_ne!(report.new_pid, Some(old));
    assert_eq!(report.unload.as_ref().unwrap().leftover_processes, 0);
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
