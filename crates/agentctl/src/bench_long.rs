//! `agentctl bench-long`: one long ReACT dialog (by default 100 iterations, each observing 50 KB) on
//! an embedded broker with the scripted LLM, to measure what a dialog's length costs: the bytes of
//! each message, of the whole dialog and of the store, and the time of a step as the dialog grows.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_bus::embedded::EmbeddedBroker;
use agent_bus::{AgentClient, Bus};
use agent_orchestrator::Settings;
use agent_schema::AgentRequest;
use anyhow::Context;
use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition};
use pulsar::{Consumer, SubType, TokioExecutor};
use scripted_llm::{Script, ScriptedLlm};
use tokio_util::sync::CancellationToken;

#[derive(clap::Args, Debug)]
pub struct LongBenchArgs {
    /// ReACT iterations that call a tool before the answer.
    #[arg(long, default_value_t = 100)]
    iterations: usize,
    /// The size of each tool observation, in KiB.
    #[arg(long, default_value_t = 50)]
    observation_kib: usize,
    /// Run without the journal (effectively-once is on by default, as deployed).
    #[arg(long)]
    no_journal: bool,
    /// Run on Apache Pulsar's standalone broker (started here) instead of pulsar-lite.
    #[arg(long)]
    apache: bool,
    #[command(flatten)]
    settings: Settings,
}

/// The tool call asked at iteration `k` (1-based) and the observation it returns; padded so that
/// one never contains another.
fn question_tag(k: usize) -> String {
    format!("q-{k:04}-")
}
fn observation_tag(k: usize) -> String {
    format!("o-{k:04}-")
}

/// The scripted dialog: iteration `k` sees observations 1..k-1 in its prompt and calls the tool
/// with `q-k`; the rule for the newest observation is listed first, so it wins.
fn script(iterations: usize, observation_bytes: usize) -> String {
    let mut rules = vec![
        serde_json::json!({"match": "Request to classify: ", "reply": "{\"choice\": \"general\", \"rationale\": \"bench\"}"}),
        serde_json::json!({"match": "Request to work on: ", "reply": "{\"choice\": \"react\", \"rationale\": \"bench\"}"}),
    ];
    // Observations are words, so a summary or excerpt has something to cut.
    let filler: String = "lorem ipsum dolor sit amet "
        .chars()
        .cycle()
        .take(observation_bytes)
        .collect();
    for k in 1..=iterations {
        rules.push(serde_json::json!({
            "match": question_tag(k),
            "exact": true,
            "reply": format!("{} {filler}", observation_tag(k)),
        }));
    }
    rules.push(serde_json::json!({
        "match": format!("Observation: {}", observation_tag(iterations)),
        "reply": "Thought: all read\nFinal Answer: done",
    }));
    for k in (1..iterations).rev() {
        rules.push(serde_json::json!({
            "match": format!("Observation: {}", observation_tag(k)),
            "reply": format!("Thought: step {}\nAction: llm\nArgs: {{\"question\": \"{}\"}}", k + 1, question_tag(k + 1)),
        }));
    }
    rules.push(serde_json::json!({"match": "Question: warm", "reply": "Thought: ready\nFinal Answer: ready"}));
    rules.push(serde_json::json!({
        "match": "Question: long",
        "reply": format!("Thought: step 1\nAction: llm\nArgs: {{\"question\": \"{}\"}}", question_tag(1)),
    }));
    serde_json::json!({ "rules": rules }).to_string()
}

/// The seed config with limits that let the dialog run as long as asked: the iterations, whole
/// observations, and messages up to Apache Pulsar's default `maxMessageSize` (5 MiB).
fn config_dir(seed: &Path, iterations: usize, observation_bytes: usize) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!(
        "agentctl-bench-long-config-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(seed).with_context(|| format!("reading {}", seed.display()))? {
        let entry = entry?;
        std::fs::copy(entry.path(), dir.join(entry.file_name()))?;
    }
    let limits_path = dir.join("agent-limits.json");
    let mut limits: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&limits_path)?)?;
    let default = limits
        .get_mut("default")
        .and_then(|d| d.as_object_mut())
        .context("agent-limits.json has no default")?;
    default.insert("max_iterations".into(), (iterations + 2).into());
    default.insert(
        "max_observation_bytes".into(),
        (observation_bytes + 1024).into(),
    );
    default.insert("max_message_bytes".into(), (5 * 1024 * 1024).into());
    default.insert("max_tokens".into(), u64::MAX.into());
    default.insert("max_wall_secs".into(), 3600.into());
    std::fs::write(&limits_path, serde_json::to_vec_pretty(&limits)?)?;
    Ok(dir)
}

/// The payload sizes published on a topic while the bench runs, in order.
#[derive(Clone, Default)]
struct Sizes(Arc<Mutex<Vec<usize>>>);

impl Sizes {
    fn all(&self) -> Vec<usize> {
        self.0.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn clear(&self) {
        if let Ok(mut v) = self.0.lock() {
            v.clear();
        }
    }
}

/// Records the size of every message published on `topic` from now on.
async fn watch(bus: &Bus, topic: &str, stop: CancellationToken) -> anyhow::Result<Sizes> {
    let mut consumer: Consumer<Vec<u8>, TokioExecutor> = bus
        .client()
        .consumer()
        .with_topic(topic)
        .with_subscription(format!("bench-long-{:08x}", rand::random::<u32>()))
        .with_subscription_type(SubType::Exclusive)
        .with_consumer_id(rand::random::<u64>() >> 1)
        .with_options(ConsumerOptions {
            initial_position: InitialPosition::Latest,
            ..ConsumerOptions::default()
        })
        .build()
        .await?;
    let sizes = Sizes::default();
    let seen = sizes.clone();
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => break,
                next = consumer.next() => match next {
                    Some(Ok(message)) => {
                        if let Ok(mut v) = seen.0.lock() {
                            v.push(message.payload.data.len());
                        }
                        let _ = consumer.ack(&message).await;
                    }
                    _ => break,
                },
            }
        }
    });
    Ok(sizes)
}

pub async fn run(args: LongBenchArgs) -> anyhow::Result<i32> {
    let observation_bytes = args.observation_kib * 1024;
    // It keeps no requests: their prompts would count in the run's memory.
    let llm = ScriptedLlm::start_keeping(
        Script::from_json(&script(args.iterations, observation_bytes))?,
        "127.0.0.1:0".parse()?,
        0,
    )
    .await?;
    let (_lite, _apache, url) = if args.apache {
        let broker = agent_bus::apache::ApacheBroker::start(0, None)?;
        let url = broker.url();
        (None, Some(broker), url)
    } else {
        let broker = EmbeddedBroker::start(0, None)?;
        let url = broker.url();
        (Some(broker), None, url)
    };
    let mut settings = args.settings.clone();
    settings.broker.pulsar_url = url.clone();
    settings.llm_base_url = llm.base_url();
    settings.llm_model = "scripted".into();
    settings.config_dir = config_dir(&settings.config_dir, args.iterations, observation_bytes)?;
    settings.http_addr = ([127, 0, 0, 1], 0).into();
    let topics = settings.topics();
    let shutdown = CancellationToken::new();

    // An aggregator with its embedded store, as `agentctl up` runs it: it stores provenance, and
    // the journal when on.
    let store_dir = std::env::temp_dir().join(format!(
        "agentctl-bench-long-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], agent_bus::embedded::free_port()?).into();
    let token = uuid::Uuid::new_v4().simple().to_string();
    let mut aggregator = agent_aggregator::AggregatorSettings::embedded(
        settings.broker.clone(),
        store_dir.clone(),
        addr,
    );
    aggregator.config_token = Some(token.clone());
    let seal = uuid::Uuid::new_v4().simple().to_string();
    aggregator.seal_key = Some(seal.clone());
    settings.seal_key = Some(seal);
    if !args.no_journal {
        settings.graph_store = Some(format!("http://{addr}"));
        settings.journal_owner_in_process = true;
        settings.config_token = Some(token.clone());
    } else {
        settings.graph_store = None;
    }
    let store = agent_graph::GraphStore::open(&format!("http://{addr}"), Some(token))?;
    let aggregator = tokio::spawn(agent_aggregator::run(aggregator, shutdown.clone()));
    crate::up::until_listening(addr, &aggregator).await;
    let services = [
        aggregator,
        tokio::spawn(agent_orchestrator::run(settings.clone(), shutdown.clone())),
    ];

    let bus = Bus::connect(&url, settings.broker.pulsar_token.as_deref()).await?;
    let requests = watch(&bus, &topics.request, shutdown.clone()).await?;
    let explanations = watch(&bus, &topics.explainability, shutdown.clone()).await?;
    let mut client = AgentClient::connect(&bus, &topics).await?;
    // A short dialog first, so the measured one finds the services ready (config read, the
    // journal answering, producers made).
    let warm = format!("bench-long-warm-{:08x}", rand::random::<u32>());
    client
        .send(
            &warm,
            &AgentRequest {
                question: "warm".into(),
                ..AgentRequest::default()
            },
        )
        .await?;
    loop {
        let (rid, response) = tokio::time::timeout(Duration::from_secs(60), client.next())
            .await
            .context("the warm-up dialog did not finish within 60 s")??;
        if rid == warm && response.end_of_dialog {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    requests.clear();
    explanations.clear();
    println!(
        "\nagentctl bench-long: {} {url}, {} tool iterations observing {} KiB each, journal {}",
        if args.apache {
            "Apache Pulsar"
        } else {
            "pulsar-lite"
        },
        args.iterations,
        args.observation_kib,
        if args.no_journal { "off" } else { "on" },
    );

    let request = AgentRequest {
        question: "long".into(),
        collection: "default".into(),
        streaming: false,
        ..AgentRequest::default()
    };
    let id = format!("bench-long-{:08x}", rand::random::<u32>());
    let started = Instant::now();
    client.send(&id, &request).await?;
    // When each observation reached the client: step k's time is the gap to the one before.
    let mut observed: Vec<Duration> = Vec::new();
    let mut response_bytes = 0usize;
    let ending = loop {
        let (rid, response) = tokio::time::timeout(Duration::from_secs(600), client.next())
            .await
            .context("the dialog did not finish within 10 minutes")??;
        if rid != id {
            continue;
        }
        response_bytes += serde_json::to_vec(&response)?.len();
        if response.message_type == "observation" {
            observed.push(started.elapsed());
        }
        if response.end_of_dialog {
            break response;
        }
    };
    let total = started.elapsed();
    // The last messages reach the watchers after the client.
    tokio::time::sleep(Duration::from_millis(500)).await;

    match ending.message_type.as_str() {
        "answer" => println!(
            "ended: answered after {} observations in {:.1} s",
            observed.len(),
            total.as_secs_f64()
        ),
        other => println!(
            "ended: {other} after {} observations in {:.1} s: {}",
            observed.len(),
            total.as_secs_f64(),
            ending
                .error
                .as_ref()
                .map_or(ending.content.as_str(), |e| e.message.as_str())
        ),
    }
    let iteration_sizes = requests.all();
    let kib = |b: usize| b as f64 / 1024.0;
    let at = |sizes: &[usize], k: usize| sizes.get(k.saturating_sub(1)).copied();
    println!(
        "request topic: {} messages, the client's {:.1} KiB, the largest {:.1} KiB",
        iteration_sizes.len(),
        kib(iteration_sizes.first().copied().unwrap_or(0)),
        kib(iteration_sizes.iter().copied().max().unwrap_or(0)),
    );
    // The client's request, then the routed one, then one after each tool iteration.
    for k in milestones(args.iterations) {
        if let Some(bytes) = at(&iteration_sizes, k + 2) {
            println!(
                "  next request after iteration {k:>4}: {:>9.1} KiB",
                kib(bytes)
            );
        }
    }
    let explain_bytes: usize = explanations.all().iter().sum();
    let request_bytes: usize = iteration_sizes.iter().sum();
    println!(
        "bytes per dialog: requests {:.1} MiB, responses {:.1} MiB (as JSON), explainability {:.1} MiB",
        request_bytes as f64 / 1048576.0,
        response_bytes as f64 / 1048576.0,
        explain_bytes as f64 / 1048576.0
    );
    let step = |k: usize| -> Option<f64> {
        let end = observed.get(k.checked_sub(1)?)?;
        let start = if k == 1 {
            Duration::ZERO
        } else {
            *observed.get(k - 2)?
        };
        Some((*end - start).as_secs_f64() * 1000.0)
    };
    println!("step times (from one observation to the next; step 1 includes routing):");
    for k in milestones(args.iterations) {
        if let Some(ms) = step(k) {
            println!("  step {k:>4}: {ms:>8.1} ms");
        }
    }
    let (quads, literal_bytes) = store_size(&store).await?;
    println!(
        "store: {quads} quads, {:.1} MiB of literal text (provenance and journal)",
        literal_bytes as f64 / 1048576.0
    );
    shutdown.cancel();
    drop(client);
    for service in services {
        let _ = tokio::time::timeout(Duration::from_secs(10), service).await;
    }
    let _ = std::fs::remove_dir_all(&store_dir);
    let _ = std::fs::remove_dir_all(&settings.config_dir);
    Ok(0)
}

/// Iterations worth printing: 1, 2, 10, 50, 100 and the last, those the dialog has.
fn milestones(iterations: usize) -> Vec<usize> {
    let mut ks: Vec<usize> = [1, 2, 10, 50, 100, iterations]
        .into_iter()
        .filter(|&k| k <= iterations)
        .collect();
    ks.sort_unstable();
    ks.dedup();
    ks
}

/// The store's quads and the bytes of its literals, in every graph.
async fn store_size(store: &agent_graph::GraphStore) -> anyhow::Result<(u64, u64)> {
    let rows = store
        .query(
            "SELECT (COUNT(*) AS ?n) (SUM(IF(isLiteral(?o), STRLEN(STR(?o)), 0)) AS ?bytes) WHERE { GRAPH ?g { ?s ?p ?o } }"
                .to_owned(),
        )
        .await?
        .rows();
    let number = |name: &str| match rows.first(name) {
        Some(agent_graph::model::Term::Literal(l)) => l.value().parse::<u64>().unwrap_or(0),
        _ => 0,
    };
    Ok((number("n"), number("bytes")))
}
