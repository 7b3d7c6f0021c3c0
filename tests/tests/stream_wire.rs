//! The stream wire's defences: a worker that breaks it (from
//! `tests/python/rogue_worker.py`, written from docs/wire.md alone) is
//! stopped at once with an error naming what it sent; the supervisor and its
//! other models carry on.

use std::time::{Duration, Instant};

use berth::{Body, Bulk, ModelSpec};
use berth_tests::python::{python_worker_command, rogue_worker};
use berth_tests::*;

/// A rogue worker that answers `after` requests as a plain echo, then
/// commits its offence.
fn rogue(name: &str, mode: &str, after: usize) -> ModelSpec {
    let mut spec = ModelSpec::new(name, "echo")
        .command(rogue_worker())
        .load_timeout(Duration::from_secs(20));
    spec.env.push(("ROGUE_MODE".into(), mode.into()));
    spec.env.push(("ROGUE_AFTER".into(), after.to_string()));
    spec
}

/// Offences committed in answer to a request, and a phrase of each error.
const OFFENCES: &[(&str, &str)] = &[
    ("oversized", "a frame length of 4294967280 bytes"),
    ("bad-json", "a header that is not a wire message"),
    ("not-an-object", "a header that is not a wire message"),
    ("unknown-message", "a message of type `launch`"),
    ("unknown-error-kind", "an error of kind `on_fire`"),
    ("no-such-request", "which was never sent"),
    ("double-done", "after its `done`"),
    (
        "unasked-fd",
        "a descriptor with a `done`, which declares none",
    ),
    ("unsealed-memfd", "a memfd not sealed"),
    ("short-memfd", "a memfd of 16 bytes declaring 1048576"),
    ("not-a-memfd", "a descriptor that is not a memfd"),
    (
        "undeclared-payload",
        "payload bytes its header does not declare",
    ),
    ("unsolicited-loaded", "when no load was asked for"),
    ("many-fds", "descriptors"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_breaking_the_wire_is_stopped_naming_what_it_sent() {
    offences_are_stopped_naming_what_was_sent(0).await;
}

/// After quick answers, a request's caller spins and reads the socket
/// itself, the reader task's watch paused (`child::inbox`): an offence it
/// reads is dealt with the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offence_read_by_a_spinning_caller_stops_the_worker_the_same_way() {
    offences_are_stopped_naming_what_was_sent(30).await;
}

async fn offences_are_stopped_naming_what_was_sent(after: usize) {
    let sup = supervisor();
    sup.load(ModelSpec::new("bystander", "echo").command(python_worker_command()))
        .await
        .unwrap();
    for (mode, phrase) in OFFENCES {
        let name = format!("rogue-{mode}");
        let load = sup.load(rogue(&name, mode, after)).await.unwrap();
        for i in 0..after {
            let body = format!(r#"{{"n":{i}}}"#);
            let answer = sup.request(&name, Body::json(body.clone())).await;
            assert_eq!(answer.unwrap().json.replace(' ', ""), body, "{mode}");
        }
        let started = Instant::now();
        let text = match sup.request(&name, Body::json("{}")).await {
            Err(err) => {
                assert_eq!(err.kind(), "protocol_violation", "{mode}: {err}");
                err.to_string()
            }
            // A second `done` breaks the wire after the first answered:
            // the request is served, the worker stopped, its exit recorded.
            Ok(_) if *mode == "double-done" => {
                let mut last = None;
                assert!(
                    eventually(Duration::from_secs(5), || {
                        last = sup
                            .stats()
                            .into_iter()
                            .find(|s| s.name == name)
                            .and_then(|s| s.last_exit);
                        last.is_some()
                    })
                    .await,
                    "{mode}: the exit is recorded"
                );
                let last = last.unwrap();
                assert!(
                    matches!(last.cause, Some(berth::KillCause::ProtocolViolation { .. })),
                    "{mode}: {last:?}"
                );
                format!("model `{name}`: {}", last.description)
            }
            Ok(body) => panic!("{mode}: answered {body:?}"),
        };
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{mode}: at once"
        );
        assert!(text.contains(phrase), "{mode}: `{phrase}` not in: {text}");
        assert!(text.contains(&name), "{mode}: the model is named: {text}");
        assert!(
            eventually(Duration::from_secs(3), || !alive(load.pid)).await,
            "{mode}: the worker was stopped"
        );
        let _ = sup.unload(&name).await;
    }
    assert_eq!(
        sup.request("bystander", Body::json(r#"{"still":"here"}"#))
            .await
            .unwrap()
            .json
            .replace(' ', ""),
        r#"{"still":"here"}"#
    );
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_does_not_say_hello_is_refused_naming_what_it_sent() {
    let sup = supervisor();
    for (mode, phrase) in [
        ("not-hello", "sent pong where hello was expected"),
        ("garbage-hello", "a frame length of"),
    ] {
        let err = sup.load(rogue("rude", mode, 0)).await.unwrap_err();
        assert!(
            matches!(err.kind(), "handshake_failed" | "unexpected_message"),
            "{mode}: {err}"
        );
        assert!(
            err.to_string().to_lowercase().contains(phrase),
            "{mode}: `{phrase}` not in: {err}"
        );
        assert!(
            eventually(Duration::from_secs(3), || workers_of_model("rude")
                .is_empty())
            .await,
            "{mode}: stopped"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_is_no_worker_is_refused_promptly_with_its_stderr() {
    let sup = supervisor();
    let spec = ModelSpec::new("nope", "echo")
        .command(["sh", "-c", "echo not a worker >&2; exit 7"])
        .load_timeout(Duration::from_secs(20));
    let started = Instant::now();
    let err = sup.load(spec).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(5), "{err}");
    assert_eq!(err.kind(), "handshake_failed", "{err}");
    let text = err.to_string();
    assert!(
        text.contains("code 7") && text.contains("not a worker"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_spec_is_checked_before_anything_starts() {
    let sup = supervisor();
    let err = sup
        .load(ModelSpec::new("empty", "echo").command(Vec::<String>::new()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "invalid_spec", "{err}");
    assert!(err.to_string().contains("`command` is empty"), "{err}");
    let err = sup
        .load(
            ModelSpec::new("both", "echo")
                .command(python_worker_command())
                .worker_binary(worker_bin()),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("keep one"), "{err}");
    // A backend the worker does not offer is found by asking it.
    let err = sup
        .load(ModelSpec::new("nobackend", "embed").command(python_worker_command()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "invalid_spec", "{err}");
    assert!(
        err.to_string().contains("echo") && err.to_string().contains("hog"),
        "names what it offers: {err}"
    );
}

fn dev_shm() -> std::collections::BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// `berth serve` runs Python models named by a declared worker kind or by a
/// `command` in its config, a client registers one by naming the kind, and
/// nothing named is left behind: not in `/dev/shm`, not in its TMPDIR, after
/// a worker crash and a SIGKILL of the server.
#[test]
fn the_sidecar_serves_python_models_and_leaves_nothing_named_behind() {
    let tmp = std::env::temp_dir().join(format!("berth-stream-tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).unwrap();
    let shm_before = dev_shm();
    let command = format!("{:?}", python_worker_command());
    let config = format!(
        "test_backends = true\n[workers.py]\ncommand = {command}\n\n\
         [[model]]\nname = \"direct\"\nbackend = \"echo\"\ncommand = {command}\n"
    );
    let mut server = Server::start_env(&config, &[], &[("TMPDIR", tmp.to_str().unwrap())]);
    let (status, reply) = server.post("/api/models/direct/infer", serde_json::json!({"a": 1}));
    assert_eq!(
        (status, reply.clone()),
        (200, serde_json::json!({"a": 1})),
        "{reply}"
    );

    // A client names the operator's kind; it cannot name a program.
    let (status, reply) = server.put(
        "/api/models/client",
        serde_json::json!({"backend": "fault", "worker": "py", "options": {"crash_on": "boom"}}),
    );
    assert_eq!(status, 201, "{reply}");
    let (status, reply) = server.post("/api/models/client/infer", serde_json::json!({"x": 2}));
    assert_eq!(
        (status, reply.clone()),
        (200, serde_json::json!({"x": 2})),
        "{reply}"
    );
    let (status, reply) = server.post("/api/models/client/infer", serde_json::json!({"x": "boom"}));
    assert!(status >= 500, "{status} {reply}");
    assert!(reply.to_string().contains("SIGSEGV"), "{reply}");
    let ps = server.ps();
    assert!(ps.iter().any(|m| m["name"] == "client"), "{ps:?}");

    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(5), || workers_of_model("direct")
            .is_empty()
            && workers_of_model("client").is_empty()),
        "no worker outlives the server"
    );
    let left: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    assert!(left.is_empty(), "left in TMPDIR: {left:?}");
    let shm_after = dev_shm();
    let new: Vec<_> = shm_after.difference(&shm_before).collect();
    assert!(new.is_empty(), "left in /dev/shm: {new:?}");
    let _ = std::fs::remove_dir_all(&tmp);
}

/// A worker that speaks no version in common is sent `refused` first and
/// given time to read it: it exits on its own, having printed why, and the
/// error names the program, both versions and advice for its kind (a
/// worker written from docs/wire.md, not the Python package).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_worker_reads_why_before_it_is_stopped() {
    let sup = supervisor();
    let err = sup
        .load(rogue("old-wire", "wrong-version", 0))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "protocol_mismatch", "{err}");
    let text = err.to_string();
    for phrase in [
        "rogue_worker.py",
        "versions 2, 3",
        "speaks 1",
        "exited with code 1",
        "rogue: refused: the worker speaks wire versions 2, 3",
        "docs/wire.md",
    ] {
        assert!(text.contains(phrase), "`{phrase}` not in: {text}");
    }
    assert!(!text.contains("berth_worker"), "no Python advice: {text}");
    assert!(workers_of_model("old-wire").is_empty());
}

/// A worker that stops reading: what the socket does not take waits in the
/// supervisor's queue (the first large frame partly written by its caller,
/// the rest behind it), no caller blocks meanwhile, and once the worker
/// reads again (slowly) every frame arrives whole and in the order it was
/// sent, a memfd with the frame that declares it, those sent while the
/// queue drains included (a caller writing past the queue would cut into
/// the frame being drained).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_stops_reading_gets_every_frame_whole_and_in_order() {
    let sup = supervisor();
    sup.load(ModelSpec::new("bystander", "echo")).await.unwrap();
    sup.load(rogue("deaf", "deaf", 0)).await.unwrap();
    let worker = sup.worker("deaf").unwrap();
    // 1 MiB of JSON each; the fourth also carries bulk bytes, which go in
    // a memfd.
    let body = |k: u8| {
        let json = format!(
            r#"{{"k":{k},"pad":"{}"}}"#,
            char::from(b'a' + k % 26).to_string().repeat(1 << 20)
        );
        let bulk = if k == 3 {
            Bulk::Inline(vec![7; 100_000])
        } else {
            Bulk::None
        };
        Body { json, bulk }
    };
    // The first request makes it deaf for a second.
    let mut first = worker.call_stream(Body::json(r#"{"first":true}"#)).unwrap();
    let first = tokio::spawn(async move { first.next().await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Six sent while it is deaf, in this order, by calls that return once
    // the frame is written or queued: far more than a socket buffer.
    let mut sent = Vec::new();
    let mut streams = Vec::new();
    for k in 0..6 {
        let b = body(k);
        sent.push(serde_json::from_str::<serde_json::Value>(&b.json).unwrap());
        streams.push(worker.call_stream(b).unwrap());
    }
    // The runtime's two threads still serve another model meanwhile.
    let answer = sup
        .request("bystander", Body::json(r#"{"still":"here"}"#))
        .await
        .unwrap();
    assert_eq!(answer.json.replace(' ', ""), r#"{"still":"here"}"#);
    assert!(
        !first.is_finished(),
        "the deaf worker answered before it read again"
    );
    assert!(matches!(
        first.await.unwrap(),
        Some(Ok(berth::Piece::Done(_)))
    ));
    // Six more while it reads the queue, slowly: each must wait its turn.
    for k in 6..12 {
        let b = body(k);
        sent.push(serde_json::from_str::<serde_json::Value>(&b.json).unwrap());
        streams.push(worker.call_stream(b).unwrap());
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for (k, (mut stream, sent)) in streams.into_iter().zip(sent).enumerate() {
        let Some(Ok(berth::Piece::Done(got))) = stream.next().await else {
            panic!("request {k} was not answered");
        };
        let got: serde_json::Value = serde_json::from_str(&got.json).unwrap();
        assert_eq!(got["seen"], k + 2, "request {k} arrived out of order");
        assert_eq!(got["fds"], u64::from(k == 3), "request {k}'s descriptors");
        assert_eq!(got["body"], sent, "request {k} arrived changed");
    }
    sup.shutdown().await;
}

/// A caller spinning for a quick answer pauses the reactor's watch of the
/// socket and, once its answer came whole, leaves it paused for the next
/// request's spin (`child::inbox`). Whatever else is sent resumes it, and
/// so does the worker's death: a heartbeat's pong, a request that does not
/// spin and the death all still reach the supervisor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_answers_read_by_spinning_callers_pongs_requests_and_a_death_still_arrive() {
    let sup = supervisor();
    sup.load(ModelSpec::new("quick", "echo").command(python_worker_command()))
        .await
        .unwrap();
    let worker = sup.worker("quick").unwrap();
    let handle = &worker;
    let echo = |i: usize| async move {
        let body = format!(r#"{{"n":{i}}}"#);
        let answer = handle.call(Body::json(body.clone())).await.unwrap();
        assert_eq!(answer.json.replace(' ', ""), body);
    };
    for i in 0..50 {
        echo(i).await;
    }
    let stats = worker.ping(Duration::from_secs(5)).await;
    assert!(stats.is_some(), "the pong after quick answers was heard");
    // Two at once: neither spins past the other, and both are answered.
    for i in 0..20 {
        tokio::join!(echo(2 * i), echo(2 * i + 1));
    }
    for i in 0..50 {
        echo(i).await;
    }
    let stats = worker.ping(Duration::from_secs(5)).await;
    assert!(
        stats.is_some(),
        "the pong after concurrent answers was heard"
    );
    for i in 0..50 {
        echo(i).await;
    }
    let pid = worker.pid();
    // SAFETY: kill(2) on the worker's pid, which is this test's child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGKILL) }, 0);
    let err = worker.call(Body::json("{}")).await.unwrap_err();
    assert!(
        err.to_string().contains("signal 9") || err.to_string().contains("SIGKILL"),
        "the request hears the death: {err}"
    );
    assert!(
        eventually(Duration::from_secs(5), || !alive(pid)).await,
        "the worker is gone"
    );
    sup.shutdown().await;
}
