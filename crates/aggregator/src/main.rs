//! `agent-aggregator`: parses settings and runs the aggregator until SIGINT or SIGTERM.

/// mimalloc rather than glibc's malloc: allocation was a tenth of a busy process's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;

#[derive(Parser)]
#[command(
    version,
    about = "Writes agent provenance into the graph store and serves it over SPARQL"
)]
struct Args {
    #[command(flatten)]
    settings: agent_aggregator::AggregatorSettings,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    agent_telemetry::init_telemetry(agent_telemetry::SERVICE_LOG_FILTER, "agent-aggregator");
    let args = Args::parse();
    let shutdown = agent_bus::stop_on_signal();
    let ran = agent_aggregator::run(args.settings, shutdown).await;
    // Its last spans (its drain's) are exported before the process ends.
    agent_telemetry::flush_spans(std::time::Duration::from_secs(2)).await;
    ran
}
