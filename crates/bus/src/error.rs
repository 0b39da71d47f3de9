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

/// Whether the broker refused for good (no token, a token without the right, a topic name it
/// rejects): asking again gives the same answer. Everything else (a broker still loading its
/// namespaces or its bookies after a start) is worth another try.
pub(crate) fn refused_for_good(e: &pulsar::Error) -> bool {
    use pulsar::error::{ConnectionError, ConsumerError, ProducerError};
    use pulsar::message::proto::ServerError;
    let connection = match e {
        pulsar::Error::Connection(c)
        | pulsar::Error::Consumer(ConsumerError::Connection(c))
        | pulsar::Error::Producer(ProducerError::Connection(c)) => c,
        pulsar::Error::Authentication(_) => return true,
        _ => return false,
    };
    match connection {
        ConnectionError::Authentication(a) => {
            !matches!(a, pulsar::error::AuthenticationError::Retriable(_))
        }
        ConnectionError::PulsarError(Some(code), _) => matches!(
            code,
            ServerError::AuthenticationError
                | ServerError::AuthorizationError
                | ServerError::InvalidTopicName
                | ServerError::NotAllowedError
        ),
        _ => false,
    }
}

/// How long a client or service keeps trying to create a producer or a subscription while the
/// broker refuses in a way that may pass.
pub(crate) const SETTLING_PATIENCE: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs `attempt` until it works, fails for good, or [`SETTLING_PATIENCE`] has passed.
pub(crate) async fn until_settled<T, F, Fut>(what: &str, mut attempt: F) -> Result<T, pulsar::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, pulsar::Error>>,
{
    let started = std::time::Instant::now();
    let mut wait = std::time::Duration::from_millis(100);
    loop {
        match attempt().await {
            Ok(done) => return Ok(done),
            Err(e) if !refused_for_good(&e) && started.elapsed() < SETTLING_PATIENCE => {
                tracing::warn!(what, error = %e, "the broker refused; trying again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(std::time::Duration::from_secs(2));
            }
            Err(e) => return Err(e),
        }
    }
}
