//! The client side of the config protocol: requests answered on the response topic, matched by the
//! `id` property, and a subscription to the change pushes.

use std::time::Duration;

use agent_schema::{ConfigPush, ConfigRequest, ConfigResponse, ID_PROPERTY};

use crate::client::{message_property, Listener};
use crate::{Bus, BusError, Properties, Publisher, Topics};

/// Asks the config service; one request at a time.
pub struct ConfigClient {
    bus: Bus,
    requests: Publisher,
    responses: Listener,
}

impl ConfigClient {
    pub async fn connect(bus: &Bus, topics: &Topics) -> Result<ConfigClient, BusError> {
        let responses = Listener::subscribe(bus, &topics.config_response, "config-client").await?;
        let requests = Publisher::new(bus, &topics.config_request).await?;
        Ok(ConfigClient {
            bus: bus.clone(),
            requests,
            responses,
        })
    }

    /// Sends `request` and waits up to `timeout` for its response (others' responses are skipped).
    ///
    /// The config topics are non-persistent, as TrustGraph's are: a request the broker finds no
    /// room for is dropped, not kept. A read is therefore sent again, under the same id, after
    /// each third of `timeout` without an answer (the first answer wins, a later copy is
    /// skipped); a write is sent once, so a lost answer cannot apply it twice.
    ///
    /// A subscription to the answers that ended (a broker restart, the topic unloaded) is made
    /// again before the request is sent; without that every later call would fail at once.
    pub async fn call(
        &mut self,
        request: &ConfigRequest,
        timeout: Duration,
    ) -> Result<ConfigResponse, BusError> {
        // The topic carries every client's answers; those that came since the last call are
        // someone else's (or a late copy of one of ours), and would only be held and skipped.
        self.responses.discard_waiting();
        if self.responses.ended() {
            self.responses.subscribe_again(&self.bus).await?;
            tracing::info!("listening to the config service's answers again");
        }
        let id = format!("{:032x}", rand::random::<u128>());
        let mut properties = Properties::new();
        properties.insert(ID_PROPERTY.to_owned(), id.clone());
        let sends = if is_read(&request.operation) { 3 } else { 1 };
        let mut answer = Box::pin(answer_to(&mut self.responses, &id));
        let payload = agent_schema::encode(request);
        crate::resend::ask(
            &self.requests,
            &payload,
            &properties,
            sends,
            timeout,
            &mut answer,
        )
        .await?
        .ok_or_else(|| BusError::Timeout {
            what: format!("the config service's answer to '{}'", request.operation),
            after: timeout,
        })
    }
}

/// The next response carrying `id`.
async fn answer_to(responses: &mut Listener, id: &str) -> Result<ConfigResponse, BusError> {
    loop {
        let message = responses.next().await?;
        if message_property(&message, ID_PROPERTY) != Some(id) {
            continue;
        }
        return agent_schema::decode::<ConfigResponse>(&message.payload.data).map_err(|e| {
            BusError::ConsumerStopped {
                topic: "config responses".into(),
                message: format!("a response that does not decode: {e}"),
            }
        });
    }
}

/// Operations that change nothing, so asking twice is harmless.
fn is_read(operation: &str) -> bool {
    use agent_schema::operation;
    [
        operation::GET,
        operation::LIST,
        operation::GET_VALUES,
        operation::CONFIG,
        operation::GET_VALUES_ALL_WS,
        operation::GET_KEYS_ALL_WS,
    ]
    .contains(&operation)
}

/// Every [`ConfigPush`] published after this subscribed.
pub struct ConfigPushes {
    pushes: Listener,
}

impl ConfigPushes {
    pub async fn subscribe(bus: &Bus, topics: &Topics) -> Result<ConfigPushes, BusError> {
        Ok(ConfigPushes {
            pushes: Listener::subscribe(bus, &topics.config_push, "config-push").await?,
        })
    }

    /// The next push; pushes that do not decode are skipped. An error means the subscription
    /// ended: what is pushed from then on is not heard until [`ConfigPushes::subscribe`] again.
    pub async fn next(&mut self) -> Result<ConfigPush, BusError> {
        loop {
            let message = self.pushes.next().await?;
            match agent_schema::decode::<ConfigPush>(&message.payload.data) {
                Ok(push) => return Ok(push),
                Err(e) => tracing::warn!(error = %e, "skipping a config push that does not decode"),
            }
        }
    }
}
