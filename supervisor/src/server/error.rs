//! Errors in OpenAI's shape: `{"error": {"message", "type", "code"}}`, with
//! a status code that fits.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::error::{Error, ErrorClass};

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

    /// The JSON body, as a response or an event in a stream sends it:
    /// `{"error": {"message", "type", "code"}}`, the type
    /// `invalid_request_error` for a 4xx status and `server_error` otherwise.
    pub fn body(&self) -> serde_json::Value {
        let kind = if self.status.is_client_error() {
            "invalid_request_error"
        } else {
            "server_error"
        };
        serde_json::json!({
            "error": { "message": self.message, "type": kind, "code": self.code }
        })
    }
}

/// The HTTP status and the stable error code ([`Error::kind`]) for an error.
/// The status follows the error's [`ErrorClass`], which [`Error::class`]
/// gives by an exhaustive match on the variant: a new variant, or a new
/// class, does not compile until it has a status. A [`Error::SharedLoad`]
/// carries the class of the error it copies, so it gets the same status.
pub(crate) fn status_and_code(e: &Error) -> (StatusCode, &'static str) {
    let status = match e.class() {
        ErrorClass::NotFound => StatusCode::NOT_FOUND,
        ErrorClass::Invalid => StatusCode::BAD_REQUEST,
        ErrorClass::Conflict => StatusCode::CONFLICT,
        ErrorClass::Overloaded => StatusCode::TOO_MANY_REQUESTS,
        ErrorClass::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        ErrorClass::TimedOut => StatusCode::GATEWAY_TIMEOUT,
        ErrorClass::WorkerFailed => StatusCode::BAD_GATEWAY,
        ErrorClass::Cancelled => StatusCode::REQUEST_TIMEOUT,
        ErrorClass::Refused => StatusCode::UNPROCESSABLE_ENTITY,
        ErrorClass::Internal => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, e.kind())
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        let (status, code) = status_and_code(&e);
        let retry_after = match &e {
            Error::Restarting { in_s, .. } | Error::LoadBackoff { in_s, .. } => {
                Some(in_s.ceil().max(1.0) as u64)
            }
            Error::QueueFull { .. } | Error::MachineQueueFull { .. } => Some(1),
            _ => None,
        };
        ApiError {
            status,
            code: code.to_string(),
            message: e.to_string(),
            retry_after,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use berth_protocol::{ErrorKind, WireError};

    use super::*;
    use crate::base::{CapMechanism, ExitStatus, KillCause};

    const M: &str = "m";

    fn died(cause: Option<KillCause>) -> Error {
        Error::WorkerDied {
            model: M.into(),
            pid: 7,
            exit: ExitStatus::Signal("SIGKILL".into()),
            during: "a request",
            stderr_tail: Vec::new(),
            cause,
        }
    }

    fn load_failed(kind: ErrorKind) -> Error {
        Error::LoadFailed {
            model: M.into(),
            source: WireError::new(kind, "it failed"),
        }
    }

    fn request(kind: ErrorKind) -> Error {
        Error::Request {
            model: M.into(),
            source: WireError::new(kind, "it failed"),
        }
    }

    fn io() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::PermissionDenied, "denied")
    }

    const WIRE_KINDS: [ErrorKind; 8] = ErrorKind::ALL;

    /// What the wire kinds map to, as the string table did.
    fn wire_expected(kind: ErrorKind) -> (u16, &'static str) {
        match kind {
            ErrorKind::BadRequest => (400, "bad_request"),
            ErrorKind::UnknownBackend => (400, "unknown_backend"),
            ErrorKind::LoadFailed => (500, "load_failed"),
            ErrorKind::NotLoaded => (409, "not_loaded"),
            ErrorKind::Cancelled => (408, "cancelled"),
            ErrorKind::InputTooLarge => (400, "input_too_large"),
            ErrorKind::Backend => (500, "backend_error"),
            ErrorKind::Internal => (500, "internal"),
            other => panic!("add {other:?} to WIRE_KINDS and to this table"),
        }
    }

    /// One error of each variant family, with the status and code it gets.
    fn table() -> Vec<(Error, u16, &'static str)> {
        let mut rows = vec![
            (
                Error::WorkerBinaryNotFound {
                    searched: vec!["/x".into()],
                },
                500,
                "worker_not_found",
            ),
            (
                Error::Spawn {
                    model: M.into(),
                    binary: "/x".into(),
                    source: io(),
                },
                500,
                "spawn_failed",
            ),
            (
                Error::Handshake {
                    model: M.into(),
                    pid: 7,
                    reason: "closed its pipe".into(),
                },
                502,
                "handshake_failed",
            ),
            (
                Error::ProtocolMismatch {
                    model: M.into(),
                    pid: 7,
                    mismatch: Box::new(crate::error::VersionMismatch {
                        program: "/opt/w".into(),
                        pid: 7,
                        wire: "protocol",
                        supervisor: "2".into(),
                        worker: "1".into(),
                        advice: "rebuild".into(),
                        ending: "it was stopped".into(),
                    }),
                },
                502,
                "protocol_mismatch",
            ),
            (
                Error::UnexpectedMessage {
                    model: M.into(),
                    expected: "Ready",
                    received: "Chunk",
                },
                502,
                "unexpected_message",
            ),
            (
                Error::LoadTimeout {
                    model: M.into(),
                    pid: 7,
                    timeout: Duration::from_secs(60),
                    phase: "load",
                },
                504,
                "load_timeout",
            ),
            (died(None), 502, "worker_died"),
            (
                died(Some(KillCause::Stalled {
                    no_progress_for_s: 30.0,
                })),
                504,
                "stalled",
            ),
            (
                died(Some(KillCause::HeartbeatLost { silent_for_s: 10.0 })),
                502,
                "heartbeat_lost",
            ),
            (
                died(Some(KillCause::GpuOutOfMemory {
                    line: "CUDA out of memory".into(),
                })),
                502,
                "gpu_out_of_memory",
            ),
            (
                died(Some(KillCause::MemoryLimit {
                    limit_bytes: 1 << 30,
                    peak_bytes: 1 << 30,
                    mechanism: CapMechanism::CgroupV2,
                })),
                502,
                "worker_died",
            ),
            (
                Error::MemoryLimitExceeded {
                    model: M.into(),
                    pid: 7,
                    limit: 1 << 30,
                    peak: 1 << 31,
                    mechanism: CapMechanism::RssPoll,
                    during: "load",
                },
                502,
                "memory_limit_exceeded",
            ),
            (Error::NotLoaded { model: M.into() }, 409, "not_loaded"),
            (
                Error::AlreadyLoaded {
                    model: M.into(),
                    pid: 7,
                },
                409,
                "already_loaded",
            ),
            (
                Error::InvalidSpec {
                    model: M.into(),
                    reason: "no backend".into(),
                },
                400,
                "invalid_spec",
            ),
            (
                Error::InvalidRequest {
                    model: M.into(),
                    reason: "deadline 0".into(),
                },
                400,
                "bad_request",
            ),
            (
                Error::ShuttingDown { model: M.into() },
                503,
                "shutting_down",
            ),
            (
                Error::Io {
                    model: M.into(),
                    what: "reading",
                    source: io(),
                },
                500,
                "io_error",
            ),
            (
                Error::UnknownModel {
                    model: M.into(),
                    known: Vec::new(),
                },
                404,
                "model_not_found",
            ),
            (
                Error::QueueFull {
                    model: M.into(),
                    max_concurrency: 1,
                    queued: 4,
                },
                429,
                "queue_full",
            ),
            (
                Error::MachineQueueFull {
                    model: M.into(),
                    waiting: 512,
                },
                503,
                "machine_queue_full",
            ),
            (
                Error::BudgetExceeded {
                    model: M.into(),
                    needed: 1 << 30,
                    reason: "over budget".into(),
                },
                503,
                "memory_budget_exceeded",
            ),
            (
                Error::GpuBudgetExceeded {
                    model: M.into(),
                    needed: 1 << 30,
                    reason: "over budget".into(),
                },
                503,
                "gpu_memory_budget_exceeded",
            ),
            (
                Error::GpuOutOfMemory {
                    model: M.into(),
                    line: "RESOURCE_EXHAUSTED: Out of memory".into(),
                    room: "its share is 1.0 GiB".into(),
                },
                502,
                "gpu_out_of_memory",
            ),
            (
                Error::GpuUnused {
                    model: M.into(),
                    pid: 7,
                    gpus: "0".into(),
                },
                502,
                "gpu_unused",
            ),
            (
                Error::Busy {
                    model: M.into(),
                    reason: "swapping".into(),
                },
                409,
                "busy",
            ),
            (
                Error::ModelFailed {
                    model: M.into(),
                    reason: "crashed".into(),
                },
                503,
                "model_failed",
            ),
            (Error::Quarantined { model: M.into() }, 422, "quarantined"),
            (
                Error::DeadlineExceeded {
                    model: M.into(),
                    after: Duration::from_secs(5),
                },
                504,
                "deadline_exceeded",
            ),
            (
                Error::Restarting {
                    model: M.into(),
                    in_s: 2.5,
                    last_exit: "signal SIGSEGV".into(),
                },
                503,
                "restarting",
            ),
            (
                Error::LoadBackoff {
                    model: M.into(),
                    in_s: 2.5,
                    last_error: "it failed".into(),
                },
                503,
                "load_backoff",
            ),
        ];
        for kind in WIRE_KINDS {
            let (status, code) = wire_expected(kind);
            rows.push((load_failed(kind), status, code));
            rows.push((request(kind), status, code));
        }
        // A copy for the callers waiting on someone else's load keeps the
        // original's status and code.
        let stalled = died(Some(KillCause::Stalled {
            no_progress_for_s: 30.0,
        }));
        rows.push((stalled.shared(), 504, "stalled"));
        let budget = Error::GpuBudgetExceeded {
            model: M.into(),
            needed: 1 << 30,
            reason: "over budget".into(),
        };
        rows.push((budget.shared(), 503, "gpu_memory_budget_exceeded"));
        rows.push((
            load_failed(ErrorKind::UnknownBackend).shared(),
            400,
            "unknown_backend",
        ));
        rows
    }

    /// The string table this mapping replaced, kept as the reference.
    fn legacy_status(kind: &str) -> u16 {
        match kind {
            "model_not_found" => 404,
            "bad_request" | "input_too_large" | "invalid_spec" | "unknown_backend" => 400,
            "not_loaded" | "already_loaded" | "busy" => 409,
            "queue_full" => 429,
            "memory_budget_exceeded"
            | "machine_queue_full"
            | "gpu_memory_budget_exceeded"
            | "shutting_down"
            | "model_failed"
            | "restarting"
            | "load_backoff" => 503,
            "load_timeout" => 504,
            "worker_died" | "gpu_out_of_memory" | "handshake_failed" | "protocol_mismatch"
            | "unexpected_message" | "gpu_unused" => 502,
            "cancelled" => 408,
            "deadline_exceeded" | "stalled" => 504,
            "quarantined" => 422,
            "memory_limit_exceeded" | "heartbeat_lost" => 502,
            _ => 500,
        }
    }

    #[test]
    fn every_error_maps_to_its_status_and_code() {
        for (error, status, code) in table() {
            let (got_status, got_code) = status_and_code(&error);
            assert_eq!((got_status.as_u16(), got_code), (status, code), "{error:?}");
            assert_eq!(got_code, error.kind(), "{error:?}");
            assert_eq!(
                status,
                legacy_status(code),
                "{error:?}: changed from before"
            );
        }
    }

    #[test]
    fn a_shared_copy_maps_as_its_original() {
        for (error, status, code) in table() {
            let shared = error.shared();
            assert!(matches!(shared, Error::SharedLoad { .. }));
            assert_eq!(shared.class(), error.class(), "{error:?}");
            assert_eq!(shared.to_string(), error.to_string());
            let (got_status, got_code) = status_and_code(&shared);
            assert_eq!((got_status.as_u16(), got_code), (status, code), "{error:?}");
            // A copy of a copy, as a waiter re-shares what it received.
            assert_eq!(status_and_code(&shared.shared()), status_and_code(&error));
        }
    }

    #[test]
    fn retry_after_for_restarting_and_a_full_queue_only() {
        let restarting = ApiError::from(Error::Restarting {
            model: M.into(),
            in_s: 2.2,
            last_exit: "exit code 1".into(),
        });
        assert_eq!(restarting.retry_after, Some(3));
        let soon = ApiError::from(Error::Restarting {
            model: M.into(),
            in_s: 0.1,
            last_exit: "exit code 1".into(),
        });
        assert_eq!(soon.retry_after, Some(1));
        let full = ApiError::from(Error::QueueFull {
            model: M.into(),
            max_concurrency: 1,
            queued: 1,
        });
        assert_eq!(full.retry_after, Some(1));
        for (error, ..) in table() {
            if !matches!(
                error,
                Error::Restarting { .. }
                    | Error::QueueFull { .. }
                    | Error::MachineQueueFull { .. }
                    | Error::LoadBackoff { .. }
            ) {
                assert_eq!(ApiError::from(error).retry_after, None);
            }
        }
    }

    #[test]
    fn the_body_names_message_type_and_code() {
        let e = ApiError::from(Error::NotLoaded { model: M.into() });
        assert_eq!(
            e.body(),
            serde_json::json!({ "error": {
                "message": "model `m` is not loaded; load it first",
                "type": "invalid_request_error",
                "code": "not_loaded",
            }})
        );
        let e = ApiError::from(Error::ShuttingDown { model: M.into() });
        assert_eq!(e.body()["error"]["type"], "server_error");
        assert_eq!(e.body()["error"]["code"], "shutting_down");
    }

    #[tokio::test]
    async fn the_response_carries_the_body_and_retry_after() {
        let response = ApiError::from(Error::QueueFull {
            model: M.into(),
            max_concurrency: 1,
            queued: 1,
        })
        .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[axum::http::header::RETRY_AFTER], "1");
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 16)
            .await
            .unwrap();
        let body: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(body["error"]["code"], "queue_full");
        assert_eq!(body["error"]["type"], "invalid_request_error");
    }
}
