//! Sharing a card on the fake driver (`berth_tests::fake_gpu`): JAX-like
//! workers told their share of it, a declared share held while its model
//! runs, and an HTTP server whose child holds the model's device memory.

use berth_tests::fake_gpu::*;
use berth_tests::*;
use serde_json::{Value, json};

/// Two JAX-like workers on one 80 GiB card (`gpu-hog` preallocating as
/// XLA's client does, from the variables JAX reads). With each model's
/// `vram` declared, berth tells each its share and both load and serve;
/// left as JAX is by default (the operator sets preallocation back on),
/// the second fails at load, out of memory, and the first serves on.
/// Without a declared share, berth turns preallocation off.
#[test]
fn jax_workers_share_a_card_when_berth_tells_them_their_share() {
    let fake = FakeGpu::new();
    let jax = |name: &str, extra: &str| {
        format!(
            "[[model]]\nname = \"{name}\"\nbackend = \"gpu-hog\"\ngpus = [0]\n\
             options = {{ preallocate = \"xla\", alloc_mib = 1024 }}\n{extra}\n"
        )
    };
    let shared = format!(
        "{}{}",
        jax("jax-a", "vram = \"30GiB\""),
        jax("jax-b", "vram = \"30GiB\"")
    );
    let server = fake.serve(&shared);
    let a = load(&server, "jax-a");
    let b = load(&server, "jax-b");
    assert_eq!((&a["gpus"], &b["gpus"]), (&json!([0]), &json!([0])));
    let env = environ_of(u(&a["pid"]) as u32);
    // One fraction variable, never both: JAX 0.11 refuses the pair and runs
    // on the CPU (as the fake's `preallocate = "xla"` does, holding nothing).
    assert_eq!(env["XLA_PYTHON_CLIENT_MEM_FRACTION"], "0.375", "{env:?}");
    assert!(!env.contains_key("XLA_CLIENT_MEM_FRACTION"), "{env:?}");
    assert_eq!(env["BERTH_VRAM_BYTES"], (30 * GIB).to_string());
    // Each took its share (30 GiB), its 1 GiB, and a context.
    for report in [&a, &b] {
        assert_eq!(u(&report["vram_bytes"]), 31 * GIB + CONTEXT, "{report}");
    }
    for model in ["jax-a", "jax-b"] {
        let (status, reply) = server.post(&format!("/api/models/{model}/infer"), json!({}));
        assert_eq!(status, 200, "{model}: {reply}");
    }
    drop(server);

    let fake = FakeGpu::new();
    let alone = format!(
        "{}{}",
        jax(
            "jax-a",
            "env = [[\"XLA_PYTHON_CLIENT_PREALLOCATE\", \"true\"]]"
        ),
        jax(
            "jax-b",
            "env = [[\"XLA_PYTHON_CLIENT_PREALLOCATE\", \"true\"]]"
        )
    );
    let server = fake.serve(&alone);
    let a = load(&server, "jax-a");
    assert_eq!(
        u(&a["vram_bytes"]),
        60 * GIB + GIB + CONTEXT,
        "JAX's default: 75% of the card: {a}"
    );
    // The second runs out of memory at load while the first, idle, holds
    // the card: the scheduler has the first give way and tries once more,
    // saying both in the load report.
    let (status, b) = server.post("/api/models/jax-b/load", json!({}));
    assert_eq!(status, 200, "{b}");
    assert_eq!(
        b["admission"]["evicted"],
        json!(["jax-a (out_of_memory)"]),
        "{b}"
    );
    assert!(
        b["admission"]["retried"]
            .as_str()
            .unwrap_or_default()
            .contains("out of GPU memory"),
        "what happened the first time is said: {b}"
    );
    let (status, reply) = server.post("/api/models/jax-b/infer", json!({}));
    assert_eq!(status, 200, "the second serves: {reply}");
    drop(server);

    // No share declared: berth turns JAX's preallocation off, and both fit.
    let fake = FakeGpu::new();
    let server = fake.serve(&format!("{}{}", jax("jax-a", ""), jax("jax-b", "")));
    let a = load(&server, "jax-a");
    let b = load(&server, "jax-b");
    let env = environ_of(u(&a["pid"]) as u32);
    assert_eq!(env["XLA_PYTHON_CLIENT_PREALLOCATE"], "false", "{env:?}");
    assert!(
        !env.contains_key("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "{env:?}"
    );
    for report in [&a, &b] {
        assert_eq!(u(&report["vram_bytes"]), GIB + CONTEXT, "{report}");
    }
}

/// An HTTP server placed on a GPU: it is told its device like any worker,
/// and the device memory of what it started (vLLM keeps its weights in an
/// engine process of its own) counts as the model's in `ps`, `/api/gpus`
/// and the unload's proof.
#[test]
fn a_server_s_child_holding_vram_counts_as_the_model_s() {
    let fake = FakeGpu::new();
    let config = format!(
        "[workers.srv]\ncommand = [\"{}\", \"{}\", \"--port\", \"{{port}}\", \"--mode\", \"fork-child\", \"--child-mib\", \"8\"]\n\
         http = {{ health = \"/health\", stop_grace = \"2s\" }}\n\n\
         [[model]]\nname = \"srv\"\nworker = \"srv\"\ngpus = [1]\n",
        berth_tests::python::test_python().display(),
        berth_tests::python::repo_root()
            .join("tests/python/fake_upstream.py")
            .display()
    );
    let server = fake.serve(&config);
    let report = load(&server, "srv");
    assert_eq!(report["gpus"], json!([1]), "{report}");
    let pid = u(&report["pid"]) as u32;
    let env = environ_of(pid);
    assert!(env.contains_key("CUDA_VISIBLE_DEVICES"), "{env:?}");
    assert_eq!(env["BERTH_GPUS"], "1");
    assert_eq!(env["XLA_PYTHON_CLIENT_PREALLOCATE"], "false");
    let children: Vec<u32> = children_of(pid).into_iter().map(|(p, _)| p).collect();
    assert_eq!(children.len(), 1, "the server's engine: {children:?}");
    fake.hold(children[0], 1, 3 * GIB);
    assert!(
        wait_for(std::time::Duration::from_secs(5), || {
            server.ps()[0]["vram_bytes"] == json!(3 * GIB)
        }),
        "{:?}",
        server.ps()
    );
    let status = gpus(&server);
    assert_eq!(
        status["devices"][1]["processes"],
        json!([{ "pid": children[0], "bytes": 3 * GIB, "model": "srv" }]),
        "{status}"
    );
    assert_eq!(u(&status["devices"][1]["berth_bytes"]), 3 * GIB);
    let report = unload(&server, "srv");
    assert_eq!(u(&report["vram_at_stop_bytes"]), 3 * GIB, "{report}");
    assert_eq!(report["gpu_pid_gone"], true, "{report}");
    assert!(u(&report["gpu_reclaimed_bytes"]) >= 3 * GIB, "{report}");
    assert!(!alive(children[0]));
}

/// A declared `vram` is held for as long as its worker runs, not only
/// while it loads: a model that has not grown into its share yet still
/// has it, so a newcomer that would not fit beside the whole share makes
/// room by evicting it (idle) rather than being placed into it.
#[test]
fn a_declared_share_is_held_while_its_model_runs() {
    let fake = FakeGpu::new();
    let model = |name: &str, vram: &str| {
        format!(
            "[[model]]\nname = \"{name}\"\nbackend = \"gpu-hog\"\ngpus = [0]\nvram = \"{vram}\"\n\
             options = {{ alloc_mib = 1024 }}\n"
        )
    };
    let server = fake.serve(&format!(
        "{}{}",
        model("first", "40GiB"),
        model("second", "45GiB")
    ));
    load(&server, "first");
    // 80 GiB, 1.5 GiB of it used: 45 GiB is free, but 38.5 GiB of that is
    // `first`'s share.
    let report = load(&server, "second");
    assert_eq!(report["gpus"], json!([0]), "{report}");
    let loaded: Vec<Value> = server.ps().iter().map(|m| m["name"].clone()).collect();
    assert_eq!(loaded, [json!("second")], "first was evicted to make room");
}
