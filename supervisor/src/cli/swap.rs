//! `berth swap`: replaces a model's worker with new weights, backend or
//! options, starting from the spec the daemon has registered. Its own file
//! because it is the one command that reads before it writes.

use std::path::PathBuf;
use std::process::ExitCode;

use berth::SwapReport;
use clap::Args;
use serde_json::{Value, json};

use super::http::{Client, Remote};
use super::output::{Progress, done, report};
use super::parse_key_value;

#[derive(Debug, Args)]
pub struct SwapArgs {
    pub name: String,
    /// New weights.
    #[arg(long)]
    model: Option<PathBuf>,
    /// New backend (default: the current one).
    #[arg(long)]
    backend: Option<String>,
    /// A backend option for the new worker. Merged into the model's current
    /// options: each KEY given replaces that key, the others are kept (see
    /// --replace-options).
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    options: Vec<(String, String)>,
    /// Start from no options: the new worker gets only the --option values
    /// given.
    #[arg(long)]
    replace_options: bool,
    /// A model that is not loaded is loaded with its new spec too (without
    /// it, its spec is updated and its next load uses it).
    #[arg(long)]
    load: bool,
    #[command(flatten)]
    remote: Remote,
}

/// Fields of a registered spec that only the operator sets: the server
/// keeps them across a swap, so the CLI does not send them back.
const OPERATOR_ONLY: &[&str] = &["worker_binary", "env", "command", "cwd", "http"];

pub fn run(args: SwapArgs) -> ExitCode {
    let client = Client::new(&args.remote);
    let json = args.remote.json;
    let result = (|| {
        let catalogue = client.get("/api/models")?;
        let current = catalogue["models"]
            .as_array()
            .and_then(|models| {
                models
                    .iter()
                    .find(|m| m["spec"]["name"] == args.name.as_str())
            })
            .map(|m| m["spec"].clone())
            .ok_or_else(|| {
                (
                    "model_not_found".to_string(),
                    format!("no model `{}` is registered", args.name),
                )
            })?;
        let mut spec = new_spec(current, &args);
        if args.load {
            spec["load"] = json!(true);
        }
        let _progress = Progress::start(format!("swapping {}", args.name));
        client.post(&format!("/api/models/{}/swap", args.name), Some(spec))
    })();
    done(result.map(|v| report::<SwapReport>(v, json)), json)
}

/// The registered spec with what the command line changes.
fn new_spec(mut spec: Value, args: &SwapArgs) -> Value {
    if let Some(object) = spec.as_object_mut() {
        for field in OPERATOR_ONLY {
            object.remove(*field);
        }
    }
    if let Some(model) = &args.model {
        spec["model"] = json!(model);
    }
    if let Some(backend) = &args.backend {
        spec["backend"] = json!(backend);
    }
    let mut options = match (&spec["options"], args.replace_options) {
        (Value::Object(current), false) => current.clone(),
        _ => serde_json::Map::new(),
    };
    for (k, v) in &args.options {
        options.insert(k.clone(), json!(v));
    }
    spec["options"] = Value::Object(options);
    spec
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        swap: SwapArgs,
    }

    fn args(line: &[&str]) -> SwapArgs {
        Cli::parse_from(std::iter::once("swap").chain(line.iter().copied())).swap
    }

    #[test]
    fn options_merge_unless_replaced_and_operator_fields_stay_behind() {
        let registered = json!({
            "name": "m", "backend": "embed", "worker_binary": "/opt/w", "env": [],
            "command": null, "cwd": null,
            "options": {"threads": "2", "max_length": "128"}
        });
        let merged = new_spec(registered.clone(), &args(&["m", "-o", "threads=1"]));
        assert_eq!(
            merged["options"],
            json!({"threads": "1", "max_length": "128"})
        );
        for field in OPERATOR_ONLY {
            assert!(merged.get(*field).is_none(), "{field}: {merged}");
        }
        let replaced = new_spec(
            registered,
            &args(&["m", "-o", "threads=1", "--replace-options"]),
        );
        assert_eq!(replaced["options"], json!({"threads": "1"}));
    }
}
