//! What to run and how: a model's spec and the supervisor's settings here;
//! the ranges every setting is held to in `limits`, where a model's files
//! may be in `paths`, and which programs run as workers in `programs`.

mod container;
mod limits;
mod paths;
mod programs;
mod residency;
mod turns;

pub use container::{ContainerSpec, Engine, RunCommand};
pub use limits::*;
pub use paths::confined;
pub use programs::{
    DEFAULT_PRELOAD_KEEP_ALIVE, HttpSpec, Reach, ServerSleep, WorkerKind, check_command,
    is_dangerous_env,
};
pub use residency::{Group, Matrix, NamedSet, Residency, Rules};
pub use turns::Turns;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::base::StopGraces;
use crate::error::{Error, Result};

/// One model: which backend, which weights, which options.
///
/// Unknown keys are refused (`deny_unknown_fields`): a misspelt setting in a
/// config or a request is an error, never a silently ignored one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// The name requests use. Letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// A backend of the worker binary (`echo`, `hog`, `fault`, ...). A
    /// model served by an HTTP server ([`ModelSpec::http`]) has none; it is
    /// shown as `http`.
    #[serde(default)]
    pub backend: String,
    /// Weights file or directory.
    #[serde(default)]
    pub model: Option<PathBuf>,
    /// Backend options (`KEY=VALUE`); numbers and booleans are accepted
    /// and passed on as text.
    #[serde(default, deserialize_with = "crate::units::scalar_map")]
    pub options: BTreeMap<String, String>,
    /// Overrides [`SupervisorConfig::load_timeout`].
    #[serde(default, with = "crate::units::duration_opt")]
    pub load_timeout: Option<Duration>,
    /// Overrides [`SupervisorConfig::worker_binary`]: a host's own worker.
    /// Set by the operator (config, CLI, host code); the HTTP API refuses it.
    #[serde(default)]
    pub worker_binary: Option<PathBuf>,
    /// A worker kind the operator declared in [`SupervisorConfig::workers`]
    /// (its program and environment), by name: how an HTTP client picks a
    /// worker program without being able to name one.
    #[serde(default)]
    pub worker: Option<String>,
    /// Extra environment for the worker (`CUDA_VISIBLE_DEVICES`, ...).
    /// Loader and interpreter variables ([`is_dangerous_env`]) are refused
    /// here; an operator sets those on a worker kind. The HTTP API refuses it.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// A worker that speaks the stream wire (`docs/wire.md`: a Python
    /// worker, or any language), by its command line:
    /// `["python3", "-m", "berth_worker"]`. The program is looked up on the
    /// supervisor's `PATH`. Set by the operator; the HTTP API refuses it (an
    /// operator declares a worker kind with `command`, which a client names).
    #[serde(default)]
    pub command: Option<Vec<String>>,
    /// The worker's working directory (default: the supervisor's). Set by
    /// the operator; the HTTP API refuses it.
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// With `command`: the program is an HTTP inference server (llama.cpp's
    /// server, vLLM, ...), not a berth worker, and this says how to reach
    /// it. Set by the operator; the HTTP API refuses it.
    #[serde(default)]
    pub http: Option<HttpSpec>,
    /// Other names requests may use for this model (llama-swap's
    /// `aliases`), unique across the catalogue.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// `mmap` or `read`; passed to the backend as its `load_mode` option.
    #[serde(default)]
    pub load_mode: Option<String>,
    /// How long the model stays loaded after its last request
    /// (default: [`SupervisorConfig::default_keep_alive`]). Zero unloads
    /// right after each request.
    #[serde(default, with = "crate::units::duration_opt")]
    pub keep_alive: Option<Duration>,
    /// The worker's memory cap (`2GiB`).
    #[serde(default, with = "crate::units::bytes_opt")]
    pub memory_limit: Option<u64>,
    /// A request making no progress this long gets its worker killed
    /// (default: never).
    #[serde(default, with = "crate::units::duration_opt")]
    pub stall_timeout: Option<Duration>,
    /// Replace the worker once its resident memory passes this (a leak).
    #[serde(default, with = "crate::units::bytes_opt")]
    pub max_rss: Option<u64>,
    /// Replace the worker after this many requests.
    #[serde(default)]
    pub max_requests: Option<u64>,
    /// Crash restarts allowed within `restart_window` before the model is
    /// marked failed (default 5).
    #[serde(default)]
    pub max_restarts: Option<u32>,
    /// Default 60 s.
    #[serde(default, with = "crate::units::duration_opt")]
    pub restart_window: Option<Duration>,
    /// GPUs for the worker: `[0, 1]` or `"auto"` (the device with the most
    /// free memory that fits); it gets `CUDA_VISIBLE_DEVICES` accordingly.
    #[serde(default)]
    pub gpus: Option<crate::gpu::GpuRequest>,
    /// The device memory the model takes on each of its GPUs (`20GiB`):
    /// placement reserves it within `gpu_memory_budget`, and the worker is
    /// told its share (`BERTH_VRAM_BYTES`, and JAX's
    /// `XLA_PYTHON_CLIENT_MEM_FRACTION`), so frameworks that preallocate take that
    /// much and no more. Without it, a model is placed by what it last
    /// measured (or its weights' size) and JAX is told not to preallocate.
    #[serde(default, with = "crate::units::bytes_opt")]
    pub vram: Option<u64>,
    /// On `gpus`: a worker whose processes hold no device memory once
    /// loaded (a framework that fell back to the CPU) fails its load
    /// instead of serving with a warning.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_gpu_memory: bool,
    /// Requests sent to the worker at once (default 8).
    #[serde(default)]
    pub max_concurrency: Option<usize>,
    /// Requests waiting beyond that before new ones are refused (default 64).
    #[serde(default)]
    pub max_queue: Option<usize>,
    /// Who goes first when models wait for room (default 0; higher first):
    /// a waiting model of higher priority takes a busy one's room once that
    /// one's least turn is over, not its most.
    #[serde(default)]
    pub priority: i32,
    /// How it gives its GPU back without losing its process
    /// (`"driver"`: the CUDA driver's checkpoint API moves its device memory
    /// into its host memory); unset: it cannot be put to sleep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<SleepMode>,
    /// The folder `model` must resolve inside, checked again at every load
    /// (with symlinks resolved, and the resolved path is what the worker
    /// opens): set for models registered over HTTP, so a path checked at
    /// registration cannot be swapped for a symlink to elsewhere later.
    #[serde(skip)]
    pub confine: Option<PathBuf>,
}

/// How a model sleeps (`sleep` in its spec).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SleepMode {
    /// The CUDA driver's checkpoint API (CUDA 12.8+ drivers, Linux), on
    /// every process of the worker that holds device memory: any framework,
    /// without its knowing.
    Driver,
    /// The server's own sleep and wake routes (`http.sleep`: vLLM's,
    /// SGLang's); what it leaves on the GPU is measured and reported.
    Server,
}

impl ModelSpec {
    pub fn new(name: impl Into<String>, backend: impl Into<String>) -> Self {
        ModelSpec {
            name: name.into(),
            backend: backend.into(),
            model: None,
            options: BTreeMap::new(),
            load_timeout: None,
            worker_binary: None,
            worker: None,
            env: Vec::new(),
            command: None,
            cwd: None,
            http: None,
            aliases: Vec::new(),
            load_mode: None,
            keep_alive: None,
            memory_limit: None,
            stall_timeout: None,
            gpus: None,
            vram: None,
            require_gpu_memory: false,
            max_rss: None,
            max_requests: None,
            max_restarts: None,
            restart_window: None,
            max_concurrency: None,
            max_queue: None,
            priority: 0,
            sleep: None,
            confine: None,
        }
    }

    pub fn model(mut self, path: impl Into<PathBuf>) -> Self {
        self.model = Some(path.into());
        self
    }

    pub fn option(mut self, key: impl Into<String>, value: impl ToString) -> Self {
        self.options.insert(key.into(), value.to_string());
        self
    }

    pub fn load_timeout(mut self, timeout: Duration) -> Self {
        self.load_timeout = Some(timeout);
        self
    }

    pub fn worker_binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.worker_binary = Some(path.into());
        self
    }

    /// A stream-wire worker by its command line (see [`ModelSpec::command`]).
    pub fn command<S: Into<String>>(mut self, argv: impl IntoIterator<Item = S>) -> Self {
        self.command = Some(argv.into_iter().map(Into::into).collect());
        self
    }

    /// The worker's working directory (with [`command`](Self::command)).
    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cwd = Some(dir.into());
        self
    }

    /// Checks what can be checked before a process is started: the name,
    /// every duration and size against its allowed range, the environment.
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: String| {
            Err(Error::InvalidSpec {
                model: self.name.clone(),
                reason,
            })
        };
        if self.name.is_empty()
            || self.name.len() > MAX_NAME_LEN
            || self.name.starts_with('.')
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return invalid(format!(
                "a model name is 1 to {MAX_NAME_LEN} letters, digits, `-`, `_` and `.`, \
                 and does not start with `.`"
            ));
        }
        if self.aliases.len() > MAX_ALIASES {
            return invalid(format!(
                "{} aliases; a model has at most {MAX_ALIASES}",
                self.aliases.len()
            ));
        }
        if let Some(crate::gpu::GpuRequest::Devices(gpus)) = &self.gpus {
            let mut seen = gpus.clone();
            seen.sort_unstable();
            seen.dedup();
            if gpus.len() > MAX_GPUS || seen.len() != gpus.len() {
                return invalid(format!(
                    "`gpus` lists {} devices; give each at most once, at most {MAX_GPUS}",
                    gpus.len()
                ));
            }
        }
        for (i, alias) in self.aliases.iter().enumerate() {
            if alias == &self.name || self.aliases[..i].contains(alias) {
                return invalid(format!("alias `{alias}` is given twice"));
            }
            // Any name a client may send in `model` (llama-swap's IDs hold
            // spaces: "GPT-OSS 20B Vulkan"), but one that reads the same in
            // a log and a table: no control characters, no other spacing,
            // no space at either end.
            if alias.is_empty()
                || alias.len() > MAX_NAME_LEN
                || alias.trim() != alias
                || alias
                    .chars()
                    .any(|c| c.is_control() || (c.is_whitespace() && c != ' '))
            {
                return invalid(format!(
                    "alias `{}` is not a name: 1 to {MAX_NAME_LEN} characters, no control \
                     characters, tabs or line breaks, and no space at either end",
                    crate::input::quote(alias)
                ));
            }
        }
        if let Some(mode) = &self.load_mode
            && mode != "mmap"
            && mode != "read"
        {
            return invalid(format!("load_mode `{mode}` is not `mmap` or `read`"));
        }
        let durations = [
            ("load_timeout", self.load_timeout),
            ("keep_alive", self.keep_alive),
            ("stall_timeout", self.stall_timeout),
            ("restart_window", self.restart_window),
        ];
        for (field, value) in durations {
            if let Err(reason) = check_duration(field, value) {
                return invalid(reason);
            }
        }
        for (field, value) in [
            ("memory_limit", self.memory_limit),
            ("max_rss", self.max_rss),
            ("vram", self.vram),
        ] {
            if let Err(reason) = check_bytes(field, value) {
                return invalid(reason);
            }
        }
        match (self.vram, &self.gpus) {
            (Some(0), _) => {
                return invalid("vram 0 is no share of a GPU: give its size, as `4GiB`".into());
            }
            (Some(_), None) => {
                return invalid(
                    "vram is the memory the model takes on its GPUs: set `gpus` too \
                     (`gpus = \"auto\"`)"
                        .into(),
                );
            }
            _ => {}
        }
        if self.require_gpu_memory && self.gpus.is_none() {
            return invalid(
                "require_gpu_memory checks a model placed on GPUs: set `gpus` too \
                 (`gpus = \"auto\"`)"
                    .into(),
            );
        }
        if let Some(n) = self.max_concurrency
            && !(1..=MAX_CONCURRENCY).contains(&n)
        {
            return invalid(format!(
                "max_concurrency {n} is out of range: 1 to {MAX_CONCURRENCY}"
            ));
        }
        if let Some(n) = self.max_queue
            && n > MAX_QUEUE
        {
            return invalid(format!("max_queue {n} is out of range: 0 to {MAX_QUEUE}"));
        }
        // A model on a declared kind may be an HTTP server's, which has
        // no backend: `validate_for` checks it against the kind.
        if self.backend.trim().is_empty() && self.http.is_none() && self.worker.is_none() {
            return invalid("no backend given".into());
        }
        if let Some(http) = &self.http {
            if self.command.is_none() {
                return invalid(
                    "`http` says how to reach a server started by `command`; give the command"
                        .into(),
                );
            }
            http.check().map_err(|reason| Error::InvalidSpec {
                model: self.name.clone(),
                reason,
            })?;
        }
        if self.options.len() > MAX_OPTIONS {
            return invalid(format!(
                "{} options; a model takes at most {MAX_OPTIONS}",
                self.options.len()
            ));
        }
        for (key, value) in &self.options {
            if key.is_empty() || key.len() > MAX_OPTION_NAME {
                return invalid(format!(
                    "option names are 1 to {MAX_OPTION_NAME} bytes long; `{}` is {}",
                    key.chars().take(MAX_OPTION_NAME).collect::<String>(),
                    key.len()
                ));
            }
            if value.len() > MAX_OPTION_VALUE {
                return invalid(format!(
                    "option `{key}` is {} bytes; an option's value is at most {MAX_OPTION_VALUE} \
                     (pass large data in a file inside the models directory)",
                    value.len()
                ));
            }
        }
        for (key, _) in &self.env {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return invalid(format!("`{key}` is not an environment variable name"));
            }
            if is_dangerous_env(key) {
                return invalid(format!(
                    "env `{key}` changes how the worker program is loaded or interpreted, \
                     so a model spec may not set it; an operator sets it on a worker kind \
                     in the config (`[workers.NAME] env`) and names that kind with `worker`"
                ));
            }
        }
        if let Some(path) = &self.model
            && !path.exists()
        {
            return invalid(format!("model path `{}` does not exist", path.display()));
        }
        if let Some(path) = &self.worker_binary
            && !path.is_file()
        {
            return invalid(format!("worker binary `{}` does not exist", path.display()));
        }
        if let Some(argv) = &self.command {
            check_command(argv).map_err(|reason| Error::InvalidSpec {
                model: self.name.clone(),
                reason,
            })?;
            if self.worker_binary.is_some() || self.worker.is_some() {
                return invalid(
                    "`command` names the worker program, so `worker_binary` and `worker` \
                     cannot be given with it; keep one"
                        .into(),
                );
            }
        }
        if let Some(dir) = &self.cwd
            && !dir.is_dir()
        {
            return invalid(format!("cwd `{}` is not a directory", dir.display()));
        }
        Ok(())
    }

    /// The HTTP server settings of this model: its own, or its worker
    /// kind's; `None` for a berth worker.
    pub fn http_spec<'a>(&'a self, config: &'a SupervisorConfig) -> Option<&'a HttpSpec> {
        self.http.as_ref().or_else(|| {
            self.worker
                .as_ref()
                .and_then(|k| config.workers.get(k))
                .and_then(|k| k.http.as_ref())
        })
    }

    /// [`ModelSpec::validate`], and the worker kind it names is one `config`
    /// declares.
    pub fn validate_for(&self, config: &SupervisorConfig) -> Result<()> {
        self.validate()?;
        if self.backend.trim().is_empty() && self.http_spec(config).is_none() {
            return Err(Error::InvalidSpec {
                model: self.name.clone(),
                reason: "no backend given".into(),
            });
        }
        let declared = self.worker.as_ref().and_then(|k| config.workers.get(k));
        if let Some(declared) = declared {
            declared
                .check(self.worker.as_deref().unwrap_or_default())
                .map_err(|reason| Error::InvalidSpec {
                    model: self.name.clone(),
                    reason,
                })?;
        }
        // The worker gets its kind's environment and the model's together.
        let names = self.env.iter().map(|(k, _)| k.as_str()).chain(
            declared
                .into_iter()
                .flat_map(|d| d.env.keys().map(String::as_str)),
        );
        if let Some(reason) = crate::gpu::fraction_conflict(names) {
            return Err(Error::InvalidSpec {
                model: self.name.clone(),
                reason,
            });
        }
        if let Some(kind) = &self.worker
            && !config.workers.contains_key(kind)
        {
            let known: Vec<&str> = config.workers.keys().map(String::as_str).collect();
            return Err(Error::InvalidSpec {
                model: self.name.clone(),
                reason: if known.is_empty() {
                    format!(
                        "worker kind `{kind}` is not declared; the operator declares worker \
                         kinds in the config (`[workers.{kind}] binary = ...`)"
                    )
                } else {
                    format!(
                        "worker kind `{kind}` is not declared (declared: {})",
                        known.join(", ")
                    )
                },
            });
        }
        Ok(())
    }
}

/// Supervisor-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SupervisorConfig {
    /// The worker binary; default: `berth-worker` next to the running executable.
    pub worker_binary: Option<PathBuf>,
    /// Arguments `worker_binary` takes before the worker's own: `["worker"]`
    /// when it is the `berth` executable in its worker role.
    pub worker_args: Vec<String>,
    /// Spawn + handshake + load must finish within this (default 120 s).
    pub load_timeout: Duration,
    pub stop_graces: StopGraces,
    /// How long an unload waits for in-flight requests (default 30 s).
    pub drain_timeout: Duration,
    pub heartbeat_interval: Duration,
    /// A worker silent this long is killed (default 30 s).
    pub heartbeat_timeout: Duration,
    /// Keep-alive of models without their own (`None`: until unloaded).
    pub default_keep_alive: Option<Duration>,
    /// Memory all loaded models may hold together; idle models are evicted,
    /// least recently used first, to make room.
    pub memory_budget: Option<u64>,
    /// Models loaded at once; the least recently used idle one makes room.
    pub max_loaded: Option<usize>,
    /// First delay before restarting a crashed worker; it doubles per
    /// consecutive crash, up to 60 s (default 500 ms).
    pub restart_backoff: Duration,
    /// VRAM berth's workers may hold on one GPU together (placement refuses
    /// a model that would pass it).
    pub gpu_memory_budget: Option<u64>,
    /// Models registered through the HTTP API must lie under this folder.
    pub models_root: Option<PathBuf>,
    /// Worker kinds a model may name with [`ModelSpec::worker`].
    pub workers: BTreeMap<String, WorkerKind>,
    /// Largest answer (or streamed piece) a worker may send: its JSON and
    /// its bulk bytes together, whether they travel inside the message, in
    /// shared memory or in a memfd; a larger one fails its request with
    /// `input_too_large` (default 256 MiB). Also the most a request's
    /// streamed pieces may hold unread by its caller.
    pub max_response: u64,
    /// Models registered at once (default 1024): past it, a registration
    /// is refused with `catalogue_full`.
    pub max_models: usize,
    /// How long a caller waiting alone on a worker whose last answer came
    /// within this keeps polling for the answer before it parks (default
    /// 100 µs; zero never spins; a longer one is held to 1 ms). See
    /// docs/performance.md, "Core": it trades that much CPU per quick
    /// request for the wake-up a parked caller's idle vCPU costs; the
    /// caller yields its CPU between polls. The thread that reads a Rust
    /// worker's answers polls half of it after each answer before it
    /// blocks, for the same reason.
    pub answer_spin: Duration,
    /// Which models may run together (groups, a matrix of sets), checked.
    pub residency: Rules,
    /// Requests waiting for their model's load or turn, all models together
    /// (default 512); past it a request is refused with `machine_queue_full`
    /// (503, `Retry-After`).
    pub max_queue: usize,
    /// How models take turns when they cannot all have room at once.
    pub turn: Turns,
}

/// Requests that may wait for their model's load or turn, all together.
pub const DEFAULT_MAX_QUEUE: usize = 512;

/// The longest [`SupervisorConfig::answer_spin`] allowed.
pub const MAX_ANSWER_SPIN: Duration = Duration::from_millis(1);

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            worker_binary: None,
            worker_args: Vec::new(),
            load_timeout: Duration::from_secs(120),
            stop_graces: StopGraces::default(),
            drain_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(30),
            default_keep_alive: None,
            memory_budget: None,
            max_loaded: None,
            models_root: None,
            workers: BTreeMap::new(),
            max_response: 256 << 20,
            max_models: DEFAULT_MAX_MODELS,
            answer_spin: Duration::from_micros(100),
            restart_backoff: Duration::from_millis(500),
            gpu_memory_budget: None,
            residency: Rules::default(),
            max_queue: DEFAULT_MAX_QUEUE,
            turn: Turns::default(),
        }
    }
}

#[cfg(test)]
mod tests;
