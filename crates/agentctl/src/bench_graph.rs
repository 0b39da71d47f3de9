//! `agentctl bench-graph`: the aggregator's write throughput (triples per second from the topic into
//! an embedded RocksDB store) and the latency of one session's explain query as unrelated triples
//! grow from 10k to 1M: the query walks from the session's root, so it must not grow with the graph.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use agent_aggregator::AggregatorSettings;
use agent_bus::embedded::{free_port, EmbeddedBroker};
use agent_bus::{BrokerArgs, Properties, Publisher};
use agent_core::pattern::Termination;
use agent_core::provenance::{self, CallStats, SessionUris, ToolStats};
use agent_core::router::{Choice, Decision, Method};
use agent_graph::convert::into_quads;
use agent_graph::model::{GraphName, Literal, NamedNode, Quad};
use agent_graph::{queries, GraphStore};
use agent_schema::{Metadata, Term as WireTerm, Triple as WireTriple, Triples};
use anyhow::Context;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args, Debug)]
pub struct GraphBenchArgs {
    /// Explainability messages published for the write benchmark.
    #[arg(long, default_value_t = 2000)]
    messages: usize,
    /// Triples per message.
    #[arg(long, default_value_t = 20)]
    triples_per_message: usize,
    /// Store sizes (unrelated triples) at which the explain query is timed.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
    sizes: Vec<usize>,
    /// Explain queries timed at each size.
    #[arg(long, default_value_t = 30)]
    runs: usize,
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "agentctl-bench-{name}-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ))
}

pub async fn run(args: GraphBenchArgs) -> anyhow::Result<i32> {
    write_throughput(&args).await?;
    query_latency(&args).await?;
    Ok(0)
}

/// Two figures: a backlog drained from the topic (publishing finished before the aggregator
/// started, so only the aggregator's own speed counts), and a live stream where publishing and
/// writing overlap.
async fn write_throughput(args: &GraphBenchArgs) -> anyhow::Result<()> {
    let broker = EmbeddedBroker::start(0, None).context("starting pulsar-lite")?;
    let broker_args = BrokerArgs {
        pulsar_url: broker.url(),
        pulsar_token: None,
        pulsar_tls_ca_file: None,
        pulsar_max_message_bytes: agent_bus::DEFAULT_MAX_MESSAGE_BYTES,
        pulsar_compression: agent_bus::Compression::default(),
        pulsar_intake_max_bytes: agent_bus::DEFAULT_INTAKE_BYTES,
        workspace: "default".into(),
        flow: "default".into(),
    };
    let bus = broker_args.connect().await?;
    let expected = args.messages * args.triples_per_message;
    for live in [false, true] {
        let topic = format!(
            "persistent://tg/flow/bench-writes-{}",
            if live { "live" } else { "backlog" }
        );
        let publisher = Publisher::new(&bus, &topic).await?;
        let dir = temp_dir("writes");
        let addr: SocketAddr = ([127, 0, 0, 1], free_port()?).into();
        let mut settings = AggregatorSettings::embedded(broker_args.clone(), dir.clone(), addr);
        settings.explain_topic = Some(topic);
        // The only aggregator on its own topic: no elder owner to listen for, and the time
        // measured is the store's.
        settings.owner_listen_ms = 0;
        let shutdown = CancellationToken::new();
        let started = Instant::now();
        let (aggregator, published) = if live {
            let aggregator = tokio::spawn(agent_aggregator::run(settings, shutdown.clone()));
            let store = GraphStore::open(&format!("http://{addr}"), None)?;
            wait_until_serving(&store).await?;
            let started = Instant::now();
            publish_messages(&publisher, args).await?;
            (aggregator, started.elapsed())
        } else {
            publish_messages(&publisher, args).await?;
            let published = started.elapsed();
            (
                tokio::spawn(agent_aggregator::run(settings, shutdown.clone())),
                published,
            )
        };
        let store = GraphStore::open(&format!("http://{addr}"), None)?;
        let started = Instant::now();
        wait_until_serving(&store).await?;
        while store.count().await? < expected {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let elapsed = if live {
            started.elapsed() + published
        } else {
            started.elapsed()
        };
        println!(
            "aggregator writes, {}: {} messages x {} triples = {expected} triples into RocksDB in {:.2} s = {:.0} triples/s ({:.0} messages/s; publishing took {:.2} s)",
            if live { "live stream" } else { "backlog drain" },
            args.messages,
            args.triples_per_message,
            elapsed.as_secs_f64(),
            expected as f64 / elapsed.as_secs_f64(),
            args.messages as f64 / elapsed.as_secs_f64(),
            published.as_secs_f64()
        );
        shutdown.cancel();
        aggregator.await??;
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

async fn wait_until_serving(store: &GraphStore) -> anyhow::Result<()> {
    for _ in 0..600 {
        if store.count().await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("the aggregator did not start serving SPARQL within 30 s")
}

/// Publishes the benchmark's messages pipelined and waits for every receipt.
async fn publish_messages(publisher: &Publisher, args: &GraphBenchArgs) -> anyhow::Result<()> {
    let mut receipts = Vec::with_capacity(args.messages);
    for m in 0..args.messages {
        let node = format!("urn:bench:node-{m}");
        let triples = (0..args.triples_per_message)
            .map(|t| WireTriple {
                s: WireTerm::iri(&node),
                p: WireTerm::iri(format!("urn:bench:p{t}")),
                o: WireTerm::literal(format!("value {m}/{t}")),
                g: Some(agent_core::vocab::PROVENANCE_GRAPH.into()),
            })
            .collect();
        let message = Triples {
            metadata: Metadata {
                id: node,
                root: String::new(),
                collection: "default".into(),
            },
            triples,
        };
        receipts.push(
            publisher
                .enqueue(agent_schema::encode(&message), &Properties::new())
                .await?,
        );
    }
    for r in receipts {
        r.wait().await?;
    }
    Ok(())
}

/// A realistic three-iteration session, built by the orchestrator's own provenance builders.
fn session_quads(session_id: &str) -> anyhow::Result<Vec<Quad>> {
    let uris = SessionUris::new(session_id);
    let stats = CallStats {
        duration_ms: 12,
        in_token: 200,
        out_token: 40,
        model: "bench".into(),
    };
    let mut triples = provenance::session(
        &uris,
        "How many hours are in a leap year?",
        "2026-01-01T00:00:00Z",
        "",
    );
    // The first iteration derives from the pattern decision, as in every dialog the orchestrator
    // runs: without it the session's DAG ends at the question.
    let chosen = |name: &str| Choice {
        candidates: vec![name.to_owned()],
        selected: name.to_owned(),
        method: Method::OnlyCandidate,
        rationale: String::new(),
        raw_answer: None,
    };
    let decision = Decision {
        task_type: chosen("general"),
        pattern: chosen("react"),
        unavailable_patterns: Vec::new(),
        framing: String::new(),
    };
    triples.extend(provenance::pattern_decision(&uris, &decision, &stats));
    for n in 1..=2 {
        triples.extend(provenance::tool_iteration(
            &uris,
            n,
            "thinking",
            "llm",
            "{}",
            &["llm"],
            &stats,
        ));
        triples.extend(provenance::observation(
            &uris,
            n,
            "366",
            ToolStats::default(),
        ));
    }
    triples.extend(provenance::conclusion(
        &uris,
        3,
        "done",
        "8784 hours",
        Termination::Answer,
        &["llm"],
        &stats,
    ));
    Ok(into_quads(triples)?)
}

/// Unrelated provenance-shaped triples: chains of derived nodes in the same named graph.
fn noise(from: usize, to: usize) -> Vec<Quad> {
    let graph: GraphName = NamedNode::new_unchecked(agent_core::vocab::PROVENANCE_GRAPH).into();
    let derived = NamedNode::new_unchecked(format!("{}wasDerivedFrom", agent_core::vocab::PROV));
    let content = agent_core::vocab::tg::CONTENT.into_owned();
    let mut quads = Vec::with_capacity(to - from);
    for i in (from..to).step_by(2) {
        let node =
            NamedNode::new_unchecked(format!("urn:trustgraph:agent:noise-{}/i{}", i / 64, i % 64));
        let prev = NamedNode::new_unchecked(format!("urn:trustgraph:agent:noise-{}", i / 64));
        quads.push(Quad::new(
            node.clone(),
            derived.clone(),
            prev,
            graph.clone(),
        ));
        quads.push(Quad::new(
            node,
            content.clone(),
            Literal::new_simple_literal(format!("text {i}")),
            graph.clone(),
        ));
    }
    quads
}

async fn query_latency(args: &GraphBenchArgs) -> anyhow::Result<()> {
    let dir = temp_dir("queries");
    let store = GraphStore::open(&dir.display().to_string(), None)?;
    let session = "bench-session";
    let real = session_quads(session)?;
    let real_len = real.len();
    store.insert(real).await?;
    let node = queries::session_node(session)?;
    let query = queries::session_triples(&node);
    let mut loaded = 0;
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    for size in sizes {
        let started = Instant::now();
        store.bulk_load(noise(loaded, size)).await?;
        let load_time = started.elapsed();
        loaded = size;
        let mut times = Vec::with_capacity(args.runs);
        for _ in 0..args.runs + 3 {
            let started = Instant::now();
            let rows = store.query(query.clone()).await?.rows();
            times.push(started.elapsed().as_secs_f64() * 1000.0);
            anyhow::ensure!(
                rows.rows.len() == real_len,
                "the explain query returned {} of {real_len} triples",
                rows.rows.len()
            );
        }
        let mut times = times.split_off(3);
        times.sort_by(|a, b| a.total_cmp(b));
        let p =
            |q: f64| times[((q * (times.len() - 1) as f64).round() as usize).min(times.len() - 1)];
        println!(
            "explain query ({real_len} triples of one session) with {size:>8} unrelated triples: p50 {:.3} ms  p99 {:.3} ms  (loading took {:.1} s)",
            p(0.5),
            p(0.99),
            load_time.as_secs_f64()
        );
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
