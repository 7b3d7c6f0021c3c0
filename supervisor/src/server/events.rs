//! `GET /api/events`: the supervisor's events as server-sent events.
//!
//! Each event is one SSE message: `id:` its number, `data:` its JSON (with
//! `"type"`). `?since=ID` (or the `Last-Event-ID` header a browser's
//! `EventSource` sends when it reconnects) resumes after that number; the
//! kept events after it come first. Two messages carry an `event:` name:
//! `missed` (events after `since` that are no longer kept, `{"missed": N}`)
//! and `dropped` (this follower fell behind by more than the supervisor
//! keeps; the stream ends: reconnect with `since` to resume). A comment
//! line every 15 s keeps proxies from closing an idle stream. The stream
//! ends after `server_stopped`; with `?follow=false`, once the kept events
//! are sent.

use std::collections::HashMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::AppState;
use super::error::ApiError;
use crate::supervisor::{EVENT_HISTORY, EventKind, Followed};

/// An idle stream's keep-alive comment.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

pub async fn events(
    State(app): State<AppState>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let given = query
        .get("since")
        .map(|v| ("since", v.as_str()))
        .or_else(|| {
            headers
                .get("last-event-id")
                .and_then(|v| v.to_str().ok())
                .map(|v| ("Last-Event-ID", v))
        });
    let since = match given {
        None => 0,
        Some((what, value)) => value.trim().parse::<u64>().map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!(
                    "`{what}` must be an event number (0 or more), not `{value}`: the `id` of \
                     the last event you saw"
                ),
            )
        })?,
    };
    let keep_following = match query.get("follow").map(String::as_str) {
        None | Some("true" | "1") => true,
        Some("false" | "0") => false,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!("`follow` is `true` or `false`, not `{other}`"),
            ));
        }
    };
    let follow = app.supervisor.events(since);
    let first = (follow.missed > 0).then(|| {
        message(
            Some("missed"),
            None,
            &json!({
                "missed": follow.missed,
                "message": format!(
                    "{} events after {since} are no longer kept (the supervisor keeps the last {EVENT_HISTORY})",
                    follow.missed
                ),
            })
            .to_string(),
        )
    });
    let handover = app.supervisor.handover_signal();
    let stream =
        futures_util::stream::unfold((follow, first, false), move |(mut follow, first, done)| {
            let mut handover = handover.clone();
            async move {
                if let Some(first) = first {
                    return Some((
                        Ok::<_, std::convert::Infallible>(first),
                        (follow, None, done),
                    ));
                }
                if done || (!keep_following && follow.caught_up()) {
                    return None;
                }
                // An upgrade's handover waits for every connection to close: a
                // follower reconnects with `since` (a browser's EventSource does
                // by itself), and the new binary goes on with the numbers.
                let next = tokio::select! {
                    // What happened before the handover (its
                    // `upgrade_started` among it) is sent first.
                    biased;
                    next = tokio::time::timeout(KEEP_ALIVE, follow.next()) => next,
                    _ = handover.wait_for(|h| *h) => return None,
                };
                let next = match next {
                    Err(_) => {
                        return Some((
                            Ok(Bytes::from_static(b": keep-alive\n\n")),
                            (follow, None, false),
                        ));
                    }
                    Ok(next) => next,
                };
                let (bytes, done) = render(next)?;
                Some((Ok(bytes), (follow, None, done)))
            }
        });
    Ok((
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            // Proxies that buffer (nginx) would hold events back.
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// The next message and whether the stream ends after it; `None` when
/// nothing more comes.
fn render(next: Followed) -> Option<(Bytes, bool)> {
    match next {
        Followed::Event(event) => {
            let stops = matches!(event.what, EventKind::ServerStopped);
            let data = serde_json::to_string(&event).unwrap_or_else(|e| {
                json!({"id": event.id, "type": "unrepresentable", "error": e.to_string()})
                    .to_string()
            });
            Some((message(None, Some(event.id), &data), stops))
        }
        Followed::FellBehind(missed) => Some((
            message(
                Some("dropped"),
                None,
                &json!({
                    "missed": missed,
                    "message": format!(
                        "this stream fell {missed} events behind and is closed; reconnect with \
                         `since` set to the last `id` you saw to resume"
                    ),
                })
                .to_string(),
            ),
            true,
        )),
        Followed::Closed => None,
    }
}

/// One SSE message. `data` is JSON: one line, no newline to escape.
fn message(event: Option<&str>, id: Option<u64>, data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + 32);
    if let Some(id) = id {
        out.push_str(&format!("id: {id}\n"));
    }
    if let Some(event) = event {
        out.push_str(&format!("event: {event}\n"));
    }
    out.push_str("data: ");
    out.push_str(data);
    out.push_str("\n\n");
    Bytes::from(out)
}
