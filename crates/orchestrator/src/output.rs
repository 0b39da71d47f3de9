//! Everything an iteration publishes: responses to the client, the `next` request, provenance.
//! Sends are pipelined; [`DialogOutput::flush`] waits for every receipt, and only then may the
//! iteration's input be acked.

use std::sync::Mutex;

use agent_bus::{BusError, Properties, Publisher, Receipt};
use agent_core::provenance::GRAPH;
use agent_schema::{
    AgentRequest, AgentResponse, MessageType, Metadata, Triple, Triples, ID_PROPERTY,
};

pub use agent_schema::{IN_TOKEN_PROPERTY, OUT_TOKEN_PROPERTY, STARTED_PROPERTY};

/// The three publishers of the orchestrator.
#[derive(Clone)]
pub struct Outputs {
    pub responses: Publisher,
    pub requests: Publisher,
    pub explainability: Publisher,
}

/// The outputs bound to one dialog: its `id` property and collection.
pub struct DialogOutput<'a> {
    outputs: &'a Outputs,
    properties: Properties,
    collection: String,
    root: String,
    started_ms: u64,
    pending: Mutex<Vec<Receipt>>,
}

impl<'a> DialogOutput<'a> {
    pub fn new(
        outputs: &'a Outputs,
        id: Option<&str>,
        collection: &str,
        root: &str,
        started_ms: u64,
    ) -> Self {
        let mut properties = Properties::new();
        if let Some(id) = id {
            properties.insert(ID_PROPERTY.to_owned(), id.to_owned());
        }
        DialogOutput {
            outputs,
            properties,
            collection: collection.to_owned(),
            root: root.to_owned(),
            started_ms,
            pending: Mutex::new(Vec::new()),
        }
    }

    async fn send(
        &self,
        to: &Publisher,
        payload: Vec<u8>,
        properties: &Properties,
    ) -> Result<(), BusError> {
        let receipt = to.enqueue(payload, properties).await?;
        if let Ok(mut pending) = self.pending.lock() {
            pending.push(receipt);
        }
        Ok(())
    }

    /// Waits until the broker has every message sent so far.
    pub async fn flush(&self) -> Result<(), BusError> {
        let receipts = match self.pending.lock() {
            Ok(mut pending) => std::mem::take(&mut *pending),
            Err(_) => Vec::new(),
        };
        for receipt in receipts {
            receipt.wait().await?;
        }
        Ok(())
    }

    pub async fn respond(&self, response: &AgentResponse) -> Result<(), BusError> {
        self.send(
            &self.outputs.responses,
            agent_schema::encode(response),
            &self.properties,
        )
        .await
    }

    /// Sends a chunk of a message.
    pub async fn chunk(
        &self,
        kind: MessageType,
        content: &str,
        message_id: &str,
        end_of_message: bool,
    ) -> Result<(), BusError> {
        let mut r = AgentResponse::new(kind, content);
        r.message_id = message_id.to_owned();
        r.end_of_message = end_of_message;
        self.respond(&r).await
    }

    /// Records provenance about `node`: inline to the client as an `explain` response, and on the
    /// explainability topic for the graph store, as TrustGraph does.
    pub async fn explain(&self, node: &str, triples: Vec<Triple>) -> Result<(), BusError> {
        let message = Triples {
            metadata: Metadata {
                id: node.to_owned(),
                root: self.root.clone(),
                collection: self.collection.clone(),
            },
            triples,
        };
        // The graph copy is enqueued before the client's, so a client that saw a node can find it.
        self.send(
            &self.outputs.explainability,
            agent_schema::encode(&message),
            &Properties::new(),
        )
        .await?;
        let mut r = AgentResponse::new(MessageType::Explain, "");
        r.explain_id = Some(node.to_owned());
        r.explain_graph = Some(GRAPH.to_owned());
        r.explain_triples = message.triples;
        self.respond(&r).await
    }

    /// Starts a subagent's dialog under the caller's `id`, so its messages reach the same client.
    pub async fn spawn(&self, request: &AgentRequest) -> Result<(), BusError> {
        self.send(
            &self.outputs.requests,
            agent_schema::encode(request),
            &self.properties,
        )
        .await
    }

    /// When the dialog's first message was taken up (Unix milliseconds).
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// The caller's `id`, which a fan-out records so its synthesis reaches the same client.
    pub fn client_id(&self) -> &str {
        self.properties
            .get(ID_PROPERTY)
            .map(String::as_str)
            .unwrap_or_default()
    }

    /// Queues the next iteration of this dialog, carrying the tokens used so far, when it started,
    /// and any `extra` properties.
    pub async fn next(
        &self,
        request: &AgentRequest,
        tokens: (u64, u64),
        extra: &[(&str, &str)],
    ) -> Result<(), BusError> {
        let mut properties = self.properties.clone();
        for (key, value) in extra {
            properties.insert((*key).to_owned(), (*value).to_owned());
        }
        properties.insert(IN_TOKEN_PROPERTY.to_owned(), tokens.0.to_string());
        properties.insert(OUT_TOKEN_PROPERTY.to_owned(), tokens.1.to_string());
        properties.insert(STARTED_PROPERTY.to_owned(), self.started_ms.to_string());
        self.send(
            &self.outputs.requests,
            agent_schema::encode(request),
            &properties,
        )
        .await
    }
}
