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
mod tests {
    use super::*;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (k, v) in pairs {
            map.insert(k.clone(), v.parse().unwrap());
        }
        map
    }

    fn loopback() -> Guard {
        Guard::new(
            &Listen::parse("127.0.0.1:7733").unwrap(),
            Vec::new(),
            &[],
            &["https://app.example".into()],
        )
    }

    #[test]
    fn a_rebound_host_or_foreign_origin_is_refused_on_loopback() {
        let guard = loopback();
        let json = (header::CONTENT_TYPE, "application/json");
        let ok = headers(&[(header::HOST, "localhost:7733"), json.clone()]);
        assert!(guard.refuse(&Method::POST, "/v1/embeddings", &ok).is_none());
        let rebound = headers(&[(header::HOST, "evil.example:7733"), json.clone()]);
        let refused = guard.refuse(&Method::GET, "/api/ps", &rebound).unwrap();
        assert_eq!(refused.code, "forbidden_host");
        assert!(guard.refuse(&Method::GET, "/healthz", &rebound).is_none());
        let page = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::ORIGIN, "https://evil.example"),
            json.clone(),
        ]);
        assert_eq!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &page)
                .unwrap()
                .code,
            "forbidden_origin"
        );
        let allowed = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::ORIGIN, "https://app.example"),
            json,
        ]);
        assert!(
            guard
                .refuse(&Method::POST, "/v1/embeddings", &allowed)
                .is_none()
        );
    }

    #[test]
    fn public_metrics_pass_without_token_or_host_and_nothing_else_does() {
        let guarded = Guard::new(
            &Listen::parse("0.0.0.0:7733").unwrap(),
            vec!["secret".into()],
            &["berth.example:7733".into()],
            &[],
        );
        let scrape = headers(&[(header::HOST, "10.1.2.3:7733")]);
        for guard in [guarded.clone(), guarded.clone().public_metrics(false)] {
            let refused = guard.refuse(&Method::GET, "/metrics", &scrape).unwrap();
            assert_eq!(refused.code, "forbidden_host");
        }
        let open = guarded.public_metrics(true);
        assert!(open.refuse(&Method::GET, "/metrics", &scrape).is_none());
        assert!(open.refuse(&Method::HEAD, "/metrics", &scrape).is_none());
        // Only the metrics: everything else still asks for Host and token.
        for path in ["/api/ps", "/v1/models", "/metrics/x", "/api/events"] {
            assert!(open.refuse(&Method::GET, path, &scrape).is_some(), "{path}");
        }
        let named = headers(&[(header::HOST, "berth.example:7733")]);
        let refused = open.refuse(&Method::GET, "/api/ps", &named).unwrap();
        assert_eq!(refused.code, "unauthorized");
        let posted = open.refuse(&Method::POST, "/metrics", &named).unwrap();
        assert_eq!(posted.code, "unauthorized");
        // On loopback the Host check stays (a rebound page's Host fails
        // it); the token is not asked for.
        let local = Guard::new(
            &Listen::parse("127.0.0.1:7733").unwrap(),
            vec!["secret".into()],
            &[],
            &[],
        )
        .public_metrics(true);
        let rebound = headers(&[(header::HOST, "evil.example:7733")]);
        let refused = local.refuse(&Method::GET, "/metrics", &rebound).unwrap();
        assert_eq!(refused.code, "forbidden_host");
        let own = headers(&[(header::HOST, "127.0.0.1:7733")]);
        assert!(local.refuse(&Method::GET, "/metrics", &own).is_none());
    }

    #[test]
    fn a_post_must_be_json() {
        let guard = loopback();
        for content_type in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ] {
            let h = headers(&[
                (header::HOST, "127.0.0.1:7733"),
                (header::CONTENT_TYPE, content_type),
                (header::CONTENT_LENGTH, "5"),
            ]);
            assert_eq!(
                guard
                    .refuse(&Method::POST, "/api/models/x/load", &h)
                    .unwrap()
                    .code,
                "unsupported_media_type",
                "{content_type}"
            );
        }
        // A body with no type, or with a type and length but not JSON.
        let untyped = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::CONTENT_LENGTH, "2"),
        ]);
        assert!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &untyped)
                .is_some()
        );
        let chunked = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::TRANSFER_ENCODING, "chunked"),
        ]);
        assert!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &chunked)
                .is_some()
        );
        // No body at all: nothing to type.
        for none in [
            headers(&[(header::HOST, "127.0.0.1:7733")]),
            headers(&[
                (header::HOST, "127.0.0.1:7733"),
                (header::CONTENT_LENGTH, "0"),
            ]),
        ] {
            assert!(
                guard
                    .refuse(&Method::POST, "/api/models/x/load", &none)
                    .is_none()
            );
        }
        // ... but a foreign origin is still refused.
        let page = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::ORIGIN, "https://evil.example"),
        ]);
        assert_eq!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &page)
                .unwrap()
                .code,
            "forbidden_origin"
        );
        // Bytes go only where a route takes them.
        let bytes = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::CONTENT_TYPE, "application/octet-stream"),
            (header::CONTENT_LENGTH, "4"),
        ]);
        assert!(
            guard
                .refuse(&Method::POST, "/api/models/x/infer", &bytes)
                .is_none()
        );
        assert!(
            guard
                .refuse(&Method::POST, "/api/models/x/load", &bytes)
                .is_some()
        );
        let charset = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::CONTENT_TYPE, "Application/JSON; charset=utf-8"),
        ]);
        assert!(
            guard
                .refuse(&Method::POST, "/v1/embeddings", &charset)
                .is_none()
        );
    }

    #[test]
    fn another_sites_page_is_refused_without_an_origin() {
        let guard = Guard::new(
            &Listen::parse("127.0.0.1:7733").unwrap(),
            Vec::new(),
            &[],
            &[],
        );
        let from = |site: &str| {
            headers(&[
                (header::HOST, "127.0.0.1:7733"),
                (header::HeaderName::from_static("sec-fetch-site"), site),
            ])
        };
        for site in ["cross-site", "same-site"] {
            let refused = guard.refuse(&Method::GET, "/unload", &from(site));
            assert_eq!(
                refused.map(|e| e.code),
                Some("forbidden_origin".into()),
                "{site}"
            );
        }
        for site in ["same-origin", "none"] {
            assert!(
                guard.refuse(&Method::GET, "/unload", &from(site)).is_none(),
                "{site}"
            );
        }
        // The console's page may be opened from a link.
        assert!(
            guard
                .refuse(&Method::GET, "/", &from("cross-site"))
                .is_none()
        );
    }

    #[test]
    fn a_token_passes_as_bearer_x_api_key_or_basic_password_and_only_exact() {
        let given = |pairs: &[(&str, &str)]| {
            let mut map = HeaderMap::new();
            for (k, v) in pairs {
                map.append(
                    axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            presented(&map).iter().any(|g| same(g, "s3cret"))
        };
        let basic = format!("Basic {}", super::super::base64::encode(b"user:s3cret"));
        for ok in [
            vec![("authorization", "Bearer s3cret")],
            vec![("authorization", "bearer s3cret")],
            vec![("authorization", "BEARER  s3cret ")],
            vec![("x-api-key", "s3cret")],
            vec![("authorization", basic.as_str())],
            vec![("authorization", "Bearer wrong"), ("x-api-key", "s3cret")],
        ] {
            assert!(given(&ok), "{ok:?}");
        }
        for bad in [
            vec![("authorization", "Bearer s3cre")],
            vec![("authorization", "Basic s3cret")],
            vec![("authorization", "s3cret")],
            vec![],
        ] {
            assert!(!given(&bad), "{bad:?}");
        }
    }

    #[test]
    fn the_consoles_own_origin_passes_where_the_host_was_checked_and_its_files_need_no_token() {
        let json = (header::CONTENT_TYPE, "application/json");
        let own = headers(&[
            (header::HOST, "127.0.0.1:7733"),
            (header::ORIGIN, "http://127.0.0.1:7733"),
            json.clone(),
        ]);
        assert!(
            loopback()
                .refuse(&Method::POST, "/api/models/x/load", &own)
                .is_none()
        );
        // On a private address with no Host list and no token, a rebound
        // page's origin matches its own Host: not taken as the console's.
        let lan = Guard::new(
            &Listen::parse("10.0.0.5:7733").unwrap(),
            Vec::new(),
            &[],
            &[],
        );
        let rebound = headers(&[
            (header::HOST, "evil.example:7733"),
            (header::ORIGIN, "http://evil.example:7733"),
            json.clone(),
        ]);
        let refused = lan
            .refuse(&Method::POST, "/api/models/x/load", &rebound)
            .unwrap();
        assert_eq!(refused.code, "forbidden_origin");
        // With a token: the page, its script and style load without it;
        // nothing else does.
        let guarded = Guard::new(
            &Listen::parse("127.0.0.1:7733").unwrap(),
            vec!["s3cret".into()],
            &[],
            &[],
        );
        let host = headers(&[(header::HOST, "127.0.0.1:7733")]);
        for path in ["/", "/console.js", "/console.css"] {
            assert!(
                guarded.refuse(&Method::GET, path, &host).is_none(),
                "{path}"
            );
        }
        for (method, path) in [
            (Method::GET, "/api/ps"),
            (Method::POST, "/"),
            (Method::GET, "/api/events"),
        ] {
            let refused = guarded.refuse(&method, path, &host).unwrap();
            assert_eq!(refused.code, "unauthorized", "{method} {path}");
        }
    }
}
