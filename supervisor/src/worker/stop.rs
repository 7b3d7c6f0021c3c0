//! Stopping a worker: ask → grace → SIGTERM → grace → SIGKILL → reap, on the
//! whole process group; then sweep the group, count what is left, and
//! measure what came back.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::report::{StopKind, UnloadReport};
use crate::worker::handle::WorkerHandle;
use crate::worker::memory::{group_members, system_memory};

/// How long each step of a stop waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopGraces {
    /// After the `Shutdown` command, before SIGTERM.
    pub shutdown: Duration,
    /// After SIGTERM, before SIGKILL.
    pub term: Duration,
}

impl Default for StopGraces {
    fn default() -> Self {
        StopGraces {
            shutdown: Duration::from_secs(5),
            term: Duration::from_secs(5),
        }
    }
}

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
    let process = worker.process();

    let stop = if already_dead {
        StopKind::AlreadyExited
    } else if worker.request_shutdown() && process.exited_within(graces.shutdown).await.is_some() {
        StopKind::Graceful
    } else {
        tracing::info!(
            model = worker.model(),
            pid,
            "worker did not exit on shutdown; sending SIGTERM"
        );
        process.signal_group(Signal::SIGTERM);
        if process.exited_within(graces.term).await.is_some() {
            StopKind::Sigterm
        } else {
            tracing::warn!(
                model = worker.model(),
                pid,
                "worker ignored SIGTERM; sending SIGKILL"
            );
            process.signal_group(Signal::SIGKILL);
            StopKind::Sigkill
        }
    };
    let exit = process.exited().await;
    let leftover_processes = sweep_group(pid).await;
    let after = system_memory();

    let anon_drop = before.anon_bytes.saturating_sub(after.anon_bytes);
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
        peak_rss_bytes,
        system_anon_before_bytes: before.anon_bytes,
        system_anon_after_bytes: after.anon_bytes,
        reclaimed_bytes,
        leftover_processes,
    }
}

/// Kills whatever is left in the worker's process group (processes it
/// forked) and waits briefly for them to go. Returns how many remain.
async fn sweep_group(pgid: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let members = group_members(pgid);
        // Under a subreaper, killed grandchildren are our children to reap.
        crate::worker::orphans::reap_strays();
        if members.is_empty() {
            return 0;
        }
        if Instant::now() >= deadline {
            tracing::error!(
                pgid,
                ?members,
                "processes of the worker's group survived SIGKILL"
            );
            return members.len() as u32;
        }
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), Signal::SIGKILL);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
