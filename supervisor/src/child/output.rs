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
//!   the log, and the count is logged once the stream is within its rate
//!   again;
//! - the last [`STDERR_TAIL_LINES`] stderr lines are kept for error
//!   messages, whatever the rate (the line before a crash matters most).
//!
//! The pipe is always drained, so a chatty worker never blocks on a write.

use std::collections::VecDeque;
use std::io::Read;
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

/// The kept tail of stderr.
pub(crate) type Tail = Arc<Mutex<VecDeque<String>>>;

/// Reads `pipe` on a thread of its own until it closes; `closed` turns true
/// then.
pub(crate) fn forward_lines(
    model: &str,
    pid: u32,
    stream: &'static str,
    pipe: impl Read + Send + 'static,
    tail: Option<Tail>,
    closed: Option<watch::Sender<bool>>,
) {
    let model = model.to_string();
    let spawned = std::thread::Builder::new()
        .name(format!("berth-{stream}-{pid}"))
        .spawn(move || {
            let mut lines = Lines::new(pipe);
            let mut bucket = Bucket::new();
            let (mut dropped_lines, mut dropped_bytes) = (0u64, 0u64);
            while let Some(line) = lines.next_line() {
                if line.is_empty() {
                    continue;
                }
                // The tail is bounded (20 lines of at most 4 KiB) and keeps
                // every line, so the one before a crash is never lost to the
                // rate limit; the log takes what the rate allows.
                if let Some(tail) = &tail {
                    let mut tail = tail.lock().unwrap_or_else(|e| e.into_inner());
                    if tail.len() == STDERR_TAIL_LINES {
                        tail.pop_front();
                    }
                    tail.push_back(line.clone());
                }
                if !bucket.take(line.len()) {
                    dropped_lines += 1;
                    dropped_bytes += line.len() as u64;
                    continue;
                }
                if dropped_lines > 0 {
                    tracing::warn!(target: "berth::worker", model = %model, pid, stream,
                        "dropped {dropped_lines} lines ({dropped_bytes} bytes) over the output rate limit");
                    (dropped_lines, dropped_bytes) = (0, 0);
                }
                tracing::info!(target: "berth::worker", model = %model, pid, stream, "{line}");
            }
            if dropped_lines > 0 {
                tracing::warn!(target: "berth::worker", model = %model, pid, stream,
                    "dropped {dropped_lines} lines ({dropped_bytes} bytes) over the output rate limit");
            }
            if let Some(closed) = closed {
                let _ = closed.send(true);
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(pid, "cannot read the worker's {stream}: {e}");
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

    fn take(&mut self, bytes: usize) -> bool {
        let now = Instant::now();
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

/// Lines of at most [`MAX_LINE`] bytes from a pipe, read in fixed blocks.
struct Lines<R> {
    pipe: R,
    block: Box<[u8]>,
    /// Unconsumed bytes of `block`: `start..end`.
    start: usize,
    end: usize,
    eof: bool,
}

impl<R: Read> Lines<R> {
    fn new(pipe: R) -> Self {
        Lines {
            pipe,
            block: vec![0; 64 * 1024].into_boxed_slice(),
            start: 0,
            end: 0,
            eof: false,
        }
    }

    fn fill(&mut self) -> bool {
        if self.eof {
            return false;
        }
        loop {
            match self.pipe.read(&mut self.block) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Ok(0) | Err(_) => {
                    self.eof = true;
                    return false;
                }
                Ok(n) => {
                    (self.start, self.end) = (0, n);
                    return true;
                }
            }
        }
    }

    /// The next line (trailing whitespace trimmed, cut if too long), or
    /// `None` once the pipe is closed and drained.
    fn next_line(&mut self) -> Option<String> {
        let mut line: Vec<u8> = Vec::new();
        let mut cut = 0usize;
        loop {
            if self.start == self.end && !self.fill() {
                if line.is_empty() && cut == 0 {
                    return None;
                }
                break;
            }
            let available = &self.block[self.start..self.end];
            let newline = available.iter().position(|&b| b == b'\n');
            let piece = &available[..newline.unwrap_or(available.len())];
            let room = MAX_LINE.saturating_sub(line.len());
            line.extend_from_slice(&piece[..piece.len().min(room)]);
            cut += piece.len().saturating_sub(room);
            self.start += piece.len();
            if newline.is_some() {
                self.start += 1;
                break;
            }
        }
        let mut text = String::from_utf8_lossy(&line).trim_end().to_string();
        if cut > 0 {
            text.push_str(&format!(" [... {cut} more bytes of this line cut]"));
        }
        Some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_huge_line_is_cut_without_being_buffered() {
        let mut input = vec![b'x'; 10 * 1024 * 1024];
        input.extend_from_slice(b"\nnext line\n");
        let mut lines = Lines::new(&input[..]);
        let first = lines.next_line().unwrap();
        assert!(first.len() < MAX_LINE + 100, "{}", first.len());
        assert!(first.ends_with(&format!(
            "[... {} more bytes of this line cut]",
            10 * 1024 * 1024 - MAX_LINE
        )));
        assert_eq!(lines.next_line().unwrap(), "next line");
        assert_eq!(lines.next_line(), None);
    }

    #[test]
    fn lines_split_across_blocks_are_joined() {
        let text: String = (0..20_000).map(|i| format!("line {i}\n")).collect();
        let mut lines = Lines::new(text.as_bytes());
        let mut n = 0;
        while let Some(line) = lines.next_line() {
            assert_eq!(line, format!("line {n}"));
            n += 1;
        }
        assert_eq!(n, 20_000);
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
