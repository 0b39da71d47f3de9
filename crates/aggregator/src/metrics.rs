//! The aggregator's Prometheus metrics: supervisor fan-outs still open, how long fan-ins took, the
//! explainability consumer's message fates, the journal's records, and the SPARQL queries it
//! refused or stopped.

use std::time::Duration;

use agent_bus::ConsumerStats;
use agent_graph::{GraphStore, QueryAnswer};
use agent_metrics::{global, Kind};

pub const FANOUTS_OPEN: &str = "agent_fanouts_open";
pub const FANIN_LATENCY: &str = "agent_fanin_duration_seconds";
pub const MESSAGES: &str = "agent_explain_messages_total";
pub const QUERIES_REFUSED: &str = "agent_sparql_queries_refused_total";
pub const JOURNAL_RECORDS: &str = "agent_journal_records_total";

pub fn describe() {
    let registry = global();
    registry.describe(FANOUTS_OPEN, Kind::Gauge, "Supervisor fan-outs recorded in the graph store and not yet synthesised (all aggregators).");
    registry.describe(FANIN_LATENCY, Kind::Histogram, "From a fan-out being recorded to its synthesis being requested, by outcome (complete, timed_out).");
    registry.describe(MESSAGES, Kind::Counter, "Explainability messages by fate: received, acked, nacked (to be redelivered), again (delivered again while in hand or just handled: not handled again), dead-lettered (with the triples that are valid RDF written, but for a fan-out or a completion).");
    registry.describe(JOURNAL_RECORDS, Kind::Counter, "Records of step outcomes this aggregator decided, by result: recorded (the first for its step), stood (another record of the step stood, and was answered).");
    registry.describe(QUERIES_REFUSED, Kind::Counter, "SPARQL queries and updates refused or stopped, by reason: busy (no turn free), timeout (stopped at the time limit), too_large (result over the row limit, or work over the budget of bindings), update_timeout (an update stopped at the time limit; it wrote nothing).");
}

/// A query `/query` refused or stopped.
pub fn query_refused(reason: &'static str) {
    global().inc(QUERIES_REFUSED, &[("reason", reason)]);
}

/// A record of a step's outcome, decided: whether it was the first.
pub fn journal_record(first: bool) {
    let result = if first { "recorded" } else { "stood" };
    global().inc(JOURNAL_RECORDS, &[("result", result)]);
}

/// A fan-in this aggregator finished.
pub fn fan_in(timed_out: bool, took: Duration) {
    let outcome = if timed_out { "timed_out" } else { "complete" };
    global().observe(FANIN_LATENCY, &[("outcome", outcome)], took);
}

/// Brings the scrape-time values up to date: the open fan-outs are read from the store (the truth
/// every aggregator shares), the message counts from the consumer.
///
/// The count of open fan-outs reads every fan-out the store holds, and `/metrics` is open to
/// anyone: it is read at most once a second (`counted`: when it last was), however often scrapes
/// come, one at a time, the turn kept until the count ends even if the scrape's client has gone;
/// a scrape in between reports the last count.
pub async fn refresh(
    store: &GraphStore,
    stats: &ConsumerStats,
    counted: &std::sync::Arc<tokio::sync::Mutex<Option<std::time::Instant>>>,
) {
    if let Ok(mut last) = counted.clone().try_lock_owned() {
        if last.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
            *last = Some(std::time::Instant::now());
            let store = store.clone();
            let count = tokio::spawn(async move {
                let _one_at_a_time = last;
                let open_fanouts = store.query(agent_graph::queries::open_fanouts()).await;
                if let Ok(QueryAnswer::Rows(rows)) = open_fanouts {
                    let open = match rows.first("n") {
                        Some(agent_graph::model::Term::Literal(n)) => {
                            n.value().parse::<f64>().unwrap_or(0.0)
                        }
                        _ => 0.0,
                    };
                    global().set(FANOUTS_OPEN, &[], open);
                }
            });
            let _counted = count.await;
        }
    }
    stats.report(MESSAGES);
}
