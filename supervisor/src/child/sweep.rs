//! Killing what a worker leaves: whatever is still in its process group,
//! and what it started outside the group (in its cgroup, or carrying its
//! mark). A stop does it after the worker exits; so does the watch on a
//! worker that died on its own (a crash, a failed start), before a restart
//! can begin, so that nothing a dead worker started outlives it.

use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::child::memory::group_members;
use crate::child::process::ProcessWatch;

/// Both sweeps, for a worker that is gone: its group, then what left it.
pub(crate) async fn sweep_all(process: &ProcessWatch) -> Escapees {
    let left = sweep_group(process.pid()).await;
    let mut escapees = sweep_escapees(process).await;
    escapees.left += left;
    escapees
}

/// Kills whatever is left in the worker's process group (processes it
/// forked) and waits briefly for them to go. Returns how many remain.
pub(crate) async fn sweep_group(pgid: u32) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let members = group_members(pgid);
        // Under a subreaper, killed grandchildren are our children to reap.
        crate::child::orphans::reap_strays(crate::child::orphans::Strays::InGroup(pgid));
        if members.is_empty() {
            return 0;
        }
        if Instant::now() >= deadline {
            tracing::error!(
                pgid,
                ?members,
                "processes of the worker's group survived SIGKILL"
            );
            return members.len() as u32;
        }
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pgid as i32), Signal::SIGKILL);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// What the sweep for processes outside the worker's group found.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Escapees {
    /// Found (and killed).
    pub found: u32,
    /// Still alive when the sweep gave up.
    pub left: u32,
}

/// Kills what the worker started that left its process group (a `setsid`,
/// a double fork): every task of its cgroup where it has one, and every
/// process carrying its mark (which survives where no cgroup could be
/// made). Processes adopted by this supervisor as a subreaper are reaped.
pub(crate) async fn sweep_escapees(process: &ProcessWatch) -> Escapees {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut seen = std::collections::BTreeSet::new();
    loop {
        // A cgroup holds everything the worker started (leaving it takes
        // privileges a worker does not have): where there is one, its
        // members are the answer, with no scan of every process's
        // environment for the mark.
        let mut found: Vec<u32> = match process.cgroup() {
            Some(cgroup) => cgroup.members(),
            None => crate::child::orphans::carrying_mark(process.mark(), process.start_time()),
        };
        found.sort_unstable();
        found.dedup();
        found.retain(|pid| crate::child::orphans::is_live(*pid));
        if found.is_empty() {
            crate::child::orphans::reap_exact(&seen);
            return Escapees {
                found: seen.len() as u32,
                left: 0,
            };
        }
        if seen.is_empty() {
            tracing::warn!(
                model = process.model(),
                pid = process.pid(),
                ?found,
                "the worker left processes outside its process group; killing them"
            );
        }
        seen.extend(found.iter().copied());
        if let Some(cgroup) = process.cgroup() {
            cgroup.kill_all();
        }
        for pid in &found {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(*pid as i32), Signal::SIGKILL);
        }
        crate::child::orphans::reap_exact(&seen);
        if Instant::now() >= deadline {
            tracing::error!(
                model = process.model(),
                ?found,
                "processes the worker started survived SIGKILL"
            );
            return Escapees {
                found: seen.len() as u32,
                left: found.len() as u32,
            };
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
