//! Relaying requests to models served by HTTP servers (llama.cpp's server,
//! vLLM, ...): a `/v1` request whose `model` names such a model is passed to
//! its server through a [`Lease`](crate::supervisor::Lease), and the answer passed back.
//!
//! The relay parses nothing it does not need: the `model` field, to route
//! (rewritten to the server's own name where the operator set one). Every
//! other field, and routes berth does not serve itself (`/v1/rerank`,
//! audio; `/v1/completions` for a server's model), pass untouched; the answer's status, headers and
//! body come back as the server sends them, a stream's pieces as they
//! arrive, never buffered whole. What is dropped on the way is what is
//! hop-by-hop (`Connection`, `Transfer-Encoding`, ...) and berth's own
//! credentials (`Authorization`, `Cookie`): the server gets the operator's
//! `http.headers` instead.
//!
//! A client that goes away closes its request to the server. A server that
//! dies mid-answer ends it at once: a stream gets a last event with the
//! cause (exit status, stderr tail), any other answer is cut. What the relay
//! reads of a request and rewrites is in `request.rs`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

mod request;
mod routes;

pub(crate) use request::{has_two_model_parts, model_of, multipart_boundary, renamed_form};
pub(crate) use routes::{ModelRoute, model_route, percent_decode, query_model};

use request::{options_of, plain_path, renamed};

use super::AppState;
use super::error::ApiError;
use crate::child::upstream::PooledBody;
use crate::supervisor::Lease;

/// Headers that belong to one connection (RFC 9110 §7.6.1), and berth's
/// own credentials: never passed on, either way.
pub(crate) const NOT_PASSED: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
    "authorization",
    "x-api-key",
    "cookie",
];

/// The middleware: a POST under `/v1/` whose `model` is served by an HTTP
/// server is relayed to it, and so is a model route outside `/v1`
/// (`routes.rs`); anything else goes on to berth's own routes.
pub(crate) async fn route(State(app): State<AppState>, request: Request, next: Next) -> Response {
    if let Some(native) = model_route(request.method(), request.uri().path()) {
        return native_route(&app, native, request).await;
    }
    if request.method() != Method::POST || !request.uri().path().starts_with("/v1/") {
        return next.run(request).await;
    }
    let (parts, body) = request.into_parts();
    // The body was read whole (and bounded) by `read_body`.
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    if has_two_model_parts(&parts.headers, &bytes) {
        // The server could read another than the one berth routed by.
        return ApiError::bad_request("the form has two `model` parts; send one").into_response();
    }
    let model = model_of(&parts.headers, &bytes).map(|m| app.supervisor.canonical(&m));
    match model {
        Some(model) if app.supervisor.is_http_model(&model) && !plain_path(parts.uri.path()) => {
            ApiError::bad_request(format!(
                "model `{model}`: the path `{}` has `.`, `..` or an encoded `/` in it; \
                 only plain /v1 paths reach its server",
                parts.uri.path()
            ))
            .into_response()
        }
        Some(model) if app.supervisor.is_http_model(&model) => {
            relay(
                &app,
                &model,
                &parts.method,
                &parts.uri,
                &parts.headers,
                bytes,
                true,
            )
            .await
        }
        _ => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
    }
}

/// A model route outside `/v1` (`routes.rs`): to its model's server, on
/// the path the server knows; a model served by a berth worker has none.
async fn native_route(app: &AppState, native: ModelRoute, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let path = parts.uri.path().to_string();
    let (model, sent_path, rename) = match &native {
        ModelRoute::Body(sent) => {
            if has_two_model_parts(&parts.headers, &bytes) {
                return ApiError::bad_request("the form has two `model` parts; send one")
                    .into_response();
            }
            (model_of(&parts.headers, &bytes), sent.clone(), true)
        }
        ModelRoute::Query => (query_model(parts.uri.query()), path.clone(), false),
    };
    let Some(model) = model.map(|m| app.supervisor.canonical(&m)) else {
        return ApiError::bad_request(format!(
            "`{path}` is a model's own route: name the model (`model` in the body{})",
            if native == ModelRoute::Query {
                ", here `?model=NAME`"
            } else {
                ""
            }
        ))
        .into_response();
    };
    if app.supervisor.spec(&model).is_some() && !app.supervisor.is_http_model(&model) {
        return ApiError::bad_request(format!(
            "model `{model}` is served by a berth worker, which answers berth's `/v1` routes; \
             `{path}` is an HTTP server's own route"
        ))
        .into_response();
    }
    let query = parts
        .uri
        .query()
        .map(|q| format!("?{q}"))
        .unwrap_or_default();
    let uri: axum::http::Uri = match format!("{sent_path}{query}").parse() {
        Ok(uri) => uri,
        Err(_) => return ApiError::bad_request("the path is not a valid URI").into_response(),
    };
    relay(
        app,
        &model,
        &parts.method,
        &uri,
        &parts.headers,
        bytes,
        rename,
    )
    .await
}

/// Relays one request to `model`'s server and returns its answer; with
/// `rename`, the body's `model` becomes the server's own name for it, where
/// the operator set one (without: the request as it is, as llama-swap's
/// `/upstream/{model}/…` passes the server's own routes).
pub(crate) async fn relay(
    app: &AppState,
    model: &str,
    method: &Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
    body: Bytes,
    rename: bool,
) -> Response {
    // berth's own options ride in a `/v1` body; a server's own route
    // (`/upstream/{model}/…`) is the server's alone, options included.
    let options = if rename {
        match options_of(&body) {
            Ok(options) => options,
            Err(e) => return e.into_response(),
        }
    } else {
        crate::supervisor::RequestOptions::default()
    };
    let lease = match app.supervisor.lease(model, options).await {
        Ok(lease) => lease,
        Err(e) => return ApiError::from(e).into_response(),
    };
    let deadline = lease.deadline();
    let started = std::time::Instant::now();
    let late = move || {
        ApiError::from(crate::error::Error::DeadlineExceeded {
            model: model.to_string(),
            after: started.elapsed(),
        })
    };
    let upstream = std::sync::Arc::clone(lease.upstream());
    let spec = upstream.spec();
    let form = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(multipart_boundary);
    let body = match (&spec.model, form) {
        _ if !rename => body,
        (Some(name), Some(boundary)) => renamed_form(body, &boundary, name),
        (Some(name), None) => renamed(body, name),
        (None, _) => body,
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request = axum::http::Request::builder()
        .method(method.clone())
        .uri(path)
        .body(body)
        .expect("a method and path from a request are valid");
    for (name, value) in headers {
        if !NOT_PASSED.contains(&name.as_str()) {
            request.headers_mut().append(name.clone(), value.clone());
        }
    }
    if let Ok(host) = HeaderValue::try_from(upstream.host()) {
        request.headers_mut().insert(header::HOST, host);
    }
    for (name, value) in &spec.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            request.headers_mut().insert(name, value);
        }
    }
    let died = Box::pin(on_death(&lease));
    let sent = tokio::select! {
        sent = upstream.send(request) => Ok(sent),
        error = lease.died() => Err(ApiError::from(error)),
        () = until(deadline) => Err(late()),
    };
    let mut lease = lease;
    // No answer began: the server died, or the deadline came first.
    let sent = match sent {
        Ok(sent) => sent,
        Err(error) => {
            lease.failed();
            return error.into_response();
        }
    };
    let response = match sent {
        Ok(response) => response,
        Err(e) => {
            lease.failed();
            // A server that died answers with its death, not a broken socket.
            let dead =
                tokio::time::timeout(std::time::Duration::from_millis(300), lease.died()).await;
            return match dead {
                Ok(error) => ApiError::from(error).into_response(),
                Err(_) => ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_unreachable",
                    format!(
                        "model `{model}`: its HTTP server at {} did not answer: {e}",
                        upstream.address()
                    ),
                )
                .into_response(),
            };
        }
    };
    let (mut head, body) = response.into_parts();
    // No /v1 route upgrades its connection: a server switching protocols
    // would leave the client a bare 101 and a dead connection.
    if head.status == StatusCode::SWITCHING_PROTOCOLS || head.status.is_informational() {
        lease.failed();
        return ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_bad_answer",
            format!(
                "model `{model}`: its HTTP server answered {} (a protocol switch); berth relays \
                 requests and answers, not upgraded connections",
                head.status
            ),
        )
        .into_response();
    }
    let stream = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("text/event-stream"));
    let passed: Vec<HeaderName> = head
        .headers
        .keys()
        .filter(|n| NOT_PASSED.contains(&n.as_str()) && *n != header::CONTENT_LENGTH)
        .cloned()
        .collect();
    for name in passed {
        head.headers.remove(name);
    }
    // The answer is served from berth's origin: a server's cookies and CORS
    // grants are not berth's to give (defence in depth, with berth's own
    // Origin and Host checks), and no browser guesses its type.
    let foreign: Vec<HeaderName> = head
        .headers
        .keys()
        .filter(|n| {
            *n == header::SET_COOKIE
                || n.as_str() == "set-cookie2"
                || n.as_str().starts_with("access-control-")
        })
        .cloned()
        .collect();
    for name in foreign {
        head.headers.remove(name);
    }
    head.headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    // The request's deadline ends the answer too, as the server's death does.
    let model_name = model.to_string();
    let died: Pin<Box<dyn Future<Output = ApiError> + Send>> = match deadline {
        None => died,
        Some(_) => Box::pin(async move {
            tokio::select! {
                error = died => error,
                () = until(deadline) => ApiError::from(crate::error::Error::DeadlineExceeded {
                    model: model_name,
                    after: started.elapsed(),
                }),
            }
        }),
    };
    // An answer of a known, modest length is read whole before its head is
    // sent: a server that dies midway then answers with its death, never a
    // head promising bytes that do not come.
    let length = head
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if !stream && length.is_some_and(|n| n <= WHOLE_MAX) {
        let whole = tokio::select! {
            read = axum::body::to_bytes(Body::new(body), WHOLE_MAX) => read.map_err(|e| {
                ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_broke_off",
                    format!("model `{model}`: its server's answer broke off: {e}"),
                )
            }),
            error = died => Err(error),
        };
        return match whole {
            Ok(bytes) => {
                drop(lease);
                head.extensions.insert(Relayed);
                Response::from_parts(head, Body::from(bytes))
            }
            Err(error) => {
                lease.failed();
                error.into_response()
            }
        };
    }
    let body = RelayBody {
        inner: body,
        lease: Some(lease),
        died: Some(died),
        stream,
        ended: false,
        broken: false,
        model: model.to_string(),
    };
    // The server's answer as it is: berth's error shaping leaves it alone.
    head.extensions.insert(Relayed);
    Response::from_parts(head, Body::new(body))
}

/// The longest answer read whole before it is passed on (see `relay`).
const WHOLE_MAX: usize = 4 << 20;

/// Marks an answer that came from a model's server, whose body berth
/// passes on untouched (its errors too, in whatever shape the server gives).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Relayed;

/// Sleeps until `deadline`; for ever without one.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A future that resolves with the server's death as an error.
fn on_death(lease: &Lease) -> impl Future<Output = ApiError> + Send + 'static {
    let watch = lease.death_watch();
    async move { ApiError::from(watch.await) }
}

/// The server's answer on its way to the client: frames pass as they come;
/// the lease (a request in flight) ends with the body; a death of the
/// server ends the body at once.
struct RelayBody {
    inner: PooledBody,
    lease: Option<Lease>,
    died: Option<Pin<Box<dyn Future<Output = ApiError> + Send>>>,
    stream: bool,
    ended: bool,
    /// The server's answer broke off; what is left is to say why.
    broken: bool,
    model: String,
}

/// How long a stream whose server's answer broke off waits to learn why
/// (the server's exit, reaped within milliseconds when it died).
const WHY_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

impl hyper::body::Body for RelayBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        // Once the answer broke off, only why is left to tell.
        let polled = if self.broken {
            Poll::Pending
        } else {
            Pin::new(&mut self.inner).poll_frame(cx)
        };
        let broke = match polled {
            Poll::Ready(None) => {
                self.ended = true;
                self.lease = None;
                return Poll::Ready(None);
            }
            Poll::Ready(Some(Ok(frame))) => return Poll::Ready(Some(Ok(frame))),
            Poll::Ready(Some(Err(e))) => Some(e),
            Poll::Pending => None,
        };
        if let Some(e) = broke {
            // The answer broke off: a server that died did that. A stream
            // learns why as a last event; any other answer is cut.
            self.broken = true;
            self.fail();
            if !self.stream {
                self.ended = true;
                return Poll::Ready(Some(Err(Box::new(e))));
            }
            let died = self.died.take();
            let broke_off = ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_broke_off",
                format!("model `{}`: its server's answer broke off: {e}", self.model),
            );
            self.died = Some(Box::pin(async move {
                match died {
                    Some(died) => tokio::time::timeout(WHY_WAIT, died)
                        .await
                        .unwrap_or(broke_off),
                    None => broke_off,
                }
            }));
        }
        let Some(died) = self.died.as_mut() else {
            return Poll::Pending;
        };
        let Poll::Ready(error) = died.as_mut().poll(cx) else {
            return Poll::Pending;
        };
        self.died = None;
        self.ended = true;
        self.fail();
        if self.stream {
            // A last event, so a streaming client reads why.
            // After a blank line: the server may have stopped mid-event.
            let event = format!("\n\ndata: {}\n\n", error.body());
            Poll::Ready(Some(Ok(hyper::body::Frame::data(Bytes::from(event)))))
        } else {
            Poll::Ready(Some(Err(error.message.into())))
        }
    }
}

impl RelayBody {
    fn fail(&mut self) {
        if let Some(mut lease) = self.lease.take() {
            lease.failed();
        }
    }
}
