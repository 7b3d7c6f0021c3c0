//! The `generate` backend with the real SmolLM2-135M-Instruct (Q4_1 GGUF),
//! through workers. Answers are short (greedy, small `max_tokens`): the
//! model decodes some 130 tokens/s on 2 AVX2 cores, some 30 without AVX2.

use std::path::{Path, PathBuf};

use berth::{Body, LoadReport, ModelSpec, Piece, Supervisor};
use berth_tests::*;
use candle_core::quantized::gguf_file::{self, Content};
use serde_json::{Value, json};

const QUESTION: &str = "What is 2 + 3?";

fn model_file() -> PathBuf {
    default_model("smollm2")
}

/// One user message, greedy (the backend's default), at most `max_tokens`.
fn ask(question: &str, max_tokens: usize) -> Value {
    json!({
        "messages": [{ "role": "user", "content": question }],
        "max_tokens": max_tokens,
    })
}

async fn generate(sup: &Supervisor, model: &str, request: &Value) -> Value {
    let body = sup
        .request(model, Body::json(request.to_string()))
        .await
        .unwrap_or_else(|e| panic!("{model}: {e}"));
    serde_json::from_str(&body.json).unwrap()
}

async fn load(sup: &Supervisor, name: &str, model: &Path, options: &[(&str, &str)]) -> LoadReport {
    let mut spec = ModelSpec::new(name, "generate").model(model);
    for (k, v) in options {
        spec = spec.option(*k, *v);
    }
    sup.load(spec)
        .await
        .unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

fn text(out: &Value) -> &str {
    out["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text: {out}"))
}

/// A coherent, complete answer to [`QUESTION`]: it says 5 and ends at the
/// end-of-turn token, not at the token limit.
fn assert_answers_five(out: &Value, max_tokens: u64) {
    assert!(text(out).contains('5'), "2 + 3 is 5: {out}");
    assert_eq!(out["finish_reason"], "stop", "ends at end of turn: {out}");
    let completion = out["completion_tokens"].as_u64().unwrap();
    assert!(
        completion > 0 && completion < max_tokens,
        "completion_tokens {completion} (max {max_tokens}): {out}"
    );
    assert!(out["prompt_tokens"].as_u64().unwrap() > 10, "{out}");
}

/// A unique scratch folder under the system's temp dir.
fn scratch(label: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("berth-generate-{label}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answers_are_deterministic_coherent_and_end_at_the_end_of_turn() {
    let sup = supervisor();
    let report = load(&sup, "smollm2", &model_file(), &[]).await;
    let details = &report.details;
    assert_eq!(details["architecture"], "llama", "{details}");
    assert_eq!(details["quant"], "q4_1", "{details}");
    assert_eq!(details["chat_template"], "chatml", "{details}");
    assert_eq!(details["load_mode"], "mmap", "{details}");
    assert_eq!(details["vocab_size"], 49152, "{details}");

    let request = ask(QUESTION, 32);
    let first = generate(&sup, "smollm2", &request).await;
    let second = generate(&sup, "smollm2", &request).await;
    assert_answers_five(&first, 32);
    assert_eq!(text(&first), text(&second), "greedy is deterministic");
    assert_eq!(first["completion_tokens"], second["completion_tokens"]);
    assert!(first["decode_ms"].as_f64().unwrap() > 0.0, "{first}");
    assert!(first["prompt_ms"].as_f64().unwrap() > 0.0, "{first}");

    // `{"input": TEXT}` is the same single user turn.
    let input = generate(
        &sup,
        "smollm2",
        &json!({ "input": QUESTION, "max_tokens": 32 }),
    )
    .await;
    assert_eq!(text(&input), text(&first), "input == one user message");
    assert_eq!(input["prompt_tokens"], first["prompt_tokens"]);

    // A system prompt of the caller's replaces the template's default one,
    // so the prompt changes length.
    let with_system = generate(
        &sup,
        "smollm2",
        &json!({
            "messages": [
                { "role": "system", "content": "Be brief." },
                { "role": "user", "content": QUESTION },
            ],
            "max_tokens": 32,
        }),
    )
    .await;
    assert_ne!(
        with_system["prompt_tokens"], first["prompt_tokens"],
        "the caller's system prompt replaces the default one"
    );
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_deltas_concatenate_to_the_final_text() {
    let sup = supervisor();
    load(&sup, "smollm2", &model_file(), &[]).await;
    let request = ask(QUESTION, 24);
    let mut stream = sup
        .request_stream("smollm2", Body::json(request.to_string()))
        .await
        .unwrap();
    let mut deltas = Vec::new();
    let mut done = None;
    while let Some(piece) = stream.next().await {
        match piece.unwrap() {
            Piece::Chunk(body) => {
                assert!(done.is_none(), "no chunk after the final body");
                let chunk: Value = serde_json::from_str(&body.json).unwrap();
                let delta = chunk["delta"].as_str().unwrap_or_else(|| panic!("{chunk}"));
                assert!(!delta.is_empty(), "no empty deltas");
                deltas.push(delta.to_string());
            }
            Piece::Done(body) => done = Some(serde_json::from_str::<Value>(&body.json).unwrap()),
        }
    }
    drop(stream);
    let done = done.expect("a final body");
    assert!(deltas.len() >= 2, "streamed piece by piece: {deltas:?}");
    assert_eq!(deltas.concat(), text(&done), "{deltas:?}");
    assert_answers_five(&done, 24);

    // The same request, not streamed, gives the same text.
    let plain = generate(&sup, "smollm2", &request).await;
    assert_eq!(text(&plain), text(&done));
    sup.shutdown().await;
}

#[test]
fn the_gguf_tokenizer_round_trips_exactly_and_keeps_control_tokens_whole() {
    let path = model_file();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut file).unwrap();
    let tokenizer = berth_worker::backends::generate::tokenizer_from_gguf(&content).unwrap();
    let ids = |text: &str| -> Vec<u32> {
        tokenizer
            .encode(text, false)
            .unwrap_or_else(|e| panic!("{text:?}: {e}"))
            .get_ids()
            .to_vec()
    };

    let im_start = tokenizer.token_to_id("<|im_start|>").expect("<|im_start|>");
    assert_eq!(ids("<|im_start|>"), [im_start], "a single id");
    let im_end = tokenizer.token_to_id("<|im_end|>").expect("<|im_end|>");
    assert_eq!(ids("<|im_end|>"), [im_end], "a single id");
    let user = ids("<|im_start|>user");
    assert_eq!(user[0], im_start, "{user:?}");
    assert_eq!(user.len(), 2, "`user` is one token: {user:?}");
    // SmolLM2's pre-tokenizer splits digits one by one.
    assert_eq!(ids("12345").len(), 5);
    // No leading space is added: "Hello" alone is the same id as in a text.
    assert_eq!(ids("Hello").len(), 1);
    assert_eq!(ids("Hello world")[0], ids("Hello")[0]);

    for text in [
        "Hello, world! The quick brown fox.",
        "12345",
        "café naïve",
        "漢字テスト",
        "<|im_start|>user",
        "  leading and trailing spaces  \n\ttabs\n",
        "<|im_start|>user\nHello 12345, café naïve 漢字テスト 🙂<|im_end|>\n<|im_start|>assistant\n",
    ] {
        let encoded = ids(text);
        let decoded = tokenizer.decode(&encoded, false).unwrap();
        assert_eq!(decoded, text, "round trip of {text:?} via {encoded:?}");
    }
}

/// A small, valid GGUF file of another architecture: GPT-2 metadata and one
/// tensor.
fn write_gpt2_gguf(path: &Path) {
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{DType, Device, Tensor};
    let weights = Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap();
    let tensor = QTensor::quantize(&weights, GgmlDType::Q8_0).unwrap();
    let arch = gguf_file::Value::String("gpt2".into());
    let name = gguf_file::Value::String("tiny gpt2".into());
    let context = gguf_file::Value::U32(1024);
    let metadata = [
        ("general.architecture", &arch),
        ("general.name", &name),
        ("gpt2.context_length", &context),
    ];
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &metadata, &[("token_embd.weight", &tensor)]).unwrap();
    // It is a real GGUF file: candle reads it back.
    let content = Content::read(&mut std::fs::File::open(path).unwrap()).unwrap();
    assert_eq!(content.tensor_infos.len(), 1);
}

/// The good model still answers (after a bad load or a bad request).
async fn still_answers(sup: &Supervisor, after: &str) {
    let body = sup
        .request("good", Body::json(ask(QUESTION, 4).to_string()))
        .await
        .unwrap_or_else(|e| panic!("after {after}, the good model failed: {e}"));
    let out: Value = serde_json::from_str(&body.json).unwrap();
    assert!(!text(&out).is_empty(), "after {after}: {out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_model_files_get_clear_errors_and_the_supervisor_carries_on() {
    let sup = supervisor();
    load(&sup, "good", &model_file(), &[]).await;
    let tmp = scratch("bad-files");

    let garbage = tmp.join("garbage.gguf");
    std::fs::write(
        &garbage,
        b"this is not a model, only some text\n".repeat(100),
    )
    .unwrap();
    let empty = tmp.join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let gpt2 = tmp.join("gpt2.gguf");
    write_gpt2_gguf(&gpt2);
    let missing = tmp.join("nowhere.gguf");

    // (A missing file is refused before any worker starts.)
    let cases: [(&Path, &str, &[&str]); 4] = [
        (&garbage, "load_failed", &["is not a GGUF file"]),
        (&empty, "load_failed", &["is not a GGUF file"]),
        (
            &gpt2,
            "load_failed",
            &["`gpt2` model", "runs `llama` models"],
        ),
        (&missing, "invalid_spec", &["does not exist"]),
    ];
    for (path, kind, expect) in cases {
        for mode in ["mmap", "read"] {
            let spec = ModelSpec::new("bad", "generate")
                .model(path)
                .option("load_mode", mode);
            let err = sup.load(spec).await.unwrap_err();
            let message = err.to_string();
            let shown = path.display().to_string();
            assert_eq!(err.kind(), kind, "{mode}: {message}");
            assert!(message.contains(&shown), "names the file: {message}");
            for e in expect {
                assert!(message.contains(e), "{mode}: says {e:?}: {message}");
            }
            still_answers(&sup, &format!("loading {shown} ({mode})")).await;
        }
    }

    let err = sup
        .load(ModelSpec::new("bad", "generate"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("--model"), "{err}");
    let err = sup
        .load(
            ModelSpec::new("bad", "generate")
                .model(model_file())
                .option("quant", "q2_k"),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("quant=q2_k"), "{err}");
    let err = sup
        .load(
            ModelSpec::new("bad", "generate")
                .model(model_file())
                .option("temprature", "1"),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("temprature"), "{err}");
    still_answers(&sup, "bad options").await;
    assert!(
        sup.worker("bad").is_err(),
        "no failed load left a model loaded"
    );
    sup.shutdown().await;
    std::fs::remove_dir_all(&tmp).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_clear_errors_and_the_model_carries_on() {
    let sup = supervisor();
    let report = load(&sup, "good", &model_file(), &[]).await;
    let context = report.details["context_length"].as_u64().unwrap();
    assert_eq!(context, 4096, "{}", report.details);

    // One token per repeated word: well past the context.
    let long = "hello ".repeat(context as usize + 1000);
    let err = sup
        .request("good", Body::json(ask(&long, 8).to_string()))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "input_too_large", "{err}");
    let message = err.to_string();
    let tokens: u64 = message
        .split("the prompt is ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("names the prompt's token count: {message}"));
    assert!(tokens > context, "{message}");
    assert!(
        message.contains(&format!("the context holds {context}")),
        "names the context: {message}"
    );
    still_answers(&sup, "a prompt too long").await;

    for (request, expect) in [
        (json!({ "messages": [] }), "`messages` is empty"),
        (
            json!({ "messages": [{ "role": "user", "content": "  " }] }),
            "empty",
        ),
        (
            json!({ "messages": [{ "role": "tool", "content": "x" }] }),
            "`tool`",
        ),
        (json!({ "input": "" }), "empty"),
        (json!({}), "no text"),
        (json!({ "input": "a", "max_tokens": 0 }), "max_tokens"),
        (json!({ "input": "a", "temperature": -1 }), "temperature"),
        (json!({ "input": "a", "stop": [""] }), "empty"),
        (json!({ "input": "a", "max_token": 3 }), "max_token"),
    ] {
        let err = sup
            .request("good", Body::json(request.to_string()))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "bad_request", "{request}: {err}");
        assert!(err.to_string().contains(expect), "{request}: {err}");
    }
    let err = sup
        .request("good", Body::json("{not json"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), "bad_request", "{err}");
    assert!(err.to_string().contains("not valid JSON"), "{err}");
    still_answers(&sup, "bad requests").await;
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mmap_and_read_load_modes_give_identical_text() {
    let sup = supervisor();
    load(&sup, "mmap", &model_file(), &[("load_mode", "mmap")]).await;
    let read = load(&sup, "read", &model_file(), &[("load_mode", "read")]).await;
    assert_eq!(read.details["load_mode"], "read", "{}", read.details);
    let request = ask("Name a colour of the sky.", 12);
    let a = generate(&sup, "mmap", &request).await;
    let b = generate(&sup, "read", &request).await;
    assert!(!text(&a).is_empty(), "{a}");
    assert_eq!(text(&a), text(&b), "identical across load modes");
    assert_eq!(a["completion_tokens"], b["completion_tokens"]);
    sup.shutdown().await;
}

#[test]
fn berth_run_returns_the_answer_and_its_token_counts() {
    let out = std::process::Command::new(berth_bin())
        .args([
            "run",
            "--backend",
            "generate",
            "--input",
            QUESTION,
            "--option",
            "max_tokens=24",
            "--json",
            "--model",
        ])
        .arg(model_file())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let response = &v["responses"][0];
    assert_answers_five(response, 24);
    assert_eq!(v["responses"].as_array().unwrap().len(), 1);
    assert_eq!(v["load"]["details"]["defaults"]["max_tokens"], 24, "{v}");
    assert_eq!(v["unload"]["leftover_processes"], 0, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quant_q8_0_converts_once_caches_and_answers() {
    // A copy of the model, so the cached conversion lands in a scratch folder
    // and not next to the shared download.
    let tmp = scratch("q8_0");
    let source = model_file();
    let copy = tmp.join(source.file_name().unwrap());
    std::fs::copy(&source, &copy).unwrap();
    let stem = copy.file_stem().unwrap().to_string_lossy().into_owned();
    let cache = tmp.join(format!("{stem}.Q8_0.gguf"));

    let sup = supervisor();
    let report = load(&sup, "q8", &copy, &[("quant", "q8_0")]).await;
    let details = &report.details;
    assert_eq!(details["quant"], "q8_0", "{details}");
    assert_eq!(details["file"], cache.display().to_string(), "{details}");
    assert_eq!(
        details["source_file"],
        copy.display().to_string(),
        "{details}"
    );
    assert!(cache.is_file(), "the conversion is cached at {cache:?}");
    let leftovers: Vec<_> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary files: {leftovers:?}");
    // A Q8_0 file is really Q8_0: candle reads it back as such.
    let content = Content::read(&mut std::fs::File::open(&cache).unwrap()).unwrap();
    let blocks = content
        .tensor_infos
        .values()
        .filter(|t| t.shape.rank() >= 2)
        .all(|t| t.ggml_dtype == candle_core::quantized::GgmlDType::Q8_0);
    assert!(blocks, "every matrix is Q8_0");

    let out = generate(&sup, "q8", &ask(QUESTION, 32)).await;
    assert_answers_five(&out, 32);
    sup.unload("q8").await.unwrap();

    // A second load reuses the cache instead of converting again.
    let modified = std::fs::metadata(&cache).unwrap().modified().unwrap();
    let again = load(&sup, "q8", &copy, &[("quant", "q8_0")]).await;
    assert_eq!(again.details["quant"], "q8_0");
    assert_eq!(
        std::fs::metadata(&cache).unwrap().modified().unwrap(),
        modified,
        "the cached file was reused, not rewritten"
    );
    let out_again = generate(&sup, "q8", &ask(QUESTION, 32)).await;
    assert_eq!(text(&out_again), text(&out));
    sup.shutdown().await;
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// The forward pass berth runs (weights shared, each sequence's cache its
/// own) against candle's `quantized_llama` on the shipped file: the same
/// greedy tokens, and logits that agree.
#[test]
fn the_forward_pass_agrees_with_candles_llama() {
    let path = model_file();
    let mut file = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut file).unwrap();
    let tokenizer = berth_worker::backends::generate::tokenizer_from_gguf(&content).unwrap();
    let prompt = tokenizer
        .encode(
            "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    let agreement =
        berth_worker::backends::generate::agreement_with_candle(&path, prompt.get_ids(), 12)
            .unwrap();
    assert_eq!(agreement.ours, agreement.candle, "{agreement:?}");
    assert!(agreement.max_logit_diff < 1e-3, "{agreement:?}");
}

/// Requests sent at once decode together, one token each per forward
/// pass; each gets the answer it gets alone (greedy), with its own
/// settings and stop strings; a bad one fails alone, one given up
/// mid-stream leaves without disturbing the others, and one that arrives
/// mid-decode joins and is answered as soon as it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_decode_together_and_each_gets_its_own_answer() {
    let sup = supervisor();
    // Q4_1, the shipped file, batches by default where berth's Q4_1 kernel
    // runs (AVX2, FMA, F16C), and not where only candle's scalar loop does
    // (no gain there).
    #[cfg(target_arch = "x86_64")]
    let kernel = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    #[cfg(not(target_arch = "x86_64"))]
    let kernel = false;
    let default_batch = if kernel { 8 } else { 1 };
    assert_eq!(
        load(&sup, "plain", &model_file(), &[]).await.max_batch,
        default_batch
    );
    sup.unload("plain").await.unwrap();
    let report = load(&sup, "smollm2", &model_file(), &[("max_batch", "8")]).await;
    assert_eq!(report.max_batch, 8);
    let requests: Vec<Value> = vec![
        ask(QUESTION, 24),
        ask("Name a colour.", 12),
        ask("Write one sentence about ships in a harbour at night.", 20),
        json!({
            "messages": [{ "role": "user", "content": "Count from one to ten in words." }],
            "max_tokens": 30,
            "stop": ["4."],
        }),
    ];
    let mut alone = Vec::new();
    for request in &requests {
        alone.push(generate(&sup, "smollm2", request).await);
    }
    assert!(
        !text(&alone[3]).contains("4.") && alone[3]["finish_reason"] == "stop",
        "{}",
        alone[3]
    );
    // A stream given up after its first piece, then the rest at once, with
    // bad input among them.
    let mut abandoned = sup
        .request_stream(
            "smollm2",
            Body::json(ask("Tell me a long story.", 200).to_string()),
        )
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for request in requests
        .iter()
        .cloned()
        .chain([json!({ "input": "x", "temperature": -1 })])
    {
        let sup = sup.clone();
        tasks.push(tokio::spawn(async move {
            sup.request("smollm2", Body::json(request.to_string()))
                .await
        }));
    }
    assert!(matches!(abandoned.next().await, Some(Ok(Piece::Chunk(_)))));
    drop(abandoned);
    let mut results = Vec::new();
    for task in tasks {
        results.push(task.await.unwrap());
    }
    let bad = results.pop().unwrap().unwrap_err();
    assert!(bad.to_string().contains("temperature"), "{bad}");
    for (i, result) in results.into_iter().enumerate() {
        let body = result.unwrap_or_else(|e| panic!("request {i}: {e}"));
        let out: Value = serde_json::from_str(&body.json).unwrap();
        assert_eq!(
            text(&out),
            text(&alone[i]),
            "request {i}: {out} vs {}",
            alone[i]
        );
        assert_eq!(
            out["completion_tokens"], alone[i]["completion_tokens"],
            "request {i}"
        );
        assert_eq!(
            out["finish_reason"], alone[i]["finish_reason"],
            "request {i}"
        );
    }
    let status = sup
        .stats()
        .into_iter()
        .find(|m| m.name == "smollm2")
        .unwrap();
    let b = &status.batching;
    assert!(b.mean_batch_size.unwrap() > 1.0, "they ran together: {b:?}");

    // Continuous: a request that arrives while another decodes joins it
    // and is answered when it ends, not when the batch does.
    let mut long = sup
        .request_stream(
            "smollm2",
            Body::json(ask("Tell me a long story.", 80).to_string()),
        )
        .await
        .unwrap();
    assert!(matches!(long.next().await, Some(Ok(Piece::Chunk(_)))));
    let short = generate(&sup, "smollm2", &requests[1]).await;
    assert_eq!(text(&short), text(&alone[1]));
    let mut after = 0;
    while let Some(piece) = long.next().await {
        match piece.unwrap() {
            Piece::Chunk(_) => after += 1,
            Piece::Done(_) => break,
        }
    }
    assert!(
        after > 0,
        "the long request was still decoding when the short one ended"
    );
    sup.shutdown().await;
}

/// `berth-worker --compare-devices`, which the GPU script runs to tell a
/// CUDA bug from a near-tie, here with the CPU on both sides: the same
/// logits, every top token agreeing. And a load ran every kernel once
/// (its warm-up), as a GPU's load does so that no request waits for the
/// driver.
#[tokio::test]
async fn the_device_comparison_and_the_warm_up_run_on_the_real_model() {
    let out = std::process::Command::new(worker_bin())
        .arg("--compare-devices")
        .arg(model_file())
        .args(["--device", "cpu", "--steps", "6"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verdict"], "agree", "{report}");
    assert_eq!(
        (report["steps"].as_u64(), report["top1_agree"].as_u64()),
        (Some(6), Some(6))
    );
    assert_eq!(report["max_logit_diff"], 0.0, "{report}");
    assert_eq!(report["cpu_tokens"].as_array().map(Vec::len), Some(6));

    let bad = std::process::Command::new(worker_bin())
        .args(["--compare-devices", "/nonexistent.gguf", "--device", "cpu"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("cannot read `/nonexistent.gguf`"));

    let sup = Supervisor::new(test_config());
    let report = load(&sup, "warm", &model_file(), &[]).await;
    assert!(
        report.details["warmup_ms"]
            .as_f64()
            .is_some_and(|ms| ms > 0.0),
        "{report}"
    );
    let report = load(&sup, "cold", &model_file(), &[("warmup", "false")]).await;
    assert_eq!(report.details["warmup_ms"], Value::Null, "{report}");
    sup.shutdown().await;
}
