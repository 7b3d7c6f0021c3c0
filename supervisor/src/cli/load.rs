//! `berth load` and `berth unload`: one model by name, and the daemon's
//! report of it; `berth reload`: the daemon's config read again, and what
//! changed. One file because they differ only in the route and the report
//! they print.

use std::process::ExitCode;

use berth::ReloadReport;
use berth::{LoadReport, UnloadReport};
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
    let result = Client::new(&args.remote).post(&format!("/api/models/{}/unload", args.name), None);
    done(
        result.map(|v| report::<UnloadReport>(v, args.remote.json)),
        args.remote.json,
    )
}

pub fn reload(remote: Remote) -> ExitCode {
    let result = Client::new(&remote).post("/api/reload", None);
    done(
        result.map(|v| report::<ReloadReport>(v, remote.json)),
        remote.json,
    )
}
