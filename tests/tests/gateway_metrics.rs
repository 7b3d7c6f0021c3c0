//! The gauges an inference gateway's endpoint picker reads from `/metrics`
//! (the Gateway API Inference Extension's Model Server Protocol, under
//! berth's names), read through Prometheus's own text parser (its Python
//! client's, `tests/python/metrics_text.py`) as berth loads a model, takes
//! a burst of requests, loads another with requests waiting for it, and
//! unloads one. `public_metrics` lets the scrape through without the token.

use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use berth_tests::python::{deploy_python, repo_root};
use berth_tests::*;
use serde_json::{Value, json};

const TOKEN: &str = "gateway-test-token";
const BUDGET: f64 = (1u64 << 30) as f64;

/// Two models, neither loaded: `hog` holds 128 MiB and takes 2.5 s a
/// request, one at a time; `slow` takes 4 s to load. (Long enough for a
/// few scrapes of each state on a busy machine: each starts the parser.)
const CONFIG: &str = "memory_budget = \"1GiB\"\npublic_metrics = true\n\
    [[model]]\nname = \"hog\"\nbackend = \"hog\"\nmax_concurrency = 1\n\
    options = { alloc_mib = 128, work_ms = 2500 }\n\
    [[model]]\nname = \"slow\"\nbackend = \"fault\"\n\
    options = { mode = \"ok\", load_delay_ms = 4000 }\n";

/// The protocol's gauges at one scrape.
#[derive(Debug, Clone, PartialEq)]
struct Gauges {
    waiting: f64,
    running: f64,
    usage: f64,
    /// `running_lora_adapters`, `waiting_lora_adapters`, `max_lora`.
    ready: String,
    loading: String,
    max: String,
    /// The info gauge's value: when its labels last changed.
    updated: f64,
}

/// Scrapes `/metrics` without a token, as the endpoint picker does, and
/// parses it with Prometheus's parser.
fn scrape(server: &Server) -> Gauges {
    let url = format!("http://127.0.0.1:{}/metrics", server.port());
    let text = ureq::get(&url)
        .call()
        .unwrap_or_else(|e| panic!("GET /metrics without a token: {e}"))
        .body_mut()
        .read_to_string()
        .unwrap();
    let mut parser = Command::new(deploy_python())
        .arg(repo_root().join("tests/python/metrics_text.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut parser.stdin.take().unwrap(), text.as_bytes()).unwrap();
    let out = parser.wait_with_output().unwrap();
    assert!(out.status.success(), "the parser refused:\n{text}");
    let families: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    // Each is a gauge with one sample of its own name.
    let sample = |name: &str| -> Value {
        let family = families
            .iter()
            .find(|f| f["name"] == name)
            .unwrap_or_else(|| panic!("no `{name}` in\n{text}"));
        assert_eq!(family["type"], "gauge", "{family}");
        let samples = family["samples"].as_array().unwrap();
        assert_eq!(samples.len(), 1, "one series: {family}");
        assert_eq!(samples[0]["name"], name, "{family}");
        samples[0].clone()
    };
    let value = |name: &str| sample(name)["value"].as_f64().unwrap();
    let info = sample("berth_loaded_models_info");
    let label = |key: &str| {
        info["labels"][key]
            .as_str()
            .unwrap_or_else(|| panic!("no `{key}`: {info}"))
            .to_string()
    };
    assert_eq!(
        info["labels"].as_object().unwrap().len(),
        3,
        "the adapter shape's three labels: {info}"
    );
    Gauges {
        waiting: value("berth_requests_waiting"),
        running: value("berth_requests_running"),
        usage: value("berth_budget_usage_ratio"),
        ready: label("running_lora_adapters"),
        loading: label("waiting_lora_adapters"),
        max: label("max_lora"),
        updated: info["value"].as_f64().unwrap(),
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// Scrapes until `condition` holds (20 s at most), and returns that scrape.
fn until(server: &Server, what: &str, condition: impl Fn(&Gauges) -> bool) -> Gauges {
    let mut last = None;
    let seen = wait_for(Duration::from_secs(20), || {
        let g = scrape(server);
        let done = condition(&g);
        last = Some(g);
        done
    });
    let last = last.unwrap();
    assert!(seen, "never {what}; last scrape: {last:?}");
    last
}

/// What the loaded workers hold, over the memory budget (`/api/ps`).
fn held_fraction(server: &Server) -> f64 {
    let (status, ps) = server.get("/api/ps");
    assert_eq!(status, 200, "{ps}");
    let held: u64 = ps["models"]
        .as_array()
        .unwrap_or_else(|| panic!("{ps}"))
        .iter()
        .map(|m| m["rss_bytes"].as_u64().unwrap_or(0))
        .sum();
    held as f64 / BUDGET
}

#[test]
fn the_gateway_gauges_follow_a_load_a_burst_a_waited_load_and_an_unload() {
    let server = &Server::start_with(CONFIG, &["--token", TOKEN]);
    // The token still guards everything else.
    let url = format!("http://127.0.0.1:{}/api/ps", server.port());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let denied = agent.get(&url).call().unwrap();
    assert_eq!(denied.status().as_u16(), 401);

    // Nothing loaded: nothing waits or runs, nothing is held; at most two
    // models can be loaded (max_loaded is unset: the two registered).
    let start = scrape(server);
    assert_eq!((start.waiting, start.running, start.usage), (0.0, 0.0, 0.0));
    assert_eq!((start.ready.as_str(), start.loading.as_str()), ("", ""));
    assert_eq!(start.max, "2");
    assert!(start.updated > 1.7e9 && start.updated <= now(), "{start:?}");

    // A load: `hog` is warm, the time moved on, and the budget's fullness
    // is what the worker holds of it.
    let (status, body) = server.post("/api/models/hog/load", json!({}));
    assert_eq!(status, 200, "{body}");
    let loaded = scrape(server);
    assert_eq!(
        (loaded.ready.as_str(), loaded.loading.as_str()),
        ("hog", "")
    );
    assert!(loaded.updated > start.updated, "{start:?} then {loaded:?}");
    let held = held_fraction(server);
    assert!(held > 0.12, "128 MiB of 1 GiB at least: {held}");
    assert!(
        (loaded.usage - held).abs() < 0.03,
        "usage {} vs held {held}",
        loaded.usage
    );
    // Nothing changed: the same time on the next scrape.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(scrape(server).updated, loaded.updated);

    // A burst of three on a model that takes one at a time: one runs, two
    // wait; then none.
    std::thread::scope(|s| {
        let burst: Vec<_> = (0..3)
            .map(|i| s.spawn(move || server.post("/api/models/hog/infer", json!({ "i": i }))))
            .collect();
        let busy = until(server, "1 running and 2 waiting", |g| {
            g.running == 1.0 && g.waiting == 2.0
        });
        assert_eq!(busy.ready, "hog", "{busy:?}");
        for request in burst {
            let (status, body) = request.join().unwrap();
            assert_eq!(status, 200, "{body}");
        }
    });
    let idle = until(server, "idle", |g| g.running == 0.0 && g.waiting == 0.0);
    assert_eq!(idle.ready, "hog");

    // Requests for a model that is not loaded wait for its load: counted
    // as waiting, the model as on its way; then it is warm too.
    std::thread::scope(|s| {
        let waiting: Vec<_> = (0..2)
            .map(|i| s.spawn(move || server.post("/api/models/slow/infer", json!({ "i": i }))))
            .collect();
        let on_its_way = until(server, "`slow` loading with 2 waiting", |g| {
            g.loading == "slow" && g.waiting == 2.0
        });
        assert_eq!(on_its_way.ready, "hog", "{on_its_way:?}");
        assert_eq!(on_its_way.running, 0.0, "{on_its_way:?}");
        assert!(on_its_way.updated > idle.updated, "{on_its_way:?}");
        for request in waiting {
            let (status, body) = request.join().unwrap();
            assert_eq!(status, 200, "{body}");
        }
    });
    let both = until(server, "both warm", |g| g.ready == "hog,slow");
    assert_eq!((both.loading.as_str(), both.waiting), ("", 0.0));

    // An unload: `hog` is gone from the list, and so is its memory.
    let (status, body) = server.post("/api/models/hog/unload", json!({}));
    assert_eq!(status, 200, "{body}");
    let unloaded = scrape(server);
    assert_eq!(
        (unloaded.ready.as_str(), unloaded.loading.as_str()),
        ("slow", "")
    );
    assert!(
        unloaded.updated > both.updated,
        "{both:?} then {unloaded:?}"
    );
    assert!(
        unloaded.usage < loaded.usage - 0.1,
        "128 MiB of 1 GiB came back: {loaded:?} then {unloaded:?}"
    );
    assert_eq!(unloaded.max, "2");
}
