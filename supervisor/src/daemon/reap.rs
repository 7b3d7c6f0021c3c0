//! Containers a berth no longer running left (its `berth.owner` label
//! names a process that is gone): removed at every start, for the engines
//! the config runs, and by `berth reap` (a unit's `ExecStopPost=`).
//! `docs/internals/containers.md` tells the sweep whole.

use std::path::Path;

use super::config::ServeConfig;

/// Sweeps `engines` (and the container engines the config at `config`
/// runs; with neither, podman and docker, those on the PATH); whether all
/// went well, each failure said on stderr.
pub async fn reap(config: Option<&Path>, engines: &[String]) -> Result<bool, String> {
    let mut engines = engines.to_vec();
    if let Some(path) = config {
        engines.extend(ServeConfig::read(path)?.container_engines());
    }
    if engines.is_empty() {
        engines = ["podman", "docker"]
            .into_iter()
            .filter(|e| crate::child::container::on_path(e))
            .map(String::from)
            .collect();
    }
    Ok(sweep_engines(&engines).await)
}

/// Sweeps each engine of the containers of a berth no longer running,
/// saying what it removed and what it could not; whether all went well.
pub async fn sweep_engines(engines: &[String]) -> bool {
    let mut ok = true;
    for engine in engines {
        match crate::child::container::sweep(engine).await {
            Ok(swept) => {
                if !swept.removed.is_empty() {
                    tracing::warn!(
                        engine,
                        containers = swept.removed.join(" "),
                        "removed containers a berth no longer running left"
                    );
                    eprintln!(
                        "berth: removed {} container(s) a berth no longer running left ({engine}): {}",
                        swept.removed.len(),
                        swept.removed.join(" ")
                    );
                }
                for (name, why) in &swept.failed {
                    ok = false;
                    eprintln!("berth: cannot remove container {name} ({engine}): {why}");
                }
            }
            Err(e) => {
                ok = false;
                eprintln!("berth: cannot sweep {engine}'s containers: {e}");
            }
        }
    }
    ok
}
