//! The supervisor's end of the stream wire (`docs/wire.md`): a worker in
//! any language on one end of a socket pair.
//!
//! The reader ([`StreamReader`]) decodes frames as they arrive. The reactor
//! watches the socket for reading only, and through an epoll instance of
//! its own ([`Watched`]), which a caller spinning for an answer pauses
//! while it reads the socket itself (`child::inbox`). A frame to send is
//! written by the caller's own thread, at once and without blocking, when
//! nothing waits before it (the common case: one `sendmsg`, no thread
//! woken); whatever the socket does not take at once waits in a queue that
//! a task drains as the socket drains, so a worker that stops reading
//! never blocks a caller (its frames wait in the queue, which admission
//! bounds); only while frames wait there is the socket watched for
//! writing, or every request the worker reads would wake a runtime thread.
//! Handing every frame to the writer task instead cost a thread wake-up per
//! request, and on a 2-vCPU host that wake could land behind the caller's
//! own answer spin (docs/performance.md, "From an idle machine").

pub(crate) mod io;

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use berth_protocol::stream::{
    self as wire, BulkRef, FrameDecoder, MEMFD_THRESHOLD, StreamHello, Violation, WorkerMessage,
};
use berth_protocol::{Body, Bulk, Command, Event, LoadInfo};
use tokio::io::Interest;
use tokio::io::unix::{AsyncFd, AsyncFdReadyGuard};
use tokio::sync::Notify;

/// What a stream worker sends, checked.
#[derive(Debug)]
pub(crate) enum Inbound {
    Hello(StreamHello),
    Event(Event),
}

/// How a read from a worker ended without a message.
#[derive(Debug)]
pub(crate) enum Ended {
    /// End of file, or the connection broke: the worker is gone.
    Closed,
    /// It broke the wire: what it sent.
    Violation(Violation),
}

/// The reading half: frames in, checked messages out.
pub(crate) struct StreamReader {
    watched: Arc<Watched>,
    decoder: FrameDecoder<OwnedFd>,
    buf: Vec<u8>,
}

/// The supervisor's end as the reactor sees it: watched for reading
/// through an epoll instance of its own (`io::socket_watch`) rather than
/// registered itself, so that the watch can be paused: a caller spinning
/// for an answer reads the socket itself, and the reader task's wake-up,
/// which costs a runtime thread's wake on every answer, is then of no use
/// (see `child::inbox`).
pub(crate) struct Watched {
    socket: Arc<OwnedFd>,
    watch: AsyncFd<OwnedFd>,
}

impl Watched {
    /// Waits until the watch says the socket holds bytes or its end.
    pub(crate) async fn readable(&self) -> std::io::Result<AsyncFdReadyGuard<'_, OwnedFd>> {
        self.watch.readable().await
    }

    /// Resumes (`true`) or pauses the watch. Resumed with bytes waiting,
    /// it wakes the reader at once.
    pub(crate) fn watch(&self, on: bool) -> std::io::Result<()> {
        io::watch_socket(self.watch.get_ref(), self.socket.as_raw_fd(), on)
    }
}

impl std::fmt::Debug for StreamReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamReader")
    }
}

/// A frame not yet wholly written: its bytes from `sent` on, and the memfd
/// that rides on its first byte (gone once that byte is sent).
struct OutFrame {
    bytes: Vec<u8>,
    sent: usize,
    memfd: Option<OwnedFd>,
}

impl std::fmt::Debug for OutFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "OutFrame({} of {} bytes sent)",
            self.sent,
            self.bytes.len()
        )
    }
}

/// What the senders and the writer task share.
#[derive(Debug)]
struct Outbox {
    socket: Arc<OwnedFd>,
    state: Mutex<OutState>,
    /// Wakes the writer task: a frame was queued, or the senders are gone.
    queued: Notify,
}

#[derive(Debug, Default)]
struct OutState {
    /// Frames waiting for the socket, in order; the first may be partly sent.
    queue: VecDeque<OutFrame>,
    /// The writer task holds a frame it took from the queue: later frames
    /// must queue behind it.
    writing: bool,
    /// A write failed (the worker is gone): nothing more is sent.
    broken: bool,
    /// Every sender is gone: the writer task ends once the queue is empty.
    senders_gone: bool,
}

impl Outbox {
    fn state(&self) -> MutexGuard<'_, OutState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The writing half. Cloned freely; the writer task ends when the last
/// clone is dropped and what was queued has been written.
#[derive(Debug, Clone)]
pub(crate) struct StreamWriter {
    senders: Arc<Senders>,
}

/// Dropped with the last [`StreamWriter`]: tells the writer task.
#[derive(Debug)]
struct Senders(Arc<Outbox>);

impl Drop for Senders {
    fn drop(&mut self) {
        self.0.state().senders_gone = true;
        self.0.queued.notify_one();
    }
}

/// Why a command could not be sent.
#[derive(Debug)]
pub(crate) enum SendError {
    /// The worker's end is gone.
    Closed,
    /// The command cannot travel on this wire (a body that is not JSON, too
    /// large a body, a memfd that cannot be made): the request fails alone.
    Refused(String),
}

/// Registers the supervisor's end with the reactor and starts its writer.
pub(crate) fn connect(ours: OwnedFd) -> std::io::Result<(StreamReader, StreamWriter)> {
    let socket = Arc::new(ours);
    // Watched for reading only: watched for writing too, every read of a
    // request by the worker (which frees room in this end's send buffer)
    // would wake a runtime thread. The writer task registers a duplicate
    // for writing while frames wait (`write_queued`).
    let watch = io::socket_watch(socket.as_raw_fd())?;
    // SAFETY: an `OwnedFd` is a valid open descriptor that stays open, and
    // its `as_raw_fd` always names it, until the `AsyncFd` drops it.
    let watch = unsafe { AsyncFd::register_with_interest(watch, Interest::READABLE) }
        .map_err(|e| e.into_parts().1)?;
    let outbox = Arc::new(Outbox {
        socket: Arc::clone(&socket),
        state: Mutex::new(OutState::default()),
        queued: Notify::new(),
    });
    tokio::spawn(write_queued(Arc::clone(&outbox)));
    Ok((
        StreamReader {
            watched: Arc::new(Watched { socket, watch }),
            decoder: FrameDecoder::new(),
            buf: vec![0; 64 << 10],
        },
        StreamWriter {
            senders: Arc::new(Senders(outbox)),
        },
    ))
}

/// One non-blocking `sendmsg` of what is left of `frame`; `WouldBlock`
/// when the socket takes nothing now.
fn send_rest(sock: std::os::fd::RawFd, frame: &mut OutFrame) -> std::io::Result<()> {
    let fd = frame.memfd.as_ref().map(AsRawFd::as_raw_fd);
    let n = io::send(sock, &frame.bytes[frame.sent..], fd.as_slice())?;
    frame.sent += n;
    // It rode on the first byte; the kernel holds its own copy.
    frame.memfd = None;
    Ok(())
}

/// [`send_rest`] for a sender: `Ok(true)` once all of `frame` is sent,
/// `Ok(false)` when the socket took only part of it, or none.
fn write_some(socket: &OwnedFd, frame: &mut OutFrame) -> std::io::Result<bool> {
    match send_rest(socket.as_raw_fd(), frame) {
        Ok(()) => Ok(frame.sent == frame.bytes.len()),
        Err(e)
            if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::Interrupted =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Marks the outbox broken when the writer task ends, whichever way (a
/// failed write, the senders gone, or the task dropped with the runtime
/// mid-frame): a sender must then hear `Closed`, not queue for nobody.
struct WriterGone(Arc<Outbox>);

impl Drop for WriterGone {
    fn drop(&mut self) {
        let mut state = self.0.state();
        state.broken = true;
        state.writing = false;
        state.queue.clear();
    }
}

/// The writer task: writes the queued frames in order as the socket takes
/// them. It waits for room through a duplicate of the socket registered
/// for writing, made when a frame must wait and dropped once the queue is
/// empty, so that an idle or keeping-up wire never wakes it.
async fn write_queued(outbox: Arc<Outbox>) {
    let _gone = WriterGone(Arc::clone(&outbox));
    let mut writable: Option<AsyncFd<OwnedFd>> = None;
    loop {
        let next = {
            let mut state = outbox.state();
            match state.queue.pop_front() {
                Some(frame) => {
                    state.writing = true;
                    Some(frame)
                }
                None => {
                    state.writing = false;
                    if state.senders_gone || state.broken {
                        return;
                    }
                    None
                }
            }
        };
        let Some(mut frame) = next else {
            writable = None;
            outbox.queued.notified().await;
            continue;
        };
        if let Err(e) = write_frame(&outbox.socket, &mut writable, &mut frame).await {
            // The worker is gone (EPIPE) or its socket broke; its death, or
            // the reader's end of file, is what the requests hear.
            tracing::debug!("stream writer stopped: {e}");
            return;
        }
    }
}

async fn write_frame(
    socket: &OwnedFd,
    writable: &mut Option<AsyncFd<OwnedFd>>,
    frame: &mut OutFrame,
) -> std::io::Result<()> {
    while frame.sent < frame.bytes.len() {
        if write_some(socket, frame)? {
            return Ok(());
        }
        let waiter = match writable {
            Some(waiter) => waiter,
            None => match watch_writable(socket) {
                Ok(waiter) => writable.insert(waiter),
                Err(e) => {
                    // Out of descriptors, say: the worker is not gone, so
                    // its frames wait on a timer rather than be dropped.
                    tracing::warn!("cannot watch a worker's socket for room ({e}); polling");
                    tokio::time::sleep(std::time::Duration::from_millis(1)).await;
                    continue;
                }
            },
        };
        // Readiness is only a hint: the write above says whether room came.
        let mut guard = waiter.writable().await?;
        guard.clear_ready();
    }
    Ok(())
}

/// A duplicate of the socket, registered with the reactor for writing.
fn watch_writable(socket: &OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
    let dup = socket.try_clone()?;
    // SAFETY: as in `connect`: the duplicate is ours and open until the
    // `AsyncFd` drops it.
    unsafe { AsyncFd::register_with_interest(dup, Interest::WRITABLE) }
        .map_err(|e| e.into_parts().1)
}

impl StreamWriter {
    /// Writes the frame now if nothing waits before it and the socket takes
    /// it; queues what is left for the writer task otherwise.
    fn push(&self, bytes: Vec<u8>, memfd: Option<OwnedFd>) -> Result<(), SendError> {
        let outbox = &self.senders.0;
        let mut frame = OutFrame {
            bytes,
            sent: 0,
            memfd,
        };
        let mut state = outbox.state();
        if state.broken {
            return Err(SendError::Closed);
        }
        if state.queue.is_empty() && !state.writing {
            match write_some(&outbox.socket, &mut frame) {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!("stream writer stopped: {e}");
                    state.broken = true;
                    drop(state);
                    // The writer task ends rather than wait for frames.
                    outbox.queued.notify_one();
                    return Err(SendError::Closed);
                }
            }
        }
        state.queue.push_back(frame);
        drop(state);
        outbox.queued.notify_one();
        Ok(())
    }

    /// Sends a bare header (`welcome`, `refused`).
    pub(crate) fn send_header(&self, header: &[u8]) -> Result<(), SendError> {
        self.push(wire::frame(header, &[]), None)
    }

    /// Sends a command as its stream-wire message.
    pub(crate) fn send(&self, command: &Command) -> Result<(), SendError> {
        match command {
            Command::Load(spec) => self.send_header(&wire::load(
                &spec.name,
                &spec.backend,
                spec.model.as_deref(),
                &spec.options,
            )),
            Command::Request { id, body } => self.send_request(*id, body),
            Command::Cancel { id } => self.send_header(&wire::cancel(*id)),
            Command::Ping { seq } => self.send_header(&wire::ping(*seq)),
            Command::Shutdown => self.send_header(&wire::shutdown()),
        }
    }

    fn send_request(&self, id: u64, body: &Body) -> Result<(), SendError> {
        let bulk = body.bulk_bytes();
        let (bulk_ref, payload, memfd) = if bulk.is_empty() {
            (None, &[][..], None)
        } else if bulk.len() < MEMFD_THRESHOLD {
            (Some(BulkRef::Inline(bulk.len() as u64)), bulk, None)
        } else {
            let fd = io::sealed_memfd(bulk).map_err(|e| {
                SendError::Refused(format!("cannot put its bulk bytes in a memfd ({e})"))
            })?;
            (Some(BulkRef::Memfd(bulk.len() as u64)), &[][..], Some(fd))
        };
        let header = wire::request(id, &body.json, bulk_ref).map_err(SendError::Refused)?;
        if 4 + header.len() + payload.len() > wire::MAX_FRAME as usize {
            return Err(SendError::Refused(format!(
                "its JSON is {} bytes; the stream wire carries at most {} MiB of JSON per \
                 message (put large data in the bulk part)",
                body.json.len(),
                wire::MAX_FRAME >> 20
            )));
        }
        self.push(wire::frame(&header, payload), memfd)
    }
}

impl StreamReader {
    /// The next message; `Err(Ended::Closed)` at end of file.
    pub(crate) async fn next(&mut self) -> Result<Inbound, Ended> {
        loop {
            if let Some(message) = self.buffered()? {
                return Ok(message);
            }
            let watched = Arc::clone(&self.watched);
            let mut guard = watched.readable().await.map_err(|_| Ended::Closed)?;
            if !self.receive()? {
                guard.clear_ready();
            }
        }
    }

    /// The socket's watch, for a reader that waits for it itself (see
    /// `child::inbox`).
    pub(crate) fn watched(&self) -> &Arc<Watched> {
        &self.watched
    }

    /// The next message, if one is whole in what was received already.
    pub(crate) fn buffered(&mut self) -> Result<Option<Inbound>, Ended> {
        match self.decoder.next_frame().map_err(Ended::Violation)? {
            Some(frame) => inbound(frame).map(Some).map_err(Ended::Violation),
            None => Ok(None),
        }
    }

    /// One non-blocking receive: `Ok(true)` when bytes (or descriptors)
    /// came, `Ok(false)` when the socket holds none now; `Err(Ended::Closed)`
    /// at end of file.
    pub(crate) fn receive(&mut self) -> Result<bool, Ended> {
        loop {
            return match io::receive(self.watched.socket.as_raw_fd(), &mut self.buf) {
                Ok(got) if got.bytes == 0 => Err(Ended::Closed),
                Ok(got) => {
                    if got.truncated {
                        return Err(Ended::Violation(Violation(
                            "more descriptors in one message than the wire allows".into(),
                        )));
                    }
                    self.decoder
                        .push(&self.buf[..got.bytes], got.fds)
                        .map_err(Ended::Violation)?;
                    Ok(true)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(false),
                Err(_) => Err(Ended::Closed),
            };
        }
    }
}

/// A checked frame as the supervisor's event, its bulk bytes taken from the
/// payload or mapped from the memfd.
fn inbound(frame: wire::Frame<OwnedFd>) -> Result<Inbound, Violation> {
    let wire::Frame {
        header,
        payload,
        mut fd,
    } = frame;
    let mut payload = Some(payload);
    let mut bulk = |r: Option<BulkRef>| -> Result<Bulk, Violation> {
        Ok(match r {
            None => Bulk::None,
            Some(BulkRef::Inline(_)) => Bulk::Inline(payload.take().unwrap_or_default()),
            Some(BulkRef::Memfd(n)) => match fd.take() {
                Some(fd) => Bulk::Mapped(io::map_memfd(fd, n)?),
                None => return Err(Violation("a memfd without its descriptor".into())),
            },
        })
    };
    Ok(match WorkerMessage::from_header(header)? {
        WorkerMessage::Hello(hello) => Inbound::Hello(hello),
        WorkerMessage::Loaded {
            details,
            load_micros,
            max_batch,
        } => Inbound::Event(Event::Loaded(LoadInfo {
            details,
            load_micros,
            max_batch,
        })),
        WorkerMessage::LoadFailed(e) => Inbound::Event(Event::LoadFailed(e)),
        WorkerMessage::Chunk { id, json, bulk: b } => Inbound::Event(Event::Chunk {
            id,
            body: Body {
                json,
                bulk: bulk(b)?,
            },
        }),
        WorkerMessage::Done { id, result, run } => Inbound::Event(Event::Done {
            id,
            run,
            result: match result {
                Ok((json, b)) => Ok(Body {
                    json,
                    bulk: bulk(b)?,
                }),
                Err(e) => Err(e),
            },
        }),
        WorkerMessage::Pong { seq, stats } => Inbound::Event(Event::Pong { seq, stats }),
    })
}
