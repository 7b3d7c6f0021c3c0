//! Memory over time: one sample a second, per model and for the host, the
//! last [`SAMPLES`] of each (17 minutes), for the console's charts and for
//! scripts (`GET /api/history`, `Supervisor::history`).
//!
//! A sample reads nothing new from the workers: their resident size is the
//! one the heartbeat read (each second by default, from `statm`), their
//! PSS the one last taken (at load, by `ps` or a metrics scrape), their
//! VRAM NVML's where a model has GPUs. The host's sample is one read of
//! two fields of `/proc/meminfo`. It ticks on the heartbeats' grid, so the
//! runtime wakes once a second for both. So the sampler costs a lock and a
//! few copies a second, watched or not (64 idle workers' supervisor CPU
//! with and without it: within the spread, docs/performance.md). Memory: ~56 bytes a sample, 56 KiB a model that has
//! been loaded since the supervisor started, and as much for the host.
//!
//! A load and an unload add samples of their own, from their reports, at
//! the moment they happen: a model loaded and unloaded between two ticks
//! still shows, and the drop at an unload is where it happened.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{EventKind, Inner, Supervisor};

/// Samples kept per model and for the host: 17 minutes at one a second.
pub const SAMPLES: usize = 1024;

/// How often the sampler runs.
pub const INTERVAL: Duration = Duration::from_secs(1);

/// A model at one moment. A model that is not loaded reads 0 bytes and no
/// pid (the moment its memory came back shows as the drop to 0).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ModelSample {
    pub at_unix_ms: u64,
    pub pid: Option<u32>,
    pub rss_bytes: u64,
    /// The last PSS taken (0 until one is).
    pub pss_bytes: u64,
    pub vram_bytes: Option<u64>,
    pub in_flight: u32,
    pub queued: usize,
}

/// The host at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostSample {
    pub at_unix_ms: u64,
    /// `MemAvailable`.
    pub available_bytes: u64,
    /// `AnonPages`, the system's anonymous memory.
    pub anon_bytes: u64,
    /// Every loaded model's worker RSS together.
    pub workers_rss_bytes: u64,
}

/// The samples after a moment.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct MemoryHistory {
    pub interval_ms: u64,
    pub host: Vec<HostSample>,
    pub models: BTreeMap<String, Vec<ModelSample>>,
}

#[derive(Default)]
pub(super) struct History {
    inner: Mutex<Kept>,
}

#[derive(Default)]
struct Kept {
    host: VecDeque<HostSample>,
    models: BTreeMap<String, VecDeque<ModelSample>>,
}

fn push<T>(ring: &mut VecDeque<T>, item: T) {
    if ring.len() == SAMPLES {
        ring.pop_front();
    }
    ring.push_back(item);
}

impl History {
    /// The samples a load or an unload adds: the load report's memory, or
    /// the memory at the stop and then nothing.
    pub(super) fn record(&self, what: &EventKind) {
        let now = crate::base::unix_ms();
        let points: Vec<(&String, ModelSample)> = match what {
            EventKind::Loaded { model, report } => vec![(
                model,
                ModelSample {
                    at_unix_ms: now,
                    pid: Some(report.pid),
                    rss_bytes: report.rss_bytes,
                    pss_bytes: report.pss_bytes,
                    vram_bytes: report.vram_bytes,
                    in_flight: 0,
                    queued: 0,
                },
            )],
            EventKind::Unloaded { model, report } => {
                let at_stop = ModelSample {
                    at_unix_ms: now.saturating_sub(1),
                    pid: Some(report.pid),
                    rss_bytes: report.rss_at_stop_bytes,
                    pss_bytes: 0,
                    vram_bytes: None,
                    in_flight: 0,
                    queued: 0,
                };
                let gone = ModelSample {
                    at_unix_ms: now,
                    pid: None,
                    rss_bytes: 0,
                    ..at_stop
                };
                vec![(model, at_stop), (model, gone)]
            }
            _ => return,
        };
        let mut kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        for (model, sample) in points {
            push(kept.models.entry(model.clone()).or_default(), sample);
        }
    }

    /// The samples taken after `since_ms` (0: all kept).
    pub(super) fn after(&self, since_ms: u64) -> MemoryHistory {
        let kept = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let newer = |at: u64| at > since_ms;
        MemoryHistory {
            interval_ms: INTERVAL.as_millis() as u64,
            host: kept
                .host
                .iter()
                .filter(|s| newer(s.at_unix_ms))
                .copied()
                .collect(),
            models: kept
                .models
                .iter()
                .map(|(name, samples)| {
                    let s = samples
                        .iter()
                        .filter(|s| newer(s.at_unix_ms))
                        .copied()
                        .collect();
                    (name.clone(), s)
                })
                .collect(),
        }
    }
}

/// Takes a sample a second until the supervisor is gone, on the
/// heartbeats' grid: with the default heartbeat interval (1 s) the runtime
/// wakes once a second for both, not twice.
pub(super) async fn sampler(inner: Weak<Inner>) {
    let start = crate::child::health::aligned(INTERVAL);
    let mut tick = tokio::time::interval_at(start, INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        sample(&Supervisor { inner });
    }
}

fn sample(supervisor: &Supervisor) {
    let at_unix_ms = crate::base::unix_ms();
    let rows: Vec<(
        String,
        Option<Arc<crate::child::handle::WorkerHandle>>,
        usize,
        bool,
    )> = {
        let state = supervisor.lock();
        state
            .catalogue
            .iter()
            .map(|(name, entry)| {
                let slot = state.slots.get(name);
                (
                    name.clone(),
                    slot.and_then(|s| s.worker.clone()),
                    entry.queued.load(Ordering::SeqCst),
                    slot.is_some_and(|s| !s.gpus.is_empty()),
                )
            })
            .collect()
    };
    // NVML only where a model is on a GPU.
    let inventory = rows.iter().any(|r| r.3).then(crate::gpu::inventory);
    let devices: &[crate::gpu::DeviceReading] = match &inventory {
        Some(crate::gpu::Inventory::Devices(d)) => d,
        _ => &[],
    };
    let system = crate::child::memory::system_memory();
    let mut workers_rss = 0;
    let history = &supervisor.inner.history;
    let mut kept = history.inner.lock().unwrap_or_else(|e| e.into_inner());
    // Deregistered models' lines go (a set: up to 1024 models a second).
    let registered: std::collections::BTreeSet<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    kept.models
        .retain(|name, _| registered.contains(name.as_str()));
    for (name, worker, queued, on_gpu) in &rows {
        let sample = match worker {
            Some(w) => {
                let memory = w.memory().last;
                workers_rss += memory.rss_bytes;
                ModelSample {
                    at_unix_ms,
                    pid: Some(w.pid()),
                    rss_bytes: memory.rss_bytes,
                    pss_bytes: memory.pss_bytes,
                    vram_bytes: if *on_gpu {
                        crate::gpu::process_vram(devices, &w.pids())
                    } else {
                        None
                    },
                    in_flight: w.in_flight(),
                    queued: *queued,
                }
            }
            // Never loaded since the start: nothing to draw yet.
            None if !kept.models.contains_key(name) => continue,
            None => ModelSample {
                at_unix_ms,
                pid: None,
                rss_bytes: 0,
                pss_bytes: 0,
                vram_bytes: None,
                in_flight: 0,
                queued: *queued,
            },
        };
        push(kept.models.entry(name.clone()).or_default(), sample);
    }
    push(
        &mut kept.host,
        HostSample {
            at_unix_ms,
            available_bytes: system.available_bytes,
            anon_bytes: system.anon_bytes,
            workers_rss_bytes: workers_rss,
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rings_keep_the_last_samples_and_after_filters_by_time() {
        let history = History::default();
        {
            let mut kept = history.inner.lock().unwrap();
            for i in 0..SAMPLES as u64 + 10 {
                push(
                    &mut kept.host,
                    HostSample {
                        at_unix_ms: i,
                        available_bytes: i,
                        anon_bytes: 0,
                        workers_rss_bytes: 0,
                    },
                );
            }
        }
        let all = history.after(0);
        assert_eq!(all.host.len(), SAMPLES);
        assert_eq!(all.host[0].at_unix_ms, 10);
        let recent = history.after(SAMPLES as u64 + 7);
        assert_eq!(
            recent.host.iter().map(|s| s.at_unix_ms).collect::<Vec<_>>(),
            [SAMPLES as u64 + 8, SAMPLES as u64 + 9]
        );
    }
}
