//! Run control over the broker: a cancel is published on the control topic, which every
//! orchestrator replica hears on a subscription of its own; an answer to an approval on the
//! durable control request topic, which one replica takes up.

use agent_schema::AgentControl;

use crate::client::Listener;
use crate::{Bus, BusError, Properties, Publisher, Topics};

/// Publishes `control` where its operation goes: a cancel to every replica, an approval's answer
/// to the durable topic one replica takes it up from.
pub async fn send_control(
    bus: &Bus,
    topics: &Topics,
    control: &AgentControl,
) -> Result<(), BusError> {
    let topic = if control.operation == agent_schema::control_operation::CANCEL {
        &topics.control
    } else {
        &topics.control_request
    };
    let publisher = Publisher::new(bus, topic).await?;
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
