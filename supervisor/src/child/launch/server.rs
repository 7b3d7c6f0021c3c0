//! Bringing an HTTP server up as a model's worker (`child/upstream/`):
//! the same spawn, cgroup, mark and reports as a worker's, with readiness
//! (its health answering 200, its port its own) in place of the hello and
//! the load; in a container, the engine's run with berth's flags.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::child::handle::WorkerHandle;
use crate::child::process::ProcessWatch;
use crate::child::program::WorkerProgram;
use crate::child::spawn::Connect;
use crate::child::start::{Start, start_process};
use crate::child::{container, upstream};
use crate::config::{ModelSpec, SupervisorConfig};
use crate::error::{Error, Result};
use crate::gpu::{self};
use crate::report::LoadReport;

use super::{Measured, kill_and_reap, ms, ready_report};

/// Starts an HTTP server for `spec` and waits until its health answers 200
/// (`child/upstream.rs`): the same spawn, cgroup, mark and reports as a
/// worker's, with readiness in place of the hello and the load.
#[allow(clippy::too_many_arguments)]
pub(super) async fn launch_server(
    spec: &ModelSpec,
    config: &SupervisorConfig,
    program: WorkerProgram,
    env: Vec<(String, String)>,
    weights: Option<PathBuf>,
    gpus: Option<Vec<u32>>,
    spawned: &(dyn Fn(u32) + Send + Sync),
    started: Instant,
    mut cancel: tokio::sync::watch::Receiver<bool>,
) -> Result<(Arc<WorkerHandle>, LoadReport)> {
    let model = spec.name.as_str();
    let timeout = spec.load_timeout.unwrap_or(config.load_timeout);
    let deadline = started + timeout;
    let http = program.http.clone().expect("an HTTP program has its spec");
    let prepared = upstream::prepare(
        &program.path.display().to_string(),
        &program.args,
        weights.as_deref(),
        http.port,
        http.find_port,
        http.host.as_deref(),
    )
    .map_err(|reason| Error::InvalidSpec {
        model: model.into(),
        reason,
    })?;
    if let (Some(_), upstream::Address::Tcp(addr)) = (http.port, &prepared.address) {
        crate::child::ports::check_free(addr.ip(), addr.port()).map_err(|reason| {
            Error::InvalidSpec {
                model: model.into(),
                reason,
            }
        })?;
    }
    // `{port}` in the kind's environment: this start's port, as in its
    // command (llama-swap's `env: ["PORT=${PORT}"]`).
    let env: Vec<(String, String)> = match prepared.address.port() {
        Some(port) => env
            .into_iter()
            .map(|(k, v)| (k, v.replace("{port}", &port.to_string())))
            .collect(),
        None => env,
    };
    let mut prepared = prepared;
    // A container's command: run with berth's own flags (a name of its own,
    // the model's cgroup, its GPUs by UUID, the owner's label).
    let container = container_start(model, &mut prepared, gpus.as_deref())?;
    let process = start_process(
        spec,
        &PathBuf::from(&prepared.path),
        &prepared.args,
        Connect::None,
        program.cwd.as_deref(),
        &env,
        spawned,
        (Start::Cold, timeout),
    )
    .await?
    .process();
    let pid = process.pid();
    if http.find_port {
        // Its exit is told below, as a server's that exits before ready.
        match find_port(&process, deadline).await {
            Some(port) => {
                tracing::info!(model, pid, port, "found the port the server listens on");
                prepared.address = upstream::Address::Tcp(SocketAddr::from(([127, 0, 0, 1], port)));
            }
            None if process.try_exit().is_none() => {
                let phase = "listening (none of its processes listened on a port)";
                let error = given_up(&process, model, timeout, phase).await;
                remove_container(model, container.as_ref()).await;
                return Err(error);
            }
            None => {}
        }
    }
    // What runs under an engine outside the model's cgroup (a container
    // berth could not place there, a command that talks to an engine but is
    // no `run`: `docker compose up`) is outside berth's tree and cgroup.
    let checked = match &container {
        Some(container) => container.listener_in_cgroup && process.cgroup().is_some(),
        None => crate::config::Engine::of(&prepared.path).is_none(),
    };
    let outside = match (&prepared.address, &container) {
        (upstream::Address::Host(host, _), _) => Some(format!(
            "its server is reached on `{host}`, not on this machine's loopback: the memory \
             shown, its limits and an unload's proof cover what berth ran here (`{}` and its \
             processes), not the server",
            prepared.path
        )),
        (_, None) if !checked => Some(format!(
            "`{}` runs its server under a container engine's own processes, outside berth's \
             cgroup: the memory shown, its limits and an unload's proof cover the command \
             berth ran, not the server",
            prepared.path
        )),
        _ => None,
    };
    let upstream = Arc::new(
        upstream::Upstream::new(model, &prepared, http, env.clone())
            .in_container(container)
            .outside_berth(outside),
    );
    tracing::debug!(model, pid, address = %upstream.address(), "server started");
    let spawn_ms = ms(started.elapsed());
    let ready = tokio::select! {
        ready = upstream.wait_ready(deadline) => ready,
        () = cancelled(&mut cancel) => {
            // A shutdown while it starts: it goes, and its container with
            // it, before berth exits (the engine's container would outlive
            // berth otherwise).
            kill_and_reap(&process).await;
            crate::child::sweep::sweep_all(&process).await;
            remove_container(model, upstream.container()).await;
            return Err(Error::ShuttingDown { model: model.into() });
        }
        exit = process.exited() => {
            // What it started dies with it (a server's engine process
            // holding GPU memory, say), and its container with it.
            crate::child::sweep::sweep_all(&process).await;
            remove_container(model, upstream.container()).await;
            let stderr_tail = process.stderr_tail().await;
            let cause = process
                .kill_cause()
                .or_else(|| crate::base::KillCause::from_stderr(&stderr_tail));
            if let Some(crate::base::KillCause::MemoryLimit { .. }) = cause {
                let death = crate::child::death::Death { exit, stderr_tail, cause, in_flight: Vec::new() };
                return Err(death.error(model, pid, "load"));
            }
            return Err(Error::ServerFailed {
                model: model.into(),
                pid,
                reason: format!("{exit} before it was ready{}", process.stderr_suffix().await),
            });
        }
    };
    if let Err(last) = ready {
        tracing::warn!(model, pid, "the server was not ready in time: {last}");
        let phase = "ready (its health never answered 200)";
        let error = given_up(&process, model, timeout, phase).await;
        remove_container(model, upstream.container()).await;
        return Err(error);
    }
    // Ready: and the one answering is the server, alone on its port. A
    // container berth ran is in the model's cgroup: its server (on the
    // host's network) or podman's port holder (conmon) is checked as any
    // server's. One it could not place there (no cgroup), docker's proxy of
    // a published port, or a command that talks to an engine but is no
    // `run`, cannot be checked; see docs/containers.md.
    if let upstream::Address::Tcp(addr) = upstream.address()
        && checked
    {
        let addr = *addr;
        let mut tree = crate::child::memory::group_members(pid);
        tree.push(pid);
        match process.cgroup() {
            Some(cgroup) => tree.extend(cgroup.members()),
            // Without a cgroup, what it started outside its group carries its mark.
            None => tree.extend(crate::child::orphans::carrying_mark(
                process.mark(),
                process.start_time(),
            )),
        }
        if let Err(reason) = crate::child::ports::check_listener(addr, &tree) {
            kill_and_reap(&process).await;
            crate::child::sweep::sweep_all(&process).await;
            remove_container(model, upstream.container()).await;
            return Err(Error::ServerFailed {
                model: model.into(),
                pid,
                reason,
            });
        }
    }
    let ready_ms = ms(started.elapsed()) - spawn_ms;
    let handle =
        WorkerHandle::upstream(model, Arc::clone(&process), Arc::clone(&upstream), started);
    let details = match upstream.container() {
        Some(c) => serde_json::json!({
            "address": upstream.address().to_string(),
            "container": { "engine": c.engine, "name": c.name, "id": c.id() },
        }),
        None => serde_json::json!({ "address": upstream.address().to_string() }),
    };
    let report = ready_report(
        &handle,
        &process,
        spec,
        upstream.unhealthy_after(),
        Measured {
            started,
            spawn_ms,
            backend_load_ms: ready_ms,
            gpus,
            details,
            max_batch: 1,
        },
        config,
    );
    let mut report = report;
    if let Some(why) = upstream.outside() {
        tracing::warn!(model, pid, "{why}");
        report
            .warnings
            .push(crate::report::Warning::memory_elsewhere(why));
    }
    Ok((handle, report))
}

/// The port a server that chose its own listens on, once it does: the
/// lowest a connection to the loopback reaches among its processes'
/// listeners. `None` if it exits first, or none by `deadline`.
async fn find_port(process: &Arc<ProcessWatch>, deadline: Instant) -> Option<u16> {
    let pid = process.pid();
    while Instant::now() < deadline {
        let mut tree = crate::child::memory::group_members(pid);
        tree.push(pid);
        if let Some(cgroup) = process.cgroup() {
            tree.extend(cgroup.members());
        }
        if let Some(port) = crate::child::ports::listening_ports_of(&tree).first() {
            return Some(*port);
        }
        tokio::select! {
            _ = process.exited() => return None,
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    None
}

/// Where `prepared` runs a container (`podman run …`, a kind's
/// `container`): its command becomes one start of it with berth's flags.
fn container_start(
    model: &str,
    prepared: &mut upstream::Prepared,
    gpus: Option<&[u32]>,
) -> Result<Option<container::Container>> {
    let argv: Vec<String> = std::iter::once(prepared.path.clone())
        .chain(prepared.args.iter().cloned())
        .collect();
    let Some(run) = crate::config::RunCommand::parse(&argv) else {
        return Ok(None);
    };
    let invalid = |reason| Error::InvalidSpec {
        model: model.into(),
        reason,
    };
    let run = run.map_err(invalid)?;
    if !run.dropped.is_empty() {
        tracing::info!(
            model,
            "the container's {} are berth's to give: its own are used",
            run.dropped.join(", ")
        );
    }
    let uuids: Vec<String> = gpus
        .unwrap_or_default()
        .iter()
        .filter_map(|&i| gpu::uuid(i))
        .collect();
    let host = container::Host::now();
    let (container, args) =
        container::Container::plan(model, &run, &uuids, &host).map_err(invalid)?;
    tracing::info!(
        model,
        container = container.name,
        image = run.image,
        "starting a container"
    );
    prepared.args = args;
    Ok(Some(container))
}

/// A failed start's container removed (its processes are already killed
/// with the model's cgroup; the engine's record of it goes too).
async fn remove_container(model: &str, container: Option<&container::Container>) {
    if let Some(container) = container
        && container.remove(model).await != container::Gone::Removed
    {
        tracing::warn!(
            model,
            container = container.name,
            "the failed start's container may remain: `berth reap` removes it"
        );
    }
}

/// A server that did not get `phase` done within `timeout`: killed, what it
/// started swept, and the load's error.
async fn given_up(
    process: &Arc<ProcessWatch>,
    model: &str,
    timeout: Duration,
    phase: &'static str,
) -> Error {
    kill_and_reap(process).await;
    crate::child::sweep::sweep_all(process).await;
    Error::LoadTimeout {
        model: model.into(),
        pid: process.pid(),
        timeout,
        phase,
    }
}

/// Resolves once `cancel` turns true (never, if its sender is gone).
async fn cancelled(cancel: &mut tokio::sync::watch::Receiver<bool>) {
    if cancel.wait_for(|c| *c).await.is_err() {
        std::future::pending::<()>().await;
    }
}
