//! What a caller holds while its request runs: a [`RequestStream`] (a
//! berth worker's answer, piece by piece) or a [`Lease`] (an HTTP server,
//! held for one relayed exchange). Both carry one [`Ticket`], whose drop
//! does the model's bookkeeping when the request ends, however it ends:
//! its concurrency slot given back, its latency and errors counted, its
//! keep-alive renewed, its recycling policy checked.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::sync::OwnedSemaphorePermit;

use super::{Inner, ModelCounters, Supervisor};
use crate::child::handle::{InFlightToken, Piece, ResponseStream, WorkerHandle};
use crate::error::{Error, Result};

/// One admitted request's bookkeeping, done when it is dropped.
pub(super) struct Ticket {
    pub(super) model: String,
    pub(super) supervisor: Weak<Inner>,
    pub(super) counters: Arc<ModelCounters>,
    pub(super) started: Instant,
    pub(super) keep_alive: Option<Duration>,
    pub(super) deadline: Option<tokio::time::Instant>,
    pub(super) failed: bool,
    pub(super) _permit: OwnedSemaphorePermit,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.failed {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.counters.observe_latency(self.started.elapsed());
        if let Some(inner) = self.supervisor.upgrade()
            // One lock per request; a second only for models that recycle.
            && Supervisor::request_finished(&inner, &self.model, self.keep_alive)
        {
            Supervisor::maybe_recycle(&inner, &self.model);
        }
    }
}

/// A request's answer, piece by piece, with the model's bookkeeping
/// (concurrency slot, keep-alive, metrics) done when it ends.
pub struct RequestStream {
    inner: ResponseStream,
    ticket: Ticket,
}

impl fmt::Debug for RequestStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RequestStream")
            .field("model", &self.ticket.model)
            .finish_non_exhaustive()
    }
}

impl RequestStream {
    pub(super) fn new(inner: ResponseStream, ticket: Ticket) -> RequestStream {
        RequestStream { inner, ticket }
    }

    /// The next piece; `None` after the final one.
    pub async fn next(&mut self) -> Option<Result<Piece>> {
        let piece = match self.ticket.deadline {
            None => self.inner.next().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, self.inner.next()).await {
                Ok(piece) => piece,
                Err(_) => {
                    self.inner.cancel();
                    Some(Err(Error::DeadlineExceeded {
                        model: self.ticket.model.clone(),
                        after: self.ticket.started.elapsed(),
                    }))
                }
            },
        };
        if matches!(piece, Some(Err(_))) {
            self.ticket.failed = true;
        }
        piece
    }
}

impl Drop for RequestStream {
    /// The worker's own time for it, beside the latency the ticket counts.
    fn drop(&mut self) {
        if let Some(run) = self.inner.run() {
            self.ticket
                .counters
                .observe_run(run, self.ticket.started.elapsed());
        }
    }
}

/// A model served by an HTTP server, held for one request (see
/// [`Supervisor::lease`]). While it lives the request counts as in flight
/// on the server, and holds one of the model's concurrency slots; when it
/// is dropped, the model's keep-alive, metrics and recycling policy take
/// note, as for any request.
pub struct Lease {
    worker: Arc<WorkerHandle>,
    _in_flight: InFlightToken,
    ticket: Ticket,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("model", &self.ticket.model)
            .field("pid", &self.worker.pid())
            .finish_non_exhaustive()
    }
}

impl Lease {
    pub(super) fn new(
        worker: Arc<WorkerHandle>,
        in_flight: InFlightToken,
        ticket: Ticket,
    ) -> Lease {
        Lease {
            worker,
            _in_flight: in_flight,
            ticket,
        }
    }

    /// Where the server listens: `http://127.0.0.1:PORT` or `unix:PATH`.
    pub fn address(&self) -> &crate::child::ports::Address {
        self.upstream().address()
    }

    /// The server's process.
    pub fn pid(&self) -> u32 {
        self.worker.pid()
    }

    pub fn model(&self) -> &str {
        &self.ticket.model
    }

    /// The request's deadline, if it has one.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.ticket.deadline
    }

    pub(crate) fn upstream(&self) -> &Arc<crate::child::upstream::Upstream> {
        self.worker
            .upstream_server()
            .expect("a lease is only given on an HTTP server")
    }

    /// Resolves once the server has died, with the error its requests
    /// fail with (exit status, cause, stderr tail).
    pub async fn died(&self) -> Error {
        let death = self.worker.death().await;
        death.error(&self.ticket.model, self.worker.pid(), "request")
    }

    /// [`Lease::died`] as a future that owns what it needs.
    pub fn death_watch(&self) -> impl std::future::Future<Output = Error> + Send + 'static {
        let (worker, model) = (Arc::clone(&self.worker), self.ticket.model.clone());
        async move {
            let death = worker.death().await;
            death.error(&model, worker.pid(), "request")
        }
    }

    /// Counts the request as failed (in the model's error counter).
    pub fn failed(&mut self) {
        self.ticket.failed = true;
    }
}
