//! A worker's stdout and stderr, read into the log with bounds.
//!
//! Whatever a worker writes is untrusted input: one 100 MB line without a
//! newline, or a loop printing as fast as it can, must not grow the
//! supervisor or flood its log. So each stream is read in fixed-size blocks
//! and split into lines here:
//! - a line is cut at [`MAX_LINE`] bytes (the rest is skipped up to its
//!   newline, never buffered), with a note of how much was cut;
//! - lines are logged at most [`RATE_BYTES`] per second (a token bucket
//!   with a burst of [`BURST_BYTES`]); the rest are counted and dropped from
//!   the log, and the count is logged in one notice at most every
//!   [`NOTICE_EVERY`] (and when the stream ends), so a stream at the edge
//!   of its rate does not double the log with notices;
//! - the last [`STDERR_TAIL_LINES`] stderr lines are kept for error
//!   messages, whatever the rate (the line before a crash matters most).
//!
//! The pipe is always drained, so a chatty worker never blocks on a write.

use std::collections::VecDeque;
use std::io::Read;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::watch;

/// How many stderr lines are kept for error messages.
pub const STDERR_TAIL_LINES: usize = 20;
/// Longest line kept; the rest of a longer one is counted and skipped.
pub const MAX_LINE: usize = 4096;
/// Bytes per second of a stream that are logged and kept.
pub const RATE_BYTES: f64 = 64.0 * 1024.0;
/// What a stream may send at once before the rate applies.
pub const BURST_BYTES: f64 = 256.0 * 1024.0;
/// One read from the pipe.
const BLOCK: usize = 8 * 1024;
/// The most often a stream's "dropped N lines" notice is logged.
pub const NOTICE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// The kept tail of stderr.
pub(crate) type Tail = Arc<Mutex<VecDeque<String>>>;

/// Reads `pipe` until it closes; `closed` turns true then. On the runtime's
/// reactor (no thread per worker), or on a thread of its own where there
/// is no runtime.
pub(crate) fn forward_lines(
    model: &str,
    pid: u32,
    stream: &'static str,
    pipe: impl Into<OwnedFd> + Read + Send + 'static,
    tail: Option<Tail>,
    closed: Option<watch::Sender<bool>>,
) {
    let mut log = Log {
        model: model.to_string(),
        pid,
        stream,
        tail,
        limit: RateLimit::new(),
    };
    if let Ok(reactor) = tokio::runtime::Handle::try_current() {
        match tokio::net::unix::pipe::Receiver::from_owned_fd(pipe.into()) {
            Ok(pipe) => {
                reactor.spawn(async move {
                    let mut lines = Lines::default();
                    let mut block = vec![0; BLOCK];
                    loop {
                        match pipe.try_read(&mut block) {
                            Ok(0) => break,
                            Ok(n) => {
                                lines.push(&block[..n], &mut |line| log.line(line));
                                // A worker that writes without pause would
                                // otherwise keep this task reading forever
                                // and hold one of the runtime's threads:
                                // give way once the task's budget is spent.
                                tokio::task::coop::consume_budget().await;
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                if pipe.readable().await.is_err() {
                                    break;
                                }
                            }
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                            Err(_) => break,
                        }
                    }
                    lines.finish(&mut |line| log.line(line));
                    log.end(closed);
                });
            }
            Err(e) => tracing::warn!(pid, "cannot read the worker's {stream}: {e}"),
        }
        return;
    }
    let spawned = std::thread::Builder::new()
        .name(format!("berth-{stream}-{pid}"))
        .spawn(move || {
            let mut pipe = pipe;
            let mut lines = Lines::default();
            let mut block = vec![0; BLOCK];
            loop {
                match pipe.read(&mut block) {
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Ok(0) | Err(_) => break,
                    Ok(n) => lines.push(&block[..n], &mut |line| log.line(line)),
                }
            }
            lines.finish(&mut |line| log.line(line));
            log.end(closed);
        });
    if let Err(e) = spawned {
        tracing::warn!(pid, "cannot read the worker's {stream}: {e}");
    }
}

/// Where a stream's lines go: the kept tail and, within the rate, the log.
struct Log {
    model: String,
    pid: u32,
    stream: &'static str,
    tail: Option<Tail>,
    limit: RateLimit,
}

impl Log {
    fn line(&mut self, line: String) {
        if line.is_empty() {
            return;
        }
        // The tail is bounded (20 lines of at most 4 KiB) and keeps every
        // line, so the one before a crash is never lost to the rate limit;
        // the log takes what the rate allows.
        if let Some(tail) = &self.tail {
            let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
            if tail.len() == STDERR_TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(line.clone());
        }
        let verdict = self.limit.admit(line.len(), Instant::now());
        if let Some(dropped) = verdict.notice {
            self.notice(dropped);
        }
        if verdict.log {
            crate::logs::model_line(&self.model, &line);
            tracing::info!(target: "berth::worker", model = %self.model, pid = self.pid,
                stream = self.stream, "{line}");
        }
    }

    fn notice(&self, (lines, bytes): (u64, u64)) {
        tracing::warn!(target: "berth::worker", model = %self.model, pid = self.pid,
            stream = self.stream,
            "dropped {lines} lines ({bytes} bytes) over the output rate limit");
    }

    fn end(mut self, closed: Option<watch::Sender<bool>>) {
        if let Some(dropped) = self.limit.flush() {
            self.notice(dropped);
        }
        if let Some(closed) = closed {
            let _ = closed.send(true);
        }
    }
}

/// What the rate limit says of one line.
#[derive(Debug, PartialEq, Eq)]
struct Verdict {
    /// Log the line.
    log: bool,
    /// Log, first, a notice of this many lines and bytes dropped.
    notice: Option<(u64, u64)>,
}

/// A stream's rate limit: the bucket, and the dropped lines not yet
/// reported, reported together at most every [`NOTICE_EVERY`].
struct RateLimit {
    bucket: Bucket,
    dropped: (u64, u64),
    last_notice: Option<Instant>,
}

impl RateLimit {
    fn new() -> Self {
        RateLimit {
            bucket: Bucket::new(),
            dropped: (0, 0),
            last_notice: None,
        }
    }

    fn admit(&mut self, bytes: usize, now: Instant) -> Verdict {
        let log = self.bucket.take_at(bytes, now);
        if !log {
            self.dropped.0 += 1;
            self.dropped.1 += bytes as u64;
        }
        let due = self
            .last_notice
            .is_none_or(|at| now.duration_since(at) >= NOTICE_EVERY);
        let notice = if log && self.dropped.0 > 0 && due {
            self.last_notice = Some(now);
            Some(std::mem::take(&mut self.dropped))
        } else {
            None
        };
        Verdict { log, notice }
    }

    /// What is still unreported, at the stream's end.
    fn flush(&mut self) -> Option<(u64, u64)> {
        let dropped = std::mem::take(&mut self.dropped);
        (dropped.0 > 0).then_some(dropped)
    }
}

/// A token bucket over bytes.
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn new() -> Bucket {
        Bucket {
            tokens: BURST_BYTES,
            at: Instant::now(),
        }
    }

    #[cfg(test)]
    fn take(&mut self, bytes: usize) -> bool {
        self.take_at(bytes, Instant::now())
    }

    fn take_at(&mut self, bytes: usize, now: Instant) -> bool {
        let refill = now.duration_since(self.at).as_secs_f64() * RATE_BYTES;
        self.tokens = (self.tokens + refill).min(BURST_BYTES);
        self.at = now;
        if self.tokens >= bytes as f64 {
            self.tokens -= bytes as f64;
            true
        } else {
            false
        }
    }
}

/// Splits what a pipe delivers, block by block, into lines of at most
/// [`MAX_LINE`] bytes: the rest of a longer line is counted, never kept.
#[derive(Default)]
struct Lines {
    line: Vec<u8>,
    /// Bytes of the current line cut so far.
    cut: usize,
}

impl Lines {
    /// Hands each line `bytes` completes to `each` (trailing whitespace
    /// trimmed, cut if too long); keeps the unfinished rest.
    fn push(&mut self, mut bytes: &[u8], each: &mut impl FnMut(String)) {
        while !bytes.is_empty() {
            let newline = bytes.iter().position(|&b| b == b'\n');
            let piece = &bytes[..newline.unwrap_or(bytes.len())];
            let room = MAX_LINE.saturating_sub(self.line.len());
            self.line.extend_from_slice(&piece[..piece.len().min(room)]);
            self.cut += piece.len().saturating_sub(room);
            match newline {
                Some(at) => {
                    each(self.take());
                    bytes = &bytes[at + 1..];
                }
                None => break,
            }
        }
    }

    /// The last line, if the stream ended without a newline.
    fn finish(&mut self, each: &mut impl FnMut(String)) {
        if !self.line.is_empty() || self.cut > 0 {
            each(self.take());
        }
    }

    fn take(&mut self) -> String {
        let mut text = String::from_utf8_lossy(&self.line).trim_end().to_string();
        if self.cut > 0 {
            text.push_str(&format!(" [... {} more bytes of this line cut]", self.cut));
        }
        self.line.clear();
        self.cut = 0;
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_line_is_cut_without_being_buffered() {
        let mut input = vec![b'x'; 10 * 1024 * 1024];
        input.extend_from_slice(b"\nnext line\nno newline");
        let mut lines = Lines::default();
        let mut out = Vec::new();
        for block in input.chunks(BLOCK) {
            lines.push(block, &mut |l| out.push(l));
            assert!(lines.line.len() <= MAX_LINE);
        }
        lines.finish(&mut |l| out.push(l));
        assert_eq!(
            out.len(),
            3,
            "{:?}",
            out.iter().map(String::len).collect::<Vec<_>>()
        );
        assert!(out[0].len() < MAX_LINE + 100, "{}", out[0].len());
        assert!(out[0].ends_with(&format!(
            "[... {} more bytes of this line cut]",
            10 * 1024 * 1024 - MAX_LINE
        )));
        assert_eq!(out[1], "next line");
        assert_eq!(out[2], "no newline");
    }

    #[test]
    fn lines_split_across_blocks_are_joined() {
        let text: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
        let mut lines = Lines::default();
        let mut n = 0;
        // Blocks of a prime size cut lines at every offset.
        for block in text.as_bytes().chunks(997) {
            lines.push(block, &mut |line| {
                assert_eq!(line, format!("line {n}"));
                n += 1;
            });
        }
        lines.finish(&mut |line| panic!("no line is left over: {line}"));
        assert_eq!(n, 20_000);
    }

    /// A stream writing at twice the rate for ten seconds: the lines
    /// logged stay within the burst and the rate, and the notices of what
    /// was dropped come at most once a second, however the passed and
    /// dropped lines alternate.
    #[test]
    fn notices_of_dropped_lines_come_at_most_once_a_second() {
        let mut limit = RateLimit::new();
        let start = Instant::now();
        let line = 100;
        let per_second = 2 * RATE_BYTES as usize / line;
        let (mut logged, mut notices, mut dropped) = (0usize, 0u64, 0u64);
        for i in 0..10 * per_second {
            let now = start + std::time::Duration::from_secs_f64(i as f64 / per_second as f64);
            let verdict = limit.admit(line, now);
            if verdict.log {
                logged += line;
            }
            if let Some((lines, _)) = verdict.notice {
                notices += 1;
                dropped += lines;
            }
        }
        dropped += limit.flush().map_or(0, |(lines, _)| lines);
        assert!(notices <= 11, "{notices} notices in 10 s");
        assert!(
            logged as f64 <= BURST_BYTES + 10.0 * RATE_BYTES + line as f64,
            "{logged} bytes logged"
        );
        assert_eq!(
            logged / line + dropped as usize,
            10 * per_second,
            "every line is logged or counted"
        );
    }

    #[test]
    fn the_bucket_passes_a_burst_then_the_rate() {
        let mut bucket = Bucket::new();
        let mut passed = 0usize;
        while bucket.take(1024) {
            passed += 1024;
        }
        assert!(passed as f64 <= BURST_BYTES + 64.0 * 1024.0, "{passed}");
        assert!(!bucket.take(1024));
    }
}
