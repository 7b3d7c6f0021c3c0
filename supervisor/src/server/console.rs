//! The console: a page at `/` that shows the models, their memory over
//! time with the events drawn on it, the event list, unload reports and
//! dead workers' last stderr lines, with load, unload and swap actions.
//!
//! Its HTML, CSS and JavaScript (`console/`) are built into the binary and
//! fetch nothing from anywhere else; the charts are SVG drawn by its own
//! script. The three files are served without the token (they hold no
//! data); the page asks for the token once, keeps it in the browser's
//! storage for this address, and sends it only in the `Authorization`
//! header of its own requests: never in a URL. A Content-Security-Policy
//! lets the page run only its own script, reach only this server, and be
//! framed by no one; its actions are JSON POSTs, which the guard's Origin
//! and Host rules cover.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("console/index.html");
const SCRIPT: &str = include_str!("console/console.js");
const STYLE: &str = include_str!("console/console.css");

/// The console's own paths: served without the token.
pub(crate) const PATHS: [&str; 3] = ["/", "/console.js", "/console.css"];

/// Only the page's own script and style, requests to this server alone,
/// no plugins, forms or frames.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; \
    frame-ancestors 'none'";

fn serve(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

pub async fn page() -> Response {
    serve("text/html; charset=utf-8", PAGE)
}

pub async fn script() -> Response {
    serve("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    serve("text/css; charset=utf-8", STYLE)
}
