//! What to run and how: a model's spec and the supervisor's settings.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::worker::stop::StopGraces;

/// One model: which backend, which weights, which options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The name requests use. Letters, digits, `-`, `_`, `.`.
    pub name: String,
    /// A backend of the worker binary (`echo`, `hog`, `fault`, ...).
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
    #[serde(default)]
    pub worker_binary: Option<PathBuf>,
    /// Extra environment for the worker (`CUDA_VISIBLE_DEVICES`, ...).
    #[serde(default)]
    pub env: Vec<(String, String)>,
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
    /// Requests sent to the worker at once (default 8).
    #[serde(default)]
    pub max_concurrency: Option<usize>,
    /// Requests waiting beyond that before new ones are refused (default 64).
    #[serde(default)]
    pub max_queue: Option<usize>,
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
            env: Vec::new(),
            load_mode: None,
            keep_alive: None,
            memory_limit: None,
            stall_timeout: None,
            gpus: None,
            max_rss: None,
            max_requests: None,
            max_restarts: None,
            restart_window: None,
            max_concurrency: None,
            max_queue: None,
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

    /// Checks what can be checked before a process is started.
    pub fn validate(&self) -> Result<()> {
        let invalid = |reason: String| {
            Err(Error::InvalidSpec {
                model: self.name.clone(),
                reason,
            })
        };
        if self.name.is_empty()
            || !self
                .name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        {
            return invalid(
                "a model name is letters, digits, `-`, `_` and `.`, and not empty".into(),
            );
        }
        if let Some(mode) = &self.load_mode
            && mode != "mmap"
            && mode != "read"
        {
            return invalid(format!("load_mode `{mode}` is not `mmap` or `read`"));
        }
        if self.max_concurrency == Some(0) {
            return invalid("max_concurrency must be at least 1".into());
        }
        if self.backend.trim().is_empty() {
            return invalid("no backend given".into());
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
        Ok(())
    }
}

/// Supervisor-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SupervisorConfig {
    /// The worker binary; default: `berth-worker` next to the running executable.
    pub worker_binary: Option<PathBuf>,
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
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            worker_binary: None,
            load_timeout: Duration::from_secs(120),
            stop_graces: StopGraces::default(),
            drain_timeout: Duration::from_secs(30),
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(30),
            default_keep_alive: None,
            memory_budget: None,
            max_loaded: None,
            models_root: None,
            restart_backoff: Duration::from_millis(500),
            gpu_memory_budget: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_before_anything_starts() {
        assert!(ModelSpec::new("mini-lm_2.v1", "echo").validate().is_ok());
        for bad in ["", "has space", "a/b"] {
            let err = ModelSpec::new(bad, "echo").validate().unwrap_err();
            assert_eq!(err.kind(), "invalid_spec", "{bad:?}");
        }
        let err = ModelSpec::new("m", "embed")
            .model("/nonexistent/dir")
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("/nonexistent/dir"), "{err}");
    }
}
