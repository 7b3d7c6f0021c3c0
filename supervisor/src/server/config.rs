//! `berth serve`'s configuration file (TOML).
//!
//! ```toml
//! listen = "127.0.0.1:7733"     # or "unix:/run/berth.sock", or "0.0.0.0:7733" with a token
//! token = "s3cret"              # bearer token; required off loopback
//! memory_budget = "8GiB"
//! max_loaded = 4
//! keep_alive = "5m"             # default for models without their own
//! models_dir = "/var/lib/berth/models"
//!
//! [[model]]
//! name = "minilm"
//! backend = "embed"
//! model = "/var/lib/berth/models/all-MiniLM-L6-v2"
//! keep_alive = "10m"
//! memory_limit = "1GiB"
//! load_mode = "mmap"
//! options = { threads = 2 }
//! ```

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::config::ModelSpec;

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7733";
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(300);

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    #[serde(default)]
    pub listen: Option<String>,
    #[serde(default)]
    pub token: Option<String>,
    #[serde(default, with = "crate::units::bytes_opt")]
    pub memory_budget: Option<u64>,
    #[serde(default)]
    pub max_loaded: Option<usize>,
    /// VRAM berth's workers may hold on one GPU together.
    #[serde(default, with = "crate::units::bytes_opt")]
    pub gpu_memory_budget: Option<u64>,
    #[serde(default, with = "crate::units::duration_opt")]
    pub keep_alive: Option<Duration>,
    #[serde(default)]
    pub models_dir: Option<PathBuf>,
    #[serde(default, with = "crate::units::duration_opt")]
    pub load_timeout: Option<Duration>,
    #[serde(default, with = "crate::units::duration_opt")]
    pub drain_timeout: Option<Duration>,
    /// Largest request body accepted (default 16 MiB).
    #[serde(default, with = "crate::units::bytes_opt")]
    pub max_body: Option<u64>,
    /// Where the supervisor records its workers, so the next one can stop
    /// what it leaves if it is killed (default: under `~/.cache/berth/run/`).
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// First restart delay after a crash (default 500 ms, doubling to 60 s).
    #[serde(default, with = "crate::units::duration_opt")]
    pub restart_backoff: Option<Duration>,
    #[serde(default, rename = "model")]
    pub models: Vec<ModelSpec>,
}

impl ServeConfig {
    pub fn from_file(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        let config: ServeConfig = toml::from_str(&text)
            .map_err(|e| format!("`{}` is not a valid berth config: {e}", path.display()))?;
        let mut seen = std::collections::HashSet::new();
        for model in &config.models {
            if !seen.insert(&model.name) {
                return Err(format!(
                    "`{}`: model `{}` is listed twice",
                    path.display(),
                    model.name
                ));
            }
        }
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_with_human_units_parses() {
        let config: ServeConfig = toml::from_str(
            r#"
            listen = "127.0.0.1:9000"
            memory_budget = "2GiB"
            keep_alive = "5m"
            [[model]]
            name = "hog"
            backend = "hog"
            keep_alive = "1s"
            memory_limit = "512MiB"
            options = { alloc_mib = 64, verbose = true }
            "#,
        )
        .unwrap();
        assert_eq!(config.memory_budget, Some(2 << 30));
        assert_eq!(config.keep_alive, Some(Duration::from_secs(300)));
        let hog = &config.models[0];
        assert_eq!(hog.keep_alive, Some(Duration::from_secs(1)));
        assert_eq!(hog.memory_limit, Some(512 << 20));
        assert_eq!(hog.options["alloc_mib"], "64");
        assert_eq!(hog.options["verbose"], "true");
    }

    #[test]
    fn unknown_keys_are_refused() {
        let err = toml::from_str::<ServeConfig>("lisen = \"x\"").unwrap_err();
        assert!(err.to_string().contains("lisen"), "{err}");
    }
}
