//! The reader's unit tests; the API and the rules acting are in
//! tests/tests/llama_swap.rs.

use std::time::Duration;

use super::text::split_command;
use super::*;

const CONFIG: &str = r#"
healthCheckTimeout: 60
startPort: 10001
logLevel: debug
macros:
  "server": /opt/llama/llama-server
  "ctx": 4096
groups:
  small:
    members: ["tiny"]
models:
  "tiny":
    # the small one
    cmd: |
      ${server} --port ${PORT}
      # a comment line
      -m "/models/tiny model.gguf" \
      --ctx-size ${ctx} --alias ${MODEL_ID}
    env:
      - "CUDA_VISIBLE_DEVICES=0"
    aliases: ["gpt-4o-mini"]
    checkEndpoint: /health
    ttl: 60
    useModelName: "tiny-upstream"
    cmdStop: "kill ${PID}"
  "qwen:7b":
    cmd: ${server} --port ${PORT} -m /m/q.gguf
    checkEndpoint: none
    concurrencyLimit: 2
  "fixed":
    cmd: /opt/server --port 9000
    proxy: http://127.0.0.1:9000
"#;

#[test]
fn a_llama_swap_config_becomes_berth_models_and_says_what_it_ignores() {
    let out = migrate(CONFIG, &|_| None).unwrap();
    assert_eq!(out.models.len(), 3, "{:?}", out.notes);
    let tiny = out.models.iter().find(|m| m.name == "tiny").unwrap();
    assert_eq!(tiny.keep_alive, Some(Duration::from_secs(60)));
    assert_eq!(tiny.load_timeout, Some(Duration::from_secs(60)));
    assert_eq!(tiny.aliases, ["gpt-4o-mini"]);
    let kind = &out.workers[tiny.worker.as_ref().unwrap()];
    assert_eq!(
        kind.command.as_deref().unwrap(),
        [
            "/opt/llama/llama-server",
            "--port",
            "{port}",
            "-m",
            "/models/tiny model.gguf",
            "--ctx-size",
            "4096",
            "--alias",
            "tiny"
        ]
    );
    assert_eq!(kind.env["CUDA_VISIBLE_DEVICES"], "0");
    let http = kind.http.as_ref().unwrap();
    assert_eq!(http.health, "/health");
    assert_eq!(http.model.as_deref(), Some("tiny-upstream"));
    let qwen = out.models.iter().find(|m| m.name == "qwen-7b").unwrap();
    assert_eq!(qwen.aliases, ["qwen:7b"], "its ID stays reachable");
    assert_eq!(qwen.max_concurrency, Some(2));
    assert_eq!(
        out.workers[qwen.worker.as_ref().unwrap()]
            .http
            .as_ref()
            .unwrap()
            .health,
        "none"
    );
    // The fixed-port server: its port, its stop command.
    let fixed = &out.workers["llama-swap-fixed"];
    let http = fixed.http.as_ref().unwrap();
    assert_eq!(http.port, Some(9000));
    assert_eq!(
        fixed.command.as_deref().unwrap(),
        ["/opt/server", "--port", "9000"]
    );
    let tiny_http = out.workers["llama-swap-tiny"].http.as_ref().unwrap();
    assert_eq!(
        tiny_http.stop_command.as_deref().unwrap(),
        ["kill", "{pid}"]
    );
    // `groups`: tiny's group; the others alone, one at a time.
    assert_eq!(out.residency.groups["small"].members, ["tiny"]);
    assert_eq!(
        out.residency.groups[routing::DEFAULT_GROUP].members,
        ["qwen-7b", "fixed"]
    );
    let notes = out.notes.join("\n");
    for said in [
        "`startPort` not honoured",
        "`logLevel` not honoured",
        "models in no group (qwen-7b, fixed) run one at a time",
    ] {
        assert!(notes.contains(said), "`{said}` not in:\n{notes}");
    }
    assert!(!notes.contains("left out"), "{notes}");
}

#[test]
fn env_variables_are_expanded_and_missing_ones_refused() {
    let text = "models:\n  m:\n    cmd: ${env.SERVER} --port ${PORT}\n";
    let out = migrate(text, &|k| (k == "SERVER").then(|| "/bin/srv".into())).unwrap();
    let kind = out.workers.values().next().unwrap();
    assert_eq!(kind.command.as_ref().unwrap()[0], "/bin/srv");
    let err = migrate(text, &|_| None).unwrap_err();
    assert!(err.contains("SERVER is not set"), "{err}");
}

#[test]
fn merge_keys_and_anchors_are_applied() {
    let text = "defs:\n  base: &base\n    ttl: 5\n    checkEndpoint: /ready\nmodels:\n  m:\n    <<: *base\n    cmd: srv --port ${PORT}\n";
    let out = migrate(text, &|_| None).unwrap();
    assert_eq!(out.models[0].keep_alive, Some(Duration::from_secs(5)));
    let kind = out.workers.values().next().unwrap();
    assert_eq!(kind.http.as_ref().unwrap().health, "/ready");
}

/// A 1 KB file whose macros double at each step asked for 1.6 GB at
/// once; YAML nested 100,000 deep gave no answer in 6 s. Both are
/// refused at once, naming what.
#[test]
fn macros_that_double_and_deep_nesting_are_refused_fast() {
    let mut text = String::from("macros:\n  a0: \"xxxxxxxx\"\n");
    for i in 1..=40 {
        text.push_str(&format!("  a{i}: \"${{a{}}}${{a{}}}\"\n", i - 1, i - 1));
    }
    text.push_str("models:\n  m:\n    cmd: srv --port ${PORT} ${a40}\n");
    let started = std::time::Instant::now();
    let out = migrate(&text, &|_| None).unwrap();
    let notes = out.notes.join("\n");
    assert!(out.models.is_empty());
    assert!(
        notes.contains("model `m` left out") && notes.contains("expands to more than"),
        "{notes}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(1));

    let deep = format!("models: {}{}", "[".repeat(100_000), "]".repeat(100_000));
    let started = std::time::Instant::now();
    let err = migrate(&deep, &|_| None).unwrap_err();
    assert!(err.contains("nest more than 32"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_millis(100));
    let indented: String = (0..400)
        .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
        .collect();
    assert!(
        migrate(&indented, &|_| None)
            .unwrap_err()
            .contains("indented")
    );
    // Brackets inside quotes and comments are not nesting.
    let quoted = format!(
        "# {}\nmodels:\n  m:\n    cmd: \"srv --port ${{PORT}} --x '{}'\"\n",
        "[".repeat(50),
        "{".repeat(50)
    );
    assert_eq!(migrate(&quoted, &|_| None).unwrap().models.len(), 1);
}

/// A `${env.X}` whose value holds quotes is the value, wherever it is
/// used; a whole-value one keeps YAML's type.
#[test]
fn env_values_with_quotes_reach_the_command_as_they_are() {
    let text = "models:\n  m:\n    cmd: |\n      srv --port ${PORT} --name '${env.NAME}'\n    ttl: ${env.TTL}\n";
    let env = |k: &str| match k {
        "NAME" => Some(r#"a "quoted" b\c"#.to_string()),
        "TTL" => Some("30".to_string()),
        _ => None,
    };
    let out = migrate(text, &env).unwrap();
    let kind = out.workers.values().next().unwrap();
    assert_eq!(
        kind.command.as_ref().unwrap().last().unwrap(),
        r#"a "quoted" b\c"#
    );
    assert_eq!(out.models[0].keep_alive, Some(Duration::from_secs(30)));
}

/// One rule for a model that cannot be served: left out, saying why,
/// the rest served. Two IDs that make one berth name are named as both
/// being in this file.
#[test]
fn a_bad_entry_is_left_out_and_the_rest_served() {
    let text = "models:\n  \"\":\n    cmd: srv --port ${PORT}\n  \"a:b\":\n    cmd: srv --port ${PORT}\n  \"a/b\":\n    cmd: srv --port ${PORT}\n  7:\n    cmd: srv --port ${PORT}\n  ok:\n    cmd: srv --port ${PORT}\n";
    let out = migrate(text, &|_| None).unwrap();
    let names: Vec<&str> = out.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["a-b", "ok"], "{:?}", out.notes);
    let notes = out.notes.join("\n");
    assert!(notes.contains("model `` left out"), "{notes}");
    assert!(
        notes.contains(
            "model `a/b` left out: its berth name `a-b` is already model `a:b`'s in this file"
        ),
        "{notes}"
    );
    assert!(notes.contains("not a string (7) left out"), "{notes}");
}

#[test]
fn commands_split_as_a_shell_would() {
    assert_eq!(
        split_command(r#"a 'b c' "d \"e\"" f\ g"#).unwrap(),
        ["a", "b c", "d \"e\"", "f g"]
    );
    assert!(split_command("a 'b").is_err());
}

/// The few lines of each cause that left one model in five out of the
/// configs people published: every model is registered.
#[test]
fn the_configs_people_wrote_register_every_model() {
    // 1. A model's macro overrides the file's in place: the file macro that
    //    uses it sees the model's value.
    let text = "macros: {ctx: 4096, base: \"llama-server --port ${PORT} --ctx-size ${ctx}\"}\nmodels: {m: {macros: {ctx: 8192}, cmd: \"${base} -m /models/m.gguf\"}}\n";
    let out = migrate(text, &|_| None).unwrap();
    assert_eq!(out.models.len(), 1, "{:?}", out.notes);
    assert_eq!(
        out.workers["llama-swap-m"].command.as_deref().unwrap(),
        [
            "llama-server",
            "--port",
            "{port}",
            "--ctx-size",
            "8192",
            "-m",
            "/models/m.gguf"
        ]
    );
    // 2. `${PORT}` in `cmdStop`: the running server's port at its stop.
    let text = "models:\n  m:\n    cmd: docker run --name m-${PORT} -p ${PORT}:8080 img\n    cmdStop: docker stop m-${PORT}\n";
    let out = migrate(text, &|_| None).unwrap();
    assert_eq!(out.models.len(), 1, "{:?}", out.notes);
    let http = out.workers["llama-swap-m"].http.as_ref().unwrap();
    assert_eq!(
        http.stop_command.as_deref().unwrap(),
        ["docker", "stop", "m-{port}"]
    );
    // 3. An ID with spaces: renamed, and its ID stays an alias.
    let text = "models:\n  \"GPT-OSS 20B Vulkan\":\n    cmd: srv --port ${PORT}\n";
    let out = migrate(text, &|_| None).unwrap();
    assert_eq!(out.models.len(), 1, "{:?}", out.notes);
    assert_eq!(out.models[0].name, "GPT-OSS-20B-Vulkan");
    assert_eq!(out.models[0].aliases, ["GPT-OSS 20B Vulkan"]);
    out.models[0].validate().unwrap();
    // 4. A proxy on another loopback address, IPv6's, or `localhost`.
    for (proxy, host) in [
        ("http://127.0.0.2:${PORT}", Some("127.0.0.2")),
        ("http://[::1]:${PORT}", Some("[::1]")),
        ("http://localhost:${PORT}", None),
        ("http://127.0.0.1:${PORT}", None),
    ] {
        let text =
            format!("models:\n  m:\n    cmd: srv --host x --port ${{PORT}}\n    proxy: {proxy}\n");
        let out = migrate(&text, &|_| None).unwrap();
        assert_eq!(out.models.len(), 1, "{proxy}: {:?}", out.notes);
        let http = out.workers["llama-swap-m"].http.as_ref().unwrap();
        assert_eq!(http.host.as_deref(), host, "{proxy}");
        assert!(!out.notes.join("\n").contains("reached at"), "{proxy}");
    }
    // 5. A compose service: its command runs here, its server is reached
    //    by the service's name, and what berth cannot prove is said.
    let text = "models:\n  qwen:\n    cmd: docker compose up ${MODEL_ID}\n    cmdStop: docker compose stop ${MODEL_ID}\n    proxy: http://${MODEL_ID}:8080\n";
    let out = migrate(text, &|_| None).unwrap();
    assert_eq!(out.models.len(), 1, "{:?}", out.notes);
    let http = out.workers["llama-swap-qwen"].http.as_ref().unwrap();
    assert_eq!(
        (http.host.as_deref(), http.port),
        (Some("qwen"), Some(8080))
    );
    let notes = out.notes.join("\n");
    assert!(notes.contains("reached at `qwen`"), "{notes}");
    assert!(notes.contains("outside berth's cgroup"), "{notes}");
    // 6. A group's unknown key is named; a `setParamsByID` key expanded with
    //    every macro becomes an alias.
    let text = "macros: {family: qwen}\ngroups:\n  main:\n    ttl: 60\n    members: [m]\nmodels:\n  m:\n    cmd: srv --port ${PORT}\n    filters:\n      setParamsByID:\n        \"${family}-thinking\": {think: true}\n";
    let out = migrate(text, &|_| None).unwrap();
    assert_eq!(out.models.len(), 1, "{:?}", out.notes);
    assert_eq!(out.models[0].aliases, ["qwen-thinking"]);
    let notes = out.notes.join("\n");
    assert!(
        notes.contains("group `main`: unknown key `ttl` ignored"),
        "{notes}"
    );
    assert!(!notes.contains("left out"), "{notes}");
}

fn read(text: &str) -> Result<Migrated, String> {
    migrate(text, &|name| (name == "KEY").then(|| "sk-peer".to_string()))
}

const PEERS: &str = r#"
macros: {host: "10.0.0.9"}
models:
  local:
    cmd: /opt/server --port ${PORT}
    aliases: [alias-a]
peers:
  box:
    proxy: http://${host}:8080
    models: [model_a, shared, model_a]
    filters:
      stripParams: "top_k"
      setParamsByID:
        "box/model_a": {temperature: 0.2}
    timeouts: {connect: 5, responseHeader: 0, idleConn: 90}
  openrouter:
    proxy: https://openrouter.ai/api
    apiKey: ${env.KEY}
    models: [z-ai/glm-4.7, shared, local]
"#;

#[test]
fn peers_are_read_as_llama_swap_reads_them() {
    let out = read(PEERS).unwrap();
    let peers = &out.compat.peers;
    assert_eq!(peers.list.len(), 2);
    let (box_, or) = (&peers.list[0], &peers.list[1]);
    assert_eq!(
        box_.url.to_string(),
        "http://10.0.0.9:8080",
        "global macros apply"
    );
    assert_eq!(
        box_.models,
        ["model_a", "shared"],
        "a duplicate listed once"
    );
    assert_eq!(box_.connect_timeout, Duration::from_secs(5));
    assert_eq!(box_.header_timeout, None, "0: no limit");
    assert_eq!(box_.filters.strip, ["top_k"]);
    assert!(box_.filters.by_id.contains_key("box/model_a"));
    assert_eq!(or.api_key.as_deref(), Some("sk-peer"));
    assert_eq!(or.header_timeout, Some(Duration::from_secs(60)));
    assert!(
        out.notes
            .iter()
            .any(|n| n.contains("peers.box.timeouts.idleConn not honoured")),
        "{:?}",
        out.notes
    );
    // Two peers list `shared`: only by its FQN; a peer's `local` loses to
    // the model here (the front door asks the model first).
    assert!(peers.resolve("shared").is_none());
    assert_eq!(peers.resolve("openrouter/shared").unwrap().model, "shared");
    assert_eq!(peers.resolve("z-ai/glm-4.7").unwrap().peer, 1);
}

#[test]
fn a_peer_without_proxy_or_models_or_with_a_clashing_name_is_refused() {
    let cases = [
        ("peers: {p: {models: [m]}}", "peers.p: proxy is required"),
        (
            "peers: {p: {proxy: 'http://h', models: []}}",
            "peers.p: peer models can not be empty",
        ),
        ("peers: {p: {proxy: 'h:80', models: [m]}}", "has no scheme"),
        (
            "models: {p/m: {cmd: '/s --port ${PORT}'}}\npeers: {p: {proxy: 'http://h', models: [m]}}",
            "model ID \"p/m\" conflicts with fully qualified peer model name \"p/m\"",
        ),
        (
            "models: {x: {cmd: '/s --port ${PORT}', aliases: [p/m]}}\npeers: {p: {proxy: 'http://h', models: [m]}}",
            "model x alias \"p/m\" conflicts with fully qualified peer model name",
        ),
        (
            "peers: {p: {proxy: 'http://h', models: [a/b]}, p/a: {proxy: 'http://i', models: [b]}}",
            "is ambiguous between peers.p model \"a/b\" and peers.p/a model \"b\"",
        ),
    ];
    for (yaml, why) in cases {
        let text = if yaml.contains("models:") && !yaml.starts_with("models") {
            format!("models: {{}}\n{yaml}")
        } else {
            yaml.to_string()
        };
        let err = read(&text)
            .err()
            .unwrap_or_else(|| panic!("{yaml}: accepted"));
        assert!(err.contains(why), "{yaml}: {err}");
    }
}

#[test]
fn upstream_ignore_paths_default_to_llama_swaps_and_a_bad_one_is_named() {
    let base = "models: {m: {cmd: '/s --port ${PORT}'}}\n";
    let out = read(base).unwrap();
    assert_eq!(out.compat.ignore_paths.len(), 1);
    assert!(out.compat.ignore_paths[0].is_match("/favicon.ico"));
    assert!(!out.compat.ignore_paths[0].is_match("/v1/models"));
    let out = read(&format!("{base}upstream: {{ignorePaths: ['^/ui/']}}")).unwrap();
    assert!(out.compat.ignore_paths[0].is_match("/ui/app.js"));
    assert!(!out.compat.ignore_paths[0].is_match("/favicon.ico"));
    let err = read(&format!("{base}upstream: {{ignorePaths: ['(']}}"))
        .err()
        .unwrap();
    assert!(
        err.starts_with("upstream.ignorePaths: invalid regular expression \"(\""),
        "{err}"
    );
}

#[test]
fn files_merged_share_their_macros() {
    let files = [
        (
            "a.yaml".to_string(),
            "macros: {srv: /opt/server}\nmodels: {a: {cmd: '${srv} --port ${PORT}'}}".to_string(),
        ),
        (
            "b.yaml".to_string(),
            "models: {b: {cmd: '${srv} --port ${PORT} -m b'}}".to_string(),
        ),
    ];
    let out = migrate_all(&files, &|_| None).unwrap();
    let names: Vec<&str> = out.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(
        out.workers["llama-swap-b"].command.as_ref().unwrap()[0],
        "/opt/server"
    );
}

#[test]
fn an_alias_two_models_claim_is_refused_in_llama_swaps_words() {
    let text = "models:\n  a: {cmd: '/s --port ${PORT}', aliases: [agent]}\n  b: {cmd: '/s --port ${PORT}', aliases: [agent]}\n";
    let err = read(text).err().unwrap();
    assert!(
        err.starts_with("duplicate alias agent found in model: b (model `a` has it already"),
        "{err}"
    );
}
