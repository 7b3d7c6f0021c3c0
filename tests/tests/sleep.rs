//! Sleep (`sleep = "driver"`): a model's GPU memory moved to its host
//! memory by the CUDA driver's checkpoint API, its process kept; against
//! the fake driver (`tests/fake-gpu`), which moves a pid's memory out and
//! back and can be told to fail each step. Every failure ends in a served
//! model or a clean stop, never a stuck one.

use std::process::Command;

use berth_tests::fake_gpu::*;
use berth_tests::*;
use serde_json::{Value, json};

fn napper(fake: &FakeGpu) -> Server {
    fake.serve(&format!("{}sleep = \"driver\"\n", hog("nap", 4096, "[0]")))
}

fn infer(server: &Server) -> (u16, Value) {
    server.post("/api/models/nap/infer", json!({}))
}

fn on_gpu(server: &Server) -> Value {
    gpus(server)["devices"][0]["processes"].clone()
}

/// Must hold: asleep, the model's pid holds nothing on the GPU (NVML says
/// so in the report), keeps its pid, and a request wakes it and gets the
/// same answer as before; an explicit wake and an unload while asleep work
/// too.
#[test]
fn a_model_put_to_sleep_gives_its_gpu_back_keeps_its_pid_and_answers_as_before() {
    let fake = FakeGpu::new();
    let server = napper(&fake);
    let loaded = load(&server, "nap");
    let pid = u(&loaded["pid"]);
    let (status, before) = infer(&server);
    assert_eq!(status, 200, "{before}");

    let (status, slept) = server.post("/api/models/nap/sleep", json!({}));
    assert_eq!(status, 200, "{slept}");
    assert_eq!(u(&slept["pid"]), pid);
    assert_eq!(u(&slept["vram_before_bytes"]), 4 * GIB + CONTEXT, "{slept}");
    assert_eq!(u(&slept["vram_after_bytes"]), 0, "{slept}");
    assert_eq!(on_gpu(&server), json!([]));
    let ps = server.ps();
    assert_eq!(ps[0]["state"], "asleep", "{ps:?}");
    assert_eq!(u(&ps[0]["pid"]), pid);
    let (status, again) = server.post("/api/models/nap/sleep", json!({}));
    assert_eq!(
        (status, again["error"]["code"].as_str()),
        (409, Some("sleep_refused"))
    );

    // A request wakes it, and waits for that.
    let (status, after) = infer(&server);
    assert_eq!(status, 200, "{after}");
    assert_eq!(after, before);
    assert_eq!(server.ps()[0]["state"], "ready");
    assert_eq!(
        on_gpu(&server),
        json!([{"pid": pid, "bytes": 4 * GIB + CONTEXT, "model": "nap"}])
    );
    let woke = server.events_of("woke");
    assert_eq!(woke.len(), 1, "{woke:?}");
    assert_eq!(woke[0]["report"]["reason"], "request");
    assert_eq!(u(&woke[0]["report"]["vram_bytes"]), 4 * GIB + CONTEXT);
    assert_eq!(server.events_of("slept").len(), 1);

    // From the CLI: asleep, awake.
    for (verb, said) in [("sleep", "asleep"), ("wake", "awake")] {
        let out = Command::new(berth_bin())
            .args([verb, "nap", "--url", &server.url])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains(said),
            "{verb}: {text}"
        );
    }
    assert_eq!(u(&server.ps()[0]["pid"]), pid);

    // Unloaded asleep: stopped at once, its memory gone with it.
    let (status, _) = server.post("/api/models/nap/sleep", json!({}));
    assert_eq!(status, 200);
    let report = unload(&server, "nap");
    assert_eq!(report["stop"], "sigkill", "{report}");
    assert_eq!(u(&report["pid"]), pid);
    assert_eq!(report["leftover_processes"], 0, "{report}");
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
    assert_eq!(on_gpu(&server), json!([]));
}

/// Must hold: a step of a sleep that fails (or a driver without the API)
/// stops the model with the reason; a step of a wake that fails stops it
/// and loads it cold; either way the next request is served.
#[test]
fn every_failed_step_ends_in_a_served_model_or_a_clean_stop() {
    let fake = FakeGpu::new();
    let server = napper(&fake);
    // Falling asleep: lock, checkpoint, no API at all.
    for fault in ["lock", "checkpoint", "no-api"] {
        let pid = u(&load(&server, "nap")["pid"]);
        if fault == "no-api" {
            fake.without_checkpoint(true);
        } else {
            fake.fail_checkpoint(Some(fault));
        }
        let (status, reply) = server.post("/api/models/nap/sleep", json!({}));
        assert_eq!(
            (status, reply["error"]["code"].as_str()),
            (502, Some("sleep_failed")),
            "{fault}: {reply}"
        );
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(message.contains("stopped instead"), "{fault}: {message}");
        if fault == "no-api" {
            assert!(message.contains("CUDA_ERROR_NOT_SUPPORTED"), "{message}");
        }
        assert!(server.ps().is_empty(), "{fault}: stopped");
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        assert_eq!(on_gpu(&server), json!([]), "{fault}");
        fake.fail_checkpoint(None);
        fake.without_checkpoint(false);
        // Served again, loaded cold.
        let (status, reply) = infer(&server);
        assert_eq!(status, 200, "{fault}: {reply}");
        unload(&server, "nap");
    }
    let failed = server.events_of("sleep_failed");
    assert_eq!(failed.len(), 3, "{failed:?}");
    assert_eq!(failed[0]["step"], "lock");
    assert_eq!(failed[1]["step"], "checkpoint");

    // Waking: restore, unlock. The request that wakes it is served by a
    // cold load.
    for fault in ["restore", "unlock"] {
        let pid = u(&load(&server, "nap")["pid"]);
        let (status, reply) = server.post("/api/models/nap/sleep", json!({}));
        assert_eq!(status, 200, "{reply}");
        fake.fail_checkpoint(Some(fault));
        let (status, reply) = infer(&server);
        fake.fail_checkpoint(None);
        assert_eq!(status, 200, "{fault}: {reply}");
        let ps = server.ps();
        assert_eq!(ps[0]["state"], "ready", "{ps:?}");
        assert_ne!(u(&ps[0]["pid"]), pid, "{fault}: loaded cold");
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        let last = server.events_of("sleep_failed").pop().unwrap();
        assert_eq!(last["step"], fault, "{last}");
        assert_eq!(last["fallback"], "stopped; loading it cold");
        // Only the new worker holds the GPU.
        let held = on_gpu(&server);
        assert_eq!(held.as_array().unwrap().len(), 1, "{held}");
        unload(&server, "nap");
    }

    // An explicit wake that fails answers so, and leaves it served.
    load(&server, "nap");
    server.post("/api/models/nap/sleep", json!({}));
    fake.fail_checkpoint(Some("restore"));
    let (status, reply) = server.post("/api/models/nap/wake", json!({}));
    fake.fail_checkpoint(None);
    assert_eq!(status, 502, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("loaded cold: it serves again"),
        "{reply}"
    );
    assert_eq!(server.ps()[0]["state"], "ready");
}

/// Must hold: no sleep where it cannot be proven or was not asked for.
#[test]
fn a_sleep_is_refused_without_nvmls_figures_or_a_sleep_setting() {
    // No driver at all: no per-process figure.
    let server = Server::start(
        "[[model]]\nname = \"cpu\"\nbackend = \"echo\"\nsleep = \"driver\"\n\
         [[model]]\nname = \"plain\"\nbackend = \"echo\"\n",
    );
    for model in ["cpu", "plain"] {
        let (status, _) = server.post(&format!("/api/models/{model}/load"), json!({}));
        assert_eq!(status, 200);
    }
    let (status, reply) = server.post("/api/models/cpu/sleep", json!({}));
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (409, Some("sleep_refused"))
    );
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("NVML's per-process figures"), "{message}");
    let (status, reply) = server.post("/api/models/plain/sleep", json!({}));
    assert_eq!(status, 409);
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("it has no `sleep`"),
        "{reply}"
    );
    // Both serve on.
    for model in ["cpu", "plain"] {
        let (status, _) = server.post(&format!("/api/models/{model}/infer"), json!({"x": 1}));
        assert_eq!(status, 200, "{model}");
    }
    let (status, reply) = server.post("/api/models/cpu/wake", json!({}));
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (409, Some("sleep_refused"))
    );
}

/// The scheduler chooses: a model that can sleep, whose wake beats its
/// cold load, sleeps to give its GPU to another (said in the `evicted`
/// event, with why) and wakes with its pid when the GPU is free again;
/// woken while the other holds the GPU, its restore finds no room and it
/// loads cold through the queue, the other giving way.
#[test]
fn the_scheduler_puts_a_model_to_sleep_to_free_its_gpu_when_that_is_cheaper() {
    let fake = FakeGpu::new();
    // One 4 GiB device: two 2.5 GiB models cannot share it.
    fake.set_devices(&format!("Fake-small 4G {BASE_USED} {CONTEXT}\n"));
    let config = "[[model]]\nname = \"slow\"\nbackend = \"gpu-hog\"\ngpus = [0]\n\
         sleep = \"driver\"\noptions = { alloc_mib = 2048, load_ms = 1500 }\n\
         [[model]]\nname = \"other\"\nbackend = \"gpu-hog\"\ngpus = [0]\n\
         options = { alloc_mib = 2048 }\n";
    let server = fake.serve(config);
    let ask = |model: &str| server.post(&format!("/api/models/{model}/infer"), json!({}));
    let slow = u(&load(&server, "slow")["pid"]);
    assert_eq!(ask("other").0, 200);
    let evicted = server.events_of("evicted");
    assert_eq!(evicted[0]["model"], "slow", "{evicted:?}");
    let why = evicted[0]["sleep"]
        .as_str()
        .unwrap_or_else(|| panic!("{evicted:?}"));
    assert!(why.starts_with("asleep instead of stopped"), "{why}");
    let ps = server.ps();
    let state = |name: &str| {
        ps.iter()
            .find(|m| m["name"] == name)
            .map(|m| (m["state"].as_str().unwrap().to_string(), u(&m["pid"])))
    };
    assert_eq!(state("slow"), Some(("asleep".into(), slow)), "{ps:?}");

    // The GPU free again: it wakes with its pid.
    unload(&server, "other");
    assert_eq!(ask("slow").0, 200);
    assert_eq!(u(&server.ps()[0]["pid"]), slow);
    assert_eq!(server.events_of("woke").len(), 1);

    // Asleep again for `other`, then asked for while `other` holds the
    // GPU: no room to restore, so a cold load through the queue.
    assert_eq!(ask("other").0, 200);
    assert_eq!(server.events_of("slept").len(), 2);
    assert_eq!(ask("slow").0, 200);
    let failed = server.events_of("sleep_failed");
    assert_eq!(failed.last().unwrap()["step"], "restore", "{failed:?}");
    let ps = server.ps();
    assert_eq!(ps.len(), 1, "{ps:?}");
    assert_eq!(ps[0]["name"], "slow");
    assert_ne!(u(&ps[0]["pid"]), slow, "loaded cold");
}

/// `sleep = "server"`: vLLM's own sleep and wake routes, with what the
/// server really gave back measured by NVML and reported; a residue over
/// `http.sleep.max_residue`, or a route that fails, stops it instead.
#[test]
fn a_server_sleeps_by_its_own_routes_and_its_residue_is_measured() {
    let fake = FakeGpu::new();
    let state = fake.state_dir();
    let serve = |modes: &str, max_residue: &str| {
        let args = format!(
            r#", "--gpu-state", "{}", "--gpu-bytes", "{}", "--residue", "{}""#,
            state.display(),
            6 * GIB,
            GIB
        );
        let config = berth_tests::upstream::config(modes, &args, "sleep = \"server\"\n")
            .replace(
                "headers = {",
                &format!(
                    "sleep = {{ sleep = \"/sleep?level=1\", wake = \"/wake_up\"{max_residue} }}, headers = {{"
                ),
            );
        Server::start_env(&config, &[], &fake.env())
    };
    let server = serve("", "");
    let pid = u(&load(&server, "fake")["pid"]);
    let (status, slept) = server.post("/api/models/fake/sleep", json!({}));
    assert_eq!(status, 200, "{slept}");
    assert_eq!(u(&slept["vram_before_bytes"]), 6 * GIB);
    assert_eq!(u(&slept["vram_after_bytes"]), GIB, "the residue, measured");
    // A request wakes it through its own route.
    let (status, reply) = server.post("/v1/embeddings", json!({"model": "fake", "input": "x"}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(u(&server.ps()[0]["pid"]), pid);
    assert_eq!(
        u(&server.events_of("woke")[0]["report"]["vram_bytes"]),
        6 * GIB
    );
    drop(server);

    // A residue over the bound: stopped instead, saying so.
    let server = serve("", ", max_residue = \"512MiB\"");
    load(&server, "fake");
    let (status, reply) = server.post("/api/models/fake/sleep", json!({}));
    assert_eq!(status, 502, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("over `http.sleep.max_residue`"),
        "{message}"
    );
    assert!(server.ps().is_empty());
    drop(server);

    // A server whose sleep route fails: stopped, the next request served.
    let server = serve("sleep-fails", "");
    load(&server, "fake");
    let (status, reply) = server.post("/api/models/fake/sleep", json!({}));
    assert_eq!(status, 502, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("answered 500")
    );
    let (status, _) = server.post("/v1/embeddings", json!({"model": "fake", "input": "x"}));
    assert_eq!(status, 200);
}

/// A worker that dies asleep is said to have crashed, and the next request
/// loads it cold: never an asleep model without a process.
#[test]
fn a_worker_that_dies_asleep_is_loaded_cold_by_the_next_request() {
    let fake = FakeGpu::new();
    let server = napper(&fake);
    let pid = u(&load(&server, "nap")["pid"]);
    assert_eq!(server.post("/api/models/nap/sleep", json!({})).0, 200);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while server.events_of("crashed").is_empty() {
        assert!(std::time::Instant::now() < deadline, "no crashed event");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(server.ps().is_empty(), "{:?}", server.ps());
    let (status, reply) = infer(&server);
    assert_eq!(status, 200, "{reply}");
    assert_ne!(u(&server.ps()[0]["pid"]), pid);
}
