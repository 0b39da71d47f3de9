//! `agent-orchestrator`: parses settings and runs the orchestrator until SIGINT or SIGTERM.

use clap::Parser;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    version,
    about = "Stateless agent orchestrator over Pulsar (TrustGraph-compatible)"
)]
struct Args {
    #[command(flatten)]
    settings: agent_orchestrator::Settings,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new("info,pulsar::retry_op=error")
            }),
        )
        .init();
    let args = Args::parse();
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        agent_bus::shutdown_signal().await;
        tracing::info!("shutting down");
        trigger.cancel();
    });
    agent_orchestrator::run(args.settings, shutdown).await
}
