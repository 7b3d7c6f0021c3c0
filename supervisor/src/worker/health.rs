//! Heartbeats: a ping per interval, the worker's own stats back, and the
//! supervisor's own procfs reading of its memory. A worker that stops
//! answering for `timeout` is killed; its death then fails its requests like
//! any crash.

use std::sync::Weak;
use std::time::Duration;

use crate::worker::handle::WorkerHandle;

/// Starts the heartbeat task. It ends when the worker dies or its handle is dropped.
pub(crate) fn spawn(handle: Weak<WorkerHandle>, interval: Duration, timeout: Duration) {
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticker.tick().await;
        loop {
            ticker.tick().await;
            let Some(worker) = handle.upgrade() else {
                return;
            };
            if !worker.is_alive() {
                return;
            }
            worker.sample_memory();
            if worker.ping(timeout).await.is_none() && worker.is_alive() {
                tracing::warn!(
                    model = worker.model(),
                    pid = worker.pid(),
                    "no heartbeat for {}; killing the worker",
                    humantime::format_duration(timeout)
                );
                worker.kill();
                return;
            }
        }
    });
}
