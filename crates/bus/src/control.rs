//! Run control over the broker: a cancel is published on the control topic, which every
//! orchestrator replica hears on a subscription of its own; an answer to an approval on the
//! durable control request topic, which one replica takes up.

use agent_schema::AgentControl;

use crate::client::Listener;
use crate::seal::SealKey;
use crate::{Bus, BusError, Properties, Publisher, Topics};

/// Publishes `control` where its operation goes: a cancel to every replica, an approval's answer
/// to the durable topic one replica takes it up from; sealed with `seal` when given.
pub async fn send_control(
    bus: &Bus,
    topics: &Topics,
    control: &AgentControl,
    seal: Option<&SealKey>,
) -> Result<(), BusError> {
    let topic = if control.operation == agent_schema::control_operation::CANCEL {
        &topics.control
    } else {
        &topics.control_request
    };
    let publisher = Publisher::new(bus, topic).await?;
    let (payload, properties) = sealed_control(control, seal);
    publisher.send(payload, &properties).await
}

/// `control` as sent: its payload, and its seal when `seal` is given.
pub fn sealed_control(control: &AgentControl, seal: Option<&SealKey>) -> (Vec<u8>, Properties) {
    let payload = agent_schema::encode(control);
    let properties =
        crate::seal::sealed_properties(seal, crate::seal::CONTROL_SEAL_PROPERTY, |key| {
            key.seal_control(&payload)
        });
    (payload, properties)
}

/// A control message heard, with what its seal is checked over.
pub struct HeardControl {
    pub control: AgentControl,
    /// The payload as it came off the wire.
    pub raw: Vec<u8>,
    pub properties: Properties,
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
    pub async fn next(&mut self) -> Result<HeardControl, BusError> {
        loop {
            let (raw, properties) = self.messages.next_with_properties().await?;
            match agent_schema::decode::<AgentControl>(&raw) {
                Ok(control) => {
                    return Ok(HeardControl {
                        control,
                        properties,
                        raw,
                    })
                }
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a control message that does not decode")
                }
            }
        }
    }
}
