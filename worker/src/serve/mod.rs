//! The serve loop: hello, then commands until `Shutdown`.
//!
//! Two threads. The executor thread owns the backend and runs loads and
//! requests one at a time, or, for a backend that batches, the requests
//! that arrived while the last batch ran, together; for a backend that
//! steps (a decoder), requests join and leave the running batch between
//! steps. While idle it reads the commands itself; while a job keeps it
//! away, the main thread (the watch) reads them, so heartbeats flow while a
//! request runs ([`duty`]). Stats carry a progress counter advanced by the
//! backend itself, which is what tells a supervisor that a worker answering
//! pings is still getting anywhere.

use std::collections::{HashSet, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Instant;

use berth_protocol::{
    Body, Command, ErrorKind, Event, Hello, LoadInfo, LoadSpec, PROTOCOL_VERSION, RequestId,
    RunInfo, WireError, WorkerStats,
};
use ipc_channel::ipc::{self, IpcSender};

use crate::backend::{Backend, LoadContext, Progress, Registry};
use crate::hygiene;

mod batch;
mod duty;

use batch::{Pace, gather, run_batch, run_stepping};
use duty::{Duty, Inbox};

/// Runs a worker process: call it from `main` with the backends this binary
/// offers. Never returns; the process exits 0 after `Shutdown`.
///
/// Arguments: `--version` and `--backends` print what they say and exit; any
/// other argument is refused (the supervisor passes none).
pub fn serve(registry: Registry) -> ! {
    serve_with_args(registry, std::env::args().skip(1))
}

/// [`serve`] with the worker's own arguments given: for a program that is a
/// worker in one of its roles (`berth worker`), which passes what follows
/// the role's name.
pub fn serve_with_args(registry: Registry, args: impl IntoIterator<Item = String>) -> ! {
    crate::kernels::keep_loader();
    let mut args = args.into_iter();
    match args.next().as_deref() {
        None => {}
        Some("--version") => {
            let cuda = if cfg!(feature = "cuda") {
                format!(
                    "; CUDA, {} of candle's kernel modules as machine code",
                    crate::kernels::fat_binaries().len()
                )
            } else {
                String::new()
            };
            println!(
                "berth-worker {} (protocol {PROTOCOL_VERSION}{cuda})",
                env!("CARGO_PKG_VERSION")
            );
            std::process::exit(0);
        }
        Some("--backends") => {
            println!("{}", registry.backends_lines());
            std::process::exit(0);
        }
        Some("--compare-devices") => std::process::exit(compare_devices(args)),
        Some("--checkpoint") => std::process::exit(crate::checkpoint::main(args)),
        Some(other) => {
            eprintln!(
                "berth-worker: unknown argument `{other}` (it takes --version, --backends, \
                 --compare-devices or --checkpoint; otherwise it is started by the berth supervisor)"
            );
            std::process::exit(2);
        }
    }
    let boot = match hygiene::start() {
        Ok(boot) => boot,
        Err(msg) => {
            eprintln!("berth-worker: {msg}");
            std::process::exit(2);
        }
    };
    match run(registry, &boot.server_name) {
        Ok(()) => std::process::exit(0),
        Err(msg) => {
            eprintln!("berth-worker: {msg}");
            std::process::exit(1);
        }
    }
}

/// `--compare-devices FILE [--device cuda:N] [--steps N] [--prompt TEXT]`:
/// `generate`'s logits on the CPU against another device's on a GGUF file,
/// as JSON (`backends/generate/compare.rs`). The exit status.
fn compare_devices(mut args: impl Iterator<Item = String>) -> i32 {
    let usage = "usage: berth-worker --compare-devices FILE.gguf [--device cuda:N] [--steps N] \
                 [--prompt TEXT]";
    let Some(file) = args.next() else {
        eprintln!("{usage}");
        return 2;
    };
    let (mut device, mut steps, mut prompt) = ("cuda:0".to_string(), 32usize, None);
    while let Some(flag) = args.next() {
        let value = args.next();
        match (flag.as_str(), value) {
            ("--device", Some(v)) => device = v,
            ("--steps", Some(v)) if v.parse::<usize>().is_ok() => steps = v.parse().unwrap_or(32),
            ("--prompt", Some(v)) => prompt = Some(v),
            _ => {
                eprintln!("{usage}");
                return 2;
            }
        }
    }
    let other = match device.as_str() {
        "cpu" => Ok(candle_core::Device::Cpu),
        d => d
            .strip_prefix("cuda")
            .map(|n| n.strip_prefix(':').unwrap_or("0"))
            .and_then(|n| n.parse::<usize>().ok())
            .ok_or_else(|| format!("device `{d}` is not `cpu` or `cuda:N`"))
            .and_then(|n| {
                candle_core::Device::new_cuda(n).map_err(|e| format!("cannot open `{d}`: {e}"))
            }),
    };
    let prompt = prompt.unwrap_or_else(|| "Write a short story about a lighthouse keeper.".into());
    match other.and_then(|other| {
        crate::backends::generate::compare_devices(
            std::path::Path::new(&file),
            &prompt,
            steps,
            &other,
        )
    }) {
        Ok(report) => {
            println!("{report}");
            0
        }
        Err(e) => {
            eprintln!("berth-worker: {e}");
            1
        }
    }
}

/// State shared by the command thread and the executor.
#[derive(Default)]
struct Shared {
    cancelled: Arc<Mutex<HashSet<RequestId>>>,
    progress: Progress,
    requests_done: AtomicU64,
    in_flight: AtomicU32,
}

impl Shared {
    fn stats(&self) -> WorkerStats {
        let (rss_bytes, peak_rss_bytes) = crate::stats::self_memory();
        WorkerStats {
            rss_bytes,
            peak_rss_bytes,
            progress: self.progress.get(),
            requests_done: self.requests_done.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
        }
    }
}

enum Job {
    Load(LoadSpec),
    Request { id: RequestId, body: Body },
    Shutdown,
}

fn run(registry: Registry, server_name: &str) -> Result<(), String> {
    let events: IpcSender<Event> = IpcSender::connect(server_name.to_string())
        .map_err(|e| format!("cannot connect to the supervisor at {server_name}: {e}"))?;
    let (commands, command_rx) =
        ipc::channel::<Command>().map_err(|e| format!("cannot create the command channel: {e}"))?;
    events
        .send(Event::Hello(Hello {
            protocol_version: PROTOCOL_VERSION,
            pid: std::process::id(),
            worker_version: env!("CARGO_PKG_VERSION").to_string(),
            backends: registry.names(),
            commands,
        }))
        .map_err(|e| format!("cannot send the hello: {e}"))?;

    let shared = Arc::new(Shared::default());
    let (duty, inbox) = Duty::new(command_rx, events.clone(), Arc::clone(&shared));
    {
        let events = events.clone();
        let shared = Arc::clone(&shared);
        thread::Builder::new()
            .name("berth-executor".into())
            .spawn(move || {
                match catch_unwind(AssertUnwindSafe(|| {
                    execute(&registry, inbox, &events, &shared)
                })) {
                    // The backend has shut down: the worker's work is done,
                    // whatever the watch is waiting for.
                    Ok(()) => std::process::exit(0),
                    // Backend code outside a request's guard (`describe`,
                    // `stepping`, `shutdown`) panicked: a worker that answers
                    // heartbeats and never serves again would be worse than
                    // a crash the supervisor sees and restarts.
                    Err(_) => {
                        eprintln!("berth-worker: the executor thread panicked; exiting");
                        std::process::exit(101);
                    }
                }
            })
            .map_err(|e| format!("cannot start the executor thread: {e}"))?;
    }
    // Reads for the executor whenever a job keeps it from the channel;
    // after a shutdown, until the executor exits the process.
    duty.watch()
}

/// Runs jobs until a shutdown, which it runs last.
fn execute(registry: &Registry, jobs: Inbox, events: &IpcSender<Event>, shared: &Shared) {
    let mut backend: Option<Box<dyn Backend>> = None;
    // Jobs taken off the channel while gathering a batch that did not join
    // it; they run next, in the order they came.
    let mut held: VecDeque<Job> = VecDeque::new();
    let mut pace = Pace::default();
    loop {
        let job = match held.pop_front() {
            Some(job) => {
                jobs.busy();
                job
            }
            None => jobs.next(),
        };
        match job {
            Job::Load(spec) => {
                let event = if backend.is_some() {
                    Event::LoadFailed(WireError::new(
                        ErrorKind::Internal,
                        format!(
                            "model `{}`: this worker has already loaded a model",
                            spec.name
                        ),
                    ))
                } else {
                    let started = Instant::now();
                    let ctx = LoadContext::new(shared.progress.clone());
                    match guarded(|| registry.load(&spec, &ctx)) {
                        Ok(loaded) => {
                            let details = loaded.describe().to_string();
                            let max_batch = loaded
                                .batching()
                                .map_or(1, |b| b.max_batch.clamp(1, u32::MAX as usize) as u32);
                            backend = Some(loaded);
                            Event::Loaded(LoadInfo {
                                details,
                                load_micros: started.elapsed().as_micros() as u64,
                                max_batch,
                            })
                        }
                        Err(e) => Event::LoadFailed(without_trace(e)),
                    }
                };
                let _ = events.send(event);
            }
            Job::Request { id, body } => {
                let Some(b) = backend.as_mut() else {
                    finish(
                        shared,
                        events,
                        id,
                        Err(WireError::new(ErrorKind::NotLoaded, "no model is loaded")),
                        RunInfo::default(),
                    );
                    continue;
                };
                if b.stepping().is_some() {
                    run_stepping(&mut **b, (id, body), &jobs, &mut held, events, shared);
                    continue;
                }
                let mut batch = vec![(id, body)];
                if let Some(policy) = b.batching() {
                    gather(&**b, policy, &mut batch, &jobs, &mut held, pace);
                }
                pace = run_batch(&mut **b, batch, events, shared);
            }
            Job::Shutdown => {
                if let Some(b) = backend.as_mut() {
                    b.shutdown();
                }
                return;
            }
        }
    }
}

/// Answers request `id` and forgets it.
fn finish(
    shared: &Shared,
    events: &IpcSender<Event>,
    id: RequestId,
    result: Result<Body, WireError>,
    run: RunInfo,
) {
    shared
        .cancelled
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
    shared.in_flight.fetch_sub(1, Ordering::Relaxed);
    shared.requests_done.fetch_add(1, Ordering::Relaxed);
    let result = result.map_err(without_trace);
    let _ = events.send(Event::Done { id, result, run });
}

/// An error for the supervisor without the backtrace it may carry (candle's
/// errors do when `RUST_BACKTRACE` is set): the trace names build paths and
/// goes to stderr, which is the supervisor's log, not to the client.
fn without_trace(error: WireError) -> WireError {
    let (error, trace) = error.split_trace();
    if let Some(trace) = trace {
        eprintln!("berth-worker: {}\n{}", error.message, trace.trim_start());
    }
    error
}

fn is_cancelled(shared: &Shared, id: RequestId) -> bool {
    shared
        .cancelled
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&id)
}

/// Turns a panic in backend code into an error for this one call.
fn guarded<T>(f: impl FnOnce() -> Result<T, WireError>) -> Result<T, WireError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| Err(panicked(panic)))
}

fn panicked(panic: Box<dyn std::any::Any + Send>) -> WireError {
    let msg = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    WireError::new(ErrorKind::Internal, format!("the backend panicked: {msg}"))
}
