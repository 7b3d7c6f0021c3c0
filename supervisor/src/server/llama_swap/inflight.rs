//! llama-swap's in-flight requests: each request for a model gets an ID
//! (a counter from 1, as llama-swap's), listed at `GET /api/inflight`
//! (llama-swap shows them in its UI's event stream; berth lists them) and
//! cancelled by `POST /api/inflight/{id}/cancel`: a request waiting for its
//! turn or its model's load stops waiting, one being relayed is cut (its
//! connection to the server closed, so the server stops working on it),
//! and a stream ends where it is.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value as Json, json};
use tokio::sync::Notify;

use crate::server::error::ApiError;

#[derive(Debug)]
struct Entry {
    method: String,
    path: String,
    model: Option<String>,
    started: Instant,
    cancel: Arc<Notify>,
}

/// A request's in-flight ID, in its extensions (so a handler can say
/// which model it is for).
#[derive(Debug, Clone, Copy)]
pub(crate) struct InflightId(pub u64);

/// The requests in flight, by ID.
#[derive(Default)]
pub struct Inflight {
    next: AtomicU64,
    entries: Arc<Mutex<BTreeMap<u64, Entry>>>,
}

impl std::fmt::Debug for Inflight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inflight").finish_non_exhaustive()
    }
}

/// A request's place in the list; dropped when its answer is done.
#[derive(Debug)]
pub struct Tracked {
    pub id: u64,
    cancel: Arc<Notify>,
    entries: Arc<Mutex<BTreeMap<u64, Entry>>>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        lock(&self.entries).remove(&self.id);
    }
}

fn lock(entries: &Mutex<BTreeMap<u64, Entry>>) -> std::sync::MutexGuard<'_, BTreeMap<u64, Entry>> {
    entries.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inflight {
    /// A new request, `method path`.
    pub fn track(&self, method: &str, path: &str) -> Tracked {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let cancel = Arc::new(Notify::new());
        lock(&self.entries).insert(
            id,
            Entry {
                method: method.to_string(),
                path: path.to_string(),
                model: None,
                started: Instant::now(),
                cancel: Arc::clone(&cancel),
            },
        );
        Tracked {
            id,
            cancel,
            entries: Arc::clone(&self.entries),
        }
    }

    /// Says which model request `id` is for, once it is known.
    pub fn set_model(&self, id: u64, model: &str) {
        if let Some(entry) = lock(&self.entries).get_mut(&id) {
            entry.model = Some(model.to_string());
        }
    }

    /// Cancels request `id`; `false` if it is not in flight.
    pub fn cancel(&self, id: u64) -> bool {
        match lock(&self.entries).get(&id) {
            Some(entry) => {
                // A stored permit: a request between its waits still sees it.
                entry.cancel.notify_one();
                true
            }
            None => false,
        }
    }

    /// `GET /api/inflight`.
    pub fn list(&self) -> Json {
        let entries = lock(&self.entries);
        let list: Vec<Json> = entries
            .iter()
            .map(|(id, e)| {
                json!({
                    "id": id.to_string(),
                    "model": e.model,
                    "method": e.method,
                    "req_path": e.path,
                    "elapsed_ms": e.started.elapsed().as_millis() as u64,
                })
            })
            .collect();
        json!({ "requests": list })
    }
}

/// `answer` run for `tracked`'s request: cut where it is if the request is
/// cancelled, its entry kept until its body is done.
pub async fn run<F>(tracked: Tracked, answer: F) -> Response
where
    F: std::future::Future<Output = Response>,
{
    let cancel = Arc::clone(&tracked.cancel);
    let cancelled = || {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "cancelled",
            format!(
                "request {} was cancelled (POST /api/inflight/{}/cancel)",
                tracked.id, tracked.id
            ),
        )
        .into_response()
    };
    let response = tokio::select! {
        response = answer => response,
        () = cancel.notified() => return cancelled(),
    };
    let (head, body) = response.into_parts();
    let stop = async move { cancel.notified().await };
    let body = body
        .into_data_stream()
        .take_until(Box::pin(stop))
        .map(move |chunk| {
            let _held = &tracked;
            chunk
        });
    Response::from_parts(head, Body::from_stream(body))
}
