//! Per-model counters: kept per registered model, they survive loads,
//! unloads and worker changes; `/metrics` renders them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram buckets, in seconds (also for the
/// queueing and compute parts of a request's time).
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Upper bounds of the batch-size histogram's buckets, in requests.
pub const BATCH_BUCKETS: [f64; 8] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];

/// A Prometheus-style histogram of `N` buckets, updated without a lock.
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    buckets: [AtomicU64; N],
    count: AtomicU64,
    /// The sum of the observed values, in millionths.
    sum_micros: AtomicU64,
}

impl<const N: usize> Default for Histogram<N> {
    fn default() -> Self {
        Histogram {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_micros: AtomicU64::new(0),
        }
    }
}

impl<const N: usize> Histogram<N> {
    pub fn observe(&self, bounds: &[f64; N], value: f64) {
        for (bound, bucket) in bounds.iter().zip(&self.buckets) {
            if value <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros
            .fetch_add((value.max(0.0) * 1e6) as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> HistogramSnapshot {
        HistogramSnapshot {
            buckets: self
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.count.load(Ordering::Relaxed),
            sum: self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}

/// A histogram at one moment: cumulative bucket counts (one per bound),
/// the count and the sum of the observed values.
#[derive(Debug, Clone, PartialEq)]
pub struct HistogramSnapshot {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum: f64,
}

impl HistogramSnapshot {
    /// The mean observed value, if anything was observed.
    pub fn mean(&self) -> Option<f64> {
        (self.count > 0).then(|| self.sum / self.count as f64)
    }
}

/// Counters kept per registered model; they survive loads and unloads.
#[derive(Debug, Default)]
pub struct ModelCounters {
    pub requests: AtomicU64,
    pub errors: AtomicU64,
    pub loads: AtomicU64,
    pub unloads: AtomicU64,
    pub restarts: AtomicU64,
    pub recycles: AtomicU64,
    /// Highest peak RSS of any stopped worker of the model (`VmHWM` at stop).
    pub worker_peak_rss_bytes: AtomicU64,
    pub reclaimed_bytes: AtomicU64,
    /// Device memory confirmed returned by unloads (NVML).
    pub gpu_reclaimed_bytes: AtomicU64,
    /// Whole requests, queueing included, in seconds.
    pub latency: Histogram<12>,
    /// Of a request's time, the part spent waiting: for a concurrency slot,
    /// for a load, and inside the worker for its batch to start.
    pub queue: Histogram<12>,
    /// Of a request's time, the part the backend spent on its batch.
    pub compute: Histogram<12>,
    /// How many requests ran together in each request's batch.
    pub batch: Histogram<8>,
}

impl ModelCounters {
    /// Counts a stopped worker and what its stop proved.
    pub fn record_unload(&self, report: &crate::report::UnloadReport) {
        self.unloads.fetch_add(1, Ordering::Relaxed);
        self.reclaimed_bytes
            .fetch_add(report.reclaimed_bytes, Ordering::Relaxed);
        self.gpu_reclaimed_bytes
            .fetch_add(report.gpu_reclaimed_bytes.unwrap_or(0), Ordering::Relaxed);
        self.worker_peak_rss_bytes
            .fetch_max(report.peak_rss_bytes, Ordering::Relaxed);
    }

    pub fn observe_latency(&self, elapsed: Duration) {
        self.latency
            .observe(&LATENCY_BUCKETS, elapsed.as_secs_f64());
    }

    /// A finished request's batch and the split of its `elapsed` time into
    /// queueing and compute, as its worker reported them. A worker that
    /// did not say (batch 0) is not counted here.
    pub fn observe_run(&self, run: berth_protocol::RunInfo, elapsed: Duration) {
        if run.batch == 0 {
            return;
        }
        let compute = Duration::from_micros(run.compute_micros);
        self.batch.observe(&BATCH_BUCKETS, f64::from(run.batch));
        self.compute
            .observe(&LATENCY_BUCKETS, compute.as_secs_f64());
        self.queue.observe(
            &LATENCY_BUCKETS,
            elapsed.saturating_sub(compute).as_secs_f64(),
        );
    }
}
