//! The Python the tests run workers with: a virtual environment under
//! `target/`, made from the repo's pinned requirement files and the
//! `berth_worker` package (`pip install ./python`), remade only when one of
//! them changes. Every test process asks for it; the first builds it under a
//! file lock and the rest reuse it, so `.ci/run` needs only `python3` with
//! `venv` and `pip` on the machine.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The repository's root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate lies in the repo")
        .to_path_buf()
}

/// A stable digest of some files' contents (FNV-1a; only change matters).
pub(crate) fn digest(files: &[PathBuf]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for file in files {
        let bytes = std::fs::read(file).unwrap_or_default();
        for b in file.to_string_lossy().bytes().chain(bytes) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "__pycache__") {
                files_under(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "py" || e == "toml") {
            out.push(path);
        }
    }
}

fn run(what: &str, command: &mut Command) {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A virtual environment with `requirements` installed and, with
/// `package`, the `berth_worker` package from `python/`; returns its
/// `python3`.
pub(crate) fn venv(name: &str, requirements: &[&str], package: bool) -> PathBuf {
    venv_built(name, requirements, package, &[])
}

/// [`venv`], with `build` added to pip's environment (what a package built
/// from source reads; pip's wheel cache is never used, so a wheel built
/// otherwise before is not reused).
pub(crate) fn venv_built(
    name: &str,
    requirements: &[&str],
    package: bool,
    build: &[(&str, &str)],
) -> PathBuf {
    let root = repo_root();
    let dir = crate::target_dir().join(name);
    let python = dir.join("bin").join("python3");
    let lock_path = crate::target_dir().join(format!("{name}.lock"));
    let lock = std::fs::File::create(&lock_path).expect("create the venv lock");
    // SAFETY: flock on a descriptor we own; released when `lock` closes.
    unsafe {
        assert_eq!(
            libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX),
            0
        );
    }
    let req_files: Vec<PathBuf> = requirements.iter().map(|r| root.join(r)).collect();
    // The build's environment is part of what the venv is made from.
    let mut req_stamp = digest(&req_files);
    for (name, value) in build {
        req_stamp.push_str(&format!(" {name}={value}"));
    }
    let stamp_file = dir.join(".berth-requirements");
    if std::fs::read_to_string(&stamp_file).ok().as_deref() != Some(req_stamp.as_str()) {
        let _ = std::fs::remove_dir_all(&dir);
        run(
            "creating the test venv",
            Command::new("python3").args(["-m", "venv"]).arg(&dir),
        );
        // pip's cache would keep a second copy of every wheel (PyTorch's
        // CUDA libraries are ~4 GB) and buffer each download twice in the
        // temporary directory, which may be a small tmpfs: no cache, and
        // temporaries beside the venv, on the disk that holds `target/`.
        let tmp = crate::target_dir().join(format!("{name}.tmp"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).expect("create pip's temporary directory");
        let mut pip = Command::new(&python);
        pip.args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
            .arg("--no-cache-dir")
            .env("TMPDIR", &tmp)
            .envs(build.iter().copied());
        for file in &req_files {
            pip.arg("-r").arg(file);
        }
        run("installing the test requirements", &mut pip);
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::write(&stamp_file, &req_stamp).expect("write the venv stamp");
    }
    if !package {
        drop(lock);
        return python;
    }
    let mut package = vec![root.join("python/pyproject.toml")];
    files_under(&root.join("python/berth_worker"), &mut package);
    let pkg_stamp = digest(&package);
    let pkg_file = dir.join(".berth-package");
    if std::fs::read_to_string(&pkg_file).ok().as_deref() != Some(pkg_stamp.as_str()) {
        run(
            "installing ./python",
            Command::new(&python)
                .args(["-m", "pip", "install", "--disable-pip-version-check", "-q"])
                .args(["--no-deps", "--no-build-isolation", "--force-reinstall"])
                .arg(root.join("python")),
        );
        let mut f = std::fs::File::create(&pkg_file).expect("write the package stamp");
        f.write_all(pkg_stamp.as_bytes())
            .expect("write the package stamp");
    }
    drop(lock);
    python
}

/// `python3` of the test environment: the standard library, numpy, and
/// `berth_worker` installed from `python/`.
pub fn test_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| venv("python-test-venv", &["python/requirements-test.txt"], true))
        .clone()
}

/// `python3` of the examples' environment: the test requirements, the
/// frameworks pinned in `python/examples/requirements.txt` (PyTorch, JAX,
/// Equinox, safetensors, tokenizers, the OpenAI client) and `berth_worker`.
/// PyTorch's wheel with its CUDA libraries is ~5 GB: the first run installs
/// it (minutes), later runs reuse it while the files are unchanged.
pub fn examples_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            venv(
                "python-examples-venv",
                &[
                    "python/requirements-test.txt",
                    "python/examples/requirements.txt",
                ],
                true,
            )
        })
        .clone()
}

/// `python3` of the ONNX Runtime bench's environment: the examples'
/// (PyTorch, to export the model) and `tests/python/requirements-onnx.txt`
/// (`onnx`, `onnxruntime`), pinned.
pub fn onnx_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            venv(
                "python-onnx-venv",
                &[
                    "python/requirements-test.txt",
                    "python/examples/requirements.txt",
                    "tests/python/requirements-onnx.txt",
                ],
                true,
            )
        })
        .clone()
}

/// `python3` of the deployment checks' environment: `deploy/requirements.txt`
/// (the Kubernetes schema validator and a Containerfile parser, pinned).
pub fn deploy_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| venv("python-deploy-venv", &["deploy/requirements.txt"], false))
        .clone()
}

/// `python3` of llama.cpp's server's environment:
/// `tests/python/requirements-llamacpp.txt` (`llama-cpp-python[server]`,
/// built from source by pip the first time, and the OpenAI client).
/// llama.cpp is built for any x86-64 CPU (`GGML_NATIVE=OFF`): built for
/// the machine's own (AVX-512 and AMX on an Intel Xeon VM here), its
/// server died of SIGSEGV at its first request. Without its multimodal
/// library (`LLAVA_BUILD=OFF`: the tests serve text models, and
/// llama-cpp-python loads it only for an image chat handler), which is a
/// large part of the build's time.
pub fn llamacpp_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            venv_built(
                "python-llamacpp-venv",
                &["tests/python/requirements-llamacpp.txt"],
                false,
                &[("CMAKE_ARGS", "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF")],
            )
        })
        .clone()
}

/// Where the examples' package (`berth_examples`) lies: the working
/// directory of their workers.
pub fn examples_dir() -> PathBuf {
    repo_root().join("python/examples")
}

/// A model served by `python3 -m berth_examples` from the examples'
/// environment, as `python/examples/serve.toml` runs it.
pub fn example_spec(name: &str, backend: &str) -> berth::ModelSpec {
    berth::ModelSpec::new(name, backend)
        .command([
            examples_python().display().to_string(),
            "-m".into(),
            "berth_examples".into(),
        ])
        .cwd(examples_dir())
}

/// The command line of a Python worker serving the test backends.
pub fn python_worker_command() -> Vec<String> {
    vec![
        test_python().display().to_string(),
        "-m".into(),
        "berth_worker".into(),
    ]
}

/// The command line of `tests/python/rogue_worker.py`: a worker that breaks
/// the stream wire as `ROGUE_MODE` says.
pub fn rogue_worker() -> Vec<String> {
    vec![
        test_python().display().to_string(),
        repo_root()
            .join("tests/python/rogue_worker.py")
            .display()
            .to_string(),
    ]
}
