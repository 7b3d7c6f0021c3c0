//! The HTTP servers the tests and benches run as models' servers: the small
//! stdlib one (`tests/python/fake_upstream.py`), a config that declares it
//! and what the tests read of the processes it makes; and llama.cpp's, as
//! a worker kind.

use serde_json::Value;

use crate::python::{llamacpp_python, repo_root, test_python};
use crate::{Server, default_model};

/// A config whose worker kind `fake` runs the fake server with `modes`
/// (and `args`), and a model `fake` on it with `extra` keys. (Each test's
/// server is told apart from the others' by the pids its own `ps` gives.)
pub fn config(modes: &str, args: &str, extra: &str) -> String {
    let python = test_python();
    let script = repo_root().join("tests/python/fake_upstream.py");
    format!(
        r#"
[workers.fake]
command = ["{}", "{}", "--port", "{{port}}", "--mode", "{modes}"{args}]
http = {{ health = "/health", stop_grace = "2s", unhealthy_after = "3s", headers = {{ "X-Upstream-Key" = "k1" }} }}

[[model]]
name = "fake"
worker = "fake"
{extra}
"#,
        python.display(),
        script.display()
    )
}

pub fn ps_of(server: &Server, model: &str) -> Value {
    server
        .ps()
        .into_iter()
        .find(|m| m["name"] == model)
        .unwrap_or(Value::Null)
}

/// The processes carrying the mark of worker `pid` (itself included).
pub fn marked_with_the_mark_of(pid: u32) -> Vec<u32> {
    let mark_of = |p: &procfs::process::Process| {
        p.environ()
            .ok()
            .and_then(|env| env.get(std::ffi::OsStr::new("BERTH_WORKER_MARK")).cloned())
    };
    let mark = mark_of(&procfs::process::Process::new(pid as i32).unwrap()).unwrap();
    procfs::process::all_processes()
        .unwrap()
        .filter_map(Result::ok)
        .filter(|p| mark_of(p).as_ref() == Some(&mark))
        .map(|p| p.pid as u32)
        .collect()
}

/// A `[workers.llamacpp]` table: llama.cpp's server through
/// `llama-cpp-python[server]` (the pinned venv), serving `{model}` on
/// `{port}`, with `args` (e.g. `, "--n_threads", "2"`) added to its command.
pub fn llamacpp_worker(args: &str) -> String {
    format!(
        r#"
[workers.llamacpp]
command = ["{}", "-m", "llama_cpp.server", "--model", "{{model}}", "--host", "127.0.0.1",
           "--port", "{{port}}", "--n_ctx", "1024", "--interrupt_requests", "false",
           "--verbose", "false"{args}]
http = {{ health = "/openapi.json", stop_grace = "5s" }}
"#,
        llamacpp_python().display()
    )
}

/// A `[[model]]` table: the SmolLM2 GGUF `berth fetch smollm2` installs,
/// named `name`, on llama.cpp's server (the worker kind of
/// [`llamacpp_worker`]). The config must name the file's folder as its
/// `models_dir`.
pub fn llamacpp_model(name: &str) -> String {
    format!(
        "[[model]]\nname = \"{name}\"\nworker = \"llamacpp\"\nmodel = \"{}\"\n",
        default_model("smollm2").display()
    )
}

/// `clients` clients streaming chat completions from `model` (`chunks`
/// pieces, 20 ms apart, each answer whole and error-free) while `during` runs:
/// what `during` gave, the failures (status and answer) and how many were
/// sent.
pub fn streaming_while<R>(
    server: &Server,
    model: &str,
    (clients, chunks): (usize, u32),
    during: impl FnOnce() -> R,
) -> (R, Vec<String>, usize) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let _stop = crate::StopOnDrop(&stop);
        let clients: Vec<_> = (0..clients)
            .map(|_| {
                scope.spawn(|| {
                    let (mut failed, mut sent) = (Vec::new(), 0);
                    while !stop.load(Ordering::Relaxed) {
                        sent += 1;
                        let (status, text) = server.post_text(
                            "/v1/chat/completions",
                            serde_json::json!({"model": model, "stream": true, "chunks": chunks, "interval_ms": 20}),
                        );
                        if status != 200 || !text.contains("[DONE]") || text.contains("error") {
                            failed.push(format!("{status}: {text}"));
                        }
                    }
                    (failed, sent)
                })
            })
            .collect();
        let out = during();
        stop.store(true, Ordering::Relaxed);
        let (failed, sent) = clients.into_iter().fold((Vec::new(), 0), |(mut f, n), c| {
            let (failed, sent) = c.join().unwrap();
            f.extend(failed);
            (f, n + sent)
        });
        (out, failed, sent)
    })
}
