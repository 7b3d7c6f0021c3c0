//! The stock worker binary: every built-in backend.

fn main() {
    berth_worker::serve(berth_worker::Registry::builtin())
}
