//! Loading and unloading a model's worker (swaps are in `swap.rs`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::room::room;
use super::slot::{Incoming, LoadSignal, Slot, Unload};
use super::{EventKind, ModelState, Need, State, Supervisor, detached};
use crate::child::handle::WorkerHandle;
use crate::child::{launch, stop};
use crate::config::ModelSpec;
use crate::error::{Error, ErrorClass, Result};
use crate::report::{Admission, LoadReport, UnloadReport};

/// Whether a load failed for want of memory others may hold: the GPU's
/// (the framework's out-of-memory, at load), or the host's (the kernel's
/// OOM killer: a SIGKILL that berth did not send). A model over its own
/// `memory_limit` is not: evicting others gives it nothing, and it fails
/// at once with why.
fn out_of_memory(e: &Error) -> bool {
    match e {
        Error::GpuOutOfMemory { .. } => true,
        Error::WorkerDied { cause, exit, .. } => match cause {
            Some(crate::base::KillCause::GpuOutOfMemory { .. }) => true,
            None => matches!(exit, crate::report::ExitStatus::Signal(s) if s == "SIGKILL"),
            _ => false,
        },
        _ => false,
    }
}

/// One launch in progress, counted in `Inner::launching` while it lives.
struct Launching<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> Launching<'a> {
    fn count(launching: &'a std::sync::atomic::AtomicUsize) -> Launching<'a> {
        launching.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Launching(launching)
    }
}

impl Drop for Launching<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether a failed load is the model's own failure (its worker, weights
/// or spec), which earns a backoff, and not the supervisor's circumstances
/// (no room in a budget, a shutdown, a conflict with another operation).
fn counts_against_the_model(e: &Error) -> bool {
    matches!(
        e.class(),
        ErrorClass::WorkerFailed
            | ErrorClass::TimedOut
            | ErrorClass::Internal
            | ErrorClass::Invalid
    )
}

impl Supervisor {
    /// Registers `spec` (replacing an unloaded model of that name) and loads it.
    pub async fn load(&self, spec: ModelSpec) -> Result<LoadReport> {
        self.check_running(&spec.name)?;
        let name = spec.name.clone();
        self.register(spec)?;
        let _waiting = self.awaiting(&name)?;
        self.start_load(&name, true).await
    }

    /// Loads a registered model.
    pub async fn load_registered(&self, model: &str) -> Result<LoadReport> {
        self.check_running(model)?;
        // A caller of `load` waits for its room as a request would, and
        // the load is given up if the caller goes.
        let _waiting = self.awaiting(model)?;
        self.unless_stopping(model, self.start_load(model, true))
            .await
    }

    /// Counts a caller waiting for `model`'s load (see `await_load`).
    fn awaiting(&self, model: &str) -> Result<super::requests::Awaiting> {
        let awaiting = {
            let state = self.lock();
            let entry = state
                .catalogue
                .get(model)
                .ok_or_else(|| self.unknown_locked(model, &state))?;
            Arc::clone(&entry.awaiting_load)
        };
        self.await_load(model, &awaiting)
    }

    /// Makes room, reserves the slot, launches the worker.
    ///
    /// Runs as a task of its own: a caller that gives up (a deadline, a
    /// client gone) must not leave a half-made slot behind.
    /// `on_demand`: callers wait for it (counted as waiting), and it is
    /// given up while it waits for room once none does.
    pub(super) async fn start_load(&self, model: &str, on_demand: bool) -> Result<LoadReport> {
        let (this, model) = (self.clone(), model.to_string());
        detached(&model.clone(), async move {
            this.start_load_inner(&model, on_demand).await
        })
        .await
    }

    /// The one way a worker gets into a slot, for a load, a swap, a recycle
    /// and a crash restart alike: launch it for `spec` on `gpus`, then let
    /// `install` put it in under the state lock (a transition of the slot).
    /// `install` answers `None` when the slot no longer waits for it (an
    /// unload or shutdown came first): the worker is stopped here. An
    /// installed worker is handed to the crash policy. `Ok(None)`: stopped.
    pub(super) async fn launch_into_slot<T>(
        &self,
        model: &str,
        spec: &ModelSpec,
        gpus: Option<Vec<u32>>,
        install: impl FnOnce(&mut State, &Arc<WorkerHandle>, &LoadReport) -> Option<T>,
    ) -> Result<Option<(Arc<WorkerHandle>, LoadReport, T)>> {
        // A kind's first load starts its preloader (its imports): that is
        // part of this load's spawn, as the caller waits for it.
        let choosing = std::time::Instant::now();
        let start = self.worker_start(spec).await;
        let chose_ms = choosing.elapsed().as_secs_f64() * 1e3;
        // Counted until its worker is in or stopped: a shutdown waits for
        // launches to end (what they started stopped) before berth exits.
        let _launching = Launching::count(&self.inner.launching);
        let launched = {
            launch::launch(
                spec,
                &self.config(),
                gpus,
                &|pid| self.note_incoming_pid(model, pid),
                start,
                self.inner.stopping.subscribe(),
            )
            .await
        };
        let (worker, mut report) = launched?;
        report.load_ms += chose_ms;
        report.spawn_ms += chose_ms;
        // Measured: within the per-GPU budget before it takes a request.
        if let Some(gpus) = report.gpus.clone()
            && let Err(e) = self.fit_measured(spec, &worker, &gpus).await
        {
            stop::stop(&worker, self.config().stop_graces).await;
            return Err(e);
        }
        let installed = install(&mut self.lock(), &worker, &report);
        self.inner.notify_changed();
        match installed {
            Some(value) => {
                // It serves now: the report's full memory reading (a walk
                // of its page tables) keeps no request waiting.
                launch::complete_report(&worker, &mut report);
                if let Some(slot) = self.lock().slots.get_mut(model)
                    && slot.report.as_ref().is_some_and(|r| r.pid == report.pid)
                {
                    slot.report = Some(report.clone());
                }
                self.watch_worker(model, &worker);
                for warning in &report.warnings {
                    self.emit(EventKind::Warning {
                        model: model.into(),
                        pid: report.pid,
                        warning: warning.clone(),
                    });
                }
                Ok(Some((worker, report, value)))
            }
            None => {
                stop::stop(&worker, self.config().stop_graces).await;
                Ok(None)
            }
        }
    }

    pub(super) async fn start_load_inner(
        &self,
        model: &str,
        on_demand: bool,
    ) -> Result<LoadReport> {
        let priority = self
            .lock()
            .catalogue
            .get(model)
            .map(|e| e.spec.priority)
            .unwrap_or(0);
        let queued_behind = self.inner.queue.len();
        let gate = self
            .make_way(model, self.inner.queue.enter(model, priority).await, None)
            .await?;
        // The files are read before the state lock is taken.
        let registered = self.lock().catalogue.get(model).map(|e| e.spec.clone());
        let files = match &registered {
            Some(spec) => super::footprint::from_files(spec).await,
            None => super::estimate::Estimate {
                bytes: 0,
                from: "unknown",
            },
        };
        let (spec, need) = {
            let mut state = self.lock();
            if state
                .slots
                .get(model)
                .is_some_and(|s| s.state == ModelState::Failed && s.worker.is_none())
            {
                // Loading by hand is how a failed model comes back.
                state.slots.remove(model);
            }
            if let Some(slot) = state.slots.get(model) {
                return Err(match &slot.worker {
                    Some(w) => Error::AlreadyLoaded {
                        model: model.into(),
                        pid: w.pid(),
                    },
                    None => Error::Busy {
                        model: model.into(),
                        reason: format!("it is {}", slot.state()),
                    },
                });
            }
            let entry = state
                .catalogue
                .get(model)
                .ok_or_else(|| self.unknown_locked(model, &state))?;
            (
                entry.spec.clone(),
                Need::new(&entry.spec, Some(entry), false, &files),
            )
        };
        let (gpus, made) = self.make_room(model, &need, on_demand).await?;
        let (done, signal) = watch::channel(None);
        {
            let mut state = self.lock();
            self.check_running(model)?;
            if !state.catalogue.contains_key(model) {
                // Deregistered while room was being made.
                return Err(self.unknown_locked(model, &state));
            }
            state.slots.insert(
                model.to_string(),
                Slot::loading(signal, need.ram, Incoming::new(gpus.clone(), need.vram())),
            );
        }
        drop(gate);
        self.inner.notify_changed();
        self.emit(EventKind::Loading {
            model: model.into(),
            restart: false,
        });
        let admission = Admission {
            estimate_bytes: need.ram,
            estimate_from: need.from.to_string(),
            evicted: made
                .evicted
                .iter()
                .map(|(m, why)| format!("{m} ({})", why.as_str()))
                .collect(),
            waited_ms: made.waited.as_secs_f64() * 1e3,
            queued_behind,
            retried: None,
        };
        // A load that runs out of memory while idle models hold it is
        // tried once more, once they have given it up: no loop.
        let mut admission = admission;
        let launched = loop {
            let launched = self
                .launch_into_slot(model, &spec, gpus.clone(), |state, worker, report| {
                    let State {
                        catalogue, slots, ..
                    } = state;
                    let slot = slots.get_mut(model)?;
                    slot.used(None);
                    slot.install(catalogue.get_mut(model), worker, report);
                    Some(())
                })
                .await;
            match &launched {
                Err(e) if admission.retried.is_none() && out_of_memory(e) => {
                    let gpu_ran_out = !matches!(e, Error::WorkerDied { cause: None, .. });
                    // Out of GPU memory: an asleep model holds none there.
                    let idle: Vec<String> = {
                        let state = self.lock();
                        room(&state, model)
                            .held
                            .into_iter()
                            .filter(|h| h.idle && h.stoppable && (h.on_gpu || !gpu_ran_out))
                            .map(|h| h.name)
                            .collect()
                    };
                    if idle.is_empty() {
                        break launched;
                    }
                    tracing::warn!(
                        model,
                        "the load ran out of memory ({e}); the idle models give their room up \
                         and it is tried once more"
                    );
                    let devices = match gpu_ran_out {
                        true => match tokio::task::spawn_blocking(crate::gpu::inventory).await {
                            Ok(crate::gpu::Inventory::Devices(devices)) => Some(devices),
                            _ => None,
                        },
                        false => None,
                    };
                    for victim in &idle {
                        // A model that can sleep gives its GPU up so, where
                        // that is the cheaper way back.
                        let note = match &devices {
                            Some(devices) => match self
                                .sleep_for(victim, model, super::admission::Why::Gpu, devices)
                                .await
                            {
                                Ok(()) => {
                                    admission.evicted.push(format!("{victim} (asleep)"));
                                    continue;
                                }
                                Err(note) => note,
                            },
                            None => None,
                        };
                        self.give_room(victim, Some(model), "out_of_memory", note)
                            .await;
                        admission.evicted.push(format!("{victim} (out_of_memory)"));
                    }
                    admission.retried = Some(e.to_string());
                }
                _ => break launched,
            }
        };
        let result = match launched {
            Ok(Some((_, mut report, ()))) => {
                report.admission = Some(admission);
                self.set_report(model, &report);
                let _ = done.send(Some(Ok(())));
                self.emit(EventKind::Loaded {
                    model: model.into(),
                    report: Box::new(report.clone()),
                });
                Ok(report)
            }
            Ok(None) => {
                // The slot went away while loading (shutdown); what was
                // started is stopped.
                let err = Error::ShuttingDown {
                    model: model.into(),
                };
                let _ = done.send(Some(Err(Arc::new(err.shared()))));
                self.emit(EventKind::LoadFailed {
                    model: model.into(),
                    error: err.to_string(),
                });
                Err(err)
            }
            Err(e) => {
                let failed = self.note_load_failure(model, &e);
                let _ = done.send(Some(Err(Arc::new(e.shared()))));
                self.inner.notify_changed();
                self.emit(EventKind::LoadFailed {
                    model: model.into(),
                    error: e.to_string(),
                });
                if let Some(reason) = failed {
                    self.emit(EventKind::Failed {
                        model: model.into(),
                        reason,
                    });
                }
                Err(e)
            }
        };
        self.inner.notify_changed();
        result
    }

    /// A load of `model` failed with `e`: its slot goes, and a failure of
    /// the model's own (its worker or weights, not a full budget or a
    /// shutdown) counts as a crash: requests wait out the same backoff
    /// before they start another load, and past `max_restarts` within
    /// `restart_window` the model is failed until loaded by hand. Returns
    /// the failure's reason when it failed the model.
    fn note_load_failure(&self, model: &str, e: &Error) -> Option<String> {
        let mut state = self.lock();
        state.slots.remove(model);
        if !counts_against_the_model(e) {
            return None;
        }
        let base = self.config().restart_backoff;
        let entry = state.catalogue.get_mut(model)?;
        let message = e.to_string();
        match entry.health.load_failed(&message, &entry.spec, base) {
            Some(delay) => {
                tracing::warn!(
                    model,
                    "load failed; requests start the next attempt in {}",
                    crate::units::format_duration(delay)
                );
                None
            }
            None => {
                let failure = entry.health.failure(&entry.spec);
                tracing::error!(model, "model failed: {failure}");
                let (_, signal) = watch::channel(None);
                let mut slot = Slot::loading(signal, 0, None);
                slot.fail(failure.clone());
                state.slots.insert(model.to_string(), slot);
                Some(failure)
            }
        }
    }

    /// The worker of a loaded model, loading it first if needed (concurrent
    /// callers share one load); the caller waits for the model's room and
    /// turn as a request does.
    pub async fn ensure_loaded(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        let _waiting = self.awaiting(model)?;
        self.load_for_request(model).await
    }

    /// [`Supervisor::ensure_loaded`] for a caller already counted as
    /// waiting. A model loading or restarting (its crash backoff included)
    /// is waited for: the caller's own deadline bounds the wait.
    pub(super) async fn load_for_request(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        loop {
            self.check_running(model)?;
            enum Next {
                Wait(LoadSignal),
                WaitChange,
                Load,
                Wake,
            }
            let changed = self.inner.changed.notified();
            let next = {
                let state = self.lock();
                let Some(entry) = state.catalogue.get(model) else {
                    return Err(Error::UnknownModel {
                        model: model.into(),
                        known: state.catalogue.keys().cloned().collect(),
                    });
                };
                match state.slots.get(model) {
                    // Its last load failed: no request starts another
                    // before the backoff is over.
                    None => match entry.health.load_wait() {
                        Some((left, error)) => {
                            return Err(Error::LoadBackoff {
                                model: model.into(),
                                in_s: left.as_secs_f64(),
                                last_error: error.to_string(),
                            });
                        }
                        None => Next::Load,
                    },
                    Some(slot) => match (slot.state(), &slot.worker, &slot.loading) {
                        (ModelState::Ready, Some(worker), _) => return Ok(Arc::clone(worker)),
                        (ModelState::Failed, None, _) => {
                            return Err(Error::ModelFailed {
                                model: model.into(),
                                reason: slot.failure.clone().unwrap_or_default(),
                            });
                        }
                        // A worker that just died: the crash policy decides next.
                        (ModelState::Failed, Some(_), _) => Next::WaitChange,
                        (_, _, Some(signal)) => Next::Wait(signal.clone()),
                        // Asleep: woken for this request, which waits as
                        // for a load (on the wake's signal, next time round).
                        _ if slot.is_asleep() => Next::Wake,
                        _ => Next::WaitChange,
                    },
                }
            };
            match next {
                Next::Wait(mut signal) => {
                    let outcome = self
                        .unless_stopping(model, async {
                            Ok(signal.wait_for(Option::is_some).await.map(|v| v.clone()))
                        })
                        .await?;
                    if let Ok(Some(Err(e))) = outcome {
                        return Err(e.shared());
                    }
                }
                Next::WaitChange => {
                    let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
                }
                Next::Wake => {
                    // A task of its own: a request that goes away cannot
                    // strand the wake halfway. Another request's wake, begun
                    // first, is simply waited for.
                    let (this, name) = (self.clone(), model.to_string());
                    tokio::spawn(async move {
                        if let Err(e) = this.wake_inner(&name, "request").await {
                            tracing::warn!(model = name, "wake for a request: {e}");
                        }
                    });
                    let _ = tokio::time::timeout(Duration::from_millis(20), changed).await;
                }
                Next::Load => match self
                    .unless_stopping(model, self.start_load(model, true))
                    .await
                {
                    Ok(_) | Err(Error::AlreadyLoaded { .. } | Error::Busy { .. }) => {}
                    Err(e) => return Err(e),
                },
            }
        }
    }

    /// Drains and stops the model's worker, and proves what came back. The
    /// model stays in the catalogue.
    pub async fn unload(&self, model: &str) -> Result<UnloadReport> {
        // A task of its own, so a caller that goes away cannot strand the
        // slot half-drained.
        let (this, model) = (self.clone(), model.to_string());
        detached(
            &model.clone(),
            async move { this.unload_inner(&model).await },
        )
        .await
    }

    pub(super) async fn unload_inner(&self, model: &str) -> Result<UnloadReport> {
        self.check_not_frozen(model)?;
        let worker = {
            let mut state = self.lock();
            if !state.slots.contains_key(model) {
                return Err(self.not_loaded_locked(model, &state));
            }
            let slot = state.slots.get_mut(model).expect("looked at just now");
            match slot.begin_unload() {
                Unload::Drain(worker) => worker,
                cancelled @ (Unload::CancelRestart | Unload::ClearFailure) => {
                    // Nothing runs: a crash backoff is cancelled (the restart
                    // task finds its slot gone and stops), or a failure cleared.
                    state.slots.remove(model);
                    drop(state);
                    self.inner.notify_changed();
                    let model = model.to_string();
                    self.emit(match cancelled {
                        Unload::CancelRestart => EventKind::RestartCancelled {
                            model: model.clone(),
                        },
                        _ => EventKind::FailureCleared {
                            model: model.clone(),
                        },
                    });
                    return Err(Error::NotLoaded { model });
                }
                Unload::Busy(reason) => {
                    return Err(Error::Busy {
                        model: model.into(),
                        reason,
                    });
                }
            }
        };
        self.inner.notify_changed();
        if !worker.drain(self.config().drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = worker.in_flight(),
                "drain deadline passed; stopping with requests in flight"
            );
        }
        if let Some(slot) = self.lock().slots.get_mut(model) {
            slot.stopping();
        }
        self.inner.notify_changed();
        let report = stop::stop(&worker, self.config().stop_graces).await;
        {
            let mut state = self.lock();
            state.slots.remove(model);
            if let Some(entry) = state.catalogue.get(model) {
                entry.counters.record_unload(&report);
            }
        }
        self.inner.notify_changed();
        tracing::info!(model, "{report}");
        self.emit(EventKind::Unloaded {
            model: model.into(),
            report: Box::new(report.clone()),
        });
        Ok(report)
    }

    /// The report its slot keeps (what an upgrade hands on), completed.
    fn set_report(&self, model: &str, report: &LoadReport) {
        if let Some(slot) = self.lock().slots.get_mut(model) {
            slot.report = Some(report.clone());
        }
    }

    /// `model` has no slot: not loaded, or not registered at all.
    pub(super) fn not_loaded_locked(&self, model: &str, state: &State) -> Error {
        if state.catalogue.contains_key(model) {
            Error::NotLoaded {
                model: model.into(),
            }
        } else {
            self.unknown_locked(model, state)
        }
    }

    pub(super) fn unknown_locked(&self, model: &str, state: &State) -> Error {
        Error::UnknownModel {
            model: model.into(),
            known: state.catalogue.keys().cloned().collect(),
        }
    }

    /// A worker for `model` was spawned: NVML's reading for its pid now
    /// stands for part of its GPU reservation.
    pub(super) fn note_incoming_pid(&self, model: &str, pid: u32) {
        if let Some(slot) = self.lock().slots.get_mut(model) {
            slot.note_incoming_pid(pid);
        }
    }
}
