//! The sweep: the containers of a berth that died without stopping them
//! (SIGKILL, a lost host), found by their `berth.owner` label naming a
//! process that is gone, and removed; run at every `berth serve` start for
//! the engines its config runs, and by `berth reap`. A container whose
//! owner lives is never touched.

use std::time::Duration;

use super::{CGROUP_LABEL, ENGINE_TIMEOUT, OWNER_LABEL, exists, run_engine};
use crate::config::Engine;

/// Whether the supervisor an owner label names is alive.
pub(super) fn owner_alive(owner: &str) -> bool {
    let Some((pid, start)) = owner.split_once('.') else {
        return false;
    };
    let (Ok(pid), Ok(start)) = (pid.parse::<u32>(), start.parse::<u64>()) else {
        return false;
    };
    crate::child::orphans::start_time(pid) == Some(start)
}

/// Whether worker cgroup `dir` (named `MODEL-PID-N`) was made by the
/// supervisor an owner label (`PID.START`) names.
pub(super) fn made_by(dir: &std::path::Path, owner: &str) -> bool {
    let maker = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.rsplit('-').nth(1));
    let owner_pid = owner.split_once('.').map(|(pid, _)| pid);
    maker.is_some() && maker == owner_pid
}

/// What a sweep found of one engine's containers.
#[derive(Debug, Default)]
pub struct Swept {
    /// Containers of a berth no longer running, removed.
    pub removed: Vec<String>,
    /// Such containers the engine would not remove, with its words.
    pub failed: Vec<(String, String)>,
}

/// Removes every container berth started (it carries the owner label)
/// whose supervisor is no longer running: what a berth killed by SIGKILL
/// left (its `conmon` and server outlive it where no systemd unit's cgroup
/// takes them). Containers of a live berth are left alone.
pub async fn sweep(program: &str) -> Result<Swept, String> {
    let Some(engine) = Engine::of(program) else {
        return Err(format!("{program} is not podman or docker"));
    };
    let filter = format!("label={OWNER_LABEL}");
    let listed = run_engine(
        program,
        &[],
        &["ps", "-a", "--filter", &filter, "--format", "{{.Names}}"],
        ENGINE_TIMEOUT,
    )
    .await?;
    if !listed.status.success() {
        return Err(format!(
            "`{program} ps` failed ({}): {}",
            listed.status,
            String::from_utf8_lossy(&listed.stderr).trim()
        ));
    }
    let mut swept = Swept::default();
    for name in String::from_utf8_lossy(&listed.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect::<Vec<_>>()
    {
        let format = format!(
            "{{{{index .Config.Labels \"{OWNER_LABEL}\"}}}} {{{{index .Config.Labels \"{CGROUP_LABEL}\"}}}}"
        );
        let inspected = run_engine(
            program,
            &[],
            &["inspect", "--format", &format, &name],
            ENGINE_TIMEOUT,
        )
        .await?;
        let labels = String::from_utf8_lossy(&inspected.stdout).to_string();
        let mut labels = labels.split_whitespace();
        let (owner, cgroup) = (labels.next().unwrap_or(""), labels.next());
        if !inspected.status.success() || owner_alive(owner) {
            continue;
        }
        let removal = run_engine(program, &[], &["rm", "-f", &name], ENGINE_TIMEOUT).await?;
        // What the engine left in the dead berth's cgroup for the model
        // (its conmon, where the engine could not stop it), and the cgroup:
        // only a cgroup the dead owner made (its name carries the maker's
        // pid), so a label naming another berth's cgroup kills nothing.
        if let Some(dir) = cgroup.and_then(crate::child::limits::worker_cgroup_at)
            && let Some(version) = crate::child::limits::is_worker_cgroup(&dir)
            && made_by(&dir, owner)
        {
            crate::child::limits::kill_cgroup(&dir, version);
            for _ in 0..50 {
                if crate::child::limits::remove_cgroup(&dir) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        match exists(program, &[], engine, &name).await {
            Ok(false) => swept.removed.push(name),
            Ok(true) => swept.failed.push((
                name,
                String::from_utf8_lossy(&removal.stderr).trim().to_string(),
            )),
            Err(e) => swept.failed.push((name, e)),
        }
    }
    Ok(swept)
}
