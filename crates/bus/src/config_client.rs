//! The client side of the config protocol: requests answered on the response topic, matched by the
//! `id` property, and a subscription to the change pushes.

use std::time::Duration;

use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition};
use pulsar::{Consumer, SubType, TokioExecutor};

use agent_schema::{ConfigPush, ConfigRequest, ConfigResponse, ID_PROPERTY};

use crate::{Bus, BusError, Properties, Publisher, Topics};

fn exclusive_latest(
    bus: &Bus,
    topic: &str,
    prefix: &str,
) -> impl std::future::Future<Output = Result<Consumer<Vec<u8>, TokioExecutor>, BusError>> {
    let builder = bus
        .client()
        .consumer()
        .with_topic(topic)
        .with_subscription(format!("{prefix}-{:016x}", rand::random::<u64>()))
        .with_subscription_type(SubType::Exclusive)
        .with_consumer_id(rand::random::<u64>() >> 1)
        .with_options(ConsumerOptions {
            initial_position: InitialPosition::Latest,
            ..ConsumerOptions::default()
        });
    let topic = topic.to_owned();
    async move {
        builder.build().await.map_err(|e| BusError::Subscribe {
            topic,
            message: e.to_string(),
        })
    }
}

/// Asks the config service; one request at a time.
pub struct ConfigClient {
    requests: Publisher,
    responses: Consumer<Vec<u8>, TokioExecutor>,
}

impl ConfigClient {
    pub async fn connect(bus: &Bus, topics: &Topics) -> Result<ConfigClient, BusError> {
        let responses = exclusive_latest(bus, &topics.config_response, "config-client").await?;
        let requests = Publisher::new(bus, &topics.config_request).await?;
        Ok(ConfigClient {
            requests,
            responses,
        })
    }

    /// Sends `request` and waits up to `timeout` for its response (others' responses are skipped).
    pub async fn call(
        &mut self,
        request: &ConfigRequest,
        timeout: Duration,
    ) -> Result<ConfigResponse, BusError> {
        let id = format!("{:032x}", rand::random::<u128>());
        let mut properties = Properties::new();
        properties.insert(ID_PROPERTY.to_owned(), id.clone());
        self.requests
            .send(agent_schema::encode(request), &properties)
            .await?;
        let wait = async {
            loop {
                let message = match self.responses.next().await {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => return Err(stopped(e.to_string())),
                    None => return Err(stopped("stream ended".into())),
                };
                let _ = self.responses.ack(&message).await;
                let matches = message
                    .payload
                    .metadata
                    .properties
                    .iter()
                    .any(|kv| kv.key == ID_PROPERTY && kv.value == id);
                if !matches {
                    continue;
                }
                return agent_schema::decode::<ConfigResponse>(&message.payload.data).map_err(
                    |e| BusError::ConsumerStopped {
                        topic: "config responses".into(),
                        message: format!("a response that does not decode: {e}"),
                    },
                );
            }
        };
        tokio::time::timeout(timeout, wait)
            .await
            .map_err(|_| BusError::Timeout {
                what: format!("the config service's answer to '{}'", request.operation),
                after: timeout,
            })?
    }
}

fn stopped(message: String) -> BusError {
    BusError::ConsumerStopped {
        topic: "config responses".into(),
        message,
    }
}

/// Every [`ConfigPush`] published after this subscribed.
pub struct ConfigPushes {
    consumer: Consumer<Vec<u8>, TokioExecutor>,
}

impl ConfigPushes {
    pub async fn subscribe(bus: &Bus, topics: &Topics) -> Result<ConfigPushes, BusError> {
        Ok(ConfigPushes {
            consumer: exclusive_latest(bus, &topics.config_push, "config-push").await?,
        })
    }

    /// The next push; pushes that do not decode are skipped.
    pub async fn next(&mut self) -> Result<ConfigPush, BusError> {
        loop {
            let message = match self.consumer.next().await {
                Some(Ok(m)) => m,
                Some(Err(e)) => return Err(stopped(e.to_string())),
                None => return Err(stopped("stream ended".into())),
            };
            let _ = self.consumer.ack(&message).await;
            match agent_schema::decode::<ConfigPush>(&message.payload.data) {
                Ok(push) => return Ok(push),
                Err(e) => tracing::warn!(error = %e, "skipping a config push that does not decode"),
            }
        }
    }
}
