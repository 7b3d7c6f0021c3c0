//! Worker kinds' preloaded interpreters (`child/preload.rs`): one per kind
//! that declares `preload`, started at the kind's first load (or with the
//! supervisor, `preload_at_start`), forking every later worker of the kind,
//! listed in `ps` and `/metrics` with what it costs, and stopped once no
//! model of its kind has been loaded for `preload_keep_alive`.
//!
//! Fallback is the rule: a refused preload (the operator's mistake, named
//! in the log, `ps` and each load report) makes its kind start cold; a
//! preloader that dies or fails to start is started anew at the next load,
//! which meanwhile starts cold. No load fails for a preloader's sake.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::{Inner, Supervisor};
use crate::child::preload::{Preloader, StartFailure};
use crate::child::start::Start;
use crate::config::{DEFAULT_PRELOAD_KEEP_ALIVE, ModelSpec, WorkerKind};

/// The wait before a failed preloader start is tried again, doubling up to
/// the most.
const PRELOAD_RETRY_FIRST: Duration = Duration::from_secs(10);
const PRELOAD_RETRY_MAX: Duration = Duration::from_secs(300);

/// The preloaders, by worker kind.
#[derive(Default)]
pub(super) struct Preloaders {
    kinds: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<KindSlot>>>>,
    /// The task that stops idle preloaders runs.
    watching: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct KindSlot {
    preloader: Option<Arc<Preloader>>,
    /// Why the kind's preload was refused: it starts cold from then on.
    refused: Option<String>,
    /// Why the last start failed, if it did, and when a load may try
    /// again (each failure doubles the wait, from 10 s to 5 minutes): a
    /// preloader that cannot start costs each load nothing meanwhile.
    failed: Option<String>,
    retry_at: Option<Instant>,
    backoff: Duration,
    /// The last time a worker of the kind was asked for.
    used: Option<Instant>,
}

/// A kind's preloader, as `ps` and `/metrics` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PreloaderStatus {
    pub kind: String,
    /// `ready`, `refused` (the kind starts cold) or `failed` (the next load
    /// of the kind tries again).
    pub state: String,
    pub pid: Option<u32>,
    pub modules: Vec<String>,
    pub import_ms: f64,
    /// The worker it forked ahead for the next load of its kind, waiting
    /// (counted in its memory below).
    #[serde(default)]
    pub spare_pid: Option<u32>,
    /// Its standing cost: what it and its spare worker hold while they wait.
    pub rss_bytes: u64,
    pub pss_bytes: u64,
    pub private_bytes: u64,
    pub uptime_s: f64,
    /// Workers forked from it.
    pub forks: u64,
    /// Seconds until it is stopped if no model of its kind is loaded
    /// meanwhile; `None` while one is.
    pub keep_alive_left_s: Option<f64>,
    /// Why it is refused or failed.
    pub reason: Option<String>,
}

/// The kind's program and modules, if `spec` runs its kind's preloadable
/// program as it is (a spec with its own command or binary does not).
fn preloading_kind<'a>(
    spec: &ModelSpec,
    workers: &'a std::collections::BTreeMap<String, WorkerKind>,
) -> Option<(&'a str, &'a WorkerKind)> {
    if spec.command.is_some() || spec.worker_binary.is_some() {
        return None;
    }
    let (name, kind) = workers.get_key_value(spec.worker.as_deref()?)?;
    (!kind.preload.is_empty() && kind.command.is_some() && kind.http.is_none())
        .then_some((name.as_str(), kind))
}

impl Preloaders {
    fn slot(&self, kind: &str) -> Arc<tokio::sync::Mutex<KindSlot>> {
        let mut kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(kinds.entry(kind.to_string()).or_default())
    }

    fn all(&self) -> Vec<(String, Arc<tokio::sync::Mutex<KindSlot>>)> {
        let kinds = self.kinds.lock().unwrap_or_else(|e| e.into_inner());
        kinds
            .iter()
            .map(|(k, s)| (k.clone(), Arc::clone(s)))
            .collect()
    }
}

impl Supervisor {
    /// How the next worker for `spec` begins: forked from its kind's
    /// preloader (started now if need be), or cold, and then why.
    pub(super) async fn worker_start(&self, spec: &ModelSpec) -> Start {
        let config = self.config();
        let Some((kind, declared)) = preloading_kind(spec, &config.workers) else {
            return Start::Cold;
        };
        let slot = self.inner.preloaders.slot(kind);
        let mut slot = slot.lock().await;
        slot.used = Some(Instant::now());
        if let Some(reason) = &slot.refused {
            return Start::ColdBecause(reason.clone());
        }
        if let Some(preloader) = &slot.preloader {
            if preloader.is_alive() {
                return Start::Fork(Arc::clone(preloader));
            }
            let exit = preloader
                .process()
                .try_exit()
                .map(|s| s.to_string())
                .unwrap_or_default();
            let tail = preloader.process().stderr_suffix().await;
            tracing::warn!(
                kind,
                pid = preloader.pid(),
                "the preloaded interpreter exited ({exit}){tail}; starting a new one"
            );
            slot.preloader = None;
        }
        if let (Some(failed), Some(at)) = (&slot.failed, slot.retry_at) {
            let left = at.saturating_duration_since(Instant::now());
            if !left.is_zero() {
                return Start::ColdBecause(format!(
                    "{failed} (the next try is in {})",
                    crate::units::format_duration(Duration::from_secs(left.as_secs().max(1)))
                ));
            }
        }
        match self.start_preloader(kind, declared).await {
            Ok(preloader) => {
                slot.failed = None;
                slot.retry_at = None;
                slot.backoff = Duration::ZERO;
                slot.preloader = Some(Arc::clone(&preloader));
                Start::Fork(preloader)
            }
            Err(failure) => {
                let reason = format!("worker kind `{kind}`: {failure}");
                match failure {
                    StartFailure::Refused { .. } => {
                        tracing::error!(
                            "{reason}; the kind's workers start cold (fix its `preload` list)"
                        );
                        slot.refused = Some(reason.clone());
                    }
                    StartFailure::Failed(_) => {
                        slot.backoff =
                            (slot.backoff * 2).clamp(PRELOAD_RETRY_FIRST, PRELOAD_RETRY_MAX);
                        slot.retry_at = Some(Instant::now() + slot.backoff);
                        tracing::warn!(
                            "{reason}; this worker starts cold, and the kind's loads until a \
                             new try in {}",
                            crate::units::format_duration(slot.backoff)
                        );
                        slot.failed = Some(reason.clone());
                    }
                }
                Start::ColdBecause(reason)
            }
        }
    }

    async fn start_preloader(
        &self,
        kind: &str,
        declared: &WorkerKind,
    ) -> Result<Arc<Preloader>, StartFailure> {
        let argv = declared.command.as_deref().unwrap_or_default();
        let Some((program, args)) = argv.split_first() else {
            return Err(StartFailure::Failed("the kind has no command".into()));
        };
        let env: Vec<(String, String)> = declared.env.clone().into_iter().collect();
        let preloader = Preloader::start(
            kind,
            (&PathBuf::from(program), args),
            declared.cwd.as_deref(),
            &env,
            &declared.preload,
            // Half the load's time: a cold start still has the rest.
            self.config().load_timeout / 2,
        )
        .await?;
        self.watch_preloaders();
        Ok(Arc::new(preloader))
    }

    /// Starts the preloaders of the kinds that ask to start with the
    /// supervisor (`preload_at_start`), each in a task of its own.
    pub(super) fn start_preloaders_now(&self) {
        for (kind, declared) in &self.config().workers {
            if declared.preload.is_empty() || !declared.preload_at_start {
                continue;
            }
            let (this, kind) = (self.clone(), kind.clone());
            tokio::spawn(async move {
                let mut spec = ModelSpec::new(format!("preload-{kind}"), "");
                spec.worker = Some(kind);
                let _ = this.worker_start(&spec).await;
            });
        }
    }

    /// Each kind's preloader, refusal or failure.
    pub fn preloaders(&self) -> Vec<PreloaderStatus> {
        let loaded = self.loaded_kinds();
        let mut out = Vec::new();
        for (kind, slot) in self.inner.preloaders.all() {
            // A kind being started holds its lock: shown once it is up.
            let Ok(slot) = slot.try_lock() else { continue };
            let keep_alive = self.keep_alive_of(&kind);
            let mut status = PreloaderStatus {
                kind: kind.clone(),
                state: "ready".into(),
                pid: None,
                spare_pid: None,
                modules: Vec::new(),
                import_ms: 0.0,
                rss_bytes: 0,
                pss_bytes: 0,
                private_bytes: 0,
                uptime_s: 0.0,
                forks: 0,
                keep_alive_left_s: None,
                reason: None,
            };
            if let Some(reason) = &slot.refused {
                status.state = "refused".into();
                status.reason = Some(reason.clone());
            } else if let Some(p) = slot.preloader.as_ref().filter(|p| p.is_alive()) {
                let memory = p.memory();
                status.pid = Some(p.pid());
                status.spare_pid = p.spare_pid();
                status.modules = p.modules().to_vec();
                status.import_ms = p.import_time().as_secs_f64() * 1e3;
                status.rss_bytes = memory.rss_bytes;
                status.pss_bytes = memory.pss_bytes;
                status.private_bytes = memory.private_bytes;
                status.uptime_s = p.uptime().as_secs_f64();
                status.forks = p.forks();
                status.keep_alive_left_s = (!loaded.contains(&kind)).then(|| {
                    let since = slot.used.map_or(Duration::ZERO, |u| u.elapsed());
                    keep_alive.saturating_sub(since).as_secs_f64()
                });
            } else if let Some(reason) = &slot.failed {
                status.state = "failed".into();
                status.reason = Some(reason.clone());
            } else {
                continue;
            }
            out.push(status);
        }
        out.sort_by(|a, b| a.kind.cmp(&b.kind));
        out
    }

    /// The kinds with a model loaded (or being loaded) now.
    fn loaded_kinds(&self) -> std::collections::HashSet<String> {
        let state = self.lock();
        state
            .slots
            .keys()
            .filter_map(|name| state.catalogue.get(name))
            .filter_map(|entry| entry.spec.worker.clone())
            .collect()
    }

    fn keep_alive_of(&self, kind: &str) -> Duration {
        self.config()
            .workers
            .get(kind)
            .and_then(|k| k.preload_keep_alive)
            .unwrap_or(DEFAULT_PRELOAD_KEEP_ALIVE)
    }

    /// Starts, once, the task that stops preloaders whose kind has had no
    /// model loaded for its keep-alive.
    fn watch_preloaders(&self) {
        if self.inner.preloaders.watching.swap(true, Ordering::SeqCst) {
            return;
        }
        tokio::spawn(preloader_reaper(Arc::downgrade(&self.inner)));
    }

    fn any_preloader_alive(&self) -> bool {
        self.inner.preloaders.all().iter().any(|(_, slot)| {
            slot.try_lock()
                .map_or(true, |s| s.preloader.as_ref().is_some_and(|p| p.is_alive()))
        })
    }

    /// Kills every preloader's group at once (a supervisor dropped without
    /// `shutdown()`).
    pub(super) fn kill_preloaders(inner: &Inner) {
        for (_, slot) in inner.preloaders.all() {
            if let Ok(slot) = slot.try_lock() {
                if let Some(p) = &slot.preloader {
                    p.process().signal_group(nix::sys::signal::Signal::SIGKILL);
                }
            }
        }
    }

    /// Takes the preloaders of `kinds` out of their slots (their next
    /// start is a new one, with a clean record), for the caller to stop.
    pub(super) async fn detach_preloaders(&self, kinds: &[String]) -> Vec<Arc<Preloader>> {
        let mut out = Vec::new();
        for (kind, slot) in self.inner.preloaders.all() {
            if kinds.contains(&kind) {
                let mut slot = slot.lock().await;
                out.extend(slot.preloader.take());
                *slot = KindSlot::default();
            }
        }
        out
    }

    /// Stops every preloader (an in-place upgrade's handover: the next
    /// berth starts its own).
    pub(crate) async fn stop_all_preloaders(&self) {
        self.stop_preloaders().await;
    }

    /// Starts the preloaders configured to start at once again (an
    /// upgrade called off after they were stopped).
    pub(crate) fn restart_preloaders(&self) {
        self.start_preloaders_now();
    }

    /// Stops every preloader (at shutdown, after the workers).
    pub(super) async fn stop_preloaders(&self) {
        for (_, slot) in self.inner.preloaders.all() {
            let mut slot = slot.lock().await;
            if let Some(p) = slot.preloader.take() {
                p.stop().await;
            }
        }
    }
}

/// Checks the preloaders every few seconds (at most a tenth of the shortest
/// keep-alive, at least one second) while the supervisor lives.
async fn preloader_reaper(inner: Weak<Inner>) {
    loop {
        let Some(strong) = inner.upgrade() else {
            return;
        };
        let this = Supervisor { inner: strong };
        let shortest = this
            .config()
            .workers
            .values()
            .filter(|k| !k.preload.is_empty())
            .map(|k| k.preload_keep_alive.unwrap_or(DEFAULT_PRELOAD_KEEP_ALIVE))
            .min()
            .unwrap_or(DEFAULT_PRELOAD_KEEP_ALIVE);
        let tick = (shortest / 10).clamp(Duration::from_secs(1), Duration::from_secs(30));
        if this.is_shutting_down() {
            return;
        }
        if !this.any_preloader_alive() {
            // Nothing to watch: end, unless a preloader started meanwhile
            // and found this task still running.
            this.inner
                .preloaders
                .watching
                .store(false, Ordering::SeqCst);
            if !this.any_preloader_alive()
                || this.inner.preloaders.watching.swap(true, Ordering::SeqCst)
            {
                return;
            }
        }
        let loaded = this.loaded_kinds();
        for (kind, slot) in this.inner.preloaders.all() {
            if loaded.contains(&kind) {
                continue;
            }
            let keep_alive = this.keep_alive_of(&kind);
            let Ok(mut slot) = slot.try_lock() else {
                continue;
            };
            let idle = slot.used.map_or(Duration::MAX, |u| u.elapsed());
            if idle < keep_alive {
                continue;
            }
            if let Some(p) = slot.preloader.take() {
                tracing::info!(
                    kind,
                    pid = p.pid(),
                    "no model of the kind loaded for {}; stopping its preloaded interpreter",
                    crate::units::format_duration(keep_alive)
                );
                p.stop().await;
            }
        }
        drop(this);
        tokio::time::sleep(tick).await;
    }
}
