//! Requests llama-swap's way: `/upstream/{model}/…` straight to the
//! model's own server, and `/v1` requests rewritten by the active profile's
//! pin, a selector, the model's `filters` and its loading state.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::Request;
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value as Json, json};

use super::layer::{Compat, TargetState};
use super::peers;
use super::{known, not_found};
use crate::server::AppState;
use crate::server::error::ApiError;
use crate::supervisor::ModelState;

/// The most `/`-separated parts a model ID is looked for in.
const MAX_ID_SEGMENTS: usize = 8;

/// `/upstream/{model}/{path}`: the model's server's own route, loaded
/// first as llama-swap does. The model is the longest leading run of the
/// path's segments that names one (or a pin of the active profile).
pub(super) async fn upstream(app: &AppState, compat: &Compat, request: Request) -> Response {
    let path = request.uri().path()["/upstream/".len()..].to_string();
    let segments: Vec<&str> = path.split('/').collect();
    let mut found = None;
    // A model ID has a few `/` at most: the path past them is the route's.
    for end in (1..=segments.len().min(MAX_ID_SEGMENTS)).rev() {
        let written = segments[..end].join("/");
        // An ID as the client wrote it in the path: `GPT%20OSS`, `a%2Fb`.
        let Some(candidate) = crate::server::relay::percent_decode(&written, false) else {
            continue;
        };
        if candidate.is_empty() {
            continue;
        }
        // The active profile's pins apply here too, as in llama-swap.
        let target = match compat.pin(&candidate) {
            Some(Some(target)) => target,
            Some(None) => return not_found("no model id could be identified"),
            None => candidate.clone(),
        };
        let dest = match known(app, compat, &target) {
            Some(name) => Some(Dest::Here(name)),
            None => compat.peers.resolve(&target).cloned().map(Dest::Peer),
        };
        if let Some(dest) = dest {
            found = Some((dest, written, segments[end..].join("/")));
            break;
        }
    }
    let Some((dest, matched, rest)) = found else {
        return not_found("model not found");
    };
    let model = match &dest {
        Dest::Here(name) => name.clone(),
        Dest::Peer(target) => format!("{}/{}", compat.peers.list[target.peer].id, target.model),
    };
    note_model(compat, request.extensions(), &model);
    // `upstream.ignorePaths` (a browser's favicon, a UI's assets): never
    // the reason a model loads.
    if let Dest::Here(name) = &dest
        && compat
            .ignore_paths
            .iter()
            .any(|re| re.is_match(&format!("/{rest}")))
        && app.supervisor.model_state(name) != Some(ModelState::Ready)
    {
        return ApiError::new(
            StatusCode::CONFLICT,
            "not_loaded",
            format!("model {matched} is not loaded; path matches upstream.ignorePaths"),
        )
        .into_response();
    }
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
    let name = match dest {
        Dest::Here(name) => name,
        Dest::Peer(target) => {
            // A peer's own route, as the client sent it past the model.
            let (parts, body) = request.into_parts();
            let bytes = axum::body::to_bytes(body, usize::MAX)
                .await
                .unwrap_or_default();
            return peers::relay(
                &compat.peers,
                &target,
                &parts.method,
                &format!("/{rest}"),
                parts.uri.query(),
                &parts.headers,
                bytes,
            )
            .await;
        }
    };
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

/// `requested` as the active profile pins it; `None`: a pin turns the name
/// off ([`turned_off`] answers it).
fn pinned(compat: &Compat, requested: String) -> Option<String> {
    match compat.pin(&requested) {
        None => Some(requested),
        Some(target) => target,
    }
}

/// A name the active profile turns off, answered as llama-swap answers it.
fn turned_off() -> Response {
    not_found("no model id could be identified")
}

/// The peer's model `name` reaches, unless a model here has that name (a
/// model here always wins).
fn peer_for(app: &AppState, compat: &Compat, name: &str) -> Option<peers::PeerModel> {
    if known(app, compat, name).is_some() {
        return None;
    }
    compat.peers.resolve(name).cloned()
}

/// Says in the in-flight list which model a request is for.
fn note_model(compat: &Compat, extensions: &axum::http::Extensions, model: &str) {
    if let Some(super::inflight::InflightId(id)) = extensions.get() {
        compat.inflight.set_model(*id, model);
    }
}

/// Where `/upstream/{model}/…` goes: a model here, or a peer's.
enum Dest {
    Here(String),
    Peer(peers::PeerModel),
}

/// A `/v1` request: the active profile's pin, then a selector, then the
/// model's `filters` and its loading state.
pub(super) async fn rewrite(
    app: AppState,
    compat: Arc<Compat>,
    request: Request,
    next: Next,
) -> Response {
    let json = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.contains("application/json"));
    if !json {
        return other_body(app, compat, request, next).await;
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
    requested = match pinned(&compat, requested) {
        Some(requested) => requested,
        None => return turned_off(),
    };
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
    note_model(&compat, &parts.extensions, &requested);
    if let Some(target) = peer_for(&app, &compat, &requested) {
        // A peer's model: its filters by the name the request used, then
        // the peer's own name for it.
        compat.peers.list[target.peer]
            .filters
            .apply(&requested, &mut body);
        peers::renamed(&mut body, &target.model);
        let bytes = Bytes::from(serde_json::to_vec(&Json::Object(body)).unwrap_or_default());
        let path = sent_path(&parts.method, parts.uri.path());
        let response = peers::relay(
            &compat.peers,
            &target,
            &parts.method,
            &path,
            parts.uri.query(),
            &parts.headers,
            bytes,
        )
        .await;
        return counted(response, spill);
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
    counted(response, spill)
}

/// The path a model route is sent on: `/v/…` without `/v`, as llama-swap
/// sends it (`relay/routes.rs`); any other as it came.
fn sent_path(method: &Method, path: &str) -> String {
    match crate::server::relay::model_route(method, path) {
        Some(crate::server::relay::ModelRoute::Body(sent)) => sent,
        _ => path.to_string(),
    }
}

/// `response`, counted in its selector's spillover until its body ends.
fn counted(response: Response, spill: Option<super::layer::Spill>) -> Response {
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

/// A model route whose body is not JSON (a multipart form: audio, an
/// image edit): to a peer where its `model` part names a peer's model (the
/// active profile's pin first), else on to berth's own routes.
async fn other_body(app: AppState, compat: Arc<Compat>, request: Request, next: Next) -> Response {
    if compat.peers.is_empty() {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let target =
        match crate::server::relay::model_of(&parts.headers, &bytes).map(|r| pinned(&compat, r)) {
            Some(None) => return turned_off(),
            Some(Some(requested)) => peer_for(&app, &compat, &requested),
            None => None,
        };
    let Some(target) = target else {
        return next
            .run(Request::from_parts(parts, Body::from(bytes)))
            .await;
    };
    if crate::server::relay::has_two_model_parts(&parts.headers, &bytes) {
        return ApiError::bad_request("the form has two `model` parts; send one").into_response();
    }
    let boundary = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::server::relay::multipart_boundary);
    let bytes = match boundary {
        Some(boundary) => crate::server::relay::renamed_form(bytes, &boundary, &target.model),
        None => bytes,
    };
    let path = sent_path(&parts.method, parts.uri.path());
    peers::relay(
        &compat.peers,
        &target,
        &parts.method,
        &path,
        parts.uri.query(),
        &parts.headers,
        bytes,
    )
    .await
}

/// A model route that names its model in the query (`GET /props?model=`):
/// to a peer where that is a peer's model (the active profile's pin
/// first), its `model=` the peer's own name; else on to berth's routes.
pub(super) async fn by_query(
    app: &AppState,
    compat: &Compat,
    request: Request,
    next: Next,
) -> Response {
    let requested = match crate::server::relay::query_model(request.uri().query()) {
        Some(requested) => match pinned(compat, requested) {
            Some(requested) => requested,
            None => return turned_off(),
        },
        None => return next.run(request).await,
    };
    note_model(compat, request.extensions(), &requested);
    let Some(target) = peer_for(app, compat, &requested) else {
        return next.run(request).await;
    };
    let query = request
        .uri()
        .query()
        .map(|q| peers::renamed_query(q, &target.model));
    let (parts, _) = request.into_parts();
    peers::relay(
        &compat.peers,
        &target,
        &parts.method,
        parts.uri.path(),
        query.as_deref(),
        &parts.headers,
        Bytes::new(),
    )
    .await
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
