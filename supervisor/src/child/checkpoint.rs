//! The CUDA driver's checkpoint API, called on a worker's processes from
//! outside them: each step is a run of the berth worker program
//! (`berth-worker --checkpoint ACTION PID`, `worker/src/checkpoint.rs`), so
//! the supervisor never loads the driver, and a step that hangs is a
//! process that is killed at its bound.

use std::time::Duration;

use crate::config::SupervisorConfig;

/// One step of a sleep or a wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

impl Step {
    pub fn as_str(self) -> &'static str {
        match self {
            Step::Lock => "lock",
            Step::Checkpoint => "checkpoint",
            Step::Restore => "restore",
            Step::Unlock => "unlock",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a step failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepError {
    /// The driver has no checkpoint API (or does not do it here).
    pub no_api: bool,
    pub message: String,
}

/// How long the lock waits for the process's CUDA work to finish.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(10);
/// The bound on one step's helper: a checkpoint or restore copies all of
/// a process's device memory (80 GiB over PCIe: a few seconds).
const STEP_BOUND: Duration = Duration::from_secs(120);
/// The most a step's helper may print on stdout (`state` prints a word).
const OUTPUT_MAX: usize = 4 << 10;

/// Runs `step` on `pid` with `config`'s berth worker program, as the
/// backends' probe runs a program (`probe::run_once`: bounded in time and
/// output, the worker's environment, a process group killed at its end).
pub(crate) async fn run(config: &SupervisorConfig, step: Step, pid: u32) -> Result<(), StepError> {
    let program = super::program::default_program(config).map_err(|e| StepError {
        no_api: true,
        message: format!("the berth worker program, which makes the driver's calls: {e}"),
    })?;
    let timeout = LOCK_TIMEOUT.as_millis().to_string();
    let ran = tokio::task::spawn_blocking(move || {
        super::probe::run_once(
            &program,
            &["--checkpoint", step.as_str(), &pid.to_string(), &timeout],
            // The API acts on the target's devices, whatever this sees.
            &["CUDA_VISIBLE_DEVICES"],
            STEP_BOUND,
            OUTPUT_MAX,
        )
        .map_err(|e| format!("cannot run `{}`: {e}", program.path.display()))
    })
    .await
    .map_err(|e| format!("the {step} step's helper failed: {e}"))
    .and_then(|ran| ran)
    .map_err(|message| StepError {
        no_api: true,
        message,
    })?;
    let said = String::from_utf8_lossy(&ran.stderr_tail);
    let said = crate::input::quote(said.trim()).into_owned();
    let status = match ran.status {
        Some(status) if ran.read.is_ok() => status,
        _ => {
            return Err(StepError {
                no_api: false,
                message: format!(
                    "the driver's {step} did not return within {} (the helper was killed)",
                    crate::units::format_duration(STEP_BOUND)
                ),
            });
        }
    };
    if status.success() {
        return Ok(());
    }
    Err(StepError {
        no_api: status.code() == Some(3),
        message: if said.is_empty() {
            format!("the driver's {step} failed ({status})")
        } else {
            said
        },
    })
}
