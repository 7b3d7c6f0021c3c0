//! `tests/gpu/measure.py`, the one call that re-measures berth on a GPU
//! machine, run here on the fake driver (`--fake`): its sections that need
//! no framework (the unload against a bare process, 4 GiB in one process
//! against berth, the budget, gpu-hog's sleep and wake) run end to end against the real `berth
//! serve`, so the script a GPU session runs is known to work before it
//! spends device time. Its figures here are the fake's bookkeeping.

use berth_tests::fake_gpu::FakeGpu;
use berth_tests::python::repo_root;
use berth_tests::*;

#[test]
fn the_gpu_script_runs_its_sections_on_the_fake_driver() {
    let fake = FakeGpu::new();
    let carry = std::env::temp_dir().join(format!("berth-gpu-carry-{}", std::process::id()));
    let work = carry.join("work");
    std::fs::create_dir_all(carry.join("models")).unwrap();
    std::fs::copy(berth_bin(), carry.join("berth")).unwrap();
    let out = std::process::Command::new("python3")
        .arg(repo_root().join("tests/gpu/measure.py"))
        .args(["--fake", "--only", "unload,bench,budget,sleep", "--carry"])
        .arg(&carry)
        .arg("--work")
        .arg(&work)
        .envs(fake.env())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for expected in [
        "| round | bare process, SIGKILL | berth unload of gpu-hog 4 GiB |",
        "pid gone: True",
        "| in one process, blocks kept in a pool (a caching allocator) | 4608 MiB of 4608 |",
        "| in one process, blocks freed, context alive | 512 MiB |",
        "50 load/unload cycles of 512 MiB",
        "| c | 20992 MiB | b, c |",
        "evicted: [[\"a\", \"c\"]]",
        "| hog4 | 4608 MiB | 0 MiB |",
        "| hog20 | 20992 MiB | 0 MiB |",
        "all sections in",
        "0 failed",
    ] {
        assert!(stdout.contains(expected), "no `{expected}` in:\n{stdout}");
    }
    let _ = std::fs::remove_dir_all(&carry);
}
