//! GPU paths. Without an NVIDIA driver (CI) they must fail clearly and
//! panic nothing; where a GPU exists the same tests check the VRAM proof.

use std::time::Duration;

use berth::gpu::{Inventory, inventory};
use berth::{Body, ModelSpec};
use berth_tests::*;

const GIB: u64 = 1 << 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_hog_holds_vram_and_the_unload_gives_it_back() {
    // Both read the device's used memory: one at a time.
    let _guard = memory_lock().await;
    let sup = supervisor();
    let spec = ModelSpec::new("vram", "gpu-hog").option("alloc_mib", 4096);
    match inventory() {
        Inventory::NoGpu(reason) => {
            let err = sup.load(spec).await.unwrap_err();
            assert_eq!(err.kind(), "load_failed", "{err}");
            assert!(
                err.to_string().contains("no NVIDIA driver found"),
                "{err} ({reason})"
            );
            // The supervisor carries on.
            sup.load(ModelSpec::new("e", "echo")).await.unwrap();
            assert!(sup.stats().iter().all(|s| s.vram_bytes.is_none()));
        }
        Inventory::Devices(_) => {
            let load = sup.load(spec).await.unwrap();
            let vram = load.vram_bytes.expect("NVML sees the worker's memory");
            assert!(vram >= 4 * GIB, "≈ 4 GiB against its pid: {vram}");
            let unload = sup.unload("vram").await.unwrap();
            let back = unload.gpu_reclaimed_bytes.expect("measured on the device");
            assert!(back as f64 >= 0.95 * (4 * GIB) as f64, "{unload:?}");
            assert!(!alive(load.pid));
            if let Inventory::Devices(devices) = inventory() {
                assert_eq!(
                    berth::gpu::process_vram(&devices, &[load.pid]),
                    None,
                    "pid gone from NVML"
                );
            }
        }
    }
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_for_gpus_without_a_driver_is_a_clear_error() {
    let sup = supervisor();
    let mut spec = ModelSpec::new("placed", "echo");
    spec.gpus = Some(serde_json::from_str("[0]").unwrap());
    match inventory() {
        Inventory::NoGpu(_) => {
            let err = sup.load(spec).await.unwrap_err();
            assert_eq!(err.kind(), "invalid_spec", "{err}");
            assert!(err.to_string().contains("no NVIDIA driver found"), "{err}");
            let mut auto = ModelSpec::new("auto", "echo");
            auto.gpus = Some(serde_json::from_str("\"auto\"").unwrap());
            assert!(
                sup.load(auto)
                    .await
                    .unwrap_err()
                    .to_string()
                    .contains("no NVIDIA driver found")
            );
        }
        Inventory::Devices(_) => {
            let load = sup.load(spec).await.unwrap();
            assert_eq!(load.gpus, Some(vec![0]));
        }
    }
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_unload_cycles_leave_the_device_where_it_started() {
    // Both read the device's used memory: one at a time.
    let _guard = memory_lock().await;
    let sup = supervisor();
    let Inventory::Devices(before) = inventory() else {
        // Without a GPU the same cycles run on the CPU hog: nothing may stay.
        for _ in 0..10 {
            let err = sup
                .load(ModelSpec::new("g", "gpu-hog").option("alloc_mib", 64))
                .await
                .unwrap_err();
            assert!(err.to_string().contains("no NVIDIA driver found"), "{err}");
        }
        assert!(sup.stats().is_empty());
        return;
    };
    for _ in 0..50 {
        sup.load(ModelSpec::new("g", "gpu-hog").option("alloc_mib", 512))
            .await
            .unwrap();
        sup.request("g", Body::json("{}")).await.unwrap();
        sup.unload("g").await.unwrap();
    }
    let settled = eventually(Duration::from_secs(5), || match inventory() {
        Inventory::Devices(after) => before
            .iter()
            .zip(&after)
            .all(|(b, a)| a.used_bytes <= b.used_bytes + (64 << 20)),
        Inventory::NoGpu(_) => false,
    })
    .await;
    assert!(settled, "the device's used memory is back where it started");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_backends_choose_their_device_and_say_how_to_get_cuda() {
    let sup = supervisor();
    let minilm = default_model("minilm");
    // On the CPU by default, and the load report says where it runs.
    let load = sup
        .load(ModelSpec::new("on-cpu", "embed").model(&minilm))
        .await
        .unwrap();
    assert_eq!(load.details["device"], "cpu", "{:?}", load.details);
    sup.unload("on-cpu").await.unwrap();

    let err = sup
        .load(
            ModelSpec::new("odd", "embed")
                .model(&minilm)
                .option("device", "tpu"),
        )
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "load_failed", "{err}");
    assert!(
        err.to_string().contains("model `odd`")
            && err.to_string().contains("`cpu`, `cuda` or `cuda:N`"),
        "{err}"
    );

    for (backend, model) in [("embed", minilm), ("generate", default_model("smollm2"))] {
        let spec = ModelSpec::new("on-cuda", backend)
            .model(&model)
            .option("device", "cuda");
        match sup.load(spec).await {
            // A worker built with `--features cuda` on a GPU machine.
            Ok(load) => {
                assert_eq!(load.details["device"], "cuda:0", "{:?}", load.details);
                sup.unload("on-cuda").await.unwrap();
            }
            Err(err) => {
                let text = err.to_string();
                assert_eq!(err.kind(), "load_failed", "{err}");
                assert!(text.contains("model `on-cuda`"), "{err}");
                assert!(
                    (text.contains("built without CUDA") && text.contains("build_worker.py"))
                        || (matches!(inventory(), Inventory::NoGpu(_))
                            && text.contains("cannot open CUDA device 0")),
                    "{backend}: {err}"
                );
            }
        }
    }
    // None of it hurt the supervisor.
    sup.load(ModelSpec::new("e", "echo")).await.unwrap();
    sup.shutdown().await;
}

#[test]
fn the_gpu_status_says_why_there_is_none_or_lists_the_devices() {
    let server = Server::start("");
    let (status, body) = server.get("/api/gpus");
    assert_eq!(status, 200, "{body}");
    let out = std::process::Command::new(berth_bin())
        .args(["gpus", "--url", &server.url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    match inventory() {
        Inventory::NoGpu(_) => {
            assert!(
                body["unavailable"]
                    .as_str()
                    .is_some_and(|r| r.contains("no NVIDIA driver found")),
                "{body}"
            );
            assert_eq!(body["devices"], serde_json::json!([]));
            assert!(text.starts_with("no GPU: no NVIDIA driver found"), "{text}");
        }
        Inventory::Devices(devices) => {
            assert_eq!(body["devices"].as_array().unwrap().len(), devices.len());
            assert!(text.starts_with("GPU "), "{text}");
        }
    }
}
