//! The house's lowest floor: small types every layer above shares (how a
//! worker ended, how a stop went, why a worker was killed, how a memory cap
//! is enforced, how long a stop waits). They depend on nothing of berth's
//! but the unit formatting, so config, errors, reports and the process
//! layer can all use them without importing one another. Also this build's
//! identity (its version and mark), which the API reports and an in-place
//! upgrade compares.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::units::mib;

/// How a worker process ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExitStatus {
    /// It exited with this code.
    Code(i32),
    /// It was killed by this signal (`SIGKILL`, `SIGSEGV`, ...).
    Signal(String),
}

impl ExitStatus {
    pub fn from_std(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => ExitStatus::Code(code),
            (None, Some(sig)) => ExitStatus::Signal(signal_name(sig)),
            (None, None) => ExitStatus::Code(-1),
        }
    }

    pub fn is_success(&self) -> bool {
        *self == ExitStatus::Code(0)
    }
}

/// Now, in milliseconds since the Unix epoch (0 before it).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn signal_name(sig: i32) -> String {
    nix::sys::signal::Signal::try_from(sig)
        .map(|s| s.as_str().to_string())
        .unwrap_or_else(|_| format!("signal {sig}"))
}

impl fmt::Display for ExitStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ExitStatus::Code(code) => write!(f, "exited with code {code}"),
            ExitStatus::Signal(sig) => write!(f, "was killed by {sig}"),
        }
    }
}

/// How a stop ended: which step of ask → SIGTERM → SIGKILL did it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopKind {
    /// The worker exited on the `Shutdown` command.
    Graceful,
    /// It ignored `Shutdown` and ended on SIGTERM.
    Sigterm,
    /// It ignored both and was killed.
    Sigkill,
    /// It had already exited (it crashed) before the stop began.
    AlreadyExited,
    /// An HTTP server that exited after its `stop_command` ran.
    StopCommand,
    /// A server in a container that the container engine stopped.
    ContainerStop,
}

impl fmt::Display for StopKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopKind::Graceful => "graceful",
            StopKind::Sigterm => "sigterm",
            StopKind::Sigkill => "sigkill",
            StopKind::AlreadyExited => "already_exited",
            StopKind::StopCommand => "stop_command",
            StopKind::ContainerStop => "container_stop",
        })
    }
}

/// How long each step of a stop waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopGraces {
    /// After the `Shutdown` command, before SIGTERM.
    pub shutdown: Duration,
    /// After SIGTERM, before SIGKILL.
    pub term: Duration,
}

impl Default for StopGraces {
    fn default() -> Self {
        StopGraces {
            shutdown: Duration::from_secs(5),
            term: Duration::from_secs(5),
        }
    }
}

/// How a memory cap is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CapMechanism {
    CgroupV2,
    CgroupV1,
    /// The supervisor samples RSS and kills the worker past the limit.
    RssPoll,
}

impl std::fmt::Display for CapMechanism {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CapMechanism::CgroupV2 => "cgroup v2 memory.max",
            CapMechanism::CgroupV1 => "cgroup v1 memory.limit_in_bytes",
            CapMechanism::RssPoll => "supervisor RSS polling",
        })
    }
}

/// Why the supervisor (or the kernel, on its behalf) killed a worker.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "reason", rename_all = "snake_case")]
pub enum KillCause {
    MemoryLimit {
        limit_bytes: u64,
        peak_bytes: u64,
        mechanism: CapMechanism,
    },
    /// A request made no progress for this long.
    Stalled { no_progress_for_s: f64 },
    /// The worker stopped answering heartbeats.
    HeartbeatLost { silent_for_s: f64 },
    /// It died of a GPU out-of-memory error (read from its stderr).
    GpuOutOfMemory { line: String },
    /// It broke the wire: sent a malformed frame, an unknown message, a
    /// reply to a request that does not exist, a descriptor it was not asked
    /// for. `sent` says what.
    ProtocolViolation { sent: String },
}

impl KillCause {
    /// Recognises a GPU out-of-memory death in the last stderr lines.
    pub(crate) fn from_stderr(tail: &[String]) -> Option<KillCause> {
        tail.iter()
            .rev()
            .find(|l| is_gpu_oom(l))
            .map(|line| KillCause::GpuOutOfMemory { line: line.clone() })
    }
}

/// Whether a line is a framework saying it ran out of device memory:
/// PyTorch's "CUDA out of memory. Tried to allocate ...", the driver's
/// `CUDA_ERROR_OUT_OF_MEMORY`, cuBLAS's "CUBLAS_STATUS_ALLOC_FAILED", and
/// XLA's (JAX's) "RESOURCE_EXHAUSTED: Out of memory while trying to
/// allocate ..." (which names no device: a worker on the CPU never says it
/// of host memory, where the kernel's OOM killer or `MemoryError` speaks).
pub(crate) fn is_gpu_oom(line: &str) -> bool {
    let l = line.to_ascii_lowercase();
    (l.contains("out of memory") || l.contains("out_of_memory"))
        && (l.contains("cuda") || l.contains("gpu") || l.contains("resource_exhausted"))
        || l.contains("cublas_status_alloc_failed")
}

impl std::fmt::Display for KillCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KillCause::MemoryLimit {
                limit_bytes,
                peak_bytes,
                mechanism,
            } => write!(
                f,
                "killed by the memory limit ({} reached at {}, {mechanism})",
                mib(*limit_bytes),
                mib(*peak_bytes)
            ),
            KillCause::Stalled { no_progress_for_s } => {
                write!(
                    f,
                    "killed after its request made no progress for {no_progress_for_s:.1} s (stall_timeout)"
                )
            }
            KillCause::GpuOutOfMemory { line } => {
                write!(f, "killed by a GPU out-of-memory error ({line})")
            }
            KillCause::HeartbeatLost { silent_for_s } => {
                write!(f, "killed after {silent_for_s:.1} s without a heartbeat")
            }
            KillCause::ProtocolViolation { sent } => {
                write!(f, "killed for breaking the wire (it sent {sent})")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::is_gpu_oom;

    /// The frameworks' own words, as they print them.
    #[test]
    fn gpu_out_of_memory_is_recognised_in_each_framework_s_words() {
        for line in [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; \
             79.19 GiB total capacity)",
            "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while \
             trying to allocate 384.00MiB.",
            "gpu-hog: CUDA out of memory allocating 120000 MiB on device 0",
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")",
            "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate",
        ] {
            assert!(is_gpu_oom(line), "{line}");
        }
        for line in [
            "MemoryError",
            "model `m`: out of memory reading the weights",
            "ValueError: a GPU is required",
        ] {
            assert!(!is_gpu_oom(line), "{line}");
        }
    }
}

/// Which engine a command runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Podman,
    /// Docker, or a client that speaks its flags (nerdctl).
    Docker,
}

impl Engine {
    /// The engine a program is, by its file name.
    pub fn of(program: &str) -> Option<Engine> {
        let name = std::path::Path::new(program).file_name()?.to_str()?;
        match name {
            "podman" => Some(Engine::Podman),
            "docker" | "nerdctl" => Some(Engine::Docker),
            _ => None,
        }
    }
}

/// This build's mark: `unmarked`, unless the bytes after the prefix were
/// set in the binary (tests tell two builds apart so; a packager may stamp
/// a build id the same way). Read through a volatile load, so the
/// compiler cannot fold the placeholder in.
pub fn build_mark() -> String {
    #[used]
    static MARK: [u8; 64] = placeholder();
    // SAFETY: a read of a static's bytes.
    let bytes = unsafe { std::ptr::read_volatile(&raw const MARK) };
    let text = &bytes[MARK_PREFIX.len()..];
    let end = text.iter().position(|b| *b == 0).unwrap_or(text.len());
    String::from_utf8_lossy(&text[..end]).into_owned()
}

/// The mark's bytes in the binary: the prefix, `unmarked`, zeroes.
const fn placeholder() -> [u8; 64] {
    let mut out = [0u8; 64];
    let text = b"BERTH-BUILD-MARK:unmarked";
    let mut i = 0;
    while i < text.len() {
        out[i] = text[i];
        i += 1;
    }
    out
}

/// What precedes the mark in the binary.
pub const MARK_PREFIX: &[u8] = b"BERTH-BUILD-MARK:";

/// This build as an upgrade names it: version and mark.
pub fn this_build() -> String {
    format!("{} ({})", env!("CARGO_PKG_VERSION"), build_mark())
}
