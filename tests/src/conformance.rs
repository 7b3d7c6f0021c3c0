//! The conformance suite's three workers (`tests/tests/conformance*.rs`):
//! every scenario that proves a worker's guarantees runs against the Rust
//! worker (`berth-worker` on `ipc-channel`), the Python worker (`python3 -m
//! berth_worker` on the stream wire, in the test venv) started cold, and the
//! same Python worker forked from its kind's preloaded interpreter, from one
//! definition. [`conformance!`](macro@crate::conformance) makes a `rust`, a
//! `python` and a `python_forked` test of each.

use berth::ModelSpec;

use crate::python::python_worker_command;
use crate::test_config;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Worker {
    Rust,
    Python,
    /// The Python worker, forked from the `py-forked` kind's preloader.
    PythonForked,
}

/// The worker kind whose workers are forked from a preloaded interpreter.
pub const FORKED_KIND: &str = "py-forked";

impl Worker {
    pub fn spec(self, name: &str, backend: &str) -> ModelSpec {
        let spec = ModelSpec::new(name, backend);
        match self {
            Worker::Rust => spec,
            Worker::Python => spec.command(python_worker_command()),
            Worker::PythonForked => {
                let mut spec = spec;
                spec.worker = Some(FORKED_KIND.into());
                spec
            }
        }
    }

    pub fn is_python(self) -> bool {
        self != Worker::Rust
    }

    /// The tests' settings, with the preloading kind declared (and this
    /// process a child subreaper, as `berth serve` is) for a forked worker.
    pub fn config(self) -> berth::SupervisorConfig {
        let mut config = test_config();
        if self == Worker::PythonForked {
            berth::become_subreaper().expect("a child subreaper");
            let mut kind = berth::WorkerKind::command(python_worker_command());
            kind.preload = vec!["berth_worker.backends".into()];
            config.workers.insert(FORKED_KIND.into(), kind);
        }
        config
    }

    pub fn supervisor(self) -> berth::Supervisor {
        berth::Supervisor::new(self.config())
    }
}

/// Every forked scenario's worker came from the preloader, not a cold start.
pub fn assert_forked(w: Worker, report: &berth::LoadReport) {
    if w == Worker::PythonForked {
        assert!(
            matches!(report.start, berth::WorkerStart::Forked { .. }),
            "{:?}",
            report.start
        );
    }
}

/// A `rust`, a `python` and a `python_forked` test of each scenario (an
/// `async fn(Worker)` of the calling file, which imports [`Worker`]).
#[macro_export]
macro_rules! conformance {
    ($($scenario:ident),* $(,)?) => {$(
        mod $scenario {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rust() {
                super::$scenario(super::Worker::Rust).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn python() {
                super::$scenario(super::Worker::Python).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn python_forked() {
                super::$scenario(super::Worker::PythonForked).await
            }
        }
    )*};
}
