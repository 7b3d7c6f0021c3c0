//! A short chaos run in CI; the long one is `berth-chaos` (see docs/performance.md).

use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_kills_leave_no_hung_request_and_no_process() {
    let report = berth_tests::chaos::run(Duration::from_secs(8), 4).await;
    println!("{report}");
    assert_eq!(report.hung, 0, "{report}");
    assert_eq!(report.leftover, 0, "{report}");
    assert!(report.kills >= 6, "{report}");
    assert!(report.answered > 100, "{report}");
    assert!(
        report.restarts >= report.kills / 2,
        "killed models came back: {report}"
    );
    let clear = ["worker_died", "busy", "restarting"];
    assert!(
        report.failed.keys().all(|k| clear.contains(&k.as_str())),
        "only clear failures: {report}"
    );
}
