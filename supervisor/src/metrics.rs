//! Per-model counters and their Prometheus text rendering.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::gpu::DeviceStatus;
use crate::supervisor::Supervisor;

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

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A counter family: name, help, and how to read it.
type Counter = (&'static str, &'static str, fn(&ModelCounters) -> u64);

/// The supervisor's state as Prometheus text exposition.
pub fn render(supervisor: &Supervisor) -> String {
    let counters = supervisor.counters();
    // One NVML reading for the workers' VRAM and the devices' gauges.
    let inventory = crate::gpu::inventory();
    let stats = supervisor.stats_on(&inventory);
    let mut out = String::new();
    let family = |out: &mut String, name: &str, kind: &str, help: &str| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    };
    let simple: [Counter; 8] = [
        ("berth_requests_total", "Requests sent to the model.", |c| {
            c.requests.load(Ordering::Relaxed)
        }),
        ("berth_request_errors_total", "Requests that failed.", |c| {
            c.errors.load(Ordering::Relaxed)
        }),
        ("berth_loads_total", "Workers loaded for the model.", |c| {
            c.loads.load(Ordering::Relaxed)
        }),
        (
            "berth_unloads_total",
            "Workers stopped for the model.",
            |c| c.unloads.load(Ordering::Relaxed),
        ),
        (
            "berth_restarts_total",
            "Workers restarted after a crash.",
            |c| c.restarts.load(Ordering::Relaxed),
        ),
        (
            "berth_recycles_total",
            "Workers replaced for crossing max_rss or max_requests.",
            |c| c.recycles.load(Ordering::Relaxed),
        ),
        (
            "berth_reclaimed_bytes_total",
            "Anonymous memory confirmed returned by unloads.",
            |c| c.reclaimed_bytes.load(Ordering::Relaxed),
        ),
        (
            "berth_gpu_reclaimed_bytes_total",
            "Device memory confirmed returned by unloads (NVML).",
            |c| c.gpu_reclaimed_bytes.load(Ordering::Relaxed),
        ),
    ];
    for (name, help, get) in simple {
        family(&mut out, name, "counter", help);
        for (model, c) in &counters {
            let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", escape(model), get(c));
        }
    }
    family(
        &mut out,
        "berth_request_duration_seconds",
        "histogram",
        "Request latency, queueing included.",
    );
    for (model, c) in &counters {
        let m = escape(model);
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&c.latency_buckets) {
            let _ = writeln!(
                out,
                "berth_request_duration_seconds_bucket{{model=\"{m}\",le=\"{bound}\"}} {}",
                bucket.load(Ordering::Relaxed)
            );
        }
        let count = c.latency_count.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "berth_request_duration_seconds_bucket{{model=\"{m}\",le=\"+Inf\"}} {count}"
        );
        let sum = c.latency_sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(
            out,
            "berth_request_duration_seconds_sum{{model=\"{m}\"}} {sum}"
        );
        let _ = writeln!(
            out,
            "berth_request_duration_seconds_count{{model=\"{m}\"}} {count}"
        );
    }
    family(
        &mut out,
        "berth_worker_rss_bytes",
        "gauge",
        "Resident memory of the model's worker.",
    );
    for s in &stats {
        let _ = writeln!(
            out,
            "berth_worker_rss_bytes{{model=\"{}\",pid=\"{}\"}} {}",
            escape(&s.name),
            s.pid.unwrap_or(0),
            s.rss_bytes
        );
    }
    family(
        &mut out,
        "berth_worker_vram_bytes",
        "gauge",
        "Device memory the model's worker holds (NVML).",
    );
    for s in stats.iter().filter(|s| s.vram_bytes.is_some()) {
        let _ = writeln!(
            out,
            "berth_worker_vram_bytes{{model=\"{}\",pid=\"{}\"}} {}",
            escape(&s.name),
            s.pid.unwrap_or(0),
            s.vram_bytes.unwrap_or(0)
        );
    }
    family(
        &mut out,
        "berth_worker_peak_rss_bytes",
        "gauge",
        "Highest peak RSS of any stopped worker of the model.",
    );
    for (model, c) in &counters {
        let peak = c.worker_peak_rss_bytes.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "berth_worker_peak_rss_bytes{{model=\"{}\"}} {peak}",
            escape(model)
        );
    }
    family(
        &mut out,
        "berth_queue_depth",
        "gauge",
        "Requests waiting for a concurrency slot.",
    );
    for s in &stats {
        let _ = writeln!(
            out,
            "berth_queue_depth{{model=\"{}\"}} {}",
            escape(&s.name),
            s.queued
        );
    }
    family(
        &mut out,
        "berth_in_flight",
        "gauge",
        "Requests inside the model's worker.",
    );
    for s in &stats {
        let _ = writeln!(
            out,
            "berth_in_flight{{model=\"{}\"}} {}",
            escape(&s.name),
            s.in_flight
        );
    }
    family(
        &mut out,
        "berth_models_loaded",
        "gauge",
        "Models with a worker.",
    );
    let _ = writeln!(out, "berth_models_loaded {}", stats.len());
    render_gpus(&mut out, &supervisor.gpus_on(inventory));
    out
}

/// A per-device gauge: name, help, and how to read it.
type DeviceGauge = (&'static str, &'static str, fn(&DeviceStatus) -> u64);

/// Per-device memory gauges; nothing without a GPU.
fn render_gpus(out: &mut String, status: &crate::gpu::GpuStatus) {
    if status.devices.is_empty() {
        return;
    }
    let gauges: [DeviceGauge; 3] = [
        (
            "berth_gpu_memory_total_bytes",
            "The device's memory.",
            |d| d.total_bytes,
        ),
        (
            "berth_gpu_memory_used_bytes",
            "The device's used memory, every process's (NVML).",
            |d| d.used_bytes,
        ),
        (
            "berth_gpu_memory_berth_bytes",
            "Device memory berth's workers hold (NVML, per process).",
            |d| d.berth_bytes,
        ),
    ];
    for (name, help, get) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for d in &status.devices {
            let _ = writeln!(
                out,
                "{name}{{gpu=\"{}\",name=\"{}\"}} {}",
                d.index,
                escape(&d.name),
                get(d)
            );
        }
    }
}
