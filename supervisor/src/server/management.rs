//! The management API: what is loaded, the catalogue, load / unload / swap,
//! and `infer` for any backend.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;
use super::error::{ApiError, parse};
use super::openai::{KeepAliveField, request_options};
use crate::{Body, ModelSpec};

/// Reads every worker's procfs off the async runtime (and the supervisor
/// reads it outside its state lock), so polling `ps` slows no request.
pub async fn ps(State(app): State<AppState>) -> Result<Json<Value>, ApiError> {
    let supervisor = app.supervisor.clone();
    let stats = tokio::task::spawn_blocking(move || supervisor.stats())
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    Ok(Json(json!({ "models": stats })))
}

/// Each GPU's memory and berth's workers on it; `unavailable` says why
/// there is none.
pub async fn gpus(State(app): State<AppState>) -> Json<Value> {
    let supervisor = app.supervisor.clone();
    // NVML calls block for milliseconds.
    let status = tokio::task::spawn_blocking(move || supervisor.gpus())
        .await
        .unwrap_or_else(|e| crate::gpu::GpuStatus {
            unavailable: Some(format!("reading the GPUs failed: {e}")),
            devices: Vec::new(),
        });
    Json(json!(status))
}

pub async fn catalogue(State(app): State<AppState>) -> Json<Value> {
    Json(json!({ "models": app.supervisor.catalogue() }))
}

/// Fields only the operator sets (the config, the CLI's own flags, the
/// embedding host): which program runs, its environment, its directory.
/// An HTTP client names a declared worker kind (`worker`) instead.
const OPERATOR_ONLY: &[&str] = &["worker_binary", "env", "command", "cwd"];

/// A spec in a request body; the name comes from the path.
pub(crate) fn spec_from(name: &str, body: &[u8]) -> Result<ModelSpec, ApiError> {
    let mut value: Value = parse(body)?;
    let object = value
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))?;
    if let Some(field) = OPERATOR_ONLY.iter().find(|f| object.contains_key(**f)) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "operator_only",
            format!(
                "model `{name}`: `{field}` cannot be set over HTTP: which program a worker runs, \
                 and with what environment, is the operator's choice; declare a worker kind in \
                 the config (`[workers.NAME]`) and name it here with `\"worker\": \"NAME\"`"
            ),
        ));
    }
    if let Some(given) = object.get("name").and_then(Value::as_str)
        && given != name
    {
        return Err(ApiError::bad_request(format!(
            "the body names model `{given}` but the path names `{name}`"
        )));
    }
    object.insert("name".into(), Value::String(name.into()));
    serde_path_to_error::deserialize(value).map_err(|e| {
        ApiError::bad_request(format!(
            "model `{name}`: invalid spec: {}: {}",
            e.path(),
            e.inner()
        ))
    })
}

pub async fn register(
    State(app): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec = app.confine(spec_from(&name, &body)?)?;
    app.supervisor.register(spec)?;
    let entry = app
        .supervisor
        .catalogue()
        .into_iter()
        .find(|e| e.spec.name == name);
    Ok((StatusCode::CREATED, Json(json!(entry))).into_response())
}

pub async fn deregister(
    State(app): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let unload = app.supervisor.deregister(&name).await?;
    Ok(Json(json!({ "removed": name, "unload": unload })))
}

pub async fn load(
    State(app): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(app.supervisor.load_registered(&name).await?)))
}

pub async fn unload(
    State(app): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(app.supervisor.unload(&name).await?)))
}

pub async fn swap(
    State(app): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let spec = app.confine(spec_from(&name, &body)?)?;
    Ok(Json(json!(app.supervisor.swap(spec).await?)))
}

/// Passes the JSON body to the backend as its request; answers with the
/// backend's JSON. `?keep_alive=` applies as on the OpenAI endpoints.
pub async fn infer(
    State(app): State<AppState>,
    Path(name): Path<String>,
    axum::extract::Query(query): axum::extract::Query<InferQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let _: Value = parse(&body)?;
    let json = String::from_utf8(body.to_vec())
        .map_err(|_| ApiError::bad_request("the body is not UTF-8"))?;
    let options = request_options(query.keep_alive.as_ref(), query.timeout.as_ref())?;
    let reply = app
        .supervisor
        .request_with(&name, Body::json(json), options)
        .await?;
    Ok(([(header::CONTENT_TYPE, "application/json")], reply.json).into_response())
}

#[derive(Debug, serde::Deserialize)]
pub struct InferQuery {
    #[serde(default)]
    keep_alive: Option<KeepAliveField>,
    #[serde(default)]
    timeout: Option<KeepAliveField>,
}
