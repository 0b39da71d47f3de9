//! Fan-in as a query, not a counter: after a completion (or a fan-out) is written, the graph is
//! asked how many completions the fan-out has; when they are all there, the synthesis is claimed in
//! the graph (first writer wins, so several aggregators and redeliveries give one synthesis), the
//! supervisor's synthesis request is published, and the fan-out is marked as done.

use std::collections::{BTreeMap, HashMap};

use agent_bus::seal::SealKey;
use agent_bus::{BusError, Properties, Publisher};
use agent_core::supervisor::{
    completion_seal_parts, decomposed_goals, dependent_request, fanout_seal_parts, fanouts_above,
    kept_goals, last_decompose, legacy_subagent_seal_parts, result_key, subagent_index,
    subagent_seal_parts, subagent_session, synthesis_request_within, Fit,
};
use agent_graph::{queries, GraphError, GraphStore, QueryAnswer, Rows};
use agent_schema::{
    AgentRequest, Triples, ID_PROPERTY, IN_TOKEN_PROPERTY, MODEL_PROPERTY, OUT_TOKEN_PROPERTY,
    REUSE_FROM_PROPERTY, REUSE_PROPERTY, RUN_TOKENS_PROPERTY, STARTED_PROPERTY,
};
use oxigraph::model::{NamedNode, Term};

use agent_core::vocab::tg;

#[derive(Debug, thiserror::Error)]
pub enum FanInError {
    #[error("graph: {0}")]
    Graph(#[from] GraphError),
    #[error("broker: {0}")]
    Bus(#[from] BusError),
    /// Another check holds the claim and has not marked the synthesis requested yet. The message
    /// comes back: by then the synthesis is requested, or the holder died and its lease ran out.
    #[error("another check is publishing the synthesis")]
    ClaimHeld,
}

/// How long fan-outs wait for their subagents.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    /// From a fan-out's start.
    pub timeout: std::time::Duration,
    /// How much sooner than the fan-out holding it a nested fan-out stops waiting.
    pub grace: std::time::Duration,
}

impl Deadlines {
    /// When the fan-out `correlation_id`, started at `started`, stops waiting: `timeout` after its
    /// start, or sooner, `grace` before the fan-out holding it does (`starts`: when each fan-out
    /// the graph holds above it started). Timed from its own start alone, a nested fan-out outlived
    /// the one holding it, which started first: that one answered without the whole nested branch
    /// because one leaf of it stalled, and the nested supervisor's partial answer came too late.
    pub fn deadline(
        &self,
        correlation_id: &str,
        started: chrono::DateTime<chrono::Utc>,
        starts: &HashMap<String, chrono::DateTime<chrono::Utc>>,
    ) -> chrono::DateTime<chrono::Utc> {
        let span = |d: std::time::Duration| chrono::Duration::from_std(d).unwrap_or_default();
        let timeout = span(self.timeout);
        // Checked: a start read from the graph may lie near the end of time.
        let after = |start: chrono::DateTime<chrono::Utc>, span: chrono::Duration| {
            start
                .checked_add_signed(span)
                .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC)
        };
        let mut deadline = after(started, timeout);
        let above = fanouts_above(correlation_id);
        // Each level up waits `grace` longer than the one below it, but no more than a share of
        // the timeout per level: with the default grace (a quarter), a fan-out four levels down
        // (`max_fanout_depth` 5) was due at the outermost's start, and its subagents were reported
        // as never answering the moment it began. A share of `1 / (levels + 1)` leaves the
        // deepest a share of its own, and deeper levels still stop sooner than those above them.
        let levels = u32::try_from(above.len()).unwrap_or(u32::MAX);
        let grace = self.grace.min(self.timeout / levels.saturating_add(1));
        for (level, above) in above.into_iter().enumerate() {
            let Some(start) = starts.get(above) else {
                continue;
            };
            let earlier = span(grace.saturating_mul(level as u32 + 1)).min(timeout);
            deadline = deadline.min(after(*start, timeout - earlier));
        }
        deadline
    }
}

/// Runs the timeout sweep until `shutdown`: every `every`, fan-outs past their deadline (see
/// [`Deadlines::deadline`]) that are still waiting get a partial synthesis. Its only state is the
/// graph, so it survives restarts.
pub async fn sweep(
    store: GraphStore,
    requests: Publisher,
    seal: Option<SealKey>,
    librarian: Option<std::sync::Arc<agent_bus::Librarian>>,
    deadlines: Deadlines,
    every: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut held_back = HeldBack::default();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) =
            agent_graph::waiting::tidy(&store, agent_graph::waiting::Waits::Synthesis).await
        {
            tracing::warn!(error = %e, "timeout sweep could not remove the marks of answered fan-outs");
        }
        let now = chrono::Utc::now();
        let Overdue { due, open, held } = match overdue(&store, deadlines, now).await {
            Ok(overdue) => overdue,
            Err(e) => {
                tracing::warn!(error = %e, "timeout sweep could not query the graph");
                continue;
            }
        };
        held_back.recorded(held);
        let now_due = held_back.due_now(due, &open, deadlines.grace, now);
        held_back.record(&store).await;
        for (cid, waited) in now_due {
            if let Err(e) = check(
                &store,
                &requests,
                seal.as_ref(),
                librarian.as_deref(),
                &cid,
                Some(waited),
            )
            .await
            {
                tracing::warn!(correlation_id = %cid, error = %e, "timeout sweep failed; retrying later");
            }
        }
    }
}

/// Fan-outs due at the same time as a nested one below them, held back a grace so that the nested
/// supervisor's partial answer can reach them. A nested fan-out is due a grace before the one
/// holding it, but when both are found due in one sweep (the aggregator was away for longer than
/// the grace) the holder, which started first, was answered first and lost the whole branch.
/// Each hold is recorded in the graph (`tg:heldUntil`) and read back by every sweep: held in one
/// process's memory alone, it was lost to another aggregator's sweep and to a restart, which
/// found the nested fan-out answered (no longer open), so nothing to wait for, and answered the
/// holder before the nested supervisor's answer came.
#[derive(Debug, Default)]
struct HeldBack {
    /// Each fan-out held back: until when, and for how many seconds.
    until: HashMap<String, (chrono::DateTime<chrono::Utc>, u64)>,
    /// Holds the graph records, read at the start of each sweep.
    in_graph: HashMap<String, (chrono::DateTime<chrono::Utc>, u64)>,
    /// Holds this sweep made and the graph does not record yet.
    unrecorded: Vec<(String, chrono::DateTime<chrono::Utc>)>,
}

impl HeldBack {
    /// Takes in the holds the graph records (see [`Overdue::held`]).
    fn recorded(&mut self, held: HashMap<String, (chrono::DateTime<chrono::Utc>, u64)>) {
        self.in_graph = held;
    }

    /// Records in the graph the holds made since the last call. One that cannot be recorded still
    /// holds here, and is tried again at the next sweep while it holds.
    async fn record(&mut self, store: &GraphStore) {
        for (cid, until) in std::mem::take(&mut self.unrecorded) {
            if !self.until.contains_key(&cid) {
                continue;
            }
            let at = until.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            if let Err(e) = store.update(queries::fanout_held(&cid, &at)).await {
                tracing::warn!(correlation_id = %cid, error = %e, "timeout sweep could not record a fan-out's hold; only this aggregator keeps it for now");
                self.unrecorded.push((cid, until));
            }
        }
    }

    /// Of `due` (fan-outs past their deadline, with the seconds each waited), those to answer now:
    /// one with fan-outs below it still open (of `open`, every open fan-out) waits from when it
    /// was first found so a grace for each level of them, the deepest answering first, then goes
    /// whether they answered or not. No grace, no wait.
    fn due_now(
        &mut self,
        due: Vec<(String, u64)>,
        open: &std::collections::HashSet<String>,
        grace: std::time::Duration,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Vec<(String, u64)> {
        self.until.retain(|cid, _| open.contains(cid));
        if grace.is_zero() {
            return due;
        }
        // How many levels of open fan-outs each fan-out has below it, read once a sweep.
        let mut levels_below: HashMap<&str, u32> = HashMap::new();
        for below in open {
            for (level, above) in fanouts_above(below).into_iter().enumerate() {
                // Nesting is read from names, and a session's id is its client's to choose: only
                // a chain of fan-outs all still open counts (a nested one is open only while
                // each holding it is), so a name made to look nested under another client's
                // fan-out, with nothing open between, holds that fan-out back not at all.
                if !open.contains(above) {
                    break;
                }
                let levels = u32::try_from(level + 1).unwrap_or(u32::MAX);
                let deepest = levels_below.entry(above).or_default();
                *deepest = (*deepest).max(levels);
            }
        }
        let mut now_due = Vec::new();
        for (cid, waited) in due {
            // The sooner of this process's own hold and the graph's, so that every aggregator
            // ends it at the same time.
            let held = match (self.until.get(&cid), self.in_graph.get(&cid)) {
                (Some(own), Some(recorded)) => {
                    Some(if recorded.0 < own.0 { recorded } else { own })
                }
                (own, recorded) => own.or(recorded),
            };
            let (until, held_secs) = match held {
                Some(held) => *held,
                None => match levels_below.get(cid.as_str()) {
                    Some(levels) => {
                        let hold = grace.saturating_mul(*levels);
                        let until = chrono::Duration::from_std(hold)
                            .ok()
                            .and_then(|hold| now.checked_add_signed(hold))
                            .unwrap_or(now);
                        self.until.insert(cid.clone(), (until, hold.as_secs()));
                        self.unrecorded.push((cid.clone(), until));
                        (until, hold.as_secs())
                    }
                    None => {
                        now_due.push((cid, waited));
                        continue;
                    }
                },
            };
            if now >= until {
                now_due.push((cid, waited.saturating_add(held_secs)));
            }
        }
        now_due
    }
}

/// What a sweep reads of the fan-outs still waiting.
struct Overdue {
    /// Those past their deadline, oldest first, each with the seconds it waited.
    due: Vec<(String, u64)>,
    /// Every one.
    open: std::collections::HashSet<String>,
    /// Those a sweep holds back (see [`HeldBack`]): until when, and how many seconds past their
    /// deadline that is.
    held: HashMap<String, (chrono::DateTime<chrono::Utc>, u64)>,
}

/// The open fan-outs at `now` (see [`Overdue`]).
async fn overdue(
    store: &GraphStore,
    deadlines: Deadlines,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Overdue, GraphError> {
    let open = rows(
        store,
        queries::overdue_fanouts(&now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
    )
    .await?;
    // One row a fan-out, at its earliest start, in the order the graph gave them (oldest first).
    // A start the graph holds as a time but chrono cannot read (a year before 1 BCE) is long past.
    let mut starts: HashMap<String, chrono::DateTime<chrono::Utc>> = HashMap::new();
    let mut order = Vec::new();
    // Two aggregators may each record a hold: the sooner one stands.
    let mut held_until: HashMap<String, chrono::DateTime<chrono::Utc>> = HashMap::new();
    for ((cid, t), held) in open
        .column("cid")
        .into_iter()
        .zip(open.column("t"))
        .zip(open.column("held"))
    {
        let (cid, started) = (
            text(cid),
            instant(&text(t)).unwrap_or(chrono::DateTime::UNIX_EPOCH),
        );
        if let Some(held) = held.and_then(|held| instant(&text(Some(held)))) {
            held_until
                .entry(cid.clone())
                .and_modify(|until| *until = (*until).min(held))
                .or_insert(held);
        }
        match starts.get_mut(&cid) {
            Some(earliest) => *earliest = (*earliest).min(started),
            None => {
                starts.insert(cid.clone(), started);
                order.push(cid);
            }
        }
    }
    let above: std::collections::BTreeSet<&str> = order
        .iter()
        .flat_map(|cid| fanouts_above(cid))
        .filter(|cid| !starts.contains_key(*cid))
        .collect();
    if !above.is_empty() {
        // Without the starts above, each fan-out waits its own timeout, as it did before nesting
        // was looked at: a failure here must not stop every timeout.
        match rows(store, queries::fanout_starts(above)).await {
            Ok(found) => {
                for (cid, t) in found.column("cid").into_iter().zip(found.column("started")) {
                    if let Some(started) = instant(&text(t)) {
                        starts.insert(text(cid), started);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "timeout sweep could not read the starts of the fan-outs holding nested ones");
            }
        }
    }
    let open = order.iter().cloned().collect();
    let mut held = HashMap::new();
    let due = order
        .into_iter()
        .filter_map(|cid| {
            let started = *starts.get(&cid)?;
            let deadline = deadlines.deadline(&cid, started, &starts);
            if let Some(until) = held_until.get(&cid) {
                let past = (*until - deadline).num_seconds().max(0) as u64;
                held.insert(cid.clone(), (*until, past));
            }
            (deadline <= now).then(|| {
                let waited = (deadline - started).num_seconds().max(0) as u64;
                (cid, waited)
            })
        })
        .collect();
    Ok(Overdue { due, open, held })
}

/// An `xsd:dateTime` as the graph gives it back (one without a zone read as UTC), if chrono can
/// represent it.
fn instant(text: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&chrono::Utc))
        .or_else(|_| {
            chrono::NaiveDateTime::parse_from_str(text, "%Y-%m-%dT%H:%M:%S%.f").map(|t| t.and_utc())
        })
        .ok()
}

/// The correlation id of a fan-out or completion in `message`, if it holds one.
pub fn correlation_of(message: &Triples) -> Option<String> {
    if !agent_core::provenance::drives_fan_in(&message.triples) {
        return None;
    }
    message
        .triples
        .iter()
        .find(|t| t.p.iri == tg::CORRELATION_ID.as_str())
        .map(|t| t.o.value.clone())
}

fn text(t: Option<&Term>) -> String {
    match t {
        Some(Term::Literal(l)) => l.value().to_owned(),
        Some(Term::NamedNode(n)) => n.as_str().to_owned(),
        _ => String::new(),
    }
}

async fn rows(store: &GraphStore, sparql: String) -> Result<Rows, GraphError> {
    Ok(match store.query(sparql).await? {
        QueryAnswer::Rows(rows) => rows,
        _ => Rows::default(),
    })
}

/// How long past its timeout a fan-out sealed with a key this aggregator does not have waits for
/// the key to be set right before it is refused for good.
const KEY_GRACE: std::time::Duration = std::time::Duration::from_secs(3600);

/// How long a claim protects a synthesis that is being published; a claim older than this whose
/// holder never marked the synthesis requested (it died) is taken over.
const CLAIM_LEASE: std::time::Duration = std::time::Duration::from_secs(10);

/// Writes `claimer`'s claim on `node` with `claim` (a synthesis's or a subagent's start), stamped
/// with the time the update gets its turn: stamped before, behind a long update (a prune, an
/// operator's `/update`), a claim was stored with its lease partly spent, and another check could
/// take it over while its holder still published.
async fn claim_at_turn(
    store: &GraphStore,
    claim: fn(&NamedNode, &str, &str, &str) -> String,
    node: &NamedNode,
    claimer: &str,
) -> Result<(), agent_graph::GraphError> {
    let (node, claimer) = (node.clone(), claimer.to_owned());
    store
        .update_built(move || {
            let now = chrono::Utc::now();
            let stale = now - chrono::Duration::from_std(CLAIM_LEASE).unwrap_or_default();
            let stamp = |t: chrono::DateTime<chrono::Utc>| {
                t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
            };
            claim(&node, &claimer, &stamp(now), &stamp(stale))
        })
        .await
}

/// Checks the fan-out `correlation_id` after a completion or fan-out was written, and publishes its
/// synthesis request when it is complete and this check wins the claim (every check claims under
/// its own name, so two checks never both win). With `timed_out` (the sweep), the synthesis goes
/// ahead with what arrived, naming the goals that did not.
pub async fn check(
    store: &GraphStore,
    requests: &Publisher,
    seal: Option<&SealKey>,
    librarian: Option<&agent_bus::Librarian>,
    correlation_id: &str,
    timed_out: Option<u64>,
) -> Result<(), FanInError> {
    // Random, so no two checks (on any aggregator, before or after a restart) share a name.
    let claimer = format!("{:032x}", uuid::Uuid::new_v4().as_u128());
    let open = rows(store, queries::open_fanout(correlation_id)).await?;
    if open.rows.is_empty() {
        // Not recorded yet (its completions came first), or already synthesised.
        return Ok(());
    }
    // A node may hold several continuations or seals (a supervisor step run twice without a
    // journal, or an injected copy): a row whose seal verifies, and whose continuation this build
    // reads, is the fan-out's.
    let cell = |name: &str, row: usize| open.column(name).get(row).copied().flatten();
    let sealed: Vec<usize> = (0..open.rows.len())
        .filter(|&row| {
            seal.is_none_or(|key| {
                let (f, continuation, client) = (
                    text(cell("f", row)),
                    text(cell("continuation", row)),
                    text(cell("client", row)),
                );
                let parts = fanout_seal_parts(&f, correlation_id, &continuation, &client);
                key.verify(&parts, &text(cell("seal", row)))
            })
        })
        .collect();
    // Past its timeout by more than [`KEY_GRACE`]: a fan-out that cannot be answered now may be
    // answerable once a key is set right or a build that reads it runs, and is given that long.
    let long_overdue = || {
        let first_recorded = (0..open.rows.len())
            .filter_map(|row| {
                chrono::DateTime::parse_from_rfc3339(&text(cell("recorded", row))).ok()
            })
            .min();
        let grace = timed_out.map_or(KEY_GRACE, |secs| {
            KEY_GRACE + std::time::Duration::from_secs(secs)
        });
        first_recorded.is_none_or(|at| {
            (chrono::Utc::now() - at.with_timezone(&chrono::Utc))
                .to_std()
                .is_ok_and(|age| age > grace)
        })
    };
    if sealed.is_empty() {
        tracing::error!(
            correlation_id,
            "a fan-out without a valid seal; it drives no synthesis"
        );
        // One sealed with another key (a replica configured wrong, a key being changed) would
        // go ahead once the key is set right, so it is given an hour for that; one with no seal
        // at all is refused at once.
        let unsigned = (0..open.rows.len()).all(|row| text(cell("seal", row)).is_empty());
        if !(unsigned || long_overdue()) {
            return Ok(());
        }
        let nodes = open.column("f").into_iter().map(text).collect();
        return refuse_overdue(store, nodes, timed_out, "no valid seal").await;
    }
    let readable = sealed.iter().find_map(|&row| {
        serde_json::from_str::<AgentRequest>(&text(cell("continuation", row)))
            .ok()
            .map(|continuation| (row, continuation))
    });
    let Some((row, continuation)) = readable else {
        tracing::error!(
            correlation_id,
            "the fan-out's continuation is not a request this build reads; no synthesis"
        );
        // Sealed, so an orchestrator wrote it: one of another build (a rolling upgrade), whose
        // aggregator may read it, is given the grace a key has.
        if !long_overdue() {
            return Ok(());
        }
        let why = "its continuation is not a request";
        let nodes = sealed.iter().map(|&row| text(cell("f", row))).collect();
        return refuse_overdue(store, nodes, timed_out, why).await;
    };
    let column = |name: &str| cell(name, row);
    let fanout = text(column("f"));
    let expected: usize = text(column("expected")).parse().unwrap_or(usize::MAX);
    let client = text(column("client"));
    let carried = carried_properties(&text(column("carries")));
    let number = |t: Option<&Term>| text(t).parse::<u64>().unwrap_or(0);
    let mut tokens = (number(column("in")), number(column("out")));
    let started = number(column("started"));
    let recorded = chrono::DateTime::parse_from_rfc3339(&text(column("recorded"))).ok();
    let goals = last_decompose(&continuation.history)
        .map(decomposed_goals)
        .unwrap_or_default();
    let done = rows(store, queries::completions(correlation_id)).await?;
    // Keyed by subagent index: two subagents with the same goal keep two results.
    let mut results = BTreeMap::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut arrived = std::collections::BTreeSet::new();
    // By subagent index: its goal and result as a subagent waiting for it is given them.
    let mut found: BTreeMap<usize, (String, String)> = BTreeMap::new();
    let (c, session, goal, status, result) = (
        done.column("c"),
        done.column("s"),
        done.column("goal"),
        done.column("status"),
        done.column("result"),
    );
    let (used_in, used_out, sealed) = (done.column("in"), done.column("out"), done.column("seal"));
    for i in 0..done.rows.len() {
        let Some(index) = subagent_index(&text(session.get(i).copied().flatten())) else {
            continue;
        };
        let cell = |col: &[Option<&Term>]| text(col.get(i).copied().flatten());
        if let Some(key) = seal {
            let (node, status, result) = (cell(&c), cell(&status), cell(&result));
            let parts = completion_seal_parts(&node, correlation_id, &status, &result);
            if !key.verify(&parts, &cell(&sealed)) {
                tracing::warn!(correlation_id, completion = %node, "a completion without a valid seal does not count");
                continue;
            }
        }
        arrived.insert(index);
        // A completion counts once, its tokens too, however often it was delivered.
        if seen.insert(text(c.get(i).copied().flatten())) {
            let count = |col: &[Option<&Term>]| {
                text(col.get(i).copied().flatten())
                    .parse::<u64>()
                    .unwrap_or(0)
            };
            tokens.0 = tokens.0.saturating_add(count(&used_in));
            tokens.1 = tokens.1.saturating_add(count(&used_out));
        }
        let goal = text(goal.get(i).copied().flatten());
        let status = text(status.get(i).copied().flatten());
        let result = text(result.get(i).copied().flatten());
        let shown = match status.as_str() {
            "answer" => result,
            // Its result says who cancelled it, when and why.
            "cancelled" => format!("The subagent was {result}"),
            _ => format!("Error: the subagent failed: {result}"),
        };
        found.insert(index, (goal.clone(), shown.clone()));
        results.insert(result_key(index, &goal), shown);
    }
    let Ok(node) = NamedNode::new(fanout) else {
        return Ok(());
    };
    let mut missing = Vec::new();
    let mut missing_sessions = Vec::new();
    if seen.len() < expected {
        let Some(secs) = timed_out else {
            tracing::debug!(correlation_id, have = seen.len(), expected, "fan-in waits");
            let fanout = Fanout {
                correlation_id,
                continuation: &continuation,
                client: &client,
                started,
                tokens: tokens.0.saturating_add(tokens.1),
                expected,
                carried: &carried,
            };
            return start_waiting(store, requests, seal, &fanout, &found).await;
        };
        let sessions = rows(store, queries::fanout_sessions(&node)).await?;
        for session in sessions.column("s") {
            let Some(index) = subagent_index(&text(session)) else {
                continue;
            };
            if arrived.contains(&index) {
                continue;
            }
            missing.push(index);
            missing_sessions.push(text(session));
            let goal = goals
                .get(index)
                .cloned()
                .unwrap_or_else(|| format!("subagent {index}"));
            results.insert(
                result_key(index, &goal),
                format!("Error: no result within {secs} s (the subagent timed out)"),
            );
        }
        missing.sort_unstable();
        missing.dedup();
        tracing::warn!(
            correlation_id,
            have = seen.len(),
            expected,
            ?missing,
            "fan-out timed out; partial synthesis"
        );
    }
    claim_at_turn(store, queries::claim_synthesis, &node, &claimer).await?;
    let claim = rows(store, queries::synthesis_claim(&node)).await?;
    let holders: Vec<String> = claim.column("who").into_iter().map(text).collect();
    if holders != [claimer.clone()] {
        // The sweep's check gives way quietly; a completion's check waits for the holder.
        return match timed_out {
            Some(_) => Ok(()),
            None => Err(FanInError::ClaimHeld),
        };
    }
    // A completion written between the read above and the claim lost its own check to this
    // claim: read again, and if one came, answer nothing now. The claim lapses and the next
    // sweep answers with it, a lease later, rather than report it as missing.
    if !missing.is_empty() {
        let distinct = |found: &Rows| {
            found
                .column("c")
                .into_iter()
                .map(text)
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        let now_done = rows(store, queries::completions(correlation_id)).await?;
        if distinct(&now_done) > distinct(&done) {
            tracing::info!(
                correlation_id,
                "a completion came as the fan-out timed out; answered with it once this claim lapses"
            );
            return Ok(());
        }
    }
    // A subagent that did not complete in time has spent what its nodes record so far, and the
    // calls it parked for approval that no answer reached (recorded once answered, on a node
    // no closing counts): counted, or the closing would leave out calls the graph holds or
    // will. What it spends before it stops comes after this and is the graph's alone.
    if !missing_sessions.is_empty() {
        missing_sessions.sort_unstable();
        missing_sessions.dedup();
        let spent = rows(store, queries::spent_under(&node, &missing_sessions)).await?;
        let sum = |name: &str| number(spent.column(name).first().copied().flatten());
        tokens.0 = tokens.0.saturating_add(sum("in"));
        tokens.1 = tokens.1.saturating_add(sum("out"));
        let parked = rows(store, queries::parked_under(&missing_sessions)).await?;
        for continuation in parked.column("continuation") {
            let (input, output) = deciding_call_of(&text(continuation));
            tokens.0 = tokens.0.saturating_add(input);
            tokens.1 = tokens.1.saturating_add(output);
        }
    }
    // Long results go by reference only to a supervisor that can read them back.
    let by_reference = last_decompose(&continuation.history).is_some_and(|d| {
        d.arguments
            .contains_key(agent_core::supervisor::RESULTS_BY_REFERENCE_KEY)
    });
    let results = if by_reference {
        check_in_results(store, librarian, results).await
    } else {
        results
    };
    // Results carried whole can outgrow the broker's limit together; a request it refuses
    // would be refused on every try and the supervisor never resumed, so they are cut to fit
    // (each saying so). Room is left for the properties (tokens, trace, seal).
    let limit = requests.max_message_bytes().saturating_sub(PROPERTIES_ROOM);
    let (built, fit) = synthesis_request_within(&continuation, results, &missing, limit);
    match fit {
        Fit::Whole => {}
        Fit::Cut => {
            tracing::warn!(correlation_id, limit, "the subagents' results together are over the broker's message limit; each is cut to fit")
        }
        Fit::Over => {
            tracing::error!(correlation_id, limit, "the supervisor's request is over the broker's message limit even with every subagent result cut; sent with the results cut to their notes")
        }
    }
    // What the supervisor's next step is given, kept as every step's input is: a fork or replay of
    // that step starts from it. Recorded before it is sent, and only if no attempt recorded one:
    // the request sent is the one recorded first. An attempt that stopped after recording (a
    // crash, a lapsed claim) may have sent it, and the orchestrator's journal drops a later copy
    // whatever it holds; sent with other results, the graph would name an input that never ran,
    // and a fork from that step would start from it.
    let step = agent_core::fork::step_of(&built);
    let input = agent_core::fork::RecordedInput {
        step,
        continues: None,
        request: built.clone(),
    };
    let uris = agent_core::provenance::SessionUris::new(&built.session_id);
    let next = match (
        agent_graph::convert::into_quads(agent_core::provenance::step_input(&uris, &input)),
        NamedNode::new(uris.input(step)),
    ) {
        (Ok(quads), Ok(node)) => {
            store
                .update(queries::record_step_input_once(&node, &quads))
                .await?;
            agent_graph::recorded::recorded_request(store, &built.session_id, step)
                .await?
                .unwrap_or(built)
        }
        _ => built,
    };
    // The supervisor goes on with its subagents' tokens counted and its own start time, and with
    // what the step that fanned out carries on (a replay's reuse, the dialog's model).
    let mut properties = carried.clone();
    properties.insert(ID_PROPERTY.to_owned(), client);
    properties.insert(IN_TOKEN_PROPERTY.to_owned(), tokens.0.to_string());
    properties.insert(OUT_TOKEN_PROPERTY.to_owned(), tokens.1.to_string());
    if started > 0 {
        properties.insert(STARTED_PROPERTY.to_owned(), started.to_string());
    }
    // The supervisor's next step continues the trace of the completion that closed the fan-in.
    if let Some(context) = agent_telemetry::trace::traceparent(&tracing::Span::current()) {
        properties.insert(
            agent_telemetry::trace::TRACEPARENT_PROPERTY.to_owned(),
            context,
        );
    }
    let payload = agent_schema::encode(&next);
    // The supervisor's later step: taken only sealed when the supervisor is itself a subagent.
    if let Some(key) = seal {
        let step_seal = key.seal_step(&payload, &properties);
        properties.insert(agent_bus::seal::STEP_SEAL_PROPERTY.to_owned(), step_seal);
    }
    requests.enqueue(payload, &properties).await?.wait().await?;
    store.update(queries::synthesis_requested(&node)).await?;
    if let Some(recorded) = recorded {
        let took = (chrono::Utc::now() - recorded.with_timezone(&chrono::Utc))
            .to_std()
            .unwrap_or_default();
        crate::metrics::fan_in(timed_out.is_some(), took);
    }
    tracing::info!(correlation_id, "fan-in complete; synthesis requested");
    Ok(())
}

/// The tokens (input, output) of the LLM call that chose a call parked for approval, from its
/// continuation (the orchestrator's `approval::Continuation`: `decision.stats`); none from one
/// that does not read.
fn deciding_call_of(continuation: &str) -> (u64, u64) {
    let Ok(parked) = serde_json::from_str::<serde_json::Value>(continuation) else {
        return (0, 0);
    };
    let stats = &parked["decision"]["stats"];
    let count = |key: &str| stats[key].as_u64().unwrap_or(0);
    (count("in_token"), count("out_token"))
}

/// What a synthesis request leaves for its properties under the broker's limit: the client's id,
/// tokens, start, trace context, what the fan-out carries on, and a seal.
const PROPERTIES_ROOM: usize = 8 * 1024;

/// Marks the fan-outs `nodes` as never to be synthesised, when the timeout sweep (`timed_out`)
/// finds them so: it would otherwise find them again every round, for good. A completion's check
/// marks nothing: a forged node could then stand in the way of the real one, written after it.
async fn refuse_overdue(
    store: &GraphStore,
    nodes: std::collections::BTreeSet<String>,
    timed_out: Option<u64>,
    why: &str,
) -> Result<(), FanInError> {
    if timed_out.is_none() {
        return Ok(());
    }
    for node in nodes {
        if let Ok(node) = NamedNode::new(node) {
            store.update(queries::fan_in_refused(&node, why)).await?;
        }
    }
    Ok(())
}

/// A fan-out as the start of its waiting subagents needs it.
struct Fanout<'a> {
    correlation_id: &'a str,
    /// What resumes the supervisor: its last step is the decompose that kept the goals.
    continuation: &'a AgentRequest,
    client: &'a str,
    /// When the run started (Unix ms) and what it had spent at the fan-out.
    started: u64,
    tokens: u64,
    expected: usize,
    /// What the fan-out carries on to the requests sent for it (see [`carried_properties`]).
    carried: &'a Properties,
}

/// The message properties a fan-out's record carries on (`tg:carries`, a JSON object) that the
/// aggregator passes on: a replay's reuse, the dialog's model and, for a nested supervisor, what
/// its run spent outside its dialog; nothing else it may name.
fn carried_properties(json: &str) -> Properties {
    const CARRIED: [&str; 4] = [
        REUSE_PROPERTY,
        REUSE_FROM_PROPERTY,
        MODEL_PROPERTY,
        RUN_TOKENS_PROPERTY,
    ];
    serde_json::from_str::<Properties>(json)
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| CARRIED.contains(&key.as_str()))
        .collect()
}

/// Starts each subagent of `fanout` that waited for others and whose prerequisites have all
/// completed (`found`: by index, goal and result), with their results in its context: claimed
/// first (one start however many checks see it ready), sealed as the orchestrator seals the
/// subagents it starts, published, then recorded (`tg:startedAfter` each prerequisite's
/// completion) and marked. A claim another check holds sends the message back, as for a synthesis.
async fn start_waiting(
    store: &GraphStore,
    requests: &Publisher,
    seal: Option<&SealKey>,
    fanout: &Fanout<'_>,
    found: &BTreeMap<usize, (String, String)>,
) -> Result<(), FanInError> {
    let Some(decompose) = last_decompose(&fanout.continuation.history) else {
        return Ok(());
    };
    // The run's spend as the waiting subagent starts: outside the supervisor's dialog (a nested
    // supervisor's run), the supervisor's own, and its completed subagents'.
    let run_tokens = fanout
        .carried
        .get(RUN_TOKENS_PROPERTY)
        .and_then(|t| t.parse::<u64>().ok())
        .unwrap_or(0)
        .saturating_add(fanout.tokens);
    let mut held = false;
    for (index, goal) in kept_goals(decompose).iter().enumerate() {
        let ready = !goal.needs.is_empty()
            && !found.contains_key(&index)
            && goal.needs.iter().all(|need| found.contains_key(need));
        if !ready || index >= fanout.expected {
            continue;
        }
        let session = subagent_session(fanout.correlation_id, index);
        let Ok(node) = NamedNode::new(agent_core::provenance::SessionUris::new(&session).session())
        else {
            continue;
        };
        let claimer = format!("{:032x}", uuid::Uuid::new_v4().as_u128());
        claim_at_turn(store, queries::claim_start, &node, &claimer).await?;
        let claim = rows(store, queries::start_claim(&node)).await?;
        if claim.column("started").iter().any(Option::is_some) {
            continue;
        }
        let holders: Vec<String> = claim.column("who").into_iter().map(text).collect();
        if holders != [claimer.clone()] {
            held = true;
            continue;
        }
        let prerequisites: Vec<(String, String)> = goal
            .needs
            .iter()
            .filter_map(|need| found.get(need).cloned())
            .collect();
        let request = dependent_request(
            fanout.continuation,
            fanout.correlation_id,
            index,
            goal,
            fanout.expected,
            &prerequisites,
        );
        // A goal's own model goes before the dialog's.
        let mut properties = fanout.carried.clone();
        properties.insert(ID_PROPERTY.to_owned(), fanout.client.to_owned());
        properties.insert(STARTED_PROPERTY.to_owned(), fanout.started.to_string());
        properties.insert(RUN_TOKENS_PROPERTY.to_owned(), run_tokens.to_string());
        if let Some(model) = &goal.model {
            properties.insert(MODEL_PROPERTY.to_owned(), model.clone());
        }
        let payload = agent_schema::encode(&request);
        if let Some(key) = seal {
            let model = properties.get(MODEL_PROPERTY).map_or("", String::as_str);
            let parts = subagent_seal_parts(
                &request,
                &payload,
                fanout.started,
                run_tokens,
                model,
                fanout.client,
            );
            properties.insert(
                agent_bus::seal::SUBAGENT_SEAL_PROPERTY.to_owned(),
                key.seal(&parts.each_ref().map(String::as_str)),
            );
            let legacy = legacy_subagent_seal_parts(&request, fanout.started, run_tokens);
            properties.insert(
                agent_bus::seal::SEAL_PROPERTY.to_owned(),
                key.seal(&legacy.each_ref().map(String::as_str)),
            );
        }
        if let Some(context) = agent_telemetry::trace::traceparent(&tracing::Span::current()) {
            properties.insert(
                agent_telemetry::trace::TRACEPARENT_PROPERTY.to_owned(),
                context,
            );
        }
        // When it was started: as it is sent, before its own first records.
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        requests.enqueue(payload, &properties).await?.wait().await?;
        let after: Vec<NamedNode> = goal
            .needs
            .iter()
            .filter_map(|&need| {
                let completion = agent_core::provenance::SessionUris::new(&subagent_session(
                    fanout.correlation_id,
                    need,
                ))
                .completion();
                NamedNode::new(completion).ok()
            })
            .collect();
        store
            .update(queries::record_dependent_start(&node, &after, &now))
            .await?;
        tracing::info!(
            correlation_id = fanout.correlation_id,
            subagent = index,
            "every subagent it needs has completed; started"
        );
    }
    if held {
        return Err(FanInError::ClaimHeld);
    }
    Ok(())
}

/// How long a fan-in waits for the librarian to keep its long results (well within the claim's
/// lease).
const LIBRARIAN_WAIT: std::time::Duration = std::time::Duration::from_secs(4);

/// Long results leave the synthesis request (claim-check): each is kept as a document and the
/// request carries an excerpt and its reference, which the supervisor reads whole for its prompts;
/// so the request, and every later message of the supervisor, stays bounded however long its
/// subagents' answers. Kept in TrustGraph's librarian when the deployment keeps documents there
/// (the supervisor reads them back from it), else in the graph, as is a result too long for one
/// librarian request or one the librarian did not keep in time (the supervisor looks for a
/// document the librarian lacks, or does not answer for, in the graph).
async fn check_in_results(
    store: &GraphStore,
    librarian: Option<&agent_bus::Librarian>,
    results: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    use agent_core::documents::{document_uri, excerpt_with_reference, wants_check_in};
    let mut carried = BTreeMap::new();
    let mut for_librarian = Vec::new();
    for (key, result) in results {
        match librarian {
            Some(librarian) if wants_check_in(&result) && librarian.takes(&result) => {
                let uri = document_uri(&result);
                for_librarian.push((key, result, uri));
            }
            _ => {
                carried.insert(key, store.check_in(result).await);
            }
        }
    }
    let Some(librarian) = librarian.filter(|_| !for_librarian.is_empty()) else {
        return carried;
    };
    // All at once and briefly: this runs under the synthesis claim, whose lease is short. A
    // result the librarian did not take in time is kept in the graph instead, under the same
    // name: the supervisor looks there for what the librarian lacks or does not answer for.
    let keeps = for_librarian
        .iter()
        .map(|(_, text, uri)| librarian.keep(uri, text));
    let kept = tokio::time::timeout(LIBRARIAN_WAIT, futures::future::join_all(keeps)).await;
    // One outcome per result, in order; none at all when the wait ran out.
    let mut outcomes = kept
        .unwrap_or_else(|_| {
            tracing::warn!("the librarian did not keep the long subagent results in time; they are kept in the graph");
            Vec::new()
        })
        .into_iter();
    for (key, text, uri) in for_librarian {
        let text = match outcomes.next() {
            Some(Ok(())) => excerpt_with_reference(&text, &uri),
            Some(Err(e)) => {
                tracing::warn!(error = %e, "a long subagent result could not be kept in the librarian; it is kept in the graph");
                store.check_in_as(text, &uri).await
            }
            None => store.check_in_as(text, &uri).await,
        };
        carried.insert(key, text);
    }
    carried
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: i64) -> chrono::DateTime<chrono::Utc> {
        chrono::DateTime::UNIX_EPOCH + chrono::Duration::seconds(secs)
    }

    const DEADLINES: Deadlines = Deadlines {
        timeout: Duration::from_secs(300),
        grace: Duration::from_secs(75),
    };

    #[test]
    fn a_parked_calls_cost_is_read_from_its_continuation() {
        let continuation = r#"{"request": {}, "properties": {}, "deadline": "",
            "decision": {"thought": "", "action": "pay", "arguments": {}, "discarded": "",
              "candidates": [], "tokens": {"input": 900, "output": 90},
              "stats": {"duration_ms": 5, "in_token": 120, "out_token": 12, "model": "m"}}}"#;
        assert_eq!(deciding_call_of(continuation), (120, 12));
        assert_eq!(deciding_call_of("not a continuation"), (0, 0));
        assert_eq!(deciding_call_of(r#"{"decision": {}}"#), (0, 0));
    }

    #[test]
    fn a_fan_out_due_with_a_nested_one_open_waits_a_grace_for_it() {
        let open = |cids: &[&str]| cids.iter().map(|c| c.to_string()).collect();
        let due = |cids: &[&str]| cids.iter().map(|c| (c.to_string(), 300)).collect();
        let grace = Duration::from_secs(75);
        let mut held = HeldBack::default();
        // Found together (the sweep was away): the nested one goes, the one holding it waits.
        let both = open(&["abc-f1", "abc-f1-s0-f2", "xyz-f3"]);
        assert_eq!(
            held.due_now(
                due(&["abc-f1", "abc-f1-s0-f2", "xyz-f3"]),
                &both,
                grace,
                at(2000)
            ),
            [("abc-f1-s0-f2".to_owned(), 300), ("xyz-f3".to_owned(), 300)]
        );
        // It keeps waiting its grace once the nested one has closed...
        let outer = open(&["abc-f1"]);
        assert!(held
            .due_now(due(&["abc-f1"]), &outer, grace, at(2074))
            .is_empty());
        // ...and goes after it, whether the nested answer came or not.
        assert_eq!(
            held.due_now(due(&["abc-f1"]), &outer, grace, at(2075)),
            [("abc-f1".to_owned(), 375)]
        );
        // Answered, it is forgotten.
        held.due_now(Vec::new(), &open(&[]), grace, at(2076));
        assert!(held.until.is_empty());
        // Three levels found together: the middle one waits a grace, the outer one two.
        let mut deep = HeldBack::default();
        let three = open(&["abc-f1", "abc-f1-s0-f2", "abc-f1-s0-f2-s1-f3"]);
        let all_due = || due(&["abc-f1", "abc-f1-s0-f2", "abc-f1-s0-f2-s1-f3"]);
        assert_eq!(
            deep.due_now(all_due(), &three, grace, at(3000)),
            [("abc-f1-s0-f2-s1-f3".to_owned(), 300)]
        );
        let two = open(&["abc-f1", "abc-f1-s0-f2"]);
        assert_eq!(
            deep.due_now(due(&["abc-f1", "abc-f1-s0-f2"]), &two, grace, at(3075)),
            [("abc-f1-s0-f2".to_owned(), 375)]
        );
        assert!(deep
            .due_now(due(&["abc-f1"]), &outer, grace, at(3100))
            .is_empty());
        assert_eq!(
            deep.due_now(due(&["abc-f1"]), &outer, grace, at(3150)),
            [("abc-f1".to_owned(), 450)]
        );
        // No grace: the outer one goes with the nested one.
        let mut none = HeldBack::default();
        assert_eq!(
            none.due_now(
                due(&["abc-f1", "abc-f1-s0-f2"]),
                &both,
                Duration::ZERO,
                at(2000)
            )
            .len(),
            2
        );
    }

    /// Records, in `store`, a fan-out `cid` waiting for its synthesis since `started`.
    async fn waiting_fanout(store: &GraphStore, cid: &str, started: chrono::DateTime<chrono::Utc>) {
        let (g, w) = (
            agent_core::vocab::PROVENANCE_GRAPH,
            agent_core::vocab::WAITING_GRAPH,
        );
        let node = format!("<{}{cid}/fanout>", agent_core::vocab::SESSION_PREFIX);
        let started = started.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        store
            .update(format!(
                "{}INSERT DATA {{ GRAPH <{g}> {{ {node} a tg:FanOut ; tg:correlationId \"{cid}\" ;
                   prov:startedAtTime \"{started}\"^^<http://www.w3.org/2001/XMLSchema#dateTime> ;
                   tg:expectedSiblings 1 ; tg:continuation \"{{}}\" ; tg:clientId \"c\" }}
                 GRAPH <{w}> {{ {node} tg:awaits tg:Synthesis }} }}",
                agent_core::vocab::SPARQL_PREFIXES
            ))
            .await
            .unwrap();
    }

    /// What a sweep at `now` would answer, as read from `store` by `held`.
    async fn sweep_at(
        store: &GraphStore,
        held: &mut HeldBack,
        now: chrono::DateTime<chrono::Utc>,
    ) -> Vec<(String, u64)> {
        let Overdue {
            due,
            open,
            held: in_graph,
        } = overdue(store, DEADLINES, now).await.unwrap();
        held.recorded(in_graph);
        let now_due = held.due_now(due, &open, DEADLINES.grace, now);
        held.record(store).await;
        now_due
    }

    /// A hold lives in the graph: another aggregator, or this one restarted, finds the nested
    /// fan-out answered (no longer open) and still holds the outer one until the first sweep's
    /// time. Held in memory alone, the second sweep answered it at once.
    #[tokio::test]
    async fn a_hold_is_kept_by_another_aggregators_sweep_and_after_a_restart() {
        let store = GraphStore::in_memory().unwrap();
        waiting_fanout(&store, "abc-f1", at(1000)).await;
        waiting_fanout(&store, "abc-f1-s0-f2", at(1010)).await;
        // Away past both deadlines (1225 and 1300): the nested one goes, the outer one is held.
        let mut first = HeldBack::default();
        assert_eq!(
            sweep_at(&store, &mut first, at(2000)).await,
            [("abc-f1-s0-f2".to_owned(), 215)]
        );
        // Its synthesis requested, the nested fan-out is no longer open.
        store
            .update(queries::synthesis_requested(&NamedNode::new_unchecked(
                format!("{}abc-f1-s0-f2/fanout", agent_core::vocab::SESSION_PREFIX),
            )))
            .await
            .unwrap();
        let mut second = HeldBack::default();
        assert!(sweep_at(&store, &mut second, at(2010)).await.is_empty());
        assert!(sweep_at(&store, &mut second, at(2074)).await.is_empty());
        // The hold ends at the first sweep's time, on every aggregator, which tells the wait from
        // the fan-out's start to then (this one was not there when it was held).
        assert_eq!(
            sweep_at(&store, &mut second, at(2075)).await,
            [("abc-f1".to_owned(), 1075)]
        );
        assert_eq!(
            sweep_at(&store, &mut first, at(2075)).await,
            [("abc-f1".to_owned(), 375)]
        );
        // A later hold (another aggregator's, recorded after) does not move it.
        store
            .update(queries::fanout_held("abc-f1", "1970-01-01T01:00:00Z"))
            .await
            .unwrap();
        let mut third = HeldBack::default();
        assert_eq!(
            sweep_at(&store, &mut third, at(2075)).await,
            [("abc-f1".to_owned(), 1075)]
        );
    }

    #[test]
    fn a_name_that_only_looks_nested_holds_no_fan_out_back() {
        let grace = Duration::from_secs(75);
        let mut held = HeldBack::default();
        // Another client's supervisor, its session named to sit 34 levels below abc-f1.
        let planted = format!("abc-f1-s0{}-f9", "-f9-s0".repeat(33));
        let open: std::collections::HashSet<String> = ["abc-f1".to_owned(), planted.clone()].into();
        assert_eq!(
            held.due_now(vec![("abc-f1".to_owned(), 300)], &open, grace, at(2000)),
            [("abc-f1".to_owned(), 300)]
        );
        assert!(held.until.is_empty());
    }

    #[test]
    fn a_fan_out_of_a_clients_supervisor_waits_its_timeout() {
        let starts = HashMap::new();
        assert_eq!(DEADLINES.deadline("abc-f2", at(1000), &starts), at(1300));
    }

    #[test]
    fn a_nested_fan_out_stops_waiting_a_grace_before_each_fan_out_above_it() {
        let starts: HashMap<String, _> = [
            ("abc-f1".to_owned(), at(1000)),
            ("abc-f1-s0-f2".to_owned(), at(1010)),
        ]
        .into();
        // One level down: before its supervisor's fan-out, not 300 s from its own start.
        assert_eq!(
            DEADLINES.deadline("abc-f1-s0-f2", at(1010), &starts),
            at(1225)
        );
        // Two levels down: 75 s before the level above it, 150 s before the outermost.
        assert_eq!(
            DEADLINES.deadline("abc-f1-s0-f2-s3-f1", at(1100), &starts),
            at(1150)
        );
        // A nested fan-out that started late is due at once rather than after its supervisor's.
        assert_eq!(
            DEADLINES.deadline("abc-f1-s0-f2", at(1280), &starts),
            at(1225)
        );
        // One started early enough keeps its own timeout.
        let early = Deadlines {
            grace: Duration::ZERO,
            ..DEADLINES
        };
        assert_eq!(early.deadline("abc-f1-s0-f2", at(1000), &starts), at(1300));
    }

    #[test]
    fn a_fan_out_above_that_the_graph_does_not_hold_changes_nothing() {
        let starts = HashMap::new();
        assert_eq!(
            DEADLINES.deadline("abc-f1-s0-f2", at(1010), &starts),
            at(1310)
        );
        // A grace longer than the timeout cannot put a deadline before the holder's start: one
        // level down, it takes at most half the timeout.
        let long = Deadlines {
            grace: Duration::from_secs(1000),
            ..DEADLINES
        };
        let starts: HashMap<String, _> = [("abc-f1".to_owned(), at(1000))].into();
        assert_eq!(long.deadline("abc-f1-s0-f2", at(1010), &starts), at(1150));
    }

    /// Fan-outs nested as deep as `max_fanout_depth` allows each keep a share of the timeout,
    /// the deeper due sooner: with the default grace, one four levels down was due at the
    /// outermost's start (and three down at 75 s of its 300).
    #[test]
    fn deeply_nested_fan_outs_each_keep_a_share_of_the_timeout() {
        let chain = [
            "abc-f1",
            "abc-f1-s0-f1",
            "abc-f1-s0-f1-s0-f1",
            "abc-f1-s0-f1-s0-f1-s0-f1",
            "abc-f1-s0-f1-s0-f1-s0-f1-s0-f1",
        ];
        let starts: HashMap<String, _> = chain
            .iter()
            .enumerate()
            .map(|(i, cid)| ((*cid).to_owned(), at(1000 + i as i64)))
            .collect();
        let due: Vec<i64> = chain
            .iter()
            .map(|cid| DEADLINES.deadline(cid, starts[*cid], &starts).timestamp())
            .collect();
        // 300 s; then 75 s sooner a level while a quarter is a share of at most 1 / (levels + 1).
        assert_eq!(due, [1300, 1225, 1150, 1075, 1060]);
        assert!(due.windows(2).all(|w| w[1] < w[0]), "{due:?}");
    }

    #[test]
    fn times_read_back_from_the_graph() {
        assert_eq!(instant("1970-01-01T00:16:40Z"), Some(at(1000)));
        assert_eq!(
            instant("1970-01-01T00:16:40.000001+00:00").map(|t| t.timestamp()),
            Some(1000)
        );
        assert_eq!(instant("1970-01-01T00:16:40"), Some(at(1000)));
        assert_eq!(instant("soon"), None);
    }

    #[test]
    fn a_start_near_the_end_of_time_does_not_overflow() {
        // chrono reads a signed year of any length, up to the end of its range.
        let end = instant("+262142-12-31T23:59:59").unwrap();
        assert!(instant("+262144-01-01T00:00:00").is_none());
        let starts: HashMap<String, _> = [("abc-f1".to_owned(), end)].into();
        assert_eq!(
            DEADLINES.deadline("abc-f1-s0-f2", at(1000), &starts),
            at(1300)
        );
        let never = DEADLINES.deadline("abc-f1", end, &HashMap::new());
        assert!(never > at(1300));
    }
}
