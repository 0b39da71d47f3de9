//! Keeps the effectively-once journal bounded: published entries of concluded dialogs are deleted
//! once they are older than the retention (a redelivery of their message is then run again
//! rather than dropped, which after a day is not a redelivery anyone waits for), and every entry
//! after seven retentions, whatever became of its dialog and whether or not it was marked
//! published (a step's mark follows its ack and is lost if its process stops between the two).
//! One aggregator owns the store; several
//! pruning at once delete the same entries, which is harmless.

use std::time::Duration;

use agent_graph::{journal, GraphStore};
use tokio_util::sync::CancellationToken;

/// Entries deleted by one update (an entry's outcome is a few kilobytes, compressed).
const PAGE: usize = 500;

/// Prunes every half retention (at least every second, at most every five minutes) until
/// `shutdown`. A failed prune is logged and tried at the next turn.
pub async fn prune(store: GraphStore, retention: Duration, shutdown: CancellationToken) {
    let every = (retention / 2).clamp(Duration::from_secs(1), Duration::from_secs(300));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let now = chrono::Utc::now();
        let cut = |age: Duration| {
            let age = chrono::Duration::from_std(age).unwrap_or(chrono::Duration::MAX);
            now.checked_sub_signed(age)
                .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC)
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        };
        let (finished_before, any_before) = (cut(retention), cut(retention * 7));
        let pruning = journal::prune(&store, &finished_before, &any_before, PAGE);
        // Dropped at a stop, a prune leaves whole entries: each page's update is one transaction
        // (one under way may still commit).
        let pruned = tokio::select! {
            _ = shutdown.cancelled() => return,
            pruned = pruning => pruned,
        };
        match pruned {
            Ok(0) => {}
            Ok(pruned) => tracing::debug!(pruned, "journal entries pruned"),
            Err(e) => tracing::warn!(error = %e, "pruning the journal failed; trying again later"),
        }
    }
}
