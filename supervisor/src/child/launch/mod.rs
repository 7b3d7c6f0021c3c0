//! Bringing a worker up: spawn → hello → load, all under one deadline.
//! Whatever goes wrong, the process is gone before the error is returned.
//! An HTTP server's start is `server.rs`.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_protocol::LoadSpec;
use nix::sys::signal::Signal;

use crate::child::handle::{LoadOutcome, WorkerHandle};
use crate::child::handshake::{self, HandshakeOutcome};
use crate::child::limits::MemoryCap;
use crate::child::memory::system_memory;
use crate::child::process::ProcessWatch;
use crate::child::program::{Wire, worker_program};
use crate::child::spawn::Connect;
use crate::child::start::{Start, Started, start_process};
use crate::child::{health, link, stop, stream};
use crate::config::{ModelSpec, SupervisorConfig};
use crate::error::{Error, Result};
use crate::gpu::{self, Inventory};
use crate::report::{LoadReport, Warning, WorkerStart};
use crate::units::gib;

mod server;

use server::launch_server;

/// The end a new worker connects to, by wire.
enum Listening {
    Ipc(
        ipc_channel::ipc::IpcOneShotServer<berth_protocol::Event>,
        String,
    ),
    /// Ours, and the end the child inherits.
    Stream(std::os::fd::OwnedFd, std::os::fd::OwnedFd),
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Starts a worker for `spec` and loads the model in it, on `gpus` (chosen
/// by the supervisor's placement) when the model asks for GPUs. `spawned`
/// hears the worker's pid as soon as it runs. A worker placed on GPUs that
/// holds no device memory once loaded is warned about in its report (or
/// stopped, with `require_gpu_memory`). `cancel` turning true (a shutdown)
/// calls off a server's start: what it started is stopped (its container
/// removed) before the error returns.
pub(crate) async fn launch(
    spec: &ModelSpec,
    config: &SupervisorConfig,
    gpus: Option<Vec<u32>>,
    spawned: &(dyn Fn(u32) + Send + Sync),
    start: Start,
    cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<(Arc<WorkerHandle>, LoadReport)> {
    let (handle, mut report) = start_and_load(spec, config, gpus, spawned, start, cancel).await?;
    if let Some(warning) = Warning::gpu_unused(report.gpus.as_deref(), report.vram_bytes) {
        if spec.require_gpu_memory {
            stop::stop(&handle, config.stop_graces).await;
            return Err(Error::GpuUnused {
                model: spec.name.clone(),
                pid: report.pid,
                gpus: crate::report::gpu_list(report.gpus.as_deref().unwrap_or_default()),
            });
        }
        tracing::warn!(model = spec.name, pid = report.pid, "{}", warning.message);
        report.warnings.push(warning);
    }
    Ok((handle, report))
}

async fn start_and_load(
    spec: &ModelSpec,
    config: &SupervisorConfig,
    gpus: Option<Vec<u32>>,
    spawned: &(dyn Fn(u32) + Send + Sync),
    start: Start,
    cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<(Arc<WorkerHandle>, LoadReport)> {
    let started = Instant::now();
    let timeout = spec.load_timeout.unwrap_or(config.load_timeout);
    let deadline = started + timeout;
    let left = || deadline.saturating_duration_since(Instant::now());
    let model = spec.name.as_str();
    // A confined model's path is resolved now, and the resolved path is the
    // one the worker opens.
    let weights = match (&spec.confine, &spec.model) {
        (Some(root), Some(path)) => Some(crate::config::confined(model, path, root)?),
        _ => spec.model.clone(),
    };

    let program = worker_program(spec, config)?;
    let mut env = program.env.clone();
    if let Some(gpus) = &gpus {
        env.extend(gpu::worker_env(gpus, gpu::uuid));
        let totals: Vec<Option<u64>> = gpus.iter().map(|&i| gpu::total_bytes(i)).collect();
        let total = gpu::fraction_base(&totals);
        env.extend(gpu::framework_env(
            spec.vram,
            config.gpu_memory_budget,
            total,
            &program.env,
        ));
    }
    let io_error = |what| {
        move |source| Error::Io {
            model: model.to_string(),
            what,
            source,
        }
    };
    if program.wire == Wire::Http {
        return launch_server(
            spec, config, program, env, weights, gpus, spawned, started, cancel,
        )
        .await;
    }
    // The wire's listening end: a one-shot ipc server, or a socket pair
    // whose other end the child inherits (closed here once it is started).
    let listen = || -> Result<Listening> {
        Ok(match program.wire {
            Wire::Ipc => {
                let (server, name) = handshake::open(model)?;
                Listening::Ipc(server, name)
            }
            Wire::Stream => {
                let (ours, theirs) = stream::io::socket_pair()
                    .map_err(io_error("cannot create the worker's socket"))?;
                Listening::Stream(ours, theirs)
            }
            Wire::Http => unreachable!("launched above"),
        })
    };
    let mut listening = listen()?;
    let mut start = start;
    let program_line = program.to_string();
    // The stream wire's socket, as an in-place upgrade hands it over.
    let mut stream_copy = None;
    // A forked worker that fails before its hello (its setup in the fork:
    // a folder, a cgroup) is started again cold: no load fails for a
    // preloader's sake.
    let (process, accepted) = loop {
        let process = match start_process(
            spec,
            &program.path,
            &program.args,
            match &listening {
                Listening::Ipc(_, name) => Connect::Ipc(name),
                Listening::Stream(_, theirs) => Connect::Stream(theirs.as_raw_fd()),
            },
            program.cwd.as_deref(),
            &env,
            spawned,
            (start, timeout),
        )
        .await?
        {
            Started::Process(process) => process,
            // A preloader that never answered may still fork a worker
            // holding that socket: a cold start gets a socket of its own.
            Started::Again(why) => {
                listening = listen()?;
                start = Start::ColdBecause(why);
                continue;
            }
        };
        let pid = process.pid();
        tracing::debug!(model, pid, program = %program, start = %process.start_kind(), "worker started");
        let forked = matches!(process.start_kind(), WorkerStart::Forked { .. });
        let outcome = match listening {
            Listening::Ipc(server, name) => {
                handshake::accept(model, &program_line, pid, server, &name, &process, left()).await
            }
            Listening::Stream(ours, theirs) => {
                drop(theirs);
                stream_copy = ours.try_clone().ok();
                let (reader, writer) =
                    stream::connect(ours).map_err(io_error("cannot watch the worker's socket"))?;
                handshake::accept_stream(
                    model,
                    &program_line,
                    pid,
                    reader,
                    writer,
                    &process,
                    left(),
                )
                .await
            }
        };
        match outcome {
            HandshakeOutcome::Ok(accepted) => break (process, accepted),
            // Started cold next: `forked` is false then.
            HandshakeOutcome::Failed(e) if forked => {
                kill_and_reap(&process).await;
                let why = format!("the worker forked from the preloaded interpreter failed: {e}");
                tracing::warn!(model, "{why}; starting it cold");
                start = Start::ColdBecause(why);
                listening = listen()?;
            }
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
        }
    };
    let pid = process.pid();
    let spawn_ms = ms(started.elapsed());
    let backends = accepted.2.backends.clone();
    let (events, link, hello) = accepted;
    let (events, wire_fds) = match link::keep_for_handover(events, stream_copy) {
        Ok(kept) => kept,
        Err(source) => {
            kill_and_reap(&process).await;
            return Err(Error::Io {
                model: model.into(),
                what: "cannot set the worker's wire aside for in-place upgrades",
                source,
            });
        }
    };
    let handle = WorkerHandle::new(
        model,
        &spec.backend,
        Arc::clone(&process),
        (events, link, hello),
        wire_fds,
        started,
        (config.max_response, config.answer_spin),
    )?;

    if !backends.contains(&spec.backend) {
        stop::stop(&handle, config.stop_graces).await;
        return Err(Error::InvalidSpec {
            model: model.into(),
            reason: format!(
                "worker `{program}` has no backend `{}` (it has: {})",
                spec.backend,
                backends.join(", ")
            ),
        });
    }

    let info = match handle
        .load(spec.to_load_spec(weights.as_deref()), left())
        .await
    {
        LoadOutcome::Loaded(info) => info,
        LoadOutcome::Failed(e) => {
            stop::stop(&handle, config.stop_graces).await;
            // Read once it is gone: what the card has without it.
            return Err(gpu_oom_at_load(spec, gpus.as_deref(), e));
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
    let report = ready_report(
        &handle,
        &process,
        spec,
        config.heartbeat_timeout,
        Measured {
            started,
            spawn_ms,
            backend_load_ms: info.load_micros as f64 / 1e3,
            gpus,
            details: serde_json::from_str(&info.details).unwrap_or(serde_json::Value::Null),
            max_batch: info.max_batch.max(1),
        },
        config,
    );
    Ok((handle, report))
}

/// What a load measured beside the worker's memory.
struct Measured {
    started: Instant,
    spawn_ms: f64,
    backend_load_ms: f64,
    gpus: Option<Vec<u32>>,
    details: serde_json::Value,
    max_batch: u32,
}

/// A worker (or server) that is ready: its memory read as the baseline its
/// growth is measured from, its heartbeats started, and its load report,
/// the one place a report is made (both wires and servers alike). The
/// reading is `/proc/<pid>/status`'s; the proportional, private and shared
/// figures, which walk the worker's page tables, are read once it serves
/// ([`complete_report`]).
fn ready_report(
    handle: &Arc<WorkerHandle>,
    process: &ProcessWatch,
    spec: &ModelSpec,
    heartbeat_timeout: Duration,
    measured: Measured,
    config: &SupervisorConfig,
) -> LoadReport {
    let memory = handle.sample_status_memory().unwrap_or_default();
    handle.set_baseline(measured.started.elapsed());
    health::spawn(
        Arc::downgrade(handle),
        health::HealthPolicy {
            interval: config.heartbeat_interval,
            heartbeat_timeout,
            stall_timeout: spec.stall_timeout,
        },
    );
    LoadReport {
        model: spec.name.clone(),
        backend: handle.backend().to_string(),
        pid: handle.pid(),
        worker_version: handle.worker_version().to_string(),
        load_ms: ms(measured.started.elapsed()),
        spawn_ms: measured.spawn_ms,
        backend_load_ms: measured.backend_load_ms,
        rss_bytes: memory.rss_bytes,
        anon_bytes: memory.anon_bytes,
        file_bytes: memory.file_bytes,
        pss_bytes: memory.pss_bytes,
        peak_rss_bytes: memory
            .peak_rss_bytes
            .max(process.cap().and_then(MemoryCap::peak).unwrap_or(0)),
        memory_limit_bytes: process.cap().map(|c| c.limit),
        memory_cap: process.cap().map(|c| c.mechanism),
        gpus: measured.gpus,
        // The tree the memory sample above read.
        vram_bytes: match gpu::inventory() {
            Inventory::Devices(devices) => gpu::process_vram(&devices, &handle.pids()),
            Inventory::NoGpu(_) => None,
        },
        system_available_bytes: system_memory().available_bytes,
        details: measured.details,
        max_batch: measured.max_batch,
        private_bytes: memory.private_bytes,
        shared_bytes: memory.shared_bytes,
        start: process.start_kind().clone(),
        warnings: Vec::new(),
        admission: None,
    }
}

/// Completes a load report with a full reading of the worker's memory
/// (`smaps_rollup`: its proportional, private and shared figures), taken
/// once the worker serves, so that no request waits for it.
pub(crate) fn complete_report(handle: &WorkerHandle, report: &mut LoadReport) {
    let Some(memory) = handle.sample_memory() else {
        return;
    };
    report.rss_bytes = memory.rss_bytes;
    report.anon_bytes = memory.anon_bytes;
    report.file_bytes = memory.file_bytes;
    report.pss_bytes = memory.pss_bytes;
    report.private_bytes = memory.private_bytes;
    report.shared_bytes = memory.shared_bytes;
    report.peak_rss_bytes = report.peak_rss_bytes.max(memory.peak_rss_bytes);
}

/// A load that failed for want of device memory (the framework's own words
/// in its error) is `gpu_out_of_memory`, saying what the model had and what
/// to try; any other failure is returned as it is. Called once the worker
/// is gone, so the cards' free memory is what it had to work with.
fn gpu_oom_at_load(spec: &ModelSpec, gpus: Option<&[u32]>, error: Error) -> Error {
    let Error::LoadFailed { source, .. } = &error else {
        return error;
    };
    let Some(line) = source
        .message
        .lines()
        .rev()
        .find(|l| crate::base::is_gpu_oom(l))
    else {
        return error;
    };
    let line: String = line.trim().chars().take(400).collect();
    let smaller = "or load it smaller (a lower precision, batch or context)";
    let room = match (spec.vram, gpus) {
        (Some(share), _) => format!(
            "its share is {} on each of its GPUs (`vram`): give it a larger share, {smaller}",
            gib(share)
        ),
        (None, Some(gpus)) => {
            let free: Vec<String> = match gpu::inventory() {
                Inventory::Devices(devices) => devices
                    .iter()
                    .filter(|d| gpus.contains(&d.index))
                    .map(|d| format!("GPU {} has {} free", d.index, gib(d.free_bytes)))
                    .collect(),
                Inventory::NoGpu(_) => Vec::new(),
            };
            let free = if free.is_empty() {
                String::new()
            } else {
                format!("{}: ", free.join(", "))
            };
            format!(
                "{free}free the card (`berth gpus` names what holds it), declare the model's \
                 `vram` so placement makes room for it, {smaller}"
            )
        }
        (None, None) => format!(
            "berth did not place it (no `gpus`), so nothing made room for it: give it `gpus` \
             and `vram`, {smaller}"
        ),
    };
    Error::GpuOutOfMemory {
        model: spec.name.clone(),
        line,
        room,
    }
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
    /// The wire's load spec, with the weights at `model` (the spec's own
    /// path, resolved where it is confined).
    pub(crate) fn to_load_spec(&self, model: Option<&std::path::Path>) -> LoadSpec {
        LoadSpec {
            name: self.name.clone(),
            backend: self.backend.clone(),
            model: model.map(|p| p.display().to_string()),
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
