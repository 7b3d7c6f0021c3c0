//! The chaos run: clients send requests to several models while a random
//! worker is SIGKILLed every second. Every request must end either answered
//! or failed with a clear error (none hung), and no process may be left.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use berth::{Body, ModelSpec, RequestOptions, Supervisor, SupervisorConfig};

/// What a chaos run saw.
#[derive(Debug, Default)]
pub struct ChaosReport {
    pub requests: u64,
    pub answered: u64,
    /// Failed with a clear error, by error kind.
    pub failed: BTreeMap<String, u64>,
    /// No answer within the 10 s deadline: must be zero.
    pub hung: u64,
    pub kills: u64,
    pub restarts: u64,
    /// Processes of this process still alive (or unreaped) after shutdown: must be zero.
    pub leftover: usize,
}

impl std::fmt::Display for ChaosReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let failed: u64 = self.failed.values().sum();
        writeln!(
            f,
            "requests {}: answered {}, failed with a clear error {} {:?}, hung {}",
            self.requests, self.answered, failed, self.failed, self.hung
        )?;
        write!(
            f,
            "workers killed {}, restarts {}, processes left {}",
            self.kills, self.restarts, self.leftover
        )
    }
}

/// Runs the chaos for `duration` with `clients` concurrent clients.
pub async fn run(duration: Duration, clients: usize) -> ChaosReport {
    let sup = Supervisor::new(SupervisorConfig {
        restart_backoff: Duration::from_millis(100),
        ..crate::test_config()
    });
    let models = [
        // Batching on where it can be: requests that wait run together.
        ModelSpec::new("echo", "echo").option("batch", 8),
        ModelSpec::new("hog", "hog")
            .option("alloc_mib", 16)
            .option("work_ms", 20)
            .option("batch", 4),
        ModelSpec::new("fault", "fault"),
    ];
    for mut spec in models {
        spec.max_restarts = Some(10_000);
        sup.load(spec).await.expect("chaos models load");
    }
    let stop = Arc::new(AtomicBool::new(false));
    let requests = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for client in 0..clients {
        let (sup, stop, requests) = (sup.clone(), Arc::clone(&stop), Arc::clone(&requests));
        tasks.spawn(async move {
            let mut answered = 0u64;
            let mut failed: BTreeMap<String, u64> = BTreeMap::new();
            let mut hung = 0u64;
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let model = ["echo", "hog", "fault"][(client + i) % 3];
                i += 1;
                requests.fetch_add(1, Ordering::Relaxed);
                let options = RequestOptions {
                    deadline: Some(Duration::from_secs(10)),
                    ..Default::default()
                };
                match sup
                    .request_with(
                        model,
                        Body::json(format!("{{\"c\":{client},\"i\":{i}}}")),
                        options,
                    )
                    .await
                {
                    Ok(_) => answered += 1,
                    Err(e) if e.kind() == "deadline_exceeded" => hung += 1,
                    Err(e) => {
                        assert!(
                            e.to_string().contains(model),
                            "a clear error names the model: {e}"
                        );
                        *failed.entry(e.kind().to_string()).or_default() += 1;
                        // As a client honouring Retry-After would, rather than spin.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            (answered, failed, hung)
        });
    }
    let started = Instant::now();
    let mut kills = 0;
    let mut seed = std::process::id() as u64;
    while started.elapsed() < duration {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let pids: Vec<u32> = sup.stats().iter().filter_map(|s| s.pid).collect();
        if pids.is_empty() {
            continue;
        }
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let victim = pids[(seed >> 33) as usize % pids.len()];
        if nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(victim as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .is_ok()
        {
            kills += 1;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut report = ChaosReport {
        kills,
        ..ChaosReport::default()
    };
    while let Some(joined) = tasks.join_next().await {
        let (answered, failed, hung) = joined.expect("client task");
        report.answered += answered;
        report.hung += hung;
        for (kind, n) in failed {
            *report.failed.entry(kind).or_default() += n;
        }
    }
    report.requests = requests.load(Ordering::Relaxed);
    report.restarts = sup
        .counters()
        .iter()
        .map(|(_, c)| c.restarts.load(Ordering::Relaxed))
        .sum();
    sup.shutdown().await;
    let me = std::process::id();
    crate::eventually(Duration::from_secs(5), || crate::children_of(me).is_empty()).await;
    report.leftover = crate::children_of(me).len();
    report
}
