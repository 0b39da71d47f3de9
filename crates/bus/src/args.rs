//! Broker settings every binary shares: flags with the environment fallbacks of DESIGN section 7.

use crate::{Bus, BusError, Topics};

#[derive(clap::Args, Debug, Clone)]
pub struct BrokerArgs {
    /// Broker URL (`pulsar://` or `pulsar+ssl://`).
    #[arg(long, env = "PULSAR_URL", default_value = "pulsar://127.0.0.1:6650")]
    pub pulsar_url: String,
    /// Broker token for token authentication.
    #[arg(long, env = "PULSAR_TOKEN", hide_env_values = true)]
    pub pulsar_token: Option<String>,
    /// CA certificates (PEM) for a `pulsar+ssl://` broker signed by a private CA.
    #[arg(long, env = "PULSAR_TLS_CA_FILE")]
    pub pulsar_tls_ca_file: Option<std::path::PathBuf>,
    /// The largest message the broker takes, in bytes (Apache Pulsar's `maxMessageSize`). A larger
    /// one is refused before it is sent: the broker would drop the connection on it.
    #[arg(long, env = "PULSAR_MAX_MESSAGE_BYTES", default_value_t = crate::DEFAULT_MAX_MESSAGE_BYTES)]
    pub pulsar_max_message_bytes: usize,
    /// How this service compresses what it publishes: `none` (the default), `lz4` or `zstd`.
    /// Consumers need no setting: a message says how it was compressed.
    #[arg(long, env = "PULSAR_COMPRESSION", value_enum, default_value_t = crate::Compression::default())]
    pub pulsar_compression: crate::Compression,
    /// The most bytes (payloads, properties, 512 a message) each consumer of a non-persistent
    /// topic (TrustGraph's agent and config request topics) holds while its handlers are busy;
    /// messages beyond it are dropped and counted, as the broker drops what a consumer has no room
    /// for. One message is always held, whatever the bound. Bounds the memory a burst can take.
    #[arg(long, env = "PULSAR_INTAKE_MAX_BYTES", default_value_t = crate::DEFAULT_INTAKE_BYTES)]
    pub pulsar_intake_max_bytes: usize,
    /// Workspace part of the topic names.
    #[arg(long, env = "AGENT_WORKSPACE", default_value = "default")]
    pub workspace: String,
    /// Flow part of the topic names.
    #[arg(long, env = "AGENT_FLOW", default_value = "default")]
    pub flow: String,
}

impl BrokerArgs {
    pub async fn connect(&self) -> Result<Bus, BusError> {
        Ok(Bus::connect_tls(
            &self.pulsar_url,
            self.pulsar_token.as_deref(),
            self.pulsar_tls_ca_file.as_deref(),
        )
        .await?
        .with_max_message_bytes(self.pulsar_max_message_bytes)
        .with_compression(self.pulsar_compression)
        .with_intake_bytes(self.pulsar_intake_max_bytes))
    }

    /// [`BrokerArgs::connect`] for a command someone waits on: a broker that neither answers nor
    /// refuses (a host gone from the network, a port that takes connections and says nothing)
    /// would have the client try for minutes, each try waiting out its 10 s connection
    /// timeout, in silence. Past `patience` it is reported instead.
    pub async fn connect_within(&self, patience: std::time::Duration) -> Result<Bus, BusError> {
        tokio::time::timeout(patience, self.connect())
            .await
            .unwrap_or_else(|_| {
                Err(BusError::Timeout {
                    what: format!("the broker at {}", self.pulsar_url),
                    after: patience,
                })
            })
    }

    /// TrustGraph's topic names for this workspace and flow.
    pub fn topics(&self) -> Topics {
        Topics::trustgraph(&self.workspace, &self.flow)
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
