//! Bringing a worker up: spawn → hello → load, all under one deadline.
//! Whatever goes wrong, the process is gone before the error is returned.

use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_protocol::LoadSpec;
use nix::sys::signal::Signal;

use crate::config::{ModelSpec, SupervisorConfig};
use crate::error::{Error, Result};
use crate::gpu::{self, Inventory};
use crate::report::LoadReport;
use crate::worker::handle::{LoadOutcome, WorkerHandle};
use crate::worker::handshake::{self, HandshakeOutcome};
use crate::worker::limits::MemoryCap;
use crate::worker::memory::system_memory;
use crate::worker::process::ProcessWatch;
use crate::worker::spawn::{SpawnOptions, find_worker_binary, spawn};
use crate::worker::{health, stop};

/// The worker binary's file name.
pub const WORKER_BINARY: &str = "berth-worker";

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Starts a worker for `spec` and loads the model in it, on `gpus` (chosen
/// by the supervisor's placement) when the model asks for GPUs. `spawned`
/// hears the worker's pid as soon as it runs.
pub(crate) async fn launch(
    spec: &ModelSpec,
    config: &SupervisorConfig,
    gpus: Option<Vec<u32>>,
    spawned: &(dyn Fn(u32) + Send + Sync),
) -> Result<(Arc<WorkerHandle>, LoadReport)> {
    let started = Instant::now();
    let timeout = spec.load_timeout.unwrap_or(config.load_timeout);
    let deadline = started + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let model = spec.name.as_str();

    let binary = match spec
        .worker_binary
        .as_ref()
        .or(config.worker_binary.as_ref())
    {
        Some(path) => path.clone(),
        None => find_worker_binary(WORKER_BINARY)?,
    };
    let mut env = spec.env.clone();
    if let Some(gpus) = &gpus {
        env.extend(gpu::worker_env(gpus, gpu::uuid));
    }
    let (server, server_name) = handshake::open(model)?;
    let cap = spec
        .memory_limit
        .map(|limit| MemoryCap::prepare(model, limit));
    let child = spawn(SpawnOptions {
        model,
        binary: &binary,
        server_name: &server_name,
        extra_env: &env,
        cgroup_procs: cap.as_ref().and_then(MemoryCap::procs_file),
    })
    .await?;
    let process = Arc::new(ProcessWatch::start(model, child, cap));
    process.spawn_rss_guard();
    let pid = process.pid();
    spawned(pid);
    tracing::debug!(model, pid, binary = %binary.display(), "worker started");

    let (events, hello) =
        match handshake::accept(model, pid, server, &server_name, &process, left()).await {
            HandshakeOutcome::Ok(accepted) => accepted,
            HandshakeOutcome::Failed(e) => {
                kill_and_reap(&process).await;
                return Err(e);
            }
            HandshakeOutcome::TimedOut => {
                kill_and_reap(&process).await;
                return Err(Error::LoadTimeout {
                    model: model.into(),
                    pid,
                    timeout,
                    phase: "handshake",
                });
            }
        };
    let spawn_ms = ms(started.elapsed());
    let backends = hello.backends.clone();
    let handle = WorkerHandle::new(
        model,
        &spec.backend,
        Arc::clone(&process),
        events,
        hello,
        started,
    )?;

    if !backends.contains(&spec.backend) {
        stop::stop(&handle, config.stop_graces).await;
        return Err(Error::InvalidSpec {
            model: model.into(),
            reason: format!(
                "worker `{}` has no backend `{}` (it has: {})",
                binary.display(),
                spec.backend,
                backends.join(", ")
            ),
        });
    }

    let info = match handle.load(spec.to_load_spec(), left()).await {
        LoadOutcome::Loaded(info) => info,
        LoadOutcome::Failed(e) => {
            stop::stop(&handle, config.stop_graces).await;
            return Err(e);
        }
        LoadOutcome::TimedOut => {
            kill_and_reap(&process).await;
            return Err(Error::LoadTimeout {
                model: model.into(),
                pid,
                timeout,
                phase: "load",
            });
        }
    };
    let memory = handle.sample_memory().unwrap_or_default();
    handle.set_baseline(started.elapsed());
    health::spawn(
        Arc::downgrade(&handle),
        health::HealthPolicy {
            interval: config.heartbeat_interval,
            heartbeat_timeout: config.heartbeat_timeout,
            stall_timeout: spec.stall_timeout,
        },
    );
    let report = LoadReport {
        model: model.into(),
        backend: spec.backend.clone(),
        pid,
        worker_version: handle.worker_version().to_string(),
        load_ms: ms(started.elapsed()),
        spawn_ms,
        backend_load_ms: info.load_micros as f64 / 1e3,
        rss_bytes: memory.rss_bytes,
        pss_bytes: memory.pss_bytes,
        peak_rss_bytes: memory
            .peak_rss_bytes
            .max(process.cap().and_then(MemoryCap::peak).unwrap_or(0)),
        memory_limit_bytes: process.cap().map(|c| c.limit),
        memory_cap: process.cap().map(|c| c.mechanism),
        gpus,
        vram_bytes: match gpu::inventory() {
            Inventory::Devices(devices) => gpu::process_vram(&devices, pid),
            Inventory::NoGpu(_) => None,
        },
        system_available_bytes: system_memory().available_bytes,
        details: serde_json::from_str(&info.details).unwrap_or(serde_json::Value::Null),
    };
    Ok((handle, report))
}

async fn kill_and_reap(process: &ProcessWatch) {
    process.signal_group(Signal::SIGKILL);
    if process
        .exited_within(Duration::from_secs(5))
        .await
        .is_none()
    {
        tracing::error!(
            pid = process.pid(),
            "worker did not die within 5 s of SIGKILL"
        );
    }
}

impl ModelSpec {
    pub(crate) fn to_load_spec(&self) -> LoadSpec {
        LoadSpec {
            name: self.name.clone(),
            backend: self.backend.clone(),
            model: self.model.as_ref().map(|p| p.display().to_string()),
            options: {
                let mut options = self.options.clone();
                if let Some(mode) = &self.load_mode {
                    options.insert("load_mode".into(), mode.clone());
                }
                options
            },
        }
    }
}
