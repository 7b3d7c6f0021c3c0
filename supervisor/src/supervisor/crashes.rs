//! A model's crash record, which outlives its workers: the crashes in the
//! restart window and the backoff they earn, the last unexpected exit, and
//! the requests quarantined for being in flight at two deaths in a row.
//! Pure bookkeeping; `resilience.rs` acts on it.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::base::KillCause;
use crate::child::death::Death;
use crate::config::ModelSpec;
use crate::report::ExitStatus;

/// Defaults of the crash policy.
pub const DEFAULT_MAX_RESTARTS: u32 = 5;
pub const DEFAULT_RESTART_WINDOW: Duration = Duration::from_secs(60);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// A worker that served this long resets the backoff.
const BACKOFF_RESET_AFTER: Duration = Duration::from_secs(30);

/// The last unexpected exit of a model's worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LastExit {
    pub pid: u32,
    pub exit: ExitStatus,
    /// Set when the supervisor or the kernel killed it (memory limit, stall).
    pub cause: Option<KillCause>,
    /// What happened, in a sentence.
    pub description: String,
    pub stderr_tail: Vec<String>,
    pub at_unix_s: u64,
}

/// A model's crash record; it outlives its workers.
#[derive(Debug, Default)]
pub(super) struct CrashHistory {
    crashes: VecDeque<Instant>,
    consecutive: u32,
    pub last_exit: Option<LastExit>,
    last_in_flight: Vec<u64>,
    quarantine: HashSet<u64>,
    /// After a failed load: when a request may start the next one, and
    /// the error it failed with. A load by hand does not wait.
    pub load_backoff: Option<(Instant, String)>,
}

impl CrashHistory {
    pub fn is_quarantined(&self, hash: u64) -> bool {
        self.quarantine.contains(&hash)
    }

    /// Forgets quarantined requests: they were poison for other weights.
    pub(super) fn clear_quarantine(&mut self) {
        self.quarantine.clear();
        self.last_in_flight.clear();
    }

    /// Records how a worker died and quarantines the requests that were in
    /// flight at this death and the one before; returns how many it newly
    /// quarantined.
    pub(super) fn note_death(&mut self, model: &str, pid: u32, death: &Death) -> usize {
        let description = match &death.cause {
            Some(cause) => format!("worker pid {pid} was {cause} ({})", death.exit),
            None => format!("worker pid {pid} {}", death.exit),
        };
        let mut quarantined = 0;
        for hash in death
            .in_flight
            .iter()
            .filter(|h| self.last_in_flight.contains(h))
        {
            if self.quarantine.insert(*hash) {
                quarantined += 1;
                tracing::warn!(
                    model,
                    "a request was in flight at two worker deaths in a row; it is quarantined"
                );
            }
        }
        self.last_in_flight = death.in_flight.clone();
        self.last_exit = Some(LastExit {
            pid,
            exit: death.exit.clone(),
            cause: death.cause.clone(),
            description,
            stderr_tail: death.stderr_tail.clone(),
            at_unix_s: crate::base::unix_ms() / 1000,
        });
        quarantined
    }

    /// Counts a crash; returns the backoff before the next start, or `None`
    /// once the intensity cap is passed.
    pub(super) fn next_restart(
        &mut self,
        served: Duration,
        spec: &ModelSpec,
        base: Duration,
    ) -> Option<Duration> {
        if served >= BACKOFF_RESET_AFTER {
            self.consecutive = 0;
        }
        let now = Instant::now();
        let window = spec.restart_window.unwrap_or(DEFAULT_RESTART_WINDOW);
        self.crashes.push_back(now);
        while self
            .crashes
            .front()
            .is_some_and(|t| now.duration_since(*t) > window)
        {
            self.crashes.pop_front();
        }
        if self.crashes.len() as u32 > spec.max_restarts.unwrap_or(DEFAULT_MAX_RESTARTS) {
            return None;
        }
        let delay = base
            .saturating_mul(1 << self.consecutive.min(16))
            .min(MAX_BACKOFF);
        self.consecutive += 1;
        Some(delay)
    }

    /// A load failed with `error`: it counts as a crash toward
    /// `max_restarts` within `restart_window`, and earns the same backoff
    /// before a request may start another. Returns the backoff, or `None`
    /// once the cap is passed (the model is then failed until loaded by
    /// hand).
    pub(super) fn load_failed(
        &mut self,
        error: &str,
        spec: &ModelSpec,
        base: Duration,
    ) -> Option<Duration> {
        self.last_exit = Some(LastExit {
            pid: 0,
            exit: ExitStatus::Code(-1),
            cause: None,
            description: format!("its load failed: {error}"),
            stderr_tail: Vec::new(),
            at_unix_s: crate::base::unix_ms() / 1000,
        });
        let delay = self.next_restart(Duration::ZERO, spec, base);
        self.load_backoff = delay.map(|d| (Instant::now() + d, error.to_string()));
        delay
    }

    /// A load succeeded: requests no longer wait for a backoff.
    pub(super) fn load_succeeded(&mut self) {
        self.load_backoff = None;
    }

    /// When a request may start the next load, and why it waits; `None`
    /// when it may now.
    pub(super) fn load_wait(&self) -> Option<(Duration, &str)> {
        let (at, error) = self.load_backoff.as_ref()?;
        let left = at.saturating_duration_since(Instant::now());
        (!left.is_zero()).then_some((left, error.as_str()))
    }

    pub(super) fn failure(&self, spec: &ModelSpec) -> String {
        format!(
            "more than {} crashes within {}; last: {}",
            spec.max_restarts.unwrap_or(DEFAULT_MAX_RESTARTS),
            crate::units::format_duration(spec.restart_window.unwrap_or(DEFAULT_RESTART_WINDOW)),
            self.last_exit
                .as_ref()
                .map(|e| e.description.as_str())
                .unwrap_or("unknown")
        )
    }
}
