//! Model files from outside, second round: a folder that loops on itself
//! cannot freeze the supervisor, every file a built-in backend opens stays
//! inside its model's folder and is a regular file, errors say what a file
//! is without telling a client what lies outside the models directory, and
//! a GGUF header cannot claim tensors its file does not hold.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use berth::ModelSpec;
use berth_tests::*;
use serde_json::{Value, json};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("berth-files-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A copy of the default embedding model's folder under `dir`, its files
/// hard-linked (no copy of the weights).
fn minilm_copy(dir: &Path, name: &str) -> PathBuf {
    let source = default_model("minilm");
    let copy = dir.join(name);
    std::fs::create_dir_all(copy.join("1_Pooling")).unwrap();
    for file in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "1_Pooling/config.json",
    ] {
        let from = source.join(file);
        if from.exists() {
            std::fs::hard_link(&from, copy.join(file))
                .or_else(|_| std::fs::copy(&from, copy.join(file)).map(|_| ()))
                .unwrap();
        }
    }
    copy
}

fn config(models_dir: &Path, extra: &str) -> String {
    format!("models_dir = \"{}\"\n{extra}", models_dir.display())
}

/// A model folder holding two links to itself, and the models directory
/// named as a model: the supervisor keeps answering while they are
/// registered and loaded (the walk that measures a folder follows no link
/// and is bounded), and the models directory itself is refused.
#[test]
fn a_folder_that_loops_on_itself_does_not_freeze_the_supervisor() {
    let models = scratch("loops");
    let looped = minilm_copy(&models, "looped");
    std::os::unix::fs::symlink(".", looped.join("a")).unwrap();
    std::os::unix::fs::symlink(".", looped.join("b")).unwrap();
    let server = Server::start(&config(&models, ""));
    let (status, reply) = server.put(
        "/api/models/looped",
        json!({ "backend": "embed", "model": "looped" }),
    );
    assert_eq!(status, 201, "{reply}");
    let (status, reply) = server.put(
        "/api/models/everything",
        json!({ "backend": "embed", "model": models }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the models directory itself"),
        "{reply}"
    );
    let loading = std::thread::scope(|scope| {
        let load = scope.spawn(|| server.post("/api/models/looped/load", json!({})));
        // While it loads, everything else answers at once.
        for path in ["/healthz", "/api/ps", "/metrics", "/api/models"] {
            let started = Instant::now();
            let (status, _) = server.get(path);
            assert_eq!(status, 200, "{path}");
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "{path} took {:?}",
                started.elapsed()
            );
        }
        load.join().unwrap()
    });
    assert_eq!(
        loading.0, 200,
        "the looped folder still loads: {}",
        loading.1
    );
    let _ = std::fs::remove_dir_all(&models);
}

/// What a PUT's error tells a client of paths outside the models
/// directory: that they are outside, nothing more (not whether they exist,
/// not where a link points). A relative path is taken inside the models
/// directory, not the server's working directory.
#[test]
fn errors_tell_a_client_nothing_of_what_lies_outside() {
    let models = scratch("leaks");
    let _ = minilm_copy(&models, "minilm");
    std::os::unix::fs::symlink("/proc/self/mem", models.join("mem")).unwrap();
    let server = Server::start(&config(&models, ""));
    for path in [
        "/root/.ssh/id_rsa",
        "/etc/passwd",
        "/no/such/file",
        "../../etc/passwd",
    ] {
        let (status, reply) = server.put(
            "/api/models/m",
            json!({ "backend": "embed", "model": path }),
        );
        assert_eq!(status, 400, "{path}: {reply}");
        let message = reply["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("outside the models directory"),
            "{path}: {message}"
        );
        assert!(
            !message.contains("No such file") && !message.contains("os error"),
            "{path}: it tells whether the path exists: {message}"
        );
    }
    let (status, reply) = server.put(
        "/api/models/m",
        json!({ "backend": "embed", "model": "mem" }),
    );
    assert_eq!(status, 400, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        !message.contains("/proc/"),
        "it tells where the link points: {message}"
    );
    // Relative: inside models_dir, whatever the server's folder.
    let (status, reply) = server.put(
        "/api/models/rel",
        json!({ "backend": "embed", "model": "minilm" }),
    );
    assert_eq!(status, 201, "{reply}");
    assert_eq!(
        reply["spec"]["model"],
        json!(models.join("minilm")),
        "{reply}"
    );
    let (status, reply) = server.put(
        "/api/models/rel2",
        json!({ "backend": "embed", "model": "nothing-here" }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not exist in the models directory"),
        "{reply}"
    );
    let _ = std::fs::remove_dir_all(&models);
}

/// Every file the embed backend opens stays inside its model's folder and
/// must be a regular file; each refusal says what the file is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_file_a_backend_opens_is_confined_and_regular() {
    let dir = scratch("confined");
    let sup = supervisor();
    /// A copy's name, how to spoil it, what the error must say.
    type Case<'a> = (&'a str, &'a dyn Fn(&Path), &'a str);
    let cases: [Case; 5] = [
        (
            "passwd",
            &|m| {
                std::fs::remove_file(m.join("config.json")).unwrap();
                std::os::unix::fs::symlink("/etc/passwd", m.join("config.json")).unwrap();
            },
            "leads outside the model's folder",
        ),
        (
            "fifo",
            &|m| {
                std::fs::remove_file(m.join("model.safetensors")).unwrap();
                let path =
                    std::ffi::CString::new(m.join("model.safetensors").to_str().unwrap()).unwrap();
                // SAFETY: mkfifo reads the path, valid for the call.
                assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
            },
            "is a FIFO",
        ),
        (
            "zero",
            &|m| {
                std::fs::remove_file(m.join("model.safetensors")).unwrap();
                std::os::unix::fs::symlink("/dev/zero", m.join("model.safetensors")).unwrap();
            },
            "leads outside the model's folder",
        ),
        (
            "looping",
            &|m| {
                std::fs::remove_file(m.join("model.safetensors")).unwrap();
                std::os::unix::fs::symlink("model.safetensors", m.join("model.safetensors"))
                    .unwrap();
            },
            "is a symlink loop",
        ),
        (
            "missing",
            &|m| std::fs::remove_file(m.join("tokenizer.json")).unwrap(),
            "is missing",
        ),
    ];
    for (name, spoil, phrase) in cases {
        let model = minilm_copy(&dir, name);
        spoil(&model);
        let started = Instant::now();
        let err = sup
            .load(ModelSpec::new(name, "embed").model(&model))
            .await
            .unwrap_err();
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{name}: a load that waits for ever"
        );
        let text = err.to_string();
        assert_eq!(err.kind(), "load_failed", "{name}: {text}");
        assert!(text.contains(phrase), "{name}: `{phrase}` not in: {text}");
    }
    // `/dev/zero` named as a GGUF file itself: a device, said so.
    let err = sup
        .load(ModelSpec::new("dev", "generate").model("/dev/zero"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("character device"), "{err}");
    sup.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// `quant=q8_0` caches its converted copy beside the GGUF: a symlink
/// planted at the cache's name (to a file outside the folder, newer than
/// the GGUF) is neither read as the cache nor written through; the copy is
/// made anew in its place and the model serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planted_symlink_at_the_q8_0_cache_is_not_followed() {
    let dir = scratch("q8cache");
    let folder = dir.join("smol");
    std::fs::create_dir_all(&folder).unwrap();
    let gguf = default_model("smollm2");
    let copy = folder.join(gguf.file_name().unwrap());
    std::fs::hard_link(&gguf, &copy)
        .or_else(|_| std::fs::copy(&gguf, &copy).map(|_| ()))
        .unwrap();
    let outside = dir.join("outside.txt");
    std::fs::write(&outside, "not weights, and not berth's to read or write").unwrap();
    let stem = copy.file_stem().unwrap().to_string_lossy().into_owned();
    let cache = folder.join(format!("{stem}.Q8_0.gguf"));
    std::os::unix::fs::symlink(&outside, &cache).unwrap();
    let sup = supervisor();
    let load = sup
        .load(
            ModelSpec::new("q8", "generate")
                .model(&copy)
                .option("quant", "q8_0"),
        )
        .await;
    assert!(load.is_ok(), "the cache was made anew: {load:?}");
    assert_eq!(
        std::fs::read_to_string(&outside).unwrap(),
        "not weights, and not berth's to read or write"
    );
    let meta = std::fs::symlink_metadata(&cache).unwrap();
    assert!(
        meta.file_type().is_file(),
        "the symlink was replaced by the copy"
    );
    sup.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GGUF whose `token_embd` claims 2^62 × 2^62 elements (a header is
/// cheap to write) is refused at load, naming the tensor, instead of
/// loading and then failing every chat with an overflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gguf_claiming_tensors_its_file_cannot_hold_is_refused_at_load() {
    use candle_core::quantized::{GgmlDType, QTensor, gguf_file};
    use candle_core::{DType, Device, Tensor};
    let dir = scratch("gguf");
    let path = dir.join("huge.gguf");
    let weights = Tensor::zeros((4, 32), DType::F32, &Device::Cpu).unwrap();
    let tensor = QTensor::quantize(&weights, GgmlDType::Q8_0).unwrap();
    let arch = gguf_file::Value::String("llama".into());
    let mut file = std::fs::File::create(&path).unwrap();
    gguf_file::write(
        &mut file,
        &[("general.architecture", &arch)],
        &[("token_embd.weight", &tensor)],
    )
    .unwrap();
    drop(file);
    // The tensor's two dimensions (u64 each) follow its name and its
    // number of dimensions (u32) in the header.
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .windows(17)
        .position(|w| w == b"token_embd.weight")
        .unwrap()
        + 17;
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 2);
    for d in 0..2 {
        let field = at + 4 + 8 * d;
        bytes[field..field + 8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    }
    std::fs::write(&path, &bytes).unwrap();
    let sup = supervisor();
    for mode in ["mmap", "read"] {
        let err = sup
            .load(
                ModelSpec::new("huge", "generate")
                    .model(&path)
                    .option("load_mode", mode),
            )
            .await
            .unwrap_err();
        let text = err.to_string();
        assert_eq!(err.kind(), "load_failed", "{mode}: {text}");
        assert!(
            text.contains("token_embd.weight") && text.contains("does not fit"),
            "{mode}: {text}"
        );
    }
    sup.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `RUST_BACKTRACE=1` in berth's environment (and so its workers'),
/// a model file candle cannot read fails with an error a client may see:
/// without the backtrace, which names build paths (it goes to the log).
#[test]
fn backtraces_stay_in_the_log() {
    let models = scratch("traces");
    // A GGUF file of an unknown version: candle's reader refuses it with
    // an error that carries a backtrace when RUST_BACKTRACE is set.
    let mut bytes = b"GGUF".to_vec();
    bytes.extend_from_slice(&99u32.to_le_bytes());
    bytes.extend_from_slice(&[0; 64]);
    std::fs::write(models.join("odd.gguf"), bytes).unwrap();
    let server = Server::start_env(&config(&models, ""), &[], &[("RUST_BACKTRACE", "1")]);
    let (status, reply) = server.put(
        "/api/models/odd",
        json!({ "backend": "generate", "model": "odd.gguf" }),
    );
    assert_eq!(status, 201, "{reply}");
    let (status, reply) = server.post("/api/models/odd/load", json!({}));
    assert_ne!(status, 200, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap().to_string();
    assert!(message.contains("not a valid GGUF file"), "{message}");
    assert!(
        !message.contains("   0: ") && !message.contains(".rs:") && !message.contains(".cargo"),
        "a backtrace reached the client: {message}"
    );
    let _ = std::fs::remove_dir_all(&models);
    let _: Value = reply;
}
