//! Stopping a worker: ask → grace → SIGTERM → grace → SIGKILL → reap, on the
//! whole process group (an HTTP server with a `stop_command`: the command →
//! grace → SIGKILL, the signal if the command fails); then sweep the group, kill what the worker started
//! outside it (in its cgroup, or carrying its mark), count what is left,
//! and measure what came back.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::base::StopGraces;
use crate::child::container::Gone;
use crate::child::handle::WorkerHandle;
use crate::child::memory::system_memory;
use crate::child::sweep::{sweep_escapees, sweep_group};
use crate::gpu::{self, Inventory};
use crate::report::{ContainerGone, StopKind, UnloadReport};

/// Stops `worker` and proves what came back.
pub(crate) async fn stop(worker: &WorkerHandle, graces: StopGraces) -> UnloadReport {
    let started = Instant::now();
    let pid = worker.pid();
    let already_dead = !worker.is_alive();
    let at_stop = worker.sample_memory().unwrap_or_default();
    let peak_rss_bytes = at_stop
        .peak_rss_bytes
        .max(worker.memory().last.peak_rss_bytes);
    let before = system_memory();
    // After the memory sample above: an HTTP server's tree is fresh.
    let pids = worker.pids();
    let gpu_before = gpu_reading(&pids);
    let process = worker.process();
    process.begin_stop();

    let container = worker.upstream_server().and_then(|u| u.container());
    let stop = if already_dead {
        after_death(worker, graces).await;
        StopKind::AlreadyExited
    } else if worker.is_asleep() {
        // Its processes are locked by the driver: their own exit would wait
        // on it. Killed; the kernel reclaims the device memory's copy.
        tracing::info!(model = worker.model(), pid, "stopping it asleep: SIGKILL");
        process.signal_group(Signal::SIGKILL);
        StopKind::Sigkill
    } else if worker.request_shutdown() && process.exited_within(graces.shutdown).await.is_some() {
        StopKind::Graceful
    } else if let Some(container) = container
        && let grace = worker.stop_signal(graces).1
        && container.stop(worker.model(), grace).await
    {
        // Its client ends as the container does.
        let why = format!("the container's client outlived its stop by {grace:?}");
        ended_or_killed(worker, grace, StopKind::ContainerStop, &why).await
    } else if let Some((argv, env)) = worker.upstream_server().and_then(|u| u.stop_command(pid))
        && let grace = worker.stop_signal(graces).1
        && run_stop_command(worker.model(), &argv, env, grace).await
    {
        let why = format!("the server outlived its stop_command by {grace:?}");
        ended_or_killed(worker, grace, StopKind::StopCommand, &why).await
    } else {
        let (signal, grace) = worker.stop_signal(graces);
        if worker.upstream_server().is_some() {
            tracing::info!(
                model = worker.model(),
                pid,
                "asking the HTTP server to stop: {signal}"
            );
        } else {
            tracing::info!(
                model = worker.model(),
                pid,
                "worker did not exit on shutdown; sending {signal}"
            );
        }
        process.signal_group(signal);
        let why = format!("worker ignored {signal}");
        ended_or_killed(worker, grace, StopKind::Sigterm, &why).await
    };
    let exit = process.exited().await;
    // A container is removed by its engine (which kills what is left of
    // it), and its monitor given a moment to leave, before the cgroup is
    // swept: what the sweep finds then is what the engine left behind.
    // Its id is read from its cidfile, which the removal deletes.
    let id = container.and_then(|c| c.id());
    let removed = match container {
        Some(container) => {
            let gone = container.remove(worker.model()).await;
            if let Some(cgroup) = process.cgroup() {
                let deadline = Instant::now() + Duration::from_secs(2);
                while !cgroup.members().is_empty() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            Some(gone)
        }
        None => None,
    };
    let in_group = sweep_group(pid).await;
    let escapees = sweep_escapees(process).await;
    let container = container.zip(removed).map(|(c, gone)| ContainerGone {
        engine: c.engine,
        name: c.name.clone(),
        id: id.clone(),
        removed: gone == Gone::Removed,
        cgroup_empty: process.cgroup().map(|cg| cg.members().is_empty()),
        error: match gone {
            Gone::Unknown(e) => Some(e),
            _ => None,
        },
    });
    let leftover_processes = in_group + escapees.left;
    let gpu_after = match &gpu_before {
        Some(before) => Some(gpu_given_back(&pids, before, started).await),
        None => None,
    };
    let after = system_memory();

    let anon_drop = before.anon_bytes.saturating_sub(after.anon_bytes);
    // Only what the system got back counts: pages a forked worker shared
    // with its preloader, which outlives it, are not freed by its exit and
    // so never in the drop, while pages it shared with its own children
    // (which die with it) are.
    let reclaimed_bytes = if already_dead {
        0
    } else {
        at_stop.anon_bytes.min(anon_drop)
    };
    UnloadReport {
        model: worker.model().to_string(),
        pid,
        stop,
        exit,
        took_ms: started.elapsed().as_secs_f64() * 1e3,
        uptime_s: worker.uptime().as_secs_f64(),
        requests: worker.requests(),
        rss_at_stop_bytes: at_stop.rss_bytes,
        anon_at_stop_bytes: at_stop.anon_bytes,
        private_at_stop_bytes: at_stop.private_bytes,
        shared_at_stop_bytes: at_stop.shared_bytes,
        peak_rss_bytes,
        system_anon_before_bytes: before.anon_bytes,
        system_anon_after_bytes: after.anon_bytes,
        reclaimed_bytes,
        leftover_processes,
        escaped_processes: escapees.found,
        vram_at_stop_bytes: gpu_before.as_ref().map(|g| g.held),
        gpu_reclaimed_bytes: gpu_after.map(|g| g.bytes),
        gpu_reclaim_ms: gpu_after.map(|g| g.ms),
        gpu_pid_gone: gpu_after.map(|g| g.pid_gone),
        container,
    }
}

/// `ended` if the worker exits within `grace` of being asked; else (`why`)
/// its group is killed.
async fn ended_or_killed(
    worker: &WorkerHandle,
    grace: Duration,
    ended: StopKind,
    why: &str,
) -> StopKind {
    let process = worker.process();
    if process.exited_within(grace).await.is_some() {
        return ended;
    }
    tracing::warn!(
        model = worker.model(),
        pid = worker.pid(),
        "{why}; sending SIGKILL"
    );
    process.signal_group(Signal::SIGKILL);
    StopKind::Sigkill
}

/// A server's client that died (`docker run`) leaves what it ran (the
/// container) running: its stop command, where it names it rather than the
/// dead pid, still runs. Called when a worker's death is found, before a
/// restart, and by a stop of a worker already dead.
pub(crate) async fn after_death(worker: &WorkerHandle, graces: StopGraces) {
    let Some(upstream) = worker.upstream_server() else {
        return;
    };
    if let Some(container) = upstream.container() {
        // Its client died (killed from outside, say): the container may
        // run on, holding its memory and GPU, until the engine stops and
        // removes it; what is left in the model's cgroup then is killed.
        container
            .stop(worker.model(), worker.stop_signal(graces).1)
            .await;
        container.remove(worker.model()).await;
        if let Some(cgroup) = worker.process().cgroup() {
            cgroup.kill_all();
        }
        return;
    }
    let by_name = upstream
        .spec()
        .stop_command
        .as_ref()
        .is_some_and(|c| !c.iter().any(|a| a.contains("{pid}")));
    if let Some((argv, env)) = upstream.stop_command(worker.pid()).filter(|_| by_name) {
        let grace = worker.stop_signal(graces).1;
        run_stop_command(worker.model(), &argv, env, grace).await;
    }
}

/// Runs an HTTP server's `stop_command` (`docker stop NAME`: what stops a
/// server whose process is only a client of what runs the model), with
/// the kind's environment, for at most `grace`. Whether it ran and
/// succeeded: if not, the stop goes on with the stop signal, so a broken
/// command never leaves a server running.
async fn run_stop_command(
    model: &str,
    argv: &[String],
    env: &[(String, String)],
    grace: Duration,
) -> bool {
    let mut command = tokio::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .env_clear()
        .envs(crate::child::spawn::passthrough_env())
        .envs(env.iter().cloned())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    tracing::info!(
        model,
        command = argv.join(" "),
        "running the server's stop_command"
    );
    let child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            tracing::warn!(
                model,
                "cannot run its stop_command `{}`: {e}; stopping it by signal",
                argv[0]
            );
            return false;
        }
    };
    match tokio::time::timeout(grace, child.wait_with_output()).await {
        Ok(Ok(out)) if out.status.success() => true,
        Ok(Ok(out)) => {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: String = stderr
                .trim()
                .chars()
                .rev()
                .take(400)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            tracing::warn!(
                model,
                "its stop_command `{}` failed ({}): {tail}; stopping it by signal",
                argv.join(" "),
                out.status
            );
            false
        }
        Ok(Err(e)) => {
            tracing::warn!(model, "its stop_command failed: {e}; stopping it by signal");
            false
        }
        Err(_) => {
            tracing::warn!(
                model,
                "its stop_command `{}` did not finish within {grace:?}; stopping it by signal",
                argv.join(" ")
            );
            false
        }
    }
}

/// What a worker held on its GPUs, and their used memory, before its stop.
struct GpuBefore {
    held: u64,
    /// `(device, used bytes)` of each device the worker had memory on.
    used: Vec<(u32, u64)>,
}

fn gpu_reading(pids: &[u32]) -> Option<GpuBefore> {
    let Inventory::Devices(devices) = gpu::inventory() else {
        return None;
    };
    let held = gpu::process_vram(&devices, pids)?;
    let used = devices
        .iter()
        .filter(|d| d.processes.iter().any(|(p, _)| pids.contains(p)))
        .map(|d| (d.index, d.used_bytes))
        .collect();
    Some(GpuBefore { held, used })
}

/// What a stop gave back on the GPUs.
#[derive(Clone, Copy)]
struct GpuAfter {
    /// The drop in the devices' used memory.
    bytes: u64,
    /// From the start of the stop until it was back (or the wait ended).
    ms: f64,
    /// The pid left NVML's process list within the wait.
    pid_gone: bool,
}

/// Waits (up to 5 s) until the worker is gone from NVML's process list and
/// its devices' used memory is back within 64 MiB of what it would be
/// without it; returns the drop and how long it took.
async fn gpu_given_back(pids: &[u32], before: &GpuBefore, started: Instant) -> GpuAfter {
    const TOLERANCE: u64 = 64 << 20;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Inventory::Devices(devices) = gpu::inventory() {
            let gone = gpu::process_vram(&devices, pids).is_none();
            let before_used: u64 = before.used.iter().map(|(_, u)| u).sum();
            let now_used: u64 = before
                .used
                .iter()
                .filter_map(|(i, _)| devices.iter().find(|d| d.index == *i).map(|d| d.used_bytes))
                .sum();
            let back = now_used <= before_used.saturating_sub(before.held) + TOLERANCE;
            if (gone && back) || Instant::now() >= deadline {
                return GpuAfter {
                    bytes: before_used.saturating_sub(now_used),
                    ms: started.elapsed().as_secs_f64() * 1e3,
                    pid_gone: gone,
                };
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
