//! `berth reap`: removes the containers a berth no longer running left
//! (for a unit's `ExecStopPost=`, and by hand). `berth serve` does the
//! same at its start, for the engines its config runs.

use std::path::PathBuf;
use std::process::ExitCode;

use berth::server::config::ServeConfig;
use clap::Args;

#[derive(Debug, Args)]
pub struct ReapArgs {
    /// The config whose container engines to sweep (default: podman and
    /// docker, those of them on the PATH).
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// An engine to sweep (`podman`, `docker`, or a path), over the
    /// config's; may be given more than once.
    #[arg(long)]
    engine: Vec<String>,
}

pub async fn run(args: ReapArgs) -> ExitCode {
    let mut engines = args.engine.clone();
    if let Some(path) = &args.config {
        match ServeConfig::read(path) {
            Ok(config) => engines.extend(config.container_engines()),
            Err(e) => return super::fail("invalid_config", &e, false),
        }
    }
    if engines.is_empty() {
        engines = ["podman", "docker"]
            .into_iter()
            .filter(|e| berth::child::container::on_path(e))
            .map(String::from)
            .collect();
    }
    if sweep_engines(&engines).await {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Sweeps each engine of the containers of a berth no longer running,
/// saying what it removed and what it could not; whether all went well.
pub async fn sweep_engines(engines: &[String]) -> bool {
    let mut ok = true;
    for engine in engines {
        match berth::child::container::sweep(engine).await {
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
