//! What keeps a model serving through faults:
//!
//! - **crash restarts**: a worker that dies unexpectedly is restarted after
//!   a backoff (500 ms, doubling, capped at 60 s, reset once a worker has
//!   served 30 s); more than `max_restarts` crashes within `restart_window`
//!   (5 in 60 s, as OTP and systemd do) marks the model failed, with the last
//!   exit's cause and stderr, until it is loaded again by hand;
//! - **quarantine**: a request (by body hash) in flight at two consecutive
//!   deaths is refused from then on, so one poison input cannot take down
//!   every new worker;
//! - **recycling**: a worker past `max_rss` or `max_requests` is replaced the
//!   way a swap does it. Past `max_rss` the old worker also stops taking new
//!   requests, which wait for the replacement, so a leak stays bounded.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use super::crashes::LastExit;
use super::{EventKind, Inner, ModelState, Need, State, Supervisor};
use crate::base::KillCause;
use crate::child::death::Death;
use crate::child::handle::WorkerHandle;
use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::report::ExitStatus;

type Done = watch::Sender<Option<std::result::Result<(), Arc<Error>>>>;

/// True when `slot` is still the one this restart was started for (not
/// one a load by hand put there after an unload cancelled the restart).
fn ours(slot: &super::Slot, done: &Done) -> bool {
    slot.loading
        .as_ref()
        .is_some_and(|signal| signal.same_channel(&done.subscribe()))
}

impl Supervisor {
    /// Watches a worker that just started serving: an unplanned death goes
    /// to the crash policy.
    pub(super) fn watch_worker(&self, model: &str, worker: &Arc<WorkerHandle>) {
        let inner = Arc::downgrade(&self.inner);
        let worker = Arc::clone(worker);
        let model = model.to_string();
        tokio::spawn(async move {
            let death = worker.death().await;
            if let Some(inner) = inner.upgrade() {
                if !worker.process().is_stopping() {
                    crate::child::stop::after_death(&worker, inner.config().stop_graces).await;
                }
                Supervisor { inner }.on_death(&model, &worker, &death);
            }
        });
    }

    pub(super) fn on_death(&self, model: &str, worker: &Arc<WorkerHandle>, death: &Death) {
        let base = self.config().restart_backoff;
        let restart = {
            let mut state = self.lock();
            let State {
                catalogue, slots, ..
            } = &mut *state;
            let (Some(entry), Some(slot)) = (catalogue.get_mut(model), slots.get_mut(model)) else {
                return;
            };
            let current = slot.worker.as_ref().is_some_and(|w| Arc::ptr_eq(w, worker));
            if current && slot.swapping && worker.process().is_stopping() {
                // A swap's break-before-make stopped it: planned.
                return;
            }
            if current && slot.swapping {
                // A swap or recycle is already replacing it: record the death
                // and let the swap install the new worker (or, if the swap
                // fails, hand this death back to the crash policy).
                let quarantined = entry.health.note_death(model, worker.pid(), death);
                self.death_events(model, entry.health.last_exit.as_ref(), quarantined);
                slot.hold();
                return;
            }
            // Asleep, it had nothing in flight: its death is said, and the
            // next request loads it cold.
            if current && slot.is_asleep() && !self.is_shutting_down() {
                let quarantined = entry.health.note_death(model, worker.pid(), death);
                self.death_events(model, entry.health.last_exit.as_ref(), quarantined);
                slots.remove(model);
                self.inner.notify_changed();
                return;
            }
            if !current || slot.state != ModelState::Ready || self.is_shutting_down() {
                return; // a planned stop, or a worker already replaced
            }
            // A worker that died during a swap that then failed was noted
            // then; the swap hands its death back here for the restart.
            let noted = entry
                .health
                .last_exit
                .as_ref()
                .is_some_and(|e| e.pid == worker.pid());
            if !noted {
                let quarantined = entry.health.note_death(model, worker.pid(), death);
                self.death_events(model, entry.health.last_exit.as_ref(), quarantined);
            }
            let last = entry
                .health
                .last_exit
                .as_ref()
                .map(|e| e.description.clone())
                .unwrap_or_default();
            tracing::warn!(model, "{last}");
            match entry
                .health
                .next_restart(worker.uptime(), &entry.spec, base)
            {
                None => {
                    let failure = entry.health.failure(&entry.spec);
                    tracing::error!(model, "model failed: {failure}");
                    self.emit(EventKind::Failed {
                        model: model.into(),
                        reason: failure.clone(),
                    });
                    slot.fail(failure);
                    None
                }
                Some(delay) => {
                    self.emit(EventKind::Restarting {
                        model: model.into(),
                        in_ms: delay.as_millis() as u64,
                    });
                    let (done, signal) = watch::channel(None);
                    slot.begin_restart(signal, delay, entry.last_peak_bytes.unwrap_or(0));
                    Some((delay, done, entry.spec.clone()))
                }
            }
        };
        self.inner.notify_changed();
        if let Some((delay, done, spec)) = restart {
            tokio::spawn(self.clone().restart(model.to_string(), spec, delay, done));
        }
    }

    /// The events a worker's unplanned death makes: what killed it, if the
    /// supervisor or the kernel did (a memory limit, a hang), the crash,
    /// and the requests it quarantined.
    fn death_events(&self, model: &str, exit: Option<&LastExit>, quarantined: usize) {
        let Some(exit) = exit else { return };
        let pid = exit.pid;
        match &exit.cause {
            Some(KillCause::MemoryLimit {
                limit_bytes,
                peak_bytes,
                ..
            }) => self.emit(EventKind::MemoryLimitExceeded {
                model: model.into(),
                pid,
                limit_bytes: *limit_bytes,
                peak_bytes: *peak_bytes,
            }),
            Some(cause @ (KillCause::Stalled { .. } | KillCause::HeartbeatLost { .. })) => self
                .emit(EventKind::HangDetected {
                    model: model.into(),
                    pid,
                    cause: cause.clone(),
                }),
            _ => {}
        }
        self.emit(EventKind::Crashed {
            model: model.into(),
            exit: exit.clone(),
        });
        if quarantined > 0 {
            self.emit(EventKind::Quarantined {
                model: model.into(),
                requests: quarantined,
            });
        }
    }

    /// Restarts a crashed model after `delay`, again with longer delays while
    /// the new workers fail, until it serves or the model is marked failed.
    async fn restart(self, model: String, spec: ModelSpec, mut delay: Duration, done: Done) {
        loop {
            tracing::info!(
                model,
                "restarting in {}",
                crate::units::format_duration(delay)
            );
            tokio::time::sleep(delay).await;
            let wanted = match self.lock().slots.get_mut(&model) {
                Some(slot) if slot.state == ModelState::Loading && ours(slot, &done) => {
                    slot.restart_starting(); // callers wait for it now
                    true
                }
                _ => false,
            };
            if !wanted || self.is_shutting_down() {
                let _ = done.send(Some(Err(Arc::new(
                    Error::ShuttingDown {
                        model: model.clone(),
                    }
                    .shared(),
                ))));
                return;
            }
            if let Some(entry) = self.lock().catalogue.get(&model) {
                entry.counters.restarts.fetch_add(1, Ordering::Relaxed);
            }
            self.emit(EventKind::Loading {
                model: model.clone(),
                restart: true,
            });
            let launched = match self.place_restart(&model, &spec, &done).await {
                Ok(gpus) => {
                    self.launch_into_slot(&model, &spec, gpus, |state, worker, report| {
                        let State {
                            catalogue, slots, ..
                        } = state;
                        match (slots.get_mut(&model), catalogue.get_mut(&model)) {
                            (Some(slot), Some(entry))
                                if slot.state == ModelState::Loading && ours(slot, &done) =>
                            {
                                slot.install(Some(entry), worker, report);
                                Some(())
                            }
                            _ => None,
                        }
                    })
                    .await
                }
                Err(e) => Err(e),
            };
            match launched {
                Ok(Some((_, report, ()))) => {
                    tracing::info!(model, pid = report.pid, "restarted");
                    let pid = report.pid;
                    self.emit(EventKind::Loaded {
                        model: model.clone(),
                        report: Box::new(report),
                    });
                    self.emit(EventKind::Restarted {
                        model: model.clone(),
                        pid,
                    });
                    let _ = done.send(Some(Ok(())));
                    return;
                }
                Ok(None) => {
                    // Unloaded or shut down meanwhile: the worker was stopped.
                    let _ = done.send(Some(Err(Arc::new(
                        Error::ShuttingDown {
                            model: model.clone(),
                        }
                        .shared(),
                    ))));
                    return;
                }
                Err(e) => {
                    tracing::warn!(model, "restart failed: {e}");
                    self.emit(EventKind::LoadFailed {
                        model: model.clone(),
                        error: e.to_string(),
                    });
                    let next = {
                        let mut state = self.lock();
                        let State {
                            catalogue, slots, ..
                        } = &mut *state;
                        let (Some(entry), Some(slot)) =
                            (catalogue.get_mut(&model), slots.get_mut(&model))
                        else {
                            return;
                        };
                        if !ours(slot, &done) {
                            return; // cancelled by an unload
                        }
                        entry.health.last_exit = Some(LastExit {
                            pid: 0,
                            exit: ExitStatus::Code(-1),
                            cause: None,
                            description: format!("restart failed: {e}"),
                            stderr_tail: Vec::new(),
                            at_unix_s: crate::base::unix_ms() / 1000,
                        });
                        match entry.health.next_restart(
                            Duration::ZERO,
                            &entry.spec,
                            self.config().restart_backoff,
                        ) {
                            Some(d) => {
                                // The next attempt places afresh.
                                slot.retry_restart(d);
                                self.emit(EventKind::Restarting {
                                    model: model.clone(),
                                    in_ms: d.as_millis() as u64,
                                });
                                Some(d)
                            }
                            None => {
                                let failure = entry.health.failure(&entry.spec);
                                tracing::error!(model, "model failed: {failure}");
                                self.emit(EventKind::Failed {
                                    model: model.clone(),
                                    reason: failure.clone(),
                                });
                                slot.fail(failure);
                                None
                            }
                        }
                    };
                    match next {
                        Some(d) => delay = d,
                        None => {
                            let _ = done.send(Some(Err(Arc::new(e.shared()))));
                            self.inner.notify_changed();
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Places a restarting model on GPUs (its old worker's VRAM is back by
    /// now), evicting idle models as a load would; its RAM is already
    /// counted in its slot.
    async fn place_restart(
        &self,
        model: &str,
        spec: &ModelSpec,
        done: &Done,
    ) -> Result<Option<Vec<u32>>> {
        if spec.gpus.is_none() {
            return Ok(None);
        }
        let _gate = self.inner.queue.enter(model, spec.priority).await;
        let files = super::footprint::from_files(spec).await;
        let need = {
            let state = self.lock();
            Need {
                ram: 0,
                ..Need::new(spec, state.catalogue.get(model), true, &files)
            }
        };
        let (gpus, _) = self.make_room(model, &need, false).await?;
        if let Some(slot) = self.lock().slots.get_mut(model)
            && ours(slot, done)
        {
            slot.reserve(None, super::slot::Incoming::new(gpus.clone(), need.vram()));
        }
        Ok(gpus)
    }

    /// After each request: replace a worker past `max_rss` or `max_requests`.
    ///
    /// The worker's RSS is read (from `/proc/<pid>/statm`, microseconds)
    /// only for a model with `max_rss`, and outside the state lock. It used
    /// to be a full memory sample (`smaps_rollup`, which walks the worker's
    /// page tables: milliseconds for a large worker) after every request of
    /// any model that recycles, under the lock: that was the latency that
    /// recycling by `max_requests` showed.
    pub(super) fn maybe_recycle(inner: &Arc<Inner>, model: &str) {
        let (worker, max_rss) = {
            let state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            let (Some(entry), Some(slot)) = (state.catalogue.get(model), state.slots.get(model))
            else {
                return;
            };
            let Some(worker) = slot.worker.clone() else {
                return;
            };
            (worker, entry.spec.max_rss)
        };
        let rss = match max_rss {
            Some(_) => worker.sample_rss().unwrap_or(0),
            None => 0,
        };
        let spec = {
            let mut state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
            let State {
                catalogue, slots, ..
            } = &mut *state;
            let (Some(entry), Some(slot)) = (catalogue.get(model), slots.get_mut(model)) else {
                return;
            };
            let (max_rss, max_requests) = (entry.spec.max_rss, entry.spec.max_requests);
            if (max_rss.is_none() && max_requests.is_none())
                || slot.state != ModelState::Ready
                || inner.shutting_down.load(Ordering::SeqCst)
                || !slot
                    .worker
                    .as_ref()
                    .is_some_and(|w| Arc::ptr_eq(w, &worker))
            {
                return;
            }
            let over = max_rss.is_some_and(|m| rss >= m);
            if over {
                // Not one more request for this worker: they wait for its replacement.
                slot.hold();
            }
            if slot.swapping {
                return;
            }
            // Start early enough that the replacement is ready before the
            // limit: the requests expected while a worker loads, at the rate
            // this one has been serving, each growing it by the trend.
            let rate = worker.requests() as f64 / worker.uptime().as_secs_f64().max(1e-3);
            let during_load = rate * worker.load_time().as_secs_f64() * 1.5;
            let headroom = worker.rss_growth_per_request()
                * (f64::from(worker.in_flight()) + 2.0 + during_load);
            let soon = max_rss.is_some_and(|m| rss as f64 + headroom >= m as f64);
            let worn = max_requests.is_some_and(|m| worker.requests() >= m);
            if !(over || soon || worn) {
                return;
            }
            if slot.begin_swap().is_err() {
                return;
            }
            entry.counters.recycles.fetch_add(1, Ordering::Relaxed);
            let why = match (over || soon, max_rss, max_requests) {
                (true, Some(m), _) if over => {
                    format!("its RSS of {rss} bytes reached max_rss ({m})")
                }
                (true, Some(m), _) => format!(
                    "its RSS of {rss} bytes would pass max_rss ({m}) before a replacement loads"
                ),
                (_, _, Some(m)) => format!(
                    "it served {} requests (max_requests {m})",
                    worker.requests()
                ),
                _ => "it wore out".to_string(),
            };
            inner.emit(EventKind::Recycling {
                model: model.into(),
                pid: worker.pid(),
                why,
            });
            tracing::info!(
                model,
                pid = worker.pid(),
                rss,
                requests = worker.requests(),
                "recycling the worker"
            );
            entry.spec.clone()
        };
        let supervisor = Supervisor {
            inner: Arc::clone(inner),
        };
        let model = model.to_string();
        tokio::spawn(async move {
            let replaced = supervisor.replace_worker(spec).await;
            supervisor.emit(match &replaced {
                Ok(report) => EventKind::Recycled {
                    model: model.clone(),
                    // A replacement always has both workers.
                    old_pid: report.old_pid.unwrap_or_default(),
                    new_pid: report.new_pid.unwrap_or_default(),
                },
                Err(e) => EventKind::RecycleFailed {
                    model: model.clone(),
                    error: e.to_string(),
                },
            });
            match replaced {
                Ok(report) => tracing::info!("recycled: {report}"),
                Err(e @ (Error::BudgetExceeded { .. } | Error::GpuBudgetExceeded { .. })) => {
                    // Two workers do not fit side by side: stop the old one
                    // first (its requests drain; new ones wait for the load
                    // that follows) rather than let it grow on.
                    tracing::warn!(
                        model,
                        "no room for a replacement beside the old worker ({e}); restarting it in place"
                    );
                    if let Err(e) = supervisor.unload(&model).await {
                        tracing::error!(model, "recycling in place failed to unload: {e}");
                        return;
                    }
                    match supervisor.load_registered(&model).await {
                        Ok(report) => tracing::info!("recycled in place: {report}"),
                        // A request that arrived meanwhile already loaded it.
                        Err(Error::AlreadyLoaded { .. } | Error::Busy { .. }) => {}
                        Err(e) => tracing::error!(model, "recycling in place failed to load: {e}"),
                    }
                }
                Err(e) => tracing::error!("recycling failed; the old worker keeps serving: {e}"),
            }
        });
    }
}
