//! Apache Pulsar's standalone broker, for the end-to-end tier that runs on it and for
//! `agentctl bench --brokers apache`: the JVM started from the jars `scripts/apache-pulsar.sh`
//! fetched, on free loopback ports, with its own data folder, without the functions worker or
//! stream storage, optionally with JWT authentication and authorization. Killed when dropped.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::Context;

/// The namespaces of TrustGraph's topics under its tenant `tg`: created at start, and each served
/// before the broker counts as ready (a service's start-up reaches them all: its dead-letter and
/// notify topics too).
const NAMESPACES: [&str; 6] = [
    "flow",
    "request",
    "response",
    "notify",
    "dead-letter",
    "config",
];

/// The role every service of a test with authentication uses (a super-user).
pub const ADMIN_ROLE: &str = "admin";

/// JWT authentication and authorization: the broker's secret key and tokens signed with it.
#[derive(Debug, Clone)]
pub struct TokenAuth {
    secret: Vec<u8>,
}

impl TokenAuth {
    pub fn new() -> TokenAuth {
        TokenAuth {
            secret: (0..32).map(|_| rand::random::<u8>()).collect(),
        }
    }

    /// A token for `role`: an HS256 JWT whose `sub` claim is the role, as Pulsar's token
    /// provider reads it.
    pub fn token(&self, role: &str) -> String {
        let header = base64url(br#"{"alg":"HS256"}"#);
        let claims = base64url(serde_json::json!({ "sub": role }).to_string().as_bytes());
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &self.secret);
        let signature = ring::hmac::sign(&key, format!("{header}.{claims}").as_bytes());
        format!("{header}.{claims}.{}", base64url(signature.as_ref()))
    }
}

impl Default for TokenAuth {
    fn default() -> Self {
        TokenAuth::new()
    }
}

fn base64url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

/// The folder of Apache Pulsar's jars, fetched once per test process.
fn jars() -> anyhow::Result<&'static Path> {
    static JARS: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let jars = JARS.get_or_init(|| {
        // This repository's script: the jars are fetched once and cached outside the clone.
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../scripts/apache-pulsar.sh"
        );
        let out = Command::new(script)
            .arg("path")
            .stderr(Stdio::inherit())
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err("scripts/apache-pulsar.sh path failed".to_owned());
        }
        Ok(PathBuf::from(
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        ))
    });
    jars.as_deref().map_err(|e| anyhow::anyhow!("{e}"))
}

/// The broker JVM's flags, also those its class archive is checked with.
const JVM_FLAGS: &[&str] = &[
    "-Xms256m",
    "-Xmx512m",
    "-XX:MaxDirectMemorySize=256m",
    "-XX:+UseG1GC",
    // Faster start; the tests are short.
    "-XX:TieredStopAtLevel=1",
    "--add-opens",
    "java.base/java.io=ALL-UNNAMED",
    "--add-opens",
    "java.base/java.nio=ALL-UNNAMED",
    "--add-opens",
    "java.base/jdk.internal.misc=ALL-UNNAMED",
    "--add-opens",
    "java.base/sun.net=ALL-UNNAMED",
    "--add-opens",
    "java.management/sun.management=ALL-UNNAMED",
    "--add-opens",
    "jdk.management/com.sun.management.internal=ALL-UNNAMED",
    "--add-opens",
    "java.base/jdk.internal.platform=ALL-UNNAMED",
    "-Dio.netty.tryReflectionSetAccessible=true",
];

/// Apache Pulsar's classes as a class-data-sharing archive beside its jars, made once per
/// machine by a first broker that archives what it loaded and stops cleanly (about 8 s). A
/// broker started from it was ready in 2.7-3.1 s instead of 4.3-4.7 s, with a third less CPU
/// (3 runs each, this 2-core machine); the Apache Pulsar tier starts about a hundred. None when
/// it cannot be made: brokers then start without it, as before.
fn class_archive() -> Option<&'static Path> {
    static ARCHIVE: OnceLock<Option<PathBuf>> = OnceLock::new();
    ARCHIVE
        .get_or_init(|| {
            let jars = jars().ok()?;
            let archive = jars.parent()?.join("classes.jsa");
            if archive_usable(&archive, jars) {
                return Some(archive);
            }
            // Making it failed before on this machine: not again in every test process.
            let failed = archive.with_extension("jsa.failed");
            if failed.exists() {
                return None;
            }
            let made = make_class_archive(&archive).and_then(|()| {
                anyhow::ensure!(
                    archive_usable(&archive, jars),
                    "the JVM refuses the archive it made"
                );
                Ok(())
            });
            match made {
                Ok(()) => Some(archive),
                Err(e) => {
                    tracing::warn!(
                        "no class archive for Apache Pulsar, brokers start without one \
                         (delete {} to try again): {e:#}",
                        failed.display()
                    );
                    let _ = std::fs::write(&failed, format!("{e:#}\n"));
                    None
                }
            }
        })
        .as_deref()
}

/// Whether this JVM maps `archive` with these jars: another JDK or other jars make an archive
/// stale (the JVM would start without it, slower, for good), and one cut short makes it crash.
fn archive_usable(archive: &Path, jars: &Path) -> bool {
    archive.exists()
        && Command::new("java")
            .args(JVM_FLAGS)
            .arg("-Xshare:on")
            .arg(format!("-XX:SharedArchiveFile={}", archive.display()))
            // A cut-short archive crashes this JVM: its crash report goes here, not to the
            // caller's folder (seen: an hs_err file in the test crate's folder).
            .arg(format!(
                "-XX:ErrorFile={}",
                std::env::temp_dir()
                    .join("apache-pulsar-class-archive-check.log")
                    .display()
            ))
            .arg("-cp")
            .arg(format!("{}/*", jars.display()))
            .arg("-version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success())
}

fn make_class_archive(archive: &Path) -> anyhow::Result<()> {
    // Written apart and renamed, so a process making it at the same time, or one killed while
    // making it, never leaves a half archive under the name others start from.
    sweep_partial_archives(archive);
    let partial = archive.with_extension(format!("jsa.{}", std::process::id()));
    let made = ApacheBroker::start_inner(0, None, &[], Some(partial.clone()))
        .and_then(|mut broker| broker.stop_cleanly(Duration::from_secs(60)))
        .and_then(|()| {
            std::fs::rename(&partial, archive)
                .with_context(|| format!("the JVM wrote no class archive at {}", partial.display()))
        });
    if made.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    made
}

/// Removes archives a killed process left half made (`classes.jsa.<pid>`, older than making one
/// takes).
fn sweep_partial_archives(archive: &Path) {
    let (Some(folder), Some(name)) = (archive.parent(), archive.file_name()) else {
        return;
    };
    let prefix = format!("{}.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let left_by_a_process = file
            .strip_prefix(&prefix)
            .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit()));
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > Duration::from_secs(600)));
        if left_by_a_process && old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A running Apache Pulsar standalone.
pub struct ApacheBroker {
    broker_port: u16,
    web_port: u16,
    /// The bookie's port, chosen here and kept across restarts: the bookie's identity in the
    /// metadata is its address, and standalone's own choice (the first free port from 3181) races
    /// with another broker starting at the same moment.
    bookie_port: u16,
    data: PathBuf,
    auth: Option<TokenAuth>,
    /// `key=value` lines added to the broker's configuration (they override the defaults here).
    settings: Vec<String>,
    /// Set only for the broker that makes the class archive (see [`class_archive`]): where its
    /// JVM writes the classes it loaded when it stops cleanly.
    archive_classes_to: Option<PathBuf>,
    child: Option<Child>,
    /// Its three ports, held for its life (see [`crate::embedded::KeptPort`]).
    _kept: [crate::embedded::KeptPort; 3],
}

impl ApacheBroker {
    /// A broker on `broker_port` (0: a free one), ready for clients when this returns.
    pub fn start(broker_port: u16, auth: Option<TokenAuth>) -> anyhow::Result<ApacheBroker> {
        Self::start_with(broker_port, auth, &[])
    }

    /// As [`ApacheBroker::start`], with broker settings (`key=value`, as in `standalone.conf`)
    /// over the defaults, such as `managedLedgerNewEntriesCheckDelayInMillis=0`.
    pub fn start_with(
        broker_port: u16,
        auth: Option<TokenAuth>,
        settings: &[String],
    ) -> anyhow::Result<ApacheBroker> {
        Self::start_inner(broker_port, auth, settings, None)
    }

    fn start_inner(
        broker_port: u16,
        auth: Option<TokenAuth>,
        settings: &[String],
        archive_classes_to: Option<PathBuf>,
    ) -> anyhow::Result<ApacheBroker> {
        if let Some(bad) = settings
            .iter()
            .find(|s| !s.contains('=') || s.contains('\n'))
        {
            anyhow::bail!("an Apache Pulsar setting is key=value on one line, not {bad:?}");
        }
        if archive_classes_to.is_none() {
            // Made (once) before this broker's ports are chosen, so none is taken meanwhile.
            let _ = class_archive();
        }
        let chosen_port = broker_port;
        let mut attempt = 1;
        loop {
            let kept_broker = match chosen_port {
                0 => crate::embedded::KeptPort::choose(&[])?,
                port => crate::embedded::KeptPort::hold(port),
            };
            let broker_port = kept_broker.port();
            let kept_web = crate::embedded::KeptPort::choose(&[broker_port])?;
            let web_port = kept_web.port();
            let kept_bookie = crate::embedded::KeptPort::choose(&[broker_port, web_port])?;
            let bookie_port = kept_bookie.port();
            // Not named by the port alone: while a broker of this process restarts, its port is
            // free, and another broker started meanwhile could be given it and wipe this folder
            // (seen as a restart that found its bookie's cookie, `current/VERSION`, gone).
            let data = std::env::temp_dir().join(format!(
                "apache-pulsar-{}-{broker_port}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            let _ = std::fs::remove_dir_all(&data);
            std::fs::create_dir_all(&data)?;
            let mut broker = ApacheBroker {
                broker_port,
                web_port,
                bookie_port,
                data,
                auth: auth.clone(),
                settings: settings.to_vec(),
                archive_classes_to: archive_classes_to.clone(),
                child: None,
                _kept: [kept_broker, kept_web, kept_bookie],
            };
            match broker.launch(true) {
                Ok(()) => return Ok(broker),
                // A port chosen free can be taken before the JVM binds it (another test's
                // connection, another broker starting): the JVM exits at once; start again on
                // other ports.
                Err(e) if attempt < 3 && broker.exited() => {
                    tracing::warn!("Apache Pulsar did not start (attempt {attempt}): {e:#}");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Whether the broker's JVM has exited.
    fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(Some(_))))
    }

    pub fn url(&self) -> String {
        format!("pulsar://127.0.0.1:{}", self.broker_port)
    }

    /// The broker's JVM's process id while it runs (to read its CPU time).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// The token the services use, when authentication is on.
    pub fn admin_token(&self) -> Option<String> {
        self.auth.as_ref().map(|a| a.token(ADMIN_ROLE))
    }

    /// SIGKILL (unless [`ApacheBroker::stop`] did) and start again on the same data and ports.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        self.launch(false)
    }

    /// SIGKILL, leaving it down until [`ApacheBroker::restart`] (an outage of a chosen length).
    pub fn stop(&mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The JVM's class-data-sharing flag: archive what it loads (the broker making the archive),
    /// or start from the archive, or the JDK's own archive only when there is none.
    fn class_sharing(&self) -> String {
        if let Some(to) = &self.archive_classes_to {
            return format!("-XX:ArchiveClassesAtExit={}", to.display());
        }
        match class_archive() {
            // A stale archive (another JDK) is refused by the JVM, which then starts without it.
            Some(archive) => format!("-XX:SharedArchiveFile={}", archive.display()),
            None => "-Xshare:auto".to_owned(),
        }
    }

    /// SIGTERM, and wait for the JVM to exit: its shutdown runs, and it writes its class archive.
    fn stop_cleanly(&mut self, within: Duration) -> anyhow::Result<()> {
        let Some(child) = self.child.as_mut() else {
            return Ok(());
        };
        let signalled = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()?;
        anyhow::ensure!(signalled.success(), "kill -TERM failed: {signalled}");
        let started = Instant::now();
        while started.elapsed() < within {
            if child.try_wait()?.is_some() {
                self.child = None;
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        anyhow::bail!("Apache Pulsar did not stop within {within:?} of SIGTERM")
    }

    fn write_config(&self) -> anyhow::Result<PathBuf> {
        let mut conf = format!(
            "clusterName=standalone
bindAddress=127.0.0.1
advertisedAddress=127.0.0.1
brokerServicePort={}
webServicePort={}
metadataStoreUrl=
managedLedgerDefaultEnsembleSize=1
managedLedgerDefaultWriteQuorum=1
managedLedgerDefaultAckQuorum=1
loadManagerClassName=org.apache.pulsar.broker.loadbalance.NoopLoadManager
loadBalancerEnabled=false
allowLoopback=true
journalSyncData=false
journalMaxGroupWaitMSec=1
ledgerStorageClass=org.apache.bookkeeper.bookie.storage.ldb.DbLedgerStorage
dbStorage_writeCacheMaxSizeMb=16
dbStorage_readAheadCacheMaxSizeMb=16
dbStorage_rocksDB_blockCacheSize=16777216
diskUsageThreshold=0.99
diskUsageWarnThreshold=0.99
bookkeeperUseV2WireProtocol=true
managedLedgerCacheSizeMB=32
numIOThreads=2
numHttpServerThreads=4
numOrderedExecutorThreads=2
numExecutorThreadPoolSize=2
numCacheExecutorThreadPoolSize=2
bookkeeperClientNumWorkerThreads=2
defaultNumberOfNamespaceBundles=1
webSocketServiceEnabled=false
functionsWorkerEnabled=false
transactionCoordinatorEnabled=false
allowAutoTopicCreation=true
allowAutoTopicCreationType=non-partitioned
brokerDeleteInactiveTopicsEnabled=false
statusFilePath=
",
            self.broker_port, self.web_port
        );
        if let Some(auth) = &self.auth {
            let key = self.data.join("secret.key");
            std::fs::write(&key, &auth.secret)?;
            let admin = self.data.join("admin.token");
            std::fs::write(&admin, auth.token(ADMIN_ROLE))?;
            conf.push_str(&format!(
                "authenticationEnabled=true
authenticationProviders=org.apache.pulsar.broker.authentication.AuthenticationProviderToken
tokenSecretKey=file://{}
authorizationEnabled=true
superUserRoles={ADMIN_ROLE}
brokerClientAuthenticationPlugin=org.apache.pulsar.client.impl.auth.AuthenticationToken
brokerClientAuthenticationParameters=file://{}
",
                key.display(),
                admin.display()
            ));
        }
        for setting in &self.settings {
            conf.push_str(setting);
            conf.push('\n');
        }
        let path = self.data.join("standalone.conf");
        std::fs::write(&path, conf)?;
        let log4j = self.data.join("log4j2.xml");
        std::fs::write(
            &log4j,
            r#"<Configuration status="warn"><Appenders><Console name="c" target="SYSTEM_OUT"><PatternLayout pattern="%d{HH:mm:ss.SSS} %-5level [%t] %c{1} - %msg%n"/></Console></Appenders><Loggers><Root level="warn"><AppenderRef ref="c"/></Root></Loggers></Configuration>"#,
        )?;
        Ok(path)
    }

    fn launch(&mut self, wipe: bool) -> anyhow::Result<()> {
        let conf = self.write_config()?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.data.join("broker.log"))?;
        // The JVM unpacks RocksDB's and Netty's native libraries into its temporary folder at
        // every start and removes them only at a clean exit: under the system's /tmp, brokers
        // SIGKILLed by the tests left 3,490 copies (45 GB) on this machine. Inside the broker's
        // own folder they go with it.
        let scratch = self.data.join("jvm-tmp");
        std::fs::create_dir_all(&scratch)?;
        let mut command = Command::new("java");
        crate::orphans::owned(&mut command)
            .args(JVM_FLAGS)
            .arg(format!("-Djava.io.tmpdir={}", scratch.display()))
            .arg(format!(
                "-Dlog4j.configurationFile={}",
                self.data.join("log4j2.xml").display()
            ))
            .arg(self.class_sharing())
            .arg("-cp")
            .arg(format!("{}/*", jars()?.display()))
            .arg("org.apache.pulsar.PulsarStandaloneStarter")
            .arg("--config")
            .arg(&conf)
            .args(["--no-functions-worker", "--no-stream-storage"])
            .arg("--metadata-dir")
            .arg(self.data.join("metadata"))
            .arg("--bookkeeper-port")
            .arg(self.bookie_port.to_string())
            .arg("--bookkeeper-dir")
            .arg(self.data.join("bookkeeper"))
            // Absent, so standalone keeps its RocksDB metadata store (no ZooKeeper).
            .arg("--zookeeper-dir")
            .arg(self.data.join("zookeeper-unused"))
            .current_dir(&self.data)
            .stdout(log.try_clone()?)
            .stderr(log);
        if wipe {
            command.arg("--wipe-data");
        }
        self.child = Some(command.spawn().context("starting java (Apache Pulsar)")?);
        self.wait_ready()
    }

    /// Ready when the default namespace exists (the web port answers before it does).
    fn wait_ready(&mut self) -> anyhow::Result<()> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    anyhow::bail!(
                        "Apache Pulsar exited ({status}); the end of {}:\n{}",
                        self.data.join("broker.log").display(),
                        self.log_tail()
                    );
                }
            }
            // Ours answers, not another broker that holds the port this one failed to bind.
            let ours = self.child.as_ref().is_some_and(|child| {
                crate::embedded::process_listens_on(child.id(), self.web_port)
            });
            if ours
                && self
                    .admin_get("/admin/v2/namespaces/public")
                    .is_some_and(|body| body.contains("public/default"))
            {
                self.create_namespaces()?;
                // After a restart the namespaces exist before their bundles are served again (a
                // client subscribing then was refused once): wait until topics of each resolve.
                while started.elapsed() < Duration::from_secs(120) {
                    let served = NAMESPACES.iter().all(|namespace| {
                        self.admin_get(&format!(
                            "/lookup/v2/topic/non-persistent/tg/{namespace}/ready-check"
                        ))
                        .is_some()
                            && self
                                .admin_get(&format!(
                                    "/lookup/v2/topic/persistent/tg/{namespace}/ready-check"
                                ))
                                .is_some()
                    });
                    if served {
                        return Ok(());
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                anyhow::bail!("Apache Pulsar did not serve TrustGraph's namespaces within 120 s");
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        anyhow::bail!(
            "Apache Pulsar was not ready within 120 s; see {}",
            self.data.join("broker.log").display()
        )
    }

    /// The last lines of the broker's log, for an error that says why it stopped.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.data.join("broker.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// TrustGraph's tenant and the namespaces of its topics, as a TrustGraph deployment's
    /// initialisation creates them (Apache Pulsar has only `public/default` out of the box).
    fn create_namespaces(&self) -> anyhow::Result<()> {
        let tenant = r#"{"allowedClusters": ["standalone"], "adminRoles": []}"#;
        self.admin_put("/admin/v2/tenants/tg", tenant)?;
        for namespace in NAMESPACES {
            self.admin_put(&format!("/admin/v2/namespaces/tg/{namespace}"), "{}")?;
        }
        Ok(())
    }

    /// A PUT on the admin API; an answer of 409 (it exists: a restart) counts as done.
    fn admin_put(&self, path: &str, body: &str) -> anyhow::Result<()> {
        let (status, answer) = self
            .admin("PUT", path, body)
            .with_context(|| format!("PUT {path}"))?;
        anyhow::ensure!(
            (200..300).contains(&status) || status == 409,
            "PUT {path}: {status} {answer}"
        );
        Ok(())
    }

    /// The body of a GET on the admin API, if it answered 200.
    fn admin_get(&self, path: &str) -> Option<String> {
        match self.admin("GET", path, "").ok()? {
            (200, body) => Some(body),
            _ => None,
        }
    }

    /// A call of the broker's admin REST API (`path` from `/admin/...`, `body` JSON): its status
    /// and body.
    pub fn admin(&self, method: &str, path: &str, body: &str) -> anyhow::Result<(u16, String)> {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", self.web_port))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        let auth = self
            .admin_token()
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        write!(
            stream,
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n{auth}Accept: application/json\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").context("no HTTP answer")?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("no HTTP status")?;
        Ok((status, body.to_owned()))
    }
}

impl Drop for ApacheBroker {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_base64url_jwts_without_padding() {
        assert_eq!(base64url(b"{\"alg\":\"HS256\"}"), "eyJhbGciOiJIUzI1NiJ9");
        assert_eq!(base64url(b"a"), "YQ");
        assert_eq!(base64url(b"ab"), "YWI");
        assert_eq!(base64url(b"abc"), "YWJj");
        let token = TokenAuth::new().token("admin");
        assert_eq!(token.split('.').count(), 3);
        assert!(token.starts_with("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhZG1pbiJ9."));
    }
}
