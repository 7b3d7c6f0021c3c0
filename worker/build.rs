//! With the `cuda` feature: candle's module kernels as machine code, when
//! the build was given them (`BERTH_CUDA_FATBINS`, a folder of
//! `<module>.fatbin` made by `deploy/cuda/build_worker.py`), embedded in
//! the worker; `src/kernels.rs` hands them to the driver in place of the
//! PTX it would otherwise compile at first use. Without the feature or the
//! folder, the table is empty.

use std::fmt::Write;
use std::path::PathBuf;

fn main() {
    println!("cargo::rerun-if-env-changed=BERTH_CUDA_FATBINS");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let mut table = String::from("pub(crate) static FATBINS: &[(&str, &[u8])] = &[\n");
    let folder = std::env::var_os("BERTH_CUDA_FATBINS")
        .filter(|_| std::env::var_os("CARGO_FEATURE_CUDA").is_some())
        .map(PathBuf::from);
    if let Some(folder) = folder {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&folder)
            .unwrap_or_else(|e| panic!("BERTH_CUDA_FATBINS={}: {e}", folder.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "fatbin"))
            .collect();
        files.sort();
        for file in files {
            println!("cargo::rerun-if-changed={}", file.display());
            let name = file.file_stem().unwrap().to_string_lossy().into_owned();
            writeln!(
                table,
                "    ({name:?}, include_bytes!({:?})),",
                file.display().to_string()
            )
            .unwrap();
        }
    }
    table.push_str("];\n");
    std::fs::write(out.join("fatbins.rs"), table).expect("OUT_DIR is writable");
}
