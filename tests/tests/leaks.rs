//! Process-wide leak checks. They count this process's file descriptors
//! and children, so they live in a test binary of their own: a test running
//! beside them would move the counts.

use std::time::Duration;

use berth::{Body, ModelSpec, StopKind};
use berth_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_load_unload_cycles_leak_nothing() {
    let sup = supervisor();
    let me = std::process::id();
    let cycle = |i: usize| {
        let sup = sup.clone();
        async move {
            let load = sup.load(ModelSpec::new("cycle", "echo")).await.unwrap();
            let reply = sup
                .request("cycle", Body::json(i.to_string()))
                .await
                .unwrap();
            assert_eq!(reply.json, i.to_string());
            let unload = sup.unload("cycle").await.unwrap();
            assert_eq!(
                (unload.stop, unload.leftover_processes),
                (StopKind::Graceful, 0)
            );
            load.pid
        }
    };
    for i in 0..5 {
        cycle(i).await;
    }
    let fds_before = fd_count();
    let mut pids = Vec::new();
    for i in 0..200 {
        pids.push(cycle(i).await);
    }
    assert!(
        wait_for(Duration::from_secs(5), || fd_count() <= fds_before),
        "fds: {} before, {} after",
        fds_before,
        fd_count()
    );
    assert!(pids.iter().all(|pid| !alive(*pid)), "no worker left");
    let ours: Vec<_> = children_of(me)
        .into_iter()
        .filter(|(pid, _)| pids.contains(pid))
        .collect();
    assert!(ours.is_empty(), "no zombie or leftover child: {ours:?}");
}
