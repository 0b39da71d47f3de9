//! The aggregator: consumes the explainability topic, writes every triple to the graph store
//! (idempotently, acking only after the write committed), completes fan-ins by querying the graph,
//! and serves the store over the SPARQL 1.1 Protocol so orchestrator replicas and the CLI can read
//! it. The graph is its only state.

pub mod approvals;
pub mod fanin;
pub mod http;
pub mod journal_prune;
pub mod metrics;
pub mod slow_clients;
mod store_beacon;
pub mod writer;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_bus::owner_fence::{self, Fence, Owner};
use agent_bus::{run_consumer, BrokerArgs, ConsumerStats, SubscriptionConfig};
use agent_graph::GraphStore;
use anyhow::Context;
use tokio_util::sync::CancellationToken;

/// The journal, kept to one owner on an explainability subscription (`agent_bus::owner_fence`):
/// its beacon and seal are those of the builds before the fence served the config service too.
pub const JOURNAL_OWNERS: owner_fence::Role = owner_fence::Role {
    owned: "the journal",
    service: "aggregator",
    beacon: "journal-owner",
    sealed_as: "owner",
    advice:
        "run one owner and point further replicas at its endpoint (GRAPH_STORE=http://<owner>:7878)",
};

#[derive(clap::Args, Debug, Clone)]
pub struct AggregatorSettings {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// The graph store: a directory for the embedded store, or an `http(s)://` SPARQL endpoint.
    #[arg(long, env = "GRAPH_STORE", default_value = ".data/graph")]
    pub graph_store: String,
    /// Where to serve the SPARQL 1.1 Protocol (`/query`, `/update`, `/store`); only for an embedded store.
    #[arg(long, env = "AGGREGATOR_HTTP_ADDR", default_value = "127.0.0.1:7878")]
    pub http_addr: SocketAddr,
    /// Bearer token that SPARQL updates and loads must carry; without one they are refused.
    #[arg(long, env = "CONFIG_TOKEN", hide_env_values = true)]
    pub config_token: Option<String>,
    /// Whether an embedded store's writes return only once its write-ahead log is on the disk
    /// (fsync): what the aggregator acknowledges (provenance, journal entries, fan-in claims)
    /// then survives the machine's crash, not only the process's. `false` trades that for the
    /// fsync's time (about 0.3 ms a write here).
    #[arg(long, env = "AGGREGATOR_SYNC_WRITES", default_value_t = true, action = clap::ArgAction::Set)]
    pub sync_writes: bool,
    /// Messages written at once.
    #[arg(long, default_value_t = 16)]
    pub max_in_flight: usize,
    #[arg(long, default_value = "agent-aggregator")]
    pub subscription: String,
    #[arg(long, env = "AGENT_EXPLAIN_TOPIC")]
    pub explain_topic: Option<String>,
    /// Where synthesis requests go: the orchestrators' request topic.
    #[arg(long, env = "AGENT_REQUEST_TOPIC")]
    pub request_topic: Option<String>,
    /// Secret shared with the orchestrators: fan-outs and completions without a valid seal do
    /// not drive fan-in (see `agent_bus::seal`).
    #[arg(long, env = "AGENT_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<String>,
    /// What becomes of an explainability message without the orchestrators' seal (with a seal
    /// key): `require` leaves out whatever it says of the agent's sessions and documents (the
    /// services read those back and act on them) and dead-letters it, writing the rest; `warn`
    /// logs it and writes it all, for a rolling upgrade from a build that did not seal them.
    #[arg(long, env = "AGENT_EXPLAIN_SEALS", value_enum, default_value_t = ExplainSeals::Require)]
    pub explain_seals: ExplainSeals,
    /// Seconds between looks for calls parked for approval past their deadline.
    #[arg(long, env = "APPROVAL_SWEEP_SECS", default_value_t = 5)]
    pub approval_sweep_secs: u64,
    /// Seconds a fan-out waits for all its subagents before a partial synthesis.
    #[arg(long, env = "FANOUT_TIMEOUT_SECS", default_value_t = 300)]
    pub fanout_timeout_secs: u64,
    /// Seconds a nested fan-out stops waiting before the fan-out holding it does, so that its
    /// supervisor's partial answer still counts there (default: a quarter of the timeout).
    #[arg(long, env = "FANOUT_NESTED_GRACE_SECS")]
    pub fanout_nested_grace_secs: Option<u64>,
    #[command(flatten)]
    pub reads: ReadSettings,
    #[command(flatten)]
    pub http: agent_serve::HttpBounds,
    /// Seconds a published journal entry is kept once its dialog has concluded (a redelivery of
    /// its message is dropped while the entry is there); entries of dialogs that never concluded
    /// are kept seven times as long. 0 keeps everything.
    #[arg(long, env = "JOURNAL_RETENTION_SECS", default_value_t = 86_400)]
    pub journal_retention_secs: u64,
    /// Milliseconds a journal owner listens for an elder owner of its explainability
    /// subscription before it consumes or answers a journal call (`owner_fence`).
    #[arg(long, env = "AGGREGATOR_OWNER_LISTEN_MS", default_value_t = 1_000)]
    pub owner_listen_ms: u64,
    /// Where a fan-in's long subagent results are kept: `graph` (the store's documents graph) or
    /// `librarian` (TrustGraph's librarian on the broker, as the orchestrators' `DOCUMENT_STORE`).
    #[arg(long, env = "DOCUMENT_STORE", default_value = "graph", value_parser = ["graph", "librarian"])]
    pub document_store: String,
}

/// Whether explainability messages must carry the orchestrators' seal to write the agent's own
/// records (see `AggregatorSettings::explain_seals`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExplainSeals {
    Require,
    Warn,
}

/// How `/query` may be used: it must not be a way to take the service down.
#[derive(clap::Args, Debug, Clone)]
pub struct ReadSettings {
    /// Seconds a query may run; past it, its evaluation is stopped and the client gets 503 (a
    /// tool's query that said how long its caller waits, at what its caller has left). Also
    /// how long a stranger has to take its answer (its turn held meanwhile), and how long any
    /// connection may take nothing of what is written to it before it is closed.
    #[arg(long, env = "AGGREGATOR_QUERY_TIMEOUT_SECS", default_value_t = 30)]
    pub query_timeout_secs: u64,
    /// Queries without a token that run at once; more wait up to a second for a turn, then get
    /// 503 with `Retry-After`. Queries with the services' token (`CONFIG_TOKEN`: the
    /// orchestrators' journal and fan-in) never wait for a turn, unless they ask for a budget (a
    /// knowledge tool's query, a stranger's forwarded by a replica): those take a turn of as many
    /// more, their own, so that strangers cannot hold every turn the agents' tools need, and
    /// wait for it as long as their caller says it waits (at most the query time limit; a
    /// second when it says nothing).
    #[arg(long, env = "AGGREGATOR_MAX_QUERIES", default_value_t = 2)]
    pub max_queries: usize,
    /// Rows (or triples) a result may have; a larger one is refused.
    #[arg(long, env = "AGGREGATOR_MAX_RESULT_ROWS", default_value_t = 100_000)]
    pub max_result_rows: usize,
    /// Bindings (rows times the variables they carry) a query's evaluation may make in all, every
    /// step counted; past it the query is stopped and refused (413). The services' own queries
    /// (with `CONFIG_TOKEN`) are held to the time limit only. Its time limit alone bounds
    /// work, not memory: a cross product held in memory fills it well within 30 s. At most
    /// 2^64 - 2: 2^64 - 1 is how the services' own queries go unbudgeted, and a stranger's query
    /// given it would also go without the bound on the text one expression holds, and a SPARQL
    /// server would be let run its `SERVICE` calls.
    #[arg(
        long,
        env = "AGGREGATOR_MAX_QUERY_BINDINGS",
        default_value_t = agent_graph::QueryBounds::DEFAULT_MAX_BINDINGS,
        value_parser = clap::value_parser!(u64).range(1..u64::MAX)
    )]
    pub max_query_bindings: u64,
    /// Longest query text taken from anyone but the services (their own queries may be long); a
    /// longer one is refused (413) before it is parsed. Long texts are how a query asks for
    /// work that cannot be stopped: a sort by 300,000 conditions, a parse quadratic in the text.
    #[arg(long, env = "AGGREGATOR_MAX_QUERY_BYTES", default_value_t = 32 * 1024)]
    pub max_query_bytes: usize,
    /// Longest answer, written out, given to a query from anyone but the services (or one the
    /// services ask to bound, see `agent_graph::BINDINGS_HEADER`); a longer one is refused (413).
    /// An answer within its rows may still be long: each row holds its own copy of a long
    /// literal, and JSON writes a control character in six bytes.
    #[arg(long, env = "AGGREGATOR_MAX_ANSWER_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_answer_bytes: usize,
    /// When set, `/query` needs this bearer token (or the services' token); without it reads
    /// are open.
    #[arg(long, env = "AGGREGATOR_QUERY_TOKEN", hide_env_values = true)]
    pub query_token: Option<String>,
}

impl ReadSettings {
    /// The query time limit, a second to a day: "no limit" written as a huge number must not
    /// overflow the deadlines it sets.
    pub fn query_timeout(&self) -> Duration {
        Duration::from_secs(self.query_timeout_secs.clamp(1, 86_400))
    }
}

impl Default for ReadSettings {
    fn default() -> Self {
        ReadSettings {
            query_timeout_secs: 30,
            max_queries: 2,
            max_result_rows: 100_000,
            max_query_bindings: agent_graph::QueryBounds::DEFAULT_MAX_BINDINGS,
            max_query_bytes: 32 * 1024,
            max_answer_bytes: 64 * 1024 * 1024,
            query_token: None,
        }
    }
}

impl AggregatorSettings {
    /// Settings for an embedded store in `dir`, served on `http_addr` (used by `agentctl up`).
    pub fn embedded(broker: BrokerArgs, dir: PathBuf, http_addr: SocketAddr) -> AggregatorSettings {
        AggregatorSettings {
            broker,
            graph_store: dir.display().to_string(),
            http_addr,
            config_token: None,
            sync_writes: true,
            max_in_flight: 16,
            subscription: "agent-aggregator".to_owned(),
            explain_topic: None,
            request_topic: None,
            fanout_timeout_secs: 300,
            fanout_nested_grace_secs: None,
            approval_sweep_secs: 5,
            seal_key: None,
            explain_seals: ExplainSeals::Require,
            reads: ReadSettings::default(),
            http: agent_serve::HttpBounds::default(),
            journal_retention_secs: 86_400,
            owner_listen_ms: 1_000,
            document_store: "graph".to_owned(),
        }
    }
}

/// The journal this aggregator serves. It owns the journal of an embedded store, and of a SPARQL
/// server (which need not isolate updates: the owner decides who wins). In front of another
/// aggregator it forwards to that one, so a store's journal always has one owner.
async fn journal_of(store: &GraphStore) -> anyhow::Result<agent_graph::journal::Journal> {
    if store.is_embedded() {
        return Ok(store.owned_journal());
    }
    let forward = store.journal();
    let started = std::time::Instant::now();
    loop {
        match forward.check().await {
            Ok(()) => {
                tracing::info!(
                    "the store is another aggregator's: its journal is served from there"
                );
                return Ok(forward);
            }
            Err(agent_graph::GraphError::NoJournal(_)) => {
                tracing::info!("the store is a SPARQL server: this aggregator owns its journal (run one replica)");
                return Ok(store.owned_journal());
            }
            Err(
                e @ agent_graph::GraphError::Http {
                    status: 401 | 403, ..
                },
            ) => {
                anyhow::bail!("the aggregator at GRAPH_STORE refuses this one's token: {e}")
            }
            Err(e) if started.elapsed() < Duration::from_secs(60) => {
                tracing::warn!(error = %e, "the graph store does not answer yet");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => anyhow::bail!("the graph store does not answer: {e}"),
        }
    }
}

/// Runs until `shutdown`: the consumer and the SPARQL, health and readiness endpoint.
pub async fn run(settings: AggregatorSettings, shutdown: CancellationToken) -> anyhow::Result<()> {
    agent_bus::seal::refuse_published_secrets(&[
        ("CONFIG_TOKEN", settings.config_token.as_deref()),
        ("AGENT_SEAL_KEY", settings.seal_key.as_deref()),
    ])
    .map_err(anyhow::Error::msg)?;
    // Its start, first: of two owners started on one subscription, the first started keeps it.
    let owner = Owner::this_process(&without_credentials(&settings.graph_store));
    let token = settings.config_token.clone().filter(|t| !t.is_empty());
    oxigraph::store::set_sync_writes(settings.sync_writes);
    let store = GraphStore::open(&settings.graph_store, token.clone())
        .with_context(|| format!("opening the graph store {}", settings.graph_store))?;
    // Served for a remote store too: health and readiness on every replica, and one SPARQL address
    // per aggregator whatever the store is.
    let listener = tokio::net::TcpListener::bind(settings.http_addr)
        .await
        .with_context(|| format!("binding {}", settings.http_addr))?;
    let served_at = listener.local_addr()?;
    tracing::info!(addr = %served_at, "serving SPARQL");
    metrics::describe();
    let stats = Arc::new(ConsumerStats::default());
    let journal = journal_of(&store).await?;
    let seal =
        agent_bus::seal::SealKey::configured(settings.seal_key.as_deref(), "agent-aggregator");
    let (fence, announcer) = match journal {
        agent_graph::journal::Journal::Owner(_) => {
            let (fence, announcer) = owner_fence::listening(JOURNAL_OWNERS, seal.clone());
            (fence, Some(announcer))
        }
        agent_graph::journal::Journal::Remote(_) => (Fence::open(JOURNAL_OWNERS), None),
    };
    // A SPARQL server may be reached by owners the broker cannot tell apart; an embedded store
    // is one process's alone (RocksDB locks its directory).
    let shared_store =
        (announcer.is_some() && !store.is_embedded()).then(|| store_beacon::shared(store.clone()));
    // Only the journal's owner prunes it: a replica pointed at the owner's endpoint would prune
    // the owner's journal with its own retention (the default day where the owner keeps all).
    let owns_journal = matches!(journal, agent_graph::journal::Journal::Owner(_));
    let (in_process_journal, in_process_token) = (journal.clone(), token.clone());
    let app = http::router(
        store.clone(),
        journal,
        fence.clone(),
        token,
        stats.clone(),
        &settings.reads,
    );
    // A client that takes nothing of what it is sent for a query's time limit is gone.
    let server = tokio::spawn(agent_serve::serve(
        "aggregator",
        listener,
        app,
        settings.http.clone(),
        settings.reads.query_timeout(),
        shutdown.clone(),
    ));

    let bus = settings.broker.connect().await?;
    let topics = settings.broker.topics();
    let topic = settings
        .explain_topic
        .clone()
        .unwrap_or(topics.explainability.clone());
    let subscription = SubscriptionConfig {
        dead_letter_topic: agent_bus::dead_letter_of(&topic),
        topic,
        subscription: settings.subscription.clone(),
        max_in_flight: settings.max_in_flight,
        // A message that decodes is never given up on: writes are idempotent, so a failure is a
        // store outage to wait out, and provenance must not be discarded for it. Poison (not
        // JSON, not RDF) is dead-lettered by the writer itself. A broker-side count would also
        // misfire on pulsar-lite, which raises it each time it tries a dead consumer's
        // connection (seen in the kill test: a valid message dead-lettered after a SIGKILL).
        max_redeliveries: None,
        drain_deadline: Duration::from_secs(10),
        nack_delay: Duration::from_secs(1),
        one_at_a_time: false,
    };
    // The announcements stop whenever this returns, on any path: a process that failed must not
    // go on claiming the journal (inside `agentctl up`, its runtime outlives it).
    let announcing_stops = shutdown.child_token();
    let _stop_announcing = announcing_stops.clone().drop_guard();
    let announcing = match announcer {
        Some(announcer) => Some(
            announcer
                .start(
                    &bus,
                    &owner_fence::beacon_topic(
                        &JOURNAL_OWNERS,
                        &subscription.topic,
                        &subscription.subscription,
                    ),
                    owner,
                    Duration::from_millis(settings.owner_listen_ms),
                    shared_store,
                    announcing_stops.clone(),
                    shutdown.clone(),
                )
                .await?,
        ),
        None => None,
    };
    // Nothing is consumed, swept or answered to a journal call before this process knows it is
    // the only owner: a refused one stops here, before it has written anything.
    if let Err(why) = fence.admitted().await {
        // Not refused: asked to stop, or the fence's task ended by itself (which must not pass
        // for a clean stop).
        let asked_to_stop = shutdown.is_cancelled();
        shutdown.cancel();
        let _ = agent_bus::http_stopped(server, agent_bus::HTTP_DRAIN).await;
        if fence.refusal().is_none() && asked_to_stop {
            // Asked to stop while it listened.
            return Ok(());
        }
        anyhow::bail!(why);
    }
    // An orchestrator in this process asks this journal directly, not over loopback HTTP (only
    // now: the owner is known; and for as long as this runs).
    let _in_process = agent_graph::in_process::serve(
        endpoint_bases(served_at),
        in_process_token,
        in_process_journal,
        metrics::journal_record,
        {
            let fence = fence.clone();
            Box::new(move || fence.refusal().is_none())
        },
    );
    let request_topic = settings
        .request_topic
        .clone()
        .unwrap_or(topics.request.clone());
    let requests = agent_bus::Publisher::new(&bus, &request_topic).await?;
    // Within a year, so the sweep's date arithmetic cannot overflow.
    let timeout = Duration::from_secs(settings.fanout_timeout_secs.clamp(1, 365 * 24 * 3600));
    let librarian = match settings.document_store.as_str() {
        "librarian" => Some(Arc::new(
            agent_bus::Librarian::connect(&bus, &topics, Duration::from_secs(30)).await?,
        )),
        _ => None,
    };
    let grace = settings
        .fanout_nested_grace_secs
        .map_or(timeout / 4, Duration::from_secs)
        .min(timeout);
    // A store written by an earlier build, or an aggregator of one still running beside this one,
    // holds fan-outs and approvals that wait without the marks the sweeps start from.
    let marking = tokio::spawn(mark_what_waits(store.clone(), shutdown.clone()));
    let sweeper = tokio::spawn(fanin::sweep(
        store.clone(),
        requests.clone(),
        seal.clone(),
        librarian.clone(),
        fanin::Deadlines { timeout, grace },
        // Often enough that a nested fan-out is answered within its grace, before the fan-out
        // holding it is due (found due together, the holder is answered first).
        (timeout / 4)
            .min(if grace.is_zero() { timeout } else { grace })
            .clamp(Duration::from_millis(500), Duration::from_secs(30)),
        shutdown.clone(),
    ));
    let approvals = tokio::spawn(approvals::sweep(
        store.clone(),
        agent_bus::Publisher::new(&bus, &topics.control_request).await?,
        seal.clone(),
        Duration::from_secs(settings.approval_sweep_secs.clamp(1, 3600)),
        shutdown.clone(),
    ));
    let pruner = (owns_journal && settings.journal_retention_secs > 0).then(|| {
        // Within ten years, so the cut-off arithmetic cannot overflow.
        let retention =
            Duration::from_secs(settings.journal_retention_secs.min(10 * 365 * 24 * 3600));
        tokio::spawn(journal_prune::prune(
            store.clone(),
            retention,
            shutdown.clone(),
        ))
    });
    let writer = Arc::new(writer::Writer::new(
        store,
        Some(requests),
        seal,
        settings.explain_seals,
        librarian,
    ));
    let consumed = run_consumer(
        &bus,
        subscription,
        stats,
        shutdown.clone(),
        move |delivery| {
            let writer = writer.clone();
            async move { writer.handle(delivery).await }
        },
    )
    .await;
    shutdown.cancel();
    let _ = marking.await;
    let _ = sweeper.await;
    let _ = approvals.await;
    if let Some(pruner) = pruner {
        let _ = pruner.await;
    }
    if let Some(announcing) = announcing {
        let _ = announcing.await;
    }
    agent_bus::http_stopped(server, agent_bus::HTTP_DRAIN).await?;
    if let Some(why) = fence.refusal() {
        anyhow::bail!(why);
    }
    consumed?;
    Ok(())
}

/// When [`mark_what_waits`] reads the record again after its first pass, counted from the
/// aggregator's start: an aggregator of the build before that still runs beside this one during a
/// rolling upgrade writes fan-outs and approvals without marks after this one's first pass, and
/// once it is gone nothing else would mark them (their timeouts and expiries would never fire).
/// A rollout is over within the hour in most deployments; after that a pass every six hours
/// covers one that is not, at the cost of one read of every fan-out and approval recorded.
const MARKING_AGAIN_AFTER: [Duration; 4] = [
    Duration::from_secs(60),
    Duration::from_secs(5 * 60),
    Duration::from_secs(15 * 60),
    Duration::from_secs(60 * 60),
];
const MARKING_PERIOD: Duration = Duration::from_secs(6 * 60 * 60);

/// Marks every fan-out and approval that waits without a mark ([`agent_graph::waiting`]), at
/// start and again at [`MARKING_AGAIN_AFTER`] and every [`MARKING_PERIOD`] after that, each pass
/// trying again (backing off to a minute) until it has; until `shutdown`, which also stops a
/// pass midway. Off every message's path.
async fn mark_what_waits(store: agent_graph::GraphStore, shutdown: CancellationToken) {
    let started = tokio::time::Instant::now();
    let mut pass: usize = 0;
    loop {
        let mut wait = Duration::from_secs(1);
        loop {
            let marked = tokio::select! {
                _ = shutdown.cancelled() => return,
                marked = agent_graph::waiting::mark_unmarked(&store) => marked,
            };
            match marked {
                Ok(0) => break,
                Ok(marked) => {
                    tracing::info!(marked, "marked the fan-outs and approvals that waited without a mark (written by an aggregator of an earlier build)");
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_secs = wait.as_secs(), "could not mark the fan-outs and approvals that wait; trying again")
                }
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
            }
            wait = (wait * 2).min(Duration::from_secs(60));
        }
        let next = match MARKING_AGAIN_AFTER.get(pass) {
            Some(after) => started + *after,
            None => tokio::time::Instant::now() + MARKING_PERIOD,
        };
        pass += 1;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(next) => {}
        }
    }
}

/// The base URLs that name this process's endpoint at `addr` from inside it: its address, and
/// the loopback address of its family when it listens on all. (Not `localhost`, which may name
/// another family's loopback, where another process could listen.)
fn endpoint_bases(addr: std::net::SocketAddr) -> Vec<String> {
    let mut bases = vec![format!("http://{addr}")];
    if addr.ip().is_unspecified() {
        let loopback = match addr {
            std::net::SocketAddr::V4(_) => std::net::IpAddr::from([127, 0, 0, 1]),
            std::net::SocketAddr::V6(_) => std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        };
        bases.push(format!(
            "http://{}",
            std::net::SocketAddr::new(loopback, addr.port())
        ));
    }
    bases
}

/// A store's address as it may be shown to others: an endpoint without its user and password.
fn without_credentials(store: &str) -> String {
    let Some((scheme, rest)) = store.split_once("://") else {
        return store.to_owned();
    };
    let (authority, path) = match rest.find('/') {
        Some(at) => rest.split_at(at),
        None => (rest, ""),
    };
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://{host}{path}"),
        None => store.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::without_credentials;
    use clap::Parser;

    #[derive(Parser)]
    struct Reads {
        #[command(flatten)]
        reads: super::ReadSettings,
    }

    #[test]
    fn a_strangers_budget_cannot_be_the_services_unbudgeted_mark() {
        let most = (u64::MAX - 1).to_string();
        let parsed = Reads::try_parse_from(["aggregator", "--max-query-bindings", &most]);
        assert_eq!(
            parsed.map(|p| p.reads.max_query_bindings).ok(),
            Some(u64::MAX - 1)
        );
        let unbudgeted = u64::MAX.to_string();
        assert!(
            Reads::try_parse_from(["aggregator", "--max-query-bindings", &unbudgeted]).is_err()
        );
        assert!(Reads::try_parse_from(["aggregator", "--max-query-bindings", "0"]).is_err());
    }

    #[test]
    fn a_store_is_announced_without_its_credentials() {
        assert_eq!(
            without_credentials("http://user:secret@fuseki:3030/ds"),
            "http://fuseki:3030/ds"
        );
        assert_eq!(without_credentials("https://a@b"), "https://b");
        assert_eq!(without_credentials("http://host/x@y"), "http://host/x@y");
        assert_eq!(without_credentials(".data/graph"), ".data/graph");
    }
}
