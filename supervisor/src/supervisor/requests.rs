//! Requests: concurrency permits and the bounded queue, routing to the
//! current worker, deadlines, and the bookkeeping when a request ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use berth_protocol::Body;
use tokio::sync::OwnedSemaphorePermit;

use super::tickets::{Lease, RequestStream, Ticket};
use super::{
    DEFAULT_MAX_QUEUE, Inner, ModelCounters, ModelState, RequestOptions, State, Supervisor,
};
use crate::child::handle::{Piece, WorkerHandle};
use crate::error::{Error, Result};

impl Supervisor {
    /// The worker serving `model`, if it is loaded and ready (no loading).
    pub fn worker(&self, model: &str) -> Result<Arc<WorkerHandle>> {
        let state = self.lock();
        match state.slots.get(model) {
            Some(slot) if slot.state() == ModelState::Ready => Ok(Arc::clone(
                slot.worker.as_ref().expect("ready slots have a worker"),
            )),
            Some(slot) => Err(Error::Busy {
                model: model.into(),
                reason: format!("it is {}", slot.state()),
            }),
            None if state.catalogue.contains_key(model) => Err(Error::NotLoaded {
                model: model.into(),
            }),
            None => Err(self.unknown_locked(model, &state)),
        }
    }

    /// Sends one request and waits for the answer, loading the model first
    /// if it is registered but not loaded.
    pub async fn request(&self, model: &str, body: Body) -> Result<Body> {
        self.request_with(model, body, RequestOptions::default())
            .await
    }

    pub async fn request_with(
        &self,
        model: &str,
        body: Body,
        options: RequestOptions,
    ) -> Result<Body> {
        let mut stream = self.request_stream_with(model, body, options).await?;
        loop {
            match stream.next().await {
                Some(Ok(Piece::Done(body))) => return Ok(body),
                Some(Ok(Piece::Chunk(_))) => {}
                Some(Err(e)) => return Err(e),
                None => {
                    return Err(Error::NotLoaded {
                        model: model.into(),
                    });
                }
            }
        }
    }

    /// Sends one request; its chunks and final body arrive on the stream.
    /// Dropping the stream cancels the request in the worker.
    pub async fn request_stream(&self, model: &str, body: Body) -> Result<RequestStream> {
        self.request_stream_with(model, body, RequestOptions::default())
            .await
    }

    pub async fn request_stream_with(
        &self,
        model: &str,
        body: Body,
        options: RequestOptions,
    ) -> Result<RequestStream> {
        let hash = crate::child::handle::body_hash(&body);
        let mut body = Some(body);
        let admitted = self
            .admit(model, options, Some(hash), |worker| {
                worker.call_stream(body.take().expect("sent once"))
            })
            .await?;
        let ticket = self.ticket(model, options, admitted.bookkeeping);
        Ok(RequestStream::new(admitted.routed, ticket))
    }

    /// Holds a model served by an HTTP server ([`ModelSpec::http`]) for one
    /// request, loading it first if it is registered but not loaded: the
    /// [`Lease`] says where the server listens, and counts as a request in
    /// flight (for `max_concurrency` and its queue, drains, keep-alive and
    /// eviction) until it is dropped. `berth serve` relays its `/v1`
    /// requests through one; an embedding host sends its own.
    ///
    /// [`ModelSpec::http`]: crate::ModelSpec::http
    pub async fn lease(&self, model: &str, options: RequestOptions) -> Result<Lease> {
        let admitted = self
            .admit(model, options, None, |worker| {
                if worker.upstream_server().is_none() {
                    return Err(Error::InvalidRequest {
                        model: model.into(),
                        reason: "it is served by a berth worker, not an HTTP server: send it \
                                 requests with Supervisor::request (or berth serve's routes)"
                            .into(),
                    });
                }
                Ok((Arc::clone(worker), worker.enter()))
            })
            .await?;
        let (worker, in_flight) = admitted.routed;
        let ticket = self.ticket(model, options, admitted.bookkeeping);
        Ok(Lease::new(worker, in_flight, ticket))
    }

    /// What every request goes through before it reaches a worker: the
    /// quarantine (by `hash`), the concurrency permit and its bounded
    /// queue, the deadline, loading the model if needed; then `route` is
    /// called with the ready worker, under the lock a swap switches routing
    /// under, so a drain never misses what it registers.
    async fn admit<T>(
        &self,
        model: &str,
        options: RequestOptions,
        hash: Option<u64>,
        mut route: impl FnMut(&Arc<WorkerHandle>) -> Result<T>,
    ) -> Result<Admitted<T>> {
        // A request may name the model by one of its aliases.
        let canonical = self.canonical(model);
        let model = canonical.as_str();
        self.check_running(model)?;
        for (field, value) in [
            ("keep_alive", options.keep_alive),
            ("timeout", options.deadline),
        ] {
            crate::config::check_duration(field, value).map_err(|reason| {
                Error::InvalidRequest {
                    model: model.into(),
                    reason,
                }
            })?;
        }
        let (permits, queued, awaiting_load, max_queue, counters, concurrency) = {
            let state = self.lock();
            let entry = state
                .catalogue
                .get(model)
                .ok_or_else(|| self.unknown_locked(model, &state))?;
            if hash.is_some_and(|h| entry.health.is_quarantined(h)) {
                entry.counters.errors.fetch_add(1, Ordering::Relaxed);
                return Err(Error::Quarantined {
                    model: model.into(),
                });
            }
            (
                Arc::clone(&entry.permits),
                Arc::clone(&entry.queued),
                Arc::clone(&entry.awaiting_load),
                entry.spec.max_queue.unwrap_or(DEFAULT_MAX_QUEUE),
                Arc::clone(&entry.counters),
                entry.concurrency,
            )
        };
        // The deadline covers the whole request: queueing, loading, answering.
        let started = Instant::now();
        let deadline = options
            .deadline
            .and_then(|d| tokio::time::Instant::now().checked_add(d));
        let permit = match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => permit,
            Err(_) => {
                // Count ourselves in the queue first, so the bound holds under a burst.
                if queued.fetch_add(1, Ordering::SeqCst) >= max_queue {
                    queued.fetch_sub(1, Ordering::SeqCst);
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                    return Err(Error::QueueFull {
                        model: model.into(),
                        max_concurrency: concurrency,
                        queued: max_queue,
                    });
                }
                // Leaves the queue however the wait ends, a dropped caller included.
                let _in_queue = LeaveQueue(Arc::clone(&queued));
                let permit = within(deadline, model, started, permits.acquire_owned()).await;
                permit?.map_err(|_| Error::ShuttingDown {
                    model: model.into(),
                })?
            }
        };
        // Waiting still, until a ready worker takes the request: counted
        // as such (the waiting requests of `/metrics`, the machine's queue
        // bounded by `max_queue`) however this ends.
        let _awaiting = self.await_load(model, &awaiting_load).inspect_err(|_| {
            counters.errors.fetch_add(1, Ordering::Relaxed);
        })?;
        loop {
            within(deadline, model, started, self.load_for_request(model))
                .await
                .map_err(|e| self.said_what_it_waited_for(model, e))
                .and_then(|loaded| loaded)
                .inspect_err(|_| {
                    counters.errors.fetch_add(1, Ordering::Relaxed);
                })?;
            let changed = self.inner.changed.notified();
            // Pick the current worker and register the call under one lock,
            // so a swap or unload that starts now sees this request in flight.
            let routed = {
                let state = self.lock();
                match state.slots.get(model) {
                    // Not once it yields its turn, but for the requests
                    // that waited through its load.
                    Some(slot)
                        if slot.state() == ModelState::Ready
                            && !slot.hold
                            && slot.takes(started) =>
                    {
                        let worker = slot.worker.as_ref().expect("ready slots have a worker");
                        Some(route(worker)?)
                    }
                    _ => None,
                }
            };
            let Some(routed) = routed else {
                // Changing state (a recycle holding requests, a restart): wait for it.
                let _ = tokio::time::timeout(Duration::from_millis(50), changed).await;
                continue;
            };
            counters.requests.fetch_add(1, Ordering::Relaxed);
            return Ok(Admitted {
                routed,
                bookkeeping: Bookkeeping {
                    permit,
                    counters,
                    started,
                    deadline,
                },
            });
        }
    }

    /// A deadline that passed while the request waited for its model's
    /// load or turn: said with what it waited for (who held the room).
    fn said_what_it_waited_for(&self, model: &str, e: Error) -> Error {
        let Error::DeadlineExceeded { after, .. } = e else {
            return e;
        };
        let state = self.lock();
        let waited_for = match state.slots.get(model) {
            Some(slot) if slot.yielding.is_some() => {
                "its next turn (it yields to another model)".to_string()
            }
            Some(slot) => format!("its load (it is {})", slot.state()),
            None => {
                let holders = super::room::room(&state, model).holders();
                format!(
                    "room to load it; held by: {}",
                    if holders.is_empty() {
                        "nothing".to_string()
                    } else {
                        holders.join(", ")
                    }
                )
            }
        };
        Error::WaitedTooLong {
            model: model.into(),
            after,
            waited_for,
        }
    }

    /// Counts a request (or a caller of `load`) as waiting for `model`'s
    /// load or turn until the guard drops: in its model's count and in the
    /// machine's, which `max_queue` bounds (past it, refused at once).
    pub(super) fn await_load(&self, model: &str, awaiting: &Arc<AtomicUsize>) -> Result<Awaiting> {
        let max = self.config().max_queue;
        let total = &self.inner.waiting;
        if total.fetch_add(1, Ordering::SeqCst) >= max {
            total.fetch_sub(1, Ordering::SeqCst);
            return Err(Error::MachineQueueFull {
                model: model.into(),
                waiting: max,
            });
        }
        awaiting.fetch_add(1, Ordering::SeqCst);
        Ok(Awaiting {
            model: Arc::clone(awaiting),
            total: Arc::clone(total),
        })
    }

    /// The ticket an admitted request carries to its end.
    fn ticket(&self, model: &str, options: RequestOptions, held: Bookkeeping) -> Ticket {
        Ticket {
            model: model.to_string(),
            supervisor: Arc::downgrade(&self.inner),
            counters: held.counters,
            started: held.started,
            keep_alive: options.keep_alive,
            deadline: held.deadline,
            failed: false,
            _permit: held.permit,
        }
    }

    /// Called when a request ends: the model was just used.
    /// Returns whether the model has a recycling policy to check.
    pub(super) fn request_finished(
        inner: &Inner,
        model: &str,
        keep_alive: Option<Duration>,
    ) -> bool {
        let mut state = inner.state.lock().unwrap_or_else(|e| e.into_inner());
        let State {
            catalogue, slots, ..
        } = &mut *state;
        let Some(entry) = catalogue.get_mut(model) else {
            return false;
        };
        if let Some(k) = keep_alive {
            entry.keep_alive = Some(k);
        }
        if let Some(slot) = slots.get_mut(model) {
            slot.used(entry.keep_alive);
        }
        // A keep-alive the request set may end before the reaper wakes; a
        // renewed one only ends later, which the reaper finds when it wakes.
        if keep_alive.is_some() {
            inner.expiry_changed.notify_one();
        }
        entry.spec.max_rss.is_some() || entry.spec.max_requests.is_some()
    }
}

/// A request let through to a ready worker.
struct Admitted<T> {
    routed: T,
    bookkeeping: Bookkeeping,
}

/// What an admitted request holds until it ends.
struct Bookkeeping {
    permit: OwnedSemaphorePermit,
    counters: Arc<ModelCounters>,
    started: Instant,
    deadline: Option<tokio::time::Instant>,
}

/// Counts a request out of its model's queue when dropped.
pub(super) struct LeaveQueue(Arc<AtomicUsize>);

/// Counts a request out of its model's wait for a load or turn, and out of
/// the machine's, when dropped.
pub(crate) struct Awaiting {
    model: Arc<AtomicUsize>,
    total: Arc<AtomicUsize>,
}

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.model.fetch_sub(1, Ordering::SeqCst);
        self.total.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for LeaveQueue {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Runs `fut` until the request's deadline, if it has one.
pub(super) async fn within<T>(
    deadline: Option<tokio::time::Instant>,
    model: &str,
    started: Instant,
    fut: impl std::future::Future<Output = T>,
) -> Result<T> {
    match deadline {
        None => Ok(fut.await),
        Some(at) => tokio::time::timeout_at(at, fut)
            .await
            .map_err(|_| Error::DeadlineExceeded {
                model: model.into(),
                after: started.elapsed(),
            }),
    }
}
