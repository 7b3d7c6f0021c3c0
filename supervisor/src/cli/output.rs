//! Terminal output the client commands share: the progress indicator, table
//! cells, a reply printed as JSON or as text, and the one way a command
//! ends (its exit code, or its failure printed by [`super::fail`]). Kept
//! apart so every command looks and fails the same way.

use std::io::IsTerminal;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::http::Failure;

/// The width of a size column: fits [`berth::mib`] up to 976 GiB
/// (`999999.9 MiB`), so a table stays aligned on the largest GPUs.
pub(super) const SIZE_WIDTH: usize = 12;

/// A table cell holding a list: its items joined by `separator`, or `-`.
pub(super) fn list_or_dash(items: &[String], separator: &str) -> String {
    if items.is_empty() {
        "-".into()
    } else {
        items.join(separator)
    }
}

/// Shows elapsed time on a terminal while something takes more than a moment.
pub(super) struct Progress {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    pub(super) fn start(what: String) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let thread = std::io::stderr().is_terminal().then(|| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut shown = false;
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if started.elapsed() > Duration::from_millis(500) {
                        eprint!("\r{what}… {:.1}s", started.elapsed().as_secs_f64());
                        shown = true;
                    }
                }
                if shown {
                    eprint!("\r\x1b[2K");
                }
            })
        });
        Progress { done, thread }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Prints a reply: the daemon's JSON with `--json`, else as the report `T`
/// it holds (or the JSON, if it holds none).
pub(super) fn report<T: serde::de::DeserializeOwned + std::fmt::Display>(
    value: Value,
    json: bool,
) -> ExitCode {
    if json {
        println!("{value}");
        return ExitCode::SUCCESS;
    }
    match serde_json::from_value::<T>(value.clone()) {
        Ok(report) => println!("{report}"),
        Err(_) => println!("{value}"),
    }
    ExitCode::SUCCESS
}

/// Ends a command: its exit code, or its failure printed.
pub(super) fn done(result: Result<ExitCode, Failure>, json: bool) -> ExitCode {
    result.unwrap_or_else(|(code, message)| super::fail(&code, &message, json))
}

/// Prints `text` and a newline on stdout; a reader that went away
/// (`berth run ... | head`) ends the command quietly, its workers with it
/// (they die with their parent), rather than panicking in `println!`.
pub(super) fn say(text: impl std::fmt::Display) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
    }
}
