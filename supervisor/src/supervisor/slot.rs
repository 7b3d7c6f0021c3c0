//! A model's slot and its catalogue entry.
//!
//! The slot is the state machine of a loaded (or loading) model; every
//! change of its state is one of the transitions below, each a method here,
//! so the rules live in one place:
//!
//! | event | from | to |
//! |---|---|---|
//! | begin load ([`Slot::loading`]) | (no slot) | Loading |
//! | [`Slot::install`]: a load or restart is done | Loading | Ready |
//! | [`Slot::begin_swap`]: a swap or recycle starts | Ready | Ready, swapping |
//! | [`Slot::reserve`]: the incoming worker is placed | swapping or Loading | same, its memory counted |
//! | [`Slot::switch_to`]: the new worker is ready | Ready, swapping | Ready, new worker (the old one retires) |
//! | [`Slot::end_swap`]: the new worker failed | Ready, swapping | Ready |
//! | [`Slot::hold`]: past `max_rss`, or died while swapping | Ready | Ready, taking no request |
//! | [`Slot::begin_restart`]: the worker died | Ready (dead) | Loading, in backoff |
//! | [`Slot::restart_starting`] / [`Slot::retry_restart`] | Loading | Loading (now / after another backoff) |
//! | [`Slot::fail`]: too many crashes | Ready (dead) or Loading | Failed, no worker |
//! | [`Slot::begin_unload`]: an unload | Ready | Draining (or the slot goes: a backoff cancelled, a failure cleared) |
//! | [`Slot::stopping`] | Draining | Stopping |
//! | [`Slot::used`]: a request ended | any | last used now, keep-alive restarted |
//! | [`Slot::yield_turn`]: another waits and its turn is over | Ready | Ready, yielding: no new request, those in flight finish |
//! | [`Slot::keep_turn`]: the yield is called off | Ready, yielding | Ready |
//!
//! A model's turn starts when its worker is in (a load, a restart, an
//! in-place upgrade's adoption): how long it has had its room, and the
//! requests it served since, are counted from there.
//!
//! The entry outlives its workers: what carries over when the spec or the
//! worker changes is decided by [`Entry::carry_over`], in one place.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Semaphore, watch};

use super::crashes;
use super::{DEFAULT_MAX_CONCURRENCY, ModelCounters, ModelState};
use crate::child::handle::WorkerHandle;
use crate::config::ModelSpec;
use crate::error::Error;
use crate::report::LoadReport;

pub(super) type LoadSignal = watch::Receiver<Option<std::result::Result<(), Arc<Error>>>>;

impl Slot {
    /// A load begins: callers wait on `signal`; `reserved_bytes` and
    /// `incoming_gpu` count the worker until it is in.
    pub(super) fn loading(
        signal: LoadSignal,
        reserved_bytes: u64,
        incoming_gpu: Option<Incoming>,
    ) -> Slot {
        Slot {
            state: ModelState::Loading,
            worker: None,
            loading: Some(signal),
            reserved_bytes,
            gpus: Vec::new(),
            incoming_gpu,
            last_used: Instant::now(),
            expires_at: None,
            swapping: false,
            hold: false,
            restart_at: None,
            failure: None,
            report: None,
            turn_started: Instant::now(),
            turn_requests: 0,
            yielding: None,
            sleep: None,
        }
    }

    /// What the slot is in, as callers see it: a ready worker that has died
    /// is `Failed` until the crash policy acts.
    pub(super) fn state(&self) -> ModelState {
        match &self.worker {
            Some(w) if !w.is_alive() && self.state == ModelState::Ready => ModelState::Failed,
            _ => self.state,
        }
    }

    /// A load or restart is done: `worker` serves from now on, and the
    /// entry records what its load measured.
    pub(super) fn install(
        &mut self,
        entry: Option<&mut Entry>,
        worker: &Arc<WorkerHandle>,
        report: &LoadReport,
    ) {
        self.state = ModelState::Ready;
        self.worker = Some(Arc::clone(worker));
        self.loading = None;
        self.restart_at = None;
        self.clear_reservation();
        self.gpus = report.gpus.clone().unwrap_or_default();
        self.report = Some(report.clone());
        self.begin_turn(entry.as_deref());
        if let Some(entry) = entry {
            entry.loaded(report);
            self.expires_at = expiry(entry.keep_alive);
        }
    }

    /// Its turn starts now.
    pub(super) fn begin_turn(&mut self, entry: Option<&Entry>) {
        self.turn_started = Instant::now();
        self.turn_requests = entry
            .map(|e| e.counters.requests.load(Ordering::Relaxed))
            .unwrap_or(0);
        self.yielding = None;
    }

    /// Another model (`for_model`) waits for its room and its turn is
    /// over: no new request reaches it (but those that waited through its
    /// load), those in flight finish, and it goes.
    pub(super) fn yield_turn(&mut self, for_model: &str) {
        self.yielding = Some(for_model.to_string());
    }

    /// The yield is called off (the model could not go): it serves on.
    pub(super) fn keep_turn(&mut self) {
        self.yielding = None;
    }

    /// Whether a request that arrived at `arrived` may be sent to it: not
    /// once it yields, but for those that waited through its load.
    pub(super) fn takes(&self, arrived: Instant) -> bool {
        self.yielding.is_none() || arrived <= self.turn_started
    }

    /// A worker an in-place upgrade handed over serves from now on, as its
    /// load left it: its entry takes what the load measured, and counts no
    /// load.
    pub(super) fn adopt(
        &mut self,
        entry: &mut Entry,
        worker: &Arc<WorkerHandle>,
        report: &LoadReport,
    ) {
        self.state = ModelState::Ready;
        self.worker = Some(Arc::clone(worker));
        self.loading = None;
        self.clear_reservation();
        self.gpus = report.gpus.clone().unwrap_or_default();
        self.report = Some(report.clone());
        self.begin_turn(Some(entry));
        entry.measured(report);
    }

    /// A swap or recycle starts; refused unless the model is ready and no
    /// other replacement is under way.
    pub(super) fn begin_swap(&mut self) -> std::result::Result<(), String> {
        if self.swapping {
            return Err("a swap of it is in progress".into());
        }
        if self.state() != ModelState::Ready {
            return Err(format!("it is {}", self.state()));
        }
        self.swapping = true;
        Ok(())
    }

    /// The incoming worker (a swap's or a restart's) is placed: count its
    /// memory until it is in, so no concurrent load takes it.
    pub(super) fn reserve(&mut self, ram: Option<u64>, incoming: Option<Incoming>) {
        if let Some(ram) = ram {
            self.reserved_bytes = ram;
        }
        self.incoming_gpu = incoming;
    }

    /// Its spawned pid: NVML's reading for it now stands for part of the
    /// GPU reservation.
    pub(super) fn note_incoming_pid(&mut self, pid: u32) {
        if let Some(incoming) = self.incoming_gpu.as_mut().filter(|i| i.pid.is_none()) {
            incoming.pid = Some(pid);
        }
    }

    /// The swap's new worker is ready: routing switches to it; the old
    /// worker and the GPUs it holds are returned to be retired.
    pub(super) fn switch_to(
        &mut self,
        new: &Arc<WorkerHandle>,
        report: &LoadReport,
    ) -> (Arc<WorkerHandle>, Vec<u32>) {
        let old = self
            .worker
            .replace(Arc::clone(new))
            .expect("a ready slot has a worker");
        let old_gpus = std::mem::replace(&mut self.gpus, report.gpus.clone().unwrap_or_default());
        self.report = Some(report.clone());
        self.state = ModelState::Ready;
        self.end_swap();
        (old, old_gpus)
    }

    /// A swap or recycle is over (or failed): the current worker serves on.
    pub(super) fn end_swap(&mut self) {
        self.swapping = false;
        self.hold = false;
        self.clear_reservation();
    }

    /// No new request for the current worker: they wait for its replacement.
    pub(super) fn hold(&mut self) {
        self.hold = true;
    }

    /// The worker died: a restart is due after `delay`; callers wait on
    /// `signal`; the model's last peak stays counted.
    pub(super) fn begin_restart(&mut self, signal: LoadSignal, delay: Duration, reserved: u64) {
        self.worker = None;
        self.hold = false;
        self.state = ModelState::Loading;
        self.loading = Some(signal);
        self.restart_at = Instant::now().checked_add(delay);
        self.reserved_bytes = reserved;
    }

    /// The backoff is over and the restart begins: callers wait for it.
    pub(super) fn restart_starting(&mut self) {
        self.restart_at = None;
    }

    /// A restart failed: another attempt after `delay`, placed afresh.
    pub(super) fn retry_restart(&mut self, delay: Duration) {
        self.incoming_gpu = None;
        self.restart_at = Instant::now().checked_add(delay);
    }

    /// Too many crashes: the model takes no request until loaded by hand,
    /// and holds nothing.
    pub(super) fn fail(&mut self, reason: String) {
        self.worker = None;
        self.hold = false;
        self.state = ModelState::Failed;
        self.loading = None;
        self.failure = Some(reason);
        self.clear_reservation();
    }

    /// An unload: what it means in the slot's state.
    pub(super) fn begin_unload(&mut self) -> Unload {
        if self.worker.is_none() && self.restart_at.is_some() {
            return Unload::CancelRestart;
        }
        if self.state == ModelState::Failed && self.worker.is_none() {
            return Unload::ClearFailure;
        }
        let Some(worker) = self.worker.clone() else {
            return Unload::Busy("it is still loading".into());
        };
        if self.swapping {
            return Unload::Busy("a swap is in progress".into());
        }
        if matches!(self.state, ModelState::Draining | ModelState::Stopping) {
            return Unload::Busy(format!("it is already {}", self.state));
        }
        match self.sleep {
            Some(
                super::sleep::state::SleepPhase::Falling | super::sleep::state::SleepPhase::Waking,
            ) => {
                return Unload::Busy("it is falling asleep or waking".into());
            }
            // Stopped asleep: killed (its stop sees the worker asleep).
            Some(super::sleep::state::SleepPhase::Asleep { .. }) | None => self.sleep = None,
        }
        self.state = ModelState::Draining;
        Unload::Drain(worker)
    }

    /// Drained: the worker is being stopped.
    pub(super) fn stopping(&mut self) {
        self.state = ModelState::Stopping;
    }

    /// Asleep, and neither falling asleep nor waking: it may be stopped
    /// (an unload, its keep-alive, an eviction) or woken.
    pub(super) fn is_asleep(&self) -> bool {
        self.state == ModelState::Asleep
            && matches!(
                self.sleep,
                Some(super::sleep::state::SleepPhase::Asleep { .. })
            )
            && self.loading.is_none()
    }

    /// A request ended: the model was just used, and its keep-alive starts
    /// again.
    pub(super) fn used(&mut self, keep_alive: Option<Duration>) {
        self.last_used = Instant::now();
        self.expires_at = expiry(keep_alive);
    }

    fn clear_reservation(&mut self) {
        self.reserved_bytes = 0;
        self.incoming_gpu = None;
    }
}

/// What an unload does, given the slot's state.
pub(super) enum Unload {
    /// Drain and stop this worker.
    Drain(Arc<WorkerHandle>),
    /// A crashed model waiting out its backoff: the restart is cancelled.
    CancelRestart,
    /// A failed model: nothing runs; its failure is cleared.
    ClearFailure,
    /// Not now, and why.
    Busy(String),
}

pub(super) struct Slot {
    pub(super) state: ModelState,
    pub(super) worker: Option<Arc<WorkerHandle>>,
    /// Set while loading: callers wait on it instead of loading again.
    pub(super) loading: Option<LoadSignal>,
    /// Memory counted for a worker still loading (a load, a restart, or
    /// the new side of a swap), on top of what the current worker holds.
    pub(super) reserved_bytes: u64,
    /// The GPUs the current worker was placed on.
    pub(super) gpus: Vec<u32>,
    /// What a worker still loading has been counted for on the GPUs.
    pub(super) incoming_gpu: Option<Incoming>,
    pub(super) last_used: Instant,
    /// When an idle model is unloaded; `None`: never.
    pub(super) expires_at: Option<Instant>,
    /// Set while a swap or recycle is in progress.
    pub(super) swapping: bool,
    /// Set when the worker crossed `max_rss` before its replacement was
    /// ready: new requests wait for the replacement.
    pub(super) hold: bool,
    /// While a crashed model waits out its backoff: when it restarts.
    pub(super) restart_at: Option<Instant>,
    /// Why the model failed (state `Failed`, no worker).
    pub(super) failure: Option<String>,
    /// The current worker's load report (an in-place upgrade hands it on).
    pub(super) report: Option<LoadReport>,
    /// When its turn began (its worker came in), and its requests then.
    pub(super) turn_started: Instant,
    pub(super) turn_requests: u64,
    /// Set while it yields its turn to the model named.
    pub(super) yielding: Option<String>,
    /// Where it is in a sleep (`sleep.rs`); `None`: awake.
    pub(super) sleep: Option<super::sleep::state::SleepPhase>,
}

/// GPU placement of a worker still loading, counted until it is in.
#[derive(Debug, Clone)]
pub(super) struct Incoming {
    pub(super) gpus: Vec<u32>,
    /// VRAM expected on each of `gpus`.
    pub(super) vram: u64,
    /// Its pid once spawned, so NVML's reading for it is not counted twice.
    pub(super) pid: Option<u32>,
}

impl Incoming {
    /// Placed on `gpus`, expected to take `vram` on each.
    pub(super) fn new(gpus: Option<Vec<u32>>, vram: u64) -> Option<Incoming> {
        gpus.map(|gpus| Incoming {
            gpus,
            vram,
            pid: None,
        })
    }
}

pub(super) struct Entry {
    pub(super) spec: ModelSpec,
    pub(super) last_peak_bytes: Option<u64>,
    /// VRAM its last worker held on each of its GPUs once loaded, as NVML
    /// saw it.
    pub(super) last_vram_bytes: Option<u64>,
    pub(super) permits: Arc<Semaphore>,
    /// The permits `permits` was sized to: the spec's `max_concurrency`,
    /// else the default, raised to the worker's batch size once loaded.
    pub(super) concurrency: usize,
    pub(super) queued: Arc<AtomicUsize>,
    /// Requests past the queue that wait for the model to load (or to
    /// settle after a restart or recycle) before a worker takes them.
    pub(super) awaiting_load: Arc<AtomicUsize>,
    pub(super) keep_alive: Option<Duration>,
    pub(super) counters: Arc<ModelCounters>,
    /// Crash restarts and what the last unexpected exit was.
    pub(super) health: crashes::CrashHistory,
}

impl Entry {
    pub(super) fn new(spec: ModelSpec, default_keep_alive: Option<Duration>) -> Self {
        let concurrency = spec.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY);
        Entry {
            keep_alive: spec.keep_alive.or(default_keep_alive),
            concurrency,
            spec,
            last_peak_bytes: None,
            last_vram_bytes: None,
            permits: Arc::new(Semaphore::new(concurrency)),
            queued: Arc::default(),
            awaiting_load: Arc::default(),
            counters: Arc::default(),
            health: crashes::CrashHistory::default(),
        }
    }

    /// The entry for `spec` where `old` was: what carries over, decided
    /// here and nowhere else.
    ///
    /// | | registered anew (the model was unloaded) | swapped (a new worker for the same name) |
    /// |---|---|---|
    /// | counters | kept | kept |
    /// | permits and queue | new, sized to the spec | kept, resized to the spec's `max_concurrency` (without one, to the new worker's batch size at its load) |
    /// | keep-alive | the spec's, else the default | the spec's, else the current one (a request's survives) |
    /// | crash history, quarantine | new | kept; quarantine cleared if backend, weights or options changed |
    /// | measured peak and VRAM | new | set by the new worker's load |
    pub(super) fn carry_over(
        old: Option<Entry>,
        spec: ModelSpec,
        default_keep_alive: Option<Duration>,
        change: Change,
    ) -> Entry {
        let mut new = Entry::new(spec, default_keep_alive);
        let Some(old) = old else { return new };
        new.counters = old.counters;
        if change == Change::Swap {
            let same_model = old.spec.backend == new.spec.backend
                && old.spec.model == new.spec.model
                && old.spec.options == new.spec.options;
            new.health = old.health;
            if !same_model {
                new.health.clear_quarantine();
            }
            if new.spec.keep_alive.is_none() {
                new.keep_alive = old.keep_alive;
            }
            if new.spec.max_concurrency.is_none() {
                // Sized by the new worker's batch size in `loaded`, which
                // follows at once: resizing to the default first would only
                // shrink and regrow the permits under requests in flight.
                new.concurrency = old.concurrency;
            }
            resize(&old.permits, old.concurrency, new.concurrency);
            new.permits = old.permits;
            new.queued = old.queued;
            new.awaiting_load = old.awaiting_load;
            new.last_peak_bytes = old.last_peak_bytes;
            new.last_vram_bytes = old.last_vram_bytes;
        }
        new
    }

    /// A worker of this model finished loading: what it measured plans the
    /// next load.
    pub(super) fn loaded(&mut self, report: &LoadReport) {
        self.measured(report);
        self.counters.loads.fetch_add(1, Ordering::Relaxed);
        self.health.load_succeeded();
    }

    /// What a worker's load measured, which plans the model's next load
    /// and its concurrency.
    pub(super) fn measured(&mut self, report: &LoadReport) {
        // A backend that batches gets enough requests to fill a batch,
        // unless the operator bounded them.
        if self.spec.max_concurrency.is_none() {
            let want = (report.max_batch as usize)
                .clamp(DEFAULT_MAX_CONCURRENCY, crate::config::MAX_CONCURRENCY);
            if want != self.concurrency {
                resize(&self.permits, self.concurrency, want);
                self.concurrency = want;
            }
        }
        self.last_peak_bytes = Some(report.peak_rss_bytes);
        self.last_vram_bytes = vram_per_gpu(report).or(self.last_vram_bytes);
    }
}

/// Why an entry is rebuilt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Change {
    /// Registered again while unloaded.
    Register,
    /// Swapped: a new worker with a new spec for the same name.
    Swap,
}

/// Resizes a semaphore of `from` permits to `to`. Requests in flight keep
/// the permits they hold; a shrink takes the missing ones as they come
/// back, so the new bound holds once the old requests are done.
fn resize(permits: &Arc<Semaphore>, from: usize, to: usize) {
    if to > from {
        permits.add_permits(to - from);
    } else if from > to {
        let short = (from - to) - permits.forget_permits(from - to);
        if short > 0 {
            let permits = Arc::clone(permits);
            tokio::spawn(async move {
                if let Ok(taken) = permits.acquire_many_owned(short as u32).await {
                    taken.forget();
                }
            });
        }
    }
}

/// When a keep-alive that starts now runs out; `None` (never) for none, or
/// for one too long for the clock (specs are range-checked, but a host's
/// own `RequestOptions` need not be).
pub(super) fn expiry(keep_alive: Option<Duration>) -> Option<Instant> {
    keep_alive.and_then(|k| Instant::now().checked_add(k))
}

/// VRAM a load report shows on each of the worker's GPUs.
pub(super) fn vram_per_gpu(report: &LoadReport) -> Option<u64> {
    let gpus = report.gpus.as_ref().map_or(1, |g| g.len().max(1)) as u64;
    report.vram_bytes.map(|bytes| bytes / gpus)
}
