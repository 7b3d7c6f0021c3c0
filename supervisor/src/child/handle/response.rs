//! The answer to one request as its caller reads it, piece by piece: the
//! request's bookkeeping (in flight, unread chunk bytes) ends with its last
//! piece, and dropping it before then cancels it in the worker.

use std::sync::Arc;
use std::time::Instant;

use berth_protocol::{Body, Command, RequestId};
use tokio::sync::mpsc;

use super::in_flight::InFlight;
use super::spin::{AnswerTime, spin_recv};
use crate::child::inbox::{Inbox, Spinning};
use crate::child::link::Link;
use crate::child::routes::{Backlog, Reply, Routes, piece_bytes};
use crate::error::{Error, Result};

/// One piece of a streamed answer.
#[derive(Debug)]
pub enum Piece {
    Chunk(Body),
    /// The final body; the stream ends after it.
    Done(Body),
}

/// The answer to one request, piece by piece.
#[derive(Debug)]
pub struct ResponseStream {
    pub(super) id: RequestId,
    pub(super) rx: mpsc::UnboundedReceiver<Reply>,
    pub(super) finished: bool,
    pub(super) model: String,
    pub(super) pid: u32,
    pub(super) routes: Arc<Routes>,
    pub(super) commands: Link,
    pub(super) in_flight: Arc<InFlight>,
    /// Chunk bytes routed here and not yet read (see `routes::Waiting`).
    pub(super) unread: Arc<Backlog>,
    /// How the worker ran it, once it is done.
    pub(super) run: Option<berth_protocol::RunInfo>,
    /// When it was sent, and how long the worker's last answer took.
    pub(super) sent_at: Instant,
    pub(super) answer_time: Arc<AnswerTime>,
    /// A stream worker's inbound side, looked at while the caller spins.
    pub(super) inbox: Option<Arc<Inbox>>,
    /// Its socket's watch, paused before the request went out for a spin
    /// for its first piece (see `Inbox::spin`).
    pub(super) spinning: Option<Spinning>,
    /// Whether a piece has been waited for already.
    pub(super) pieces: bool,
}

impl ResponseStream {
    /// The next piece; `None` after the final one.
    pub async fn next(&mut self) -> Option<Result<Piece>> {
        if self.finished {
            return None;
        }
        // Alone on a worker that answers within microseconds: spin briefly
        // for the first piece rather than park (see `spin`). A stream of
        // pieces is not such an answer: later pieces are waited for parked.
        let reply = match self.answer_time.spin() {
            Some(spin) if !self.pieces && self.in_flight.count() == 1 => {
                let reply = spin_recv(
                    &mut self.rx,
                    spin,
                    self.inbox.as_deref(),
                    &mut self.spinning,
                )
                .await;
                if let Some(spinning) = self.spinning.take()
                    && let Some(Reply::Done(..)) = reply
                {
                    // Nothing more comes for it: the watch may stay paused
                    // for the next request's spin (see `Inbox::spin`).
                    spinning.answered();
                }
                reply
            }
            _ => {
                // Resumes the socket's watch: the reader task hands over
                // the answer now.
                self.spinning = None;
                self.rx.recv().await
            }
        };
        self.pieces = true;
        match reply {
            Some(Reply::Chunk(body)) => {
                self.unread.read(piece_bytes(&body));
                Some(Ok(Piece::Chunk(body)))
            }
            Some(Reply::Refused(source)) => {
                self.cancel();
                Some(Err(Error::Request {
                    model: self.model.clone(),
                    source,
                }))
            }
            Some(Reply::Done(result, run)) => {
                if result.is_ok() {
                    self.answer_time.record(self.sent_at.elapsed());
                }
                self.run = Some(run);
                self.finish();
                Some(result.map(Piece::Done).map_err(|source| Error::Request {
                    model: self.model.clone(),
                    source,
                }))
            }
            Some(Reply::Died(death)) => {
                self.finish();
                Some(Err(death.error(&self.model, self.pid, "request")))
            }
            None => {
                self.finish();
                None
            }
        }
    }

    /// How the worker ran the request (its batch, its compute time), once
    /// its answer has come.
    pub fn run(&self) -> Option<berth_protocol::RunInfo> {
        self.run
    }

    fn finish(&mut self) {
        if !self.finished {
            self.finished = true;
            self.in_flight.leave();
        }
    }
}

impl ResponseStream {
    /// Stops waiting and tells the worker to stop working on the request.
    pub fn cancel(&mut self) {
        if !self.finished {
            self.routes.give_up(self.id);
            if let Some(inbox) = &self.inbox {
                inbox.resume_watch();
            }
            let _ = self.commands.send(Command::Cancel { id: self.id });
            self.finish();
        }
    }

    /// Ends a request that never reached the worker.
    pub(super) fn forget(&mut self) {
        if !self.finished {
            self.routes.lock().pending.remove(&self.id);
            self.finish();
        }
    }
}

impl Drop for ResponseStream {
    /// Abandoned mid-way (a client went away): cancel it in the worker.
    fn drop(&mut self) {
        self.cancel();
    }
}
