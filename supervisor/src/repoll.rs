//! Polling again rather than yielding, where one task's own parts wake each
//! other.
//!
//! A task that wakes itself while it is polled counts, for tokio, as one
//! that yields: it goes to the back of its worker's queue, and another
//! worker thread is woken to look for work (a futex wake and a context
//! switch, then another as that thread finds nothing and sleeps again). A
//! client connection driven in the request's own task
//! (`child::upstream`) and the request's answer wake each other as a matter
//! of course: the request queued wakes the connection, the answer's head
//! and bytes handed over wake the request. Measured on a relayed request,
//! that was two of the four futex calls between the two worker threads;
//! the other two are the server's side's (below).
//!
//! [`Repoll`] is a waker to poll such a task's parts with: a wake that
//! comes while they are being polled is only noted, and they are polled
//! again at once (up to [`ROUNDS`] times, then the task does yield); a
//! wake that comes at any other time (the socket's readiness, from the I/O
//! driver) wakes the task as usual.
//!
//! (The server's side, hyper's connection and the request body it hands
//! the service, wakes itself the same way on every POST. Polled through a
//! `Repoll` too, a relayed request gained another ~15 µs, but `GET
//! /healthz` from one client (ureq) lost ~60 µs, for a reason not found;
//! so it is not done. See docs/performance.md, "Servers you already run".)

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polled again this many times at most in one poll before the task
/// yields: a part that keeps waking itself cannot starve the others.
pub(crate) const ROUNDS: usize = 8;

/// The waker of one task's parts (see the module's docs). One per thing
/// polled (a connection), kept for its life: a part registers the waker it
/// was last polled with, and a wake from it must find the current task.
#[derive(Default)]
pub(crate) struct Repoll {
    woken: AtomicBool,
    polling: AtomicBool,
    task: AtomicWaker,
}

impl Repoll {
    /// Polls `work` with this waker on behalf of the task of `cx`,
    /// polling it again at once while it woke itself meanwhile.
    pub(crate) fn poll<T>(
        self: &Arc<Self>,
        cx: &mut Context<'_>,
        mut work: impl FnMut(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.task.register(cx.waker());
        let waker = Waker::from(Arc::clone(self));
        let mut here = Context::from_waker(&waker);
        for _ in 0..ROUNDS {
            self.woken.store(false, Ordering::SeqCst);
            self.polling.store(true, Ordering::SeqCst);
            let polled = work(&mut here);
            self.polling.store(false, Ordering::SeqCst);
            if polled.is_ready() {
                return polled;
            }
            // A wake after `polling` turned false went to the task too.
            if !self.woken.load(Ordering::SeqCst) {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Forgets the task that polled last: what is woken from now on wakes
    /// nobody until the next poll (a connection back in its pool).
    pub(crate) fn forget_task(&self) {
        self.task.take();
    }

    /// Polls `work` with this waker for no task: what it wakes wakes
    /// nobody (a look at a pooled connection between requests).
    pub(crate) fn poll_alone<T>(self: &Arc<Self>, work: impl FnOnce(&mut Context<'_>) -> T) -> T {
        self.forget_task();
        let waker = Waker::from(Arc::clone(self));
        work(&mut Context::from_waker(&waker))
    }
}

impl Wake for Repoll {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;
    use std::pin::Pin;

    /// Polls `future` through `repoll` for the task of `cx`.
    fn poll<F: Future + Unpin>(
        repoll: &Arc<Repoll>,
        future: &mut F,
        cx: &mut Context<'_>,
    ) -> Poll<F::Output> {
        repoll.poll(cx, |cx| Pin::new(&mut *future).poll(cx))
    }

    /// A future that wakes itself `times` times while polled, then is
    /// ready; counts its polls.
    struct SelfWaking {
        times: usize,
        polls: usize,
    }

    impl Future for SelfWaking {
        type Output = usize;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<usize> {
            self.polls += 1;
            if self.times == 0 {
                return Poll::Ready(self.polls);
            }
            self.times -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    /// Counts the task's wakes.
    #[derive(Default)]
    struct Count(std::sync::atomic::AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_wake_while_polled_is_a_poll_again_not_a_wake_of_the_task() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let repoll: Arc<Repoll> = Arc::default();
        let mut f = SelfWaking { times: 3, polls: 0 };
        assert_eq!(poll(&repoll, &mut f, &mut cx), Poll::Ready(4));
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "the task was not woken");
    }

    #[test]
    fn a_part_that_keeps_waking_itself_yields_after_the_rounds() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let repoll: Arc<Repoll> = Arc::default();
        let mut f = SelfWaking {
            times: ROUNDS + 1,
            polls: 0,
        };
        assert_eq!(poll(&repoll, &mut f, &mut cx), Poll::Pending);
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "it yielded once");
        assert_eq!(poll(&repoll, &mut f, &mut cx), Poll::Ready(ROUNDS + 2));
    }

    #[test]
    fn a_wake_after_the_poll_wakes_the_task() {
        let count = Arc::new(Count::default());
        let waker = Waker::from(Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let repoll: Arc<Repoll> = Arc::default();
        let mut kept = None;
        let polled: Poll<()> = repoll.poll(&mut cx, |cx| {
            kept = Some(cx.waker().clone());
            Poll::Pending
        });
        assert_eq!(polled, Poll::Pending);
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        kept.unwrap().wake();
        assert_eq!(
            count.0.load(Ordering::SeqCst),
            1,
            "the later wake reached the task"
        );
    }
}
