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

/// Where a server listens.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Address {
    Tcp(std::net::SocketAddr),
    Unix(PathBuf),
    /// On another host, by its name (resolved at each connection: a
    /// compose service's name answers only once it runs).
    Host(String, u16),
}

impl Address {
    /// Its port, where it has one.
    pub fn port(&self) -> Option<u16> {
        match self {
            Address::Tcp(addr) => Some(addr.port()),
            Address::Host(_, port) => Some(*port),
            Address::Unix(_) => None,
        }
    }
}

impl std::fmt::Display for Address {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Address::Tcp(addr) => write!(f, "http://{addr}"),
            Address::Unix(path) => write!(f, "unix:{}", path.display()),
            Address::Host(host, port) if host.contains(':') => write!(f, "http://[{host}]:{port}"),
            Address::Host(host, port) => write!(f, "http://{host}:{port}"),
        }
    }
}

/// Ports handed out to servers that still live.
static IN_USE: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());

/// What one server start holds: its port or its socket's folder, given
/// back when dropped (with the server, or with a start that failed).
#[derive(Debug)]
pub(crate) struct Reserved {
    port: Option<u16>,
    dir: Option<PathBuf>,
}

impl Reserved {
    /// Nothing held: a server on a port of its own.
    pub(crate) fn nothing() -> Reserved {
        Reserved {
            port: None,
            dir: None,
        }
    }
}

impl Reserved {
    /// What a server handed over by an in-place upgrade holds: its port
    /// (kept from other servers again) or its socket's folder (removed
    /// with it).
    pub(crate) fn taken_over(address: &Address) -> Reserved {
        match address {
            Address::Tcp(addr) => {
                let port = addr.port();
                IN_USE
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(port);
                Reserved {
                    port: Some(port),
                    dir: None,
                }
            }
            Address::Host(..) => Reserved::nothing(),
            Address::Unix(path) => Reserved {
                port: None,
                dir: path
                    .parent()
                    .filter(|d| {
                        d.file_name()
                            .is_some_and(|n| n.to_string_lossy().starts_with("berth-"))
                    })
                    .map(std::path::Path::to_path_buf),
            },
        }
    }
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

/// Whether `port`, the loopback port a server listens on of its own (a
/// fixed port, in its command line), is free now, whoever would hold it.
/// Checked at each start, not held as a chosen one is: the supervisor never
/// runs two models on one fixed port at once (`config/residency.rs`), and a
/// swap stops the old server first.
pub(crate) fn check_free(ip: std::net::IpAddr, port: u16) -> Result<(), String> {
    let taken = || {
        Err(format!(
            "its fixed port {port} is taken{}: stop what listens there, or give the server \
             another port",
            holder_of(ip, port)
        ))
    };
    match std::net::TcpListener::bind((ip, port)) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => taken(),
        // A privileged port berth may not bind (its server may, by a
        // capability or as root): free if nothing listens there.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            if listening_on(ip, port).is_empty() {
                Ok(())
            } else {
                taken()
            }
        }
        Err(e) => Err(format!("cannot check that its port {port} is free: {e}")),
    }
}

/// ` by pid N (`comm`)` for what listens on `port`, where the tables say.
fn holder_of(ip: std::net::IpAddr, port: u16) -> String {
    let listening = listening_on(ip, port);
    if listening.is_empty() {
        return String::new();
    }
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return String::new();
    };
    for entry in procs.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if !sockets_of(&[pid]).is_disjoint(&listening) {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            return format!(" by pid {pid} (`{}`)", comm.trim());
        }
    }
    String::new()
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

/// The inodes of the sockets listening at `ip:port` (or on every address),
/// from `/proc/net/tcp` and `tcp6`.
fn listening_on(ip: std::net::IpAddr, port: u16) -> HashSet<u64> {
    let mut inodes = HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        inodes.extend(listeners_in(&text, ip, port));
    }
    inodes
}

/// The listening sockets' inodes at `port` in one `/proc/net/tcp*` table,
/// on the addresses a connection to `ip:port` can reach: that address or
/// every address (a listener on another address is not in the way).
fn listeners_in(table: &str, ip: std::net::IpAddr, port: u16) -> Vec<u64> {
    reachable_listeners(table, ip)
        .filter(|(at, _)| *at == port)
        .map(|(_, inode)| inode)
        .collect()
}

/// An address as `/proc/net/tcp*` writes it: each 32-bit word in the
/// machine's byte order, in hex.
fn kernel_hex(ip: std::net::IpAddr) -> String {
    let words = |octets: &[u8]| -> String {
        octets
            .chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]])))
            .collect()
    };
    match ip {
        std::net::IpAddr::V4(v4) => words(&v4.octets()),
        std::net::IpAddr::V6(v6) => words(&v6.octets()),
    }
}

/// `(port, inode)` of each listening socket in one `/proc/net/tcp*` table
/// that a connection to `ip` can reach.
fn reachable_listeners(table: &str, ip: std::net::IpAddr) -> impl Iterator<Item = (u16, u64)> + '_ {
    let mut reached = vec![
        kernel_hex(ip),
        kernel_hex(std::net::Ipv4Addr::UNSPECIFIED.into()),
        kernel_hex(std::net::Ipv6Addr::UNSPECIFIED.into()),
    ];
    if let std::net::IpAddr::V4(v4) = ip {
        reached.push(kernel_hex(v4.to_ipv6_mapped().into()));
    }
    table.lines().skip(1).filter_map(move |line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        // sl local_address rem_address st ... uid timeout inode
        let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
        let (address, at) = local.split_once(':')?;
        let port = u16::from_str_radix(at, 16).ok()?;
        (reached.iter().any(|r| r == address) && *state == "0A")
            .then(|| inode.parse().ok().map(|inode| (port, inode)))
            .flatten()
    })
}

/// The loopback-reachable ports the processes `tree` listen on, lowest
/// first: where a server that chose its own port is.
pub(crate) fn listening_ports_of(tree: &[u32]) -> Vec<u16> {
    let own = sockets_of(tree);
    let mut ports = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        ports.extend(
            reachable_listeners(&text, std::net::Ipv4Addr::LOCALHOST.into())
                .filter(|(_, inode)| own.contains(inode))
                .map(|(port, _)| port),
        );
    }
    ports.sort_unstable();
    ports.dedup();
    ports
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
pub(crate) fn check_listener(addr: SocketAddr, tree: &[u32]) -> Result<(), String> {
    let port = addr.port();
    let listening = listening_on(addr.ip(), port);
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
        let lo = std::net::Ipv4Addr::LOCALHOST.into();
        assert_eq!(listeners_in(table, lo, 0x1F90), [4242]);
        assert_eq!(listeners_in(table, lo, 0x1F91), [4444]);
        assert!(listeners_in(table, lo, 80).is_empty());
        // Another loopback address reaches its own listeners and the
        // wildcard's, not 127.0.0.1's.
        let two = std::net::Ipv4Addr::new(127, 0, 0, 2).into();
        assert!(listeners_in(table, two, 0x1F90).is_empty());
        assert_eq!(listeners_in(table, two, 0x1F91), [4444]);
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0200007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4646 1 0000000000000000 100 0 0 10 0
";
        assert_eq!(listeners_in(table, two, 0x1F90), [4646]);
        // `::1` as tcp6 writes it.
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4747 1 0000000000000000 100 0 0 10 0
";
        assert_eq!(
            listeners_in(table, std::net::Ipv6Addr::LOCALHOST.into(), 0x1F90),
            [4747]
        );
        assert!(listeners_in(table, lo, 0x1F90).is_empty());
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
    fn a_fixed_port_is_refused_while_taken_naming_its_holder() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let taken = listener.local_addr().unwrap().port();
        let err = check_free(std::net::Ipv4Addr::LOCALHOST.into(), taken).unwrap_err();
        assert!(
            err.contains(&format!(
                "its fixed port {taken} is taken by pid {}",
                std::process::id()
            )),
            "{err}"
        );
        drop(listener);
        assert!(check_free(std::net::Ipv4Addr::LOCALHOST.into(), taken).is_ok());
    }

    #[test]
    fn the_ports_a_process_listens_on_are_found() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(listening_ports_of(&[std::process::id()]).contains(&port));
        assert!(!listening_ports_of(&[1]).contains(&port));
    }

    #[test]
    fn our_own_listener_passes_and_a_stranger_s_does_not() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(
            check_listener(
                std::net::SocketAddr::from(([127, 0, 0, 1], port)),
                &[std::process::id()]
            )
            .is_ok()
        );
        let err =
            check_listener(std::net::SocketAddr::from(([127, 0, 0, 1], port)), &[1]).unwrap_err();
        assert!(err.contains(&port.to_string()), "{err}");
    }
}
