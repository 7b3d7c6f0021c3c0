//! `infinity-emb`, an established embedding server, started from a venv of
//! its own (`tests/python/requirements-infinity.txt`, pinned, installed by
//! name) on the same MiniLM folder `berth fetch minilm` installs: the
//! batching bench's row for what users would run instead of berth.
//!
//! The folder berth fetches has the weights, config, tokenizer and pooling
//! config; sentence-transformers also reads `modules.json` (which modules,
//! in which order) and `sentence_bert_config.json` (MiniLM's 256-token
//! limit, without which it would take the tokenizer's 512). Those two small
//! files are written into a scratch folder beside links to the fetched
//! files, so both servers read the same weights and nothing is downloaded.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use crate::{free_port, json_reply, target_dir, terminate, wait_for};

/// A running `infinity_emb v2` serving MiniLM on loopback; stopped on drop.
#[derive(Debug)]
pub struct Infinity {
    child: Child,
    url: String,
    agent: ureq::Agent,
    /// The name it serves the model under.
    pub model: String,
}

/// `python3` of the infinity venv (built on first use, reused while the
/// requirements file is unchanged; ~6 GB with PyTorch's CUDA libraries).
pub fn infinity_python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| crate::python::venv("python-infinity-venv"))
        .clone()
}

/// A scratch copy of `minilm` (links to its files) with the
/// sentence-transformers metadata infinity reads: mean pooling, then
/// normalisation, at most 256 tokens, as the model was trained.
fn model_folder(minilm: &Path) -> PathBuf {
    let dir = target_dir().join("infinity-minilm");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("1_Pooling")).expect("create the infinity model folder");
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "1_Pooling/config.json",
    ] {
        std::os::unix::fs::symlink(minilm.join(file), dir.join(file))
            .unwrap_or_else(|e| panic!("link {file} into {}: {e}", dir.display()));
    }
    let modules = serde_json::json!([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]);
    std::fs::write(dir.join("modules.json"), modules.to_string()).expect("write modules.json");
    std::fs::write(
        dir.join("sentence_bert_config.json"),
        r#"{"max_seq_length": 256, "do_lower_case": false}"#,
    )
    .expect("write sentence_bert_config.json");
    dir
}

impl Infinity {
    /// Starts it on `minilm` (the folder `berth fetch minilm` installs) with
    /// its torch engine on the CPU at batch size 32, offline and without
    /// telemetry, and waits until it lists the model (its load and warm-up
    /// take seconds).
    pub fn start(minilm: &Path) -> Infinity {
        let python = infinity_python();
        let folder = model_folder(minilm);
        let home = target_dir().join("infinity-home");
        std::fs::create_dir_all(&home).expect("create infinity's home");
        let port = free_port();
        let model = "all-MiniLM-L6-v2".to_string();
        let child = Command::new(python.with_file_name("infinity_emb"))
            .args(["v2", "--model-id"])
            .arg(&folder)
            .args(["--served-model-name", &model])
            .args(["--engine", "torch", "--device", "cpu", "--dtype", "float32"])
            .args([
                "--batch-size",
                "32",
                "--no-bettertransformer",
                "--no-compile",
            ])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--log-level", "warning"])
            .env("HF_HUB_OFFLINE", "1")
            .env("TRANSFORMERS_OFFLINE", "1")
            .env("INFINITY_ANONYMOUS_USAGE_STATS", "0")
            .env("DO_NOT_TRACK", "1")
            .env("HF_HOME", &home)
            .current_dir(&home)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start infinity_emb");
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(120)))
            .build()
            .into();
        let mut server = Infinity {
            child,
            url: format!("http://127.0.0.1:{port}"),
            agent,
            model,
        };
        let ready = wait_for(Duration::from_secs(180), || {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("infinity_emb exited before it was ready: {status}");
            }
            server
                .agent
                .get(format!("{}/models", server.url))
                .call()
                .is_ok_and(|r| r.status() == 200)
        });
        assert!(
            ready,
            "infinity_emb did not list its model within 3 minutes"
        );
        server
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// POSTs `body` to its OpenAI-style `/embeddings`; the status and JSON.
    pub fn embeddings(&self, body: serde_json::Value) -> (u16, serde_json::Value) {
        json_reply(
            self.agent
                .post(format!("{}/embeddings", self.url))
                .send_json(body),
        )
    }
}

impl Drop for Infinity {
    fn drop(&mut self) {
        if terminate(&mut self.child, Duration::from_secs(10)).is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
