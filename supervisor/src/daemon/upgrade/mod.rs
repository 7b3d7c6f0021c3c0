//! The daemon's in-place upgrade: berth replaces its own program with a
//! new binary, in the same process, and keeps every worker
//! (`docs/internals/upgrade.md` tells it whole). Here: who may ask for one (`SIGUSR2`, `POST /api/upgrade`, and `berth upgrade
//! --binary`, which signals), the check of the new binary while berth still
//! serves, and the handover itself, run by the serve loop once it has
//! stopped accepting: wait for what is in flight, write the state, exec.
//! Whatever fails before the exec calls the upgrade off, and berth serves
//! on as it was.
//!
//! Which binary runs is the operator's choice: the one berth was started
//! from (as the file is now: replace it, then ask), or one named in a
//! request file only the server's own user can have written, next to its
//! state file, which `berth upgrade --binary` writes before it signals.
//! No HTTP client names a program.
//!
//! Beside this file: `exec.rs` (the check, the exec, the fallback),
//! `state.rs` (what crosses the exec), `takeover.rs` (the new program's
//! side), `request.rs` (the request file of `berth upgrade --binary`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::daemon::notify::notify;
use crate::server::listen::Bound;

mod exec;
mod request;
pub(crate) mod state;
mod takeover;

use crate::supervisor::EventKind;
use crate::supervisor::Supervisor;
pub use exec::{CHECK_FLAG, CheckAnswer, fall_back, is_upgrade};
pub(crate) use exec::{serve_within, serving, watchdog};
pub(crate) use request::requested_binary;
pub use request::{RequestFile, ask, request_file};
pub use state::{READS, VERSION};
pub use takeover::{Adoption, Takeover};

/// An upgrade whose binary passed its check, for the serve loop to run.
pub(crate) struct Checked {
    /// The file checked, opened once: the one exec'd.
    pub binary: exec::Binary,
    pub answer: CheckAnswer,
    pub trigger: String,
    /// Held until the upgrade ends: one at a time.
    _one: tokio::sync::OwnedMutexGuard<()>,
}

/// Where upgrade requests go: checked here, run by the serve loop.
#[derive(Clone)]
pub(crate) struct Upgrades {
    to_loop: mpsc::Sender<Checked>,
    supervisor: Supervisor,
    /// One upgrade at a time, from its check to its end.
    running: Arc<tokio::sync::Mutex<()>>,
    /// When the last handover was called off: the next comes no sooner than
    /// [`ATTEMPTS_EVERY`] after it (each held new connections a moment).
    last_called_off: Arc<std::sync::Mutex<Option<Instant>>>,
}

/// The least time between a handover called off and the next attempt.
pub(crate) const ATTEMPTS_EVERY: Duration = Duration::from_secs(2);

impl Upgrades {
    pub(crate) fn new(supervisor: Supervisor) -> (Upgrades, mpsc::Receiver<Checked>) {
        let (to_loop, from) = mpsc::channel(1);
        (
            Upgrades {
                to_loop,
                supervisor,
                running: Arc::default(),
                last_called_off: Arc::default(),
            },
            from,
        )
    }

    /// An upgrade request refused before anything was checked (a request
    /// file that is not the server's user's): said as `upgrade_failed`, so
    /// that `berth upgrade` hears it.
    pub(crate) fn refuse(&self, reason: &str) {
        tracing::warn!("SIGUSR2: {reason}");
        self.supervisor.emit(EventKind::UpgradeFailed {
            binary: "(the request file's)".into(),
            reason: reason.to_string(),
        });
    }

    /// A handover was called off: the next attempt waits its moment.
    pub(crate) fn called_off(&self) {
        *self
            .last_called_off
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    /// Checks `binary` (default: the one berth was started from) and hands
    /// it to the serve loop; `Err` says why not, and nothing changed.
    pub(crate) async fn request(
        &self,
        trigger: &str,
        binary: Option<PathBuf>,
    ) -> Result<CheckAnswer, String> {
        let refused = |binary: &str, reason: String| {
            tracing::warn!("upgrade ({trigger}) refused: {reason}");
            self.supervisor.emit(EventKind::UpgradeFailed {
                binary: binary.to_string(),
                reason: reason.clone(),
            });
            reason
        };
        if self.supervisor.is_shutting_down() {
            return Err(refused("(not checked)", "berth is shutting down".into()));
        }
        let Ok(one) = Arc::clone(&self.running).try_lock_owned() else {
            return Err(refused(
                "(not checked)",
                "an upgrade is already under way; ask again once it is done".into(),
            ));
        };
        let last = *self
            .last_called_off
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(at) = last
            && at.elapsed() < ATTEMPTS_EVERY
        {
            return Err(refused(
                "(not checked)",
                format!(
                    "the last handover was called off {} ms ago; the next may come {} s after \
                     one",
                    at.elapsed().as_millis(),
                    ATTEMPTS_EVERY.as_secs()
                ),
            ));
        }
        let path = match binary {
            Some(binary) => binary,
            None => exec::default_binary().map_err(|e| refused("(unknown)", e))?,
        };
        let shown = path.display().to_string();
        let binary = exec::Binary::open(&path).map_err(|e| refused(&shown, e))?;
        let failed = |reason: String| refused(&shown, format!("called off: {reason}"));
        let answer = exec::check_binary(&binary).await.map_err(failed)?;
        self.supervisor.emit(EventKind::UpgradeStarted {
            trigger: trigger.to_string(),
            binary: shown.clone(),
        });
        tracing::info!(
            "upgrade ({trigger}): `{shown}` (berth {} {}) passed its check; handing over",
            answer.version,
            answer.build
        );
        self.to_loop
            .send(Checked {
                binary,
                answer: answer.clone(),
                trigger: trigger.to_string(),
                _one: one,
            })
            .await
            .map_err(|_| failed("berth is shutting down".into()))?;
        Ok(answer)
    }
}

/// How long the connections accepted while an upgrade waited for the older
/// ones may take to finish once accepting has stopped (each serves one
/// request, answered with `Connection: close`; one whose request has not
/// begun is given the header timeout to send it).
pub(crate) fn last_requests(header_timeout: Duration) -> Duration {
    Duration::from_secs(5).max(header_timeout + Duration::from_secs(1))
}

/// How long heartbeats already sent may take to come back before the
/// wires change hands anyway (a pong arriving later is dropped by nobody:
/// it waits in the socket for the new berth, which ignores it).
const PONGS_WAIT: Duration = Duration::from_secs(2);

/// What the daemon serves with that an upgrade hands over besides the
/// workers: the config in force (with the texts it was read from) and the
/// state file.
pub(crate) struct Served {
    pub applied: Option<super::reload::SharedApplied>,
    pub state_file: Option<PathBuf>,
}

/// What an upgrade does before accepting stops, so that new connections
/// do not wait for it: the preloaded interpreters stopped (they hold no
/// model; the new berth starts its own), heartbeats paused and those sent
/// given [`PONGS_WAIT`] to come back. Called off, [`hand_over`] undoes it.
pub(crate) async fn quiesce(supervisor: &Supervisor) {
    supervisor.stop_all_preloaders().await;
    crate::child::health::pause(true);
    let pongs = Instant::now() + PONGS_WAIT;
    while crate::child::health::outstanding() > 0 && Instant::now() < pongs {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Runs a checked upgrade once accepting has stopped and the connections
/// have closed (`called_off` says why they did not, if they did not).
/// Returns only if the upgrade was called off, with why; berth then serves
/// on.
pub(crate) async fn hand_over(
    supervisor: &Supervisor,
    bound: &Bound,
    checked: &Checked,
    stop: &watch::Receiver<bool>,
    served: &Served,
    called_off: Option<String>,
    paused_at_unix_ms: u64,
) -> String {
    let paused = Instant::now();
    let wait = supervisor.config().drain_timeout;
    let reason = match called_off {
        Some(reason) => reason,
        None => {
            notify(&format!(
                "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=upgrading in place to {}",
                crate::daemon::notify::monotonic_usec(),
                checked.binary.path.display()
            ));
            let reason = hand_over_steps(
                supervisor,
                (bound, stop),
                checked,
                served,
                (paused, paused_at_unix_ms),
                wait,
            )
            .await;
            notify("READY=1\nSTATUS=serving (the upgrade was called off)");
            reason
        }
    };
    // Called off: everything as it was.
    supervisor.handing_over(false);
    supervisor.freeze(false);
    crate::child::health::pause(false);
    supervisor.restart_preloaders();
    supervisor.emit(EventKind::UpgradeFailed {
        binary: checked.binary.path.display().to_string(),
        reason: reason.clone(),
    });
    tracing::warn!("upgrade called off: {reason}");
    reason
}

async fn hand_over_steps(
    supervisor: &Supervisor,
    (bound, stop): (&Bound, &watch::Receiver<bool>),
    checked: &Checked,
    served: &Served,
    (paused, paused_at_unix_ms): (Instant, u64),
    wait: Duration,
) -> String {
    let stopping = || *stop.borrow();
    const STOPPING: &str = "berth was asked to stop";
    let deadline = paused + wait;
    // No reload runs across the handover: the config in force is the one
    // handed over.
    let applied = match &served.applied {
        Some(applied) => match tokio::time::timeout_at(deadline.into(), applied.lock()).await {
            Ok(guard) => Some(guard),
            Err(_) => {
                return format!(
                    "a reload was still running after {}; nothing changed: ask again",
                    crate::units::format_duration(wait)
                );
            }
        },
        None => None,
    };
    supervisor.freeze(true);
    loop {
        if stopping() {
            return STOPPING.into();
        }
        match supervisor.busy() {
            None => break,
            Some(what) if Instant::now() >= deadline => {
                return format!(
                    "{what} after {}; nothing changed: ask again when it is done",
                    crate::units::format_duration(wait)
                );
            }
            // Rare (the connections are closed, so no request runs):
            // looked at often, since new connections wait meanwhile.
            Some(_) => tokio::time::sleep(Duration::from_millis(2)).await,
        }
    }
    let (workers, mut keep) = match supervisor.hand_over() {
        Ok(handed) => handed,
        Err(e) => return e,
    };
    let listener = match bound.duplicate() {
        Ok(fd) => fd,
        Err(e) => return format!("cannot hand the listening socket over: {e}"),
    };
    let state = state::Handover {
        version: VERSION,
        ipc_channel: crate::child::handover::ipc::IPC_CHANNEL_VERSION.to_string(),
        from: crate::base::this_build(),
        listener: std::os::fd::AsRawFd::as_raw_fd(&listener),
        previous_binary: -1,
        binary: -1,
        workers,
        events: supervisor.event_log(),
        fell_back: None,
        paused_at_unix_ms,
        catalogue: Some(supervisor.specs()),
        files: applied.as_ref().map(|a| a.texts.clone()),
        state_file: served.state_file.clone(),
    };
    keep.push(listener);
    if stopping() {
        return STOPPING.into();
    }
    tracing::info!(
        "upgrade ({}): handing {} workers to {} (berth {} {})",
        checked.trigger,
        state.workers.len(),
        checked.binary.path.display(),
        checked.answer.version,
        checked.answer.build
    );
    let why = exec::exec(&checked.binary, exec::Prepared { state, keep }).await;
    drop(applied);
    why
}
