//! The service manager's readiness protocol (`sd_notify`): with
//! `NOTIFY_SOCKET` set, as systemd sets it for a `Type=notify` unit, berth
//! says `READY=1` once it listens, `STOPPING=1` when a shutdown begins,
//! a `STATUS=` line for each, and `WATCHDOG=1` at half of `WATCHDOG_USEC`
//! while it runs. Without `NOTIFY_SOCKET` every call does nothing.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

/// Where the service manager listens: a path, or (`@name`) an abstract name.
fn address() -> Option<SocketAddr> {
    let socket = std::env::var_os("NOTIFY_SOCKET")?;
    let socket = socket.to_str()?;
    match socket.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()).ok(),
        None if socket.starts_with('/') => SocketAddr::from_pathname(socket).ok(),
        None => None,
    }
}

/// Sends `state` (newline-separated `KEY=VALUE` lines). Failures are logged
/// and otherwise ignored: a service manager that cannot be told is no
/// reason to stop serving.
pub fn notify(state: &str) {
    let Some(addr) = address() else { return };
    let sent = UnixDatagram::unbound().and_then(|s| s.send_to_addr(state.as_bytes(), &addr));
    if let Err(e) = sent {
        tracing::warn!("cannot notify the service manager ({state:?}): {e}");
    }
}

/// The watchdog interval the service manager asked for, if any: half its
/// `WATCHDOG_USEC`, when `WATCHDOG_PID` is unset or names this process.
pub fn watchdog_interval() -> Option<Duration> {
    if let Some(pid) = std::env::var_os("WATCHDOG_PID")
        && pid.to_str() != Some(&std::process::id().to_string())
    {
        return None;
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// Pets the watchdog until the process exits (a task of the server's).
pub async fn watchdog() {
    let Some(every) = watchdog_interval() else {
        return;
    };
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        notify("WATCHDOG=1");
    }
}

/// `CLOCK_MONOTONIC` now, in microseconds (what `RELOADING=1` is sent
/// with).
pub(crate) fn monotonic_usec() -> u64 {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the struct we own.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
}
