//! What a scheduler in front of several berths reads to choose one for a
//! request: how many requests wait and run, how full the budgets are, and
//! which models are warm or on their way. An inference gateway's endpoint
//! picker reads it from `/metrics` in the shapes of its Model Server
//! Protocol (`server/metrics.rs`); an embedding host may read it here.

use serde::Serialize;
use std::sync::atomic::Ordering;

use super::room::{gpu_holders, room};
use super::{ModelState, Supervisor};
use crate::gpu::{self, Inventory};

/// One reading of [`Supervisor::occupancy_on`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Occupancy {
    /// Requests berth holds that no worker has yet: queued for a
    /// concurrency slot, or waiting for their model to load. All models.
    pub waiting: usize,
    /// Requests inside workers (or relayed to their servers), those of
    /// workers a swap is draining included.
    pub running: usize,
    /// Models loaded and ready, by name.
    pub ready: Vec<String>,
    /// Models loading, or with requests waiting for a load that has not
    /// begun (a restart's backoff, room being made).
    pub loading: Vec<String>,
    /// Models that may be loaded at once: `max_loaded`, or without it the
    /// number registered (no more can be).
    pub max_loaded: usize,
    /// How full the fullest of the budgets is, 0 to 1 (1: full, or past
    /// it): the memory budget, the per-GPU VRAM budget, and `max_loaded`
    /// (where fewer may be loaded than are registered), those that are set;
    /// with none set, the host's memory in use (the machine's, also inside
    /// a container). What a next load would have to evict for.
    pub budget_usage: f64,
    /// When a model last changed state, or the config was replaced, in
    /// seconds since the Unix epoch.
    pub changed_at: f64,
}

impl Supervisor {
    /// Reads the occupancy, with `inventory` as the GPUs' reading (one
    /// NVML reading serves a whole `/metrics` answer). The state is copied
    /// under the lock; nothing slow is done under it.
    pub fn occupancy_on(&self, inventory: &Inventory) -> Occupancy {
        let config = self.config();
        let state = self.lock();
        let mut waiting = 0;
        let mut ready = Vec::new();
        let mut loading = Vec::new();
        for (name, entry) in &state.catalogue {
            let awaiting = entry.awaiting_load.load(Ordering::SeqCst);
            waiting += entry.queued.load(Ordering::SeqCst) + awaiting;
            match state.slots.get(name).map(|slot| slot.state()) {
                Some(ModelState::Ready) => ready.push(name.clone()),
                Some(ModelState::Loading) => loading.push(name.clone()),
                _ if awaiting > 0 => loading.push(name.clone()),
                _ => {}
            }
        }
        let running = state
            .slots
            .values()
            .filter_map(|slot| slot.worker.as_ref())
            .chain(state.retiring.values().map(|r| &r.worker))
            .map(|worker| worker.in_flight() as usize)
            .sum();
        let registered = state.catalogue.len();
        let room = room(&state, "");
        let holders = config
            .gpu_memory_budget
            .is_some()
            .then(|| gpu_holders(&state, ""));
        drop(state);
        let mut fullest: Option<f64> = None;
        let mut count = |fraction: f64| {
            fullest = Some(fullest.map_or(fraction, |f| f.max(fraction)));
        };
        if let Some(budget) = config.memory_budget {
            count(room.used as f64 / budget.max(1) as f64);
        }
        // Only where it can make a load evict: with every registered model
        // loaded under it, nothing is left to load.
        if let Some(max) = config.max_loaded.filter(|max| *max < registered) {
            count(room.loaded as f64 / max.max(1) as f64);
        }
        if let (Some(budget), Some(holders)) = (config.gpu_memory_budget, holders) {
            let devices = match inventory {
                Inventory::Devices(devices) => devices.as_slice(),
                Inventory::NoGpu(_) => &[],
            };
            count(gpu::fullest(devices, budget, &holders));
        }
        let budget_usage = fullest.unwrap_or_else(|| {
            let host = crate::child::memory::system_memory();
            match host.total_bytes {
                0 => 0.0, // no /proc/meminfo to read
                total => 1.0 - host.available_bytes as f64 / total as f64,
            }
        });
        Occupancy {
            waiting,
            running,
            ready,
            loading,
            max_loaded: config.max_loaded.unwrap_or(registered),
            budget_usage: budget_usage.clamp(0.0, 1.0),
            changed_at: self.inner.changed_at.load(Ordering::Relaxed) as f64 / 1e3,
        }
    }
}
