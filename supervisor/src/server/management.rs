//! The management API: what is loaded, the catalogue, load / unload /
//! swap (`infer`, any backend's own request, has its own file).

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::AppState;
use super::error::{ApiError, parse};
use crate::config::ModelSpec;

/// Reads every worker's procfs off the async runtime (and the supervisor
/// reads it outside its state lock), so polling `ps` slows no request.
pub async fn ps(State(app): State<AppState>) -> Result<Json<Value>, ApiError> {
    let supervisor = app.supervisor.clone();
    let (stats, preloaders) =
        tokio::task::spawn_blocking(move || (supervisor.stats(), supervisor.preloaders()))
            .await
            .map_err(|e| {
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            })?;
    let mut answer = json!({ "models": stats, "preloaders": preloaders });
    // Models another server serves (a llama-swap file's `peers`): no
    // process here, so nothing to measure or prove.
    if let Some(compat) = &app.llama_swap
        && !compat.peers.is_empty()
    {
        answer["peers"] = compat.peers.status();
    }
    Ok(Json(answer))
}

/// Memory over time (`?since_ms=`: only the samples after that moment).
pub async fn history(
    State(app): State<AppState>,
    axum::extract::Query(query): axum::extract::Query<std::collections::HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let since = match query.get("since_ms") {
        None => 0,
        Some(v) => v.trim().parse::<u64>().map_err(|_| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                "bad_request",
                format!(
                    "`since_ms` must be a time in Unix milliseconds (the last sample's \
                     `at_unix_ms`), not `{v}`"
                ),
            )
        })?,
    };
    Ok(Json(json!(app.supervisor.history(since))))
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
const OPERATOR_ONLY: &[&str] = &["worker_binary", "env", "command", "cwd", "http"];

/// An operator-only field `field` given over HTTP.
fn operator_only(name: &str, field: &str) -> ApiError {
    ApiError::new(
        StatusCode::FORBIDDEN,
        "operator_only",
        format!(
            "model `{name}`: `{field}` cannot be set over HTTP: which program a worker runs, \
             and with what environment, is the operator's choice; declare a worker kind in \
             the config (`[workers.NAME]`) and name it here with `\"worker\": \"NAME\"`"
        ),
    )
}

/// True for a value that sets nothing: `null`, `[]`, `{}`, `""` (what a
/// spec read from `/api/models` holds for a field the operator left unset).
fn is_unset(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

/// A spec in a request body; the name comes from the path. An
/// operator-only field may appear only unset.
pub(crate) fn spec_from(name: &str, body: &[u8]) -> Result<ModelSpec, ApiError> {
    spec_over(name, body_value(name, body)?, None)
}

/// A spec body as JSON, bounded before it is parsed.
fn body_value(name: &str, body: &[u8]) -> Result<Value, ApiError> {
    if body.len() > MAX_SPEC_BODY {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!(
                "model `{name}`: the spec is {} bytes; a model spec is at most {MAX_SPEC_BODY} \
                 (64 options, 64 aliases)",
                body.len()
            ),
        ));
    }
    parse(body)
}

/// [`spec_from`] for a swap: the operator's fields are `registered`'s. A
/// body may repeat them as they are (a client that read the spec from
/// `/api/models` and posts it back changed), or leave them out, but never
/// change them.
fn swap_spec_from(name: &str, body: Value, registered: &ModelSpec) -> Result<ModelSpec, ApiError> {
    let mut spec = spec_over(name, body, Some(registered))?;
    // What the body leaves out is the registered model's: its worker kind
    // (an HTTP server's too) and backend.
    if spec.worker.is_none() {
        spec.worker = registered.worker.clone();
    }
    if spec.backend.is_empty() {
        spec.backend = registered.backend.clone();
    }
    if spec.worker != registered.worker
        && (registered.command.is_some() || registered.worker_binary.is_some())
    {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "operator_only",
            format!(
                "model `{name}` runs the program its operator named for it (`{}`); a swap \
                 over HTTP keeps that program and cannot name a worker kind instead",
                if registered.command.is_some() {
                    "command"
                } else {
                    "worker_binary"
                }
            ),
        ));
    }
    spec.worker_binary = registered.worker_binary.clone();
    spec.env = registered.env.clone();
    spec.command = registered.command.clone();
    spec.cwd = registered.cwd.clone();
    spec.http = registered.http.clone();
    Ok(spec)
}

/// The largest body a registration or a swap takes: a spec at its limits
/// (64 options of 4 KiB, 64 aliases) is under 300 KiB. Checked before the
/// body is parsed, so a client cannot make berth parse a 16 MiB spec.
const MAX_SPEC_BODY: usize = 1 << 20;

fn spec_over(
    name: &str,
    mut value: Value,
    registered: Option<&ModelSpec>,
) -> Result<ModelSpec, ApiError> {
    let object = value
        .as_object_mut()
        .ok_or_else(|| ApiError::bad_request("the body must be a JSON object"))?;
    let current = registered.map(|spec| serde_json::to_value(spec).unwrap_or_default());
    for field in OPERATOR_ONLY {
        let Some(given) = object.remove(*field) else {
            continue;
        };
        let as_registered = current.as_ref().is_some_and(|c| c[*field] == given);
        if !is_unset(&given) && !as_registered {
            return Err(operator_only(name, field));
        }
    }
    if let Some(given) = object.get("name").and_then(Value::as_str)
        && given != name
    {
        return Err(ApiError::bad_request(format!(
            "the body names model `{}` but the path names `{}`",
            crate::input::quote(given),
            crate::input::quote(name)
        )));
    }
    object.insert("name".into(), Value::String(name.into()));
    serde_path_to_error::deserialize(value).map_err(|e| {
        ApiError::bad_request(format!(
            "model `{}`: invalid spec: {}: {}",
            crate::input::quote(name),
            crate::input::quote(&e.path().to_string()),
            crate::input::quote(&e.inner().to_string())
        ))
    })
}

pub async fn register(
    State(app): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let spec = app.confine(app.allowed(spec_from(&name, &body)?)?)?;
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

/// Puts a model to sleep (`sleep = "driver"`): its GPU memory moved to its
/// host memory, its process kept; the report proves it by NVML.
pub async fn sleep(
    State(app): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(app.supervisor.sleep(&name).await?)))
}

/// Wakes a sleeping model (a request for it does too).
pub async fn wake(
    State(app): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    Ok(Json(json!(app.supervisor.wake(&name).await?)))
}

/// Swaps a model for the spec in the body. The program, environment and
/// folder stay the registered model's (see [`swap_spec_from`]); weights
/// that are the registered ones stay as the operator placed them, new ones
/// must lie inside `models_dir`. A model that is not loaded has its spec
/// updated, and with `"load": true` in the body is loaded with it.
pub async fn swap(
    State(app): State<AppState>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let registered = app
        .supervisor
        .catalogue()
        .into_iter()
        .find(|e| e.spec.name == name)
        .map(|e| e.spec)
        .ok_or_else(|| ApiError::from(app.supervisor.unknown(&name)))?;
    let mut body = body_value(&name, &body)?;
    // `"load": true`: a model not loaded is loaded with its new spec too.
    let load = match body.as_object_mut().and_then(|o| o.remove("load")) {
        None | Some(Value::Null) => false,
        Some(Value::Bool(load)) => load,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "model `{name}`: `load` is true or false, not {other}"
            )));
        }
    };
    let mut spec = swap_spec_from(&name, body, &registered)?;
    // The operator's own test models may be swapped as they are; a client
    // may not turn a model into a test double, nor change one's options,
    // unless test doubles are allowed.
    if !(spec.backend == registered.backend && spec.options == registered.options) {
        spec = app.allowed(spec)?;
    }
    if spec.model.is_some() && spec.model == registered.model {
        spec.confine = registered.confine.clone();
    } else {
        spec = app.confine(spec)?;
    }
    Ok(Json(json!(app.supervisor.swap_with(spec, load).await?)))
}

/// `POST /api/reload`'s query.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadQuery {
    /// A config with no models may replace one with some (every model is
    /// then unloaded and deregistered).
    #[serde(default)]
    allow_empty: bool,
}

/// Reads the config files again and applies them (as `SIGHUP` does): what
/// changed, or why nothing did.
pub async fn reload(
    State(app): State<AppState>,
    axum::extract::Query(query): axum::extract::Query<ReloadQuery>,
) -> Result<Json<Value>, ApiError> {
    let no_config = || {
        ApiError::new(
            StatusCode::CONFLICT,
            "no_config",
            "this berth serve has no config file to reload: start it with --config (or \
             --llama-swap)",
        )
    };
    let Some(controls) = app.controls.as_ref().and_then(std::sync::Weak::upgrade) else {
        return Err(no_config());
    };
    match controls.reload("POST /api/reload", query.allow_empty).await {
        None => Err(no_config()),
        Some(Ok(report)) => Ok(Json(json!(report))),
        Some(Err(why)) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_config",
            format!("the config was not reloaded, nothing changed: {why}"),
        )),
    }
}

/// Upgrades berth in place to the binary it was started from, as the file
/// is now (`berth upgrade`): answered once the new binary has passed its
/// check (202), before the handover, which then waits for this request's
/// connection to close like every other. A request that names a binary is
/// refused: which program runs is the operator's choice, not a client's.
pub async fn upgrade(State(app): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    if !body.iter().all(u8::is_ascii_whitespace) {
        let named: Value = parse(&body)?;
        if named.get("binary").is_some_and(|b| !b.is_null()) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "binary_not_allowed",
                "an HTTP client does not choose which program berth runs: replace the binary \
                 berth was started from and ask again, or name one with `berth upgrade \
                 --binary PATH` on the server's host (as its user: it signals berth)",
            ));
        }
    }
    let Some(controls) = app.controls.as_ref().and_then(std::sync::Weak::upgrade) else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_upgrades",
            "this server does not upgrade in place",
        ));
    };
    match controls.upgrade("POST /api/upgrade").await {
        Ok(accepted) => Ok((
            StatusCode::ACCEPTED,
            Json(json!({
                "upgrading": true,
                "from": crate::base::this_build(),
                "to": accepted.to,
            })),
        )
            .into_response()),
        Err(why) => Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "upgrade_refused",
            format!("berth was not upgraded, nothing changed: {why}"),
        )),
    }
}

/// Which berth this is: its version and build mark, its pid, its state
/// file (where `berth upgrade --binary` leaves its request), and the
/// number of its last event (what a follower of an upgrade starts after).
pub async fn version(State(app): State<AppState>) -> Json<Value> {
    Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "build": crate::base::build_mark(),
        "pid": std::process::id(),
        "state_file": crate::child::orphans::state_file(),
        "last_event": app.supervisor.last_event_id(),
        "handover_versions": app
            .controls
            .as_ref()
            .and_then(std::sync::Weak::upgrade)
            .map_or(&[][..], |c| c.handover_versions()),
    }))
}
