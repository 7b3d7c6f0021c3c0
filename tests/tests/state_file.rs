//! The state file names processes to kill, so berth believes only its own:
//! a file that is not a berth state file is refused and left as it is, and
//! so are a directory, a file another user owns and one others can write.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use berth_tests::*;

/// `berth serve` with `state_file` set to `path`: its exit status and
/// stderr, or `None` if it started (then it is stopped).
fn serve_with_state_file(dir: &std::path::Path, path: &std::path::Path) -> Option<(i32, String)> {
    let config = dir.join("berth.toml");
    std::fs::write(&config, format!("state_file = \"{}\"\n", path.display())).unwrap();
    let port = free_port();
    let mut child = Command::new(berth_bin())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--config",
        ])
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    match wait_exit(&mut child, std::time::Duration::from_secs(10)) {
        Some(status) => {
            let mut err = String::new();
            std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
            Some((status.code().unwrap_or(-1), err))
        }
        None => {
            terminate(&mut child, std::time::Duration::from_secs(10));
            None
        }
    }
}

#[test]
fn only_berths_own_state_file_is_believed() {
    let dir = std::env::temp_dir().join(format!("berth-state-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // The config file itself: not a state file, and untouched.
    let config = dir.join("berth.toml");
    let (code, err) = serve_with_state_file(&dir, &config).expect("refused");
    assert_ne!(code, 0);
    assert!(err.contains("is not a berth state file"), "{err}");
    assert!(
        std::fs::read_to_string(&config)
            .unwrap()
            .starts_with("state_file"),
        "the file was overwritten"
    );
    assert!(
        !dir.join("berth.lock").exists(),
        "nothing was made beside it"
    );

    // A directory.
    let folder = dir.join("folder");
    std::fs::create_dir(&folder).unwrap();
    let (_, err) = serve_with_state_file(&dir, &folder).expect("refused");
    assert!(err.contains("is a directory"), "{err}");

    // A state file others may write, then one another user owns.
    let state = dir.join("state.json");
    let (started, _) = (serve_with_state_file(&dir, &state), ());
    assert!(started.is_none(), "a fresh state file is fine");
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "berth writes it for its own user alone");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o666)).unwrap();
    let (_, err) = serve_with_state_file(&dir, &state).expect("refused");
    assert!(err.contains("writable by other users"), "{err}");
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o600)).unwrap();
    // SAFETY: chown reads the path, valid for the call.
    let path = std::ffi::CString::new(state.to_str().unwrap()).unwrap();
    let me = unsafe { libc::geteuid() };
    if me == 0 {
        assert_eq!(unsafe { libc::chown(path.as_ptr(), 65534, 65534) }, 0);
        let (_, err) = serve_with_state_file(&dir, &state).expect("refused");
        assert!(err.contains("belongs to uid 65534"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
