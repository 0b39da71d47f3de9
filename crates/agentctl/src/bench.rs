//! `agentctl bench`: end-to-end latency and throughput of the orchestrator with an instantly
//! answering scripted LLM, on pulsar-lite, Apache Pulsar or an external broker (several in one run,
//! compared at the end), next to the broker's own produce-to-consume round trip measured in the
//! same run, so the orchestrator's cost per iteration reads as a multiple of the broker's.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_bus::embedded::EmbeddedBroker;
use agent_bus::{AgentClient, Bus, Properties, Publisher};
use agent_orchestrator::Settings;
use agent_schema::{AgentRequest, AgentResponse, MessageType, ID_PROPERTY};
use anyhow::Context;
use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition};
use pulsar::{Consumer, SubType, TokioExecutor};
use scripted_llm::{Script, ScriptedLlm};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Broker round trips to time.
    #[arg(long, default_value_t = 2000)]
    round_trips: usize,
    /// Sequential one-iteration dialogs to time.
    #[arg(long, default_value_t = 200)]
    one_iteration: usize,
    /// Sequential three-iteration dialogs to time.
    #[arg(long, default_value_t = 100)]
    three_iteration: usize,
    /// Three-iteration dialogs for the throughput run.
    #[arg(long, default_value_t = 300)]
    dialogs: usize,
    /// Dialogs kept open at once in the throughput run.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Journal iterations (effectively-once) through an aggregator's embedded store, as in
    /// production: `on` (also plain `--journal`), `off`, or `both`, one after the other on each
    /// broker, to read what the journal costs side by side.
    #[arg(long, value_enum, default_value = "off", num_args = 0..=1, default_missing_value = "on")]
    journal: JournalMode,
    /// Run without the aggregator (provenance goes to the explainability topic and nowhere else)
    /// when the journal is off. By default an aggregator stores provenance in both modes, as in
    /// production, so the figures side by side differ by the journal alone.
    #[arg(long)]
    no_store: bool,
    /// Keep the graph (provenance and the journal's entries) in this SPARQL server behind the
    /// aggregator, instead of its embedded store: the base URL that serves `/query` and `/update`
    /// (Oxigraph's `oxigraph serve`, Apache Jena Fuseki's `http://host:3030/ds`). The aggregator
    /// still decides the journal. The store's figures count what the run added.
    #[arg(long)]
    graph_server: Option<String>,
    /// The brokers to run on, one after the other, compared at the end: `pulsar-lite`, `apache`
    /// (Apache Pulsar's standalone, started here), `external` (the broker at `--pulsar-url`).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "pulsar-lite")]
    brokers: Vec<BrokerKind>,
    /// A setting for the Apache Pulsar broker started here (`key=value`, repeatable), e.g.
    /// `managedLedgerNewEntriesCheckDelayInMillis=0`.
    #[arg(long = "apache-setting")]
    apache_settings: Vec<String>,
    /// In the throughput run, a second reader of the response topic on a connection of its own:
    /// should the run stall, it tells whether the broker delivered the missing closings to anyone.
    /// Costs throughput (every response is delivered twice).
    #[arg(long)]
    witness: bool,
    #[command(flatten)]
    settings: Settings,
}

const SCRIPT: &str = r#"{"rules": [
  {"match": "Request to classify: ", "reply": "{\"choice\": \"general\", \"rationale\": \"bench\"}"},
  {"match": "Request to work on: ", "reply": "{\"choice\": \"react\", \"rationale\": \"bench\"}"},
  {"match": "Observation: r2", "reply": "Thought: both known\nFinal Answer: done"},
  {"match": "Observation: r1", "reply": "Thought: step two\nAction: llm\nArgs: {\"question\": \"b\"}"},
  {"match": "a", "exact": true, "reply": "r1"},
  {"match": "b", "exact": true, "reply": "r2"},
  {"match": "Question: three", "reply": "Thought: step one\nAction: llm\nArgs: {\"question\": \"a\"}"},
  {"match": "Question: one", "reply": "Thought: known\nFinal Answer: done"}
]}"#;

/// Whether iterations are journaled.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum JournalMode {
    Off,
    On,
    Both,
}

impl JournalMode {
    fn runs(self) -> &'static [bool] {
        match self {
            JournalMode::Off => &[false],
            JournalMode::On => &[true],
            JournalMode::Both => &[false, true],
        }
    }
}

/// The broker a bench runs on.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BrokerKind {
    /// pulsar-lite, embedded on a free loopback port.
    PulsarLite,
    /// Apache Pulsar's standalone broker on the JVM (`scripts/apache-pulsar.sh` fetches it once).
    Apache,
    /// The broker at `--pulsar-url`, as it is (TrustGraph's tenant and namespaces must exist).
    External,
}

impl BrokerKind {
    fn name(self) -> &'static str {
        match self {
            BrokerKind::PulsarLite => "pulsar-lite",
            BrokerKind::Apache => "Apache Pulsar 4.0 standalone",
            BrokerKind::External => "external broker",
        }
    }
}

/// A started broker, stopped when dropped.
enum Running {
    Lite(EmbeddedBroker),
    Apache(agent_bus::apache::ApacheBroker),
    External(String),
}

impl Running {
    fn start(
        kind: BrokerKind,
        external_url: &str,
        apache_settings: &[String],
    ) -> anyhow::Result<Running> {
        Ok(match kind {
            BrokerKind::PulsarLite => {
                Running::Lite(EmbeddedBroker::start(0, None).context("starting pulsar-lite")?)
            }
            BrokerKind::Apache => Running::Apache(
                agent_bus::apache::ApacheBroker::start_with(0, None, apache_settings)
                    .context("starting Apache Pulsar")?,
            ),
            BrokerKind::External => Running::External(external_url.to_owned()),
        })
    }

    /// The broker's process, when it runs here.
    fn pid(&self) -> Option<u32> {
        match self {
            Running::Lite(b) => b.pid(),
            Running::Apache(b) => b.pid(),
            Running::External(_) => None,
        }
    }

    fn url(&self) -> String {
        match self {
            Running::Lite(b) => b.url(),
            Running::Apache(b) => b.url(),
            Running::External(url) => url.clone(),
        }
    }
}

/// One broker's figures, for the comparison at the end.
struct Figures {
    broker: &'static str,
    journal: bool,
    /// The journal's bytes (its entries' outcomes) per dialog, when on.
    journal_bytes_per_dialog: Option<f64>,
    round_trip_p50: f64,
    one_p50: f64,
    three_p50: f64,
    steps_per_sec: f64,
    /// CPU time a step of the throughput run cost this process and the broker's, in ms.
    cpu_ms_per_step: Option<f64>,
}

/// The scripted answer that closes every bench dialog: one that ends otherwise (at its iteration
/// limit, because a tool was missing) did not run the steps the figures are per.
const SCRIPTED_ANSWER: &str = "done";

pub async fn run(args: BenchArgs) -> anyhow::Result<i32> {
    // The bench's dialogs call the `llm` tool: without it a three-iteration dialog would run to its
    // iteration limit and every figure would be per the wrong number of steps.
    let dir = &args.settings.config_dir;
    let config = agent_orchestrator::load_config_dir(dir)?;
    anyhow::ensure!(
        config.tool_by_name("llm").is_some(),
        "the bench's dialogs call the `llm` tool, and the config in {} has none (run from the repository root, or pass --config-dir with the seed config)",
        dir.display()
    );
    // It keeps no requests: their copies would count in the run's memory.
    let llm =
        ScriptedLlm::start_keeping(Script::from_json(SCRIPT)?, "127.0.0.1:0".parse()?, 0).await?;
    let mut all = Vec::new();
    for kind in args.brokers.clone() {
        let broker = Running::start(
            kind,
            &args.settings.broker.pulsar_url,
            &args.apache_settings,
        )?;
        for &journal in args.journal.runs() {
            all.push(bench_on(&args, journal, &llm, &broker, kind.name()).await?);
        }
    }
    if all.len() > 1 {
        println!("\ncomparison (p50 figures; per step as a multiple of the broker round trip):");
        println!(
            "{:<30} {:>8} {:>12} {:>15} {:>9} {:>17} {:>9} {:>10} {:>14} {:>12}",
            "broker",
            "journal",
            "round trip",
            "one-iteration",
            "x rtt",
            "three-iteration",
            "x rtt",
            "steps/s",
            "journal B/dlg",
            "CPU ms/step"
        );
        for f in &all {
            let per_step = |p50: f64, steps: f64| p50 / steps / f.round_trip_p50;
            println!(
                "{:<30} {:>8} {:>9.3} ms {:>12.2} ms {:>9.1} {:>14.2} ms {:>9.1} {:>10.0} {:>14} {:>12}",
                f.broker,
                on_off_short(f.journal),
                f.round_trip_p50,
                f.one_p50,
                per_step(f.one_p50, 2.0),
                f.three_p50,
                per_step(f.three_p50, 4.0),
                f.steps_per_sec,
                f.journal_bytes_per_dialog
                    .map_or("-".to_owned(), |b| format!("{b:.0}")),
                f.cpu_ms_per_step
                    .map_or("-".to_owned(), |ms| format!("{ms:.2}")),
            );
        }
    }
    Ok(0)
}

fn on_off_short(journal: bool) -> &'static str {
    if journal {
        "on"
    } else {
        "off"
    }
}

fn on_off(journal: bool, stored: bool, server: Option<&str>) -> String {
    let store = match server {
        Some(url) => format!("an aggregator over the SPARQL server {url}"),
        None => "an aggregator's embedded store".to_owned(),
    };
    match (journal, stored) {
        (true, _) => format!("on (decided by {store}, which also stores provenance)"),
        (false, true) => format!("off (provenance stored by {store})"),
        (false, false) => "off (provenance not stored: no aggregator)".to_owned(),
    }
}

/// Runs the whole bench (an orchestrator, and unless `--no-store` with the journal off an
/// aggregator, in this process) against `broker`, named `broker_name` (its process's CPU, when it
/// runs here, counts in the run's).
async fn bench_on(
    args: &BenchArgs,
    journal: bool,
    llm: &ScriptedLlm,
    broker: &Running,
    broker_name: &'static str,
) -> anyhow::Result<Figures> {
    let url = &broker.url();
    let mut settings = args.settings.clone();
    settings.broker.pulsar_url = url.clone();
    settings.llm_base_url = llm.base_url();
    settings.llm_model = "scripted".into();
    let topics = settings.topics();
    let shutdown = CancellationToken::new();
    let store_dir = std::env::temp_dir().join(format!(
        "agentctl-bench-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut store = None;
    // What the store held before the run (a SPARQL server may hold earlier runs').
    let mut held_before = (0, (0, 0));
    let aggregator = if journal || !args.no_store {
        let _ = std::fs::remove_dir_all(&store_dir);
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], agent_bus::embedded::free_port()?).into();
        let token = uuid::Uuid::new_v4().simple().to_string();
        let mut aggregator = agent_aggregator::AggregatorSettings::embedded(
            settings.broker.clone(),
            store_dir.clone(),
            addr,
        );
        if let Some(server) = &args.graph_server {
            server.clone_into(&mut aggregator.graph_store);
        }
        aggregator.config_token = Some(token.clone());
        let seal = uuid::Uuid::new_v4().simple().to_string();
        aggregator.seal_key = Some(seal.clone());
        settings.seal_key = Some(seal);
        store = Some(match &args.graph_server {
            // Read where the graph is, so the figures do not wait for the aggregator's reads.
            Some(server) => agent_graph::GraphStore::open(server, None)?,
            None => agent_graph::GraphStore::open(&format!("http://{addr}"), Some(token.clone()))?,
        });
        // The orchestrator journals when, and only when, it is given the aggregator's store.
        if journal {
            settings.graph_store = Some(format!("http://{addr}"));
            settings.journal_owner_in_process = true;
            settings.config_token = Some(token);
        } else {
            settings.graph_store = None;
        }
        let task = tokio::spawn(agent_aggregator::run(aggregator, shutdown.clone()));
        crate::up::until_listening(addr, &task).await;
        if let Some(store) = &store {
            held_before = (quad_count(store).await?, journal_size(store).await?);
        }
        Some(task)
    } else {
        settings.graph_store = None;
        None
    };
    // Embedded: its health and metrics endpoint on a free loopback port (it logs which).
    settings.http_addr = ([127, 0, 0, 1], 0).into();
    let orchestrator = tokio::spawn(agent_orchestrator::run(settings.clone(), shutdown.clone()));
    let bus = Bus::connect(url, settings.broker.pulsar_token.as_deref()).await?;

    println!(
        "\nagentctl bench: {broker_name} {url}, scripted LLM answering instantly, max_in_flight {}, journal {}",
        settings.max_in_flight,
        on_off(journal, store.is_some(), args.graph_server.as_deref())
    );
    let rtt = broker_round_trip(&bus, args.round_trips).await?;
    let rtt_p50 = percentile(&rtt, 50.0);
    println!(
        "broker round trip  (produce+receipt -> consume, 1 KiB, n={}): p50 {:.3} ms  p99 {:.3} ms",
        rtt.len(),
        rtt_p50,
        percentile(&rtt, 99.0)
    );

    let mut client = AgentClient::connect(&bus, &topics).await?;
    // Warm up connections, producers and the subscription.
    sequential(&mut client, "one", 5).await?;
    let one = sequential(&mut client, "one", args.one_iteration).await?;
    // Every dialog is routed first (two LLM calls: task type and pattern; one message), so it
    // takes one step more than it has ReACT iterations.
    report("one-iteration dialog  ", &one, 2, rtt_p50);
    let three = sequential(&mut client, "three", args.three_iteration).await?;
    report("three-iteration dialog", &three, 4, rtt_p50);

    let requests = Publisher::new(&bus, &topics.request).await?;
    let witness = if args.witness {
        let own = Bus::connect(url, settings.broker.pulsar_token.as_deref()).await?;
        Some(Witness::start(AgentClient::connect(&own, &topics).await?))
    } else {
        None
    };
    let cpu_before = CpuUse::now(broker.pid());
    let Throughput {
        elapsed,
        latencies,
        recovered,
    } = concurrent(
        client,
        requests,
        witness.as_ref(),
        args.dialogs,
        args.concurrency,
        store.as_ref(),
    )
    .await?;
    let steps = (args.dialogs * 4) as f64;
    let steps_per_sec = steps / elapsed.as_secs_f64();
    println!(
        "throughput: {} routed three-iteration dialogs, {} open at once: {:.0} steps/s, {:.1} dialogs/s; dialog p50 {:.1} ms p99 {:.1} ms",
        args.dialogs,
        args.concurrency,
        steps_per_sec,
        args.dialogs as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 50.0),
        percentile(&latencies, 99.0),
    );
    let cpu = cpu_before.and_then(|before| CpuUse::now(broker.pid())?.since(&before, steps));
    if let Some(cpu) = &cpu {
        cpu.report(steps_per_sec);
    }
    if recovered > 0 {
        println!(
            "closings that never reached the client (the response topic is non-persistent), read back from the journal or the provenance graph: {recovered}"
        );
    }
    println!("LLM calls served so far: {}", llm.served());
    let dialogs = (5 + args.one_iteration + args.three_iteration + args.dialogs) as f64;
    let mut journal_bytes_per_dialog = None;
    if let Some(store) = &store {
        if journal {
            let (bytes, entries) = journal_size(store).await?;
            let (bytes, entries) = (
                bytes.saturating_sub(held_before.1 .0),
                entries.saturating_sub(held_before.1 .1),
            );
            println!(
                "journal: {entries} entries, {bytes} bytes of outcomes: {:.0} bytes per dialog, {:.0} per entry",
                bytes as f64 / dialogs,
                bytes as f64 / entries.max(1) as f64
            );
            journal_bytes_per_dialog = Some(bytes as f64 / dialogs);
        }
        let (quads, caught_up) = settled_quad_count(store).await?;
        let quads = quads.saturating_sub(held_before.0);
        println!(
            "store: {quads} quads (provenance{}): {:.0} per dialog; the aggregator had written them {:.1} s after the last dialog ended",
            if journal { " and journal" } else { "" },
            quads as f64 / dialogs,
            caught_up.as_secs_f64()
        );
    }
    shutdown.cancel();
    orchestrator.await??;
    if let Some(aggregator) = aggregator {
        aggregator.await??;
        let _ = std::fs::remove_dir_all(&store_dir);
    }
    Ok(Figures {
        broker: broker_name,
        journal,
        journal_bytes_per_dialog,
        round_trip_p50: rtt_p50,
        one_p50: percentile(&one, 50.0),
        three_p50: percentile(&three, 50.0),
        steps_per_sec,
        // The sum only where the broker's share is known: a row without it would read cheaper.
        cpu_ms_per_step: cpu.and_then(|c| Some(c.process_ms + c.broker_ms?)),
    })
}

/// CPU time used so far: by this process (the orchestrator, the aggregator and its store, the
/// scripted LLM and the bench's client), by the broker when it runs here, and by the whole
/// machine. On a machine whose cores are all busy, throughput is CPU a step: this says how much.
struct CpuUse {
    process: f64,
    broker: Option<f64>,
    /// The machine's busy and idle time, all cores.
    machine: Option<(f64, f64)>,
}

/// What a throughput run's steps cost, from two [`CpuUse`] readings.
struct CpuPerStep {
    process_ms: f64,
    broker_ms: Option<f64>,
    /// The share of the machine's cores that was busy.
    machine_busy: Option<f64>,
}

impl CpuUse {
    /// `None` without `/proc` (not Linux): the bench then prints no CPU figures.
    fn now(broker: Option<u32>) -> Option<CpuUse> {
        Some(CpuUse {
            process: agent_bus::embedded::cpu_seconds("self")?,
            broker: broker.and_then(|pid| agent_bus::embedded::cpu_seconds(&pid.to_string())),
            machine: machine_cpu_seconds(),
        })
    }

    fn since(&self, before: &CpuUse, steps: f64) -> Option<CpuPerStep> {
        if steps <= 0.0 {
            return None;
        }
        let per_step = |now: f64, then: f64| (now - then) * 1000.0 / steps;
        Some(CpuPerStep {
            process_ms: per_step(self.process, before.process),
            broker_ms: self
                .broker
                .zip(before.broker)
                .map(|(now, then)| per_step(now, then)),
            machine_busy: self.machine.zip(before.machine).and_then(
                |((busy, idle), (busy_then, idle_then))| {
                    // The kernel's idle count can step back (its iowait share is an estimate
                    // that may fall), so over a short run the total could come out below the
                    // busy time: a share over 100% (seen once in CI). Idle time never counts
                    // below none.
                    let busy = (busy - busy_then).max(0.0);
                    let total = busy + (idle - idle_then).max(0.0);
                    (total > 0.0).then(|| busy / total)
                },
            ),
        })
    }
}

impl CpuPerStep {
    fn report(&self, steps_per_sec: f64) {
        let cores = |ms: f64| ms * steps_per_sec / 1000.0;
        let mut line = format!(
            "CPU a step: this process {:.2} ms ({:.2} cores)",
            self.process_ms,
            cores(self.process_ms)
        );
        if let Some(broker) = self.broker_ms {
            line.push_str(&format!(
                ", the broker {broker:.2} ms ({:.2} cores)",
                cores(broker)
            ));
        }
        if let Some(busy) = self.machine_busy {
            line.push_str(&format!("; the machine's cores {:.0}% busy", busy * 100.0));
        }
        let available = std::thread::available_parallelism().map_or(1, usize::from);
        line.push_str(&format!(
            "; 2,000 steps/s on {available} cores leaves {:.2} ms a step",
            available as f64 * 1000.0 / 2000.0
        ));
        println!("{line}");
    }
}

/// The machine's busy and idle CPU seconds, all cores, from `/proc/stat`.
fn machine_cpu_seconds() -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let times: Vec<f64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .filter_map(|t| t.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal; idle and iowait are the time not busy.
    let total: f64 = times.iter().take(8).sum();
    let idle = times.get(3)? + times.get(4).unwrap_or(&0.0);
    Some(((total - idle) / 100.0, idle / 100.0))
}

/// The store's quads once the aggregator has written what the run explained (provenance is
/// written behind the dialogs, and a SPARQL server may take a while), and how long that took: the
/// count once it has not moved for two seconds.
async fn settled_quad_count(store: &agent_graph::GraphStore) -> anyhow::Result<(u64, Duration)> {
    const STILL_FOR: Duration = Duration::from_secs(2);
    const AT_MOST: Duration = Duration::from_secs(600);
    let started = Instant::now();
    let mut count = quad_count(store).await?;
    let mut moved = started;
    while moved.elapsed() < STILL_FOR && started.elapsed() < AT_MOST {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = quad_count(store).await?;
        if now != count {
            (count, moved) = (now, Instant::now());
        }
    }
    Ok((count, moved.duration_since(started)))
}

/// Every quad the store holds, in every graph.
async fn quad_count(store: &agent_graph::GraphStore) -> anyhow::Result<u64> {
    let rows = store
        .query("SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?s ?p ?o } }".to_owned())
        .await?
        .rows();
    Ok(match rows.first("n") {
        Some(agent_graph::model::Term::Literal(l)) => l.value().parse::<u64>().unwrap_or(0),
        _ => 0,
    })
}

/// The journal's outcome bytes and entries (every dialog's: none is pruned within a bench).
async fn journal_size(store: &agent_graph::GraphStore) -> anyhow::Result<(u64, u64)> {
    let rows = store
        .query(format!(
            "SELECT (SUM(STRLEN(?o)) AS ?bytes) (COUNT(?e) AS ?n) WHERE {{ GRAPH <{}> {{ ?e {} ?o }} }}",
            agent_core::vocab::JOURNAL_GRAPH,
            agent_core::vocab::tg::OUTCOME
        ))
        .await?
        .rows();
    let number = |name: &str| match rows.first(name) {
        Some(agent_graph::model::Term::Literal(l)) => l.value().parse::<u64>().unwrap_or(0),
        _ => 0,
    };
    Ok((number("bytes"), number("n")))
}

fn report(label: &str, times: &[f64], steps: usize, rtt_p50: f64) {
    let p50 = percentile(times, 50.0);
    println!(
        "{label} (n={}, sequential, not streamed): p50 {:.2} ms  p99 {:.2} ms  per step {:.2} ms = {:.1} x broker round trip",
        times.len(),
        p50,
        percentile(times, 99.0),
        p50 / steps as f64,
        p50 / steps as f64 / rtt_p50
    );
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

async fn broker_round_trip(bus: &Bus, n: usize) -> anyhow::Result<Vec<f64>> {
    let topic = format!(
        "persistent://public/default/bench-rtt-{:08x}",
        rand::random::<u32>()
    );
    let mut consumer: Consumer<Vec<u8>, TokioExecutor> = bus
        .client()
        .consumer()
        .with_topic(&topic)
        .with_subscription("bench")
        .with_subscription_type(SubType::Exclusive)
        .with_consumer_id(rand::random::<u64>() >> 1)
        .with_options(ConsumerOptions {
            initial_position: InitialPosition::Earliest,
            ..ConsumerOptions::default()
        })
        .build()
        .await?;
    let producer = Publisher::new(bus, &topic).await?;
    let payload = vec![b'x'; 1024];
    let mut times = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let started = Instant::now();
        producer.send(payload.clone(), &Properties::new()).await?;
        let message = consumer
            .next()
            .await
            .context("the round-trip consumer stopped")??;
        consumer.ack(&message).await?;
        // The first few warm the connection.
        if i >= 20 {
            times.push(started.elapsed().as_secs_f64() * 1000.0);
        }
    }
    Ok(times)
}

fn bench_request(kind: &str, i: usize) -> AgentRequest {
    AgentRequest {
        question: format!("{kind} #{i}"),
        collection: "default".into(),
        streaming: false,
        ..AgentRequest::default()
    }
}

async fn sequential(client: &mut AgentClient, kind: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("bench-{kind}-{i}-{:08x}", rand::random::<u32>());
        let started = Instant::now();
        client.send(&id, &bench_request(kind, i)).await?;
        loop {
            let (rid, response) = tokio::time::timeout(Duration::from_secs(60), client.next())
                .await
                .context("a benchmark dialog did not finish within 60 s")??;
            if rid == id && response.end_of_dialog {
                anyhow::ensure!(
                    response.message_type == "answer" && response.content == SCRIPTED_ANSWER,
                    "a bench dialog did not run as scripted: {}",
                    response.content
                );
                break;
            }
        }
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(times)
}

async fn concurrent(
    mut client: AgentClient,
    requests: Publisher,
    witness: Option<&Witness>,
    n: usize,
    concurrency: usize,
    store: Option<&agent_graph::GraphStore>,
) -> anyhow::Result<Throughput> {
    // By request id: when it was sent, and its session (to find it in the graph should it stall).
    let open: Arc<Mutex<HashMap<String, (Instant, String)>>> = Arc::new(Mutex::new(HashMap::new()));
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let started = Instant::now();
    let reader = {
        let open = open.clone();
        let permits = permits.clone();
        let journal = store.cloned();
        tokio::spawn(async move {
            // However the reader stops, the sending stops too: a reader that stopped early gives
            // no permits back, and the sender would wait for one instead of reporting the stall.
            let _stop_sending = ClosedOnDrop(permits.clone());
            let mut latencies = Vec::with_capacity(n);
            let mut recovered = 0;
            let mut heard: HashMap<String, usize> = HashMap::new();
            let mut last_heard = Instant::now();
            let ended = |id: &str, response: &AgentResponse, latencies: &mut Vec<f64>| {
                if response.content != SCRIPTED_ANSWER {
                    tracing::error!(content = %response.content, "a bench dialog did not run as scripted");
                }
                let begun = open.lock().ok().and_then(|mut m| m.remove(id));
                if let Some((begun, _)) = begun {
                    latencies.push(begun.elapsed().as_secs_f64() * 1000.0);
                    permits.add_permits(1);
                    return true;
                }
                false
            };
            let mut last_checked = Instant::now();
            while latencies.len() < n {
                match tokio::time::timeout(LOOK_BACK_EVERY, client.next()).await {
                    Ok(Ok((id, response))) => {
                        last_heard = Instant::now();
                        *heard.entry(id.clone()).or_insert(0) += 1;
                        if response.end_of_dialog {
                            ended(&id, &response, &mut latencies);
                        }
                    }
                    Ok(Err(_)) => {
                        return Err(Stalled {
                            ended: latencies.len(),
                            waiting: Vec::new(),
                            heard: Vec::new(),
                            copies_dropped: client.copies_dropped(),
                        })
                    }
                    Err(_) => {}
                }
                // The response topic is non-persistent: a broker drops what a reader that falls
                // behind has no room for, closings included. A journaled dialog's closing is read
                // back from the journal instead of waited for (while the others go on); without a
                // journal, its answer from the provenance graph.
                if let (Some(journal), true) = (&journal, last_checked.elapsed() >= LOOK_BACK_EVERY)
                {
                    last_checked = Instant::now();
                    // A slow store (Fuseki) makes every dialog slow: overdue is then a few times
                    // the usual dialog, not a second.
                    let usual = percentile(&latencies, 50.0);
                    let overdue = if usual.is_finite() {
                        OVERDUE.max(Duration::from_secs_f64(3.0 * usual / 1000.0))
                    } else {
                        OVERDUE
                    };
                    for (id, closing) in lost_closings(journal, &open, overdue).await {
                        if ended(&id, &closing, &mut latencies) {
                            recovered += 1;
                            last_heard = Instant::now();
                        }
                    }
                }
                if last_heard.elapsed() < STALL_SILENCE {
                    continue;
                }
                let waiting: Vec<(String, String)> = open
                    .lock()
                    .map(|m| {
                        m.iter()
                            .map(|(id, (_, s))| (id.clone(), s.clone()))
                            .collect()
                    })
                    .unwrap_or_default();
                let heard = waiting
                    .iter()
                    .map(|(id, _)| heard.get(id).copied().unwrap_or(0))
                    .collect();
                return Err(Stalled {
                    ended: latencies.len(),
                    waiting,
                    heard,
                    copies_dropped: client.copies_dropped(),
                });
            }
            Ok((latencies, recovered))
        })
    };
    // A client that waited for each request's receipt before sending the next would hold fewer
    // dialogs open than asked once the broker is busy (a receipt then takes milliseconds): the
    // receipts are waited for beside the sending, each checked before the run's figure counts.
    let mut receipts = tokio::task::JoinSet::new();
    for i in 0..n {
        let Ok(permit) = permits.acquire().await else {
            // The reader stopped and closed the permits: its report follows.
            break;
        };
        permit.forget();
        let id = format!("bench-c-{i}-{:08x}", rand::random::<u32>());
        let request = AgentRequest {
            session_id: uuid::Uuid::new_v4().to_string(),
            ..bench_request("three", i)
        };
        if let Ok(mut m) = open.lock() {
            m.insert(id.clone(), (Instant::now(), request.session_id.clone()));
        }
        let mut properties = Properties::new();
        properties.insert(ID_PROPERTY.to_owned(), id);
        let receipt = requests
            .enqueue(agent_schema::encode(&request), &properties)
            .await?;
        receipts.spawn(receipt.wait());
        while let Some(confirmed) = receipts.try_join_next() {
            confirmed??;
        }
    }
    while let Some(confirmed) = receipts.join_next().await {
        confirmed??;
    }
    match reader.await? {
        Ok((latencies, recovered)) => Ok(Throughput {
            elapsed: started.elapsed(),
            latencies,
            recovered,
        }),
        Err(stalled) => {
            let mut report = format!(
                "the throughput run stalled: {} of {n} dialogs ended, then nothing came for {} s and no closing could be read back from the journal or the graph; {} still open; the client dropped {} responses as re-emitted copies",
                stalled.ended,
                STALL_SILENCE.as_secs(),
                stalled.waiting.len(),
                stalled.copies_dropped
            );
            for ((id, session), heard) in stalled.waiting.iter().zip(&stalled.heard).take(4) {
                report.push_str(&format!(
                    "\n  {id} (session {session}, {heard} responses heard)"
                ));
                if let Some(witness) = witness {
                    report.push_str(&format!(": {}", witness.heard(id)));
                }
                if let Some(store) = store {
                    report.push_str(&format!(": {}", how_far(store, session).await));
                }
            }
            anyhow::bail!(report)
        }
    }
}

/// Closes a semaphore when dropped.
struct ClosedOnDrop(Arc<Semaphore>);

impl Drop for ClosedOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// How long a dialog of the throughput run may be open at least (two to ten times its p99 here)
/// before its closing is looked for in the journal or the graph. Short, since the run's figure includes
/// the wait: a closing read back while the broker still delivers it only ends the dialog once.
const OVERDUE: Duration = Duration::from_secs(1);

/// How often the throughput run's client looks for overdue dialogs' closings.
const LOOK_BACK_EVERY: Duration = Duration::from_millis(250);

/// How long the throughput run's client hears nothing, and recovers nothing, before it gives up.
const STALL_SILENCE: Duration = Duration::from_secs(120);

/// What the throughput run measured.
struct Throughput {
    elapsed: Duration,
    /// Each dialog's time from its request to its closing.
    latencies: Vec<f64>,
    /// Closings the client never received, read back from the journal.
    recovered: usize,
}

/// The closings of the dialogs open for longer than [`OVERDUE`] that the journal recorded, by
/// request id.
async fn lost_closings(
    journal: &agent_graph::GraphStore,
    open: &Mutex<HashMap<String, (Instant, String)>>,
    overdue: Duration,
) -> Vec<(String, AgentResponse)> {
    let overdue: Vec<(String, String)> = open
        .lock()
        .map(|m| {
            m.iter()
                .filter(|(_, (begun, _))| begun.elapsed() >= overdue)
                .map(|(id, (_, session))| (id.clone(), session.clone()))
                .collect()
        })
        .unwrap_or_default();
    let mut lost = Vec::new();
    for (id, session) in overdue {
        match agent_orchestrator::journal::recorded_closing(journal, &session, &id).await {
            Ok(Some(closing)) => {
                tracing::warn!(%id, %session, "the closing never reached the client; read back from the journal");
                lost.push((id, closing));
            }
            // No journal entry (the journal is off): the provenance graph holds the answer a
            // dialog concluded with.
            Ok(None) => {
                if let Some(answer) = crate::invoke::concluded_answer(Some(journal), &session).await
                {
                    tracing::warn!(%id, %session, "the closing never reached the client; its answer read back from the provenance graph");
                    let mut closing = AgentResponse::new(MessageType::Answer, &answer);
                    closing.end_of_dialog = true;
                    closing.end_of_message = true;
                    lost.push((id, closing));
                }
            }
            Err(e) => {
                tracing::warn!(%id, error = %e, "could not read the journal for a lost closing")
            }
        }
    }
    lost
}

/// A second reader of the response topic, on a connection of its own: what it heard of each
/// dialog.
struct Witness {
    /// Request id: responses received, and whether its closing was among them.
    closed: Arc<Mutex<HashMap<String, (usize, bool)>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Witness {
    fn start(mut client: AgentClient) -> Witness {
        let closed: Arc<Mutex<HashMap<String, (usize, bool)>>> = Arc::default();
        let reader = tokio::spawn({
            let closed = closed.clone();
            async move {
                while let Ok((id, response)) = client.next().await {
                    if let Ok(mut closed) = closed.lock() {
                        let heard = closed.entry(id).or_default();
                        heard.0 += 1;
                        heard.1 |= response.end_of_dialog;
                    }
                }
            }
        });
        Witness { closed, reader }
    }

    /// What it heard of dialog `id`.
    fn heard(&self, id: &str) -> String {
        match self.closed.lock().ok().and_then(|c| c.get(id).copied()) {
            Some((n, true)) => format!("the witness heard {n} responses, its closing among them"),
            Some((n, false)) => format!("the witness heard {n} responses, not its closing"),
            None => "the witness heard nothing of it".to_owned(),
        }
    }
}

impl Drop for Witness {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// Where a throughput run stopped hearing from its dialogs.
struct Stalled {
    ended: usize,
    /// Request id and session of every dialog still open.
    waiting: Vec<(String, String)>,
    /// How many responses of each of those the client had received.
    heard: Vec<usize>,
    /// Responses the client dropped as re-emitted copies (by effect id).
    copies_dropped: u64,
}

/// What the graph holds of a stalled dialog: its nodes and journal entries, to tell a lost
/// message (the graph ends where the dialog did) from a lost response (the graph has its answer).
async fn how_far(store: &agent_graph::GraphStore, session: &str) -> String {
    let prefix = agent_core::provenance::SessionUris::new(session).session();
    let query = format!(
        "SELECT DISTINCT ?s WHERE {{ GRAPH ?g {{ ?s ?p ?o }} FILTER(STRSTARTS(STR(?s), \"{prefix}\")) }}"
    );
    match store.query(query).await {
        Ok(answer) => {
            let rows = answer.rows();
            let mut nodes: Vec<String> = rows
                .column("s")
                .into_iter()
                .filter_map(|term| match term {
                    Some(agent_graph::model::Term::NamedNode(n)) => {
                        Some(n.as_str().trim_start_matches(&prefix).to_owned())
                    }
                    _ => None,
                })
                .collect();
            nodes.sort();
            format!("in the graph: [{}]", nodes.join(" "))
        }
        Err(e) => format!("the graph did not answer: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_a_step_is_read_from_proc_and_grows_with_work() {
        let before = CpuUse::now(Some(std::process::id())).expect("/proc on Linux");
        let mut spin = 0u64;
        while agent_bus::embedded::cpu_seconds("self").unwrap() < before.process + 0.05 {
            spin = spin.wrapping_add(1);
        }
        let after = CpuUse::now(Some(std::process::id())).unwrap();
        let cost = after.since(&before, 10.0).unwrap();
        // 50 ms of CPU or more over 10 steps, counted for the process and, as the same pid, for
        // "the broker" (read a moment apart, and in ticks of 10 ms: a tick's margin).
        assert!(cost.process_ms >= 4.0, "{} ms", cost.process_ms);
        assert!(cost.broker_ms.unwrap() >= 4.0);
        assert!(cost
            .machine_busy
            .is_some_and(|busy| busy > 0.0 && busy <= 1.0));
        assert!(after.since(&before, 0.0).is_none(), "{spin}");
    }

    #[test]
    fn the_machines_busy_share_stays_within_its_cores_when_idle_time_steps_back() {
        let reading = |busy: f64, idle: f64| CpuUse {
            process: 0.0,
            broker: None,
            machine: Some((busy, idle)),
        };
        let share = |before: CpuUse, after: CpuUse| after.since(&before, 1.0).unwrap().machine_busy;
        // /proc/stat's idle and iowait, summed, fell by 0.25 s while 0.5 s were busy.
        assert_eq!(share(reading(8.0, 16.0), reading(8.5, 15.75)), Some(1.0));
        assert_eq!(share(reading(8.0, 16.0), reading(8.5, 16.5)), Some(0.5));
        assert_eq!(share(reading(8.0, 16.0), reading(8.0, 16.0)), None);
    }
}
