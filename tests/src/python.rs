//! The Python the tests run workers with: virtual environments under
//! `target/`, made from the repo's pinned requirement files and, for some,
//! the `berth_worker` package (`pip install ./python`), remade only when one
//! of them changes. `tests/python/venvs.py` builds them: its table is the one
//! list of what each is made from. Every test process asks it for the venv
//! it needs; the first builds it under a file lock and the rest wait and
//! reuse it. `.ci/run` starts it in the background before cargo compiles,
//! so the downloads overlap the build; it needs only `python3` with `venv`
//! and `pip` on the machine.

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
/// `tests/python/venvs.py` computes its venvs' stamps the same way.
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

/// The virtual environment `name` of `tests/python/venvs.py`'s table under
/// [`crate::target_dir`], built first unless it is up to date; returns its
/// `python3`.
pub(crate) fn venv(name: &str) -> PathBuf {
    let script = repo_root().join("tests/python/venvs.py");
    let mut command = Command::new("python3");
    command
        .arg(&script)
        .arg("--target-dir")
        .arg(crate::target_dir())
        .arg(name);
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("venv {name}: cannot run {command:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let python = stdout.lines().next_back().unwrap_or_default().trim();
    assert!(
        out.status.success() && !python.is_empty(),
        "venv {name}: {} failed ({}):\n{stdout}\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(python)
}

/// `python3` of the test environment: the standard library, numpy, and
/// `berth_worker` installed from `python/`.
pub fn test_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv("python-test-venv")).clone()
}

/// `python3` of the examples' environment: the test requirements, the
/// frameworks pinned in `python/examples/requirements.txt` (PyTorch, JAX,
/// Equinox, safetensors, tokenizers, the OpenAI client) and `berth_worker`.
/// PyTorch's wheel with its CUDA libraries is ~5 GB: the first run installs
/// it (minutes), later runs reuse it while the files are unchanged.
pub fn examples_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv("python-examples-venv")).clone()
}

/// `python3` of the ONNX Runtime bench's environment: the examples'
/// (PyTorch, to export the model) and `tests/python/requirements-onnx.txt`
/// (`onnx`, `onnxruntime`), pinned.
pub fn onnx_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv("python-onnx-venv")).clone()
}

/// `python3` of the deployment checks' environment: `deploy/requirements.txt`
/// (the Kubernetes schema validator and a Containerfile parser, pinned).
pub fn deploy_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv("python-deploy-venv")).clone()
}

/// `python3` of llama.cpp's server's environment:
/// `tests/python/requirements-llamacpp.txt` (`llama-cpp-python[server]`,
/// built from source by pip the first time, and the OpenAI client).
/// `tests/python/venvs.py` builds llama.cpp for any x86-64 CPU
/// (`GGML_NATIVE=OFF` in pip's environment): built for
/// the machine's own (AVX-512 and AMX on an Intel Xeon VM here), its
/// server died of SIGSEGV at its first request. Without its multimodal
/// library (`LLAVA_BUILD=OFF`: the tests serve text models, and
/// llama-cpp-python loads it only for an image chat handler), which is a
/// large part of the build's time.
pub fn llamacpp_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON.get_or_init(|| venv("python-llamacpp-venv")).clone()
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
