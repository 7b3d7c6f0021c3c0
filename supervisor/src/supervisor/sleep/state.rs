//! What a sleep leaves in the state and tells: where a model is in its
//! sleep, and the reports of a sleep and a wake.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::config::SleepMode;

/// Where a model is in its sleep.
#[derive(Debug, Clone)]
pub(in crate::supervisor) enum SleepPhase {
    /// Draining and being checkpointed.
    Falling,
    /// Asleep (`mode`): the processes checkpointed, or the server's.
    Asleep {
        pids: Vec<u32>,
        since: Instant,
        mode: SleepMode,
    },
    /// Being restored.
    Waking,
}

/// What a sleep did, and its proof.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SleepReport {
    pub model: String,
    /// The worker's pid, the same before and after.
    pub pid: u32,
    /// The processes checkpointed: those NVML showed holding device memory.
    pub pids: Vec<u32>,
    /// What NVML read for them before and after.
    pub vram_before_bytes: u64,
    pub vram_after_bytes: u64,
    /// The worker's resident memory before and after: the device memory's
    /// copy is its host memory now (counted in `memory_budget`).
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    /// How long its requests took to finish, and the driver's steps.
    pub drain_ms: f64,
    pub checkpoint_ms: f64,
}

/// What a wake did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WakeReport {
    pub model: String,
    pub pid: u32,
    /// What NVML reads for its processes once restored.
    pub vram_bytes: u64,
    /// The driver's steps (restore, unlock).
    pub restore_ms: f64,
    /// How long it had slept.
    pub slept_s: f64,
    /// Why it woke: `request` or `asked`.
    pub reason: String,
}

impl std::fmt::Display for SleepReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} asleep (pid {}): GPU {} -> {} per NVML, RSS {} -> {}; drained in {:.0} ms, \
             checkpointed in {:.0} ms",
            self.model,
            self.pid,
            crate::units::mib(self.vram_before_bytes),
            crate::units::mib(self.vram_after_bytes),
            crate::units::mib(self.rss_before_bytes),
            crate::units::mib(self.rss_after_bytes),
            self.drain_ms,
            self.checkpoint_ms
        )
    }
}

impl std::fmt::Display for WakeReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} awake (pid {}): GPU {} per NVML, restored in {:.0} ms after {:.1} s asleep",
            self.model,
            self.pid,
            crate::units::mib(self.vram_bytes),
            self.restore_ms,
            self.slept_s
        )
    }
}
