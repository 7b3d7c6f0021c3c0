//! `berth upgrade`: a running `berth serve` replaces its own program with
//! a new binary in place (same pid, every model still loaded), and this
//! prints how it went. Without `--binary`, the daemon is asked over HTTP to
//! run the binary it was started from, as that file is now. With
//! `--binary`, the request goes through the host: a request file beside the
//! daemon's state file, which only its own user can write, and `SIGUSR2`
//! (an HTTP client never names a program).

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::Value;

use super::http::{Client, Failure, Remote};
use super::output::done;

#[derive(Debug, Args)]
pub struct UpgradeArgs {
    /// The new binary (default: the one the daemon was started from, as the
    /// file is now). Run on the daemon's host, as its user: the request is
    /// a file beside its state file and a signal.
    #[arg(long)]
    binary: Option<PathBuf>,
    /// How long to wait for the daemon to say how the upgrade went.
    #[arg(long, default_value = "5m", value_parser = berth::parse_duration)]
    wait: Duration,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(args: UpgradeArgs) -> ExitCode {
    let json = args.remote.json;
    done(upgrade(&args), json)
}

fn upgrade(args: &UpgradeArgs) -> Result<ExitCode, Failure> {
    let client = Client::new(&args.remote);
    let before = client.get("/api/version")?;
    let since = before["last_event"].as_u64().unwrap_or(0);
    match &args.binary {
        None => {
            client.post("/api/upgrade", None)?;
        }
        Some(binary) => berth::daemon::upgrade::ask(
            before["pid"].as_u64(),
            before["state_file"].as_str(),
            binary,
        )
        .map_err(|e| ("upgrade_refused".to_string(), e))?,
    }
    let event = wait_for_outcome(&client, since, args.wait)?;
    if args.remote.json {
        println!("{event}");
    }
    match event["type"].as_str() {
        Some("upgraded") if event["fell_back"].is_null() => {
            if !args.remote.json {
                let list = |v: &Value| -> Vec<String> {
                    v.as_array()
                        .map(|a| {
                            a.iter()
                                .filter_map(|s| s.as_str().map(str::to_owned))
                                .collect()
                        })
                        .unwrap_or_default()
                };
                println!(
                    "upgraded in place: {} -> {} (pid {} kept); new connections waited {} ms",
                    event["from"].as_str().unwrap_or("?"),
                    event["to"].as_str().unwrap_or("?"),
                    before["pid"],
                    event["held_ms"]
                );
                for kept in list(&event["adopted"]) {
                    println!("  kept {kept}");
                }
                for lost in list(&event["lost"]) {
                    println!("  lost {lost}");
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Some("upgraded") => Err((
            "upgrade_fell_back".into(),
            format!(
                "the new binary could not serve, and the previous one took every worker \
                 back: {}",
                event["fell_back"].as_str().unwrap_or("?")
            ),
        )),
        _ => Err((
            "upgrade_failed".into(),
            format!(
                "berth was not upgraded, nothing changed: {}",
                event["reason"].as_str().unwrap_or("?")
            ),
        )),
    }
}

/// Follows the daemon's events after `since` until the upgrade's outcome:
/// an `upgraded` or `upgrade_failed` event (the log goes on across the
/// exec). While the handover runs, requests wait in the backlog.
fn wait_for_outcome(client: &Client, since: u64, wait: Duration) -> Result<Value, Failure> {
    let deadline = Instant::now() + wait;
    let timed_out = || {
        (
            "timed_out".to_string(),
            format!(
                "the daemon did not say how the upgrade went within {}; see `berth events`",
                berth::format_duration(wait)
            ),
        )
    };
    let client = std::sync::Arc::new(client.clone());
    loop {
        // Each look runs beside the wait, which ends at the deadline
        // however long a look takes (a connection held in the backlog
        // while the handover runs, a slow answer).
        let (tx, rx) = std::sync::mpsc::channel();
        let looker = std::sync::Arc::clone(&client);
        std::thread::spawn(move || {
            let _ = tx.send(outcome_since(&looker, since));
        });
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(Some(event)) => return Ok(event),
            Ok(None) => {}
            Err(_) => return Err(timed_out()),
        }
        if Instant::now() >= deadline {
            return Err(timed_out());
        }
        std::thread::sleep(Duration::from_millis(200).min(deadline - Instant::now()));
    }
}

/// The upgrade's outcome among the events after `since`, if one is there.
fn outcome_since(client: &Client, since: u64) -> Option<Value> {
    let path = format!("/api/events?since={since}&follow=false");
    let reply = client.send("GET", &path, None).ok()?;
    let mut text = String::new();
    let mut body = reply.body;
    body.read_to_string(&mut text).ok()?;
    text.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find(|event| {
            matches!(
                event["type"].as_str(),
                Some("upgraded") | Some("upgrade_failed")
            )
        })
}
