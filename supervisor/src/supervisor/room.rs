//! The machine's room, read from the state as admission sees it
//! ([`room`], [`gpu_holders`], and what "idle" means: [`is_idle`]), and
//! admission's decision carried out ([`Supervisor::make_room`]): evicting,
//! asking a busy model to yield when its turn is over, waiting for memory
//! on its way back or for a turn to end, one step at a time, planning
//! again after each. The decision itself is `admission::plan`'s.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::admission::{Admit, Asker, Held, Limits, Room, Why, plan};
use super::footprint::Need;
use super::slot::Slot;
use super::{ModelState, State, Supervisor};
use crate::error::{Error, Result};
use crate::gpu;
use crate::units::mib;

/// How a room was made for a load: what went, and how long it waited.
#[derive(Debug, Clone, Default)]
pub(super) struct Made {
    /// The models that gave their room, each with why.
    pub evicted: Vec<(String, Why)>,
    /// How long it waited for memory on its way back or for a turn.
    pub waited: Duration,
}

/// What `state` holds, as admission sees it for `model`.
pub(super) fn room(state: &State, model: &str) -> Room {
    let rss = |s: &Slot| {
        s.worker
            .as_ref()
            .map(|w| w.memory().last.rss_bytes)
            .unwrap_or(0)
            + s.reserved_bytes
    };
    let held = state
        .slots
        .iter()
        .filter(|(name, slot)| {
            name.as_str() != model && (slot.worker.is_some() || slot.loading.is_some())
        })
        .map(|(name, slot)| {
            let entry = state.catalogue.get(name);
            Held {
                name: name.clone(),
                ram: rss(slot),
                state: slot.state(),
                idle: is_idle(state, name, slot),
                stoppable: (slot.state() == ModelState::Ready && !slot.swapping)
                    || slot.is_asleep(),
                in_flight: slot.worker.as_ref().map(|w| w.in_flight()).unwrap_or(0),
                turn: slot.turn_started.elapsed(),
                load_time: slot
                    .report
                    .as_ref()
                    .map(|r| Duration::from_secs_f64(r.load_ms.max(0.0) / 1e3))
                    .unwrap_or_default(),
                priority: entry.map(|e| e.spec.priority).unwrap_or(0),
                unused_for: slot.last_used.elapsed(),
                // Asleep, its device memory is in its host memory.
                on_gpu: (!slot.gpus.is_empty() || slot.incoming_gpu.is_some()) && !slot.is_asleep(),
            }
        })
        .collect();
    Room {
        used: state.slots.values().map(rss).sum::<u64>()
            + state
                .retiring
                .values()
                .map(|r| r.worker.memory().last.rss_bytes)
                .sum::<u64>(),
        // A failed model holds nothing; a replaced one is counted once.
        loaded: state
            .slots
            .values()
            .filter(|s| s.worker.is_some() || s.loading.is_some())
            .count(),
        freeing: !state.retiring.is_empty()
            || state
                .slots
                .values()
                .any(|s| matches!(s.state, ModelState::Draining | ModelState::Stopping)),
        held,
    }
}

impl Room {
    /// The least recently used idle model, if any.
    pub(super) fn lru_idle(&self) -> Option<&Held> {
        self.held
            .iter()
            .filter(|h| h.idle && h.stoppable)
            .max_by_key(|h| h.unused_for)
    }

    /// Each model's holding, for messages.
    pub(super) fn holders(&self) -> Vec<String> {
        self.held
            .iter()
            .map(|h| {
                format!(
                    "`{}` {} ({} in flight, {})",
                    h.name,
                    mib(h.ram),
                    h.in_flight,
                    h.state
                )
            })
            .collect()
    }
}

/// Whether a model is idle: ready, no request in flight, queued or
/// waiting to be sent to it (the request that loaded it counts until it is
/// sent), not being replaced. A model yielding its turn is idle once what
/// it has in flight is done: the requests waiting for it wait for its next
/// turn. Eviction and the keep-alive both stop only idle models; this is
/// where "idle" is decided.
pub(super) fn is_idle(state: &State, name: &str, slot: &Slot) -> bool {
    if slot.is_asleep() {
        return true;
    }
    slot.state == ModelState::Ready
        && !slot.swapping
        && slot.worker.as_ref().is_some_and(|w| w.in_flight() == 0)
        && (slot.yielding.is_some()
            || state.catalogue.get(name).is_none_or(|e| {
                e.queued.load(Ordering::SeqCst) == 0 && e.awaiting_load.load(Ordering::SeqCst) == 0
            }))
}

/// berth's workers and loads in progress as GPU placement sees them;
/// `model` itself (being replaced) is never a candidate for eviction, and
/// its own reservation (a retried restart's) is not counted against it.
pub(super) fn gpu_holders(state: &State, model: &str) -> Vec<gpu::Holder> {
    // A declared share is held for as long as its worker runs, used or not
    // (a PyTorch model grows into it at its first large batch).
    let share = |name: &str| {
        state
            .catalogue
            .get(name)
            .and_then(|e| e.spec.vram)
            .unwrap_or(0)
    };
    let mut holders: Vec<gpu::Holder> = state
        .retiring
        .values()
        .map(|r| gpu::Holder {
            model: r.model.clone(),
            pids: r.worker.pids(),
            gpus: r.gpus.clone(),
            reserved_bytes: share(&r.model),
            evictable: false,
            last_used: 0,
        })
        .collect();
    for (name, slot) in &state.slots {
        // Larger is more recent.
        let last_used = u64::MAX - slot.last_used.elapsed().as_micros() as u64;
        // Asleep: nothing of it is on a GPU (its wake restores it there,
        // or loads it cold through the queue when there is no room).
        if let Some(worker) = slot.worker.as_ref().filter(|_| !slot.is_asleep()) {
            holders.push(gpu::Holder {
                model: name.clone(),
                pids: worker.pids(),
                gpus: slot.gpus.clone(),
                reserved_bytes: share(name),
                evictable: name != model && is_idle(state, name, slot),
                last_used,
            });
        }
        if let Some(incoming) = slot.incoming_gpu.as_ref().filter(|_| name != model) {
            holders.push(gpu::Holder {
                model: name.clone(),
                pids: incoming.pid.into_iter().collect(),
                gpus: incoming.gpus.clone(),
                reserved_bytes: incoming.vram,
                evictable: false,
                last_used,
            });
        }
    }
    holders
}

impl Supervisor {
    /// Makes room for a new worker of `model`: evicts idle models, least
    /// recently used first, has busy ones yield once their turn is over,
    /// waits for memory on its way back and for turns to end, until the
    /// worker fits the memory budget, `max_loaded` and (for a model on
    /// GPUs) the per-GPU VRAM budget; returns the GPUs it goes on, and
    /// what the room cost. Called with the machine's queue entered (one
    /// load plans at a time, in order). `on_demand`: a load that requests
    /// asked for, which gives up once none waits for it any more. The
    /// decision is [`plan`]'s; this carries it out.
    pub(super) async fn make_room(
        &self,
        model: &str,
        need: &Need,
        on_demand: bool,
    ) -> Result<(Option<Vec<u32>>, Made)> {
        let mut made = Made::default();
        let started = Instant::now();
        let priority = self
            .lock()
            .catalogue
            .get(model)
            .map(|e| e.spec.priority)
            .unwrap_or(0);
        let asker = Asker { model, priority };
        loop {
            self.check_running(model)?;
            if on_demand && !self.wanted(model) {
                return Err(Error::Busy {
                    model: model.into(),
                    reason: "no request waits for its load any more".into(),
                });
            }
            let config = self.config();
            let limits = Limits {
                budget: config.memory_budget,
                max_loaded: config.max_loaded,
            };
            // NVML is read outside the lock: it can take milliseconds.
            let devices = match &need.gpu {
                None => None,
                Some(_) => match gpu::inventory() {
                    gpu::Inventory::Devices(devices) => Some(devices),
                    gpu::Inventory::NoGpu(reason) => {
                        return Err(Error::InvalidSpec {
                            model: model.into(),
                            reason: format!("it asks for GPUs but {reason}"),
                        });
                    }
                },
            };
            let changed = self.inner.changed.notified();
            let (room, gpu_plan) = {
                let state = self.lock();
                let gpu_plan = match (&need.gpu, &devices) {
                    (Some((request, vram)), Some(devices)) => Some(gpu::plan(
                        request,
                        devices,
                        *vram,
                        config.gpu_memory_budget,
                        &gpu_holders(&state, model),
                    )),
                    _ => None,
                };
                (room(&state, model), gpu_plan)
            };
            match plan(asker, need, &room, limits, &config.turn, gpu_plan) {
                Admit::Place(gpus) => {
                    made.waited = started.elapsed();
                    return Ok((gpus, made));
                }
                Admit::Refuse(e) => return Err(e),
                Admit::Wait(at_most) => {
                    let at_most = at_most
                        .unwrap_or(Duration::from_millis(200))
                        .min(Duration::from_millis(200));
                    let _ = tokio::time::timeout(at_most, changed).await;
                }
                Admit::Evict(victim, why) => {
                    tracing::info!(
                        model,
                        victim,
                        why = why.as_str(),
                        "making room: the model gives its room up"
                    );
                    // For a GPU's room, a model that can sleep sleeps when
                    // that is the cheaper way back (`sleep.rs`).
                    let note = match (&need.gpu, &devices) {
                        (Some(_), Some(devices)) => {
                            match self.sleep_for(&victim, model, why, devices).await {
                                Ok(()) => {
                                    made.evicted.push((victim, why));
                                    continue;
                                }
                                Err(note) => note,
                            }
                        }
                        _ => None,
                    };
                    self.evict_for(&victim, model, why, note).await;
                    made.evicted.push((victim, why));
                }
            }
        }
    }

    /// Whether a request (or a caller of `load`) still waits for `model`'s
    /// load.
    pub(super) fn wanted(&self, model: &str) -> bool {
        self.lock()
            .catalogue
            .get(model)
            .is_some_and(|e| e.awaiting_load.load(Ordering::SeqCst) > 0)
    }
}
