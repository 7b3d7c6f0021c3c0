//! Swaps: a model's worker replaced by one for a new spec without dropping
//! a request (make-before-break), or, for a server on a fixed port, the old
//! one stopped first (break-before-make); a swap of a model with no worker
//! updates its spec.

use std::sync::Arc;
use std::time::Instant;

use super::slot::{Change, Entry, Incoming};
use super::{EventKind, ModelState, Need, Retiring, Supervisor, SwapReport, detached};
use crate::child::handle::WorkerHandle;
use crate::child::stop;
use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::report::UnloadReport;

impl Supervisor {
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
                    if let Err(reason) = slot.begin_swap() {
                        return Err(Error::Busy {
                            model: model.clone(),
                            reason,
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
        let files = super::footprint::from_files(&spec).await;
        let need = {
            let state = self.lock();
            Need::new(&spec, state.catalogue.get(&model), true, &files)
        };
        // A server on a fixed port that the old one holds: two cannot
        // listen there at once, so the old one stops first (requests wait).
        let stopped_first = match self.fixed_port_held(&model, &spec) {
            Some(old) => Some(self.stop_first(&model, &old).await),
            None => None,
        };
        // Models the new spec's rules (its fixed port) exclude stop first.
        let gate = match self
            .make_way(
                &model,
                self.inner.queue.enter(&model, spec.priority).await,
                Some(&spec),
            )
            .await
        {
            Ok(gate) => gate,
            Err(e) if stopped_first.is_some() => return Err(self.restart_old(&model, e)),
            Err(e) => {
                clear(self);
                return Err(e);
            }
        };
        let gpus = match self.make_room(&model, &need, false).await {
            Ok((gpus, _)) => gpus,
            Err(e) if stopped_first.is_some() => {
                drop(gate);
                return Err(self.restart_old(&model, e));
            }
            Err(e) => {
                clear(self);
                return Err(e);
            }
        };
        if let Some(slot) = self.lock().slots.get_mut(&model) {
            // Counted until the new worker is in: a concurrent load cannot
            // take the memory it is about to use.
            slot.reserve(Some(need.ram), Incoming::new(gpus.clone(), need.vram()));
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
                        self.config().default_keep_alive,
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
            Err(e) if stopped_first.is_some() => return Err(self.restart_old(&model, e)),
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
        let (unload, break_before_make) = match stopped_first {
            // Stopped before the new one started.
            Some(unload) => (unload, true),
            None => {
                if !old.drain(self.config().drain_timeout).await {
                    tracing::warn!(
                        model,
                        in_flight = old.in_flight(),
                        "old worker missed the drain deadline"
                    );
                }
                let unload = stop::stop(&old, self.config().stop_graces).await;
                {
                    let mut state = self.lock();
                    state.retiring.remove(&old.pid());
                    if let Some(entry) = state.catalogue.get(&model) {
                        entry.counters.record_unload(&unload);
                    }
                }
                self.inner.notify_changed();
                (unload, false)
            }
        };
        Ok(SwapReport {
            model,
            old_pid: Some(old.pid()),
            new_pid: Some(new_worker.pid()),
            switch_ms,
            took_ms: started.elapsed().as_secs_f64() * 1e3,
            load: Some(load),
            unload: Some(unload),
            break_before_make,
        })
    }

    /// A break-before-make swap failed (`e`) after the old server stopped:
    /// nothing runs. The old spec (still the catalogue's) starts again, as
    /// a load; returns `e`.
    fn restart_old(&self, model: &str, e: Error) -> Error {
        self.lock().slots.remove(model);
        self.inner.notify_changed();
        tracing::warn!(
            model,
            "the new server did not start ({e}); starting the old spec again"
        );
        let this = self.clone();
        let name = model.to_string();
        tokio::spawn(async move {
            if let Err(e) = this.start_load(&name, false).await {
                tracing::warn!(model = name, "the old spec did not start again: {e}");
            }
        });
        e
    }

    /// The model's current worker, where it is a server listening on the
    /// fixed port `spec`'s server is to listen on (or one a server that
    /// chooses its own port likely chooses too).
    fn fixed_port_held(&self, model: &str, spec: &ModelSpec) -> Option<Arc<WorkerHandle>> {
        let config = self.config();
        let http = spec.http_spec(&config)?;
        let state = self.lock();
        let worker = state.slots.get(model)?.worker.clone()?;
        let port = worker.upstream_server()?.address().port()?;
        (http.find_port || http.port == Some(port)).then_some(worker)
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
        if !old.drain(self.config().drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = old.in_flight(),
                "old worker missed the drain deadline"
            );
        }
        let unload = stop::stop(old, self.config().stop_graces).await;
        if let Some(entry) = self.lock().catalogue.get(model) {
            entry.counters.record_unload(&unload);
        }
        unload
    }
}
