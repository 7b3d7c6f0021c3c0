//! A model's slot: the state a loaded (or loading) model is in, and the
//! catalogue entry that outlives its workers.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, watch};

use super::resilience;
use super::{DEFAULT_MAX_CONCURRENCY, ModelCounters, ModelState, Need};
use crate::child::handle::WorkerHandle;
use crate::config::ModelSpec;
use crate::error::Error;
use crate::report::LoadReport;

pub(super) type LoadSignal = watch::Receiver<Option<std::result::Result<(), Arc<Error>>>>;

impl Slot {
    pub(super) fn loading(
        signal: LoadSignal,
        reserved_bytes: u64,
        incoming_gpu: Option<Incoming>,
    ) -> Slot {
        Slot {
            state: ModelState::Loading,
            worker: None,
            loading: Some(signal),
            reserved_bytes,
            gpus: Vec::new(),
            incoming_gpu,
            last_used: Instant::now(),
            expires_at: None,
            swapping: false,
            hold: false,
            restart_at: None,
            failure: None,
        }
    }
}

pub(super) struct Slot {
    pub(super) state: ModelState,
    pub(super) worker: Option<Arc<WorkerHandle>>,
    /// Set while loading: callers wait on it instead of loading again.
    pub(super) loading: Option<LoadSignal>,
    /// Memory counted for a worker still loading (a load, a restart, or
    /// the new side of a swap), on top of what the current worker holds.
    pub(super) reserved_bytes: u64,
    /// The GPUs the current worker was placed on.
    pub(super) gpus: Vec<u32>,
    /// What a worker still loading has been counted for on the GPUs.
    pub(super) incoming_gpu: Option<Incoming>,
    pub(super) last_used: Instant,
    /// When an idle model is unloaded; `None`: never.
    pub(super) expires_at: Option<Instant>,
    /// Set while a swap or recycle is in progress.
    pub(super) swapping: bool,
    /// Set when the worker crossed `max_rss` before its replacement was
    /// ready: new requests wait for the replacement.
    pub(super) hold: bool,
    /// While a crashed model waits out its backoff: when it restarts.
    pub(super) restart_at: Option<Instant>,
    /// Why the model failed (state `Failed`, no worker).
    pub(super) failure: Option<String>,
}

/// GPU placement of a worker still loading, counted until it is in.
#[derive(Debug, Clone)]
pub(super) struct Incoming {
    pub(super) gpus: Vec<u32>,
    /// VRAM expected on each of `gpus`.
    pub(super) vram: u64,
    /// Its pid once spawned, so NVML's reading for it is not counted twice.
    pub(super) pid: Option<u32>,
}

impl Incoming {
    pub(super) fn new(gpus: Option<Vec<u32>>, need: &Need) -> Option<Incoming> {
        gpus.map(|gpus| Incoming {
            gpus,
            vram: need.vram(),
            pid: None,
        })
    }
}

pub(super) struct Entry {
    pub(super) spec: ModelSpec,
    pub(super) last_peak_bytes: Option<u64>,
    /// VRAM its last worker held on each of its GPUs once loaded, as NVML
    /// saw it.
    pub(super) last_vram_bytes: Option<u64>,
    pub(super) permits: Arc<Semaphore>,
    pub(super) queued: Arc<AtomicUsize>,
    pub(super) keep_alive: Option<Duration>,
    pub(super) counters: Arc<ModelCounters>,
    /// Crash restarts and what the last unexpected exit was.
    pub(super) health: resilience::CrashHistory,
}

impl Entry {
    pub(super) fn new(spec: ModelSpec, default_keep_alive: Option<Duration>) -> Self {
        let concurrency = spec.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY);
        Entry {
            keep_alive: spec.keep_alive.or(default_keep_alive),
            spec,
            last_peak_bytes: None,
            last_vram_bytes: None,
            permits: Arc::new(Semaphore::new(concurrency)),
            queued: Arc::default(),
            counters: Arc::default(),
            health: resilience::CrashHistory::default(),
        }
    }
}

pub(super) fn slot_state(slot: &Slot) -> ModelState {
    match &slot.worker {
        Some(w) if !w.is_alive() && slot.state == ModelState::Ready => ModelState::Failed,
        _ => slot.state,
    }
}

/// Puts a freshly loaded worker into its slot (a load or a restart) and
/// records what its load measured.
pub(super) fn install(
    slot: &mut Slot,
    entry: Option<&mut Entry>,
    worker: &Arc<WorkerHandle>,
    report: &LoadReport,
) {
    slot.state = ModelState::Ready;
    slot.worker = Some(Arc::clone(worker));
    slot.loading = None;
    slot.reserved_bytes = 0;
    slot.gpus = report.gpus.clone().unwrap_or_default();
    slot.incoming_gpu = None;
    if let Some(entry) = entry {
        entry.last_peak_bytes = Some(report.peak_rss_bytes);
        entry.last_vram_bytes = vram_per_gpu(report).or(entry.last_vram_bytes);
        entry.counters.loads.fetch_add(1, Ordering::Relaxed);
        slot.expires_at = expiry(entry.keep_alive);
    }
}

/// When a keep-alive that starts now runs out; `None` (never) for none, or
/// for one too long for the clock (specs are range-checked, but a host's
/// own `RequestOptions` need not be).
pub(super) fn expiry(keep_alive: Option<Duration>) -> Option<Instant> {
    keep_alive.and_then(|k| Instant::now().checked_add(k))
}

/// VRAM a load report shows on each of the worker's GPUs.
pub(super) fn vram_per_gpu(report: &LoadReport) -> Option<u64> {
    let gpus = report.gpus.as_ref().map_or(1, |g| g.len().max(1)) as u64;
    report.vram_bytes.map(|bytes| bytes / gpus)
}
