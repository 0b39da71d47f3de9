//! The client side of the agent service: publish requests, read the response stream.

use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition};
use pulsar::{Consumer, SubType, TokioExecutor};

use agent_schema::{AgentRequest, AgentResponse, ID_PROPERTY};

use crate::{Bus, BusError, Properties, Publisher, Topics};

/// Sends requests and receives every response on the response topic, tagged with its `id`.
pub struct AgentClient {
    requests: Publisher,
    responses: Consumer<Vec<u8>, TokioExecutor>,
}

impl AgentClient {
    /// Subscribes to the responses first, so nothing published after this returns is missed.
    pub async fn connect(bus: &Bus, topics: &Topics) -> Result<AgentClient, BusError> {
        let subscription = format!("agent-client-{:016x}", rand::random::<u64>());
        let responses = bus
            .client()
            .consumer()
            .with_topic(&topics.response)
            .with_subscription(&subscription)
            .with_subscription_type(SubType::Exclusive)
            .with_consumer_id(rand::random::<u64>() >> 1)
            .with_options(ConsumerOptions {
                initial_position: InitialPosition::Latest,
                ..ConsumerOptions::default()
            })
            .build()
            .await
            .map_err(|e| BusError::Subscribe {
                topic: topics.response.clone(),
                message: e.to_string(),
            })?;
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
            let message = match self.responses.next().await {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    return Err(BusError::ConsumerStopped {
                        topic: "responses".into(),
                        message: e.to_string(),
                    })
                }
                None => {
                    return Err(BusError::ConsumerStopped {
                        topic: "responses".into(),
                        message: "stream ended".into(),
                    })
                }
            };
            let _ = self.responses.ack(&message).await;
            let id = message
                .payload
                .metadata
                .properties
                .iter()
                .find(|kv| kv.key == ID_PROPERTY)
                .map(|kv| kv.value.clone())
                .unwrap_or_default();
            match agent_schema::decode::<AgentResponse>(&message.payload.data) {
                Ok(r) => return Ok((id, r)),
                Err(e) => tracing::warn!(error = %e, "skipping a response that does not decode"),
            }
        }
    }
}
