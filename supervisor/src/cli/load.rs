//! `berth load`, `berth unload`, `berth sleep` and `berth wake`: one model
//! by name, and the daemon's report of it; `berth reload`: the daemon's config read again, and what
//! changed. One file because they differ only in the route and the report
//! they print.

use std::process::ExitCode;

use berth::ReloadReport;
use berth::{LoadReport, SleepReport, UnloadReport, WakeReport};
use clap::Args;

use super::http::{Client, Remote};
use super::output::{Progress, done, report};

#[derive(Debug, Args)]
pub struct NameArgs {
    pub name: String,
    #[command(flatten)]
    pub remote: Remote,
}

pub fn load(args: NameArgs) -> ExitCode {
    let _progress = Progress::start(format!("loading {}", args.name));
    let result = Client::new(&args.remote).post(&format!("/api/models/{}/load", args.name), None);
    drop(_progress);
    done(
        result.map(|v| report::<LoadReport>(v, args.remote.json)),
        args.remote.json,
    )
}

pub fn unload(args: NameArgs) -> ExitCode {
    act::<UnloadReport>(args, "unload")
}

pub fn sleep(args: NameArgs) -> ExitCode {
    act::<SleepReport>(args, "sleep")
}

pub fn wake(args: NameArgs) -> ExitCode {
    act::<WakeReport>(args, "wake")
}

/// `POST /api/models/NAME/ACTION`, and its report `R` printed.
fn act<R: serde::de::DeserializeOwned + std::fmt::Display>(
    args: NameArgs,
    action: &str,
) -> ExitCode {
    let result =
        Client::new(&args.remote).post(&format!("/api/models/{}/{action}", args.name), None);
    done(
        result.map(|v| report::<R>(v, args.remote.json)),
        args.remote.json,
    )
}

#[derive(Debug, Args)]
pub struct ReloadArgs {
    /// Apply a config with no models, unloading and removing every model
    /// (without it such a config is refused as a file caught half-written).
    #[arg(long)]
    pub allow_empty: bool,
    #[command(flatten)]
    pub remote: Remote,
}

pub fn reload(args: ReloadArgs) -> ExitCode {
    let path = if args.allow_empty {
        "/api/reload?allow_empty=true"
    } else {
        "/api/reload"
    };
    let result = Client::new(&args.remote).post(path, None);
    let json = args.remote.json;
    done(
        result.map(|v| {
            // Steps that failed were kept as they were: the reload is not
            // whole, and the exit status says so.
            let failed = v["failed"].as_array().is_some_and(|f| !f.is_empty());
            let code = report::<ReloadReport>(v, json);
            if failed { ExitCode::FAILURE } else { code }
        }),
        json,
    )
}
