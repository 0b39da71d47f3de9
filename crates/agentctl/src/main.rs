//! `agentctl`: the command line of the agent service.

/// mimalloc rather than glibc's malloc: allocation was a tenth of a busy process's CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod bench;
mod bench_graph;
mod bench_long;
mod config;
mod control;
mod fork;
mod graph;
mod invoke;
mod terminal;
mod tools;
mod up;

use clap::{Parser, Subcommand};

/// How long a command waits for the broker to take its connection before it says so: long
/// enough for a broker that is restarting (Apache Pulsar's standalone takes 10-20 s), short next
/// to the minutes the client would try a host that does not answer.
const BROKER_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

#[derive(Parser)]
#[command(version, about = "Invoke agents, run the local stack, benchmark")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Publish a request and print the dialog as it streams.
    Invoke(invoke::InvokeArgs),
    /// Run the whole stack in this process on embedded defaults (pulsar-lite, scripted or real LLM).
    Up(up::UpArgs),
    /// Measure the aggregator's write throughput and the explain query's latency as the graph grows.
    BenchGraph(bench_graph::GraphBenchArgs),
    /// Stop a running dialog (and every subagent under it); the graph records who and when.
    Cancel(control::CancelArgs),
    /// Run a tool call that waits for approval (optionally with other arguments).
    Approve(control::ApproveArgs),
    /// Refuse a tool call that waits for approval; the agent goes on without it.
    Deny(control::DenyArgs),
    /// Start a new session from the recorded input of any step of a dialog, optionally edited.
    Fork(fork::ForkArgs),
    /// Show a session's provenance as a tree, JSON, DOT or Mermaid.
    Explain(graph::ExplainArgs),
    /// Run a SPARQL query against the graph store.
    Sparql(graph::SparqlArgs),
    /// Load an RDF file into a collection that knowledge tools read.
    Load(graph::LoadArgs),
    /// Which tools a request with a given group and state would see.
    Tools(tools::ToolsArgs),
    /// Measure latency and throughput on an embedded broker with an instant scripted LLM.
    Bench(bench::BenchArgs),
    /// Measure one long dialog: bytes per message and per dialog, store growth, step times.
    BenchLong(bench_long::LongBenchArgs),
    /// Read and change the agent config through config-svc's REST API; seed and validate files.
    Config(config::ConfigArgs),
}

fn main() {
    // `up` and `bench` run the orchestrator in this process: its runtime, with room for a step.
    let runtime = match agent_orchestrator::runtime() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("agentctl: no runtime: {e}");
            std::process::exit(1);
        }
    };
    runtime.block_on(run());
}

async fn run() {
    agent_telemetry::init_logging("warn,pulsar=error");
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let result = match cli.command {
        Command::Invoke(args) => invoke::run(args).await,
        Command::Up(args) => {
            let llm = matches
                .subcommand_matches("up")
                .is_some_and(up::names_an_llm);
            up::run(args, llm).await
        }
        Command::Bench(args) => bench::run(args).await,
        Command::BenchGraph(args) => bench_graph::run(args).await,
        Command::BenchLong(args) => bench_long::run(args).await,
        Command::Cancel(args) => control::cancel(args).await,
        Command::Approve(args) => control::approve(args).await,
        Command::Deny(args) => control::deny(args).await,
        Command::Fork(args) => fork::run(args).await,
        Command::Explain(args) => graph::explain(args).await,
        Command::Sparql(args) => graph::sparql(args).await,
        Command::Load(args) => graph::load(args).await,
        Command::Tools(args) => tools::run(args).await,
        Command::Config(args) => config::run(args).await,
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("agentctl: {e:#}");
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `up --llm-base-url` names the LLM as `OPENAI_BASE_URL` does. Before, only the variable
    /// did: the flag, offered by `up --help`, was overwritten with the scripted server's URL.
    #[test]
    fn up_takes_the_llm_its_flag_names() {
        let up = |args: &[&str]| {
            let matches = Cli::command()
                .try_get_matches_from([&["agentctl", "up"][..], args].concat())
                .unwrap_or_else(|e| panic!("{e}"));
            matches
                .subcommand_matches("up")
                .is_some_and(up::names_an_llm)
        };
        assert!(up(&["--llm-base-url", "http://127.0.0.1:9/v1"]));
        if std::env::var_os("OPENAI_BASE_URL").is_none() {
            assert!(!up(&[]), "the scripted LLM by default");
        }
    }
}
