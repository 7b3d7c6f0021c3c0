//! The `embed` backend with the real all-MiniLM-L6-v2, through workers.

use std::path::Path;

use berth::{Body, ModelSpec, Supervisor};
use berth_tests::*;
use berth_worker::RequestContext;
use serde_json::{Value, json};

const FOX: &str = "The quick brown fox jumps over the lazy dog.";
const FOOD: &str = "A man is eating food.";
const BREAD: &str = "A man is eating a piece of bread.";

fn vectors(body: &Body) -> Vec<Vec<f32>> {
    let v: Value = serde_json::from_str(&body.json).unwrap();
    serde_json::from_value(v["embeddings"].clone()).unwrap()
}

async fn embed(sup: &Supervisor, model: &str, texts: &[&str]) -> Vec<Vec<f32>> {
    vectors(
        &sup.request(model, Body::json(json!({ "input": texts }).to_string()))
            .await
            .unwrap(),
    )
}

async fn load(sup: &Supervisor, name: &str, mode: &str) {
    let spec = ModelSpec::new(name, "embed")
        .model(default_model("minilm"))
        .option("load_mode", mode);
    sup.load(spec).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_are_unit_length_deterministic_and_match_the_reference() {
    let sup = supervisor();
    load(&sup, "mmap", "mmap").await;
    load(&sup, "read", "read").await;
    let a = embed(&sup, "mmap", &[FOX, FOOD, BREAD]).await;
    let again = embed(&sup, "mmap", &[FOX, FOOD, BREAD]).await;
    let read = embed(&sup, "read", &[FOX, FOOD, BREAD]).await;
    assert_eq!(a, again, "deterministic across runs");
    assert_eq!(a, read, "identical across load modes");
    for v in &a {
        assert_eq!(v.len(), 384);
        let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "unit length: {norm}");
    }
    // An independent float64 reference gives these.
    let reference = [0.043934, 0.058934, 0.048178, 0.077548, 0.026744];
    for (x, r) in a[0].iter().zip(reference) {
        assert!((x - r).abs() < 1e-5, "{:?} vs {reference:?}", &a[0][..5]);
    }
    let similar = cosine(&a[1], &a[2]);
    let unrelated = cosine(&a[1], &a[0]);
    assert!(
        (similar - 0.7553).abs() < 1e-3,
        "cos(food, bread) = {similar}"
    );
    assert!(
        similar > unrelated + 0.5,
        "similar {similar} vs unrelated {unrelated}"
    );
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_equals_single_requests_and_the_in_process_backend() {
    let sup = supervisor();
    load(&sup, "m", "mmap").await;
    let texts: Vec<String> = (0..32)
        .map(|i| format!("Sentence number {i} is {} long.", "very ".repeat(i % 7)))
        .collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let batch = embed(&sup, "m", &refs).await;
    assert_eq!(batch.len(), 32);
    for (i, text) in refs.iter().enumerate() {
        let single = embed(&sup, "m", &[text]).await;
        let diff = single[0]
            .iter()
            .zip(&batch[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff < 1e-5, "text {i}: batch and single differ by {diff}");
    }
    sup.shutdown().await;

    // The same backend code, in this process, gives the same vectors.
    let mut local = local_backend("embed", Some(&default_model("minilm")), &[]);
    let body = Body::json(json!({ "input": refs }).to_string());
    let here = vectors(&local.handle(body, &RequestContext::standalone()).unwrap());
    assert_eq!(here, batch, "through a worker == in-process");
}

/// Requests sent at once are batched inside the worker; each still gets
/// its own vectors (equal to those it gets alone), in its own encoding, and
/// one with bad input fails alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_batched_in_the_worker_get_their_own_vectors() {
    let sup = supervisor();
    // No max_concurrency: the worker's batch size (64) lets them in.
    let spec = ModelSpec::new("batched", "embed").model(default_model("minilm"));
    let report = sup.load(spec).await.unwrap();
    assert_eq!(report.max_batch, 64);
    let texts: Vec<String> = (0..48)
        .map(|i| format!("request {i}: {}", "a ship at its berth ".repeat(1 + i % 7)))
        .collect();
    let mut alone = Vec::new();
    for text in &texts {
        alone.push(embed(&sup, "batched", &[text.as_str()]).await.remove(0));
    }
    let mut tasks = Vec::new();
    for (i, text) in texts.iter().enumerate() {
        let sup = sup.clone();
        let body = match i {
            // Bad input in the middle of the crowd.
            17 => json!({ "input": [1, 2, 3] }),
            i if i % 2 == 0 => json!({ "input": [text, FOX], "encoding": "f32" }),
            _ => json!({ "input": text }),
        };
        tasks.push(tokio::spawn(async move {
            sup.request("batched", Body::json(body.to_string())).await
        }));
    }
    let fox = embed(&sup, "batched", &[FOX]).await.remove(0);
    for (i, task) in tasks.into_iter().enumerate() {
        let result = task.await.unwrap();
        if i == 17 {
            let err = result.unwrap_err();
            assert!(err.to_string().contains("input"), "{err}");
            continue;
        }
        let body = result.unwrap_or_else(|e| panic!("request {i}: {e}"));
        let got = if i % 2 == 0 {
            let v: Value = serde_json::from_str(&body.json).unwrap();
            assert_eq!(v["count"], 2, "{v}");
            let floats: Vec<f32> = body
                .bulk_bytes()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let got: Vec<Vec<f32>> = floats.chunks(384).map(<[f32]>::to_vec).collect();
            assert!(cosine(&got[1], &fox) >= 0.9999, "request {i}: FOX");
            got
        } else {
            vectors(&body)
        };
        let c = cosine(&got[0], &alone[i]);
        assert!(c >= 0.9999, "request {i}: cosine {c} with its vector alone");
    }
    // ps and /metrics show that they ran together, and where time went.
    let status = sup
        .stats()
        .into_iter()
        .find(|m| m.name == "batched")
        .unwrap();
    let b = &status.batching;
    assert_eq!(b.requests, 48 + 48 + 1, "{b:?}");
    assert!(
        b.batch_sizes
            .iter()
            .any(|(bound, n)| bound.is_none_or(|x| x > 1) && *n > 0),
        "{b:?}"
    );
    assert!(b.mean_batch_size.unwrap() > 1.0, "{b:?}");
    assert!(
        b.mean_queue_ms.is_some() && b.mean_compute_ms.unwrap() > 0.0,
        "{b:?}"
    );
    let metrics = berth::prometheus_text(&sup);
    for family in [
        "berth_batch_size_bucket{model=\"batched\",le=\"1\"}",
        "berth_request_queue_seconds_count{model=\"batched\"} 97",
        "berth_request_compute_seconds_count{model=\"batched\"} 97",
    ] {
        assert!(
            metrics.contains(family),
            "{family} missing from:\n{metrics}"
        );
    }
    sup.unload("batched").await.unwrap();
}

fn copy_model(to: &Path) {
    let from = default_model("minilm");
    std::fs::create_dir_all(to.join("1_Pooling")).unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "1_Pooling/config.json",
    ] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_model_files_and_inputs_get_clear_errors() {
    let sup = supervisor();
    let tmp = std::env::temp_dir().join(format!("berth-embed-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);

    let missing = tmp.join("nowhere");
    let err = sup
        .load(ModelSpec::new("m", "embed").model(&missing))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );

    let truncated = tmp.join("truncated");
    copy_model(&truncated);
    let weights = truncated.join("model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&weights)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    for mode in ["mmap", "read"] {
        let spec = ModelSpec::new("m", "embed")
            .model(&truncated)
            .option("load_mode", mode);
        let err = sup.load(spec).await.unwrap_err();
        assert_eq!(err.kind(), "load_failed", "{err}");
        assert!(
            err.to_string().contains("model.safetensors"),
            "{mode}: {err}"
        );
    }

    let no_tokenizer = tmp.join("no-tokenizer");
    copy_model(&no_tokenizer);
    std::fs::remove_file(no_tokenizer.join("tokenizer.json")).unwrap();
    let err = sup
        .load(ModelSpec::new("m", "embed").model(&no_tokenizer))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("tokenizer.json") && err.to_string().contains("missing"),
        "{err}"
    );

    let err = sup.load(ModelSpec::new("m", "embed")).await.unwrap_err();
    assert!(err.to_string().contains("--model"), "{err}");

    // The supervisor carries on: a good load, then bad requests, then good ones.
    load(&sup, "m", "mmap").await;
    for (body, expect) in [
        (json!({ "input": [] }), "empty list"),
        (json!({ "input": 5 }), "not {\"input\""),
        (json!({ "text": "hi" }), "missing field `input`"),
    ] {
        let err = sup
            .request("m", Body::json(body.to_string()))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "bad_request", "{err}");
        assert!(err.to_string().contains(expect), "{err}");
    }
    let err = sup.request("m", Body::json("{not json")).await.unwrap_err();
    assert_eq!(err.kind(), "bad_request");
    assert_eq!(embed(&sup, "m", &[FOX]).await.len(), 1);
    sup.shutdown().await;
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[test]
fn berth_run_returns_the_vectors() {
    let out = std::process::Command::new(berth_bin())
        .args([
            "run",
            "--backend",
            "embed",
            "--json",
            "--input",
            FOX,
            "--model",
        ])
        .arg(default_model("minilm"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let vector = v["responses"][0]["embeddings"][0].as_array().unwrap();
    assert_eq!(vector.len(), 384);
    assert!((vector[0].as_f64().unwrap() - 0.043934).abs() < 1e-5);
    assert_eq!(v["load"]["details"]["dim"], 384);
    // The load ran one pass (its warm-up): no request waits for a first run.
    let warmup = &v["load"]["details"]["warmup_ms"];
    assert!(warmup.as_f64().is_some_and(|ms| ms > 0.0), "{v}");
}

/// `embed`'s encoder (its own pass for a few rows, candle's operations past
/// them) against candle's `BertModel` on the shipped model: each text
/// alone (the own pass) and all at once (past it, candle's).
#[test]
fn the_encoder_agrees_with_candles_bert() {
    let texts: Vec<String> = [FOX, FOOD, BREAD, "A somewhat longer sentence, so that the batch of all four texts has more rows than the few-rows product takes."]
        .iter()
        .map(|t| t.to_string())
        .collect();
    let worst =
        berth_worker::backends::embed::agreement_with_candle(&default_model("minilm"), &texts)
            .unwrap();
    assert!(worst >= 0.99999, "smallest cosine {worst}");
}
