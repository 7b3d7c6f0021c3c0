//! What the supervisor sends a worker, and how each answer comes back: its
//! `Load`, its requests (streamed or whole), and heartbeats.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use berth_protocol::{Body, Command, Event, LoadSpec, WorkerStats};

use super::{LoadOutcome, NoPong, Piece, ResponseStream, WorkerHandle, body_hash};
use crate::child::routes::{Backlog, Waiting};
use crate::child::stream::SendError;
use crate::error::{Error, Result};
use tokio::sync::mpsc;

impl WorkerHandle {
    /// Sends `command`, whose answer the reader task hands over.
    pub(super) fn send(&self, command: Command) -> std::result::Result<(), SendError> {
        if let Some(inbox) = &self.inbox {
            inbox.resume_watch();
        }
        self.commands.send(command)
    }

    /// Sends `Load` and waits for the answer, the worker's death, or the deadline.
    pub(crate) async fn load(&self, spec: LoadSpec, timeout: Duration) -> LoadOutcome {
        self.routes.expect_load();
        if self.send(Command::Load(spec)).is_err() {
            return LoadOutcome::Failed(self.death_error("load").await);
        }
        let mut control = self.control.lock().await;
        tokio::select! {
            event = control.recv() => match event {
                Some(Event::Loaded(info)) => {
                    *self.load_info.lock().unwrap_or_else(|e| e.into_inner()) = Some(info.clone());
                    LoadOutcome::Loaded(info)
                }
                Some(Event::LoadFailed(source)) => {
                    LoadOutcome::Failed(Error::LoadFailed { model: self.model.clone(), source })
                }
                Some(other) => LoadOutcome::Failed(Error::UnexpectedMessage {
                    model: self.model.clone(),
                    expected: "Loaded or LoadFailed",
                    received: other.name(),
                }),
                None => LoadOutcome::Failed(self.death_error("load").await),
            },
            _ = self.process.exited() => LoadOutcome::Failed(self.death_error("load").await),
            () = tokio::time::sleep(timeout) => LoadOutcome::TimedOut,
        }
    }

    /// Sends one request; the answer arrives on the returned stream.
    /// Dropping the stream before its end cancels the request in the worker.
    pub fn call_stream(&self, body: Body) -> Result<ResponseStream> {
        if self.upstream.is_some() {
            return Err(Error::InvalidRequest {
                model: self.model.clone(),
                reason: "it is served by an HTTP server, which takes HTTP requests: send them \
                         through berth serve's /v1 routes, or lease the model \
                         (Supervisor::lease) and send them to its address"
                    .into(),
            });
        }
        let id = self.routes.next_id();
        let (tx, rx) = mpsc::unbounded_channel();
        let unread = Arc::new(Backlog::default());
        {
            let mut routes = self.routes.lock();
            if let Some(death) = &routes.death {
                return Err(self.died(death, "request"));
            }
            routes.pending.insert(
                id,
                Waiting {
                    tx,
                    hash: body_hash(&body),
                    unread: Arc::clone(&unread),
                },
            );
        }
        self.in_flight.enter();
        // A caller that will spin for the answer pauses the socket's watch
        // before the request goes out (see `Inbox::spin`).
        let spinning = match &self.inbox {
            Some(inbox) if self.answer_time.spin().is_some() && self.in_flight.count() == 1 => {
                Some(inbox.spin())
            }
            _ => None,
        };
        let stream = ResponseStream {
            id,
            rx,
            finished: false,
            model: self.model.clone(),
            pid: self.pid,
            routes: Arc::clone(&self.routes),
            commands: self.commands.clone(),
            in_flight: Arc::clone(&self.in_flight),
            unread,
            run: None,
            sent_at: Instant::now(),
            answer_time: Arc::clone(&self.answer_time),
            inbox: self.inbox.clone(),
            spinning,
            pieces: false,
        };
        self.requests.fetch_add(1, Ordering::Relaxed);
        // The request itself: its caller's spin reads the answer.
        let sent = match &stream.spinning {
            Some(_) => self.commands.send(Command::Request { id, body }),
            None => self.send(Command::Request { id, body }),
        };
        match sent {
            Ok(()) => {}
            // The worker is gone; its death watch answers the stream.
            Err(SendError::Closed) => {
                tracing::debug!(model = %self.model, pid = self.pid, "request sent to a closed channel");
            }
            Err(SendError::Refused(reason)) => {
                let mut stream = stream;
                stream.forget();
                return Err(Error::Request {
                    model: self.model.clone(),
                    source: berth_protocol::WireError::new(
                        berth_protocol::ErrorKind::BadRequest,
                        format!(
                            "model `{}`: the request cannot be sent: {reason}",
                            self.model
                        ),
                    ),
                });
            }
        }
        Ok(stream)
    }

    /// Sends one request and waits for its result (chunks are skipped; the
    /// final body holds the whole answer).
    pub async fn call(&self, body: Body) -> Result<Body> {
        let mut stream = self.call_stream(body)?;
        loop {
            match stream.next().await {
                Some(Ok(Piece::Done(body))) => return Ok(body),
                Some(Ok(Piece::Chunk(_))) => continue,
                Some(Err(e)) => return Err(e),
                None => return Err(self.death_error("request").await),
            }
        }
    }

    /// Pings the worker and waits for its pong (its own stats). An HTTP
    /// server's health is polled instead, `timeout` being how long it may go
    /// without answering 200: its stats are then the supervisor's own
    /// figures (bytes relayed as progress).
    pub async fn ping(&self, timeout: Duration) -> Option<WorkerStats> {
        self.heartbeat(timeout).await.ok()
    }

    /// [`Self::ping`], saying why no pong came: silence for `timeout`, or
    /// a channel already gone (the worker died, and is not reaped yet).
    pub(crate) async fn heartbeat(&self, timeout: Duration) -> Result<WorkerStats, NoPong> {
        if let Some(upstream) = &self.upstream {
            // `timeout` is its `unhealthy_after`: a window, not one poll.
            if !upstream.still_healthy(timeout).await {
                return Err(NoPong::Silent);
            }
            let stats = WorkerStats {
                rss_bytes: self.memory().last.rss_bytes,
                peak_rss_bytes: self.memory().last.peak_rss_bytes,
                progress: upstream.progress(),
                requests_done: upstream.answered(),
                in_flight: self.in_flight(),
            };
            self.record_stats(stats);
            return Ok(stats);
        }
        let seq = self.next_seq.fetch_add(1, Ordering::Relaxed);
        let mut pongs = self.pongs.clone();
        self.send(Command::Ping { seq }).map_err(|_| NoPong::Gone)?;
        let waited = tokio::time::timeout(
            timeout,
            pongs.wait_for(|p| p.as_ref().is_some_and(|(s, _)| *s >= seq)),
        )
        .await;
        let stats = match waited {
            Ok(Ok(pong)) => pong.as_ref().map(|(_, stats)| *stats).ok_or(NoPong::Gone)?,
            // The reader dropped the pongs: the worker's channel ended.
            Ok(Err(_)) => return Err(NoPong::Gone),
            Err(_) => return Err(NoPong::Silent),
        };
        self.record_stats(stats);
        Ok(stats)
    }
}
