//! The `berth_worker` Python package's own unit tests (`python/tests`),
//! run by the test venv's interpreter against the package as `pip install
//! ./python` installed it, so `.ci/run` runs them too.

use std::process::Command;

use berth_tests::python::{repo_root, test_python};

#[test]
fn the_python_package_passes_its_own_tests() {
    let out = Command::new(test_python())
        .args(["-m", "unittest", "discover", "-s", "python/tests"])
        .current_dir(repo_root())
        .output()
        .expect("run the Python unit tests");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python -m unittest failed ({}):\n{}\n{stderr}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
    // Every test ran: none skipped for a missing package or interpreter.
    assert!(stderr.contains("OK"), "{stderr}");
    assert!(!stderr.contains("skipped"), "{stderr}");
}
