//! `WorkerHandle`: a typed handle on one running worker.
//!
//! A reader routes each event straight to whoever waits for it: chunks and
//! results to the request's own channel (found by id in the pending map),
//! pongs to a watch, load results to the control channel. On `ipc-channel`
//! it is a plain thread blocked in `recv()` (measured on a 2-core VM this
//! beats every async alternative tried); on the stream wire, a task woken
//! by the reactor.
//!
//! When the worker dies, every pending request fails at once with the exit
//! status and the last lines of stderr; nothing waits for a time-out.
//!
//! Beside this file: `calls` (what is sent to the worker: its load, its
//! requests, heartbeats), `memory` (what the supervisor reads of the
//! worker's memory), `response` (one request's answer as its caller reads
//! it), `in_flight` (the count a drain waits on), `spin` (the answer's
//! busy wait) and `handover` (what an in-place upgrade reads of it).

mod calls;
mod handover;
mod in_flight;
mod memory;
mod response;
pub(crate) mod spin;

use in_flight::InFlight;
pub(crate) use in_flight::InFlightToken;

pub use response::{Piece, ResponseStream};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_protocol::{Body, Command, Event, LoadInfo, WorkerStats};
use nix::sys::signal::Signal;
use tokio::sync::{mpsc, watch};

use crate::base::KillCause;
use crate::child::death::Death;
use crate::child::handshake::Accepted;
use crate::child::inbox::Inbox;
use crate::child::link::{Events, Link, WireFds};
use crate::child::memory::ProcessMemory;
use crate::child::process::ProcessWatch;
use crate::child::routes::{Dispatch, Routes};
use crate::child::upstream::Upstream;
use crate::error::{Error, Result};
use crate::report::ExitStatus;

/// What identifies a request for quarantine: its JSON and the shape of its bulk part.
pub(crate) fn body_hash(body: &Body) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    body.json.hash(&mut h);
    let bulk = body.bulk_bytes();
    bulk.len().hash(&mut h);
    bulk[..bulk.len().min(4096)].hash(&mut h);
    bulk[bulk.len().saturating_sub(4096)..].hash(&mut h);
    h.finish()
}

/// Memory as the supervisor sees it, plus what the worker reported.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryState {
    pub last: ProcessMemory,
    pub worker_stats: WorkerStats,
    pub sampled_at: Option<Instant>,
}

/// A running worker process and the channel to it.
pub struct WorkerHandle {
    model: String,
    backend: String,
    pid: u32,
    worker_version: String,
    commands: Link,
    routes: Arc<Routes>,
    process: Arc<ProcessWatch>,
    control: tokio::sync::Mutex<mpsc::UnboundedReceiver<Event>>,
    pongs: watch::Receiver<Option<(u64, WorkerStats)>>,
    reader_done: watch::Receiver<bool>,
    next_seq: AtomicU64,
    started_at: Instant,
    requests: AtomicU64,
    in_flight: Arc<InFlight>,
    /// How long this worker's last answer took (whether callers spin).
    answer_time: Arc<spin::AnswerTime>,
    memory: Mutex<MemoryState>,
    /// An HTTP server's tree as last read by a memory sample (never read
    /// from procfs on the way to it, so it may be taken under the state
    /// lock): the pids whose GPU memory counts as the model's.
    tree_seen: Mutex<Vec<u32>>,
    load_info: Mutex<Option<LoadInfo>>,
    /// Resident memory right after load: the base of the per-request trend.
    baseline_rss: AtomicU64,
    load_micros: AtomicU64,
    died_tx: watch::Sender<Option<Arc<Death>>>,
    /// For a model served by an HTTP server: how it is reached. Its
    /// commands, routes and pongs are then unused.
    upstream: Option<Arc<Upstream>>,
    /// What an in-place upgrade hands over of its wire.
    wire_fds: WireFds,
    /// A stream worker's inbound side, which a caller spinning for its
    /// answer reads too.
    inbox: Option<Arc<Inbox>>,
    /// Put to sleep (its processes locked by the driver): no heartbeat or
    /// health check is sent, and a stop kills it.
    asleep: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for WorkerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerHandle")
            .field("model", &self.model)
            .field("backend", &self.backend)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

/// What an HTTP server's model shows as its backend.
pub const HTTP_BACKEND: &str = "http";

/// What a worker's handle and an HTTP server's are built from differently.
struct Wiring {
    backend: String,
    worker_version: String,
    commands: Link,
    routes: Arc<Routes>,
    control: mpsc::UnboundedReceiver<Event>,
    pongs: watch::Receiver<Option<(u64, WorkerStats)>>,
    reader_done: watch::Receiver<bool>,
    answer_time: Arc<spin::AnswerTime>,
    upstream: Option<Arc<Upstream>>,
    wire_fds: WireFds,
    inbox: Option<Arc<Inbox>>,
}

impl WorkerHandle {
    /// Wraps a worker that has said hello: starts its reader and the task
    /// that fails its requests when it dies.
    pub(crate) fn new(
        model: &str,
        backend: &str,
        process: Arc<ProcessWatch>,
        (events, link, hello): Accepted,
        wire_fds: WireFds,
        started_at: Instant,
        (max_response, answer_spin): (u64, Duration),
    ) -> Result<Arc<Self>> {
        let routes = Arc::new(Routes::new(max_response));
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        let (pong_tx, pongs) = watch::channel(None);
        let (done_tx, reader_done) = watch::channel(false);
        let answer_time = Arc::new(spin::AnswerTime::new(answer_spin));
        let mut stream_inbox = None;
        let dispatch = Dispatch {
            model: model.to_string(),
            routes: Arc::clone(&routes),
            commands: link.clone(),
            control: control_tx,
            pongs: pong_tx,
            max_response,
            process: Arc::clone(&process),
            answer_time: Arc::clone(&answer_time),
        };
        match events {
            Events::Ipc(receiver) => {
                std::thread::Builder::new()
                    .name(format!("berth-reader-{}", hello.pid))
                    .spawn(move || {
                        dispatch.read_ipc(&receiver);
                        let _ = done_tx.send(true);
                    })
                    .map_err(|source| Error::Io {
                        model: model.to_string(),
                        what: "cannot start the reader thread",
                        source,
                    })?;
            }
            Events::Stream(reader) => {
                let inbox = Inbox::new(reader, dispatch);
                let reading = Arc::clone(&inbox);
                tokio::spawn(async move {
                    reading.read().await;
                    let _ = done_tx.send(true);
                });
                stream_inbox = Some(inbox);
            }
        }
        Ok(Self::assemble(
            model,
            process,
            started_at,
            Wiring {
                backend: backend.to_string(),
                worker_version: hello.worker_version,
                commands: link,
                routes,
                control: control_rx,
                pongs,
                reader_done,
                answer_time,
                upstream: None,
                wire_fds,
                inbox: stream_inbox,
            },
        ))
    }

    /// Wraps an HTTP server that answered its health check.
    pub(crate) fn upstream(
        model: &str,
        process: Arc<ProcessWatch>,
        upstream: Arc<Upstream>,
        started_at: Instant,
    ) -> Arc<Self> {
        let (_, pongs) = watch::channel(None);
        let (_, control) = mpsc::unbounded_channel();
        Self::assemble(
            model,
            process,
            started_at,
            Wiring {
                backend: HTTP_BACKEND.to_string(),
                worker_version: format!("HTTP server at {}", upstream.address()),
                commands: Link::None,
                routes: Arc::new(Routes::new(0)),
                control,
                pongs,
                reader_done: watch::channel(true).1,
                answer_time: Arc::new(spin::AnswerTime::new(Duration::ZERO)),
                upstream: Some(upstream),
                wire_fds: WireFds::default(),
                inbox: None,
            },
        )
    }

    /// The handle over `wiring` (what differs between a worker and an HTTP
    /// server), its counters and readings fresh, its death watched.
    fn assemble(
        model: &str,
        process: Arc<ProcessWatch>,
        started_at: Instant,
        w: Wiring,
    ) -> Arc<Self> {
        let handle = Arc::new(WorkerHandle {
            model: model.to_string(),
            backend: w.backend,
            pid: process.pid(),
            worker_version: w.worker_version,
            commands: w.commands,
            routes: w.routes,
            process,
            control: tokio::sync::Mutex::new(w.control),
            pongs: w.pongs,
            reader_done: w.reader_done,
            next_seq: AtomicU64::new(1),
            started_at,
            requests: AtomicU64::new(0),
            in_flight: Arc::default(),
            answer_time: w.answer_time,
            memory: Mutex::default(),
            tree_seen: Mutex::default(),
            load_info: Mutex::default(),
            baseline_rss: AtomicU64::new(0),
            load_micros: AtomicU64::new(0),
            died_tx: watch::channel(None).0,
            upstream: w.upstream,
            wire_fds: w.wire_fds,
            inbox: w.inbox,
            asleep: std::sync::atomic::AtomicBool::new(false),
        });
        handle.watch_death();
        handle
    }

    /// The death watch: once the process is reaped and its last events and
    /// stderr lines are in, fail whatever is still pending.
    fn watch_death(self: &Arc<Self>) {
        let died_tx = self.died_tx.clone();
        let process = Arc::clone(&self.process);
        let routes = Arc::clone(&self.routes);
        let mut reader_done = self.reader_done.clone();
        let inbox = self.inbox.clone();
        tokio::spawn(async move {
            let exit = process.exited().await;
            // A paused watch would keep the reader from its end of file.
            if let Some(inbox) = &inbox {
                inbox.resume_watch();
            }
            // A death nobody planned: what the worker started dies with it
            // before its death is told (and a restart can begin). A stop
            // sweeps, and counts, for itself.
            if !process.is_stopping() {
                crate::child::sweep::sweep_all(&process).await;
            }
            let _ = tokio::time::timeout(Duration::from_millis(500), reader_done.wait_for(|d| *d))
                .await;
            let stderr_tail = process.stderr_tail().await;
            let cause = process
                .kill_cause()
                .or_else(|| KillCause::from_stderr(&stderr_tail));
            let death = routes.close(Death {
                exit,
                stderr_tail,
                cause,
                in_flight: Vec::new(),
            });
            // Kept even when nobody is waiting yet (`send` would drop it):
            // a later `death()` must find it.
            died_tx.send_replace(Some(death));
        });
    }

    /// How a model served by an HTTP server is reached; `None` for a berth
    /// worker.
    pub fn upstream_server(&self) -> Option<&Arc<Upstream>> {
        self.upstream.as_ref()
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn backend(&self) -> &str {
        &self.backend
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn worker_version(&self) -> &str {
        &self.worker_version
    }

    pub fn uptime(&self) -> Duration {
        self.started_at.elapsed()
    }

    /// Requests sent to this worker so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.count.load(Ordering::SeqCst)
    }

    /// The exit status once the worker is dead.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        self.process.try_exit()
    }

    pub fn is_alive(&self) -> bool {
        self.process.try_exit().is_none()
    }

    pub(crate) fn process(&self) -> &ProcessWatch {
        &self.process
    }

    /// What the worker said when the model loaded.
    pub fn load_info(&self) -> Option<LoadInfo> {
        self.load_info
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn died(&self, death: &Death, during: &'static str) -> Error {
        death.error(&self.model, self.pid, during)
    }

    /// Waits until the worker is dead and its death fully recorded.
    pub(crate) async fn death(&self) -> Arc<Death> {
        let mut rx = self.died_tx.subscribe();
        let recorded = rx
            .wait_for(Option::is_some)
            .await
            .ok()
            .and_then(|d| d.clone());
        match recorded {
            Some(death) => death,
            None => Arc::new(Death {
                exit: self.process.exited().await,
                stderr_tail: Vec::new(),
                cause: self.process.kill_cause(),
                in_flight: Vec::new(),
            }),
        }
    }

    /// The error for a worker that is gone, waiting for its death to be
    /// fully recorded (exit status and stderr) first.
    async fn death_error(&self, during: &'static str) -> Error {
        let exit = self.process.exited().await;
        let stderr_tail = self.process.stderr_tail().await;
        let cause = self
            .process
            .kill_cause()
            .or_else(|| KillCause::from_stderr(&stderr_tail));
        self.died(
            &Death {
                exit,
                stderr_tail,
                cause,
                in_flight: Vec::new(),
            },
            during,
        )
    }

    /// Waits until no request is in flight, up to `timeout`. True if drained.
    pub async fn drain(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let zero = self.in_flight.zero.notified();
            if self.in_flight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, zero).await.is_err() {
                return self.in_flight() == 0;
            }
        }
    }

    /// The signal a stop sends after the `Shutdown` command (or first, for
    /// an HTTP server, which takes no command), and the grace after it.
    pub(crate) fn stop_signal(&self, graces: crate::base::StopGraces) -> (Signal, Duration) {
        match &self.upstream {
            Some(upstream) => (upstream.stop_signal(), upstream.stop_grace()),
            None => (Signal::SIGTERM, graces.term),
        }
    }

    /// Marks a request in flight for as long as the returned token lives:
    /// what a relayed HTTP request holds, so drains, keep-alive and
    /// eviction see it as they see a worker's request.
    pub(crate) fn enter(&self) -> InFlightToken {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.in_flight.enter();
        InFlightToken(Arc::clone(&self.in_flight))
    }

    /// Asks the worker to exit (the first step of a stop).
    pub(crate) fn request_shutdown(&self) -> bool {
        self.send(Command::Shutdown).is_ok()
    }

    /// Marks it asleep, or awake (`supervisor/sleep.rs`).
    pub(crate) fn set_asleep(&self, asleep: bool) {
        self.asleep.store(asleep, Ordering::SeqCst);
    }

    /// Whether it is asleep (or falling asleep, or waking).
    pub fn is_asleep(&self) -> bool {
        self.asleep.load(Ordering::SeqCst)
    }

    /// Kills the whole process group at once (used on a failed load or a
    /// missed heartbeat; a planned stop goes through `stop`).
    pub(crate) fn kill(&self) {
        self.process.signal_group(Signal::SIGKILL);
    }
}

/// How a `Load` command ended.
pub(crate) enum LoadOutcome {
    Loaded(LoadInfo),
    Failed(Error),
    TimedOut,
}

/// Why a heartbeat got no pong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NoPong {
    /// None came within the timeout (or an HTTP server stayed unhealthy).
    Silent,
    /// The worker's channel is gone: it died, or is dying.
    Gone,
}
