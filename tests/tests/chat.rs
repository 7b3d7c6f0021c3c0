//! `/v1/chat/completions` against a real `berth serve` running SmolLM2
//! through the `generate` backend: OpenAI's shapes, plain and streamed.

use std::time::Duration;

use berth_tests::*;
use serde_json::{Value, json};

const QUESTION: &str = "What is 2 + 3?";

fn server() -> Server {
    Server::start(&format!(
        "[[model]]\nname = \"smollm2\"\nbackend = \"generate\"\nmodel = \"{}\"\n",
        default_model("smollm2").display()
    ))
}

/// A chat request for the 2 + 3 question with `extra` fields merged in.
fn chat(extra: Value) -> Value {
    let mut request = json!({
        "model": "smollm2",
        "messages": [{ "role": "user", "content": QUESTION }],
        "max_tokens": 32,
    });
    for (k, v) in extra.as_object().unwrap() {
        request[k] = v.clone();
    }
    request
}

fn complete(server: &Server, request: Value) -> Value {
    let (status, body) = server.post("/v1/chat/completions", request);
    assert_eq!(status, 200, "{body}");
    body
}

fn content(body: &Value) -> &str {
    body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("no content: {body}"))
}

/// The `data:` payloads of a server-sent event stream, in order.
fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

/// A streamed completion: its chunks (parsed), and the stream's end marker.
fn stream(server: &Server, request: Value) -> Vec<Value> {
    let (status, text) = server.post_text("/v1/chat/completions", request);
    assert_eq!(status, 200, "{text}");
    let data = sse_data(&text);
    assert_eq!(
        data.last().map(String::as_str),
        Some("[DONE]"),
        "ends with [DONE]: {text}"
    );
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1, "{text}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap_or_else(|e| panic!("{d}: {e}")))
        .collect()
}

/// The text of streamed chunks, their `delta.content`s concatenated.
fn streamed_text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// The chunks carrying a finish reason.
fn finish_reasons(chunks: &[Value]) -> Vec<&Value> {
    chunks
        .iter()
        .map(|c| &c["choices"][0]["finish_reason"])
        .filter(|f| !f.is_null())
        .collect()
}

#[test]
fn chat_completions_have_openais_shape_and_stream_the_same_text() {
    let server = server();

    let body = complete(&server, chat(json!({})));
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert!(
        body["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("chatcmpl-")),
        "{body}"
    );
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000, "{body}");
    assert_eq!(body["model"], "smollm2");
    assert_eq!(body["choices"].as_array().unwrap().len(), 1, "{body}");
    assert_eq!(body["choices"][0]["index"], 0);
    assert_eq!(body["choices"][0]["message"]["role"], "assistant", "{body}");
    let answer = content(&body).to_string();
    assert!(answer.contains('5'), "2 + 3 is 5: {body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    let usage = &body["usage"];
    let prompt = usage["prompt_tokens"].as_u64().unwrap();
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert!(prompt > 10 && completion > 0 && completion < 32, "{usage}");
    assert_eq!(usage["total_tokens"].as_u64(), Some(prompt + completion));

    // Streamed: the same greedy text, piece by piece.
    let chunks = stream(&server, chat(json!({ "stream": true })));
    assert!(chunks.len() >= 4, "role, >= 2 pieces, finish: {chunks:?}");
    let id = &chunks[0]["id"];
    for chunk in &chunks {
        assert_eq!(chunk["object"], "chat.completion.chunk", "{chunk}");
        assert_eq!(&chunk["id"], id, "one id for the whole stream");
        assert_eq!(chunk["model"], "smollm2");
        assert!(chunk.get("usage").is_none_or(Value::is_null), "{chunk}");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let pieces = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
        })
        .count();
    assert!(pieces >= 2, "streamed in pieces: {chunks:?}");
    assert_eq!(streamed_text(&chunks), answer, "streamed == not streamed");
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{last}");
    assert_eq!(finish_reasons(&chunks).len(), 1, "{chunks:?}");

    // With usage asked for, a last chunk carries it (and no choices).
    let chunks = stream(
        &server,
        chat(json!({ "stream": true, "stream_options": { "include_usage": true } })),
    );
    assert_eq!(streamed_text(&chunks), answer);
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]), "{last}");
    assert_eq!(last["usage"], *usage, "the same usage as not streamed");
    let before = &chunks[chunks.len() - 2];
    assert_eq!(before["choices"][0]["finish_reason"], "stop", "{before}");
    assert!(
        chunks[..chunks.len() - 1]
            .iter()
            .all(|c| c.get("usage") == Some(&Value::Null)),
        "every other chunk has \"usage\": null: {chunks:?}"
    );
}

#[test]
fn stop_strings_and_max_tokens_end_the_answer() {
    let server = server();
    let answer = content(&complete(&server, chat(json!({})))).to_string();
    // Greedy SmolLM2 answers "2 + 3 = 5": a stop string cuts it before its
    // first occurrence, and the stop string itself is not sent.
    let at = answer
        .find('3')
        .unwrap_or_else(|| panic!("the answer repeats the question: {answer:?}"));
    let cut = &answer[..at];
    let request = chat(json!({ "stop": ["3", "never appears"] }));
    let body = complete(&server, request.clone());
    assert_eq!(content(&body), cut, "{body}");
    assert_eq!(body["choices"][0]["finish_reason"], "stop", "{body}");
    // A single string works too.
    let body = complete(&server, chat(json!({ "stop": "3" })));
    assert_eq!(content(&body), cut, "{body}");
    // Streamed, nothing past the cut leaks out.
    let mut streamed = request;
    streamed["stream"] = json!(true);
    let chunks = stream(&server, streamed);
    assert_eq!(streamed_text(&chunks), cut);
    assert_eq!(finish_reasons(&chunks), [&json!("stop")]);

    // max_tokens: the answer ends at the limit, with finish_reason "length".
    let body = complete(&server, chat(json!({ "max_tokens": 3 })));
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 3, "{body}");
    assert!(
        answer.starts_with(content(&body)),
        "a prefix of the full greedy answer: {body}"
    );
    // max_completion_tokens (OpenAI's newer name) does the same.
    let body = complete(&server, chat(json!({ "max_completion_tokens": 3 })));
    assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    let chunks = stream(&server, chat(json!({ "max_tokens": 3, "stream": true })));
    assert_eq!(finish_reasons(&chunks), [&json!("length")]);

    // A request the backend refuses is a 400 with OpenAI's error shape.
    let (status, body) = server.post(
        "/v1/chat/completions",
        json!({ "model": "smollm2", "messages": [{ "role": "tool", "content": "x" }] }),
    );
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["code"], "bad_request", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("`tool`")),
        "{body}"
    );
}

#[test]
fn refused_requests_get_a_status_not_a_broken_stream() {
    let server = server();
    let user = json!({ "role": "user", "content": "What is 2 + 3?" });
    // A role the model does not take: 400 before any stream starts, named once.
    for stream in [false, true] {
        let (status, body) = server.post(
            "/v1/chat/completions",
            json!({ "model": "smollm2", "stream": stream, "messages": [{ "role": "tool", "content": "x" }] }),
        );
        assert_eq!(status, 400, "stream={stream}: {body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert_eq!(
            message.matches("model `smollm2`").count(),
            1,
            "the model is named once: {message}"
        );
    }
    let (status, body) = server.post(
        "/v1/chat/completions",
        chat(json!({ "messages": [user.clone()], "n": 2 })),
    );
    assert_eq!(status, 400, "{body}");
    // OpenAI's content parts are accepted and mean the same as a string.
    let parts = json!({ "role": "user", "content": [{ "type": "text", "text": "What is 2 + " }, { "type": "text", "text": "3?" }] });
    let with_parts = complete(&server, chat(json!({ "messages": [parts] })));
    let with_text = complete(&server, chat(json!({ "messages": [user] })));
    assert_eq!(content(&with_parts), content(&with_text));
}

#[test]
fn the_cli_talks_to_a_daemon_on_a_unix_socket() {
    use std::process::{Command, Stdio};
    let dir = std::env::temp_dir().join(format!("berth-unix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("berth.sock");
    let config = dir.join("berth.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"unix:{}\"\n[[model]]\nname = \"smollm2\"\nbackend = \"generate\"\nmodel = \"{}\"\n",
            socket.display(),
            default_model("smollm2").display()
        ),
    )
    .unwrap();
    let mut daemon = Command::new(berth_bin())
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("unix:{}", socket.display());
    let berth = |args: &[&str]| {
        let out = Command::new(berth_bin())
            .args(args)
            .args(["--url", &url])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    assert!(
        wait_for(Duration::from_secs(20), || berth(&["ps"]).0),
        "berth ps over {url}: {:?}",
        berth(&["ps"])
    );
    let (ok, out, err) = berth(&["load", "smollm2"]);
    assert!(ok, "{out}{err}");
    let (ok, out, err) = berth(&["ps", "--json"]);
    assert!(ok, "{err}");
    let ps: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(ps["models"][0]["state"], "ready", "{ps}");
    // Streamed (chunked) over the socket, as over TCP.
    let (ok, out, err) = berth(&["generate", "smollm2", QUESTION, "--max-tokens", "8"]);
    assert!(ok && !out.trim().is_empty(), "{out}{err}");
    let (ok, out, err) = berth(&["unload", "smollm2"]);
    assert!(ok, "{out}{err}");

    // A wrong socket is a clear error, not a panic.
    let (ok, _, err) = Command::new(berth_bin())
        .args(["ps", "--url", "unix:/nonexistent/berth.sock"])
        .output()
        .map(|o| {
            (
                o.status.success(),
                (),
                String::from_utf8_lossy(&o.stderr).to_string(),
            )
        })
        .unwrap();
    assert!(!ok);
    assert!(
        err.contains("cannot reach berth at unix:/nonexistent/berth.sock"),
        "{err}"
    );
    unsafe { libc::kill(daemon.id() as i32, libc::SIGTERM) };
    assert!(daemon.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}
