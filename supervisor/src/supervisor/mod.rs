//! `Supervisor`: the catalogue of models, their workers, and the operations
//! on them. The sidecar and the CLI are thin layers over this type.
//!
//! Policies that live here, so an embedding host gets them too:
//! - on-demand loading: a request for a model that is not loaded loads it,
//!   and concurrent requests wait for that one load;
//! - keep-alive: an idle model is unloaded when its keep-alive runs out;
//! - memory budget and `max_loaded`: before a load, idle models are evicted
//!   least recently used first; a busy model keeps its room for its turn,
//!   then finishes what it has in flight and yields, while the requests for
//!   the waiting model wait in the machine's queue (never refused for want
//!   of room unless the model could never fit); after loads, when models
//!   grow past the budget, idle ones are evicted too, as for the per-GPU
//!   VRAM budget once NVML shows what a load really took (`budget.rs`);
//! - per-model concurrency with a bounded queue;
//! - swap: the new worker is ready before routing switches, and the old one
//!   drains before it stops.
//!
//! # Where each operation lives
//!
//! `impl Supervisor` is spread over the files of its concerns; this is
//! the index (public operations first, then the crate's).
//!
//! | file | operations |
//! |---|---|
//! | `mod.rs` | `new`, `config`, `set_config`, `events`, `history`, `is_shutting_down`, `shutdown`; `replace_config` (a reload), `emit` |
//! | `catalogue.rs` | `register`, `deregister`, `catalogue`, `spec`, `model_state`, `canonical` (aliases), `is_http_model`, `check_workers`; `check_spec`, `unknown` |
//! | `requests.rs` | `request`, `request_with`, `request_stream`, `request_stream_with`, `lease`, `worker`; admission of one request (`admit`: queue, deadline, load); `request_finished` |
//! | `tickets.rs` | (no `impl Supervisor`) `RequestStream`, `Lease`: what a caller holds while its request runs, and the bookkeeping when it ends |
//! | `lifecycle.rs` | `load`, `load_registered`, `ensure_loaded`, `unload`; `start_load` (the machine's queue, room, the launch, one retry after running out of memory), `launch_into_slot`, `unload_inner` |
//! | `room.rs` | `make_room`: admission's decision carried out (evictions, yields at a turn's end, waits), and the state read as admission sees it (`room`, `is_idle`, `gpu_holders`) |
//! | `residency.rs` | `make_way`: the evictions groups and the matrix ask for, turns kept |
//! | `budget.rs` | the budget watch (memory and VRAM, once a second), `fit_measured` (VRAM after a load), `evict`, `give_room` (a model yields: no new request, drains, goes; said as an event) |
//! | `swap.rs` | `swap`, `swap_with`; `replace_worker` (swaps, recycles, restarts) |
//! | `resilience.rs` | `watch_worker`, `on_death` (restart with backoff), `maybe_recycle` |
//! | `keep_alive.rs` | the keep-alive reaper |
//! | `sleep/` | `sleep`, `wake` (the checkpoint API or the server's routes; `state.rs` the phase and reports), `sleep_for` (`choice.rs`: sleep or stop to free a GPU) |
//! | `preloaders.rs` | `preloaders`; the worker kinds' preloaded interpreters started, stopped, restarted |
//! | `status.rs` | `stats`, `gpus`, `counters` (what `ps`, `/api/ps` and `/metrics` read) |
//! | `occupancy.rs` | `occupancy_on`: the gauges an inference gateway's picker reads |
//! | `handover.rs` | an in-place upgrade's part: `freeze`, `busy`, `hand_over`, `install_adopted`, the event log carried over |
//!
//! The decisions, pure: `admission.rs` (`plan`: place, evict, wait,
//! refuse, with the turns; `docs/internals/scheduler.md`), and
//! `gpu::placement`. The state they share: `slot.rs` (one model's worker
//! and its state machine, `Entry` its catalogue record), `queue.rs` (the
//! machine's queue of loads, by priority then arrival), `footprint.rs`
//! (what a load needs room for) with `estimate.rs` (a model's size from its
//! files before its first load), `crashes.rs` (restarts and quarantine),
//! `counters.rs`, `events.rs`, `history.rs`, `types.rs` (what callers
//! read).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;

use crate::config::SupervisorConfig;
use crate::error::{Error, Result};

use crate::child::handle::WorkerHandle;
use crate::report::UnloadReport;

mod admission;
mod budget;
mod catalogue;
mod counters;
mod crashes;
mod estimate;
mod events;
mod footprint;
mod handover;
mod history;
mod keep_alive;
mod lifecycle;
mod occupancy;
mod preloaders;
mod queue;
mod requests;
mod residency;
mod resilience;
mod room;
mod sleep;
mod slot;
mod status;
mod swap;
mod tickets;
mod types;

pub use counters::{BATCH_BUCKETS, HistogramSnapshot, LATENCY_BUCKETS, ModelCounters};

pub use crashes::LastExit;
pub use events::{Event, EventKind, Follow, Followed, HISTORY as EVENT_HISTORY};
pub(crate) use handover::Awaited;
pub use history::{HostSample, MemoryHistory, ModelSample};
pub use occupancy::Occupancy;
pub use preloaders::PreloaderStatus;
pub use sleep::state::{SleepReport, WakeReport};
pub use tickets::{Lease, RequestStream};
pub use types::{
    BatchingStatus, CatalogueEntry, ModelState, ModelStatus, RequestOptions, SwapReport,
};

use footprint::Need;
use slot::{Entry, Slot};

/// How long a shutdown waits for launches in progress to end.
const LAUNCHES_END_WITHIN: Duration = Duration::from_secs(60);

/// Default per-model concurrency and queue bounds.
pub const DEFAULT_MAX_CONCURRENCY: usize = 8;
pub const DEFAULT_MAX_QUEUE: usize = 64;

#[derive(Default)]
struct State {
    catalogue: BTreeMap<String, Entry>,
    /// Every alias, to the model it names: looked up, never scanned (a
    /// catalogue of a thousand models with 64 aliases each is 64,000).
    aliases: HashMap<String, String>,
    slots: HashMap<String, Slot>,
    /// Workers a swap or recycle replaced, by pid, until they have stopped:
    /// their memory still counts, and shutdown waits for them.
    retiring: HashMap<u32, Retiring>,
}

struct Retiring {
    model: String,
    worker: Arc<WorkerHandle>,
    gpus: Vec<u32>,
}

struct Inner {
    /// Replaced whole by a reload ([`Supervisor::set_config`]); each use
    /// reads the one current then.
    config: std::sync::RwLock<Arc<SupervisorConfig>>,
    state: Mutex<State>,
    /// Woken whenever a slot changes state.
    changed: Notify,
    /// When that last happened (or the config was replaced), in ms since
    /// the Unix epoch: the time a scheduler in front of berth is told its
    /// set of loaded models was last updated.
    changed_at: AtomicU64,
    /// Wakes the keep-alive reaper: a slot changed, or a keep-alive was
    /// set that may end sooner than the one it waits for.
    expiry_changed: Arc<Notify>,
    /// The machine's queue: "make room, then reserve" one at a time, in
    /// order (priority, then arrival), so two loads cannot both count the
    /// same free memory.
    queue: queue::LoadQueue,
    /// Requests waiting for their model's load or turn, all models: bounded
    /// by `max_queue`.
    waiting: Arc<std::sync::atomic::AtomicUsize>,
    shutting_down: AtomicBool,
    /// Set while an in-place upgrade hands the workers over: nothing
    /// starts, stops or swaps meanwhile (`handover.rs`).
    frozen: AtomicBool,
    /// True while an upgrade's handover waits for connections to close:
    /// event followers end their streams.
    handing_over: tokio::sync::watch::Sender<bool>,
    /// Turns true when shutdown begins: whoever waits for a load stops
    /// waiting and is told so, rather than be cut off when the process ends;
    /// a server's start in progress is called off (its container removed).
    stopping: tokio::sync::watch::Sender<bool>,
    /// Launches in progress: a shutdown waits for them to end.
    launching: std::sync::atomic::AtomicUsize,
    /// Worker kinds' preloaded interpreters.
    preloaders: preloaders::Preloaders,
    /// What happened, for followers.
    events: events::Events,
    /// Memory over time, a sample a second.
    history: history::History,
}

impl Inner {
    fn config(&self) -> Arc<SupervisorConfig> {
        Arc::clone(&self.config.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// Records an event, and the memory sample a load or unload adds.
    fn emit(&self, what: EventKind) {
        self.history.record(&what);
        self.events.emit(what);
    }

    /// Wakes whoever waits for a slot to change, the reaper included.
    fn notify_changed(&self) {
        self.changed_at
            .store(crate::base::unix_ms(), Ordering::Relaxed);
        self.changed.notify_waiters();
        self.expiry_changed.notify_one();
    }
}

impl Drop for Inner {
    /// A supervisor dropped without `shutdown()` still leaves no worker
    /// behind: each group is killed (and reaped by its waiter).
    fn drop(&mut self) {
        // The reaper finds the supervisor gone and ends.
        self.expiry_changed.notify_one();
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for slot in state.slots.values() {
            if let Some(worker) = &slot.worker {
                worker.kill();
            }
        }
        Supervisor::kill_preloaders(self);
    }
}

/// Runs each model in a worker process of its own.
///
/// Cheap to clone; clones share the models. Create it inside a tokio
/// runtime (it starts a keep-alive task there).
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.lock().slots.keys().cloned().collect();
        f.debug_struct("Supervisor")
            .field("loaded", &names)
            .finish_non_exhaustive()
    }
}

impl Supervisor {
    pub fn new(config: SupervisorConfig) -> Self {
        let inner = Arc::new(Inner {
            config: std::sync::RwLock::new(Arc::new(config)),
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            changed_at: AtomicU64::new(crate::base::unix_ms()),
            expiry_changed: Arc::default(),
            queue: Default::default(),
            waiting: Default::default(),
            shutting_down: AtomicBool::new(false),
            frozen: AtomicBool::new(false),
            handing_over: tokio::sync::watch::Sender::new(false),
            stopping: tokio::sync::watch::Sender::new(false),
            launching: Default::default(),
            preloaders: Default::default(),
            events: Default::default(),
            history: Default::default(),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            Supervisor {
                inner: Arc::clone(&inner),
            }
            .start_preloaders_now();
            runtime.spawn(keep_alive::keep_alive_reaper(
                Arc::downgrade(&inner),
                Arc::clone(&inner.expiry_changed),
            ));
            runtime.spawn(history::sampler(Arc::downgrade(&inner)));
            // The budgets are read at each check: a reload may set them.
            runtime.spawn(budget::budget_watch(Arc::downgrade(&inner)));
        }
        Supervisor { inner }
    }

    /// The configuration now (a reload may replace it).
    pub fn config(&self) -> Arc<SupervisorConfig> {
        self.inner.config()
    }

    /// Replaces the configuration: budgets, limits, timeouts, keep-alive
    /// and worker kinds apply from the next use of each (a load, a stop, the
    /// next budget check); what runs is left as it is. The preloaded
    /// interpreter of a worker kind that changed or went is stopped (the
    /// next load starts one of the new kind); a kind that now preloads at
    /// start gets its interpreter.
    pub async fn set_config(&self, config: SupervisorConfig) {
        let retired = self.replace_config(config).await;
        for preloader in retired {
            preloader.stop().await;
        }
    }

    /// [`Supervisor::set_config`], handing back the preloaders of the
    /// kinds that changed or went rather than stopping them: what was
    /// forked from them runs on until the caller (a reload, once it has
    /// swapped those models) stops them.
    pub(crate) async fn replace_config(
        &self,
        config: SupervisorConfig,
    ) -> Vec<Arc<crate::child::preload::Preloader>> {
        let old = self.config();
        let changed: Vec<String> = old
            .workers
            .iter()
            .filter(|(name, kind)| config.workers.get(*name) != Some(kind))
            .map(|(name, _)| name.clone())
            .collect();
        *self.inner.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
        let retired = self.detach_preloaders(&changed).await;
        self.inner.notify_changed();
        self.start_preloaders_now();
        retired
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_running(&self, model: &str) -> Result<()> {
        if self.inner.shutting_down.load(Ordering::SeqCst) {
            return Err(Error::ShuttingDown {
                model: model.into(),
            });
        }
        self.check_not_frozen(model)
    }

    /// Refuses a start, stop or swap while an upgrade hands over.
    fn check_not_frozen(&self, model: &str) -> Result<()> {
        if self.inner.frozen.load(Ordering::SeqCst) {
            return Err(Error::Busy {
                model: model.into(),
                reason: "berth is handing its workers over to a new binary (an in-place \
                         upgrade); retry in a moment"
                    .into(),
            });
        }
        Ok(())
    }

    /// Follows what happens to the models: the kept events after `since`
    /// (0: all kept), then each as it happens.
    pub fn events(&self, since: u64) -> Follow {
        self.inner.events.follow(since)
    }

    /// Memory over time, per model and for the host: the samples taken
    /// after `since_ms` (Unix milliseconds; 0: all kept).
    pub fn history(&self, since_ms: u64) -> MemoryHistory {
        self.inner.history.after(since_ms)
    }

    /// Records an event (and a load's or unload's memory sample).
    pub(crate) fn emit(&self, what: EventKind) {
        self.inner.emit(what);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.inner.shutting_down.load(Ordering::SeqCst)
    }

    /// Refuses new work, unloads every model (concurrently) and returns the
    /// reports. Returns only once no worker is left: a swap or recycle in
    /// progress is waited for (it installs nothing once shutdown began), and
    /// an unload someone else started is waited out.
    pub async fn shutdown(&self) -> Vec<Result<UnloadReport>> {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
        self.inner.stopping.send_replace(true);
        let mut reports = Vec::new();
        loop {
            let changed = self.inner.changed.notified();
            let (names, retiring) = {
                let mut state = self.lock();
                // Loads and restarts still in progress find their slot gone
                // and stop their worker.
                state.slots.retain(|_, slot| slot.worker.is_some());
                let names: Vec<String> = state.slots.keys().cloned().collect();
                (names, state.retiring.len())
            };
            if names.is_empty() {
                if retiring == 0 {
                    break;
                }
                // Workers a swap replaced are still stopping.
                let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
                continue;
            }
            self.inner.notify_changed();
            let mut tasks = tokio::task::JoinSet::new();
            for name in names {
                let this = self.clone();
                tasks.spawn(async move { this.unload(&name).await });
            }
            let mut busy = false;
            while let Some(joined) = tasks.join_next().await {
                match joined {
                    // Swapping, or being unloaded by someone else: again
                    // once that is over.
                    Ok(Err(Error::Busy { .. })) => busy = true,
                    Ok(report) => reports.push(report),
                    Err(_) => {}
                }
            }
            if busy {
                let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
            }
        }
        // Launches still running end now (told by `stopping`), each
        // stopping what it started: waited for, so nothing they started
        // (a container) outlives berth.
        let until = std::time::Instant::now() + LAUNCHES_END_WITHIN;
        while self.inner.launching.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.inner.notify_changed();
        self.stop_preloaders().await;
        reports
    }
}

impl Supervisor {
    /// `fut`, unless shutdown begins first: then `ShuttingDown` at once (a
    /// load that was waited for goes on in its own task, and stops its
    /// worker when it finds the supervisor shutting down).
    async fn unless_stopping<T>(
        &self,
        model: &str,
        fut: impl std::future::Future<Output = Result<T>>,
    ) -> Result<T> {
        let mut stopping = self.inner.stopping.subscribe();
        tokio::select! {
            out = fut => out,
            _ = stopping.wait_for(|s| *s) => Err(Error::ShuttingDown { model: model.into() }),
        }
    }
}

/// Runs `fut` as a task of its own and waits for it: dropping the caller
/// does not cancel it.
async fn detached<T: Send + 'static>(
    model: &str,
    fut: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    tokio::spawn(fut).await.unwrap_or_else(|e| {
        Err(Error::Busy {
            model: model.into(),
            reason: format!("its operation failed: {e}"),
        })
    })
}
