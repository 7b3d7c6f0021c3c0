//! What the relay reads of a request and what it rewrites: the `model` it
//! names (a JSON field, or a form's part, read as bytes), whether its path
//! is a plain `/v1` one, berth's own `keep_alive` and `timeout`, and the
//! model's name as its server knows it. Nothing else of a request is
//! parsed or changed.

use axum::body::Bytes;
use axum::http::{HeaderMap, header};
use serde_json::Value;

use crate::server::error::ApiError;
use crate::supervisor::RequestOptions;

/// A path with no `.` or `..` segment (written plainly or percent-encoded),
/// no encoded `/` or `\\` and no empty segment but a trailing one: what berth checked (`/v1/`)
/// is what the server sees, whatever it normalises.
pub(super) fn plain_path(path: &str) -> bool {
    let lower = path.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") || lower.contains('\\') {
        return false;
    }
    let segments: Vec<&str> = lower.split('/').skip(1).collect();
    segments.iter().enumerate().all(|(i, segment)| {
        let dots = segment.replace("%2e", ".");
        // A trailing `/` is a path of its own, not a way around `/v1/`.
        (!segment.is_empty() || i + 1 == segments.len()) && dots != "." && dots != ".."
    })
}

/// Whether a form names `model` more than once.
pub(crate) fn has_two_model_parts(headers: &HeaderMap, body: &[u8]) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(multipart_boundary)
        .is_some_and(|boundary| form_spans(body, &boundary, "model").len() > 1)
}

/// The `model` a request names: the JSON body's `model` field, or a
/// multipart form's `model` part (audio transcriptions).
pub(crate) fn model_of(headers: &HeaderMap, body: &[u8]) -> Option<String> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if let Some(boundary) = multipart_boundary(content_type) {
        return multipart_field(body, &boundary, "model");
    }
    #[derive(serde::Deserialize)]
    struct Named {
        model: String,
    }
    serde_json::from_slice::<Named>(body).ok().map(|n| n.model)
}

pub(crate) fn multipart_boundary(content_type: &str) -> Option<String> {
    let mut parts = content_type.split(';');
    if !parts
        .next()?
        .trim()
        .eq_ignore_ascii_case("multipart/form-data")
    {
        return None;
    }
    parts.find_map(|p| {
        let (key, value) = p.trim().split_once('=')?;
        key.eq_ignore_ascii_case("boundary")
            .then(|| value.trim_matches('"').to_string())
    })
}

/// The value of the form field `name` in a `multipart/form-data` body
/// (the first, if the form has several).
fn multipart_field(body: &[u8], boundary: &str, name: &str) -> Option<String> {
    let span = form_spans(body, boundary, name).into_iter().next()?;
    Some(String::from_utf8_lossy(&body[span]).into_owned())
}

/// Where the values of the form field `name` lie in a `multipart/form-data`
/// body, read as bytes (the other parts, audio say, are not text).
fn form_spans(body: &[u8], boundary: &str, name: &str) -> Vec<std::ops::Range<usize>> {
    let delimiter = format!("--{boundary}");
    let delimiter = delimiter.as_bytes();
    let find = |from: usize, what: &[u8]| {
        body.get(from..)?
            .windows(what.len())
            .position(|w| w == what)
            .map(|at| from + at)
    };
    // `name="model"`, `name=model`, `NAME = "model"`: as servers read it.
    let names = |param: &str| {
        param.split_once('=').is_some_and(|(key, value)| {
            key.trim().eq_ignore_ascii_case("name") && value.trim().trim_matches('"') == name
        })
    };
    let mut spans = Vec::new();
    let mut at = find(0, delimiter);
    while let Some(here) = at {
        let part_start = here + delimiter.len();
        let next = find(part_start, delimiter);
        let part_end = next.unwrap_or(body.len());
        if let Some(head_end) = find(part_start, b"\r\n\r\n").filter(|h| *h < part_end) {
            let head = String::from_utf8_lossy(&body[part_start..head_end]);
            let named = head.lines().any(|l| {
                l.to_ascii_lowercase().starts_with("content-disposition:")
                    && l.split(';').skip(1).any(names)
            });
            if named {
                let value_end = if body[..part_end].ends_with(b"\r\n") {
                    part_end - 2
                } else {
                    part_end
                };
                spans.push(head_end + 4..value_end.max(head_end + 4));
            }
        }
        at = next;
    }
    spans
}

/// `body` with the form field `model` set to `name`.
pub(crate) fn renamed_form(body: Bytes, boundary: &str, name: &str) -> Bytes {
    let spans = form_spans(&body, boundary, "model");
    if spans.is_empty() {
        return body;
    }
    let mut out = Vec::with_capacity(body.len() + name.len());
    let mut from = 0;
    for span in spans {
        out.extend_from_slice(&body[from..span.start]);
        out.extend_from_slice(name.as_bytes());
        from = span.end;
    }
    out.extend_from_slice(&body[from..]);
    Bytes::from(out)
}

/// berth's own request options in a JSON body (`keep_alive`, `timeout`, as
/// its own routes take them); they reach the server too, untouched.
pub(super) fn options_of(body: &[u8]) -> Result<RequestOptions, ApiError> {
    #[derive(serde::Deserialize)]
    struct Options {
        keep_alive: Option<crate::server::openai::KeepAliveField>,
        timeout: Option<crate::server::openai::KeepAliveField>,
    }
    match serde_json::from_slice::<Options>(body) {
        Ok(o) => crate::server::openai::request_options(o.keep_alive.as_ref(), o.timeout.as_ref()),
        // Not JSON (a form), or fields of other types: none of berth's.
        Err(_) => Ok(RequestOptions::default()),
    }
}

/// `body` with its JSON `model` field set to `name` (the server's own name
/// for the model); any other body as it is.
pub(super) fn renamed(body: Bytes, name: &str) -> Bytes {
    match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(mut object)) => {
            object.insert("model".into(), Value::String(name.into()));
            serde_json::to_vec(&object).map(Bytes::from).unwrap_or(body)
        }
        _ => body,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_read_from_json_or_a_form() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        assert_eq!(
            model_of(
                &headers,
                br#"{"messages": [], "model": "m1", "tools": [1]}"#
            ),
            Some("m1".into())
        );
        assert_eq!(model_of(&headers, b"not json"), None);
        headers.insert(
            header::CONTENT_TYPE,
            "multipart/form-data; boundary=XyZ".parse().unwrap(),
        );
        let form = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF....\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";
        assert_eq!(model_of(&headers, form), Some("whisper-1".into()));
    }

    #[test]
    fn only_plain_paths_reach_a_server() {
        assert!(plain_path("/v1/chat/completions"));
        assert!(plain_path("/v1/audio/transcriptions"));
        assert!(plain_path("/v1/models/"));
        for path in [
            "/v1/../slots",
            "/v1/%2e%2e/props",
            "/v1/%2E./props",
            "/v1/./x",
            "/v1//x",
            "/v1/a%2fb",
            "/v1/a\\b",
        ] {
            assert!(!plain_path(path), "{path}");
        }
    }

    #[test]
    fn a_form_s_model_part_is_renamed_and_its_other_bytes_kept() {
        let form: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\xff\x00\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper-1\r\n--XyZ--\r\n";
        let renamed = renamed_form(Bytes::from_static(form), "XyZ", "large-v3");
        let expected: &[u8] = b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\xff\x00\r\n--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nlarge-v3\r\n--XyZ--\r\n";
        assert_eq!(&renamed[..], expected);
        // Written without quotes, or another way, it is still `model`.
        let unquoted: &[u8] =
            b"--B\r\nContent-Disposition: form-data; NAME = model\r\n\r\nv\r\n--B--\r\n";
        assert_eq!(form_spans(unquoted, "B", "model").len(), 1);
        // `name="model_x"` is not `model`.
        let other: &[u8] =
            b"--B\r\nContent-Disposition: form-data; name=\"model_x\"\r\n\r\nv\r\n--B--\r\n";
        assert!(form_spans(other, "B", "model").is_empty());
        // Two `model` parts are seen as such.
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            "multipart/form-data; boundary=B".parse().unwrap(),
        );
        let twice: &[u8] = b"--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\na\r\n--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nb\r\n--B--\r\n";
        assert!(has_two_model_parts(&headers, twice));
        assert!(!has_two_model_parts(&headers, other));
    }

    #[test]
    fn a_rename_keeps_every_other_field() {
        let body =
            Bytes::from_static(br#"{"model":"berth-name","tools":[{"x":1}],"logprobs":true}"#);
        let renamed: Value = serde_json::from_slice(&renamed(body, "upstream-name")).unwrap();
        assert_eq!(
            renamed,
            serde_json::json!({"model": "upstream-name", "tools": [{"x": 1}], "logprobs": true})
        );
    }
}
