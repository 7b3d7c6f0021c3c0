//! Making room for a new worker: the memory budget, `max_loaded` and the
//! per-GPU VRAM budget, by evicting idle models least recently used first.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::slot::{Entry, Slot, slot_state};
use super::{ModelState, State, Supervisor};
use crate::config::ModelSpec;
use crate::error::{Error, Result};
use crate::gpu;
use crate::units::mib;

impl Supervisor {
    /// Evicts idle models, least recently used first, until the new worker
    /// fits the memory budget, `max_loaded` and (for a model on GPUs) the
    /// per-GPU VRAM budget; returns the GPUs it goes on. While a model that
    /// is being unloaded will free what is missing, waits for it rather
    /// than refuse. Called with the load gate held.
    pub(super) async fn make_room(&self, model: &str, need: &Need) -> Result<Option<Vec<u32>>> {
        let budget = self.inner.config.memory_budget;
        let max_loaded = self.inner.config.max_loaded;
        if let Some(budget) = budget
            && need.ram > budget
        {
            return Err(Error::BudgetExceeded {
                model: model.into(),
                needed: need.ram,
                reason: format!("more than the whole memory budget of {}", mib(budget)),
            });
        }
        // Long enough for a drain and a stop to finish.
        let room_wait = self.inner.config.drain_timeout + Duration::from_secs(10);
        let waiting_since = Instant::now();
        loop {
            self.check_running(model)?;
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
            let (fits, victim, freeing, holders, gpu_plan) = {
                let state = self.lock();
                let used: u64 = state
                    .slots
                    .values()
                    .map(|s| {
                        let rss = s
                            .worker
                            .as_ref()
                            .map(|w| w.memory().last.rss_bytes)
                            .unwrap_or(0);
                        rss + s.reserved_bytes
                    })
                    .chain(
                        state
                            .retiring
                            .values()
                            .map(|r| r.worker.memory().last.rss_bytes),
                    )
                    .sum();
                // A failed model holds nothing; a replaced one is counted once.
                let loaded = state
                    .slots
                    .values()
                    .filter(|s| s.worker.is_some() || s.loading.is_some())
                    .count();
                let fits = budget.is_none_or(|b| used + need.ram <= b)
                    && max_loaded.is_none_or(|m| {
                        if need.replacing {
                            loaded <= m
                        } else {
                            loaded < m
                        }
                    });
                let victim = state
                    .slots
                    .iter()
                    .filter(|(name, slot)| name.as_str() != model && evictable(&state, name, slot))
                    .min_by_key(|(_, slot)| slot.last_used)
                    .map(|(name, _)| name.clone());
                let freeing = !state.retiring.is_empty()
                    || state
                        .slots
                        .values()
                        .any(|s| matches!(s.state, ModelState::Draining | ModelState::Stopping));
                let holders: Vec<String> = state
                    .slots
                    .iter()
                    .map(|(name, s)| {
                        let rss = s
                            .worker
                            .as_ref()
                            .map(|w| w.memory().last.rss_bytes)
                            .unwrap_or(0)
                            + s.reserved_bytes;
                        let busy = s.worker.as_ref().map(|w| w.in_flight()).unwrap_or(0);
                        format!(
                            "`{name}` {} ({} in flight, {})",
                            mib(rss),
                            busy,
                            slot_state(s)
                        )
                    })
                    .collect();
                let gpu_plan = match (&need.gpu, &devices) {
                    (Some((request, vram)), Some(devices)) => Some(gpu::plan(
                        request,
                        devices,
                        *vram,
                        self.inner.config.gpu_memory_budget,
                        &gpu_holders(&state, model),
                    )),
                    _ => None,
                };
                (fits, victim, freeing, holders, gpu_plan)
            };
            // A GPU that cannot take the model even with every idle model
            // evicted is said before anything is evicted for RAM.
            let gpu_victim = match gpu_plan {
                None => None,
                Some(gpu::Plan::Invalid(reason)) => {
                    return Err(Error::InvalidSpec {
                        model: model.into(),
                        reason,
                    });
                }
                Some(gpu::Plan::Refuse(reason)) => {
                    if freeing && waiting_since.elapsed() < room_wait {
                        let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
                        continue;
                    }
                    return Err(Error::GpuBudgetExceeded {
                        model: model.into(),
                        needed: need.vram(),
                        reason,
                    });
                }
                Some(gpu::Plan::Place(gpus)) if fits => return Ok(Some(gpus)),
                Some(gpu::Plan::Place(_)) => None,
                Some(gpu::Plan::Evict(victim)) => Some(victim),
            };
            if fits && need.gpu.is_none() {
                return Ok(None);
            }
            // RAM first (any idle model helps there); then the GPU's pick.
            let victim = if fits { gpu_victim } else { victim };
            match victim {
                Some(victim) => {
                    tracing::info!(
                        model,
                        victim,
                        "evicting the least recently used idle model to make room"
                    );
                    match self.unload(&victim).await {
                        Ok(report) => tracing::info!("{report}"),
                        Err(e) => tracing::warn!(victim, "eviction failed: {e}"),
                    }
                }
                None if freeing && waiting_since.elapsed() < room_wait => {
                    // A model being unloaded will give its memory back.
                    let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
                }
                None => {
                    let limits = match (budget, max_loaded) {
                        (Some(b), Some(m)) => {
                            format!("the memory budget of {} and max_loaded {m}", mib(b))
                        }
                        (Some(b), None) => format!("the memory budget of {}", mib(b)),
                        (None, Some(m)) => format!("max_loaded {m}"),
                        (None, None) => "the limits".into(),
                    };
                    return Err(Error::BudgetExceeded {
                        model: model.into(),
                        needed: need.ram,
                        reason: format!(
                            "which does not fit {limits}, and no idle model can be evicted; held by: {}",
                            holders.join(", ")
                        ),
                    });
                }
            }
        }
    }
}

/// What a new worker needs room for.
#[derive(Debug, Clone)]
pub(super) struct Need {
    /// RAM to count for it while it loads.
    pub(super) ram: u64,
    /// It replaces the model's current worker (swap, recycle, restart),
    /// which already counts toward `max_loaded`.
    pub(super) replacing: bool,
    /// Its GPU request and the VRAM it is expected to take on each device.
    pub(super) gpu: Option<(gpu::GpuRequest, u64)>,
}

impl Need {
    /// Sized from what the model's last worker measured when it ran the
    /// same thing, else from the weights on disk.
    pub(super) fn new(spec: &ModelSpec, entry: Option<&Entry>, replacing: bool) -> Need {
        let same = entry.filter(|e| {
            e.spec.backend == spec.backend
                && e.spec.model == spec.model
                && e.spec.options == spec.options
        });
        let disk = footprint_on_disk(spec);
        Need {
            ram: same.and_then(|e| e.last_peak_bytes).unwrap_or(disk),
            replacing,
            gpu: spec.gpus.clone().map(|request| {
                (
                    request,
                    same.and_then(|e| e.last_vram_bytes).unwrap_or(disk),
                )
            }),
        }
    }

    pub(super) fn vram(&self) -> u64 {
        self.gpu.as_ref().map(|(_, vram)| *vram).unwrap_or(0)
    }
}

/// Whether eviction may stop this model: ready, idle, nothing queued, not
/// being replaced.
pub(super) fn evictable(state: &State, name: &str, slot: &Slot) -> bool {
    slot.state == ModelState::Ready
        && !slot.swapping
        && slot.worker.as_ref().is_some_and(|w| w.in_flight() == 0)
        && state
            .catalogue
            .get(name)
            .is_none_or(|e| e.queued.load(Ordering::SeqCst) == 0)
}

/// berth's workers and loads in progress as GPU placement sees them;
/// `model` itself (being replaced) is never a candidate for eviction, and
/// its own reservation (a retried restart's) is not counted against it.
pub(super) fn gpu_holders(state: &State, model: &str) -> Vec<gpu::Holder> {
    let mut holders: Vec<gpu::Holder> = state
        .retiring
        .values()
        .map(|r| gpu::Holder {
            model: r.model.clone(),
            pid: Some(r.worker.pid()),
            gpus: r.gpus.clone(),
            reserved_bytes: 0,
            evictable: false,
            last_used: 0,
        })
        .collect();
    for (name, slot) in &state.slots {
        // Larger is more recent.
        let last_used = u64::MAX - slot.last_used.elapsed().as_micros() as u64;
        if let Some(worker) = &slot.worker {
            holders.push(gpu::Holder {
                model: name.clone(),
                pid: Some(worker.pid()),
                gpus: slot.gpus.clone(),
                reserved_bytes: 0,
                evictable: name != model && evictable(state, name, slot),
                last_used,
            });
        }
        if let Some(incoming) = slot.incoming_gpu.as_ref().filter(|_| name != model) {
            holders.push(gpu::Holder {
                model: name.clone(),
                pid: incoming.pid,
                gpus: incoming.gpus.clone(),
                reserved_bytes: incoming.vram,
                evictable: false,
                last_used,
            });
        }
    }
    holders
}

pub(super) fn footprint_on_disk(spec: &ModelSpec) -> u64 {
    pub(super) fn size(path: &std::path::Path) -> u64 {
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => std::fs::read_dir(path)
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .map(|e| size(&e.path()))
                        .sum()
                })
                .unwrap_or(0),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    spec.model.as_deref().map(size).unwrap_or(0)
}
