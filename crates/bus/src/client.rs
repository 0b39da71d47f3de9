//! The client side of the agent service: publish requests, read the response stream. Also the
//! reading half every client shares: a private Exclusive subscription from the latest message,
//! read one acked message at a time.

use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition, Message};
use pulsar::{Consumer, SubType, TokioExecutor};

use std::collections::{HashSet, VecDeque};

use agent_schema::{AgentRequest, AgentResponse, EFFECT_ID_PROPERTY, ID_PROPERTY};

use crate::{Bus, BusError, Properties, Publisher, Topics};

/// A subscription of this client alone (named `{prefix}-{random}`) that sees what is published
/// from now on.
pub struct Listener {
    topic: String,
    consumer: Consumer<Vec<u8>, TokioExecutor>,
}

impl Listener {
    pub async fn subscribe(bus: &Bus, topic: &str, prefix: &str) -> Result<Listener, BusError> {
        // Just after a broker (re)starts it refuses subscriptions for a moment while it loads the
        // topic's namespace and its storage: a client tries again before it reports the refusal.
        let consumer = crate::error::until_settled(topic, || {
            bus.client()
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
        })
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
    /// The next message's payload, already acked.
    pub async fn next_payload(&mut self) -> Result<Vec<u8>, BusError> {
        Ok(self.next().await?.payload.data)
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
pub fn message_property<'m>(message: &'m Message<Vec<u8>>, key: &str) -> Option<&'m str> {
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
    seen: SeenEffects,
}

/// The effect ids of the latest responses, to drop a copy that an orchestrator re-emitted after a
/// crash between publishing an iteration's outcome and marking it published.
#[derive(Default)]
struct SeenEffects {
    ids: HashSet<String>,
    order: VecDeque<String>,
    copies: u64,
}

impl SeenEffects {
    /// Re-emission follows the original within a redelivery, so a window this long is plenty.
    const WINDOW: usize = 65_536;

    /// Whether `id` is new; remembers it.
    fn first_time(&mut self, id: &str) -> bool {
        if self.ids.contains(id) {
            self.copies += 1;
            return false;
        }
        if self.order.len() >= Self::WINDOW {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        self.ids.insert(id.to_owned());
        self.order.push_back(id.to_owned());
        true
    }
}

impl AgentClient {
    /// Subscribes to the responses first, so nothing published after this returns is missed.
    pub async fn connect(bus: &Bus, topics: &Topics) -> Result<AgentClient, BusError> {
        let responses = Listener::subscribe(bus, &topics.response, "agent-client").await?;
        let requests = Publisher::new(bus, &topics.request).await?;
        Ok(AgentClient {
            requests,
            responses,
            seen: SeenEffects::default(),
        })
    }

    /// Publishes `request` with the correlation `id`.
    pub async fn send(&self, id: &str, request: &AgentRequest) -> Result<(), BusError> {
        self.send_raw(id, agent_schema::encode(request)).await
    }

    /// Publishes a request with the correlation `id` and our own `extra` properties (a fork's
    /// origin, a replay's reuse), which a TrustGraph service ignores.
    pub async fn send_with(
        &self,
        id: &str,
        request: &AgentRequest,
        extra: &Properties,
    ) -> Result<(), BusError> {
        self.send_with_payload(id, agent_schema::encode(request), extra)
            .await
    }

    /// Publishes any payload with the correlation `id` (used to test hostile input).
    pub async fn send_raw(&self, id: &str, payload: Vec<u8>) -> Result<(), BusError> {
        self.send_with_payload(id, payload, &Properties::new())
            .await
    }

    async fn send_with_payload(
        &self,
        id: &str,
        payload: Vec<u8>,
        extra: &Properties,
    ) -> Result<(), BusError> {
        let mut properties = extra.clone();
        properties.insert(ID_PROPERTY.to_owned(), id.to_owned());
        self.requests.send(payload, &properties).await
    }

    /// Re-emitted copies of responses this client had already received, which it dropped.
    pub fn copies_dropped(&self) -> u64 {
        self.seen.copies
    }

    /// The next response of any dialog, with its `id`; responses that do not decode, and copies of
    /// responses already received, are skipped.
    pub async fn next(&mut self) -> Result<(String, AgentResponse), BusError> {
        loop {
            let message = self.responses.next().await?;
            if let Some(effect) = message_property(&message, EFFECT_ID_PROPERTY) {
                if !self.seen.first_time(effect) {
                    tracing::debug!(effect, "dropping a re-emitted copy of a response");
                    continue;
                }
            }
            let id = message_property(&message, ID_PROPERTY)
                .unwrap_or_default()
                .to_owned();
            match agent_schema::decode::<AgentResponse>(&message.payload.data) {
                Ok(r) => return Ok((id, r)),
                Err(e) => tracing::warn!(error = %e, "skipping a response that does not decode"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SeenEffects;

    #[test]
    fn a_re_emitted_effect_is_dropped_once_seen() {
        let mut seen = SeenEffects::default();
        assert!(seen.first_time("s/journal/a#0"));
        assert!(seen.first_time("s/journal/a#1"));
        assert!(!seen.first_time("s/journal/a#0"));
        assert_eq!(seen.copies, 1);
    }

    #[test]
    fn the_window_forgets_the_oldest() {
        let mut seen = SeenEffects::default();
        for i in 0..=SeenEffects::WINDOW {
            assert!(seen.first_time(&i.to_string()));
        }
        assert_eq!(seen.ids.len(), SeenEffects::WINDOW);
        assert!(seen.first_time("0"));
    }
}
