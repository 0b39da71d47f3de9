//! Turns explainability messages into graph writes. Every message is written in one transaction and
//! acked only after it committed; RDF set semantics make a redelivered message change nothing.

use agent_bus::{Delivery, Disposition, Publisher};
use agent_graph::convert::into_quads;
use agent_graph::GraphStore;
use agent_schema::Triples;

/// The consumer's handler. Fan-in runs after the write, when the graph already holds the event.
pub struct Writer {
    store: GraphStore,
    /// Where synthesis requests go (the agent request topic); `None` writes only.
    requests: Option<Publisher>,
    /// Only fan-outs and completions sealed with it drive fan-in, when there is one.
    seal: Option<agent_bus::seal::SealKey>,
    /// Where long subagent results are kept, when the deployment keeps documents in TrustGraph's
    /// librarian.
    librarian: Option<std::sync::Arc<agent_bus::Librarian>>,
}

impl Writer {
    pub fn new(
        store: GraphStore,
        requests: Option<Publisher>,
        seal: Option<agent_bus::seal::SealKey>,
        librarian: Option<std::sync::Arc<agent_bus::Librarian>>,
    ) -> Writer {
        Writer {
            store,
            requests,
            seal,
            librarian,
        }
    }

    pub async fn handle(&self, delivery: Delivery<Triples>) -> Disposition {
        use tracing::Instrument;
        // In the trace of the step that explained itself, so a dialog's trace shows its writes and
        // its fan-in next to its iterations.
        let traceparent = delivery
            .properties
            .get(agent_telemetry::trace::TRACEPARENT_PROPERTY)
            .cloned()
            .unwrap_or_default();
        let span = tracing::info_span!(
            "explain",
            node = %delivery.payload.metadata.id,
            traceparent = traceparent.as_str(),
        );
        self.write(delivery).instrument(span).await
    }

    async fn write(&self, delivery: Delivery<Triples>) -> Disposition {
        let message = delivery.payload;
        // Read before the triples are converted, which moves their text into the quads.
        let correlation = crate::fanin::correlation_of(&message);
        let Triples { metadata, triples } = message;
        let quads = match into_quads(triples) {
            Ok(q) => q,
            // Not valid RDF: it will never be writable.
            Err(e) => {
                return Disposition::DeadLetter(format!(
                    "triples of {} are not valid RDF: {e}",
                    metadata.id
                ))
            }
        };
        if quads.is_empty() {
            return Disposition::Ack;
        }
        let count = quads.len();
        match self.store.insert(quads).await {
            Ok(()) => {
                tracing::debug!(id = %metadata.id, quads = count, "written");
                self.fan_in(correlation).await
            }
            Err(e) if e.retryable() => Disposition::Nack(e.to_string()),
            Err(e) => Disposition::DeadLetter(e.to_string()),
        }
    }

    /// After a completion or fan-out (whose correlation id is `correlation`) was written: the
    /// fan-in check. A failure is retried by redelivery; the write before it and the claim are
    /// idempotent for the same message.
    async fn fan_in(&self, correlation: Option<String>) -> Disposition {
        let (Some(requests), Some(cid)) = (&self.requests, correlation) else {
            return Disposition::Ack;
        };
        let librarian = self.librarian.as_deref();
        let seal = self.seal.as_ref();
        match crate::fanin::check(&self.store, requests, seal, librarian, &cid, None).await {
            Ok(()) => Disposition::Ack,
            Err(e) => Disposition::Nack(format!("fan-in of {cid}: {e}")),
        }
    }
}
