//! What the benches share: medians, percentiles and [`Rounds`], the
//! interleaved A/B measurement whose ratio comes with its spread.

use std::time::{Duration, Instant};

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Per-round figures of two sides measured in the same run, A and B taking
/// turns, so that noise on a shared machine lands on both; printed with the
/// median of the per-round ratios A/B and its 10th-90th percentile spread.
#[derive(Debug, Default)]
pub struct Rounds {
    pub a: Vec<f64>,
    pub b: Vec<f64>,
}

impl Rounds {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one round's figures.
    pub fn push(&mut self, a: f64, b: f64) {
        self.a.push(a);
        self.b.push(b);
    }

    /// `(p10, median, p90)` of the per-round ratios A/B.
    pub fn ratio(&self) -> (f64, f64, f64) {
        let mut ratios: Vec<f64> = self.a.iter().zip(&self.b).map(|(a, b)| a / b).collect();
        (
            percentile(&mut ratios, 0.1),
            median(&mut ratios),
            percentile(&mut ratios, 0.9),
        )
    }

    /// A markdown table row: what, both sides' medians (times `scale`, in
    /// `unit`), the ratio with its spread, and the number of rounds.
    pub fn print(&self, what: &str, a_name: &str, b_name: &str, unit: &str, scale: f64) {
        let (p10, p50, p90) = self.ratio();
        let cell = |name: &str, v: &[f64]| {
            let figure = format!("{:.1} {unit}", median(&mut v.to_vec()) * scale);
            if name.is_empty() {
                figure
            } else {
                format!("{name} {figure}")
            }
        };
        println!(
            "| {what} | {} | {} | {p50:.2}× ({p10:.2}–{p90:.2}) | {} rounds |",
            cell(a_name, &self.a),
            cell(b_name, &self.b),
            self.a.len()
        );
    }
}

/// `rounds` rounds of `a` and `b`, each a figure, the order flipping each
/// round so that neither side always runs first.
pub fn alternate(rounds: usize, mut a: impl FnMut() -> f64, mut b: impl FnMut() -> f64) -> Rounds {
    let mut out = Rounds::new();
    for round in 0..rounds {
        if round % 2 == 0 {
            let x = a();
            out.push(x, b());
        } else {
            let y = b();
            out.push(a(), y);
        }
    }
    out
}

/// How a round of quick round trips starts, each a row of its own: after
/// a pause of 100 ms (from an idle machine, as a request at low load does),
/// or at once after the last round (back to back). The two differ on a
/// small VM: the scheduler's view of the last round (which threads were
/// busy, on which vCPU) decides where the next round's threads wake. Back
/// to back, the same bare echo read 11 or 45 µs depending on what ran
/// before it; a fault that only showed from idle (a worker woken behind the
/// caller's spin) went unseen while only back-to-back rounds were run.
pub const STARTS: [(&str, Duration); 2] = [
    ("from idle", Duration::from_millis(100)),
    ("back to back", Duration::ZERO),
];

/// Times `n` calls of `f`, returns the median in seconds.
pub fn timed(n: usize, mut f: impl FnMut()) -> f64 {
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(&mut v)
}

/// One line naming the machine a bench ran on: kernel, cores, CPU model.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!(
        "Linux {}, {} cores, {cpu}",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    )
}

/// The runtime the benches run the supervisor on: two worker threads, as
/// many as this machine has cores.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// The sections named on a bench's command line (arguments that do not
/// start with `-`): the returned test is true for those, or for every
/// section where none is named.
pub fn sections() -> impl Fn(&str) -> bool {
    let wanted: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    move |section| wanted.is_empty() || wanted.iter().any(|w| w == section)
}

/// The echo benches' supervisor settings: the tests' own, with
/// `BERTH_BENCH_ANSWER_SPIN_US` (microseconds; `0` parks at once) setting
/// `answer_spin`, for the runs that compare callers with and without it.
pub fn echo_config() -> berth::SupervisorConfig {
    let mut config = crate::test_config();
    if let Ok(spin) = std::env::var("BERTH_BENCH_ANSWER_SPIN_US") {
        config.answer_spin = Duration::from_micros(spin.parse().expect("microseconds"));
    }
    config
}

/// The `p` quantile (0 to 1) of `samples`, in milliseconds.
pub fn pct_ms(samples: &mut [Duration], p: f64) -> f64 {
    samples.sort();
    samples[((samples.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

/// Nanoseconds on a CPU of `pid`'s live threads (`schedstat`: exact, where
/// `stat` counts in 10 ms ticks).
pub fn cpu_nanos(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// This process's resident memory, in bytes.
pub fn own_rss() -> u64 {
    berth::memory::process_memory(std::process::id())
        .map(|m| m.rss_bytes)
        .unwrap_or(0)
}

/// Seconds from SIGKILL to reaped for a plain process holding 1 GiB, every
/// page touched: the floor any stop of a process that size stands on.
pub fn kernel_kill_1gib() -> f64 {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let mut child = Command::new("python3")
        .args([
            "-c",
            "import sys\nb = bytearray(1 << 30)\nb[::4096] = b'\\x01' * (1 << 18)\nprint('ready', flush=True)\nsys.stdin.read()",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("the process says it is ready");
    assert_eq!(line.trim(), "ready");
    let started = Instant::now();
    child.kill().expect("SIGKILL");
    child.wait().expect("reaped");
    started.elapsed().as_secs_f64()
}
