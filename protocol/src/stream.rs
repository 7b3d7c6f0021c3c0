//! The stream wire (`docs/wire.md`): the language-neutral second transport
//! for workers not built on `berth-worker`. Length-prefixed frames with a
//! JSON header over a `socketpair`, bulk bytes in sealed memfds.
//!
//! This module is pure: it turns bytes (and the descriptors that came with
//! them) into checked messages and messages into bytes. The syscalls
//! (`recvmsg`, `sendmsg`, `memfd_create`, `mmap`) are the supervisor's. Every
//! way a worker can break the wire is a [`Violation`] naming what it sent;
//! nothing here panics on any input, and the decoder never holds more than
//! one frame (at most [`MAX_FRAME`] bytes) plus one read.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::{ErrorKind, RequestId, WireError, WorkerStats};

/// The stream wire versions this crate speaks (a worker lists its own in its hello).
pub const STREAM_VERSIONS: &[u32] = &[1];
/// Environment variable naming the worker's end of the socket.
pub const ENV_FD: &str = "BERTH_FD";
/// The descriptor the worker's end is placed at.
pub const WORKER_FD: i32 = 3;
/// The largest value of a frame's length field.
pub const MAX_FRAME: u32 = 64 << 20;
/// The smallest: a header length field and `{}`.
pub const MIN_FRAME: u32 = 6;
/// Bulk bytes of this many or more travel in a memfd.
pub const MEMFD_THRESHOLD: usize = 64 << 10;
/// Descriptors a decoder holds before the frames that claim them arrive.
const MAX_QUEUED_FDS: usize = 8;

/// How a worker broke the wire: what it sent, in words.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Violation(pub String);

fn violation(what: impl Into<String>) -> Violation {
    Violation(what.into())
}

/// Where a body's bulk bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum BulkRef {
    /// The frame's payload.
    Inline(u64),
    /// A sealed memfd passed with the frame.
    Memfd(u64),
}

/// A frame's header: every member the wire names, all optional; which a
/// type needs is checked by [`WorkerMessage::from_header`]. Unknown members
/// are ignored.
#[derive(Debug, Default, Deserialize)]
pub struct Header {
    #[serde(rename = "type")]
    pub kind: String,
    pub versions: Option<Vec<u32>>,
    pub pid: Option<u32>,
    pub worker_version: Option<String>,
    pub backends: Option<Vec<String>>,
    pub runtime: Option<String>,
    pub library: Option<String>,
    pub details: Option<Box<RawValue>>,
    pub load_micros: Option<u64>,
    pub max_batch: Option<u32>,
    pub batch: Option<u32>,
    pub compute_us: Option<u64>,
    pub error: Option<ErrorJson>,
    pub id: Option<RequestId>,
    pub body: Option<Box<RawValue>>,
    pub bulk: Option<BulkRef>,
    pub seq: Option<u64>,
    pub stats: Option<StatsJson>,
}

/// An error as the stream wire writes it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ErrorJson {
    pub kind: String,
    pub message: String,
}

/// A pong's figures as the stream wire writes them (all required).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct StatsJson {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    pub progress: u64,
    pub requests_done: u64,
    pub in_flight: u32,
}

impl From<StatsJson> for WorkerStats {
    fn from(s: StatsJson) -> Self {
        WorkerStats {
            rss_bytes: s.rss_bytes,
            peak_rss_bytes: s.peak_rss_bytes,
            progress: s.progress,
            requests_done: s.requests_done,
            in_flight: s.in_flight,
        }
    }
}

/// One decoded frame: its header, its payload, the descriptor that came with it.
#[derive(Debug)]
pub struct Frame<F> {
    pub header: Header,
    pub payload: Vec<u8>,
    pub fd: Option<F>,
}

/// Bytes and descriptors in, checked frames out.
///
/// `F` is the descriptor type (an `OwnedFd` in the supervisor, anything in
/// tests). A descriptor belongs to the frame whose first byte arrived in the
/// same read; one that no frame claims is a violation.
#[derive(Debug)]
pub struct FrameDecoder<F> {
    buf: Vec<u8>,
    /// Stream offset of `buf[0]`.
    base: u64,
    /// Descriptors with the stream range of the read that brought them.
    fds: VecDeque<(F, u64, u64)>,
}

impl<F> Default for FrameDecoder<F> {
    fn default() -> Self {
        FrameDecoder {
            buf: Vec::new(),
            base: 0,
            fds: VecDeque::new(),
        }
    }
}

impl<F> FrameDecoder<F> {
    pub fn new() -> Self {
        Self::default()
    }

    /// What one read returned: its bytes and the descriptors that came with them.
    pub fn push(&mut self, bytes: &[u8], fds: Vec<F>) -> Result<(), Violation> {
        let start = self.base + self.buf.len() as u64;
        self.buf.extend_from_slice(bytes);
        let end = self.base + self.buf.len() as u64;
        for fd in fds {
            self.fds.push_back((fd, start, end));
        }
        if self.fds.len() > MAX_QUEUED_FDS {
            return Err(violation(format!(
                "{} descriptors that no frame declared",
                self.fds.len()
            )));
        }
        Ok(())
    }

    /// Bytes received but not yet part of a whole frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame, if one is in; a violation if the bytes cannot
    /// be one.
    pub fn next_frame(&mut self) -> Result<Option<Frame<F>>, Violation> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let length = u32::from_le_bytes(self.buf[0..4].try_into().expect("4 bytes"));
        if !(MIN_FRAME..=MAX_FRAME).contains(&length) {
            return Err(violation(format!(
                "a frame length of {length} bytes (the wire allows {MIN_FRAME} to {MAX_FRAME})"
            )));
        }
        let total = 4 + length as usize;
        if self.buf.len() < total {
            return Ok(None);
        }
        let header_len = u32::from_le_bytes(self.buf[4..8].try_into().expect("4 bytes")) as usize;
        if header_len < 2 || header_len > length as usize - 4 {
            return Err(violation(format!(
                "a header length of {header_len} bytes in a frame of {length}"
            )));
        }
        let header: Header = parse_header(&self.buf[8..8 + header_len])?;
        let payload = self.buf[8 + header_len..total].to_vec();
        let frame_start = self.base;
        let frame_end = self.base + total as u64;
        self.buf.drain(..total);
        self.base = frame_end;

        match header.bulk {
            Some(BulkRef::Inline(n)) if n != payload.len() as u64 => {
                return Err(violation(format!(
                    "a `{}` declaring {n} inline bulk bytes with a payload of {}",
                    header.kind,
                    payload.len()
                )));
            }
            Some(BulkRef::Inline(_)) => {}
            _ if !payload.is_empty() => {
                return Err(violation(format!(
                    "a `{}` with {} payload bytes its header does not declare",
                    header.kind,
                    payload.len()
                )));
            }
            _ => {}
        }
        let fd = match header.bulk {
            Some(BulkRef::Memfd(_)) => match self.fds.pop_front() {
                Some((fd, start, end)) if start <= frame_start && frame_start < end => Some(fd),
                _ => {
                    return Err(violation(format!(
                        "a `{}` declaring a memfd without a descriptor sent with it",
                        header.kind
                    )));
                }
            },
            _ => None,
        };
        if self
            .fds
            .front()
            .is_some_and(|(_, _, end)| *end <= frame_end)
        {
            return Err(violation(format!(
                "a descriptor with a `{}`, which declares none",
                header.kind
            )));
        }
        Ok(Some(Frame {
            header,
            payload,
            fd,
        }))
    }
}

fn parse_header(bytes: &[u8]) -> Result<Header, Violation> {
    let text = std::str::from_utf8(bytes)
        .map_err(|_| violation(format!("a header that is not UTF-8 ({})", excerpt(bytes))))?;
    serde_json::from_str(text).map_err(|e| {
        violation(format!(
            "a header that is not a wire message ({e}): {}",
            excerpt(bytes)
        ))
    })
}

/// The start of what a worker sent, printable, for error messages.
pub fn excerpt(bytes: &[u8]) -> String {
    const MAX: usize = 120;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX)]);
    let text: String = text
        .chars()
        .map(|c| if c.is_control() { '.' } else { c })
        .collect();
    if bytes.len() > MAX {
        format!("`{text}`...")
    } else {
        format!("`{text}`")
    }
}

/// The worker's hello on the stream wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamHello {
    pub versions: Vec<u32>,
    pub pid: u32,
    pub worker_version: String,
    pub backends: Vec<String>,
    pub runtime: Option<String>,
    /// The worker library it is built on (`berth_worker` for the Python
    /// package), when it says: what advice a version mismatch gets.
    pub library: Option<String>,
}

/// A checked message from a worker. Bulk bytes stay in the frame (payload
/// or descriptor) for the caller to take.
#[derive(Debug)]
pub enum WorkerMessage {
    Hello(StreamHello),
    Loaded {
        details: String,
        load_micros: u64,
        max_batch: u32,
    },
    LoadFailed(WireError),
    Chunk {
        id: RequestId,
        json: String,
        bulk: Option<BulkRef>,
    },
    Done {
        id: RequestId,
        result: Result<(String, Option<BulkRef>), WireError>,
        run: crate::RunInfo,
    },
    Pong {
        seq: u64,
        stats: WorkerStats,
    },
}

fn need<T>(value: Option<T>, kind: &str, member: &str) -> Result<T, Violation> {
    value.ok_or_else(|| violation(format!("a `{kind}` without its `{member}`")))
}

fn wire_error(e: ErrorJson) -> Result<WireError, Violation> {
    let kind = ErrorKind::from_code(&e.kind).ok_or_else(|| {
        violation(format!(
            "an error of kind {}, which the wire does not name",
            excerpt(e.kind.as_bytes())
        ))
    })?;
    Ok(WireError::new(kind, e.message))
}

fn body_text(body: Option<Box<RawValue>>) -> String {
    body.map(|b| String::from(Box::<str>::from(b)))
        .unwrap_or_else(|| "null".into())
}

impl WorkerMessage {
    /// Checks a header from a worker: a type of the worker's side with the
    /// members it needs.
    pub fn from_header(h: Header) -> Result<WorkerMessage, Violation> {
        let kind = h.kind.as_str();
        Ok(match kind {
            "hello" => WorkerMessage::Hello(StreamHello {
                versions: need(h.versions, kind, "versions")?,
                pid: need(h.pid, kind, "pid")?,
                worker_version: h.worker_version.unwrap_or_default(),
                backends: need(h.backends, kind, "backends")?,
                runtime: h.runtime,
                library: h.library,
            }),
            "loaded" => WorkerMessage::Loaded {
                details: body_text(h.details),
                load_micros: h.load_micros.unwrap_or(0),
                max_batch: h.max_batch.unwrap_or(0),
            },
            "load_failed" => WorkerMessage::LoadFailed(wire_error(need(h.error, kind, "error")?)?),
            "chunk" => WorkerMessage::Chunk {
                id: need(h.id, kind, "id")?,
                json: body_text(h.body),
                bulk: h.bulk,
            },
            "done" => WorkerMessage::Done {
                id: need(h.id, kind, "id")?,
                run: crate::RunInfo {
                    batch: h.batch.unwrap_or(0),
                    compute_micros: h.compute_us.unwrap_or(0),
                },
                result: match h.error {
                    Some(e) => Err(wire_error(e)?),
                    None => Ok((body_text(h.body), h.bulk)),
                },
            },
            "pong" => WorkerMessage::Pong {
                seq: need(h.seq, kind, "seq")?,
                stats: need(h.stats, kind, "stats")?.into(),
            },
            other => {
                return Err(violation(format!(
                    "a message of type {}, which a worker does not send",
                    excerpt(other.as_bytes())
                )));
            }
        })
    }
}

/// A whole frame: the length prefix, the header, the payload.
pub fn frame(header: &[u8], payload: &[u8]) -> Vec<u8> {
    let length = 4 + header.len() + payload.len();
    let mut out = Vec::with_capacity(4 + length);
    out.extend_from_slice(&(length as u32).to_le_bytes());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(payload);
    out
}

fn json_header(value: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&value).expect("a JSON value always serialises")
}

/// `welcome`: the version chosen.
pub fn welcome(version: u32) -> Vec<u8> {
    json_header(serde_json::json!({ "type": "welcome", "version": version }))
}

/// `refused`: why the supervisor will not use this worker.
pub fn refused(reason: &str) -> Vec<u8> {
    json_header(serde_json::json!({ "type": "refused", "reason": reason }))
}

/// `load`.
pub fn load(
    name: &str,
    backend: &str,
    model: Option<&str>,
    options: &BTreeMap<String, String>,
) -> Vec<u8> {
    json_header(serde_json::json!({
        "type": "load", "name": name, "backend": backend, "model": model, "options": options,
    }))
}

/// `cancel`.
pub fn cancel(id: RequestId) -> Vec<u8> {
    json_header(serde_json::json!({ "type": "cancel", "id": id }))
}

/// `ping`.
pub fn ping(seq: u64) -> Vec<u8> {
    json_header(serde_json::json!({ "type": "ping", "seq": seq }))
}

/// `shutdown`.
pub fn shutdown() -> Vec<u8> {
    json_header(serde_json::json!({ "type": "shutdown" }))
}

/// `request`, its body JSON text written as is (checked to be one JSON
/// value first: a host's malformed body must not reach the worker as a
/// malformed header).
pub fn request(id: RequestId, json: &str, bulk: Option<BulkRef>) -> Result<Vec<u8>, String> {
    let body: &RawValue = serde_json::from_str(json.trim())
        .map_err(|e| format!("the request body is not one JSON value ({e})"))?;
    let mut out = Vec::with_capacity(json.len() + 64);
    out.extend_from_slice(br#"{"type":"request","id":"#);
    out.extend_from_slice(id.to_string().as_bytes());
    out.extend_from_slice(br#","body":"#);
    out.extend_from_slice(body.get().as_bytes());
    if let Some(bulk) = bulk {
        out.extend_from_slice(br#","bulk":"#);
        out.extend_from_slice(&serde_json::to_vec(&bulk).expect("a bulk reference serialises"));
    }
    out.push(b'}');
    Ok(out)
}

/// The highest version both sides speak.
pub fn choose_version(worker: &[u32]) -> Option<u32> {
    STREAM_VERSIONS
        .iter()
        .copied()
        .filter(|v| worker.contains(v))
        .max()
}
