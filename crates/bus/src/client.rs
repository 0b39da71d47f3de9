//! The client side of the agent service: publish requests, read the response stream. Also the
//! reading half every client shares: a private Exclusive subscription from the latest message,
//! read one acked message at a time.

use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition, Message};
use pulsar::{Consumer, SubType, TokioExecutor};

use agent_schema::{AgentRequest, AgentResponse, ID_PROPERTY};

use crate::{Bus, BusError, Properties, Publisher, Topics};

/// A subscription of this client alone (named `{prefix}-{random}`) that sees what is published
/// from now on.
pub(crate) struct Listener {
    topic: String,
    consumer: Consumer<Vec<u8>, TokioExecutor>,
}

impl Listener {
    pub(crate) async fn subscribe(
        bus: &Bus,
        topic: &str,
        prefix: &str,
    ) -> Result<Listener, BusError> {
        let consumer = bus
            .client()
            .consumer()
            .with_topic(topic)
            .with_subscription(format!("{prefix}-{:016x}", rand::random::<u64>()))
            .with_subscription_type(SubType::Exclusive)
            .with_consumer_id(rand::random::<u64>() >> 1)
            .with_options(ConsumerOptions {
                initial_position: InitialPosition::Latest,
                ..ConsumerOptions::default()
            })
            .build()
            .await
            .map_err(|e| BusError::Subscribe {
                topic: topic.to_owned(),
                message: e.to_string(),
            })?;
        Ok(Listener {
            topic: topic.to_owned(),
            consumer,
        })
    }

    /// The next message, already acked (a listener never wants one again).
    pub(crate) async fn next(&mut self) -> Result<Message<Vec<u8>>, BusError> {
        let stopped = |message: String| BusError::ConsumerStopped {
            topic: self.topic.clone(),
            message,
        };
        let message = match self.consumer.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => return Err(stopped(e.to_string())),
            None => return Err(stopped("the stream ended".into())),
        };
        let _ = self.consumer.ack(&message).await;
        Ok(message)
    }
}

/// The value of a message property.
pub(crate) fn property<'m>(message: &'m Message<Vec<u8>>, key: &str) -> Option<&'m str> {
    message
        .payload
        .metadata
        .properties
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| kv.value.as_str())
}

/// Sends requests and receives every response on the response topic, tagged with its `id`.
pub struct AgentClient {
    requests: Publisher,
    responses: Listener,
}

impl AgentClient {
    /// Subscribes to the responses first, so nothing published after this returns is missed.
    pub async fn connect(bus: &Bus, topics: &Topics) -> Result<AgentClient, BusError> {
        let responses = Listener::subscribe(bus, &topics.response, "agent-client").await?;
        let requests = Publisher::new(bus, &topics.request).await?;
        Ok(AgentClient {
            requests,
            responses,
        })
    }

    /// Publishes `request` with the correlation `id`.
    pub async fn send(&self, id: &str, request: &AgentRequest) -> Result<(), BusError> {
        self.send_raw(id, agent_schema::encode(request)).await
    }

    /// Publishes any payload with the correlation `id` (used to test hostile input).
    pub async fn send_raw(&self, id: &str, payload: Vec<u8>) -> Result<(), BusError> {
        let mut properties = Properties::new();
        properties.insert(ID_PROPERTY.to_owned(), id.to_owned());
        self.requests.send(payload, &properties).await
    }

    /// The next response of any dialog, with its `id`; responses that do not decode are skipped.
    pub async fn next(&mut self) -> Result<(String, AgentResponse), BusError> {
        loop {
            let message = self.responses.next().await?;
            let id = property(&message, ID_PROPERTY)
                .unwrap_or_default()
                .to_owned();
            match agent_schema::decode::<AgentResponse>(&message.payload.data) {
                Ok(r) => return Ok((id, r)),
                Err(e) => tracing::warn!(error = %e, "skipping a response that does not decode"),
            }
        }
    }
}
