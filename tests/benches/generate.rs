//! Generation benchmarks: SmolLM2-135M-Instruct, the shipped Q4_1 file and
//! its Q8_0 conversion, through a worker and in-process; printed as the
//! README's tables.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench generate`
//! (fetches the model first if it is missing).
//!
//! Each figure is the median of 3 greedy runs of one fixed prompt (about 100
//! tokens with the chat template) and `max_tokens` 64, after a warm-up.
//! Prompt tokens/s = `prompt_tokens` / `prompt_ms`; decode tokens/s =
//! one-token forward passes / `decode_ms` (the backend's
//! `decode_tokens_per_s`).

use std::path::{Path, PathBuf};

use berth::{Body, ModelSpec, Supervisor};
use berth_protocol::LoadSpec;
use berth_tests::{default_model, test_config};
use berth_worker::{LoadContext, Registry, RequestContext};
use serde_json::{Value, json};

const RUNS: usize = 3;
const MAX_TOKENS: usize = 64;

fn request(max_tokens: usize) -> Body {
    let text = "Berth runs every model in a worker process of its own and speaks \
                to it over a pipe. When a model is unloaded, its worker exits, so \
                the kernel takes back every byte the model held: weights, caches, \
                leaks and all. The supervisor measures how much memory came back \
                and reports it. Explain, in a few sentences, why running each \
                model in its own process makes memory easier to reclaim.";
    Body::json(
        json!({
            "messages": [{ "role": "user", "content": text }],
            "max_tokens": max_tokens,
            "temperature": 0,
        })
        .to_string(),
    )
}

/// One run's figures, from the backend's final body.
#[derive(Debug, Clone, Copy)]
struct Run {
    prompt_tokens: u64,
    completion_tokens: u64,
    prompt_per_s: f64,
    decode_per_s: f64,
}

impl Run {
    fn from_body(body: &Body) -> Run {
        let v: Value = serde_json::from_str(&body.json).unwrap();
        let prompt_tokens = v["prompt_tokens"].as_u64().unwrap();
        Run {
            prompt_tokens,
            completion_tokens: v["completion_tokens"].as_u64().unwrap(),
            prompt_per_s: prompt_tokens as f64 / (v["prompt_ms"].as_f64().unwrap() / 1e3),
            decode_per_s: v["decode_tokens_per_s"].as_f64().unwrap(),
        }
    }
}

/// Medians of `RUNS` runs of `call` (after one short warm-up).
fn median(mut call: impl FnMut(Body) -> Body) -> Run {
    call(request(4));
    let runs: Vec<Run> = (0..RUNS)
        .map(|_| Run::from_body(&call(request(MAX_TOKENS))))
        .collect();
    let mid = |f: fn(&Run) -> f64| {
        let mut v: Vec<f64> = runs.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Run {
        prompt_tokens: runs[0].prompt_tokens,
        completion_tokens: runs[0].completion_tokens,
        prompt_per_s: mid(|r| r.prompt_per_s),
        decode_per_s: mid(|r| r.decode_per_s),
    }
}

async fn through_worker(sup: &Supervisor, model: &Path, quant: &str) -> (Run, f64) {
    let spec = ModelSpec::new("smollm2", "generate")
        .model(model)
        .option("quant", quant);
    let report = sup.load(spec).await.unwrap();
    let handle = tokio::runtime::Handle::current();
    let run = tokio::task::block_in_place(|| {
        median(|body| handle.block_on(sup.request("smollm2", body)).unwrap())
    });
    sup.unload("smollm2").await.unwrap();
    (run, report.backend_load_ms)
}

fn in_process(model: &Path, quant: &str) -> Run {
    let spec = LoadSpec {
        name: "smollm2".into(),
        backend: "generate".into(),
        model: Some(model.display().to_string()),
        options: [("quant".to_string(), quant.to_string())].into(),
    };
    let mut backend = Registry::builtin()
        .load(&spec, &LoadContext::standalone())
        .unwrap();
    median(|body| backend.handle(body, &RequestContext::standalone()).unwrap())
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let shipped = default_model("smollm2");
    // The Q8_0 conversion is cached next to its source: convert a copy in a
    // scratch folder, not the shared download.
    let scratch: PathBuf =
        std::env::temp_dir().join(format!("berth-bench-generate-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let copy = scratch.join(shipped.file_name().unwrap());
    std::fs::copy(&shipped, &copy).unwrap();

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "### Generation: SmolLM2-135M-Instruct, greedy, {MAX_TOKENS} new tokens, {cores} cores (median of {RUNS})\n"
    );
    println!(
        "| weights | prompt | prompt tokens/s: worker | in-process | ratio | decode tokens/s: worker | in-process | ratio | load (worker) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (label, model, quant) in [
        ("Q4_1 (shipped)", &shipped, "native"),
        ("Q8_0 (quant=q8_0)", &copy, "q8_0"),
    ] {
        let sup = Supervisor::new(test_config());
        if quant == "q8_0" {
            // Convert once, outside the measured loads.
            runtime.block_on(async {
                sup.load(
                    ModelSpec::new("convert", "generate")
                        .model(model)
                        .option("quant", quant),
                )
                .await
                .unwrap();
                sup.unload("convert").await.unwrap();
            });
        }
        let (worker, load_ms) = runtime.block_on(through_worker(&sup, model, quant));
        runtime.block_on(sup.shutdown());
        let here = in_process(model, quant);
        println!(
            "| {label} | {} tokens | {:.1} | {:.1} | {:.3} | {:.1} | {:.1} | {:.3} | {load_ms:.0} ms |",
            worker.prompt_tokens,
            worker.prompt_per_s,
            here.prompt_per_s,
            worker.prompt_per_s / here.prompt_per_s,
            worker.decode_per_s,
            here.decode_per_s,
            worker.decode_per_s / here.decode_per_s,
        );
        if worker.completion_tokens != MAX_TOKENS as u64 {
            println!(
                "\n(note: {label} stopped after {} tokens)\n",
                worker.completion_tokens
            );
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
