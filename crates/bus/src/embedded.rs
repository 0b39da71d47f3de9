//! The embedded development broker: a `pulsar-lite` child process (from the PyPI package of that
//! name) on a loopback port with its own data folder. Used by `agentctl up`, `agentctl bench` and the
//! end-to-end tests; production uses Apache Pulsar.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The CPU time (user and system, in seconds) the process `pid` (a number, or `self`) has used,
/// read from `/proc`: how the bench and the tests tell a broker's or a service's share of the CPU.
/// `None` where there is no such process, or no `/proc`.
pub fn cpu_seconds(pid: &str) -> Option<f64> {
    let fields = crate::orphans::stat_fields(pid)?;
    // Fields 14 and 15.
    let user: f64 = fields.get(11)?.parse().ok()?;
    let system: f64 = fields.get(12)?.parse().ok()?;
    // `/proc` counts in USER_HZ, which Linux fixes at 100 a second whatever its own tick.
    Some((user + system) / 100.0)
}

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
    #[error("pulsar-lite exited ({status}) before listening on port {port} (taken by another process?); see {log}")]
    Exited {
        port: u16,
        status: std::process::ExitStatus,
        log: String,
    },
}

/// How many free ports a broker whose port is ours to choose tries: another process may take the
/// one we found between our look and the broker's bind.
const PORT_TRIES: usize = 5;

/// A running pulsar-lite; stopped on drop. Its data folder is removed on drop only when it was temporary.
pub struct EmbeddedBroker {
    port: u16,
    /// Held for the broker's life, so no other broker or service of this process is given its
    /// port while it restarts.
    _kept: KeptPort,
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
    loop {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        if !held_ports().contains(&port) {
            return Ok(port);
        }
    }
}

/// A free port for a broker to keep across its restarts, other than `besides` (the ports already
/// chosen for it), chosen outside the kernel's range of ephemeral ports: within that range an
/// outgoing connection made while the broker is down can be given the port as its own end, and
/// the broker then cannot listen there again (a restarted Apache Pulsar's bookie failed so in a
/// suite run, 2026-11-30). Outside it only a listener can take it: another broker's kept port
/// (this process holds the ports it keeps, see [`KeptPort`]; another process's
/// could still pick it while this one is down, one chance in thousands), never a connection.
fn port_to_keep(besides: &[u16]) -> Result<u16, std::io::Error> {
    const LOWEST: u32 = 15_000;
    let (ephemeral_from, ephemeral_to) =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|range| {
                let mut ends = range.split_whitespace().map(str::parse::<u32>);
                Some((ends.next()?.ok()?, ends.next()?.ok()?))
            })
            .unwrap_or((32_768, 60_999));
    // The room below the range and above it, as `(first, count)`.
    let below = (LOWEST, ephemeral_from.saturating_sub(LOWEST));
    let above = (ephemeral_to + 1, 65_536u32.saturating_sub(ephemeral_to + 1));
    let (first, count) = if below.1 >= above.1 { below } else { above };
    if count >= 1_000 {
        for _ in 0..500 {
            let Ok(port) = u16::try_from(first + rand::random::<u32>() % count) else {
                continue;
            };
            if !besides.contains(&port)
                && !held_ports().contains(&port)
                && TcpListener::bind(("127.0.0.1", port)).is_ok()
            {
                return Ok(port);
            }
        }
    }
    loop {
        let port = free_port()?;
        if !besides.contains(&port) {
            return Ok(port);
        }
    }
}

/// The ports this process keeps for its brokers and services (see [`KeptPort`]), held while they
/// live: one restarting has its port free for a moment, and one started meanwhile must not take
/// it.
fn held_ports() -> std::sync::MutexGuard<'static, Vec<u16>> {
    static HELD: std::sync::OnceLock<std::sync::Mutex<Vec<u16>>> = std::sync::OnceLock::new();
    HELD.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Gives back one hold of `port` (see [`KeptPort`]).
fn release_port(port: u16) {
    let mut held = held_ports();
    if let Some(at) = held.iter().position(|p| *p == port) {
        held.swap_remove(at);
    }
}

/// A port chosen by [`port_to_keep`] and held until dropped: no broker or service this process
/// starts meanwhile is given it, even while the one keeping it restarts.
#[derive(Debug)]
pub struct KeptPort(u16);

impl KeptPort {
    /// A port outside `besides`, held from now on.
    pub fn choose(besides: &[u16]) -> Result<KeptPort, std::io::Error> {
        loop {
            let port = port_to_keep(besides)?;
            // Checked again under the lock it is held by: another thread may have kept it since.
            let mut held = held_ports();
            if !held.contains(&port) {
                held.push(port);
                return Ok(KeptPort(port));
            }
        }
    }

    /// Holds `port`, which the caller chose itself (a broker told its port).
    pub fn hold(port: u16) -> KeptPort {
        held_ports().push(port);
        KeptPort(port)
    }

    pub fn port(&self) -> u16 {
        self.0
    }
}

impl Drop for KeptPort {
    fn drop(&mut self) {
        release_port(self.0);
    }
}

/// Whether process `pid` holds a socket listening on TCP `port` (from `/proc`: the kernel's socket
/// table and the process's descriptors). A connect that succeeds says only that someone listens:
/// a child that failed to bind a port another process took would pass for ready. The test harness
/// waits for its other children with this too.
#[cfg(target_os = "linux")]
pub fn process_listens_on(pid: u32, port: u16) -> bool {
    let listeners = listener_inodes(port);
    !listeners.is_empty() && holds_any_socket(pid, &listeners)
}

/// The processes that listen on TCP `port`, as far as this process may read their descriptors:
/// said when a child could not take a port it was given, so the log names who has it.
#[cfg(target_os = "linux")]
pub fn processes_listening_on(port: u16) -> Vec<(u32, String)> {
    let listeners = listener_inodes(port);
    if listeners.is_empty() {
        return Vec::new();
    }
    let Ok(processes) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    processes
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| holds_any_socket(*pid, &listeners))
        .map(|pid| {
            let command = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|line| String::from_utf8_lossy(&line).replace('\0', " "))
                .unwrap_or_default();
            (pid, command.trim().chars().take(200).collect())
        })
        .collect()
}

/// Elsewhere nobody is named.
#[cfg(not(target_os = "linux"))]
pub fn processes_listening_on(_port: u16) -> Vec<(u32, String)> {
    Vec::new()
}

/// The inodes of the sockets listening on TCP `port`, over IPv4 and IPv6.
#[cfg(target_os = "linux")]
fn listener_inodes(port: u16) -> Vec<String> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|table| {
            table
                .lines()
                .skip(1)
                .filter_map(|line| listener_inode(line, port))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Whether one of `pid`'s descriptors is one of the sockets `inodes`.
#[cfg(target_os = "linux")]
fn holds_any_socket(pid: u32, inodes: &[String]) -> bool {
    let Ok(descriptors) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    descriptors.flatten().any(|fd| {
        std::fs::read_link(fd.path()).is_ok_and(|target| {
            let target = target.to_string_lossy();
            inodes
                .iter()
                .any(|inode| *target == format!("socket:[{inode}]"))
        })
    })
}

/// Elsewhere only whether something listens on the port.
#[cfg(not(target_os = "linux"))]
pub fn process_listens_on(_pid: u32, port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// The socket inode of a `/proc/net/tcp` line, when it listens on `port`.
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn listener_inode(line: &str, port: u16) -> Option<String> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let local_port = fields.get(1)?.rsplit_once(':')?.1;
    const LISTEN: &str = "0A";
    let listens = u16::from_str_radix(local_port, 16).ok()? == port && *fields.get(3)? == LISTEN;
    listens.then(|| fields.get(9).map(|inode| (*inode).to_owned()))?
}

/// The broker's settings: write-buffer marks high enough that a busy reader of a non-persistent
/// topic is not dropped messages, and metrics off. One file for this and `scripts/pulsar-lite.sh`;
/// it says why.
const BROKER_CONFIG: &str = include_str!("../../../scripts/pulsar-lite.toml");

impl EmbeddedBroker {
    /// Starts a broker on `port` (0 = a free one) keeping its data in `data` (None = a temporary folder).
    pub fn start(port: u16, data: Option<&Path>) -> Result<EmbeddedBroker, EmbeddedError> {
        let binary = pulsar_lite_binary()?;
        let mut tries = if port == 0 { PORT_TRIES } else { 1 };
        loop {
            tries -= 1;
            let kept = if port == 0 {
                KeptPort::choose(&[])?
            } else {
                KeptPort::hold(port)
            };
            match EmbeddedBroker::start_on(kept, data, binary.clone()) {
                Err(EmbeddedError::Exited { port: taken, .. }) if tries > 0 => {
                    tracing::warn!(
                        port = taken,
                        "pulsar-lite could not take its port; trying another"
                    );
                }
                started => return started,
            }
        }
    }

    fn start_on(
        kept: KeptPort,
        data: Option<&Path>,
        binary: PathBuf,
    ) -> Result<EmbeddedBroker, EmbeddedError> {
        let port = kept.port();
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
            _kept: kept,
            data,
            temporary,
            binary,
            child: None,
        };
        broker.launch()?;
        Ok(broker)
    }

    fn launch(&mut self) -> Result<(), EmbeddedError> {
        let config = self.data.join("broker.toml");
        std::fs::write(&config, BROKER_CONFIG)?;
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)?;
        let child = crate::orphans::owned(&mut Command::new(&self.binary))
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
        let pid = child.id();
        let child = self.child.insert(child);
        let waited = Duration::from_secs(30);
        let deadline = Instant::now() + waited;
        // Listening means this child listening: a connection alone may reach another process on
        // the port (a broker that took it first, when this one then fails to bind and exits).
        while !process_listens_on(pid, self.port) {
            if let Some(status) = child.try_wait()? {
                self.child = None;
                return Err(EmbeddedError::Exited {
                    port: self.port,
                    status,
                    log: log_path.display().to_string(),
                });
            }
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

    /// SIGKILLs the broker (if it runs: after [`EmbeddedBroker::stop`] it does not) and starts it
    /// again on the same port and data (messages survive).
    pub fn restart(&mut self) -> Result<(), EmbeddedError> {
        self.stop();
        self.launch()
    }

    /// The broker's process id while it runs (to read its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_has_the_cpu_it_used_and_one_that_is_not_there_has_none() {
        let mut spin = 0u64;
        let before = cpu_seconds("self").unwrap();
        while cpu_seconds("self").unwrap() < before + 0.02 {
            spin = spin.wrapping_add(1);
        }
        assert!(cpu_seconds(&std::process::id().to_string()).unwrap() >= before + 0.02);
        assert!(cpu_seconds("not-a-pid").is_none(), "{spin}");
    }

    #[test]
    fn a_broker_whose_port_is_taken_fails_instead_of_passing_for_the_one_there() {
        let first = EmbeddedBroker::start(0, None).unwrap();
        let second = EmbeddedBroker::start(first.port(), None);
        assert!(
            matches!(second, Err(EmbeddedError::Exited { port, .. }) if port == first.port()),
            "a second broker on a taken port must fail: {:?}",
            second.map(|b| b.port())
        );
        let third = EmbeddedBroker::start(0, None).unwrap();
        assert_ne!(third.port(), first.port());
    }

    #[test]
    fn only_listening_lines_on_the_port_name_an_inode() {
        let listening =
            "   1: 0100007F:B3B1 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 178381 1 0000 100 0 0 10 0";
        let connected =
            "   2: 0100007F:B3B1 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 178390 1 0000 100 0 0 10 0";
        assert_eq!(listener_inode(listening, 46001).as_deref(), Some("178381"));
        assert_eq!(listener_inode(listening, 46002), None);
        assert_eq!(listener_inode(connected, 46001), None);
        assert_eq!(listener_inode("garbage", 46001), None);
    }
}
