//! The supervisor's errors. Each says what happened, to which model, and
//! what to do; each has a stable [`Error::kind`] code for programs.

use std::path::PathBuf;
use std::time::Duration;

use berth_protocol::{ErrorKind, WireError};

use crate::base::KillCause;
use crate::report::ExitStatus;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(
        "cannot find the worker binary `berth-worker` (looked in {}); build it with \
         `cargo build --release --bins`, or set the worker binary explicitly (--worker PATH)",
        .searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    )]
    WorkerBinaryNotFound { searched: Vec<PathBuf> },

    #[error("model `{model}`: cannot start worker `{}`: {source}", .binary.display())]
    Spawn {
        model: String,
        binary: PathBuf,
        source: std::io::Error,
    },

    #[error("model `{model}`: its HTTP server (pid {pid}) {reason}")]
    ServerFailed {
        model: String,
        pid: u32,
        reason: String,
    },

    #[error("model `{model}`: worker pid {pid} {reason}")]
    Handshake {
        model: String,
        pid: u32,
        reason: String,
    },

    #[error("model `{model}`: worker {mismatch}")]
    ProtocolMismatch {
        model: String,
        pid: u32,
        mismatch: Box<VersionMismatch>,
    },

    #[error("model `{model}`: worker sent {received} where {expected} was expected")]
    UnexpectedMessage {
        model: String,
        expected: &'static str,
        received: &'static str,
    },

    #[error(
        "model `{model}`: the {phase} did not finish within {} and worker pid {pid} was killed; \
         raise the load timeout if the model is just slow",
        crate::units::format_duration(*.timeout)
    )]
    LoadTimeout {
        model: String,
        pid: u32,
        timeout: Duration,
        phase: &'static str,
    },

    #[error("{}", with_model(.model, &.source.message))]
    LoadFailed { model: String, source: WireError },

    #[error(
        "model `{model}`: worker pid {pid} {}{exit} during {during}{}",
        cause_prefix(.cause),
        stderr_suffix(.stderr_tail)
    )]
    WorkerDied {
        model: String,
        pid: u32,
        exit: ExitStatus,
        during: &'static str,
        stderr_tail: Vec<String>,
        /// Set when the supervisor killed it (stall, lost heartbeat).
        cause: Option<KillCause>,
    },

    #[error(
        "model `{model}`: worker pid {pid} exceeded its memory limit of {} during {during} (peak {}, \
         enforced by {mechanism}); raise memory_limit or use a smaller model",
        crate::units::mib(*.limit),
        crate::units::mib(*.peak)
    )]
    MemoryLimitExceeded {
        model: String,
        pid: u32,
        limit: u64,
        peak: u64,
        mechanism: crate::base::CapMechanism,
        during: &'static str,
    },

    #[error("{}", with_model(.model, &.source.message))]
    Request { model: String, source: WireError },

    #[error("model `{model}` is not loaded; load it first")]
    NotLoaded { model: String },

    /// A sleep or wake that cannot be done as asked; nothing changed.
    #[error("model `{model}` cannot sleep: {reason}")]
    SleepRefused { model: String, reason: String },

    /// A step of a sleep or wake failed; `fallback` says what was done
    /// instead (stopped, loaded cold), so the model is never left stuck.
    #[error("model `{model}`: the driver's {step} failed: {reason}; {fallback}")]
    SleepFailed {
        model: String,
        step: String,
        reason: String,
        fallback: String,
    },

    #[error("model `{model}` is already loaded (worker pid {pid}); unload it first or swap it")]
    AlreadyLoaded { model: String, pid: u32 },

    #[error("model `{model}`: {reason}")]
    InvalidSpec { model: String, reason: String },

    /// A request's own settings are out of range (its deadline, keep-alive).
    #[error("model `{model}`: {reason}")]
    InvalidRequest { model: String, reason: String },

    #[error("the supervisor is shutting down; model `{model}` takes no new work")]
    ShuttingDown { model: String },

    #[error("model `{model}`: {what}: {source}")]
    Io {
        model: String,
        what: &'static str,
        source: std::io::Error,
    },

    #[error(
        "no model `{}` is registered{}",
        crate::input::quote(.model),
        known_suffix(.known)
    )]
    UnknownModel { model: String, known: Vec<String> },

    #[error(
        "model `{model}`: the catalogue holds its maximum of {max} models; remove one \
         (DELETE /api/models/NAME) or raise max_models"
    )]
    CatalogueFull { model: String, max: usize },

    #[error(
        "model `{model}`: {queued} requests are already waiting behind {max_concurrency} running; \
         retry later or raise max_concurrency / max_queue"
    )]
    QueueFull {
        model: String,
        max_concurrency: usize,
        queued: usize,
    },

    #[error(
        "model `{model}`: {waiting} requests already wait for their models' loads or turns \
         (max_queue); retry shortly, or raise max_queue"
    )]
    MachineQueueFull { model: String, waiting: usize },

    #[error("model `{model}` needs about {}, {reason}", crate::units::mib(*.needed))]
    BudgetExceeded {
        model: String,
        needed: u64,
        reason: String,
    },

    #[error("model `{model}` needs about {} of GPU memory, {reason}", crate::units::mib(*.needed))]
    GpuBudgetExceeded {
        model: String,
        needed: u64,
        reason: String,
    },

    #[error(
        "model `{model}`: worker pid {pid} was placed on GPU {gpus} but holds no GPU memory once \
         loaded (is it running on the CPU?), and `require_gpu_memory` is set, so it was stopped; \
         {}",
        crate::report::CHECK_THE_FRAMEWORK
    )]
    GpuUnused {
        model: String,
        pid: u32,
        /// `0` or `0,1`.
        gpus: String,
    },

    /// A framework ran out of device memory while the model loaded.
    #[error("model `{model}`: out of GPU memory while loading ({line}); {room}")]
    GpuOutOfMemory {
        model: String,
        /// The framework's own words.
        line: String,
        /// What the model had: its share, or the cards' free memory, and
        /// what to try.
        room: String,
    },

    #[error("model `{model}` is busy: {reason}")]
    Busy { model: String, reason: String },

    #[error(
        "model `{model}` failed and takes no requests until it is loaded again by hand \
         (`berth load {model}`): {reason}"
    )]
    ModelFailed { model: String, reason: String },

    #[error(
        "model `{model}`: this request was in flight when its worker died twice in a row and is \
         refused (quarantined) so it cannot take down another worker"
    )]
    Quarantined { model: String },

    #[error("model `{model}`: no answer within the request's deadline ({:.1} s); it was cancelled", .after.as_secs_f64())]
    DeadlineExceeded { model: String, after: Duration },

    #[error(
        "model `{model}`: the request's deadline ({:.1} s) passed while it waited for {waited_for}; \
         nothing was sent to the model",
        .after.as_secs_f64()
    )]
    WaitedTooLong {
        model: String,
        after: Duration,
        waited_for: String,
    },

    #[error(
        "model `{model}` is restarting after a crash ({last_exit}); the next attempt is in {in_s:.1} s, retry then"
    )]
    Restarting {
        model: String,
        in_s: f64,
        last_exit: String,
    },

    #[error(
        "model `{model}` failed to load ({last_error}); requests start the next attempt in \
         {in_s:.1} s, retry then, or load it by hand (`berth load {model}`) to try now"
    )]
    LoadBackoff {
        model: String,
        in_s: f64,
        last_error: String,
    },

    /// A load another caller started failed; every caller waiting on it gets
    /// this copy (errors are not `Clone`): the original's code, class and message.
    #[error("{message}")]
    SharedLoad {
        kind: &'static str,
        class: ErrorClass,
        message: String,
    },
}

/// What sort of failure an [`Error`] is, whatever the transport: the HTTP
/// server turns it into a status, and a copy of an error made for the callers
/// waiting on someone else's load ([`Error::SharedLoad`]) keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// No such model is registered.
    NotFound,
    /// The request or spec is wrong; sent again unchanged, it fails again.
    Invalid,
    /// The model's state does not allow it now (not loaded, already loaded, busy).
    Conflict,
    /// Too many requests are already waiting; retry shortly.
    Overloaded,
    /// The model takes no work for now (memory budget, shutdown, failed, restarting).
    Unavailable,
    /// Something took too long: a load, a request's deadline, a stalled worker.
    TimedOut,
    /// The worker misbehaved or died (handshake, protocol, crash, memory limit).
    WorkerFailed,
    /// The request was cancelled.
    Cancelled,
    /// This request is refused for what it did before (quarantined).
    Refused,
    /// A fault in the supervisor, its environment or a backend.
    Internal,
}

/// Most names an unknown-model error lists: a catalogue of thousands must
/// not make every 404 as large.
const KNOWN_SHOWN: usize = 10;

fn known_suffix(known: &[String]) -> String {
    match known.len() {
        0 => "; register it first".into(),
        n if n <= KNOWN_SHOWN => format!(" (registered: {})", known.join(", ")),
        n => format!(
            " (registered: {}, and {} more; GET /api/models lists them)",
            known[..KNOWN_SHOWN].join(", "),
            n - KNOWN_SHOWN
        ),
    }
}

/// Backends name the model in their messages already; name it once.
fn with_model(model: &str, message: &str) -> String {
    if message.starts_with(&format!("model `{model}`")) {
        message.to_string()
    } else {
        format!("model `{model}`: {message}")
    }
}

fn cause_prefix(cause: &Option<KillCause>) -> String {
    match cause {
        Some(cause) => format!("was {cause} and "),
        None => String::new(),
    }
}

fn stderr_suffix(lines: &[String]) -> String {
    if lines.is_empty() {
        String::new()
    } else {
        format!("; last stderr lines:\n  {}", lines.join("\n  "))
    }
}

/// What a worker and the supervisor disagree on: their wire's versions.
#[derive(Debug, Clone)]
pub struct VersionMismatch {
    /// The program the worker runs, as its command line.
    pub program: String,
    pub pid: u32,
    /// `protocol` (`ipc-channel`) or `stream-wire`.
    pub wire: &'static str,
    /// The versions this supervisor speaks (`1`, `1, 2`).
    pub supervisor: String,
    /// The versions the worker said it speaks.
    pub worker: String,
    /// What to do about it, for this kind of worker.
    pub advice: String,
    /// How the worker ended: it exited on reading `refused`, or was stopped.
    pub ending: String,
}

impl std::fmt::Display for VersionMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` (pid {}) speaks {} version {}, this supervisor speaks {}; {} ({})",
            self.program,
            self.pid,
            self.wire,
            self.worker,
            self.supervisor,
            self.advice,
            self.ending
        )
    }
}

impl Error {
    /// A stable code for programs (`--json` output, HTTP error types).
    pub fn kind(&self) -> &'static str {
        match self {
            Error::WorkerBinaryNotFound { .. } => "worker_not_found",
            Error::Spawn { .. } => "spawn_failed",
            Error::Handshake { .. } => "handshake_failed",
            Error::ServerFailed { .. } => "server_failed",
            Error::ProtocolMismatch { .. } => "protocol_mismatch",
            Error::UnexpectedMessage { .. } => "unexpected_message",
            Error::LoadTimeout { .. } => "load_timeout",
            Error::LoadFailed { source, .. } | Error::Request { source, .. } => source.kind.code(),
            Error::WorkerDied {
                cause: Some(KillCause::Stalled { .. }),
                ..
            } => "stalled",
            Error::WorkerDied {
                cause: Some(KillCause::HeartbeatLost { .. }),
                ..
            } => "heartbeat_lost",
            Error::WorkerDied {
                cause: Some(KillCause::GpuOutOfMemory { .. }),
                ..
            } => "gpu_out_of_memory",
            Error::WorkerDied {
                cause: Some(KillCause::ProtocolViolation { .. }),
                ..
            } => "protocol_violation",
            Error::WorkerDied { .. } => "worker_died",
            Error::MemoryLimitExceeded { .. } => "memory_limit_exceeded",
            Error::NotLoaded { .. } => "not_loaded",
            Error::SleepRefused { .. } => "sleep_refused",
            Error::SleepFailed { .. } => "sleep_failed",
            Error::AlreadyLoaded { .. } => "already_loaded",
            Error::InvalidSpec { .. } => "invalid_spec",
            Error::InvalidRequest { .. } => "bad_request",
            Error::ShuttingDown { .. } => "shutting_down",
            Error::Io { .. } => "io_error",
            Error::UnknownModel { .. } => "model_not_found",
            Error::CatalogueFull { .. } => "catalogue_full",
            Error::QueueFull { .. } => "queue_full",
            Error::MachineQueueFull { .. } => "machine_queue_full",
            Error::BudgetExceeded { .. } => "memory_budget_exceeded",
            Error::GpuBudgetExceeded { .. } => "gpu_memory_budget_exceeded",
            Error::GpuUnused { .. } => "gpu_unused",
            Error::GpuOutOfMemory { .. } => "gpu_out_of_memory",
            Error::Busy { .. } => "busy",
            Error::ModelFailed { .. } => "model_failed",
            Error::Restarting { .. } => "restarting",
            Error::LoadBackoff { .. } => "load_backoff",
            Error::Quarantined { .. } => "quarantined",
            Error::DeadlineExceeded { .. } | Error::WaitedTooLong { .. } => "deadline_exceeded",
            Error::SharedLoad { kind, .. } => kind,
        }
    }

    /// What sort of failure this is. Exhaustive on purpose (no wildcard for
    /// `Error`): a new variant must be classified before it compiles.
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::WorkerBinaryNotFound { .. } | Error::Spawn { .. } | Error::Io { .. } => {
                ErrorClass::Internal
            }
            Error::Handshake { .. }
            | Error::ServerFailed { .. }
            | Error::ProtocolMismatch { .. }
            | Error::UnexpectedMessage { .. }
            | Error::MemoryLimitExceeded { .. }
            | Error::GpuUnused { .. }
            | Error::GpuOutOfMemory { .. } => ErrorClass::WorkerFailed,
            Error::LoadTimeout { .. }
            | Error::DeadlineExceeded { .. }
            | Error::WaitedTooLong { .. } => ErrorClass::TimedOut,
            Error::LoadFailed { source, .. } | Error::Request { source, .. } => {
                wire_class(source.kind)
            }
            Error::WorkerDied { cause, .. } => match cause {
                Some(KillCause::Stalled { .. }) => ErrorClass::TimedOut,
                Some(
                    KillCause::HeartbeatLost { .. }
                    | KillCause::GpuOutOfMemory { .. }
                    | KillCause::ProtocolViolation { .. }
                    | KillCause::MemoryLimit { .. },
                )
                | None => ErrorClass::WorkerFailed,
            },
            Error::NotLoaded { .. }
            | Error::AlreadyLoaded { .. }
            | Error::Busy { .. }
            | Error::SleepRefused { .. } => ErrorClass::Conflict,
            Error::SleepFailed { .. } => ErrorClass::WorkerFailed,
            Error::InvalidSpec { .. } | Error::InvalidRequest { .. } => ErrorClass::Invalid,
            Error::UnknownModel { .. } => ErrorClass::NotFound,
            Error::CatalogueFull { .. } => ErrorClass::Conflict,
            Error::QueueFull { .. } => ErrorClass::Overloaded,
            Error::ShuttingDown { .. }
            | Error::MachineQueueFull { .. }
            | Error::BudgetExceeded { .. }
            | Error::GpuBudgetExceeded { .. }
            | Error::ModelFailed { .. }
            | Error::Restarting { .. }
            | Error::LoadBackoff { .. } => ErrorClass::Unavailable,
            Error::Quarantined { .. } => ErrorClass::Refused,
            Error::SharedLoad { class, .. } => *class,
        }
    }
}

/// The class of an error a worker reported.
fn wire_class(kind: ErrorKind) -> ErrorClass {
    match kind {
        ErrorKind::BadRequest | ErrorKind::UnknownBackend | ErrorKind::InputTooLarge => {
            ErrorClass::Invalid
        }
        ErrorKind::NotLoaded => ErrorClass::Conflict,
        ErrorKind::Cancelled => ErrorClass::Cancelled,
        ErrorKind::LoadFailed | ErrorKind::Backend | ErrorKind::Internal => ErrorClass::Internal,
        // `ErrorKind` is `#[non_exhaustive]` and lives in another crate
        // (berth-protocol), so a wildcard is required here; a kind added there
        // is an internal error until it is classified above.
        _ => ErrorClass::Internal,
    }
}

impl Error {
    /// What a caller waiting on someone else's load gets (errors hold
    /// io::Error and are not Clone).
    pub(crate) fn shared(&self) -> Error {
        Error::SharedLoad {
            kind: self.kind(),
            class: self.class(),
            message: self.to_string(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
