//! The syscalls of the stream wire: the socket pair, `sendmsg`/`recvmsg`
//! with descriptors, sealed memfds out, read-only mappings of memfds in.
//! Everything unsafe about the stream wire is in this file.

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use berth_protocol::MappedBytes;
use berth_protocol::stream::Violation;

/// A connected `AF_UNIX` stream pair, both ends close-on-exec; the first
/// (the supervisor's) non-blocking, the second (the worker's) blocking.
pub(crate) fn socket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: `fds` has room for the two descriptors socketpair writes.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair succeeded, so both are open descriptors we own.
    let (ours, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(ours.as_raw_fd(), libc::F_GETFL);
        if flags < 0 || libc::fcntl(ours.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok((ours, theirs))
}

/// Most descriptors one `recvmsg` takes; more is a violation.
const MAX_FDS_PER_READ: usize = 4;

/// Room for the control message of [`receive`] or [`send`] (CMSG_SPACE of
/// four descriptors is 32 bytes on Linux), in u64 words.
const CONTROL_WORDS: usize = 8;

/// What one `recvmsg` brought.
pub(crate) struct Received {
    pub bytes: usize,
    pub fds: Vec<OwnedFd>,
    /// More descriptors came than fit: the kernel closed the rest.
    pub truncated: bool,
}

/// One non-blocking `recvmsg` into `buf`, taking any descriptors.
pub(crate) fn receive(fd: RawFd, buf: &mut [u8]) -> io::Result<Received> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS_PER_READ * size_of::<RawFd>()) as u32) };
    // On the stack (each answer is read through here); u64 elements keep
    // it aligned for `cmsghdr`.
    let mut control = [0u64; CONTROL_WORDS];
    let space = (space as usize).min(CONTROL_WORDS * 8);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: `msg` points at live buffers of the sizes it states.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel filled `control` with well-formed cmsghdrs up to
    // msg_controllen; the CMSG_* macros walk exactly those. Every
    // SCM_RIGHTS descriptor is a new one installed for us, owned once.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                let header = libc::CMSG_LEN(0) as usize;
                let count = ((*cmsg).cmsg_len as usize).saturating_sub(header) / size_of::<RawFd>();
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok(Received {
        bytes: n as usize,
        fds,
        truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// One non-blocking `sendmsg` of `bytes`, with `fds` (at most
/// [`MAX_SENT_FDS`]) riding on its first byte.
pub(crate) fn send(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> io::Result<usize> {
    if fds.len() > MAX_SENT_FDS {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let payload = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
    // On the stack: each request is sent through here.
    let mut control = [0u64; CONTROL_WORDS];
    assert!(
        space <= CONTROL_WORDS * 8,
        "MAX_SENT_FDS fits the control buffer"
    );
    // SAFETY: as in `receive`; the control buffer holds exactly one cmsghdr
    // with `fds.len()` descriptors, written through the CMSG_* macros.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(*fd);
            }
        }
        let n = libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT);
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

/// The most descriptors [`send`] carries at once (a preloader's fork takes
/// three: the wire, stdout, stderr).
pub(crate) const MAX_SENT_FDS: usize = 3;

const SEALS_NEEDED: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;

/// `bytes` in a new memfd, sealed against every change.
pub(crate) fn sealed_memfd(bytes: &[u8]) -> io::Result<OwnedFd> {
    // SAFETY: the name is a NUL-terminated literal.
    let raw = unsafe {
        libc::memfd_create(
            c"berth-bulk".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a new descriptor we own.
    let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
    file.write_all(bytes)?;
    // SAFETY: F_ADD_SEALS on a descriptor we own.
    let rc = unsafe {
        libc::fcntl(
            file.as_raw_fd(),
            libc::F_ADD_SEALS,
            SEALS_NEEDED | libc::F_SEAL_SEAL,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file.into())
}

/// A read-only mapping of a worker's memfd.
struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

// SAFETY: the mapping is read-only and of a memfd sealed against writes,
// shrinking and growing: its bytes cannot change or vanish under any thread.
unsafe impl Send for Mapping {}
// SAFETY: as above; shared reads of immutable bytes.
unsafe impl Sync for Mapping {}

impl AsRef<[u8]> for Mapping {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `ptr` maps `len` readable bytes until drop (see `Send`).
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what `map_memfd` mapped, once.
        unsafe {
            libc::munmap(self.ptr, self.len);
        }
    }
}

/// Maps the first `len` bytes of a worker's memfd read-only, after checking
/// that it is a memfd sealed against shrinking, growing and writing (else
/// the worker could change or truncate bytes being read: a SIGBUS in the
/// supervisor) and holds at least `len` bytes.
pub(crate) fn map_memfd(fd: OwnedFd, len: u64) -> Result<MappedBytes, Violation> {
    // SAFETY: F_GET_SEALS on a descriptor we own.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(Violation(
            "a descriptor that is not a memfd (it cannot hold seals)".into(),
        ));
    }
    if seals & SEALS_NEEDED != SEALS_NEEDED {
        return Err(Violation(format!(
            "a memfd not sealed against shrinking, growing and writing (seals {seals:#x}, \
             needed {SEALS_NEEDED:#x})"
        )));
    }
    let file = std::fs::File::from(fd);
    let size = file
        .metadata()
        .map_err(|e| Violation(format!("a memfd whose size cannot be read ({e})")))?
        .len();
    if size < len {
        return Err(Violation(format!(
            "a memfd of {size} bytes declaring {len}"
        )));
    }
    let len = usize::try_from(len).map_err(|_| Violation(format!("a memfd of {len} bytes")))?;
    if len == 0 {
        return Ok(Arc::new(Vec::<u8>::new()));
    }
    // SAFETY: a fresh read-only shared mapping of `len` bytes, which the
    // file holds (checked above) and cannot lose (sealed).
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Violation(format!(
            "a memfd of {len} bytes that cannot be mapped ({})",
            io::Error::last_os_error()
        )));
    }
    Ok(Arc::new(Mapping { ptr, len }))
}

/// What the watch of a socket waits for: bytes, or the peer's end.
const WATCHED: u32 = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;

/// An epoll instance of its own watching `socket` for reading, for the
/// reactor to watch in turn: unlike the reactor's own registration, this
/// watch can be paused and resumed ([`watch_socket`]).
pub(crate) fn socket_watch(socket: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: epoll_create1 takes no pointers.
    let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if epoll < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: epoll_create1 succeeded: a new descriptor we own.
    let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
    control_watch(&epoll, libc::EPOLL_CTL_ADD, socket, WATCHED)?;
    Ok(epoll)
}

/// Resumes (`true`) or pauses the watch of [`socket_watch`]: paused, the
/// socket's bytes and end wake nobody; resumed with bytes (or the end)
/// already there, it wakes its watcher at once.
pub(crate) fn watch_socket(epoll: &OwnedFd, socket: RawFd, on: bool) -> io::Result<()> {
    control_watch(
        epoll,
        libc::EPOLL_CTL_MOD,
        socket,
        if on { WATCHED } else { 0 },
    )
}

fn control_watch(epoll: &OwnedFd, op: libc::c_int, socket: RawFd, events: u32) -> io::Result<()> {
    let mut event = libc::epoll_event {
        events,
        u64: socket as u64,
    };
    // SAFETY: `event` is a valid epoll_event for the call's duration; both
    // descriptors are open (the caller holds them).
    if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), op, socket, &mut event) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}
