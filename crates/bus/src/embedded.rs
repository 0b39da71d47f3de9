//! The embedded development broker: a `pulsar-lite` child process (from the PyPI package of that
//! name) on a loopback port with its own data folder. Used by `agentctl up`, `agentctl bench` and the
//! end-to-end tests; production uses Apache Pulsar.

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Why the embedded broker could not run.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    #[error(
        "pulsar-lite is not installed (run scripts/setup.sh, or pip install pulsar-lite): {0}"
    )]
    NotInstalled(String),
    #[error("cannot start pulsar-lite: {0}")]
    Start(#[from] std::io::Error),
    #[error("pulsar-lite did not listen on port {port} within {waited:?}; see {log}")]
    NotListening {
        port: u16,
        waited: Duration,
        log: String,
    },
}

/// A running pulsar-lite; stopped on drop. Its data folder is removed on drop only when it was temporary.
pub struct EmbeddedBroker {
    port: u16,
    data: PathBuf,
    temporary: bool,
    binary: PathBuf,
    child: Option<Child>,
}

/// The pulsar-lite binary: `PULSAR_LITE_BIN`, or the one inside the installed Python package.
pub fn pulsar_lite_binary() -> Result<PathBuf, EmbeddedError> {
    if let Some(path) = std::env::var_os("PULSAR_LITE_BIN") {
        return Ok(PathBuf::from(path));
    }
    let output = Command::new("python3")
        .args([
            "-c",
            "import os, pulsar_lite; print(os.path.join(os.path.dirname(pulsar_lite.__file__), 'bin', 'pulsar-lite'))",
        ])
        .stderr(Stdio::null())
        .output()
        .map_err(|e| EmbeddedError::NotInstalled(e.to_string()))?;
    let path = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
    if output.status.success() && path.is_file() {
        Ok(path)
    } else {
        Err(EmbeddedError::NotInstalled(
            "the pulsar_lite Python package was not found".into(),
        ))
    }
}

/// A port nobody listens on right now.
pub fn free_port() -> Result<u16, std::io::Error> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl EmbeddedBroker {
    /// Starts a broker on `port` (0 = a free one) keeping its data in `data` (None = a temporary folder).
    pub fn start(port: u16, data: Option<&Path>) -> Result<EmbeddedBroker, EmbeddedError> {
        let binary = pulsar_lite_binary()?;
        let port = if port == 0 { free_port()? } else { port };
        let (data, temporary) = match data {
            Some(d) => (d.to_path_buf(), false),
            None => (
                std::env::temp_dir().join(format!(
                    "pulsar-lite-{}-{port}-{:08x}",
                    std::process::id(),
                    rand::random::<u32>()
                )),
                true,
            ),
        };
        std::fs::create_dir_all(&data)?;
        let mut broker = EmbeddedBroker {
            port,
            data,
            temporary,
            binary,
            child: None,
        };
        broker.launch()?;
        Ok(broker)
    }

    fn launch(&mut self) -> Result<(), EmbeddedError> {
        // Metrics would bind 0.0.0.0:8080 and collide between brokers: switch them off.
        let config = self.data.join("broker.toml");
        std::fs::write(&config, "[metrics]\nenabled = false\n")?;
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let child = Command::new(&self.binary)
            .arg("--config")
            .arg(&config)
            .arg("--addr")
            .arg(format!("127.0.0.1:{}", self.port))
            .arg("--db-path")
            .arg(self.data.join("broker"))
            .arg("--log-level")
            // PULSAR_LITE_LOG_LEVEL=debug keeps the broker's view of a failing test in broker.log.
            .arg(std::env::var("PULSAR_LITE_LOG_LEVEL").unwrap_or_else(|_| "warn".into()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        let waited = Duration::from_secs(30);
        let deadline = Instant::now() + waited;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            if Instant::now() > deadline {
                return Err(EmbeddedError::NotListening {
                    port: self.port,
                    waited,
                    log: log_path.display().to_string(),
                });
            }
            std::thread::sleep(Duration::from_millis(25));
        }
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("pulsar://127.0.0.1:{}", self.port)
    }

    /// The broker's own log (stderr), kept in its data folder.
    pub fn log_path(&self) -> PathBuf {
        self.data.join("broker.log")
    }

    /// Connections pulsar-lite dropped on a read error (a peer killed with data in flight resets
    /// the connection). pulsar-lite 0.2.0 skips its consumer cleanup on that path, so every
    /// consumer of such a connection stays registered as a ghost that keeps its un-acked messages
    /// until the broker restarts: these lines are the evidence. Apache Pulsar has no such path.
    pub fn reset_connections(&self) -> Vec<String> {
        std::fs::read_to_string(self.log_path())
            .map(|log| {
                log.lines()
                    .filter(|l| l.contains("Connection error from"))
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// SIGKILLs the broker and starts it again on the same port and data (messages survive).
    pub fn restart(&mut self) -> Result<(), EmbeddedError> {
        self.stop();
        self.launch()
    }

    /// Stops the broker (SIGKILL; pulsar-lite keeps acknowledged messages across it).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for EmbeddedBroker {
    fn drop(&mut self) {
        self.stop();
        // PULSAR_LITE_KEEP_DATA=1 keeps the folder (and its broker.log) for a post-mortem.
        if self.temporary && std::env::var_os("PULSAR_LITE_KEEP_DATA").is_none() {
            let _ = std::fs::remove_dir_all(&self.data);
        }
    }
}
