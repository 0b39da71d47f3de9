//! Transport errors, split by what the caller should do about them.

/// A transport failure. Every variant is transient from the point of view of a message being
/// processed: the message is nacked and comes back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BusError {
    #[error("cannot connect to the broker: {0}")]
    Connect(String),
    #[error("cannot create a producer for {topic}: {message}")]
    Producer { topic: String, message: String },
    #[error("cannot subscribe to {topic}: {message}")]
    Subscribe { topic: String, message: String },
    #[error("publishing to {topic} failed: {message}")]
    Publish { topic: String, message: String },
    #[error("the consumer of {topic} stopped: {message}")]
    ConsumerStopped { topic: String, message: String },
    #[error("no answer from {what} within {after:?}")]
    Timeout {
        what: String,
        after: std::time::Duration,
    },
}

impl BusError {
    pub(crate) fn connect(e: pulsar::Error) -> BusError {
        BusError::Connect(e.to_string())
    }
}
