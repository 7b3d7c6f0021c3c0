//! llama-swap's API beside berth's, where berth serves a llama-swap config:
//! `/running`, `/unload`, `/api/models/unload[/{id}]`, `/upstream/{model}/…`,
//! `/logs[/stream[/{id}]]`, `/health`, `/api/profiles[/active]`, its
//! `/v1/models`; and, on `/v1` requests, the active profile's pins, the
//! selectors, each model's `filters` and its loading state. Shapes as
//! llama-swap answers them (docs/llama-swap.md). Everything here is behind
//! berth's guard (Host, Origin, token or `apiKeys`), `/health` aside.

use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value as Json, json};

use super::inflight;
use super::layer::{Compat, render_capabilities};
use super::logs::{logs_history, logs_stream};
use super::requests::{by_query, rewrite, upstream};
use super::{known, not_found, states};
use crate::server::AppState;
use crate::server::error::ApiError;
use crate::supervisor::ModelState;

/// The middleware: llama-swap's routes, and its rewriting of `/v1`
/// requests; anything else goes on as it came.
pub(crate) async fn front(State(app): State<AppState>, request: Request, next: Next) -> Response {
    let Some(compat) = app.llama_swap.clone() else {
        return next.run(request).await;
    };
    let path = request.uri().path().to_string();
    let method = request.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/health") => "OK".into_response(),
        (&Method::GET, "/running") => running(&app, &compat),
        (&Method::GET, "/unload") => match unload_all(&app).await {
            Ok(()) => "OK".into_response(),
            Err(e) => e.into_response(),
        },
        (&Method::POST, "/api/models/unload") => match unload_all(&app).await {
            Ok(()) => axum::Json(json!({"msg": "ok"})).into_response(),
            Err(e) => e.into_response(),
        },
        (&Method::GET, "/v1/models" | "/models") => models(&app, &compat),
        (&Method::GET, "/api/profiles") => axum::Json(compat.profiles_json()).into_response(),
        (&Method::PUT, "/api/profiles/active") => set_profile(&compat, request).await,
        (&Method::GET, "/logs") => logs_history(&request),
        (&Method::GET, p) if p == "/logs/stream" || p.starts_with("/logs/stream/") => {
            logs_stream(&app, &request, p.strip_prefix("/logs/stream").unwrap_or(""))
        }
        // berth's own `/api/models/{name}/{action}` for a model named
        // `unload` wins over llama-swap's unload of a model named like
        // the action (which stays reachable as `/api/models/unload` +
        // `/unload` for every other name).
        (&Method::POST, p)
            if p.strip_prefix("/api/models/unload/").is_some_and(|rest| {
                BERTH_ACTIONS.contains(&rest) && app.supervisor.spec("unload").is_some()
            }) =>
        {
            next.run(request).await
        }
        (&Method::POST, p) if p.starts_with("/api/models/unload/") => {
            let id = &p["/api/models/unload/".len()..];
            match known(&app, &compat, id) {
                Some(name) => match stop(&app, &name).await {
                    Ok(()) => "OK".into_response(),
                    Err(e) => e.into_response(),
                },
                None => not_found("model not found"),
            }
        }
        (&Method::GET, "/api/inflight") => axum::Json(compat.inflight.list()).into_response(),
        (&Method::POST, p) if p.starts_with("/api/inflight/") && p.ends_with("/cancel") => {
            let id = &p["/api/inflight/".len()..p.len() - "/cancel".len()];
            match id.parse::<u64>() {
                Ok(id) if compat.inflight.cancel(id) => {
                    axum::Json(json!({"msg": "ok"})).into_response()
                }
                _ => not_found("inflight request not found"),
            }
        }
        (_, p) if p.starts_with("/upstream/") => {
            let (tracked, request) = tracked(&compat, request);
            inflight::run(tracked, upstream(&app, &compat, request)).await
        }
        (&Method::POST, p)
            if p.starts_with("/v1/") || crate::server::relay::model_route(&method, p).is_some() =>
        {
            let (tracked, request) = tracked(&compat, request);
            inflight::run(tracked, rewrite(app, compat, request, next)).await
        }
        (&Method::GET | &Method::HEAD, p)
            if crate::server::relay::model_route(&method, p).is_some() =>
        {
            let (tracked, request) = tracked(&compat, request);
            inflight::run(tracked, by_query(&app, &compat, request, next)).await
        }
        _ => next.run(request).await,
    }
}

/// `request` in the in-flight list, its ID in its extensions (so the
/// handler can say which model it is for).
fn tracked(compat: &Compat, mut request: Request) -> (inflight::Tracked, Request) {
    let tracked = compat
        .inflight
        .track(request.method().as_str(), request.uri().path());
    request
        .extensions_mut()
        .insert(inflight::InflightId(tracked.id));
    (tracked, request)
}

/// berth's actions on one model (`/api/models/{name}/{action}`).
const BERTH_ACTIONS: &[&str] = &["load", "unload", "swap", "infer", "sleep", "wake"];

/// llama-swap's word for a model's state, where it runs.
fn running_state(state: ModelState) -> Option<&'static str> {
    match state {
        ModelState::Loading => Some("starting"),
        ModelState::Ready => Some("ready"),
        ModelState::Draining | ModelState::Stopping => Some("stopping"),
        // llama-swap's word for a server put to sleep.
        ModelState::Asleep => Some("sleeping"),
        ModelState::Unloaded | ModelState::Queued | ModelState::Failed => None,
    }
}

fn running(app: &AppState, compat: &Compat) -> Response {
    let config = app.supervisor.config();
    let mut out = Vec::new();
    for (name, (state, spec)) in states(app) {
        let Some(state) = running_state(state) else {
            continue;
        };
        let extras = compat.models.get(&name);
        let kind = spec.worker.as_ref().and_then(|k| config.workers.get(k));
        let cmd = kind
            .and_then(|k| k.command.as_ref())
            .map(|c| c.join(" "))
            .unwrap_or_default();
        let http = spec.http_spec(&config);
        // Where the server is reached: its host (a compose service, another
        // loopback address), else 127.0.0.1.
        let host = match http.as_ref().and_then(|h| h.host.as_deref()) {
            Some(h) if h.contains(':') && !h.starts_with('[') => format!("[{h}]"),
            Some(h) => h.to_string(),
            None => "127.0.0.1".into(),
        };
        let proxy = match http.and_then(|h| h.port) {
            Some(port) => format!("http://{host}:{port}"),
            None => format!("http://{host}:${{PORT}}"),
        };
        let listing = extras.map(|e| e.listing.clone()).unwrap_or_default();
        out.push(json!({
            "model": if listing.id.is_empty() { name.clone() } else { listing.id.clone() },
            "state": state,
            "cmd": cmd,
            "proxy": proxy,
            "ttl": spec.keep_alive.filter(|k| *k < crate::config::MAX_DURATION).map_or(0, |k| k.as_secs()),
            "name": listing.name.unwrap_or_default(),
            "description": listing.description.unwrap_or_default(),
        }));
    }
    out.sort_by(|a, b| a["model"].as_str().cmp(&b["model"].as_str()));
    axum::Json(json!({ "running": out })).into_response()
}

/// Unloads every model that runs, together; waits for them.
async fn unload_all(app: &AppState) -> Result<(), ApiError> {
    let names: Vec<String> = states(app)
        .into_iter()
        .filter(|(_, (s, _))| running_state(*s).is_some())
        .map(|(n, _)| n)
        .collect();
    let stops = names.iter().map(|n| stop(app, n));
    let failed: Vec<String> = futures_util::future::join_all(stops)
        .await
        .into_iter()
        .filter_map(Result::err)
        .map(|e| e.message)
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        Err(ApiError::new(
            StatusCode::CONFLICT,
            "busy",
            failed.join("; "),
        ))
    }
}

/// Unloads `model`: one that is loading or being swapped is waited for
/// (as long as a drain and a stop take), then stopped; not running is done.
async fn stop(app: &AppState, model: &str) -> Result<(), ApiError> {
    let config = app.supervisor.config();
    let deadline = Instant::now() + config.drain_timeout + Duration::from_secs(60);
    loop {
        match app.supervisor.unload(model).await {
            Ok(_) | Err(crate::error::Error::NotLoaded { .. }) => return Ok(()),
            Err(crate::error::Error::Busy { .. }) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(ApiError::from(e)),
        }
    }
}

fn models(app: &AppState, compat: &Compat) -> Response {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let states = states(app);
    let mut data: Vec<Json> = Vec::new();
    for (name, (state, spec)) in &states {
        let extras = compat.models.get(name);
        let listing = extras.map(|e| e.listing.clone()).unwrap_or_default();
        if listing.unlisted {
            continue;
        }
        let id = if listing.id.is_empty() {
            name.clone()
        } else {
            listing.id.clone()
        };
        let loaded = running_state(*state).is_some();
        let record = |id: &str, meta: Json| {
            let mut r = Map::new();
            r.insert("id".into(), json!(id));
            r.insert("object".into(), json!("model"));
            r.insert("created".into(), json!(created));
            r.insert("owned_by".into(), json!("llama-swap"));
            if let Some(n) = &listing.name {
                r.insert("name".into(), json!(n));
            }
            if let Some(d) = &listing.description {
                r.insert("description".into(), json!(d));
            }
            let mut meta = meta;
            if let Some(Json::Object(user)) = &listing.metadata {
                let mut merged = user.clone();
                if listing.capabilities.is_some() {
                    for k in [
                        "architecture",
                        "capabilities",
                        "supported_parameters",
                        "context_length",
                    ] {
                        merged.remove(k);
                    }
                }
                if let Json::Object(internal) = meta {
                    merged.extend(internal);
                }
                meta = Json::Object(merged);
            }
            if let Some(caps) = &listing.capabilities {
                render_capabilities(caps, &mut r);
            }
            let mut m = json!({"llamaswap": meta});
            if let Some(c) = r.get("context_length") {
                m["n_ctx"] = c.clone();
            }
            r.insert("meta".into(), m);
            r.insert(
                "status".into(),
                json!({"value": if loaded { "loaded" } else { "unloaded" }}),
            );
            // berth's own fields, as in its plain /v1/models.
            r.insert("backend".into(), json!(spec.backend));
            r.insert("state".into(), json!(state));
            Json::Object(r)
        };
        let aliases: Vec<&String> = listing.aliases.iter().filter(|a| **a != id).collect();
        let mut meta = json!({"type": "model"});
        if !aliases.is_empty() {
            meta["aliases"] = json!(aliases);
        }
        data.push(record(&id, meta));
        if compat.include_aliases {
            for alias in aliases {
                data.push(record(alias, json!({"type": "alias", "modelID": id})));
            }
        }
    }
    for (id, s) in &compat.selectors {
        if s.unlisted {
            continue;
        }
        let target_state = |t: &str| states.get(&app.supervisor.canonical(t)).map(|(s, _)| *s);
        let checked = match s.strategy {
            super::layer::Strategy::Pin => &s.targets[..1],
            _ => &s.targets[..],
        };
        let loaded = checked.iter().any(|t| {
            matches!(
                target_state(t),
                Some(ModelState::Ready | ModelState::Loading)
            )
        });
        let mut meta = json!({"type": "selector", "targets": s.targets});
        meta["strategy"] = json!(match s.strategy {
            super::layer::Strategy::Pin => "pin",
            super::layer::Strategy::Warm => "warm",
            super::layer::Strategy::Spillover(n) => {
                meta["spillover"] = json!(n);
                "spillover"
            }
        });
        if let Some(Json::Object(user)) = &s.metadata {
            let mut merged = user.clone();
            if let Json::Object(internal) = meta {
                merged.extend(internal);
            }
            meta = Json::Object(merged);
        }
        let mut r = json!({"id": id, "object": "model", "created": created, "owned_by": "llama-swap",
            "meta": {"llamaswap": meta}, "status": {"value": if loaded { "loaded" } else { "unloaded" }}});
        if let Some(n) = &s.name {
            r["name"] = json!(n);
        }
        if let Some(d) = &s.description {
            r["description"] = json!(d);
        }
        data.push(r);
    }
    if let Some(active) = compat.active_profile()
        && let Some(profile) = compat.profiles.get(&active)
    {
        for (pin, target) in &profile.pins {
            let shadowed = known(app, compat, pin).is_some() || compat.selectors.contains_key(pin);
            if target.is_some() && !shadowed {
                data.push(json!({"id": pin, "object": "model", "created": created,
                    "owned_by": "llama-swap", "meta": {"llamaswap": {"type": "profile"}},
                    "status": {"value": "unloaded"}}));
            }
        }
    }
    // A peer's models, as `PEER/MODEL` (llama-swap lists no bare name).
    for (peer, model) in compat.peers.qualified() {
        data.push(
            json!({"id": format!("{}/{model}", peer.id), "object": "model",
            "created": created, "owned_by": "llama-swap", "name": format!("{}: {model}", peer.id),
            "meta": {"llamaswap": {"type": "peer", "peerID": peer.id}},
            "status": {"value": "unloaded"}}),
        );
    }
    data.sort_by(|a, b| a["id"].as_str().cmp(&b["id"].as_str()));
    let mut response = axum::Json(json!({"object": "list", "data": data})).into_response();
    response
        .extensions_mut()
        .insert(crate::server::relay::Relayed);
    response
}

async fn set_profile(compat: &Compat, request: Request) -> Response {
    let bytes = axum::body::to_bytes(request.into_body(), usize::MAX)
        .await
        .unwrap_or_default();
    let bad = |m: &str| ApiError::bad_request(m.to_string()).into_response();
    let Ok(Json::Object(body)) = serde_json::from_slice::<Json>(&bytes) else {
        return bad("invalid profile request");
    };
    let name = match body.get("name") {
        None => return bad("profile name is required"),
        Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s.as_str()),
        Some(_) => return bad("profile name must be a string or null"),
    };
    match compat.set_active(name) {
        Ok(()) => axum::Json(json!({"active": compat.active_profile()})).into_response(),
        Err(e) => not_found(&e),
    }
}
