//! A compute pool for small, frequent parallel steps (a few rows through a
//! model's layers: one dispatch every 20–100 µs), in which the caller waits
//! only for helpers still working on an item, never for one to turn up.
//!
//! candle's barrier pool waits, at the end of every dispatch, for each
//! helper to say it is done, spinning. A helper that is not running then
//! holds the caller up until the scheduler runs it again: in the `onnx`
//! bench on a 2-vCPU VM, with another process's threads busy beside it,
//! ~1 dispatch in 400 waited 2–3 ms (a time slice), and alone the
//! caller's wait at a dispatch's end averaged 1.6–2.3 µs (0.8–0.9 here).
//!
//! Here helpers join a dispatch rather than being summoned to it: the
//! caller opens it, runs it itself (`f` takes every item not yet taken,
//! whoever calls it), closes it, and then waits only for helpers that
//! joined and are still inside (one item at most), yielding its CPU to
//! them after a few microseconds. A helper that wakes late finds the
//! dispatch closed and touches nothing of it.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The pool's state word: the dispatch's generation in the high 32 bits,
/// whether it is open, and how many helpers are inside it.
const OPEN: u64 = 1 << 31;
const INSIDE: u64 = OPEN - 1;

/// How long an idle helper spins for the next dispatch before it sleeps:
/// longer than the gaps between one text's dispatches and between texts
/// sent back to back, short enough to cost nothing worth naming at rest.
const SPIN: Duration = Duration::from_micros(200);

/// How long the caller spins for a helper still inside before it yields
/// its CPU to it (an item takes 1–3 µs).
const WAIT_SPIN: Duration = Duration::from_micros(5);

pub(crate) struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// One dispatch at a time: a second caller runs its items alone.
    dispatch: Mutex<()>,
}

struct Shared {
    state: AtomicU64,
    /// The open dispatch's work: written by its caller while no helper is
    /// inside and the pool is closed; read by helpers once they are inside.
    job: UnsafeCell<Job>,
    stop: AtomicBool,
    panicked: AtomicBool,
}

// SAFETY: `job` is written only by the dispatching caller (one at a time,
// under `dispatch`) while closed with no helper inside, and read only by
// helpers that entered the open dispatch it belongs to (the `Release` store
// that opens it, the `AcqRel` entry that reads it).
unsafe impl Sync for Shared {}
// SAFETY: `job`'s pointer is a `&F` with `F: Sync`, valid while a dispatch
// is open (above); the rest is atomics.
unsafe impl Send for Shared {}

#[derive(Clone, Copy)]
struct Job {
    run: unsafe fn(*const (), usize),
    data: *const (),
}

/// Calls the `F` at `data` with thread index `t`.
///
/// # Safety
/// `data` is a live `&F`.
unsafe fn trampoline<F: Fn(usize) + Sync>(data: *const (), t: usize) {
    // SAFETY: the caller's.
    unsafe { (*(data as *const F))(t) }
}

fn nothing(_: *const (), _: usize) {}

impl Pool {
    /// A pool of `threads` in all: the caller and `threads - 1` helpers.
    /// A helper the system will not start is done without (said on
    /// stderr): the dispatches run on fewer threads, not not at all.
    pub(crate) fn new(threads: usize, name: &str) -> Pool {
        let shared = Arc::new(Shared {
            state: AtomicU64::new(0),
            job: UnsafeCell::new(Job {
                run: nothing,
                data: std::ptr::null(),
            }),
            stop: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        });
        let mut pool = Pool {
            shared,
            helpers: Vec::new(),
            dispatch: Mutex::new(()),
        };
        for index in 0..threads.saturating_sub(1) {
            let shared = Arc::clone(&pool.shared);
            match std::thread::Builder::new()
                .name(format!("{name}-{index}"))
                .spawn(move || help(&shared, index))
            {
                Ok(helper) => pool.helpers.push(helper),
                Err(e) => {
                    eprintln!(
                        "berth-worker: {name}: cannot start compute thread {} of {threads} \
                         ({e}); running on {}",
                        index + 2,
                        index + 1
                    );
                    break;
                }
            }
        }
        pool
    }

    /// Threads a dispatch may run on, the caller's included.
    pub(crate) fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    /// Runs `f(t)` on the caller (`t` = the helpers' count) and on each
    /// helper that joins in time (`t` its index). `f` must run every item
    /// of the dispatch that no other call of it has taken, whatever its
    /// `t`: the caller's call alone may be the only one.
    pub(crate) fn execute<F: Fn(usize) + Sync>(&self, f: F) {
        let me = self.helpers.len();
        // (A panic in a dispatch poisons nothing that matters here.)
        let _one = match self.dispatch.try_lock() {
            Ok(one) => one,
            Err(std::sync::TryLockError::Poisoned(one)) => one.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return f(me),
        };
        if me == 0 {
            return f(me);
        }
        let shared = &*self.shared;
        let closed = shared.state.load(Ordering::Relaxed);
        debug_assert_eq!(closed & (OPEN | INSIDE), 0, "a dispatch left open");
        // SAFETY: closed, and no helper inside (the last dispatch waited
        // for them all): no one reads `job` until the store below.
        unsafe {
            *shared.job.get() = Job {
                run: trampoline::<F>,
                data: &f as *const F as *const (),
            };
        }
        let generation = ((closed >> 32) + 1) & u64::from(u32::MAX);
        shared
            .state
            .store((generation << 32) | OPEN, Ordering::Release);
        for helper in &self.helpers {
            helper.thread().unpark();
        }
        // Closes and waits even if `f` panics, so that no helper is left
        // inside a closure that is gone.
        struct Close<'a>(&'a Shared);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                let state = &self.0.state;
                let mut inside = state.fetch_and(!OPEN, Ordering::AcqRel) & INSIDE;
                let began = Instant::now();
                while inside > 0 {
                    if began.elapsed() < WAIT_SPIN {
                        std::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                    inside = state.load(Ordering::Acquire) & INSIDE;
                }
            }
        }
        let close = Close(shared);
        f(me);
        drop(close);
        if shared.panicked.swap(false, Ordering::Relaxed) {
            panic!("a compute helper panicked (its message is above)");
        }
    }

    /// Runs `f` on every chunk of `0..items`, the chunks handed out from a
    /// shared cursor, ~8 a thread.
    pub(crate) fn chunked(&self, items: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
        use std::sync::atomic::AtomicUsize;
        let chunk = items.div_ceil(self.threads() * 8).max(1);
        let cursor = AtomicUsize::new(0);
        self.execute(|_| {
            loop {
                let start = cursor.fetch_add(chunk, Ordering::Relaxed);
                if start >= items {
                    break;
                }
                f(start..items.min(start + chunk));
            }
        });
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        for helper in self.helpers.drain(..) {
            helper.thread().unpark();
            let _ = helper.join();
        }
    }
}

/// A helper's life: waits for a dispatch (spinning for [`SPIN`], then
/// asleep until the next), joins it if it is still open, runs its share.
fn help(shared: &Shared, index: usize) {
    let mut seen = shared.state.load(Ordering::Acquire) >> 32;
    loop {
        let began = Instant::now();
        let mut spins = 0u32;
        let mut state = shared.state.load(Ordering::Acquire);
        while state >> 32 == seen {
            if shared.stop.load(Ordering::Relaxed) {
                return;
            }
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 && began.elapsed() > SPIN {
                // A dispatch opened after the load above has unparked us
                // (or will): the token makes this return at once.
                std::thread::park();
            } else {
                std::hint::spin_loop();
            }
            state = shared.state.load(Ordering::Acquire);
        }
        seen = state >> 32;
        // Join while it is open and still this generation.
        while state >> 32 == seen && state & OPEN != 0 {
            match shared.state.compare_exchange_weak(
                state,
                state + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // SAFETY: inside the open dispatch: its caller waits
                    // for us before `job` or what it points to changes.
                    let job = unsafe { *shared.job.get() };
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                        (job.run)(job.data, index)
                    }));
                    if ran.is_err() {
                        shared.panicked.store(true, Ordering::Relaxed);
                    }
                    shared.state.fetch_sub(1, Ordering::Release);
                    break;
                }
                Err(now) => state = now,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    #[test]
    fn every_chunk_runs_once_in_each_of_many_dispatches() {
        for threads in [1, 2, 4] {
            let pool = Pool::new(threads, "test-pool");
            assert_eq!(pool.threads(), threads);
            for items in [0, 1, 3, 17, 200] {
                for _ in 0..50 {
                    let seen: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                    pool.chunked(items, |range| {
                        for i in range {
                            seen[i].fetch_add(1, Relaxed);
                        }
                    });
                    assert!(seen.iter().all(|s| s.load(Relaxed) == 1), "{items} items");
                }
            }
        }
    }

    #[test]
    fn helpers_that_sleep_between_dispatches_still_join() {
        let pool = Pool::new(2, "test-pool");
        let helped = AtomicUsize::new(0);
        for round in 1..=20 {
            // Long past the spin: the helper is asleep when this opens.
            std::thread::sleep(SPIN * 3);
            pool.execute(|t| {
                if t == 0 {
                    helped.fetch_add(1, Relaxed);
                } else {
                    // The caller holds the dispatch open until the woken
                    // helper has joined (or long past any wake-up).
                    let until = Instant::now() + Duration::from_secs(5);
                    while helped.load(Relaxed) < round && Instant::now() < until {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
            });
        }
        assert_eq!(
            helped.load(Relaxed),
            20,
            "a sleeping helper joined every dispatch"
        );
    }

    #[test]
    fn a_helpers_panic_reaches_the_caller_and_the_pool_goes_on() {
        let pool = Pool::new(2, "test-pool");
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for _ in 0..200 {
                pool.execute(|t| {
                    if t == 0 {
                        panic!("the helper's item failed");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                });
            }
        }));
        assert!(caught.is_err(), "the helper's panic is the caller's");
        let count = AtomicUsize::new(0);
        pool.chunked(10, |r| {
            count.fetch_add(r.len(), Relaxed);
        });
        assert_eq!(count.load(Relaxed), 10);
    }
}
