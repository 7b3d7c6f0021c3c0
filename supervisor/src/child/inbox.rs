//! A stream worker's inbound side, read by its reader task or by the
//! caller that spins for an answer.
//!
//! The reader task is woken by the reactor when the worker writes. On a
//! 2-vCPU VM that wake was the one thread hop a round trip paid beyond a
//! bare socket echo: the worker's write woke a runtime thread asleep in
//! `epoll_wait`, often on the other, halted vCPU, and only that thread's
//! dispatch reached the caller, who was already spinning for the answer
//! (docs/performance.md, "Workers in Python"). So a caller that spins
//! (`handle::spin`) also looks at the socket itself between its polls: one
//! non-blocking receive, and what it completes is dispatched there, to
//! whichever request it answers. While a caller spins, the socket's watch
//! is paused (`stream::Watched`), so the worker's answer wakes no runtime
//! thread at all: on a shared vCPU that wake, and the reader task's look
//! that found nothing, had cost as much as the worker's own work. The watch
//! resumes when the last spinning caller stops (with its answer, or to park
//! for it), and wakes the reader task at once if bytes wait.
//!
//! One lock keeps the two readers in order: a receive, and the dispatch of
//! every message it completes, happen under it, so pieces reach their
//! requests in the order the worker sent them. A caller only ever tries the
//! lock, and the reader task takes it for one receive (at most the read
//! buffer) at a time, so nobody waits behind a worker's large answer.

use std::sync::{Arc, Mutex, MutexGuard};

use berth_protocol::stream::Violation;

use super::handle::spin::Look;
use super::routes::Dispatch;
use super::stream::{Ended, Inbound, StreamReader, Watched};

/// The reader and where it hands what it reads, until the worker's wire
/// ends: then both are dropped, which closes the load's and the
/// heartbeat's channels as the reader's end always has.
pub(crate) struct Inbox {
    state: Mutex<Option<(StreamReader, Dispatch)>>,
    watched: Arc<Watched>,
    quiet: Mutex<Quiet>,
}

/// Callers spinning now, and whether the watch is paused for them.
#[derive(Default)]
struct Quiet {
    spinning: usize,
    paused: bool,
}

/// A caller's spin: the watch stays paused until the last is dropped, or
/// past it, until something else is sent, once the answer came whole
/// ([`Spinning::answered`]).
pub(crate) struct Spinning {
    inbox: Arc<Inbox>,
    answered: bool,
}

impl Spinning {
    /// The spin got its answer whole: nothing more comes for it, and the
    /// watch stays paused past it if no other spin is on. The next
    /// request's spin then pauses nothing (two `epoll_ctl` calls a round
    /// trip fewer); anything else sent resumes it ([`Inbox::resume_watch`]),
    /// and so does the worker's death (`Inbox::resume_watch`).
    pub(crate) fn answered(mut self) {
        self.answered = true;
    }
}

impl std::fmt::Debug for Spinning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Spinning")
    }
}

impl Drop for Spinning {
    fn drop(&mut self) {
        let mut quiet = self.inbox.quiet();
        quiet.spinning -= 1;
        if quiet.spinning == 0 && !self.answered {
            self.inbox.resume(&mut quiet);
        }
    }
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inbox")
    }
}

/// What a look at the socket came to.
enum Read {
    /// Bytes came, and every message they completed was dispatched.
    More,
    /// The socket holds nothing now.
    Empty,
    /// The wire ended (end of file, or a violation dealt with).
    Ended,
}

impl Inbox {
    pub(crate) fn new(reader: StreamReader, dispatch: Dispatch) -> Arc<Inbox> {
        Arc::new(Inbox {
            watched: Arc::clone(reader.watched()),
            state: Mutex::new(Some((reader, dispatch))),
            quiet: Mutex::default(),
        })
    }

    /// A caller is about to spin for an answer: the watch pauses until it
    /// (and any other spinning caller) stops, or until something else is
    /// sent ([`Inbox::resume_watch`]). Paused before the request goes out: a
    /// worker woken on the caller's own vCPU may run, and answer, before
    /// the caller runs again.
    pub(crate) fn spin(self: &Arc<Self>) -> Spinning {
        let mut quiet = self.quiet();
        quiet.spinning += 1;
        // Once resumed for another sender, it stays so until the spins end.
        if quiet.spinning == 1 && !quiet.paused {
            match self.watched.watch(false) {
                Ok(()) => quiet.paused = true,
                // Harmless: the reader task is woken as it would be anyway.
                Err(e) => tracing::debug!("cannot pause watching a worker's socket: {e}"),
            }
        }
        Spinning {
            inbox: Arc::clone(self),
            answered: false,
        }
    }

    /// Resumes the watch if it is paused: the reader task then hears
    /// whatever comes, the worker's end included. Called for anything sent
    /// whose answer no spinning caller waits for (a ping, a load, a request
    /// that parks, a cancel), so that the reader hands its answer over even
    /// while a spinning caller's stream goes unread, and at the worker's
    /// death.
    pub(crate) fn resume_watch(&self) {
        let mut quiet = self.quiet();
        if quiet.paused {
            self.resume(&mut quiet);
        }
    }

    fn resume(&self, quiet: &mut Quiet) {
        if !quiet.paused {
            return;
        }
        match self.watched.watch(true) {
            Ok(()) => quiet.paused = false,
            // Cannot happen short of the kernel's memory: the reader would
            // then hear nothing more, and the heartbeat ends the worker.
            Err(e) => tracing::error!("cannot resume watching a worker's socket: {e}"),
        }
    }

    fn quiet(&self) -> MutexGuard<'_, Quiet> {
        self.quiet.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lock(&self) -> MutexGuard<'_, Option<(StreamReader, Dispatch)>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The reader task: reads the worker until it is gone or breaks the
    /// wire.
    pub(crate) async fn read(self: Arc<Self>) {
        loop {
            let Ok(mut ready) = self.watched.readable().await else {
                break;
            };
            // One receive at a time, each through the reactor's budget, so
            // that a worker writing without pause does not hold a runtime
            // thread.
            match self.read_once() {
                Read::More => {}
                Read::Empty => ready.clear_ready(),
                Read::Ended => break,
            }
        }
        // Dropping the dispatch closes its channels: a load waiting for its
        // answer and a heartbeat waiting for its pong hear the end.
        self.lock().take();
    }

    fn read_once(&self) -> Read {
        let mut state = self.lock();
        let Some((reader, dispatch)) = state.as_mut() else {
            return Read::Ended;
        };
        receive_and_dispatch(reader, dispatch)
    }
}

impl Look for Inbox {
    /// A spinning caller's look: one receive, if nobody else is reading
    /// now, its messages dispatched.
    fn look(&self) {
        let Ok(mut state) = self.state.try_lock() else {
            return;
        };
        if let Some((reader, dispatch)) = state.as_mut()
            && let Read::Ended = receive_and_dispatch(reader, dispatch)
        {
            // The reader task finds the wire ended and stops once the watch
            // wakes it: at once, or when this spin ends (without a whole
            // answer: its watch resumes) or the death is seen.
            state.take();
        }
    }
}

/// What is whole already, then one receive and what it completed, each
/// message dispatched in order.
fn receive_and_dispatch(reader: &mut StreamReader, dispatch: &Dispatch) -> Read {
    if let Err(ended) = dispatch_buffered(reader, dispatch) {
        return end(dispatch, ended);
    }
    match reader.receive() {
        Ok(false) => Read::Empty,
        Ok(true) => match dispatch_buffered(reader, dispatch) {
            Ok(()) => Read::More,
            Err(ended) => end(dispatch, ended),
        },
        Err(ended) => end(dispatch, ended),
    }
}

fn dispatch_buffered(reader: &mut StreamReader, dispatch: &Dispatch) -> Result<(), Ended> {
    while let Some(message) = reader.buffered()? {
        match message {
            Inbound::Event(event) => dispatch.dispatch(event).map_err(Ended::Violation)?,
            Inbound::Hello(_) => return Err(Ended::Violation(Violation("a second hello".into()))),
        }
    }
    Ok(())
}

fn end(dispatch: &Dispatch, ended: Ended) -> Read {
    if let Ended::Violation(v) = ended {
        dispatch.violated(v);
    }
    Read::Ended
}
