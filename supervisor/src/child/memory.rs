//! Memory accounting from procfs: a worker's resident, proportional and
//! peak memory, the system's available and anonymous memory, and the
//! members of a process group.

use serde::{Deserialize, Serialize};

/// One reading of a worker's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessMemory {
    pub rss_bytes: u64,
    /// Anonymous resident memory: heap, stacks, allocator caches.
    pub anon_bytes: u64,
    /// File-backed resident memory: mapped weights, code.
    pub file_bytes: u64,
    /// Proportional set size (0 if smaps_rollup is unreadable).
    pub pss_bytes: u64,
    /// Resident pages no other process maps (the unique set size): what
    /// the process's exit gives back. Beside `shared_bytes`, it tells a
    /// worker forked from a preloaded interpreter apart from what it shares
    /// with it. 0 if smaps_rollup is unreadable.
    #[serde(default)]
    pub private_bytes: u64,
    /// Resident pages another process maps too (a preloader, a library).
    #[serde(default)]
    pub shared_bytes: u64,
    /// Peak resident memory so far (`VmHWM`).
    pub peak_rss_bytes: u64,
}

/// A process's resident memory from `/proc/<pid>/statm`: one small read,
/// for checks made after every request; `None` once it is gone.
pub fn resident_bytes(pid: u32) -> Option<u64> {
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * procfs::page_size())
}

/// Reads a process's memory; `None` once it is gone.
pub fn process_memory(pid: u32) -> Option<ProcessMemory> {
    read_memory(pid, true)
}

/// Reads a process's memory from `/proc/<pid>/status` alone: the
/// proportional, private and shared figures are left 0, and the kernel
/// walks no page tables for it (`smaps_rollup` does: 5–10 ms for an
/// interpreter holding PyTorch). `None` once it is gone.
pub(crate) fn process_status_memory(pid: u32) -> Option<ProcessMemory> {
    read_memory(pid, false)
}

fn read_memory(pid: u32, rollup: bool) -> Option<ProcessMemory> {
    let process = procfs::process::Process::new(pid as i32).ok()?;
    let status = process.status().ok()?;
    let kib = |v: Option<u64>| v.unwrap_or(0) * 1024;
    let rollup = rollup.then(|| process.smaps_rollup().ok()).flatten();
    let field = |name: &str| {
        rollup
            .as_ref()
            .and_then(|r| r.memory_map_rollup.0.first())
            .and_then(|m| m.extension.map.get(name).copied())
            .unwrap_or(0)
    };
    Some(ProcessMemory {
        rss_bytes: kib(status.vmrss),
        anon_bytes: kib(status.rssanon),
        file_bytes: kib(status.rssfile),
        pss_bytes: field("Pss"),
        private_bytes: field("Private_Clean") + field("Private_Dirty"),
        shared_bytes: field("Shared_Clean") + field("Shared_Dirty"),
        peak_rss_bytes: kib(status.vmhwm),
    })
}

/// One reading of the system's memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SystemMemory {
    pub total_bytes: u64,
    pub available_bytes: u64,
    /// `AnonPages`: the evidence that a worker's anonymous memory came back.
    /// (`MemAvailable` drifts by ±100 MB on a busy machine and proves nothing.)
    pub anon_bytes: u64,
}

/// Reads the three fields from `/proc/meminfo` (by hand: a full parse of
/// every field cost more than the memory history's whole sample).
pub fn system_memory() -> SystemMemory {
    let Ok(text) = std::fs::read_to_string("/proc/meminfo") else {
        return SystemMemory::default();
    };
    let field = |name: &str| -> u64 {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0)
    };
    SystemMemory {
        total_bytes: field("MemTotal"),
        available_bytes: field("MemAvailable"),
        anon_bytes: field("AnonPages"),
    }
}

/// Live processes of process group `pgid` (zombies excluded: they hold no
/// memory and their parent reaps them).
pub fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.filter_map(Result::ok)
        .filter_map(|p| p.stat().ok())
        .filter(|s| s.pgrp == pgid as i32 && s.state != 'Z' && s.state != 'X')
        .map(|s| s.pid as u32)
        .collect()
}

/// The memory of a process and of everything it started that is still in
/// `extra` (its process group, its cgroup): summed. What a server that
/// forks workers of its own (vLLM, a uvicorn with workers) holds.
/// Each process is read by `read` ([`process_memory`], or
/// [`process_status_memory`] for what needs no page-table walk).
pub(crate) fn tree_memory(
    pid: u32,
    extra: &[u32],
    read: fn(u32) -> Option<ProcessMemory>,
) -> Option<ProcessMemory> {
    let mut total = read(pid)?;
    for other in extra.iter().copied().filter(|p| *p != pid) {
        if let Some(m) = read(other) {
            total.rss_bytes += m.rss_bytes;
            total.anon_bytes += m.anon_bytes;
            total.file_bytes += m.file_bytes;
            total.pss_bytes += m.pss_bytes;
            total.private_bytes += m.private_bytes;
            total.shared_bytes += m.shared_bytes;
            total.peak_rss_bytes += m.peak_rss_bytes;
        }
    }
    Some(total)
}

/// [`resident_bytes`] of a process and of `extra`, summed.
pub fn tree_resident_bytes(pid: u32, extra: &[u32]) -> Option<u64> {
    let own = resident_bytes(pid)?;
    Some(
        own + extra
            .iter()
            .copied()
            .filter(|p| *p != pid)
            .filter_map(resident_bytes)
            .sum::<u64>(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_memory_and_the_system() {
        let me = process_memory(std::process::id()).expect("own process is readable");
        assert!(me.rss_bytes > 0 && me.peak_rss_bytes >= me.rss_bytes);
        assert!(me.anon_bytes > 0 && me.anon_bytes <= me.rss_bytes);
        assert!(me.private_bytes > 0 && me.private_bytes <= me.rss_bytes);
        assert!(me.private_bytes + me.shared_bytes <= me.rss_bytes + (1 << 20));
        let sys = system_memory();
        assert!(sys.available_bytes > 0 && sys.anon_bytes > 0);
    }

    #[test]
    fn a_gone_process_reads_as_none() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(process_memory(pid), None);
    }

    #[test]
    fn finds_own_group() {
        let pgid = nix::unistd::getpgrp().as_raw() as u32;
        assert!(group_members(pgid).contains(&std::process::id()));
    }
}
