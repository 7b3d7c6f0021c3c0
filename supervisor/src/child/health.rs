//! Heartbeats: a ping per interval, the worker's own stats back, and the
//! supervisor's own reading of its resident memory.
//!
//! The pong comes from the worker's command thread, so a worker whose model
//! code is stuck still answers it; what gives it away is the progress
//! counter the model code itself advances. A worker whose request in flight
//! makes no progress for `stall_timeout`, or that stops answering pings for
//! `heartbeat_timeout`, is killed, and its death fails its requests like
//! any crash.

use std::sync::Weak;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::base::KillCause;
use crate::child::handle::{NoPong, WorkerHandle};

/// How a worker is watched.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HealthPolicy {
    pub interval: Duration,
    pub heartbeat_timeout: Duration,
    pub stall_timeout: Option<Duration>,
}

/// The next instant on the process-wide grid of `interval`: every worker's
/// heartbeat ticks on the same instants, so one wake-up of the runtime
/// sends all the pings and their pongs come back together, instead of a
/// wake-up per worker spread over each second (on a VM, the context
/// switches were most of what idle workers cost).
pub(crate) fn aligned(interval: Duration) -> tokio::time::Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    let step = interval.as_nanos().max(1);
    let periods = Instant::now().duration_since(epoch).as_nanos() / step + 1;
    let offset = Duration::from_nanos(u64::try_from(periods * step).unwrap_or(u64::MAX));
    (epoch + offset).into()
}

/// Heartbeats are held (an in-place upgrade's handover: no ping may be
/// answered into a wire while it changes hands).
static PAUSED: AtomicBool = AtomicBool::new(false);
/// Pings sent and not yet answered or given up, all workers together.
static OUTSTANDING: AtomicUsize = AtomicUsize::new(0);

/// Holds (or resumes) every worker's heartbeats.
pub(crate) fn pause(paused: bool) {
    PAUSED.store(paused, Ordering::SeqCst);
}

/// Pings still waiting for their pong.
pub(crate) fn outstanding() -> usize {
    OUTSTANDING.load(Ordering::SeqCst)
}

/// Starts the heartbeat task. It ends when the worker dies or its handle is dropped.
pub(crate) fn spawn(handle: Weak<WorkerHandle>, policy: HealthPolicy) {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval_at(aligned(policy.interval), policy.interval);
        // Late ticks are skipped, not shifted: the phase stays shared.
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_progress: Option<(u64, Instant)> = None;
        loop {
            ticker.tick().await;
            let Some(worker) = handle.upgrade() else {
                return;
            };
            // A stop watches its worker itself from here on.
            if !worker.is_alive() || worker.process().is_stopping() {
                return;
            }
            if PAUSED.load(Ordering::SeqCst) {
                continue;
            }
            // RSS alone (one `statm` read) keeps admission's budget fresh;
            // the full reading (smaps_rollup, status) is taken when asked
            // for, by `ps` or an unload.
            worker.sample_rss();
            // Asleep: its processes are locked by the driver, and a
            // server's health route may wait on it. Nothing runs to stall.
            if worker.is_asleep() {
                last_progress = None;
                continue;
            }
            let asked = Instant::now();
            OUTSTANDING.fetch_add(1, Ordering::SeqCst);
            let answer = worker.heartbeat(policy.heartbeat_timeout).await;
            OUTSTANDING.fetch_sub(1, Ordering::SeqCst);
            let stats = match answer {
                Ok(stats) => Some(stats),
                Err(why) => {
                    // A worker that died (a crash, a kill from outside)
                    // fails its ping at once, before it is reaped: its death,
                    // not a lost heartbeat, is then the cause its requests
                    // are told.
                    if why == NoPong::Gone
                        && worker
                            .process()
                            .exited_within(Duration::from_millis(250))
                            .await
                            .is_some()
                    {
                        return;
                    }
                    None
                }
            };
            let Some(stats) = stats else {
                if worker.is_alive() && !worker.process().is_stopping() {
                    tracing::warn!(
                        model = worker.model(),
                        pid = worker.pid(),
                        "no heartbeat; killing the worker"
                    );
                    worker.process().kill_for(KillCause::HeartbeatLost {
                        silent_for_s: asked.elapsed().as_secs_f64(),
                    });
                }
                return;
            };
            // The worker read its counter between `asked` and `answered`. So
            // a value is stamped as first seen when its pong came back, and
            // the clock is read at the ask: the time measured without
            // progress is never more than the time that truly passed.
            let answered = Instant::now();
            let now = asked;
            match last_progress {
                // Idle: no clock runs. A request's clock starts at the first
                // tick that sees it in flight, which is never before it began.
                _ if worker.in_flight() == 0 => last_progress = None,
                // Moving: the clock restarts.
                Some((seen, _)) if seen != stats.progress => {
                    last_progress = Some((stats.progress, answered))
                }
                None => last_progress = Some((stats.progress, answered)),
                Some((_, since)) => {
                    if let Some(stall) = policy.stall_timeout
                        && !worker.process().is_stopping()
                        // Never early: at least `stall` without progress;
                        // at most about two intervals late (one until a tick
                        // first sees the request, one to the tick that ends it).
                        && now.duration_since(since) >= stall
                    {
                        tracing::warn!(
                            model = worker.model(),
                            pid = worker.pid(),
                            "request made no progress for {:.1} s; killing the worker",
                            now.duration_since(since).as_secs_f64()
                        );
                        worker.process().kill_for(KillCause::Stalled {
                            no_progress_for_s: now.duration_since(since).as_secs_f64(),
                        });
                        return;
                    }
                }
            }
        }
    });
}
