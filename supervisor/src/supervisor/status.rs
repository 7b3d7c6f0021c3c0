//! Status views: `ps` rows with memory readings taken outside the state
//! lock, GPU views naming berth's workers, counters for metrics.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{BatchingStatus, ModelCounters, ModelStatus, Supervisor};
use crate::child::handle::WorkerHandle;

impl Supervisor {
    /// Every loaded (or loading) model, with memory readings at most a
    /// second old (the heartbeat's, or read now).
    pub fn stats(&self) -> Vec<ModelStatus> {
        self.stats_on(&crate::gpu::inventory())
    }

    /// [`Supervisor::stats`] with VRAM read from `inventory`, so one NVML
    /// reading can serve several views (a metrics scrape).
    pub(crate) fn stats_on(&self, inventory: &crate::gpu::Inventory) -> Vec<ModelStatus> {
        let devices: &[crate::gpu::DeviceReading] = match inventory {
            crate::gpu::Inventory::Devices(devices) => devices,
            crate::gpu::Inventory::NoGpu(_) => &[],
        };
        // What the state holds is copied under the lock; procfs is read
        // after it is released, so a status poll never holds up a request.
        let rows: Vec<(ModelStatus, Option<Arc<WorkerHandle>>)> = {
            let state = self.lock();
            let now = Instant::now();
            state
                .slots
                .iter()
                .map(|(name, slot)| {
                    let entry = state.catalogue.get(name);
                    let worker = slot.worker.clone();
                    let status = ModelStatus {
                        name: name.clone(),
                        backend: entry.map(|e| e.spec.backend.clone()).unwrap_or_default(),
                        state: slot.state(),
                        pid: worker.as_ref().map(|w| w.pid()),
                        rss_bytes: 0,
                        pss_bytes: 0,
                        private_bytes: 0,
                        shared_bytes: 0,
                        peak_rss_bytes: 0,
                        start: worker.as_ref().map(|w| w.process().start_kind().clone()),
                        uptime_s: 0.0,
                        requests: 0,
                        in_flight: 0,
                        queued: entry.map(|e| e.queued.load(Ordering::SeqCst)).unwrap_or(0),
                        waiting: entry
                            .map(|e| e.awaiting_load.load(Ordering::SeqCst))
                            .unwrap_or(0),
                        queue_position: None,
                        keep_alive_left_s: slot
                            .expires_at
                            .map(|t| t.saturating_duration_since(now).as_secs_f64()),
                        restarts: entry
                            .map(|e| e.counters.restarts.load(Ordering::Relaxed))
                            .unwrap_or(0),
                        recycles: entry
                            .map(|e| e.counters.recycles.load(Ordering::Relaxed))
                            .unwrap_or(0),
                        last_exit: entry.and_then(|e| e.health.last_exit.clone()),
                        rss_growth_per_request_bytes: 0.0,
                        vram_bytes: None,
                        gpus: slot.gpus.clone(),
                        batching: entry
                            .map(|e| BatchingStatus::of(&e.counters))
                            .unwrap_or_default(),
                        stderr_tail: Vec::new(),
                        warnings: Vec::new(),
                    };
                    (status, worker)
                })
                .collect()
        };
        let mut out: Vec<ModelStatus> = rows
            .into_iter()
            .map(|(mut status, worker)| {
                if let Some(w) = worker {
                    // At most one full procfs reading per worker a second,
                    // however many clients poll, and none when nobody asks
                    // (heartbeats read only the resident size).
                    let memory = w.recent_memory(Duration::from_secs(1)).unwrap_or_default();
                    status.rss_bytes = memory.rss_bytes;
                    status.pss_bytes = memory.pss_bytes;
                    status.private_bytes = memory.private_bytes;
                    status.shared_bytes = memory.shared_bytes;
                    status.peak_rss_bytes = memory.peak_rss_bytes;
                    status.uptime_s = w.uptime().as_secs_f64();
                    status.requests = w.requests();
                    status.in_flight = w.in_flight();
                    status.rss_growth_per_request_bytes = w.rss_growth_per_request();
                    status.vram_bytes = crate::gpu::process_vram(devices, &w.pids());
                    status.stderr_tail = w.process().stderr_lines();
                    // Read from the same NVML reading: it clears once the
                    // worker allocates (a framework that starts lazily).
                    if let Some(why) = w.upstream_server().and_then(|u| u.outside()) {
                        status
                            .warnings
                            .push(crate::report::Warning::memory_elsewhere(why));
                    }
                    if status.state == super::ModelState::Ready && !devices.is_empty() {
                        status.warnings.extend(crate::report::Warning::gpu_unused(
                            Some(&status.gpus),
                            status.vram_bytes,
                        ));
                    }
                }
                status
            })
            .collect();
        // Models whose load waits in the machine's queue have no slot yet.
        for (name, place) in self.inner.queue.places() {
            if let Some(row) = out.iter_mut().find(|s| s.name == name) {
                row.queue_position = Some(place);
                continue;
            }
            let state = self.lock();
            let Some(entry) = state.catalogue.get(&name) else {
                continue;
            };
            out.push(queued_row(&name, entry, place));
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Each GPU's memory, with berth's workers on it named (a worker being
    /// replaced is named too). Reads NVML; creates no CUDA context.
    pub fn gpus(&self) -> crate::gpu::GpuStatus {
        self.gpus_on(crate::gpu::inventory())
    }

    /// [`Supervisor::gpus`] from an NVML reading already taken.
    pub(crate) fn gpus_on(&self, inventory: crate::gpu::Inventory) -> crate::gpu::GpuStatus {
        let workers: Vec<(u32, String)> = {
            let state = self.lock();
            state
                .slots
                .iter()
                .filter_map(|(name, slot)| slot.worker.as_ref().map(|w| (w, name)))
                .chain(state.retiring.values().map(|r| (&r.worker, &r.model)))
                .flat_map(|(w, name)| w.pids().into_iter().map(move |pid| (pid, name.clone())))
                .collect()
        };
        crate::gpu::GpuStatus::new(inventory, &workers)
    }

    /// Counters per registered model, for metrics.
    pub fn counters(&self) -> Vec<(String, Arc<ModelCounters>)> {
        self.lock()
            .catalogue
            .iter()
            .map(|(n, e)| (n.clone(), Arc::clone(&e.counters)))
            .collect()
    }
}

/// A model with no worker whose load waits in the machine's queue at
/// `place` (0: making room now).
fn queued_row(name: &str, entry: &super::slot::Entry, place: usize) -> ModelStatus {
    use std::sync::atomic::Ordering;
    ModelStatus {
        name: name.to_string(),
        backend: entry.spec.backend.clone(),
        state: super::ModelState::Queued,
        pid: None,
        rss_bytes: 0,
        pss_bytes: 0,
        private_bytes: 0,
        shared_bytes: 0,
        peak_rss_bytes: 0,
        start: None,
        uptime_s: 0.0,
        requests: 0,
        in_flight: 0,
        queued: entry.queued.load(Ordering::SeqCst),
        waiting: entry.awaiting_load.load(Ordering::SeqCst),
        queue_position: Some(place),
        keep_alive_left_s: None,
        restarts: entry.counters.restarts.load(Ordering::Relaxed),
        recycles: entry.counters.recycles.load(Ordering::Relaxed),
        last_exit: entry.health.last_exit.clone(),
        rss_growth_per_request_bytes: 0.0,
        vram_bytes: None,
        gpus: Vec::new(),
        batching: BatchingStatus::of(&entry.counters),
        stderr_tail: Vec::new(),
        warnings: Vec::new(),
    }
}
