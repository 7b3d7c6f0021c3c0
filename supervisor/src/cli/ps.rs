//! `berth ps`: the models a running `berth serve` has loaded, as a table.
//! Its own file so the table's columns live with the command that prints
//! them.

use std::process::ExitCode;
use std::time::Duration;

use berth::{ModelState, ModelStatus, PreloaderStatus, WorkerStart, mib};

use super::http::{Client, Remote};
use super::output::{SIZE_WIDTH as W, done, list_or_dash};

pub fn run(remote: Remote) -> ExitCode {
    let json = remote.json;
    done(
        Client::new(&remote).get("/api/ps").map(|value| {
            if json {
                println!("{value}");
                return ExitCode::SUCCESS;
            }
            let models: Vec<ModelStatus> =
                serde_json::from_value(value["models"].clone()).unwrap_or_default();
            let preloaders: Vec<PreloaderStatus> =
                serde_json::from_value(value["preloaders"].clone()).unwrap_or_default();
            // GPU columns only where a model is on one; what a worker owns
            // and how it began only where one of a preloading kind is.
            let gpu = models
                .iter()
                .any(|m| m.vram_bytes.is_some() || !m.gpus.is_empty());
            let warm = !preloaders.is_empty()
                || models
                    .iter()
                    .any(|m| !matches!(m.start, None | Some(WorkerStart::Cold)));
            let mut header = format!(
                "{:<16} {:<10} {:>8} {:<9} {:>W$} {:>W$}",
                "NAME", "BACKEND", "PID", "STATE", "RSS", "PEAK"
            );
            if warm {
                header += &format!(" {:>W$} {:<6}", "OWN", "START");
            }
            if gpu {
                header += &format!(" {:>W$} {:<5}", "VRAM", "GPU");
            }
            println!(
                "{header} {:>9} {:>9} {:>9} {:>6} {:>15}  UNTIL",
                "UPTIME", "REQUESTS", "IN FLIGHT", "BATCH", "QUEUE/COMPUTE"
            );
            let mut warnings = Vec::new();
            for m in models {
                warnings.extend(
                    m.warnings
                        .iter()
                        .map(|w| format!("{}: {}", m.name, w.message)),
                );
                // A keep-alive counts down only on a model that serves.
                let until = match m.keep_alive_left_s {
                    _ if m.state != ModelState::Ready => "-".to_string(),
                    None => "forever".to_string(),
                    Some(s) => format!(
                        "{} from now",
                        berth::format_duration(Duration::from_secs(s as u64))
                    ),
                };
                let mut line = format!(
                    "{:<16} {:<10} {:>8} {:<9} {:>W$} {:>W$}",
                    m.name,
                    m.backend,
                    m.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                    match (m.state, m.queue_position) {
                        (ModelState::Queued, Some(0)) => "room...".to_string(),
                        (ModelState::Queued, Some(place)) => format!("queued#{place}"),
                        _ if m.waiting > 0 => format!("{}+{}w", m.state, m.waiting),
                        _ => m.state.to_string(),
                    },
                    mib(m.rss_bytes),
                    mib(m.peak_rss_bytes),
                );
                if warm {
                    let start = match &m.start {
                        None => "-",
                        Some(WorkerStart::Cold) => "cold",
                        Some(WorkerStart::Forked { .. }) => "forked",
                        Some(WorkerStart::ColdFallback { .. }) => "cold!",
                    };
                    line += &format!(" {:>W$} {start:<6}", mib(m.private_bytes));
                }
                if gpu {
                    let gpus: Vec<String> = m.gpus.iter().map(u32::to_string).collect();
                    line += &format!(
                        " {:>W$} {:<5}",
                        m.vram_bytes.map(mib).unwrap_or_else(|| "-".into()),
                        list_or_dash(&gpus, ","),
                    );
                }
                // Mean batch size, and mean queueing vs compute per request.
                let b = &m.batching;
                let batch = b
                    .mean_batch_size
                    .map_or_else(|| "-".into(), |x| format!("{x:.1}"));
                let split = match (b.mean_queue_ms, b.mean_compute_ms) {
                    (Some(q), Some(c)) => format!("{q:.1}/{c:.1} ms"),
                    _ => "-".into(),
                };
                println!(
                    "{line} {:>9} {:>9} {:>9} {batch:>6} {split:>15}  {until}",
                    berth::format_duration(Duration::from_secs(m.uptime_s as u64)).to_string(),
                    m.requests,
                    m.in_flight,
                );
            }
            for warning in warnings {
                println!("warning: {warning}");
            }
            print_preloaders(&preloaders);
            print_peers(&value["peers"]);
            ExitCode::SUCCESS
        }),
        json,
    )
}

/// The preloaded interpreters, under the models: what each costs while it
/// waits, and why a kind starts cold (`cold!` above).
fn print_preloaders(preloaders: &[PreloaderStatus]) {
    if preloaders.is_empty() {
        return;
    }
    println!(
        "\n{:<16} {:>8} {:<8} {:>W$} {:>W$} {:>9} {:>6}  UNTIL",
        "PRELOADER", "PID", "STATE", "RSS", "OWN", "IMPORT", "FORKS"
    );
    for p in preloaders {
        let until = match (p.state.as_str(), p.keep_alive_left_s) {
            ("ready", None) => "while its models are loaded".to_string(),
            ("ready", Some(s)) => format!(
                "{} from now",
                berth::format_duration(Duration::from_secs(s as u64))
            ),
            _ => p.reason.clone().unwrap_or_default(),
        };
        let until = match p.spare_pid {
            Some(spare) => format!("{until}; a spare worker (pid {spare}) waits for the next load"),
            None => until,
        };
        println!(
            "{:<16} {:>8} {:<8} {:>W$} {:>W$} {:>9} {:>6}  {until}",
            p.kind,
            p.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
            p.state,
            mib(p.rss_bytes),
            mib(p.private_bytes),
            format!("{:.0} ms", p.import_ms),
            p.forks,
        );
    }
}

/// The peers (a llama-swap file's): where each is, what it serves; their
/// models run on another server, so there is no process or memory to show.
fn print_peers(peers: &serde_json::Value) {
    let Some(peers) = peers.as_array().filter(|p| !p.is_empty()) else {
        return;
    };
    println!("\n{:<16} {:<40} MODELS", "PEER", "URL");
    for p in peers {
        let models: Vec<&str> = p["models"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m.as_str())
            .collect();
        println!(
            "{:<16} {:<40} {}",
            p["peer"].as_str().unwrap_or("?"),
            p["url"].as_str().unwrap_or("?"),
            models.join(", ")
        );
    }
    println!(
        "(a peer's models are served by another server: berth runs no process for them, so \
         there is nothing here to load, unload or measure)"
    );
}
