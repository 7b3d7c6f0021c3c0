//! What a load and an unload return: reports a person can read (`Display`)
//! and a program can parse (`serde`, snake_case fields).

use std::fmt;

use serde::{Deserialize, Serialize};

pub use crate::base::{ExitStatus, StopKind};
use crate::units::mib;

/// What a load returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoadReport {
    pub model: String,
    pub backend: String,
    pub pid: u32,
    pub worker_version: String,
    /// Spawn to ready: the worker loaded, serving from here (the
    /// proportional, private and shared figures are read right after, once
    /// it serves; the call returns when they are in).
    pub load_ms: f64,
    /// Spawn to hello: the cost of the process itself.
    pub spawn_ms: f64,
    /// Time the backend spent loading, measured inside the worker.
    pub backend_load_ms: f64,
    pub rss_bytes: u64,
    /// Of the RSS, anonymous memory (heap, weights read into the process)
    /// and file-backed pages (weights mapped from their file, libraries),
    /// which the kernel can share between workers and drop under pressure.
    #[serde(default)]
    pub anon_bytes: u64,
    #[serde(default)]
    pub file_bytes: u64,
    /// Proportional set size: shared pages (mapped weights) split among sharers.
    pub pss_bytes: u64,
    /// Peak memory of the worker up to the end of the load (`VmHWM`, or the
    /// cgroup's peak where the worker has one, whichever is higher).
    pub peak_rss_bytes: u64,
    /// The worker's memory cap, if it has one, and how it is enforced.
    pub memory_limit_bytes: Option<u64>,
    pub memory_cap: Option<crate::base::CapMechanism>,
    /// The GPUs the worker was given (`CUDA_VISIBLE_DEVICES`).
    pub gpus: Option<Vec<u32>>,
    /// Device memory the worker holds after load, as NVML counts it per process.
    pub vram_bytes: Option<u64>,
    pub system_available_bytes: u64,
    /// What the backend says about the loaded model.
    pub details: serde_json::Value,
    /// Requests the backend takes in one batch (1: one at a time).
    #[serde(default)]
    pub max_batch: u32,
    /// Of the RSS, pages the worker alone maps (what its exit gives back),
    /// and pages it shares (with the preloaded interpreter it was forked
    /// from, with libraries).
    #[serde(default)]
    pub private_bytes: u64,
    #[serde(default)]
    pub shared_bytes: u64,
    /// How its process began: started cold, or forked from its kind's
    /// preloaded interpreter.
    #[serde(default)]
    pub start: WorkerStart,
    /// What looked wrong about the load without failing it (a worker placed
    /// on a GPU that holds no GPU memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<Warning>,
    /// How the load got its room: what it was planned to take and where
    /// that came from, what gave room up, how long it waited (a load of
    /// the supervisor's; not a swap's or a restart's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<Admission>,
}

/// How a load got its room.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Admission {
    /// The RAM it was planned to take before it ran.
    pub estimate_bytes: u64,
    /// Where that came from: `measured` (its last load of the same thing),
    /// `gguf` (a GGUF file's tensors and its context's cache),
    /// `safetensors` (their headers), `files` (its weights' size on disk),
    /// `memory_limit`, `unknown`.
    pub estimate_from: String,
    /// The models that gave their room up, each `model (why)`: `idle`,
    /// `turn_over`, `priority`, `gpu`.
    pub evicted: Vec<String>,
    /// How long it waited for room (memory on its way back, a turn).
    pub waited_ms: f64,
    /// Loads waiting before it in the machine's queue when it asked.
    pub queued_behind: usize,
    /// A load that ran out of memory and was tried once more after idle
    /// models gave room: what happened the first time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retried: Option<String>,
}

/// Something that looks wrong about a loaded model without failing it: in
/// its load report, in `ps` while it holds, and as a `warning` event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Warning {
    /// A stable code for programs: `gpu_unused`.
    pub code: String,
    pub message: String,
}

/// `0,1`.
pub(crate) fn gpu_list(gpus: &[u32]) -> String {
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// What to check when a worker on a GPU holds no GPU memory.
pub(crate) const CHECK_THE_FRAMEWORK: &str = "check that its framework sees the GPU (JAX: \
     `jax.devices()`, PyTorch: `torch.cuda.is_available()`, berth's own models: a worker built \
     with CUDA)";

impl Warning {
    /// A worker placed on GPUs whose processes hold no device memory
    /// (`vram`, as NVML counts it): a framework that fell back to the CPU
    /// serves slowly while berth would otherwise say "GPU 0". `None` when
    /// it holds some, or was not placed on a GPU.
    pub fn gpu_unused(gpus: Option<&[u32]>, vram: Option<u64>) -> Option<Warning> {
        let gpus = gpus.filter(|g| !g.is_empty())?;
        if vram.unwrap_or(0) > 0 {
            return None;
        }
        Some(Warning {
            code: "gpu_unused".into(),
            message: format!(
                "placed on GPU {} but holds no GPU memory: is it running on the CPU? \
                 {CHECK_THE_FRAMEWORK}; `require_gpu_memory = true` makes this a load failure",
                gpu_list(gpus)
            ),
        })
    }
}

impl Warning {
    /// A server whose memory is not what berth measures (on another host,
    /// or under a container engine's own processes): `why` says which.
    pub fn memory_elsewhere(why: &str) -> Warning {
        Warning {
            code: "memory_elsewhere".into(),
            message: why.to_string(),
        }
    }
}

/// How a worker process began.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkerStart {
    /// Its program started afresh.
    #[default]
    Cold,
    /// Forked from its worker kind's preloaded interpreter (that process's pid).
    Forked { preloader_pid: u32 },
    /// Started afresh although its kind preloads, for this reason (a
    /// refused preload names the module at fault).
    ColdFallback { reason: String },
}

impl fmt::Display for WorkerStart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WorkerStart::Cold => f.write_str("cold"),
            WorkerStart::Forked { preloader_pid } => {
                write!(f, "forked from preloader pid {preloader_pid}")
            }
            WorkerStart::ColdFallback { reason } => write!(f, "cold ({reason})"),
        }
    }
}

/// What an unload returns: the proof that memory came back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnloadReport {
    pub model: String,
    pub pid: u32,
    pub stop: StopKind,
    pub exit: ExitStatus,
    /// From the start of the stop to the process reaped and its group empty.
    pub took_ms: f64,
    pub uptime_s: f64,
    pub requests: u64,
    /// Resident memory when the stop began (anonymous + file-backed + shared).
    pub rss_at_stop_bytes: u64,
    /// Of which anonymous (heap, stacks, allocator caches): what exit frees,
    /// but for pages shared with a process that outlives the worker.
    pub anon_at_stop_bytes: u64,
    /// Of the RSS, pages no other process mapped (the worker's own), and
    /// pages shared (with its preloader, if it was forked from one).
    #[serde(default)]
    pub private_at_stop_bytes: u64,
    #[serde(default)]
    pub shared_at_stop_bytes: u64,
    pub peak_rss_bytes: u64,
    /// The system's `AnonPages` before the stop and after the reap.
    pub system_anon_before_bytes: u64,
    pub system_anon_after_bytes: u64,
    /// Anonymous memory confirmed returned: the worker's anonymous resident
    /// memory at stop, capped by the system-wide drop in `AnonPages` and
    /// counted only once the process is gone. For a worker forked from a
    /// preloaded interpreter, the pages it still shared with it are not
    /// freed by its exit and so not counted: this is what it owned.
    /// Conservative: other processes allocating during the stop make it
    /// lower, never higher.
    pub reclaimed_bytes: u64,
    /// Processes the worker started alive after the stop (0): of its
    /// process group, its cgroup, or carrying its mark.
    pub leftover_processes: u32,
    /// Processes the worker started that had left its process group (a
    /// `setsid`, a double fork), found in its cgroup or by its mark and
    /// killed.
    #[serde(default)]
    pub escaped_processes: u32,
    /// Device memory the worker held when the stop began (NVML, per process).
    pub vram_at_stop_bytes: Option<u64>,
    /// The drop in its GPUs' used memory once the worker was gone from
    /// NVML's process list, and how long the device took to give it back.
    pub gpu_reclaimed_bytes: Option<u64>,
    pub gpu_reclaim_ms: Option<f64>,
    /// Whether the pid had left NVML's process list when the wait for the
    /// device ended (it waits up to 5 s); `false` means the driver still
    /// counted the worker, and `gpu_reclaimed_bytes` is what was back then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_pid_gone: Option<bool>,
    /// A server in a container: what proves the container gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerGone>,
}

/// A server's container after its stop. Its processes' memory and VRAM are
/// the report's own figures (they were counted over the model's cgroup,
/// where the container ran); this says the container itself is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerGone {
    /// `podman` or `docker`.
    pub engine: crate::base::Engine,
    pub name: String,
    pub id: Option<String>,
    /// The engine, asked after the forced removal, no longer knows it (a
    /// successful `rm` alone is not taken as proof).
    pub removed: bool,
    /// No process is left in the model's cgroup, where the engine's monitor
    /// and the container's processes ran (`None`: it had no cgroup).
    pub cgroup_empty: Option<bool>,
    /// Why the engine could not be asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "loaded `{}` ({}) in worker pid {} in {:.1} ms (spawn {:.1} ms, backend {:.1} ms; {})",
            self.model,
            self.backend,
            self.pid,
            self.load_ms,
            self.spawn_ms,
            self.backend_load_ms,
            self.start
        )?;
        write!(
            f,
            "  memory: rss {} (anonymous {}, file-backed {}; own {}, shared {}), pss {}, peak {}; \
             system available {}",
            mib(self.rss_bytes),
            mib(self.anon_bytes),
            mib(self.file_bytes),
            mib(self.private_bytes),
            mib(self.shared_bytes),
            mib(self.pss_bytes),
            mib(self.peak_rss_bytes),
            mib(self.system_available_bytes)
        )?;
        if let (Some(limit), Some(cap)) = (self.memory_limit_bytes, self.memory_cap) {
            write!(f, "; limit {} ({cap})", mib(limit))?;
        }
        if self.gpus.is_some() || self.vram_bytes.is_some() {
            write!(f, "\n  gpu: vram {}", mib(self.vram_bytes.unwrap_or(0)))?;
            if let Some(gpus) = &self.gpus {
                write!(f, " on GPU {}", gpu_list(gpus))?;
            }
        }
        for warning in &self.warnings {
            write!(f, "\n  warning: {}", warning.message)?;
        }
        if let Some(a) = &self.admission {
            write!(
                f,
                "\n  room: planned {} ({}); ",
                mib(a.estimate_bytes),
                a.estimate_from
            )?;
            if a.evicted.is_empty() {
                write!(f, "nothing evicted")?;
            } else {
                write!(f, "evicted {}", a.evicted.join(", "))?;
            }
            if a.waited_ms >= 1.0 {
                write!(f, "; waited {:.0} ms", a.waited_ms)?;
            }
            if let Some(retried) = &a.retried {
                write!(f, "; tried again after: {retried}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for UnloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "unloaded `{}`: worker pid {} stopped ({}) and {} after {:.1} ms; served {} requests in {:.1} s",
            self.model, self.pid, self.stop, self.exit, self.took_ms, self.requests, self.uptime_s
        )?;
        writeln!(
            f,
            "  memory at stop: rss {} (anonymous {}; own {}, shared {}), peak {}",
            mib(self.rss_at_stop_bytes),
            mib(self.anon_at_stop_bytes),
            mib(self.private_at_stop_bytes),
            mib(self.shared_at_stop_bytes),
            mib(self.peak_rss_bytes)
        )?;
        write!(
            f,
            "  reclaimed {} (system anonymous memory {} -> {}); {} processes left over",
            mib(self.reclaimed_bytes),
            mib(self.system_anon_before_bytes),
            mib(self.system_anon_after_bytes),
            self.leftover_processes
        )?;
        if self.escaped_processes > 0 {
            write!(
                f,
                " ({} that had left its process group were found and killed)",
                self.escaped_processes
            )?;
        }
        if let Some(held) = self.vram_at_stop_bytes {
            write!(
                f,
                "\n  gpu: vram at stop {}; device memory back {} after {:.1} ms ({})",
                mib(held),
                mib(self.gpu_reclaimed_bytes.unwrap_or(0)),
                self.gpu_reclaim_ms.unwrap_or(0.0),
                if self.gpu_pid_gone == Some(false) {
                    "NVML still listed the pid when the wait ended"
                } else {
                    "pid gone from NVML"
                }
            )?;
        }
        if let Some(c) = &self.container {
            let id: String = c.id.as_deref().unwrap_or("?").chars().take(12).collect();
            write!(
                f,
                "\n  container {} ({id}): {}; {}",
                c.name,
                match (&c.error, c.removed) {
                    (Some(e), _) => format!("not known to be removed ({e})"),
                    (None, true) => "removed (the engine no longer knows it)".to_string(),
                    (None, false) => "STILL KNOWN to the engine".to_string(),
                },
                match c.cgroup_empty {
                    Some(true) => "its cgroup is empty",
                    Some(false) => "PROCESSES REMAIN in its cgroup",
                    None => "it had no cgroup of berth's",
                }
            )?;
        }
        Ok(())
    }
}

/// What a reload changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReloadReport {
    /// Models registered.
    pub added: Vec<String>,
    /// Models unloaded (if loaded) and deregistered.
    pub removed: Vec<String>,
    /// Models whose spec or worker kind changed: swapped if loaded, their
    /// spec replaced if not.
    pub changed: Vec<String>,
    /// Models left as they were.
    pub unchanged: Vec<String>,
    /// Settings that changed and apply now.
    pub settings: Vec<String>,
    /// Settings that changed but apply only at a restart of berth.
    pub restart_needed: Vec<String>,
    /// `model: why` for each model a step failed for (a changed model
    /// whose swap failed keeps its old worker and spec).
    pub failed: Vec<String>,
    /// The models of `failed`: kept as they were, and their steps tried
    /// again at the next reload.
    #[serde(default)]
    pub pending: Vec<String>,
}

impl std::fmt::Display for ReloadReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            if v.is_empty() {
                "none".to_string()
            } else {
                v.join(", ")
            }
        };
        write!(
            f,
            "config reloaded: added {}; removed {}; changed {}; {} unchanged; settings {}",
            list(&self.added),
            list(&self.removed),
            list(&self.changed),
            self.unchanged.len(),
            list(&self.settings)
        )?;
        if !self.restart_needed.is_empty() {
            write!(
                f,
                "; changed but applied only at a restart: {}",
                self.restart_needed.join(", ")
            )?;
        }
        if !self.failed.is_empty() {
            write!(
                f,
                "; FAILED (kept as they were, tried again at the next reload): {}",
                self.failed.join("; ")
            )?;
        }
        Ok(())
    }
}
