//! Opening a model's files: the folder a backend was given, and nothing
//! outside it, and regular files only.
//!
//! The supervisor checks the model's own path (a folder or a file) against
//! its models directory, but a folder's `config.json` may be a symlink to
//! `/etc/passwd`, and its `model.safetensors` a FIFO, `/dev/zero` or a
//! symlink loop. So every file a built-in backend opens inside a model
//! folder is opened beneath it (`openat2` with `RESOLVE_BENEATH`, Linux
//! 5.6; on older kernels the path is resolved and checked, which a
//! concurrent rename could race), without blocking (a FIFO would hold the
//! load for ever), and refused unless it is a regular file, with an error
//! that says which of these it is.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};

/// Why a model file could not be opened.
#[derive(Debug)]
pub(crate) enum FileError {
    Missing,
    /// It leads outside the model's folder (`..`, an absolute symlink, a
    /// symlink to elsewhere).
    Outside,
    /// A symlink loop, or too many links.
    Loop,
    /// Not a regular file: what it is.
    NotRegular(&'static str),
    Io(io::Error),
}

impl std::fmt::Display for FileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FileError::Missing => f.write_str("is missing"),
            FileError::Outside => f.write_str(
                "leads outside the model's folder (a symlink or `..`), which is refused",
            ),
            FileError::Loop => f.write_str("is a symlink loop"),
            FileError::NotRegular(what) => write!(f, "is {what}, not a regular file"),
            FileError::Io(e) => write!(f, "cannot be opened: {e}"),
        }
    }
}

/// A model file, open. [`ModelFile::path`] names the open file itself, for
/// APIs that take a path: whatever happens to the folder meanwhile, it is
/// the file that was checked.
#[derive(Debug)]
pub(crate) struct ModelFile {
    pub file: File,
}

impl ModelFile {
    /// A path that opens this very file (`/proc/self/fd/N`).
    pub(crate) fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    pub(crate) fn read_to_string(&mut self) -> io::Result<String> {
        let mut text = String::new();
        io::Read::read_to_string(&mut self.file, &mut text)?;
        Ok(text)
    }

    pub(crate) fn read_bytes(&mut self) -> io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        io::Read::read_to_end(&mut self.file, &mut bytes)?;
        Ok(bytes)
    }
}

/// Opens `name` (a relative path) beneath the folder `dir`.
pub(crate) fn open_in(dir: &Path, name: &str) -> Result<ModelFile, FileError> {
    let folder = File::open(dir).map_err(|e| classify(&e))?;
    let file = match openat2_beneath(&folder, name) {
        Some(result) => result.map_err(|e| classify(&e))?,
        // No openat2 (a kernel before 5.6, a seccomp filter): resolve and
        // check the path, then open what it resolved to.
        None => {
            let root = dir.canonicalize().map_err(|e| classify(&e))?;
            let resolved = dir.join(name).canonicalize().map_err(|e| classify(&e))?;
            if !resolved.starts_with(&root) {
                return Err(FileError::Outside);
            }
            open_nonblocking(&resolved).map_err(|e| classify(&e))?
        }
    };
    regular(file)
}

/// Opens a model file named by its own path (the supervisor confined it),
/// regular files only.
pub(crate) fn open_file(path: &Path) -> Result<ModelFile, FileError> {
    regular(open_nonblocking(path).map_err(|e| classify(&e))?)
}

fn open_nonblocking(path: &Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
}

/// `openat2(folder, name, O_RDONLY | O_NONBLOCK, RESOLVE_BENEATH)`, or
/// `None` where the kernel has no `openat2`.
fn openat2_beneath(folder: &File, name: &str) -> Option<io::Result<File>> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: open_how is plain data; all-zero is its defaults.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = (libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC) as u64;
    how.resolve = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 reads `name` and `how`, valid for the call, and
    // returns a new descriptor or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_openat2,
            folder.as_raw_fd(),
            name.as_ptr(),
            &how as *const libc::open_how,
            size_of::<libc::open_how>(),
        )
    };
    if fd < 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::ENOSYS) | Some(libc::EPERM) => None,
            _ => Some(Err(e)),
        };
    }
    // SAFETY: the syscall returned a new descriptor that nothing else owns.
    Some(Ok(unsafe { File::from_raw_fd(fd as i32) }))
}

/// `file` if it is a regular file, back in blocking mode.
fn regular(file: File) -> Result<ModelFile, FileError> {
    let kind = file.metadata().map_err(FileError::Io)?.file_type();
    if !kind.is_file() {
        return Err(FileError::NotRegular(if kind.is_dir() {
            "a directory"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_char_device() {
            "a character device"
        } else if kind.is_block_device() {
            "a block device"
        } else if kind.is_socket() {
            "a socket"
        } else {
            "something else"
        }));
    }
    // SAFETY: F_GETFL/F_SETFL on a descriptor we own.
    unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(ModelFile { file })
}

fn classify(e: &io::Error) -> FileError {
    match e.raw_os_error() {
        Some(libc::ENOENT) => FileError::Missing,
        // openat2 refuses a path that would leave the folder with EXDEV.
        Some(libc::EXDEV) => FileError::Outside,
        Some(libc::ELOOP) => FileError::Loop,
        _ => FileError::Io(io::Error::new(e.kind(), e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn folder(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("berth-files-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        dir
    }

    #[test]
    fn files_beneath_the_folder_open_and_nothing_else_does() {
        let dir = folder("beneath");
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        std::fs::write(dir.join("sub/inner.json"), "[]").unwrap();
        std::os::unix::fs::symlink("config.json", dir.join("link.json")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("passwd.json")).unwrap();
        std::os::unix::fs::symlink("../../etc/hostname", dir.join("up.json")).unwrap();
        std::os::unix::fs::symlink("loop.json", dir.join("loop.json")).unwrap();
        let fifo = std::ffi::CString::new(dir.join("fifo").to_str().unwrap()).unwrap();
        // SAFETY: mkfifo reads the path, valid for the call.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

        assert_eq!(
            open_in(&dir, "config.json")
                .unwrap()
                .read_to_string()
                .unwrap(),
            "{}"
        );
        assert_eq!(
            open_in(&dir, "sub/inner.json")
                .unwrap()
                .read_to_string()
                .unwrap(),
            "[]"
        );
        assert_eq!(
            open_in(&dir, "link.json")
                .unwrap()
                .read_to_string()
                .unwrap(),
            "{}"
        );
        for (name, expected) in [
            ("passwd.json", "outside"),
            ("up.json", "outside"),
            ("../config.json", "outside"),
            ("loop.json", "loop"),
            ("fifo", "FIFO"),
            ("sub", "directory"),
            ("nothing.json", "missing"),
        ] {
            let err = open_in(&dir, name).unwrap_err().to_string();
            assert!(err.contains(expected), "{name}: {err}");
        }
        let err = open_file(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("character device"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
