//! What a swap carries over to the new worker and what it takes from the
//! new spec: the concurrency bound, the quarantine, a request's keep-alive.

use std::time::Duration;

use berth::{Body, ModelSpec, RequestOptions, Supervisor};
use berth_tests::*;

fn in_flight(sup: &Supervisor, model: &str) -> u32 {
    sup.stats()
        .into_iter()
        .find(|s| s.name == model)
        .map_or(0, |s| s.in_flight)
}

/// Sends `n` slow requests at once and returns the most that were inside
/// the worker together.
async fn most_in_flight_of(sup: &Supervisor, model: &str, n: usize) -> u32 {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let sup = sup.clone();
        let model = model.to_string();
        tasks.spawn(async move {
            sup.request(&model, Body::json(format!("{{\"i\":{i}}}")))
                .await
        });
    }
    let mut most = 0;
    while !tasks.is_empty() {
        most = most.max(in_flight(sup, model));
        tokio::select! {
            done = tasks.join_next() => { done.unwrap().unwrap().unwrap(); }
            _ = tokio::time::sleep(Duration::from_millis(5)) => {}
        }
    }
    most
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_swap_applies_the_new_max_concurrency() {
    let sup = supervisor();
    let mut spec = ModelSpec::new("h", "hog")
        .option("work_ms", 150)
        .option("batch", 4);
    spec.max_concurrency = Some(1);
    sup.load(spec.clone()).await.unwrap();
    assert_eq!(most_in_flight_of(&sup, "h", 4).await, 1);

    let mut wider = spec.clone();
    wider.max_concurrency = Some(4);
    sup.swap(wider.clone()).await.unwrap();
    assert_eq!(
        most_in_flight_of(&sup, "h", 4).await,
        4,
        "the swapped-in spec's bound applies"
    );

    let mut narrower = wider;
    narrower.max_concurrency = Some(2);
    sup.swap(narrower).await.unwrap();
    assert_eq!(most_in_flight_of(&sup, "h", 6).await, 2);
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quarantine_survives_a_swap_of_the_same_model() {
    let sup = supervisor();
    let spec = ModelSpec::new("p", "fault").option("crash_on", "poison");
    sup.load(spec.clone()).await.unwrap();
    let poison = || Body::json(r#"{"input":"poison"}"#);
    for death in 1..=2 {
        let err = sup.request("p", poison()).await.unwrap_err();
        assert_eq!(err.kind(), "worker_died", "death {death}: {err}");
        assert!(
            eventually(Duration::from_secs(20), || ready_pid(&sup, "p").is_some()).await,
            "restarted after death {death}"
        );
    }
    assert_eq!(
        sup.request("p", poison()).await.unwrap_err().kind(),
        "quarantined"
    );
    let swapped = sup.swap(spec.clone()).await.unwrap();
    let err = sup.request("p", poison()).await.unwrap_err();
    assert_eq!(err.kind(), "quarantined", "{err}");
    assert_eq!(
        ready_pid(&sup, "p"),
        swapped.new_pid,
        "the new worker was spared"
    );

    // Other weights or options: the poison may be harmless now.
    let other = spec.option("load_delay_ms", 10);
    sup.swap(other).await.unwrap();
    assert_eq!(
        sup.request("p", poison()).await.unwrap_err().kind(),
        "worker_died",
        "a changed model starts without the old quarantine"
    );
    sup.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_requests_keep_alive_survives_a_swap() {
    let sup = supervisor();
    let spec = ModelSpec::new("e", "echo");
    sup.load(spec.clone()).await.unwrap();
    let options = RequestOptions {
        keep_alive: Some(Duration::from_secs(600)),
        deadline: None,
    };
    sup.request_with("e", Body::json("{}"), options)
        .await
        .unwrap();
    sup.swap(spec.clone()).await.unwrap();
    sup.request("e", Body::json("{}")).await.unwrap();
    let left = sup.stats()[0].keep_alive_left_s;
    assert!(
        left.is_some_and(|s| s > 590.0),
        "the request's keep-alive still applies: {left:?}"
    );

    // A spec that sets its own keep-alive takes over.
    let mut own = spec;
    own.keep_alive = Some(Duration::from_secs(30));
    sup.swap(own).await.unwrap();
    sup.request("e", Body::json("{}")).await.unwrap();
    let left = sup.stats()[0].keep_alive_left_s;
    assert!(left.is_some_and(|s| s <= 30.0), "{left:?}");
    sup.shutdown().await;
}
