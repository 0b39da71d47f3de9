//! Run control over the broker: a control message is published on the control topic, and every
//! orchestrator replica hears it on a subscription of its own.

use agent_schema::AgentControl;

use crate::client::Listener;
use crate::{Bus, BusError, Properties, Publisher, Topics};

/// Publishes `control` on the control topic.
pub async fn send_control(
    bus: &Bus,
    topics: &Topics,
    control: &AgentControl,
) -> Result<(), BusError> {
    let publisher = Publisher::new(bus, &topics.control).await?;
    publisher
        .send(agent_schema::encode(control), &Properties::new())
        .await
}

/// Every control message published after this subscribed.
pub struct ControlListener {
    messages: Listener,
}

impl ControlListener {
    pub async fn subscribe(bus: &Bus, topics: &Topics) -> Result<ControlListener, BusError> {
        Ok(ControlListener {
            messages: Listener::subscribe(bus, &topics.control, "agent-control").await?,
        })
    }

    /// The next control message; one that does not decode is skipped with a warning.
    pub async fn next(&mut self) -> Result<AgentControl, BusError> {
        loop {
            let message = self.messages.next().await?;
            match agent_schema::decode::<AgentControl>(&message.payload.data) {
                Ok(control) => return Ok(control),
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a control message that does not decode")
                }
            }
        }
    }
}
