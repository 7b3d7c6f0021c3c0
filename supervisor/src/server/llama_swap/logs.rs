//! llama-swap's `/logs`, `/logs/stream` and `/logs/stream/{id}`: berth's
//! log history and the servers' output, as llama-swap shows them.

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;

use super::known;
use crate::server::AppState;
use crate::server::error::ApiError;

pub(super) fn logs_history(request: &Request) -> Response {
    let html = request
        .headers()
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|a| a.contains("text/html"));
    if html {
        // llama-swap sends a browser to its UI: berth's console.
        return (StatusCode::FOUND, [(header::LOCATION, "/")]).into_response();
    }
    text(crate::logs::history(None))
}

fn text(bytes: Vec<u8>) -> Response {
    let mut response = Body::from(bytes).into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// `/logs/stream[/{id}]`: raw text, the history first (unless
/// `no-history`), then each new line; `id` is `proxy` (berth's log),
/// `upstream` (every model's output), or a model's ID or alias.
pub(super) fn logs_stream(app: &AppState, request: &Request, id: &str) -> Response {
    let id = id.trim_start_matches('/');
    let which: Option<Option<String>> = match id {
        "" | "proxy" => None,
        "upstream" => Some(None),
        id => {
            let compat = app.llama_swap.as_ref().expect("the layer is on");
            match known(app, compat, id) {
                Some(name) => Some(Some(name)),
                None => {
                    return ApiError::bad_request(
                        "invalid logger. Use 'proxy', 'upstream' or a model's ID",
                    )
                    .into_response();
                }
            }
        }
    };
    let history = !request
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .any(|p| p == "no-history" || p.starts_with("no-history="));
    let first = if history {
        crate::logs::history(which.as_ref().map(|w| w.as_deref()))
    } else {
        Vec::new()
    };
    let follower = tokio_stream_of(crate::logs::follow());
    let wanted = which.clone();
    let lines = follower.filter_map(move |line| {
        let keep = match (&wanted, &line.source) {
            (None, crate::logs::Source::Berth) => true,
            (Some(None), crate::logs::Source::Model(_)) => true,
            (Some(Some(m)), crate::logs::Source::Model(n)) => m == n,
            _ => false,
        };
        std::future::ready(
            keep.then(|| Ok::<_, std::io::Error>(Bytes::copy_from_slice(&line.text))),
        )
    });
    let stream =
        futures_util::stream::once(std::future::ready(Ok(Bytes::from(first)))).chain(lines);
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// The lines a follower gets, as a stream; one that falls behind skips.
fn tokio_stream_of(
    rx: tokio::sync::broadcast::Receiver<crate::logs::Line>,
) -> impl futures_util::Stream<Item = crate::logs::Line> + Send {
    futures_util::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(line) => return Some((line, rx)),
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
                Err(_) => return None,
            }
        }
    })
}
