//! `berth serve`: the sidecar daemon. Its arguments, parsed and handed to
//! [`berth::daemon::run`].

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// A TOML config (see docs/configuration.md); without one, the default models are
    /// served (fetched by package name if missing).
    #[arg(long, short = 'c')]
    config: Option<PathBuf>,
    /// `127.0.0.1:7733` (default), `0.0.0.0:7733` (needs a token) or `unix:/path`.
    #[arg(long)]
    listen: Option<String>,
    /// Bearer token clients must send; overrides the config's.
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The worker program (default: this executable, as `berth worker`).
    #[arg(long, env = "BERTH_WORKER")]
    worker: Option<PathBuf>,
    /// A llama-swap `config.yaml`: its models are served as HTTP-server
    /// models beside the config's (docs/upstream.md says what maps, and
    /// berth says at start what it ignores).
    #[arg(long, value_name = "CONFIG_YAML")]
    llama_swap: Option<PathBuf>,
    /// A folder of llama-swap files (llama-swap's `-config-dir`): its
    /// `.yml`/`.yaml` files merged, in name order, after `--llama-swap`'s,
    /// as llama-swap merges them.
    #[arg(long, value_name = "DIR")]
    llama_swap_dir: Option<PathBuf>,
    /// Reload the config when its file (or the llama-swap file) changes,
    /// as `SIGHUP` and `berth reload` do.
    #[arg(long)]
    watch_config: bool,
    /// Check that this binary could take over from a running berth started
    /// with the same arguments (an in-place upgrade asks it first), print
    /// what it reads, and exit.
    #[arg(long = "upgrade-check", hide = true)]
    upgrade_check: bool,
}

pub async fn run(args: ServeArgs) -> ExitCode {
    let options = berth::daemon::Options {
        config: args.config,
        listen: args.listen,
        token: args.token,
        worker: super::default_worker(args.worker),
        llama_swap: args.llama_swap,
        llama_swap_dir: args.llama_swap_dir,
        watch_config: args.watch_config,
    };
    if args.upgrade_check {
        return match berth::daemon::check(&options) {
            Ok(answer) => {
                println!("{}", serde_json::to_string(&answer).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(message) => super::fail("upgrade_check_failed", &message, false),
        };
    }
    match berth::daemon::run(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => super::fail("serve_failed", &message, false),
    }
}
