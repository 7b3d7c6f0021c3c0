//! `berth-worker --checkpoint ACTION PID [TIMEOUT_MS]`: one call of the CUDA
//! driver's checkpoint API (CUDA 12.8+ drivers, Linux) on another process,
//! as NVIDIA's `cuda-checkpoint` makes it: the supervisor's sleep and wake
//! (`supervisor/src/child/checkpoint.rs`) run it as a process of its own,
//! so the supervisor never loads the driver, and a driver call that hangs
//! is a process it can kill.
//!
//! ACTION: `state` (prints `running`, `locked`, `checkpointed` or
//! `failed`), `lock` (within TIMEOUT_MS; 0: the driver's own wait),
//! `checkpoint` (the process's device memory moved to its host memory, the
//! GPU released), `restore` (moved back), `unlock`. Exit 0 on success; 1
//! with the driver's error on stderr (`CUDA_ERROR_…: text`); 3 when the
//! driver has no checkpoint API; 2 for bad arguments.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

type CuResult = c_int;

#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// The driver library, opened once.
struct Driver {
    handle: *mut c_void,
}

impl Driver {
    fn open() -> Result<Driver, String> {
        for name in [c"libcuda.so.1", c"libcuda.so"] {
            // SAFETY: a constant, NUL-terminated name; the flags are valid.
            let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !handle.is_null() {
                return Ok(Driver { handle });
            }
        }
        Err("no CUDA driver (libcuda.so.1) could be loaded".into())
    }

    /// The address of `name`, or `None` where the driver lacks it.
    fn symbol(&self, name: &CStr) -> Option<*mut c_void> {
        // SAFETY: `handle` is a live dlopen handle, `name` NUL-terminated.
        let address = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        (!address.is_null()).then_some(address)
    }

    /// `CUDA_ERROR_…: text` for `code`.
    fn describe(&self, code: CuResult) -> String {
        let text = |symbol: &CStr| -> Option<String> {
            let f = self.symbol(symbol)?;
            // SAFETY: cuGetErrorName/String(CUresult, const char**) per cuda.h.
            let f: extern "C" fn(CuResult, *mut *const c_char) -> CuResult =
                unsafe { std::mem::transmute(f) };
            let mut out: *const c_char = std::ptr::null();
            if f(code, &mut out) != 0 || out.is_null() {
                return None;
            }
            // SAFETY: the driver returns a static NUL-terminated string.
            Some(
                unsafe { CStr::from_ptr(out) }
                    .to_string_lossy()
                    .into_owned(),
            )
        };
        match (text(c"cuGetErrorName"), text(c"cuGetErrorString")) {
            (Some(name), Some(text)) => format!("{name}: {text}"),
            (Some(name), None) => name,
            _ => format!("CUDA error {code}"),
        }
    }
}

/// Runs `--checkpoint`'s arguments (after the flag); the exit code.
pub fn main(args: impl IntoIterator<Item = String>) -> i32 {
    let args: Vec<String> = args.into_iter().collect();
    let (action, pid) = match (
        args.first(),
        args.get(1).and_then(|p| p.parse::<c_int>().ok()),
    ) {
        (Some(action), Some(pid)) if pid > 0 => (action.as_str(), pid),
        _ => {
            eprintln!(
                "berth-worker: --checkpoint ACTION PID [TIMEOUT_MS]: ACTION is state, lock, \
                 checkpoint, restore or unlock"
            );
            return 2;
        }
    };
    let timeout_ms: c_uint = args.get(2).and_then(|t| t.parse().ok()).unwrap_or(0);
    let driver = match Driver::open() {
        Ok(driver) => driver,
        Err(e) => {
            eprintln!("{e}");
            return 3;
        }
    };
    let symbol = match action {
        "state" => c"cuCheckpointProcessGetState",
        "lock" => c"cuCheckpointProcessLock",
        "checkpoint" => c"cuCheckpointProcessCheckpoint",
        "restore" => c"cuCheckpointProcessRestore",
        "unlock" => c"cuCheckpointProcessUnlock",
        other => {
            eprintln!("berth-worker: --checkpoint: unknown action `{other}`");
            return 2;
        }
    };
    let (Some(init), Some(call)) = (driver.symbol(c"cuInit"), driver.symbol(symbol)) else {
        eprintln!(
            "the CUDA driver has no checkpoint API ({} is missing: it needs a CUDA 12.8+ \
             driver on Linux)",
            symbol.to_string_lossy()
        );
        return 3;
    };
    // SAFETY: cuInit(unsigned int) per cuda.h.
    let init: extern "C" fn(c_uint) -> CuResult = unsafe { std::mem::transmute(init) };
    // No device visible to this process is no reason to fail: the API acts
    // on another process's devices.
    let _ = init(0);
    let result = match action {
        "state" => {
            // SAFETY: cuCheckpointProcessGetState(int, CUprocessState*).
            let f: extern "C" fn(c_int, *mut c_int) -> CuResult =
                unsafe { std::mem::transmute(call) };
            let mut state: c_int = -1;
            let r = f(pid, &mut state);
            if r == 0 {
                println!(
                    "{}",
                    match state {
                        0 => "running",
                        1 => "locked",
                        2 => "checkpointed",
                        3 => "failed",
                        _ => "unknown",
                    }
                );
            }
            r
        }
        "lock" => {
            // SAFETY: cuCheckpointProcessLock(int, CUcheckpointLockArgs*).
            let f: extern "C" fn(c_int, *mut LockArgs) -> CuResult =
                unsafe { std::mem::transmute(call) };
            let mut lock = LockArgs {
                timeout_ms,
                reserved0: 0,
                reserved1: [0; 7],
            };
            f(pid, &mut lock)
        }
        _ => {
            // SAFETY: cuCheckpointProcess{Checkpoint,Restore,Unlock}(int,
            // args*), whose args may be NULL.
            let f: extern "C" fn(c_int, *mut c_void) -> CuResult =
                unsafe { std::mem::transmute(call) };
            f(pid, std::ptr::null_mut())
        }
    };
    if result == 0 {
        return 0;
    }
    let why = driver.describe(result);
    eprintln!("{why}");
    // The API is there but this driver or device does not do it.
    if why.starts_with("CUDA_ERROR_NOT_SUPPORTED") {
        3
    } else {
        1
    }
}
