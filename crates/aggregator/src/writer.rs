//! Turns explainability messages into graph writes. Every message is written in one transaction and
//! acked only after it committed; RDF set semantics make a redelivered message change nothing.

use agent_bus::{Delivery, Disposition};
use agent_graph::convert::to_quads;
use agent_graph::GraphStore;
use agent_schema::Triples;

/// The consumer's handler. New event kinds (fan-in completions, sweeps) hook in at [`Writer::handle`]
/// after the write, where the graph already holds the event.
pub struct Writer {
    store: GraphStore,
}

impl Writer {
    pub fn new(store: GraphStore) -> Writer {
        Writer { store }
    }

    pub async fn handle(&self, delivery: Delivery<Triples>) -> Disposition {
        let message = delivery.payload;
        let quads = match to_quads(&message.triples) {
            Ok(q) => q,
            // Not valid RDF: it will never be writable.
            Err(e) => {
                return Disposition::DeadLetter(format!(
                    "triples of {} are not valid RDF: {e}",
                    message.metadata.id
                ))
            }
        };
        if quads.is_empty() {
            return Disposition::Ack;
        }
        let count = quads.len();
        match self.store.insert(quads).await {
            Ok(()) => {
                tracing::debug!(id = %message.metadata.id, quads = count, "written");
                Disposition::Ack
            }
            Err(e) if e.retryable() => Disposition::Nack(e.to_string()),
            Err(e) => Disposition::DeadLetter(e.to_string()),
        }
    }
}
