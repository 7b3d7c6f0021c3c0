//! Routing a worker's events: the reader (a blocking thread on
//! `ipc-channel`; on the stream wire a task, or a spinning caller: see
//! `inbox`) hands each event straight to
//! whoever waits for it, by request id; answers past `max_response` are
//! refused on arrival; the pending map fails every request at once when the
//! worker dies. An event that cannot be routed (an answer to a request never
//! sent or already done, a load result nobody asked for) is a violation:
//! the reader stops and the worker is killed, naming what it sent.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use berth_protocol::stream::Violation;
use berth_protocol::{Body, Event, RequestId, WireError, WorkerStats};
use tokio::sync::{mpsc, watch};

use super::death::Death;
use super::process::ProcessWatch;
use crate::base::KillCause;

/// Cancelled requests remembered until their `done` arrives; past this
/// many, the oldest are forgotten (a worker withholding them is answered
/// by stall detection, not by memory).
const MAX_CANCELLED: usize = 1 << 16;

pub(super) enum Reply {
    Chunk(Body),
    /// A streamed piece refused on arrival (past `max_response`): the
    /// request is cancelled in the worker, which would otherwise go on.
    Refused(WireError),
    Done(Result<Body, WireError>, berth_protocol::RunInfo),
    Died(Arc<Death>),
}

/// What became of a reply handed to [`Routes::route`].
pub(super) enum Routed {
    Delivered,
    /// For a request given up on, or after the worker died: dropped.
    Dropped,
    /// The request was refused and given up on: its caller is told, and the
    /// worker must be told to cancel it.
    GaveUp,
}

/// A request waiting for its answer.
pub(super) struct Waiting {
    pub(super) tx: mpsc::UnboundedSender<Reply>,
    /// What identifies it for quarantine.
    pub(super) hash: u64,
    /// Chunks routed to it and not yet read by its caller (see [`Backlog`]).
    pub(super) unread: Arc<Backlog>,
}

/// What a request's caller has not read yet of the pieces streamed to it:
/// a worker streaming faster than its caller reads (a client that does not
/// read its server-sent events) has its request cancelled past a small
/// backlog, rather than have its pieces queued without bound.
#[derive(Debug, Default)]
pub(super) struct Backlog {
    bytes: AtomicU64,
    pieces: AtomicU64,
}

/// The unread pieces one request may have queued, in bytes as the
/// supervisor holds them (see [`piece_bytes`]; `max_response` if that is
/// lower) and in number. One piece of any size up to `max_response` is
/// always let through when nothing is unread.
pub(super) const BACKLOG_BYTES: u64 = 4 << 20;
pub(super) const BACKLOG_PIECES: u64 = 4096;
/// What a queued piece costs beyond its bytes: the reply, the body, their
/// allocations. A stream of one-token chunks is mostly this.
const PIECE_OVERHEAD: u64 = 160;

/// A queued piece's cost in the supervisor's memory.
pub(super) fn piece_bytes(body: &Body) -> u64 {
    held_bytes(body) + PIECE_OVERHEAD
}

impl Backlog {
    /// Counts a piece in, if a backlog of at most `limit` bytes has room
    /// for it.
    fn admit(&self, size: u64, limit: u64) -> Result<(), (u64, u64)> {
        let bytes = self.bytes.fetch_add(size, Ordering::SeqCst);
        let pieces = self.pieces.fetch_add(1, Ordering::SeqCst);
        if bytes > 0 && (bytes + size > limit || pieces >= BACKLOG_PIECES) {
            self.bytes.fetch_sub(size, Ordering::SeqCst);
            self.pieces.fetch_sub(1, Ordering::SeqCst);
            return Err((bytes, pieces));
        }
        Ok(())
    }

    /// Counts a piece out, once its caller has it.
    pub(super) fn read(&self, size: u64) {
        self.bytes.fetch_sub(size, Ordering::SeqCst);
        self.pieces.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The size of a body as `max_response` counts it: its JSON and its bulk
/// bytes, however they travel (inside the message, in `ipc-channel`'s
/// shared memory, in a memfd). Bulk bytes in shared memory are not the
/// supervisor's heap, but a mapping held until the answer is passed on
/// keeps them alive just the same, so one rule counts every form.
pub(super) fn held_bytes(body: &Body) -> u64 {
    (body.json.len() + body.bulk_bytes().len()) as u64
}

#[derive(Default)]
pub(super) struct RoutesInner {
    pub(super) pending: HashMap<RequestId, Waiting>,
    /// Requests given up on whose `done` has not come yet.
    cancelled: BTreeSet<RequestId>,
    pub(super) death: Option<Arc<Death>>,
}

/// The pending map and, once the worker is dead, why.
pub(super) struct Routes {
    inner: Mutex<RoutesInner>,
    /// The most unread bytes one request may have queued.
    backlog_bytes: u64,
    /// The next request id; every id below it was sent.
    next_id: AtomicU64,
    /// A `Load` was sent and its answer has not come.
    load_asked: AtomicBool,
}

impl Routes {
    pub(super) fn new(max_response: u64) -> Self {
        Routes {
            inner: Mutex::default(),
            backlog_bytes: max_response.min(BACKLOG_BYTES),
            next_id: AtomicU64::new(1),
            load_asked: AtomicBool::new(false),
        }
    }
}

impl Routes {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, RoutesInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A fresh request id.
    pub(super) fn next_id(&self) -> RequestId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn expect_load(&self) {
        self.load_asked.store(true, Ordering::SeqCst);
    }

    /// Stops waiting for `id`: its `done` (and any chunk before it) will be
    /// dropped on arrival.
    pub(super) fn give_up(&self, id: RequestId) {
        let mut inner = self.lock();
        if inner.pending.remove(&id).is_some() {
            inner.cancelled.insert(id);
            if inner.cancelled.len() > MAX_CANCELLED {
                inner.cancelled.pop_first();
            }
        }
    }

    /// Hands `reply` to request `id`'s caller. A streamed piece that its
    /// caller's backlog has no room for, or that was refused on arrival,
    /// ends the request: its caller gets the refusal, later pieces and its
    /// `done` are dropped, and the caller of `route` must tell the worker
    /// to cancel it ([`Routed::GaveUp`]).
    pub(super) fn route(&self, id: RequestId, mut reply: Reply) -> Result<Routed, Violation> {
        let mut inner = self.lock();
        let done = matches!(reply, Reply::Done(..));
        if done {
            if let Some(waiting) = inner.pending.remove(&id) {
                drop(inner);
                let _ = waiting.tx.send(reply);
                return Ok(Routed::Delivered);
            }
        } else if let Some(waiting) = inner.pending.get(&id) {
            let refused = match &reply {
                Reply::Refused(_) => true,
                Reply::Chunk(body) => {
                    match waiting.unread.admit(piece_bytes(body), self.backlog_bytes) {
                        Ok(()) => false,
                        Err((bytes, pieces)) => {
                            reply = Reply::Refused(WireError::new(
                                berth_protocol::ErrorKind::InputTooLarge,
                                format!(
                                    "request {id}: the worker streamed {pieces} pieces ({bytes} \
                                     bytes) its caller has not read yet, and one request may \
                                     have at most {BACKLOG_PIECES} pieces or {} bytes waiting, \
                                     so it was cancelled; read the stream as it comes",
                                    self.backlog_bytes
                                ),
                            ));
                            true
                        }
                    }
                }
                _ => false,
            };
            let tx = waiting.tx.clone();
            if refused {
                inner.pending.remove(&id);
                inner.cancelled.insert(id);
                if inner.cancelled.len() > MAX_CANCELLED {
                    inner.cancelled.pop_first();
                }
            }
            drop(inner);
            let _ = tx.send(reply);
            if refused {
                // What was queued goes with the caller's channel; give the
                // heap back once it has.
                crate::heap::trim_soon();
                return Ok(Routed::GaveUp);
            }
            return Ok(Routed::Delivered);
        }
        let what = if done { "done" } else { "chunk" };
        if inner.death.is_some()
            || (done && inner.cancelled.remove(&id))
            || (!done && inner.cancelled.contains(&id))
        {
            return Ok(Routed::Dropped);
        }
        if id == 0 || id >= self.next_id.load(Ordering::Relaxed) {
            Err(Violation(format!(
                "a `{what}` for request {id}, which was never sent"
            )))
        } else {
            Err(Violation(format!(
                "a `{what}` for request {id} after its `done`"
            )))
        }
    }

    /// Fails every pending request and refuses new ones. Idempotent.
    pub(super) fn close(&self, mut death: Death) -> Arc<Death> {
        let mut inner = self.lock();
        if let Some(first) = &inner.death {
            return Arc::clone(first);
        }
        let pending = std::mem::take(&mut inner.pending);
        death.in_flight = pending.values().map(|w| w.hash).collect();
        let death = Arc::new(death);
        inner.death = Some(Arc::clone(&death));
        drop(inner);
        for (_, Waiting { tx, .. }) in pending {
            let _ = tx.send(Reply::Died(Arc::clone(&death)));
        }
        death
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reply::Chunk(_) => "Chunk",
            Reply::Refused(_) => "Refused",
            Reply::Done(..) => "Done",
            Reply::Died(_) => "Died",
        })
    }
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Routes")
    }
}

/// Where a reader hands what it reads.
pub(super) struct Dispatch {
    pub(super) model: String,
    pub(super) routes: Arc<Routes>,
    /// For cancelling a request whose pieces its caller refused.
    pub(super) commands: crate::child::link::Link,
    pub(super) control: mpsc::UnboundedSender<Event>,
    pub(super) pongs: watch::Sender<Option<(u64, WorkerStats)>>,
    pub(super) max_response: u64,
    pub(super) process: Arc<ProcessWatch>,
    /// How quickly the worker answers: after an answer from a worker whose
    /// callers spin, the `ipc-channel` reader polls for the next event for
    /// half the spin (see `read_ipc`).
    pub(super) answer_time: Arc<crate::child::handle::spin::AnswerTime>,
}

impl Dispatch {
    pub(super) fn dispatch(&self, event: Event) -> Result<(), Violation> {
        let model = self.model.as_str();
        match event {
            Event::Chunk { id, body } => {
                let reply = match bounded(model, body, self.max_response) {
                    Ok(body) => Reply::Chunk(body),
                    Err(e) => Reply::Refused(e),
                };
                if let Routed::GaveUp = self.routes.route(id, reply)? {
                    let _ = self.commands.send(berth_protocol::Command::Cancel { id });
                }
                Ok(())
            }
            Event::Done { id, result, run } => {
                let result = result
                    .map_err(|e| self.without_trace(e))
                    .and_then(|body| bounded(model, body, self.max_response));
                self.routes.route(id, Reply::Done(result, run)).map(|_| ())
            }
            Event::Pong { seq, stats } => {
                let _ = self.pongs.send(Some((seq, stats)));
                Ok(())
            }
            Event::LoadFailed(e) if self.routes.load_asked.load(Ordering::SeqCst) => {
                self.routes.load_asked.store(false, Ordering::SeqCst);
                let _ = self.control.send(Event::LoadFailed(self.without_trace(e)));
                Ok(())
            }
            Event::Loaded(_) | Event::LoadFailed(_) => {
                if !self.routes.load_asked.swap(false, Ordering::SeqCst) {
                    return Err(Violation(format!(
                        "a `{}` when no load was asked for",
                        event.name()
                    )));
                }
                let _ = self.control.send(event);
                Ok(())
            }
            Event::Hello(_) => Err(Violation("a second hello".into())),
        }
    }

    /// A worker's error without a backtrace or traceback in its message
    /// (any worker, in any language, may send one): logged whole, told to
    /// clients without it.
    fn without_trace(&self, error: WireError) -> WireError {
        let (error, trace) = error.split_trace();
        if let Some(trace) = trace {
            tracing::warn!(model = %self.model, "the worker's error `{}` came with a trace: {trace}",
                error.message);
        }
        error
    }

    pub(super) fn violated(&self, violation: Violation) {
        tracing::error!(model = %self.model, "the worker broke the wire: it sent {violation}");
        self.process
            .kill_for(KillCause::ProtocolViolation { sent: violation.0 });
    }

    /// Reads an `ipc-channel` worker (a blocking receive: run it on a
    /// thread of its own) until it is gone or breaks the wire.
    ///
    /// This is the one thread an idle worker costs, and it is kept on
    /// purpose: `ipc-channel` reads the rest of a message that came in
    /// fragments with blocking reads on the sender, and exposes no
    /// descriptor to poll, so a shared reader (its `ROUTER`, an
    /// `IpcReceiverSet`) would let one worker that stops mid-message (frozen,
    /// stopped under a debugger, thrashing) hold up every other worker's
    /// answers and heartbeats, and an error it reads ends that reader for
    /// all of them. One thread each keeps a worker's faults its own.
    ///
    /// After delivering an answer from a worker whose answers come within
    /// `answer_spin` (the callers spin for them), it polls (yielding its
    /// CPU) for half of that before it blocks again: the next answer, when
    /// a caller sends its next request at once, then finds this thread
    /// awake. Measured from an idle 2-vCPU VM, this thread otherwise slept
    /// between answers on a vCPU of its own that halted, and each answer
    /// paid the hypervisor's wake-up (~20 µs) on its way to the caller
    /// (docs/performance.md, "From an idle machine"). Pongs, chunks, an idle
    /// worker and a model whose answers take longer never make it poll.
    pub(super) fn read_ipc(&self, events: &ipc_channel::ipc::IpcReceiver<Event>) {
        let mut answered = false;
        loop {
            let poll = answered.then(|| self.answer_time.spin()).flatten();
            let next = match poll.and_then(|spin| poll_ipc(events, spin / 2)) {
                Some(next) => next,
                None => events.recv(),
            };
            match next {
                Ok(event) => {
                    answered = matches!(event, Event::Done { .. });
                    if let Err(v) = self.dispatch(event) {
                        return self.violated(v);
                    }
                }
                Err(ipc_channel::IpcError::Disconnected) => return,
                Err(e) => {
                    tracing::error!(model = %self.model, "cannot decode an event from the worker: {e}");
                    return;
                }
            }
        }
    }
}

/// The next event if one comes within `poll`, polled without blocking and
/// yielding the CPU between polls; `None` when none came.
fn poll_ipc(
    events: &ipc_channel::ipc::IpcReceiver<Event>,
    poll: std::time::Duration,
) -> Option<Result<Event, ipc_channel::IpcError>> {
    if poll.is_zero() {
        return None;
    }
    let started = std::time::Instant::now();
    while started.elapsed() < poll {
        match events.try_recv() {
            Ok(event) => return Some(Ok(event)),
            Err(ipc_channel::TryRecvError::Empty) => std::thread::yield_now(),
            Err(ipc_channel::TryRecvError::IpcError(e)) => return Some(Err(e)),
        }
    }
    None
}

/// A body the worker sent: a large one asks for a heap trim once it is
/// through (whatever front door passes it on); one past `max_response`
/// bytes (JSON and bulk together, in whatever form: see [`held_bytes`]) is
/// refused and its request fails alone: the supervisor would otherwise
/// parse and copy it several times over on its way to the client.
/// Bulk bytes a body holds on the supervisor's heap.
fn inline_len(body: &Body) -> usize {
    match &body.bulk {
        berth_protocol::Bulk::Inline(bytes) => bytes.len(),
        _ => 0,
    }
}

fn bounded(model: &str, body: Body, max_response: u64) -> std::result::Result<Body, WireError> {
    let size = held_bytes(&body);
    if size <= max_response {
        if body.json.len() + inline_len(&body) >= crate::heap::LARGE as usize {
            // Its copies on the way to the client will be freed shortly.
            crate::heap::trim_soon();
        }
        return Ok(body);
    }
    drop(body);
    crate::heap::release_freed_heap();
    Err(WireError::new(
        berth_protocol::ErrorKind::InputTooLarge,
        format!(
            "model `{model}`: its answer was {size} bytes (JSON and bulk bytes together), over \
             the supervisor's max_response of {max_response} bytes; send fewer inputs per \
             request, or raise max_response"
        ),
    ))
}
