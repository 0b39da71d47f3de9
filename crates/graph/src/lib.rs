//! The graph store behind one small interface: embedded `oxigraph` (RocksDB on disk, or in memory for
//! tests) or any SPARQL 1.1 endpoint over HTTP. Embedded calls run on the blocking pool so they never
//! stall the async workers. The queries the system needs live in [`queries`], built from typed terms.

pub mod batch;
pub mod convert;
pub mod explain;
pub mod in_process;
pub mod journal;
pub mod nesting;
pub mod planning;
pub mod queries;
pub mod recorded;
mod remote;
mod takings;
pub mod turns;
pub mod waiting;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use oxigraph::model::{Quad, Term};
use oxigraph::sparql::{QueryResults, SparqlEvaluator};
use oxigraph::store::Store;

pub use oxigraph::model;
pub use remote::RemoteSparql;

/// Why a store operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    #[error("the graph store failed: {0}")]
    Storage(String),
    #[error("invalid SPARQL: {0}")]
    Syntax(String),
    #[error("the query failed: {0}")]
    Evaluation(String),
    #[error("the SPARQL endpoint answered HTTP {status}: {body}")]
    Http { status: u16, body: String },
    #[error("cannot reach the SPARQL endpoint: {0}")]
    Transport(String),
    #[error("the SPARQL endpoint's answer is malformed: {0}")]
    Malformed(String),
    #[error("the store is read-only")]
    ReadOnly,
    /// A query stopped at its time limit (its evaluation was cancelled, nothing runs on).
    #[error("the query ran past its limit of {0:?} and was stopped")]
    TimedOut(std::time::Duration),
    /// A query whose result has more rows (or triples) than allowed.
    #[error("the query's result has more than {0} rows")]
    TooManyRows(usize),
    /// A query whose evaluation made more than the bindings allowed (rows times the variables
    /// they carry, every step of it counted) and was stopped.
    #[error("the query's evaluation made more than {0} bindings (rows times their variables) and was stopped")]
    TooMuchWork(u64),
    /// A query whose answer, written out, would take more than this many bytes.
    #[error("the query's answer takes more than {0} bytes")]
    AnswerTooLarge(usize),
    /// The endpoint is a SPARQL server, not a journal's owner: the journal is kept by the
    /// aggregator in front of the store, not by the store itself.
    #[error(
        "{0} serves no journal API: point GRAPH_STORE at the agent-aggregator that owns the store"
    )]
    NoJournal(String),
}

impl GraphError {
    /// Transient failures are worth another delivery; the others never succeed.
    pub fn retryable(&self) -> bool {
        match self {
            GraphError::Storage(_) | GraphError::Transport(_) => true,
            // 408: the request's body did not reach the server in time (a slow link).
            GraphError::Http { status, .. } => *status == 408 || *status == 429 || *status >= 500,
            _ => false,
        }
    }
}

/// The answer to a query, the same whichever backend ran it.
#[derive(Debug, Clone, PartialEq)]
pub enum QueryAnswer {
    Rows(Rows),
    Boolean(bool),
    Graph(Vec<oxigraph::model::Triple>),
}

/// SELECT results: variable names and one row of optional bindings per solution.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rows {
    pub variables: Vec<String>,
    pub rows: Vec<Vec<Option<Term>>>,
}

impl Rows {
    /// The binding of `variable` in the first row.
    pub fn first(&self, variable: &str) -> Option<&Term> {
        let i = self.variables.iter().position(|v| v == variable)?;
        self.rows.first()?.get(i)?.as_ref()
    }

    /// The bindings of `variable`, one per row.
    pub fn column(&self, variable: &str) -> Vec<Option<&Term>> {
        match self.variables.iter().position(|v| v == variable) {
            Some(i) => self
                .rows
                .iter()
                .map(|r| r.get(i).and_then(Option::as_ref))
                .collect(),
            None => Vec::new(),
        }
    }
}

impl QueryAnswer {
    pub fn rows(self) -> Rows {
        match self {
            QueryAnswer::Rows(rows) => rows,
            _ => Rows::default(),
        }
    }
}

/// Serialises SPARQL updates on embedded stores (see [`GraphStore::update`]).
static SERIAL_UPDATES: std::sync::Mutex<()> = std::sync::Mutex::new(());
/// The endpoint's updates wait here for their turn before they take [`SERIAL_UPDATES`] on a
/// thread: a queue of them holds no thread, and one whose client went leaves it.
static ENDPOINT_UPDATES: std::sync::LazyLock<Arc<tokio::sync::Mutex<()>>> =
    std::sync::LazyLock::new(Arc::default);
/// Serialises this process's SPARQL updates to one endpoint: a turn for each endpoint, not one for
/// the process. With one for the process, a process that was a client of an aggregator's endpoint
/// and that aggregator too, its graph in a SPARQL server, waited on itself: the client's update
/// held the turn the aggregator needed to forward it, until the client timed out.
static SERIAL_REMOTE_UPDATES: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
> = std::sync::LazyLock::new(Default::default);

/// This process's turn for updates to the endpoint at `base`.
fn remote_update_turn(base: &str) -> Arc<tokio::sync::Mutex<()>> {
    SERIAL_REMOTE_UPDATES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .entry(base.to_owned())
        .or_default()
        .clone()
}

/// Where the graph lives.
#[derive(Clone)]
pub struct GraphStore {
    backend: Backend,
    /// Names this handle (and its clones) apart from every other opened in the process: what the
    /// journal's owner knows of a store is kept under it (see `journal::ExpectedSteps`).
    identity: u64,
}

/// A new `GraphStore::identity`.
fn new_identity() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

#[derive(Clone)]
enum Backend {
    Embedded {
        store: Store,
        /// Where this store's inserts go, in group commit; none when it was opened read-only.
        inserts: Option<Arc<EmbeddedInserts>>,
    },
    Remote(Arc<RemoteSparql>),
}

/// A backend that accepts writes (the embedded store is a cheap handle, cloned into blocking tasks).
enum Writable<'a> {
    Embedded(Store, &'a EmbeddedInserts),
    Remote(&'a RemoteSparql),
}

impl GraphStore {
    /// Opens `spec`: an `http(s)://` SPARQL endpoint base (serving `/query`, `/update`, `/store`) or a
    /// directory for the embedded store. One process owns a directory at a time.
    pub fn open(spec: &str, token: Option<String>) -> Result<GraphStore, GraphError> {
        if GraphStore::is_endpoint(spec) {
            return Ok(GraphStore {
                backend: Backend::Remote(Arc::new(RemoteSparql::new(spec, token)?)),
                identity: new_identity(),
            });
        }
        let store = Store::open(Path::new(spec)).map_err(|e| GraphError::Storage(e.to_string()))?;
        Ok(GraphStore {
            backend: Backend::Embedded {
                inserts: Some(EmbeddedInserts::start(&store)?),
                store,
            },
            identity: new_identity(),
        })
    }

    /// Whether `spec` names a SPARQL endpoint (`http(s)://`) rather than a store directory.
    pub fn is_endpoint(spec: &str) -> bool {
        spec.starts_with("http://") || spec.starts_with("https://")
    }

    /// Opens a directory that no running process writes to, for reading.
    pub fn open_read_only(dir: &Path) -> Result<GraphStore, GraphError> {
        let store = Store::open_read_only(dir).map_err(|e| GraphError::Storage(e.to_string()))?;
        Ok(GraphStore {
            backend: Backend::Embedded {
                inserts: None,
                store,
            },
            identity: new_identity(),
        })
    }

    /// An in-memory store (tests and benchmarks).
    pub fn in_memory() -> Result<GraphStore, GraphError> {
        let store = Store::new().map_err(|e| GraphError::Storage(e.to_string()))?;
        Ok(GraphStore {
            backend: Backend::Embedded {
                inserts: Some(EmbeddedInserts::start(&store)?),
                store,
            },
            identity: new_identity(),
        })
    }

    /// Where a write goes; an embedded store opened read-only refuses every write here.
    fn writable(&self) -> Result<Writable<'_>, GraphError> {
        match &self.backend {
            Backend::Embedded { inserts: None, .. } => Err(GraphError::ReadOnly),
            Backend::Embedded {
                store,
                inserts: Some(inserts),
            } => Ok(Writable::Embedded(store.clone(), inserts)),
            Backend::Remote(remote) => Ok(Writable::Remote(remote)),
        }
    }

    /// The embedded store, for a journal decision that reads and writes it in one task of the
    /// blocking pool; none for an endpoint or a store opened read-only.
    fn embedded_writable(&self) -> Option<Store> {
        match self.writable() {
            Ok(Writable::Embedded(store, _)) => Some(store),
            _ => None,
        }
    }

    /// The journal as this store's users reach it: kept here for an embedded store (this process
    /// owns it), asked of its owner for an endpoint (an aggregator's).
    pub fn journal(&self) -> journal::Journal {
        match &self.backend {
            Backend::Embedded { .. } => journal::Journal::Owner(self.clone()),
            Backend::Remote(remote) => journal::Journal::Remote(remote.clone()),
        }
    }

    /// A journal this process owns over this store, whatever the store is: only one process may
    /// own a store's journal (the aggregator, which runs as one replica).
    pub fn owned_journal(&self) -> journal::Journal {
        journal::Journal::Owner(self.clone())
    }

    pub fn is_embedded(&self) -> bool {
        matches!(self.backend, Backend::Embedded { .. })
    }

    /// When a connection to this store's server was last refused, if before `at` (see
    /// [`remote::RemoteSparql::refused_before`]); never for an embedded store.
    pub(crate) fn refused_before(&self, at: std::time::Instant) -> Option<std::time::Instant> {
        match &self.backend {
            Backend::Remote(remote) => remote.refused_before(at),
            Backend::Embedded { .. } => None,
        }
    }

    /// Claim-check: keeps `text` as a document and answers the excerpt (with its reference) to carry
    /// instead, when it is long; a short text, or one that is already an excerpt, comes back as it
    /// is. Should the store refuse, the text stays whole (bounded by the message size limit): a
    /// message is not lost for want of a smaller one.
    pub async fn check_in(&self, text: String) -> String {
        use agent_core::documents::{document_uri, wants_check_in};
        if !wants_check_in(&text) {
            return text;
        }
        let uri = document_uri(&text);
        self.check_in_as(text, &uri).await
    }

    /// [`GraphStore::check_in`] of a long text whose document name (`document_uri`) the caller
    /// already has.
    pub async fn check_in_as(&self, text: String, uri: &str) -> String {
        match self.keep_document(uri, &text).await {
            Ok(()) => agent_core::documents::excerpt_with_reference(&text, uri),
            Err(e) => {
                tracing::warn!(error = %e, bytes = text.len(), "a long text could not be kept as a document; the message carries it whole");
                text
            }
        }
    }

    /// Keeps `text` as the document `uri` in the documents graph (`tg:content`). A document is named
    /// by its text's digest, so keeping it again changes nothing.
    pub async fn keep_document(&self, uri: &str, text: &str) -> Result<(), GraphError> {
        let quad = Quad::new(
            model::NamedNode::new(uri).map_err(|e| GraphError::Syntax(e.to_string()))?,
            agent_core::vocab::tg::CONTENT.into_owned(),
            model::Literal::new_simple_literal(text),
            model::NamedNode::new_unchecked(agent_core::vocab::DOCUMENTS_GRAPH),
        );
        self.insert(vec![quad]).await
    }

    /// Adds quads in one transaction. RDF graphs are sets, so adding what is there changes nothing:
    /// a redelivered message is harmless.
    pub async fn insert(&self, quads: Vec<Quad>) -> Result<(), GraphError> {
        match self.writable()? {
            Writable::Embedded(_, inserts) => inserts.insert(quads).await,
            Writable::Remote(remote) => remote.insert_batched(quads).await,
        }
    }

    /// Runs a SPARQL query within `bounds`: on an embedded store its evaluation is cancelled at
    /// the time limit, or as soon as the returned future is dropped (an HTTP client that went
    /// away), so no abandoned query keeps a core busy.
    ///
    /// On a SPARQL server, a query held to a budget says how long its caller waits
    /// ([`WITHIN_HEADER`]: the time limit), so that the aggregator may keep it waiting for a turn
    /// that long, and no longer.
    pub async fn query_bounded(
        &self,
        sparql: String,
        bounds: QueryBounds,
    ) -> Result<QueryAnswer, GraphError> {
        self.query_bounded_holding(sparql, bounds, (), true).await
    }

    /// [`Self::query_bounded`], keeping `held` (a permit to run a query) until the evaluation
    /// has really ended: after its time limit it may still be finishing a step the cancellation
    /// token is not checked in, and a permit released at the limit would let more start beside it.
    /// On a SPARQL server, which cannot be told to stop, that is when the server answers.
    /// `caller_waits`: the query's caller waits its whole time limit (a tool's, or one a replica
    /// passes on for a tool), so a server that takes budgeted queries in turns may keep it
    /// waiting for one that long ([`WITHIN_HEADER`]); a stranger's query a replica forwards does
    /// not, and waits a second there as a stranger's does.
    pub async fn query_bounded_holding<H: Send + 'static>(
        &self,
        sparql: String,
        bounds: QueryBounds,
        held: H,
        caller_waits: bool,
    ) -> Result<QueryAnswer, GraphError> {
        match &self.backend {
            Backend::Embedded { store, .. } => {
                let store = store.clone();
                let cancel =
                    oxigraph::sparql::CancellationToken::with_binding_budget(bounds.max_bindings);
                let _stop_when_dropped = CancelOnDrop(cancel.clone());
                let token = cancel.clone();
                let evaluation = tokio::task::spawn_blocking(move || {
                    let _held_until_ended = held;
                    query_embedded(&store, &sparql, Some((token, bounds)))
                });
                match tokio::time::timeout(bounds.timeout, evaluation).await {
                    Ok(Ok(Ok(answer))) => Ok(answer),
                    // A sort cancelled midway compares no more, which the standard library's
                    // sort may take for a broken order and panic (caught on the pool, or on a deep
                    // query's own thread): the query was stopped, whatever the error says.
                    Ok(_) if cancel.budget_exhausted() => {
                        Err(GraphError::TooMuchWork(bounds.max_bindings))
                    }
                    Ok(_) if cancel.is_cancelled() => Err(GraphError::TimedOut(bounds.timeout)),
                    Ok(Ok(Err(e))) => Err(e),
                    Ok(Err(e)) => Err(GraphError::Storage(format!("store task failed: {e}"))),
                    Err(_) => {
                        cancel.cancel();
                        Err(GraphError::TimedOut(bounds.timeout))
                    }
                }
            }
            Backend::Remote(remote) => {
                // The server holds the query to the budget asked of it (a replica forwarding a
                // stranger's, a tool's query an LLM wrote) where it would otherwise take the
                // services' own queries at their word.
                let budget = (bounds.max_bindings != u64::MAX).then_some(bounds.max_bindings);
                if budget.is_some() {
                    refuse_services(sparql.clone()).await?;
                }
                // The server evaluates on after this side stops waiting (past the limit, or its
                // caller gone): the query, and `held` with it, goes on until the server answers
                // or the connection's own time limit ends it, so no more queries run on the
                // server at once than there are permits.
                let within = (budget.is_some() && caller_waits).then_some(bounds.timeout);
                let remote = remote.clone();
                let asked = tokio::spawn(async move {
                    let _held_until_the_server_answers = held;
                    remote
                        .query_within(&sparql, budget, within, bounds.max_rows)
                        .await
                });
                let answer = tokio::time::timeout(bounds.timeout, asked)
                    .await
                    .map_err(|_| GraphError::TimedOut(bounds.timeout))?
                    .map_err(|e| {
                        GraphError::Transport(format!("the query's task failed: {e}"))
                    })??;
                Ok(answer)
            }
        }
    }

    /// Whether the store answers a query at all (a readiness probe's question), as a message.
    pub async fn answers(&self) -> Result<(), String> {
        let answer = self.query("ASK { }".to_owned()).await;
        answer.map(|_| ()).map_err(|e| e.to_string())
    }

    /// Runs a SPARQL query.
    pub async fn query(&self, sparql: String) -> Result<QueryAnswer, GraphError> {
        match &self.backend {
            Backend::Embedded { store, .. } => {
                let store = store.clone();
                blocking(move || query_embedded(&store, &sparql, None)).await
            }
            Backend::Remote(remote) => remote.query(&sparql).await,
        }
    }

    /// Runs a SPARQL update. Updates to an embedded store run one at a time: oxigraph evaluates an
    /// update on a snapshot and then writes, so two conditional inserts (`INSERT ... WHERE FILTER
    /// NOT EXISTS`) running at once could both see nothing and both write. Serialised, such an
    /// update is a compare-and-set, for this process and for every client of its endpoint.
    pub async fn update(&self, sparql: String) -> Result<(), GraphError> {
        self.update_built(move || sparql).await
    }

    /// As [`GraphStore::update`], the update's text written by `build` once it has its turn:
    /// for an update that stamps the time (a claim and its lease), which must be the time it
    /// is applied, not the time it began to wait behind others.
    pub async fn update_built(
        &self,
        build: impl FnOnce() -> String + Send + 'static,
    ) -> Result<(), GraphError> {
        match self.writable()? {
            Writable::Embedded(store, _) => {
                blocking(move || {
                    let _one_at_a_time = SERIAL_UPDATES
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    let sparql = build();
                    // Not held to `nesting`'s bound: an update comes from the services or an
                    // operator (the endpoint's `/update` needs the token), and an `INSERT DATA` of
                    // long documents holds many characters that bound would count.
                    SparqlEvaluator::new()
                        .parse_update(&sparql)
                        .map_err(|e| GraphError::Syntax(e.to_string()))?
                        .on_store(&store)
                        .execute()
                        .map_err(|e| GraphError::Evaluation(e.to_string()))
                })
                .await
            }
            Writable::Remote(remote) => {
                // The same for an endpoint: a SPARQL server need not isolate updates, and this
                // process's conditional updates (a fan-in's claim) must not interleave.
                let turn = remote_update_turn(remote.base());
                let _one_at_a_time = turn.lock().await;
                remote.update(&build()).await
            }
        }
    }

    /// Runs a SPARQL update within `bounds`' time limit and budget of bindings (its rows do not
    /// apply): what the endpoint's `/update` runs, for the services and operators. An update to
    /// an embedded store holds the turn every update of this process waits for (the fan-ins'
    /// claims among them), so one that ran on would stop them all. The time limit runs from its
    /// turn (callers queued for one hold no thread, and leave the queue when they go). Stopped at
    /// its limit, or when the returned future is dropped (its client went), its evaluation ends
    /// at its next step and it writes nothing. The answer is the truth: past the limit it waits
    /// for the evaluation to end, and an update that committed meanwhile (an `INSERT DATA`,
    /// which has no steps to stop at) is answered as done. Its patterns are planned as a query's
    /// are (one too large to order in time runs as written, a larger one is refused). On a
    /// SPARQL server it runs as [`Self::update`]: the server bounds its own.
    pub async fn update_bounded(
        &self,
        sparql: String,
        bounds: QueryBounds,
    ) -> Result<(), GraphError> {
        let store = match self.writable()? {
            Writable::Embedded(store, _) => store,
            Writable::Remote(_) => return self.update(sparql).await,
        };
        let turn = ENDPOINT_UPDATES.clone().lock_owned().await;
        let cancel = oxigraph::sparql::CancellationToken::with_binding_budget(bounds.max_bindings);
        let _stop_when_dropped = CancelOnDrop(cancel.clone());
        let token = cancel.clone();
        let mut evaluation = tokio::task::spawn_blocking(move || {
            let _turn_until_ended = turn;
            update_embedded(&store, &sparql, &token)
        });
        let ended = match tokio::time::timeout(bounds.timeout, &mut evaluation).await {
            Ok(ended) => ended,
            Err(_) => {
                cancel.cancel();
                evaluation.await
            }
        };
        match ended {
            Ok(Ok(())) => Ok(()),
            Ok(Err(GraphError::Syntax(e))) => Err(GraphError::Syntax(e)),
            _ if cancel.budget_exhausted() => Err(GraphError::TooMuchWork(bounds.max_bindings)),
            _ if cancel.is_cancelled() => Err(GraphError::TimedOut(bounds.timeout)),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(GraphError::Storage(format!("store task failed: {e}"))),
        }
    }

    /// Runs a SPARQL update that touches only nodes no other update of this process writes (a
    /// journal owner's own record): it need not wait for this process's other updates, which may
    /// be slow, and an endpoint's update goes at once. An embedded store still runs it in turn.
    pub async fn update_own(&self, sparql: String) -> Result<(), GraphError> {
        match self.writable()? {
            Writable::Remote(remote) => remote.update(&sparql).await,
            Writable::Embedded(..) => self.update(sparql).await,
        }
    }

    /// Loads RDF text (`format` a MIME type: N-Triples, N-Quads, Turtle, TriG) into `graph` (None =
    /// the default graph, or the graphs the data names).
    pub async fn load(
        &self,
        data: Vec<u8>,
        format: &str,
        graph: Option<String>,
    ) -> Result<(), GraphError> {
        match self.writable()? {
            Writable::Embedded(store, _) => {
                let format = oxigraph::io::RdfFormat::from_media_type(format).ok_or_else(|| {
                    GraphError::Syntax(format!("unsupported RDF format {format}"))
                })?;
                blocking(move || {
                    let mut parser = oxigraph::io::RdfParser::from_format(format);
                    if let Some(g) = graph {
                        let g = oxigraph::model::NamedNode::new(g)
                            .map_err(|e| GraphError::Syntax(e.to_string()))?;
                        parser = parser.with_default_graph(g);
                    }
                    store.load_from_slice(parser, &data).map_err(load_failure)
                })
                .await
            }
            Writable::Remote(remote) => remote.load(data, format, graph.as_deref()).await,
        }
    }

    /// Loads many quads fast, without one big transaction (embedded stores only; benchmarks and
    /// imports, where atomicity is not needed).
    pub async fn bulk_load(&self, quads: Vec<Quad>) -> Result<(), GraphError> {
        match self.writable()? {
            Writable::Embedded(store, _) => {
                blocking(move || {
                    store
                        .bulk_loader()
                        .load_quads(quads)
                        .map_err(|e| GraphError::Storage(e.to_string()))
                })
                .await
            }
            Writable::Remote(remote) => remote.insert(&quads).await,
        }
    }

    /// What the graph `graph` says about each of `subjects` (predicate, object), in order: on an
    /// embedded store direct index lookups in one task of the blocking pool, no SPARQL to parse
    /// and plan; on an endpoint one query for all (the journal asks this for each batch of
    /// lookups or records it decides).
    pub async fn about_each(
        &self,
        subjects: &[oxigraph::model::NamedNode],
        graph: &oxigraph::model::NamedNode,
    ) -> Result<Vec<Vec<(oxigraph::model::NamedNode, Term)>>, GraphError> {
        if subjects.is_empty() {
            return Ok(Vec::new());
        }
        match &self.backend {
            Backend::Embedded { store, .. } => {
                let (store, subjects, graph) = (store.clone(), subjects.to_vec(), graph.clone());
                blocking(move || about_each_in(&store, &subjects, &graph)).await
            }
            Backend::Remote(remote) => {
                let values: std::collections::BTreeSet<String> =
                    subjects.iter().map(|s| s.to_string()).collect();
                let values: Vec<String> = values.into_iter().collect();
                let answer = remote
                    .query(&format!(
                        "SELECT ?s ?p ?o WHERE {{ VALUES ?s {{ {} }} GRAPH {graph} {{ ?s ?p ?o }} }}",
                        values.join(" ")
                    ))
                    .await?
                    .rows();
                let mut said: HashMap<String, Vec<(oxigraph::model::NamedNode, Term)>> =
                    HashMap::new();
                let column = |name: &str| answer.variables.iter().position(|v| v == name);
                let (Some(si), Some(pi), Some(oi)) = (column("s"), column("p"), column("o")) else {
                    return Err(GraphError::Storage(
                        "the endpoint answered without the columns asked for".to_owned(),
                    ));
                };
                for row in &answer.rows {
                    let (
                        Some(Some(Term::NamedNode(s))),
                        Some(Some(Term::NamedNode(p))),
                        Some(Some(o)),
                    ) = (row.get(si), row.get(pi), row.get(oi))
                    else {
                        continue;
                    };
                    said.entry(s.as_str().to_owned())
                        .or_default()
                        .push((p.clone(), o.clone()));
                }
                Ok(subjects
                    .iter()
                    .map(|s| said.get(s.as_str()).cloned().unwrap_or_default())
                    .collect())
            }
        }
    }

    /// Number of quads, for tests and benchmarks.
    pub async fn count(&self) -> Result<usize, GraphError> {
        let rows = self
            .query(
                "SELECT (COUNT(*) AS ?n) WHERE { { ?s ?p ?o } UNION { GRAPH ?g { ?s ?p ?o } } }"
                    .into(),
            )
            .await?
            .rows();
        let n = rows
            .column("n")
            .first()
            .copied()
            .flatten()
            .and_then(|t| match t {
                Term::Literal(l) => l.value().parse::<usize>().ok(),
                _ => None,
            })
            .unwrap_or(0);
        Ok(n)
    }
}

/// How long a query may run and how large its answer may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryBounds {
    pub timeout: std::time::Duration,
    pub max_rows: usize,
    /// Bindings (rows times the variables they carry) the evaluation's every step may make in
    /// all: what bounds the memory and the work of a query whose joins multiply rows in memory,
    /// where its time limit alone would let it fill the memory first.
    pub max_bindings: u64,
}

impl QueryBounds {
    /// The bindings a query may make unless configured otherwise: a few seconds of work, and at
    /// most a few GB held (a binding takes tens of bytes). Counting ten million triples passes
    /// as many rows through two or three steps: a store that large needs a larger budget.
    pub const DEFAULT_MAX_BINDINGS: u64 = 100_000_000;
}

/// The bytes of `term`'s text (an IRI, a blank node's id, a literal's value); 0 for a quoted
/// triple, which this build's queries do not make (RDF 1.2 is not enabled).
fn term_bytes(term: &Term) -> usize {
    match term {
        Term::NamedNode(node) => node.as_str().len(),
        Term::BlankNode(node) => node.as_str().len(),
        Term::Literal(literal) => literal.value().len(),
        #[allow(unreachable_patterns)]
        _ => 0,
    }
}

/// Cancels an evaluation when the future awaiting it is dropped.
struct CancelOnDrop(oxigraph::sparql::CancellationToken);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// Inserts into an embedded store, in group commit: inserts made while one is being written go
/// together in the next transaction, written by a thread of the store's own (so no runtime's
/// lifetime bounds it). RocksDB inserts one transaction's keys into its memtables one after
/// another, while transactions committed side by side insert theirs concurrently, where every key
/// costs a search of the memtable from its top; and each transaction pays its own commit
/// (write-ahead log, hand-offs between writer threads).
struct EmbeddedInserts {
    queue: Option<std::sync::mpsc::Sender<Insert>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

/// One caller's quads and where its outcome goes.
type Insert = (
    Vec<Quad>,
    tokio::sync::oneshot::Sender<Result<(), GraphError>>,
);

impl EmbeddedInserts {
    /// The most inserts written in one transaction.
    const MAX_TOGETHER: usize = 64;

    fn start(store: &Store) -> Result<Arc<EmbeddedInserts>, GraphError> {
        let (queue, inserts) = std::sync::mpsc::channel::<Insert>();
        let store = store.clone();
        let writer = std::thread::Builder::new()
            .name("graph-inserts".to_owned())
            .spawn(move || {
                while let Ok(first) = inserts.recv() {
                    let batch =
                        batch::gather(first, Self::MAX_TOGETHER, || inserts.try_recv().ok());
                    let (quads, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
                    let written = store
                        .extend(quads.into_iter().flatten())
                        .map_err(|e| e.to_string());
                    for reply in replies {
                        // A caller that went away no longer wants its outcome.
                        let _ = reply.send(written.clone().map_err(GraphError::Storage));
                    }
                }
            })
            .map_err(|e| GraphError::Storage(format!("cannot start the store's writer: {e}")))?;
        Ok(Arc::new(EmbeddedInserts {
            queue: Some(queue),
            writer: Some(writer),
        }))
    }

    async fn insert(&self, quads: Vec<Quad>) -> Result<(), GraphError> {
        let stopped = || GraphError::Storage("the store's writer has stopped".to_owned());
        let (reply, outcome) = tokio::sync::oneshot::channel();
        self.queue
            .as_ref()
            .ok_or_else(stopped)?
            .send((quads, reply))
            .map_err(|_| stopped())?;
        outcome.await.map_err(|_| stopped())?
    }
}

impl Drop for EmbeddedInserts {
    /// Waits for the writer to finish and let go of the store, so the directory can be opened
    /// again as soon as the last handle is dropped.
    fn drop(&mut self) {
        self.queue = None;
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

/// [`GraphStore::about_each`] on an embedded store, in the calling thread.
fn about_each_in(
    store: &Store,
    subjects: &[oxigraph::model::NamedNode],
    graph: &oxigraph::model::NamedNode,
) -> Result<Vec<Vec<(oxigraph::model::NamedNode, Term)>>, GraphError> {
    subjects
        .iter()
        .map(|subject| {
            store
                .quads_for_pattern(
                    Some(subject.as_ref().into()),
                    None,
                    None,
                    Some(graph.as_ref().into()),
                )
                .map(|quad| {
                    quad.map(|q| (q.predicate, q.object))
                        .map_err(|e| GraphError::Storage(e.to_string()))
                })
                .collect()
        })
        .collect()
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, GraphError> + Send + 'static,
) -> Result<T, GraphError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| GraphError::Storage(format!("store task failed: {e}")))?
}

/// Refuses a query that calls other endpoints (`SERVICE`), before a SPARQL server does it for
/// a stranger: Apache Jena Fuseki calls any URL it can reach by default, so a `SERVICE` clause
/// asked of our endpoint would make the server fetch from inside the network. (The embedded store
/// has no HTTP client and refuses them itself.) Parsed on a stack sized for the query.
///
/// Read twice: as our parser reads it, and with its `\u` escapes decoded first, as SPARQL 1.1
/// (19.2) has a server do. Our parser decodes them only inside a string or IRI, so to a server
/// that does as the spec says `"a\u0022 . SERVICE <..> {..} } #"` is a call the first reading
/// does not see. (Fuseki 5.6 reads the escape as our parser does; other servers may not.) The
/// query goes to the server as written: written out again from the parse, it could mean another
/// thing (a group's FILTER printed so that it covers the whole pattern).
async fn refuse_services(sparql: String) -> Result<(), GraphError> {
    blocking(move || {
        let calls_out = |text: &str| {
            nesting::with_stack_for(text, || {
                spargebra::SparqlParser::new()
                    .parse_query(text)
                    .map(|query| planning::measure(&query).services > 0)
                    .map_err(|e| GraphError::Syntax(e.to_string()))
            })
            .map_err(GraphError::Syntax)?
        };
        let as_written = calls_out(&sparql)?;
        // A text whose decoded form does not parse would not parse at such a server either.
        let decoded = with_codepoint_escapes_decoded(&sparql);
        let as_decoded = decoded != sparql && calls_out(&decoded).unwrap_or(false);
        if as_written || as_decoded {
            return Err(GraphError::Syntax(
                "SERVICE (a call to another endpoint) is not taken here".to_owned(),
            ));
        }
        Ok(())
    })
    .await
}

/// `text` with each `\uXXXX` and `\UXXXXXXXX` escape replaced by its character, once, as SPARQL
/// 1.1 (19.2) has a query read before its grammar. An escape that names no character is kept.
fn with_codepoint_escapes_decoded(text: &str) -> String {
    let mut decoded = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find('\\') {
        decoded.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let digits = match after.as_bytes().first() {
            Some(b'u') => 4,
            Some(b'U') => 8,
            _ => 0,
        };
        let named = after
            .get(1..1 + digits)
            .filter(|hex| digits > 0 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .and_then(char::from_u32);
        match named {
            Some(c) => {
                decoded.push(c);
                rest = &after[1 + digits..];
            }
            None => {
                decoded.push('\\');
                rest = after;
            }
        }
    }
    decoded.push_str(rest);
    decoded
}

/// Evaluates `sparql` on `store`; `bounded`: the token that stops it (at its time limit, or
/// past its budget of bindings) and the bounds its result is held to. It is parsed on a stack
/// sized for its brackets and operators, and evaluated on one sized for those and its patterns
/// too (see [`nesting::with_stack_for_levels`]).
fn query_embedded(
    store: &Store,
    sparql: &str,
    bounded: Option<(oxigraph::sparql::CancellationToken, QueryBounds)>,
) -> Result<QueryAnswer, GraphError> {
    nesting::with_stack_for(sparql, || {
        let query = spargebra::SparqlParser::new()
            .parse_query(sparql)
            .map_err(|e| GraphError::Syntax(e.to_string()))?;
        let levels = nesting::openers(sparql).saturating_add(planning::operands(&query));
        nesting::with_stack_for_levels(levels, || evaluate_embedded(store, query, bounded))
            .map_err(GraphError::Syntax)?
    })
    .map_err(GraphError::Syntax)?
}

/// [`query_embedded`]'s evaluation, on a thread with stack enough for `query`. One too large
/// for the optimizer to plan in time runs as written, one larger is refused (see [`planning`]).
fn evaluate_embedded(
    store: &Store,
    query: spargebra::Query,
    bounded: Option<(oxigraph::sparql::CancellationToken, QueryBounds)>,
) -> Result<QueryAnswer, GraphError> {
    let mut evaluator = SparqlEvaluator::new();
    if planning::plan(&query).map_err(GraphError::Syntax)? == planning::Plan::AsWritten {
        evaluator = evaluator.without_optimizations();
    }
    let Some((token, bounds)) = bounded else {
        let results = evaluator
            .for_query(query)
            .on_store(store)
            .execute()
            .map_err(|e| GraphError::Evaluation(e.to_string()))?;
        return collect(results);
    };
    let answer = evaluator
        .with_cancellation_token(token.clone())
        .for_query(query)
        .on_store(store)
        .execute()
        .map_err(|e| GraphError::Evaluation(e.to_string()))
        .and_then(|results| collect_at_most(results, bounds.max_rows, Some(&token)));
    // A step that took a cancellation for "no" (an EXISTS, a LIMIT met early) may still give an
    // answer: after the token ended the evaluation, no answer is one.
    if token.budget_exhausted() {
        return Err(GraphError::TooMuchWork(bounds.max_bindings));
    }
    if token.is_cancelled() {
        return Err(GraphError::TimedOut(bounds.timeout));
    }
    answer
}

/// [`GraphStore::update_bounded`]'s evaluation, in the calling thread: parsed, planned and
/// evaluated with stack enough for it, as [`query_embedded`] does a query, in this process's turn
/// for updates. Stopped by `token`, it commits nothing.
fn update_embedded(
    store: &Store,
    sparql: &str,
    token: &oxigraph::sparql::CancellationToken,
) -> Result<(), GraphError> {
    let levels = nesting::update_levels(sparql);
    nesting::with_stack_for_levels(levels, || {
        let update = spargebra::SparqlParser::new()
            .parse_update(sparql)
            .map_err(|e| GraphError::Syntax(e.to_string()))?;
        let (plan, operands) = planning::plan_update(&update).map_err(GraphError::Syntax)?;
        let levels = levels.saturating_add(operands);
        nesting::with_stack_for_levels(levels, || {
            let mut evaluator = SparqlEvaluator::new().with_cancellation_token(token.clone());
            if plan == planning::Plan::AsWritten {
                evaluator = evaluator.without_optimizations();
            }
            let _one_at_a_time = SERIAL_UPDATES
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Stopped while it waited for the turn: nothing of it has run.
            if token.is_cancelled() {
                return Err(GraphError::Evaluation("stopped before its turn".to_owned()));
            }
            evaluator
                .for_update(update)
                .on_store(store)
                .execute()
                .map_err(update_failure)
        })
        .map_err(GraphError::Syntax)?
    })
    .map_err(GraphError::Syntax)?
}

/// Why an update failed: the store (a full disk, RocksDB read-only after an error) or the
/// update. Told apart so the aggregator answers the first 500, which a replica writing through it
/// tries again, and only the second 400, which it dead-letters as a bad update (a fan-out lost
/// so, the supervisor it stands for was never resumed).
fn update_failure(e: oxigraph::sparql::UpdateEvaluationError) -> GraphError {
    match e {
        oxigraph::sparql::UpdateEvaluationError::Storage(e) => GraphError::Storage(e.to_string()),
        e => GraphError::Evaluation(e.to_string()),
    }
}

/// Why a load failed: as [`update_failure`], the store, or what was sent.
fn load_failure(e: oxigraph::store::LoaderError) -> GraphError {
    match e {
        oxigraph::store::LoaderError::Storage(e) => GraphError::Storage(e.to_string()),
        e => GraphError::Syntax(e.to_string()),
    }
}

/// Materialises results so they can cross the blocking-pool boundary.
pub(crate) fn collect(results: QueryResults<'_>) -> Result<QueryAnswer, GraphError> {
    collect_at_most(results, usize::MAX, None)
}

/// As [`collect`], refusing a result of more than `max_rows` rows or triples; `budget`: the
/// evaluation's token, whose budget the answer's terms are spent from as they are copied out (a
/// binding a term and one per 16 bytes of it: each row owns its copy of a long literal).
pub(crate) fn collect_at_most(
    results: QueryResults<'_>,
    max_rows: usize,
    budget: Option<&oxigraph::sparql::CancellationToken>,
) -> Result<QueryAnswer, GraphError> {
    let spend = |bindings: usize| -> Result<(), GraphError> {
        match budget {
            Some(token) if !token.spend_bindings(bindings) => Err(GraphError::Evaluation(
                "the binding budget was spent".to_owned(),
            )),
            _ => Ok(()),
        }
    };
    match results {
        QueryResults::Boolean(b) => Ok(QueryAnswer::Boolean(b)),
        QueryResults::Solutions(solutions) => {
            let variables: Vec<String> = solutions
                .variables()
                .iter()
                .map(|v| v.as_str().to_owned())
                .collect();
            let mut rows = Vec::new();
            for solution in solutions {
                let solution = solution.map_err(|e| GraphError::Evaluation(e.to_string()))?;
                if rows.len() == max_rows {
                    return Err(GraphError::TooManyRows(max_rows));
                }
                spend(
                    solution
                        .iter()
                        .map(|(_, term)| 1 + term_bytes(term) / 16)
                        .sum(),
                )?;
                rows.push(
                    variables
                        .iter()
                        .map(|v| solution.get(v.as_str()).cloned())
                        .collect(),
                );
            }
            Ok(QueryAnswer::Rows(Rows { variables, rows }))
        }
        QueryResults::Graph(triples) => {
            let mut collected = Vec::new();
            for triple in triples {
                if collected.len() == max_rows {
                    return Err(GraphError::TooManyRows(max_rows));
                }
                let triple = triple.map_err(|e| GraphError::Evaluation(e.to_string()))?;
                spend(3 + (term_bytes(&triple.object) + triple.predicate.as_str().len()) / 16)?;
                collected.push(triple);
            }
            Ok(QueryAnswer::Graph(collected))
        }
    }
}

/// Serialises an answer in the SPARQL 1.1 Query Results JSON format (or N-Triples for a graph).
pub fn serialize_answer(answer: &QueryAnswer) -> Result<(Vec<u8>, &'static str), GraphError> {
    serialize_answer_at_most(answer, usize::MAX)
}

/// The header in which a query with the services' token asks to be held to a budget of
/// bindings (a replica forwarding a stranger's query, a tool's query an LLM wrote): the server
/// holds it to that budget, and its answer to `AGGREGATOR_MAX_ANSWER_BYTES`, as a stranger's.
pub const BINDINGS_HEADER: &str = "x-agent-query-bindings";

/// The header in which a budgeted query with the services' token says how long its caller waits
/// for the answer, in milliseconds: the server may hold it that long for a turn (a tool's query
/// behind other tools'), and no longer, then evaluates it within what is left. One without it
/// (a replica forwarding a stranger's query, holding a turn of its own) waits a second, as a
/// stranger's does.
pub const WITHIN_HEADER: &str = "x-agent-query-within-ms";

/// A writer that refuses to hold more than `left` bytes.
struct AtMost {
    out: Vec<u8>,
    left: usize,
}

impl std::io::Write for AtMost {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.left = self
            .left
            .checked_sub(bytes.len())
            .ok_or_else(|| std::io::Error::other(TooLarge))?;
        self.out.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// What [`AtMost`] fails with, told apart from other write errors by its type.
#[derive(Debug, thiserror::Error)]
#[error("the answer is too large")]
struct TooLarge;

/// [`serialize_answer`], refused ([`GraphError::AnswerTooLarge`]) past `max_bytes`: an answer
/// within its rows may still be large when written (each row its own copy of a long literal,
/// each control character six bytes in JSON).
pub fn serialize_answer_at_most(
    answer: &QueryAnswer,
    max_bytes: usize,
) -> Result<(Vec<u8>, &'static str), GraphError> {
    use oxigraph::sparql::results::{QueryResultsFormat, QueryResultsSerializer};
    use std::io::Write;
    let io = |e: std::io::Error| {
        if e.get_ref().is_some_and(|inner| inner.is::<TooLarge>()) {
            GraphError::AnswerTooLarge(max_bytes)
        } else {
            GraphError::Malformed(e.to_string())
        }
    };
    let out = || AtMost {
        out: Vec::new(),
        left: max_bytes,
    };
    let serializer = QueryResultsSerializer::from_format(QueryResultsFormat::Json);
    match answer {
        QueryAnswer::Boolean(b) => Ok((
            serializer
                .serialize_boolean_to_writer(out(), *b)
                .map_err(io)?
                .out,
            "application/sparql-results+json",
        )),
        QueryAnswer::Rows(rows) => {
            let variables = rows
                .variables
                .iter()
                .map(|v| oxigraph::sparql::Variable::new(v.as_str()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| GraphError::Malformed(e.to_string()))?;
            let mut writer = serializer
                .serialize_solutions_to_writer(out(), variables.clone())
                .map_err(io)?;
            for row in &rows.rows {
                let bindings = variables
                    .iter()
                    .zip(row)
                    .filter_map(|(v, t)| t.as_ref().map(|t| (v.as_ref(), t.as_ref())));
                writer.serialize(bindings).map_err(io)?;
            }
            Ok((
                writer.finish().map_err(io)?.out,
                "application/sparql-results+json",
            ))
        }
        QueryAnswer::Graph(triples) => {
            let mut written = out();
            for t in triples {
                writeln!(written, "{t} .").map_err(io)?;
            }
            Ok((written.out, "application/n-triples"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store that failed is told from an update or a load that is wrong: the first is tried
    /// again, the second is not. Before, both were the update's (`Evaluation`) or the load's
    /// (`Syntax`) fault, and a replica dead-lettered what the owner's full disk refused.
    #[test]
    fn a_failing_store_is_not_the_writes_fault() {
        let full = || {
            oxigraph::store::StorageError::Io(std::io::Error::new(
                std::io::ErrorKind::StorageFull,
                "No space left on device",
            ))
        };
        let failed = update_failure(oxigraph::sparql::UpdateEvaluationError::Storage(full()));
        assert!(
            matches!(&failed, GraphError::Storage(why) if why.contains("No space")),
            "{failed:?}"
        );
        assert!(failed.retryable());
        let wrong = update_failure(oxigraph::sparql::UpdateEvaluationError::UnboundService);
        assert!(matches!(wrong, GraphError::Evaluation(_)), "{wrong:?}");
        assert!(!wrong.retryable());
        let failed = load_failure(oxigraph::store::LoaderError::Storage(full()));
        assert!(matches!(failed, GraphError::Storage(_)), "{failed:?}");
    }
}
