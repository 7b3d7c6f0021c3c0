//! Reading what berth is handed to read, and quoting it back: a config
//! file, a llama-swap file, an upgrade's request file. Every such read is
//! bounded, takes regular files only, and never blocks on what it opens.
//!
//! A path may be a link (a Kubernetes ConfigMap's files are links; so are
//! NixOS's `/etc` files), so links are followed, but only to a regular
//! file: the file is opened with `O_NONBLOCK` (a FIFO's open would
//! otherwise wait for a writer, and with it every later reload), then its
//! type and size are read from the descriptor itself, so what is checked is
//! what is read (no race with a rename in between). A device (`/dev/zero`),
//! a FIFO, a socket or a folder is refused; so is a file larger than the
//! bound, before a byte is read, and a file that grows past it while read.
//!
//! Whatever quotes input back (an error, an event, a log line) quotes at
//! most [`QUOTE_MAX`] bytes of it: a 5 MB bad line must not become a 5 MB
//! event kept in the history and sent to every follower.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

/// The largest config file berth reads: far past any real one (a thousand
/// models take ~200 KB), far short of what would hurt.
pub const CONFIG_MAX: u64 = 8 << 20;

/// The most of an input an error or event quotes.
pub const QUOTE_MAX: usize = 300;

/// Opens `path` without blocking and checks what it is (a regular file of
/// at most `max` bytes); `what` names it in errors (`the config`).
pub fn open_regular(
    path: &Path,
    max: u64,
    what: &str,
) -> Result<(File, std::fs::Metadata), String> {
    let shown = path.display();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot read {what} `{shown}`: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read {what} `{shown}`: {e}"))?;
    let kind = meta.file_type();
    if !kind.is_file() {
        let is = if kind.is_dir() {
            "a folder"
        } else if kind.is_fifo() {
            "a FIFO"
        } else if kind.is_socket() {
            "a socket"
        } else if kind.is_char_device() || kind.is_block_device() {
            "a device"
        } else {
            "not a regular file"
        };
        return Err(format!(
            "{what} `{shown}` is {is}, not a regular file: berth reads only regular files \
             (links to them are followed); point it at the file itself"
        ));
    }
    if meta.len() > max {
        return Err(format!(
            "{what} `{shown}` is {} bytes, over the {} berth reads; is it the right file?",
            meta.len(),
            crate::units::mib(max)
        ));
    }
    Ok((file, meta))
}

/// Reads `path` whole (see [`open_regular`]); a file that grows past `max`
/// while it is read is refused too.
pub fn read_regular(path: &Path, max: u64, what: &str) -> Result<Vec<u8>, String> {
    let (file, meta) = open_regular(path, max, what)?;
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {what} `{}`: {e}", path.display()))?;
    if bytes.len() as u64 > max {
        return Err(format!(
            "{what} `{}` grew past the {} berth reads while it was read",
            path.display(),
            crate::units::mib(max)
        ));
    }
    Ok(bytes)
}

/// [`read_regular`] as UTF-8 text.
pub fn read_text(path: &Path, max: u64, what: &str) -> Result<String, String> {
    String::from_utf8(read_regular(path, max, what)?)
        .map_err(|e| format!("{what} `{}` is not UTF-8 text: {e}", path.display()))
}

/// What identifies a file's content for a watcher: its inode, size, and
/// modification and change times. A write, a truncation or a rename over
/// it changes at least one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    ino: u64,
    len: u64,
    mtime_ns: i128,
    ctime_ns: i128,
}

impl Stamp {
    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The stamp of what `path` names now (links followed); `None` if it
    /// cannot be read.
    pub fn of(path: &Path) -> Option<Stamp> {
        let meta = std::fs::metadata(path).ok()?;
        Some(Stamp {
            ino: meta.ino(),
            len: meta.len(),
            mtime_ns: meta.mtime() as i128 * 1_000_000_000 + meta.mtime_nsec() as i128,
            ctime_ns: meta.ctime() as i128 * 1_000_000_000 + meta.ctime_nsec() as i128,
        })
    }
}

/// `text` cut to at most [`QUOTE_MAX`] bytes (at a character boundary),
/// saying how much was left out.
pub fn quote(text: &str) -> std::borrow::Cow<'_, str> {
    quote_at(text, QUOTE_MAX)
}

/// A message that quotes input (a parser's error shows the offending line
/// under a caret): each line cut to [`QUOTE_MAX`] bytes, and at most 20
/// lines.
pub fn quote_lines(text: &str) -> String {
    const LINES: usize = 20;
    let mut out: Vec<String> = text
        .lines()
        .take(LINES)
        .map(|l| quote(l).into_owned())
        .collect();
    let total = text.lines().count();
    if total > LINES {
        out.push(format!("… ({} more lines not shown)", total - LINES));
    }
    out.join("\n")
}

/// [`quote`] with another bound.
pub fn quote_at(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    std::borrow::Cow::Owned(format!(
        "{}… ({} more bytes not shown)",
        &text[..end],
        text.len() - end
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_bound_are_read() {
        let dir = std::env::temp_dir().join(format!("berth-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.toml");
        std::fs::write(&file, "a = 1\n").unwrap();
        assert_eq!(read_text(&file, 100, "the config").unwrap(), "a = 1\n");
        // Through a link, to a regular file: read.
        let link = dir.join("link.toml");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert_eq!(read_text(&link, 100, "the config").unwrap(), "a = 1\n");
        // Over the bound: refused before reading.
        let e = read_text(&file, 3, "the config").unwrap_err();
        assert!(e.contains("over the"), "{e}");
        // A device behind a link: refused, at once.
        let zero = dir.join("zero.toml");
        let _ = std::fs::remove_file(&zero);
        std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
        let e = read_text(&zero, CONFIG_MAX, "the config").unwrap_err();
        assert!(e.contains("a device"), "{e}");
        // A FIFO: refused without waiting for a writer.
        let fifo = dir.join("fifo.toml");
        let _ = std::fs::remove_file(&fifo);
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = std::time::Instant::now();
        let e = read_text(&fifo, CONFIG_MAX, "the config").unwrap_err();
        assert!(e.contains("a FIFO"), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        // A folder.
        let e = read_text(&dir, CONFIG_MAX, "the config").unwrap_err();
        assert!(e.contains("a folder"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn quotes_are_cut_at_a_character_boundary() {
        assert_eq!(quote("short"), "short");
        let long = "é".repeat(400);
        let cut = quote(&long);
        assert!(cut.len() < QUOTE_MAX + 40, "{}", cut.len());
        assert!(cut.ends_with("more bytes not shown)"));
    }
}
