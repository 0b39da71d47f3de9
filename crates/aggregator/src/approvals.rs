//! The approvals sweep: a tool call parked for a person's approval whose deadline passed without an
//! answer gets an `expire` answer, so its dialog ends (a subagent's with a completion its
//! supervisor synthesises around) instead of waiting forever; so does the call of a run cancelled
//! while it waited, which then ends as cancelled. The orchestrator that takes the answer up
//! decides; if a person's answer came first, the expiry changes nothing.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use agent_bus::Publisher;
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore};
use agent_schema::{control_operation, AgentControl};
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
        let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let due = match due_calls(&store, &now).await {
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
                at: now.clone(),
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

/// A parked call the sweep answers `expire`, and why.
#[derive(Debug, PartialEq, Eq)]
struct Due {
    /// The approval node.
    node: String,
    session: String,
    step: u64,
    reason: &'static str,
}

/// The unanswered parked calls in `rows` (`?a ?step`, as the approval queries give them).
fn parked_calls(rows: &agent_graph::Rows, reason: &'static str) -> Vec<Due> {
    let steps = rows.column("step");
    rows.column("a")
        .into_iter()
        .zip(steps)
        .filter_map(|(node, step)| {
            let (Some(Term::NamedNode(node)), Some(Term::Literal(step))) = (node, step) else {
                return None;
            };
            Some(Due {
                session: agent_core::vocab::session_id_of(node.as_str())?.to_owned(),
                step: step.value().parse().ok()?,
                node: node.as_str().to_owned(),
                reason,
            })
        })
        .collect()
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
/// wait for its closing until the deadline (minutes, or days as configured).
async fn due_calls(store: &GraphStore, now: &str) -> Result<Vec<Due>, agent_graph::GraphError> {
    let waiting = parked_calls(
        &store.query(queries::unanswered_approvals()).await?.rows(),
        RUN_CANCELLED,
    );
    if waiting.is_empty() {
        return Ok(Vec::new());
    }
    let mut due = parked_calls(
        &store.query(queries::expired_approvals(now)).await?.rows(),
        PAST_DEADLINE,
    );
    let expired: HashSet<&str> = due.iter().map(|call| call.node.as_str()).collect();
    let undue: Vec<Due> = waiting
        .into_iter()
        .filter(|call| !expired.contains(call.node.as_str()))
        .collect();
    let mut asked: Vec<String> = undue
        .iter()
        .flat_map(|call| session_and_supervisors(&call.session))
        .map(|session| agent_core::provenance::SessionUris::new(session).cancellation())
        .collect();
    asked.sort_unstable();
    asked.dedup();
    let mut cancelled = HashSet::new();
    for page in asked.chunks(CANCELS_A_QUERY) {
        let nodes: Vec<_> = page
            .iter()
            .filter_map(|node| agent_graph::model::NamedNode::new(node).ok())
            .collect();
        let rows = store.query(queries::cancellations_at(&nodes)).await?.rows();
        cancelled.extend(rows.column("c").into_iter().filter_map(|c| match c {
            Some(Term::NamedNode(c)) => Some(c.as_str().to_owned()),
            _ => None,
        }));
    }
    due.extend(undue.into_iter().filter(|call| {
        session_and_supervisors(&call.session)
            .into_iter()
            .any(|session| {
                cancelled
                    .contains(&agent_core::provenance::SessionUris::new(session).cancellation())
            })
    }));
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

    #[test]
    fn a_cancel_of_any_supervisor_above_a_call_reaches_it() {
        assert_eq!(
            session_and_supervisors("abc-f2-s0-f4-s11"),
            ["abc-f2-s0-f4-s11", "abc-f2-s0", "abc"]
        );
        assert_eq!(session_and_supervisors("abc"), ["abc"]);
    }
}
