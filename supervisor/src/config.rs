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
    /// Backend options (`KEY=VALUE`).
    #[serde(default)]
    pub options: BTreeMap<String, String>,
    /// Overrides [`SupervisorConfig::load_timeout`].
    #[serde(default, with = "humantime_serde_opt")]
    pub load_timeout: Option<Duration>,
    /// Overrides [`SupervisorConfig::worker_binary`]: a host's own worker.
    #[serde(default)]
    pub worker_binary: Option<PathBuf>,
    /// Extra environment for the worker (`CUDA_VISIBLE_DEVICES`, ...).
    #[serde(default)]
    pub env: Vec<(String, String)>,
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
        }
    }
}

/// Parses `120`, `120s`, `2m`, `1h 30m`, `500ms`: a bare number is seconds.
pub fn parse_duration(text: &str) -> std::result::Result<Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<f64>() {
        if secs.is_finite() && secs >= 0.0 {
            return Ok(Duration::from_secs_f64(secs));
        }
        return Err(format!("`{text}` is not a duration"));
    }
    humantime::parse_duration(text)
        .map_err(|e| format!("`{text}` is not a duration ({e}); try 30s, 5m, 500ms"))
}

mod humantime_serde_opt {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        let text: Option<String> = Option::deserialize(d)?;
        text.map(|t| super::parse_duration(&t).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_take_bare_seconds_and_units() {
        assert_eq!(parse_duration("120").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("2s").unwrap(), Duration::from_secs(2));
        assert_eq!(parse_duration("5m").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert!(parse_duration("soon").unwrap_err().contains("soon"));
        assert!(parse_duration("-1").is_err());
    }

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
