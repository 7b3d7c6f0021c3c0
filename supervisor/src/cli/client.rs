//! The CLI as a client of a running `berth serve`: `ps`, `load`, `unload`,
//! `swap`, `embed`, `generate`.

use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use berth::{LoadReport, ModelStatus, SwapReport, UnloadReport};
use clap::Args;
use serde_json::{Value, json};

use super::parse_key_value;

/// Where the daemon is.
#[derive(Debug, Clone, Args)]
pub struct Remote {
    /// The daemon's URL.
    #[arg(
        long,
        env = "BERTH_URL",
        default_value = "http://127.0.0.1:7733",
        global = true
    )]
    url: String,
    /// Bearer token, if the daemon wants one.
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true, global = true)]
    token: Option<String>,
    /// Print the daemon's JSON instead of text.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Args)]
pub struct NameArgs {
    pub name: String,
    #[command(flatten)]
    pub remote: Remote,
}

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

#[derive(Debug, Args)]
pub struct EmbedArgs {
    pub name: String,
    #[arg(required = true)]
    texts: Vec<String>,
    #[command(flatten)]
    remote: Remote,
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    pub name: String,
    prompt: String,
    #[arg(long)]
    max_tokens: Option<u64>,
    #[arg(long)]
    temperature: Option<f64>,
    #[command(flatten)]
    remote: Remote,
}

struct Client {
    agent: ureq::Agent,
    remote: Remote,
}

type Failure = (String, String);

impl Client {
    fn new(remote: &Remote) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(None)
            .build()
            .into();
        Client {
            agent,
            remote: remote.clone(),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.remote.url.trim_end_matches('/'))
    }

    fn auth<B>(&self, request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.remote.token {
            Some(token) => request.header("Authorization", format!("Bearer {token}")),
            None => request,
        }
    }

    fn finish(
        &self,
        result: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Value, Failure> {
        let mut response = result.map_err(|e| {
            (
                "unreachable".to_string(),
                format!(
                    "cannot reach berth at {}: {e}; is `berth serve` running?",
                    self.remote.url
                ),
            )
        })?;
        let status = response.status();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| ("io_error".into(), e.to_string()))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if status.is_success() {
            Ok(value)
        } else {
            let code = value["error"]["code"]
                .as_str()
                .unwrap_or("http_error")
                .to_string();
            let message = value["error"]["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| format!("HTTP {status}: {value}"));
            Err((code, message))
        }
    }

    fn get(&self, path: &str) -> Result<Value, Failure> {
        self.finish(self.auth(self.agent.get(self.url(path))).call())
    }

    fn post(&self, path: &str, body: Option<Value>) -> Result<Value, Failure> {
        let request = self.auth(self.agent.post(self.url(path)));
        self.finish(match body {
            Some(body) => request.send_json(body),
            None => request.send_empty(),
        })
    }
}

/// Shows elapsed time on a terminal while something takes more than a moment.
struct Progress {
    done: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    fn start(what: String) -> Self {
        let done = Arc::new(AtomicBool::new(false));
        let thread = std::io::stderr().is_terminal().then(|| {
            let done = Arc::clone(&done);
            std::thread::spawn(move || {
                let started = Instant::now();
                let mut shown = false;
                while !done.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(100));
                    if started.elapsed() > Duration::from_millis(500) {
                        eprint!("\r{what}… {:.1}s", started.elapsed().as_secs_f64());
                        shown = true;
                    }
                }
                if shown {
                    eprint!("\r\x1b[2K");
                }
            })
        });
        Progress { done, thread }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.done.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn report<T: serde::de::DeserializeOwned + std::fmt::Display>(
    value: Value,
    json: bool,
) -> ExitCode {
    if json {
        println!("{value}");
        return ExitCode::SUCCESS;
    }
    match serde_json::from_value::<T>(value.clone()) {
        Ok(report) => println!("{report}"),
        Err(_) => println!("{value}"),
    }
    ExitCode::SUCCESS
}

fn done(result: Result<ExitCode, Failure>, json: bool) -> ExitCode {
    result.unwrap_or_else(|(code, message)| super::fail(&code, &message, json))
}

pub fn ps(remote: Remote) -> ExitCode {
    let json = remote.json;
    done(
        Client::new(&remote).get("/api/ps").map(|value| {
            if json {
                println!("{value}");
                return ExitCode::SUCCESS;
            }
            let models: Vec<ModelStatus> =
                serde_json::from_value(value["models"].clone()).unwrap_or_default();
            println!(
                "{:<16} {:<10} {:>8} {:<9} {:>10} {:>10} {:>9} {:>9} {:>9}  UNTIL",
                "NAME", "BACKEND", "PID", "STATE", "RSS", "PEAK", "UPTIME", "REQUESTS", "IN FLIGHT"
            );
            for m in models {
                let until = match m.keep_alive_left_s {
                    None => "forever".to_string(),
                    Some(s) => format!(
                        "{} from now",
                        humantime::format_duration(Duration::from_secs(s as u64))
                    ),
                };
                println!(
                    "{:<16} {:<10} {:>8} {:<9} {:>10} {:>10} {:>9} {:>9} {:>9}  {until}",
                    m.name,
                    m.backend,
                    m.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                    m.state.to_string(),
                    human_bytes(m.rss_bytes),
                    human_bytes(m.peak_rss_bytes),
                    humantime::format_duration(Duration::from_secs(m.uptime_s as u64)).to_string(),
                    m.requests,
                    m.in_flight,
                );
            }
            ExitCode::SUCCESS
        }),
        json,
    )
}

fn human_bytes(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

pub fn load(args: NameArgs) -> ExitCode {
    let _progress = Progress::start(format!("loading {}", args.name));
    let result = Client::new(&args.remote).post(&format!("/api/models/{}/load", args.name), None);
    drop(_progress);
    done(
        result.map(|v| report::<LoadReport>(v, args.remote.json)),
        args.remote.json,
    )
}

pub fn unload(args: NameArgs) -> ExitCode {
    let result = Client::new(&args.remote).post(&format!("/api/models/{}/unload", args.name), None);
    done(
        result.map(|v| report::<UnloadReport>(v, args.remote.json)),
        args.remote.json,
    )
}

pub fn swap(args: SwapArgs) -> ExitCode {
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

pub fn embed(args: EmbedArgs) -> ExitCode {
    let json = args.remote.json;
    let _progress = Progress::start(format!("embedding with {}", args.name));
    let result = Client::new(&args.remote).post(
        "/v1/embeddings",
        Some(json!({ "model": args.name, "input": args.texts })),
    );
    drop(_progress);
    done(
        result.map(|value| {
            if json {
                println!("{value}");
            } else {
                for item in value["data"].as_array().into_iter().flatten() {
                    println!("{}", item["embedding"]);
                }
            }
            ExitCode::SUCCESS
        }),
        json,
    )
}

/// Streams the answer to stdout as it is generated.
pub fn generate(args: GenerateArgs) -> ExitCode {
    let client = Client::new(&args.remote);
    let json = args.remote.json;
    let mut body = json!({
        "model": args.name,
        "messages": [{ "role": "user", "content": args.prompt }],
        "stream": true,
        "stream_options": { "include_usage": true },
    });
    if let Some(n) = args.max_tokens {
        body["max_tokens"] = json!(n);
    }
    if let Some(t) = args.temperature {
        body["temperature"] = json!(t);
    }
    let progress = Progress::start(format!("waiting for {}", args.name));
    let response = client
        .auth(client.agent.post(client.url("/v1/chat/completions")))
        .send_json(body);
    let result = (|| -> Result<ExitCode, Failure> {
        let response = response.map_err(|e| {
            (
                "unreachable".to_string(),
                format!("cannot reach berth at {}: {e}", args.remote.url),
            )
        })?;
        if !response.status().is_success() {
            drop(progress);
            return client.finish(Ok(response)).map(|_| ExitCode::FAILURE);
        }
        let mut progress = Some(progress);
        let reader = BufReader::new(response.into_body().into_reader());
        let mut stdout = std::io::stdout();
        for line in reader.lines() {
            let line = line.map_err(|e| ("io_error".to_string(), e.to_string()))?;
            let Some(data) = line.strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                break;
            }
            progress.take();
            let event: Value = serde_json::from_str(data).unwrap_or(Value::Null);
            if let Some(message) = event["error"]["message"].as_str() {
                return Err((
                    event["error"]["code"]
                        .as_str()
                        .unwrap_or("error")
                        .to_string(),
                    message.to_string(),
                ));
            }
            if json {
                println!("{event}");
                continue;
            }
            if let Some(text) = event["choices"][0]["delta"]["content"].as_str() {
                print!("{text}");
                let _ = stdout.flush();
            }
        }
        if !json {
            println!();
        }
        Ok(ExitCode::SUCCESS)
    })();
    done(result, json)
}
