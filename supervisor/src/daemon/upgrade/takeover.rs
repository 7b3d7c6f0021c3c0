//! The new program's side of an in-place upgrade: the state read, the
//! listening socket taken, every worker adopted.

use std::os::fd::RawFd;

use super::state::Handover;
use crate::child::handover::{HandedWorker, take};
use crate::server::listen::{Bound, Listen};
use crate::supervisor::Awaited;
use crate::supervisor::EventKind;
use crate::supervisor::Supervisor;

/// What a previous berth in this process handed over.
#[derive(Debug)]
pub struct Takeover {
    state: Handover,
}

impl Takeover {
    /// The handover this process was exec'd with, if it was.
    pub fn from_env() -> Option<Result<Takeover, String>> {
        super::exec::handed_over().map(|state| state.map(|state| Takeover { state }))
    }

    /// The workers' pids: the state file's leftovers that are not to be
    /// stopped.
    pub fn worker_pids(&self) -> Vec<u32> {
        self.state.workers.iter().map(|w| w.pid).collect()
    }

    /// The config files' texts the previous berth had applied.
    pub fn files(&self) -> Option<crate::daemon::files::Texts> {
        self.state.files.clone()
    }

    /// Every model the previous berth had registered, as registered.
    pub fn catalogue(&self) -> Option<Vec<crate::config::ModelSpec>> {
        self.state.catalogue.clone()
    }

    /// The state file the previous berth used.
    pub fn state_file(&self) -> Option<std::path::PathBuf> {
        self.state.state_file.clone()
    }

    /// The listening socket, for `listen`.
    pub fn listener(&mut self, listen: &Listen) -> Result<Bound, String> {
        let fd: RawFd = std::mem::replace(&mut self.state.listener, -1);
        if fd < 0 {
            return Err("the listening socket was taken already".into());
        }
        // SAFETY: named by the state; taken once (the field is now -1).
        Bound::handed_over(listen, unsafe { take(fd) })
    }

    /// Takes up the event log and holds a place for each handed-over
    /// worker's model (requests for it wait until [`Adoption::run`] has
    /// adopted it), so that the new program may accept at once; says how
    /// long new connections waited.
    pub fn begin(self, supervisor: &Supervisor) -> Adoption {
        let mut state = self.state;
        supervisor.resume_event_log(std::mem::take(&mut state.events));
        let workers = std::mem::take(&mut state.workers)
            .into_iter()
            .map(|worker| {
                let awaited = supervisor.await_adoption(&worker.model);
                (worker, awaited)
            })
            .collect();
        let held_ms = crate::base::unix_ms().saturating_sub(state.paused_at_unix_ms);
        Adoption {
            state,
            workers,
            held_ms,
        }
    }
}

/// The workers an upgrade handed over, their models' places held, to be
/// adopted while the new program serves.
#[derive(Debug)]
pub struct Adoption {
    state: Handover,
    workers: Vec<(HandedWorker, Option<Awaited>)>,
    held_ms: u64,
}

impl Adoption {
    /// Adopts every worker into `supervisor`, each into the place held for
    /// it; returns the event that says so. A worker that cannot be adopted
    /// (gone, not this process's child, its model no longer in the config)
    /// is stopped and named in the event; its model loads afresh on demand.
    /// Blocks (it reads `/proc`, starts threads): run it off the async
    /// threads.
    pub fn run(self, supervisor: &Supervisor) -> EventKind {
        let Adoption {
            state,
            workers,
            held_ms,
        } = self;
        // A fault for the upgrade's tests: an adoption that takes its time,
        // in the build whose mark the variable names (requests for the
        // handed-over models then wait for it while the program serves).
        if std::env::var("BERTH_FAULT_ADOPT_SLOW").is_ok_and(|m| m == crate::base::build_mark()) {
            tracing::warn!("BERTH_FAULT_ADOPT_SLOW: the workers are adopted 1.5 s late, as asked");
            std::thread::sleep(std::time::Duration::from_millis(1500));
        }
        let config = supervisor.config();
        let (mut adopted, mut lost) = (Vec::new(), Vec::new());
        for (worker, awaited) in workers {
            let model = worker.model.clone();
            let pid = worker.pid;
            let (spec, awaited) = match (supervisor.spec(&model), awaited) {
                (Some(spec), Some(awaited)) => (spec, awaited),
                (spec, _) => {
                    // No place held: not registered, or a second worker
                    // for one model in the state (which no berth writes).
                    lost.push(match spec {
                        None => format!(
                            "{model} (pid {pid}): no longer in the config; its worker is stopped"
                        ),
                        Some(_) => format!(
                            "{model} (pid {pid}): the model has a worker already; this one is \
                             stopped"
                        ),
                    });
                    crate::child::handover::discard(worker);
                    continue;
                }
            };
            let idle = std::time::Duration::from_millis(worker.idle_ms);
            let taken = crate::child::handover::adopt(worker, &spec, &config).and_then(
                |(handle, report)| {
                    supervisor
                        .install_adopted(awaited, &handle, &report, idle)
                        .inspect_err(|_| handle.kill())?;
                    // Measured once its requests may go on (an HTTP
                    // server's tree took ~1 ms to read).
                    handle.sample_rss();
                    Ok(())
                },
            );
            match taken {
                Ok(()) => adopted.push(format!("{model} (pid {pid})")),
                Err(why) => {
                    tracing::warn!(model, pid, "not taken over: {why}");
                    lost.push(format!("{model} (pid {pid}): {why}"));
                }
            }
        }
        // Serving from here on: no fallback can come, and the state's
        // memfd and the previous binary's descriptor go (else each upgrade
        // would leave two more open, and hand them on).
        super::exec::close_handover_descriptors(state.previous_binary, state.binary);
        let (from, to) = match &state.fell_back {
            // This is the previous binary again: the upgrade went nowhere.
            Some(_) => (crate::base::this_build(), crate::base::this_build()),
            None => (state.from, crate::base::this_build()),
        };
        tracing::info!(
            "upgraded in place from {from} to {to}: {} workers taken over, {} lost; \
             new connections waited {held_ms} ms",
            adopted.len(),
            lost.len()
        );
        EventKind::Upgraded {
            from,
            to,
            adopted,
            lost,
            held_ms,
            fell_back: state.fell_back,
        }
    }
}
