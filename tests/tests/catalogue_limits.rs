//! What HTTP clients can make the catalogue hold, second round: a bounded
//! number of models with bounded options, checked when registered; short
//! 404s; the test doubles only where the operator allows them; a model of
//! unknown size that is not free; and models that outgrow the budget after
//! loading.

use std::time::Duration;

use berth::{Body, ModelSpec, Supervisor, SupervisorConfig};
use berth_tests::*;
use serde_json::json;

#[test]
fn registrations_are_bounded_and_checked_when_made() {
    let server = Server::start("max_models = 5\n");
    for i in 0..5 {
        let (status, reply) =
            server.put(&format!("/api/models/m{i}"), json!({ "backend": "echo" }));
        assert_eq!(status, 201, "{reply}");
    }
    let (status, reply) = server.put("/api/models/m5", json!({ "backend": "echo" }));
    assert_eq!(status, 409, "{reply}");
    assert_eq!(reply["error"]["code"], "catalogue_full", "{reply}");
    // Replacing a registered model is not a new one.
    assert_eq!(
        server
            .put(
                "/api/models/m0",
                json!({ "backend": "echo", "options": { "chunks": 1 } })
            )
            .0,
        201
    );
    assert_eq!(server.delete("/api/models/m4").0, 200);

    // Options: a name the backend does not take is refused now, not at load.
    let (status, reply) = server.put(
        "/api/models/m4",
        json!({ "backend": "echo", "options": { "chunkz": 1 } }),
    );
    assert_eq!(status, 400, "{reply}");
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("`chunkz`") && message.contains("chunks"),
        "{message}"
    );
    // ... and their size is bounded.
    let huge = "x".repeat(8 << 20);
    let (status, reply) = server.put(
        "/api/models/m4",
        json!({ "backend": "echo", "options": { "chunks": huge } }),
    );
    assert!(status == 400 || status == 413, "{status}: {reply}");
    let many: serde_json::Map<String, serde_json::Value> =
        (0..100).map(|i| (format!("o{i}"), json!(1))).collect();
    let (status, reply) = server.put(
        "/api/models/m4",
        json!({ "backend": "echo", "options": many }),
    );
    assert_eq!(status, 400, "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at most 64"),
        "{reply}"
    );
}

#[test]
fn a_404_names_a_few_models_not_the_whole_catalogue() {
    let server = Server::start("");
    for i in 0..40 {
        assert_eq!(
            server
                .put(
                    &format!("/api/models/model-{i:02}"),
                    json!({ "backend": "echo" })
                )
                .0,
            201
        );
    }
    let (status, reply) = server.post("/api/models/nope/infer", json!({}));
    assert_eq!(status, 404);
    let message = reply["error"]["message"].as_str().unwrap();
    assert!(message.contains("and 30 more"), "{message}");
    assert!(message.len() < 400, "{} bytes: {message}", message.len());
}

#[test]
fn the_test_doubles_are_the_operators_to_offer() {
    let server = Server::start(
        "memory_budget = \"512MiB\"\n\
         [[model]]\nname = \"own-hog\"\nbackend = \"hog\"\noptions = { alloc_mib = 8 }\n",
    );
    for backend in ["hog", "fault", "gpu-hog"] {
        let (status, reply) = server.put(
            "/api/models/x",
            json!({ "backend": backend, "options": { "alloc_mib": 1500 } }),
        );
        assert_eq!(status, 403, "{backend}: {reply}");
        assert_eq!(reply["error"]["code"], "test_backend", "{reply}");
        assert!(
            reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains("test_backends = true"),
            "{reply}"
        );
    }
    // A client cannot swap an operator's model into one, nor change the
    // options of the operator's own test model.
    assert_eq!(server.post("/api/models/own-hog/load", json!({})).0, 200);
    let (status, reply) = server.post(
        "/api/models/own-hog/swap",
        json!({ "backend": "hog", "options": { "alloc_mib": 1500 } }),
    );
    assert_eq!(status, 403, "{reply}");
    let (status, reply) = server.post(
        "/api/models/own-hog/swap",
        json!({ "backend": "hog", "options": { "alloc_mib": 8 } }),
    );
    assert_eq!(status, 200, "the operator's model as it is swaps: {reply}");
}

/// A model with no file and no earlier load is not free: it is counted as
/// its memory_limit (or a stated default) when it is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_of_unknown_size_is_counted_before_its_first_load() {
    let sup = Supervisor::new(SupervisorConfig {
        memory_budget: Some(512 << 20),
        ..test_config()
    });
    let mut spec = ModelSpec::new("capped", "echo");
    spec.memory_limit = Some(2 << 30);
    let err = sup.load(spec).await.unwrap_err();
    assert_eq!(err.kind(), "memory_budget_exceeded", "{err}");
    assert!(err.to_string().contains("whole memory budget"), "{err}");
    // Without a limit, the default (256 MiB) fits: it loads, and its
    // measured peak is what counts from then on.
    sup.load(ModelSpec::new("small", "echo")).await.unwrap();
    sup.shutdown().await;
}

/// Models that grow past the budget after they loaded: the idle ones are
/// evicted, least recently used first, without waiting for another load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_that_outgrow_the_budget_push_idle_ones_out() {
    let _memory = memory_lock().await;
    let sup = Supervisor::new(SupervisorConfig {
        memory_budget: Some(400 << 20),
        ..test_config()
    });
    let idle = sup
        .load(ModelSpec::new("idle", "hog").option("alloc_mib", 100))
        .await
        .unwrap();
    sup.load(ModelSpec::new("leaky", "hog").option("leak_kib_per_request", 100 << 10))
        .await
        .unwrap();
    for i in 0..4 {
        sup.request("leaky", Body::json(json!({ "i": i }).to_string()))
            .await
            .unwrap();
    }
    // Its process ends first; its row goes once the stop has swept and
    // measured what came back.
    assert!(
        eventually(Duration::from_secs(15), || {
            !alive(idle.pid) && sup.stats().iter().all(|s| s.name != "idle")
        })
        .await,
        "the idle model was evicted: {:?}",
        sup.stats()
    );
    sup.shutdown().await;
}
