//! Who may talk to the sidecar, checked before any handler runs.
//!
//! berth on loopback without a token is reachable by every web page the
//! user opens: a browser sends a cross-site "simple" POST (form or `fetch`
//! with a text body) to `127.0.0.1` without asking, and DNS rebinding lets a
//! page's own host name resolve to it. So, as Ollama and Jupyter learnt:
//! - every POST and PUT that carries a body must be `application/json`
//!   (or, where a route takes bytes, `application/octet-stream`), which a
//!   browser sends cross-site only after a CORS preflight that berth never
//!   approves; one with no body has nothing to type;
//! - a request whose `Origin` is not one the operator allowed is refused;
//! - on loopback, a `Host` that is not the listen address (or `localhost`
//!   with its port, or a name the operator allowed) is refused, which is
//!   what defeats rebinding;
//! - the bearer token, where set, is compared in constant time, with the
//!   `Bearer` scheme in any case (RFC 7235).
//!
//! `/healthz` and `/readyz` skip the Host and token checks: probes address a
//! pod by its IP and carry no secret. So does `GET /metrics` where the
//! operator set `public_metrics` (an inference gateway's endpoint picker
//! scrapes it by pod IP and cannot send a token), but for the Host check on
//! loopback, which stays: a rebound page could read the metrics otherwise.

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::listen::Listen;

/// The checks, built once from the listen address and the config.
#[derive(Debug, Clone)]
pub(crate) struct Guard {
    /// Any of them is accepted (berth's token, llama-swap's `apiKeys`).
    tokens: Vec<String>,
    /// `Host` values accepted (lower case); `None`: any (a unix socket, or a
    /// non-loopback address the operator protects with a token).
    hosts: Option<Vec<String>>,
    origins: Vec<String>,
    /// `GET /metrics` passes as the probes do (the Host check too, but on
    /// loopback, where it is what defeats DNS rebinding).
    public_metrics: bool,
    /// Listening on loopback.
    loopback: bool,
}

impl Guard {
    pub fn new(
        listen: &Listen,
        tokens: Vec<String>,
        allowed_hosts: &[String],
        allowed_origins: &[String],
    ) -> Guard {
        let mut hosts: Vec<String> = allowed_hosts
            .iter()
            .map(|h| h.to_ascii_lowercase())
            .collect();
        let loopback = matches!(listen, Listen::Tcp(addr) if addr.ip().is_loopback());
        let check_hosts = match listen {
            Listen::Tcp(addr) if addr.ip().is_loopback() => {
                let port = addr.port();
                hosts.extend([
                    addr.to_string(),
                    format!("localhost:{port}"),
                    format!("127.0.0.1:{port}"),
                    format!("[::1]:{port}"),
                ]);
                if port == 80 {
                    // Browsers leave the default port out.
                    hosts.extend(["localhost".into(), "127.0.0.1".into(), "[::1]".into()]);
                }
                true
            }
            Listen::Tcp(addr) => {
                if !addr.ip().is_unspecified() {
                    hosts.push(addr.to_string());
                }
                !allowed_hosts.is_empty()
            }
            Listen::Unix(_) => false,
        };
        Guard {
            tokens,
            hosts: check_hosts.then_some(hosts),
            origins: allowed_origins
                .iter()
                .map(|o| o.trim_end_matches('/').to_ascii_lowercase())
                .collect(),
            public_metrics: false,
            loopback,
        }
    }

    /// With `open`, `GET /metrics` needs neither token nor Host.
    pub fn public_metrics(mut self, open: bool) -> Guard {
        self.public_metrics = open;
        self
    }

    /// What passes without the token: the probes, and the metrics where
    /// the operator made them public.
    fn is_open(&self, method: &Method, path: &str) -> bool {
        is_probe(path)
            || (self.public_metrics
                && path == "/metrics"
                && (method == Method::GET || method == Method::HEAD))
    }

    /// What passes without the Host check: the same, but the metrics not
    /// on loopback, where a rebound page could otherwise read them (an
    /// endpoint picker scrapes a pod's own address, never loopback).
    fn skips_host_check(&self, method: &Method, path: &str) -> bool {
        is_probe(path) || (!self.loopback && self.is_open(method, path))
    }

    /// Why `request` is refused, or `None`.
    ///
    /// The probes (`/healthz`, `/readyz`) pass without Host or token: a
    /// kubelet addresses a pod by its IP and cannot carry a secret without
    /// writing it into the manifest, and they tell nothing but up or ready.
    fn refuse(&self, method: &Method, path: &str, headers: &HeaderMap) -> Option<ApiError> {
        let text = |name| {
            headers
                .get(name)
                .and_then(|v: &header::HeaderValue| v.to_str().ok())
        };
        // A missing or unreadable Host fails the check too.
        if !self.skips_host_check(method, path)
            && let Some(hosts) = &self.hosts
            && let host = text(header::HOST).unwrap_or("")
            && !hosts.contains(&host.to_ascii_lowercase())
        {
            return Some(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden_host",
                format!(
                    "Host `{host}` is not this server's address; to reach berth under another \
                     name, add it to `allowed_hosts` in the config"
                ),
            ));
        }
        // A page's navigation or sub-resource (`<img src=".../unload">`)
        // carries no Origin, but a browser says it came from another site.
        if headers.get(header::ORIGIN).is_none()
            && !is_probe(path)
            && !is_console(method, path)
            && matches!(
                headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()),
                Some("cross-site" | "same-site")
            )
        {
            return Some(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden_origin",
                "requests from other sites' pages are refused",
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("").trim_end_matches('/');
            // The console's own requests: a page served by this server, at
            // the address the Host check just accepted (a page elsewhere
            // has another origin; a rebound name fails the Host check, or
            // has no token).
            // Only where the Host was checked, or a token is asked for too.
            let same_origin = (self.hosts.is_some() || !self.tokens.is_empty())
                && text(header::HOST).is_some_and(|host| {
                    ["http://", "https://"]
                        .iter()
                        .any(|scheme| origin.eq_ignore_ascii_case(&format!("{scheme}{host}")))
                });
            if !same_origin && !self.origins.contains(&origin.to_ascii_lowercase()) {
                return Some(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "forbidden_origin",
                    format!(
                        "requests from web pages (Origin `{origin}`) are refused; to let a page \
                         call berth, add its origin to `allowed_origins` in the config"
                    ),
                ));
            }
        }
        if (method == Method::POST || method == Method::PUT)
            && has_body(headers)
            && !is_json(text(header::CONTENT_TYPE))
            && !(takes_bytes(path) && is_octet_stream(text(header::CONTENT_TYPE)))
            && !(takes_forms(path) && is_form(text(header::CONTENT_TYPE)))
        {
            return Some(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                if takes_bytes(path) {
                    "send the body as JSON with `Content-Type: application/json`, or bytes \
                     with `Content-Type: application/octet-stream` \
                     (curl: -H 'Content-Type: application/json')"
                } else {
                    "send the body as JSON with `Content-Type: application/json` \
                     (curl: -H 'Content-Type: application/json')"
                },
            ));
        }
        if !self.is_open(method, path)
            && !is_console(method, path)
            && !self.tokens.is_empty()
            && !self
                .tokens
                .iter()
                .any(|token| presented(headers).iter().any(|given| same(given, token)))
        {
            return Some(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer <token>)",
            ));
        }
        None
    }
}

/// A GET of the console's page, script or style: no data in them, and a
/// browser cannot send a header with a navigation.
fn is_console(method: &Method, path: &str) -> bool {
    (method == Method::GET || method == Method::HEAD) && super::console::PATHS.contains(&path)
}

/// The liveness and readiness probes' paths.
fn is_probe(path: &str) -> bool {
    // `/health`: llama-swap's, where berth serves its config.
    path == "/healthz" || path == "/readyz" || path == "/health"
}

fn media_type_is(content_type: Option<&str>, wanted: &str) -> bool {
    content_type
        .and_then(|v| v.split(';').next())
        .is_some_and(|m| m.trim().eq_ignore_ascii_case(wanted))
}

fn is_json(content_type: Option<&str>) -> bool {
    media_type_is(content_type, "application/json")
}

/// Like JSON, `application/octet-stream` is not a type a browser sends
/// cross-site without a preflight, so it is as safe to accept.
fn is_octet_stream(content_type: Option<&str>) -> bool {
    media_type_is(content_type, "application/octet-stream")
}

/// Routes whose body may be a form: audio for a model served by an HTTP
/// server (`/v1/audio/transcriptions`). A page can send a form cross-site
/// without a preflight, but not without its `Origin`, which is checked.
fn takes_forms(path: &str) -> bool {
    path.starts_with("/v1/audio/")
}

fn is_form(content_type: Option<&str>) -> bool {
    media_type_is(content_type, "multipart/form-data")
}

/// Routes whose body may be raw bytes: a backend's own request (`infer`).
fn takes_bytes(path: &str) -> bool {
    path.strip_prefix("/api/models/")
        .and_then(|rest| rest.strip_suffix("/infer"))
        .is_some_and(|name| !name.is_empty() && !name.contains('/'))
}

/// Whether a request carries a body: a `Transfer-Encoding`, or a
/// `Content-Length` other than 0 (an unreadable one counts as a body). A
/// request with none has nothing whose type could matter, and nothing a
/// cross-site form could smuggle: the Origin and Host checks still apply.
fn has_body(headers: &HeaderMap) -> bool {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        return true;
    }
    headers
        .get_all(header::CONTENT_LENGTH)
        .iter()
        .any(|v| v.to_str().ok().map(str::trim) != Some("0"))
}

/// The tokens a request presents: `Authorization: Bearer <token>` (the
/// scheme in any case), `x-api-key: <token>`, or the password of
/// `Authorization: Basic` (as llama-swap's clients send its `apiKeys`).
fn presented(headers: &HeaderMap) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for value in headers.get_all(header::AUTHORIZATION) {
        let Some((scheme, given)) = value
            .to_str()
            .ok()
            .map(str::trim)
            .and_then(|v| v.split_once(' '))
        else {
            continue;
        };
        if scheme.eq_ignore_ascii_case("bearer") {
            out.push(given.trim().as_bytes().to_vec());
        } else if scheme.eq_ignore_ascii_case("basic")
            && let Ok(decoded) = super::base64::decode(given.trim())
            && let Some(at) = decoded.iter().position(|b| *b == b':')
        {
            out.push(decoded[at + 1..].to_vec());
        }
    }
    for value in headers.get_all("x-api-key") {
        out.push(value.as_bytes().trim_ascii().to_vec());
    }
    out
}

/// Whether `given` is `token`, in time that does not depend on where they
/// first differ.
fn same(given: &[u8], token: &str) -> bool {
    let token = token.as_bytes();
    given.len() == token.len()
        && given
            .iter()
            .zip(token)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// The middleware: refuses, or passes the request on.
pub(crate) async fn check(
    State(guard): State<Guard>,
    request: Request<Body>,
    next: Next,
) -> Response {
    match guard.refuse(request.method(), request.uri().path(), request.headers()) {
        Some(refusal) => refusal.into_response(),
        None => next.run(request).await,
    }
}

#[cfg(test)]
mod tests;
