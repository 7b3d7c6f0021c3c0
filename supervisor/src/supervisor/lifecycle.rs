//! Loading, unloading and swapping a model's worker.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::slot::{Change, Entry, Incoming, LoadSignal, Slot, Unload};
use super::{EventKind, ModelState, Need, Retiring, State, Supervisor, SwapReport, detached};
use crate::child::handle::WorkerHandle;
use crate::child::{launch, stop};
use crate::config::ModelSpec;
use crate::error::{Error, ErrorClass, Result};
use crate::report::{LoadReport, UnloadReport};

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
        self.start_load(&name).await
    }

    /// Loads a registered model.
    pub async fn load_registered(&self, model: &str) -> Result<LoadReport> {
        self.check_running(model)?;
        self.unless_stopping(model, self.start_load(model)).await
    }

    /// Makes room, reserves the slot, launches the worker.
    ///
    /// Runs as a task of its own: a caller that gives up (a deadline, a
    /// client gone) must not leave a half-made slot behind.
    pub(super) async fn start_load(&self, model: &str) -> Result<LoadReport> {
        let (this, model) = (self.clone(), model.to_string());
        detached(&model.clone(), async move {
            this.start_load_inner(&model).await
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
        let (worker, mut report) = launch::launch(
            spec,
            &self.inner.config,
            gpus,
            &|pid| self.note_incoming_pid(model, pid),
            start,
        )
        .await?;
        report.load_ms += chose_ms;
        report.spawn_ms += chose_ms;
        // Measured: within the per-GPU budget before it takes a request.
        if let Some(gpus) = report.gpus.clone()
            && let Err(e) = self.fit_measured(spec, &worker, &gpus).await
        {
            stop::stop(&worker, self.inner.config.stop_graces).await;
            return Err(e);
        }
        let installed = install(&mut self.lock(), &worker, &report);
        self.inner.notify_changed();
        match installed {
            Some(value) => {
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
                stop::stop(&worker, self.inner.config.stop_graces).await;
                Ok(None)
            }
        }
    }

    pub(super) async fn start_load_inner(&self, model: &str) -> Result<LoadReport> {
        let gate = self
            .make_way(model, self.inner.load_gate.lock().await)
            .await?;
        // The weights are measured on disk before the state lock is taken.
        let registered = self.lock().catalogue.get(model).map(|e| e.spec.clone());
        let disk = match &registered {
            Some(spec) => super::footprint::disk_footprint(spec).await,
            None => 0,
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
                Need::new(&entry.spec, Some(entry), false, disk),
            )
        };
        let gpus = self.make_room(model, &need).await?;
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
                Slot::loading(signal, need.ram, Incoming::new(gpus.clone(), &need)),
            );
        }
        drop(gate);
        self.inner.notify_changed();
        self.emit(EventKind::Loading {
            model: model.into(),
            restart: false,
        });

        let launched = self
            .launch_into_slot(model, &spec, gpus, |state, worker, report| {
                let State {
                    catalogue, slots, ..
                } = state;
                let slot = slots.get_mut(model)?;
                slot.used(None);
                slot.install(catalogue.get_mut(model), worker, report);
                Some(())
            })
            .await;
        let result = match launched {
            Ok(Some((_, report, ()))) => {
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
        let base = self.inner.config.restart_backoff;
        let entry = state.catalogue.get_mut(model)?;
        let message = e.to_string();
        match entry.health.load_failed(&message, &entry.spec, base) {
            Some(delay) => {
                tracing::warn!(
                    model,
                    "load failed; requests start the next attempt in {}",
                    humantime::format_duration(delay)
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
    /// callers share one load).
    pub async fn ensure_loaded(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        loop {
            self.check_running(model)?;
            enum Next {
                Wait(LoadSignal),
                WaitChange,
                Load,
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
                        // In a crash backoff of more than a moment: say so now
                        // rather than hold the request for up to a minute.
                        (ModelState::Loading, None, _)
                            if slot
                                .restart_at
                                .is_some_and(|t| t > Instant::now() + Duration::from_secs(1)) =>
                        {
                            let left = slot
                                .restart_at
                                .map(|t| t.saturating_duration_since(Instant::now()));
                            return Err(Error::Restarting {
                                model: model.into(),
                                in_s: left.unwrap_or_default().as_secs_f64(),
                                last_exit: state
                                    .catalogue
                                    .get(model)
                                    .and_then(|e| e.health.last_exit.as_ref())
                                    .map(|e| e.description.clone())
                                    .unwrap_or_default(),
                            });
                        }
                        (_, _, Some(signal)) => Next::Wait(signal.clone()),
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
                Next::Load => match self.unless_stopping(model, self.start_load(model)).await {
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
        let worker = {
            let mut state = self.lock();
            let known = state.catalogue.contains_key(model);
            let Some(slot) = state.slots.get_mut(model) else {
                return Err(if known {
                    Error::NotLoaded {
                        model: model.into(),
                    }
                } else {
                    self.unknown_locked(model, &state)
                });
            };
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
        if !worker.drain(self.inner.config.drain_timeout).await {
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
        let report = stop::stop(&worker, self.inner.config.stop_graces).await;
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

    /// Replaces a loaded model's worker with one for `spec` without dropping
    /// a request: the new worker loads while the old one serves, routing
    /// switches atomically, the old one drains and stops. If the new worker
    /// fails to load, the old one keeps serving and the error is returned.
    ///
    /// A registered model that is not loaded (or has failed) has nothing to
    /// replace: its spec is updated, checked as a registration is, and the
    /// report says nothing was running; its next load uses it.
    pub async fn swap(&self, spec: ModelSpec) -> Result<SwapReport> {
        self.swap_with(spec, false).await
    }

    /// [`Supervisor::swap`]; with `load`, a model that was not loaded is
    /// also loaded with the new spec.
    pub async fn swap_with(&self, spec: ModelSpec, load: bool) -> Result<SwapReport> {
        let model = spec.name.clone();
        self.check_running(&model)?;
        self.check_spec(&spec)?;
        let running = {
            let mut state = self.lock();
            if !state.catalogue.contains_key(&model) {
                return Err(self.unknown_locked(&model, &state));
            }
            super::catalogue::check_names(&state, &spec)?;
            match state.slots.get_mut(&model) {
                None => false,
                Some(slot) if slot.state == ModelState::Failed && slot.worker.is_none() => false,
                Some(slot) => {
                    if let Err(now) = slot.begin_swap() {
                        return Err(Error::Busy {
                            model: model.clone(),
                            reason: format!("it is {now}"),
                        });
                    }
                    true
                }
            }
        };
        if !running {
            return self.update_spec(spec, load).await;
        }
        self.emit(EventKind::SwapBegun {
            model: model.clone(),
        });
        // A task of its own: a caller that goes away must not leave the slot
        // marked `swapping` forever.
        let (this, name) = (self.clone(), model.clone());
        detached(&model, async move {
            let swapped = this.replace_worker(spec).await;
            this.emit(match &swapped {
                Ok(report) => EventKind::SwapCompleted {
                    model: name,
                    report: Box::new(report.clone()),
                },
                Err(e) => EventKind::SwapRolledBack {
                    model: name,
                    error: e.to_string(),
                },
            });
            swapped
        })
        .await
    }

    /// A swap of a model with no worker: its spec is registered in place of
    /// the old (a failed model's failure is cleared with it), and with
    /// `load` it is loaded.
    async fn update_spec(&self, spec: ModelSpec, load: bool) -> Result<SwapReport> {
        let started = Instant::now();
        let model = spec.name.clone();
        {
            let mut state = self.lock();
            if state
                .slots
                .get(&model)
                .is_some_and(|s| s.state == ModelState::Failed && s.worker.is_none())
            {
                state.slots.remove(&model);
            }
        }
        self.register(spec)?;
        tracing::info!(model, "swapped with nothing running: its spec is updated");
        let load = if load {
            Some(self.load_registered(&model).await?)
        } else {
            None
        };
        let report = SwapReport {
            model: model.clone(),
            old_pid: None,
            new_pid: load.as_ref().map(|l| l.pid),
            switch_ms: started.elapsed().as_secs_f64() * 1e3,
            took_ms: started.elapsed().as_secs_f64() * 1e3,
            load,
            unload: None,
            break_before_make: false,
        };
        self.emit(EventKind::SwapCompleted {
            model,
            report: Box::new(report.clone()),
        });
        Ok(report)
    }

    /// The body of a swap (and of a recycle): the slot is already marked
    /// `swapping` by the caller; this clears it whatever happens.
    pub(super) async fn replace_worker(&self, spec: ModelSpec) -> Result<SwapReport> {
        let started = Instant::now();
        let model = spec.name.clone();
        let clear = |this: &Self| {
            if let Some(slot) = this.lock().slots.get_mut(&model) {
                slot.end_swap();
            }
            this.inner.notify_changed();
        };
        let disk = super::footprint::disk_footprint(&spec).await;
        let need = {
            let state = self.lock();
            Need::new(&spec, state.catalogue.get(&model), true, disk)
        };
        // A server on a fixed port that the old one holds: two cannot
        // listen there at once, so the old one stops first (requests wait).
        let stopped_first = match self.fixed_port_held(&model, &spec) {
            Some(old) => Some(self.stop_first(&model, &old).await),
            None => None,
        };
        let gate = self.inner.load_gate.lock().await;
        let gpus = match self.make_room(&model, &need).await {
            Ok(gpus) => gpus,
            Err(e) => {
                clear(self);
                return Err(e);
            }
        };
        if let Some(slot) = self.lock().slots.get_mut(&model) {
            // Counted until the new worker is in: a concurrent load cannot
            // take the memory it is about to use.
            slot.reserve(Some(need.ram), Incoming::new(gpus.clone(), &need));
        }
        drop(gate);
        let launched = if self.is_shutting_down() {
            Err(Error::ShuttingDown {
                model: model.clone(),
            })
        } else {
            self.launch_into_slot(&model, &spec, gpus, |state, new_worker, load| {
                if self.is_shutting_down() {
                    // Shutdown began while it loaded: the old worker is
                    // stopped by shutdown; the new one must not outlive it.
                    return None;
                }
                let slot = state
                    .slots
                    .get_mut(&model)
                    .expect("a swapping slot is never removed");
                let (old, old_gpus) = slot.switch_to(new_worker, load);
                if old.is_alive() || stopped_first.is_none() {
                    state.retiring.insert(
                        old.pid(),
                        Retiring {
                            model: model.clone(),
                            worker: Arc::clone(&old),
                            gpus: old_gpus,
                        },
                    );
                }
                if let Some(entry) = state.catalogue.remove(&model) {
                    // Aliases were checked when the swap began; one another
                    // model took since is not taken from it.
                    let mut spec = spec.clone();
                    spec.aliases.retain(|a| {
                        let free = state.aliases.get(a).is_none_or(|m| *m == model)
                            && !state.catalogue.contains_key(a);
                        if !free {
                            tracing::warn!(
                                model,
                                alias = a,
                                "alias taken during the swap; dropped"
                            );
                        }
                        free
                    });
                    super::catalogue::index_aliases(
                        state,
                        &model,
                        &entry.spec.aliases,
                        &spec.aliases,
                    );
                    let mut entry = Entry::carry_over(
                        Some(entry),
                        spec,
                        self.inner.config.default_keep_alive,
                        Change::Swap,
                    );
                    entry.loaded(load);
                    state.catalogue.insert(model.clone(), entry);
                }
                Some(old)
            })
            .await
            .and_then(|installed| {
                installed.ok_or_else(|| Error::ShuttingDown {
                    model: model.clone(),
                })
            })
        };
        let (new_worker, load, old) = match launched {
            Ok(launched) => launched,
            Err(e) if stopped_first.is_some() => {
                // The old server was stopped first: nothing runs. The old
                // spec (still the catalogue's) starts again, as a load.
                self.lock().slots.remove(&model);
                self.inner.notify_changed();
                tracing::warn!(
                    model,
                    "the new server failed to start ({e}); starting the old spec again"
                );
                let this = self.clone();
                let name = model.clone();
                tokio::spawn(async move {
                    if let Err(e) = this.start_load(&name).await {
                        tracing::warn!(model = name, "the old spec did not start again: {e}");
                    }
                });
                return Err(e);
            }
            Err(e) => {
                clear(self);
                // An old worker that died during the swap goes to the crash
                // policy now that the swap no longer covers it.
                let current = self.lock().slots.get(&model).and_then(|s| s.worker.clone());
                if let Some(old) = current.filter(|w| !w.is_alive()) {
                    let death = old.death().await;
                    self.on_death(&model, &old, &death);
                }
                return Err(e);
            }
        };
        let switch_ms = started.elapsed().as_secs_f64() * 1e3;
        self.inner.notify_changed();
        if let Some(unload) = stopped_first {
            return Ok(SwapReport {
                model,
                old_pid: Some(old.pid()),
                new_pid: Some(new_worker.pid()),
                switch_ms,
                took_ms: started.elapsed().as_secs_f64() * 1e3,
                load: Some(load),
                unload: Some(unload),
                break_before_make: true,
            });
        }
        if !old.drain(self.inner.config.drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = old.in_flight(),
                "old worker missed the drain deadline"
            );
        }
        let unload = stop::stop(&old, self.inner.config.stop_graces).await;
        {
            let mut state = self.lock();
            state.retiring.remove(&old.pid());
            if let Some(entry) = state.catalogue.get(&model) {
                entry.counters.record_unload(&unload);
            }
        }
        self.inner.notify_changed();
        Ok(SwapReport {
            model,
            old_pid: Some(old.pid()),
            new_pid: Some(new_worker.pid()),
            switch_ms,
            took_ms: started.elapsed().as_secs_f64() * 1e3,
            load: Some(load),
            unload: Some(unload),
            break_before_make: false,
        })
    }

    /// The model's current worker, where it is a server listening on the
    /// fixed port `spec`'s server is to listen on (or one a server that
    /// chooses its own port likely chooses too).
    fn fixed_port_held(&self, model: &str, spec: &ModelSpec) -> Option<Arc<WorkerHandle>> {
        let http = spec.http_spec(&self.inner.config)?;
        let state = self.lock();
        let worker = state.slots.get(model)?.worker.clone()?;
        match worker.upstream_server()?.address() {
            crate::child::upstream::Address::Tcp(addr)
                if http.find_port || http.port == Some(addr.port()) =>
            {
                Some(worker)
            }
            _ => None,
        }
    }

    /// A swap's break-before-make: requests wait (the slot holds), the old
    /// worker drains and stops. Its death is a planned one: a failed start
    /// of the new one hands it to the crash policy, which restarts the old
    /// spec.
    async fn stop_first(&self, model: &str, old: &Arc<WorkerHandle>) -> UnloadReport {
        if let Some(slot) = self.lock().slots.get_mut(model) {
            slot.hold();
        }
        tracing::info!(
            model,
            pid = old.pid(),
            "its server listens on a fixed port: stopping the old one before the new one starts"
        );
        if !old.drain(self.inner.config.drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = old.in_flight(),
                "old worker missed the drain deadline"
            );
        }
        let unload = stop::stop(old, self.inner.config.stop_graces).await;
        if let Some(entry) = self.lock().catalogue.get(model) {
            entry.counters.record_unload(&unload);
        }
        unload
    }
}
