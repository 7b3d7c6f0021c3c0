//! `POST /api/models/{name}/infer`: a backend's own request, for any
//! backend (a host's, a Python one), with nothing of its answer lost.
//!
//! In, by `Content-Type`:
//! - `application/json`: the backend's request as it is (no body: `{}`);
//! - `application/octet-stream`: the request's JSON, then its bulk bytes,
//!   the JSON's length in `Berth-Json-Length` (as Triton's binary tensor
//!   extension gives it in `Inference-Header-Content-Length`); without that
//!   header the whole body is bulk and the JSON is `{}`.
//!
//! Out, by the first of these the `Accept` header names:
//! - `text/event-stream`: each piece as the worker sends it, as server-sent
//!   events `chunk`, then `done` (or `error`);
//! - `application/x-ndjson`: the same pieces, one JSON object a line;
//! - `application/octet-stream`: the final answer's JSON, then its bulk
//!   bytes, the JSON's length in `Berth-Json-Length`;
//! - anything else (`application/json`, none): the final answer's JSON as
//!   the backend gave it, or, when it has bulk bytes,
//!   `{"body": ANSWER, "bulk_base64": "..."}`.
//!
//! A streamed piece is `{"chunk": BODY}`, `{"done": BODY}` or
//! `{"error": {...}}`, with `"bulk_base64"` beside a body that has bulk
//! bytes. An answer that is not streamed says in `Berth-Chunks` how many
//! streamed pieces it left out, so none is dropped unsaid.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt, stream};
use ipc_channel::ipc::IpcSharedMemory;
use serde_json::{Value, json};

use super::AppState;
use super::error::ApiError;
use super::openai::{KeepAliveField, request_options};
use crate::child::handle::Piece;
use crate::supervisor::RequestStream;
use berth_protocol::Body;
use berth_protocol::Bulk;

/// The length of the JSON that starts a body of bytes, in or out.
pub const JSON_LENGTH: &str = "berth-json-length";
/// How many streamed pieces an answer that is not streamed left out.
pub const CHUNKS: &str = "berth-chunks";
/// Bulk bytes below this travel inside the message; more go in shared memory.
const INLINE_MAX: usize = 64 << 10;

#[derive(Debug, serde::Deserialize)]
pub(crate) struct InferQuery {
    #[serde(default)]
    keep_alive: Option<KeepAliveField>,
    #[serde(default)]
    timeout: Option<KeepAliveField>,
}

/// How the client wants the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Sse,
    Ndjson,
    Bytes,
    Json,
}

impl Answer {
    /// The first media type in `Accept` that is one of ours, in the
    /// client's order; JSON when none is.
    fn wanted(headers: &HeaderMap) -> Answer {
        headers
            .get_all(header::ACCEPT)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| match media_type(t).as_str() {
                "text/event-stream" => Some(Answer::Sse),
                "application/x-ndjson" | "application/jsonl" => Some(Answer::Ndjson),
                "application/octet-stream" => Some(Answer::Bytes),
                "application/json" | "*/*" | "application/*" => Some(Answer::Json),
                _ => None,
            })
            .next()
            .unwrap_or(Answer::Json)
    }
}

fn media_type(value: &str) -> String {
    value
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// Passes the request to the backend and answers as the client asked.
/// `?keep_alive=` and `?timeout=` apply as on the OpenAI endpoints.
pub(crate) async fn infer(
    State(app): State<AppState>,
    Path(name): Path<String>,
    Query(query): Query<InferQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let request = request_body(&headers, &body)?;
    drop(body);
    let options = request_options(query.keep_alive.as_ref(), query.timeout.as_ref())?;
    let answer = Answer::wanted(&headers);
    let mut stream = app
        .supervisor
        .request_stream_with(&name, request, options)
        .await?;
    if matches!(answer, Answer::Sse | Answer::Ndjson) {
        // A request the backend refuses fails before its first piece:
        // answer it with a status, not with an error inside a 200 stream.
        let first = stream.next().await;
        if let Some(Err(e)) = first {
            return Err(e.into());
        }
        let pieces = pieces(stream, first, name);
        return Ok(if answer == Answer::Sse {
            let events = pieces.map(|(kind, value)| {
                Ok::<_, Infallible>(Event::default().event(kind).data(value.to_string()))
            });
            Sse::new(events)
                .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
                .into_response()
        } else {
            let lines = pieces.map(|(_, value)| {
                let mut line = value.to_string().into_bytes();
                line.push(b'\n');
                Ok::<_, Infallible>(Bytes::from(line))
            });
            (
                [(header::CONTENT_TYPE, "application/x-ndjson")],
                axum::body::Body::from_stream(lines),
            )
                .into_response()
        });
    }
    let (done, left_out) = final_answer(stream, &name).await?;
    let mut response = match answer {
        Answer::Bytes => {
            let json_length = done.json.len();
            let (length, body) = bytes_answer(done);
            let mut response =
                ([(header::CONTENT_TYPE, "application/octet-stream")], body).into_response();
            let headers = response.headers_mut();
            headers.insert(JSON_LENGTH, HeaderValue::from(json_length));
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length));
            response
        }
        _ if matches!(done.bulk, Bulk::None) => {
            ([(header::CONTENT_TYPE, "application/json")], done.json).into_response()
        }
        _ => {
            let answer = parsed(&name, &done.json)?;
            let (length, body) = enveloped(answer, done);
            let mut response = ([(header::CONTENT_TYPE, "application/json")], body).into_response();
            response
                .headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(length));
            response
        }
    };
    if left_out > 0 {
        response
            .headers_mut()
            .insert(CHUNKS, HeaderValue::from(left_out));
    }
    Ok(response)
}

/// The request for the backend, from the body and its type.
fn request_body(headers: &HeaderMap, body: &[u8]) -> Result<Body, ApiError> {
    let bytes = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| media_type(t) == "application/octet-stream");
    let (json, bulk) = if bytes {
        let json_length = match headers.get(JSON_LENGTH) {
            None => 0,
            Some(v) => v
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request("`Berth-Json-Length` is not a number of bytes")
                })?,
        };
        if json_length > body.len() {
            return Err(ApiError::bad_request(format!(
                "`Berth-Json-Length` is {json_length}, past the body's {} bytes",
                body.len()
            )));
        }
        body.split_at(json_length)
    } else {
        (body, &[][..])
    };
    let json = if json.iter().all(u8::is_ascii_whitespace) {
        "{}".to_string()
    } else {
        let _: Value = super::error::parse(json)?;
        String::from_utf8(json.to_vec())
            .map_err(|_| ApiError::bad_request("the request's JSON is not UTF-8"))?
    };
    let bulk = if !bytes {
        Bulk::None
    } else if bulk.len() < INLINE_MAX {
        Bulk::Inline(bulk.to_vec())
    } else {
        Bulk::Shared(IpcSharedMemory::from_bytes(bulk))
    };
    Ok(Body { json, bulk })
}

/// The backend's final answer, and how many streamed pieces came before it.
async fn final_answer(mut stream: RequestStream, model: &str) -> Result<(Body, u64), ApiError> {
    let mut left_out = 0;
    loop {
        match stream.next().await {
            Some(Ok(Piece::Done(body))) => return Ok((body, left_out)),
            Some(Ok(Piece::Chunk(_))) => left_out += 1,
            Some(Err(e)) => return Err(e.into()),
            None => return Err(ended_early(model)),
        }
    }
}

fn ended_early(model: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "worker_died",
        format!("model `{model}`: the worker's answer ended before its last piece"),
    )
}

/// A body's JSON as a value; a worker's JSON that does not parse is its fault.
fn parsed(model: &str, json: &str) -> Result<Value, ApiError> {
    serde_json::from_str(json).map_err(|e| {
        ApiError::new(
            StatusCode::BAD_GATEWAY,
            "backend_error",
            format!("model `{model}` answered JSON that does not parse: {e}"),
        )
    })
}

/// An answer's bulk bytes, owned where the worker left them (a shared
/// region, a sealed memfd), so they are written to the client from there.
struct BulkOf(Body);

impl AsRef<[u8]> for BulkOf {
    fn as_ref(&self) -> &[u8] {
        self.0.bulk_bytes()
    }
}

/// The answer as bytes (its JSON, then its bulk) and its length: the bulk
/// is written from where it lies, not copied, so a client that reads slowly
/// makes the server hold no copy of it.
fn bytes_answer(mut done: Body) -> (usize, axum::body::Body) {
    let json = Bytes::from(std::mem::take(&mut done.json));
    let length = json.len() + done.bulk_bytes().len();
    let bulk = Bytes::from_owner(BulkOf(done));
    let pieces = stream::iter([json, bulk].map(Ok::<_, Infallible>));
    (length, axum::body::Body::from_stream(pieces))
}

/// Bulk bytes encoded per piece of the envelope: a multiple of 3, so the
/// pieces' base64 is the whole's.
const BASE64_PIECE: usize = 48 << 10;

/// `{"body": ANSWER, "bulk_base64": "..."}` and its length, the base64
/// encoded piece by piece as the client takes it: a slow reader makes the
/// server hold one piece of it, not the whole text (a third larger than the
/// bytes).
fn enveloped(answer: Value, done: Body) -> (usize, axum::body::Body) {
    let head = format!("{{\"body\":{answer},\"bulk_base64\":\"");
    let bulk_length = done.bulk_bytes().len();
    let length = head.len() + bulk_length.div_ceil(3) * 4 + 2;
    let done = std::sync::Arc::new(done);
    let pieces = bulk_length.div_ceil(BASE64_PIECE);
    let encoded = stream::iter(0..pieces).map(move |i| {
        let bytes = done.bulk_bytes();
        let piece = &bytes[i * BASE64_PIECE..((i + 1) * BASE64_PIECE).min(bytes.len())];
        Ok::<_, Infallible>(Bytes::from(super::base64::encode(piece)))
    });
    let whole = stream::once(async move { Ok(Bytes::from(head)) })
        .chain(encoded)
        .chain(stream::once(async { Ok(Bytes::from_static(b"\"}")) }));
    (length, axum::body::Body::from_stream(whole))
}

/// `object` with the body's bulk bytes in base64 beside it, if it has any.
fn with_bulk(mut object: Value, body: &Body) -> Value {
    if !matches!(body.bulk, Bulk::None) {
        object["bulk_base64"] = json!(super::base64::encode(body.bulk_bytes()));
    }
    object
}

/// The pieces of a streamed answer, each with its event name, as they
/// come; the request ends (and is bookkept) with its last piece, and is
/// cancelled in the worker if the client goes away first.
fn pieces(
    stream: RequestStream,
    first: Option<crate::error::Result<Piece>>,
    model: String,
) -> impl Stream<Item = (&'static str, Value)> {
    stream::unfold((Some(stream), Some(first)), move |(stream, pending)| {
        let model = model.clone();
        async move {
            let mut stream = stream?;
            let piece = match pending {
                Some(piece) => piece,
                None => stream.next().await,
            };
            let (kind, value, last) = match piece {
                Some(Ok(Piece::Chunk(body))) => match parsed(&model, &body.json) {
                    Ok(value) => ("chunk", with_bulk(json!({ "chunk": value }), &body), false),
                    Err(e) => ("error", e.body(), true),
                },
                Some(Ok(Piece::Done(body))) => match parsed(&model, &body.json) {
                    Ok(value) => ("done", with_bulk(json!({ "done": value }), &body), true),
                    Err(e) => ("error", e.body(), true),
                },
                Some(Err(e)) => ("error", ApiError::from(e).body(), true),
                None => ("error", ended_early(&model).body(), true),
            };
            // After its last piece the request is over: dropping it
            // does the bookkeeping now, not when the client hangs up.
            let stream = if last { None } else { Some(stream) };
            Some(((kind, value), (stream, None)))
        }
    })
}
