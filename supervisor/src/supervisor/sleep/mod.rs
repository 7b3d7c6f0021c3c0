//! Sleep: a loaded model gives its GPU memory back without losing its
//! process, and wakes in the time it takes to copy that memory back.
//!
//! `sleep = "driver"`: the CUDA driver's checkpoint API, called from
//! outside (`child/checkpoint.rs`) on each of the worker's processes that
//! NVML shows holding device memory: lock, checkpoint (the memory moves
//! into the process's host memory, the GPU is released); at wake, restore
//! and unlock. Any framework (candle, PyTorch, JAX, an HTTP server) sleeps
//! so without knowing.
//!
//! | from | event | to |
//! |---|---|---|
//! | Ready | `sleep`: no new request (they wait, as for a load), in-flight ones finish | Asleep, falling |
//! | Asleep, falling | every process checkpointed; NVML read again | Asleep |
//! | Asleep, falling | a step failed | what was done undone, then stopped (the reason in `sleep_failed`) |
//! | Asleep | `wake`, or a request for it (waiting on its signal, as for a load) | Asleep, waking |
//! | Asleep, waking | every process restored and unlocked | Ready |
//! | Asleep, waking | a step failed | stopped; a cold load follows (the requests waiting wait for it) |
//! | Asleep | an unload, its keep-alive, an eviction | stopped at once (SIGKILL: a locked process's own exit would wait on the driver) |
//!
//! Nothing is put to sleep that cannot be proven: without NVML's
//! per-process figures (no driver, a container without the host's PID
//! namespace) a sleep is refused with the reason, and every sleep says
//! what NVML read for the model's processes before and after.

mod choice;
pub(super) mod state;

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::{EventKind, ModelState, Supervisor, detached};
use crate::child::checkpoint::{self, Step};
use crate::child::handle::WorkerHandle;
use crate::child::upstream::Upstream;
use crate::config::{ServerSleep, SleepMode};
use crate::error::{Error, Result};
use crate::gpu::{self, Inventory};
use state::{SleepPhase, SleepReport, WakeReport};

/// What NVML reads for each of `pids` now; `Err` says why there is no
/// per-process figure.
async fn per_pid_vram(pids: Vec<u32>) -> std::result::Result<Vec<(u32, u64)>, String> {
    let inventory = tokio::task::spawn_blocking(gpu::inventory)
        .await
        .map_err(|e| format!("reading NVML failed: {e}"))?;
    let devices = match inventory {
        Inventory::NoGpu(reason) => return Err(reason),
        Inventory::Devices(devices) => devices,
    };
    Ok(pids
        .iter()
        .map(|pid| (*pid, gpu::process_vram(&devices, &[*pid]).unwrap_or(0)))
        .collect())
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

impl Supervisor {
    /// Puts `model` to sleep (`sleep = "driver"`): no new request reaches
    /// it, those in flight finish, its processes' device memory moves to
    /// their host memory and the GPU is released; it keeps its pid. A
    /// failed step stops it instead (`Error::SleepFailed` says so).
    pub async fn sleep(&self, model: &str) -> Result<SleepReport> {
        let (this, model) = (self.clone(), self.canonical(model));
        detached(
            &model.clone(),
            async move { this.sleep_inner(&model).await },
        )
        .await
    }

    /// Wakes `model` (its memory restored to the GPU); a failed restore
    /// ends in a cold load, never a stuck model.
    pub async fn wake(&self, model: &str) -> Result<WakeReport> {
        let (this, model) = (self.clone(), self.canonical(model));
        detached(&model.clone(), async move {
            match this.wake_inner(&model, "asked").await {
                // Stopped: loaded cold, so it serves again.
                Err(Error::SleepFailed {
                    model,
                    step,
                    reason,
                    ..
                }) => {
                    this.ensure_loaded(&model).await?;
                    Err(Error::SleepFailed {
                        model,
                        step,
                        reason,
                        fallback: "stopped, then loaded cold: it serves again".into(),
                    })
                }
                other => other,
            }
        })
        .await
    }

    async fn sleep_inner(&self, model: &str) -> Result<SleepReport> {
        self.check_not_frozen(model)?;
        let refused = |reason: String| Error::SleepRefused {
            model: model.into(),
            reason,
        };
        let (worker, mode) = {
            let mut state = self.lock();
            let Some(entry) = state.catalogue.get(model) else {
                return Err(self.unknown_locked(model, &state));
            };
            let Some(mode) = entry.spec.sleep else {
                return Err(refused(
                    "it has no `sleep` (a model sleeps only as its config says: `sleep = \
                     \"driver\"`, the CUDA driver's checkpoint API, or `\"server\"`, its \
                     server's own routes)"
                        .into(),
                ));
            };
            let Some(slot) = state.slots.get_mut(model) else {
                return Err(Error::NotLoaded {
                    model: model.into(),
                });
            };
            match slot.state() {
                ModelState::Ready if !slot.swapping && !slot.hold => {}
                ModelState::Asleep => return Err(refused("it is asleep already".into())),
                ModelState::Ready => {
                    return Err(Error::Busy {
                        model: model.into(),
                        reason: "it is being swapped or recycled".into(),
                    });
                }
                other => {
                    return Err(Error::Busy {
                        model: model.into(),
                        reason: format!("it is {other}"),
                    });
                }
            }
            let worker = Arc::clone(slot.worker.as_ref().expect("a ready slot has a worker"));
            slot.state = ModelState::Asleep;
            slot.sleep = Some(SleepPhase::Falling);
            (worker, mode)
        };
        self.inner.notify_changed();
        match self.fall_asleep(model, &worker, mode).await {
            Ok(report) => Ok(report),
            Err(Fell::Refused(reason)) => {
                self.back_to_ready(model);
                Err(refused(reason))
            }
            Err(Fell::Busy(reason)) => {
                self.back_to_ready(model);
                Err(Error::Busy {
                    model: model.into(),
                    reason,
                })
            }
            Err(Fell::Failed {
                step,
                reason,
                undone,
            }) => {
                // Stopped with the reason: the GPU is given back either way,
                // and the next request loads it cold.
                worker.set_asleep(false);
                if !undone {
                    worker.kill();
                }
                self.back_to_ready(model);
                // Held (no request reaches it) until the unload has it.
                if let Some(slot) = self.lock().slots.get_mut(model) {
                    slot.hold = true;
                }
                let fallback = match self.unload_inner(model).await {
                    Ok(_) => {
                        "stopped instead (its unload report proves what came back)".to_string()
                    }
                    Err(e) => format!("stopping it instead failed too: {e}"),
                };
                self.emit(EventKind::SleepFailed {
                    model: model.into(),
                    step: step.to_string(),
                    error: reason.clone(),
                    fallback: fallback.clone(),
                });
                Err(Error::SleepFailed {
                    model: model.into(),
                    step: step.to_string(),
                    reason,
                    fallback,
                })
            }
        }
    }

    /// The sleep's work, its slot set falling.
    async fn fall_asleep(
        &self,
        model: &str,
        worker: &Arc<WorkerHandle>,
        mode: SleepMode,
    ) -> std::result::Result<SleepReport, Fell> {
        // The server's own routes, for `sleep = "server"`.
        let server = match (mode, worker.upstream_server()) {
            (SleepMode::Driver, _) => None,
            (SleepMode::Server, None) => {
                return Err(Fell::Refused(
                    "`sleep = \"server\"` is for a model served by an HTTP server; a berth \
                     worker sleeps by the driver (`sleep = \"driver\"`)"
                        .into(),
                ));
            }
            (SleepMode::Server, Some(upstream)) => match upstream.spec().sleep.clone() {
                Some(routes) => Some((Arc::clone(upstream), routes)),
                None => {
                    return Err(Fell::Refused(
                        "its server's kind has no `http.sleep` routes (vLLM's: `sleep = \
                         \"/sleep?level=1\"`, `wake = \"/wake_up\"`)"
                            .into(),
                    ));
                }
            },
        };
        let _ = worker.sample_memory();
        let pids = worker.pids();
        let before = per_pid_vram(pids.clone()).await.map_err(|reason| {
            Fell::Refused(format!(
                "without NVML's per-process figures a sleep cannot be proven ({reason})"
            ))
        })?;
        let held: Vec<(u32, u64)> = before.into_iter().filter(|(_, b)| *b > 0).collect();
        if held.is_empty() {
            return Err(Fell::Refused(format!(
                "NVML shows no GPU memory held by its processes (pid {}): nothing to give \
                 back, or NVML cannot see them (a container without the host's PID \
                 namespace)",
                pids.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        let drained = Instant::now();
        let drain_timeout = self.config().drain_timeout;
        if !worker.drain(drain_timeout).await {
            return Err(Fell::Busy(format!(
                "its requests did not finish within {}; it serves on",
                crate::units::format_duration(drain_timeout)
            )));
        }
        let drain_ms = ms(drained);
        let rss_before_bytes = worker.sample_memory().unwrap_or_default().rss_bytes;
        // Heartbeats and health checks pause: a locked process's CUDA
        // calls (a server's health route among them) wait on the driver.
        worker.set_asleep(true);
        let started = Instant::now();
        let config = self.config();
        let mut done: Vec<(u32, Step)> = Vec::new();
        if let Some((upstream, routes)) = &server
            && let Err(reason) = post(upstream, &routes.sleep).await
        {
            // Asleep or not, it is stopped the ordinary way.
            return Err(Fell::Failed {
                step: "sleep".into(),
                reason,
                undone: true,
            });
        }
        for (pid, _) in held.iter().filter(|_| server.is_none()) {
            for step in [Step::Lock, Step::Checkpoint] {
                if let Err(e) = checkpoint::run(&config, step, *pid).await {
                    let undone = self.undo(&config, &done).await;
                    return Err(Fell::Failed {
                        step: step.to_string(),
                        reason: if e.no_api {
                            format!("{} (the driver cannot put processes to sleep)", e.message)
                        } else {
                            e.message
                        },
                        undone,
                    });
                }
                match done.last_mut() {
                    Some((p, s)) if p == pid => *s = step,
                    _ => done.push((*pid, step)),
                }
            }
        }
        let checkpoint_ms = ms(started);
        let held_pids: Vec<u32> = held.iter().map(|(p, _)| *p).collect();
        let after = per_pid_vram(held_pids.clone()).await.unwrap_or_default();
        let report = SleepReport {
            model: model.into(),
            pid: worker.pid(),
            pids: held_pids.clone(),
            vram_before_bytes: held.iter().map(|(_, b)| b).sum(),
            vram_after_bytes: after.iter().map(|(_, b)| b).sum(),
            rss_before_bytes,
            rss_after_bytes: worker.sample_memory().unwrap_or_default().rss_bytes,
            drain_ms,
            checkpoint_ms,
        };
        // What the server's own sleep left on the GPU, over its bound.
        if let Some((
            _,
            ServerSleep {
                max_residue: Some(max),
                ..
            },
        )) = &server
            && report.vram_after_bytes > *max
        {
            return Err(Fell::Failed {
                step: "residue".into(),
                reason: format!(
                    "its server's sleep left {} on the GPU (NVML), over `http.sleep.\
                     max_residue` ({})",
                    crate::units::mib(report.vram_after_bytes),
                    crate::units::mib(*max)
                ),
                undone: true,
            });
        }
        {
            let mut state = self.lock();
            if let Some(slot) = state.slots.get_mut(model) {
                slot.sleep = Some(SleepPhase::Asleep {
                    pids: held_pids,
                    since: Instant::now(),
                    mode,
                });
            }
        }
        self.inner.notify_changed();
        tracing::info!(
            model,
            vram_before = report.vram_before_bytes,
            vram_after = report.vram_after_bytes,
            "asleep in {:.0} ms",
            report.checkpoint_ms
        );
        self.emit(EventKind::Slept {
            model: model.into(),
            report: Box::new(report.clone()),
        });
        Ok(report)
    }

    /// Undoes the steps `done` (last first); whether every process runs
    /// again as before.
    async fn undo(&self, config: &crate::config::SupervisorConfig, done: &[(u32, Step)]) -> bool {
        let mut whole = true;
        for (pid, step) in done.iter().rev() {
            if *step == Step::Checkpoint {
                whole &= checkpoint::run(config, Step::Restore, *pid).await.is_ok();
            }
            whole &= checkpoint::run(config, Step::Unlock, *pid).await.is_ok();
        }
        whole
    }

    /// A sleep that did not happen: the model serves on.
    fn back_to_ready(&self, model: &str) {
        let mut state = self.lock();
        if let Some(slot) = state.slots.get_mut(model)
            && slot.state == ModelState::Asleep
        {
            slot.state = ModelState::Ready;
            slot.sleep = None;
            slot.loading = None;
        }
        drop(state);
        self.inner.notify_changed();
    }

    /// Wakes `model` (asked, or for a request: `reason`).
    pub(super) async fn wake_inner(&self, model: &str, reason: &str) -> Result<WakeReport> {
        self.check_not_frozen(model)?;
        let (tx, worker, pids, since, mode) = {
            let mut state = self.lock();
            if !state.slots.contains_key(model) {
                return Err(self.not_loaded_locked(model, &state));
            }
            let slot = state.slots.get_mut(model).expect("looked at just now");
            let (pids, since, mode) = match (&slot.sleep, slot.state) {
                (Some(SleepPhase::Asleep { pids, since, mode }), ModelState::Asleep) => {
                    (pids.clone(), *since, *mode)
                }
                (Some(_), _) => {
                    return Err(Error::Busy {
                        model: model.into(),
                        reason: "it is falling asleep or waking".into(),
                    });
                }
                (None, _) => {
                    return Err(Error::SleepRefused {
                        model: model.into(),
                        reason: format!("it is not asleep (it is {})", slot.state()),
                    });
                }
            };
            let (tx, rx) = watch::channel(None);
            slot.sleep = Some(SleepPhase::Waking);
            slot.loading = Some(rx);
            let worker = Arc::clone(slot.worker.as_ref().expect("an asleep slot has a worker"));
            (tx, worker, pids, since, mode)
        };
        self.inner.notify_changed();
        let config = self.config();
        let started = Instant::now();
        let mut failed = None;
        let server = worker
            .upstream_server()
            .and_then(|u| Some((Arc::clone(u), u.spec().sleep.clone()?)))
            .filter(|_| mode == SleepMode::Server);
        match &server {
            Some((upstream, routes)) => {
                if let Err(why) = post(upstream, &routes.wake).await {
                    failed = Some(("wake".to_string(), why));
                }
            }
            None => {
                for pid in &pids {
                    for step in [Step::Restore, Step::Unlock] {
                        if failed.is_none()
                            && let Err(e) = checkpoint::run(&config, step, *pid).await
                        {
                            failed = Some((step.to_string(), e.message));
                        }
                    }
                }
            }
        }
        if let Some((step, why)) = failed {
            // Never a wedged model: the worker goes, and a cold load
            // follows (the requests waiting on the signal wait for it).
            worker.set_asleep(false);
            worker.kill();
            {
                let mut state = self.lock();
                if let Some(slot) = state.slots.get_mut(model) {
                    slot.state = ModelState::Ready;
                    slot.sleep = None;
                    slot.loading = None;
                }
            }
            let _ = self.unload_inner(model).await;
            drop(tx);
            let fallback = "stopped; loading it cold".to_string();
            self.emit(EventKind::SleepFailed {
                model: model.into(),
                step: step.to_string(),
                error: why.clone(),
                fallback: fallback.clone(),
            });
            tracing::warn!(model, "wake failed at {step}: {why}; it loads cold");
            return Err(Error::SleepFailed {
                model: model.into(),
                step: step.to_string(),
                reason: why,
                fallback,
            });
        }
        let restore_ms = ms(started);
        worker.set_asleep(false);
        let back = per_pid_vram(pids).await.unwrap_or_default();
        {
            let mut state = self.lock();
            let super::State {
                slots, catalogue, ..
            } = &mut *state;
            if let Some(slot) = slots.get_mut(model) {
                slot.state = ModelState::Ready;
                slot.sleep = None;
                slot.loading = None;
                slot.last_used = Instant::now();
                // Its worker is back in: a turn of its own begins.
                slot.begin_turn(catalogue.get(model));
            }
        }
        let _ = tx.send(Some(Ok(())));
        self.inner.notify_changed();
        let report = WakeReport {
            model: model.into(),
            pid: worker.pid(),
            vram_bytes: back.iter().map(|(_, b)| b).sum(),
            restore_ms,
            slept_s: since.elapsed().as_secs_f64(),
            reason: reason.into(),
        };
        tracing::info!(model, "awake in {:.0} ms", report.restore_ms);
        self.emit(EventKind::Woke {
            model: model.into(),
            report: Box::new(report.clone()),
        });
        Ok(report)
    }
}

/// How long a server's own sleep or wake may take (vLLM's level 1 copies
/// its weights to host memory).
const SERVER_STEP_BOUND: Duration = Duration::from_secs(120);

/// POSTs `path` to the server (its kind's `http.headers` sent); `Err` says
/// what it answered instead of a 2xx.
async fn post(upstream: &Arc<Upstream>, path: &str) -> std::result::Result<(), String> {
    use axum::http::{HeaderName, HeaderValue, header};
    let mut request = axum::http::Request::builder()
        .method(axum::http::Method::POST)
        .uri(path)
        .body(axum::body::Bytes::new())
        .map_err(|e| format!("`{path}` is not a path: {e}"))?;
    let headers = request.headers_mut();
    if let Ok(host) = HeaderValue::try_from(upstream.host()) {
        headers.insert(header::HOST, host);
    }
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    for (name, value) in &upstream.spec().headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            headers.insert(name, value);
        }
    }
    let answer = tokio::time::timeout(SERVER_STEP_BOUND, upstream.send(request))
        .await
        .map_err(|_| {
            format!(
                "POST {path} did not answer within {}",
                crate::units::format_duration(SERVER_STEP_BOUND)
            )
        })?
        .map_err(|e| format!("POST {path}: {e}"))?;
    let status = answer.status();
    let body = axum::body::Body::new(answer.into_body());
    let said = tokio::time::timeout(
        Duration::from_secs(10),
        axum::body::to_bytes(body, 16 << 10),
    )
    .await
    .ok()
    .and_then(Result::ok)
    .map(|b| String::from_utf8_lossy(&b).trim().to_string())
    .unwrap_or_default();
    if status.is_success() {
        Ok(())
    } else {
        Err(format!(
            "POST {path} answered {status}: {}",
            crate::input::quote(&said)
        ))
    }
}

/// Why a sleep did not happen.
enum Fell {
    /// Nothing was done; it serves on.
    Refused(String),
    Busy(String),
    /// A step failed; `undone`: what was done before it was undone.
    Failed {
        step: String,
        reason: String,
        undone: bool,
    },
}
