//! The per-GPU VRAM budget once loads are measured (the decision is
//! `gpu::overrun`'s; this carries it out). Admission plans a load with
//! what the model is expected to take, which for a first load of unknown
//! size can be far less than it takes. So:
//!
//! - after every load (a swap's, a recycle's and a restart's too), before
//!   the worker takes a request, what NVML shows berth's workers holding on
//!   its GPUs is compared with `gpu_memory_budget`: idle models there are
//!   evicted, least recently used first, until it fits; with nothing idle
//!   to evict, the newcomer is stopped and its load fails with
//!   `gpu_memory_budget_exceeded`, naming the figures (and its measured
//!   size plans its next load);
//! - once a second (`budget.rs`'s watch, beside the memory budget's),
//!   while a budget is set, the same comparison runs for every GPU: a model that grew past the budget (a cache filling, a
//!   leak, a server that preallocates as it warms up) has its idle
//!   neighbours evicted; with none idle it is said once a minute, in the
//!   log and as an event.

use std::sync::Arc;
use std::time::Instant;

use super::admission::gpu_holders;
use super::{EventKind, Supervisor};
use crate::child::handle::WorkerHandle;
use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::gpu;

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
        match self.unload(victim).await {
            Ok(report) => {
                tracing::info!("{report}");
                self.emit(EventKind::Evicted {
                    model: victim.into(),
                    for_model: for_model.map(Into::into),
                });
            }
            Err(e) => tracing::info!(victim, "eviction skipped: {e}"),
        }
    }
}

/// One check of the per-GPU budget (once a second, from the budget watch):
/// idle models on a GPU where berth's workers hold more than the budget are
/// evicted, least recently used first.
pub(super) async fn gpu_step(supervisor: &Supervisor, budget: u64, warned: &mut Option<Instant>) {
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
        None if super::budget::warn_due(warned) => {
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
