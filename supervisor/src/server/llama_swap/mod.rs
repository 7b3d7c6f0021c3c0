//! llama-swap's HTTP API over berth (`berth serve --llama-swap`): its
//! routes (`/running`, `/unload`, `/upstream/{model}/…`, `/logs`, …) and
//! the request rewriting its config asks for (`api.rs`), and the layer its
//! config becomes: profiles, selectors, filters, listing (`layer.rs`). The
//! file itself is read by the daemon (`daemon/llama_swap/`).

pub mod api;
mod filters;
pub mod inflight;
pub mod layer;
mod logs;
pub mod peers;
mod requests;

use std::collections::BTreeMap;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::server::AppState;
use crate::server::error::ApiError;
use crate::supervisor::ModelState;
use layer::Compat;

/// llama-swap's error shape: `{"error": {"message", "type", "code"}}`.
pub(super) fn not_found(message: &str) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", message.to_string()).into_response()
}

/// A model's berth name from its llama-swap ID, an alias, or its name.
pub(super) fn known(app: &AppState, compat: &Compat, id: &str) -> Option<String> {
    let name = compat
        .models
        .iter()
        .find(|(_, e)| e.listing.id == id)
        .map(|(n, _)| n.clone())
        .unwrap_or_else(|| app.supervisor.canonical(id));
    app.supervisor.model_state(&name).map(|_| name)
}

pub(super) fn states(app: &AppState) -> BTreeMap<String, (ModelState, crate::config::ModelSpec)> {
    app.supervisor
        .catalogue()
        .into_iter()
        .map(|e| (e.spec.name.clone(), (e.state, e.spec)))
        .collect()
}
