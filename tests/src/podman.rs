//! podman for the container tests: Debian's package (with `runc`, which
//! runs where `crun` cannot: a host whose cgroups are v1 or hybrid), and
//! an image built here (no image registry is reachable from the test
//! machines): `tests/python/container_rootfs.py` writes a root filesystem
//! with a Python interpreter and the fake server, and `podman import` makes
//! it an image, tagged by a digest of both files, so it is rebuilt only
//! when they change. Where podman cannot run, the tests fail and say why.

use std::path::PathBuf;
use std::process::Command;

use crate::python::repo_root;

/// podman's path, installing Debian's `podman` and `runc` first where
/// podman is missing.
pub fn podman() -> PathBuf {
    let path = crate::apt::ensure("the container tests", &["podman", "runc"], true, &|| {
        crate::apt::find("podman").filter(|_| crate::apt::find("runc").is_some())
    });
    let info = Command::new(&path)
        .args(["info", "--format", "{{.Host.CgroupsVersion}}"])
        .output()
        .expect("podman runs");
    assert!(
        info.status.success(),
        "podman cannot run on this machine ({}): {}",
        info.status,
        String::from_utf8_lossy(&info.stderr)
    );
    path
}

/// The test image (`localhost/berth-test-server:DIGEST`): the fake server
/// as its entrypoint, its arguments the container's.
pub fn test_image() -> String {
    let podman = podman();
    let files = vec![
        repo_root().join("tests/python/fake_upstream.py"),
        repo_root().join("tests/python/container_rootfs.py"),
    ];
    let tag = format!(
        "localhost/berth-test-server:{}",
        crate::python::digest(&files)
    );
    let lock = std::fs::File::create(crate::target_dir().join("podman-image.lock"))
        .expect("the image lock");
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .expect("the image lock");
    let exists = Command::new(&podman)
        .args(["image", "exists", &tag])
        .status()
        .expect("podman runs");
    if !exists.success() {
        let tar: PathBuf = crate::target_dir().join("berth-test-rootfs.tar");
        let built = Command::new("python3")
            .arg(&files[1])
            .arg(&tar)
            .output()
            .expect("python3 runs");
        assert!(
            built.status.success(),
            "building the test image's root filesystem failed: {}",
            String::from_utf8_lossy(&built.stderr)
        );
        let imported = Command::new(&podman)
            .args([
                "import",
                "--change",
                r#"ENTRYPOINT ["/usr/local/bin/python3", "/fake_upstream.py"]"#,
            ])
            .arg(&tar)
            .arg(&tag)
            .output()
            .expect("podman runs");
        let _ = std::fs::remove_file(&tar);
        assert!(
            imported.status.success(),
            "podman import failed: {}",
            String::from_utf8_lossy(&imported.stderr)
        );
    }
    drop(held);
    tag
}

/// A config whose worker kind `name` runs the test image in a container
/// (the fake server with `modes`, on the host's network at `{port}`), and
/// a model `name` on it with `extra` keys. No runtime and no limits: berth
/// picks runc on a cgroup v1 host (the test machines) and gives the
/// container its own limits, which the engine's defaults for root exceed
/// there.
pub fn config(name: &str, modes: &str, extra: &str) -> String {
    format!(
        r#"
[workers.{name}]
container = {{ engine = "{}", image = "{}", args = ["--port", "{{port}}", "--mode", "{modes}"] }}
http = {{ health = "/health", stop_grace = "3s", unhealthy_after = "3s" }}

[[model]]
name = "{name}"
worker = "{name}"
{extra}
"#,
        podman().display(),
        test_image()
    )
}

/// As [`config`], in the form a llama-swap `cmd` (or a kind's own
/// `command`) gives: `podman run` with a name, `--rm` and a `stop_command`
/// of its own, which berth recognises and runs as its own container.
pub fn command_config(name: &str, modes: &str) -> String {
    format!(
        r#"
[workers.{name}]
command = ["{podman}", "--runtime", "runc", "run", "--name", "{name}", "--rm", "--network", "host",
           "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096", "{image}",
           "--port", "{{port}}", "--mode", "{modes}"]
http = {{ health = "/health", stop_grace = "3s", unhealthy_after = "3s", stop_command = ["{podman}", "stop", "{name}"] }}

[[model]]
name = "{name}"
worker = "{name}"
"#,
        podman = podman().display(),
        image = test_image()
    )
}

/// The containers of model `model` podman knows (berth names each start
/// `berth-MODEL-PID-N`).
pub fn containers(model: &str) -> Vec<String> {
    let prefix = format!("berth-{model}-");
    let out = Command::new(podman())
        .args(["ps", "-a", "--format", "{{.Names}}"])
        .output()
        .expect("podman runs");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter(|n| n.starts_with(&prefix))
        .map(String::from)
        .collect()
}
