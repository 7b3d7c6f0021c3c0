//! llama.cpp's server (through `llama-cpp-python[server]`, pinned, built by
//! pip into a venv under target/ the first time) run by berth as a model's
//! worker, serving the SmolLM2 GGUF that `berth fetch smollm2` installs:
//! chat, streaming, the official OpenAI client, swaps under load, the
//! unload's proof, a SIGKILLed berth, and a llama-swap config.

use std::process::Command;
use std::time::Duration;

use berth_tests::python::llamacpp_python;
use berth_tests::*;
use serde_json::{Value, json};

/// A config serving the SmolLM2 GGUF as `smollm2-cpp` on llama.cpp's
/// server, inside `models_dir`.
fn config(extra: &str) -> String {
    let gguf = default_model("smollm2");
    format!(
        r#"
models_dir = "{}"

{}
{}{extra}
"#,
        gguf.parent().unwrap().display(),
        berth_tests::upstream::llamacpp_worker(""),
        berth_tests::upstream::llamacpp_model("smollm2-cpp"),
    )
}

fn ask(max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": "smollm2-cpp",
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    })
}

#[test]
fn llama_cpp_serves_chats_through_berth_and_the_openai_client() {
    let server = Server::start(&config(""));
    let (status, reply) = server.post("/v1/chat/completions", ask(16, false));
    assert_eq!(status, 200, "{reply}");
    let text = reply["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(!text.trim().is_empty(), "{reply}");
    assert!(
        reply["usage"]["completion_tokens"].as_u64() > Some(0),
        "{reply}"
    );
    let (status, stream) = server.post_text("/v1/chat/completions", ask(16, true));
    assert_eq!(status, 200, "{stream}");
    let pieces = stream.lines().filter(|l| l.starts_with("data: {")).count();
    assert!(pieces > 2, "streamed in pieces: {stream}");
    assert!(stream.contains("data: [DONE]"), "{stream}");
    // The official OpenAI client, plain and streamed.
    let script = r#"
import json, sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="unused")
ask = dict(model="smollm2-cpp", max_tokens=16, temperature=0,
           messages=[{"role": "user", "content": "What is 2 + 3?"}])
plain = client.chat.completions.create(**ask)
pieces = [c.choices[0].delta.content for c in client.chat.completions.create(stream=True, **ask)
          if c.choices and c.choices[0].delta.content]
models = [m.id for m in client.models.list()]
print(json.dumps({"plain": plain.choices[0].message.content, "pieces": pieces, "models": models}))
"#;
    let out = Command::new(llamacpp_python())
        .args(["-c", script, &format!("{}/v1", server.url)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(!seen["plain"].as_str().unwrap().is_empty(), "{seen}");
    assert!(seen["pieces"].as_array().unwrap().len() > 2, "{seen}");
    assert!(
        seen["models"]
            .as_array()
            .unwrap()
            .contains(&json!("smollm2-cpp")),
        "{seen}"
    );
    let ps = server.ps();
    assert_eq!(ps[0]["backend"], "http");
    assert!(ps[0]["rss_bytes"].as_u64() > Some(50 << 20), "{}", ps[0]);
}

/// Swaps while four clients stream chats: none fails; each swap starts a
/// new server on its own port before the old one drains and stops. Then
/// the unload proves what came back.
#[test]
fn swaps_under_load_and_the_unload_proof() {
    let server = Server::start(&config(""));
    assert_eq!(
        server.post("/api/models/smollm2-cpp/load", json!({})).0,
        200
    );
    let first = server.ps()[0]["pid"].as_u64().unwrap();
    let (_, catalogue) = server.get("/api/models");
    let spec = catalogue["models"][0]["spec"].clone();
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (failures, total, swapped) = std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        let clients: Vec<_> = (0..4)
            .map(|_| {
                scope.spawn(|| {
                    let (mut failed, mut sent) = (Vec::new(), 0);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        sent += 1;
                        let (status, text) =
                            server.post_text("/v1/chat/completions", ask(12, true));
                        if status != 200 || !text.contains("[DONE]") || text.contains("\"error\"") {
                            failed.push(format!("{status}: {text}"));
                        }
                    }
                    (failed, sent)
                })
            })
            .collect();
        let mut pids = Vec::new();
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(500));
            let (status, reply) = server.post("/api/models/smollm2-cpp/swap", spec.clone());
            assert_eq!(status, 200, "{reply}");
            assert_eq!(reply["unload"]["leftover_processes"], 0, "{reply}");
            pids.push(reply["new_pid"].as_u64().unwrap());
        }
        std::thread::sleep(Duration::from_millis(500));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (failed, sent) = clients.into_iter().fold((Vec::new(), 0), |(mut f, n), c| {
            let (failed, sent) = c.join().unwrap();
            f.extend(failed);
            (f, n + sent)
        });
        (failed, sent, pids)
    });
    assert!(total >= 8, "{total} chats");
    assert!(
        failures.is_empty(),
        "{} of {total} failed: {failures:?}",
        failures.len()
    );
    assert!(!alive(first as u32));
    assert_eq!(server.ps()[0]["pid"].as_u64(), swapped.last().copied());
    let (status, report) = server.post("/api/models/smollm2-cpp/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["leftover_processes"], 0, "{report}");
    assert!(
        report["reclaimed_bytes"].as_u64() > Some(20 << 20),
        "the server's memory came back: {report}"
    );
    assert!(!alive(report["pid"].as_u64().unwrap() as u32));
}

/// A `berth serve` killed with SIGKILL leaves no server behind.
#[test]
fn a_sigkilled_berth_leaves_no_server() {
    let mut server = Server::start(&config(""));
    assert_eq!(
        server.post("/api/models/smollm2-cpp/load", json!({})).0,
        200
    );
    let pid = server.ps()[0]["pid"].as_u64().unwrap() as u32;
    let tree = workers_of_model("smollm2-cpp");
    assert!(tree.contains(&pid));
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || tree.iter().all(|p| !alive(*p))),
        "outlived berth: {:?}",
        tree.iter().filter(|p| alive(**p)).collect::<Vec<_>>()
    );
}

/// A llama-swap config, as its users have it, served by berth against the
/// real server: macros, `${PORT}`, `checkEndpoint`, `ttl`, `aliases`,
/// `cmdStop`, `groups`; and what berth does not honour is said.
#[test]
fn a_llama_swap_config_serves_through_berth() {
    let gguf = default_model("smollm2");
    let dir = std::env::temp_dir().join(format!("berth-llama-swap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("config.yaml");
    std::fs::write(
        &yaml,
        format!(
            r#"healthCheckTimeout: 60
startPort: 10001
macros:
  "python": "{}"
  "ctx": 1024
models:
  "smol":
    cmd: |
      ${{python}} -m llama_cpp.server
      --model "{}"
      # the port llama-swap (and berth) choose
      --host 127.0.0.1 --port ${{PORT}}
      --n_ctx ${{ctx}} --interrupt_requests false --verbose false
    checkEndpoint: /openapi.json
    ttl: 300
    aliases: ["gpt-4o-mini"]
    cmdStop: "kill ${{PID}}"
groups:
  all:
    members: ["smol"]
"#,
            llamacpp_python().display(),
            gguf.display()
        ),
    )
    .unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(&config, "").unwrap();
    let stderr = dir.join("stderr.log");
    let port = free_port();
    let mut child = Command::new(berth_bin())
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--config",
        ])
        .arg(&config)
        .arg("--llama-swap")
        .arg(&yaml)
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}");
    let agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .new_agent();
    assert!(
        wait_for(Duration::from_secs(20), || agent
            .get(format!("{url}/healthz"))
            .call()
            .is_ok_and(|r| r.status() == 200)),
        "serve came up: {}",
        std::fs::read_to_string(&stderr).unwrap_or_default()
    );
    let said = std::fs::read_to_string(&stderr).unwrap();
    assert!(
        said.contains("`startPort` not honoured"),
        "not said: {said}"
    );
    assert!(!said.contains("left out"), "{said}");
    // Asked by its alias, as llama-swap's clients do.
    let (status, reply) = json_reply(agent.post(format!("{url}/v1/chat/completions")).send_json(
        json!({
            "model": "gpt-4o-mini",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 8
        }),
    ));
    assert_eq!(status, 200, "{reply}");
    assert!(
        reply["choices"][0]["message"]["content"].is_string(),
        "{reply}"
    );
    let (_, ps) = json_reply(agent.get(format!("{url}/api/ps")).call());
    assert_eq!(ps["models"][0]["name"], "smol", "{ps}");
    assert!(
        ps["models"][0]["keep_alive_left_s"].as_f64() > Some(200.0),
        "ttl 300 became its keep-alive: {ps}"
    );
    assert!(terminate(&mut child, Duration::from_secs(30)).is_some());
    let _ = std::fs::remove_dir_all(&dir);
}
