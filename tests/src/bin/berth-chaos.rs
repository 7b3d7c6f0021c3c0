//! The long chaos run: `cargo run --release -p berth-tests --bin berth-chaos -- [SECONDS]`
//! (default 180). Exits non-zero if a request hung or a process was left.

fn main() -> std::process::ExitCode {
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let report = runtime.block_on(berth_tests::chaos::run(
        std::time::Duration::from_secs(seconds),
        4,
    ));
    println!("{report}");
    if report.hung == 0 && report.leftover == 0 && report.answered > 0 {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
