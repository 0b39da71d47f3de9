//! The approvals sweep: a tool call parked for a person's approval whose deadline passed without an
//! answer gets an `expire` answer, so its dialog ends (a subagent's with a completion its
//! supervisor synthesises around) instead of waiting forever; so does the call of a run cancelled
//! while it waited, which then ends as cancelled. The orchestrator that takes the answer up
//! decides; if a person's answer came first, the expiry changes nothing.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use agent_bus::Publisher;
use agent_core::provenance::SessionUris;
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore};
use agent_schema::{control_operation, AgentControl};
use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

/// How long the sweep waits before it sends an expiry again for the same call (its answer may be
/// on its way to the graph, or the orchestrators down).
const RESEND_AFTER: Duration = Duration::from_secs(60);

/// Expiries sent for one call a minute apart before the sweep spaces them out: an orchestrator
/// that takes an answer up records it whatever becomes of the step, so a call still unanswered
/// after these is most likely one no orchestrator can resume (its continuation sealed with another
/// key), and a minute apart they would load the orchestrators for ever. They go on, doubling
/// their gap up to [`LONGEST_GAP`]: a call whose expiries found no subscription (a new deployment,
/// a subscription the broker removed) still ends once orchestrators listen.
const MOST_EXPIRIES: u32 = 5;
const LONGEST_GAP: Duration = Duration::from_secs(3600);

/// How long after the `sent`-th expiry of a call the next one goes.
fn gap_after(sent: u32) -> Duration {
    if sent < MOST_EXPIRIES {
        return RESEND_AFTER;
    }
    let doublings = (sent - MOST_EXPIRIES + 1).min(16);
    (RESEND_AFTER * 2u32.pow(doublings)).min(LONGEST_GAP)
}

/// Expiries sent for one call, and when the last went.
struct Sent {
    count: u32,
    last: Instant,
}

/// Every `every`, sends an expiry for each parked call past its deadline.
pub async fn sweep(
    store: GraphStore,
    answers: Publisher,
    seal: Option<agent_bus::seal::SealKey>,
    every: Duration,
    shutdown: CancellationToken,
) {
    // Only calls still due are remembered, so this holds no more than the queries give: the
    // unanswered calls past their deadline or of a cancelled run.
    let mut sent: HashMap<String, Sent> = HashMap::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        if let Err(e) =
            agent_graph::waiting::tidy(&store, agent_graph::waiting::Waits::ApprovalAnswer).await
        {
            tracing::warn!(error = %e, "the approvals sweep could not remove the marks of answered calls");
        }
        let now = Utc::now();
        let due = match due_calls(&store, now).await {
            Ok(due) => due,
            Err(e) => {
                tracing::warn!(error = %e, "the approvals sweep could not query the graph");
                continue;
            }
        };
        let due_now: HashSet<&str> = due.iter().map(|call| call.node.as_str()).collect();
        sent.retain(|node, _| due_now.contains(node.as_str()));
        for Due {
            node,
            session,
            step,
            reason,
        } in &due
        {
            let (session, step) = (session.as_str(), *step);
            if let Some(sent) = sent.get(node) {
                if sent.last.elapsed() < gap_after(sent.count) {
                    continue;
                }
            }
            let expiry = AgentControl {
                operation: control_operation::EXPIRE.to_owned(),
                session_id: session.to_owned(),
                by: "agent-aggregator".to_owned(),
                reason: (*reason).to_owned(),
                at: now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                step: Some(step),
                arguments: None,
            };
            let (payload, properties) = agent_bus::sealed_control(&expiry, seal.as_ref());
            match answers.send(payload, &properties).await {
                Ok(()) => {
                    let sent = sent.entry(node.clone()).or_insert(Sent {
                        count: 0,
                        last: Instant::now(),
                    });
                    sent.count += 1;
                    sent.last = Instant::now();
                    if sent.count == 1 {
                        tracing::info!(session, step, reason, "a call parked for approval expired");
                    } else if sent.count == MOST_EXPIRIES {
                        tracing::warn!(session, step, expiries = sent.count, "no orchestrator took up the expiry of a call parked for approval (its continuation may be sealed with another key); sending it again less and less often, at most hourly");
                    } else {
                        tracing::info!(
                            session,
                            step,
                            expiries = sent.count,
                            "a call parked for approval expired; its expiry sent again"
                        );
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the approvals sweep could not send an expiry")
                }
            }
        }
    }
}

/// Why an expiry is sent for a call past its deadline.
const PAST_DEADLINE: &str = "no answer before the deadline";
/// Why an expiry is sent for a call whose run was cancelled while it waited.
const RUN_CANCELLED: &str = "its run was cancelled while the call waited";
/// The most cancellation nodes asked about in one query.
const CANCELS_A_QUERY: usize = 200;

/// How far before a call was asked a cancel of its run may be recorded and still count: the
/// step that parked it may have started before the cancel was heard, and the cancel's time is
/// the clock of whoever sent it. A cancel older than that did not stop the run before it parked
/// (a session id used again after its cancel was forgotten), so it does not end the call now.
const CLOCK_SLACK: chrono::Duration = chrono::Duration::minutes(5);

/// A parked call the sweep answers `expire`, and why.
#[derive(Debug, PartialEq, Eq)]
struct Due {
    /// The approval node.
    node: String,
    session: String,
    step: u64,
    reason: &'static str,
}

/// An unanswered parked call, as [`queries::unanswered_approvals`] gives it.
struct Parked {
    due: Due,
    deadline: Option<DateTime<Utc>>,
    asked: Option<DateTime<Utc>>,
}

fn time(term: Option<&Term>) -> Option<DateTime<Utc>> {
    match term {
        Some(Term::Literal(t)) => DateTime::parse_from_rfc3339(t.value())
            .ok()
            .map(|t| t.with_timezone(&Utc)),
        _ => None,
    }
}

/// The unanswered parked calls in `rows`.
fn parked_calls(rows: &agent_graph::Rows) -> Vec<Parked> {
    let [nodes, steps, deadlines, asked] =
        ["a", "step", "deadline", "asked"].map(|c| rows.column(c));
    let mut parked = Vec::new();
    for (i, node) in nodes.into_iter().enumerate() {
        let (Some(Term::NamedNode(node)), Some(Some(Term::Literal(step)))) = (node, steps.get(i))
        else {
            continue;
        };
        let (Some(session), Ok(step)) = (
            agent_core::vocab::session_id_of(node.as_str()),
            step.value().parse::<u64>(),
        ) else {
            continue;
        };
        parked.push(Parked {
            due: Due {
                node: node.as_str().to_owned(),
                session: session.to_owned(),
                step,
                reason: PAST_DEADLINE,
            },
            deadline: time(deadlines.get(i).copied().flatten()),
            asked: time(asked.get(i).copied().flatten()),
        });
    }
    parked
}

/// `session` and every supervisor above it: a cancel of any of them stops it.
fn session_and_supervisors(session: &str) -> Vec<&str> {
    let mut chain = vec![session];
    let mut at = session;
    while let Some(place) = agent_core::supervisor::place_of(at) {
        chain.push(place.supervisor);
        at = place.supervisor;
    }
    chain
}

/// The parked calls to answer `expire` now: those past their deadline, and those whose run (the
/// dialog or a supervisor above it) was cancelled while they waited. A cancel stops a run at its
/// next step, and a parked call has none until it is answered: without this, its client would
/// wait for its closing until the deadline (minutes, or days as configured). A call parked by a
/// build before 2026-12-02 records no time asked, and waits for its deadline.
async fn due_calls(
    store: &GraphStore,
    now: DateTime<Utc>,
) -> Result<Vec<Due>, agent_graph::GraphError> {
    let rows = store.query(queries::unanswered_approvals()).await?.rows();
    let mut due = Vec::new();
    let mut waiting = Vec::new();
    for call in parked_calls(&rows) {
        match call.deadline {
            Some(deadline) if deadline < now => due.push(call.due),
            _ => {
                if let Some(asked) = call.asked {
                    waiting.push((call.due, asked));
                }
            }
        }
    }
    let mut asked: Vec<String> = waiting
        .iter()
        .flat_map(|(call, _)| session_and_supervisors(&call.session))
        .map(|session| SessionUris::new(session).cancellation())
        .collect();
    asked.sort_unstable();
    asked.dedup();
    // Each cancellation node, and when the cancel was recorded.
    let mut cancelled: HashMap<String, DateTime<Utc>> = HashMap::new();
    for page in asked.chunks(CANCELS_A_QUERY) {
        let nodes: Vec<_> = page
            .iter()
            .filter_map(|node| agent_graph::model::NamedNode::new(node).ok())
            .collect();
        let rows = store.query(queries::cancellations_at(&nodes)).await?.rows();
        for (node, at) in rows.column("c").into_iter().zip(rows.column("at")) {
            if let (Some(Term::NamedNode(node)), Some(at)) = (node, time(at)) {
                // The latest cancel of a node: a session's id is its client's to choose, so a
                // node can hold an old dialog's cancel beside a new one's, in any row order.
                let latest = cancelled.entry(node.as_str().to_owned()).or_insert(at);
                *latest = (*latest).max(at);
            }
        }
    }
    for (mut call, asked) in waiting {
        let stopped = session_and_supervisors(&call.session)
            .into_iter()
            .any(|session| {
                cancelled
                    .get(&SessionUris::new(session).cancellation())
                    .is_some_and(|at| *at >= asked - CLOCK_SLACK)
            });
        if stopped {
            call.reason = RUN_CANCELLED;
            due.push(call);
        }
    }
    Ok(due)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiries_go_a_minute_apart_then_less_and_less_often() {
        let gaps: Vec<u64> = (1..=12).map(|sent| gap_after(sent).as_secs()).collect();
        assert_eq!(
            gaps,
            [60, 60, 60, 60, 120, 240, 480, 960, 1920, 3600, 3600, 3600]
        );
        assert_eq!(gap_after(u32::MAX), LONGEST_GAP);
    }

    /// Calls parked at various times, some of them in runs cancelled at various times: which the
    /// sweep ends, and why.
    #[tokio::test]
    async fn a_call_is_due_past_its_deadline_or_once_its_run_is_cancelled_after_it_was_asked() {
        #![allow(clippy::unwrap_used)]
        let now = Utc::now();
        let at = |minutes: i64| {
            let t = (now + chrono::Duration::minutes(minutes))
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
            format!("\"{t}\"^^xsd:dateTime")
        };
        let parked = |session: &str, asked: i64, deadline: i64| {
            format!(
                "<urn:trustgraph:agent:{session}/i1/approval> a tg:ApprovalRequest ; tg:step 1 ;
                   prov:startedAtTime {} ; tg:deadline {} .\n",
                at(asked),
                at(deadline)
            )
        };
        let cancel = |session: &str, minutes: i64| {
            format!(
                "<urn:trustgraph:agent:{session}/cancellation> a tg:Cancellation ;
                   tg:cancelledBy \"ops\" ; prov:atTime {} .\n",
                at(minutes)
            )
        };
        let data = [
            parked("expired", -20, -10),
            parked("waiting", -1, 60),
            parked("cancelled", -1, 60),
            cancel("cancelled", 0),
            parked("sup-f1-s0", -1, 60),
            cancel("sup", 0),
            // The session id used again a day after its cancel.
            parked("reused", -1, 60),
            cancel("reused", -24 * 60),
            // Cancelled just before the step that parked the call heard of it.
            parked("raced", 0, 60),
            cancel("raced", -1),
            // Used again after a cancel a day old, and cancelled again now: the latest counts.
            cancel("twice", -24 * 60),
            parked("twice", -1, 60),
            cancel("twice", 0),
        ]
        .concat();
        let store = GraphStore::in_memory().unwrap();
        store
            .update(format!(
                "{}PREFIX xsd: <http://www.w3.org/2001/XMLSchema#>
                 INSERT DATA {{ GRAPH <urn:graph:retrieval> {{ {data} }} }}",
                agent_core::vocab::SPARQL_PREFIXES
            ))
            .await
            .unwrap();
        agent_graph::waiting::mark_unmarked(&store).await.unwrap();
        let mut due: Vec<(String, &str)> = due_calls(&store, now)
            .await
            .unwrap()
            .into_iter()
            .map(|call| (call.session, call.reason))
            .collect();
        due.sort();
        assert_eq!(
            due,
            [
                ("cancelled".to_owned(), RUN_CANCELLED),
                ("expired".to_owned(), PAST_DEADLINE),
                ("raced".to_owned(), RUN_CANCELLED),
                ("sup-f1-s0".to_owned(), RUN_CANCELLED),
                ("twice".to_owned(), RUN_CANCELLED),
            ]
        );
    }

    #[test]
    fn a_cancel_of_any_supervisor_above_a_call_reaches_it() {
        assert_eq!(
            session_and_supervisors("abc-f2-s0-f4-s11"),
            ["abc-f2-s0-f4-s11", "abc-f2-s0", "abc"]
        );
        assert_eq!(session_and_supervisors("abc"), ["abc"]);
    }
}
