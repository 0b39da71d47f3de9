//! `config-svc`: the config service binary (see the library for what it serves).

use clap::Parser;
use config_svc::ConfigSvcSettings;

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
    agent_telemetry::init_telemetry(agent_telemetry::SERVICE_LOG_FILTER, "config-svc");
    let cli = Cli::parse();
    let shutdown = agent_bus::stop_on_signal();
    let ran = config_svc::run(cli.settings, shutdown).await;
    // Its last spans (its drain's) are exported before the process ends.
    agent_telemetry::flush_spans(std::time::Duration::from_secs(2)).await;
    ran
}
