//! Routing a worker's events: the reader (a blocking thread on
//! `ipc-channel`, a task on the stream wire) hands each event straight to
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
use super::stream::{Ended, Inbound, StreamReader};
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

/// A request waiting for its answer.
pub(super) struct Waiting {
    pub(super) tx: mpsc::UnboundedSender<Reply>,
    /// What identifies it for quarantine.
    pub(super) hash: u64,
    /// Bytes of chunks routed to it and not yet read by its caller: a
    /// worker streaming faster than a client reads is refused past
    /// `max_response`, rather than queued without bound.
    pub(super) unread: Arc<AtomicU64>,
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
    /// The most unread chunk bytes one request may have queued.
    max_unread: u64,
    /// The next request id; every id below it was sent.
    next_id: AtomicU64,
    /// A `Load` was sent and its answer has not come.
    load_asked: AtomicBool,
}

impl Routes {
    pub(super) fn new(max_unread: u64) -> Self {
        Routes {
            inner: Mutex::default(),
            max_unread,
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

    pub(super) fn route(&self, id: RequestId, mut reply: Reply) -> Result<(), Violation> {
        let mut inner = self.lock();
        let done = matches!(reply, Reply::Done(..));
        let tx = if done {
            inner.pending.remove(&id).map(|w| w.tx)
        } else {
            inner.pending.get(&id).map(|w| {
                if let Reply::Chunk(body) = &reply {
                    let size = held_bytes(body);
                    let unread = w.unread.fetch_add(size, Ordering::SeqCst) + size;
                    if unread > self.max_unread {
                        w.unread.fetch_sub(size, Ordering::SeqCst);
                        reply = Reply::Refused(WireError::new(
                            berth_protocol::ErrorKind::InputTooLarge,
                            format!(
                                "request {id}: the worker streamed {unread} bytes its caller \
                                 has not read yet, over max_response ({} bytes); read the \
                                 stream as it comes, or raise max_response",
                                self.max_unread
                            ),
                        ));
                    }
                }
                w.tx.clone()
            })
        };
        if let Some(tx) = tx {
            drop(inner);
            let _ = tx.send(reply);
            return Ok(());
        }
        let what = if done { "done" } else { "chunk" };
        if inner.death.is_some()
            || (done && inner.cancelled.remove(&id))
            || (!done && inner.cancelled.contains(&id))
        {
            return Ok(());
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
    pub(super) control: mpsc::UnboundedSender<Event>,
    pub(super) pongs: watch::Sender<Option<(u64, WorkerStats)>>,
    pub(super) max_response: u64,
    pub(super) process: Arc<ProcessWatch>,
}

impl Dispatch {
    fn dispatch(&self, event: Event) -> Result<(), Violation> {
        let model = self.model.as_str();
        match event {
            Event::Chunk { id, body } => match bounded(model, body, self.max_response) {
                Ok(body) => self.routes.route(id, Reply::Chunk(body)),
                Err(e) => self.routes.route(id, Reply::Refused(e)),
            },
            Event::Done { id, result, run } => {
                let result = result.and_then(|body| bounded(model, body, self.max_response));
                self.routes.route(id, Reply::Done(result, run))
            }
            Event::Pong { seq, stats } => {
                let _ = self.pongs.send(Some((seq, stats)));
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

    fn violated(&self, violation: Violation) {
        tracing::error!(model = %self.model, "the worker broke the wire: it sent {violation}");
        self.process
            .kill_for(KillCause::ProtocolViolation { sent: violation.0 });
    }

    /// Reads a stream worker until it is gone or breaks the wire.
    pub(super) async fn read_stream(&self, mut reader: StreamReader) {
        loop {
            match reader.next().await {
                Ok(Inbound::Event(event)) => {
                    if let Err(v) = self.dispatch(event) {
                        return self.violated(v);
                    }
                }
                Ok(Inbound::Hello(_)) => return self.violated(Violation("a second hello".into())),
                Err(Ended::Closed) => return,
                Err(Ended::Violation(v)) => return self.violated(v),
            }
        }
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
    pub(super) fn read_ipc(&self, events: &ipc_channel::ipc::IpcReceiver<Event>) {
        loop {
            match events.recv() {
                Ok(event) => {
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
