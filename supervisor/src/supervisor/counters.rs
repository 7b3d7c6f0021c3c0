//! Per-model counters: kept per registered model, they survive loads,
//! unloads and worker changes; `/metrics` renders them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency histogram buckets, in seconds.
pub const LATENCY_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

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
    latency_buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_micros: AtomicU64,
}

impl ModelCounters {
    /// Counts a stopped worker and what its stop proved.
    pub fn record_unload(&self, report: &crate::UnloadReport) {
        self.unloads.fetch_add(1, Ordering::Relaxed);
        self.reclaimed_bytes
            .fetch_add(report.reclaimed_bytes, Ordering::Relaxed);
        self.gpu_reclaimed_bytes
            .fetch_add(report.gpu_reclaimed_bytes.unwrap_or(0), Ordering::Relaxed);
        self.worker_peak_rss_bytes
            .fetch_max(report.peak_rss_bytes, Ordering::Relaxed);
    }

    pub fn observe_latency(&self, elapsed: Duration) {
        let secs = elapsed.as_secs_f64();
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.latency_buckets) {
            if secs <= *bound {
                bucket.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.latency_count.fetch_add(1, Ordering::Relaxed);
        self.latency_sum_micros
            .fetch_add(elapsed.as_micros() as u64, Ordering::Relaxed);
    }
}

/// The latency histogram at one moment: cumulative bucket counts (one per
/// [`LATENCY_BUCKETS`] bound), the count and the sum in seconds.
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyHistogram {
    pub buckets: Vec<u64>,
    pub count: u64,
    pub sum_s: f64,
}

impl ModelCounters {
    pub fn latency(&self) -> LatencyHistogram {
        LatencyHistogram {
            buckets: self
                .latency_buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect(),
            count: self.latency_count.load(Ordering::Relaxed),
            sum_s: self.latency_sum_micros.load(Ordering::Relaxed) as f64 / 1e6,
        }
    }
}
