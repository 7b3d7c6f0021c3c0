//! The OpenAI-compatible endpoints: `/v1/models` and
//! `/v1/chat/completions` (plain and `stream: true` as server-sent events);
//! `/v1/completions` is in `completions.rs`, `/v1/embeddings` in
//! `embeddings.rs`.
//! They translate shapes and delegate to the supervisor; the backends speak
//! berth's own request JSON.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use serde_json::{Value, json};

use super::AppState;
use super::error::{ApiError, parse};
use crate::child::handle::Piece;
use crate::supervisor::RequestOptions;
use crate::supervisor::RequestStream;
use berth_protocol::Body;

pub(super) fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// `keep_alive` in a request body: `"5m"`, a number of seconds, or 0.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum KeepAliveField {
    Text(String),
    Secs(f64),
}

pub(crate) fn request_options(
    keep_alive: Option<&KeepAliveField>,
    timeout: Option<&KeepAliveField>,
) -> Result<RequestOptions, ApiError> {
    let parse =
        |field: &str, value: Option<&KeepAliveField>| -> Result<Option<Duration>, ApiError> {
            let parsed = match value {
                None => return Ok(None),
                Some(KeepAliveField::Text(t)) => crate::units::parse_duration(t),
                Some(KeepAliveField::Secs(s)) => crate::units::parse_duration(&s.to_string()),
            }
            .map_err(|e| ApiError::bad_request(format!("`{field}`: {e}")))?;
            crate::config::check_duration(field, Some(parsed)).map_err(ApiError::bad_request)?;
            Ok(Some(parsed))
        };
    Ok(RequestOptions {
        keep_alive: parse("keep_alive", keep_alive)?,
        deadline: parse("timeout", timeout)?,
    })
}

/// The built-in backends that answer each OpenAI endpoint. A model on one
/// of the others is refused at once, before anything is loaded or run;
/// a host's own backends are not known here and go through.
const CHAT_BACKENDS: &[&str] = &["generate"];
const EMBEDDING_BACKENDS: &[&str] = &["embed"];

pub(super) fn refuse_other_kind(
    app: &AppState,
    model: &str,
    endpoint: &str,
) -> Result<(), ApiError> {
    let Some(spec) = app.supervisor.spec(model) else {
        return Ok(()); // the supervisor names the unknown model
    };
    let (wrong, right, right_endpoint) = match endpoint {
        "embeddings" => (CHAT_BACKENDS, "a chat model", "/v1/chat/completions"),
        _ => (EMBEDDING_BACKENDS, "an embedding model", "/v1/embeddings"),
    };
    if wrong.contains(&spec.backend.as_str()) {
        return Err(ApiError::bad_request(format!(
            "model `{model}` is {right} (backend `{}`), not one for /v1/{endpoint}; use {right_endpoint}",
            spec.backend
        )));
    }
    Ok(())
}

pub async fn models(State(app): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = app
        .supervisor
        .catalogue()
        .into_iter()
        .map(|e| json!({ "id": e.spec.name, "object": "model", "created": 0, "owned_by": "berth", "backend": e.spec.backend, "state": e.state }))
        .collect();
    Json(json!({ "object": "list", "data": data }))
}

/// What both generation routes (chat and legacy completions) take besides
/// what the model continues.
#[derive(Debug, Deserialize)]
pub(super) struct Generation {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<u64>,
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
    pub n: Option<u64>,
    #[serde(default)]
    keep_alive: Option<KeepAliveField>,
    /// berth's extension: fail (and cancel) past this (`30s`, or seconds).
    #[serde(default)]
    timeout: Option<KeepAliveField>,
}

impl Generation {
    /// The sampling fields, with `max_tokens` as the route reads it.
    pub(super) fn sampling(&self, max_tokens: Option<u64>) -> Sampling {
        [
            ("max_tokens", max_tokens.map(Value::from)),
            ("temperature", self.temperature.map(Value::from)),
            ("top_p", self.top_p.map(Value::from)),
            ("seed", self.seed.map(Value::from)),
            ("stop", self.stop.clone()),
        ]
    }

    pub(super) fn options(&self) -> Result<RequestOptions, ApiError> {
        request_options(self.keep_alive.as_ref(), self.timeout.as_ref())
    }

    /// How to stream the answer, where the client asked for a stream.
    pub(super) fn streamed(&self, id: &str, created: u64, shape: Shape) -> Option<Streamed> {
        self.stream.then(|| Streamed {
            id: id.to_string(),
            created,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o["include_usage"] == Value::Bool(true)),
            shape,
        })
    }
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(flatten)]
    common: Generation,
    messages: Vec<Value>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
}

pub async fn chat_completions(
    State(app): State<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(&body)?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("`messages` is empty"));
    }
    if req.common.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("only `n: 1` is supported"));
    }
    let common = &req.common;
    refuse_other_kind(&app, &common.model, "chat/completions")?;
    let sampling = common.sampling(req.max_completion_tokens.or(common.max_tokens));
    let options = common.options()?;
    let id = format!("chatcmpl-{:x}", rand_id());
    let created = now_unix();
    let streamed = common.streamed(&id, created, Shape::Chat);
    let request = json!({ "messages": req.messages });
    let out = match generate(&app, &common.model, request, sampling, options, streamed).await? {
        Generated::Stream(response) => return Ok(response),
        Generated::Done(out) => out,
    };
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": common.model,
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": out["text"] },
            "finish_reason": out["finish_reason"],
            "logprobs": null,
        }],
        "usage": usage(&out),
    }))
    .into_response())
}

/// The sampling fields a generation route passes on, as the `generate`
/// backend names them (`None`: the model's default).
pub(super) type Sampling = [(&'static str, Option<Value>); 5];

/// How a streamed answer is sent.
pub(super) struct Streamed {
    pub id: String,
    pub created: u64,
    pub include_usage: bool,
    pub shape: Shape,
}

/// A generation's answer: a stream already begun, or the final body.
pub(super) enum Generated {
    Stream(Response),
    Done(Value),
}

/// What the generation routes share once their request is read: `request`
/// with `sampling`'s fields set goes to `model`; with `streamed`, the
/// answer is server-sent chunks of its shape, else the final body.
pub(super) async fn generate(
    app: &AppState,
    model: &str,
    mut request: Value,
    sampling: Sampling,
    options: RequestOptions,
    streamed: Option<Streamed>,
) -> Result<Generated, ApiError> {
    for (key, value) in sampling {
        if let Some(value) = value {
            request[key] = value;
        }
    }
    let body = Body::json(request.to_string());
    let mut stream = app
        .supervisor
        .request_stream_with(model, body, options)
        .await?;
    let Some(streamed) = streamed else {
        return Ok(Generated::Done(final_body(stream, model).await?));
    };
    // A request the backend refuses fails before its first piece: answer it
    // with a status, not with an error inside a 200 stream.
    let first = stream.next().await;
    if let Some(Err(e)) = first {
        return Err(e.into());
    }
    let events = sse_events(stream, first, model.to_string(), streamed);
    Ok(Generated::Stream(
        Sse::new(events)
            .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
            .into_response(),
    ))
}

pub(super) fn usage(out: &Value) -> Value {
    let prompt = out["prompt_tokens"].as_u64().unwrap_or(0);
    let completion = out["completion_tokens"].as_u64().unwrap_or(0);
    json!({ "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion })
}

pub(super) fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

pub(super) async fn final_body(mut stream: RequestStream, model: &str) -> Result<Value, ApiError> {
    loop {
        match stream.next().await {
            Some(Ok(Piece::Done(body))) => {
                return serde_json::from_str(&body.json).map_err(|e| {
                    ApiError::new(
                        axum::http::StatusCode::BAD_GATEWAY,
                        "backend_error",
                        format!("model `{model}` answered non-JSON: {e}"),
                    )
                });
            }
            Some(Ok(Piece::Chunk(_))) => {}
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(ApiError::new(
                    axum::http::StatusCode::BAD_GATEWAY,
                    "worker_died",
                    "the stream ended early",
                ));
            }
        }
    }
}

/// Which API a stream answers: its chunks' shape.
pub(super) enum Shape {
    /// `chat.completion.chunk`: a `delta`, the first one the role.
    Chat,
    /// `text_completion`: the `text`; with `echo`, the prompt first.
    Text { echo: Option<String> },
}

impl Shape {
    /// A chunk's choice with `text` (`None`: the role, or nothing).
    fn choice(&self, text: Option<&str>, finish: Value) -> Value {
        match self {
            Shape::Chat => {
                let delta = match text {
                    Some(text) => json!({ "content": text }),
                    None => json!({}),
                };
                json!({ "index": 0, "delta": delta, "finish_reason": finish })
            }
            Shape::Text { .. } => json!({
                "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
            }),
        }
    }

    /// What goes before the model's first piece.
    fn start(&self) -> Option<Value> {
        match self {
            Shape::Chat => Some(json!({
                "index": 0, "delta": { "role": "assistant", "content": "" }, "finish_reason": null,
            })),
            Shape::Text { echo } => echo.as_deref().map(|p| self.choice(Some(p), Value::Null)),
        }
    }

    fn object(&self) -> &'static str {
        match self {
            Shape::Chat => "chat.completion.chunk",
            Shape::Text { .. } => "text_completion",
        }
    }
}

fn sse_events(
    stream: RequestStream,
    first_piece: Option<crate::error::Result<Piece>>,
    model: String,
    streamed: Streamed,
) -> impl Stream<Item = Result<Event, Infallible>> {
    let Streamed {
        id,
        created,
        include_usage,
        shape,
    } = streamed;
    let object = shape.object();
    let wrap = move |choice: Value| {
        let mut chunk = json!({
            "id": id, "object": object, "created": created, "model": model, "choices": [choice],
        });
        if include_usage {
            // As OpenAI does: every chunk has the field, null but the last.
            chunk["usage"] = Value::Null;
        }
        chunk
    };
    let first = shape.start().map(&wrap);
    let chunk = move |text: Option<&str>, finish: Value| wrap(shape.choice(text, finish));
    enum Phase {
        Start(RequestStream, Value, Option<crate::error::Result<Piece>>),
        Streaming(RequestStream, Option<Option<crate::error::Result<Piece>>>),
        Tail(Vec<Value>),
        Done,
    }
    let chunk = std::sync::Arc::new(chunk);
    let start = match first {
        Some(first) => Phase::Start(stream, first, first_piece),
        // Nothing to say first: on with the model's first piece.
        None => Phase::Streaming(stream, Some(first_piece)),
    };
    stream::unfold(start, move |phase| {
        let chunk = std::sync::Arc::clone(&chunk);
        async move {
            match phase {
                Phase::Start(stream, first, piece) => {
                    Some((Ok(data(&first)), Phase::Streaming(stream, Some(piece))))
                }
                Phase::Streaming(mut stream, pending) => match match pending {
                    Some(piece) => piece,
                    None => stream.next().await,
                } {
                    Some(Ok(Piece::Chunk(body))) => {
                        let delta: Value = serde_json::from_str(&body.json).unwrap_or(Value::Null);
                        let text = delta["delta"].as_str().unwrap_or_default();
                        Some((
                            Ok(data(&chunk(Some(text), Value::Null))),
                            Phase::Streaming(stream, None),
                        ))
                    }
                    Some(Ok(Piece::Done(body))) => {
                        let out: Value = serde_json::from_str(&body.json).unwrap_or(Value::Null);
                        let mut tail = vec![chunk(None, out["finish_reason"].clone())];
                        if include_usage {
                            let mut u = chunk(None, Value::Null);
                            u["choices"] = json!([]);
                            u["usage"] = usage(&out);
                            tail.push(u);
                        }
                        tail.reverse();
                        let first = tail.pop().expect("one element");
                        Some((Ok(data(&first)), Phase::Tail(tail)))
                    }
                    Some(Err(e)) => {
                        let err = ApiError::from(e).body();
                        Some((Ok(data(&err)), Phase::Tail(Vec::new())))
                    }
                    None => Some((Ok(Event::default().data("[DONE]")), Phase::Done)),
                },
                Phase::Tail(mut rest) => match rest.pop() {
                    Some(next) => Some((Ok(data(&next)), Phase::Tail(rest))),
                    None => Some((Ok(Event::default().data("[DONE]")), Phase::Done)),
                },
                Phase::Done => None,
            }
        }
    })
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}
