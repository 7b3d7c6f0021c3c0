//! `ipc-channel` endpoints across an `execve`.
//!
//! An endpoint is a socket descriptor, and a descriptor survives an exec;
//! but `ipc-channel` makes typed endpoints only from its own channels and
//! from the messages it receives, never from a raw descriptor. So an
//! endpoint crosses as a message: [`capture`] has `ipc-channel` send it to a
//! socket of ours and reads that packet raw (its bytes, and the descriptor
//! the kernel passed along); [`rebuild`] replays the packet, the same bytes
//! with that descriptor, into a one-shot server of `ipc-channel`'s own, whose
//! `accept` hands back the typed endpoint. Nothing of `ipc-channel`'s wire
//! format is written here: the bytes replayed are the ones it wrote. The
//! handed-over state names the `ipc-channel` version, and a binary built
//! with another one refuses the state before the exec.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;

use ipc_channel::ipc::{IpcOneShotServer, IpcSender};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// The version of `ipc-channel` whose packets a handed-over state holds.
pub(crate) const IPC_CHANNEL_VERSION: &str = "0.23";

/// One endpoint as `ipc-channel` sent it: the packet's bytes and the
/// descriptor that came with it (close-on-exec until a handover clears it).
#[derive(Debug)]
pub(crate) struct Captured {
    pub packet: Vec<u8>,
    pub fd: OwnedFd,
}

/// The largest packet of one endpoint (its header and an index).
const MAX_PACKET: usize = 4096;

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: socket takes integers; the descriptor is owned from here.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor socket() just returned, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn address(path: &std::path::Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    let bytes = path.as_os_str().as_encoded_bytes();
    // SAFETY: sockaddr_un is plain data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::other(format!(
            "socket path `{}` is too long",
            path.display()
        )));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (to, from) in addr.sun_path.iter_mut().zip(bytes) {
        *to = *from as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// A listening socket at a fresh path, removed when dropped.
struct Listener {
    fd: OwnedFd,
    path: PathBuf,
}

impl Drop for Listener {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn listen() -> io::Result<Listener> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "berth-handover-{}-{}.sock",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_file(&path);
    let fd = socket()?;
    let (addr, len) = address(&path)?;
    // SAFETY: addr is a valid sockaddr_un of length len.
    check(unsafe { libc::bind(fd.as_raw_fd(), (&raw const addr).cast(), len) })?;
    let listener = Listener { fd, path };
    // SAFETY: listen on a socket we own.
    check(unsafe { libc::listen(listener.fd.as_raw_fd(), 1) })?;
    Ok(listener)
}

/// Has `ipc-channel` send `endpoint` (one `IpcSender` or `IpcReceiver`) and
/// reads the packet raw: its bytes, and the endpoint's descriptor.
pub(crate) fn capture<T: Serialize>(endpoint: T) -> io::Result<Captured> {
    let listener = listen()?;
    let path = listener
        .path
        .to_str()
        .ok_or_else(|| io::Error::other("the temporary directory's path is not UTF-8"))?;
    let sender = IpcSender::<T>::connect(path.to_string()).map_err(io::Error::other)?;
    // SAFETY: accept on our listening socket; the peer is `sender`.
    let conn = check(unsafe {
        libc::accept4(
            listener.fd.as_raw_fd(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            libc::SOCK_CLOEXEC,
        )
    })?;
    // SAFETY: accept4 returned a descriptor nobody else owns.
    let conn = unsafe { OwnedFd::from_raw_fd(conn) };
    sender.send(endpoint).map_err(io::Error::other)?;
    drop(sender);
    let (packet, fds) = receive(conn.as_raw_fd())?;
    let mut fds = fds.into_iter();
    match (fds.next(), fds.next()) {
        (Some(fd), None) => Ok(Captured { packet, fd }),
        _ => Err(io::Error::other(
            "ipc-channel sent an endpoint as other than one descriptor",
        )),
    }
}

/// One packet and the descriptors passed with it (close-on-exec).
fn receive(fd: RawFd) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut packet = vec![0u8; MAX_PACKET];
    // Room for a few descriptors, aligned as cmsghdr needs.
    let mut control = [0u64; 16];
    let mut iov = libc::iovec {
        iov_base: packet.as_mut_ptr().cast(),
        iov_len: packet.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at buffers that live across the call.
    let n = unsafe { libc::recvmsg(fd, &raw mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(io::Error::other("the endpoint's packet did not fit"));
    }
    packet.truncate(n as usize);
    let mut fds = Vec::new();
    // SAFETY: walking the control messages recvmsg filled in.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&raw const msg, cmsg);
        }
    }
    Ok((packet, fds))
}

/// The typed endpoint of a [`capture`]d packet, over `fd` (which stays
/// ours: the kernel passes a copy).
pub(crate) fn rebuild<T: DeserializeOwned + Serialize>(
    packet: &[u8],
    fd: BorrowedFd<'_>,
) -> io::Result<T> {
    let (server, name) = IpcOneShotServer::<T>::new().map_err(io::Error::other)?;
    let conn = socket()?;
    let (addr, len) = address(std::path::Path::new(&name))?;
    // SAFETY: addr is a valid sockaddr_un of length len.
    check(unsafe { libc::connect(conn.as_raw_fd(), (&raw const addr).cast(), len) })?;
    send(conn.as_raw_fd(), packet, fd.as_raw_fd())?;
    let (_receiver, endpoint) = server.accept().map_err(io::Error::other)?;
    Ok(endpoint)
}

/// Sends `packet` with one descriptor.
fn send(sock: RawFd, packet: &[u8], fd: RawFd) -> io::Result<()> {
    let mut control = [0u64; 4];
    let mut iov = libc::iovec {
        iov_base: packet.as_ptr().cast_mut().cast(),
        iov_len: packet.len(),
    };
    // SAFETY: msghdr is plain data; all zeroes is a valid value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE/CMSG_LEN compute sizes; the header is written
    // inside `control`, which holds CMSG_SPACE(4) bytes.
    unsafe {
        msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
        let cmsg = libc::CMSG_FIRSTHDR(&raw const msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        libc::CMSG_DATA(cmsg).cast::<RawFd>().write_unaligned(fd);
    }
    // SAFETY: msg points at buffers that live across the call.
    let n = unsafe { libc::sendmsg(sock, &raw const msg, libc::MSG_EOR) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != packet.len() {
        return Err(io::Error::other("the endpoint's packet was sent in part"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ipc_channel::ipc::{self, IpcReceiver};

    #[test]
    fn an_endpoint_rebuilt_from_its_packet_and_descriptor_still_speaks() {
        let (tx, rx) = ipc::channel::<u32>().unwrap();
        let captured = capture(rx).unwrap();
        let rx: IpcReceiver<u32> = rebuild(&captured.packet, captured.fd.as_fd()).unwrap();
        tx.send(7).unwrap();
        assert_eq!(rx.recv().unwrap(), 7);
        // And again from the same capture: the descriptor was only lent.
        let again: IpcReceiver<u32> = rebuild(&captured.packet, captured.fd.as_fd()).unwrap();
        tx.send(8).unwrap();
        assert_eq!(again.recv().unwrap(), 8);

        let (tx, rx) = ipc::channel::<String>().unwrap();
        let captured = capture(tx.clone()).unwrap();
        let tx2: IpcSender<String> = rebuild(&captured.packet, captured.fd.as_fd()).unwrap();
        tx2.send("hi".into()).unwrap();
        assert_eq!(rx.recv().unwrap(), "hi");
    }

    use std::os::fd::AsFd;
}
