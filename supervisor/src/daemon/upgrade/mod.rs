//! The daemon's in-place upgrade (`crate::upgrade` has the mechanism):
//! who may ask for one (`SIGUSR2`, `POST /api/upgrade`, and `berth upgrade
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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::daemon::notify::notify;
use crate::server::listen::{Bound, Connections};

mod exec;
mod request;
pub(crate) mod state;
mod takeover;

use crate::supervisor::EventKind;
use crate::supervisor::Supervisor;
pub use exec::{CHECK_FLAG, CheckAnswer, fall_back, is_upgrade};
pub(crate) use request::requested_binary;
pub use request::{RequestFile, ask, request_file};
pub use state::{READS, VERSION};
pub use takeover::Takeover;

/// An upgrade whose binary passed its check, for the serve loop to run.
pub(crate) struct Checked {
    pub binary: PathBuf,
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
}

impl Upgrades {
    pub(crate) fn new(supervisor: Supervisor) -> (Upgrades, mpsc::Receiver<Checked>) {
        let (to_loop, from) = mpsc::channel(1);
        (
            Upgrades {
                to_loop,
                supervisor,
                running: Arc::default(),
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

    /// Checks `binary` (default: the one berth was started from) and hands
    /// it to the serve loop; `Err` says why not, and nothing changed.
    pub(crate) async fn request(
        &self,
        trigger: &str,
        binary: Option<PathBuf>,
    ) -> Result<CheckAnswer, String> {
        let Ok(one) = Arc::clone(&self.running).try_lock_owned() else {
            return Err("an upgrade is already under way".into());
        };
        let binary = match binary {
            Some(binary) => binary,
            None => exec::default_binary()?,
        };
        let failed = |reason: String| {
            tracing::warn!("upgrade to {} called off: {reason}", binary.display());
            self.supervisor.emit(EventKind::UpgradeFailed {
                binary: binary.display().to_string(),
                reason: reason.clone(),
            });
            reason
        };
        let answer = exec::check_binary(&binary).await.map_err(failed)?;
        self.supervisor.emit(EventKind::UpgradeStarted {
            trigger: trigger.to_string(),
            binary: binary.display().to_string(),
        });
        tracing::info!(
            "upgrade ({trigger}): `{}` (berth {} {}) passed its check; handing over",
            binary.display(),
            answer.version,
            answer.build
        );
        self.to_loop
            .send(Checked {
                binary: binary.clone(),
                answer: answer.clone(),
                trigger: trigger.to_string(),
                _one: one,
            })
            .await
            .map_err(|_| failed("berth is shutting down".into()))?;
        Ok(answer)
    }
}

/// How long answers say `Connection: close` before accepting stops.
pub(crate) const SETTLE: Duration = Duration::from_millis(300);

/// How long heartbeats already sent may take to come back before the
/// wires change hands anyway (a pong arriving later is dropped by nobody:
/// it waits in the socket for the new berth, which ignores it).
const PONGS_WAIT: Duration = Duration::from_secs(2);

/// Runs a checked upgrade: the listener is no longer polled, and the open
/// connections were told to close after their request. Returns only if the
/// upgrade was called off, with why; berth then serves on.
pub(crate) async fn hand_over(
    supervisor: &Supervisor,
    bound: &Bound,
    connections: &Connections,
    checked: &Checked,
    stop: &watch::Receiver<bool>,
) -> String {
    let paused = Instant::now();
    let paused_at_unix_ms = crate::base::unix_ms();
    let wait = supervisor.config().drain_timeout;
    notify(&format!(
        "RELOADING=1\nMONOTONIC_USEC={}\nSTATUS=upgrading in place to {}",
        crate::daemon::notify::monotonic_usec(),
        checked.binary.display()
    ));
    let reason = hand_over_steps(
        supervisor,
        (bound, connections, stop),
        checked,
        (paused, paused_at_unix_ms),
        wait,
    )
    .await;
    // Called off: everything as it was.
    supervisor.handing_over(false);
    supervisor.freeze(false);
    crate::child::health::pause(false);
    supervisor.restart_preloaders();
    notify("READY=1\nSTATUS=serving (the upgrade was called off)");
    supervisor.emit(EventKind::UpgradeFailed {
        binary: checked.binary.display().to_string(),
        reason: reason.clone(),
    });
    tracing::warn!("upgrade called off: {reason}");
    reason
}

async fn hand_over_steps(
    supervisor: &Supervisor,
    (bound, connections, stop): (&Bound, &Connections, &watch::Receiver<bool>),
    checked: &Checked,
    (paused, paused_at_unix_ms): (Instant, u64),
    wait: Duration,
) -> String {
    let stopping = || *stop.borrow();
    const STOPPING: &str = "berth was asked to stop";
    if !connections.wait_closed(wait).await {
        return format!(
            "{} connections were still open after {} (a long answer streaming?); nothing \
             changed: ask again when they are done",
            connections.open(),
            humantime::format_duration(wait)
        );
    }
    if stopping() {
        return STOPPING.into();
    }
    supervisor.freeze(true);
    let deadline = paused + wait;
    loop {
        if stopping() {
            return STOPPING.into();
        }
        match supervisor.busy() {
            None => break,
            Some(what) if Instant::now() >= deadline => {
                return format!(
                    "{what} after {}; nothing changed: ask again when it is done",
                    humantime::format_duration(wait)
                );
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    // Preloaded interpreters hold no model: the new berth starts its own.
    supervisor.stop_all_preloaders().await;
    crate::child::health::pause(true);
    let pongs = Instant::now() + PONGS_WAIT;
    while crate::child::health::outstanding() > 0 && Instant::now() < pongs {
        tokio::time::sleep(Duration::from_millis(5)).await;
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
        workers,
        events: supervisor.event_log(),
        fell_back: None,
        paused_at_unix_ms,
    };
    keep.push(listener);
    if stopping() {
        return STOPPING.into();
    }
    tracing::info!(
        "upgrade ({}): handing {} workers to {} (berth {} {})",
        checked.trigger,
        state.workers.len(),
        checked.binary.display(),
        checked.answer.version,
        checked.answer.build
    );
    exec::exec(&checked.binary, exec::Prepared { state, keep }).await
}
