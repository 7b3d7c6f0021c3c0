//! `berth generate`: chats with a model through the daemon's
//! OpenAI-compatible `/v1/chat/completions`, printing the answer as it
//! streams in (server-sent events). Its own file because it is the one
//! command that reads its reply as a stream.

use std::io::{BufRead, BufReader, Write};
use std::process::ExitCode;

use clap::Args;
use serde_json::{Value, json};

use super::http::{Client, Failure, Remote};
use super::output::{Progress, done};

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

/// Streams the answer to stdout as it is generated.
pub fn run(args: GenerateArgs) -> ExitCode {
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
