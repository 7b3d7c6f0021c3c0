//! Errors in OpenAI's shape: `{"error": {"message", "type", "code"}}`, with
//! a status code that fits.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::error::Error;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: String,
    pub message: String,
    /// Seconds a client should wait before retrying (`Retry-After`).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code: code.into(),
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }
}

fn status_for(kind: &str) -> StatusCode {
    match kind {
        "model_not_found" => StatusCode::NOT_FOUND,
        "bad_request" | "input_too_large" | "invalid_spec" | "unknown_backend" => {
            StatusCode::BAD_REQUEST
        }
        "not_loaded" | "already_loaded" | "busy" => StatusCode::CONFLICT,
        "queue_full" => StatusCode::TOO_MANY_REQUESTS,
        "memory_budget_exceeded"
        | "gpu_memory_budget_exceeded"
        | "shutting_down"
        | "model_failed"
        | "restarting" => StatusCode::SERVICE_UNAVAILABLE,
        "load_timeout" => StatusCode::GATEWAY_TIMEOUT,
        "worker_died" | "gpu_out_of_memory" | "handshake_failed" | "protocol_mismatch"
        | "unexpected_message" => StatusCode::BAD_GATEWAY,
        "cancelled" => StatusCode::REQUEST_TIMEOUT,
        "deadline_exceeded" | "stalled" => StatusCode::GATEWAY_TIMEOUT,
        "quarantined" => StatusCode::UNPROCESSABLE_ENTITY,
        "memory_limit_exceeded" | "heartbeat_lost" => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let kind = e.kind();
        let retry_after = match &e {
            Error::Restarting { in_s, .. } => Some(in_s.ceil().max(1.0) as u64),
            Error::QueueFull { .. } => Some(1),
            _ => None,
        };
        ApiError {
            status: status_for(kind),
            code: kind.to_string(),
            message: e.to_string(),
            retry_after,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        let body = serde_json::json!({
            "error": { "message": self.message, "type": kind, "code": self.code }
        });
        let mut response = (self.status, Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(axum::http::header::RETRY_AFTER, secs.into());
        }
        response
    }
}

/// Parses a JSON body with an error that names what is wrong.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}
