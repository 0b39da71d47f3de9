//! `agentctl up`: the whole stack in one process on embedded defaults — a pulsar-lite broker, the
//! orchestrator, and the scripted LLM unless `OPENAI_BASE_URL` points at a real one.

use std::path::PathBuf;

use agent_bus::embedded::EmbeddedBroker;
use agent_bus::{AgentClient, Bus};
use agent_core::provenance::describe;
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
    /// The scripted LLM's script, used when OPENAI_BASE_URL is not set.
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

pub async fn run(args: UpArgs) -> anyhow::Result<i32> {
    let UpArgs {
        port,
        data_dir,
        script,
        question,
        stay,
        mut settings,
    } = args;
    let broker = EmbeddedBroker::start(port, Some(&data_dir))
        .with_context(|| format!("starting pulsar-lite on port {port}"))?;
    settings.pulsar_url = broker.url();
    eprintln!(
        "broker        {} (pulsar-lite, data in {})",
        broker.url(),
        data_dir.display()
    );

    // A real endpoint when one is configured, the scripted one otherwise, so the demo runs offline.
    let _scripted = if std::env::var_os("OPENAI_BASE_URL").is_some() {
        eprintln!(
            "llm           {} (model {})",
            settings.llm_base_url, settings.llm_model
        );
        None
    } else {
        let text = std::fs::read_to_string(&script)
            .with_context(|| format!("reading the LLM script {}", script.display()))?;
        let server = ScriptedLlm::start(Script::from_json(&text)?, "127.0.0.1:0".parse()?).await?;
        settings.llm_base_url = server.base_url();
        settings.llm_model = "scripted".to_owned();
        eprintln!(
            "llm           {} (scripted, {})",
            server.base_url(),
            script.display()
        );
        Some(server)
    };

    let topics = settings.topics();
    let shutdown = CancellationToken::new();
    let mut orchestrator =
        tokio::spawn(agent_orchestrator::run(settings.clone(), shutdown.clone()));
    eprintln!("orchestrator  requests on {}", topics.request);
    eprintln!("              responses on {}", topics.response);

    let mut code = 0;
    if let Some(question) = question {
        let bus = Bus::connect(&settings.pulsar_url, None).await?;
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
            pulsar_url: settings.pulsar_url.clone(),
            pulsar_token: None,
            workspace: settings.workspace.clone(),
            flow: settings.flow.clone(),
        };
        println!("\nQuestion: {question}\n");
        let outcome = invoke(&mut client, &invoke_args, &mut Renderer::new(false, false)).await?;
        // Node URIs all start with the session URI; show them relative to it so the lines stay short.
        let session = outcome
            .provenance
            .first()
            .map(|(n, _)| n.clone())
            .unwrap_or_default();
        println!("\nProvenance (PROV-O + tg:, named graph urn:graph:retrieval), S = <{session}>:");
        for (node, triples) in &outcome.provenance {
            println!("  {}", node.replace(&session, "S"));
            for line in describe(triples) {
                println!("    {}", line.replace(&format!("<{session}"), "<S"));
            }
        }
        code = outcome.exit_code();
        if !stay {
            shutdown.cancel();
        }
    }
    if !shutdown.is_cancelled() {
        eprintln!("\nready; Ctrl-C stops (try: agentctl invoke -q \"How many hours are in a leap year?\")");
        tokio::select! {
            _ = agent_orchestrator::settings::shutdown_signal() => shutdown.cancel(),
            finished = &mut orchestrator => return finished?.map(|()| code),
        }
    }
    shutdown.cancel();
    orchestrator.await??;
    Ok(code)
}
