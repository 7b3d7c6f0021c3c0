//! berth as a drop-in for llama-swap, on llama-swap's own example config
//! (`config.example.yaml` at 0bdb372): its servers replaced by the test's
//! fake server (`tests/python/fake_upstream.py`), its paths and ports by
//! the test's own; every model served, each key berth maps shown to act,
//! what it does not do named at start; and llama-swap's API. The aider
//! example and the rules are in `llama_swap_rules.rs`.

use std::path::Path;
use std::time::Duration;

use berth_tests::llama_swap::{FakePeer, chat, fake, running, said, serve, stream_until};
use berth_tests::*;
use serde_json::json;

/// llama-swap's `config.example.yaml`, key for key; its servers are the
/// fake (the `docker run` one too, its `docker stop` a script that notes
/// the stop), `gpt-oss-120b`'s fixed port one of the test's, and
/// `some-upstream-server` the fake on a port of its own.
/// Its peers are two fake servers: one over HTTP, one (OpenRouter's
/// place) over HTTPS under `/api`, as `https://openrouter.ai/api` is.
fn example_config(dir: &Path, fixed: u16, peer: u16, tls_peer: u16) -> String {
    let fake = fake();
    let stopped = dir.join("stopped").display().to_string();
    format!(
        r#"healthCheckTimeout: 500
logLevel: info
logTimeFormat: ""
logToStdout: "proxy"
metricsMaxInMemory: 1000
captureBuffer: 15
ui:
  activity:
    session_id: ["X-Session-ID", "X-Litellm-Session-Id"]
performance:
  disabled: false
  every: 15s
startPort: 10001
sendLoadingState: true
includeAliasesInList: false
globalTTL: 0
unloadTimeout: 10
macros:
  "latest-llama": >
    {fake} --port ${{PORT}} --health /custom-endpoint
  "default_ctx": 4096
  "default_args": "--ctx-size ${{default_ctx}}"
  "models_dir": "${{env.HOME}}/models"
apiKeys:
  - "sk-hunter2"
  - "sk-gyCPiKUcIfPlaM4OSMZekkprgijPx6+OsmQs8Rsg0xZ9qpy6gKWsIKqHOk+cgXVx"
  - "${{env.API_KEY_1}}"
  - "${{env.API_KEY_2}}"
upstream:
  ignorePaths:
    - '.*\.(js|json|css|png|gif|jpg|jpeg|ico|txt)$'
profiles:
  "coding":
    description: "Coding-focused model routing"
    pins:
      "llm-code": "gpt-oss-120b"
      "llm-plan": "qwen-unlisted"
      "image-gen": ~
selectors:
  "coding-model":
    strategy: warm
    targets:
      - "gpt-oss-120b"
      - "qwen-unlisted"
    name: "Coding Model"
    description: "Best currently loaded coding model"
    metadata:
      purpose: coding
  "llm-plan":
    strategy: pin
    targets:
      - "gpt-oss-120b"
      - "z-ai/glm-4.7"
  "llama":
    strategy: spillover
    targets:
      - "docker-llama"
      - "modelA"
      - "modelB"
    settings:
      spillover: 4
models:
  "gpt-oss-120b":
    macros:
      "default_ctx": 16384
      "temp": 0.7
    cmd: |
      ${{latest-llama}}
      --model path/to/gpt-oss-120B.gguf
      --ctx-size ${{default_ctx}}
      --temperature ${{temp}}
    name: "gpt-oss 120B"
    description: "A thinking model from OpenAI"
    env:
      - "CUDA_VISIBLE_DEVICES=0,1,2"
    proxy: http://127.0.0.1:{fixed}
    checkEndpoint: /custom-endpoint
    ttl: 60
    unloadTimeout: 10
    compat:
      ignoreWebsockets: true
    useModelName: "openai/gpt-oss-120B"
    filters:
      stripParams: "temperature, top_p, top_k"
      setParams:
        temperature: 0.7
        top_p: 0.9
      setParamsByID:
        "${{MODEL_ID}}":
          chat_template_kwargs:
            reasoning_effort: medium
        "${{MODEL_ID}}:high":
          chat_template_kwargs:
            reasoning_effort: high
        "${{MODEL_ID}}:low":
          chat_template_kwargs:
            reasoning_effort: low
    aliases:
      - "gpt-4o-mini"
    metadata:
      port: ${{PORT}}
      temperature: ${{temp}}
      note: "The ${{MODEL_ID}} is running on port ${{PORT}} temp=${{temp}},
        context=${{default_ctx}}"
      a_list:
        - 1
        - 1.23
        - "macros are OK in list and dictionary types: ${{MODEL_ID}}"
      an_obj:
        a: "1"
        b: 2
        c: ["${{temp}}", false, "model: ${{MODEL_ID}}"]
    concurrencyLimit: 0
    sendLoadingState: false
    timeouts:
      connect: 30
      keepalive: 0
      responseHeader: 60
      tlsHandshake: 10
      idleConn: 90
    capabilities:
      in:
        - text
        - audio
        - image
      out:
        - text
        - audio
        - image
      tools: true
      reranker: false
      context: 32000
  "unlisted-model":
    unlisted: true
    cmd: {fake} --port 0
  "docker-llama":
    proxy: "http://127.0.0.1:${{PORT}}"
    cmd: |
      {fake} --port ${{PORT}}
      --model '/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf'
    cmdStop: sh -c 'echo ${{MODEL_ID}} >> {stopped}; kill ${{PID}}'
hooks:
  on_startup:
    preload:
      - "llama"
routing:
  router:
    use: group
    settings:
      groups:
        "group1":
          swap: true
          exclusive: true
          members:
            - "llama"
            - "qwen-unlisted"
        "group2":
          swap: false
          exclusive: false
          members:
            - "docker-llama"
            - "modelA"
            - "modelB"
        "forever":
          persistent: true
          swap: false
          exclusive: false
          members:
            - "forever-modelA"
            - "forever-modelB"
            - "forever-modelc"
      matrix:
        vars:
          g: gemma-model
          q: qwen-model
        evict_costs:
          g: 50
        sets:
          standard: "g & q"
  scheduler:
    use: fifo
    settings:
      fifo:
        priority:
          A: 10
peers:
  llama-swap-peer:
    proxy: http://127.0.0.1:{peer}
    models:
      - model_a
  openrouter:
    proxy: https://localhost:{tls_peer}/api
    apiKey: ${{env.OPENROUTER_API_KEY}}
    models:
      - z-ai/glm-4.7
"#
    )
}

/// Must hold: on llama-swap's own example config, no model is left out
/// and everything berth does not do is named at start; and each key it
/// maps acts.
#[test]
fn llama_swaps_example_config_serves_every_model_and_each_key_acts() {
    let dir = daemon::temp_dir("llama-swap-example");
    let fixed = free_port();
    let home = dir.display().to_string();
    let (peer, tls_peer) = (FakePeer::http(&dir), FakePeer::https(&dir));
    let trusted = dir.join("peer-cert.pem").display().to_string();
    let mut server = serve(
        &dir,
        &example_config(&dir, fixed, peer.port, tls_peer.port),
        &[
            ("HOME", home.as_str()),
            ("API_KEY_1", "key-one"),
            ("API_KEY_2", "key-two"),
            ("OPENROUTER_API_KEY", "or-key"),
            ("SSL_CERT_FILE", trusted.as_str()),
        ],
    );
    let notes = said(&dir);
    for id in ["gpt-oss-120b", "unlisted-model", "docker-llama"] {
        assert!(
            !notes.contains(&format!("model `{id}` left out")),
            "{notes}"
        );
    }
    for key in [
        "`peers` not honoured",
        "`upstream` not honoured",
        "selectors.llm-plan.targets[1] references unknown model",
    ] {
        assert!(!notes.contains(key), "`{key}` said:\n{notes}");
    }
    for key in [
        "`startPort` not honoured",
        "`logLevel` not honoured",
        "`logToStdout` not honoured",
        "`logTimeFormat` not honoured",
        "`metricsMaxInMemory` not honoured",
        "`captureBuffer` not honoured",
        "`ui` not honoured",
        "`performance` not honoured",
        "`timeouts` not honoured",
        "`compat` not honoured",
        "routing.scheduler.settings.fifo.priority references unknown model \"A\"",
        "`routing.router.settings.matrix` not used",
        "profiles.coding.pins.llm-plan references unknown model",
        "`hooks.on_startup.preload` names `llama`",
        "group `group1` names `llama`",
        "models in no group (gpt-oss-120b, unlisted-model) run one at a time",
    ] {
        assert!(notes.contains(key), "`{key}` not said:\n{notes}");
    }

    // apiKeys: none, a wrong one: refused; each of the file's, in any of
    // llama-swap's headers: accepted. /health needs none.
    assert_eq!(server.get("/v1/models").0, 401);
    assert_eq!(server.raw("GET", "/health", &[], None).text(), "OK");
    for (header, value) in [
        ("x-api-key", "sk-hunter2".to_string()),
        ("authorization", "Bearer key-one".to_string()),
        ("authorization", "Bearer key-two".to_string()),
        ("x-api-key", "wrong".to_string()),
    ] {
        let status = server
            .raw("GET", "/v1/models", &[(header, &value)], None)
            .status;
        assert_eq!(
            status,
            if value == "wrong" { 401 } else { 200 },
            "{header}: {value}"
        );
    }
    server.token = Some("sk-hunter2".into());

    // /v1/models: listed as llama-swap lists them.
    let (_, list) = server.get("/v1/models");
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        [
            "coding-model",
            "docker-llama",
            "gpt-oss-120b",
            "llama",
            "llama-swap-peer/model_a",
            "llm-plan",
            "openrouter/z-ai/glm-4.7"
        ],
        "{list}"
    );
    let gpt = &list["data"][2];
    assert_eq!(gpt["name"], "gpt-oss 120B");
    assert_eq!(gpt["description"], "A thinking model from OpenAI");
    assert_eq!(gpt["capabilities"]["function_calling"], true, "{gpt}");
    assert_eq!(gpt["context_length"], 32000);
    assert_eq!(gpt["meta"]["llamaswap"]["port"], fixed, "{gpt}");
    assert!(
        gpt["meta"]["llamaswap"]["note"]
            .as_str()
            .unwrap()
            .starts_with(&format!(
                "The gpt-oss-120b is running on port {fixed} temp=0.7"
            )),
        "{gpt}"
    );
    assert_eq!(gpt["status"]["value"], "unloaded");
    assert_eq!(list["data"][0]["meta"]["llamaswap"]["strategy"], "warm");
    assert_eq!(list["data"][6]["name"], "openrouter: z-ai/glm-4.7");
    assert_eq!(list["data"][6]["meta"]["llamaswap"]["type"], "peer");
    assert_eq!(list["data"][6]["meta"]["llamaswap"]["peerID"], "openrouter");

    // The peers: relayed (over TLS to the one whose certificate berth
    // trusts by SSL_CERT_FILE), the model renamed to the peer's own, its
    // key sent in both headers and berth's token never.
    let (status, reply) = chat(&server, "openrouter/z-ai/glm-4.7", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["path"], "/api/v1/chat/completions", "{reply}");
    assert_eq!(reply["received"]["model"], "z-ai/glm-4.7", "{reply}");
    assert_eq!(
        reply["headers"]["authorization"], "Bearer or-key",
        "{reply}"
    );
    assert_eq!(reply["headers"]["x-api-key"], "or-key", "{reply}");
    assert_eq!(
        reply["headers"]["host"],
        format!("localhost:{}", tls_peer.port),
        "{reply}"
    );
    // A bare name only one peer lists reaches it; no key: none sent.
    let streamed = server.raw(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(br#"{"model":"model_a","stream":true,"messages":[]}"#),
    );
    assert_eq!(streamed.status, 200);
    assert!(streamed.text().contains("tok4 "), "{}", streamed.text());
    let reply = server.raw(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(br#"{"model":"llama-swap-peer/model_a","messages":[]}"#),
    );
    let answer = reply.json();
    assert_eq!(answer["received"]["model"], "model_a", "{answer}");
    assert!(answer["headers"].get("authorization").is_none(), "{answer}");
    assert!(answer["headers"].get("x-api-key").is_none(), "{answer}");
    // The selector's second target is the peer's model now.
    let (_, list) = server.get("/v1/models");
    let plan = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "llm-plan")
        .unwrap();
    assert_eq!(plan["meta"]["llamaswap"]["targets"][1], "z-ai/glm-4.7");
    // ps says what they are, and never the key.
    let (_, ps) = server.get("/api/ps");
    assert_eq!(ps["peers"][1]["peer"], "openrouter", "{ps}");
    assert_eq!(ps["peers"][1]["api_key"], true, "{ps}");
    assert!(!ps.to_string().contains("or-key"), "{ps}");
    // /upstream reaches a peer's own routes too.
    let page = server.raw("GET", "/upstream/llama-swap-peer/model_a/health", &[], None);
    assert_eq!(page.status, 200, "{}", page.text());
    // A peer that cannot be reached: 502, saying which and where.
    drop(peer);
    let (status, reply) = chat(&server, "model_a", json!({}));
    assert_eq!(
        (status, reply["error"]["code"].as_str()),
        (502, Some("upstream_unreachable")),
        "{reply}"
    );
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("peer `llama-swap-peer` (model `model_a`)"),
        "{reply}"
    );

    // In flight: listed, and cancelled where it is.
    let waiting = {
        let url = format!("http://127.0.0.1:{}/v1/completions", server.port());
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let answer = ureq::post(&url)
                .header("x-api-key", "sk-hunter2")
                .config()
                .http_status_as_error(false)
                .build()
                .send_json(json!({"model": "openrouter/z-ai/glm-4.7", "delay_ms": 20000}))
                .unwrap();
            (answer.status().as_u16(), started.elapsed())
        })
    };
    let id = loop {
        let (_, list) = server.get("/api/inflight");
        if let Some(r) = list["requests"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["req_path"] == "/v1/completions")
        {
            assert_eq!(r["model"], "openrouter/z-ai/glm-4.7", "{list}");
            break r["id"].as_str().unwrap().to_string();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let (status, reply) = server.post(&format!("/api/inflight/{id}/cancel"), json!({}));
    assert_eq!(
        (status, reply["msg"].as_str()),
        (200, Some("ok")),
        "{reply}"
    );
    let (status, took) = waiting.join().unwrap();
    assert_eq!(status, 408);
    assert!(took < Duration::from_secs(15), "{took:?}");
    assert_eq!(
        server
            .post(&format!("/api/inflight/{id}/cancel"), json!({}))
            .0,
        404
    );

    // The fixed-port server, its filters and its useModelName.
    let (status, reply) = chat(
        &server,
        "gpt-oss-120b:high",
        json!({"temperature": 0.1, "top_k": 5}),
    );
    assert_eq!(status, 200, "{reply}");
    let received = &reply["received"];
    assert_eq!(received["model"], "openai/gpt-oss-120B", "{received}");
    assert_eq!(received["temperature"], 0.7, "{received}");
    assert_eq!(received["top_p"], 0.9, "{received}");
    assert!(received.get("top_k").is_none(), "{received}");
    assert_eq!(received["chat_template_kwargs"]["reasoning_effort"], "high");
    let (_, plain) = chat(&server, "gpt-4o-mini", json!({}));
    assert!(
        plain["received"].get("chat_template_kwargs").is_none(),
        "{plain}"
    );
    let (_, run) = server.get("/running");
    assert_eq!(run["running"][0]["model"], "gpt-oss-120b", "{run}");
    assert_eq!(run["running"][0]["state"], "ready");
    assert_eq!(
        run["running"][0]["proxy"],
        format!("http://127.0.0.1:{fixed}")
    );
    assert_eq!(run["running"][0]["ttl"], 60);

    // sendLoadingState (the file's, docker-llama's too): the streamed
    // answer says it loads, then carries the server's stream. group2 is
    // not exclusive: gpt-oss-120b stays.
    let reply = server.raw(
        "POST",
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        Some(br#"{"model":"docker-llama","stream":true,"messages":[{"role":"user","content":"hi"}]}"#),
    );
    let text = reply.text();
    assert_eq!(reply.status, 200, "{text}");
    let loading = text
        .find("llama-swap loading model: docker-llama")
        .expect(&text);
    let done = text.find("Done! (").expect(&text);
    let answer = text.find("tok0 ").expect(&text);
    assert!(loading < done && done < answer, "{text}");
    assert_eq!(running(&server), ["docker-llama", "gpt-oss-120b"]);

    // The active profile's pins, then a selector.
    let (status, active) = server.put("/api/profiles/active", json!({"name": "coding"}));
    assert_eq!(
        (status, active["active"].as_str()),
        (200, Some("coding")),
        "{active}"
    );
    let (status, reply) = chat(&server, "llm-code", json!({}));
    assert_eq!(
        (status, reply["received"]["model"].as_str()),
        (200, Some("openai/gpt-oss-120B")),
        "{reply}"
    );
    assert_eq!(chat(&server, "image-gen", json!({})).0, 404);
    let (status, reply) = chat(&server, "coding-model", json!({}));
    assert_eq!(
        (status, reply["received"]["model"].as_str()),
        (200, Some("openai/gpt-oss-120B")),
        "{reply}"
    );
    assert_eq!(
        server
            .put("/api/profiles/active", json!({"name": "nope"}))
            .0,
        404
    );
    // The pins apply to /upstream too: the server's own health route.
    let page = server.raw("GET", "/upstream/llm-code/custom-endpoint", &[], None);
    assert_eq!(page.status, 200, "{}", page.text());

    // A model's own output, from its history on.
    let seen = stream_until(
        &server,
        "/logs/stream/gpt-oss-120b",
        "fake_upstream: listening",
    );
    assert!(seen.contains("fake_upstream: listening"), "{seen}");

    // upstream.ignorePaths: a browser's favicon loads no model.
    let icon = server.raw("GET", "/upstream/unlisted-model/favicon.ico", &[], None);
    assert_eq!(icon.status, 409, "{}", icon.text());
    assert!(icon.text().contains("path matches upstream.ignorePaths"));

    // The default group is exclusive: the unlisted model (a server on a
    // port of its own, found) stops both; docker-llama by its cmdStop.
    let (status, reply) = chat(&server, "unlisted-model", json!({}));
    assert_eq!(status, 200, "{reply}");
    assert_eq!(running(&server), ["unlisted-model"]);
    let stopped = std::fs::read_to_string(dir.join("stopped")).unwrap_or_default();
    assert_eq!(stopped.trim(), "docker-llama", "its cmdStop ran");

    // /upstream: the server's own routes, for the operator.
    let page = server.raw("GET", "/upstream/unlisted-model/health", &[], None);
    assert_eq!(
        (page.status, page.json()["status"].as_str()),
        (200, Some("ok")),
        "{}",
        page.text()
    );
    // Its root is `/upstream/NAME/`, as llama-swap redirects.
    let port = server.port();
    let (status, reply) = raw_http(
        port,
        &format!(
            "GET /upstream/unlisted-model?x=1 HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
             x-api-key: sk-hunter2\r\nConnection: close\r\n\r\n"
        ),
    );
    assert_eq!(status, 301, "{reply}");
    assert!(
        reply
            .to_ascii_lowercase()
            .contains("location: /upstream/unlisted-model/?x=1"),
        "{reply}"
    );
    assert_eq!(
        server.raw("GET", "/upstream/nope/health", &[], None).status,
        404
    );

    // Unload one, then all.
    let one = server.raw(
        "POST",
        "/api/models/unload/unlisted-model",
        &[("content-type", "application/json")],
        None,
    );
    assert_eq!((one.status, one.text().as_str()), (200, "OK"));
    assert!(running(&server).is_empty());
    chat(&server, "gpt-oss-120b", json!({}));
    assert_eq!(server.raw("GET", "/unload", &[], None).text(), "OK");
    assert!(running(&server).is_empty());
    assert!(server.terminate(Duration::from_secs(30)).is_some());
    let _ = std::fs::remove_dir_all(&dir);
}
