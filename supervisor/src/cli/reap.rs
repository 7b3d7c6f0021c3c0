//! `berth reap`: removes the containers a berth no longer running left
//! (for a unit's `ExecStopPost=`, and by hand). `berth serve` does the
//! same at its start, for the engines its config runs.

use std::path::PathBuf;
use std::process::ExitCode;

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
    match berth::daemon::reap(args.config.as_deref(), &args.engine).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => super::fail("invalid_config", &e, false),
    }
}
