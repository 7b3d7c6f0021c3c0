//! Where an HTTP server is told to listen, and a check that it is the one
//! listening there.
//!
//! berth picks a free loopback port for each start (`{port}`) and lets go
//! of it for the server to bind, so another process can take it first. Two
//! things keep that from going unseen: a port handed out is not handed out
//! again while its server lives (two of berth's own starts cannot draw the
//! same one), and once the server is ready every socket listening on its
//! port must be one of the server's own (a stranger answering the health
//! check, or sharing the port by `SO_REUSEPORT` as vLLM binds, fails the
//! load). A `{socket}` folder is berth's own (0700), named by this process
//! and a counter only, so its path stays within a socket path's 108 bytes.

use std::collections::{BTreeSet, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Ports handed out to servers that still live.
static IN_USE: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// What one server start holds: its port or its socket's folder, given
/// back when dropped (with the server, or with a start that failed).
#[derive(Debug)]
pub(crate) struct Reserved {
    port: Option<u16>,
    dir: Option<PathBuf>,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if let Some(port) = self.port {
            IN_USE
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&port);
        }
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// A loopback port free now and not handed to another of berth's servers.
pub(crate) fn port() -> Result<(SocketAddr, Reserved), String> {
    for _ in 0..16 {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("cannot find a free loopback port: {e}"))?;
        if IN_USE
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr.port())
        {
            let reserved = Reserved {
                port: Some(addr.port()),
                dir: None,
            };
            return Ok((addr, reserved));
        }
    }
    Err("cannot find a loopback port not already given to a server".into())
}

/// A private folder (0700) for one server's socket.
pub(crate) fn socket_dir() -> Result<(PathBuf, Reserved), String> {
    use std::os::unix::fs::DirBuilderExt;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // A name already taken (left by an earlier berth with the same pid, as
    // pid 1 in a container, or made by someone else) is passed over.
    for _ in 0..64 {
        let dir = std::env::temp_dir().join(format!(
            "berth-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                let reserved = Reserved {
                    port: None,
                    dir: Some(dir.clone()),
                };
                return Ok((dir, reserved));
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("cannot make a folder for the server's socket: {e}")),
        }
    }
    Err("cannot make a folder for the server's socket: 64 names in a row were taken".into())
}

/// The inodes of the sockets listening on loopback (or every address) at
/// `port`, from `/proc/net/tcp` and `tcp6`.
fn listening_on(port: u16) -> HashSet<u64> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        inodes.extend(listeners_in(&text, port));
    }
    inodes
}

/// The listening sockets' inodes at `port` in one `/proc/net/tcp*` table,
/// on the addresses a connection to `127.0.0.1:port` can reach: loopback
/// or every address (a listener on another address is not in the way).
fn listeners_in(table: &str, port: u16) -> Vec<u64> {
    const REACHED: [&str; 4] = [
        "0100007F",                         // 127.0.0.1
        "00000000",                         // 0.0.0.0
        "00000000000000000000000000000000", // ::
        "0000000000000000FFFF00000100007F", // ::ffff:127.0.0.1
    ];
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st ... uid timeout inode
            let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
            let (address, at) = local.split_once(':')?;
            let reached = REACHED.contains(&address) && u16::from_str_radix(at, 16).ok()? == port;
            (reached && *state == "0A")
                .then(|| inode.parse().ok())
                .flatten()
        })
        .collect()
}

/// The socket inodes the processes `pids` hold open.
fn sockets_of(pids: &[u32]) -> HashSet<u64> {
    let mut inodes = HashSet::new();
    for pid in pids {
        let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Ok(target) = std::fs::read_link(fd.path()) else {
                continue;
            };
            let target = target.to_string_lossy();
            if let Some(inode) = target
                .strip_prefix("socket:[")
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse().ok())
            {
                inodes.insert(inode);
            }
        }
    }
    inodes
}

/// `Err` naming why when a socket listening on `port` is not one of the
/// server's (`tree`: its processes). Where the tables cannot be read, or
/// show no listener (another network namespace), nothing is claimed.
pub(crate) fn check_listener(port: u16, tree: &[u32]) -> Result<(), String> {
    let listening = listening_on(port);
    if listening.is_empty() {
        return Ok(());
    }
    let own = sockets_of(tree);
    let strangers = listening.iter().filter(|i| !own.contains(i)).count();
    if strangers == 0 {
        return Ok(());
    }
    Err(format!(
        "another process also listens on its port {port} ({strangers} socket(s) not the \
         server's): it may have answered the health check, or share the port"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_are_read_from_the_kernel_s_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4343 1 0000000000000000 20 4 30 10 -1
   2: 00000000:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0000000000000000 100 0 0 10 0
   3: 0500000A:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4545 1 0000000000000000 100 0 0 10 0
";
        assert_eq!(listeners_in(table, 0x1F90), [4242]);
        assert_eq!(listeners_in(table, 0x1F91), [4444]);
        assert!(listeners_in(table, 80).is_empty());
    }

    #[test]
    fn a_port_is_not_handed_out_twice_while_held() {
        let (a, held) = port().unwrap();
        let (b, _other) = port().unwrap();
        assert_ne!(a.port(), b.port());
        assert!(IN_USE.lock().unwrap().contains(&a.port()));
        drop(held);
        assert!(!IN_USE.lock().unwrap().contains(&a.port()));
    }

    #[test]
    fn our_own_listener_passes_and_a_stranger_s_does_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(check_listener(port, &[std::process::id()]).is_ok());
        let err = check_listener(port, &[1]).unwrap_err();
        assert!(err.contains(&port.to_string()), "{err}");
    }
}
