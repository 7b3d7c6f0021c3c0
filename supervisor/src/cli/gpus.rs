//! `berth gpus`: each device's memory and berth's workers on it, as a
//! table. Its own file so the table's columns live with the command that
//! prints them.

use std::process::ExitCode;

use berth::mib;

use super::http::{Client, Remote};
use super::output::{SIZE_WIDTH as W, done, list_or_dash};

/// `berth gpus`: each device's memory and berth's workers on it.
pub fn run(remote: Remote) -> ExitCode {
    let json = remote.json;
    done(
        Client::new(&remote).get("/api/gpus").map(|value| {
            if json {
                println!("{value}");
                return ExitCode::SUCCESS;
            }
            let status: berth::gpu::GpuStatus = match serde_json::from_value(value.clone()) {
                Ok(status) => status,
                Err(_) => {
                    println!("{value}");
                    return ExitCode::SUCCESS;
                }
            };
            if let Some(reason) = &status.unavailable {
                println!("no GPU: {reason}");
                return ExitCode::SUCCESS;
            }
            println!(
                "{:<4} {:<28} {:>W$} {:>W$} {:>W$} {:>W$}  PROCESSES",
                "GPU", "NAME", "TOTAL", "USED", "FREE", "BERTH"
            );
            for d in &status.devices {
                let processes: Vec<String> = d
                    .processes
                    .iter()
                    .map(|p| {
                        format!(
                            "{} {} ({})",
                            p.pid,
                            p.model.as_deref().unwrap_or("not berth's"),
                            mib(p.bytes)
                        )
                    })
                    .collect();
                println!(
                    "{:<4} {:<28} {:>W$} {:>W$} {:>W$} {:>W$}  {}",
                    d.index,
                    d.name,
                    mib(d.total_bytes),
                    mib(d.used_bytes),
                    mib(d.free_bytes),
                    mib(d.berth_bytes),
                    list_or_dash(&processes, ", "),
                );
            }
            ExitCode::SUCCESS
        }),
        json,
    )
}
