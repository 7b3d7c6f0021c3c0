//! llama-swap's API beside berth's, where berth serves a llama-swap config:
//! `/running`, `/unload`, `/api/models/unload[/{id}]`, `/upstream/{model}/…`,
//! `/logs[/stream[/{id}]]`, `/health`, `/api/profiles[/active]`, its
//! `/v1/models`; and, on `/v1` requests, the active profile's pins, the
//! selectors, each model's `filters` and its loading state. Shapes as
//! llama-swap answers them (docs/llama-swap.md). Everything here is behind
//! berth's guard (Host, Origin, token or `apiKeys`), `/health` aside.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Map, Value as Json, json};

use super::layer::{Compat, TargetState, render_capabilities};
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
        (_, p) if p.starts_with("/upstream/") => upstream(&app, &compat, request).await,
        (&Method::POST, p) if p.starts_with("/v1/") => rewrite(app, compat, request, next).await,
        _ => next.run(request).await,
    }
}

/// llama-swap's error shape: `{"error": {"message", "type", "code"}}`.
fn not_found(message: &str) -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", message.to_string()).into_response()
}

/// A model's berth name from its llama-swap ID, an alias, or its name.
fn known(app: &AppState, compat: &Compat, id: &str) -> Option<String> {
    let name = compat
        .models
        .iter()
        .find(|(_, e)| e.listing.id == id)
        .map(|(n, _)| n.clone())
        .unwrap_or_else(|| app.supervisor.canonical(id));
    app.supervisor.model_state(&name).map(|_| name)
}

fn states(app: &AppState) -> BTreeMap<String, (ModelState, crate::config::ModelSpec)> {
    app.supervisor
        .catalogue()
        .into_iter()
        .map(|e| (e.spec.name.clone(), (e.state, e.spec)))
        .collect()
}

/// llama-swap's word for a model's state, where it runs.
fn running_state(state: ModelState) -> Option<&'static str> {
    match state {
        ModelState::Loading => Some("starting"),
        ModelState::Ready => Some("ready"),
        ModelState::Draining | ModelState::Stopping => Some("stopping"),
        ModelState::Unloaded | ModelState::Failed => None,
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
        let proxy = match spec.http_spec(&config).and_then(|h| h.port) {
            Some(port) => format!("http://127.0.0.1:{port}"),
            None => "http://127.0.0.1:${PORT}".into(),
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

fn logs_history(request: &Request) -> Response {
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
fn logs_stream(app: &AppState, request: &Request, id: &str) -> Response {
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

/// The most `/`-separated parts a model ID is looked for in.
const MAX_ID_SEGMENTS: usize = 8;

/// `/upstream/{model}/{path}`: the model's server's own route, loaded
/// first as llama-swap does. The model is the longest leading run of the
/// path's segments that names one (or a pin of the active profile).
async fn upstream(app: &AppState, compat: &Compat, request: Request) -> Response {
    let path = request.uri().path()["/upstream/".len()..].to_string();
    let segments: Vec<&str> = path.split('/').collect();
    let mut found = None;
    // A model ID has a few `/` at most: the path past them is the route's.
    for end in (1..=segments.len().min(MAX_ID_SEGMENTS)).rev() {
        let candidate = segments[..end].join("/");
        if candidate.is_empty() {
            continue;
        }
        // The active profile's pins apply here too, as in llama-swap.
        let target = match compat.pin(&candidate) {
            Some(Some(target)) => target,
            Some(None) => return not_found("no model id could be identified"),
            None => candidate.clone(),
        };
        if let Some(name) = known(app, compat, &target) {
            found = Some((name, candidate, segments[end..].join("/")));
            break;
        }
    }
    let Some((name, matched, rest)) = found else {
        return not_found("model not found");
    };
    let query = request
        .uri()
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    if rest.is_empty() && !path.ends_with('/') {
        let status = if matches!(*request.method(), Method::GET | Method::HEAD) {
            StatusCode::MOVED_PERMANENTLY
        } else {
            StatusCode::PERMANENT_REDIRECT
        };
        let to = format!("/upstream/{matched}/{query}");
        return (status, [(header::LOCATION, to)]).into_response();
    }
    if !app.supervisor.is_http_model(&name) {
        return ApiError::bad_request(format!(
            "model `{name}` is served by a berth worker, which has no routes of its own"
        ))
        .into_response();
    }
    let uri: Uri = match format!("/{rest}{query}").parse() {
        Ok(uri) => uri,
        Err(_) => return ApiError::bad_request("the path is not a valid URI").into_response(),
    };
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    crate::server::relay::relay(
        app,
        &name,
        &parts.method,
        &uri,
        &parts.headers,
        bytes,
        false,
    )
    .await
}

/// A `/v1` request: the active profile's pin, then a selector, then the
/// model's `filters` and its loading state.
async fn rewrite(app: AppState, compat: Arc<Compat>, request: Request, next: Next) -> Response {
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.contains("application/json"));
    if !json {
        return next.run(request).await;
    }
    let (mut parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let Ok(Json::Object(mut body)) = serde_json::from_slice::<Json>(&bytes) else {
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    let Some(mut requested) = body.get("model").and_then(Json::as_str).map(str::to_string) else {
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    if let Some(pin) = compat.pin(&requested) {
        match pin {
            Some(target) => requested = target,
            None => return not_found("no model id could be identified"),
        }
    }
    let mut spill = None;
    if compat.selectors.contains_key(&requested) {
        let state = |t: &str| match app.supervisor.model_state(&app.supervisor.canonical(t)) {
            Some(ModelState::Ready) => TargetState::Ready,
            Some(ModelState::Loading) => TargetState::Starting,
            Some(ModelState::Draining | ModelState::Stopping) => TargetState::Stopping,
            _ => TargetState::Idle,
        };
        match compat.select(&requested, &state) {
            Ok(picked) => {
                requested = picked.target;
                spill = picked.spill;
            }
            Err(e) => {
                return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", e)
                    .into_response();
            }
        }
    }
    let name = app.supervisor.canonical(&requested);
    let extras = compat.models.get(&name);
    let renamed = body.get("model").and_then(Json::as_str) != Some(requested.as_str());
    let filtered = extras.is_some_and(|e| !e.filters.is_empty());
    // The body as it came, unless a pin, a selector or filters change it.
    let bytes = if renamed || filtered {
        body.insert("model".into(), Json::String(requested.clone()));
        if let Some(extras) = extras {
            extras.filters.apply(&requested, &mut body);
        }
        parts.headers.remove(header::CONTENT_LENGTH);
        Bytes::from(serde_json::to_vec(&Json::Object(body.clone())).unwrap_or_default())
    } else {
        bytes
    };
    let streaming = body.get("stream").and_then(Json::as_bool).unwrap_or(false);
    let loading = extras.is_some_and(|e| e.loading_state)
        && streaming
        && parts.uri.path().starts_with("/v1/chat/completions")
        && app.supervisor.model_state(&name) != Some(ModelState::Ready);
    let request = Request::from_parts(parts, Body::from(bytes));
    let response = if loading {
        loading_then(app, name, request, next).await
    } else {
        next.run(request).await
    };
    match spill {
        None => response,
        // Counted until the answer's body is done.
        Some(spill) => {
            let (head, body) = response.into_parts();
            let body = body.into_data_stream().map(move |chunk| {
                let _counted = &spill;
                chunk
            });
            Response::from_parts(head, Body::from_stream(body))
        }
    }
}

/// `sendLoadingState`: the answer begins at once, saying the model loads
/// (as llama-swap's does, in `reasoning_content`), and goes on with the
/// server's own stream once it is ready.
async fn loading_then(app: AppState, name: String, request: Request, next: Next) -> Response {
    let chunk = |text: &str| {
        Bytes::from(format!(
            "data: {}\n\n",
            json!({"choices": [{"delta": {"reasoning_content": text}}]})
        ))
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let started = Instant::now();
        let _ = tx.send(Ok(chunk("━━━━━\n"))).await;
        let _ = tx
            .send(Ok(chunk(&format!("llama-swap loading model: {name}\n"))))
            .await;
        let supervisor = app.supervisor.clone();
        let load_name = name.clone();
        let mut load =
            tokio::spawn(async move { supervisor.ensure_loaded(&load_name).await.map(drop) });
        let loaded = loop {
            tokio::select! {
                done = &mut load => break done,
                () = tokio::time::sleep(Duration::from_millis(750)) => {
                    if tx.send(Ok(chunk("."))).await.is_err() {
                        load.abort();
                        return;
                    }
                }
            }
        };
        let _ = tx
            .send(Ok(chunk(&format!(
                "\nDone! ({:.2}s)\n",
                started.elapsed().as_secs_f64()
            ))))
            .await;
        let _ = tx.send(Ok(chunk("━━━━━\n"))).await;
        let _ = tx.send(Ok(chunk(" "))).await;
        if let Ok(Err(e)) = &loaded {
            let error = json!({"error": {"message": e.to_string(), "type": "server_error", "code": e.kind()}});
            let _ = tx.send(Ok(Bytes::from(format!("data: {error}\n\n")))).await;
            return;
        }
        let response = next.run(request).await;
        let mut body = response.into_body().into_data_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(std::io::Error::other);
            if tx.send(chunk).await.is_err() {
                return;
            }
        }
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
    let mut response = Body::from_stream(stream).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
        .extensions_mut()
        .insert(crate::server::relay::Relayed);
    response
}
