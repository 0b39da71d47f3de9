//! The approvals sweep: a tool call parked for a person's approval whose deadline passed without an
//! answer gets an `expire` answer, so its dialog ends (a subagent's with a completion its
//! supervisor synthesises around) instead of waiting forever. The orchestrator that takes the
//! answer up decides; if a person's answer came first, the expiry changes nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use agent_bus::{Properties, Publisher};
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore, QueryAnswer};
use agent_schema::{control_operation, AgentControl};
use tokio_util::sync::CancellationToken;

/// How long the sweep waits before it sends an expiry again for the same call (its answer may be
/// on its way to the graph, or the orchestrators down).
const RESEND_AFTER: Duration = Duration::from_secs(60);

/// Expiries sent for one call before the sweep leaves it: an orchestrator that takes an answer up
/// records it whatever becomes of the step, so a call still unanswered after these is one no
/// orchestrator can resume (its continuation sealed with another key, or unreadable), and sending
/// more would only load the orchestrators for ever.
const MOST_EXPIRIES: u32 = 5;

/// Expiries sent for one call, and when the last went.
struct Sent {
    count: u32,
    last: Instant,
}

/// Every `every`, sends an expiry for each parked call past its deadline.
pub async fn sweep(
    store: GraphStore,
    answers: Publisher,
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
                if sent.count >= MOST_EXPIRIES || sent.last.elapsed() < RESEND_AFTER {
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
            match answers
                .send(agent_schema::encode(&expiry), &Properties::new())
                .await
            {
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
                        tracing::warn!(session, step, expiries = sent.count, "no orchestrator took up the expiry of a call parked for approval; the sweep leaves it (its continuation may be sealed with another key)");
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
