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

/// Every `every`, sends an expiry for each parked call past its deadline.
pub async fn sweep(
    store: GraphStore,
    answers: Publisher,
    every: Duration,
    shutdown: CancellationToken,
) {
    let mut sent: HashMap<String, Instant> = HashMap::new();
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
        sent.retain(|_, at| at.elapsed() < RESEND_AFTER);
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
            if sent.contains_key(node.as_str()) {
                continue;
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
                    tracing::info!(session, step, "a call parked for approval expired");
                    sent.insert(node.as_str().to_owned(), Instant::now());
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the approvals sweep could not send an expiry")
                }
            }
        }
    }
}
