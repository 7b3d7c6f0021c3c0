//! What the supervisor shows of its models: states, `ps` rows, catalogue
//! entries, swap reports, and the options a request may carry.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ModelSpec;
use crate::report::{LoadReport, UnloadReport};

use super::LastExit;

/// Where a model is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelState {
    /// Registered, no worker.
    Unloaded,
    /// Requests wait for it, and its load waits in the machine's queue for
    /// room (or makes room now): `ps` shows its place.
    Queued,
    /// The worker process is starting or loading the model.
    Loading,
    Ready,
    /// No new requests; in-flight ones finish.
    Draining,
    Stopping,
    /// Its worker lives, its GPU memory moved to its host memory (`sleep`):
    /// a request wakes it, and waits as for a load.
    Asleep,
    /// The worker died on its own; requests fail until it is loaded again.
    /// A worker that has only just died shows this, with its pid, for the
    /// moment before the crash policy restarts it (`loading`) or gives up
    /// (`failed`, no pid).
    Failed,
}

impl fmt::Display for ModelState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModelState::Unloaded => "unloaded",
            ModelState::Queued => "queued",
            ModelState::Loading => "loading",
            ModelState::Ready => "ready",
            ModelState::Draining => "draining",
            ModelState::Stopping => "stopping",
            ModelState::Asleep => "asleep",
            ModelState::Failed => "failed",
        })
    }
}

/// A loaded (or loading) model, as `ps` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStatus {
    pub name: String,
    pub backend: String,
    pub state: ModelState,
    pub pid: Option<u32>,
    pub rss_bytes: u64,
    pub pss_bytes: u64,
    /// Of the RSS, pages only the worker maps (what its exit gives back),
    /// and pages it shares (with the preloader it was forked from, if it was).
    #[serde(default)]
    pub private_bytes: u64,
    #[serde(default)]
    pub shared_bytes: u64,
    pub peak_rss_bytes: u64,
    /// How its worker began: cold, or forked from its kind's preloader.
    #[serde(default)]
    pub start: Option<crate::report::WorkerStart>,
    pub uptime_s: f64,
    pub requests: u64,
    pub in_flight: u32,
    /// Requests waiting for a concurrency slot.
    pub queued: usize,
    /// Requests waiting for its load or its turn (past their concurrency
    /// slot).
    #[serde(default)]
    pub waiting: usize,
    /// Its load's place in the machine's queue: 1 is next, 0 is making
    /// room now; `None` when its load waits for nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_position: Option<usize>,
    /// Seconds until an idle model is unloaded; `None`: never.
    pub keep_alive_left_s: Option<f64>,
    /// Crash restarts of this model.
    pub restarts: u64,
    /// Workers replaced for crossing `max_rss` or `max_requests`.
    pub recycles: u64,
    /// The last unexpected exit: cause and stderr tail.
    pub last_exit: Option<LastExit>,
    /// Resident memory growth per request since load: a leak shows here
    /// before it matters.
    pub rss_growth_per_request_bytes: f64,
    /// Device memory the worker holds (NVML, per process); `None` without a GPU.
    pub vram_bytes: Option<u64>,
    /// The GPUs (NVML indices) the worker was placed on; empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    /// How requests ran, since the model was registered: batch sizes and
    /// the split of their time into queueing and compute.
    #[serde(default)]
    pub batching: BatchingStatus,
    /// The worker's last stderr lines (at most 20), as the supervisor kept
    /// them for its death report.
    #[serde(default)]
    pub stderr_tail: Vec<String>,
    /// What looks wrong about it now (a worker on a GPU holding no GPU
    /// memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<crate::report::Warning>,
}

/// Batch sizes and where requests' time went, as a model's workers reported
/// them (workers that do not report are not counted).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchingStatus {
    /// Requests counted.
    pub requests: u64,
    /// Requests by the size of the batch they ran in, as `[upper bound,
    /// count]` pairs (1, 2, 4, ... 128, then `null` for anything larger).
    pub batch_sizes: Vec<(Option<u32>, u64)>,
    pub mean_batch_size: Option<f64>,
    /// Mean time a request waited (for a slot, a load, its batch), and
    /// the mean time the backend spent on its batch, in milliseconds.
    pub mean_queue_ms: Option<f64>,
    pub mean_compute_ms: Option<f64>,
}

impl BatchingStatus {
    pub(crate) fn of(counters: &super::ModelCounters) -> Self {
        let batch = counters.batch.snapshot();
        let mut batch_sizes = Vec::new();
        let mut below = 0;
        for (bound, cumulative) in super::BATCH_BUCKETS.iter().zip(&batch.buckets) {
            batch_sizes.push((Some(*bound as u32), cumulative - below));
            below = *cumulative;
        }
        batch_sizes.push((None, batch.count - below));
        batch_sizes.retain(|(_, n)| *n > 0);
        BatchingStatus {
            requests: batch.count,
            batch_sizes,
            mean_batch_size: batch.mean(),
            mean_queue_ms: counters.queue.snapshot().mean().map(|s| s * 1e3),
            mean_compute_ms: counters.compute.snapshot().mean().map(|s| s * 1e3),
        }
    }
}

/// A registered model, as the catalogue shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CatalogueEntry {
    pub spec: ModelSpec,
    pub state: ModelState,
    pub pid: Option<u32>,
    /// Peak memory of its last load, used to plan the next one.
    pub last_peak_bytes: Option<u64>,
}

/// What a swap returns: both workers and the old one's unload report; for
/// a model that was not running, that its spec was updated (and, with
/// `load`, the load report).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwapReport {
    pub model: String,
    /// The worker replaced; `None`: nothing was running, the spec was
    /// updated.
    #[serde(default)]
    pub old_pid: Option<u32>,
    /// The worker serving now; `None`: nothing was loaded.
    #[serde(default)]
    pub new_pid: Option<u32>,
    /// From the swap call to the new worker taking requests.
    pub switch_ms: f64,
    pub took_ms: f64,
    #[serde(default)]
    pub load: Option<LoadReport>,
    #[serde(default)]
    pub unload: Option<UnloadReport>,
    /// The old worker was stopped before the new one started: a server on
    /// a fixed port, which two cannot listen on at once. Requests waited
    /// for the new one in between.
    #[serde(default)]
    pub break_before_make: bool,
}

impl fmt::Display for SwapReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.old_pid, self.new_pid) {
            (Some(old), Some(new)) => writeln!(
                f,
                "swapped `{}`: worker pid {old} -> pid {new}, serving after {:.1} ms, done after {:.1} ms",
                self.model, self.switch_ms, self.took_ms
            )?,
            (None, Some(_)) => writeln!(
                f,
                "updated `{}`: nothing was running; loaded with the new spec",
                self.model
            )?,
            _ => {
                return write!(
                    f,
                    "updated `{}`: nothing was running; its next load uses the new spec (`--load` \
                 loads it now)",
                    self.model
                );
            }
        }
        if self.break_before_make {
            writeln!(
                f,
                "(its server listens on a fixed port: the old one stopped before the new one \
                 started, and requests waited between)"
            )?;
        }
        if let Some(load) = &self.load {
            writeln!(f, "{load}")?;
        }
        if let Some(unload) = &self.unload {
            write!(f, "{unload}")?;
        }
        Ok(())
    }
}

/// Per-request settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestOptions {
    /// Overrides the model's keep-alive from this request on.
    pub keep_alive: Option<Duration>,
    /// The request fails (and is cancelled in the worker) past this.
    pub deadline: Option<Duration>,
}
