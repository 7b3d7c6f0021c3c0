//! `berth events`: follows a running `berth serve`'s events (`/api/events`),
//! one line each (`--json`: each event's JSON), until the daemon stops or
//! the user does. A stream the daemon drops for falling behind is resumed
//! from the last event seen; `--since ID` starts after event `ID`, and
//! `--once` prints the kept events and ends.

use std::io::{BufRead, BufReader};
use std::process::ExitCode;

use berth::mib;
use clap::Args;
use serde_json::Value;

use super::http::{Client, Failure, Remote};
use super::output::{done, say};

#[derive(Debug, Args)]
pub struct EventsArgs {
    /// Start after this event number (0: every event the daemon kept).
    #[arg(long, default_value_t = 0)]
    since: u64,
    /// Print the kept events and end, rather than follow.
    #[arg(long)]
    once: bool,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(args: EventsArgs) -> ExitCode {
    let json = args.remote.json;
    let client = Client::new(&args.remote);
    let mut since = args.since;
    let mut upgrading = false;
    done(
        (|| -> Result<ExitCode, Failure> {
            loop {
                let follow = if args.once { "&follow=false" } else { "" };
                let path = format!("/api/events?since={since}{follow}");
                let reply = client.send("GET", &path, None)?;
                if !(200..300).contains(&reply.status) {
                    return client.finish(reply).map(|_| ExitCode::FAILURE);
                }
                let mut event_name = None;
                let mut resume = false;
                let mut body = BufReader::new(reply.body);
                while let Some(line) = read_line(&mut body)? {
                    if let Some(name) = line.strip_prefix("event: ") {
                        event_name = Some(name.to_string());
                        continue;
                    }
                    let Some(data) = line.strip_prefix("data: ") else {
                        continue;
                    };
                    let value: Value = serde_json::from_str(data).unwrap_or(Value::Null);
                    match event_name.take().as_deref() {
                        Some("dropped") => {
                            eprintln!(
                                "berth: {}; resuming",
                                value["message"].as_str().unwrap_or("")
                            );
                            resume = true;
                            break;
                        }
                        Some(_) => {
                            eprintln!("berth: {}", value["message"].as_str().unwrap_or(data))
                        }
                        None => {
                            since = value["id"].as_u64().unwrap_or(since);
                            say(if json {
                                data.to_string()
                            } else {
                                line_for(&value)
                            });
                            if value["type"] == "server_stopped" {
                                return Ok(ExitCode::SUCCESS);
                            }
                            // An in-place upgrade closes every stream as it
                            // hands over (and any opened meanwhile): the
                            // new binary goes on with the numbers.
                            match value["type"].as_str() {
                                Some("upgrade_started") => upgrading = true,
                                Some("upgraded" | "upgrade_failed") => upgrading = false,
                                _ => {}
                            }
                        }
                    }
                }
                if args.once && !resume {
                    return Ok(ExitCode::SUCCESS);
                }
                if upgrading {
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    continue;
                }
                if !resume {
                    return Err((
                        "unreachable".to_string(),
                        "the daemon closed the event stream".to_string(),
                    ));
                }
            }
        })(),
        json,
    )
}

/// The longest line taken from the stream: an event is one line of JSON
/// (its stderr tail at most 20 lines of 4 KiB); something at `--url` that
/// sends an endless line ends the command instead of filling its memory.
const MAX_LINE: u64 = 1 << 20;

/// The next line, without its newline; `None` at the end of the stream.
fn read_line(body: &mut impl BufRead) -> Result<Option<String>, Failure> {
    let mut line = String::new();
    let n = std::io::Read::take(&mut *body, MAX_LINE)
        .read_line(&mut line)
        .map_err(|e| ("io_error".to_string(), e.to_string()))?;
    if n == 0 {
        return Ok(None);
    }
    if !line.ends_with('\n') && n as u64 == MAX_LINE {
        return Err((
            "bad_stream".to_string(),
            format!("the event stream sent a line longer than {MAX_LINE} bytes"),
        ));
    }
    Ok(Some(line.trim_end_matches(['\n', '\r']).to_string()))
}

/// One event as a line: the time (UTC), its number, its type, its model, and
/// what matters about it.
fn line_for(event: &Value) -> String {
    let ms = event["at_unix_ms"].as_u64().unwrap_or(0);
    let secs = ms / 1000;
    let time = format!(
        "{:02}:{:02}:{:02}.{:03}",
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60,
        ms % 1000
    );
    let kind = event["type"].as_str().unwrap_or("?");
    let model = event["model"].as_str().unwrap_or("-");
    let bytes = |v: &Value| mib(v.as_u64().unwrap_or(0));
    let detail = match kind {
        "loaded" => {
            let r = &event["report"];
            format!(
                "pid {} in {:.0} ms, rss {}",
                r["pid"],
                r["load_ms"].as_f64().unwrap_or(0.0),
                bytes(&r["rss_bytes"])
            )
        }
        "unloaded" => {
            let r = &event["report"];
            format!(
                "pid {} stopped, reclaimed {} of rss {}, {} processes left over",
                r["pid"],
                bytes(&r["reclaimed_bytes"]),
                bytes(&r["rss_at_stop_bytes"]),
                r["leftover_processes"]
            )
        }
        "slept" => {
            let r = &event["report"];
            format!(
                "pid {}: GPU {} -> {} (NVML), rss {} -> {}, in {:.0} ms",
                r["pid"],
                bytes(&r["vram_before_bytes"]),
                bytes(&r["vram_after_bytes"]),
                bytes(&r["rss_before_bytes"]),
                bytes(&r["rss_after_bytes"]),
                r["checkpoint_ms"].as_f64().unwrap_or(0.0)
            )
        }
        "woke" => {
            let r = &event["report"];
            format!(
                "pid {}: GPU {} back in {:.0} ms ({})",
                r["pid"],
                bytes(&r["vram_bytes"]),
                r["restore_ms"].as_f64().unwrap_or(0.0),
                r["reason"].as_str().unwrap_or("")
            )
        }
        "sleep_failed" => format!(
            "{}: {}; {}",
            event["step"].as_str().unwrap_or("?"),
            event["error"].as_str().unwrap_or(""),
            event["fallback"].as_str().unwrap_or("")
        ),
        "crashed" => event["description"].as_str().unwrap_or("").to_string(),
        "memory_limit_exceeded" => format!(
            "pid {}: peak {} over its limit of {}",
            event["pid"],
            bytes(&event["peak_bytes"]),
            bytes(&event["limit_bytes"])
        ),
        "evicted" => match event["for_model"].as_str() {
            Some(other) => format!("to make room for `{other}`"),
            None => "loaded models passed the memory or GPU budget".to_string(),
        },
        "swap_completed" => {
            let r = &event["report"];
            if r["old_pid"].is_null() {
                "spec updated (nothing was running)".to_string()
            } else {
                format!("pid {} -> {}", r["old_pid"], r["new_pid"])
            }
        }
        "recycled" => format!("pid {} -> {}", event["old_pid"], event["new_pid"]),
        "recycling" => event["why"].as_str().unwrap_or("").to_string(),
        "restarting" => format!("in {} ms", event["in_ms"]),
        "restarted" => format!("pid {}", event["pid"]),
        "hang_detected" => format!("pid {}: {}", event["pid"], event["cause"]),
        "quarantined" => format!("{} requests", event["requests"]),
        "load_failed" | "swap_rolled_back" | "recycle_failed" => {
            event["error"].as_str().unwrap_or("").to_string()
        }
        "failed" => event["reason"].as_str().unwrap_or("").to_string(),
        "warning" => format!(
            "pid {}: {}",
            event["pid"],
            event["message"].as_str().unwrap_or("")
        ),
        "gpu_budget_overrun" => event["message"].as_str().unwrap_or("").to_string(),
        "server_started" => format!(
            "berth {} on {}",
            event["version"].as_str().unwrap_or("?"),
            event["listen"].as_str().unwrap_or("?")
        ),
        "config_reloaded" => {
            match serde_json::from_value::<berth::ReloadReport>(event["report"].clone()) {
                Ok(report) => format!("{} ({})", report, event["trigger"].as_str().unwrap_or("")),
                Err(_) => event["report"].to_string(),
            }
        }
        "upgrade_started" => format!(
            "{}: to {}",
            event["trigger"].as_str().unwrap_or(""),
            event["binary"].as_str().unwrap_or("?")
        ),
        "upgrade_failed" => format!(
            "{}: {}",
            event["binary"].as_str().unwrap_or("?"),
            event["reason"].as_str().unwrap_or("")
        ),
        "upgraded" => {
            let list = |v: &serde_json::Value| v.as_array().map_or(0, Vec::len);
            let mut line = format!(
                "{} -> {}: {} workers kept, {} lost, connections held {} ms",
                event["from"].as_str().unwrap_or("?"),
                event["to"].as_str().unwrap_or("?"),
                list(&event["adopted"]),
                list(&event["lost"]),
                event["held_ms"]
            );
            if let Some(why) = event["fell_back"].as_str() {
                line.push_str(&format!(
                    " (the new binary gave up, the old one serves: {why})"
                ));
            }
            line
        }
        "config_rejected" => format!(
            "{}: {}",
            event["trigger"].as_str().unwrap_or(""),
            event["error"].as_str().unwrap_or("")
        ),
        _ => String::new(),
    };
    format!(
        "{time} {:>6} {kind:<22} {model:<16} {detail}",
        format!("#{}", event["id"])
    )
    .trim_end()
    .to_string()
}
