//! What a dead worker leaves behind for the requests it could not answer:
//! its exit status, its last stderr lines, why it was killed, and which
//! requests were in flight. The reader's routes fail pending requests with
//! it, the crash policy records it.

use crate::base::KillCause;
use crate::error::Error;
use crate::report::ExitStatus;

/// What a dead worker leaves for the requests it could not answer.
#[derive(Debug, Clone)]
pub(crate) struct Death {
    pub exit: ExitStatus,
    pub stderr_tail: Vec<String>,
    pub cause: Option<KillCause>,
    /// Hashes of the requests in flight when it died (for quarantine).
    pub in_flight: Vec<u64>,
}

impl Death {
    pub(crate) fn error(&self, model: &str, pid: u32, during: &'static str) -> Error {
        match &self.cause {
            Some(KillCause::MemoryLimit {
                limit_bytes,
                peak_bytes,
                mechanism,
            }) => Error::MemoryLimitExceeded {
                model: model.into(),
                pid,
                limit: *limit_bytes,
                peak: *peak_bytes,
                mechanism: *mechanism,
                during,
            },
            cause => Error::WorkerDied {
                model: model.into(),
                pid,
                exit: self.exit.clone(),
                during,
                stderr_tail: self.stderr_tail.clone(),
                cause: cause.clone(),
            },
        }
    }
}
