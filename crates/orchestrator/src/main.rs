//! `agent-orchestrator`: parses settings and runs the orchestrator until SIGINT or SIGTERM.

/// mimalloc rather than glibc's malloc: allocation was a tenth of a busy process's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;

#[derive(Parser)]
#[command(
    version,
    about = "Stateless agent orchestrator over Pulsar (TrustGraph-compatible)"
)]
struct Args {
    #[command(flatten)]
    settings: agent_orchestrator::Settings,
}

fn main() -> anyhow::Result<()> {
    agent_orchestrator::runtime()?.block_on(async {
        agent_telemetry::init_telemetry(agent_telemetry::SERVICE_LOG_FILTER, "agent-orchestrator");
        let args = Args::parse();
        let shutdown = agent_bus::stop_on_signal();
        let ran = agent_orchestrator::run(args.settings, shutdown).await;
        // Its last spans (its drain's) are exported before the process ends.
        agent_telemetry::flush_spans(std::time::Duration::from_secs(2)).await;
        ran
    })
}
