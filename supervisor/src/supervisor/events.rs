//! What happens to the models, as typed events a program can follow:
//! `Supervisor::events()` in a library host, `GET /api/events` (server-sent
//! events) from the sidecar, `berth events` from the CLI.
//!
//! Every event gets the next number (from 1) and the time; the last
//! [`HISTORY`] stay in memory so a follower that reconnects resumes where
//! it left off (`since`). Followers share one bounded ring
//! (`tokio::sync::broadcast`): emitting never waits for a reader and costs
//! the same whether nobody or a hundred follow; a follower that falls more
//! than [`HISTORY`] events behind is told how many it missed, and its
//! stream ends, rather than hold memory for it.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::base::KillCause;
use crate::report::{LoadReport, UnloadReport};

use super::{LastExit, SwapReport};

/// Events kept for followers that resume, and the most a live follower
/// may fall behind.
pub const HISTORY: usize = 1024;

/// One thing that happened, numbered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Event {
    /// 1, 2, 3, ... in the order they happened; `since` takes it.
    pub id: u64,
    pub at_unix_ms: u64,
    #[serde(flatten)]
    pub what: EventKind,
}

/// What happened. Serialised with `"type"` naming the variant.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    /// `berth serve` took its listener.
    ServerStarted {
        listen: String,
        version: String,
    },
    /// An in-place upgrade began (`trigger`: what asked): berth stops
    /// accepting (new connections wait in the backlog), waits for what is
    /// in flight, and hands its workers to `binary`.
    UpgradeStarted {
        trigger: String,
        binary: String,
    },
    /// The upgrade was called off before the exec; berth serves on as it
    /// was, every model with it.
    UpgradeFailed {
        binary: String,
        reason: String,
    },
    /// A new binary took over: `from` and `to` are each build's version
    /// (and mark), `adopted` the workers it took over, `lost` those it
    /// could not (each with why), `held_ms` how long new connections waited.
    Upgraded {
        from: String,
        to: String,
        adopted: Vec<String>,
        lost: Vec<String>,
        held_ms: u64,
        /// Set when the new binary could not serve and this one, the old,
        /// took its workers back: why.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fell_back: Option<String>,
    },
    /// `berth serve` began to drain: no new work, every model unloads.
    ServerDraining,
    /// Every worker has stopped; the process exits.
    ServerStopped,
    /// The config was reloaded (`trigger`: what asked), and what changed.
    ConfigReloaded {
        trigger: String,
        report: Box<crate::report::ReloadReport>,
    },
    /// A reload was refused (the new config did not read or check):
    /// nothing changed.
    ConfigRejected {
        trigger: String,
        error: String,
    },
    Registered {
        model: String,
    },
    Deregistered {
        model: String,
    },
    /// A worker is starting for the model (`restart`: after a crash).
    Loading {
        model: String,
        restart: bool,
    },
    Loaded {
        model: String,
        report: Box<LoadReport>,
    },
    LoadFailed {
        model: String,
        error: String,
    },
    /// The model was put to sleep: its processes' device memory moved to
    /// their host memory, NVML's figures before and after.
    Slept {
        model: String,
        report: Box<super::sleep::state::SleepReport>,
    },
    /// The model woke: its memory back on the GPU, how long that took.
    Woke {
        model: String,
        report: Box<super::sleep::state::WakeReport>,
    },
    /// A sleep or wake's step failed, and what was done instead (stopped;
    /// after a wake, loaded cold).
    SleepFailed {
        model: String,
        step: String,
        error: String,
        fallback: String,
    },
    /// The model's worker stopped: what came back, and the proof.
    Unloaded {
        model: String,
        report: Box<UnloadReport>,
    },
    /// A model gave its room up (its `unloaded` comes first): for
    /// `for_model`'s load, or (`null`) because the loaded models grew past
    /// a budget. `reason`: `idle`, `turn_over` (its most turn was over
    /// while another waited: it finished what it had in flight first),
    /// `priority` (a waiter of higher priority, past its least turn),
    /// `gpu` (the GPU placement chose it), `residency` (its groups, matrix
    /// or fixed port); `ran_ms` and `served`: its turn, how long and how
    /// many requests; `sleep`, for a model that can sleep, whether it was
    /// put to sleep instead of stopped, and why.
    Evicted {
        model: String,
        for_model: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sleep: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ran_ms: Option<u64>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        served: Option<u64>,
    },
    /// Unloaded (its `unloaded` comes first) because it sat idle past its
    /// keep-alive.
    KeepAliveExpired {
        model: String,
    },
    SwapBegun {
        model: String,
    },
    SwapCompleted {
        model: String,
        report: Box<SwapReport>,
    },
    /// The new worker failed; the old one keeps serving.
    SwapRolledBack {
        model: String,
        error: String,
    },
    /// A worker past `max_rss` or `max_requests` is being replaced.
    Recycling {
        model: String,
        pid: u32,
        why: String,
    },
    Recycled {
        model: String,
        old_pid: u32,
        new_pid: u32,
    },
    RecycleFailed {
        model: String,
        error: String,
    },
    /// A worker died unplanned: its pid, exit, the cause if it was
    /// killed, a sentence, and its last stderr lines.
    Crashed {
        model: String,
        #[serde(flatten)]
        exit: LastExit,
    },
    /// The worker passed its memory limit and was killed (a `crashed`
    /// follows).
    MemoryLimitExceeded {
        model: String,
        pid: u32,
        limit_bytes: u64,
        peak_bytes: u64,
    },
    /// The worker stopped making progress or answering heartbeats and was
    /// killed (a `crashed` follows).
    HangDetected {
        model: String,
        pid: u32,
        cause: KillCause,
    },
    /// Requests in flight at two deaths in a row: refused from now on.
    Quarantined {
        model: String,
        requests: usize,
    },
    Restarting {
        model: String,
        in_ms: u64,
    },
    Restarted {
        model: String,
        pid: u32,
    },
    /// Crashed too often: no more restarts until loaded by hand.
    Failed {
        model: String,
        reason: String,
    },
    /// Unloaded while waiting out a crash's backoff: no restart comes.
    RestartCancelled {
        model: String,
    },
    /// A failed model unloaded: its failure is cleared, nothing ran.
    FailureCleared {
        model: String,
    },
    /// Something looks wrong about a loaded worker without failing it
    /// (`code` `gpu_unused`: placed on a GPU, it holds no GPU memory).
    Warning {
        model: String,
        pid: u32,
        #[serde(flatten)]
        warning: crate::report::Warning,
    },
    /// Idle models could not be evicted for GPU memory: berth's workers hold
    /// more than the per-GPU budget (a model grew, or a first load was
    /// larger than expected), and every model there is busy. Said at most
    /// once a minute while it lasts.
    GpuBudgetOverrun {
        gpu: u32,
        held_bytes: u64,
        budget_bytes: u64,
        message: String,
    },
}

/// The event log: the recent history and the followers' ring.
pub(super) struct Events {
    history: Mutex<VecDeque<Event>>,
    live: broadcast::Sender<Event>,
}

impl Default for Events {
    fn default() -> Self {
        Events {
            history: Mutex::new(VecDeque::with_capacity(HISTORY)),
            live: broadcast::Sender::new(HISTORY),
        }
    }
}

impl Events {
    pub(super) fn emit(&self, what: EventKind) {
        let at_unix_ms = crate::base::unix_ms();
        // Numbered and sent under the history's lock, so followers see
        // events in their numbers' order.
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let id = history.back().map(|e| e.id + 1).unwrap_or(1);
        let event = Event {
            id,
            at_unix_ms,
            what,
        };
        if history.len() == HISTORY {
            history.pop_front();
        }
        history.push_back(event.clone());
        // No follower: nothing to do.
        let _ = self.live.send(event);
    }

    /// The number of the last event (0 before the first).
    pub(super) fn last_id(&self) -> u64 {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        history.back().map_or(0, |e| e.id)
    }

    /// Every event kept.
    pub(super) fn kept(&self) -> Vec<Event> {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        history.iter().cloned().collect()
    }

    /// Takes up the log a previous process of this berth kept (an in-place
    /// upgrade): numbering goes on from its last event.
    pub(super) fn resume(&self, events: Vec<Event>) {
        let mut history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let mine: Vec<Event> = history.drain(..).collect();
        let last = events.last().map_or(0, |e| e.id);
        let skip = events.len().saturating_sub(HISTORY);
        history.extend(events.into_iter().skip(skip));
        // Anything this process said before it took the log up follows it.
        for (n, mut event) in mine.into_iter().enumerate() {
            event.id = last + 1 + n as u64;
            if history.len() == HISTORY {
                history.pop_front();
            }
            history.push_back(event);
        }
    }

    /// The events after `since` that are still kept, how many after it are
    /// not, and the live events that follow them.
    pub(super) fn follow(&self, since: u64) -> Follow {
        let history = self.history.lock().unwrap_or_else(|e| e.into_inner());
        let live = self.live.subscribe();
        // A number past the last is from another run of the supervisor
        // (numbers start at 1 each run): everything kept is new to it.
        let since = if history.back().is_some_and(|e| e.id < since) {
            0
        } else {
            since
        };
        let backlog: VecDeque<Event> = history.iter().filter(|e| e.id > since).cloned().collect();
        let first_kept = backlog
            .front()
            .map(|e| e.id)
            .unwrap_or_else(|| history.back().map(|e| e.id + 1).unwrap_or(1));
        Follow {
            missed: first_kept.saturating_sub(since + 1),
            backlog,
            live,
            ended: false,
        }
    }
}

/// A follower's view: first what it missed, then events as they happen.
#[derive(Debug)]
pub struct Follow {
    /// Events after `since` that are no longer kept (0 when none).
    pub missed: u64,
    backlog: VecDeque<Event>,
    live: broadcast::Receiver<Event>,
    ended: bool,
}

/// What a follower gets next.
#[derive(Debug)]
pub enum Followed {
    Event(Event),
    /// It fell this many events behind and is dropped: nothing more comes.
    FellBehind(u64),
    /// The supervisor is gone.
    Closed,
}

impl Follow {
    /// True once the kept events it started with have been taken.
    pub fn caught_up(&self) -> bool {
        self.backlog.is_empty()
    }

    pub async fn next(&mut self) -> Followed {
        if self.ended {
            return Followed::Closed;
        }
        if let Some(event) = self.backlog.pop_front() {
            return Followed::Event(event);
        }
        match self.live.recv().await {
            Ok(event) => Followed::Event(event),
            Err(broadcast::error::RecvError::Lagged(n)) => {
                self.ended = true;
                Followed::FellBehind(n)
            }
            Err(broadcast::error::RecvError::Closed) => {
                self.ended = true;
                Followed::Closed
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registered(i: usize) -> EventKind {
        EventKind::Registered {
            model: format!("m{i}"),
        }
    }

    #[tokio::test]
    async fn a_follower_resumes_after_since_and_is_told_what_was_lost() {
        let events = Events::default();
        for i in 0..HISTORY + 10 {
            events.emit(registered(i));
        }
        // Event 5 is long gone: 11..=1034 are kept, 6..=10 are not.
        let mut follow = events.follow(5);
        assert_eq!(follow.missed, 5);
        match follow.next().await {
            Followed::Event(e) => assert_eq!(e.id, 11),
            other => panic!("{other:?}"),
        }
        let mut recent = events.follow(HISTORY as u64 + 8);
        assert_eq!(recent.missed, 0);
        let ids = [recent.next().await, recent.next().await].map(|f| match f {
            Followed::Event(e) => e.id,
            other => panic!("{other:?}"),
        });
        assert_eq!(ids, [HISTORY as u64 + 9, HISTORY as u64 + 10]);
        // Then live ones, in order.
        events.emit(registered(0));
        match recent.next().await {
            Followed::Event(e) => assert_eq!(e.id, HISTORY as u64 + 11),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_follower_that_falls_behind_is_dropped_and_costs_nothing_more() {
        let events = Events::default();
        let mut slow = events.follow(0);
        let mut keeping_up = events.follow(0);
        for i in 0..HISTORY + 5 {
            events.emit(registered(i));
            match keeping_up.next().await {
                Followed::Event(e) => assert_eq!(e.id, i as u64 + 1),
                other => panic!("{other:?}"),
            }
        }
        match slow.next().await {
            Followed::FellBehind(n) => assert_eq!(n, 5),
            other => panic!("{other:?}"),
        }
        assert!(matches!(slow.next().await, Followed::Closed));
    }
}
