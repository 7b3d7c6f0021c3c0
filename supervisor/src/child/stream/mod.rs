//! The supervisor's end of the stream wire (`docs/wire.md`): a worker in
//! any language on one end of a socket pair.
//!
//! One registration with tokio's reactor serves both directions: the reader
//! ([`StreamReader`]) decodes frames as they arrive, the writer is a task
//! draining a queue, so a worker that stops reading never blocks a caller
//! (its frames wait in the queue, which admission bounds). Neither is a
//! thread of its own.

pub(crate) mod io;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use berth_protocol::stream::{
    self as wire, BulkRef, FrameDecoder, MEMFD_THRESHOLD, StreamHello, Violation, WorkerMessage,
};
use berth_protocol::{Body, Bulk, Command, Event, LoadInfo};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

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
    socket: Arc<AsyncFd<OwnedFd>>,
    decoder: FrameDecoder<OwnedFd>,
    buf: Vec<u8>,
}

impl std::fmt::Debug for StreamReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StreamReader")
    }
}

/// A frame waiting to be written, with the memfd that rides on it.
struct OutFrame {
    bytes: Vec<u8>,
    memfd: Option<OwnedFd>,
}

/// The writing half: a queue drained by a task.
#[derive(Debug, Clone)]
pub(crate) struct StreamWriter {
    queue: mpsc::UnboundedSender<OutFrame>,
}

impl std::fmt::Debug for OutFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OutFrame({} bytes)", self.bytes.len())
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
    // SAFETY: an `OwnedFd` is a valid open descriptor that stays open, and
    // its `as_raw_fd` always names it, until the `AsyncFd` drops it.
    let socket = Arc::new(unsafe { AsyncFd::register(ours) }.map_err(|e| e.into_parts().1)?);
    let (queue, rx) = mpsc::unbounded_channel();
    tokio::spawn(write_frames(Arc::clone(&socket), rx));
    Ok((
        StreamReader {
            socket,
            decoder: FrameDecoder::new(),
            buf: vec![0; 64 << 10],
        },
        StreamWriter { queue },
    ))
}

async fn write_frames(socket: Arc<AsyncFd<OwnedFd>>, mut rx: mpsc::UnboundedReceiver<OutFrame>) {
    while let Some(frame) = rx.recv().await {
        if let Err(e) = write_frame(&socket, frame).await {
            // The worker is gone (EPIPE) or its socket broke; its death, or
            // the reader's end of file, is what the requests hear.
            tracing::debug!("stream writer stopped: {e}");
            return;
        }
    }
}

async fn write_frame(socket: &AsyncFd<OwnedFd>, frame: OutFrame) -> std::io::Result<()> {
    let mut sent = 0;
    let mut memfd = frame.memfd;
    while sent < frame.bytes.len() {
        let mut guard = socket.writable().await?;
        let rest = &frame.bytes[sent..];
        let fd = memfd.as_ref().map(AsRawFd::as_raw_fd);
        match guard.try_io(|s| io::send(s.as_raw_fd(), rest, fd.as_slice())) {
            Ok(Ok(n)) => {
                sent += n;
                // It rode on the first byte; the kernel holds its own copy.
                memfd = None;
            }
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
    Ok(())
}

impl StreamWriter {
    fn push(&self, bytes: Vec<u8>, memfd: Option<OwnedFd>) -> Result<(), SendError> {
        self.queue
            .send(OutFrame { bytes, memfd })
            .map_err(|_| SendError::Closed)
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
            if let Some(frame) = self.decoder.next_frame().map_err(Ended::Violation)? {
                return inbound(frame).map_err(Ended::Violation);
            }
            let mut guard = self.socket.readable().await.map_err(|_| Ended::Closed)?;
            let buf = &mut self.buf;
            match guard.try_io(|s| io::receive(s.as_raw_fd(), buf)) {
                Ok(Ok(got)) if got.bytes == 0 => return Err(Ended::Closed),
                Ok(Ok(got)) => {
                    if got.truncated {
                        return Err(Ended::Violation(Violation(
                            "more descriptors in one message than the wire allows".into(),
                        )));
                    }
                    self.decoder
                        .push(&self.buf[..got.bytes], got.fds)
                        .map_err(Ended::Violation)?;
                }
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Ok(Err(_)) => return Err(Ended::Closed),
                Err(_would_block) => continue,
            }
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
