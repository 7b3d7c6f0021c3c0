//! Two builds of berth for the upgrade tests and bench: copies of the
//! build's `berth` whose build marks (`berth::upgrade::build_mark`, what
//! `/api/version` says) are set apart, and a config of one model of each
//! kind a worker can be (`ipc-channel`, the stream wire, an HTTP server).

use std::path::PathBuf;

use crate::python::python_worker_command;
use crate::{berth_bin, target_dir};

/// A copy of `berth` marked `mark` (at most 40 ASCII bytes), beside the
/// build's own (its `berth worker` role is itself). Made once per mark and
/// process, under a name of its own.
pub fn marked_berth(mark: &str) -> PathBuf {
    assert!(mark.len() <= 40 && mark.is_ascii() && !mark.contains('\0'));
    let mut bytes = std::fs::read(berth_bin()).expect("read the berth binary");
    let prefix = berth::upgrade::MARK_PREFIX;
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
