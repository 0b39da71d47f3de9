//! The SPARQL 1.1 Protocol over the store: `/query` (open unless a read token is set, each query
//! bounded in time and result size and stopped when its client goes, anonymous ones a few at a
//! time), `/update` and the Graph Store Protocol's `POST /store` (bearer token); the orchestrators'
//! journal (`/journal/entries`, `/journal/takings`, `/journal/records`, `/journal/marks`,
//! batched; `/journal/chains/...` and `/journal/turns`; bearer token); and `/healthz`, `/readyz`,
//! `/metrics`.

use std::collections::HashMap;
use std::sync::Arc;

use agent_bus::ConsumerStats;

use agent_graph::journal::{ChainBeat, ChainRefs, EntryRefs, Journal, RecordRequests, TakingRefs};
use agent_graph::model::NamedNode;
use agent_graph::turns::{self, TurnAsked};
use agent_graph::{serialize_answer_at_most, GraphError, GraphStore, QueryBounds};
use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

#[derive(Clone)]
struct AppState {
    store: GraphStore,
    journal: Journal,
    /// Whether this process may decide the journal (see `owner_fence`).
    fence: agent_bus::owner_fence::Fence,
    token: Option<String>,
    stats: Arc<ConsumerStats>,
    reads: Arc<Reads>,
    /// When `/metrics` last counted the open fan-outs (see [`crate::metrics::refresh`]).
    fanouts_counted: Arc<tokio::sync::Mutex<Option<std::time::Instant>>>,
    /// The store's last answer to `/readyz` (see [`ready`]).
    readiness: Arc<agent_serve::probe::Probe>,
}

/// How long `/readyz` waits for the store's answer.
const PROBE_WITHIN: std::time::Duration = std::time::Duration::from_secs(5);

/// The read policy in force.
struct Reads {
    bounds: QueryBounds,
    /// Turns for queries without the services' token.
    turns: Arc<tokio::sync::Semaphore>,
    /// Turns, as many, for the budgeted queries that carry it (a knowledge tool's, a stranger's
    /// forwarded by a replica, which took a stranger's turn there): strangers here cannot hold
    /// them all and leave the agents' tools with "too many queries at once".
    service_turns: Arc<tokio::sync::Semaphore>,
    token: Option<String>,
    /// Longest query text taken from anyone but the services.
    max_query_bytes: usize,
    /// Longest answer, written out, given to a query held to a budget.
    max_answer_bytes: usize,
}

/// The largest journal record call taken: an orchestrator's batch of up to 64 records of a few
/// MB each.
const MOST_JOURNAL_RECORDS_BYTES: usize = 256 * 1024 * 1024;

/// The largest of the journal's other calls: up to 4,096 names of at most 1 KiB each.
const MOST_JOURNAL_CALL_BYTES: usize = 8 * 1024 * 1024;

/// The largest update or load taken (only with the services' token, checked before the body is
/// read). axum's 2 MB default refused what the services themselves send: a replica writes each
/// explainability message through the owner's `/update` as one `INSERT DATA`, and a message may be
/// as large as the broker takes (5 MB by default), more once its literals are escaped; and
/// `agentctl load` sends a collection's file whole to `/store`.
const MOST_WRITE_BYTES: usize = 256 * 1024 * 1024;

/// How long a query waits for a turn before it is told to come back, unless it is a budgeted
/// query with the services' token that says how long its caller waits (a tool's,
/// [`agent_graph::WITHIN_HEADER`]).
const TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The least time a caller that said how long it waits must have left once it has its turn.
const LEAST_LEFT: std::time::Duration = std::time::Duration::from_millis(20);

/// The routes; `token` guards writes (no token configured: writes are refused) and lets the
/// services' own queries through without waiting; `stats` are the explainability consumer's, for
/// `/metrics`; `reads` bound `/query`.
pub fn router(
    store: GraphStore,
    journal: Journal,
    fence: agent_bus::owner_fence::Fence,
    token: Option<String>,
    stats: Arc<ConsumerStats>,
    reads: &crate::ReadSettings,
) -> Router {
    let reads = Arc::new(Reads {
        bounds: QueryBounds {
            timeout: reads.query_timeout(),
            max_rows: reads.max_result_rows,
            max_bindings: reads.max_query_bindings,
        },
        turns: Arc::new(tokio::sync::Semaphore::new(reads.max_queries.max(1))),
        service_turns: Arc::new(tokio::sync::Semaphore::new(reads.max_queries.max(1))),
        token: reads.query_token.clone().filter(|t| !t.is_empty()),
        max_query_bytes: reads.max_query_bytes,
        max_answer_bytes: reads.max_answer_bytes,
    });
    let state = AppState {
        store,
        journal,
        fence,
        token,
        stats,
        reads,
        fanouts_counted: Arc::default(),
        readiness: Arc::new(agent_serve::probe::Probe::new(
            std::time::Duration::from_secs(1),
            PROBE_WITHIN,
        )),
    };
    // Records of several steps travel in one call, each with its whole outcome (a step's messages
    // may be a few MB), so the journal's calls are let past axum's 2 MB default: 32 steps of 64 KB
    // questions in one batch went over it, and each of those steps failed. Only with the
    // services' token, checked before the body is read: anyone who can reach the port could
    // otherwise have the owner buffer 256 MB a call.
    // The other journal calls carry names only: a 256 MB body of names was parsed whole (tens
    // of millions of strings) before the count of names was looked at.
    let journal_records = Router::new()
        .route("/journal/records", post(journal_records))
        .layer(axum::extract::DefaultBodyLimit::max(
            MOST_JOURNAL_RECORDS_BYTES,
        ));
    let journal_routes = Router::new()
        .route("/journal/entries", post(journal_entries))
        .route("/journal/takings", post(journal_takings))
        .route("/journal/marks", post(journal_marks))
        .route("/journal/chains/beat", post(journal_chain_beat))
        .route("/journal/chains/held", post(journal_chains_held))
        .route("/journal/turns", post(journal_turns))
        .layer(axum::extract::DefaultBodyLimit::max(
            MOST_JOURNAL_CALL_BYTES,
        ))
        .merge(journal_records)
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            token_first,
        ));
    // Writes need the token, checked before the body is read: up to 2 MB was read first, for a
    // request refused anyway.
    let write_routes = Router::new()
        .route("/update", post(update))
        .route("/store", post(store_post))
        .layer(axum::extract::DefaultBodyLimit::max(MOST_WRITE_BYTES))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            token_first,
        ));
    let read_routes = Router::new()
        .route("/query", get(query_get).post(query_post))
        .route("/sparql", get(query_get).post(query_post))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            reader_first,
        ));
    Router::new()
        .merge(read_routes)
        .merge(write_routes)
        .merge(journal_routes)
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// A query from anyone but the services: refused before its body is read when the endpoint
/// needs a read token it does not carry, and its body read only as far as a query text of
/// `AGGREGATOR_MAX_QUERY_BYTES` can take (form-encoded, a byte of text may take three). Before,
/// up to 2 MB was read (and copied) first, whatever the bound on the text.
async fn reader_first(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let headers = request.headers();
    if carries(headers, state.token.as_ref()) {
        return next.run(request).await;
    }
    let reads = &state.reads;
    if reads.token.is_some() && !carries(headers, reads.token.as_ref()) {
        return (
            StatusCode::UNAUTHORIZED,
            "queries need a valid bearer token here (AGGREGATOR_QUERY_TOKEN)",
        )
            .into_response();
    }
    let most = reads.max_query_bytes.saturating_mul(3).saturating_add(1024);
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > most as u64) {
        crate::metrics::query_refused("too_long");
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the request's body is longer than the {most} bytes a query of at most {} bytes \
                 takes here (AGGREGATOR_MAX_QUERY_BYTES)",
                reads.max_query_bytes
            ),
        )
            .into_response();
    }
    let request =
        request.map(|body| axum::body::Body::new(http_body_util::Limited::new(body, most)));
    next.run(request).await
}

/// Refuses a journal call or a write without the services' token before its body is read.
async fn token_first(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if let Some(denied) = denied(&state, request.headers()) {
        return denied;
    }
    next.run(request).await
}

/// [`error_response`] for a query or write this aggregator forwards to the store it stands in
/// front of (its owner when a replica, or a SPARQL server): the store's refusal (a 4xx: an update
/// that does not parse, a load over its limit) or its being busy (503) goes to the client as the
/// store said it. Only for these: elsewhere (the journal) a 4xx from a SPARQL server would read
/// as this aggregator's own answer. An update or load was answered 500 for them, and its client
/// tried a malformed update again for ever, or never split a load the owner found too large.
fn forwarded_error_response(e: GraphError) -> Response {
    match e {
        GraphError::Http { status, body } if matches!(status, 400..=499 | 503) => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            (status, body).into_response()
        }
        e => error_response(e),
    }
}

fn error_response(e: GraphError) -> Response {
    let status = match &e {
        GraphError::Syntax(_) => StatusCode::BAD_REQUEST,
        GraphError::ReadOnly => StatusCode::FORBIDDEN,
        GraphError::Evaluation(_) => StatusCode::BAD_REQUEST,
        GraphError::TimedOut(_) => StatusCode::SERVICE_UNAVAILABLE,
        GraphError::TooManyRows(_) | GraphError::TooMuchWork(_) | GraphError::AnswerTooLarge(_) => {
            StatusCode::PAYLOAD_TOO_LARGE
        }
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, e.to_string()).into_response()
}

/// Whether the request carries `token`.
fn carries(headers: &HeaderMap, token: Option<&String>) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    token.is_some_and(|t| agent_bus::bearer_matches(given, t))
}

/// A query refused for want of a turn (counted as `busy`), to be asked again.
fn too_busy(why: &'static str) -> Response {
    crate::metrics::query_refused("busy");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        why,
    )
        .into_response()
}

async fn run_query(state: &AppState, headers: &HeaderMap, sparql: String) -> Response {
    let reads = &state.reads;
    // A stranger without the read token was refused before this (`reader_first`).
    let service = carries(headers, state.token.as_ref());
    // A long text is how a query asks for unbounded work before any of it can be stopped
    // (parsing alone is quadratic in some shapes): the services' own may be long, others not.
    if !service && sparql.len() > reads.max_query_bytes {
        crate::metrics::query_refused("too_long");
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "the query is {} bytes; at most {} are taken here (AGGREGATOR_MAX_QUERY_BYTES)",
                sparql.len(),
                reads.max_query_bytes
            ),
        )
            .into_response();
    }
    // The services' own queries (the journal, fan-in) never queue behind anonymous ones, but
    // a query they ask to bound (a stranger's forwarded by a replica, a tool's) takes a turn, of
    // a pool of its own: strangers here must not be able to hold every turn the tools need. The
    // turn is held by the evaluation, not this request, so it counts a query until its
    // evaluation has ended, even one whose client went away.
    let asked = headers
        .get(agent_graph::BINDINGS_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let caller_waits = headers
        .get(agent_graph::WITHIN_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(std::time::Duration::from_millis);
    let arrived = tokio::time::Instant::now();
    let turn = if service && asked.is_none() {
        None
    } else {
        // A tool's query waits for its turn for as long as its caller waits (at most the time
        // limit a query has to run): a dialog's step cannot come back later as a stranger can,
        // and with a second's wait a third dialog's knowledge query failed ("too many queries
        // at once") whenever two others' ran for a second or more. Not longer: a request whose
        // caller has gone would otherwise keep its place, then spend a turn on an answer nobody
        // reads. Whoever waits holds one request of a service, bounded by the orchestrators'
        // dialogs in flight. A replica's forwarded stranger says nothing and waits a second.
        let (pool, wait) = match (service, caller_waits) {
            (true, Some(within)) => (&reads.service_turns, within.min(reads.bounds.timeout)),
            (true, None) => (&reads.service_turns, TURN_WAIT),
            (false, _) => (&reads.turns, TURN_WAIT),
        };
        match tokio::time::timeout(wait, pool.clone().acquire_owned()).await {
            Ok(Ok(turn)) => Some(turn),
            _ => return too_busy("too many queries at once; try again"),
        }
    };
    // A caller that said how long it waits and has next to nothing of it left is not served:
    // over a SPARQL server the query would run on after its caller has gone, holding the turn.
    let left = caller_waits.map(|within| within.saturating_sub(arrived.elapsed()));
    if service && left.is_some_and(|left| left < LEAST_LEFT) {
        return too_busy("too many queries at once: no time left to run this one; try again");
    }
    // The services' own queries (a knowledge tool's scan of a large collection, a count after a
    // load) are held to the time limit, not to the budget that bounds a stranger's, unless they
    // ask for one: a replica forwards a stranger's query with the services' token and the
    // stranger's budget, and a tool sends the query an LLM wrote with its own.
    let (bounds, max_answer_bytes) = match (service, asked) {
        (true, None) => (
            QueryBounds {
                max_bindings: u64::MAX,
                ..reads.bounds
            },
            usize::MAX,
        ),
        // Within what its caller has left after the wait for a turn.
        (true, Some(budget)) => (
            QueryBounds {
                max_bindings: budget.min(reads.bounds.max_bindings),
                timeout: left.map_or(reads.bounds.timeout, |left| left.min(reads.bounds.timeout)),
                ..reads.bounds
            },
            reads.max_answer_bytes,
        ),
        (false, _) => (reads.bounds, reads.max_answer_bytes),
    };
    // The turn is held until the answer is written out and taken too: a long answer is as much
    // memory as a long evaluation.
    let turn = std::sync::Arc::new(turn);
    let answered = state
        .store
        .query_bounded_holding(
            sparql,
            bounds,
            turn.clone(),
            service && caller_waits.is_some(),
        )
        .await;
    let written = match answered {
        Ok(answer) => tokio::task::spawn_blocking(move || {
            serialize_answer_at_most(&answer, max_answer_bytes).map(|written| (written, turn))
        })
        .await
        .unwrap_or_else(|e| {
            Err(GraphError::Storage(format!(
                "writing the answer failed: {e}"
            )))
        }),
        Err(e) => Err(e),
    };
    match written {
        // An answer bounded for a stranger holds its turn until its client has taken it, within
        // the query's time limit: answers written to clients that do not read would otherwise
        // each hold up to `AGGREGATOR_MAX_ANSWER_BYTES` with nothing to bound how many.
        Ok(((body, content_type), turn)) if turn.is_some() => {
            // The whole time limit, not what a waiting caller had left of it: an answer is taken
            // at once by a client that reads, and a few milliseconds' stall must not cut it.
            let answer = crate::slow_clients::HeldAnswer::new(body, reads.bounds.timeout, turn);
            (
                [(header::CONTENT_TYPE, content_type)],
                axum::body::Body::new(answer),
            )
                .into_response()
        }
        Ok(((body, content_type), _)) => {
            ([(header::CONTENT_TYPE, content_type)], body).into_response()
        }
        Err(e) => {
            match &e {
                GraphError::TimedOut(_) => crate::metrics::query_refused("timeout"),
                GraphError::TooManyRows(_)
                | GraphError::TooMuchWork(_)
                | GraphError::AnswerTooLarge(_) => crate::metrics::query_refused("too_large"),
                _ => {}
            }
            forwarded_error_response(e)
        }
    }
}

async fn query_get(
    State(state): State<AppState>,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    match params.get("query") {
        Some(q) => run_query(&state, &headers, q.clone()).await,
        None => (StatusCode::BAD_REQUEST, "missing the 'query' parameter").into_response(),
    }
}

/// The text of a POSTed operation: the body itself, or the `name` field of a form.
fn operation_text(headers: &HeaderMap, body: &Bytes, name: &str) -> Option<String> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if content_type.starts_with("application/x-www-form-urlencoded") {
        form_urlencoded_field(body, name)
    } else {
        String::from_utf8(body.to_vec()).ok()
    }
}

fn form_urlencoded_field(body: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    text.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == name).then(|| percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
                match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                    Some(b) => {
                        out.push(b);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

async fn query_post(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    match operation_text(&headers, &body, "query") {
        Some(q) => run_query(&state, &headers, q).await,
        None => (StatusCode::BAD_REQUEST, "no query in the request").into_response(),
    }
}

/// `Some(denial)` when the request may not write.
fn denied(state: &AppState, headers: &HeaderMap) -> Option<Response> {
    let Some(expected) = &state.token else {
        return Some(
            (
                StatusCode::FORBIDDEN,
                "writes are disabled: no CONFIG_TOKEN is configured",
            )
                .into_response(),
        );
    };
    if carries(headers, Some(expected)) {
        None
    } else {
        Some((StatusCode::UNAUTHORIZED, "a valid bearer token is required").into_response())
    }
}

/// Behind `token_first`, as `/store` is.
async fn update(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let Some(text) = operation_text(&headers, &body, "update") else {
        return (StatusCode::BAD_REQUEST, "no update in the request").into_response();
    };
    // Held to the queries' time limit: an update holds the store's one turn for updates, which
    // the fan-ins' claims wait for. Not to the budget of bindings, as the services' own queries
    // are not (only the services' token writes): under a budget an expression's string is cut
    // at 1 MiB, and an update would write less than it asked.
    let bounds = QueryBounds {
        max_bindings: u64::MAX,
        ..state.reads.bounds
    };
    match state.store.update_bounded(text, bounds).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => {
            if let GraphError::TimedOut(_) = &e {
                crate::metrics::query_refused("update_timeout");
            }
            forwarded_error_response(e)
        }
    }
}

/// Behind `token_first`, as `/update` is.
async fn store_post(
    State(state): State<AppState>,
    Query(params): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let format = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/n-triples")
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    match state
        .store
        .load(body.to_vec(), &format, params.get("graph").cloned())
        .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => forwarded_error_response(e),
    }
}

/// A journal call waits while this process listens for an elder owner, and is refused if one was
/// heard: only the owner decides.
#[allow(clippy::result_large_err)] // Built once per refused call, never carried far.
async fn owner(state: &AppState) -> Result<(), Response> {
    let limit = std::time::Duration::from_secs(30);
    state.fence.admitted_within(limit).await.map_err(|why| {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("this aggregator does not own the journal: {why}"),
        )
            .into_response()
    })
}

/// A journal call's checks: entries that name nodes, and this process's ownership of the journal
/// (see `owner`). The services' token was checked before the body was read (`token_first`).
#[allow(clippy::result_large_err)] // Built once per refused call, never carried far.
async fn journal_call<'e>(
    state: &AppState,
    entries: impl IntoIterator<Item = &'e String>,
) -> Result<Vec<NamedNode>, Response> {
    let named = entries
        .into_iter()
        .map(|entry| NamedNode::new(entry.as_str()))
        .collect::<Result<Vec<_>, _>>();
    let named = named
        .map_err(|e| (StatusCode::BAD_REQUEST, format!("not an entry: {e}")).into_response())?;
    if named.len() > MAX_JOURNAL_BATCH {
        return Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("at most {MAX_JOURNAL_BATCH} entries a call"),
        )
            .into_response());
    }
    owner(state).await?;
    Ok(named)
}

use agent_graph::journal::MAX_TAKING_NAME;

/// The most entries one journal call may name: a batch holds every lock of its keys at once.
const MAX_JOURNAL_BATCH: usize = 4 * agent_graph::journal::MAX_BATCH;

fn json<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// The orchestrators' journal (services only): each entry asked for, or `null`, in order.
async fn journal_entries(
    State(state): State<AppState>,
    axum::Json(asked): axum::Json<EntryRefs>,
) -> Response {
    let nodes = match journal_call(&state, &asked.entries).await {
        Ok(nodes) => nodes,
        Err(refused) => return refused,
    };
    match state.journal.entries(&nodes).await {
        Ok(entries) => json(&entries),
        Err(e) => error_response(e),
    }
}

/// [`journal_entries`] for steps that deliveries are taking up: each taking of a step without an
/// entry is counted (a bound on a message that crashes every process that takes it).
async fn journal_takings(
    State(state): State<AppState>,
    axum::Json(asked): axum::Json<TakingRefs>,
) -> Response {
    if let Err(refused) = journal_call(&state, asked.takings.iter().map(|t| &t.entry)).await {
        return refused;
    }
    // The owner keeps these names while a step is unrecorded: an entry, a broker's message id
    // and a process's token are short.
    if asked.takings.iter().any(|t| {
        [&t.entry, &t.delivery, &t.taker]
            .iter()
            .any(|name| name.len() > MAX_TAKING_NAME)
    }) {
        return (
            StatusCode::BAD_REQUEST,
            format!("an entry, delivery or taker longer than {MAX_TAKING_NAME} bytes"),
        )
            .into_response();
    }
    match state.journal.take_all(&asked.takings).await {
        Ok(takings) => json(&takings),
        Err(e) => error_response(e),
    }
}

/// Records steps' outcomes, each unless one stands, and answers the ones that stand, in order.
async fn journal_records(
    State(state): State<AppState>,
    axum::Json(asked): axum::Json<RecordRequests>,
) -> Response {
    if let Err(refused) = journal_call(&state, asked.records.iter().map(|r| &r.entry)).await {
        return refused;
    }
    match state
        .journal
        .record_all_reporting(asked.records, crate::metrics::journal_record)
        .await
    {
        Ok(standing) => json(&standing),
        Err(e) => error_response(e),
    }
}

/// Marks steps' outcomes as published.
async fn journal_marks(
    State(state): State<AppState>,
    axum::Json(asked): axum::Json<EntryRefs>,
) -> Response {
    let nodes = match journal_call(&state, &asked.entries).await {
        Ok(nodes) => nodes,
        Err(refused) => return refused,
    };
    match state.journal.mark_all_published(&nodes).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => error_response(e),
    }
}

/// An orchestrator's word that it still runs the chains it names (see `ChainBeat`).
async fn journal_chain_beat(
    State(state): State<AppState>,
    axum::Json(beat): axum::Json<ChainBeat>,
) -> Response {
    if let Err(refused) = chains_call(&state, beat.holding.len()).await {
        return refused;
    }
    match state.journal.beat(beat).await {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        // A beat the journal will not keep (a process's name too long).
        Err(GraphError::Malformed(why)) => (StatusCode::BAD_REQUEST, why).into_response(),
        Err(e) => error_response(e),
    }
}

/// Which of the chains named a live orchestrator still runs, in order.
async fn journal_chains_held(
    State(state): State<AppState>,
    axum::Json(asked): axum::Json<ChainRefs>,
) -> Response {
    if let Err(refused) = chains_call(&state, asked.chains.len()).await {
        return refused;
    }
    match state.journal.held(asked).await {
        Ok(held) => json(&held),
        Err(e) => error_response(e),
    }
}

/// A dialog's turn in its conversation (see `agent_graph::turns`): kept where the journal is
/// decided, so that two replicas cannot each let a dialog of one conversation start.
async fn journal_turns(
    State(state): State<AppState>,
    axum::Json(asked): axum::Json<TurnAsked>,
) -> Response {
    let too_long = std::iter::once(&asked.conversation)
        .chain(std::iter::once(&asked.session))
        .chain(&asked.shown)
        .chain(asked.running.iter().flatten())
        .any(|id| id.len() > turns::MAX_ID_BYTES);
    let running = asked.running.as_ref().map_or(0, Vec::len);
    if too_long || asked.shown.len() > turns::MAX_SHOWN || running > turns::MAX_SHOWN {
        return (
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "ids of at most {} bytes, and at most {} dialogs shown",
                turns::MAX_ID_BYTES,
                turns::MAX_SHOWN
            ),
        )
            .into_response();
    }
    if let Err(refused) = owner(&state).await {
        return refused;
    }
    match state.journal.take_turn(asked).await {
        Ok(turn) => json(&turn),
        Err(e) => error_response(e),
    }
}

/// A chains call's checks: a bounded list, and the owner's word (beats are kept where the
/// journal is decided). The services' token was checked before the body was read.
#[allow(clippy::result_large_err)] // Built once per refused call, never carried far.
async fn chains_call(state: &AppState, named: usize) -> Result<(), Response> {
    if named > agent_graph::journal::MAX_CHAINS_HELD {
        return Err((
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "at most {} chains a call",
                agent_graph::journal::MAX_CHAINS_HELD
            ),
        )
            .into_response());
    }
    owner(state).await
}

async fn metrics(State(state): State<AppState>) -> Response {
    crate::metrics::refresh(&state.store, &state.stats, &state.fanouts_counted).await;
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        agent_metrics::global().render(),
    )
        .into_response()
}

/// The store's answer to a probe, asked at most once a second, whoever asks (see
/// `agent_serve::probe`).
async fn probed(state: &AppState) -> Result<(), String> {
    let store = state.store.clone();
    let answer = state
        .readiness
        .answer(|| async move { store.answers().await })
        .await;
    answer.map_err(|e| format!("the store: {e}"))
}

/// Ready when consuming and the store answers (see [`probed`]).
async fn ready(State(state): State<AppState>) -> Response {
    if !state
        .stats
        .consuming
        .load(std::sync::atomic::Ordering::SeqCst)
    {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not consuming from the broker",
        )
            .into_response();
    }
    let answer = probed(&state).await;
    match answer {
        Ok(()) => "ready".into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn form_fields_are_decoded() {
        let body = b"query=SELECT+%3Fs+WHERE+%7B%7D&x=1";
        assert_eq!(
            form_urlencoded_field(body, "query").unwrap(),
            "SELECT ?s WHERE {}"
        );
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    /// A store that failed is answered as the server's fault (500), which a replica writing
    /// through this endpoint tries again; a bad update as the client's (400), which it does not.
    #[test]
    fn a_failing_store_is_answered_as_the_servers_fault() {
        let status = |e| error_response(e).status();
        assert_eq!(
            status(GraphError::Storage("No space left on device".into())),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        assert_eq!(
            status(GraphError::Evaluation("unbound service".into())),
            StatusCode::BAD_REQUEST
        );
    }
}
