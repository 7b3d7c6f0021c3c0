//! Starting a worker's process: spawned cold, or forked from its kind's
//! preloaded interpreter (`preload.rs`), either way capped or fenced in a
//! cgroup of its own, marked, and handed to a watch that reaps it.

use std::sync::Arc;
use std::time::Duration;

use crate::child::limits::{Cgroup, MemoryCap};
use crate::child::preload::{ForkRequest, Preloader};
use crate::child::process::ProcessWatch;
use crate::child::spawn::{Connect, SpawnOptions, spawn};
use crate::config::ModelSpec;
use crate::error::Result;
use crate::report::WorkerStart;

/// How a worker process is to begin.
pub(crate) enum Start {
    /// Its program starts afresh.
    Cold,
    /// Forked from its kind's preloaded interpreter; started cold if the
    /// fork fails.
    Fork(Arc<Preloader>),
    /// Afresh although its kind preloads, for this reason.
    ColdBecause(String),
}

/// What [`start_process`] did.
pub(crate) enum Started {
    Process(Arc<ProcessWatch>),
    /// The preloader did not answer the fork (it was stopped); start the
    /// worker cold, on a new wire (the old one's other end may yet be
    /// held by a worker it forked late), saying why.
    Again(String),
}

impl Started {
    /// The process of a start that cannot ask to start again (a cold one).
    pub(crate) fn process(self) -> Arc<ProcessWatch> {
        match self {
            Started::Process(process) => process,
            Started::Again(why) => unreachable!("a cold start asked to start again: {why}"),
        }
    }
}

/// Starts a worker's process, capped if the spec says so and else in a
/// cgroup of its own to fence in what it starts, with a fresh mark, and
/// hands it to a watch that reaps it; `spawned` is told its pid. With
/// [`Start::Fork`] it is forked from its kind's preloaded interpreter, and
/// started cold if that fails: a load never fails for the preloader's sake.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn start_process(
    spec: &ModelSpec,
    binary: &std::path::Path,
    args: &[String],
    connect: Connect<'_>,
    cwd: Option<&std::path::Path>,
    env: &[(String, String)],
    spawned: &(dyn Fn(u32) + Send + Sync),
    (start, load_timeout): (Start, Duration),
) -> Result<Started> {
    let model = spec.name.as_str();
    // A fork is handed the preloader's spare worker, which already sits in
    // a cgroup made for it ahead: that cgroup becomes this worker's, and the
    // load does not wait for a process to move between cgroups (which waits
    // out an RCU grace period: 8–26 ms measured).
    let spare = match (&start, connect) {
        (Start::Fork(preloader), Connect::Stream(_)) => {
            preloader.spare_cgroup_for(model, spec.memory_limit)
        }
        _ => None,
    };
    let (cap, fence) = match (spec.memory_limit, spare) {
        (Some(limit), Some(cgroup)) => (Some(MemoryCap::in_cgroup(limit, cgroup)), None),
        (Some(limit), None) => (Some(MemoryCap::prepare(model, limit)), None),
        (None, Some(cgroup)) => (None, Some(cgroup)),
        (None, None) => (
            None,
            Cgroup::create(model, None)
                .inspect_err(|why| tracing::debug!(model, "no cgroup for the worker: {why}"))
                .ok(),
        ),
    };
    // A container's command names the model's cgroup (`child/container.rs`).
    let args = &crate::child::container::fill_cgroup(
        args,
        cap.as_ref().and_then(MemoryCap::cgroup).or(fence.as_ref()),
    );
    let mark = crate::child::orphans::new_mark();
    let spawning = crate::child::orphans::spawning();
    let procs = cap
        .as_ref()
        .and_then(MemoryCap::cgroup)
        .or(fence.as_ref())
        .map(Cgroup::procs_file);
    let cold_because = match (start, connect) {
        (Start::Fork(preloader), Connect::Stream(wire)) => {
            let request = ForkRequest {
                model,
                mark: &mark,
                extra_env: env,
                cwd,
                cgroup_procs: procs
                    .and_then(|p| p.to_str().ok())
                    .map(std::path::Path::new),
                wire,
            };
            // A fork takes milliseconds: one that has not come in a third
            // of the load's time leaves the rest for a cold start.
            let timeout = (load_timeout / 3).min(Duration::from_secs(10));
            match preloader.fork(request, timeout).await {
                Ok(forked) => {
                    let start = WorkerStart::Forked {
                        preloader_pid: preloader.pid(),
                    };
                    let process = Arc::new(
                        ProcessWatch::adopt(model, forked.pid, forked.output, cap, fence, &mark)
                            .with_start(start),
                    );
                    drop(spawning);
                    process.spawn_rss_guard();
                    spawned(process.pid());
                    return Ok(Started::Process(process));
                }
                Err(failure) => {
                    let why = format!(
                        "forking from the preloaded interpreter of kind `{}` (pid {}) failed: {}",
                        preloader.kind(),
                        preloader.pid(),
                        failure.why
                    );
                    tracing::warn!(model, "{why}; starting the worker cold");
                    if failure.unanswered {
                        // Wedged, or off the protocol: stopped, so that the
                        // next load starts a new one.
                        preloader.stop().await;
                        return Ok(Started::Again(why));
                    }
                    Some(why)
                }
            }
        }
        (Start::ColdBecause(why), _) => Some(why),
        (Start::Fork(_) | Start::Cold, _) => None,
    };
    let child = spawn(SpawnOptions {
        model,
        binary,
        args,
        connect,
        cwd,
        mark: &mark,
        extra_env: env,
        cgroup_procs: procs,
    })
    .await?;
    let start = match cold_because {
        Some(reason) => WorkerStart::ColdFallback { reason },
        None => WorkerStart::Cold,
    };
    let process = Arc::new(ProcessWatch::start(model, child, cap, fence, &mark).with_start(start));
    drop(spawning);
    process.spawn_rss_guard();
    spawned(process.pid());
    Ok(Started::Process(process))
}
