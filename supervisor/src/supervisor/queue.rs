//! The machine's queue: loads (and swaps, and restarts) waiting to plan
//! their room, one at a time, in order of their model's priority, then of
//! arrival. The one at its head holds the [`Gate`] while it decides and
//! makes room, so two loads never count the same free memory; the others
//! wait their turn, and can say where they stand ([`LoadQueue::position`]).

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::sync::Mutex;

use tokio::sync::Notify;

/// A place in the queue: higher priority first, then earlier arrival.
type Key = (Reverse<i32>, u64);

#[derive(Default)]
pub(super) struct LoadQueue {
    state: Mutex<QueueState>,
    /// Woken when the gate is let go or a place is given up.
    turn: Notify,
}

#[derive(Default)]
struct QueueState {
    next: u64,
    /// Whether the gate is held, and by which model.
    held: bool,
    holder: Option<String>,
    /// Who waits for the gate, by place.
    waiting: BTreeMap<Key, String>,
}

/// The gate: held by the one load planning; let go when dropped.
pub(super) struct Gate<'a> {
    queue: &'a LoadQueue,
    /// Its place, kept across a moment let go ([`Gate::pause`]).
    key: Key,
    model: String,
}

/// A place given up when its waiter goes (a caller that gave up).
struct Place<'a> {
    queue: &'a LoadQueue,
    key: Option<Key>,
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            self.queue.lock().waiting.remove(&key);
            self.queue.turn.notify_waiters();
        }
    }
}

impl LoadQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for `model`'s turn to plan (`priority`: its model's), and
    /// holds the gate.
    pub(super) async fn enter(&self, model: &str, priority: i32) -> Gate<'_> {
        let key = {
            let mut state = self.lock();
            state.next += 1;
            (Reverse(priority), state.next)
        };
        self.wait_at(model, key).await
    }

    async fn wait_at(&self, model: &str, key: Key) -> Gate<'_> {
        self.lock().waiting.insert(key, model.to_string());
        let mut place = Place {
            queue: self,
            key: Some(key),
        };
        loop {
            let turn = self.turn.notified();
            tokio::pin!(turn);
            turn.as_mut().enable();
            {
                let mut state = self.lock();
                let first = state.waiting.keys().next().copied();
                if !state.held && first == Some(key) {
                    state.waiting.remove(&key);
                    state.held = true;
                    state.holder = Some(model.to_string());
                    place.key = None;
                    return Gate {
                        queue: self,
                        key,
                        model: model.to_string(),
                    };
                }
            }
            turn.await;
        }
    }

    #[cfg(test)]
    /// Where `model`'s first load waits: 1 is next; `None` if it waits for
    /// none (or plans now).
    pub(super) fn position(&self, model: &str) -> Option<usize> {
        self.lock()
            .waiting
            .values()
            .position(|m| m == model)
            .map(|p| p + 1)
    }

    /// How many loads wait.
    pub(super) fn len(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Each model whose load waits, with its place (0: it makes room now,
    /// 1: next).
    pub(super) fn places(&self) -> Vec<(String, usize)> {
        let state = self.lock();
        let mut places: Vec<(String, usize)> =
            state.holder.iter().map(|m| (m.clone(), 0)).collect();
        for (i, model) in state.waiting.values().enumerate() {
            if !places.iter().any(|(m, _)| m == model) {
                places.push((model.clone(), i + 1));
            }
        }
        places
    }
}

impl<'a> Gate<'a> {
    /// Lets the gate go for a moment (while what it waits for cannot
    /// happen under it) and takes it again at the same place: the loads
    /// behind it may plan meanwhile, none jumps ahead of it after.
    pub(super) async fn pause(self, wait: impl std::future::Future<Output = ()>) -> Gate<'a> {
        let (queue, key, model) = (self.queue, self.key, self.model.clone());
        drop(self);
        wait.await;
        queue.wait_at(&model, key).await
    }
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        let mut state = self.queue.lock();
        state.held = false;
        state.holder = None;
        drop(state);
        self.queue.turn.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// One at a time, by priority then arrival; a waiter that gives up
    /// holds no one up; a pause keeps its place.
    #[tokio::test]
    async fn the_gate_goes_by_priority_then_arrival() {
        let queue = Arc::new(LoadQueue::default());
        let first = queue.enter("a", 0).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for (model, priority) in [("low", 0), ("gone", 0), ("high", 5), ("later", 0)] {
            let (queue, order) = (Arc::clone(&queue), Arc::clone(&order));
            tasks.push(tokio::spawn(async move {
                let _gate = queue.enter(model, priority).await;
                order.lock().unwrap().push(model);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }));
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(queue.position("high"), Some(1));
        assert_eq!(queue.position("low"), Some(2));
        assert_eq!(queue.len(), 4);
        // A waiter that gives up leaves its place.
        tasks.remove(1).abort();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        assert_eq!(queue.len(), 3);
        drop(first);
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(*order.lock().unwrap(), ["high", "low", "later"]);
        assert_eq!(queue.len(), 0);
    }
}
