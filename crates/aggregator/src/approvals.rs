//! The approvals sweep: a tool call parked for a person's approval whose deadline passed without an
//! answer gets an `expire` answer, so its dialog ends (a subagent's with a completion its
//! supervisor synthesises around) instead of waiting forever. The orchestrator that takes the
//! answer up decides; if a person's answer came first, the expiry changes nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use agent_bus::Publisher;
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore, QueryAnswer};
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
    // Only calls the query still returns are remembered, so this holds no more than the query
    // gives: the calls past their deadline and unanswered.
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
        let rows = match store.query(queries::expired_approvals(&now)).await {
            Ok(QueryAnswer::Rows(rows)) => rows,
            Ok(_) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "the approvals sweep could not query the graph");
                continue;
            }
        };
        let returned: std::collections::HashSet<&str> = rows
            .column("a")
            .into_iter()
            .filter_map(|node| match node {
                Some(Term::NamedNode(node)) => Some(node.as_str()),
                _ => None,
            })
            .collect();
        sent.retain(|node, _| returned.contains(node.as_str()));
        for (node, step) in rows.column("a").into_iter().zip(rows.column("step")) {
            let (Some(Term::NamedNode(node)), Some(Term::Literal(step))) = (node, step) else {
                continue;
            };
            let (Some(session), Ok(step)) = (
                agent_core::vocab::session_id_of(node.as_str()),
                step.value().parse::<u64>(),
            ) else {
                continue;
            };
            if let Some(sent) = sent.get(node.as_str()) {
                if sent.last.elapsed() < gap_after(sent.count) {
                    continue;
                }
            }
            let expiry = AgentControl {
                operation: control_operation::EXPIRE.to_owned(),
                session_id: session.to_owned(),
                by: "agent-aggregator".to_owned(),
                reason: "no answer before the deadline".to_owned(),
                at: now.clone(),
                step: Some(step),
                arguments: None,
            };
            let (payload, properties) = agent_bus::sealed_control(&expiry, seal.as_ref());
            match answers.send(payload, &properties).await {
                Ok(()) => {
                    let sent = sent.entry(node.as_str().to_owned()).or_insert(Sent {
                        count: 0,
                        last: Instant::now(),
                    });
                    sent.count += 1;
                    sent.last = Instant::now();
                    if sent.count == 1 {
                        tracing::info!(session, step, "a call parked for approval expired");
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
}
