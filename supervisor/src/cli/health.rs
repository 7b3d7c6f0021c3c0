//! `berth health`: is a running `berth serve` alive (`/healthz`), or ready
//! for requests (`/readyz`, `--ready`)? Exit status 0 or 1, for service
//! managers and container probes that can run a command but cannot speak
//! HTTP over a unix socket.

use std::io::Read;
use std::process::ExitCode;

use clap::Args;

use super::http::{Client, Remote};

#[derive(Debug, Args)]
pub struct HealthArgs {
    /// Ask whether it takes requests (`/readyz`: not while shutting down)
    /// rather than whether it is alive (`/healthz`).
    #[arg(long)]
    ready: bool,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(args: HealthArgs) -> ExitCode {
    let path = if args.ready { "/readyz" } else { "/healthz" };
    match Client::new(&args.remote).send("GET", path, None) {
        Ok(mut reply) => {
            let mut text = String::new();
            let _ = reply.body.read_to_string(&mut text);
            let text = text.trim();
            if reply.status == 200 {
                println!("{text}");
                ExitCode::SUCCESS
            } else {
                super::fail(
                    "not_ready",
                    &format!("{path} answered {}: {text}", reply.status),
                    args.remote.json,
                )
            }
        }
        Err((code, message)) => super::fail(&code, &message, args.remote.json),
    }
}
