//! `config-svc`: the config service binary (see the library for what it serves).

use clap::Parser;
use config_svc::ConfigSvcSettings;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "config-svc",
    about = "The agent config API over Pulsar and REST"
)]
struct Cli {
    #[command(flatten)]
    settings: ConfigSvcSettings,
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
    let cli = Cli::parse();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone();
    tokio::spawn(async move {
        agent_bus::shutdown_signal().await;
        stop.cancel();
    });
    config_svc::run(cli.settings, shutdown).await
}
