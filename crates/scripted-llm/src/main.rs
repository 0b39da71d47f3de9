//! `scripted-llm`: serves a script file as an OpenAI-compatible endpoint until interrupted.

use std::net::SocketAddr;

use anyhow::Context;
use clap::Parser;
use scripted_llm::{Script, ScriptedLlm};

#[derive(Parser)]
#[command(about = "An OpenAI-compatible chat completions server that answers from a script file")]
struct Args {
    /// The script (JSON): {"rules": [{"match", "reply", "faults", ...}], "default_reply"}.
    #[arg(long)]
    script: std::path::PathBuf,
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8089")]
    addr: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let args = Args::parse();
    let text = std::fs::read_to_string(&args.script)
        .with_context(|| format!("reading {}", args.script.display()))?;
    let script =
        Script::from_json(&text).with_context(|| format!("parsing {}", args.script.display()))?;
    // Nothing can read its requests back from outside: it keeps none, however long it runs.
    let server = ScriptedLlm::start_keeping(script, args.addr, 0).await?;
    println!("{}", server.base_url());
    tokio::signal::ctrl_c().await?;
    server.stop();
    Ok(())
}
