//! The serve loop: hello, then commands until `Shutdown`.
//!
//! Two threads. The main thread reads commands and answers pings at once, so
//! heartbeats flow while a request runs; the executor thread owns the backend
//! and runs loads and requests one at a time, or, for a backend that
//! batches, the requests that arrived while the last batch ran, together;
//! for a backend that steps (a decoder), requests join and leave the running
//! batch between steps. Stats carry a progress counter
//! advanced by the backend itself, which is what tells a supervisor that a
//! worker answering pings is still getting anywhere.

use std::collections::{HashSet, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use berth_protocol::{
    Body, Command, ErrorKind, Event, Hello, LoadInfo, LoadSpec, PROTOCOL_VERSION, RequestId,
    RunInfo, WireError, WorkerStats,
};
use ipc_channel::IpcError;
use ipc_channel::ipc::{self, IpcSender};

use crate::backend::{Backend, Batching, LoadContext, Progress, Registry, RequestContext};
use crate::hygiene;

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
    let mut args = args.into_iter();
    match args.next().as_deref() {
        None => {}
        Some("--version") => {
            println!(
                "berth-worker {} (protocol {PROTOCOL_VERSION})",
                env!("CARGO_PKG_VERSION")
            );
            std::process::exit(0);
        }
        Some("--backends") => {
            println!("{}", registry.names().join("\n"));
            std::process::exit(0);
        }
        Some(other) => {
            eprintln!(
                "berth-worker: unknown argument `{other}` (it takes --version or --backends; \
                 otherwise it is started by the berth supervisor)"
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
    let (jobs, job_rx) = mpsc::channel::<Job>();
    let executor = {
        let events = events.clone();
        let shared = Arc::clone(&shared);
        thread::Builder::new()
            .name("berth-executor".into())
            .spawn(move || execute(&registry, job_rx, &events, &shared))
            .map_err(|e| format!("cannot start the executor thread: {e}"))?
    };

    loop {
        let command = match command_rx.recv() {
            Ok(command) => command,
            // The supervisor dropped its end: it is gone or gave up on us.
            Err(IpcError::Disconnected) => return Err("the supervisor closed the channel".into()),
            // A signal landed during the wait (a grandchild's SIGCHLD, say): not an error.
            Err(IpcError::Io(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("cannot read a command: {e}")),
        };
        match command {
            Command::Ping { seq } => {
                // A failed send means the supervisor is gone; the next recv says so.
                let _ = events.send(Event::Pong {
                    seq,
                    stats: shared.stats(),
                });
            }
            Command::Load(spec) => {
                let _ = jobs.send(Job::Load(spec));
            }
            Command::Request { id, body } => {
                shared.in_flight.fetch_add(1, Ordering::Relaxed);
                let _ = jobs.send(Job::Request { id, body });
            }
            Command::Cancel { id } => {
                shared
                    .cancelled
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id);
            }
            Command::Shutdown => {
                let _ = jobs.send(Job::Shutdown);
                let _ = executor.join();
                return Ok(());
            }
        }
    }
}

fn execute(
    registry: &Registry,
    jobs: mpsc::Receiver<Job>,
    events: &IpcSender<Event>,
    shared: &Shared,
) {
    let mut backend: Option<Box<dyn Backend>> = None;
    // Jobs taken off the channel while gathering a batch that did not join
    // it; they run next, in the order they came.
    let mut held: VecDeque<Job> = VecDeque::new();
    let mut pace = Pace::default();
    loop {
        let job = match held.pop_front() {
            Some(job) => job,
            None => match jobs.recv() {
                Ok(job) => job,
                Err(_) => return,
            },
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
                        Err(e) => Event::LoadFailed(e),
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

/// The batch that ran last: how large, and how long it took.
#[derive(Debug, Clone, Copy, Default)]
struct Pace {
    batch: usize,
    compute: Duration,
}

/// The longest a batch waits for company, and then only under load.
const MAX_LINGER: Duration = Duration::from_millis(2);

/// Adds to `batch` the requests already waiting, within `policy`. A job
/// that does not join (a request over the budget, a shutdown) is held to
/// run next.
///
/// An idle worker never waits. Under load (the last batch held more than
/// one request) it waits a little for the batch to fill to the last one's
/// size: the clients answered by that batch are sending their next
/// requests, and without the wait the next batch would take the one or two
/// that made it and run nearly as long for them as for all. The wait is a
/// twentieth of the last batch's compute time, at most [`MAX_LINGER`].
fn gather(
    backend: &dyn Backend,
    policy: Batching,
    batch: &mut Vec<(RequestId, Body)>,
    jobs: &mpsc::Receiver<Job>,
    held: &mut VecDeque<Job>,
    pace: Pace,
) {
    let max_batch = policy.max_batch.max(1);
    let fill_to = pace.batch.min(max_batch);
    let linger_until =
        (pace.batch > 1).then(|| Instant::now() + (pace.compute / 20).min(MAX_LINGER));
    // Costs are computed only once a second request is there: a lone
    // request pays nothing for batching.
    let mut cost: Option<usize> = None;
    while batch.len() < max_batch {
        let job = match held.pop_front() {
            Some(job) => job,
            None => match jobs.try_recv() {
                Ok(job) => job,
                Err(_) => {
                    let Some(until) = linger_until.filter(|_| batch.len() < fill_to) else {
                        break;
                    };
                    let left = until.saturating_duration_since(Instant::now());
                    match jobs.recv_timeout(left) {
                        Ok(job) => job,
                        Err(_) => break,
                    }
                }
            },
        };
        match job {
            Job::Request { id, body } => {
                let so_far =
                    *cost.get_or_insert_with(|| batch.iter().map(|(_, b)| backend.cost(b)).sum());
                let c = backend.cost(&body);
                if so_far.saturating_add(c) > policy.max_cost {
                    held.push_front(Job::Request { id, body });
                    break;
                }
                cost = Some(so_far + c);
                batch.push((id, body));
            }
            other => {
                held.push_front(other);
                break;
            }
        }
    }
}

/// Runs `batch` (one request or several) and answers each request. Those
/// cancelled while they waited are answered at once and do not run.
fn run_batch(
    backend: &mut dyn Backend,
    batch: Vec<(RequestId, Body)>,
    events: &IpcSender<Event>,
    shared: &Shared,
) -> Pace {
    let mut ids = Vec::with_capacity(batch.len());
    let mut bodies = Vec::with_capacity(batch.len());
    for (id, body) in batch {
        if is_cancelled(shared, id) {
            let e = WireError::new(ErrorKind::Cancelled, "cancelled before it started");
            finish(shared, events, id, Err(e), RunInfo::default());
        } else {
            ids.push(id);
            bodies.push(body);
        }
    }
    if ids.is_empty() {
        return Pace::default();
    }
    let contexts: Vec<RequestContext> = ids
        .iter()
        .map(|id| {
            RequestContext::ipc(
                *id,
                events.clone(),
                Arc::clone(&shared.cancelled),
                shared.progress.clone(),
            )
        })
        .collect();
    let started = Instant::now();
    let results = if ids.len() == 1 {
        let body = bodies.pop().expect("one body");
        vec![guarded(|| backend.handle(body, &contexts[0]))]
    } else {
        let n = ids.len();
        let items: Vec<(Body, &RequestContext)> = bodies.into_iter().zip(&contexts).collect();
        match catch_unwind(AssertUnwindSafe(|| backend.handle_batch(items))) {
            Ok(results) if results.len() == n => results,
            Ok(results) => {
                let e = WireError::new(
                    ErrorKind::Internal,
                    format!(
                        "the backend answered a batch of {n} requests with {} results",
                        results.len()
                    ),
                );
                vec![Err(e); n]
            }
            Err(panic) => vec![Err(panicked(panic)); n],
        }
    };
    let pace = Pace {
        batch: ids.len(),
        compute: started.elapsed(),
    };
    let run = RunInfo {
        batch: ids.len() as u32,
        compute_micros: pace.compute.as_micros() as u64,
    };
    for (id, result) in ids.into_iter().zip(results) {
        finish(shared, events, id, result, run);
    }
    pace
}

/// Continuous batching: begins `first` and every request that arrives
/// while others run (within the backend's batch size and token budget),
/// steps them all together, and answers each as it ends; returns once none
/// is left. A job that is not a request (a shutdown) waits, held, until
/// the running requests have ended; no request begins after it.
fn run_stepping(
    backend: &mut dyn Backend,
    first: (RequestId, Body),
    jobs: &mpsc::Receiver<Job>,
    held: &mut VecDeque<Job>,
    events: &IpcSender<Event>,
    shared: &Shared,
) {
    let policy = backend.batching().unwrap_or(Batching {
        max_batch: 1,
        max_cost: usize::MAX,
    });
    // Request id -> (began at, its cost).
    let mut active: std::collections::HashMap<RequestId, (Instant, usize)> = Default::default();
    let mut next = Some(first);
    let mut blocked = false;
    loop {
        // Admit what waits.
        while !blocked && active.len() < policy.max_batch.max(1) {
            let (id, body) = match next.take() {
                Some(request) => request,
                None => match held.pop_front().or_else(|| jobs.try_recv().ok()) {
                    Some(Job::Request { id, body }) => (id, body),
                    Some(other) => {
                        held.push_front(other);
                        blocked = true;
                        break;
                    }
                    None => break,
                },
            };
            let cost = backend.cost(&body);
            let used: usize = active.values().map(|(_, c)| c).sum();
            if !active.is_empty() && used.saturating_add(cost) > policy.max_cost {
                held.push_front(Job::Request { id, body });
                break;
            }
            if is_cancelled(shared, id) {
                let e = WireError::new(ErrorKind::Cancelled, "cancelled before it started");
                finish(shared, events, id, Err(e), RunInfo::default());
                continue;
            }
            let ctx = RequestContext::ipc(
                id,
                events.clone(),
                Arc::clone(&shared.cancelled),
                shared.progress.clone(),
            );
            let started = Instant::now();
            let Some(stepping) = backend.stepping() else {
                return;
            };
            match guarded(|| stepping.begin(body, ctx)) {
                Ok(()) => {
                    active.insert(id, (started, cost));
                }
                Err(e) => finish(shared, events, id, Err(e), RunInfo::default()),
            }
        }
        if active.is_empty() {
            return;
        }
        let Some(stepping) = backend.stepping() else {
            return;
        };
        let running = active.len() as u32;
        let ended = match catch_unwind(AssertUnwindSafe(|| stepping.step())) {
            Ok(ended) => ended,
            Err(panic) => {
                let e = panicked(panic);
                let _ = catch_unwind(AssertUnwindSafe(|| stepping.abandon()));
                active
                    .keys()
                    .map(|id| (*id, Err(e.clone())))
                    .collect::<Vec<_>>()
            }
        };
        for (id, result) in ended {
            // An id the backend never began, or answered already, is ignored.
            if let Some((started, _)) = active.remove(&id) {
                let run = RunInfo {
                    batch: running,
                    compute_micros: started.elapsed().as_micros() as u64,
                };
                finish(shared, events, id, result, run);
            }
        }
        if stepping.active() == 0 && !active.is_empty() {
            // The backend forgot requests it never answered.
            let e = WireError::new(ErrorKind::Internal, "the backend dropped the request");
            for id in active.drain().map(|(id, _)| id).collect::<Vec<_>>() {
                finish(shared, events, id, Err(e.clone()), RunInfo::default());
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
    let _ = events.send(Event::Done { id, result, run });
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches of up to 3 requests, at most 10 cost; a body's cost is its
    /// length.
    struct Counting;

    impl Backend for Counting {
        fn handle(&mut self, request: Body, _: &RequestContext) -> Result<Body, WireError> {
            Ok(request)
        }
        fn batching(&self) -> Option<Batching> {
            Some(Batching {
                max_batch: 3,
                max_cost: 10,
            })
        }
        fn cost(&self, request: &Body) -> usize {
            request.json.len()
        }
    }

    fn request(id: RequestId, json: &str) -> Job {
        Job::Request {
            id,
            body: Body::json(json),
        }
    }

    /// Gathers for `Counting` as a worker whose last batch was one request.
    fn gather_idle(
        batch: &mut Vec<(RequestId, Body)>,
        rx: &mpsc::Receiver<Job>,
        held: &mut VecDeque<Job>,
    ) {
        let policy = Counting.batching().unwrap();
        gather(&Counting, policy, batch, rx, held, Pace::default());
    }

    fn ids(batch: &[(RequestId, Body)]) -> Vec<RequestId> {
        batch.iter().map(|(id, _)| *id).collect()
    }

    #[test]
    fn a_batch_takes_what_waits_up_to_its_size_and_never_waits_for_more() {
        let (tx, rx) = mpsc::channel();
        let mut held = VecDeque::new();
        for id in 2..=5 {
            tx.send(request(id, "ab")).unwrap();
        }
        let mut batch = vec![(1, Body::json("ab"))];
        gather_idle(&mut batch, &rx, &mut held);
        assert_eq!(ids(&batch), [1, 2, 3]);
        // The rest is still there for the next batch; an empty queue ends
        // the gathering at once.
        let Ok(Job::Request { id, body }) = rx.try_recv() else {
            unreachable!()
        };
        let mut batch = vec![(id, body)];
        gather_idle(&mut batch, &rx, &mut held);
        assert_eq!(ids(&batch), [4, 5]);
        assert!(held.is_empty());
    }

    #[test]
    fn an_idle_worker_never_waits_and_a_busy_one_waits_briefly() {
        let (tx, rx) = mpsc::channel();
        let mut held = VecDeque::new();
        let policy = Counting.batching().unwrap();
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            tx.send(request(2, "b")).unwrap();
        });
        // After a batch of one: nothing waits, so it runs alone at once.
        let started = Instant::now();
        let mut batch = vec![(1, Body::json("a"))];
        gather_idle(&mut batch, &rx, &mut held);
        assert_eq!(ids(&batch), [1]);
        assert!(started.elapsed() < Duration::from_millis(250));
        // After a batch of three that took a second: it waits, but no more
        // than MAX_LINGER, for company that does not come in time.
        let started = Instant::now();
        let busy = Pace {
            batch: 3,
            compute: Duration::from_secs(1),
        };
        let mut batch = vec![(1, Body::json("a"))];
        gather(&Counting, policy, &mut batch, &rx, &mut held, busy);
        assert_eq!(ids(&batch), [1]);
        let waited = started.elapsed();
        assert!(
            waited >= MAX_LINGER && waited < Duration::from_millis(250),
            "{waited:?}"
        );
        late.join().unwrap();
    }

    #[test]
    fn the_cost_budget_and_other_jobs_end_a_batch_and_are_held_in_order() {
        let (tx, rx) = mpsc::channel();
        let mut held = VecDeque::new();
        tx.send(request(2, "12345678")).unwrap(); // 4 + 8 > 10
        tx.send(request(3, "x")).unwrap();
        let mut batch = vec![(1, Body::json("abcd"))];
        gather_idle(&mut batch, &rx, &mut held);
        assert_eq!(ids(&batch), [1]);
        assert!(matches!(held.front(), Some(Job::Request { id: 2, .. })));
        // The held request starts the next batch; a shutdown ends it.
        let Some(Job::Request { id, body }) = held.pop_front() else {
            unreachable!()
        };
        tx.send(Job::Shutdown).unwrap();
        tx.send(request(4, "y")).unwrap();
        let mut batch = vec![(id, body)];
        gather_idle(&mut batch, &rx, &mut held);
        assert_eq!(ids(&batch), [2, 3]);
        assert!(matches!(held.front(), Some(Job::Shutdown)));
    }
}
