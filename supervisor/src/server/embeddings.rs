//! `POST /v1/embeddings`: OpenAI's request in, the backend's vectors out.
//!
//! The backend is asked for `{"input": ..., "encoding": "f32"}`. It may
//! answer with the vectors as JSON, `{"embeddings": [[...], ...], "tokens"}`,
//! or, having understood `encoding`, as bulk bytes: body
//! `{"count": N, "dim": D, "tokens": T}` and `N x D` little-endian `f32`s.
//! The bulk form saves formatting and parsing tens of thousands of numbers
//! per batch on both sides of the wire. Either answer is checked as the
//! untrusted input it is: one vector per text, all of one length, finite.

use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::AppState;
use super::error::{ApiError, parse};
use super::openai::{KeepAliveField, refuse_other_kind, request_options};
use berth_protocol::Body;

#[derive(Debug, Deserialize)]
struct EmbeddingsRequest {
    model: String,
    input: Value,
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    keep_alive: Option<KeepAliveField>,
    /// berth's extension: fail (and cancel) past this (`30s`, or seconds).
    #[serde(default)]
    timeout: Option<KeepAliveField>,
}

/// One vector of the answer: numbers (`float`) or base64 of its `f32`s.
#[derive(Serialize)]
#[serde(untagged)]
pub enum Embedding {
    Float(Vec<f32>),
    Base64(String),
}

/// The answer, serialised as is: through a `Value` each `f32` would
/// become an `f64` and print with 17 digits instead of its shortest form.
#[derive(Serialize)]
pub struct Answered {
    object: &'static str,
    data: Vec<Item>,
    model: String,
    usage: Usage,
}

#[derive(Serialize)]
pub struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
}

#[derive(Serialize)]
pub struct Item {
    object: &'static str,
    index: usize,
    embedding: Embedding,
}

pub async fn embeddings(State(app): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let req: EmbeddingsRequest = parse(&body)?;
    if !(req.input.is_string()
        || req
            .input
            .as_array()
            .is_some_and(|a| a.iter().all(Value::is_string)))
    {
        return Err(ApiError::bad_request(
            "`input` must be a string or an array of strings",
        ));
    }
    let count = req.input.as_array().map_or(1, Vec::len);
    if count > app.max_inputs {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_many_inputs",
            format!(
                "model `{}`: {count} texts in one request, over max_inputs ({}); split them \
                 across requests",
                req.model, app.max_inputs
            ),
        ));
    }
    refuse_other_kind(&app, &req.model, "embeddings")?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "encoding_format `{other}` is not `float` or `base64`"
            )));
        }
    };
    let options = request_options(req.keep_alive.as_ref(), req.timeout.as_ref())?;
    let body = Body::json(json!({ "input": req.input, "encoding": "f32" }).to_string());
    let reply = app
        .supervisor
        .request_with(&req.model, body, options)
        .await?;
    let (vectors, tokens) = vectors(&req.model, count, &reply)?;
    drop(reply);
    let usage = Usage {
        prompt_tokens: tokens,
        total_tokens: tokens,
    };
    let numbers: usize = vectors.iter().map(Vec::len).sum();
    if numbers * 4 <= PIECE {
        let data: Vec<Item> = vectors
            .into_iter()
            .enumerate()
            .map(|(index, v)| item(index, v, base64))
            .collect();
        return Ok(Json(Answered {
            object: "list",
            data,
            model: req.model,
            usage,
        })
        .into_response());
    }
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(answer_in_pieces(vectors, base64, req.model, usage)),
    )
        .into_response())
}

/// About how much JSON is written at a time.
const PIECE: usize = 64 << 10;

fn item(index: usize, vector: Vec<f32>, base64: bool) -> Item {
    Item {
        object: "embedding",
        index,
        embedding: if base64 {
            Embedding::Base64(encode_f32_base64(&vector))
        } else {
            Embedding::Float(vector)
        },
    }
}

/// A large answer, written as the client takes it, a piece of about
/// [`PIECE`] bytes at a time: what a connection holds is the vectors as
/// `f32`s, not the four times larger JSON text all at once (a client that
/// does not read holds that much, until `send_timeout` drops it). The JSON
/// is the same as [`Answered`]'s.
fn answer_in_pieces(
    vectors: Vec<Vec<f32>>,
    base64: bool,
    model: String,
    usage: Usage,
) -> impl futures_util::Stream<Item = Result<Bytes, std::convert::Infallible>> {
    let tail = serde_json::to_string(&json!({ "model": model, "usage": usage }))
        .unwrap_or_else(|_| "{}".into());
    let mut tail = Some(format!(",{}", &tail[1..]));
    let mut items = vectors.into_iter().enumerate().peekable();
    let mut head = Some(r#"{"object":"list","data":["#.to_string());
    futures_util::stream::iter(std::iter::from_fn(move || {
        let mut out = head.take().map(String::into_bytes).unwrap_or_default();
        while out.len() < PIECE {
            let Some((index, vector)) = items.next() else {
                break;
            };
            let _ = serde_json::to_writer(&mut out, &item(index, vector, base64));
            if items.peek().is_some() {
                out.push(b',');
            }
        }
        if items.peek().is_none()
            && let Some(tail) = tail.take()
        {
            out.push(b']');
            out.extend_from_slice(tail.as_bytes());
        }
        (!out.is_empty()).then(|| Ok(Bytes::from(out)))
    }))
}

/// What the backend answered, in either form.
#[derive(Deserialize)]
struct Answer {
    #[serde(default)]
    embeddings: Option<Vec<Vec<f32>>>,
    #[serde(default)]
    count: Option<usize>,
    #[serde(default)]
    dim: Option<usize>,
    #[serde(default)]
    tokens: u64,
}

fn bad_gateway(model: &str, what: String) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "backend_error",
        format!("model `{model}` answered {what}"),
    )
}

/// The vectors of a backend's answer to `count` texts, and its token count.
fn vectors(model: &str, count: usize, reply: &Body) -> Result<(Vec<Vec<f32>>, u64), ApiError> {
    let answer: Answer = serde_json::from_str(&reply.json).map_err(|e| {
        let excerpt: String = reply.json.chars().take(120).collect();
        bad_gateway(
            model,
            format!("an embeddings body that does not parse ({e}): {excerpt}"),
        )
    })?;
    let bulk = reply.bulk_bytes();
    let vectors = match (answer.embeddings, answer.count, answer.dim) {
        (Some(vectors), _, _) => vectors,
        (None, Some(n), Some(dim)) => {
            let expected = n.checked_mul(dim).and_then(|x| x.checked_mul(4));
            if expected != Some(bulk.len()) || dim == 0 {
                return Err(bad_gateway(
                    model,
                    format!(
                        "{} bulk bytes for {n} vectors of {dim} f32s (want {})",
                        bulk.len(),
                        expected.map_or("an overflow".into(), |e| e.to_string())
                    ),
                ));
            }
            bulk.chunks_exact(dim * 4)
                .map(|v| {
                    v.chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                        .collect()
                })
                .collect()
        }
        _ => {
            return Err(ApiError::bad_request(format!(
                "model `{model}` is not an embedding model (backend gave no `embeddings`)"
            )));
        }
    };
    if vectors.len() != count {
        return Err(bad_gateway(
            model,
            format!("{} vectors for {count} texts", vectors.len()),
        ));
    }
    let dim = vectors.first().map_or(0, Vec::len);
    if let Some((i, v)) = vectors.iter().enumerate().find(|(_, v)| v.len() != dim) {
        return Err(bad_gateway(
            model,
            format!("vector {i} of {} numbers beside {dim}", v.len()),
        ));
    }
    if vectors.iter().flatten().any(|x| !x.is_finite()) {
        return Err(bad_gateway(model, "a vector that is not finite".into()));
    }
    Ok((vectors, answer.tokens))
}

/// OpenAI's `base64` encoding: little-endian f32s, standard base64.
fn encode_f32_base64(vector: &[f32]) -> String {
    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
    super::base64::encode(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large answer written in pieces is, put together, the JSON the
    /// small-answer path writes whole.
    #[tokio::test]
    async fn an_answer_in_pieces_is_the_same_json() {
        use futures_util::StreamExt;
        for base64 in [false, true] {
            let vectors: Vec<Vec<f32>> = (0..200)
                .map(|i| (0..768).map(|j| (i * j) as f32 / 7.0).collect())
                .collect();
            let usage = || Usage {
                prompt_tokens: 12,
                total_tokens: 12,
            };
            let whole = serde_json::to_string(&Answered {
                object: "list",
                data: vectors
                    .iter()
                    .enumerate()
                    .map(|(i, v)| item(i, v.clone(), base64))
                    .collect(),
                model: "m".into(),
                usage: usage(),
            })
            .unwrap();
            let pieces: Vec<Bytes> = answer_in_pieces(vectors, base64, "m".into(), usage())
                .map(Result::unwrap)
                .collect()
                .await;
            assert!(pieces.len() > 2, "{} pieces", pieces.len());
            // A piece ends after the vector that takes it past PIECE.
            assert!(pieces.iter().all(|p| p.len() < PIECE + (16 << 10)));
            let joined = String::from_utf8(pieces.concat()).unwrap();
            assert!(
                joined == whole,
                "base64 {base64}: {} bytes in pieces, {} whole",
                joined.len(),
                whole.len()
            );
        }
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        // 1.0f32 = 00 00 80 3f; 2.0f32 = 00 00 00 40.
        assert_eq!(encode_f32_base64(&[1.0]), "AACAPw==");
        assert_eq!(encode_f32_base64(&[1.0, 2.0]), "AACAPwAAAEA=");
    }

    fn reply(json: &str, bulk: Vec<u8>) -> Body {
        Body::with_bulk(json, bulk)
    }

    #[test]
    fn vectors_come_as_json_or_as_bulk_f32() {
        let (v, tokens) = vectors(
            "m",
            2,
            &reply(r#"{"embeddings": [[1, 2], [3, 4]], "tokens": 5}"#, vec![]),
        )
        .unwrap();
        assert_eq!(v, vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
        assert_eq!(tokens, 5);
        let bytes: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let (v, _) = vectors(
            "m",
            2,
            &reply(r#"{"count": 2, "dim": 2, "tokens": 5}"#, bytes),
        )
        .unwrap();
        assert_eq!(v, vec![vec![1.0, 2.0], vec![3.0, 4.0]]);
    }

    #[test]
    fn a_worker_answering_the_wrong_shape_is_a_bad_gateway_naming_the_model() {
        let cases = [
            (r#"{"embeddings": [[1, 2]]}"#, vec![]), // one vector for two texts
            (r#"{"embeddings": [[1, 2], [3]]}"#, vec![]), // ragged
            (r#"{"embeddings": [["x"], [1]]}"#, vec![]), // not numbers
            (r#"{"count": 2, "dim": 2}"#, vec![0u8; 12]), // short bulk
            (r#"{"count": 2, "dim": 0}"#, vec![]),   // no dimensions
            (r#"{"count": 18446744073709551615, "dim": 2}"#, vec![]), // overflow
            (r#""just a string""#, vec![]),
        ];
        for (json, bulk) in cases {
            let err = vectors("m", 2, &reply(json, bulk)).unwrap_err();
            assert_eq!(
                err.status,
                StatusCode::BAD_GATEWAY,
                "{json}: {}",
                err.message
            );
            assert!(err.message.contains("model `m`"), "{}", err.message);
        }
        let nan: Vec<u8> = [1.0f32, f32::NAN]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let err = vectors("m", 1, &reply(r#"{"count": 1, "dim": 2}"#, nan)).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_GATEWAY);
        // No vectors at all: the model is not an embedding model.
        let err = vectors("m", 1, &reply(r#"{"text": "hi"}"#, vec![])).unwrap_err();
        assert_eq!(err.status, StatusCode::BAD_REQUEST);
    }
}
