//! The supervisor's part of an in-place upgrade (`crate::daemon::upgrade`): freeze
//! (nothing starts, stops or swaps), say what is still busy, write down
//! every ready worker, and, in the new process, install the workers handed
//! over as ready models whose loads are long done.

use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::slot::Slot;
use super::{Event, ModelState, Supervisor};
use crate::child::handle::WorkerHandle;
use crate::child::handover::HandedWorker;
use crate::report::LoadReport;

impl Supervisor {
    /// Freezes (or thaws) the models: while frozen, loads, unloads, swaps
    /// and restarts are refused as busy, so the set of workers stays as
    /// written down.
    pub(crate) fn freeze(&self, frozen: bool) {
        self.inner.frozen.store(frozen, Ordering::SeqCst);
        self.inner.notify_changed();
    }

    /// Says a handover began (or was called off): event followers end
    /// their streams, so their connections close.
    pub(crate) fn handing_over(&self, yes: bool) {
        self.inner.handing_over.send_replace(yes);
    }

    /// Turns true while a handover waits for connections to close.
    pub(crate) fn handover_signal(&self) -> watch::Receiver<bool> {
        self.inner.handing_over.subscribe()
    }

    /// What keeps the models from being handed over now (a load, a swap,
    /// a stop or a request in progress), or `None` when they are quiet.
    pub(crate) fn busy(&self) -> Option<String> {
        let state = self.lock();
        if let Some((pid, r)) = state.retiring.iter().next() {
            return Some(format!(
                "model `{}`: a replaced worker (pid {pid}) is still stopping",
                r.model
            ));
        }
        for (name, slot) in &state.slots {
            let what = match slot.state() {
                ModelState::Ready if slot.swapping => "being swapped",
                ModelState::Ready | ModelState::Failed | ModelState::Unloaded => match &slot.worker
                {
                    Some(w) if w.in_flight() > 0 => "serving a request",
                    _ => continue,
                },
                ModelState::Loading | ModelState::Queued => "loading",
                ModelState::Draining | ModelState::Stopping => "being unloaded",
                // Its processes are locked by the driver: the next berth
                // would take it for awake.
                ModelState::Asleep => "asleep (wake or unload it first)",
            };
            return Some(format!("model `{name}` is {what}"));
        }
        for (name, entry) in &state.catalogue {
            if entry.queued.load(Ordering::SeqCst) > 0 {
                return Some(format!("model `{name}` has requests queued"));
            }
        }
        None
    }

    /// Every ready worker as handed over, and the descriptors that must
    /// stay open until the exec; models without a live worker are left
    /// (they load again on demand in the new process).
    pub(crate) fn hand_over(&self) -> Result<(Vec<HandedWorker>, Vec<OwnedFd>), String> {
        let ready: Vec<(String, Arc<WorkerHandle>, Duration, Option<LoadReport>)> = {
            let state = self.lock();
            state
                .slots
                .iter()
                .filter_map(|(name, slot)| {
                    let worker = slot.worker.as_ref().filter(|w| w.is_alive())?;
                    Some((
                        name.clone(),
                        Arc::clone(worker),
                        slot.last_used.elapsed(),
                        slot.report.clone(),
                    ))
                })
                .collect()
        };
        let mut handed = Vec::new();
        let mut keep = Vec::new();
        for (name, worker, idle, report) in ready {
            let Some(report) = report else {
                return Err(format!("model `{name}`: its load's report is missing"));
            };
            let (w, fds) = crate::child::handover::hand(&worker, idle, report)
                .map_err(|e| format!("model `{name}`: cannot hand its worker over: {e}"))?;
            handed.push(w);
            keep.extend(fds);
        }
        Ok((handed, keep))
    }

    /// The number of the last event (0 before the first).
    pub(crate) fn last_event_id(&self) -> u64 {
        self.inner.events.last_id()
    }

    /// The event log, for the process that comes next.
    pub(crate) fn event_log(&self) -> Vec<Event> {
        self.inner.events.kept()
    }

    /// Takes up the event log of the process that came before.
    pub(crate) fn resume_event_log(&self, events: Vec<Event>) {
        self.inner.events.resume(events);
    }

    /// Holds `model`'s place while the worker an upgrade handed over is
    /// adopted: a request for it waits as for a load, and none starts a
    /// second worker meanwhile. `None` if the model is not registered (its
    /// worker is not to be kept) or already has a slot.
    pub(crate) fn await_adoption(&self, model: &str) -> Option<Awaited> {
        let mut state = self.lock();
        if !state.catalogue.contains_key(model) || state.slots.contains_key(model) {
            return None;
        }
        let (done, signal) = watch::channel(None);
        state
            .slots
            .insert(model.to_string(), Slot::loading(signal, 0, None));
        Some(Awaited {
            supervisor: self.clone(),
            model: model.to_string(),
            done,
        })
    }

    /// Installs a worker handed over by an in-place upgrade as its model's
    /// ready worker, last used `idle` ago, in the place `awaited` held.
    pub(crate) fn install_adopted(
        &self,
        awaited: Awaited,
        worker: &Arc<WorkerHandle>,
        report: &LoadReport,
        idle: Duration,
    ) -> Result<(), String> {
        let model = worker.model().to_string();
        {
            let mut state = self.lock();
            let super::State {
                catalogue, slots, ..
            } = &mut *state;
            let Some(entry) = catalogue.get_mut(&model) else {
                return Err(format!(
                    "model `{model}` is no longer in the config; its worker is stopped"
                ));
            };
            if model != awaited.model || !slots.get(&model).is_some_and(|s| awaited.holds(s)) {
                return Err(format!("model `{model}` is loaded already"));
            }
            let mut slot = Slot::loading(watch::channel(None).1, 0, None);
            slot.adopt(entry, worker, report);
            slot.last_used = Instant::now()
                .checked_sub(idle)
                .unwrap_or_else(Instant::now);
            slot.expires_at = entry.keep_alive.and_then(|k| slot.last_used.checked_add(k));
            slots.insert(model.clone(), slot);
        }
        // The place is filled: `awaited`'s drop wakes whoever waited.
        drop(awaited);
        self.watch_worker(&model, worker);
        Ok(())
    }
}

/// A model's place held while its handed-over worker is adopted
/// ([`Supervisor::await_adoption`]). Dropped (the worker installed, or not
/// kept), the requests that waited go on: to the worker, or to a load.
pub(crate) struct Awaited {
    supervisor: Supervisor,
    model: String,
    done: watch::Sender<Option<std::result::Result<(), Arc<crate::error::Error>>>>,
}

impl std::fmt::Debug for Awaited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Awaited")
            .field("model", &self.model)
            .finish()
    }
}

impl Awaited {
    /// Whether `slot` is the place this holds (not a worker installed since).
    fn holds(&self, slot: &Slot) -> bool {
        slot.worker.is_none()
            && slot
                .loading
                .as_ref()
                .is_some_and(|signal| signal.same_channel(&self.done.subscribe()))
    }
}

impl Drop for Awaited {
    fn drop(&mut self) {
        {
            let mut state = self.supervisor.lock();
            if state.slots.get(&self.model).is_some_and(|s| self.holds(s)) {
                // Not adopted: the next request loads it afresh.
                state.slots.remove(&self.model);
            }
        }
        self.done.send_replace(Some(Ok(())));
        self.supervisor.inner.notify_changed();
    }
}
