//! The `berth` command line: a thin layer over `berth::Supervisor`.

mod cli;

fn main() -> std::process::ExitCode {
    if cli::is_worker_role() {
        return cli::main();
    }
    // Workers are forked, and an in-place upgrade execs, from this (the
    // main) thread, the one that lives as long as the process: see
    // `berth::main_thread_spawns`.
    berth::main_thread_spawns(cli::main)
}
