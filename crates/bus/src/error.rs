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
    /// Refused before it reached the broker, which would close the connection on it (Apache
    /// Pulsar's `maxMessageSize`, 5 MiB by default) and leave the send to time out.
    #[error("a message of {bytes} bytes for {topic} is over the limit of {max} bytes ({limit})")]
    TooLarge {
        topic: String,
        bytes: usize,
        max: usize,
        /// Which limit: the broker's or one of ours.
        limit: String,
    },
    #[error("the consumer of {topic} stopped: {message}")]
    ConsumerStopped { topic: String, message: String },
    #[error("no answer from {what} within {after:?}")]
    Timeout {
        what: String,
        after: std::time::Duration,
    },
}

impl BusError {
    /// Whether trying again may succeed: everything but a message over a size limit, which is
    /// refused the same way every time.
    pub fn passes(&self) -> bool {
        !matches!(self, BusError::TooLarge { .. })
    }

    pub(crate) fn connect(e: pulsar::Error) -> BusError {
        BusError::Connect(e.to_string())
    }
}
