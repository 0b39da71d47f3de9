//! `agentctl up`: the whole stack in one process on embedded defaults — a pulsar-lite broker, the
//! orchestrator, the aggregator with an embedded graph store and its SPARQL endpoint, and the scripted
//! LLM unless `OPENAI_BASE_URL` points at a real one.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use agent_aggregator::AggregatorSettings;
use agent_bus::embedded::{free_port, EmbeddedBroker};
use agent_bus::AgentClient;
use agent_graph::GraphStore;
use agent_orchestrator::Settings;
use anyhow::Context;
use scripted_llm::{Script, ScriptedLlm};
use tokio_util::sync::CancellationToken;

use crate::invoke::{invoke, InvokeArgs, Renderer};

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// Broker port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 6650)]
    port: u16,
    /// Where the embedded broker keeps its data.
    #[arg(long, default_value = ".data/broker")]
    data_dir: PathBuf,
    /// Where the embedded graph store keeps the provenance.
    #[arg(long, default_value = ".data/graph")]
    graph_dir: PathBuf,
    /// Port of the aggregator's SPARQL endpoint on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 7878)]
    sparql_port: u16,
    /// The scripted LLM's script, used when no LLM is named (--llm-base-url, OPENAI_BASE_URL).
    #[arg(long, default_value = "examples/demo-script.json")]
    script: PathBuf,
    /// Ask this question once the stack is up, print the dialog and its provenance, then stop.
    #[arg(short, long)]
    question: Option<String>,
    /// Keep serving after the question was answered.
    #[arg(long)]
    stay: bool,
    #[command(flatten)]
    settings: Settings,
}

/// Whether `up` was given an LLM to use (`--llm-base-url` or `OPENAI_BASE_URL`), rather than
/// left to the scripted one.
pub fn names_an_llm(matches: &clap::ArgMatches) -> bool {
    matches
        .value_source("llm_base_url")
        .is_some_and(|source| source != clap::parser::ValueSource::DefaultValue)
}

/// Runs the stack; `llm_named`: an LLM endpoint was given ([`names_an_llm`]), so the scripted
/// one is not started.
pub async fn run(args: UpArgs, llm_named: bool) -> anyhow::Result<i32> {
    let UpArgs {
        port,
        data_dir,
        graph_dir,
        sparql_port,
        script,
        question,
        stay,
        mut settings,
    } = args;
    let broker = EmbeddedBroker::start(port, Some(&data_dir))
        .with_context(|| format!("starting pulsar-lite on port {port}"))?;
    settings.broker.pulsar_url = broker.url();
    eprintln!(
        "broker        {} (pulsar-lite, data in {})",
        broker.url(),
        data_dir.display()
    );

    // A real endpoint when one is configured, the scripted one otherwise, so the demo runs offline.
    let _scripted = if llm_named {
        eprintln!(
            "llm           {} (model {})",
            settings.llm_base_url, settings.llm_model
        );
        None
    } else {
        let text = std::fs::read_to_string(&script)
            .with_context(|| format!("reading the LLM script {}", script.display()))?;
        // Nothing reads its requests back here: it keeps none, however long it runs.
        let server =
            ScriptedLlm::start_keeping(Script::from_json(&text)?, "127.0.0.1:0".parse()?, 0)
                .await?;
        settings.llm_base_url = server.base_url();
        settings.llm_model = "scripted".to_owned();
        eprintln!(
            "llm           {} (scripted, {})",
            server.base_url(),
            script.display()
        );
        Some(server)
    };

    let shutdown = CancellationToken::new();
    let sparql_port = if sparql_port == 0 {
        free_port()?
    } else {
        sparql_port
    };
    let sparql_addr: SocketAddr = ([127, 0, 0, 1], sparql_port).into();
    // The orchestrator journals its iterations in the aggregator's store, through its endpoint.
    let token = uuid::Uuid::new_v4().simple().to_string();
    let mut aggregator_settings =
        AggregatorSettings::embedded(settings.broker.clone(), graph_dir.clone(), sparql_addr);
    aggregator_settings.config_token = Some(token.clone());
    // The same bounds on the SPARQL endpoint's connections as on the orchestrator's.
    aggregator_settings.http = settings.http.clone();
    // Both services are in this process: a fresh secret seals what they send each other. Nobody
    // else can hold a fresh one, so `agentctl cancel` and `approve` from another shell cannot seal
    // their messages: sent `--unsealed`, they are acted on, counted and logged (set
    // AGENT_SEAL_KEY to require them sealed).
    let seal = match settings.seal_key.clone().filter(|k| !k.trim().is_empty()) {
        Some(given) => given,
        None => {
            settings.control_seals = agent_orchestrator::settings::SealRule::Warn;
            eprintln!("seal key      a fresh one (no AGENT_SEAL_KEY): control messages are taken unsealed (agentctl cancel/approve/deny --unsealed), whatever --control-seals says");
            uuid::Uuid::new_v4().simple().to_string()
        }
    };
    aggregator_settings.seal_key = Some(seal.clone());
    settings.seal_key = Some(seal);
    let mut aggregator = tokio::spawn(agent_aggregator::run(aggregator_settings, shutdown.clone()));
    let endpoint = format!("http://{sparql_addr}");
    settings.graph_store = Some(endpoint.clone());
    settings.journal_owner_in_process = true;
    settings.config_token = Some(token);
    eprintln!(
        "graph store   {} (oxigraph), SPARQL at {endpoint}/query",
        graph_dir.display()
    );
    until_listening(sparql_addr, &aggregator).await;
    // Embedded: its health and metrics endpoint on a free loopback port (it logs which).
    settings.http_addr = ([127, 0, 0, 1], 0).into();
    let topics = settings.topics();
    let mut orchestrator =
        tokio::spawn(agent_orchestrator::run(settings.clone(), shutdown.clone()));
    eprintln!("orchestrator  requests on {}", topics.request);
    eprintln!("              responses on {}", topics.response);

    let mut code = 0;
    if let Some(question) = question {
        let bus = settings.broker.connect().await?;
        let mut client = AgentClient::connect(&bus, &topics).await?;
        let invoke_args = InvokeArgs {
            question: question.clone(),
            pattern: String::new(),
            groups: Vec::new(),
            state: None,
            no_streaming: false,
            json: false,
            explain: false,
            timeout: 300,
            graph_store: Some(endpoint.clone()),
            graph_token: settings.config_token.clone(),
            broker: settings.broker.clone(),
        };
        println!("\nQuestion: {question}\n");
        // A service that stopped (its port taken, its store unreadable) is reported at once:
        // the question alone would wait out its timeout, then name only that.
        let mut renderer = Renderer::new(false, false);
        let outcome = tokio::select! {
            outcome = invoke(&mut client, &invoke_args, &mut renderer) => outcome?,
            finished = &mut orchestrator => {
                finished?.context("the orchestrator stopped")?;
                anyhow::bail!("the orchestrator stopped before the dialog ended")
            }
            finished = &mut aggregator => {
                finished?.context("the aggregator stopped")?;
                anyhow::bail!("the aggregator stopped before the dialog ended")
            }
        };
        if let Some((session, _)) = outcome.provenance.first() {
            show_provenance(&endpoint, session).await?;
        }
        code = outcome.exit_code();
        if !stay {
            shutdown.cancel();
        }
    }
    if !shutdown.is_cancelled() {
        eprintln!("\nready; Ctrl-C stops (try: agentctl invoke -q \"How many hours are in a leap year?\")");
        tokio::select! {
            _ = agent_bus::shutdown_signal() => {}
            finished = &mut orchestrator => finished??,
            finished = &mut aggregator => finished??,
        }
    }
    shutdown.cancel();
    if !orchestrator.is_finished() {
        orchestrator.await??;
    }
    if !aggregator.is_finished() {
        aggregator.await??;
    }
    // Producers and consumers close in background tasks when dropped; give them a moment before
    // the broker goes, or each logs a "could not close ... Disconnected" error.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok(code)
}

/// Reads the run back from the graph store, as an auditor would. The aggregator writes
/// asynchronously, so this first waits for the conclusion to land.
async fn show_provenance(endpoint: &str, session: &str) -> anyhow::Result<()> {
    let store = GraphStore::open(endpoint, None)?;
    for _ in 0..200 {
        if let Ok(true) = agent_graph::recorded::concluded(&store, session).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let view = crate::graph::load_session(&store, session).await?;
    println!("\nProvenance, read back from the graph store:\n");
    // Rendered as `explain` renders it: what a model or a tool wrote is shown, never acted on by
    // the terminal.
    print!(
        "{}",
        crate::graph::render(&view, crate::graph::Format::Tree, false)?
    );
    println!(
        "\nMore: agentctl explain --last [--format json|dot|mermaid], agentctl sparql 'SELECT ...'"
    );
    Ok(())
}

/// Waits until the in-process aggregator `task` listens on `addr` (a few milliseconds), at most
/// 10 s: the orchestrator probes the journal at start, and would log that it does not answer yet.
/// An aggregator that fails to start is reported by whoever awaits `task`.
pub async fn until_listening<T>(addr: std::net::SocketAddr, task: &tokio::task::JoinHandle<T>) {
    let listening = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_err()
        && tokio::time::Instant::now() < listening
        && !task.is_finished()
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
