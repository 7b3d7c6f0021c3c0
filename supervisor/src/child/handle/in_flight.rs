//! Counting a worker's requests in flight: a drain waits for zero, and a
//! token held by whoever sends outside a request stream (a relayed request)
//! counts as one until dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::Notify;

/// A request in flight on a worker, counted out when dropped.
#[derive(Debug)]
pub(crate) struct InFlightToken(pub(super) Arc<InFlight>);

impl Drop for InFlightToken {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// Requests in flight, with a wake-up for whoever waits for zero.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    pub(super) count: AtomicU32,
    pub(super) zero: Notify,
}

impl InFlight {
    pub(super) fn enter(&self) {
        self.count.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn count(&self) -> u32 {
        self.count.load(Ordering::SeqCst)
    }

    pub(super) fn leave(&self) {
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.zero.notify_waiters();
        }
    }
}
