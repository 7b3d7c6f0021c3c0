//! berth as a drop-in for llama-swap: llama-swap's aider example
//! (`docs/examples/aider-qwq-coder`, at 0bdb372), servers on fixed ports,
//! stop commands (`cmdStop`), the matrix, the preload hook and listed
//! aliases, a folder of files (`-config-dir`), against the test's fake server. llama-swap's own `config.example.yaml` is in `llama_swap.rs`.

use std::time::Duration;

use berth_tests::llama_swap::{chat, fake, running, said, serve};
use berth_tests::python::{repo_root, test_python};
use berth_tests::*;
use serde_json::json;

/// llama-swap's aider example, its legacy `profiles` list made a mapping:
/// both models (each on a fixed port) served, one at a time (llama-swap's
/// default group); a swap of one is break-before-make.
#[test]
fn the_aider_example_serves_both_models_on_their_fixed_ports() {
    let dir = daemon::temp_dir("llama-swap-aider");
    let (coder, qwq) = (free_port(), free_port());
    let fake = fake();
    let yaml = format!(
        r#"healthCheckTimeout: 300
logLevel: debug

profiles:
    aider:
      description: "aider: the architect and the editor"
      pins:
        architect: QwQ
        editor: qwen-coder-32B

models:
  "qwen-coder-32B":
    env:
      - "CUDA_VISIBLE_DEVICES=0"
    aliases:
      - coder
    proxy: "http://127.0.0.1:{coder}"

    # set appropriate paths for your environment
    cmd: >
      {fake}
      --host 127.0.0.1 --port {coder} --flash-attn --slots
      --ctx-size 16000
      --model /path/to/Qwen2.5-Coder-32B-Instruct-Q4_K_M.gguf
  "QwQ":
    env:
      - "CUDA_VISIBLE_DEVICES=1"
    proxy: "http://127.0.0.1:{qwq}"

    # set appropriate paths for your environment
    cmd: >
      {fake}
      --host 127.0.0.1 --port {qwq}
      --flash-attn --metrics
      --slots
      --model /path/to/Qwen_QwQ-32B-Q4_K_M.gguf
      --samplers "top_k;top_p;min_p;temperature;dry;typ_p;xtc"
      --temp 0.6
"#
    );
    let mut server = serve(&dir, &yaml, &[]);
    let notes = said(&dir);
    assert!(!notes.contains("left out"), "{notes}");
    let (status, reply) = chat(&server, "coder", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(running(&server), ["qwen-coder-32B"]);
    let (status, reply) = chat(&server, "QwQ", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(running(&server), ["QwQ"], "one at a time");
    // The profile's pins.
    server.put("/api/profiles/active", json!({"name": "aider"}));
    let (status, _) = chat(&server, "editor", json!({}));
    assert_eq!(status, 200);
    assert_eq!(running(&server), ["qwen-coder-32B"]);

    // A swap on a fixed port: the old server stops first, requests wait.
    let (status, report) = server.post("/api/models/qwen-coder-32B/swap", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["break_before_make"], true, "{report}");
    assert_ne!(report["old_pid"], report["new_pid"]);
    assert_eq!(chat(&server, "qwen-coder-32B", json!({})).0, 200);
    assert!(server.terminate(Duration::from_secs(30)).is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two models on one fixed port never run at once, in a berth config as
/// under llama-swap; a port another process holds is refused naming it.
#[test]
fn models_on_one_fixed_port_take_turns_and_a_taken_port_is_named() {
    let python = test_python();
    let script = repo_root().join("tests/python/fake_upstream.py");
    let port = free_port();
    let kind = |name: &str| {
        format!(
            "[workers.{name}]\ncommand = [\"{}\", \"{}\", \"--port\", \"{port}\"]\nhttp = {{ port = {port}, stop_grace = \"2s\" }}\n",
            python.display(),
            script.display()
        )
    };
    let config = format!(
        "{}{}[[model]]\nname = \"a\"\nworker = \"a\"\n[[model]]\nname = \"b\"\nworker = \"b\"\n",
        kind("a"),
        kind("b")
    );
    let server = Server::start(&config);
    assert_eq!(server.post("/api/models/a/load", json!({})).0, 200);
    let (status, reply) = server.post("/api/models/b/load", json!({}));
    assert_eq!(status, 200, "{reply}");
    let states: Vec<(String, String)> = server
        .ps()
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap().into(),
                m["state"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(
        states,
        [("b".to_string(), "ready".to_string())],
        "a stopped for b"
    );
    server.post("/api/models/b/unload", json!({}));
    let holder = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    let (status, reply) = server.post("/api/models/a/load", json!({}));
    assert_ne!(status, 200);
    let message = reply["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(&format!(
            "its fixed port {port} is taken by pid {}",
            std::process::id()
        )),
        "{reply}"
    );
    drop(holder);
}

/// The legacy top-level `matrix` (its sets acting), `hooks.on_startup
/// .preload` (loaded at start), `includeAliasesInList`, and a legacy
/// list-shaped profile refused with llama-swap's own reason.
#[test]
fn the_matrix_the_preload_hook_and_listed_aliases_act() {
    let dir = daemon::temp_dir("llama-swap-matrix");
    let fake = fake();
    let yaml = format!(
        r#"includeAliasesInList: true
hooks:
  on_startup:
    preload: ["first"]
profiles:
  old:
    - alpha
    - beta
matrix:
  vars: {{ a: alpha, b: beta }}
  sets:
    pair: "a & b"
    solo: "gamma"
  evict_costs: {{ b: 5 }}
models:
  alpha: {{ cmd: "{fake} --port ${{PORT}}", aliases: ["first"] }}
  beta: {{ cmd: "{fake} --port ${{PORT}}" }}
  gamma: {{ cmd: "{fake} --port ${{PORT}}" }}
"#
    );
    let server = serve(&dir, &yaml, &[]);
    assert!(
        said(&dir).contains(
            "profile `old` refused: profile must be a mapping with description and pins; the \
             legacy list syntax is no longer supported"
        ),
        "{}",
        said(&dir)
    );
    assert!(
        wait_for(Duration::from_secs(20), || running(&server) == ["alpha"]),
        "preloaded at start: {:?}",
        running(&server)
    );
    let (_, list) = server.get("/v1/models");
    let alias = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "first")
        .cloned()
        .unwrap_or_default();
    assert_eq!(alias["meta"]["llamaswap"]["type"], "alias", "{list}");
    assert_eq!(alias["meta"]["llamaswap"]["modelID"], "alpha");
    assert_eq!(alias["status"]["value"], "loaded");
    // beta joins alpha (their set); gamma's set holds it alone.
    assert_eq!(chat(&server, "beta", json!({})).0, 200);
    assert_eq!(running(&server), ["alpha", "beta"]);
    assert_eq!(chat(&server, "gamma", json!({})).0, 200);
    assert_eq!(running(&server), ["gamma"]);
    assert_eq!(chat(&server, "first", json!({})).0, 200);
    assert_eq!(running(&server), ["alpha"]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A server's `stop_command` that names what it stops (a container, in
/// llama-swap's `docker stop ${MODEL_ID}`) runs at an unload and again when
/// the server's client dies on its own, before the restart; one that fails
/// falls back to the stop signal.
#[test]
fn a_stop_command_runs_at_unload_and_after_the_client_dies() {
    let dir = daemon::temp_dir("stop-command");
    let marker = dir.join("stopped");
    let python = test_python();
    let script = repo_root().join("tests/python/fake_upstream.py");
    let config = format!(
        r#"[workers.named]
command = ["{python}", "{script}", "--port", "{{port}}"]
http = {{ stop_command = ["sh", "-c", "echo named >> {marker}; kill {{pid}}"], stop_grace = "5s" }}
[workers.broken]
command = ["{python}", "{script}", "--port", "{{port}}"]
http = {{ stop_command = ["/nonexistent/stop"], stop_grace = "5s" }}
[workers.by-name]
command = ["{python}", "{script}", "--port", "{{port}}"]
http = {{ stop_command = ["sh", "-c", "echo by-name >> {marker}"], stop_grace = "1s" }}
[[model]]
name = "named"
worker = "named"
[[model]]
name = "broken"
worker = "broken"
[[model]]
name = "by-name"
worker = "by-name"
"#,
        python = python.display(),
        script = script.display(),
        marker = marker.display(),
    );
    let server = Server::start(&config);
    let unload = |name: &str| {
        assert_eq!(
            server
                .post(&format!("/api/models/{name}/load"), json!({}))
                .0,
            200
        );
        let (status, report) = server.post(&format!("/api/models/{name}/unload"), json!({}));
        assert_eq!(status, 200, "{report}");
        report
    };
    assert_eq!(unload("named")["stop"], "stop_command");
    assert_eq!(
        std::fs::read_to_string(&marker).unwrap_or_default(),
        "named\n"
    );
    // A command that cannot run: the stop signal stops it all the same.
    assert_eq!(unload("broken")["stop"], "sigterm");

    // The client killed from outside: its by-name command runs before the
    // restart.
    let (_, load) = server.post("/api/models/by-name/load", json!({}));
    let pid = load["pid"].as_u64().unwrap() as i32;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(
        wait_for(Duration::from_secs(10), || std::fs::read_to_string(&marker)
            .unwrap_or_default()
            .contains("by-name")),
        "its stop command ran after the death"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A JSON body sent to `/upstream/{model}/…` is the server's, not berth's:
/// its `keep_alive` does not unload the model after a second. And a model
/// named `unload` has berth's routes of its own: `POST
/// /api/models/unload/infer` is its request, not an unload of a model
/// named `infer`.
#[test]
fn upstream_bodies_are_the_servers_and_a_model_named_unload_keeps_berths_routes() {
    let dir = daemon::temp_dir("llama-swap-hardening");
    let fake = fake();
    let yaml = format!(
        "models:\n  unload:\n    cmd: {fake} --port ${{PORT}}\n  infer:\n    cmd: {fake} --port ${{PORT}}\n\
         groups:\n  both:\n    swap: false\n    members: [unload, infer]\n"
    );
    let server = serve(&dir, &yaml, &[]);
    let (status, reply) = server.post(
        "/upstream/infer/v1/anything",
        json!({"keep_alive": "1s", "plain": "ok"}),
    );
    assert_eq!(status, 200, "{reply}");
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        running(&server).contains(&"infer".to_string()),
        "{:?}",
        running(&server)
    );
    // `unload` loaded; `infer` still running after berth's route for it.
    let (status, reply) = server.post("/api/models/unload/load", json!({}));
    assert_eq!(status, 200, "{reply}");
    let (status, reply) = server.post("/api/models/unload/infer", json!({"plain": "x"}));
    assert_ne!(status, 404, "{reply}");
    assert!(
        running(&server).contains(&"infer".to_string()),
        "{:?}",
        running(&server)
    );
}

/// Configs as people wrote them, served: an ID with spaces reached by its
/// ID (a chat, `/upstream` with it URL-encoded, `/running`), a server on
/// another loopback address, `${PORT}` in `cmdStop`, and llama-swap's model
/// routes outside `/v1` routed by their model.
#[test]
fn ids_with_spaces_other_loopbacks_and_routes_outside_v1_are_served() {
    let dir = daemon::temp_dir("llama-swap-second");
    let fake = fake();
    let marker = dir.join("stopped-on");
    let yaml = format!(
        "models:\n  \"GPT OSS 20B\":\n    cmd: {fake} --port ${{PORT}}\n    cmdStop: sh -c \"echo ${{PORT}} > {}; kill ${{PID}}\"\n  two:\n    cmd: {fake} --host 127.0.0.2 --port ${{PORT}}\n    proxy: http://127.0.0.2:${{PORT}}\n\
         groups:\n  both:\n    swap: false\n    members: [\"GPT OSS 20B\", two]\n",
        marker.display()
    );
    let server = serve(&dir, &yaml, &[]);
    assert!(!said(&dir).contains("left out"), "{}", said(&dir));
    let (status, reply) = chat(&server, "GPT OSS 20B", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(running(&server), ["GPT OSS 20B"]);
    let (status, reply) = server.post("/upstream/GPT%20OSS%2020B/v1/anything", json!({"x": 1}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["path"], "/v1/anything", "{reply}");
    // The other loopback address: reached there.
    let (status, reply) = chat(&server, "two", json!({}));
    assert_eq!(status, 200, "{reply}");
    // Model routes outside `/v1`, by the body's model or the query's.
    for (path, sent) in [
        ("/completion", "/completion"),
        ("/infill", "/infill"),
        ("/rerank", "/rerank"),
        ("/v/chat/completions", "/chat/completions"),
        ("/sdapi/v1/txt2img", "/sdapi/v1/txt2img"),
    ] {
        let (status, reply) = server.post(path, json!({"model": "two", "prompt": "hi"}));
        assert_eq!(status, 200, "{path}: {reply}");
        assert_eq!(reply["path"], sent, "{path}: {reply}");
    }
    let (status, reply) = server.get("/props?model=GPT+OSS+20B");
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["path"], "/props?model=GPT+OSS+20B", "{reply}");
    let (status, reply) = server.post("/completion", json!({"prompt": "hi"}));
    assert_eq!(status, 400, "{reply}");
    // `${PORT}` in `cmdStop`: the port of the start it stops.
    let (status, reply) = server.post("/api/models/GPT-OSS-20B/unload", json!({}));
    assert_eq!(status, 200, "{reply}");
    let port = std::fs::read_to_string(&marker).unwrap_or_default();
    let port: u16 = port.trim().parse().unwrap_or_else(|_| panic!("`{port}`"));
    assert!(port > 0);
}

/// llama-swap's `-config-dir`: the folder's files merged in name order, a
/// macro of one serving another's model; what is not YAML ignored.
#[test]
fn a_config_folder_is_merged_as_llama_swap_merges_it() {
    let dir = daemon::temp_dir("llama-swap-dir");
    let folder = dir.join("conf.d");
    std::fs::create_dir_all(&folder).unwrap();
    let fake = fake();
    std::fs::write(
        folder.join("10-base.yaml"),
        format!("macros:\n  srv: {fake} --port ${{PORT}}\nmodels:\n  first:\n    cmd: ${{srv}}\n"),
    )
    .unwrap();
    std::fs::write(
        folder.join("20-more.yml"),
        "models:\n  second:\n    cmd: ${srv} --model /m/second.gguf\n",
    )
    .unwrap();
    std::fs::write(folder.join("README.txt"), "not a config").unwrap();
    let config = dir.join("berth.toml");
    std::fs::write(&config, "").unwrap();
    let stderr = std::fs::File::create(dir.join("stderr.log")).unwrap();
    let args = ["--llama-swap-dir", folder.to_str().unwrap()];
    let mut server = Server::start_custom(&config, Some(&dir), &args, &[], &mut |command| {
        command.stderr(stderr.try_clone().unwrap());
    });
    let (_, list) = server.get("/v1/models");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["first", "second"], "{list}");
    let (status, reply) = chat(&server, "second", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert!(server.terminate(Duration::from_secs(30)).is_some());
    let _ = std::fs::remove_dir_all(&dir);
}
