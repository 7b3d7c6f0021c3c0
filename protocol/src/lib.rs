//! The wire contract between the berth supervisor and its workers.
//!
//! This crate is only the contract: message types, constants and their
//! documentation. It has no runtime and no model code, so a host that builds
//! its own worker binary depends on exactly what crosses the process boundary.
//!
//! # The conversation
//!
//! 1. The supervisor opens an [`ipc_channel::ipc::IpcOneShotServer<Event>`]
//!    and starts the worker with the server's name in [`ENV_BOOTSTRAP`].
//! 2. The worker connects and its first event is [`Event::Hello`], carrying
//!    the [`IpcSender<Command>`] the supervisor talks back on. The supervisor
//!    refuses a worker whose [`Hello::protocol_version`] differs from
//!    [`PROTOCOL_VERSION`].
//! 3. The supervisor sends [`Command::Load`]; the worker answers
//!    [`Event::Loaded`] or [`Event::LoadFailed`].
//! 4. Requests ([`Command::Request`]) are answered by zero or more
//!    [`Event::Chunk`]s and exactly one [`Event::Done`] with the same id.
//! 5. [`Command::Shutdown`] asks the worker to exit; the supervisor escalates
//!    to signals if it does not.
//!
//! The hello travels on the same channel as every later event (the one-shot
//! server hands back one receiver for its message type), which is why
//! [`Event::Hello`] is an event rather than a type of its own.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use ipc_channel::ipc::{IpcSender, IpcSharedMemory};
use serde::{Deserialize, Serialize};

/// Bumped whenever a type in this crate changes shape on the wire.
///
/// Fixtures of each released version live in `tests/fixtures/` and are
/// decoded by the tests, so an accidental change is caught.
/// Version 2: `LoadInfo::max_batch` and `Event::Done::run` (batching).
pub const PROTOCOL_VERSION: u32 = 2;

pub mod stream;

/// Environment variable holding the one-shot server name the worker connects to.
pub const ENV_BOOTSTRAP: &str = "BERTH_BOOTSTRAP";
/// Environment variable holding the pid of the supervisor that started the
/// worker; the worker exits if its parent is not that process.
pub const ENV_PARENT_PID: &str = "BERTH_PARENT_PID";
/// Environment variable naming the model the worker serves (for its logs).
pub const ENV_MODEL_NAME: &str = "BERTH_MODEL";
/// Environment variable listing the GPUs (physical indices, comma-separated)
/// the supervisor placed the worker on; absent when it has none. The worker
/// also gets `CUDA_VISIBLE_DEVICES`, so CUDA numbers them from 0.
pub const ENV_GPUS: &str = "BERTH_GPUS";

/// Request identifier, unique per worker for the worker's lifetime.
pub type RequestId = u64;

/// Supervisor → worker.
#[derive(Debug, Serialize, Deserialize)]
pub enum Command {
    /// Load a model. Sent exactly once, right after the hello.
    Load(LoadSpec),
    /// Run one request against the loaded model.
    Request { id: RequestId, body: Body },
    /// Stop working on a request; the worker still answers it with
    /// [`Event::Done`] (an error of kind [`ErrorKind::Cancelled`] if it was
    /// cut short).
    Cancel { id: RequestId },
    /// Liveness and statistics probe; answered with [`Event::Pong`].
    Ping { seq: u64 },
    /// Finish and exit with status 0.
    Shutdown,
}

/// Worker → supervisor.
#[derive(Debug, Serialize, Deserialize)]
pub enum Event {
    /// The first message of every worker.
    Hello(Hello),
    Loaded(LoadInfo),
    LoadFailed(WireError),
    /// A streamed piece of a response.
    Chunk {
        id: RequestId,
        body: Body,
    },
    /// The end of a request. Every request gets exactly one.
    Done {
        id: RequestId,
        result: Result<Body, WireError>,
        /// How it ran: its batch and the backend's time on it.
        run: RunInfo,
    },
    Pong {
        seq: u64,
        stats: WorkerStats,
    },
}

impl Event {
    /// The variant's name, for `UnexpectedMessage` errors and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Event::Hello(_) => "Hello",
            Event::Loaded(_) => "Loaded",
            Event::LoadFailed(_) => "LoadFailed",
            Event::Chunk { .. } => "Chunk",
            Event::Done { .. } => "Done",
            Event::Pong { .. } => "Pong",
        }
    }
}

/// The worker introduces itself.
#[derive(Debug, Serialize, Deserialize)]
pub struct Hello {
    /// Kept first so that it is the first thing decoded.
    pub protocol_version: u32,
    pub pid: u32,
    /// The worker crate's version (`CARGO_PKG_VERSION`), for reports.
    pub worker_version: String,
    /// Names of the backends this worker binary can load.
    pub backends: Vec<String>,
    /// Where the supervisor sends its commands.
    pub commands: IpcSender<Command>,
}

/// What to load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadSpec {
    /// The model's name in the supervisor (for messages).
    pub name: String,
    pub backend: String,
    /// Weights file or directory, if the backend needs one.
    pub model: Option<String>,
    /// Backend options, as `KEY=VALUE` pairs from the CLI or a config table.
    pub options: BTreeMap<String, String>,
}

impl LoadSpec {
    /// The refusal of options the backend does not take, in the words both
    /// sides use (the supervisor, when a backend declared its options, at
    /// registration; a worker at load): `None` when every option is known.
    pub fn unknown_options(&self, known: &[&str]) -> Option<String> {
        let unknown: Vec<String> = self
            .options
            .keys()
            .filter(|k| !known.contains(&k.as_str()))
            .map(|k| format!("`{k}`"))
            .collect();
        if unknown.is_empty() {
            return None;
        }
        let mut takes = known.to_vec();
        takes.sort_unstable();
        takes.dedup();
        Some(format!(
            "backend `{}` has no option {} (it takes: {})",
            self.backend,
            unknown.join(", "),
            if takes.is_empty() {
                "none".to_string()
            } else {
                takes.join(", ")
            }
        ))
    }
}

/// The answer to a successful load.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadInfo {
    /// Backend-specific description (dimensions, context length, ...), as JSON text.
    pub details: String,
    /// Time the backend spent loading, measured inside the worker.
    pub load_micros: u64,
    /// Requests the backend takes in one batch (0 or 1: one at a time).
    #[serde(default)]
    pub max_batch: u32,
}

/// How a request ran inside the worker, for the supervisor's figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunInfo {
    /// Requests in the batch it ran in: 1 alone; 0 when the worker did not
    /// say (a stream-wire worker may leave it out).
    pub batch: u32,
    /// Time the backend spent on that batch, in microseconds: the rest of
    /// the request's time was spent waiting.
    pub compute_micros: u64,
}

/// A request or response body: a structured part and an optional bulk part.
///
/// The structured part is JSON text (the wire codec is not self-describing, so
/// JSON values travel as text). Bulk bytes travel inline for small payloads or
/// in shared memory for large ones, so a tensor is never copied through the
/// socket.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Body {
    pub json: String,
    pub bulk: Bulk,
}

impl Body {
    pub fn json(json: impl Into<String>) -> Self {
        Body {
            json: json.into(),
            bulk: Bulk::None,
        }
    }

    /// A body with bulk bytes: carried inside the message when small, in a
    /// shared-memory region from [`stream::MEMFD_THRESHOLD`] on (one copy
    /// instead of serialising every byte through the channel).
    pub fn with_bulk(json: impl Into<String>, bytes: Vec<u8>) -> Self {
        let bulk = if bytes.len() >= stream::MEMFD_THRESHOLD {
            Bulk::Shared(IpcSharedMemory::from_bytes(&bytes))
        } else {
            Bulk::Inline(bytes)
        };
        Body {
            json: json.into(),
            bulk,
        }
    }

    /// The bulk bytes, wherever they live.
    pub fn bulk_bytes(&self) -> &[u8] {
        match &self.bulk {
            Bulk::None => &[],
            Bulk::Inline(bytes) => bytes,
            Bulk::Shared(shm) => shm,
            Bulk::Mapped(bytes) => bytes.as_ref().as_ref(),
        }
    }
}

/// Bytes mapped from somewhere else (a memfd a worker sent on the stream
/// wire), read in place.
pub type MappedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// The bulk part of a [`Body`].
#[derive(Clone, Default, Serialize, Deserialize)]
pub enum Bulk {
    #[default]
    None,
    /// Bytes inside the message (`serde_bytes`: a plain `Vec<u8>` encodes
    /// element by element and is several times slower).
    Inline(#[serde(with = "serde_bytes")] Vec<u8>),
    /// Bytes in a shared-memory region mapped by both processes.
    Shared(IpcSharedMemory),
    /// Bytes mapped read-only from a sealed memfd a stream-wire worker sent
    /// (`docs/wire.md`). Never crosses `ipc-channel`: a body holding one is
    /// turned into [`Bulk::Shared`] before it is sent to a Rust worker.
    #[serde(skip)]
    Mapped(MappedBytes),
}

impl fmt::Debug for Bulk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bulk::None => f.write_str("None"),
            Bulk::Inline(b) => write!(f, "Inline({} bytes)", b.len()),
            Bulk::Shared(s) => write!(f, "Shared({} bytes)", s.len()),
            Bulk::Mapped(m) => write!(f, "Mapped({} bytes)", m.as_ref().as_ref().len()),
        }
    }
}

/// What a worker says about itself in every [`Event::Pong`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerStats {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    /// Advanced by the code doing the work (tokens generated, batches run,
    /// load steps), so a stuck model shows as a counter that stops moving.
    pub progress: u64,
    pub requests_done: u64,
    pub in_flight: u32,
}

/// An error crossing the process boundary, as data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct WireError {
    pub kind: ErrorKind,
    pub message: String,
}

impl WireError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        WireError {
            kind,
            message: message.into(),
        }
    }

    /// The error with any backtrace or traceback cut from its message (see
    /// [`without_trace`]), and the trace that was cut, if there was one: a
    /// trace belongs in the worker's log, not in what a client is told.
    pub fn split_trace(mut self) -> (Self, Option<String>) {
        let kept = without_trace(&self.message).len();
        if kept == self.message.len() {
            return (self, None);
        }
        let trace = self.message.split_off(kept);
        self.message.truncate(self.message.trim_end().len());
        (self, Some(trace))
    }
}

/// `message` up to the first line of a backtrace (Rust's `   0: ...`
/// frames, or a `stack backtrace:` heading, as candle's errors carry when
/// `RUST_BACKTRACE` is set) or a Python traceback (`Traceback (most recent
/// call last):`): those name build paths and source files, for the log.
pub fn without_trace(message: &str) -> &str {
    let mut at = 0;
    for line in message.split_inclusive('\n') {
        let text = line.trim();
        let frame = text
            .split_once(": ")
            .is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if at > 0 && frame
            || text.eq_ignore_ascii_case("stack backtrace:")
            || text.starts_with("Traceback (most recent call last)")
        {
            return message[..at].trim_end();
        }
        at += line.len();
    }
    message
}

/// Stable error kinds. Their [`ErrorKind::code`]s are part of the public
/// interface (they appear in `--json` output and HTTP errors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The request could not be understood (bad JSON, wrong types, empty input).
    BadRequest,
    /// The backend named in the spec is not built into this worker.
    UnknownBackend,
    /// The model could not be loaded (missing file, bad format, ...).
    LoadFailed,
    /// A request arrived before a successful load.
    NotLoaded,
    /// The request was cancelled.
    Cancelled,
    /// The input does not fit the model (e.g. longer than the context).
    InputTooLarge,
    /// The backend failed while serving a request.
    Backend,
    /// Anything else; a bug.
    Internal,
}

impl ErrorKind {
    pub fn code(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::UnknownBackend => "unknown_backend",
            ErrorKind::LoadFailed => "load_failed",
            ErrorKind::NotLoaded => "not_loaded",
            ErrorKind::Cancelled => "cancelled",
            ErrorKind::InputTooLarge => "input_too_large",
            ErrorKind::Backend => "backend_error",
            ErrorKind::Internal => "internal",
        }
    }
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 8] = [
        ErrorKind::BadRequest,
        ErrorKind::UnknownBackend,
        ErrorKind::LoadFailed,
        ErrorKind::NotLoaded,
        ErrorKind::Cancelled,
        ErrorKind::InputTooLarge,
        ErrorKind::Backend,
        ErrorKind::Internal,
    ];

    /// The kind whose [`ErrorKind::code`] this is.
    pub fn from_code(code: &str) -> Option<ErrorKind> {
        Self::ALL.into_iter().find(|k| k.code() == code)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_are_cut_from_messages() {
        let candle = "model `m`: cannot load weights: shape mismatch\n   0: candle_core::error::Error::bt\n             at /root/.cargo/registry/src/candle-core/src/error.rs:1:1\n   1: main";
        assert_eq!(
            without_trace(candle),
            "model `m`: cannot load weights: shape mismatch"
        );
        let heading = "capacity overflow\nStack backtrace:\n   0: x";
        assert_eq!(without_trace(heading), "capacity overflow");
        let python = "the backend failed: boom\nTraceback (most recent call last):\n  File \"/srv/app/m.py\", line 3";
        assert_eq!(without_trace(python), "the backend failed: boom");
        let plain = "model `m`: 3 texts: too long\nsee max_length";
        assert_eq!(without_trace(plain), plain);
        let (error, trace) = WireError::new(ErrorKind::LoadFailed, candle).split_trace();
        assert_eq!(
            error.message,
            "model `m`: cannot load weights: shape mismatch"
        );
        assert!(trace.unwrap().contains("error.rs"));
        let (error, trace) = WireError::new(ErrorKind::BadRequest, plain).split_trace();
        assert_eq!((error.message.as_str(), trace), (plain, None));
    }
}
