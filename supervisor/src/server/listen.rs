//! Where the sidecar listens, and how it holds connections.
//!
//! `axum::serve` has no header-read timeout, no connection cap and a
//! graceful shutdown that waits for every connection forever, so berth runs
//! its own accept loop over hyper's HTTP/1 connection (what `axum::serve`
//! uses underneath):
//! - a request's head must arrive within `header_timeout`, on a new
//!   connection and on a kept-alive one waiting for its next request (hyper
//!   restarts the timer there), so slow-header and idle connections are shed;
//! - at most `max_connections` are held; past that a new connection gets a
//!   503 in one write and is closed at once, so the process never runs out
//!   of descriptors and the clients it already serves keep being served;
//! - a write that makes no progress for `send_timeout` (a client that does
//!   not read its answer) drops the connection, so a stalled reader holds
//!   its slot and its answer's memory for that long at most;
//! - on shutdown every connection is told to finish its current request and
//!   close, and the caller decides how long to wait for them.

use std::net::SocketAddr;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{Semaphore, watch};

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    Tcp(SocketAddr),
    Unix(PathBuf),
}

impl Listen {
    /// `127.0.0.1:7733`, `[::1]:7733`, `localhost:7733`, or `unix:/path`.
    pub fn parse(text: &str) -> Result<Listen, String> {
        if let Some(path) = text.strip_prefix("unix:") {
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        let text = text.replace("localhost:", "127.0.0.1:");
        text.parse::<SocketAddr>().map(Listen::Tcp).map_err(|_| {
            format!("`{text}` is not an address to listen on (try 127.0.0.1:7733 or unix:/path)")
        })
    }

    /// Loopback addresses and unix sockets are private to this machine.
    pub fn is_private(&self) -> bool {
        match self {
            Listen::Tcp(addr) => addr.ip().is_loopback(),
            Listen::Unix(_) => true,
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(addr) => write!(f, "http://{addr}"),
            Listen::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// How connections are held.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    pub max_connections: usize,
    pub header_timeout: Duration,
    /// A write that makes no progress this long drops the connection.
    pub send_timeout: Duration,
}

/// A bound listener. A unix socket it created is removed when it is
/// dropped, and only if the path still holds that very socket.
#[derive(Debug)]
pub enum Bound {
    Tcp(tokio::net::TcpListener),
    Unix {
        listener: tokio::net::UnixListener,
        path: PathBuf,
        /// (device, inode) of the socket this server created.
        identity: (u64, u64),
    },
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Bound::Unix { path, identity, .. } = self
            && std::fs::symlink_metadata(&*path).is_ok_and(|m| (m.dev(), m.ino()) == *identity)
        {
            let _ = std::fs::remove_file(&*path);
        }
    }
}

impl Bound {
    /// A copy of the listening socket (close-on-exec), which an in-place
    /// upgrade hands over.
    pub(crate) fn duplicate(&self) -> std::io::Result<std::os::fd::OwnedFd> {
        use std::os::fd::AsFd;
        match self {
            Bound::Tcp(listener) => listener.as_fd().try_clone_to_owned(),
            Bound::Unix { listener, .. } => listener.as_fd().try_clone_to_owned(),
        }
    }

    /// The listening socket an in-place upgrade handed over, for `listen`
    /// (what the command line and config say; the socket is what the
    /// previous berth listened on).
    pub(crate) fn handed_over(listen: &Listen, fd: std::os::fd::OwnedFd) -> Result<Bound, String> {
        let fail = |e: std::io::Error| format!("cannot take over the listening socket: {e}");
        match listen {
            Listen::Tcp(addr) => {
                let std = std::net::TcpListener::from(fd);
                let at = std.local_addr().map_err(fail)?;
                if at != *addr {
                    tracing::warn!(
                        "the handed-over socket listens on {at}, the config says {addr}:                          berth listens on {at} (restart it to change the address)"
                    );
                }
                std.set_nonblocking(true).map_err(fail)?;
                tokio::net::TcpListener::from_std(std)
                    .map(Bound::Tcp)
                    .map_err(fail)
            }
            Listen::Unix(path) => {
                let std = std::os::unix::net::UnixListener::from(fd);
                let at = std.local_addr().map_err(fail)?;
                if at.as_pathname() != Some(path.as_path()) {
                    return Err(format!(
                        "the handed-over socket is {at:?}, not {}: restart berth to change                          the address",
                        path.display()
                    ));
                }
                std.set_nonblocking(true).map_err(fail)?;
                let meta = std::fs::symlink_metadata(path).map_err(fail)?;
                Ok(Bound::Unix {
                    listener: tokio::net::UnixListener::from_std(std).map_err(fail)?,
                    path: path.clone(),
                    identity: (meta.dev(), meta.ino()),
                })
            }
        }
    }
}

/// Binds `listen`. A unix socket path is taken over only when it holds a
/// socket that nothing answers on (a crashed server's); a live socket, or
/// anything that is not a socket, is refused and left where it is.
pub async fn bind(listen: &Listen) -> Result<Bound, String> {
    match listen {
        Listen::Tcp(addr) => tokio::net::TcpListener::bind(addr)
            .await
            .map(Bound::Tcp)
            .map_err(|e| format!("cannot listen on {listen}: {e}")),
        Listen::Unix(path) => {
            bind_unix(path).map_err(|e| format!("cannot listen on {listen}: {e}"))
        }
    }
}

fn bind_unix(path: &Path) -> Result<Bound, String> {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(format!(
                "`{}` exists and is not a socket; refusing to replace it (choose another path)",
                path.display()
            ));
        }
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => {
                return Err(format!(
                    "another server is listening on `{}`; stop it first or choose another path",
                    path.display()
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                // A socket nobody listens on: a crashed server's leftover.
                std::fs::remove_file(path)
                    .map_err(|e| format!("cannot remove the stale socket: {e}"))?;
            }
            Err(e) => return Err(format!("cannot tell whether the socket is in use: {e}")),
        }
    }
    // Created 0600 from the start: a chmod after bind would leave a moment
    // in which anyone could connect (and stay connected).
    // SAFETY: umask only swaps the process's file-creation mask.
    let previous = unsafe { libc::umask(0o177) };
    let bound = tokio::net::UnixListener::bind(path);
    // SAFETY: as above, restoring the mask.
    unsafe { libc::umask(previous) };
    let listener = bound.map_err(|e| e.to_string())?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("cannot restrict it to mode 0600: {e}"))?;
    let meta = std::fs::symlink_metadata(path).map_err(|e| e.to_string())?;
    Ok(Bound::Unix {
        listener,
        path: path.to_path_buf(),
        identity: (meta.dev(), meta.ino()),
    })
}

/// The connections being served, across the accept loops of the server's
/// life; [`Connections::wait_closed`] waits for them to end. Each is
/// counted under the epoch it was accepted in, so an upgrade can wait for
/// the connections older than its start to finish while it still accepts
/// (the newer ones are told to close after one request).
#[derive(Debug, Clone)]
pub struct Connections {
    slots: Arc<Semaphore>,
    max: usize,
    epoch: Arc<std::sync::atomic::AtomicU64>,
    by_epoch: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, usize>>>,
}

/// One connection's place in [`Connections`], given back when dropped.
struct Held {
    _slot: tokio::sync::OwnedSemaphorePermit,
    epoch: u64,
    by_epoch: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, usize>>>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut by = self.by_epoch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = by.get_mut(&self.epoch) {
            *n -= 1;
            if *n == 0 {
                by.remove(&self.epoch);
            }
        }
    }
}

impl Connections {
    /// Room for `max` connections at once.
    pub fn new(max: usize) -> Connections {
        Connections {
            slots: Arc::new(Semaphore::new(max)),
            max,
            epoch: Arc::default(),
            by_epoch: Arc::default(),
        }
    }

    pub fn open(&self) -> usize {
        self.max - self.slots.available_permits()
    }

    /// A slot for a new connection, counted in the current epoch; `None`
    /// at the cap.
    fn hold(&self) -> Option<Held> {
        let slot = Arc::clone(&self.slots).try_acquire_owned().ok()?;
        let epoch = self.epoch.load(std::sync::atomic::Ordering::SeqCst);
        *self
            .by_epoch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(epoch)
            .or_default() += 1;
        Some(Held {
            _slot: slot,
            epoch,
            by_epoch: Arc::clone(&self.by_epoch),
        })
    }

    /// Starts a new epoch: connections accepted from now on are counted
    /// apart from those open now. Returns it.
    pub fn new_epoch(&self) -> u64 {
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1
    }

    /// The connections open that were accepted before epoch `epoch`.
    pub fn open_before(&self, epoch: u64) -> usize {
        self.by_epoch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .range(..epoch)
            .map(|(_, n)| n)
            .sum()
    }

    /// True once every connection accepted before `epoch` has closed,
    /// false if `timeout` passed first.
    pub async fn wait_closed_before(&self, epoch: u64, timeout: Duration) -> bool {
        let until = tokio::time::Instant::now() + timeout;
        while self.open_before(epoch) > 0 {
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        true
    }

    /// True once every connection has closed, false if `timeout` passed first.
    pub async fn wait_closed(&self, timeout: Duration) -> bool {
        let all = u32::try_from(self.max).unwrap_or(u32::MAX);
        tokio::time::timeout(timeout, self.slots.acquire_many(all))
            .await
            .is_ok()
    }
}

/// The refusal a connection past the cap gets, written in one go.
fn refusal(max: usize) -> Vec<u8> {
    let body = serde_json::json!({ "error": {
        "message": format!("berth is holding its maximum of {max} connections; retry shortly \
                            (raise max_connections in the config if this is normal load)"),
        "type": "server_error",
        "code": "too_many_connections",
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n\
         connection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Accepts and serves connections (counted in `connections`) until `stop`
/// turns true, then tells every open connection to finish its request and
/// close; the caller waits for them as long as it chooses.
pub async fn serve(
    bound: &Bound,
    app: watch::Receiver<Router>,
    limits: ConnectionLimits,
    closing: &Arc<std::sync::atomic::AtomicBool>,
    mut stop: watch::Receiver<bool>,
    connections: &Connections,
) {
    let refusal = refusal(limits.max_connections);
    loop {
        let accepted = tokio::select! {
            // A stop first: what is still in the backlog stays there (for
            // an upgrade's next program).
            biased;
            _ = stop.wait_for(|s| *s) => break,
            accepted = accept(bound) => accepted,
        };
        let stream = match accepted {
            Ok(stream) => stream,
            Err(e) => {
                // EMFILE and the like: wait for descriptors to come back
                // rather than spinning.
                tracing::warn!("cannot accept a connection: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(slot) = connections.hold() else {
            stream.refuse(&refusal);
            continue;
        };
        let (app, stop, closing) = (app.clone(), stop.clone(), Arc::clone(closing));
        tokio::spawn(async move {
            match stream {
                Stream::Tcp(s) => serve_one(s, app, limits, closing, stop).await,
                Stream::Unix(s) => serve_one(s, app, limits, closing, stop).await,
            }
            drop(slot);
        });
    }
}

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

impl Stream {
    /// One non-blocking write of the refusal (a new socket's send buffer
    /// holds it), then close: a client that does not read cannot hold it.
    fn refuse(self, refusal: &[u8]) {
        let _ = match &self {
            Stream::Tcp(s) => s.try_write(refusal),
            Stream::Unix(s) => s.try_write(refusal),
        };
    }
}

async fn accept(bound: &Bound) -> std::io::Result<Stream> {
    match bound {
        Bound::Tcp(listener) => {
            let (stream, _) = listener.accept().await?;
            let _ = stream.set_nodelay(true);
            Ok(Stream::Tcp(stream))
        }
        Bound::Unix { listener, .. } => Ok(Stream::Unix(listener.accept().await?.0)),
    }
}

async fn serve_one<S>(
    stream: S,
    app: watch::Receiver<Router>,
    limits: ConnectionLimits,
    closing: Arc<std::sync::atomic::AtomicBool>,
    mut stop: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    // Each request is served by the front door current when it comes (a
    // reload replaces it), kept-alive connections included. While
    // `closing` (an upgrade is about to stop accepting), each answer says
    // `Connection: close`: its client opens a new connection for its next
    // request (which waits in the backlog for the new binary) rather than
    // send it into one that is about to close.
    // Set once a request has begun: a connection accepted as a stop came
    // serves its first request before it closes (its client sent it).
    let begun = Arc::new(tokio::sync::Notify::new());
    let first = Arc::clone(&begun);
    let service = hyper::service::service_fn(move |request| {
        use hyper::service::Service;
        first.notify_one();
        let call = TowerToHyperService::new(app.borrow().clone()).call(request);
        let closing = Arc::clone(&closing);
        async move {
            call.await.map(|mut response| {
                if closing.load(std::sync::atomic::Ordering::SeqCst) {
                    response.headers_mut().insert(
                        axum::http::header::CONNECTION,
                        axum::http::HeaderValue::from_static("close"),
                    );
                }
                response
            })
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let stream = SendTimeout::new(stream, limits.send_timeout);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => return,
        _ = stop.wait_for(|s| *s) => {}
    }
    // No request yet: it may be on its way (the connection was accepted
    // as the stop came, and its client wrote at once); closing now would
    // cut it off unanswered. Its first request is awaited, within the
    // header timeout, and answered (with `Connection: close`).
    let begun_once = begun.notified();
    tokio::pin!(begun_once);
    if begun_once.as_mut().enable() {
        // A request began already (its permit was stored): go on.
    } else {
        tokio::select! {
            _ = connection.as_mut() => return,
            () = begun_once => {}
            () = tokio::time::sleep(limits.header_timeout) => {}
        }
    }
    connection.as_mut().graceful_shutdown();
    let _ = connection.await;
}

/// A connection whose writes must make progress: once a write (or flush)
/// has waited `timeout` without the peer taking a byte, it fails with
/// `TimedOut` and hyper drops the connection. Reads are untouched (the
/// header and body timeouts bound them).
struct SendTimeout<S> {
    inner: S,
    timeout: Duration,
    /// Armed when a write first waits; disarmed by any progress.
    stalled: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<S> SendTimeout<S> {
    fn new(inner: S, timeout: Duration) -> Self {
        SendTimeout {
            inner,
            timeout,
            stalled: None,
        }
    }

    /// After the inner write or flush returned `poll`: disarm on progress;
    /// on a wait, arm the timer (once) and fail if it has run out.
    fn watch<T>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        poll: std::task::Poll<std::io::Result<T>>,
    ) -> std::task::Poll<std::io::Result<T>> {
        use std::future::Future;
        use std::task::Poll;
        match poll {
            Poll::Ready(result) => {
                self.stalled = None;
                Poll::Ready(result)
            }
            Poll::Pending => {
                let timeout = self.timeout;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "the client took no byte of its answer for {} s (send_timeout)",
                            timeout.as_secs_f64()
                        ),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for SendTimeout<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendTimeout<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, poll)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let poll = std::pin::Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, poll)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Raises the soft limit on open descriptors to the hard one, as servers
/// do: each connection and each worker (pipes, IPC) takes descriptors, and
/// the usual soft limit of 1024 is below what `max_connections` allows.
pub fn raise_descriptor_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit read and write the struct given, nothing else.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 && limit.rlim_cur < limit.rlim_max
        {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}
