//! llama-swap's `peers`: models another server serves (another llama-swap,
//! another berth, OpenRouter, any OpenAI-compatible endpoint), relayed to
//! it over HTTP or HTTPS. berth runs nothing for them, so there is nothing
//! to load, unload or prove: `ps` lists them as such.
//!
//! A peer's model is reached as `PEER/MODEL`, or by its bare name where
//! exactly one peer lists it (and no model here has it: a model here always
//! wins). The request goes to the peer's URL with its path joined on
//! (`https://openrouter.ai/api` + `/v1/chat/completions`), the `model`
//! rewritten to the peer's own name, the peer's `apiKey` sent as both
//! `Authorization: Bearer` and `x-api-key` (never shown: not in `ps`, not
//! in a log, not in an error). The client's own credentials are berth's
//! and never go on. The answer comes back as the peer sends it, a stream's
//! pieces as they arrive.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value as Json, json};

use super::filters::Filters;
use crate::server::error::ApiError;

/// A peer's address, as its `proxy` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerUrl {
    pub https: bool,
    /// `host[:port]`.
    pub authority: String,
    /// Its path, without a trailing `/` (`/api`; empty for none).
    pub path: String,
    /// Its query, joined before the request's own.
    pub query: Option<String>,
}

impl PeerUrl {
    /// `proxy` read: `http://` or `https://`, a host, maybe a port, a path.
    pub fn parse(proxy: &str) -> Result<PeerUrl, String> {
        let uri: Uri = proxy
            .trim()
            .parse()
            .map_err(|e| format!("`proxy` `{proxy}` is not a URL: {e}"))?;
        let https = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            Some(other) => {
                return Err(format!(
                    "`proxy` `{proxy}`: berth reaches a peer over http:// or https://, not \
                     {other}://"
                ));
            }
            None => {
                return Err(format!(
                    "`proxy` `{proxy}` has no scheme: write http://HOST[:PORT] or https://…"
                ));
            }
        };
        let authority = uri
            .authority()
            .filter(|a| !a.host().is_empty())
            .ok_or_else(|| format!("`proxy` `{proxy}` names no host"))?
            .to_string();
        if authority.contains('@') {
            return Err(format!(
                "`proxy` `{proxy}` carries credentials in its address; give them as `apiKey`"
            ));
        }
        Ok(PeerUrl {
            https,
            authority,
            path: uri.path().trim_end_matches('/').to_string(),
            query: uri.query().filter(|q| !q.is_empty()).map(str::to_string),
        })
    }

    /// The URL a request for `path` (and `query`) goes to.
    fn join(&self, path: &str, query: Option<&str>) -> String {
        let scheme = if self.https { "https" } else { "http" };
        let path = format!("{}/{}", self.path, path.trim_start_matches('/'));
        let query = match (self.query.as_deref(), query.filter(|q| !q.is_empty())) {
            (Some(a), Some(b)) => format!("?{a}&{b}"),
            (Some(q), None) | (None, Some(q)) => format!("?{q}"),
            (None, None) => String::new(),
        };
        format!("{scheme}://{}{path}{query}", self.authority)
    }
}

impl std::fmt::Display for PeerUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.https { "https" } else { "http" };
        write!(f, "{scheme}://{}{}", self.authority, self.path)
    }
}

/// A peer, as its config says.
#[derive(Clone)]
pub struct Peer {
    pub id: String,
    pub url: PeerUrl,
    /// Sent as `Authorization: Bearer` and `x-api-key`; never shown.
    pub api_key: Option<String>,
    /// The models it serves, by its own names, in the file's order.
    pub models: Vec<String>,
    pub filters: Filters,
    /// `timeouts.connect` (llama-swap's default: 30 s).
    pub connect_timeout: Duration,
    /// `timeouts.responseHeader`: how long the answer's head may take
    /// (llama-swap's default: 60 s; `None`: as long as it takes).
    pub header_timeout: Option<Duration>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("id", &self.id)
            .field("url", &self.url)
            .field("api_key", &self.api_key.as_ref().map(|_| "(set)"))
            .field("models", &self.models)
            .finish_non_exhaustive()
    }
}

/// What a name a request used reaches on a peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerModel {
    /// Index into [`Peers::list`].
    pub peer: usize,
    /// The peer's own name for it.
    pub model: String,
}

type HttpsClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>;

/// The peers, and the names that reach their models.
#[derive(Default)]
pub struct Peers {
    pub list: Vec<Peer>,
    /// `PEER/MODEL` for every model, and the bare name where one peer
    /// alone lists it.
    routes: BTreeMap<String, PeerModel>,
    /// One client per peer (its own timeouts), made at its first request.
    clients: Vec<OnceLock<Result<HttpsClient, String>>>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers").field("list", &self.list).finish()
    }
}

impl Peers {
    /// The peers (sorted by ID, as llama-swap walks them) and their routes.
    pub fn new(mut list: Vec<Peer>) -> Peers {
        list.sort_by(|a, b| a.id.cmp(&b.id));
        let mut routes = BTreeMap::new();
        let mut bare: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, peer) in list.iter().enumerate() {
            for model in &peer.models {
                routes.insert(
                    format!("{}/{model}", peer.id),
                    PeerModel {
                        peer: i,
                        model: model.clone(),
                    },
                );
                let owners = bare.entry(model.as_str()).or_default();
                if !owners.contains(&i) {
                    owners.push(i);
                }
            }
        }
        for (model, owners) in bare {
            if let [only] = owners[..]
                && !routes.contains_key(model)
            {
                routes.insert(
                    model.to_string(),
                    PeerModel {
                        peer: only,
                        model: model.to_string(),
                    },
                );
            }
        }
        let clients = list.iter().map(|_| OnceLock::new()).collect();
        Peers {
            list,
            routes,
            clients,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The peer's model `name` reaches, if any.
    pub fn resolve(&self, name: &str) -> Option<&PeerModel> {
        self.routes.get(name)
    }

    /// Every `PEER/MODEL`, for the listing, sorted.
    pub fn qualified(&self) -> impl Iterator<Item = (&Peer, &str)> {
        self.list
            .iter()
            .flat_map(|p| p.models.iter().map(move |m| (p, m.as_str())))
    }

    /// `ps`'s account of the peers: where each is and what it serves; its
    /// key only as whether one is set.
    pub fn status(&self) -> Json {
        Json::Array(
            self.list
                .iter()
                .map(|p| {
                    json!({
                        "peer": p.id,
                        "url": p.url.to_string(),
                        "models": p.models,
                        "api_key": p.api_key.is_some(),
                        "note": "served by another server: no process here, nothing to load, \
                                 unload or measure",
                    })
                })
                .collect(),
        )
    }

    fn client(&self, peer: usize) -> Result<&HttpsClient, String> {
        self.clients[peer]
            .get_or_init(|| client(&self.list[peer]))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// The roots a peer's certificate is checked against: the host's (where
/// `SSL_CERT_FILE` or `SSL_CERT_DIR` point, else the system's store).
fn roots() -> Result<rustls::RootCertStore, String> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map(|e| format!(": {e}"))
            .unwrap_or_default();
        return Err(format!(
            "no trusted certificate could be read from this host{why} (install the system's \
             CA certificates, or point SSL_CERT_FILE at a PEM file)"
        ));
    }
    Ok(roots)
}

fn client(peer: &Peer) -> Result<HttpsClient, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    // A plain-HTTP peer needs no roots; an HTTPS one cannot go without.
    let roots = if peer.url.https {
        roots()?
    } else {
        rustls::RootCertStore::empty()
    };
    let tls = builder.with_root_certificates(roots).with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(peer.connect_timeout));
    http.set_nodelay(true);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(connector))
}

/// What the relay never passes on (`relay::NOT_PASSED`: one connection's
/// headers, berth's own credentials), and what says where the client is:
/// never sent to a peer, which is another site, nor passed back from it.
fn not_passed(name: &HeaderName) -> bool {
    const WHERE_FROM: &[&str] = &[
        "forwarded",
        "x-forwarded-for",
        "x-forwarded-host",
        "x-forwarded-proto",
    ];
    crate::server::relay::NOT_PASSED.contains(&name.as_str()) || WHERE_FROM.contains(&name.as_str())
}

/// One request for `target` relayed to its peer: `path` and `query` as the
/// peer is to see them, `body` as berth's filters left it.
pub(crate) async fn relay(
    peers: &Peers,
    target: &PeerModel,
    method: &Method,
    path: &str,
    query: Option<&str>,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    let peer = &peers.list[target.peer];
    let named = format!("peer `{}` (model `{}`)", peer.id, target.model);
    let client = match peers.client(target.peer) {
        Ok(client) => client,
        Err(e) => {
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                format!("{named}: cannot reach {}: {e}", peer.url),
            )
            .into_response();
        }
    };
    let url = peer.url.join(path, query);
    let mut request = match axum::http::Request::builder()
        .method(method.clone())
        .uri(&url)
        .body(Body::from(body))
    {
        Ok(request) => request,
        Err(e) => {
            return ApiError::bad_request(format!("{named}: `{url}` is not a valid URL: {e}"))
                .into_response();
        }
    };
    for (name, value) in headers {
        if !not_passed(name) {
            request.headers_mut().append(name.clone(), value.clone());
        }
    }
    if let Ok(host) = HeaderValue::try_from(peer.url.authority.as_str()) {
        request.headers_mut().insert(header::HOST, host);
    }
    if let Some(key) = &peer.api_key
        && let (Ok(bearer), Ok(key)) = (
            HeaderValue::try_from(format!("Bearer {key}")),
            HeaderValue::try_from(key.as_str()),
        )
    {
        let (mut bearer, mut key) = (bearer, key);
        bearer.set_sensitive(true);
        key.set_sensitive(true);
        request.headers_mut().insert(header::AUTHORIZATION, bearer);
        request
            .headers_mut()
            .insert(HeaderName::from_static("x-api-key"), key);
    }
    let sent = client.request(request);
    let answer = match peer.header_timeout {
        Some(limit) => match tokio::time::timeout(limit, sent).await {
            Ok(answer) => answer,
            Err(_) => {
                return ApiError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    "upstream_timeout",
                    format!(
                        "{named}: {} did not begin its answer within {} (`timeouts.\
                         responseHeader`)",
                        peer.url,
                        crate::units::format_duration(limit)
                    ),
                )
                .into_response();
            }
        },
        None => sent.await,
    };
    let answer = match answer {
        Ok(answer) => answer,
        Err(e) => {
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(inner) = source {
                why = format!("{why}: {inner}");
                source = inner.source();
            }
            return ApiError::new(
                StatusCode::BAD_GATEWAY,
                "upstream_unreachable",
                format!("{named}: {} did not answer: {why}", peer.url),
            )
            .into_response();
        }
    };
    let (mut head, body) = answer.into_parts();
    if head.status.is_informational() {
        return ApiError::new(
            StatusCode::BAD_GATEWAY,
            "upstream_bad_answer",
            format!(
                "{named}: {} answered {} (a protocol switch); berth relays requests and \
                 answers, not upgraded connections",
                peer.url, head.status
            ),
        )
        .into_response();
    }
    let dropped: Vec<HeaderName> = head
        .headers
        .keys()
        .filter(|n| {
            (not_passed(n) && **n != header::CONTENT_LENGTH)
                || **n == header::SET_COOKIE
                || n.as_str().starts_with("access-control-")
        })
        .cloned()
        .collect();
    for name in dropped {
        head.headers.remove(name);
    }
    let stream = head
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.contains("text/event-stream"));
    if stream {
        head.headers.insert(
            HeaderName::from_static("x-accel-buffering"),
            HeaderValue::from_static("no"),
        );
    }
    head.headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    head.extensions.insert(crate::server::relay::Relayed);
    Response::from_parts(head, Body::new(body))
}

/// `body`'s `model` made `model` (a JSON body; any other is left as it is).
pub(crate) fn renamed(body: &mut serde_json::Map<String, Json>, model: &str) {
    body.insert("model".into(), Json::String(model.to_string()));
}

/// `query`'s `model=` made `model`, the rest as it was.
pub(crate) fn renamed_query(query: &str, model: &str) -> String {
    let encoded: String = model
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect();
    query
        .split('&')
        .map(|pair| {
            if pair == "model" || pair.starts_with("model=") {
                format!("model={encoded}")
            } else {
                pair.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(id: &str, models: &[&str]) -> Peer {
        Peer {
            id: id.into(),
            url: PeerUrl::parse("http://127.0.0.1:9").unwrap(),
            api_key: None,
            models: models.iter().map(|m| m.to_string()).collect(),
            filters: Filters::default(),
            connect_timeout: Duration::from_secs(1),
            header_timeout: None,
        }
    }

    #[test]
    fn a_bare_name_reaches_a_peer_only_where_one_peer_alone_lists_it() {
        let peers = Peers::new(vec![
            peer("b", &["shared", "only-b", "a/x"]),
            peer("a", &["shared", "x"]),
        ]);
        assert_eq!(peers.resolve("a/shared").unwrap().model, "shared");
        assert_eq!(peers.resolve("b/shared").unwrap().peer, 1);
        assert!(peers.resolve("shared").is_none(), "two peers list it");
        assert_eq!(peers.resolve("only-b").unwrap().peer, 1);
        // `a/x` is `a`'s FQN: b's model of that bare name is reached only
        // as `b/a/x`.
        assert_eq!(
            peers.resolve("a/x").unwrap(),
            &PeerModel {
                peer: 0,
                model: "x".into()
            }
        );
        assert_eq!(peers.resolve("b/a/x").unwrap().model, "a/x");
        assert!(peers.resolve("nope").is_none());
    }

    #[test]
    fn a_peers_url_joins_its_path_and_query_with_the_requests() {
        let url = PeerUrl::parse("https://openrouter.ai/api/").unwrap();
        assert_eq!(
            url.join("/v1/chat/completions", None),
            "https://openrouter.ai/api/v1/chat/completions"
        );
        let url = PeerUrl::parse("http://10.0.0.2:8080?k=1").unwrap();
        assert_eq!(
            url.join("/props", Some("model=m")),
            "http://10.0.0.2:8080/props?k=1&model=m"
        );
        for bad in ["10.0.0.2:8080", "ftp://x", "http://", "http://user:pw@host"] {
            assert!(PeerUrl::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_querys_model_is_replaced_and_the_rest_kept() {
        assert_eq!(
            renamed_query("a=1&model=p%2Fm&b=2", "m x"),
            "a=1&model=m%20x&b=2"
        );
    }

    #[test]
    fn a_peers_key_is_never_shown() {
        let mut p = peer("p", &["m"]);
        p.api_key = Some("sk-secret".into());
        let peers = Peers::new(vec![p]);
        assert!(!format!("{peers:?}").contains("sk-secret"));
        assert!(!peers.status().to_string().contains("sk-secret"));
    }
}
