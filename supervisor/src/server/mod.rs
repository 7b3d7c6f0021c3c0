//! `berth serve`: the sidecar. HTTP (axum) over one `Supervisor`; the
//! handlers translate and delegate, and hold no process logic.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::supervisor::Supervisor;

mod base64;
mod completions;
mod console;
pub(crate) mod controls;
mod embeddings;
mod error;
mod events;
mod guard;
pub mod infer;
pub mod listen;
pub mod llama_swap;
pub(crate) mod management;
pub mod metrics;
mod openai;
pub(crate) mod options;
mod relay;

pub use controls::{Controls, UpgradeAccepted};
pub use error::ApiError;
pub use listen::Listen;
pub use options::{DEFAULT_LISTEN, ServeOptions, refuse_open_door};

#[derive(Clone)]
pub(crate) struct AppState {
    pub supervisor: Supervisor,
    /// Texts one embeddings request may carry.
    pub max_inputs: usize,
    /// HTTP clients may register the test doubles.
    pub test_backends: bool,
    /// A llama-swap config's layer (`--llama-swap`).
    pub llama_swap: Option<Arc<llama_swap::layer::Compat>>,
    /// The daemon's reloads and upgrades (`POST /api/reload`, `POST
    /// /api/upgrade`); weak, as the daemon holds the front door it builds.
    pub controls: Option<std::sync::Weak<dyn Controls>>,
}

/// Backends that exist to test berth: they hold memory, crash or hang on
/// command. A client may name them only where the operator allows it.
pub const TEST_BACKENDS: &[&str] = &["hog", "fault", "gpu-hog"];

impl AppState {
    /// Models registered through the API must lie inside the models
    /// directory, checked now and again at every load with symlinks
    /// resolved: the API must not become a way to read any file as weights.
    /// A spec from an HTTP client: no test double unless the operator
    /// allowed them.
    pub fn allowed(
        &self,
        spec: crate::config::ModelSpec,
    ) -> Result<crate::config::ModelSpec, ApiError> {
        if !self.test_backends && TEST_BACKENDS.contains(&spec.backend.as_str()) {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "test_backend",
                format!(
                    "model `{}`: backend `{}` is a test double (it holds memory, crashes or \
                     hangs on command); clients may register it only where the operator \
                     set `test_backends = true` in the config",
                    spec.name, spec.backend
                ),
            ));
        }
        Ok(spec)
    }

    pub fn confine(
        &self,
        mut spec: crate::config::ModelSpec,
    ) -> Result<crate::config::ModelSpec, ApiError> {
        let Some(root) = &self.supervisor.config().models_root else {
            return Ok(spec);
        };
        if let Some(path) = &mut spec.model {
            // A relative path names a model inside models_dir, as in the
            // config; never one in the server's working directory.
            if path.is_relative() {
                *path = root.join(&*path);
            }
            crate::config::confined(&spec.name, path, root)?;
        }
        spec.confine = Some(root.clone());
        Ok(spec)
    }
}

/// The router over `supervisor`.
pub fn router(
    supervisor: Supervisor,
    options: &ServeOptions,
    controls: Option<std::sync::Weak<dyn Controls>>,
) -> Router {
    let state = AppState {
        supervisor,
        max_inputs: options.max_inputs,
        test_backends: options.test_backends,
        llama_swap: options.llama_swap.clone(),
        controls,
    };
    let tokens = options
        .token
        .iter()
        .chain(&options.api_keys)
        .cloned()
        .collect();
    let guard = guard::Guard::new(
        &options.listen,
        tokens,
        &options.allowed_hosts,
        &options.allowed_origins,
    )
    .public_metrics(options.public_metrics);
    let body = BodyLimits {
        max: options.max_body,
        timeout: options.body_timeout,
        held: Arc::new(tokio::sync::Semaphore::new(kib(options.max_body_total))),
        total: options.max_body_total,
    };
    let api = Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/api/ps", get(management::ps))
        .route("/api/events", get(events::events))
        .route("/api/history", get(management::history))
        .route("/api/gpus", get(management::gpus))
        .route("/api/models", get(management::catalogue))
        .route(
            "/api/models/{name}",
            axum::routing::put(management::register).delete(management::deregister),
        )
        .route("/api/models/{name}/load", post(management::load))
        .route("/api/models/{name}/unload", post(management::unload))
        .route("/api/models/{name}/sleep", post(management::sleep))
        .route("/api/models/{name}/wake", post(management::wake))
        .route("/api/models/{name}/swap", post(management::swap))
        .route("/api/models/{name}/infer", post(infer::infer))
        .route("/api/reload", post(management::reload))
        .route("/api/upgrade", post(management::upgrade))
        .route("/api/version", get(management::version))
        .route("/metrics", get(metrics))
        .route("/readyz", get(readyz));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/", get(console::page))
        .route("/console.js", get(console::script))
        .route("/console.css", get(console::style))
        .merge(api)
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .layer(DefaultBodyLimit::max(options.max_body))
        // `/v1` requests for models served by HTTP servers go to them.
        .layer(middleware::from_fn_with_state(state.clone(), relay::route))
        // A llama-swap config's API and request rewriting, before the relay.
        .layer(middleware::from_fn_with_state(
            state.clone(),
            llama_swap::api::front,
        ))
        .layer(middleware::from_fn_with_state(body, read_body))
        .layer(middleware::from_fn_with_state(guard, guard::check))
        .layer(middleware::map_response(openai_shaped))
        .with_state(state)
}

#[derive(Debug, Clone)]
struct BodyLimits {
    max: usize,
    timeout: Duration,
    /// The bytes of request bodies held at once, in KiB: each body takes
    /// its share as it arrives and gives it back when its request is done.
    held: Arc<tokio::sync::Semaphore>,
    total: usize,
}

/// Bytes as KiB, rounded up: the body budget's unit.
fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1024)
}

/// Reads a request's body whole, within `body_timeout` and `max_body`, so a
/// client that sends its headers and then trickles (or withholds) the body
/// cannot hold a handler, and with it shutdown, without bound. The bytes
/// count against `max_body_total` as they arrive, until the request is
/// done: past it, the request is answered 503 at once (100 clients each
/// sending 15 MiB would otherwise have berth hold 1.5 GB).
async fn read_body(State(limits): State<BodyLimits>, request: Request, next: Next) -> Response {
    // A body of any method relayed to a server (llama-swap's `/upstream`)
    // is bounded as a POST's is.
    if !matches!(
        *request.method(),
        Method::POST | Method::PUT | Method::PATCH
    ) && !request.uri().path().starts_with("/upstream/")
    {
        return next.run(request).await;
    }
    // A body announced larger than max_body is refused before it is
    // waited for: a client would otherwise get 408 after body_timeout.
    let announced = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(length) = announced
        && length > limits.max as u64
    {
        return too_large(limits.max, format!("is {length} bytes"));
    }
    let full = || {
        let mut response = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "bodies_full",
            format!(
                "berth holds {} of request bodies already (max_body_total); retry shortly",
                crate::units::mib(limits.total as u64)
            ),
        )
        .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        response
    };
    // What was announced is taken at once; a body of unknown length takes
    // its share chunk by chunk. A body past the budget is still read, and
    // dropped as it arrives (the client gets its 503, not a broken pipe),
    // within body_timeout and max_body as any body.
    let mut permit = match announced {
        Some(length) => Arc::clone(&limits.held)
            .try_acquire_many_owned(kib(length as usize) as u32)
            .ok(),
        None => None,
    };
    let refused = announced.is_some() && permit.is_none();
    let (parts, body) = request.into_parts();
    let mut stream = body.into_data_stream();
    if refused {
        let drain = async {
            use futures_util::StreamExt;
            let mut seen = 0usize;
            while let Some(Ok(chunk)) = stream.next().await {
                seen += chunk.len();
                if seen > limits.max {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(limits.timeout, drain).await;
        return full();
    }
    /// How a body's reading ended.
    enum Read {
        Whole(Vec<u8>),
        /// Past `max_body_total`: read and dropped.
        Over,
        /// Past `max_body`, or broken off: why.
        TooLarge(String),
    }
    let read = async {
        use futures_util::StreamExt;
        let (mut bytes, mut seen, mut over) = (Vec::new(), 0usize, false);
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                Err(e) => return Read::TooLarge(format!("broke off: {e}")),
            };
            seen += chunk.len();
            if seen > limits.max {
                return Read::TooLarge("is larger".into());
            }
            if over {
                continue; // read and dropped: the answer is 503
            }
            bytes.extend_from_slice(&chunk);
            let owed =
                kib(bytes.len()).saturating_sub(permit.as_ref().map_or(0, |p| p.num_permits()));
            if owed > 0 {
                match Arc::clone(&limits.held).try_acquire_many_owned(owed as u32) {
                    Ok(more) => match &mut permit {
                        Some(p) => p.merge(more),
                        None => permit = Some(more),
                    },
                    Err(_) => {
                        over = true;
                        bytes = Vec::new();
                        permit = None;
                    }
                }
            }
        }
        if over { Read::Over } else { Read::Whole(bytes) }
    };
    let bytes = match tokio::time::timeout(limits.timeout, read).await {
        Ok(Read::Whole(bytes)) => bytes,
        Ok(Read::TooLarge(what)) => return too_large(limits.max, what),
        Ok(Read::Over) => return full(),
        Err(_) => {
            return ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "body_timeout",
                format!(
                    "the request body did not arrive within body_timeout ({})",
                    crate::units::format_duration(limits.timeout)
                ),
            )
            .into_response();
        }
    };
    let large = bytes.len() as u64 >= crate::heap::LARGE;
    let response = next
        .run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await;
    drop(permit);
    if large {
        // As after a large answer: the freed megabytes go back to the kernel.
        crate::heap::trim_soon();
    }
    response
}

/// The answer to a body over `max_body`, read only in part: the connection
/// closes after it (the rest of the body is never read), and says so, so a
/// client does not send its next request into a connection that is closing.
fn too_large(max: usize, what: String) -> Response {
    let mut response = ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("the request body {what}, over max_body ({max} bytes)"),
    )
    .into_response();
    response.headers_mut().insert(
        header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

/// Turns axum's own plain-text rejections (413 body too large, 405, 415,
/// ...) into the same error shape as every other error; a model's server's
/// own answers pass as they are.
async fn openai_shaped(response: Response) -> Response {
    if response.extensions().get::<relay::Relayed>().is_some() {
        return response;
    }
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| {
            v.as_bytes().starts_with(b"application/json")
                || v.as_bytes().starts_with(b"text/event-stream")
        });
    if status.is_success() || is_json || !(status.is_client_error() || status.is_server_error()) {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 64 << 10)
        .await
        .unwrap_or_default();
    let message = String::from_utf8_lossy(&text).trim().to_string();
    let code = match status {
        StatusCode::PAYLOAD_TOO_LARGE => "body_too_large",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        _ => "bad_request",
    };
    let message = if message.is_empty() {
        status.to_string()
    } else {
        message
    };
    ApiError::new(status, code, message).into_response()
}

/// `/metrics`: read at once (off the async threads: procfs and NVML reads
/// block for milliseconds), written out a piece at a time as the reader
/// takes it, so a slow scraper of thousands of models holds one piece.
async fn metrics(State(app): State<AppState>) -> Response {
    let supervisor = app.supervisor.clone();
    match tokio::task::spawn_blocking(move || metrics::Snapshot::take(&supervisor)).await {
        Ok(snapshot) => {
            let pieces =
                futures_util::stream::iter(snapshot.pieces().map(|piece| {
                    Ok::<_, std::convert::Infallible>(axum::body::Bytes::from(piece))
                }));
            (
                [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                axum::body::Body::from_stream(pieces),
            )
                .into_response()
        }
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the metrics failed: {e}\n"),
        )
            .into_response(),
    }
}

async fn readyz(State(app): State<AppState>) -> Response {
    if app.supervisor.is_shutting_down() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response()
    } else {
        "ready\n".into_response()
    }
}
