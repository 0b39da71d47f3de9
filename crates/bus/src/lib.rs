//! Pulsar transport for the agent services: topic names, typed publishing that waits for the
//! broker's receipt, and a bounded consumer loop that acks only after the handler's effects are
//! published, nacks transient failures and dead-letters payloads that do not decode.

pub mod apache;
mod args;
mod client;
mod config_client;
mod consumer;
mod control;
pub mod embedded;
mod error;
mod librarian;
pub mod orphans;
pub mod owner_fence;
mod publisher;
mod redelivered;
mod resend;
pub mod seal;
mod service;
mod topics;

pub use args::{shutdown_signal, BrokerArgs};
pub use client::{message_property, AgentClient, Listener, Received, StreamedAnswer};
pub use config_client::{ConfigClient, ConfigPushes};
pub use consumer::{
    run_consumer, Aside, AsideLease, ConsumerStats, Delivery, Disposition, SubscriptionConfig,
    DEAD_LETTERS_KEPT, DEAD_LETTER_PAYLOAD_BYTES, DEAD_LETTER_REASON, SHED_METRIC,
};
pub use control::{sealed_control, send_control, ControlListener, HeardControl};
pub use error::BusError;
pub use librarian::{Librarian, LibrarianError};
pub use publisher::{Publisher, Receipt};
pub use service::{bearer_matches, http_stopped, stop_on_signal, HTTP_DRAIN};
pub use topics::{dead_letter_of, Topics};

use std::collections::BTreeMap;
use std::time::Duration;

use pulsar::{
    Authentication, ConnectionRetryOptions, OperationRetryOptions, Pulsar, TokioExecutor,
};

/// Message properties.
pub type Properties = BTreeMap<String, String>;

/// A connection to the broker shared by every producer and consumer of a process.
#[derive(Clone)]
pub struct Bus {
    client: Pulsar<TokioExecutor>,
    max_message_bytes: usize,
    compression: Compression,
    intake_bytes: usize,
}

/// How publishers compress payloads. Every Pulsar client decompresses what a message's metadata
/// names (TrustGraph's Python client included), and a broker passes the bytes on untouched, so it
/// is the publisher's choice alone. Off by default, as Pulsar's clients have it: over loopback the
/// bytes cost less than compressing them (paired `agentctl bench` runs on pulsar-lite and Apache
/// Pulsar here measured no gain); between hosts, and in BookKeeper's copies, a step's provenance
/// (tens of KB of JSON) takes a sixth of the bytes with LZ4.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compression {
    /// Payloads as they are.
    #[default]
    None,
    /// LZ4 (its fast mode): the cheapest to compress and to read.
    Lz4,
    /// zstd at level 1: a little smaller than LZ4, for more CPU.
    Zstd,
}

impl Compression {
    pub(crate) fn for_producer(self) -> pulsar::compression::Compression {
        use pulsar::compression as c;
        match self {
            Compression::None => c::Compression::None,
            Compression::Lz4 => c::Compression::Lz4(c::CompressionLz4::default()),
            Compression::Zstd => c::Compression::Zstd(c::CompressionZstd { level: 1 }),
        }
    }
}

/// Apache Pulsar's default `maxMessageSize` (5 MiB); a broker with another limit is told with
/// `PULSAR_MAX_MESSAGE_BYTES`.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 5 * 1024 * 1024;

/// The most bytes a consumer of a non-persistent topic holds for its handlers (see
/// `consumer.rs`): without it, the 10,000 messages the broker may send ahead could each be
/// as large as the broker takes (50 GB at Apache Pulsar's 5 MiB).
pub const DEFAULT_INTAKE_BYTES: usize = 64 * 1024 * 1024;

/// The longest wait between two tries to reach a broker that is away (the crate adds up to 90 ms
/// of jitter). The crate doubles its wait up to 30 s, so a process came back about as long after
/// the broker's return as the broker had been away: in CI, after Apache Pulsar's standalone
/// restarted under load, the services published again only 10 s after its SIGKILL.
const RECONNECT_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// Tries to reach a broker before the operation fails: about 40 s, as the crate's default allows
/// (10 ms doubling to 30 s, 12 tries). A consumer that gives up then subscribes again (see
/// `consumer.rs`).
const RECONNECT_TRIES: u32 = 47;

/// The wait before asking again a broker that answered "not ready" (a topic loading after its
/// restart), or did not answer in time: the crate's 5 s outlasts the loading itself.
const NOT_READY_RETRY: Duration = Duration::from_millis(500);

fn reconnecting() -> ConnectionRetryOptions {
    ConnectionRetryOptions {
        max_backoff: RECONNECT_AT_MOST_EVERY,
        max_retries: RECONNECT_TRIES,
        ..ConnectionRetryOptions::default()
    }
}

/// How errors name the broker's message size limit.
pub const BROKER_MESSAGE_LIMIT: &str = "the broker's maxMessageSize, PULSAR_MAX_MESSAGE_BYTES";

impl Bus {
    /// Connects to `url` (`pulsar://` or `pulsar+ssl://`), with token authentication when a token is given.
    pub async fn connect(url: &str, token: Option<&str>) -> Result<Bus, BusError> {
        Bus::connect_tls(url, token, None).await
    }

    /// As [`Bus::connect`], trusting the CA certificates (PEM) in `ca_file` for a `pulsar+ssl://`
    /// broker whose certificate the public roots built in (Mozilla's, `webpki-roots`) do not cover.
    pub async fn connect_tls(
        url: &str,
        token: Option<&str>,
        ca_file: Option<&std::path::Path>,
    ) -> Result<Bus, BusError> {
        let mut builder = Pulsar::builder(url, TokioExecutor)
            .with_connection_retry_options(reconnecting())
            .with_operation_retry_options(OperationRetryOptions {
                retry_delay: NOT_READY_RETRY,
                ..OperationRetryOptions::default()
            });
        if let Some(ca_file) = ca_file {
            builder = builder.with_certificate_chain_file(ca_file).map_err(|e| {
                BusError::Connect(format!("reading the CA file {}: {e}", ca_file.display()))
            })?;
        }
        if let Some(token) = token.filter(|t| !t.is_empty()) {
            builder = builder.with_auth(Authentication {
                name: "token".to_owned(),
                data: token.as_bytes().to_vec(),
            });
        }
        let client = builder.build().await.map_err(BusError::connect)?;
        Ok(Bus {
            client,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            compression: Compression::default(),
            intake_bytes: DEFAULT_INTAKE_BYTES,
        })
    }

    /// The largest message the broker takes (payload and properties); publishers refuse larger
    /// ones themselves.
    pub fn with_max_message_bytes(mut self, max: usize) -> Bus {
        self.max_message_bytes = max;
        // A message received compressed may decompress to as much (our patch of `pulsar` drops
        // one that decompresses to more: a compression bomb).
        pulsar::consumer::set_max_uncompressed_bytes(max);
        self
    }

    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// How this connection's publishers compress what they send.
    pub fn with_compression(mut self, compression: Compression) -> Bus {
        self.compression = compression;
        self
    }

    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// The most bytes each consumer of a non-persistent topic holds waiting for its
    /// handlers; what comes beyond is dropped, as the broker drops what a consumer has no room for.
    pub fn with_intake_bytes(mut self, bytes: usize) -> Bus {
        self.intake_bytes = bytes;
        self
    }

    pub fn intake_bytes(&self) -> usize {
        self.intake_bytes
    }

    pub fn client(&self) -> &Pulsar<TokioExecutor> {
        &self.client
    }
}
