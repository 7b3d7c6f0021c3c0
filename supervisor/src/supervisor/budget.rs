//! The budgets after loads: one watch for the memory budget and the
//! per-GPU VRAM budget.
//!
//! **Memory.** Admission counts a model in with what it was measured (or
//! expected) to take, but a model can grow once loaded (a leak, a cache
//! filling up) and push the models together past `memory_budget`. While a
//! budget is set, once a second the supervisor compares what its workers
//! hold with it (the heartbeats' readings) and evicts idle models, least
//! recently used first, until they fit. If no model is idle it says so in
//! the log (at most once a minute), and new loads wait, naming what holds
//! the memory, until some comes back (admission decides that from the same
//! figures). A model that alone outgrows what it may hold is what
//! `memory_limit` and `max_rss` are for.
//!
//! **VRAM** (the decision is `gpu::overrun`'s; this carries it out).
//! Admission plans a load with what the model is expected to take, which
//! for a first load of unknown size can be far less than it takes. So:
//!
//! - after every load (a swap's, a recycle's and a restart's too), before
//!   the worker takes a request, what NVML shows berth's workers holding on
//!   its GPUs is compared with `gpu_memory_budget`: idle models there are
//!   evicted, least recently used first, until it fits; with nothing idle
//!   to evict, the newcomer is stopped and its load fails with
//!   `gpu_memory_budget_exceeded`, naming the figures (and its measured
//!   size plans its next load);
//! - once a second, beside the memory budget's check, while a budget is
//!   set, the same comparison runs for every GPU: a model that grew past
//!   the budget (a cache filling, a leak, a server that preallocates as it
//!   warms up) has its idle neighbours evicted; with none idle it is said
//!   once a minute, in the log and as an event.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::admission::Why;
use super::room::{gpu_holders, room};
use super::{EventKind, Inner, Supervisor};
use crate::child::handle::WorkerHandle;
use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::gpu;
use crate::units::mib;

/// How often the budget is checked.
const EVERY: Duration = Duration::from_secs(1);
/// The most often "over the budget, nothing idle" is logged.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// Once a second while the supervisor lives: the memory budget and the
/// per-GPU budget, whichever are set then.
pub(super) async fn budget_watch(inner: Weak<Inner>) {
    let mut ticker = tokio::time::interval(EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let (mut warned_ram, mut warned_gpu): (Option<Instant>, Option<Instant>) = (None, None);
    loop {
        ticker.tick().await;
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let supervisor = Supervisor { inner: strong };
        if supervisor.is_shutting_down() {
            return;
        }
        // Read at each check: a reload may set or change them.
        let config = supervisor.config();
        let (ram, gpu) = (config.memory_budget, config.gpu_memory_budget);
        if let Some(budget) = ram {
            ram_step(&supervisor, budget, &mut warned_ram).await;
        }
        if let Some(budget) = gpu {
            gpu_step(&supervisor, budget, &mut warned_gpu).await;
        }
    }
}

/// Whether a "nothing idle to evict" warning is due (at most once a
/// minute), noting it said now if so.
fn warn_due(warned: &mut Option<Instant>) -> bool {
    let due = warned.is_none_or(|at| at.elapsed() >= WARN_EVERY);
    if due {
        *warned = Some(Instant::now());
    }
    due
}

/// One check of the memory budget: evicts the least recently used idle
/// model while the workers hold more.
async fn ram_step(supervisor: &Supervisor, budget: u64, warned: &mut Option<Instant>) {
    let room = room(&supervisor.lock(), "");
    if room.used <= budget {
        return;
    }
    match room.lru_idle().map(|h| h.name.clone()) {
        Some(victim) => {
            tracing::warn!(
                victim,
                "loaded models hold {}, over the memory budget of {}; evicting the least \
                 recently used idle model",
                mib(room.used),
                mib(budget)
            );
            supervisor.evict(&victim, None).await;
        }
        None if warn_due(warned) => {
            tracing::warn!(
                "loaded models hold {}, over the memory budget of {}, and none is idle to \
                 evict; new loads are refused until memory comes back. Held by: {}",
                mib(room.used),
                mib(budget),
                room.holders().join(", ")
            );
        }
        None => {}
    }
}

/// Evictions one newcomer may cause before it is refused: each takes a
/// model away, so a handful is already a rare case; this bounds a loop
/// whose victims keep turning busy.
const MAX_EVICTIONS: usize = 16;

impl Supervisor {
    /// Makes the newly loaded `worker` of `model` fit the per-GPU budget
    /// on `gpus`, evicting idle models there; `Err` when it cannot (the
    /// caller stops the worker).
    pub(super) async fn fit_measured(
        &self,
        spec: &ModelSpec,
        worker: &Arc<WorkerHandle>,
        gpus: &[u32],
    ) -> Result<()> {
        let Some(budget) = self.config().gpu_memory_budget else {
            return Ok(());
        };
        let model = spec.name.as_str();
        for _ in 0..=MAX_EVICTIONS {
            // NVML is read outside the lock.
            let gpu::Inventory::Devices(devices) = gpu::inventory() else {
                return Ok(());
            };
            let newcomer = gpu::Holder {
                model: model.into(),
                pids: worker.pids(),
                gpus: gpus.to_vec(),
                reserved_bytes: spec.vram.unwrap_or(0),
                evictable: false,
                last_used: u64::MAX,
            };
            let holders = {
                let mut holders = gpu_holders(&self.lock(), model);
                holders.push(newcomer);
                holders
            };
            let Some(over) = gpu::overrun(&devices, budget, &holders, Some(gpus)) else {
                return Ok(());
            };
            let victim = match over.victim.clone() {
                Some(victim) if over.evicting_helps => victim,
                // Nothing is evicted for nothing: it does not fit even with
                // every idle model there gone (or none is idle).
                _ => {
                    let measured = gpu::process_vram(&devices, &worker.pids()).unwrap_or(0);
                    self.remember_vram(spec, measured / gpus.len().max(1) as u64);
                    return Err(Error::GpuBudgetExceeded {
                        model: model.into(),
                        needed: measured,
                        reason: format!(
                            "measured once loaded: {}; it does not fit even with every idle \
                             model there evicted, so it was stopped. Unload a model on that \
                             GPU, place this one elsewhere (`gpus`), or raise gpu_memory_budget",
                            over.describe()
                        ),
                    });
                }
            };
            tracing::info!(
                model,
                victim,
                "{}; evicting the least recently used idle model there",
                over.describe()
            );
            self.evict(&victim, Some(model)).await;
        }
        Err(Error::GpuBudgetExceeded {
            model: model.into(),
            needed: 0,
            reason: format!(
                "after {MAX_EVICTIONS} evictions its GPUs are still past gpu_memory_budget; \
                 it was stopped"
            ),
        })
    }

    /// What a worker of `spec` was measured to hold on each GPU, so its
    /// next load is planned with it (when the catalogue still holds the
    /// same model: a swap's refused newcomer is not the registered spec).
    fn remember_vram(&self, spec: &ModelSpec, per_gpu: u64) {
        let mut state = self.lock();
        if let Some(entry) = state.catalogue.get_mut(&spec.name).filter(|e| {
            e.spec.backend == spec.backend
                && e.spec.model == spec.model
                && e.spec.options == spec.options
        }) && per_gpu > 0
        {
            entry.last_vram_bytes = Some(per_gpu);
        }
    }

    /// Unloads idle `victim` to make room (for `for_model`, or for the
    /// budget itself), and says so.
    pub(super) async fn evict(&self, victim: &str, for_model: Option<&str>) {
        self.give_room(victim, for_model, "idle", None).await;
    }

    /// `victim` gives its room up for `model` (`why`): a busy one yields
    /// (no new request reaches it; those in flight finish), then goes.
    /// `sleep`: why a model that can sleep was stopped instead.
    pub(super) async fn evict_for(
        &self,
        victim: &str,
        model: &str,
        why: Why,
        sleep: Option<String>,
    ) {
        self.give_room(victim, Some(model), why.as_str(), sleep)
            .await;
    }

    /// Unloads `victim` (draining what it has in flight), said as an
    /// `evicted` event with its turn's length and requests; a model that
    /// cannot go now (swapped meanwhile) keeps its turn.
    pub(super) async fn give_room(
        &self,
        victim: &str,
        for_model: Option<&str>,
        reason: &str,
        sleep: Option<String>,
    ) {
        let turn = {
            let mut state = self.lock();
            let super::State {
                slots, catalogue, ..
            } = &mut *state;
            slots.get_mut(victim).map(|slot| {
                slot.yield_turn(for_model.unwrap_or_default());
                let served = catalogue
                    .get(victim)
                    .map(|e| {
                        e.counters
                            .requests
                            .load(std::sync::atomic::Ordering::Relaxed)
                    })
                    .unwrap_or(0)
                    .saturating_sub(slot.turn_requests);
                (slot.turn_started.elapsed().as_millis() as u64, served)
            })
        };
        self.inner.notify_changed();
        match self.unload(victim).await {
            Ok(report) => {
                tracing::info!("{report}");
                self.emit(EventKind::Evicted {
                    model: victim.into(),
                    for_model: for_model.map(Into::into),
                    reason: Some(reason.into()),
                    sleep,
                    ran_ms: turn.map(|t| t.0),
                    served: turn.map(|t| t.1),
                });
            }
            Err(e) => {
                if let Some(slot) = self.lock().slots.get_mut(victim) {
                    slot.keep_turn();
                }
                self.inner.notify_changed();
                tracing::info!(victim, "eviction skipped: {e}");
            }
        }
    }
}

/// One check of the per-GPU budget (once a second, from the budget watch):
/// idle models on a GPU where berth's workers hold more than the budget are
/// evicted, least recently used first.
async fn gpu_step(supervisor: &Supervisor, budget: u64, warned: &mut Option<Instant>) {
    // No NVML reading while no worker is on a GPU.
    let on_gpus = {
        let state = supervisor.lock();
        state
            .slots
            .values()
            .any(|s| !s.gpus.is_empty() || s.incoming_gpu.is_some())
            || state.retiring.values().any(|r| !r.gpus.is_empty())
    };
    if !on_gpus {
        return;
    }
    let gpu::Inventory::Devices(devices) = gpu::inventory() else {
        return;
    };
    let holders = gpu_holders(&supervisor.lock(), "");
    let Some(over) = gpu::overrun(&devices, budget, &holders, None) else {
        return;
    };
    match over.victim.clone() {
        Some(victim) => {
            tracing::warn!(
                victim,
                "{}; evicting the least recently used idle model there",
                over.describe()
            );
            supervisor.evict(&victim, None).await;
        }
        None if warn_due(warned) => {
            let message = format!(
                "{}, and none of them is idle to evict; new loads there are refused until \
                 memory comes back",
                over.describe()
            );
            tracing::warn!("{message}");
            supervisor.emit(EventKind::GpuBudgetOverrun {
                gpu: over.device,
                held_bytes: over.held,
                budget_bytes: over.budget,
                message,
            });
        }
        None => {}
    }
}
