//! A fake NVIDIA driver for the GPU tests on a machine without a GPU:
//! `tests/fake-gpu/fake_gpu.c`, built with `cc` into a folder of its own
//! and loaded by `berth serve` and its workers through `LD_LIBRARY_PATH`,
//! as both NVML and the CUDA driver API; and the helpers the tests read it
//! with.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::Server;

/// A mebibyte.
pub const MIB: u64 = 1 << 20;
/// A device's memory.
pub const GIB: u64 = 1 << 30;
/// What a CUDA context costs each process on the fake device.
pub const CONTEXT: u64 = 512 * MIB;
/// Used memory of a fake device with no process on it.
pub const BASE_USED: u64 = 300 * MIB;

/// A fake driver in a folder of its own: the library under the names NVML
/// and cudarc load, its `devices` file, and its `state/`.
#[derive(Debug)]
pub struct FakeGpu {
    dir: PathBuf,
}

impl FakeGpu {
    /// Two 80 GiB devices.
    pub fn new() -> FakeGpu {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "berth-fake-gpu-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("fake-gpu/fake_gpu.c");
        let library = dir.join("libberth-fake-gpu.so");
        let compiler = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = Command::new(&compiler)
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(&library)
            .arg(&source)
            .args(["-ldl", "-lpthread"])
            .output()
            .unwrap_or_else(|e| panic!("cannot run the C compiler `{compiler}`: {e}"));
        assert!(
            out.status.success(),
            "building the fake driver failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        for name in [
            "libnvidia-ml.so.1",
            "libnvidia-ml.so",
            "libcuda.so.1",
            "libcuda.so",
        ] {
            std::os::unix::fs::symlink(&library, dir.join(name)).unwrap();
        }
        let device = format!("Fake-H100-80GB {} {BASE_USED} {CONTEXT}\n", 80 * GIB);
        std::fs::write(dir.join("devices"), device.repeat(2)).unwrap();
        FakeGpu { dir }
    }

    /// Replaces the `devices` file (`<name> <total> <base_used>
    /// <context_bytes>` a line).
    pub fn set_devices(&self, text: &str) {
        std::fs::write(self.dir.join("devices"), text).unwrap();
    }

    /// Where the fake driver keeps what each pid holds (`state/<pid>.<gpu>`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The environment that makes a process load the fake.
    pub fn env(&self) -> [(&str, &str); 1] {
        [("LD_LIBRARY_PATH", self.dir.to_str().unwrap())]
    }

    /// Has `pid` (a live process that is not berth's) hold `bytes` on `gpu`.
    pub fn hold(&self, pid: u32, gpu: u32, bytes: u64) {
        let state = self.dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        std::fs::write(state.join(format!("{pid}.{gpu}")), bytes.to_string()).unwrap();
    }

    /// Makes the checkpoint API's `step` (`lock`, `checkpoint`, `restore`,
    /// `unlock`) fail from now on; `None`: none fails.
    pub fn fail_checkpoint(&self, step: Option<&str>) {
        let file = self.dir.join("checkpoint-fail");
        match step {
            Some(step) => std::fs::write(file, step).unwrap(),
            None => {
                let _ = std::fs::remove_file(file);
            }
        }
    }

    /// A driver without the checkpoint API (`true`), or with it.
    pub fn without_checkpoint(&self, without: bool) {
        let file = self.dir.join("no-checkpoint");
        if without {
            std::fs::write(file, "").unwrap();
        } else {
            let _ = std::fs::remove_file(file);
        }
    }

    pub fn serve(&self, config: &str) -> Server {
        // The tests register gpu-hog models over HTTP.
        Server::start_env(&format!("test_backends = true\n{config}"), &[], &self.env())
    }
}

impl Default for FakeGpu {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for FakeGpu {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn hog(name: &str, alloc_mib: u64, gpus: &str) -> String {
    format!(
        "[[model]]\nname = \"{name}\"\nbackend = \"gpu-hog\"\ngpus = {gpus}\n\
         options = {{ alloc_mib = {alloc_mib} }}\n"
    )
}

pub fn gpus(server: &Server) -> Value {
    let (status, body) = server.get("/api/gpus");
    assert_eq!(status, 200, "{body}");
    body
}

pub fn load(server: &Server, model: &str) -> Value {
    let (status, report) = server.post(&format!("/api/models/{model}/load"), json!({}));
    assert_eq!(status, 200, "{report}");
    report
}

pub fn unload(server: &Server, model: &str) -> Value {
    let (status, report) = server.post(&format!("/api/models/{model}/unload"), json!({}));
    assert_eq!(status, 200, "{report}");
    report
}

pub fn u(value: &Value) -> u64 {
    value
        .as_u64()
        .unwrap_or_else(|| panic!("not a number: {value}"))
}

/// The variables a worker's environment holds, by name.
pub fn environ_of(pid: u32) -> std::collections::HashMap<String, String> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    String::from_utf8_lossy(&environ)
        .split('\0')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}
