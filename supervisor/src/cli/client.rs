//! The CLI as a client of a running `berth serve`: `ps`, `load`, `unload`,
//! `swap`, `embed`, `generate`.

use std::io::{self, BufRead, BufReader, IsTerminal, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
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
    /// The daemon's URL, or `unix:/path` for a daemon listening on a unix
    /// socket.
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

/// A response: its status and its body as a stream of bytes.
struct Reply {
    status: u16,
    body: Box<dyn Read>,
}

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

    fn unreachable(&self, e: impl std::fmt::Display) -> Failure {
        (
            "unreachable".to_string(),
            format!(
                "cannot reach berth at {}: {e}; is `berth serve` running?",
                self.remote.url
            ),
        )
    }

    /// Sends a GET (no body) or a POST (a JSON body or none).
    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> Result<Reply, Failure> {
        if let Some(socket) = self.remote.url.strip_prefix("unix:") {
            return unix_request(
                Path::new(socket),
                method,
                path,
                self.remote.token.as_deref(),
                body,
            )
            .map_err(|e| self.unreachable(e));
        }
        let url = self.url(path);
        let result = match (method, body) {
            ("GET", _) => self.auth(self.agent.get(url)).call(),
            (_, Some(body)) => self.auth(self.agent.post(url)).send_json(body),
            // Always JSON: the daemon refuses a POST of any other type.
            (_, None) => self
                .auth(self.agent.post(url))
                .send_json(serde_json::json!({})),
        };
        let response = result.map_err(|e| self.unreachable(e))?;
        Ok(Reply {
            status: response.status().as_u16(),
            body: Box::new(response.into_body().into_reader()),
        })
    }

    fn finish(&self, reply: Reply) -> Result<Value, Failure> {
        let Reply { status, mut body } = reply;
        let mut text = String::new();
        body.read_to_string(&mut text)
            .map_err(|e| ("io_error".to_string(), e.to_string()))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if (200..300).contains(&status) {
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
        self.finish(self.send("GET", path, None)?)
    }

    fn post(&self, path: &str, body: Option<Value>) -> Result<Value, Failure> {
        self.finish(self.send("POST", path, body.as_ref())?)
    }
}

/// HTTP/1.1 over a unix socket, one request per connection: what `berth
/// serve --listen unix:/path` speaks. The body comes back as it arrives
/// (chunked or sized), so streamed answers stream.
fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&Value>,
) -> io::Result<Reply> {
    let mut stream = UnixStream::connect(socket)?;
    // Always JSON: the daemon refuses a POST of any other type.
    let payload = match body {
        Some(body) => Some(body.to_string()),
        None if method != "GET" => Some("{}".to_string()),
        None => None,
    };
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    if let Some(token) = token {
        head.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    match &payload {
        Some(p) => head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            p.len()
        )),
        None if method != "GET" => head.push_str("Content-Length: 0\r\n"),
        None => {}
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    if let Some(p) = &payload {
        stream.write_all(p.as_bytes())?;
    }
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("not an HTTP response: {:?}", line.trim_end()),
            )
        })?;
    let (mut chunked, mut length) = (false, None);
    loop {
        line.clear();
        if reader.read_line(&mut line)? == 0 || line.trim_end().is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let (name, value) = (name.trim(), value.trim());
            if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.eq_ignore_ascii_case("chunked");
            } else if name.eq_ignore_ascii_case("content-length") {
                length = value.parse::<u64>().ok();
            }
        }
    }
    let body: Box<dyn Read> = match (chunked, length) {
        (true, _) => Box::new(Chunked {
            inner: reader,
            left: 0,
            done: false,
        }),
        (false, Some(n)) => Box::new(reader.take(n)),
        (false, None) => Box::new(reader),
    };
    Ok(Reply { status, body })
}

/// A chunked HTTP/1.1 body, decoded as it is read.
struct Chunked<R> {
    inner: R,
    /// Bytes left in the current chunk.
    left: u64,
    done: bool,
}

impl<R: BufRead> Read for Chunked<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.done || buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            let mut line = String::new();
            self.inner.read_line(&mut line)?;
            let size = line.trim().split(';').next().unwrap_or_default().trim();
            self.left = u64::from_str_radix(size, 16).map_err(|_| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad chunk size {:?}", line.trim_end()),
                )
            })?;
            if self.left == 0 {
                self.done = true;
                return Ok(0);
            }
        }
        let want = buf
            .len()
            .min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        self.left -= n as u64;
        if self.left == 0 {
            // The CRLF that ends the chunk.
            let mut crlf = String::new();
            self.inner.read_line(&mut crlf)?;
        }
        Ok(n)
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
            // GPU columns only where a model is on one.
            let gpu = models
                .iter()
                .any(|m| m.vram_bytes.is_some() || !m.gpus.is_empty());
            let mut header = format!(
                "{:<16} {:<10} {:>8} {:<9} {:>10} {:>10}",
                "NAME", "BACKEND", "PID", "STATE", "RSS", "PEAK"
            );
            if gpu {
                header += &format!(" {:>10} {:<5}", "VRAM", "GPU");
            }
            println!(
                "{header} {:>9} {:>9} {:>9}  UNTIL",
                "UPTIME", "REQUESTS", "IN FLIGHT"
            );
            for m in models {
                let until = match m.keep_alive_left_s {
                    None => "forever".to_string(),
                    Some(s) => format!(
                        "{} from now",
                        humantime::format_duration(Duration::from_secs(s as u64))
                    ),
                };
                let mut line = format!(
                    "{:<16} {:<10} {:>8} {:<9} {:>10} {:>10}",
                    m.name,
                    m.backend,
                    m.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                    m.state.to_string(),
                    human_bytes(m.rss_bytes),
                    human_bytes(m.peak_rss_bytes),
                );
                if gpu {
                    let gpus: Vec<String> = m.gpus.iter().map(u32::to_string).collect();
                    line += &format!(
                        " {:>10} {:<5}",
                        m.vram_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
                        if gpus.is_empty() {
                            "-".into()
                        } else {
                            gpus.join(",")
                        }
                    );
                }
                println!(
                    "{line} {:>9} {:>9} {:>9}  {until}",
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

/// `berth gpus`: each device's memory and berth's workers on it.
pub fn gpus(remote: Remote) -> ExitCode {
    let json = remote.json;
    done(
        Client::new(&remote).get("/api/gpus").map(|value| {
            if json {
                println!("{value}");
                return ExitCode::SUCCESS;
            }
            let status: berth::gpu::GpuStatus = match serde_json::from_value(value.clone()) {
                Ok(status) => status,
                Err(_) => {
                    println!("{value}");
                    return ExitCode::SUCCESS;
                }
            };
            if let Some(reason) = &status.unavailable {
                println!("no GPU: {reason}");
                return ExitCode::SUCCESS;
            }
            println!(
                "{:<4} {:<28} {:>10} {:>10} {:>10} {:>10}  PROCESSES",
                "GPU", "NAME", "TOTAL", "USED", "FREE", "BERTH"
            );
            for d in &status.devices {
                let processes: Vec<String> = d
                    .processes
                    .iter()
                    .map(|p| {
                        format!(
                            "{} {} ({})",
                            p.pid,
                            p.model.as_deref().unwrap_or("not berth's"),
                            human_bytes(p.bytes)
                        )
                    })
                    .collect();
                println!(
                    "{:<4} {:<28} {:>10} {:>10} {:>10} {:>10}  {}",
                    d.index,
                    d.name,
                    human_bytes(d.total_bytes),
                    human_bytes(d.used_bytes),
                    human_bytes(d.free_bytes),
                    human_bytes(d.berth_bytes),
                    if processes.is_empty() {
                        "-".into()
                    } else {
                        processes.join(", ")
                    }
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
    let result = (|| -> Result<ExitCode, Failure> {
        let reply = client.send("POST", "/v1/chat/completions", Some(&body))?;
        if !(200..300).contains(&reply.status) {
            drop(progress);
            return client.finish(reply).map(|_| ExitCode::FAILURE);
        }
        let mut progress = Some(progress);
        let reader = BufReader::new(reply.body);
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
