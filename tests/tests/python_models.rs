//! The examples in `python/examples/` with the real frameworks: PyTorch
//! embeddings equal to candle's, the JAX/Equinox initialisation that spikes
//! past its cap contained while the careful one loads under it, a leaking
//! training step recycled by `max_rss`, and `python/examples/serve.toml`
//! served as shipped and spoken to with the official OpenAI client.
//!
//! The first run installs the pinned frameworks into a virtual environment
//! under `target/` (PyTorch with its CUDA libraries is ~5 GB); later runs
//! reuse it.

use std::time::Duration;

use berth::{Body, Error, LoadReport, Supervisor};
use berth_tests::python::{example_spec, examples_dir, examples_python, repo_root};
use berth_tests::{Server, cosine, default_model, local_backend, test_config, wait_for};

const MIB: u64 = 1 << 20;

/// Texts of this test's own: short, long, punctuated, non-ASCII, repeated.
fn texts() -> Vec<String> {
    [
        "A harbour master assigns each ship its own berth.",
        "Unloading a model should give every byte back to the machine.",
        "Kernels reclaim memory when processes exit; allocators inside a process often do not.",
        "短い文",
        "Ünïcödé wörds and emoji 🚢 in one sentence.",
        "ok",
        "The same sentence twice.",
        "The same sentence twice.",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// The candle `embed` backend's vectors for `texts`, computed in this process.
fn candle_vectors(texts: &[String]) -> Vec<Vec<f32>> {
    let minilm = default_model("minilm");
    let mut backend = local_backend("embed", Some(&minilm), &[]);
    let body = serde_json::json!({ "input": texts }).to_string();
    let ctx = berth_worker::RequestContext::standalone();
    let out = backend.handle(Body::json(body), &ctx).unwrap();
    let v: serde_json::Value = serde_json::from_str(&out.json).unwrap();
    serde_json::from_value(v["embeddings"].clone()).unwrap()
}

fn f32_vectors(body: &Body) -> Vec<Vec<f32>> {
    let v: serde_json::Value = serde_json::from_str(&body.json).unwrap();
    let dim = v["dim"].as_u64().unwrap() as usize;
    let count = v["count"].as_u64().unwrap() as usize;
    let bytes = body.bulk_bytes();
    assert_eq!(bytes.len(), count * dim * 4, "{}", body.json);
    bytes
        .chunks_exact(dim * 4)
        .map(|row| {
            row.chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect()
        })
        .collect()
}

fn assert_same_vectors(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) {
    assert_eq!(got.len(), want.len(), "{what}: one vector per text");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), 384, "{what}: vector {i}");
        let c = cosine(g, w);
        assert!(c >= 0.9999, "{what}: text {i}: cosine {c} with candle's");
    }
}

async fn load_torch(sup: &Supervisor, name: &str, load_mode: &str) -> LoadReport {
    let mut spec = example_spec(name, "torch_embed")
        .model(default_model("minilm"))
        .option("load_mode", load_mode);
    spec.load_timeout = Some(Duration::from_secs(120));
    sup.load(spec).await.unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn torch_embeddings_equal_candle_ones_in_both_load_modes() {
    let texts = texts();
    let want = candle_vectors(&texts);
    let sup = Supervisor::new(test_config());
    let mmap = load_torch(&sup, "torch-mmap", "mmap").await;
    let read = load_torch(&sup, "torch-read", "read").await;
    assert_eq!(mmap.details["load_mode"], "mmap", "{mmap:?}");
    assert_eq!(read.details["load_mode"], "read", "{read:?}");
    assert_eq!(mmap.details["dim"], 384);
    // Read into the process, the 87 MiB of weights are anonymous memory;
    // mapped, they are file-backed pages brought in as they are used.
    assert!(
        read.anon_bytes >= mmap.anon_bytes + 60 * MIB,
        "read: anonymous {} MiB; mmap: {} MiB",
        read.anon_bytes / MIB,
        mmap.anon_bytes / MIB
    );
    assert!(mmap.file_bytes > 0 && mmap.peak_rss_bytes >= mmap.rss_bytes);

    for model in ["torch-mmap", "torch-read"] {
        // As JSON numbers, all texts at once.
        let body = serde_json::json!({ "input": texts }).to_string();
        let out = sup.request(model, Body::json(body)).await.unwrap();
        let v: serde_json::Value = serde_json::from_str(&out.json).unwrap();
        let got: Vec<Vec<f32>> = serde_json::from_value(v["embeddings"].clone()).unwrap();
        assert_same_vectors(model, &got, &want);
        assert!(v["tokens"].as_u64().unwrap() > texts.len() as u64);
        // As bulk f32, one text per request: each gets its own vector.
        for (i, text) in texts.iter().enumerate() {
            let body = serde_json::json!({ "input": text, "encoding": "f32" }).to_string();
            let out = sup.request(model, Body::json(body)).await.unwrap();
            assert_same_vectors(model, &f32_vectors(&out), &want[i..=i]);
        }
    }
    // Sent at once, requests run in batches inside the Python worker; each
    // gets its own vector, equal to candle's.
    let sup = std::sync::Arc::new(sup);
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let sup = std::sync::Arc::clone(&sup);
            let text = texts[i % texts.len()].clone();
            tokio::spawn(async move {
                let body = serde_json::json!({ "input": text, "encoding": "f32" }).to_string();
                sup.request("torch-read", Body::json(body)).await
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let out = task.await.unwrap().unwrap();
        let j = i % texts.len();
        assert_same_vectors("batched", &f32_vectors(&out), &want[j..=j]);
    }
    let status = sup
        .stats()
        .into_iter()
        .find(|m| m.name == "torch-read")
        .unwrap();
    assert!(
        status.batching.mean_batch_size.unwrap() > 1.0,
        "{:?}",
        status.batching
    );

    // Bad input fails the request alone, naming the model.
    let body = serde_json::json!({ "input": [1, 2] }).to_string();
    let err = sup
        .request("torch-mmap", Body::json(body))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("torch-mmap") && err.to_string().contains("input"),
        "{err}"
    );
    let body = serde_json::json!({ "input": "still fine" }).to_string();
    sup.request("torch-mmap", Body::json(body)).await.unwrap();

    // The worker held PyTorch's heap; all of it goes with the process.
    // (The proof against the system's AnonPages is conservative: the other
    // tests of this file allocate gigabytes meanwhile, so it can read 0
    // here. tests/tests/conformance.rs measures it with nothing else
    // running, for the Python worker too.)
    for model in ["torch-mmap", "torch-read"] {
        let report = sup.unload(model).await.unwrap();
        assert_eq!(report.leftover_processes, 0, "{report:?}");
        assert!(report.anon_at_stop_bytes > 100 * MIB, "{report:?}");
        assert!(
            report.reclaimed_bytes <= report.anon_at_stop_bytes,
            "{report:?}"
        );
    }
}

/// Limit for the stacked-blocks model: fits its block-by-block
/// initialisation (peak ~1.2 GiB), not the float32 vmap one (~2.2 GiB).
const EQX_LIMIT: u64 = 1600 * MIB;

#[tokio::test(flavor = "multi_thread")]
async fn eqx_vmap_init_is_contained_by_its_cap_and_blocks_init_loads_under_it() {
    let sup = Supervisor::new(test_config());
    // A neighbour that must not notice.
    let mut neighbour = example_spec("neighbour", "torch_embed").model(default_model("minilm"));
    neighbour.load_timeout = Some(Duration::from_secs(120));
    let neighbour_pid = sup.load(neighbour).await.unwrap().pid;

    let spec = |name: &str, init: &str| {
        let mut spec = example_spec(name, "eqx_stack").option("init", init);
        spec.memory_limit = Some(EQX_LIMIT);
        spec.load_timeout = Some(Duration::from_secs(300));
        spec
    };
    let err = sup.load(spec("eqx-vmap", "vmap")).await.unwrap_err();
    match &err {
        Error::MemoryLimitExceeded {
            model,
            limit,
            peak,
            during,
            ..
        } => {
            assert_eq!(model, "eqx-vmap");
            assert_eq!(*limit, EQX_LIMIT);
            assert!(*peak >= EQX_LIMIT * 9 / 10, "{err}");
            assert_eq!(*during, "load", "{err}");
        }
        other => panic!("expected MemoryLimitExceeded, got {other:?}"),
    }
    assert!(err.to_string().contains("memory_limit"), "{err}");
    assert!(berth_tests::workers_of_model("eqx-vmap").is_empty());

    let report = sup.load(spec("eqx-blocks", "blocks")).await.unwrap();
    assert!(
        report.peak_rss_bytes < EQX_LIMIT,
        "blocks init peaked at {} MiB",
        report.peak_rss_bytes / MIB
    );
    assert_eq!(report.details["parameters"], 201_449_472);
    assert_eq!(report.details["dtype"], "float16");
    let out = sup
        .request("eqx-blocks", Body::json(r#"{"rows": 4, "seed": 1}"#))
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_str(&out.json).unwrap();
    assert_eq!(v["rows"], 4);
    assert!(v["std"].as_f64().unwrap() > 0.0, "{v}");
    // Rows as bulk float32 in, rows out.
    let rows: Vec<u8> = (0..2 * 1024)
        .flat_map(|i| ((i % 7) as f32 * 0.1).to_le_bytes())
        .collect();
    let out = sup
        .request("eqx-blocks", Body::with_bulk("{}", rows))
        .await
        .unwrap();
    assert_eq!(out.bulk_bytes().len(), 2 * 1024 * 4, "{}", out.json);

    // The neighbour kept its worker and serves.
    assert_eq!(
        berth_tests::ready_pid(&sup, "neighbour"),
        Some(neighbour_pid)
    );
    sup.request("neighbour", Body::json(r#"{"input": "still here"}"#))
        .await
        .unwrap();
    for model in ["eqx-blocks", "neighbour"] {
        let report = sup.unload(model).await.unwrap();
        assert_eq!(report.leftover_processes, 0, "{report:?}");
    }
}

fn ps_model(server: &Server, name: &str) -> serde_json::Value {
    server
        .ps()
        .into_iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("`{name}` is not in ps"))
}

fn metric(server: &Server, line_start: &str) -> f64 {
    let (status, text) = server.get("/metrics");
    assert_eq!(status, 200);
    text.as_str()
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// `berth serve --config python/examples/serve.toml`, from the repo's root,
/// with the examples' environment first on the path.
fn shipped_server() -> Server {
    let python = examples_python();
    let bin = python.parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let models = default_model("minilm").parent().unwrap().to_path_buf();
    let models = models.display().to_string();
    Server::start_file(
        &examples_dir().join("serve.toml"),
        Some(&repo_root()),
        &[],
        &[("PATH", &path), ("BERTH_MODELS", &models)],
    )
}

#[test]
fn shipped_config_serves_torch_embeddings_to_the_openai_client() {
    let texts = texts();
    let want = candle_vectors(&texts);
    let server = shipped_server();
    // The official OpenAI client, from the examples' environment.
    let script = r#"
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
texts = json.loads(sys.argv[2])
out = client.embeddings.create(model="minilm-torch", input=texts)
b64 = client.embeddings.create(model="minilm-torch", input=texts[0], encoding_format="base64")
print(json.dumps({"vectors": [d.embedding for d in out.data],
                  "b64": b64.data[0].embedding, "tokens": out.usage.prompt_tokens}))
"#;
    let out = std::process::Command::new(examples_python())
        .args(["-c", script, &server.url])
        .arg(serde_json::to_string(&texts).unwrap())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let got: Vec<Vec<f32>> = serde_json::from_value(v["vectors"].clone()).unwrap();
    assert_same_vectors("openai client", &got, &want);
    // The client decodes base64 itself unless asked not to; either way
    // the first vector is the same.
    let b64: Vec<f32> = serde_json::from_value(v["b64"].clone()).unwrap_or_default();
    if !b64.is_empty() {
        assert!(cosine(&b64, &want[0]) >= 0.9999);
    }
    assert!(v["tokens"].as_u64().unwrap() > 0);

    let m = ps_model(&server, "minilm-torch");
    assert_eq!(m["backend"], "torch_embed");
    assert_eq!(m["state"], "ready");
    // The JAX model, by its management endpoint.
    let (status, v) = server.post(
        "/api/models/eqx-stack/infer",
        serde_json::json!({"rows": 2}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["width"], 1024);
}

#[test]
fn leaking_training_step_is_recycled_by_max_rss_and_no_step_fails() {
    let server = shipped_server();
    // 2000 steps keeping ~0.4 MB of graph each: ~800 MB of leak against a
    // worker allowed 900 MiB in all.
    let mut pids = std::collections::BTreeSet::new();
    let mut rss_max = 0u64;
    let mut growth_seen = 0.0f64;
    for i in 0..200 {
        let (status, v) = server.post(
            "/api/models/leaky-train/infer",
            serde_json::json!({"steps": 10}),
        );
        assert_eq!(status, 200, "request {i}: {v}");
        let m = ps_model(&server, "leaky-train");
        if let Some(pid) = m["pid"].as_u64() {
            pids.insert(pid);
        }
        rss_max = rss_max.max(m["rss_bytes"].as_u64().unwrap_or(0));
        growth_seen = growth_seen.max(m["rss_growth_per_request_bytes"].as_f64().unwrap_or(0.0));
    }
    let m = ps_model(&server, "leaky-train");
    let recycles = m["recycles"].as_u64().unwrap();
    assert!(recycles >= 2, "{m}");
    assert!(
        pids.len() >= 2,
        "one worker pid in ps throughout: {pids:?}, {m}"
    );
    // Bounded: never far past max_rss (one request's growth, 10 steps).
    assert!(rss_max < 1000 * MIB, "rss peaked at {} MiB", rss_max / MIB);
    assert!(
        growth_seen > 100_000.0,
        "ps showed no growth trend: {growth_seen}"
    );
    assert_eq!(m["restarts"], 0, "{m}");
    assert!(
        metric(&server, "berth_recycles_total{model=\"leaky-train\"") >= recycles as f64,
        "metrics"
    );
    assert_eq!(
        metric(&server, "berth_request_errors_total{model=\"leaky-train\""),
        0.0
    );
    // The old workers are gone, not parked.
    assert!(wait_for(Duration::from_secs(10), || {
        berth_tests::workers_of_model("leaky-train").len() <= 1
    }));
}
