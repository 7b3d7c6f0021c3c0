//! The GPU paths end to end on a machine without a GPU: a real `berth
//! serve` and real `berth-worker`s, with the NVIDIA driver's two libraries
//! (NVML and the CUDA driver API) replaced by `tests/fake-gpu/fake_gpu.c`.
//! The fake keeps each process's device memory in files and drops a
//! process's share the moment it exits, as the driver does.
//!
//! This proves berth's side: placement by NVML index reaching the right
//! device through `CUDA_VISIBLE_DEVICES`, VRAM per worker in the reports,
//! `ps`, `/api/gpus` and `/metrics`, the per-GPU budget's evictions, the
//! unload proof waiting for the pid to leave NVML's list, and out-of-memory
//! errors that say so. It cannot prove the real driver's numbers; `gpu.rs`
//! and `benches/gpu.rs` do that where a GPU exists.

use std::process::Command;

use berth_tests::fake_gpu::*;
use berth_tests::*;
use serde_json::{Value, json};

#[test]
fn a_placed_worker_allocates_on_its_gpu_and_the_unload_proves_it_came_back() {
    let fake = FakeGpu::new();
    let server = fake.serve(&hog("vram", 4096, "[1]"));
    let report = load(&server, "vram");
    assert_eq!(report["gpus"], json!([1]), "{report}");
    let pid = u(&report["pid"]) as u32;
    // 4 GiB and the context, against the worker's pid.
    assert_eq!(u(&report["vram_bytes"]), 4 * GIB + CONTEXT, "{report}");

    // NVML's GPU 1 is the one CUDA allocated on (named by UUID), not 0.
    let status = gpus(&server);
    let devices = status["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2, "{status}");
    assert_eq!(devices[0]["processes"], json!([]), "{status}");
    assert_eq!(
        devices[1]["processes"],
        json!([{ "pid": pid, "bytes": 4 * GIB + CONTEXT, "model": "vram" }]),
        "{status}"
    );
    assert_eq!(u(&devices[1]["berth_bytes"]), 4 * GIB + CONTEXT);
    assert_eq!(u(&devices[1]["used_bytes"]), BASE_USED + 4 * GIB + CONTEXT);

    let ps = server.ps();
    assert_eq!(ps[0]["vram_bytes"], json!(4 * GIB + CONTEXT), "{ps:?}");
    assert_eq!(ps[0]["gpus"], json!([1]), "{ps:?}");
    let (_, metrics) = server.get("/metrics");
    let metrics = metrics.as_str().unwrap().to_string();
    assert!(
        metrics.contains(&format!(
            "berth_worker_vram_bytes{{model=\"vram\",pid=\"{pid}\"}} {}",
            4 * GIB + CONTEXT
        )),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "berth_gpu_memory_berth_bytes{{gpu=\"1\",name=\"Fake-H100-80GB\"}} {}",
            4 * GIB + CONTEXT
        )),
        "{metrics}"
    );

    // The CLI shows the same.
    let out = Command::new(berth_bin())
        .args(["gpus", "--url", &server.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    let vram = berth::mib(4 * GIB + CONTEXT);
    assert!(
        text.lines()
            .any(|l| l.starts_with("1 ") && l.contains(&format!("{pid} vram ({vram})"))),
        "{text}"
    );
    let out = Command::new(berth_bin())
        .args(["ps", "--url", &server.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("VRAM") && text.contains(&vram), "{text}");

    let report = unload(&server, "vram");
    assert_eq!(u(&report["vram_at_stop_bytes"]), 4 * GIB + CONTEXT);
    let back = u(&report["gpu_reclaimed_bytes"]);
    assert!(back as f64 >= 0.95 * (4 * GIB) as f64, "{report}");
    assert!(report["gpu_reclaim_ms"].as_f64().is_some(), "{report}");
    assert_eq!(report["gpu_pid_gone"], true, "{report}");
    assert_eq!(report["leftover_processes"], 0);
    let status = gpus(&server);
    assert_eq!(status["devices"][1]["processes"], json!([]), "{status}");
    assert_eq!(u(&status["devices"][1]["used_bytes"]), BASE_USED);
    let (_, metrics) = server.get("/metrics");
    assert!(
        metrics.as_str().unwrap().contains(&format!(
            "berth_gpu_reclaimed_bytes_total{{model=\"vram\"}} {back}"
        )),
        "{metrics}"
    );
}

#[test]
fn auto_placement_avoids_a_busy_gpu_and_the_budget_evicts_idle_models() {
    let fake = FakeGpu::new();
    // Someone else's process (this test's, alive) holds 70 GiB of GPU 0.
    fake.hold(std::process::id(), 0, 70 * GIB);
    let config = format!(
        "gpu_memory_budget = \"20GiB\"\n{}{}{}{}",
        hog("auto", 1024, "\"auto\""),
        hog("a", 8192, "[1]"),
        hog("b", 8192, "[1]"),
        hog("c", 8192, "[1]"),
    );
    let server = fake.serve(&config);
    let report = load(&server, "auto");
    assert_eq!(
        report["gpus"],
        json!([1]),
        "GPU 1 has the most free: {report}"
    );
    let status = gpus(&server);
    assert_eq!(
        status["devices"][0]["processes"][0]["model"],
        Value::Null,
        "not berth's: {status}"
    );
    unload(&server, "auto");

    // c's footprint is measured by its first load; a and b then fill the
    // budget (2 × 8.5 GiB of 20), and c's next load evicts the least
    // recently used of them.
    load(&server, "c");
    unload(&server, "c");
    load(&server, "a");
    load(&server, "b");
    let report = load(&server, "c");
    assert_eq!(report["gpus"], json!([1]));
    let loaded: Vec<String> = server
        .ps()
        .iter()
        .map(|m| m["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(loaded, ["b", "c"], "a was idle the longest");
    let status = gpus(&server);
    assert_eq!(
        u(&status["devices"][1]["berth_bytes"]),
        2 * (8 * GIB + CONTEXT)
    );

    // A model whose size is not known yet is placed on what is free (the
    // budget cannot see an allocation before it happens); measured at the
    // end of its load past the budget on its own, it is stopped, and
    // nothing is evicted for nothing. Its next load is refused up front,
    // naming the GPU and the budget.
    let (status, body) = server.put(
        "/api/models/huge",
        json!({ "backend": "gpu-hog", "gpus": [1], "options": { "alloc_mib": 30720 } }),
    );
    assert_eq!(status, 201, "{body}");
    let (status, body) = server.post("/api/models/huge/load", json!({}));
    assert_eq!(status, 503, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("measured once loaded"),
        "{body}"
    );
    assert_eq!(server.ps().len(), 2, "b and c are still loaded");
    let (status, body) = server.post("/api/models/huge/load", json!({}));
    assert_eq!(status, 503, "{body}");
    assert_eq!(
        body["error"]["code"], "gpu_memory_budget_exceeded",
        "{body}"
    );
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`huge`") && message.contains("GPU 1") && message.contains("20.0 GiB"),
        "{message}"
    );
    assert_eq!(server.ps().len(), 2, "b and c are still loaded");
}

#[test]
fn running_out_of_device_memory_says_so_and_the_supervisor_carries_on() {
    let fake = FakeGpu::new();
    let config = format!(
        "{}[[model]]\nname = \"leak\"\nbackend = \"gpu-hog\"\ngpus = [0]\n\
         options = {{ alloc_mib = 40960, leak_mib_per_request = 20480 }}\n",
        hog("too-big", 100 * 1024, "[0]")
    );
    let server = fake.serve(&config);
    let (status, body) = server.post("/api/models/too-big/load", json!({}));
    assert!(status >= 500, "{status} {body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("model `too-big`") && message.contains("CUDA out of memory"),
        "{body}"
    );
    // Nothing of it is left on the device.
    let status_now = gpus(&server);
    assert_eq!(
        u(&status_now["devices"][0]["used_bytes"]),
        BASE_USED,
        "{status_now}"
    );

    // A worker that leaks until the device is full: the request that does
    // not fit fails with the reason, and the worker keeps serving.
    load(&server, "leak");
    let (status, _) = server.post("/api/models/leak/infer", json!({}));
    assert_eq!(status, 200);
    let (status, body) = server.post("/api/models/leak/infer", json!({}));
    assert!(status >= 500, "{status} {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("CUDA out of memory"),
        "{body}"
    );
    let ps = server.ps();
    assert_eq!(ps[0]["state"], "ready", "{ps:?}");
    let report = unload(&server, "leak");
    assert!(u(&report["gpu_reclaimed_bytes"]) >= 60 * GIB, "{report}");

    // A worker that dies of it (a framework's uncaught out-of-memory error):
    // the request in flight fails at once naming the cause, the device has
    // its memory back, and the model is restarted.
    let (status, body) = server.put(
        "/api/models/dies",
        json!({ "backend": "gpu-hog", "gpus": [0],
                "options": { "alloc_mib": 40960, "leak_mib_per_request": 40960, "on_oom": "abort" } }),
    );
    assert_eq!(status, 201, "{body}");
    let first = u(&load(&server, "dies")["pid"]);
    let (status, body) = server.post("/api/models/dies/infer", json!({}));
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "gpu_out_of_memory", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("model `dies`")
            && message.contains("killed by a GPU out-of-memory error")
            && message.contains("CUDA out of memory allocating 40960 MiB"),
        "{message}"
    );
    let restarted = wait_for(std::time::Duration::from_secs(20), || {
        server
            .ps()
            .iter()
            .any(|m| m["name"] == "dies" && m["state"] == "ready" && m["pid"] != json!(first))
    });
    assert!(restarted, "{:?}", server.ps());
    let dies = server
        .ps()
        .into_iter()
        .find(|m| m["name"] == "dies")
        .unwrap();
    assert!(
        dies["last_exit"].to_string().contains("out-of-memory"),
        "{dies}"
    );
    // Only the new worker's 40 GiB and context are on the device.
    assert_eq!(
        u(&gpus(&server)["devices"][0]["used_bytes"]),
        BASE_USED + 40 * GIB + CONTEXT
    );
}

#[test]
fn fifty_load_unload_cycles_and_a_swap_leave_the_device_where_it_started() {
    let fake = FakeGpu::new();
    let server = fake.serve(&hog("cycled", 512, "[0]"));
    let before = u(&gpus(&server)["devices"][0]["used_bytes"]);
    for _ in 0..50 {
        load(&server, "cycled");
        let (status, body) = server.post("/api/models/cycled/infer", json!({}));
        assert_eq!(status, 200, "{body}");
        let report = unload(&server, "cycled");
        assert_eq!(u(&report["gpu_reclaimed_bytes"]), 512 * MIB + CONTEXT);
    }
    assert_eq!(u(&gpus(&server)["devices"][0]["used_bytes"]), before);

    // A swap: the new worker is placed and counted while the old one still
    // holds its memory, and the old one's unload proves its share came back.
    let old = load(&server, "cycled");
    let (status, swap) = server.post(
        "/api/models/cycled/swap",
        json!({ "backend": "gpu-hog", "gpus": [0], "options": { "alloc_mib": 1024 } }),
    );
    assert_eq!(status, 200, "{swap}");
    assert_eq!(swap["old_pid"], old["pid"], "{swap}");
    assert_eq!(
        u(&swap["unload"]["gpu_reclaimed_bytes"]),
        512 * MIB + CONTEXT,
        "{swap}"
    );
    assert_eq!(u(&swap["load"]["vram_bytes"]), GIB + CONTEXT, "{swap}");
    unload(&server, "cycled");
    assert_eq!(u(&gpus(&server)["devices"][0]["used_bytes"]), before);
}

/// GPU placement is wire-agnostic: a Python worker placed on GPU 1 gets
/// `CUDA_VISIBLE_DEVICES` and `BERTH_GPUS`, its VRAM (held here through the
/// fake driver on its pid, as PyTorch's allocator would) shows in `ps`, and
/// the unload proves it came back.
#[test]
fn a_python_worker_is_placed_and_its_vram_proven_back_like_any_other() {
    let config = format!(
        "[[model]]\nname = \"pyvram\"\nbackend = \"hog\"\ngpus = [1]\ncommand = {:?}\n",
        berth_tests::python::python_worker_command()
    );
    python_worker_placed(&config, "cold");
}

/// As above, for a worker forked from its kind's preloaded interpreter:
/// its placement is set in the fork, before its backend loads, and the
/// preloader itself is placed nowhere.
#[test]
fn a_forked_python_worker_is_placed_and_its_vram_proven_back_like_any_other() {
    let config = format!(
        "[workers.py]\ncommand = {:?}\npreload = [\"berth_worker.backends\"]\n\n\
         [[model]]\nname = \"pyvram\"\nbackend = \"hog\"\ngpus = [1]\nworker = \"py\"\n",
        berth_tests::python::python_worker_command()
    );
    python_worker_placed(&config, "forked");
}

fn python_worker_placed(config: &str, start: &str) {
    let fake = FakeGpu::new();
    let server = fake.serve(config);
    let report = load(&server, "pyvram");
    assert_eq!(report["gpus"], json!([1]), "{report}");
    assert_eq!(report["start"]["kind"], start, "{report}");
    let pid = u(&report["pid"]) as u32;
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let environ = String::from_utf8_lossy(&environ);
    assert!(
        environ.split('\0').any(|kv| kv == "BERTH_GPUS=1"),
        "{environ}"
    );
    assert!(
        environ
            .split('\0')
            .any(|kv| kv.starts_with("CUDA_VISIBLE_DEVICES=")),
        "{environ}"
    );
    fake.hold(pid, 1, 2 * GIB);
    assert!(
        wait_for(
            std::time::Duration::from_secs(5),
            || server.ps()[0]["vram_bytes"] == json!(2 * GIB)
        ),
        "{:?}",
        server.ps()
    );
    let report = unload(&server, "pyvram");
    assert_eq!(u(&report["vram_at_stop_bytes"]), 2 * GIB, "{report}");
    assert_eq!(report["gpu_pid_gone"], true, "{report}");
    assert_eq!(report["leftover_processes"], 0);
    let status = gpus(&server);
    assert_eq!(status["devices"][1]["processes"], json!([]), "{status}");
}
