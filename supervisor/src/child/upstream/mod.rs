//! The supervisor's side of an unmodified HTTP inference server (llama.cpp's
//! server, vLLM, TabbyAPI, infinity) run as a model's worker.
//!
//! The process is a worker like any other: the same spawn (own group, own
//! cgroup, parent-death signal, cleared environment plus the kind's, GPU
//! placement), output handling, memory accounting, stop and reports. What
//! differs is the link:
//! - its command names `{port}` (a free loopback port chosen for each
//!   start, so a swap's new server has its own) or `{socket}` (a unix socket
//!   path chosen likewise), and `{model}`, the model's resolved path;
//! - it is ready when `GET health` answers 200, polled every 100 ms within
//!   the load timeout (a server that exits first fails the load with its
//!   exit and stderr);
//! - the heartbeat is the same poll, once a second, while it runs;
//! - a request is an HTTP exchange, relayed by the front door over a small
//!   pool of kept-alive connections (`server/relay.rs`); the bytes relayed
//!   are the worker's progress counter, for stall detection;
//! - there is no shutdown message: a stop runs the kind's `stop_command`
//!   if it has one (`docker stop NAME`), else sends its `stop_signal` to the
//!   group, waits `stop_grace`, then SIGKILL.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use nix::sys::signal::Signal;

use crate::config::HttpSpec;
use crate::repoll::Repoll;

/// An environment: `(name, value)` pairs.
pub(crate) type Env = [(String, String)];

/// Default grace between the stop signal and SIGKILL.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// How long a server may not answer its health before it is lost.
pub const DEFAULT_UNHEALTHY_AFTER: Duration = Duration::from_secs(30);
/// Idle kept-alive connections kept per server.
const POOL: usize = 32;

pub use super::ports::Address;

/// A command line with its placeholders filled in, and where the server
/// it starts will listen.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub args: Vec<String>,
    pub path: String,
    pub address: Address,
    /// Its port or socket folder, given back with the server.
    pub reserved: Arc<super::ports::Reserved>,
}

/// Fills in `{port}`, `{socket}` and `{model}` in `program` and `args`.
/// With `fixed`, the server listens on that port of its own (its command
/// may name it, or `{port}`; whether it is free is checked at each start,
/// [`super::ports::check_free`]). With `find`, on one its command does not
/// say: found once it is started. `host` is where the server is reached
/// ([`HttpSpec::host`]; `None`: `127.0.0.1`).
pub(crate) fn prepare(
    program: &str,
    args: &[String],
    weights: Option<&Path>,
    fixed: Option<u16>,
    find: bool,
    host: Option<&str>,
) -> Result<Prepared, String> {
    let all = || std::iter::once(program).chain(args.iter().map(String::as_str));
    let wants_port = all().any(|a| a.contains("{port}"));
    let wants_socket = all().any(|a| a.contains("{socket}"));
    let reach = crate::config::Reach::of(host)?;
    let at = |port: u16| match &reach {
        crate::config::Reach::Loopback(ip) => Address::Tcp(std::net::SocketAddr::new(*ip, port)),
        crate::config::Reach::Elsewhere(host) => Address::Host(host.clone(), port),
    };
    if let crate::config::Reach::Elsewhere(host) = &reach {
        if find {
            return Err(format!(
                "`http.find_port` finds the port the server's processes listen on here; on \
                 `{host}` give `http.port` or name `{{port}}` in the command"
            ));
        }
        if wants_socket {
            return Err(format!(
                "the command names `{{socket}}`, a unix socket on this machine, but the server \
                 is reached on `{host}`"
            ));
        }
    }
    let (address, reserved) = match (wants_port, wants_socket, fixed) {
        (false, false, None) if find => (
            // Found once it listens (`launch.rs`).
            at(0),
            super::ports::Reserved::nothing(),
        ),
        (_, _, None) if find => {
            return Err(
                "`http.find_port` is for a server whose command names no port; this one names \
                 `{port}` or `{socket}`"
                    .into(),
            );
        }
        (_, true, Some(port)) => {
            return Err(format!(
                "the command names `{{socket}}` but the server listens on port {port} of its own"
            ));
        }
        (_, false, Some(port)) => (at(port), super::ports::Reserved::nothing()),
        (true, false, None) => {
            let (addr, reserved) = super::ports::port()?;
            (at(addr.port()), reserved)
        }
        (false, true, None) => {
            let (dir, reserved) = super::ports::socket_dir()?;
            (Address::Unix(dir.join("server.sock")), reserved)
        }
        (true, true, None) => {
            return Err("the command names both `{port}` and `{socket}`".into());
        }
        (false, false, None) => {
            return Err(
                "the command must name `{port}` (a loopback port berth chooses for each start) \
                 or `{socket}` (a unix socket path), where the server is to listen"
                    .into(),
            );
        }
    };
    if all().any(|a| a.contains("{model}")) && weights.is_none() {
        return Err("the command names `{model}` but the model has no `model` path".into());
    }
    let fill = |text: &str| {
        let mut text = text.to_string();
        match &address {
            Address::Tcp(addr) => text = text.replace("{port}", &addr.port().to_string()),
            Address::Host(_, port) => text = text.replace("{port}", &port.to_string()),
            Address::Unix(path) => text = text.replace("{socket}", &path.display().to_string()),
        }
        if let Some(weights) = weights {
            text = text.replace("{model}", &weights.display().to_string());
        }
        text
    };
    Ok(Prepared {
        path: fill(program),
        args: args.iter().map(|a| fill(a)).collect(),
        address,
        reserved: Arc::new(reserved),
    })
}

/// A connection's I/O: polled by whoever uses the connection.
type Driver = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A kept-alive connection to the server. Its I/O has no task of its own:
/// the request that uses it drives it (while its answer's head comes, then
/// as its body is read), so a relayed request wakes no other task, and
/// often no other thread, on its way there and back.
struct Conn {
    sender: SendRequest<Body>,
    io: Io,
    /// Since when it has waited in the pool; `None` until its first answer.
    idle_since: Option<Instant>,
}

/// A connection's I/O, and the one waker everything on the connection is
/// polled with ([`Repoll`]: the request and the connection wake each
/// other as they go, and that must not make the task yield).
struct Io {
    /// `None` once the connection has ended.
    driver: Option<Driver>,
    waker: Arc<Repoll>,
}

impl Conn {
    /// An HTTP/1 connection over `stream` (TCP or a unix socket).
    async fn over<S>(stream: S) -> std::io::Result<Conn>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        Ok(Conn {
            sender,
            io: Io {
                driver: Some(Box::pin(async move {
                    let _ = connection.await;
                })),
                waker: Arc::default(),
            },
            idle_since: None,
        })
    }

    /// Whether the connection has ended, once what its socket holds now is
    /// read (a server that closed it while it waited in the pool).
    fn ended(&mut self) -> bool {
        let Io { driver, waker } = &mut self.io;
        waker.poll_alone(|cx| drive(driver, cx))
    }
}

/// Polls a connection's I/O; true once it has ended.
fn drive(driver: &mut Option<Driver>, cx: &mut std::task::Context<'_>) -> bool {
    let Some(io) = driver else { return true };
    if io.as_mut().poll(cx).is_pending() {
        return false;
    }
    *driver = None;
    true
}

/// Polls `work` (a request on the connection, or its answer's body) and the
/// connection's I/O together, in the task that uses them.
fn poll_driven<T>(
    io: &mut Io,
    cx: &mut std::task::Context<'_>,
    mut work: impl FnMut(&mut std::task::Context<'_>) -> std::task::Poll<T>,
) -> std::task::Poll<T> {
    let Io { driver, waker } = io;
    waker.poll(cx, |cx| {
        drive(driver, cx);
        work(cx)
    })
}

/// Runs `work` (a request on the connection: its readiness, its answer's
/// head) while driving the connection's I/O from the same task. `work`
/// must do nothing until polled (an `async` block), so that what it wakes
/// is seen as part of the poll.
async fn driven<F: std::future::Future>(io: &mut Io, work: F) -> F::Output {
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| poll_driven(io, cx, |cx| work.as_mut().poll(cx))).await
}

/// How long a connection may wait in the pool: below the keep-alive of the
/// servers berth runs (uvicorn's and llama.cpp's own 5 s), so a request is
/// never written into a connection the server is closing.
const IDLE_MAX: Duration = Duration::from_secs(2);

/// A running HTTP server, as the supervisor reaches it.
pub struct Upstream {
    model: String,
    address: Address,
    spec: HttpSpec,
    idle: Mutex<Vec<Conn>>,
    /// Bytes relayed from the server: the progress counter.
    progress: AtomicU64,
    /// Requests answered (headers received).
    answered: AtomicU64,
    /// Its port or socket folder, held while it lives.
    _reserved: Arc<super::ports::Reserved>,
    /// When its health last answered 200 (its readiness counts).
    last_healthy: Mutex<Instant>,
    /// The kind's environment, which its `stop_command` runs with too.
    env: Vec<(String, String)>,
    /// The container it runs in, where its command runs one.
    container: Option<super::container::Container>,
    /// Why its memory is outside what berth measures, where it is.
    outside: Option<String>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("model", &self.model)
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

/// Why a request could not be relayed.
#[derive(Debug)]
pub enum RelayError {
    /// No connection could be made, or it broke before the answer's head.
    Connect(std::io::Error),
    Http(hyper::Error),
}

impl std::fmt::Display for RelayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RelayError::Connect(e) => write!(f, "cannot connect: {e}"),
            RelayError::Http(e) => write!(f, "{e}"),
        }
    }
}

impl Upstream {
    pub(crate) fn new(
        model: &str,
        prepared: &Prepared,
        spec: HttpSpec,
        env: Vec<(String, String)>,
    ) -> Self {
        Upstream {
            model: model.to_string(),
            address: prepared.address.clone(),
            spec,
            idle: Mutex::new(Vec::new()),
            progress: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            _reserved: Arc::clone(&prepared.reserved),
            last_healthy: Mutex::new(Instant::now()),
            env,
            container: None,
            outside: None,
        }
    }

    /// The same, its memory outside what berth measures, for `why`.
    pub(crate) fn outside_berth(mut self, why: Option<String>) -> Self {
        self.outside = why;
        self
    }

    /// The same, running in `container`.
    pub(crate) fn in_container(mut self, container: Option<super::container::Container>) -> Self {
        self.container = container;
        self
    }

    /// The container it runs in, if its command runs one.
    pub(crate) fn container(&self) -> Option<&super::container::Container> {
        self.container.as_ref()
    }

    pub fn address(&self) -> &Address {
        &self.address
    }

    pub fn spec(&self) -> &HttpSpec {
        &self.spec
    }

    /// The signal that asks the server to stop.
    pub(crate) fn stop_signal(&self) -> Signal {
        match self.spec.stop_signal.as_str() {
            "SIGINT" => Signal::SIGINT,
            "SIGQUIT" => Signal::SIGQUIT,
            "SIGHUP" => Signal::SIGHUP,
            _ => Signal::SIGTERM,
        }
    }

    /// Its `stop_command` for the server `pid`, `{pid}` and `{port}` (the
    /// port this start of the server listens on) filled in, and the
    /// environment it runs with (the kind's).
    pub(crate) fn stop_command(&self, pid: u32) -> Option<(Vec<String>, &Env)> {
        let argv = self.spec.stop_command.as_ref()?;
        let pid = pid.to_string();
        let port = self.address.port().map(|p| p.to_string());
        Some((
            argv.iter()
                .map(|a| {
                    let a = a.replace("{pid}", &pid);
                    match &port {
                        Some(port) => a.replace("{port}", port),
                        None => a,
                    }
                })
                .collect(),
            &self.env,
        ))
    }

    pub(crate) fn stop_grace(&self) -> Duration {
        self.spec.stop_grace.unwrap_or(DEFAULT_STOP_GRACE)
    }

    pub(crate) fn unhealthy_after(&self) -> Duration {
        self.spec.unhealthy_after.unwrap_or(DEFAULT_UNHEALTHY_AFTER)
    }

    /// Counts relayed bytes (the worker's progress).
    pub(crate) fn relayed(&self, bytes: u64) {
        self.progress.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn progress(&self) -> u64 {
        self.progress.load(Ordering::Relaxed)
    }

    pub(crate) fn answered(&self) -> u64 {
        self.answered.load(Ordering::Relaxed)
    }

    async fn connect(&self) -> std::io::Result<Conn> {
        match &self.address {
            Address::Host(host, port) => {
                let stream = tokio::net::TcpStream::connect((host.as_str(), *port)).await?;
                let _ = stream.set_nodelay(true);
                Conn::over(stream).await
            }
            Address::Tcp(addr) => {
                let stream = tokio::net::TcpStream::connect(addr).await?;
                let _ = stream.set_nodelay(true);
                Conn::over(stream).await
            }
            Address::Unix(path) => Conn::over(tokio::net::UnixStream::connect(path).await?).await,
        }
    }

    /// An idle connection from the pool, else a new one.
    async fn checkout(&self) -> std::io::Result<Conn> {
        loop {
            let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(mut conn) = pooled else {
                return self.connect().await;
            };
            // Not closed and not too old; `send` waits for it to be ready.
            // (Dropped, a connection closes.)
            if !conn.ended()
                && !conn.sender.is_closed()
                && conn.idle_since.is_some_and(|t| t.elapsed() < IDLE_MAX)
            {
                return Ok(conn);
            }
        }
    }

    fn checkin(&self, mut conn: Conn) {
        conn.idle_since = Some(Instant::now());
        // The request's task is done with it.
        conn.io.waker.forget_task();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        // Right after an answer's last byte the connection may not yet be
        // ready for the next request (its I/O not polled since): only a
        // closed one is dropped here (checking `is_ready` had dropped every
        // connection). Dropped, a connection closes.
        if idle.len() < POOL && conn.io.driver.is_some() && !conn.sender.is_closed() {
            idle.push(conn);
        }
    }

    /// Sends `request` and returns the answer's head with its body to be
    /// read; the connection goes back to the pool once the body is read to
    /// its end, and is closed if the body is dropped before (a client that
    /// went away: the server sees its request end).
    ///
    /// A request written into a pooled connection that the server closed
    /// without a byte of answer (it closed the idle connection as the
    /// request came: uvicorn's keep-alive) is sent again, once, on a new
    /// connection: the server never read it.
    pub(crate) async fn send(
        self: &Arc<Self>,
        request: Request<axum::body::Bytes>,
    ) -> Result<Response<PooledBody>, RelayError> {
        let (parts, bytes) = request.into_parts();
        let again = || {
            let mut request = Request::new(Body::from(bytes.clone()));
            *request.method_mut() = parts.method.clone();
            *request.uri_mut() = parts.uri.clone();
            *request.version_mut() = parts.version;
            *request.headers_mut() = parts.headers.clone();
            request
        };
        let mut conn = self.checkout().await.map_err(RelayError::Connect)?;
        let mut request = again();
        let mut resent = false;
        let response = loop {
            let reused = conn.idle_since.is_some();
            if reused {
                // A pooled connection is ready at once, unless the server
                // closed it while it waited, or left it half-way (an early
                // answer to an upload it never read): then a new one.
                let ready = tokio::time::timeout(
                    Duration::from_secs(1),
                    driven(&mut conn.io, conn.sender.ready()),
                )
                .await;
                if !matches!(ready, Ok(Ok(()))) {
                    conn = self.connect().await.map_err(RelayError::Connect)?;
                    continue;
                }
            } else if let Err(e) = driven(&mut conn.io, conn.sender.ready()).await {
                return Err(RelayError::Http(e));
            }
            // Queued when called, which wakes the connection: called
            // inside the poll.
            let sender = &mut conn.sender;
            let sent = driven(&mut conn.io, async {
                sender.try_send_request(request).await
            })
            .await;
            match sent {
                Ok(response) => break response,
                Err(mut e) => {
                    // Not written at all (the connection was closing): the
                    // same request goes again, once, on a new connection.
                    match e.take_message() {
                        Some(unsent) if reused => {
                            request = unsent;
                            conn = self.connect().await.map_err(RelayError::Connect)?;
                        }
                        None if reused && !resent && e.error().is_incomplete_message() => {
                            resent = true;
                            request = again();
                            conn = self.connect().await.map_err(RelayError::Connect)?;
                        }
                        _ => return Err(RelayError::Http(e.into_error())),
                    }
                }
            }
        };
        self.answered.fetch_add(1, Ordering::Relaxed);
        let (head, body) = response.into_parts();
        Ok(Response::from_parts(
            head,
            PooledBody {
                inner: body,
                conn: Some(conn),
                upstream: Arc::clone(self),
            },
        ))
    }

    /// `GET health` within `timeout`: its status, or `None` when no answer
    /// came. Over a connection of its own, never a pooled one, so a server
    /// busy answering relayed requests still answers it at once if it can.
    pub(crate) async fn health(&self, timeout: Duration) -> Option<StatusCode> {
        let attempt = async {
            let mut conn = self.connect().await.ok()?;
            if self.spec.health == "none" {
                // No health route: accepting a connection is all there is.
                return Some(StatusCode::OK);
            }
            let request = Request::get(&self.spec.health)
                .header(axum::http::header::HOST, self.host())
                .body(Body::empty())
                .ok()?;
            let sender = &mut conn.sender;
            let response = driven(&mut conn.io, async { sender.send_request(request).await })
                .await
                .ok();
            response.map(|r| r.status())
        };
        let status = tokio::time::timeout(timeout, attempt).await.ok().flatten();
        if status == Some(StatusCode::OK) {
            *self.last_healthy.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
        status
    }

    /// One health check of a running server (a poll of at most 5 s): false
    /// once its health has not answered 200 for `window` (its
    /// `unhealthy_after`). One refused connection or one 503 is not yet a
    /// lost server.
    pub(crate) async fn still_healthy(&self, window: Duration) -> bool {
        let poll = window.min(Duration::from_secs(5));
        if self.health(poll).await == Some(StatusCode::OK) {
            return true;
        }
        let since = *self.last_healthy.lock().unwrap_or_else(|e| e.into_inner());
        since.elapsed() < window
    }

    /// The `Host` a request to the server carries.
    pub(crate) fn host(&self) -> String {
        match &self.address {
            Address::Tcp(addr) => addr.to_string(),
            Address::Host(host, port) if host.contains(':') => format!("[{host}]:{port}"),
            Address::Host(host, port) => format!("{host}:{port}"),
            Address::Unix(_) => "localhost".into(),
        }
    }

    /// Why the server's memory is not what berth measures, where it is
    /// not: it runs on another host or under a container engine's
    /// processes berth did not start (`docker compose up`).
    pub(crate) fn outside(&self) -> Option<&str> {
        self.outside.as_deref()
    }

    /// Polls `health` until it answers 200, every 100 ms: `Ok` when ready,
    /// `Err` with the last thing seen if `deadline` passes first.
    pub(crate) async fn wait_ready(&self, deadline: Instant) -> Result<(), String> {
        let mut last = "no answer".to_string();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(last);
            }
            match self.health(left.min(Duration::from_secs(2))).await {
                Some(StatusCode::OK) => return Ok(()),
                Some(status) => last = format!("GET {} answered {status}", self.spec.health),
                None => last = format!("GET {} did not answer", self.spec.health),
            }
            tokio::time::sleep(Duration::from_millis(100).min(left)).await;
        }
    }
}

/// An answer's body from the server; its connection goes back to the pool
/// when it ends, and is closed if it is dropped before its end.
pub struct PooledBody {
    inner: Incoming,
    conn: Option<Conn>,
    upstream: Arc<Upstream>,
}

impl std::fmt::Debug for PooledBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PooledBody")
    }
}

impl hyper::body::Body for PooledBody {
    type Data = axum::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        // With the connection's I/O, which brings the body's bytes.
        let this = &mut *self;
        let polled = match &mut this.conn {
            Some(conn) => poll_driven(&mut conn.io, cx, |cx| {
                std::pin::Pin::new(&mut this.inner).poll_frame(cx)
            }),
            None => std::pin::Pin::new(&mut this.inner).poll_frame(cx),
        };
        let ended = match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.upstream.relayed(data.len() as u64);
                }
                // An answer of known length ends with its last byte: whoever
                // writes it on may never poll for the end (hyper does not).
                self.inner.is_end_stream()
            }
            std::task::Poll::Ready(None) => true,
            _ => false,
        };
        if ended && let Some(conn) = self.conn.take() {
            self.upstream.checkin(conn);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // Dropped before its end: the connection is closed, so the server
        // sees the request end (llama.cpp stops generating).
        drop(self.conn.take());
    }
}

#[cfg(test)]
mod tests;
