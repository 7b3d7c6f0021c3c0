//! `Supervisor`: the catalogue of models, their workers, and the operations
//! on them. The sidecar and the CLI are thin layers over this type.
//!
//! Policies that live here, so an embedding host gets them too:
//! - on-demand loading: a request for a model that is not loaded loads it,
//!   and concurrent requests wait for that one load;
//! - keep-alive: an idle model is unloaded when its keep-alive runs out;
//! - memory budget and `max_loaded`: before a load, idle models are evicted
//!   least recently used first; a model with work in flight never is;
//! - per-model concurrency with a bounded queue;
//! - swap: the new worker is ready before routing switches, and the old one
//!   drains before it stops.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use berth_protocol::Body;
use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};

use crate::config::{ModelSpec, SupervisorConfig};
use crate::error::{Error, Result};
use crate::gpu;

use crate::child::handle::{Piece, ResponseStream, WorkerHandle};
use crate::child::{launch, stop};
use crate::report::{LoadReport, UnloadReport};
use crate::units::mib;

mod counters;
mod resilience;

pub use counters::{LATENCY_BUCKETS, ModelCounters};

pub use resilience::LastExit;

/// Default per-model concurrency and queue bounds.
pub const DEFAULT_MAX_CONCURRENCY: usize = 8;
pub const DEFAULT_MAX_QUEUE: usize = 64;

/// Where a model is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelState {
    /// Registered, no worker.
    Unloaded,
    /// The worker process is starting or loading the model.
    Loading,
    Ready,
    /// No new requests; in-flight ones finish.
    Draining,
    Stopping,
    /// The worker died on its own; requests fail until it is loaded again.
    /// A worker that has only just died shows this, with its pid, for the
    /// moment before the crash policy restarts it (`loading`) or gives up
    /// (`failed`, no pid).
    Failed,
}

impl fmt::Display for ModelState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ModelState::Unloaded => "unloaded",
            ModelState::Loading => "loading",
            ModelState::Ready => "ready",
            ModelState::Draining => "draining",
            ModelState::Stopping => "stopping",
            ModelState::Failed => "failed",
        })
    }
}

/// A loaded (or loading) model, as `ps` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelStatus {
    pub name: String,
    pub backend: String,
    pub state: ModelState,
    pub pid: Option<u32>,
    pub rss_bytes: u64,
    pub pss_bytes: u64,
    pub peak_rss_bytes: u64,
    pub uptime_s: f64,
    pub requests: u64,
    pub in_flight: u32,
    /// Requests waiting for a concurrency slot.
    pub queued: usize,
    /// Seconds until an idle model is unloaded; `None`: never.
    pub keep_alive_left_s: Option<f64>,
    /// Crash restarts of this model.
    pub restarts: u64,
    /// Workers replaced for crossing `max_rss` or `max_requests`.
    pub recycles: u64,
    /// The last unexpected exit: cause and stderr tail.
    pub last_exit: Option<LastExit>,
    /// Resident memory growth per request since load: a leak shows here
    /// before it matters.
    pub rss_growth_per_request_bytes: f64,
    /// Device memory the worker holds (NVML, per process); `None` without a GPU.
    pub vram_bytes: Option<u64>,
    /// The GPUs (NVML indices) the worker was placed on; empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
}

/// A registered model, as the catalogue shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CatalogueEntry {
    pub spec: ModelSpec,
    pub state: ModelState,
    pub pid: Option<u32>,
    /// Peak memory of its last load, used to plan the next one.
    pub last_peak_bytes: Option<u64>,
}

/// What a swap returns: both workers and the old one's unload report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwapReport {
    pub model: String,
    pub old_pid: u32,
    pub new_pid: u32,
    /// From the swap call to the new worker taking requests.
    pub switch_ms: f64,
    pub took_ms: f64,
    pub load: LoadReport,
    pub unload: UnloadReport,
}

impl fmt::Display for SwapReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "swapped `{}`: worker pid {} -> pid {}, serving after {:.1} ms, done after {:.1} ms",
            self.model, self.old_pid, self.new_pid, self.switch_ms, self.took_ms
        )?;
        writeln!(f, "{}", self.load)?;
        write!(f, "{}", self.unload)
    }
}

/// Per-request settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestOptions {
    /// Overrides the model's keep-alive from this request on.
    pub keep_alive: Option<Duration>,
    /// The request fails (and is cancelled in the worker) past this.
    pub deadline: Option<Duration>,
}

type LoadSignal = watch::Receiver<Option<std::result::Result<(), Arc<Error>>>>;

impl Slot {
    fn loading(signal: LoadSignal, reserved_bytes: u64, incoming_gpu: Option<Incoming>) -> Slot {
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
        }
    }
}

struct Slot {
    state: ModelState,
    worker: Option<Arc<WorkerHandle>>,
    /// Set while loading: callers wait on it instead of loading again.
    loading: Option<LoadSignal>,
    /// Memory counted for a worker still loading (a load, a restart, or
    /// the new side of a swap), on top of what the current worker holds.
    reserved_bytes: u64,
    /// The GPUs the current worker was placed on.
    gpus: Vec<u32>,
    /// What a worker still loading has been counted for on the GPUs.
    incoming_gpu: Option<Incoming>,
    last_used: Instant,
    /// When an idle model is unloaded; `None`: never.
    expires_at: Option<Instant>,
    /// Set while a swap or recycle is in progress.
    swapping: bool,
    /// Set when the worker crossed `max_rss` before its replacement was
    /// ready: new requests wait for the replacement.
    hold: bool,
    /// While a crashed model waits out its backoff: when it restarts.
    restart_at: Option<Instant>,
    /// Why the model failed (state `Failed`, no worker).
    failure: Option<String>,
}

/// GPU placement of a worker still loading, counted until it is in.
#[derive(Debug, Clone)]
struct Incoming {
    gpus: Vec<u32>,
    /// VRAM expected on each of `gpus`.
    vram: u64,
    /// Its pid once spawned, so NVML's reading for it is not counted twice.
    pid: Option<u32>,
}

impl Incoming {
    fn new(gpus: Option<Vec<u32>>, need: &Need) -> Option<Incoming> {
        gpus.map(|gpus| Incoming {
            gpus,
            vram: need.vram(),
            pid: None,
        })
    }
}

struct Entry {
    spec: ModelSpec,
    last_peak_bytes: Option<u64>,
    /// VRAM its last worker held on each of its GPUs once loaded, as NVML
    /// saw it.
    last_vram_bytes: Option<u64>,
    permits: Arc<Semaphore>,
    queued: Arc<AtomicUsize>,
    keep_alive: Option<Duration>,
    counters: Arc<ModelCounters>,
    /// Crash restarts and what the last unexpected exit was.
    health: resilience::CrashHistory,
}

impl Entry {
    fn new(spec: ModelSpec, default_keep_alive: Option<Duration>) -> Self {
        let concurrency = spec.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY);
        Entry {
            keep_alive: spec.keep_alive.or(default_keep_alive),
            spec,
            last_peak_bytes: None,
            last_vram_bytes: None,
            permits: Arc::new(Semaphore::new(concurrency)),
            queued: Arc::default(),
            counters: Arc::default(),
            health: resilience::CrashHistory::default(),
        }
    }
}

#[derive(Default)]
struct State {
    catalogue: BTreeMap<String, Entry>,
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
    config: SupervisorConfig,
    state: Mutex<State>,
    /// Woken whenever a slot changes state.
    changed: Notify,
    /// Serialises "make room, then reserve" so two loads cannot both count
    /// the same free memory.
    load_gate: tokio::sync::Mutex<()>,
    shutting_down: AtomicBool,
}

impl Drop for Inner {
    /// A supervisor dropped without `shutdown()` still leaves no worker
    /// behind: each group is killed (and reaped by its waiter thread).
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for slot in state.slots.values() {
            if let Some(worker) = &slot.worker {
                worker.kill();
            }
        }
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
            config,
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            load_gate: tokio::sync::Mutex::new(()),
            shutting_down: AtomicBool::new(false),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(keep_alive_reaper(Arc::downgrade(&inner)));
        }
        Supervisor { inner }
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
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
        Ok(())
    }

    // ----- catalogue -----

    /// Adds a model to the catalogue (or replaces an unloaded one's spec).
    /// It loads on its first request, or with [`Supervisor::load_registered`].
    pub fn register(&self, spec: ModelSpec) -> Result<()> {
        self.check_spec(&spec)?;
        let mut state = self.lock();
        if let Some(slot) = state.slots.get(&spec.name) {
            let pid = slot.worker.as_ref().map(|w| w.pid()).unwrap_or(0);
            return Err(Error::AlreadyLoaded {
                model: spec.name.clone(),
                pid,
            });
        }
        let name = spec.name.clone();
        let entry = Entry::new(spec, self.inner.config.default_keep_alive);
        let counters = state.catalogue.get(&name).map(|e| Arc::clone(&e.counters));
        let entry = Entry {
            counters: counters.unwrap_or(entry.counters.clone()),
            ..entry
        };
        state.catalogue.insert(name, entry);
        Ok(())
    }

    /// Everything about `spec` that can be checked without loading it: its
    /// fields and ranges, its worker kind, that its worker program can be
    /// found and offers its backend.
    fn check_spec(&self, spec: &ModelSpec) -> Result<()> {
        spec.validate_for(&self.inner.config)?;
        let program = crate::child::launch::worker_program(spec, &self.inner.config)?;
        if let Some(offered) = crate::child::launch::offered_backends(&program)
            && !offered.contains(&spec.backend)
        {
            return Err(Error::InvalidSpec {
                model: spec.name.clone(),
                reason: format!(
                    "worker `{program}` has no backend `{}` (it offers: {})",
                    spec.backend,
                    offered.join(", ")
                ),
            });
        }
        Ok(())
    }

    /// Asks the default worker program, and every declared worker kind,
    /// which backends it offers: what `berth serve` checks before it says
    /// it is listening, so a missing or broken worker is found at start and
    /// not at the first request.
    pub fn check_workers(&self) -> std::result::Result<(), String> {
        use crate::child::launch::{WorkerProgram, offered_backends, worker_program};
        let config = &self.inner.config;
        let probe = ModelSpec::new("probe", "any");
        let mut programs = vec![worker_program(&probe, config).map_err(|e| e.to_string())?];
        programs.extend(config.workers.values().map(|kind| WorkerProgram {
            path: kind.binary.clone(),
            args: Vec::new(),
        }));
        for program in programs {
            if offered_backends(&program).is_none() {
                return Err(format!(
                    "worker program `{program}` did not answer `--backends` with its backends; \
                     a worker program is a berth worker (`berth worker`, `berth-worker`, or a \
                     binary built on the berth-worker library), or a wrapper that execs one \
                     passing its arguments on"
                ));
            }
        }
        Ok(())
    }

    /// Removes a model from the catalogue, unloading it first if loaded.
    pub async fn deregister(&self, model: &str) -> Result<Option<UnloadReport>> {
        if !self.lock().catalogue.contains_key(model) {
            return Err(self.unknown(model));
        }
        let report = match self.unload(model).await {
            Ok(report) => Some(report),
            Err(Error::NotLoaded { .. }) => None,
            Err(e) => return Err(e),
        };
        self.lock().catalogue.remove(model);
        Ok(report)
    }

    fn unknown(&self, model: &str) -> Error {
        Error::UnknownModel {
            model: model.into(),
            known: self.lock().catalogue.keys().cloned().collect(),
        }
    }

    /// Every registered model with its state.
    pub fn catalogue(&self) -> Vec<CatalogueEntry> {
        let state = self.lock();
        state
            .catalogue
            .iter()
            .map(|(name, entry)| {
                let slot = state.slots.get(name);
                CatalogueEntry {
                    spec: entry.spec.clone(),
                    state: slot.map(slot_state).unwrap_or(ModelState::Unloaded),
                    pid: slot.and_then(|s| s.worker.as_ref()).map(|w| w.pid()),
                    last_peak_bytes: entry.last_peak_bytes,
                }
            })
            .collect()
    }

    /// The spec a model is registered with.
    pub fn spec(&self, model: &str) -> Option<ModelSpec> {
        self.lock().catalogue.get(model).map(|e| e.spec.clone())
    }

    // ----- load / unload -----

    /// Registers `spec` (replacing an unloaded model of that name) and loads it.
    pub async fn load(&self, spec: ModelSpec) -> Result<LoadReport> {
        self.check_running(&spec.name)?;
        let name = spec.name.clone();
        self.register(spec)?;
        self.start_load(&name).await
    }

    /// Loads a registered model.
    pub async fn load_registered(&self, model: &str) -> Result<LoadReport> {
        self.check_running(model)?;
        self.start_load(model).await
    }

    /// Makes room, reserves the slot, launches the worker.
    ///
    /// Runs as a task of its own: a caller that gives up (a deadline, a
    /// client gone) must not leave a half-made slot behind.
    async fn start_load(&self, model: &str) -> Result<LoadReport> {
        let (this, model) = (self.clone(), model.to_string());
        detached(&model.clone(), async move {
            this.start_load_inner(&model).await
        })
        .await
    }

    async fn start_load_inner(&self, model: &str) -> Result<LoadReport> {
        let gate = self.inner.load_gate.lock().await;
        let (spec, need) = {
            let mut state = self.lock();
            if state
                .slots
                .get(model)
                .is_some_and(|s| s.state == ModelState::Failed && s.worker.is_none())
            {
                // Loading by hand is how a failed model comes back.
                state.slots.remove(model);
            }
            if let Some(slot) = state.slots.get(model) {
                return Err(match &slot.worker {
                    Some(w) => Error::AlreadyLoaded {
                        model: model.into(),
                        pid: w.pid(),
                    },
                    None => Error::Busy {
                        model: model.into(),
                        reason: format!("it is {}", slot_state(slot)),
                    },
                });
            }
            let entry = state
                .catalogue
                .get(model)
                .ok_or_else(|| self.unknown_locked(model, &state))?;
            (
                entry.spec.clone(),
                Need::new(&entry.spec, Some(entry), false),
            )
        };
        let gpus = self.make_room(model, &need).await?;
        let (done, signal) = watch::channel(None);
        {
            let mut state = self.lock();
            self.check_running(model)?;
            if !state.catalogue.contains_key(model) {
                // Deregistered while room was being made.
                return Err(self.unknown_locked(model, &state));
            }
            state.slots.insert(
                model.to_string(),
                Slot::loading(signal, need.ram, Incoming::new(gpus.clone(), &need)),
            );
        }
        drop(gate);
        self.inner.changed.notify_waiters();

        let launched = launch::launch(&spec, &self.inner.config, gpus, &|pid| {
            self.note_incoming_pid(model, pid)
        })
        .await;
        let outcome = {
            let mut state = self.lock();
            let State {
                catalogue, slots, ..
            } = &mut *state;
            match (launched, slots.get_mut(model)) {
                (Ok((worker, report)), Some(slot)) => {
                    slot.last_used = Instant::now();
                    install(slot, catalogue.get_mut(model), &worker, &report);
                    self.watch_worker(model, &worker);
                    Ok(report)
                }
                (Ok((worker, _)), None) => Err(worker),
                (Err(e), _) => {
                    slots.remove(model);
                    let _ = done.send(Some(Err(Arc::new(e.shared()))));
                    self.inner.changed.notify_waiters();
                    return Err(e);
                }
            }
        };
        let result = match outcome {
            Ok(report) => {
                let _ = done.send(Some(Ok(())));
                Ok(report)
            }
            Err(orphan) => {
                // The slot went away while loading (shutdown): stop what we started.
                stop::stop(&orphan, self.inner.config.stop_graces).await;
                let err = Error::ShuttingDown {
                    model: model.into(),
                };
                let _ = done.send(Some(Err(Arc::new(err.shared()))));
                Err(err)
            }
        };
        self.inner.changed.notify_waiters();
        result
    }

    /// The worker of a loaded model, loading it first if needed (concurrent
    /// callers share one load).
    pub async fn ensure_loaded(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        loop {
            self.check_running(model)?;
            enum Next {
                Wait(LoadSignal),
                WaitChange,
                Load,
            }
            let changed = self.inner.changed.notified();
            let next = {
                let state = self.lock();
                if !state.catalogue.contains_key(model) {
                    return Err(Error::UnknownModel {
                        model: model.into(),
                        known: state.catalogue.keys().cloned().collect(),
                    });
                }
                match state.slots.get(model) {
                    None => Next::Load,
                    Some(slot) => match (slot_state(slot), &slot.worker, &slot.loading) {
                        (ModelState::Ready, Some(worker), _) => return Ok(Arc::clone(worker)),
                        (ModelState::Failed, None, _) => {
                            return Err(Error::ModelFailed {
                                model: model.into(),
                                reason: slot.failure.clone().unwrap_or_default(),
                            });
                        }
                        // A worker that just died: the crash policy decides next.
                        (ModelState::Failed, Some(_), _) => Next::WaitChange,
                        // In a crash backoff of more than a moment: say so now
                        // rather than hold the request for up to a minute.
                        (ModelState::Loading, None, _)
                            if slot
                                .restart_at
                                .is_some_and(|t| t > Instant::now() + Duration::from_secs(1)) =>
                        {
                            let left = slot
                                .restart_at
                                .map(|t| t.saturating_duration_since(Instant::now()));
                            return Err(Error::Restarting {
                                model: model.into(),
                                in_s: left.unwrap_or_default().as_secs_f64(),
                                last_exit: state
                                    .catalogue
                                    .get(model)
                                    .and_then(|e| e.health.last_exit.as_ref())
                                    .map(|e| e.description.clone())
                                    .unwrap_or_default(),
                            });
                        }
                        (_, _, Some(signal)) => Next::Wait(signal.clone()),
                        _ => Next::WaitChange,
                    },
                }
            };
            match next {
                Next::Wait(mut signal) => {
                    let outcome = signal.wait_for(Option::is_some).await.map(|v| v.clone());
                    if let Ok(Some(Err(e))) = outcome {
                        return Err(e.shared());
                    }
                }
                Next::WaitChange => {
                    let _ = tokio::time::timeout(Duration::from_millis(100), changed).await;
                }
                Next::Load => match self.start_load(model).await {
                    Ok(_) | Err(Error::AlreadyLoaded { .. } | Error::Busy { .. }) => {}
                    Err(e) => return Err(e),
                },
            }
        }
    }

    /// Evicts idle models, least recently used first, until the new worker
    /// fits the memory budget, `max_loaded` and (for a model on GPUs) the
    /// per-GPU VRAM budget; returns the GPUs it goes on. While a model that
    /// is being unloaded will free what is missing, waits for it rather
    /// than refuse. Called with the load gate held.
    async fn make_room(&self, model: &str, need: &Need) -> Result<Option<Vec<u32>>> {
        let budget = self.inner.config.memory_budget;
        let max_loaded = self.inner.config.max_loaded;
        if let Some(budget) = budget
            && need.ram > budget
        {
            return Err(Error::BudgetExceeded {
                model: model.into(),
                needed: need.ram,
                reason: format!("more than the whole memory budget of {}", mib(budget)),
            });
        }
        // Long enough for a drain and a stop to finish.
        let room_wait = self.inner.config.drain_timeout + Duration::from_secs(10);
        let waiting_since = Instant::now();
        loop {
            self.check_running(model)?;
            // NVML is read outside the lock: it can take milliseconds.
            let devices = match &need.gpu {
                None => None,
                Some(_) => match gpu::inventory() {
                    gpu::Inventory::Devices(devices) => Some(devices),
                    gpu::Inventory::NoGpu(reason) => {
                        return Err(Error::InvalidSpec {
                            model: model.into(),
                            reason: format!("it asks for GPUs but {reason}"),
                        });
                    }
                },
            };
            let changed = self.inner.changed.notified();
            let (fits, victim, freeing, holders, gpu_plan) = {
                let state = self.lock();
                let used: u64 = state
                    .slots
                    .values()
                    .map(|s| {
                        let rss = s
                            .worker
                            .as_ref()
                            .map(|w| w.memory().last.rss_bytes)
                            .unwrap_or(0);
                        rss + s.reserved_bytes
                    })
                    .chain(
                        state
                            .retiring
                            .values()
                            .map(|r| r.worker.memory().last.rss_bytes),
                    )
                    .sum();
                // A failed model holds nothing; a replaced one is counted once.
                let loaded = state
                    .slots
                    .values()
                    .filter(|s| s.worker.is_some() || s.loading.is_some())
                    .count();
                let fits = budget.is_none_or(|b| used + need.ram <= b)
                    && max_loaded.is_none_or(|m| {
                        if need.replacing {
                            loaded <= m
                        } else {
                            loaded < m
                        }
                    });
                let victim = state
                    .slots
                    .iter()
                    .filter(|(name, slot)| name.as_str() != model && evictable(&state, name, slot))
                    .min_by_key(|(_, slot)| slot.last_used)
                    .map(|(name, _)| name.clone());
                let freeing = !state.retiring.is_empty()
                    || state
                        .slots
                        .values()
                        .any(|s| matches!(s.state, ModelState::Draining | ModelState::Stopping));
                let holders: Vec<String> = state
                    .slots
                    .iter()
                    .map(|(name, s)| {
                        let rss = s
                            .worker
                            .as_ref()
                            .map(|w| w.memory().last.rss_bytes)
                            .unwrap_or(0)
                            + s.reserved_bytes;
                        let busy = s.worker.as_ref().map(|w| w.in_flight()).unwrap_or(0);
                        format!(
                            "`{name}` {} ({} in flight, {})",
                            mib(rss),
                            busy,
                            slot_state(s)
                        )
                    })
                    .collect();
                let gpu_plan = match (&need.gpu, &devices) {
                    (Some((request, vram)), Some(devices)) => Some(gpu::plan(
                        request,
                        devices,
                        *vram,
                        self.inner.config.gpu_memory_budget,
                        &gpu_holders(&state, model),
                    )),
                    _ => None,
                };
                (fits, victim, freeing, holders, gpu_plan)
            };
            // A GPU that cannot take the model even with every idle model
            // evicted is said before anything is evicted for RAM.
            let gpu_victim = match gpu_plan {
                None => None,
                Some(gpu::Plan::Invalid(reason)) => {
                    return Err(Error::InvalidSpec {
                        model: model.into(),
                        reason,
                    });
                }
                Some(gpu::Plan::Refuse(reason)) => {
                    if freeing && waiting_since.elapsed() < room_wait {
                        let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
                        continue;
                    }
                    return Err(Error::GpuBudgetExceeded {
                        model: model.into(),
                        needed: need.vram(),
                        reason,
                    });
                }
                Some(gpu::Plan::Place(gpus)) if fits => return Ok(Some(gpus)),
                Some(gpu::Plan::Place(_)) => None,
                Some(gpu::Plan::Evict(victim)) => Some(victim),
            };
            if fits && need.gpu.is_none() {
                return Ok(None);
            }
            // RAM first (any idle model helps there); then the GPU's pick.
            let victim = if fits { gpu_victim } else { victim };
            match victim {
                Some(victim) => {
                    tracing::info!(
                        model,
                        victim,
                        "evicting the least recently used idle model to make room"
                    );
                    match self.unload(&victim).await {
                        Ok(report) => tracing::info!("{report}"),
                        Err(e) => tracing::warn!(victim, "eviction failed: {e}"),
                    }
                }
                None if freeing && waiting_since.elapsed() < room_wait => {
                    // A model being unloaded will give its memory back.
                    let _ = tokio::time::timeout(Duration::from_millis(200), changed).await;
                }
                None => {
                    let limits = match (budget, max_loaded) {
                        (Some(b), Some(m)) => {
                            format!("the memory budget of {} and max_loaded {m}", mib(b))
                        }
                        (Some(b), None) => format!("the memory budget of {}", mib(b)),
                        (None, Some(m)) => format!("max_loaded {m}"),
                        (None, None) => "the limits".into(),
                    };
                    return Err(Error::BudgetExceeded {
                        model: model.into(),
                        needed: need.ram,
                        reason: format!(
                            "which does not fit {limits}, and no idle model can be evicted; held by: {}",
                            holders.join(", ")
                        ),
                    });
                }
            }
        }
    }

    /// Drains and stops the model's worker, and proves what came back. The
    /// model stays in the catalogue.
    pub async fn unload(&self, model: &str) -> Result<UnloadReport> {
        // A task of its own, so a caller that goes away cannot strand the
        // slot half-drained.
        let (this, model) = (self.clone(), model.to_string());
        detached(
            &model.clone(),
            async move { this.unload_inner(&model).await },
        )
        .await
    }

    async fn unload_inner(&self, model: &str) -> Result<UnloadReport> {
        let worker = {
            let mut state = self.lock();
            let known = state.catalogue.contains_key(model);
            let Some(slot) = state.slots.get_mut(model) else {
                return Err(if known {
                    Error::NotLoaded {
                        model: model.into(),
                    }
                } else {
                    self.unknown_locked(model, &state)
                });
            };
            if slot.worker.is_none() && slot.restart_at.is_some() {
                // Waiting out a crash backoff: unloading cancels the restart
                // (the restart task finds its slot gone and stops).
                state.slots.remove(model);
                self.inner.changed.notify_waiters();
                return Err(Error::NotLoaded {
                    model: model.into(),
                });
            }
            if slot.state == ModelState::Failed && slot.worker.is_none() {
                // Nothing runs; clearing the failure is all there is to do.
                state.slots.remove(model);
                return Err(Error::NotLoaded {
                    model: model.into(),
                });
            }
            let Some(worker) = slot.worker.clone() else {
                return Err(Error::Busy {
                    model: model.into(),
                    reason: "it is still loading".into(),
                });
            };
            if slot.swapping {
                return Err(Error::Busy {
                    model: model.into(),
                    reason: "a swap is in progress".into(),
                });
            }
            if matches!(slot.state, ModelState::Draining | ModelState::Stopping) {
                return Err(Error::Busy {
                    model: model.into(),
                    reason: format!("it is already {}", slot.state),
                });
            }
            slot.state = ModelState::Draining;
            worker
        };
        self.inner.changed.notify_waiters();
        if !worker.drain(self.inner.config.drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = worker.in_flight(),
                "drain deadline passed; stopping with requests in flight"
            );
        }
        self.set_state(model, ModelState::Stopping);
        let report = stop::stop(&worker, self.inner.config.stop_graces).await;
        {
            let mut state = self.lock();
            state.slots.remove(model);
            if let Some(entry) = state.catalogue.get(model) {
                entry.counters.record_unload(&report);
            }
        }
        self.inner.changed.notify_waiters();
        tracing::info!(model, "{report}");
        Ok(report)
    }

    fn unknown_locked(&self, model: &str, state: &State) -> Error {
        Error::UnknownModel {
            model: model.into(),
            known: state.catalogue.keys().cloned().collect(),
        }
    }

    /// A worker for `model` was spawned: NVML's reading for its pid now
    /// stands for part of its GPU reservation.
    fn note_incoming_pid(&self, model: &str, pid: u32) {
        if let Some(incoming) = self
            .lock()
            .slots
            .get_mut(model)
            .and_then(|s| s.incoming_gpu.as_mut())
            .filter(|i| i.pid.is_none())
        {
            incoming.pid = Some(pid);
        }
    }

    fn set_state(&self, model: &str, new: ModelState) {
        if let Some(slot) = self.lock().slots.get_mut(model) {
            slot.state = new;
        }
        self.inner.changed.notify_waiters();
    }

    /// Replaces a loaded model's worker with one for `spec` without dropping
    /// a request: the new worker loads while the old one serves, routing
    /// switches atomically, the old one drains and stops. If the new worker
    /// fails to load, the old one keeps serving and the error is returned.
    pub async fn swap(&self, spec: ModelSpec) -> Result<SwapReport> {
        let model = spec.name.clone();
        self.check_running(&model)?;
        self.check_spec(&spec)?;
        {
            let mut state = self.lock();
            if !state.catalogue.contains_key(&model) {
                return Err(self.unknown_locked(&model, &state));
            }
            let slot = state
                .slots
                .get_mut(&model)
                .ok_or_else(|| Error::NotLoaded {
                    model: model.clone(),
                })?;
            if slot.swapping || slot_state(slot) != ModelState::Ready {
                return Err(Error::Busy {
                    model: model.clone(),
                    reason: format!("it is {}", slot_state(slot)),
                });
            }
            slot.swapping = true;
        }
        // A task of its own: a caller that goes away must not leave the slot
        // marked `swapping` forever.
        let this = self.clone();
        detached(&model, async move { this.replace_worker(spec).await }).await
    }

    /// The body of a swap (and of a recycle): the slot is already marked
    /// `swapping` by the caller; this clears it whatever happens.
    pub(super) async fn replace_worker(&self, spec: ModelSpec) -> Result<SwapReport> {
        let started = Instant::now();
        let model = spec.name.clone();
        let clear = |this: &Self| {
            if let Some(slot) = this.lock().slots.get_mut(&model) {
                slot.swapping = false;
                slot.hold = false;
                slot.reserved_bytes = 0;
                slot.incoming_gpu = None;
            }
            this.inner.changed.notify_waiters();
        };
        let need = {
            let state = self.lock();
            Need::new(&spec, state.catalogue.get(&model), true)
        };
        let gate = self.inner.load_gate.lock().await;
        let gpus = match self.make_room(&model, &need).await {
            Ok(gpus) => gpus,
            Err(e) => {
                clear(self);
                return Err(e);
            }
        };
        if let Some(slot) = self.lock().slots.get_mut(&model) {
            // Counted until the new worker is in: a concurrent load cannot
            // take the memory it is about to use.
            slot.reserved_bytes = need.ram;
            slot.incoming_gpu = Incoming::new(gpus.clone(), &need);
        }
        drop(gate);
        let launched = if self.is_shutting_down() {
            Err(Error::ShuttingDown {
                model: model.clone(),
            })
        } else {
            launch::launch(&spec, &self.inner.config, gpus, &|pid| {
                self.note_incoming_pid(&model, pid)
            })
            .await
        };
        let launched = match launched {
            Ok((worker, _)) if self.is_shutting_down() => {
                // Shutdown began while it loaded: the old worker is stopped by
                // shutdown; the new one must not outlive it.
                stop::stop(&worker, self.inner.config.stop_graces).await;
                Err(Error::ShuttingDown {
                    model: model.clone(),
                })
            }
            other => other,
        };
        let (new_worker, load) = match launched {
            Ok(launched) => launched,
            Err(e) => {
                clear(self);
                // An old worker that died during the swap goes to the crash
                // policy now that the swap no longer covers it.
                let current = self.lock().slots.get(&model).and_then(|s| s.worker.clone());
                if let Some(old) = current.filter(|w| !w.is_alive()) {
                    let death = old.death().await;
                    self.on_death(&model, &old, &death);
                }
                return Err(e);
            }
        };
        let old = {
            let mut state = self.lock();
            let State {
                catalogue,
                slots,
                retiring,
            } = &mut *state;
            let slot = slots
                .get_mut(&model)
                .expect("a swapping slot is never removed");
            let old = slot
                .worker
                .replace(Arc::clone(&new_worker))
                .expect("a ready slot has a worker");
            retiring.insert(
                old.pid(),
                Retiring {
                    model: model.clone(),
                    worker: Arc::clone(&old),
                    gpus: std::mem::take(&mut slot.gpus),
                },
            );
            slot.swapping = false;
            slot.hold = false;
            slot.state = ModelState::Ready;
            slot.reserved_bytes = 0;
            slot.incoming_gpu = None;
            slot.gpus = load.gpus.clone().unwrap_or_default();
            if let Some(entry) = catalogue.get_mut(&model) {
                let counters = Arc::clone(&entry.counters);
                let mut replacement =
                    Entry::new(spec.clone(), self.inner.config.default_keep_alive);
                replacement.counters = counters;
                replacement.permits = Arc::clone(&entry.permits);
                replacement.queued = Arc::clone(&entry.queued);
                replacement.last_peak_bytes = Some(load.peak_rss_bytes);
                replacement.last_vram_bytes = vram_per_gpu(&load);
                *entry = replacement;
                entry.counters.loads.fetch_add(1, Ordering::Relaxed);
            }
            old
        };
        self.watch_worker(&model, &new_worker);
        let switch_ms = started.elapsed().as_secs_f64() * 1e3;
        self.inner.changed.notify_waiters();
        if !old.drain(self.inner.config.drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = old.in_flight(),
                "old worker missed the drain deadline"
            );
        }
        let unload = stop::stop(&old, self.inner.config.stop_graces).await;
        {
            let mut state = self.lock();
            state.retiring.remove(&old.pid());
            if let Some(entry) = state.catalogue.get(&model) {
                entry.counters.record_unload(&unload);
            }
        }
        self.inner.changed.notify_waiters();
        Ok(SwapReport {
            model,
            old_pid: old.pid(),
            new_pid: new_worker.pid(),
            switch_ms,
            took_ms: started.elapsed().as_secs_f64() * 1e3,
            load,
            unload,
        })
    }

    // ----- requests -----

    /// The worker serving `model`, if it is loaded and ready (no loading).
    pub fn worker(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        let state = self.lock();
        match state.slots.get(model) {
            Some(slot) if slot_state(slot) == ModelState::Ready => Ok(Arc::clone(
                slot.worker.as_ref().expect("ready slots have a worker"),
            )),
            Some(slot) => Err(Error::Busy {
                model: model.into(),
                reason: format!("it is {}", slot_state(slot)),
            }),
            None if state.catalogue.contains_key(model) => Err(Error::NotLoaded {
                model: model.into(),
            }),
            None => Err(self.unknown_locked(model, &state)),
        }
    }

    /// Sends one request and waits for the answer, loading the model first
    /// if it is registered but not loaded.
    pub async fn request(&self, model: &str, body: Body) -> Result<Body> {
        self.request_with(model, body, RequestOptions::default())
            .await
    }

    pub async fn request_with(
        &self,
        model: &str,
        body: Body,
        options: RequestOptions,
    ) -> Result<Body> {
        let mut stream = self.request_stream_with(model, body, options).await?;
        loop {
            match stream.next().await {
                Some(Ok(Piece::Done(body))) => return Ok(body),
                Some(Ok(Piece::Chunk(_))) => {}
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(Error::NotLoaded {
                        model: model.into(),
                    });
                }
            }
        }
    }

    /// Sends one request; its chunks and final body arrive on the stream.
    /// Dropping the stream cancels the request in the worker.
    pub async fn request_stream(&self, model: &str, body: Body) -> Result<RequestStream> {
        self.request_stream_with(model, body, RequestOptions::default())
            .await
    }

    pub async fn request_stream_with(
        &self,
        model: &str,
        body: Body,
        options: RequestOptions,
    ) -> Result<RequestStream> {
        self.check_running(model)?;
        for (field, value) in [
            ("keep_alive", options.keep_alive),
            ("timeout", options.deadline),
        ] {
            crate::config::check_duration(field, value).map_err(|reason| {
                Error::InvalidRequest {
                    model: model.into(),
                    reason,
                }
            })?;
        }
        let hash = crate::child::handle::body_hash(&body);
        let (permits, queued, max_queue, counters) = {
            let state = self.lock();
            let entry = state
                .catalogue
                .get(model)
                .ok_or_else(|| self.unknown_locked(model, &state))?;
            if entry.health.is_quarantined(hash) {
                entry.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Quarantined {
                    model: model.into(),
                });
            }
            (
                Arc::clone(&entry.permits),
                Arc::clone(&entry.queued),
                entry.spec.max_queue.unwrap_or(DEFAULT_MAX_QUEUE),
                Arc::clone(&entry.counters),
            )
        };
        // The deadline covers the whole request: queueing, loading, answering.
        let started = Instant::now();
        let deadline = options
            .deadline
            .and_then(|d| tokio::time::Instant::now().checked_add(d));
        let permit = match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                // Count ourselves in the queue first, so the bound holds under a burst.
                if queued.fetch_add(1, Ordering::SeqCst) >= max_queue {
                    queued.fetch_sub(1, Ordering::SeqCst);
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::QueueFull {
                        model: model.into(),
                        max_concurrency: self
                            .spec(model)
                            .and_then(|s| s.max_concurrency)
                            .unwrap_or(DEFAULT_MAX_CONCURRENCY),
                        queued: max_queue,
                    });
                }
                // Leaves the queue however the wait ends, a dropped caller included.
                let _in_queue = LeaveQueue(Arc::clone(&queued));
                let permit = within(deadline, model, started, permits.acquire_owned()).await;
                permit?.map_err(|_| Error::ShuttingDown {
                    model: model.into(),
                })?
            }
        };
        let give_up = started
            .checked_add(self.inner.config.load_timeout.saturating_mul(2))
            .unwrap_or(started + Duration::from_secs(3600));
        let mut body = Some(body);
        while Instant::now() < give_up {
            within(deadline, model, started, self.ensure_loaded(model))
                .await
                .and_then(|loaded| loaded)
                .inspect_err(|_| {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                })?;
            let changed = self.inner.changed.notified();
            // Pick the current worker and register the call under one lock,
            // so a swap or unload that starts now sees this request in flight.
            let routed = {
                let state = self.lock();
                match state.slots.get(model) {
                    Some(slot) if slot_state(slot) == ModelState::Ready && !slot.hold => {
                        let worker = slot.worker.as_ref().expect("ready slots have a worker");
                        Some(worker.call_stream(body.take().expect("sent once"))?)
                    }
                    _ => None,
                }
            };
            let Some(inner) = routed else {
                // Changing state (a recycle holding requests, a restart): wait for it.
                let _ = tokio::time::timeout(Duration::from_millis(50), changed).await;
                continue;
            };
            counters.requests.fetch_add(1, Ordering::Relaxed);
            return Ok(RequestStream {
                inner,
                model: model.to_string(),
                supervisor: Arc::downgrade(&self.inner),
                counters,
                started,
                keep_alive: options.keep_alive,
                deadline,
                failed: false,
                _permit: permit,
            });
        }
        Err(Error::Busy {
            model: model.into(),
            reason: "it kept changing state; retry".into(),
        })
    }

    // ----- status -----

    /// Every loaded (or loading) model, with memory readings at most a
    /// second old (the heartbeat's, or read now).
    pub fn stats(&self) -> Vec<ModelStatus> {
        self.stats_on(&crate::gpu::inventory())
    }

    /// [`Supervisor::stats`] with VRAM read from `inventory`, so one NVML
    /// reading can serve several views (a metrics scrape).
    pub(crate) fn stats_on(&self, inventory: &crate::gpu::Inventory) -> Vec<ModelStatus> {
        let devices: &[crate::gpu::DeviceReading] = match inventory {
            crate::gpu::Inventory::Devices(devices) => devices,
            crate::gpu::Inventory::NoGpu(_) => &[],
        };
        // What the state holds is copied under the lock; procfs is read
        // after it is released, so a status poll never holds up a request.
        let rows: Vec<(ModelStatus, Option<Arc<WorkerHandle>>)> = {
            let state = self.lock();
            let now = Instant::now();
            state
                .slots
                .iter()
                .map(|(name, slot)| {
                    let entry = state.catalogue.get(name);
                    let worker = slot.worker.clone();
                    let status = ModelStatus {
                        name: name.clone(),
                        backend: entry.map(|e| e.spec.backend.clone()).unwrap_or_default(),
                        state: slot_state(slot),
                        pid: worker.as_ref().map(|w| w.pid()),
                        rss_bytes: 0,
                        pss_bytes: 0,
                        peak_rss_bytes: 0,
                        uptime_s: 0.0,
                        requests: 0,
                        in_flight: 0,
                        queued: entry.map(|e| e.queued.load(Ordering::SeqCst)).unwrap_or(0),
                        keep_alive_left_s: slot
                            .expires_at
                            .map(|t| t.saturating_duration_since(now).as_secs_f64()),
                        restarts: entry
                            .map(|e| e.counters.restarts.load(Ordering::Relaxed))
                            .unwrap_or(0),
                        recycles: entry
                            .map(|e| e.counters.recycles.load(Ordering::Relaxed))
                            .unwrap_or(0),
                        last_exit: entry.and_then(|e| e.health.last_exit.clone()),
                        rss_growth_per_request_bytes: 0.0,
                        vram_bytes: None,
                        gpus: slot.gpus.clone(),
                    };
                    (status, worker)
                })
                .collect()
        };
        let mut out: Vec<ModelStatus> = rows
            .into_iter()
            .map(|(mut status, worker)| {
                if let Some(w) = worker {
                    // Heartbeats sample every worker each second; a status
                    // view reuses that reading rather than walking procfs
                    // again for each poll.
                    let memory = w.recent_memory(Duration::from_secs(1)).unwrap_or_default();
                    status.rss_bytes = memory.rss_bytes;
                    status.pss_bytes = memory.pss_bytes;
                    status.peak_rss_bytes = memory.peak_rss_bytes;
                    status.uptime_s = w.uptime().as_secs_f64();
                    status.requests = w.requests();
                    status.in_flight = w.in_flight();
                    status.rss_growth_per_request_bytes = w.rss_growth_per_request();
                    status.vram_bytes = crate::gpu::process_vram(devices, w.pid());
                }
                status
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Each GPU's memory, with berth's workers on it named (a worker being
    /// replaced is named too). Reads NVML; creates no CUDA context.
    pub fn gpus(&self) -> crate::gpu::GpuStatus {
        self.gpus_on(crate::gpu::inventory())
    }

    /// [`Supervisor::gpus`] from an NVML reading already taken.
    pub(crate) fn gpus_on(&self, inventory: crate::gpu::Inventory) -> crate::gpu::GpuStatus {
        let workers: Vec<(u32, String)> = {
            let state = self.lock();
            state
                .slots
                .iter()
                .filter_map(|(name, slot)| slot.worker.as_ref().map(|w| (w.pid(), name.clone())))
                .chain(
                    state
                        .retiring
                        .values()
                        .map(|r| (r.worker.pid(), r.model.clone())),
                )
                .collect()
        };
        crate::gpu::GpuStatus::new(inventory, &workers)
    }

    /// Counters per registered model, for metrics.
    pub fn counters(&self) -> Vec<(String, Arc<ModelCounters>)> {
        self.lock()
            .catalogue
            .iter()
            .map(|(n, e)| (n.clone(), Arc::clone(&e.counters)))
            .collect()
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
            self.inner.changed.notify_waiters();
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
        self.inner.changed.notify_waiters();
        reports
    }

    /// Called when a request ends: the model was just used.
    /// Returns whether the model has a recycling policy to check.
    fn request_finished(inner: &Inner, model: &str, keep_alive: Option<Duration>) -> bool {
        let mut state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        let State {
            catalogue, slots, ..
        } = &mut *state;
        let Some(entry) = catalogue.get_mut(model) else {
            return false;
        };
        if let Some(k) = keep_alive {
            entry.keep_alive = Some(k);
        }
        if let Some(slot) = slots.get_mut(model) {
            slot.last_used = Instant::now();
            slot.expires_at = expiry(entry.keep_alive);
        }
        entry.spec.max_rss.is_some() || entry.spec.max_requests.is_some()
    }
}

/// Counts a request out of its model's queue when dropped.
struct LeaveQueue(Arc<AtomicUsize>);

impl Drop for LeaveQueue {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
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

/// Runs `fut` until the request's deadline, if it has one.
async fn within<T>(
    deadline: Option<tokio::time::Instant>,
    model: &str,
    started: Instant,
    fut: impl std::future::Future<Output = T>,
) -> Result<T> {
    match deadline {
        None => Ok(fut.await),
        Some(at) => tokio::time::timeout_at(at, fut)
            .await
            .map_err(|_| Error::DeadlineExceeded {
                model: model.into(),
                after: started.elapsed(),
            }),
    }
}

fn slot_state(slot: &Slot) -> ModelState {
    match &slot.worker {
        Some(w) if !w.is_alive() && slot.state == ModelState::Ready => ModelState::Failed,
        _ => slot.state,
    }
}

/// What a new worker needs room for.
#[derive(Debug, Clone)]
struct Need {
    /// RAM to count for it while it loads.
    ram: u64,
    /// It replaces the model's current worker (swap, recycle, restart),
    /// which already counts toward `max_loaded`.
    replacing: bool,
    /// Its GPU request and the VRAM it is expected to take on each device.
    gpu: Option<(gpu::GpuRequest, u64)>,
}

impl Need {
    /// Sized from what the model's last worker measured when it ran the
    /// same thing, else from the weights on disk.
    fn new(spec: &ModelSpec, entry: Option<&Entry>, replacing: bool) -> Need {
        let same = entry.filter(|e| {
            e.spec.backend == spec.backend
                && e.spec.model == spec.model
                && e.spec.options == spec.options
        });
        let disk = footprint_on_disk(spec);
        Need {
            ram: same.and_then(|e| e.last_peak_bytes).unwrap_or(disk),
            replacing,
            gpu: spec.gpus.clone().map(|request| {
                (
                    request,
                    same.and_then(|e| e.last_vram_bytes).unwrap_or(disk),
                )
            }),
        }
    }

    fn vram(&self) -> u64 {
        self.gpu.as_ref().map(|(_, vram)| *vram).unwrap_or(0)
    }
}

/// Whether eviction may stop this model: ready, idle, nothing queued, not
/// being replaced.
fn evictable(state: &State, name: &str, slot: &Slot) -> bool {
    slot.state == ModelState::Ready
        && !slot.swapping
        && slot.worker.as_ref().is_some_and(|w| w.in_flight() == 0)
        && state
            .catalogue
            .get(name)
            .is_none_or(|e| e.queued.load(Ordering::SeqCst) == 0)
}

/// Puts a freshly loaded worker into its slot (a load or a restart) and
/// records what its load measured.
fn install(
    slot: &mut Slot,
    entry: Option<&mut Entry>,
    worker: &Arc<WorkerHandle>,
    report: &LoadReport,
) {
    slot.state = ModelState::Ready;
    slot.worker = Some(Arc::clone(worker));
    slot.loading = None;
    slot.reserved_bytes = 0;
    slot.gpus = report.gpus.clone().unwrap_or_default();
    slot.incoming_gpu = None;
    if let Some(entry) = entry {
        entry.last_peak_bytes = Some(report.peak_rss_bytes);
        entry.last_vram_bytes = vram_per_gpu(report).or(entry.last_vram_bytes);
        entry.counters.loads.fetch_add(1, Ordering::Relaxed);
        slot.expires_at = expiry(entry.keep_alive);
    }
}

/// When a keep-alive that starts now runs out; `None` (never) for none, or
/// for one too long for the clock (specs are range-checked, but a host's
/// own `RequestOptions` need not be).
fn expiry(keep_alive: Option<Duration>) -> Option<Instant> {
    keep_alive.and_then(|k| Instant::now().checked_add(k))
}

/// VRAM a load report shows on each of the worker's GPUs.
fn vram_per_gpu(report: &LoadReport) -> Option<u64> {
    let gpus = report.gpus.as_ref().map_or(1, |g| g.len().max(1)) as u64;
    report.vram_bytes.map(|bytes| bytes / gpus)
}

/// berth's workers and loads in progress as GPU placement sees them;
/// `model` itself (being replaced) is never a candidate for eviction, and
/// its own reservation (a retried restart's) is not counted against it.
fn gpu_holders(state: &State, model: &str) -> Vec<gpu::Holder> {
    let mut holders: Vec<gpu::Holder> = state
        .retiring
        .values()
        .map(|r| gpu::Holder {
            model: r.model.clone(),
            pid: Some(r.worker.pid()),
            gpus: r.gpus.clone(),
            reserved_bytes: 0,
            evictable: false,
            last_used: 0,
        })
        .collect();
    for (name, slot) in &state.slots {
        // Larger is more recent.
        let last_used = u64::MAX - slot.last_used.elapsed().as_micros() as u64;
        if let Some(worker) = &slot.worker {
            holders.push(gpu::Holder {
                model: name.clone(),
                pid: Some(worker.pid()),
                gpus: slot.gpus.clone(),
                reserved_bytes: 0,
                evictable: name != model && evictable(state, name, slot),
                last_used,
            });
        }
        if let Some(incoming) = slot.incoming_gpu.as_ref().filter(|_| name != model) {
            holders.push(gpu::Holder {
                model: name.clone(),
                pid: incoming.pid,
                gpus: incoming.gpus.clone(),
                reserved_bytes: incoming.vram,
                evictable: false,
                last_used,
            });
        }
    }
    holders
}

fn footprint_on_disk(spec: &ModelSpec) -> u64 {
    fn size(path: &std::path::Path) -> u64 {
        match std::fs::metadata(path) {
            Ok(m) if m.is_dir() => std::fs::read_dir(path)
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .map(|e| size(&e.path()))
                        .sum()
                })
                .unwrap_or(0),
            Ok(m) => m.len(),
            Err(_) => 0,
        }
    }
    spec.model.as_deref().map(size).unwrap_or(0)
}

/// Unloads idle models whose keep-alive ran out.
async fn keep_alive_reaper(inner: Weak<Inner>) {
    let mut ticker = tokio::time::interval(Duration::from_millis(100));
    loop {
        ticker.tick().await;
        let Some(strong) = inner.upgrade() else {
            return;
        };
        if strong.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        let expired: Vec<String> = {
            let state = strong.state.lock().unwrap_or_else(|e| e.into_inner());
            state
                .slots
                .iter()
                .filter(|(name, slot)| {
                    slot.state == ModelState::Ready
                        && !slot.swapping
                        && slot.expires_at.is_some_and(|t| t <= now)
                        && slot.worker.as_ref().is_some_and(|w| w.in_flight() == 0)
                        && state
                            .catalogue
                            .get(*name)
                            .is_none_or(|e| e.queued.load(Ordering::SeqCst) == 0)
                })
                .map(|(name, _)| name.clone())
                .collect()
        };
        let supervisor = Supervisor { inner: strong };
        for name in expired {
            let supervisor = supervisor.clone();
            tokio::spawn(async move {
                tracing::info!(model = name, "keep-alive ran out; unloading");
                if let Err(e) = supervisor.unload(&name).await {
                    tracing::debug!(model = name, "keep-alive unload skipped: {e}");
                }
            });
        }
    }
}

/// A request's answer, piece by piece, with the model's bookkeeping
/// (concurrency slot, keep-alive, metrics) done when it ends.
pub struct RequestStream {
    inner: ResponseStream,
    model: String,
    supervisor: Weak<Inner>,
    counters: Arc<ModelCounters>,
    started: Instant,
    keep_alive: Option<Duration>,
    deadline: Option<tokio::time::Instant>,
    failed: bool,
    _permit: OwnedSemaphorePermit,
}

impl fmt::Debug for RequestStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestStream")
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl RequestStream {
    /// The next piece; `None` after the final one.
    pub async fn next(&mut self) -> Option<Result<Piece>> {
        let piece = match self.deadline {
            None => self.inner.next().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, self.inner.next()).await {
                Ok(piece) => piece,
                Err(_) => {
                    self.inner.cancel();
                    Some(Err(Error::DeadlineExceeded {
                        model: self.model.clone(),
                        after: self.started.elapsed(),
                    }))
                }
            },
        };
        if matches!(piece, Some(Err(_))) {
            self.failed = true;
        }
        piece
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if self.failed {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.observe_latency(self.started.elapsed());
        if let Some(inner) = self.supervisor.upgrade() {
            // One lock per request; a second only for models that recycle.
            if Supervisor::request_finished(&inner, &self.model, self.keep_alive) {
                Supervisor::maybe_recycle(&inner, &self.model);
            }
        }
    }
}
