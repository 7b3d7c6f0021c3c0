//! Recent log lines, kept for `/logs` (llama-swap's log API): everything
//! berth writes to its log, and each server's or worker's own output. Each
//! history is bounded (100 KiB, the oldest bytes go first); followers get
//! new lines as they are written, and a follower that falls behind loses
//! lines rather than hold anything up.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock};

use tokio::sync::broadcast;

/// Bytes of history kept per log.
pub const HISTORY: usize = 100 << 10;
/// Models whose output is kept; past it, the least recently written goes.
const MAX_MODELS: usize = 1024;

/// Which log a line is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// berth's own log (which holds the servers' lines too).
    Berth,
    /// A model's worker or server output.
    Model(String),
}

/// A line on its way to followers.
#[derive(Debug, Clone)]
pub struct Line {
    pub source: Source,
    pub text: std::sync::Arc<[u8]>,
}

#[derive(Default)]
struct Ring(VecDeque<u8>);

impl Ring {
    fn push(&mut self, bytes: &[u8]) {
        let bytes = &bytes[bytes.len().saturating_sub(HISTORY)..];
        let over = (self.0.len() + bytes.len()).saturating_sub(HISTORY);
        self.0.drain(..over);
        self.0.extend(bytes);
    }
}

/// Each model's output and when it was last written (a counter), and the
/// counter.
type ModelLogs = (HashMap<String, (Ring, u64)>, u64);

struct Logs {
    berth: Mutex<Ring>,
    models: Mutex<ModelLogs>,
    all_models: Mutex<Ring>,
    followers: broadcast::Sender<Line>,
}

fn logs() -> &'static Logs {
    static LOGS: OnceLock<Logs> = OnceLock::new();
    LOGS.get_or_init(|| Logs {
        berth: Mutex::default(),
        models: Mutex::default(),
        all_models: Mutex::default(),
        followers: broadcast::channel(1024).0,
    })
}

/// Bytes berth wrote to its log.
pub fn berth(bytes: &[u8]) {
    let logs = logs();
    logs.berth
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(bytes);
    let _ = logs.followers.send(Line {
        source: Source::Berth,
        text: bytes.into(),
    });
}

/// One line of `model`'s output.
pub fn model_line(model: &str, line: &str) {
    let logs = logs();
    let mut text = Vec::with_capacity(line.len() + 1);
    text.extend_from_slice(line.as_bytes());
    text.push(b'\n');
    {
        let mut models = logs.models.lock().unwrap_or_else(|e| e.into_inner());
        let (map, clock) = &mut *models;
        *clock += 1;
        let now = *clock;
        if !map.contains_key(model) && map.len() >= MAX_MODELS {
            let oldest = map
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone());
            if let Some(oldest) = oldest {
                map.remove(&oldest);
            }
        }
        let entry = map.entry(model.to_string()).or_default();
        entry.0.push(&text);
        entry.1 = now;
    }
    logs.all_models
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(&text);
    let _ = logs.followers.send(Line {
        source: Source::Model(model.to_string()),
        text: text.into(),
    });
}

/// The history of berth's log (`None`), of every model's output
/// (`Some(None)`), or of one model's (`Some(Some(name))`).
pub fn history(which: Option<Option<&str>>) -> Vec<u8> {
    let logs = logs();
    let copy = |ring: &Ring| ring.0.iter().copied().collect();
    match which {
        None => copy(&logs.berth.lock().unwrap_or_else(|e| e.into_inner())),
        Some(None) => copy(&logs.all_models.lock().unwrap_or_else(|e| e.into_inner())),
        Some(Some(model)) => logs
            .models
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .0
            .get(model)
            .map(|(ring, _)| copy(ring))
            .unwrap_or_default(),
    }
}

/// New lines from now on.
pub fn follow() -> broadcast::Receiver<Line> {
    logs().followers.subscribe()
}

/// A writer for the log subscriber: stderr, and the history.
#[derive(Debug)]
pub struct Tee;

impl std::io::Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        // Whole, so the history never holds a part twice.
        std::io::stderr().write_all(buf)?;
        berth(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_history_keeps_its_newest_bytes_within_its_bound() {
        let mut ring = Ring::default();
        ring.push(&vec![b'a'; HISTORY - 10]);
        ring.push(b"0123456789abcdefghij");
        assert_eq!(ring.0.len(), HISTORY);
        assert!(
            ring.0
                .iter()
                .rev()
                .take(20)
                .eq(b"0123456789abcdefghij".iter().rev())
        );
        ring.push(&vec![b'z'; 3 * HISTORY]);
        assert_eq!(ring.0.len(), HISTORY);
    }
}
