//! `berth run`: one model, one shot.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use berth::gpu::{AutoWord, GpuRequest};
use berth::{Body, ModelSpec, Supervisor, SupervisorConfig, parse_duration};
use clap::Args;

use super::{fail, parse_key_value};

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Backend to load (`echo`, `hog`, `fault`, or one of a custom worker).
    #[arg(long)]
    backend: String,
    /// Weights file or directory.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Backend option, repeatable.
    #[arg(long = "option", short = 'o', value_name = "KEY=VALUE", value_parser = parse_key_value)]
    options: Vec<(String, String)>,
    /// One request per input, in order.
    #[arg(long = "input", short = 'i', value_name = "TEXT")]
    inputs: Vec<String>,
    /// Name of the model in reports (default: the backend's name).
    #[arg(long)]
    name: Option<String>,
    /// Place the worker on GPUs: NVML indices (`0`, `0,1`) or `auto` (the
    /// device with the most free memory).
    #[arg(long, value_parser = parse_gpus)]
    gpus: Option<GpuRequest>,
    /// Spawn + handshake + load must finish within this.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    load_timeout: Duration,
    /// The worker program (default: this executable, as `berth worker`).
    #[arg(long, env = "BERTH_WORKER")]
    worker: Option<PathBuf>,
    /// A worker speaking the stream wire (a Python worker), by its command
    /// line, split at whitespace: `--command "python3 -m berth_worker"`.
    #[arg(long, value_name = "COMMAND LINE", conflicts_with = "worker")]
    command: Option<String>,
    /// The worker's working directory.
    #[arg(long)]
    cwd: Option<PathBuf>,
    /// Print one JSON object on stdout instead of text.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: RunArgs) -> ExitCode {
    let (worker_binary, worker_args) = super::default_worker(args.worker.clone());
    let config = SupervisorConfig {
        worker_binary,
        worker_args,
        load_timeout: args.load_timeout,
        ..SupervisorConfig::default()
    };
    let supervisor = Supervisor::new(config);
    let name = args.name.clone().unwrap_or_else(|| args.backend.clone());
    let mut spec = ModelSpec::new(&name, &args.backend);
    spec.model = args.model.clone();
    spec.options = args.options.iter().cloned().collect();
    spec.gpus = args.gpus.clone();
    spec.command = args
        .command
        .as_deref()
        .map(|line| line.split_whitespace().map(str::to_string).collect());
    spec.cwd = args.cwd.clone();

    let load = match supervisor.load(spec).await {
        Ok(report) => report,
        Err(e) => return fail(e.kind(), &e.to_string(), args.json),
    };
    if !args.json {
        super::output::say(&load);
    }
    let mut responses = Vec::new();
    let mut failure = None;
    for (i, input) in args.inputs.iter().enumerate() {
        let body = Body::json(serde_json::json!({ "input": input }).to_string());
        match supervisor.request(&name, body).await {
            Ok(body) => {
                let value = response_value(&body);
                if !args.json {
                    super::output::say(format!("response {}: {}", i + 1, value));
                }
                responses.push(value);
            }
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let unload = supervisor.unload(&name).await;
    if let Some(e) = failure {
        return fail(e.kind(), &e.to_string(), args.json);
    }
    let unload = match unload {
        Ok(report) => report,
        Err(e) => return fail(e.kind(), &e.to_string(), args.json),
    };
    if args.json {
        super::output::say(
            serde_json::json!({ "load": load, "responses": responses, "unload": unload }),
        );
    } else {
        super::output::say(&unload);
    }
    ExitCode::SUCCESS
}

/// `auto`, or a comma-separated list of NVML device indices.
fn parse_gpus(text: &str) -> Result<GpuRequest, String> {
    if text.trim() == "auto" {
        return Ok(GpuRequest::Auto(AutoWord::Auto));
    }
    text.split(',')
        .map(|n| {
            n.trim()
                .parse::<u32>()
                .map_err(|_| format!("`{text}` is not `auto` or GPU indices like `0` or `0,1`"))
        })
        .collect::<Result<Vec<u32>, String>>()
        .map(GpuRequest::Devices)
}

/// A response as JSON: the backend's JSON, with the size of any bulk part.
fn response_value(body: &Body) -> serde_json::Value {
    let mut value: serde_json::Value = serde_json::from_str(&body.json)
        .unwrap_or_else(|_| serde_json::Value::String(body.json.clone()));
    let bulk = body.bulk_bytes().len();
    if bulk > 0 {
        if let serde_json::Value::Object(map) = &mut value {
            map.insert("bulk_bytes".into(), bulk.into());
        }
    }
    value
}
