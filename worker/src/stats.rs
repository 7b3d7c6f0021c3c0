//! The worker's view of its own memory, for heartbeats.

/// `(rss_bytes, peak_rss_bytes)` of this process, from procfs; zeros if
/// procfs cannot be read (never fatal: stats are advisory).
pub fn self_memory() -> (u64, u64) {
    procfs::process::Process::myself()
        .and_then(|p| p.status())
        .map(|s| (s.vmrss.unwrap_or(0) * 1024, s.vmhwm.unwrap_or(0) * 1024))
        .unwrap_or((0, 0))
}
