//! The `berth` command line: a thin layer over `berth::Supervisor`.

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
