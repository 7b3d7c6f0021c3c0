//! `berth serve`: the sidecar. HTTP (axum) over one `Supervisor`; the
//! handlers translate and delegate, and hold no process logic.

use std::net::SocketAddr;
use std::path::PathBuf;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::Supervisor;

pub mod config;
mod error;
mod management;
mod openai;

pub use error::ApiError;

#[derive(Clone)]
pub(crate) struct AppState {
    pub supervisor: Supervisor,
    pub token: Option<String>,
}

impl AppState {
    /// Models registered through the API must lie inside the models
    /// directory: the API must not become a way to read any file as weights.
    pub fn check_model_path(&self, spec: &crate::ModelSpec) -> Result<(), ApiError> {
        let (Some(root), Some(path)) = (&self.supervisor.config().models_root, &spec.model) else {
            return Ok(());
        };
        let inside = path
            .canonicalize()
            .ok()
            .zip(root.canonicalize().ok())
            .is_some_and(|(p, r)| p.starts_with(r));
        if inside {
            Ok(())
        } else {
            Err(ApiError::bad_request(format!(
                "model `{}`: path `{}` is outside the models directory `{}`",
                spec.name,
                path.display(),
                root.display()
            )))
        }
    }
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl Listen {
    /// `127.0.0.1:7733`, `[::1]:7733`, `localhost:7733`, or `unix:/path`.
    pub fn parse(text: &str) -> Result<Listen, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        let text = text.replace("localhost:", "127.0.0.1:");
        text.parse::<SocketAddr>().map(Listen::Tcp).map_err(|_| {
            format!("`{text}` is not an address to listen on (try 127.0.0.1:7733 or unix:/path)")
        })
    }

    /// Loopback addresses and unix sockets are private to this machine.
    pub fn is_private(&self) -> bool {
        match self {
            Listen::Tcp(addr) => addr.ip().is_loopback(),
            Listen::Unix(_) => true,
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(addr) => write!(f, "http://{addr}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// The router over `supervisor`.
pub fn router(supervisor: Supervisor, token: Option<String>, max_body: usize) -> Router {
    let state = AppState { supervisor, token };
    let api = Router::new()
        .route("/v1/models", get(openai::models))
        .route("/v1/embeddings", post(openai::embeddings))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/api/ps", get(management::ps))
        .route("/api/gpus", get(management::gpus))
        .route("/api/models", get(management::catalogue))
        .route(
            "/api/models/{name}",
            axum::routing::put(management::register).delete(management::deregister),
        )
        .route("/api/models/{name}/load", post(management::load))
        .route("/api/models/{name}/unload", post(management::unload))
        .route("/api/models/{name}/swap", post(management::swap))
        .route("/api/models/{name}/infer", post(management::infer))
        .route("/metrics", get(metrics))
        .route("/readyz", get(readyz))
        .route_layer(middleware::from_fn_with_state(state.clone(), authorize));
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(api)
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint")
        })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(middleware::map_response(openai_shaped))
        .with_state(state)
}

/// Turns axum's own plain-text rejections (413 body too large, 405, 415,
/// ...) into the same error shape as every other error.
async fn openai_shaped(response: Response) -> Response {
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

async fn authorize(State(app): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(token) = &app.token {
        let given = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given != Some(token.as_str()) {
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer <token>)",
            )
            .into_response();
        }
    }
    next.run(request).await
}

async fn metrics(State(app): State<AppState>) -> Response {
    // procfs and NVML reads block for milliseconds.
    let supervisor = app.supervisor.clone();
    match tokio::task::spawn_blocking(move || crate::metrics::render(&supervisor)).await {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
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

/// Serves until SIGTERM or SIGINT, then stops accepting, lets in-flight
/// HTTP requests finish, unloads every model (reports in the log) and returns.
pub async fn serve(
    supervisor: Supervisor,
    listen: Listen,
    token: Option<String>,
    max_body: usize,
) -> Result<(), String> {
    if !listen.is_private() && token.is_none() {
        return Err(format!(
            "refusing to listen on {listen} without a token: anyone who can reach it could run models; \
             set `token` in the config (or BERTH_TOKEN), or listen on 127.0.0.1"
        ));
    }
    let app = router(supervisor.clone(), token, max_body);
    let shutdown = shutdown_signal();
    let served = match &listen {
        Listen::Tcp(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
            tracing::info!("berth serve listening on {listen}");
            eprintln!("berth: listening on {listen}");
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
        }
        Listen::Unix(path) => {
            let _ = std::fs::remove_file(path);
            let listener = tokio::net::UnixListener::bind(path)
                .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| format!("cannot restrict {listen} to mode 0600: {e}"))?;
            tracing::info!("berth serve listening on {listen}");
            eprintln!("berth: listening on {listen}");
            let result = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await;
            let _ = std::fs::remove_file(path);
            result
        }
    };
    served.map_err(|e| format!("server error: {e}"))?;
    eprintln!("berth: shutting down; unloading every model");
    // Each report is logged by the supervisor as the unload ends.
    for failed in supervisor
        .shutdown()
        .await
        .into_iter()
        .filter_map(Result::err)
    {
        eprintln!("berth: {failed}");
    }
    Ok(())
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            tracing::error!("cannot install the SIGTERM/SIGINT handlers; stop berth with SIGKILL");
            std::future::pending::<()>().await;
        }
    }
}
