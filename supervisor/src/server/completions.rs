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
    Generated, Generation, Shape, generate, now_unix, rand_id, refuse_other_kind, usage,
};

#[derive(Deserialize)]
struct CompletionRequest {
    #[serde(flatten)]
    common: Generation,
    prompt: PromptField,
    #[serde(default)]
    best_of: Option<u64>,
    /// The prompt before the completion, in the answer.
    #[serde(default)]
    echo: bool,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    logprobs: Option<Value>,
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
        let model = &self.common.model;
        let refuse = |what: String| Err(ApiError::bad_request(format!("model `{model}`: {what}")));
        if self.common.n.is_some_and(|n| n != 1) || self.best_of.is_some_and(|n| n != 1) {
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
    let common = &req.common;
    refuse_other_kind(&app, &common.model, "completions")?;
    let sampling = common.sampling(common.max_tokens);
    let options = common.options()?;
    let id = format!("cmpl-{:x}", rand_id());
    let created = now_unix();
    let echo = req.echo.then(|| prompt.clone());
    let streamed = common.streamed(&id, created, Shape::Text { echo });
    let request = json!({ "raw_prompt": prompt });
    let out = match generate(&app, &common.model, request, sampling, options, streamed).await? {
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
        "model": common.model,
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
