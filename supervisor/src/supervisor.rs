//! `Supervisor`: the models, their workers, and the operations on them.
//! The sidecar and the CLI are thin layers over this type.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use berth_protocol::Body;
use serde::{Deserialize, Serialize};

use crate::config::{ModelSpec, SupervisorConfig};
use crate::error::{Error, Result};
use crate::report::{LoadReport, UnloadReport};
use crate::worker::handle::{ResponseStream, WorkerHandle};
use crate::worker::{launch, stop};

/// Where a model slot is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelState {
    /// The worker process is starting (spawn, handshake).
    Starting,
    /// The worker is loading the model.
    Loading,
    Ready,
    /// No new requests; in-flight ones finish.
    Draining,
    Stopping,
    /// The worker died on its own; requests fail until it is unloaded or reloaded.
    Failed,
}

impl fmt::Display for ModelState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned));
        f.write_str(s.as_deref().unwrap_or("?"))
    }
}

/// A loaded (or loading) model as `stats()` shows it.
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
}

struct Slot {
    spec: ModelSpec,
    state: ModelState,
    worker: Option<Arc<WorkerHandle>>,
}

struct Inner {
    config: SupervisorConfig,
    slots: Mutex<HashMap<String, Slot>>,
    shutting_down: AtomicBool,
}

impl Drop for Inner {
    /// A supervisor dropped without `shutdown()` still leaves no worker
    /// behind: each group is killed (and reaped by its waiter thread).
    fn drop(&mut self) {
        let slots = self.slots.get_mut().unwrap_or_else(|e| e.into_inner());
        for slot in slots.values() {
            if let Some(worker) = &slot.worker {
                worker.kill();
            }
        }
    }
}

/// Runs each model in a worker process of its own.
///
/// Cheap to clone; clones share the models. Needs a tokio runtime.
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Supervisor")
            .field("models", &self.model_names())
            .finish_non_exhaustive()
    }
}

impl Supervisor {
    pub fn new(config: SupervisorConfig) -> Self {
        Supervisor {
            inner: Arc::new(Inner {
                config,
                slots: Mutex::new(HashMap::new()),
                shutting_down: AtomicBool::new(false),
            }),
        }
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        self.inner.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn model_names(&self) -> Vec<String> {
        self.slots().keys().cloned().collect()
    }

    /// Starts a worker for `spec` and loads the model in it.
    pub async fn load(&self, spec: ModelSpec) -> Result<LoadReport> {
        spec.validate()?;
        let name = spec.name.clone();
        {
            let mut slots = self.slots();
            if self.inner.shutting_down.load(Ordering::SeqCst) {
                return Err(Error::ShuttingDown { model: name });
            }
            if let Some(slot) = slots.get(&name) {
                return Err(match &slot.worker {
                    Some(w) => Error::AlreadyLoaded {
                        model: name,
                        pid: w.pid(),
                    },
                    None => Error::InvalidSpec {
                        model: name,
                        reason: format!("it is already {}; wait for that to finish", slot.state),
                    },
                });
            }
            slots.insert(
                name.clone(),
                Slot {
                    spec: spec.clone(),
                    state: ModelState::Starting,
                    worker: None,
                },
            );
        }
        match launch::launch(&spec, &self.inner.config).await {
            Ok((worker, report)) => {
                let installed = match self.slots().get_mut(&name) {
                    Some(slot) => {
                        slot.state = ModelState::Ready;
                        slot.worker = Some(Arc::clone(&worker));
                        true
                    }
                    None => false,
                };
                if installed {
                    Ok(report)
                } else {
                    // Removed while loading (shutdown): stop what we started.
                    stop::stop(&worker, self.inner.config.stop_graces).await;
                    Err(Error::ShuttingDown { model: name })
                }
            }
            Err(e) => {
                self.slots().remove(&name);
                Err(e)
            }
        }
    }

    /// The worker serving `model`, if it is ready.
    pub fn worker(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        let slots = self.slots();
        let slot = slots.get(model).ok_or_else(|| Error::NotLoaded {
            model: model.into(),
        })?;
        match (&slot.worker, slot.state) {
            (Some(worker), ModelState::Ready) => Ok(Arc::clone(worker)),
            (_, ModelState::Draining | ModelState::Stopping) => Err(Error::NotLoaded {
                model: model.into(),
            }),
            (_, state) => Err(Error::InvalidSpec {
                model: model.into(),
                reason: format!("it is {state}, not ready for requests"),
            }),
        }
    }

    /// Sends one request and waits for the answer.
    pub async fn request(&self, model: &str, body: Body) -> Result<Body> {
        self.worker(model)?.call(body).await
    }

    /// Sends one request; its chunks and final body arrive on the stream.
    /// Dropping the stream cancels the request in the worker.
    pub fn request_stream(&self, model: &str, body: Body) -> Result<ResponseStream> {
        self.worker(model)?.call_stream(body)
    }

    /// Drains and stops the model's worker, and proves what came back.
    pub async fn unload(&self, model: &str) -> Result<UnloadReport> {
        let worker = {
            let mut slots = self.slots();
            let slot = slots.get_mut(model).ok_or_else(|| Error::NotLoaded {
                model: model.into(),
            })?;
            let Some(worker) = slot.worker.clone() else {
                return Err(Error::InvalidSpec {
                    model: model.into(),
                    reason: format!("it is {}; wait for that to finish", slot.state),
                });
            };
            if matches!(slot.state, ModelState::Draining | ModelState::Stopping) {
                return Err(Error::NotLoaded {
                    model: model.into(),
                });
            }
            slot.state = ModelState::Draining;
            worker
        };
        if !worker.drain(self.inner.config.drain_timeout).await {
            tracing::warn!(
                model,
                in_flight = worker.in_flight(),
                "drain deadline passed; stopping with requests in flight"
            );
        }
        self.set_state(model, ModelState::Stopping);
        let report = stop::stop(&worker, self.inner.config.stop_graces).await;
        self.slots().remove(model);
        tracing::info!(model, "{report}");
        Ok(report)
    }

    fn set_state(&self, model: &str, state: ModelState) {
        if let Some(slot) = self.slots().get_mut(model) {
            slot.state = state;
        }
    }

    /// The spec a model was loaded with.
    pub fn spec(&self, model: &str) -> Option<ModelSpec> {
        self.slots().get(model).map(|s| s.spec.clone())
    }

    /// Every model slot, with fresh memory readings.
    pub fn stats(&self) -> Vec<ModelStatus> {
        let slots = self.slots();
        let mut out: Vec<ModelStatus> = slots
            .iter()
            .map(|(name, slot)| {
                let worker = slot.worker.as_ref();
                let memory = worker.and_then(|w| w.sample_memory()).unwrap_or_default();
                let state = match worker {
                    Some(w) if !w.is_alive() => ModelState::Failed,
                    _ => slot.state,
                };
                ModelStatus {
                    name: name.clone(),
                    backend: slot.spec.backend.clone(),
                    state,
                    pid: worker.map(|w| w.pid()),
                    rss_bytes: memory.rss_bytes,
                    pss_bytes: memory.pss_bytes,
                    peak_rss_bytes: memory.peak_rss_bytes,
                    uptime_s: worker.map(|w| w.uptime().as_secs_f64()).unwrap_or(0.0),
                    requests: worker.map(|w| w.requests()).unwrap_or(0),
                    in_flight: worker.map(|w| w.in_flight()).unwrap_or(0),
                }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Refuses new loads, unloads every model (concurrently) and returns the
    /// reports.
    pub async fn shutdown(&self) -> Vec<Result<UnloadReport>> {
        self.inner.shutting_down.store(true, Ordering::SeqCst);
        let names: Vec<String> = {
            let mut slots = self.slots();
            // Loads still in progress find their slot gone and stop their worker.
            slots.retain(|_, slot| slot.worker.is_some());
            slots.keys().cloned().collect()
        };
        let mut tasks = tokio::task::JoinSet::new();
        for name in names {
            let this = self.clone();
            tasks.spawn(async move { this.unload(&name).await });
        }
        let mut reports = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            if let Ok(report) = joined {
                reports.push(report);
            }
        }
        reports
    }
}
