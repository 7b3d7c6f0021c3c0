//! `/v1/completions` (OpenAI's legacy completions) against a real `berth
//! serve` running SmolLM2 through the `generate` backend: the prompt goes
//! to the model as it is, plain and streamed. (A model served by an HTTP
//! server has the route relayed: `upstream.rs`.)

use berth_tests::*;
use serde_json::{Value, json};

fn server() -> Server {
    Server::start(&format!(
        "[[model]]\nname = \"smollm2\"\nbackend = \"generate\"\nmodel = \"{}\"\n\
         [[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        default_model("smollm2").display(),
        default_model("minilm").display()
    ))
}

const SYSTEM: &str = "You are a careful calculator.";
const QUESTION: &str = "What is 2 + 3?";

/// The conversation of `SYSTEM` and `QUESTION` as SmolLM2's ChatML
/// template renders it: sent raw, it must be answered as the chat is.
fn rendered_by_hand() -> String {
    format!(
        "<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n\
         <|im_start|>assistant\n"
    )
}

/// The `data:` payloads of a server-sent event stream, `[DONE]` last.
fn sse_chunks(text: &str) -> Vec<Value> {
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim_start)
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "ends with [DONE]: {text}");
    assert_eq!(data.iter().filter(|d| **d == "[DONE]").count(), 1);
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")))
        .collect()
}

#[test]
fn the_prompt_is_continued_as_it_is_in_openais_shape_plain_and_streamed() {
    let server = server();
    // The chat route renders the conversation through the template...
    let (status, chat) = server.post(
        "/v1/chat/completions",
        json!({ "model": "smollm2", "max_tokens": 24, "messages": [
            { "role": "system", "content": SYSTEM }, { "role": "user", "content": QUESTION },
        ]}),
    );
    assert_eq!(status, 200, "{chat}");
    let answer = chat["choices"][0]["message"]["content"].as_str().unwrap();
    // ... and completions takes the text as it is: the same text rendered
    // by hand is the same prompt, token for token, and the same answer.
    let request = json!({ "model": "smollm2", "max_tokens": 24, "prompt": rendered_by_hand() });
    let (status, body) = server.post("/v1/completions", request.clone());
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["object"], "text_completion", "{body}");
    assert!(
        body["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("cmpl-"))
    );
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000, "{body}");
    assert_eq!(body["model"], "smollm2");
    let choice = &body["choices"][0];
    assert_eq!(body["choices"].as_array().unwrap().len(), 1, "{body}");
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["logprobs"], Value::Null);
    assert_eq!(choice["text"], answer, "raw == chat: {body} vs {chat}");
    assert!(!answer.trim().is_empty(), "{chat}");
    assert_eq!(choice["finish_reason"], chat["choices"][0]["finish_reason"]);
    assert_eq!(body["usage"], chat["usage"], "the same tokens in and out");

    // Text with no template around it is continued, not answered as a
    // question: fewer prompt tokens than the same words as a chat turn.
    let plain = json!({ "model": "smollm2", "max_tokens": 8, "prompt": QUESTION });
    let (status, raw) = server.post("/v1/completions", plain.clone());
    assert_eq!(status, 200, "{raw}");
    let raw_tokens = raw["usage"]["prompt_tokens"].as_u64().unwrap();
    let (_, turn) = server.post(
        "/v1/chat/completions",
        json!({ "model": "smollm2", "max_tokens": 8, "messages": [{ "role": "user", "content": QUESTION }] }),
    );
    let turn_tokens = turn["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        raw_tokens + 5 < turn_tokens,
        "raw {raw_tokens} tokens, as a chat turn {turn_tokens}"
    );

    // Streamed: the same text in pieces, one finish reason, then usage.
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({ "include_usage": true });
    let (status, text) = server.post_text("/v1/completions", streamed);
    assert_eq!(status, 200, "{text}");
    let chunks = sse_chunks(&text);
    let id = &chunks[0]["id"];
    for chunk in &chunks {
        assert_eq!(chunk["object"], "text_completion", "{chunk}");
        assert_eq!(&chunk["id"], id, "one id for the whole stream");
    }
    let (last, pieces) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    assert_eq!(last["usage"], body["usage"], "{last}");
    let said: String = pieces
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(said, answer, "streamed == not streamed");
    let finishes: Vec<&Value> = pieces
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finishes, [&choice["finish_reason"]], "{chunks:?}");
    assert!(pieces.len() >= 3, "streamed in pieces: {chunks:?}");

    // `echo`: the prompt, then the completion; streamed, the prompt first.
    let mut echoed = plain.clone();
    echoed["echo"] = json!(true);
    let (status, with_echo) = server.post("/v1/completions", echoed.clone());
    assert_eq!(status, 200, "{with_echo}");
    let completion = raw["choices"][0]["text"].as_str().unwrap();
    assert_eq!(
        with_echo["choices"][0]["text"],
        format!("{QUESTION}{completion}")
    );
    echoed["stream"] = json!(true);
    let (_, text) = server.post_text("/v1/completions", echoed);
    let chunks = sse_chunks(&text);
    assert_eq!(chunks[0]["choices"][0]["text"], QUESTION, "{chunks:?}");
    let said: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(said, format!("{QUESTION}{completion}"));
}

#[test]
fn what_berth_cannot_do_is_refused_with_a_status_naming_the_model() {
    let server = server();
    let refusals = [
        (json!({ "n": 2 }), "`n: 1`"),
        (json!({ "best_of": 3 }), "`best_of: 1`"),
        (json!({ "suffix": " end" }), "`suffix`"),
        (json!({ "logprobs": 2 }), "`logprobs`"),
        (json!({ "prompt": [1, 2, 3] }), "token ids"),
        (json!({ "prompt": [[1, 2], [3]] }), "token ids"),
        (json!({ "prompt": ["a", "b"] }), "one prompt per request"),
        (json!({ "prompt": "" }), "empty"),
        (json!({ "max_tokens": 0 }), "max_tokens"),
        (json!({ "temperature": -1 }), "temperature"),
        (json!({ "model": "minilm" }), "/v1/embeddings"),
    ];
    for (fields, says) in refusals {
        for stream in [false, true] {
            let mut request = json!({ "model": "smollm2", "prompt": "Once", "stream": stream });
            for (k, v) in fields.as_object().unwrap() {
                request[k] = v.clone();
            }
            let (status, body) = server.post("/v1/completions", request.clone());
            assert_eq!(status, 400, "{request}: {body}");
            assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(message.contains(says), "{request}: {message}");
            assert!(message.contains("model `"), "names the model: {message}");
        }
    }
    // A prompt of one string in a list is that string.
    let (status, body) = server.post(
        "/v1/completions",
        json!({ "model": "smollm2", "prompt": ["Once"], "max_tokens": 2 }),
    );
    assert_eq!(status, 200, "{body}");
    // An unknown model is named, and nothing was loaded for it.
    let (status, body) = server.post(
        "/v1/completions",
        json!({ "model": "nope", "prompt": "Once" }),
    );
    assert_eq!(status, 404, "{body}");
}

/// A prompt of 14.5 MB (under the default `max_body`), on both routes:
/// refused as larger than the context can hold before it is tokenized, so
/// the worker neither dies at its memory cap nor grows (it served a
/// streamed answer meanwhile), and its pid is the same after.
#[test]
fn a_prompt_far_past_the_context_is_refused_before_it_is_tokenized() {
    let server = server();
    let (status, _) = server.post(
        "/v1/completions",
        json!({"model": "smollm2", "prompt": "Once", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    let pid = |server: &Server| {
        server
            .ps()
            .into_iter()
            .find(|m| m["name"] == "smollm2")
            .and_then(|m| m["pid"].as_u64())
    };
    let before = pid(&server).unwrap();
    let rss_before = berth::memory::resident_bytes(before as u32).unwrap_or(0);
    let huge = "word ".repeat(14_500_000 / 5);
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": "smollm2", "prompt": huge}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "smollm2", "messages": [{"role": "user", "content": huge}]}),
        ),
    ] {
        let started = std::time::Instant::now();
        let (status, reply) = server.post(path, body);
        assert_eq!(status, 400, "{path}: {reply}");
        assert_eq!(reply["error"]["code"], "input_too_large", "{reply}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{path} took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(pid(&server), Some(before), "the worker died");
    let rss_after = berth::memory::resident_bytes(before as u32).unwrap_or(0);
    assert!(
        rss_after < rss_before + (200 << 20),
        "the worker grew from {} to {} MiB",
        rss_before >> 20,
        rss_after >> 20
    );
}
