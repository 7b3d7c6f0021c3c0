//! A model's turn when models contend for the machine: how long it keeps
//! its room once loaded while another waits (`[turn]` in the config).

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How long a model keeps its room once loaded, when another waits for it
/// (`[turn]` in the config). Each bound defaults to one that fits the
/// model's measured load time, so a load of seconds is worth its while.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Turns {
    /// The least: before it, a busy model keeps its room, even against a
    /// waiter of higher priority (default: its load time, 1 s at least).
    #[serde(default, with = "crate::units::duration_opt")]
    pub min: Option<Duration>,
    /// The most: a busy model takes new requests for this long while
    /// another waits, then finishes what it has in flight and yields
    /// (default: four times its load time, 5 s at least).
    #[serde(default, with = "crate::units::duration_opt")]
    pub max: Option<Duration>,
}

impl Turns {
    /// The most time a model whose load took `load_time` may serve new
    /// requests while another waits.
    pub fn max_for(&self, load_time: Duration) -> Duration {
        self.max
            .unwrap_or_else(|| Duration::from_secs(5).max(load_time.saturating_mul(4)))
    }

    /// The least time it keeps its room once loaded.
    pub fn min_for(&self, load_time: Duration) -> Duration {
        self.min
            .unwrap_or_else(|| Duration::from_secs(1).max(load_time))
            .min(self.max_for(load_time))
    }
}
