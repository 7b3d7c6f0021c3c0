//! Generation benchmarks: SmolLM2-135M-Instruct, the shipped Q4_1 file and
//! its Q8_0 conversion, through a worker and in-process; printed as the
//! tables of docs/performance.md.
//!
//! `cargo build --release --workspace --bins && cargo bench -p berth-tests --bench generate`
//! (`-- --batching`: the concurrent-chats section alone; `-- --compare`:
//! the worker-vs-in-process section alone; `-- --llamacpp`: one chat
//! against llama.cpp's server on the same file, alone)
//! (fetches the model first if it is missing).
//!
//! The worker and the in-process backend are loaded side by side and take
//! turns (the order flips each round), one greedy run of one fixed prompt
//! (about 100 tokens with the chat template) and `max_tokens` 64 each per
//! round, after a warm-up; the ratio is the median of the per-round ratios,
//! with its 10th–90th percentile spread. Prompt tokens/s = `prompt_tokens`
//! / `prompt_ms`; decode tokens/s = one-token forward passes / `decode_ms`
//! (the backend's `decode_tokens_per_s`).

use std::path::{Path, PathBuf};

use berth::{Body, ModelSpec, Supervisor};
use berth_protocol::LoadSpec;
use berth_tests::bench::{Rounds, machine};
use berth_tests::upstream::{llamacpp_model, llamacpp_worker};
use berth_tests::{Server, default_model, json_reply, test_config};
use berth_worker::{LoadContext, Registry, RequestContext};
use serde_json::{Value, json};

const ROUNDS: usize = 8;
const MAX_TOKENS: usize = 64;

fn request(max_tokens: usize) -> Body {
    Body::json(
        json!({
            "messages": [{ "role": "user", "content": PROMPT }],
            "max_tokens": max_tokens,
            "temperature": 0,
        })
        .to_string(),
    )
}

/// About a hundred tokens with the chat template.
const PROMPT: &str = "Berth runs every model in a worker process of its own and speaks \
                to it over a pipe. When a model is unloaded, its worker exits, so \
                the kernel takes back every byte the model held: weights, caches, \
                leaks and all. The supervisor measures how much memory came back \
                and reports it. Explain, in a few sentences, why running each \
                model in its own process makes memory easier to reclaim.";

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

fn in_process(model: &Path, quant: &str) -> Box<dyn berth_worker::Backend> {
    let spec = LoadSpec {
        name: "smollm2".into(),
        backend: "generate".into(),
        model: Some(model.display().to_string()),
        options: [("quant".to_string(), quant.to_string())].into(),
    };
    Registry::builtin()
        .load(&spec, &LoadContext::standalone())
        .unwrap()
}

/// Prompt and decode rounds, worker (A) against in-process (B), and the
/// worker's backend load time.
async fn compare(sup: &Supervisor, model: &Path, quant: &str) -> (Rounds, Rounds, Run, f64) {
    let spec = ModelSpec::new("smollm2", "generate")
        .model(model)
        .option("quant", quant);
    let report = sup.load(spec).await.unwrap();
    let mut local = in_process(model, quant);
    let handle = tokio::runtime::Handle::current();
    let (mut prompt, mut decode) = (Rounds::new(), Rounds::new());
    let last = tokio::task::block_in_place(|| {
        let worker = |body| Run::from_body(&handle.block_on(sup.request("smollm2", body)).unwrap());
        let mut here =
            |body| Run::from_body(&local.handle(body, &RequestContext::standalone()).unwrap());
        worker(request(4));
        here(request(4));
        let mut last = None;
        for round in 0..ROUNDS {
            let (a, b) = if round % 2 == 0 {
                let a = worker(request(MAX_TOKENS));
                (a, here(request(MAX_TOKENS)))
            } else {
                let b = here(request(MAX_TOKENS));
                (worker(request(MAX_TOKENS)), b)
            };
            prompt.push(a.prompt_per_s, b.prompt_per_s);
            decode.push(a.decode_per_s, b.decode_per_s);
            last = Some(a);
        }
        last.unwrap()
    });
    sup.unload("smollm2").await.unwrap();
    (prompt, decode, last, report.backend_load_ms)
}

/// Concurrent chats: `clients` requests at once, each a different
/// question and `max_tokens` 48, through a model that batches
/// (`max_batch` 8, the default) and one that cannot (`max_batch = 1`),
/// both loaded, taking turns round by round. Completion tokens per second
/// of the whole round, and each request's latency.
async fn concurrent(sup: &Supervisor, model: &Path, quant: &str, label: &str) {
    const ROUNDS: usize = 5;
    let questions = [
        "Name three rivers and the seas they reach.",
        "Write two sentences about a lighthouse.",
        "Explain what a harbour master does.",
        "List four kinds of ships.",
        "Why do tides happen?",
        "Describe a calm morning at sea.",
        "What is a berth, in a port?",
        "Give three tips for sailing in fog.",
    ];
    for (name, max_batch) in [("batched", "8"), ("single", "1")] {
        sup.load(
            ModelSpec::new(name, "generate")
                .model(model)
                .option("quant", quant)
                .option("max_batch", max_batch),
        )
        .await
        .unwrap();
    }
    let round = async |name: &str, clients: usize| -> (f64, Vec<f64>) {
        let started = std::time::Instant::now();
        let tasks: Vec<_> = (0..clients)
            .map(|i| {
                let sup = sup.clone();
                let body = json!({
                    "messages": [{ "role": "user", "content": questions[i % questions.len()] }],
                    "max_tokens": 48,
                    "temperature": 0,
                })
                .to_string();
                let name = name.to_string();
                tokio::spawn(async move {
                    let t = std::time::Instant::now();
                    let out = sup.request(&name, Body::json(body)).await.unwrap();
                    let v: Value = serde_json::from_str(&out.json).unwrap();
                    (
                        v["completion_tokens"].as_u64().unwrap(),
                        t.elapsed().as_secs_f64(),
                    )
                })
            })
            .collect();
        let mut tokens = 0;
        let mut latencies = Vec::new();
        for task in tasks {
            let (n, latency) = task.await.unwrap();
            tokens += n;
            latencies.push(latency);
        }
        (tokens as f64 / started.elapsed().as_secs_f64(), latencies)
    };
    round("batched", 2).await;
    round("single", 2).await;
    for clients in [4usize, 8] {
        let (mut rate, mut p50) = (Rounds::new(), Rounds::new());
        for r in 0..ROUNDS {
            let ((a, mut la), (b, mut lb)) = if r % 2 == 0 {
                let a = round("batched", clients).await;
                (a, round("single", clients).await)
            } else {
                let b = round("single", clients).await;
                (round("batched", clients).await, b)
            };
            rate.push(a, b);
            p50.push(
                berth_tests::bench::median(&mut la),
                berth_tests::bench::median(&mut lb),
            );
        }
        rate.print(
            &format!("{label}, {clients} concurrent chats: completion tokens/s"),
            "batched",
            "`max_batch = 1`",
            "tokens/s",
            1.0,
        );
        p50.print(
            &format!("{label}, {clients} concurrent chats: p50 latency"),
            "batched",
            "`max_batch = 1`",
            "s",
            1.0,
        );
    }
    for name in ["batched", "single"] {
        sup.unload(name).await.unwrap();
    }
}

/// One chat at a time, `generate` with its default settings against
/// llama.cpp's server (`llama-cpp-python[server]`, pinned) on the same GGUF
/// file, both served by one `berth serve` and taking turns, 8 rounds after a
/// warm-up. Each side answers the same prompt twice a round, once with one
/// token and once with up to 128 (greedy): prompt tokens/s = prompt tokens /
/// the one-token reply's time; decode tokens/s = the further tokens / the
/// time the long reply took beyond the short one. Every request's system
/// message begins with a number of its own, so llama.cpp cannot reuse the
/// previous request's evaluated prompt (which `generate` never does).
/// Both run with their own defaults: `generate` computes on every core this
/// process may use; llama-cpp-python's server decodes on half the cores and
/// reads prompts on all of them. `BERTH_BENCH_LLAMACPP_ARGS` adds arguments
/// to its command line (e.g. `, "--n_threads", "2"`).
fn versus_llamacpp() {
    const ROUNDS: usize = 8;
    const LONG: u64 = 128;
    let gguf = default_model("smollm2");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let server = Server::start(&format!(
        r#"models_dir = "{}"
{}
[[model]]
name = "generate"
backend = "generate"
model = "{}"

{}"#,
        gguf.parent().unwrap().display(),
        llamacpp_worker(&std::env::var("BERTH_BENCH_LLAMACPP_ARGS").unwrap_or_default()),
        gguf.display(),
        llamacpp_model("llamacpp")
    ));
    for model in ["generate", "llamacpp"] {
        let (status, reply) = server.post(&format!("/api/models/{model}/load"), json!({}));
        assert_eq!(status, 200, "{model}: {reply}");
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(std::time::Duration::from_secs(300)))
        .build()
        .into();
    let url = format!("{}/v1/chat/completions", server.url);
    let mut nonce = 1000;
    let mut ask = |model: &str, max_tokens: u64| -> (f64, u64, u64) {
        nonce += 1;
        let body = json!({
            "model": model,
            "messages": [
                {"role": "system", "content": format!("Conversation {nonce}. You are a careful writer.")},
                {"role": "user", "content": format!("{} Then write a long essay on lighthouses.", PROMPT)},
            ],
            "max_tokens": max_tokens,
            "temperature": 0,
        });
        let started = std::time::Instant::now();
        let (status, reply) = json_reply(agent.post(&url).send_json(&body));
        let took = started.elapsed().as_secs_f64();
        assert_eq!(status, 200, "{model}: {reply}");
        let usage = &reply["usage"];
        (
            took,
            usage["prompt_tokens"].as_u64().unwrap(),
            usage["completion_tokens"].as_u64().unwrap(),
        )
    };
    let mut tokens = Vec::new();
    let mut side = |model: &str| -> (f64, f64) {
        let (short, prompt_tokens, _) = ask(model, 1);
        let (long, _, completion) = ask(model, LONG);
        tokens.push((model == "generate", prompt_tokens, completion));
        (
            prompt_tokens as f64 / short,
            (completion - 1) as f64 / (long - short),
        )
    };
    side("generate");
    side("llamacpp");
    let (mut prompt, mut decode) = (Rounds::new(), Rounds::new());
    for round in 0..ROUNDS {
        let (g, l) = if round % 2 == 0 {
            let g = side("generate");
            (g, side("llamacpp"))
        } else {
            let l = side("llamacpp");
            (side("generate"), l)
        };
        prompt.push(g.0, l.0);
        decode.push(g.1, l.1);
    }
    let span = |ours: bool| {
        let of: Vec<_> = tokens.iter().filter(|t| t.0 == ours).collect();
        let p = of.iter().map(|t| t.1).max().unwrap();
        let (lo, hi) = (
            of.iter().map(|t| t.2).min().unwrap(),
            of.iter().map(|t| t.2).max().unwrap(),
        );
        format!("{p} prompt tokens, {lo}–{hi} new")
    };
    println!(
        "### One chat: `generate` against llama.cpp's server, same GGUF, defaults ({} cores; {})\n",
        threads,
        machine()
    );
    println!("| phase | `generate` | llama.cpp | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    prompt.print("prompt, tokens/s", "", "", "tokens/s", 1.0);
    decode.print("decode, tokens/s", "", "", "tokens/s", 1.0);
    println!("\n(`generate`: {}; llama.cpp: {})", span(true), span(false));
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    if std::env::args().any(|a| a == "--llamacpp") {
        versus_llamacpp();
        return;
    }
    let batching_only = std::env::args().any(|a| a == "--batching");
    let compare_only = std::env::args().any(|a| a == "--compare");
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
    println!(
        "### Generation: SmolLM2-135M-Instruct, greedy, {MAX_TOKENS} new tokens ({})\n",
        machine()
    );
    println!(
        "| weights, phase | through a worker | in-process | worker / in-process, median (p10–p90) | samples |"
    );
    println!("|---|---|---|---|---|");
    let mut batching = Vec::new();
    for (label, model, quant) in [
        ("Q4_1 (shipped)", &shipped, "native"),
        ("Q8_0 (quant=q8_0)", &copy, "q8_0"),
    ] {
        let sup = Supervisor::new(test_config());
        batching.push((label, model.clone(), quant));
        if batching_only {
            continue;
        }
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
        let (prompt, decode, last, load_ms) = runtime.block_on(compare(&sup, model, quant));
        runtime.block_on(sup.shutdown());
        prompt.print(
            &format!("{label}, prompt ({} tokens)", last.prompt_tokens),
            "",
            "",
            "tokens/s",
            1.0,
        );
        decode.print(&format!("{label}, decode"), "", "", "tokens/s", 1.0);
        println!("| {label}, worker's load | {load_ms:.0} ms | | | |");
        if last.completion_tokens != MAX_TOKENS as u64 {
            println!(
                "\n(note: {label} stopped after {} tokens)\n",
                last.completion_tokens
            );
        }
    }
    if compare_only {
        let _ = std::fs::remove_dir_all(&scratch);
        return;
    }
    println!(
        "\n### Concurrent chats: batched decoding against none ({})\n",
        machine()
    );
    println!("| what | batched (`max_batch` 8) | baseline | ratio, median (p10–p90) | samples |");
    println!("|---|---|---|---|---|");
    for (label, model, quant) in batching {
        let sup = Supervisor::new(test_config());
        runtime.block_on(concurrent(&sup, &model, quant, label));
        runtime.block_on(sup.shutdown());
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
