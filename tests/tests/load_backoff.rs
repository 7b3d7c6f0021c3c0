//! A model whose load always fails is not started again by every request:
//! a failed load counts as a crash, requests wait out the backoff (503 with
//! the last error, when the next attempt is, and `Retry-After`), past
//! `max_restarts` within `restart_window` the model is failed until it is
//! loaded by hand, and a load by hand tries at once.

use std::time::{Duration, Instant};

use berth_tests::*;
use serde_json::{Value, json};

const CONFIG: &str = r#"
test_backends = true
restart_backoff = "1s"

[[model]]
name = "crashes"
backend = "fault"
options = { mode = "crash-on-load" }
max_restarts = 2

[[model]]
name = "raises"
backend = "fault"
options = { fail_load_with = "ValueError: the weights are corrupt" }
max_restarts = 2
"#;

/// Hammers `model` with `clients` threads for `seconds`; every answer's
/// status and body.
fn hammer(server: &Server, model: &str, clients: usize, seconds: u64) -> Vec<(u16, Value, bool)> {
    let until = Instant::now() + Duration::from_secs(seconds);
    let threads: Vec<_> = (0..clients)
        .map(|_| {
            let url = format!("{}/api/models/{model}/infer", server.url);
            std::thread::spawn(move || {
                let agent: ureq::Agent = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .build()
                    .into();
                let mut answers = Vec::new();
                while Instant::now() < until {
                    let mut reply = agent.post(&url).send_json(json!({ "x": 1 })).unwrap();
                    let retry = reply.headers().get("retry-after").is_some();
                    let body: Value = reply.body_mut().read_json().unwrap_or(Value::Null);
                    answers.push((reply.status().as_u16(), body, retry));
                }
                answers
            })
        })
        .collect();
    threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect()
}

fn starts(server: &Server, model: &str) -> usize {
    server
        .events()
        .iter()
        .filter(|e| e["type"] == "loading" && e["model"] == model)
        .count()
}

#[test]
fn a_load_that_always_fails_costs_one_start_per_backoff_step() {
    let server = Server::start(CONFIG);
    for model in ["crashes", "raises"] {
        // Starts at 0, ~1 s and ~3 s (backoff 1 s, then 2 s); the third
        // failure is past max_restarts (2): failed until loaded by hand.
        let answers = hammer(&server, model, 8, 5);
        assert_eq!(starts(&server, model), 3, "{model}: {:?}", server.events());
        let backoff: Vec<&(u16, Value, bool)> = answers
            .iter()
            .filter(|(_, b, _)| b["error"]["code"] == "load_backoff")
            .collect();
        assert!(!backoff.is_empty(), "{model}: {answers:?}");
        for (status, body, retry_after) in &backoff {
            assert_eq!(*status, 503, "{body}");
            assert!(*retry_after, "{body}");
            let message = body["error"]["message"].as_str().unwrap();
            assert!(
                message.contains(&format!("model `{model}` failed to load"))
                    && message.contains("requests start the next attempt in"),
                "{message}"
            );
        }
        assert!(
            answers.iter().all(|(s, _, _)| *s >= 500),
            "nothing served: {answers:?}"
        );
        let (status, body) = server.post(&format!("/api/models/{model}/infer"), json!({}));
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["code"], "model_failed", "{body}");
        assert!(
            server
                .events()
                .iter()
                .any(|e| e["type"] == "failed" && e["model"] == model)
        );
        // A load by hand tries at once, whatever the backoff.
        let before = starts(&server, model);
        let (status, _) = server.post(&format!("/api/models/{model}/load"), json!({}));
        assert!(status >= 500);
        assert_eq!(starts(&server, model), before + 1);
    }
    let (status, body) = server.post("/api/models/raises/load", json!({}));
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("ValueError: the weights are corrupt"),
        "{status} {body}"
    );
}
