//! `/metrics`: the supervisor's counters and state as Prometheus text.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::gpu::DeviceStatus;
use crate::supervisor::{
    BATCH_BUCKETS, HistogramSnapshot, LATENCY_BUCKETS, ModelCounters, ModelStatus, Occupancy,
    PreloaderStatus, Supervisor,
};

fn escape(label: &str) -> String {
    label
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A counter family: name, help, and how to read it.
type Counter = (&'static str, &'static str, fn(&ModelCounters) -> u64);

/// A histogram family: name, help, bucket bounds, and how to read it.
type HistogramFamily = (
    &'static str,
    &'static str,
    &'static [f64],
    fn(&ModelCounters) -> HistogramSnapshot,
);

const COUNTERS: [Counter; 8] = [
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

/// The counter only a machine with GPUs has.
const GPU_ONLY: &str = "berth_gpu_reclaimed_bytes_total";

const HISTOGRAMS: [HistogramFamily; 4] = [
    (
        "berth_request_duration_seconds",
        "Request latency, queueing included.",
        &LATENCY_BUCKETS,
        |c| c.latency.snapshot(),
    ),
    (
        "berth_request_queue_seconds",
        "Of a request's time, the part spent waiting (for a slot, a load, its batch), as its worker reported its compute.",
        &LATENCY_BUCKETS,
        |c| c.queue.snapshot(),
    ),
    (
        "berth_request_compute_seconds",
        "Of a request's time, the part the backend spent on its batch.",
        &LATENCY_BUCKETS,
        |c| c.compute.snapshot(),
    ),
    (
        "berth_batch_size",
        "Requests that ran together in each request's batch.",
        &BATCH_BUCKETS,
        |c| c.batch.snapshot(),
    ),
];

const WORKER_GAUGES: [WorkerGauge; 3] = [
    (
        "berth_worker_rss_bytes",
        "Resident memory of the model's worker.",
        |s| Some(s.rss_bytes),
    ),
    (
        "berth_worker_private_bytes",
        "Resident memory only the model's worker maps: what its exit gives back.",
        |s| Some(s.private_bytes),
    ),
    (
        "berth_worker_vram_bytes",
        "Device memory the model's worker holds (NVML).",
        |s| s.vram_bytes,
    ),
];

/// Models one piece of the text holds: a scrape of thousands of models is
/// written out a piece at a time, as its reader takes it, so a slow reader
/// holds one piece, not the whole text.
const MODELS_A_PIECE: usize = 64;

/// One family of per-model series, as the pieces walk them.
#[derive(Clone, Copy)]
enum Family {
    Counter(Counter),
    /// Left out for models that never served: their buckets are all zero,
    /// and they were most of the text.
    Histogram(HistogramFamily),
    Worker(WorkerGauge),
    PeakRss,
    QueueDepth,
    InFlight,
}

/// What one scrape reads, taken at once (the procfs and NVML reads), then
/// written out piece by piece ([`Snapshot::pieces`]).
pub struct Snapshot {
    counters: Vec<(String, Arc<ModelCounters>)>,
    stats: Vec<ModelStatus>,
    families: Vec<Family>,
    /// The families not per model (the gateway's gauges, the preloaders',
    /// the devices'): small, written whole.
    tail: String,
}

impl Snapshot {
    /// Reads the supervisor's counters and state now. Blocking (procfs,
    /// NVML): call it off the async threads.
    pub fn take(supervisor: &Supervisor) -> Snapshot {
        let counters = supervisor.counters();
        // One NVML reading for the workers' VRAM and the devices' gauges.
        let inventory = crate::gpu::inventory();
        let on_gpu = matches!(inventory, crate::gpu::Inventory::Devices(_));
        let stats = supervisor.stats_on(&inventory);
        let mut families: Vec<Family> = COUNTERS
            .into_iter()
            .filter(|(name, _, _)| on_gpu || *name != GPU_ONLY)
            .map(Family::Counter)
            .collect();
        families.extend(HISTOGRAMS.into_iter().map(Family::Histogram));
        families.extend(WORKER_GAUGES.into_iter().map(Family::Worker));
        families.extend([Family::PeakRss, Family::QueueDepth, Family::InFlight]);
        let mut tail = String::new();
        family(
            &mut tail,
            "berth_models_loaded",
            "gauge",
            "Models with a worker.",
        );
        let _ = writeln!(tail, "berth_models_loaded {}", stats.len());
        render_occupancy(&mut tail, &supervisor.occupancy_on(&inventory));
        render_preloaders(&mut tail, &supervisor.preloaders());
        render_gpus(&mut tail, &supervisor.gpus_on(inventory));
        Snapshot {
            counters,
            stats,
            families,
            tail,
        }
    }

    /// The text, piece by piece, each written when it is asked for.
    pub fn pieces(mut self) -> impl Iterator<Item = String> + Send {
        let (mut family, mut offset) = (0, 0);
        let mut tail = Some(std::mem::take(&mut self.tail));
        let snapshot = self;
        std::iter::from_fn(move || {
            let Some(which) = snapshot.families.get(family).copied() else {
                return tail.take();
            };
            let mut out = String::new();
            let items = snapshot.write(which, offset, &mut out);
            offset += MODELS_A_PIECE;
            if offset >= items {
                family += 1;
                offset = 0;
            }
            Some(out)
        })
    }

    /// Writes `which`'s header (at offset 0) and its series for the models
    /// from `offset`, at most [`MODELS_A_PIECE`]; returns how many models
    /// the family walks.
    fn write(&self, which: Family, offset: usize, out: &mut String) -> usize {
        let counters = || self.counters.iter().skip(offset).take(MODELS_A_PIECE);
        let stats = || self.stats.iter().skip(offset).take(MODELS_A_PIECE);
        match which {
            Family::Counter((name, help, get)) => {
                if offset == 0 {
                    family(out, name, "counter", help);
                }
                for (model, c) in counters() {
                    let _ = writeln!(out, "{name}{{model=\"{}\"}} {}", escape(model), get(c));
                }
                self.counters.len()
            }
            Family::Histogram((name, help, bounds, get)) => {
                if offset == 0 {
                    family(out, name, "histogram", help);
                }
                for (model, c) in counters() {
                    let h = get(c);
                    if h.count == 0 {
                        continue;
                    }
                    let m = escape(model);
                    for (bound, bucket) in bounds.iter().zip(&h.buckets) {
                        let _ = writeln!(
                            out,
                            "{name}_bucket{{model=\"{m}\",le=\"{bound}\"}} {bucket}"
                        );
                    }
                    let count = h.count;
                    let _ = writeln!(out, "{name}_bucket{{model=\"{m}\",le=\"+Inf\"}} {count}");
                    let _ = writeln!(out, "{name}_sum{{model=\"{m}\"}} {}", h.sum);
                    let _ = writeln!(out, "{name}_count{{model=\"{m}\"}} {count}");
                }
                self.counters.len()
            }
            Family::Worker((name, help, get)) => {
                if offset == 0 {
                    family(out, name, "gauge", help);
                }
                for (s, value) in stats().filter_map(|s| get(s).map(|v| (s, v))) {
                    let _ = writeln!(
                        out,
                        "{name}{{model=\"{}\",pid=\"{}\"}} {value}",
                        escape(&s.name),
                        s.pid.unwrap_or(0),
                    );
                }
                self.stats.len()
            }
            Family::PeakRss => {
                if offset == 0 {
                    family(
                        out,
                        "berth_worker_peak_rss_bytes",
                        "gauge",
                        "Highest peak RSS of any stopped worker of the model.",
                    );
                }
                for (model, c) in counters() {
                    let peak = c.worker_peak_rss_bytes.load(Ordering::Relaxed);
                    let _ = writeln!(
                        out,
                        "berth_worker_peak_rss_bytes{{model=\"{}\"}} {peak}",
                        escape(model)
                    );
                }
                self.counters.len()
            }
            Family::QueueDepth => {
                if offset == 0 {
                    family(
                        out,
                        "berth_queue_depth",
                        "gauge",
                        "Requests waiting for a concurrency slot.",
                    );
                }
                for s in stats() {
                    let _ = writeln!(
                        out,
                        "berth_queue_depth{{model=\"{}\"}} {}",
                        escape(&s.name),
                        s.queued
                    );
                }
                self.stats.len()
            }
            Family::InFlight => {
                if offset == 0 {
                    family(
                        out,
                        "berth_in_flight",
                        "gauge",
                        "Requests inside the model's worker.",
                    );
                }
                for s in stats() {
                    let _ = writeln!(
                        out,
                        "berth_in_flight{{model=\"{}\"}} {}",
                        escape(&s.name),
                        s.in_flight
                    );
                }
                self.stats.len()
            }
        }
    }
}

fn family(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// The supervisor's state as Prometheus text exposition, whole.
pub fn render(supervisor: &Supervisor) -> String {
    Snapshot::take(supervisor).pieces().collect()
}

/// The gauges an inference gateway's endpoint picker scrapes to choose a
/// berth for a request, in the types and meaning of the Gateway API
/// Inference Extension's Model Server Protocol, under berth's names (the
/// picker's config names them; docs/production.md): requests waiting and
/// running, all models; how full the budgets are, a fraction as vLLM's
/// `kv_cache_usage_perc` is (the picker compares it with 0.8); and one
/// series in the shape of vLLM's `lora_requests_info` listing the models
/// warm and on their way, its value the time that last changed, so the
/// picker sends a request where its model is loaded.
fn render_occupancy(out: &mut String, o: &Occupancy) {
    let gauges: [(&str, &str, f64); 3] = [
        (
            "berth_requests_waiting",
            "Requests waiting, all models: queued for a concurrency slot or for their model's load.",
            o.waiting as f64,
        ),
        (
            "berth_requests_running",
            "Requests inside workers (or relayed to their servers), all models.",
            o.running as f64,
        ),
        (
            "berth_budget_usage_ratio",
            "How full the fullest budget is, 0 to 1: memory_budget, gpu_memory_budget, max_loaded (with none set, the host's memory).",
            o.budget_usage,
        ),
    ];
    for (name, help, value) in gauges {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
        );
    }
    let name = "berth_loaded_models_info";
    let _ = writeln!(
        out,
        "# HELP {name} Models loaded and ready (running_lora_adapters), loading or waiting for a load (waiting_lora_adapters), and how many may be loaded at once (max_lora); the value is when that last changed (Unix seconds).\n# TYPE {name} gauge"
    );
    let _ = writeln!(
        out,
        "{name}{{running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\",max_lora=\"{}\"}} {}",
        escape(&o.ready.join(",")),
        escape(&o.loading.join(",")),
        o.max_loaded,
        o.changed_at
    );
}

/// A per-worker gauge: name, help, and how to read it (`None`: no line).
type WorkerGauge = (&'static str, &'static str, fn(&ModelStatus) -> Option<u64>);

/// A per-preloader gauge: name, help, and how to read it.
type PreloaderGauge = (&'static str, &'static str, fn(&PreloaderStatus) -> f64);

/// The worker kinds' preloaded interpreters: their standing cost, and the
/// workers forked from each; nothing where no kind preloads.
fn render_preloaders(out: &mut String, preloaders: &[PreloaderStatus]) {
    if preloaders.is_empty() {
        return;
    }
    let ready: Vec<&PreloaderStatus> = preloaders.iter().filter(|p| p.pid.is_some()).collect();
    let gauges: [PreloaderGauge; 4] = [
        (
            "berth_preloader_rss_bytes",
            "Resident memory of the worker kind's preloaded interpreter.",
            |p| p.rss_bytes as f64,
        ),
        (
            "berth_preloader_pss_bytes",
            "Its proportional set size (what it shares with its forked workers, split).",
            |p| p.pss_bytes as f64,
        ),
        (
            "berth_preloader_forks",
            "Workers forked from it since it started.",
            |p| p.forks as f64,
        ),
        (
            "berth_preloader_import_seconds",
            "How long its preload's imports took.",
            |p| p.import_ms / 1e3,
        ),
    ];
    for (name, help, get) in gauges {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for p in &ready {
            let _ = writeln!(
                out,
                "{name}{{kind=\"{}\",pid=\"{}\"}} {}",
                escape(&p.kind),
                p.pid.unwrap_or(0),
                get(p)
            );
        }
    }
    let name = "berth_preloader_refused";
    let _ = writeln!(
        out,
        "# HELP {name} 1 where the kind's preload was refused (its workers start cold).\n# TYPE {name} gauge"
    );
    for p in preloaders {
        let _ = writeln!(
            out,
            "{name}{{kind=\"{}\"}} {}",
            escape(&p.kind),
            u8::from(p.state == "refused")
        );
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ModelSpec, SupervisorConfig};

    /// Thousands of models: the text comes in pieces of at most
    /// [`MODELS_A_PIECE`] models, and the models that never served have no
    /// histogram series (their buckets were most of the text).
    #[tokio::test]
    async fn the_text_comes_in_pieces_without_the_histograms_of_models_that_never_served() {
        let supervisor = Supervisor::new(SupervisorConfig::default());
        for n in 0..300 {
            supervisor
                .register(ModelSpec::new(format!("m{n}"), "echo"))
                .unwrap();
        }
        let pieces: Vec<String> = Snapshot::take(&supervisor).pieces().collect();
        assert!(pieces.len() > 20, "{} pieces", pieces.len());
        let text = pieces.concat();
        assert_eq!(text.matches("berth_requests_total{").count(), 300);
        assert!(!text.contains("berth_request_duration_seconds_bucket"));
        assert!(text.contains("# TYPE berth_request_duration_seconds histogram"));
        let largest = pieces.iter().map(String::len).max().unwrap();
        assert!(largest < 64 << 10, "a piece of {largest} bytes");
        // Without a GPU, no GPU counter.
        if matches!(crate::gpu::inventory(), crate::gpu::Inventory::NoGpu(_)) {
            assert!(!text.contains("berth_gpu_reclaimed_bytes_total"));
        }
    }
}
