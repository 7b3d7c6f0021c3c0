//! What an in-place upgrade (`crate::child::handover`) reads of a worker's handle,
//! and what an adopted worker's handle takes over.

use std::sync::atomic::Ordering;

use berth_protocol::LoadInfo;

use super::WorkerHandle;
use crate::child::link::{Link, WireFds};

impl WorkerHandle {
    /// What an in-place upgrade hands over of this worker's wire: its
    /// commands (captured now) and its events or socket (kept aside).
    pub(crate) fn wire_for_handover(
        &self,
    ) -> std::io::Result<(Option<crate::child::handover::ipc::Captured>, &WireFds)> {
        let commands = match &self.commands {
            Link::Ipc(sender) => Some(crate::child::handover::ipc::capture(sender.clone())?),
            Link::Stream(_) | Link::None => None,
        };
        Ok((commands, &self.wire_fds))
    }

    /// What an adopted worker's handle takes over from its handover: the
    /// requests it served, its load's figures.
    pub(crate) fn resume(
        &self,
        requests: u64,
        info: Option<LoadInfo>,
        baseline_rss: u64,
        load_micros: u64,
    ) {
        self.requests.store(requests, Ordering::Relaxed);
        *self.load_info.lock().unwrap_or_else(|e| e.into_inner()) = info;
        self.baseline_rss.store(baseline_rss, Ordering::Relaxed);
        self.load_micros.store(load_micros, Ordering::Relaxed);
    }

    /// Resident memory right after load.
    pub(crate) fn baseline_rss(&self) -> u64 {
        self.baseline_rss.load(Ordering::Relaxed)
    }
}
