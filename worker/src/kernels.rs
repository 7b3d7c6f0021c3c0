//! candle's CUDA kernels as machine code rather than PTX.
//!
//! candle keeps its kernels as PTX text and hands it to the driver
//! (`cuModuleLoadData`) the first time a module is used; the driver then
//! compiles it for the GPU. On a fresh H100 that compile made the first
//! `embed` request take 17.7 s and `generate`'s load 18.8 s (the driver's
//! cache, `~/.nv/ComputeCache`, is lost with each new container).
//! `deploy/cuda/build_worker.py` builds the same kernel sources as fat
//! binaries (machine code for each supported architecture, PTX for newer
//! ones) and embeds them (`build.rs`). In the `cuda` build this file
//! defines `cuModuleLoadData` itself, so candle's (cudarc's) calls reach it
//! before the driver's: a module whose PTX is one of candle's is loaded
//! from its fat binary instead; anything else, or a fat binary the driver
//! refuses, goes to the driver as it was (and is counted, so a load report
//! can say which way each module came).
//!
//! The decision (which module a PTX text is) is [`module_of`], compiled in
//! every build and tested without a GPU.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Modules loaded from machine code, and from PTX the driver compiled.
static MACHINE_CODE: AtomicUsize = AtomicUsize::new(0);
static PTX: AtomicUsize = AtomicUsize::new(0);

/// How this process's CUDA modules were loaded so far, for a load report:
/// `{"machine_code": n, "ptx": m, "fat_binaries": k}` (`k`: modules this
/// build carries as machine code).
pub(crate) fn loaded() -> serde_json::Value {
    serde_json::json!({
        "machine_code": MACHINE_CODE.load(Ordering::Relaxed),
        "ptx": PTX.load(Ordering::Relaxed),
        "fat_binaries": fat_binaries().len(),
    })
}

mod table {
    include!(concat!(env!("OUT_DIR"), "/fatbins.rs"));
}

/// The modules this build carries as machine code, by name.
pub(crate) fn fat_binaries() -> &'static [(&'static str, &'static [u8])] {
    table::FATBINS
}

/// Which of `known` (name, PTX text) the NUL-free text `image` is.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn module_of(image: &[u8], known: &[(&'static str, &str)]) -> Option<&'static str> {
    known
        .iter()
        .find(|(_, ptx)| ptx.as_bytes() == image)
        .map(|(name, _)| *name)
}

#[cfg(feature = "cuda")]
mod hook {
    use std::ffi::{CStr, c_void};
    use std::sync::OnceLock;
    use std::sync::atomic::Ordering;

    use cudarc::driver::sys::{CUmodule, CUresult};

    use super::{MACHINE_CODE, PTX, fat_binaries, module_of};

    type LoadData = unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult;

    /// candle's module kernels, by the names `build_worker.py` gives
    /// their fat binaries.
    fn candle_modules() -> [(&'static str, &'static str); 11] {
        use candle_kernels as k;
        [
            ("affine", k::AFFINE.ptx()),
            ("binary", k::BINARY.ptx()),
            ("cast", k::CAST.ptx()),
            ("conv", k::CONV.ptx()),
            ("fill", k::FILL.ptx()),
            ("indexing", k::INDEXING.ptx()),
            ("quantized", k::QUANTIZED.ptx()),
            ("reduce", k::REDUCE.ptx()),
            ("sort", k::SORT.ptx()),
            ("ternary", k::TERNARY.ptx()),
            ("unary", k::UNARY.ptx()),
        ]
    }

    /// The driver's own `cuModuleLoadData`: the next definition after this
    /// executable's.
    fn driver() -> Option<LoadData> {
        static DRIVER: OnceLock<Option<LoadData>> = OnceLock::new();
        *DRIVER.get_or_init(|| {
            // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; the
            // symbol, when found, is the driver's function of this type.
            let f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"cuModuleLoadData".as_ptr()) };
            (!f.is_null()).then(|| {
                // SAFETY: the driver API's signature for this symbol.
                unsafe { std::mem::transmute::<*mut c_void, LoadData>(f) }
            })
        })
    }

    /// A fat binary copied to 8-byte-aligned memory, as the driver wants
    /// an image; kept for the life of the process (modules are few).
    fn aligned(bytes: &'static [u8]) -> &'static [u64] {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `words` has at least `bytes.len()` bytes; u64 has no
        // invalid bit patterns.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), words.as_mut_ptr().cast(), bytes.len());
        }
        Vec::leak(words)
    }

    /// Loads candle's modules from machine code; everything else as asked.
    ///
    /// # Safety
    /// The driver API's contract: `module` is writable, `image` a valid
    /// image (PTX text, cubin or fat binary).
    #[unsafe(no_mangle)]
    pub unsafe extern "C" fn cuModuleLoadData(
        module: *mut CUmodule,
        image: *const c_void,
    ) -> CUresult {
        let Some(driver) = driver() else {
            return CUresult::CUDA_ERROR_NOT_INITIALIZED;
        };
        // PTX is text: an ELF cubin or a fat binary starts otherwise.
        // SAFETY: `image` points at an image, whose first bytes exist.
        let head = unsafe { std::slice::from_raw_parts(image.cast::<u8>(), 4) };
        if head != b"\x7fELF" && head != [0x50, 0xed, 0x55, 0xba] {
            // SAFETY: PTX text is NUL-terminated.
            let text = unsafe { CStr::from_ptr(image.cast()) }.to_bytes();
            let name = module_of(text, &candle_modules());
            if let Some((name, fatbin)) =
                name.and_then(|n| fat_binaries().iter().find(|(m, _)| *m == n).copied())
            {
                let words = aligned(fatbin);
                // SAFETY: the driver's function, with a valid fat binary.
                let result = unsafe { driver(module, words.as_ptr().cast()) };
                if result == CUresult::CUDA_SUCCESS {
                    MACHINE_CODE.fetch_add(1, Ordering::Relaxed);
                    return result;
                }
                eprintln!(
                    "berth-worker: the driver refused the machine code of candle's `{name}` \
                     kernels ({result:?}); loading their PTX, which the driver compiles"
                );
            }
            PTX.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller's arguments, unchanged.
        unsafe { driver(module, image) }
    }

    /// Keeps this file's `cuModuleLoadData` in the executable.
    pub fn linked() -> usize {
        std::hint::black_box(cuModuleLoadData as *const () as usize)
    }
}

/// Keeps the machine-code loader in the `cuda` build's executable (called
/// at the worker's start); nothing without it.
pub(crate) fn keep_loader() {
    #[cfg(feature = "cuda")]
    hook::linked();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_module_is_known_by_its_whole_text() {
        let known = [
            ("unary", ".version 8.0\n.target sm_80\n// unary"),
            ("binary", ".version 8.0\n.target sm_80\n// binary"),
        ];
        assert_eq!(
            module_of(b".version 8.0\n.target sm_80\n// binary", &known),
            Some("binary")
        );
        // A prefix, or a kernel of someone else's, is not one of them.
        assert_eq!(module_of(b".version 8.0\n.target sm_80\n", &known), None);
        assert_eq!(module_of(b"// a custom kernel", &known), None);
    }

    #[test]
    fn a_build_without_machine_code_says_so() {
        // CI builds without the `cuda` feature: no fat binaries, nothing
        // loaded.
        assert!(fat_binaries().is_empty());
        assert_eq!(loaded()["fat_binaries"], 0);
        assert_eq!(loaded()["machine_code"], 0);
    }
}
