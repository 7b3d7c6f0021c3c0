//! `/v1/completions`, OpenAI's legacy completions, for `generate` models:
//! the prompt is continued as it is, through no chat template (plain, and
//! `stream: true` as server-sent events). It is what an inference
//! gateway's Model Server Protocol asks of a model server besides chat.
//! A model served by an HTTP server never gets here: the relay passes its
//! request to the server untouched.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::error::{ApiError, parse};
use super::openai::{
    Generated, KeepAliveField, Shape, Streamed, generate, include_usage, now_unix, rand_id,
    refuse_other_kind, request_options, usage,
};

#[derive(Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: PromptField,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Value>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<Value>,
    #[serde(default)]
    n: Option<u64>,
    #[serde(default)]
    best_of: Option<u64>,
    /// The prompt before the completion, in the answer.
    #[serde(default)]
    echo: bool,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    keep_alive: Option<KeepAliveField>,
    /// berth's extension: fail (and cancel) past this (`30s`, or seconds).
    #[serde(default)]
    timeout: Option<KeepAliveField>,
}

/// `prompt`: a string, or OpenAI's other forms (which berth names in its
/// refusal rather than misread).
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Texts(Vec<String>),
    /// Token ids, or lists of them.
    Tokens(Vec<serde::de::IgnoredAny>),
}

impl CompletionRequest {
    /// The one prompt, or what is wrong with the request, said so that a
    /// client knows what to send instead.
    fn checked_prompt(&self) -> Result<String, ApiError> {
        let model = &self.model;
        let refuse = |what: String| Err(ApiError::bad_request(format!("model `{model}`: {what}")));
        if self.n.is_some_and(|n| n != 1) || self.best_of.is_some_and(|n| n != 1) {
            return refuse("only `n: 1` and `best_of: 1` are supported".into());
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return refuse("`suffix` (insertion) is not supported: send the prompt only".into());
        }
        if self.logprobs.as_ref().is_some_and(|l| !l.is_null()) {
            return refuse("`logprobs` is not supported".into());
        }
        let prompt = match &self.prompt {
            PromptField::Text(text) => text.clone(),
            PromptField::Texts(texts) if texts.len() == 1 => texts[0].clone(),
            PromptField::Texts(texts) => {
                return refuse(format!(
                    "`prompt` holds {} prompts; send one prompt per request",
                    texts.len()
                ));
            }
            PromptField::Tokens(ids) => {
                return refuse(format!(
                    "`prompt` holds {} token ids (or lists of them); berth takes the prompt as \
                     text: send the text",
                    ids.len()
                ));
            }
        };
        if prompt.is_empty() {
            return refuse("`prompt` is empty".into());
        }
        Ok(prompt)
    }
}

pub async fn completions(State(app): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(&body)?;
    let prompt = req.checked_prompt()?;
    refuse_other_kind(&app, &req.model, "completions")?;
    let sampling = [
        ("max_tokens", req.max_tokens.map(Value::from)),
        ("temperature", req.temperature.map(Value::from)),
        ("top_p", req.top_p.map(Value::from)),
        ("seed", req.seed.map(Value::from)),
        ("stop", req.stop.clone()),
    ];
    let options = request_options(req.keep_alive.as_ref(), req.timeout.as_ref())?;
    let id = format!("cmpl-{:x}", rand_id());
    let created = now_unix();
    let streamed = req.stream.then(|| Streamed {
        id: id.clone(),
        created,
        include_usage: include_usage(req.stream_options.as_ref()),
        shape: Shape::Text {
            echo: req.echo.then(|| prompt.clone()),
        },
    });
    let request = json!({ "raw_prompt": prompt });
    let out = match generate(&app, &req.model, request, sampling, options, streamed).await? {
        Generated::Stream(response) => return Ok(response),
        Generated::Done(out) => out,
    };
    let completion = out["text"].as_str().unwrap_or_default();
    let text = if req.echo {
        format!("{prompt}{completion}")
    } else {
        completion.to_string()
    };
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": req.model,
        "choices": [{
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": out["finish_reason"],
        }],
        "usage": usage(&out),
    }))
    .into_response())
}
