//! What a real GPU (an H100) showed that the fake driver had not, taught to
//! the fake (`berth_tests::fake_gpu`) and held here: a worker on a GPU
//! that holds no GPU memory (a framework fallen back to the CPU) is said
//! to be so; the per-GPU budget holds once loads are measured, whatever
//! they were expected to take; a framework's out-of-memory error at load
//! is `gpu_out_of_memory`, naming what the model had.

use std::time::Duration;

use berth_tests::fake_gpu::*;
use berth_tests::*;
use serde_json::{Value, json};

/// A worker placed on a GPU whose process holds no device memory once
/// loaded (here the `echo` backend, which never touches CUDA, as JAX or
/// PyTorch fallen back to the CPU would): its load report, `ps` and an
/// event say so; with `require_gpu_memory` its load fails and nothing is
/// left running.
#[test]
fn a_worker_on_a_gpu_that_holds_no_gpu_memory_is_said_to_be_on_the_cpu() {
    let fake = FakeGpu::new();
    let config = format!(
        "[[model]]\nname = \"cpu-bound\"\nbackend = \"echo\"\ngpus = [1]\n\n\
         [[model]]\nname = \"strict\"\nbackend = \"echo\"\ngpus = [0]\nrequire_gpu_memory = true\n\n{}",
        hog("on-gpu", 1024, "[0]")
    );
    let server = fake.serve(&config);
    let report = load(&server, "cpu-bound");
    assert_eq!(report["warnings"][0]["code"], "gpu_unused", "{report}");
    let message = report["warnings"][0]["message"].as_str().unwrap();
    assert!(
        message.contains("placed on GPU 1 but holds no GPU memory: is it running on the CPU?"),
        "{message}"
    );
    let ps = server.ps();
    assert_eq!(ps[0]["warnings"][0]["code"], "gpu_unused", "{ps:?}");
    let warned = server.events_of("warning");
    assert_eq!(warned.len(), 1, "{warned:?}");
    assert_eq!(
        (&warned[0]["model"], &warned[0]["code"], &warned[0]["pid"]),
        (&json!("cpu-bound"), &json!("gpu_unused"), &report["pid"])
    );
    let (ok, text, _) = server.cli(&["ps"]);
    assert!(ok, "{text}");
    assert_eq!(
        text["models"][0]["warnings"][0]["code"], "gpu_unused",
        "{text}"
    );

    // A worker that holds device memory is not warned about.
    let report = load(&server, "on-gpu");
    assert!(report.get("warnings").is_none(), "{report}");
    assert!(
        server
            .ps()
            .iter()
            .all(|m| m["name"] != "on-gpu" || m.get("warnings").is_none())
    );

    let (status, body) = server.post("/api/models/strict/load", json!({}));
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "gpu_unused", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("model `strict`")
            && message.contains("placed on GPU 0 but holds no GPU memory")
            && message.contains("`require_gpu_memory` is set"),
        "{message}"
    );
    assert!(server.ps().iter().all(|m| m["name"] != "strict"));
}

/// Four models of 20 GiB on GPU 0 under a 48 GiB budget; a request to
/// `a` or `b` works for 6 s.
fn budget_config() -> String {
    let busy = |name: &str| {
        format!(
            "[[model]]\nname = \"{name}\"\nbackend = \"gpu-hog\"\ngpus = [0]\n\
             options = {{ alloc_mib = 20480, request_ms = 6000 }}\n"
        )
    };
    format!(
        "gpu_memory_budget = \"48GiB\"\n{}{}{}{}",
        busy("a"),
        busy("b"),
        hog("c", 20480, "[0]"),
        hog("d", 20480, "[0]")
    )
}

fn loaded(server: &Server) -> Vec<String> {
    server
        .ps()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect()
}

/// What the H100 showed with `gpu_memory_budget = "48GiB"`: three models
/// of 20 GiB, each of unknown size before its first load, all loaded, 61
/// GiB held. Measured, the third load evicts the least recently used idle
/// model on its GPU; with every model there busy, it fails naming the
/// figures, its worker is stopped, and its next load is planned with what
/// it was measured to take.
#[test]
fn the_vram_budget_holds_once_loads_are_measured() {
    let fake = FakeGpu::new();
    let server = fake.serve(&budget_config());
    load(&server, "a");
    load(&server, "b");
    let report = load(&server, "c");
    assert_eq!(report["gpus"], json!([0]), "{report}");
    assert_eq!(
        loaded(&server),
        ["b", "c"],
        "a, the least recently used, went"
    );
    let evicted = server.events_of("evicted");
    assert_eq!(
        (&evicted[0]["model"], &evicted[0]["for_model"]),
        (&json!("a"), &json!("c")),
        "{evicted:?}"
    );
    let held = u(&gpus(&server)["devices"][0]["berth_bytes"]);
    assert!(held <= 48 * GIB, "berth holds {held} on GPU 0");
    unload(&server, "c");

    // a and b busy: nothing there may be evicted for d, whose size no load
    // has measured yet.
    load(&server, "a");
    let busy: Vec<_> = ["a", "b"]
        .into_iter()
        .map(|m| {
            let url = format!("{}/api/models/{m}/infer", server.url);
            std::thread::spawn(move || ureq::post(&url).send_json(json!({})).is_ok())
        })
        .collect();
    assert!(wait_for(Duration::from_secs(5), || {
        server.ps().iter().all(|m| m["in_flight"] == 1)
    }));
    let (status, body) = server.post("/api/models/d/load", json!({}));
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        body["error"]["code"], "gpu_memory_budget_exceeded",
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("model `d`")
            && message.contains("measured once loaded")
            && message.contains("past the per-GPU budget of 48.0 GiB")
            && message.contains("even with every idle model there evicted"),
        "{message}"
    );
    assert_eq!(loaded(&server), ["a", "b"]);
    // Its worker is gone from the device.
    let processes = &gpus(&server)["devices"][0]["processes"];
    assert_eq!(processes.as_array().unwrap().len(), 2, "{processes}");
    for thread in busy {
        assert!(thread.join().unwrap(), "the busy requests were served");
    }
    // Planned now with the 20.5 GiB it took: room is made before it starts,
    // and the budget holds throughout.
    load(&server, "d");
    let now = loaded(&server);
    assert!(now.len() == 2 && now.contains(&"d".to_string()), "{now:?}");
    let held = u(&gpus(&server)["devices"][0]["berth_bytes"]);
    assert!(held <= 48 * GIB, "berth holds {held} on GPU 0");
}

/// A model that grows past the budget once loaded (a leak, a cache, a
/// server warming up): its idle neighbour on that GPU is evicted, without
/// any load asking. An HTTP server's device memory is measured the same
/// way (vLLM preallocates at start, from an engine process of its own).
#[test]
fn a_model_growing_past_the_vram_budget_evicts_its_idle_neighbours() {
    let fake = FakeGpu::new();
    let config = format!(
        "gpu_memory_budget = \"48GiB\"\n{}\
         [[model]]\nname = \"grows\"\nbackend = \"gpu-hog\"\ngpus = [0]\n\
         options = {{ alloc_mib = 10240, leak_mib_per_request = 20480 }}\n\n\
         [workers.srv]\ncommand = [\"{}\", \"{}\", \"--port\", \"{{port}}\", \"--mode\", \"fork-child\", \"--child-mib\", \"8\"]\n\
         http = {{ health = \"/health\", stop_grace = \"2s\" }}\n\n\
         [[model]]\nname = \"srv\"\nworker = \"srv\"\ngpus = [1]\n{}",
        hog("idle", 20480, "[0]"),
        berth_tests::python::test_python().display(),
        berth_tests::python::repo_root()
            .join("tests/python/fake_upstream.py")
            .display(),
        hog("idle1", 20480, "[1]"),
    );
    let server = fake.serve(&config);
    load(&server, "idle");
    load(&server, "grows");
    let (status, body) = server.post("/api/models/grows/infer", json!({}));
    assert_eq!(status, 200, "{body}");
    // 20.5 + 30.5 GiB: past 48.
    assert!(
        wait_for(Duration::from_secs(10), || loaded(&server) == ["grows"]),
        "{:?}",
        loaded(&server)
    );
    let evicted = server.events_of("evicted");
    assert_eq!(evicted[0]["model"], "idle", "{evicted:?}");
    assert_eq!(evicted[0]["for_model"], Value::Null, "{evicted:?}");

    // The server's engine process takes 40 GiB once it is up.
    load(&server, "idle1");
    let report = load(&server, "srv");
    let engine = children_of(u(&report["pid"]) as u32)[0].0;
    fake.hold(engine, 1, 40 * GIB);
    assert!(
        wait_for(Duration::from_secs(10), || {
            !loaded(&server).contains(&"idle1".to_string())
        }),
        "{:?}",
        loaded(&server)
    );
    assert!(loaded(&server).contains(&"srv".to_string()));
}

/// A framework out of device memory at load, in its own words (JAX's
/// `RESOURCE_EXHAUSTED`, CUDA's), is `gpu_out_of_memory`, naming the
/// model's share or its card's free memory and what to try.
#[test]
fn out_of_gpu_memory_at_load_is_named_with_what_the_model_had() {
    let fake = FakeGpu::new();
    let jax = "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while \
               trying to allocate 384.00MiB.";
    let config = format!(
        "[[model]]\nname = \"jax\"\nbackend = \"fault\"\ngpus = [0]\nvram = \"1GiB\"\n\
         options = {{ fail_load_with = \"{jax}\" }}\n\n{}",
        hog("too-big", 100 * 1024, "[1]")
    );
    let server = fake.serve(&config);
    let (status, body) = server.post("/api/models/jax/load", json!({}));
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "gpu_out_of_memory", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("model `jax`: out of GPU memory while loading")
            && message.contains("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
            && message.contains("its share is 1.0 GiB on each of its GPUs (`vram`)"),
        "{message}"
    );

    let (status, body) = server.post("/api/models/too-big/load", json!({}));
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "gpu_out_of_memory", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("CUDA out of memory allocating 102400 MiB")
            && message.contains("GPU 1 has 79.7 GiB free")
            && message.contains("declare the model's `vram`"),
        "{message}"
    );
    assert!(server.ps().is_empty());
}

/// A worker built with CUDA (it links the driver's libcuda.so.1) declared
/// on a machine without the NVIDIA driver: `berth serve` refuses to start,
/// naming the missing library and what it means, rather than have every
/// load of its models fail. The stand-in is a program linked against a
/// libcuda.so.1 that is then taken away, as a built `berth-worker-cuda`
/// finds it on a CPU machine.
#[test]
fn a_cuda_worker_without_the_driver_says_so() {
    let dir = std::env::temp_dir().join(format!("berth-no-driver-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cc = |args: &[&str]| {
        let out = std::process::Command::new("cc")
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    std::fs::write(dir.join("cuda.c"), "int cuInit(unsigned f) { return 0; }\n").unwrap();
    std::fs::write(
        dir.join("worker.c"),
        "int cuInit(unsigned); int main(void) { return cuInit(0); }\n",
    )
    .unwrap();
    cc(&[
        "-shared",
        "-fPIC",
        "-Wl,-soname,libcuda.so.1",
        "-o",
        "libcuda.so",
        "cuda.c",
    ]);
    cc(&["-o", "berth-worker-cuda", "worker.c", "-L.", "-lcuda"]);
    std::fs::remove_file(dir.join("libcuda.so")).unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "[workers.cuda]\nbinary = \"{}\"\n\n[[model]]\nname = \"minilm-gpu\"\n\
             worker = \"cuda\"\nbackend = \"embed\"\n",
            dir.join("berth-worker-cuda").display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(berth_bin())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{}", free_port()),
            "--config",
        ])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("berth-worker-cuda")
            && stderr.contains("`libcuda.so.1` it needs is not found")
            && stderr.contains("starts only where the NVIDIA driver is installed"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
