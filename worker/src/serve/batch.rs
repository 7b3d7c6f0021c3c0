//! Running requests in batches: gathering the requests that wait into one
//! batch for a backend that batches ([`gather`], [`run_batch`]), and
//! continuous batching for one that steps ([`run_stepping`]).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth_protocol::{Body, ErrorKind, Event, RequestId, RunInfo, WireError};
use ipc_channel::ipc::IpcSender;

use super::duty::Jobs;
use super::{Job, Shared, finish, guarded, is_cancelled, panicked};
use crate::backend::{Backend, Batching, RequestContext};

/// The batch that ran last: how large, how long it took, and how many
/// requests were waiting when it was answered.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Pace {
    batch: usize,
    compute: Duration,
    waiting: usize,
}

/// The longest a batch waits for company, and then only under load.
const MAX_LINGER: Duration = Duration::from_millis(10);

/// Adds to `batch` the requests already waiting, within `policy`. A job
/// that does not join (a request over the budget, a shutdown) is held to
/// run next.
///
/// An idle worker never waits. Under load (the last batch held more than
/// one request) it waits a little for the batch to fill to the requests
/// that were outstanding when the last batch was answered: those it
/// answered (their clients are sending their next requests) and those
/// that were already waiting. Without the wait the next batch would take
/// the ones that made it and run nearly as long for them as for all; with
/// a target of only the last batch's size, a load of 16 clients settles
/// into batches that split it in two (10 and 6, and so on) and never
/// joins again. The wait is a twentieth of the last batch's compute time,
/// at most [`MAX_LINGER`].
pub(super) fn gather(
    backend: &dyn Backend,
    policy: Batching,
    batch: &mut Vec<(RequestId, Body)>,
    jobs: &impl Jobs,
    held: &mut VecDeque<Job>,
    pace: Pace,
) {
    let max_batch = policy.max_batch.max(1);
    let fill_to = pace.batch.saturating_add(pace.waiting).min(max_batch);
    let linger_until =
        (pace.batch > 1).then(|| Instant::now() + (pace.compute / 20).min(MAX_LINGER));
    // Costs are computed only once a second request is there: a lone
    // request pays nothing for batching.
    let mut cost: Option<usize> = None;
    while batch.len() < max_batch {
        let job = match held.pop_front() {
            Some(job) => job,
            None => match jobs.try_next() {
                Some(job) => job,
                None => {
                    let Some(until) = linger_until.filter(|_| batch.len() < fill_to) else {
                        break;
                    };
                    let left = until.saturating_duration_since(Instant::now());
                    match jobs.next_within(left) {
                        Some(job) => job,
                        None => break,
                    }
                }
            },
        };
        match job {
            Job::Request { id, body } => {
                let so_far = *cost.get_or_insert_with(|| {
                    batch.iter().fold(0, |sum: usize, (_, b)| {
                        sum.saturating_add(cost_of(backend, b))
                    })
                });
                let c = cost_of(backend, &body);
                if so_far.saturating_add(c) > policy.max_cost {
                    held.push_front(Job::Request { id, body });
                    break;
                }
                cost = Some(so_far.saturating_add(c));
                batch.push((id, body));
            }
            other => {
                held.push_front(other);
                break;
            }
        }
    }
}

/// A request's cost as the backend estimates it; 1 where the estimate
/// panics (the request fails on its own when it runs).
fn cost_of(backend: &dyn Backend, body: &Body) -> usize {
    catch_unwind(AssertUnwindSafe(|| backend.cost(body))).unwrap_or(1)
}

/// Runs `batch` (one request or several) and answers each request. Those
/// cancelled while they waited are answered at once and do not run.
pub(super) fn run_batch(
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
    let compute = started.elapsed();
    let run = RunInfo {
        batch: ids.len() as u32,
        compute_micros: compute.as_micros() as u64,
    };
    let batch = ids.len();
    for (id, result) in ids.into_iter().zip(results) {
        finish(shared, events, id, result, run);
    }
    Pace {
        batch,
        compute,
        // Received and not answered: every one of them is waiting.
        waiting: shared.in_flight.load(Ordering::Relaxed) as usize,
    }
}

/// Continuous batching: begins `first` and every request that arrives
/// while others run (within the backend's batch size and token budget),
/// steps them all together, and answers each as it ends; returns once none
/// is left. A job that is not a request (a shutdown) waits, held, until
/// the running requests have ended; no request begins after it.
pub(super) fn run_stepping(
    backend: &mut dyn Backend,
    first: (RequestId, Body),
    jobs: &impl Jobs,
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
                None => match held.pop_front().or_else(|| jobs.try_next()) {
                    Some(Job::Request { id, body }) => (id, body),
                    Some(other) => {
                        held.push_front(other);
                        blocked = true;
                        break;
                    }
                    None => break,
                },
            };
            let cost = cost_of(backend, &body);
            let used = active
                .values()
                .fold(0, |sum: usize, (_, c)| sum.saturating_add(*c));
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
                finish(
                    shared,
                    events,
                    id,
                    Err(stopped_stepping()),
                    RunInfo::default(),
                );
                fail_all(&mut active, shared, events, stopped_stepping());
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
            fail_all(&mut active, shared, events, stopped_stepping());
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
        let left = catch_unwind(AssertUnwindSafe(|| stepping.active())).unwrap_or(0);
        if left == 0 && !active.is_empty() {
            // The backend forgot requests it never answered.
            let e = WireError::new(ErrorKind::Internal, "the backend dropped the request");
            fail_all(&mut active, shared, events, e);
        }
    }
}

fn stopped_stepping() -> WireError {
    WireError::new(
        ErrorKind::Internal,
        "the backend stopped stepping with requests begun",
    )
}

/// Fails every request in `active` with `e`.
fn fail_all<T>(
    active: &mut std::collections::HashMap<RequestId, T>,
    shared: &Shared,
    events: &IpcSender<Event>,
    e: WireError,
) {
    for id in active.drain().map(|(id, _)| id).collect::<Vec<_>>() {
        finish(shared, events, id, Err(e.clone()), RunInfo::default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

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
            waiting: 0,
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
    fn a_busy_worker_waits_for_every_request_that_was_outstanding() {
        let (tx, rx) = mpsc::channel();
        let mut held = VecDeque::new();
        let policy = Counting.batching().unwrap();
        // The last batch answered two while one more waited: three clients.
        // Two requests are here, as many as the last batch held; it still
        // waits for the third client's.
        let pace = Pace {
            batch: 2,
            compute: Duration::from_secs(1),
            waiting: 1,
        };
        tx.send(request(2, "b")).unwrap();
        let started = Instant::now();
        let mut batch = vec![(1, Body::json("a"))];
        gather(&Counting, policy, &mut batch, &rx, &mut held, pace);
        assert_eq!(ids(&batch), [1, 2]);
        assert!(started.elapsed() >= MAX_LINGER);
        // When it comes in time, it joins.
        let late = std::thread::spawn(move || tx.send(request(4, "d")).unwrap());
        let mut batch = vec![(3, Body::json("c"))];
        late.join().unwrap();
        gather(&Counting, policy, &mut batch, &rx, &mut held, pace);
        assert_eq!(ids(&batch), [3, 4]);
    }

    /// A backend whose cost estimate panics.
    struct Panicky;

    impl Backend for Panicky {
        fn handle(&mut self, request: Body, _: &RequestContext) -> Result<Body, WireError> {
            Ok(request)
        }
        fn cost(&self, _: &Body) -> usize {
            panic!("no estimate")
        }
    }

    #[test]
    fn a_panicking_cost_estimate_counts_as_one_and_gathers_on() {
        let (tx, rx) = mpsc::channel();
        let mut held = VecDeque::new();
        tx.send(request(2, "b")).unwrap();
        tx.send(request(3, "c")).unwrap();
        let policy = Batching {
            max_batch: 8,
            max_cost: 2,
        };
        let mut batch = vec![(1, Body::json("a"))];
        gather(
            &Panicky,
            policy,
            &mut batch,
            &rx,
            &mut held,
            Pace::default(),
        );
        // 1 + 1 fits the budget of 2; the third is held for the next batch.
        assert_eq!(ids(&batch), [1, 2]);
        assert!(matches!(held.front(), Some(Job::Request { id: 3, .. })));
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
