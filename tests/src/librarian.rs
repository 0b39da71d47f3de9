//! TrustGraph's own librarian on a test's broker, with Apache Cassandra and an S3 server behind it
//! (`scripts/librarian.sh`): the document store of a TrustGraph deployment, reached through its
//! protocol. Cassandra listens on 9042, where the librarian looks, so one runs at a time.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use agent_schema::{ConfigRequest, ConfigValue};

use crate::{repo_root, Broker};

/// The librarian and what is behind it; stopped (and their data removed) on drop.
pub struct LibrarianService {
    dir: PathBuf,
    /// A client of it, on the test's broker.
    pub client: agent_bus::Librarian,
}

impl LibrarianService {
    /// Starts it on `broker`. TrustGraph's librarian serves only the workspaces its config
    /// service lists, so `default` is registered first (a `config-svc` must run on the broker).
    pub async fn start(broker: &Broker) -> LibrarianService {
        let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
        let topics = agent_bus::Topics::trustgraph("default", "default");
        let mut config = agent_bus::ConfigClient::connect(&bus, &topics)
            .await
            .unwrap();
        let register = ConfigRequest {
            operation: "put".into(),
            workspace: Some("__workspaces__".into()),
            values: vec![ConfigValue {
                kind: "workspace".into(),
                key: "default".into(),
                value: "{}".into(),
                workspace: None,
            }],
            ..ConfigRequest::default()
        };
        // The config service may not consume from the broker yet (Apache Pulsar takes a while to
        // hand a new subscription its topic): the put, the same each time, is sent until answered.
        let since = Instant::now();
        let registered = loop {
            match config.call(&register, Duration::from_secs(5)).await {
                Ok(answer) => break answer,
                Err(e) if since.elapsed() > Duration::from_secs(120) => {
                    panic!("the config service did not answer: {e}")
                }
                Err(_) => {}
            }
        };
        assert!(registered.error.is_none(), "{registered:?}");
        let dir = std::env::temp_dir().join(format!(
            "agent-e2e-librarian-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let started =
            agent_bus::orphans::owned(&mut Command::new(repo_root().join("scripts/librarian.sh")))
                .arg("start")
                .arg(&dir)
                .arg(broker.url())
                .status()
                .unwrap();
        let client = agent_bus::Librarian::connect(&bus, &topics, Duration::from_secs(3))
            .await
            .unwrap();
        let service = LibrarianService { dir, client };
        assert!(started.success(), "scripts/librarian.sh start failed");
        // Ready when it answers: a document nobody kept is missing, not an error.
        let since = Instant::now();
        loop {
            match service.client.read("urn:agent-e2e:probe").await {
                Ok(None) => break,
                outcome if since.elapsed() > Duration::from_secs(120) => {
                    panic!(
                        "the librarian did not answer: {outcome:?}; its log: {}",
                        std::fs::read_to_string(service.dir.join("librarian.log"))
                            .unwrap_or_default()
                    )
                }
                _ => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
        service
    }
}

impl Drop for LibrarianService {
    fn drop(&mut self) {
        let _ = Command::new(repo_root().join("scripts/librarian.sh"))
            .arg("stop")
            .arg(&self.dir)
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
