//! Who reads the supervisor's commands: the executor while it is idle, the
//! watch (the main thread) while a job keeps the executor away.
//!
//! An idle executor reads the next command itself and runs a request at
//! once, so a round trip wakes one thread in the worker, as the bare
//! `ipc-channel` floor does. Handing every command from a reader thread to
//! the executor cost a wake-up per request, tens of microseconds on a VM
//! whose other vCPU had halted (docs/performance.md).
//!
//! What the hand-off bought is kept: pings answered and cancels recorded
//! while a model computes for seconds. While the executor runs a job:
//!
//! - it reads what waits on the channel itself wherever it looks for more
//!   work (between steps, gathering a batch: [`Jobs::try_next`], which
//!   never blocks);
//! - once it has not looked for [`WATCH`], the watch takes the channel
//!   over, answers pings, records cancels and queues jobs, as the reader
//!   thread did, until the executor is idle again and the channel goes
//!   back to it.
//!
//! An executor that has answered blocks at once for the next command. It
//! used to poll for a quarter of the supervisor's `answer_spin` first, so
//! that a caller's next request found it awake; from an idle machine that
//! poll kept the caller, woken on the same vCPU, from running, and it is
//! the supervisor's reader that polls now, after an answer it delivered
//! (docs/performance.md, "From an idle machine").
//!
//! No timer is armed per request: the watch checks every [`WATCH`] for
//! [`LINGER`] after the last job and then sleeps until the next job wakes
//! it (one wake, for the first request after a quiet spell). A variant
//! that woke the watch for every request gained nothing (its wake-up took
//! the vCPU the supervisor needed), and one that armed a timer per request
//! lost (arming a timer exits to the hypervisor): both were measured.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

use berth_protocol::{Command, Event};
use ipc_channel::ipc::{IpcReceiver, IpcSender};
use ipc_channel::{IpcError, TryRecvError};

use super::{Job, Shared};

/// How long the executor may go without looking at the channel during a
/// job before the watch takes it over: the most a pong or a cancel waits
/// beyond that is the time to read it.
pub(super) const WATCH: Duration = Duration::from_millis(25);

/// How long after the last job the watch keeps checking every [`WATCH`]
/// before it sleeps until woken.
const LINGER: Duration = Duration::from_secs(2);

/// Where the executor takes more work from while it runs a job.
pub(super) trait Jobs {
    /// A job waiting now, if any.
    fn try_next(&self) -> Option<Job>;
    /// A job within `timeout`, if one comes.
    fn next_within(&self, timeout: Duration) -> Option<Job>;
}

/// A plain queue: what the batching tests gather from.
#[cfg(test)]
impl Jobs for mpsc::Receiver<Job> {
    fn try_next(&self) -> Option<Job> {
        self.try_recv().ok()
    }

    fn next_within(&self, timeout: Duration) -> Option<Job> {
        self.recv_timeout(timeout).ok()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reader {
    Executor,
    Watch,
}

struct State {
    reader: Reader,
    /// When the busy executor last looked at the channel; `None` while it
    /// is idle (and then only it reads).
    busy_since: Option<Instant>,
    last_busy: Instant,
    /// The watch waits for nothing but a notification.
    asleep: bool,
    /// A shutdown was read: the channel's end is expected.
    stopping: bool,
}

/// What the watch queues for the executor.
enum Queued {
    Job(Job),
    /// The channel is the executor's again.
    Resume,
}

/// The channel's reading duty, shared by the executor and the watch.
pub(super) struct Duty {
    /// Held by whichever thread is reading a command: the receiver is
    /// never read by two threads at once.
    commands: Mutex<IpcReceiver<Command>>,
    state: Mutex<State>,
    changed: Condvar,
    queue: mpsc::Sender<Queued>,
    events: IpcSender<Event>,
    shared: Arc<Shared>,
}

/// The executor's side: the duty and the jobs queued for it.
pub(super) struct Inbox {
    duty: Arc<Duty>,
    queued: mpsc::Receiver<Queued>,
}

/// Exits the process: the supervisor is gone or broke the channel, and
/// nothing the worker could still do would reach anyone.
fn lost(msg: String) -> ! {
    eprintln!("berth-worker: {msg}");
    std::process::exit(1)
}

impl Duty {
    /// The duty over `commands`, and the executor's inbox.
    pub(super) fn new(
        commands: IpcReceiver<Command>,
        events: IpcSender<Event>,
        shared: Arc<Shared>,
    ) -> (Arc<Duty>, Inbox) {
        let (queue, queued) = mpsc::channel();
        let duty = Arc::new(Duty {
            commands: Mutex::new(commands),
            state: Mutex::new(State {
                reader: Reader::Executor,
                busy_since: None,
                last_busy: Instant::now(),
                asleep: false,
                stopping: false,
            }),
            changed: Condvar::new(),
            queue,
            events,
            shared,
        });
        let inbox = Inbox {
            duty: Arc::clone(&duty),
            queued,
        };
        (duty, inbox)
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Answers a ping or records a cancel (`None`); anything else is a job.
    fn sort(&self, command: Command) -> Option<Job> {
        match command {
            Command::Ping { seq } => {
                // A failed send means the supervisor is gone; the next read says so.
                let _ = self.events.send(Event::Pong {
                    seq,
                    stats: self.shared.stats(),
                });
                None
            }
            Command::Cancel { id } => {
                self.shared
                    .cancelled
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(id);
                None
            }
            Command::Load(spec) => Some(Job::Load(spec)),
            Command::Request { id, body } => {
                self.shared.in_flight.fetch_add(1, Ordering::Relaxed);
                Some(Job::Request { id, body })
            }
            Command::Shutdown => {
                self.state().stopping = true;
                Some(Job::Shutdown)
            }
        }
    }

    /// The executor starts a job, or looked at the channel during one.
    fn busy(&self) {
        let mut state = self.state();
        state.busy_since = Some(Instant::now());
        if state.asleep {
            state.asleep = false;
            self.changed.notify_one();
        }
    }

    /// Whether a failed read is the expected end after a shutdown.
    fn read_failed(&self, error: IpcError) -> Option<()> {
        match error {
            // A signal landed during the wait (a grandchild's SIGCHLD, say): not an error.
            IpcError::Io(e) if e.kind() == std::io::ErrorKind::Interrupted => Some(()),
            IpcError::Disconnected if self.state().stopping => None,
            // The supervisor dropped its end: it is gone or gave up on us.
            IpcError::Disconnected => lost("the supervisor closed the channel".into()),
            e => lost(format!("cannot read a command: {e}")),
        }
    }

    /// The watch: runs on the main thread for the worker's life. After a
    /// shutdown and the channel's end it stops reading and waits for the
    /// executor to exit the process.
    pub(super) fn watch(&self) -> ! {
        loop {
            self.wait_for_a_long_job();
            if !self.hold_channel() {
                loop {
                    std::thread::park();
                }
            }
        }
    }

    /// Returns once the executor has been busy [`WATCH`] without looking
    /// at the channel; the channel is then the watch's.
    fn wait_for_a_long_job(&self) {
        let mut state = self.state();
        loop {
            let now = Instant::now();
            let timeout = match state.busy_since {
                Some(since) => {
                    let due = since + WATCH;
                    if now >= due {
                        state.reader = Reader::Watch;
                        return;
                    }
                    Some(due - now)
                }
                None if now.duration_since(state.last_busy) < LINGER => Some(WATCH),
                None => {
                    state.asleep = true;
                    None
                }
            };
            state = match timeout {
                Some(t) => {
                    self.changed
                        .wait_timeout(state, t)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
                None => self.changed.wait(state).unwrap_or_else(|e| e.into_inner()),
            };
            state.asleep = false;
        }
    }

    /// Reads commands for the busy executor until it is idle, then gives
    /// the channel back. False once the channel has ended after a shutdown.
    fn hold_channel(&self) -> bool {
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            {
                let mut state = self.state();
                if state.busy_since.is_none() {
                    state.reader = Reader::Executor;
                    break;
                }
            }
            // Timed, so that an executor gone idle gets the channel back
            // within WATCH even when no command comes.
            match commands.try_recv_timeout(WATCH) {
                Ok(command) => {
                    if let Some(job) = self.sort(command) {
                        let _ = self.queue.send(Queued::Job(job));
                    }
                }
                Err(TryRecvError::Empty) => {}
                Err(TryRecvError::IpcError(e)) => {
                    if self.read_failed(e).is_none() {
                        return false;
                    }
                }
            }
        }
        drop(commands);
        let _ = self.queue.send(Queued::Resume);
        true
    }
}

impl Inbox {
    /// The executor's next job: read from the channel while it holds it,
    /// or queued by the watch. Blocks; marks the executor busy.
    pub(super) fn next(&self) -> Job {
        let duty = &*self.duty;
        loop {
            match self.queued.try_recv() {
                Ok(Queued::Job(job)) => {
                    duty.busy();
                    return job;
                }
                Ok(Queued::Resume) => continue,
                Err(_) => {}
            }
            let mine = {
                let mut state = duty.state();
                if state.busy_since.take().is_some() {
                    state.last_busy = Instant::now();
                }
                state.reader == Reader::Executor
            };
            if mine {
                let commands = duty.commands.lock().unwrap_or_else(|e| e.into_inner());
                let read = commands.recv();
                drop(commands);
                match read {
                    Ok(command) => {
                        if let Some(job) = duty.sort(command) {
                            duty.busy();
                            return job;
                        }
                        continue;
                    }
                    Err(e) => {
                        if duty.read_failed(e).is_some() {
                            continue;
                        }
                        // The channel ended after a shutdown: that job is
                        // queued and comes below.
                    }
                }
            }
            // The watch holds the channel and gives it back within WATCH.
            match self.queued.recv() {
                Ok(Queued::Job(job)) => {
                    duty.busy();
                    return job;
                }
                Ok(Queued::Resume) | Err(_) => continue,
            }
        }
    }

    /// Marks the executor busy with a job it held back earlier.
    pub(super) fn busy(&self) {
        self.duty.busy();
    }

    /// Reads what waits on the channel (never blocking) while the executor
    /// holds it, queuing the jobs.
    fn look(&self) {
        let duty = &*self.duty;
        if duty.state().reader != Reader::Executor {
            return;
        }
        let Ok(commands) = duty.commands.try_lock() else {
            return;
        };
        loop {
            match commands.try_recv() {
                Ok(command) => {
                    if let Some(job) = duty.sort(command) {
                        let _ = duty.queue.send(Queued::Job(job));
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::IpcError(e)) => {
                    if duty.read_failed(e).is_none() {
                        break;
                    }
                }
            }
        }
        drop(commands);
        duty.busy();
    }

    fn queued_job(&self) -> Option<Job> {
        loop {
            match self.queued.try_recv() {
                Ok(Queued::Job(job)) => return Some(job),
                Ok(Queued::Resume) => continue,
                Err(_) => return None,
            }
        }
    }
}

impl Jobs for Inbox {
    fn try_next(&self) -> Option<Job> {
        self.look();
        self.queued_job()
    }

    fn next_within(&self, timeout: Duration) -> Option<Job> {
        let until = Instant::now() + timeout;
        loop {
            if let Some(job) = self.try_next() {
                return Some(job);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            // Waits on the channel while the executor holds it, else for
            // what the watch queues; either way at most `left`.
            let holds = self.duty.state().reader == Reader::Executor;
            let commands = if holds {
                self.duty.commands.try_lock().ok()
            } else {
                None
            };
            if let Some(commands) = commands {
                match commands.try_recv_timeout(left) {
                    Ok(command) => {
                        if let Some(job) = self.duty.sort(command) {
                            return Some(job);
                        }
                    }
                    Err(TryRecvError::Empty) => return None,
                    Err(TryRecvError::IpcError(e)) => {
                        let _ = self.duty.read_failed(e);
                        return None;
                    }
                }
                continue;
            }
            match self.queued.recv_timeout(left) {
                Ok(Queued::Job(job)) => return Some(job),
                Ok(Queued::Resume) => continue,
                Err(_) => return None,
            }
        }
    }
}
