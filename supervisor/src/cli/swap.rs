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
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    options: Vec<(String, String)>,
    #[command(flatten)]
    remote: Remote,
}

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
        let mut spec = current;
        if let Some(model) = &args.model {
            spec["model"] = json!(model);
        }
        if let Some(backend) = &args.backend {
            spec["backend"] = json!(backend);
        }
        if !args.options.is_empty() {
            let options: serde_json::Map<String, Value> = args
                .options
                .iter()
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            spec["options"] = Value::Object(options);
        }
        let _progress = Progress::start(format!("swapping {}", args.name));
        client.post(&format!("/api/models/{}/swap", args.name), Some(spec))
    })();
    done(result.map(|v| report::<SwapReport>(v, json)), json)
}
