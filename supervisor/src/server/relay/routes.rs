//! Model routes outside `/v1`: the native routes of the servers people run
//! (llama.cpp's `/completion` and `/infill`, `/rerank`, stable-diffusion's
//! `/sdapi/v1/…`), llama-swap's versionless `/v/…` forms, and the GET
//! routes that name their model in the query (`/props?model=`). Each is
//! routed by its model, as llama-swap routes them, to an HTTP server only.

use axum::http::Method;

/// POST routes whose JSON body names the model, sent on as they are.
const POSTS: &[&str] = &[
    "/completion",
    "/infill",
    "/rerank",
    "/reranking",
    "/sdapi/v1/txt2img",
    "/sdapi/v1/img2img",
];

/// llama-swap's versionless forms: sent on without the `/v`.
const VERSIONLESS: &[&str] = &[
    "/v/chat/completions",
    "/v/responses",
    "/v/completions",
    "/v/messages",
    "/v/messages/count_tokens",
    "/v/embeddings",
    "/v/rerank",
    "/v/reranking",
];

/// GET routes whose query names the model (`?model=`).
const GETS: &[&str] = &["/props", "/sdapi/v1/loras", "/v1/audio/voices"];

/// How a model route names its model, and the path its server is sent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum ModelRoute {
    /// In the body; the server is sent this path.
    Body(String),
    /// In the query's `model`.
    Query,
}

/// The model route `path` is, for `method`, outside `/v1` POSTs (which the
/// relay routes by their body as ever); `None` for any other path.
pub(crate) fn model_route(method: &Method, path: &str) -> Option<ModelRoute> {
    if method == Method::POST {
        if POSTS.contains(&path) {
            return Some(ModelRoute::Body(path.to_string()));
        }
        if VERSIONLESS.contains(&path) {
            return Some(ModelRoute::Body(path["/v".len()..].to_string()));
        }
        if path == "/audioapi/v1/tasks/run" {
            return Some(ModelRoute::Body(path["/audioapi".len()..].to_string()));
        }
    }
    if method == Method::GET && GETS.contains(&path) {
        return Some(ModelRoute::Query);
    }
    None
}

/// The `model` of a query string, percent-decoded (`+` is a space).
pub(crate) fn query_model(query: Option<&str>) -> Option<String> {
    let value = query?
        .split('&')
        .find_map(|pair| pair.strip_prefix("model="))?;
    percent_decode(value, true).filter(|m| !m.is_empty())
}

/// `text` percent-decoded (with `plus`, a `+` is a space, as in a query);
/// `None` if it is not well formed or not UTF-8.
pub(crate) fn percent_decode(text: &str, plus: bool) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' if plus => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b'%' => return None,
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_routes_and_the_paths_sent_on() {
        let post = Method::POST;
        assert_eq!(
            model_route(&post, "/completion"),
            Some(ModelRoute::Body("/completion".into()))
        );
        assert_eq!(
            model_route(&post, "/v/chat/completions"),
            Some(ModelRoute::Body("/chat/completions".into()))
        );
        assert_eq!(
            model_route(&post, "/audioapi/v1/tasks/run"),
            Some(ModelRoute::Body("/v1/tasks/run".into()))
        );
        assert_eq!(model_route(&Method::GET, "/props"), Some(ModelRoute::Query));
        assert_eq!(model_route(&Method::GET, "/completion"), None);
        assert_eq!(model_route(&post, "/v1/chat/completions"), None);
        assert_eq!(model_route(&post, "/api/models"), None);
        assert_eq!(
            query_model(Some("a=1&model=GPT-OSS%2020B+x")).as_deref(),
            Some("GPT-OSS 20B x")
        );
        assert_eq!(query_model(Some("model=a%2")), None);
        assert_eq!(query_model(Some("model=")), None);
        assert_eq!(query_model(None), None);
    }
}
