//! Routing a worker's events: one blocking reader thread per worker
//! receives each event and hands it straight to whoever waits for it, by
//! request id; answers past `max_response` are refused on arrival; the
//! pending map fails every request at once when the worker dies.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use berth_protocol::{Body, Event, RequestId, WireError, WorkerStats};
use ipc_channel::ipc::IpcReceiver;
use tokio::sync::{mpsc, watch};

use super::handle::Death;

pub(super) enum Reply {
    Chunk(Body),
    /// A streamed piece refused on arrival (past `max_response`): the
    /// request is cancelled in the worker, which would otherwise go on.
    Refused(WireError),
    Done(Result<Body, WireError>),
    Died(Arc<Death>),
}

#[derive(Default)]
pub(super) struct RoutesInner {
    pub(super) pending: HashMap<RequestId, (mpsc::UnboundedSender<Reply>, u64)>,
    pub(super) death: Option<Arc<Death>>,
}

/// The pending map and, once the worker is dead, why.
#[derive(Default)]
pub(super) struct Routes(Mutex<RoutesInner>);

impl Routes {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, RoutesInner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn route(&self, id: RequestId, reply: Reply) {
        let mut inner = self.lock();
        let done = matches!(reply, Reply::Done(_));
        let tx = if done {
            inner.pending.remove(&id).map(|(tx, _)| tx)
        } else {
            inner.pending.get(&id).map(|(tx, _)| tx.clone())
        };
        drop(inner);
        if let Some(tx) = tx {
            let _ = tx.send(reply);
        }
    }

    /// Fails every pending request and refuses new ones. Idempotent.
    pub(super) fn close(&self, mut death: Death) -> Arc<Death> {
        let mut inner = self.lock();
        if let Some(first) = &inner.death {
            return Arc::clone(first);
        }
        let pending = std::mem::take(&mut inner.pending);
        death.in_flight = pending.values().map(|(_, hash)| *hash).collect();
        let death = Arc::new(death);
        inner.death = Some(Arc::clone(&death));
        drop(inner);
        for (_, (tx, _)) in pending {
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
            Reply::Done(_) => "Done",
            Reply::Died(_) => "Died",
        })
    }
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Routes")
    }
}

pub(super) fn read_events(
    model: &str,
    events: &IpcReceiver<Event>,
    routes: &Routes,
    control: &mpsc::UnboundedSender<Event>,
    pongs: &watch::Sender<Option<(u64, WorkerStats)>>,
    max_response: u64,
) {
    loop {
        match events.recv() {
            Ok(Event::Chunk { id, body }) => match bounded(model, body, max_response) {
                Ok(body) => routes.route(id, Reply::Chunk(body)),
                Err(e) => routes.route(id, Reply::Refused(e)),
            },
            Ok(Event::Done { id, result }) => {
                let result = result.and_then(|body| bounded(model, body, max_response));
                routes.route(id, Reply::Done(result))
            }
            Ok(Event::Pong { seq, stats }) => {
                let _ = pongs.send(Some((seq, stats)));
            }
            Ok(event) => {
                let _ = control.send(event);
            }
            Err(ipc_channel::IpcError::Disconnected) => return,
            Err(e) => {
                tracing::error!(model, "cannot decode an event from the worker: {e}");
                return;
            }
        }
    }
}

/// A body the worker sent: a large one asks for a heap trim once it is
/// through (whatever front door passes it on); one past
/// `max_response` bytes inside the message: the supervisor would otherwise
/// parse and copy it several times over on its way to the client. Bulk bytes
/// in shared memory are the worker's mapping, not the supervisor's heap, and
/// do not count.
fn bounded(model: &str, body: Body, max_response: u64) -> std::result::Result<Body, WireError> {
    let inline = match &body.bulk {
        berth_protocol::Bulk::Inline(bytes) => bytes.len(),
        _ => 0,
    };
    let size = (body.json.len() + inline) as u64;
    if size <= max_response {
        if size >= crate::heap::LARGE {
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
            "model `{model}`: its answer was {size} bytes, over the supervisor's max_response \
             of {max_response} bytes; send fewer inputs per request, or raise max_response"
        ),
    ))
}
