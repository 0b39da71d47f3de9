//! Any SPARQL 1.1 endpoint over HTTP: the Protocol for queries and updates, the Graph Store Protocol
//! for loads. The base URL serves `/query` and `/update` (Oxigraph server's layout, the aggregator's,
//! and a Jena Fuseki dataset's), and `/store` or `/data`; an aggregator also serves the journal API.

use std::time::{Duration, Instant};

use oxigraph::model::{GraphName, Quad};
use oxigraph::sparql::results::{QueryResultsFormat, QueryResultsParser};

use crate::batch::Batcher;
use crate::journal::{
    ChainBeat, ChainRefs, EntryRefs, JournalEntry, RecordRequest, RecordRequests, Taking,
    TakingRef, TakingRefs, MAX_BATCH,
};
use crate::turns::{Turn, TurnAsked};
use crate::{collect_at_most, GraphError, QueryAnswer};

/// A remote SPARQL endpoint.
pub struct RemoteSparql {
    api: Endpoint,
    journal: JournalCalls,
    /// Inserts made while one is on its way go together in the next `INSERT DATA` (group
    /// commit): a server that runs one write transaction at a time and commits each to disk
    /// (Jena TDB2) then commits many messages' quads at once instead of one each.
    inserts: Batcher<Vec<Quad>, Result<(), GraphError>>,
    /// The server's `scheme://host:port`, under which its refused connections are noted.
    origin: String,
}

/// When a connection to each server (by origin, `scheme://host:port`) was last refused: nothing
/// listened there then, so the process that served it before had stopped (see
/// [`RemoteSparql::refused_before`]).
static REFUSALS: std::sync::LazyLock<std::sync::Mutex<std::collections::HashMap<String, Instant>>> =
    std::sync::LazyLock::new(Default::default);

/// The most servers whose refusals are remembered (a process talks to one or two).
const MOST_REFUSING_SERVERS: usize = 64;

/// Notes `e` if it is a refused connection, under its server's origin.
fn note_refusal(e: &reqwest::Error) {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    let mut refused = false;
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            refused = true;
            break;
        }
        cause = c.source();
    }
    let Some(url) = e.url().filter(|_| refused) else {
        return;
    };
    let mut refusals = REFUSALS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if refusals.len() >= MOST_REFUSING_SERVERS {
        refusals.clear();
    }
    refusals.insert(url.origin().ascii_serialization(), Instant::now());
}

/// How long after a journal path last answered a refusal of it (404, 405) is taken for an
/// outage: longer than an owner takes to restart behind a proxy.
const OUTAGE_WINDOW: Duration = Duration::from_secs(300);

/// The most inserts sent together: explainability messages are bounded by the broker's message
/// limit, so a batch stays a bounded request.
const MAX_INSERTS: usize = 16;

/// The journal API of an aggregator, its calls of each kind batched while one is on its way
/// (see [`Batcher`]): many steps in flight share one HTTP call and one store transaction.
struct JournalCalls {
    lookups: Batcher<String, Option<JournalEntry>>,
    takings: Batcher<TakingRef, Taking>,
    records: Batcher<RecordRequest, JournalEntry>,
    marks: Batcher<String, ()>,
}

/// The longest answer taken to a query held to a budget: a server that does not hold it to one
/// (a SPARQL server) might otherwise send one larger than this process can hold.
pub const MOST_BOUNDED_ANSWER_BYTES: usize = 256 * 1024 * 1024;

/// The server: its base URL, its token and the HTTP client, owned, as every call needs them (the
/// batching workers too).
#[derive(Clone)]
struct Endpoint {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    /// The journal's paths this server has answered, and when last: one of them refused soon
    /// after (404, 405) is an outage, not an owner without a journal (see [`Endpoint::call`]).
    answered: std::sync::Arc<std::sync::Mutex<std::collections::BTreeMap<String, Instant>>>,
}

impl Endpoint {
    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.post(format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    async fn call<T: serde::Serialize>(&self, path: &str, body: &T) -> Result<Vec<u8>, GraphError> {
        let payload = serde_json::to_vec(body).map_err(|e| GraphError::Malformed(e.to_string()))?;
        let request = self
            .post(path)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(payload);
        let answered = || {
            self.answered
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
        };
        match RemoteSparql::send(request).await {
            Ok(body) => {
                answered().insert(path.to_owned(), Instant::now());
                Ok(body)
            }
            // Refused by a server that answered it lately: a proxy in front of an owner that is
            // restarting (some answer 404 when a route has no backend), not an owner of an
            // earlier build. Taken for that, every chain would count as not held (a live
            // dialog's root run again) and turns be decided here: an outage, tried again. Past
            // [`OUTAGE_WINDOW`] of refusals it is taken for an owner rolled back to a build
            // without the path, whose fallback the README describes.
            Err(GraphError::Http {
                status: status @ (404 | 405),
                body,
            }) if answered()
                .get(path)
                .is_some_and(|last| last.elapsed() < OUTAGE_WINDOW) =>
            {
                Err(GraphError::Http {
                status: 503,
                    body: format!(
                        "{path} answered {status} where it answered before (taken for an outage): {body}"
                    ),
                })
            }
            Err(GraphError::Http {
                status: 404 | 405, ..
            }) => Err(GraphError::NoJournal(self.base.clone())),
            other => other,
        }
    }

    async fn answers<A: serde::de::DeserializeOwned, T: serde::Serialize>(
        &self,
        path: &str,
        body: &T,
    ) -> Result<A, GraphError> {
        let body = self.call(path, body).await?;
        serde_json::from_slice(&body).map_err(|e| GraphError::Malformed(e.to_string()))
    }

    async fn update(&self, sparql: String) -> Result<(), GraphError> {
        let request = self
            .post("/update")
            .header(reqwest::header::CONTENT_TYPE, "application/sparql-update")
            .body(sparql);
        RemoteSparql::send(request).await.map(|_| ())
    }

    /// Inserts batched: each call's quads commit with the others of its batch. A batch the
    /// server answers with an error (not an outage) is tried again call by call, so one call's bad
    /// quads fail only that call.
    fn batched_inserts(&self) -> Batcher<Vec<Quad>, Result<(), GraphError>> {
        let api = self.clone();
        Batcher::new(MAX_INSERTS, move |batch: Vec<Vec<Quad>>| {
            let api = api.clone();
            async move {
                let together = api.update(insert_data(batch.iter().flatten())).await;
                match together {
                    Ok(()) => Ok(vec![Ok(()); batch.len()]),
                    // No answer (the server is away): every call waits for redelivery alike.
                    Err(e) if batch.len() == 1 || !matches!(e, GraphError::Http { .. }) => {
                        Ok(vec![Err(e); batch.len()])
                    }
                    // An answer that refuses: one call's quads may be to blame, so that only
                    // it fails, each is tried alone.
                    Err(_) => {
                        let mut each = Vec::with_capacity(batch.len());
                        for quads in &batch {
                            each.push(api.update(insert_data(quads.iter())).await);
                        }
                        Ok(each)
                    }
                }
            }
        })
    }

    /// The journal's owner when it runs in this process (see `in_process`): asked directly.
    fn in_process(&self) -> Option<crate::in_process::InProcessOwner> {
        crate::in_process::owner(&self.base, self.token.as_deref())
    }

    fn batched(&self) -> JournalCalls {
        let (api_l, api_t, api_r, api_m) = (self.clone(), self.clone(), self.clone(), self.clone());
        JournalCalls {
            lookups: Batcher::new(MAX_BATCH, move |entries| {
                let api = api_l.clone();
                async move {
                    if let Some(owner) = api.in_process() {
                        return owner.entries(entries).await;
                    }
                    api.answers("/journal/entries", &EntryRefs { entries })
                        .await
                }
            }),
            takings: Batcher::new(MAX_BATCH, move |takings: Vec<TakingRef>| {
                let api = api_t.clone();
                async move {
                    if let Some(owner) = api.in_process() {
                        return owner.takings(takings).await;
                    }
                    let asked = TakingRefs { takings };
                    match api.answers("/journal/takings", &asked).await {
                        // An owner of an earlier build does not count takings: its lookups
                        // answer all the same.
                        Err(GraphError::NoJournal(_)) => {
                            static TOLD: std::sync::Once = std::sync::Once::new();
                            TOLD.call_once(|| {
                                tracing::warn!(endpoint = %api.base, "the journal's owner does not count takings (an earlier build, or a proxy that refuses /journal/takings): a message that crashes every process is bounded only by the broker's count");
                            });
                            let entries = asked.takings.into_iter().map(|t| t.entry).collect();
                            let found: Vec<Option<JournalEntry>> = api
                                .answers("/journal/entries", &EntryRefs { entries })
                                .await?;
                            Ok(found
                                .into_iter()
                                .map(|entry| Taking { entry, takings: 0 })
                                .collect())
                        }
                        answered => answered,
                    }
                }
            }),
            records: Batcher::new(MAX_BATCH, move |records| {
                let api = api_r.clone();
                async move {
                    if let Some(owner) = api.in_process() {
                        return owner.records(records).await;
                    }
                    api.answers("/journal/records", &RecordRequests { records })
                        .await
                }
            }),
            marks: Batcher::new(MAX_BATCH, move |entries: Vec<String>| {
                let api = api_m.clone();
                async move {
                    if let Some(owner) = api.in_process() {
                        return owner.marks(entries).await;
                    }
                    let marked = entries.len();
                    api.call("/journal/marks", &EntryRefs { entries }).await?;
                    Ok(vec![(); marked])
                }
            }),
        }
    }
}

impl RemoteSparql {
    pub fn new(base: &str, token: Option<String>) -> Result<RemoteSparql, GraphError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            // Under the aggregator's time for a request's head (`HTTP_HEAD_TIMEOUT_SECS`, at
            // least 5 s), which is also how long it keeps an idle connection: a request is not
            // sent on a connection the server is closing.
            .pool_idle_timeout(Duration::from_secs(4))
            .build()
            .map_err(|e| GraphError::Transport(e.to_string()))?;
        let api = Endpoint {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token: token.filter(|t| !t.is_empty()),
            answered: Default::default(),
        };
        let origin = reqwest::Url::parse(&api.base)
            .map(|url| url.origin().ascii_serialization())
            .unwrap_or_default();
        Ok(RemoteSparql {
            journal: api.batched(),
            inserts: api.batched_inserts(),
            api,
            origin,
        })
    }

    /// When a connection to this server was last refused, if that was before `at`: the server
    /// process listening then had stopped, and one answering since is another (a SPARQL server
    /// holds its store's lock, so two never serve one store). What the stopped one committed is
    /// in the store; what it had not, it never will.
    pub fn refused_before(&self, at: Instant) -> Option<Instant> {
        REFUSALS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&self.origin)
            .copied()
            .filter(|refused| *refused < at)
    }

    /// The endpoint's base address, without a trailing slash.
    pub fn base(&self) -> &str {
        &self.api.base
    }

    async fn send(request: reqwest::RequestBuilder) -> Result<Vec<u8>, GraphError> {
        Self::send_at_most(request, usize::MAX).await
    }

    /// [`Self::send`], refusing a body of more than `most` bytes as it arrives.
    async fn send_at_most(
        request: reqwest::RequestBuilder,
        most: usize,
    ) -> Result<Vec<u8>, GraphError> {
        let mut response = Self::open(request).await?;
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| GraphError::Transport(e.to_string()))?
        {
            if body.len().saturating_add(chunk.len()) > most {
                return Err(GraphError::AnswerTooLarge(most));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// Sends `request`: its response once its status says it succeeded, or the failure with the
    /// start of what the server said (read no further than [`MOST_ERROR_BYTES`]).
    async fn open(request: reqwest::RequestBuilder) -> Result<reqwest::Response, GraphError> {
        let mut response = request.send().await.map_err(|e| {
            note_refusal(&e);
            GraphError::Transport(e.to_string())
        })?;
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let mut said = Vec::new();
        while said.len() < MOST_ERROR_BYTES {
            match response.chunk().await {
                Ok(Some(chunk)) => said.extend_from_slice(&chunk),
                Ok(None) | Err(_) => break,
            }
        }
        Err(GraphError::Http {
            status: status.as_u16(),
            body: String::from_utf8_lossy(&said).chars().take(500).collect(),
        })
    }

    pub async fn query(&self, sparql: &str) -> Result<QueryAnswer, GraphError> {
        self.query_within(sparql, None, None, usize::MAX).await
    }

    /// [`Self::query`]; with `budget`, the server (an aggregator) is asked to hold the query to
    /// that many bindings ([`crate::BINDINGS_HEADER`]; a SPARQL server ignores it), and an answer
    /// longer than [`MOST_BOUNDED_ANSWER_BYTES`] is refused as it arrives rather than held. The
    /// answer is parsed as it arrives, and refused at its row past `max_rows`: a SPARQL server,
    /// which no budget holds, may send millions of rows to a short query.
    /// With `within`, the server is told how long the caller waits ([`crate::WITHIN_HEADER`]).
    pub async fn query_within(
        &self,
        sparql: &str,
        budget: Option<u64>,
        within: Option<Duration>,
        max_rows: usize,
    ) -> Result<QueryAnswer, GraphError> {
        let mut request = self
            .api
            .post("/query")
            .header(reqwest::header::CONTENT_TYPE, "application/sparql-query")
            .header(
                reqwest::header::ACCEPT,
                "application/sparql-results+json, application/n-triples;q=0.9",
            )
            .body(sparql.to_owned());
        let mut most = usize::MAX;
        if let Some(budget) = budget {
            request = request.header(crate::BINDINGS_HEADER, budget.to_string());
            most = MOST_BOUNDED_ANSWER_BYTES;
        }
        if let Some(within) = within {
            let millis = u64::try_from(within.as_millis()).unwrap_or(u64::MAX);
            request = request.header(crate::WITHIN_HEADER, millis.to_string());
        }
        parsed_as_it_arrives(Self::open(request).await?, most, max_rows).await
    }

    pub async fn update(&self, sparql: &str) -> Result<(), GraphError> {
        let request = self
            .api
            .post("/update")
            .header(reqwest::header::CONTENT_TYPE, "application/sparql-update")
            .body(sparql.to_owned());
        Self::send(request).await.map(|_| ())
    }

    /// Adds quads with one `INSERT DATA` update: atomic, and understood by every SPARQL 1.1 server
    /// (the Graph Store Protocol's paths differ between servers, and it takes one graph a call).
    pub async fn insert(&self, quads: &[Quad]) -> Result<(), GraphError> {
        self.update(&insert_data(quads.iter())).await
    }

    /// Adds quads atomically, in one `INSERT DATA` with the inserts made while the previous one
    /// was on its way (group commit).
    pub async fn insert_batched(&self, quads: Vec<Quad>) -> Result<(), GraphError> {
        // A blank node's label names one node within one request: beside another call's quads it
        // could become that call's node too.
        let blank = |q: &Quad| {
            q.subject.is_blank_node()
                || q.object.is_blank_node()
                || matches!(q.graph_name, GraphName::BlankNode(_))
        };
        if quads.iter().any(blank) {
            return self.insert(&quads).await;
        }
        self.inserts.call(quads).await?
    }

    pub async fn load(
        &self,
        data: Vec<u8>,
        format: &str,
        graph: Option<&str>,
    ) -> Result<(), GraphError> {
        // Oxigraph's server and the aggregator serve the Graph Store Protocol at `/store`, Jena
        // Fuseki at `/data`.
        let mut outcome = Ok(());
        for path in ["/store", "/data"] {
            let request = self.api.post(path);
            let request = match graph {
                Some(g) => request.query(&[("graph", g)]),
                None => request.query(&[("default", "")]),
            };
            let request = request
                .header(reqwest::header::CONTENT_TYPE, format.to_owned())
                .body(data.clone());
            outcome = Self::send(request).await.map(|_| ());
            if !matches!(outcome, Err(GraphError::Http { status: 404, .. })) {
                break;
            }
        }
        outcome
    }

    /// The journal entry `entry` at the journal's owner (an aggregator), if recorded.
    pub async fn journal_entry(&self, entry: &str) -> Result<Option<JournalEntry>, GraphError> {
        // An owner in this process answers a step it expects from memory: no batch to wait for.
        if self
            .api
            .in_process()
            .is_some_and(|owner| owner.expects(entry))
        {
            return Ok(None);
        }
        self.journal.lookups.call(entry.to_owned()).await
    }

    /// The journal entry of a step being taken up, at the journal's owner (see [`Taking`]).
    pub async fn journal_take(&self, taking: TakingRef) -> Result<Taking, GraphError> {
        // As a lookup: an owner in this process answers a step it expects from memory.
        if let Some(taken) = self
            .api
            .in_process()
            .and_then(|owner| owner.take_expected(&taking))
        {
            return Ok(taken);
        }
        self.journal.takings.call(taking).await
    }

    /// Records at the journal's owner; the entry that stands comes back in the same call.
    pub async fn journal_record(&self, request: RecordRequest) -> Result<JournalEntry, GraphError> {
        self.journal.records.call(request).await
    }

    pub async fn journal_published(&self, entry: &str) -> Result<(), GraphError> {
        self.journal.marks.call(entry.to_owned()).await
    }

    /// A beat of chains held, to the journal's owner (one call a second at most: not batched).
    pub async fn journal_beat(&self, beat: ChainBeat) -> Result<(), GraphError> {
        if let Some(owner) = self.api.in_process() {
            return owner.beat(beat);
        }
        self.api
            .call("/journal/chains/beat", &beat)
            .await
            .map(|_| ())
    }

    /// A dialog's turn in its conversation, as the journal's owner gives it (one call per new
    /// dialog of a conversation: not batched). An owner of an earlier build, which keeps no
    /// starts, leaves them to this process alone, as before.
    pub async fn journal_turn(&self, asked: TurnAsked) -> Result<Turn, GraphError> {
        if let Some(owner) = self.api.in_process() {
            return Ok(owner.turn(&asked));
        }
        match self.api.answers("/journal/turns", &asked).await {
            Err(GraphError::NoJournal(_)) => {
                static TOLD: std::sync::Once = std::sync::Once::new();
                TOLD.call_once(|| {
                    tracing::warn!(endpoint = %self.api.base, "the journal's owner does not keep conversations' starts (an earlier build): two replicas can each let a dialog of one conversation start in the same instant");
                });
                Ok(crate::turns::take_turn_here(&self.api.base, &asked))
            }
            answered => answered,
        }
    }

    /// Which of the chains asked for the journal's owner has word of a live process still running.
    /// An owner of an earlier build, which has no such word, holds none.
    pub async fn journal_held(&self, asked: ChainRefs) -> Result<Vec<bool>, GraphError> {
        if let Some(owner) = self.api.in_process() {
            return Ok(owner.held(&asked));
        }
        match self.api.answers("/journal/chains/held", &asked).await {
            Err(GraphError::NoJournal(_)) => Ok(vec![false; asked.chains.len()]),
            answered => answered,
        }
    }
}

/// The most of a failed request's answer read for its error's text.
const MOST_ERROR_BYTES: usize = 64 * 1024;

fn content_type(response: &reqwest::Response) -> String {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A query's answer parsed as it arrives (on the blocking pool: parsing a long answer held a
/// runtime worker for seconds), refused past `most` bytes or `max_rows` rows. Past them the
/// response is dropped, and with it the connection, so the server stops sending. The whole body
/// was read (up to 256 MiB) and every row of it parsed before either bound was looked at.
async fn parsed_as_it_arrives(
    mut response: reqwest::Response,
    most: usize,
    max_rows: usize,
) -> Result<QueryAnswer, GraphError> {
    let triples = content_type(&response).starts_with("application/n-triples");
    // A few chunks ahead of the parser at most.
    let (chunks, arriving) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let parsing = tokio::task::spawn_blocking(move || {
        parse_answer(
            ArrivingChunks {
                arriving,
                current: bytes::Bytes::new(),
            },
            triples,
            max_rows,
        )
    });
    let feeding = async move {
        let mut taken = 0usize;
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|e| GraphError::Transport(e.to_string()))?
        {
            taken = taken.saturating_add(chunk.len());
            if taken > most {
                return Err(GraphError::AnswerTooLarge(most));
            }
            if chunks.send(chunk).await.is_err() {
                // The parser has stopped: it has its answer, or its refusal.
                break;
            }
        }
        Ok(())
    };
    let (fed, parsed) = tokio::join!(feeding, parsing);
    // A parser whose input was cut off fails for that: the cut is the cause.
    let parsed =
        parsed.map_err(|e| GraphError::Transport(format!("the answer's parser failed: {e}")))?;
    match (fed, parsed) {
        (Err(e), _) => Err(e),
        (Ok(()), parsed) => parsed,
    }
}

/// The chunks of an answer as they arrive, read where blocking is allowed.
struct ArrivingChunks {
    arriving: tokio::sync::mpsc::Receiver<bytes::Bytes>,
    current: bytes::Bytes,
}

impl std::io::Read for ArrivingChunks {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.arriving.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// A query's answer, SPARQL JSON results or N-Triples (`triples`), refused past `max_rows`.
fn parse_answer(
    reader: impl std::io::Read + 'static,
    triples: bool,
    max_rows: usize,
) -> Result<QueryAnswer, GraphError> {
    if triples {
        let mut graph = Vec::new();
        let parser = oxigraph::io::RdfParser::from_format(oxigraph::io::RdfFormat::NTriples);
        for quad in parser.for_reader(reader) {
            let quad = quad.map_err(|e| GraphError::Malformed(e.to_string()))?;
            if graph.len() == max_rows {
                return Err(GraphError::TooManyRows(max_rows));
            }
            graph.push(oxigraph::model::Triple::from(quad));
        }
        return Ok(QueryAnswer::Graph(graph));
    }
    let parsed = QueryResultsParser::from_format(QueryResultsFormat::Json)
        .for_reader(reader)
        .map_err(|e| GraphError::Malformed(e.to_string()))?;
    collect_at_most(parsed.into(), max_rows, None)
}

/// One `INSERT DATA` update adding `quads`, grouped by graph.
fn insert_data<'q>(quads: impl Iterator<Item = &'q Quad>) -> String {
    format!(
        "INSERT DATA {{\n{}}}",
        crate::queries::quads_by_graph(quads)
    )
}
