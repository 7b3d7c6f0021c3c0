//! A short, bounded spin before parking, where a worker's answer is due
//! within microseconds.
//!
//! Measured on a 2-vCPU VM (docs/performance.md, "Core"): an echo round
//! trip through a worker cost 7–9× a bare `ipc-channel` round trip, and a
//! scheduler trace put most of the difference in wake-ups: each time the
//! caller's thread parks, its vCPU halts, and the worker's answer must then
//! wake it through the hypervisor (~15 µs here, where the echo itself costs
//! a few). So while a request is alone on its worker and that worker's last
//! answer came within the spin (`answer_spin`, 100 µs by default), the caller keeps polling for the answer,
//! yielding to the runtime between polls, for at most that long; then it
//! parks as before. Nothing spins for a worker whose answers take longer
//! (any real model), while several requests are in flight (under load the
//! CPU is better spent elsewhere), or while nobody is waiting (idle workers
//! cost what they did).
//!
//! The spin yields its CPU between polls (`sched_yield`). A request is a
//! write to a Unix socket, whose wake-up is a "sync" one: the kernel tends
//! to put the woken worker on the caller's own vCPU, expecting the caller
//! to sleep. A caller that spins without yielding then keeps its worker
//! off that vCPU for most of the spin: from an idle machine, a Python
//! worker's echo took 43–58 µs that way and 24 µs yielding, and the bare
//! echo measured between berth's rounds was no longer slowed (44 → 11 µs).
//! Where the two are on different vCPUs there is nothing to yield to, and
//! the call returns at once.
//!
//! For a stream worker the spin also reads the socket itself between its
//! polls, the socket's watch paused, so that the answer reaches the caller
//! without a runtime thread's wake-up (`child::inbox`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

/// What a spinning caller reads for itself between its polls: a stream
/// worker's socket (`child::inbox`).
pub(crate) trait Look {
    /// One non-blocking look, whatever it completes handed on.
    fn look(&self);
}

/// How long the worker's last served answer took, from the request's send
/// to its final piece (errors are not answers a model computed, and do not
/// count), and the spin (`answer_spin`, zero for none).
#[derive(Debug)]
pub(crate) struct AnswerTime {
    /// Microseconds; `u64::MAX` before the first answer.
    last: AtomicU64,
    spin: Duration,
}

impl AnswerTime {
    /// `spin` is held to `MAX_ANSWER_SPIN` here too, for a host that set
    /// `SupervisorConfig` itself rather than through a checked config file.
    pub(super) fn new(spin: Duration) -> AnswerTime {
        AnswerTime {
            last: AtomicU64::new(u64::MAX),
            spin: spin.min(crate::config::MAX_ANSWER_SPIN),
        }
    }

    pub(super) fn record(&self, took: Duration) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.last.store(micros, Ordering::Relaxed);
    }

    /// How long to spin for the next answer: the spin, if the last answer
    /// came within it.
    pub(crate) fn spin(&self) -> Option<Duration> {
        let window = u64::try_from(self.spin.as_micros()).unwrap_or(u64::MAX);
        let quick = self.last.load(Ordering::Relaxed) <= window;
        (quick && !self.spin.is_zero()).then_some(self.spin)
    }
}

/// `rx.recv()`, polled again at once (after the runtime's other tasks) for
/// up to `spin` before it parks the task. Meanwhile, for a stream worker,
/// it reads the socket itself (`inbox`), the socket's watch paused until
/// `spinning` is dropped (here, when the spin ends without the answer), so
/// that the answer wakes no reader task on its way.
pub(super) async fn spin_recv<T, G>(
    rx: &mut mpsc::UnboundedReceiver<T>,
    spin: Duration,
    inbox: Option<&impl Look>,
    spinning: &mut Option<G>,
) -> Option<T> {
    let started = Instant::now();
    // On a current-thread runtime the answer may need this very thread (a
    // stream worker's reader is a task here), and the runtime looks at its
    // sockets only every few dozen polls: a `sched_yield` per poll would
    // stretch that wait, so there the spin only yields to the runtime.
    let yield_cpu = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() != tokio::runtime::RuntimeFlavor::CurrentThread);
    // The first poll comes right after the request went out: no worker has
    // answered yet, so it only yields.
    let mut first = true;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = rx.poll_recv(cx) {
            return Poll::Ready(v);
        }
        if let (Some(inbox), Some(_), false) = (inbox, &*spinning, std::mem::take(&mut first)) {
            inbox.look();
            if let Poll::Ready(v) = rx.poll_recv(cx) {
                return Poll::Ready(v);
            }
        }
        if started.elapsed() >= spin {
            // The spin is over: the watch resumes (waking the reader task
            // at once if bytes came since the last look), and the task
            // parks until the reader hands it its answer.
            *spinning = None;
            return Poll::Pending;
        }
        // Give the CPU to whatever waits for it here: quite often the very
        // worker whose answer we wait for (see above).
        if yield_cpu {
            std::thread::yield_now();
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}
