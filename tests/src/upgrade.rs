//! Two builds of berth for the upgrade tests and bench: copies of the
//! build's `berth` whose build marks (`berth::build_mark`, what
//! `/api/version` says) are set apart, and a config of one model of each
//! kind a worker can be (`ipc-channel`, the stream wire, an HTTP server).

use std::path::PathBuf;

use crate::python::python_worker_command;
use crate::{berth_bin, target_dir};

/// A copy of `berth` marked `mark` (at most 40 ASCII bytes), beside the
/// build's own (its `berth worker` role is itself). Made once per mark and
/// process, under a name of its own; the copies of test processes that
/// have ended are removed first (each is a whole berth, ~150 MB with its
/// debug info: 28 of them had piled up here).
pub fn marked_berth(mark: &str) -> PathBuf {
    assert!(mark.len() <= 40 && mark.is_ascii() && !mark.contains('\0'));
    remove_ended_copies();
    let mut bytes = std::fs::read(berth_bin()).expect("read the berth binary");
    let prefix = berth::MARK_PREFIX;
    let starts: Vec<usize> = bytes
        .windows(prefix.len())
        .enumerate()
        .filter(|(_, w)| *w == prefix)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        starts.len(),
        1,
        "the build mark's place in the binary is not unique"
    );
    let at = starts[0] + prefix.len();
    let field = &mut bytes[at..at + 64 - prefix.len()];
    field.fill(0);
    field[..mark.len()].copy_from_slice(mark.as_bytes());
    let path = target_dir().join(format!("berth-marked-{mark}-{}", std::process::id()));
    let partial = path.with_extension("partial");
    std::fs::write(&partial, &bytes).expect("write the marked copy");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::rename(&partial, &path).unwrap();
    path
}

/// Removes the marked copies (and half-written ones) whose test process
/// is gone: the pid ends their name.
fn remove_ended_copies() {
    let Ok(entries) = std::fs::read_dir(target_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("berth-marked-") else {
            continue;
        };
        let rest = rest.strip_suffix(".partial").unwrap_or(rest);
        let Some(pid) = rest.rsplit('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A config of three models, each on another wire: `ipc` (berth's own
/// worker, `ipc-channel`), `stream` (a Python worker on the stream wire)
/// and `fake` (an HTTP server, `tests/python/fake_upstream.py`).
pub fn three_wires() -> String {
    let command = format!("{:?}", python_worker_command());
    format!(
        "{}\n[workers.py]\ncommand = {command}\n\n\
         [[model]]\nname = \"ipc\"\nbackend = \"echo\"\n\n\
         [[model]]\nname = \"stream\"\nbackend = \"echo\"\nworker = \"py\"\n",
        crate::upstream::config("", "", "")
    )
}
