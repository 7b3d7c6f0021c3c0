//! What an unload gives back, read from the system's own memory counters.
//!
//! `reclaimed_bytes` is confirmed by the fall in the machine's anonymous
//! memory across the stop, so these tests run alone in their own binary
//! (cargo runs test binaries one after another) and one at a time within
//! it: a worker another test started at the same moment would hide part of
//! the fall.

use std::time::Duration;

use berth::{Body, ModelSpec, StopKind};
use berth_tests::*;
use serde_json::json;

const MIB: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hog_memory_is_reclaimed_and_proven() {
    let _guard = memory_lock().await;
    let sup = supervisor();
    let load = sup
        .load(ModelSpec::new("hog", "hog").option("alloc_mib", 512))
        .await
        .unwrap();
    assert!(
        load.rss_bytes >= 512 * MIB,
        "the hog holds its memory: {load}"
    );
    let reply = sup.request("hog", Body::json("{}")).await.unwrap();
    assert!(
        reply.json.contains(&(512 * MIB).to_string()),
        "{}",
        reply.json
    );

    let unload = sup.unload("hog").await.unwrap();
    assert_eq!(unload.stop, StopKind::Graceful, "{unload}");
    assert_eq!(unload.leftover_processes, 0);
    assert!(unload.anon_at_stop_bytes >= 512 * MIB, "{unload}");
    assert!(
        unload.reclaimed_bytes as f64 >= 0.95 * (512 * MIB) as f64,
        "reclaimed at least 95% of 512 MiB: {unload}"
    );
    assert!(
        unload.system_anon_before_bytes - unload.system_anon_after_bytes >= unload.reclaimed_bytes,
        "the system's anonymous memory confirms it: {unload}"
    );
    assert!(!alive(unload.pid));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_embedding_model_unloaded_over_http_gives_its_memory_back() {
    let _guard = memory_lock().await;
    let minilm = default_model("minilm");
    let server = Server::start(&format!(
        "[[model]]\nname = \"minilm\"\nbackend = \"embed\"\nmodel = \"{}\"\n",
        minilm.display()
    ));
    let (status, _) = server.post(
        "/v1/embeddings",
        json!({ "model": "minilm", "input": "The quick brown fox." }),
    );
    assert_eq!(status, 200);
    let pid = server.ps()[0]["pid"].as_u64().unwrap() as u32;
    let (status, report) = server.post("/api/models/minilm/unload", json!({}));
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["leftover_processes"], 0);
    let anon = report["anon_at_stop_bytes"].as_u64().unwrap();
    let reclaimed = report["reclaimed_bytes"].as_u64().unwrap();
    assert!(reclaimed > 50 * MIB, "{report}");
    assert!(
        reclaimed as f64 >= 0.9 * anon as f64,
        "most of the worker's anonymous memory is seen coming back: {report}"
    );
    assert!(
        wait_for(Duration::from_secs(1), || !alive(pid)),
        "the worker is gone"
    );
}
