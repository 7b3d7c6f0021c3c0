//! A worker's memory as the supervisor reads it: procfs samples (for an
//! HTTP server, of everything it started), the cheap resident-size reading
//! the heartbeat takes, the growth trend a leak shows in, and the pids whose
//! device memory is the model's.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth_protocol::WorkerStats;

use super::{MemoryState, WorkerHandle};
use crate::child::memory::{ProcessMemory, process_memory, process_status_memory, tree_memory};

impl WorkerHandle {
    /// The processes besides the worker whose memory counts as its: for an
    /// HTTP server, what it started (its group and its cgroup), which is
    /// where a server that forks workers keeps its memory.
    fn tree(&self) -> Option<Vec<u32>> {
        self.upstream.as_ref()?;
        let mut pids = crate::child::memory::group_members(self.pid);
        if let Some(cgroup) = self.process.cgroup() {
            pids.extend(cgroup.members());
        }
        pids.push(self.pid);
        pids.sort_unstable();
        pids.dedup();
        *self.tree_seen.lock().unwrap_or_else(|e| e.into_inner()) = pids.clone();
        Some(pids)
    }

    /// The pids whose device memory is the model's: the worker's own, and
    /// for an HTTP server everything it started as last seen (vLLM keeps
    /// its weights in an engine process of its own). Reads nothing.
    pub fn pids(&self) -> Vec<u32> {
        let seen = self.tree_seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.is_empty() {
            vec![self.pid]
        } else {
            seen.clone()
        }
    }

    /// The latest memory reading.
    pub fn memory(&self) -> MemoryState {
        *self.memory.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the worker's memory from procfs now and records it (for an
    /// HTTP server, with everything it started).
    pub fn sample_memory(&self) -> Option<ProcessMemory> {
        let reading = self.read_memory(process_memory)?;
        let mut m = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        let peak = m.last.peak_rss_bytes.max(reading.peak_rss_bytes);
        m.last = ProcessMemory {
            peak_rss_bytes: peak,
            ..reading
        };
        m.sampled_at = Some(Instant::now());
        Some(m.last)
    }

    /// [`WorkerHandle::sample_memory`] without the proportional, private
    /// and shared figures (left as last read): what `/proc/<pid>/status`
    /// says, read without walking the worker's page tables. Not counted as
    /// a sample (a status asks for a full one still).
    pub(crate) fn sample_status_memory(&self) -> Option<ProcessMemory> {
        let reading = self.read_memory(process_status_memory)?;
        let mut m = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        m.last = ProcessMemory {
            peak_rss_bytes: m.last.peak_rss_bytes.max(reading.peak_rss_bytes),
            pss_bytes: m.last.pss_bytes,
            private_bytes: m.last.private_bytes,
            shared_bytes: m.last.shared_bytes,
            ..reading
        };
        Some(m.last)
    }

    /// The worker's memory (for an HTTP server, with everything it
    /// started), each process read by `read`.
    fn read_memory(&self, read: fn(u32) -> Option<ProcessMemory>) -> Option<ProcessMemory> {
        match self.tree() {
            Some(tree) => tree_memory(self.pid, &tree, read),
            None => read(self.pid),
        }
    }

    /// Reads just the worker's resident memory now (`statm`: cheap, unlike
    /// a full sample) and records it; `None` once the process is gone.
    pub fn sample_rss(&self) -> Option<u64> {
        let rss = match self.tree() {
            Some(tree) => crate::child::memory::tree_resident_bytes(self.pid, &tree)?,
            None => crate::child::memory::resident_bytes(self.pid)?,
        };
        let mut m = self.memory.lock().unwrap_or_else(|e| e.into_inner());
        m.last.rss_bytes = rss;
        m.last.peak_rss_bytes = m.last.peak_rss_bytes.max(rss);
        Some(rss)
    }

    /// The last reading if it is younger than `max_age`, else a new one:
    /// status views polled in a loop then cost at most one procfs read per
    /// worker per `max_age`, however many clients poll.
    pub fn recent_memory(&self, max_age: Duration) -> Option<ProcessMemory> {
        {
            let m = self.memory.lock().unwrap_or_else(|e| e.into_inner());
            if m.sampled_at.is_some_and(|at| at.elapsed() < max_age) {
                return Some(m.last);
            }
        }
        self.sample_memory()
    }

    /// Records, after load, the current RSS as the base of the growth trend
    /// and how long the load took (what a replacement will cost).
    pub(crate) fn set_baseline(&self, load_time: Duration) {
        let rss = self.memory().last.rss_bytes;
        self.baseline_rss.store(rss, Ordering::Relaxed);
        self.load_micros
            .store(load_time.as_micros() as u64, Ordering::Relaxed);
    }

    /// Spawn to ready for this worker.
    pub fn load_time(&self) -> Duration {
        Duration::from_micros(self.load_micros.load(Ordering::Relaxed))
    }

    /// Resident memory growth per request since load; a leak shows here.
    pub fn rss_growth_per_request(&self) -> f64 {
        let requests = self.requests();
        if requests == 0 {
            return 0.0;
        }
        let now = self.memory().last.rss_bytes;
        now.saturating_sub(self.baseline_rss.load(Ordering::Relaxed)) as f64 / requests as f64
    }

    pub(super) fn record_stats(&self, stats: WorkerStats) {
        self.memory
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .worker_stats = stats;
    }
}
