//! `berth embed`: embeds texts with a model through the daemon's
//! OpenAI-compatible `/v1/embeddings`, one vector a line. Its own file so
//! each command reads on its own.

use std::process::ExitCode;

use clap::Args;
use serde_json::json;

use super::http::{Client, Remote};
use super::output::{Progress, done};

#[derive(Debug, Args)]
pub struct EmbedArgs {
    pub name: String,
    #[arg(required = true)]
    texts: Vec<String>,
    #[command(flatten)]
    remote: Remote,
}

pub fn run(args: EmbedArgs) -> ExitCode {
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
