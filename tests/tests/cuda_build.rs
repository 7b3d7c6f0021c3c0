//! `deploy/cuda/build_worker.py`, which builds the CUDA worker from the
//! Python index's toolkit wheels: what it would install and build for a
//! driver's CUDA version (`--plan`), and what it refuses. The build itself
//! takes most of an hour on two cores and is not run here; the worker it
//! makes refusing clearly without a driver is `gpu_measured.rs`'s.

use berth_tests::python::repo_root;
use serde_json::{Value, json};

fn plan(args: &[&str]) -> Result<Value, String> {
    let out = std::process::Command::new("python3")
        .arg(repo_root().join("deploy/cuda/build_worker.py"))
        .arg("--plan")
        .args(args)
        .output()
        .expect("python3 runs");
    if out.status.success() {
        Ok(serde_json::from_slice(&out.stdout).unwrap())
    } else {
        assert_eq!(out.status.code(), Some(2));
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn the_toolkit_is_the_driver_s_cuda_version_and_never_newer() {
    let p = plan(&["--cuda", "13.0"]).unwrap();
    assert_eq!(p["toolkit"], "13.0");
    let packages: Vec<&str> = p["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    // A CUDA 13.0 driver refuses newer PTX ("Unsupported .version 9.5"):
    // the compiler's parts are pinned to 13.0.
    for name in ["nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt"] {
        assert!(
            packages.contains(&format!("{name}==13.0.*").as_str()),
            "{packages:?}"
        );
    }
    assert!(
        packages.contains(&"nvidia-curand==10.4.0.*"),
        "{packages:?}"
    );
    assert_eq!(p["archs"], json!([80, 86, 89, 90]));
    assert_eq!(
        p["gencode"].as_array().unwrap().last().unwrap(),
        "-gencode=arch=compute_90,code=compute_90",
        "PTX for GPUs newer than the newest architecture"
    );

    // CUDA 12's wheels carry the version in their names.
    let p = plan(&["--cuda", "12.8", "--arch", "sm_90"]).unwrap();
    assert_eq!(p["toolkit"], "12.8");
    assert!(
        p["packages"]
            .as_array()
            .unwrap()
            .contains(&json!("nvidia-cuda-nvcc-cu12==12.8.*"))
    );
    assert_eq!(p["archs"], json!([90]));
    // A driver newer than any toolkit the bindings know: the newest, whose
    // PTX it runs.
    assert_eq!(plan(&["--cuda", "14.1"]).unwrap()["toolkit"], "13.4");
    assert_eq!(plan(&["--cuda", "13.9"]).unwrap()["toolkit"], "13.4");
}

#[test]
fn what_cannot_be_built_is_refused_with_what_to_do() {
    let old = plan(&["--cuda", "12.2"]).unwrap_err();
    assert!(
        old.contains("older than CUDA 12.4") && old.contains("update the NVIDIA driver"),
        "{old}"
    );
    let arch = plan(&["--cuda", "13.0", "--arch", "75"]).unwrap_err();
    assert!(
        arch.contains("`75`") && arch.contains("80 or more"),
        "{arch}"
    );
    let garbled = plan(&["--cuda", "thirteen"]).unwrap_err();
    assert!(garbled.contains("not a CUDA version"), "{garbled}");
}
