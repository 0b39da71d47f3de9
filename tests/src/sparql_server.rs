//! SPARQL servers this project does not own, each on a free loopback port with its data in a
//! folder of its own: the store behind the aggregator in the tiers that keep the graph in one
//! (`AGENT_E2E_STORE=fuseki` or `oxigraph`). Neither gives a compare-and-set the journal could
//! rely on; the design needs none.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Apache Jena Fuseki with a TDB2 dataset (Maven Central, `scripts/fuseki.sh`), which runs one
    /// writer at a time.
    Fuseki,
    /// Oxigraph's own server on RocksDB (PyPI, `scripts/oxigraph-server.sh`), which evaluates a
    /// conditional update on a snapshot and does not serialise updates.
    Oxigraph,
}

impl Kind {
    /// The server this test run keeps the graph in, if any (`AGENT_E2E_STORE`).
    pub fn of_this_run() -> Option<Kind> {
        match std::env::var("AGENT_E2E_STORE").as_deref() {
            Ok("fuseki") => Some(Kind::Fuseki),
            Ok("oxigraph") => Some(Kind::Oxigraph),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kind::Fuseki => "Fuseki",
            Kind::Oxigraph => "Oxigraph server",
        }
    }

    /// Where its SPARQL services are: `/query`, `/update` and the Graph Store Protocol below it.
    fn base_path(self) -> &'static str {
        match self {
            Kind::Fuseki => "/ds",
            Kind::Oxigraph => "",
        }
    }
}

/// A running server; SIGKILLed (and its data removed) on drop.
pub struct SparqlServer {
    kind: Kind,
    child: Option<Child>,
    port: agent_bus::embedded::KeptPort,
    dir: PathBuf,
}

impl SparqlServer {
    /// A server ready for queries when this returns.
    pub fn start(kind: Kind) -> SparqlServer {
        let mut attempt = 1;
        loop {
            // Kept across its restarts: outside the range an outgoing connection is given.
            let kept = agent_bus::embedded::KeptPort::choose(&[]).unwrap();
            let port = kept.port();
            // Not named by the port alone: a server restarting leaves its port free for a moment,
            // and one started meanwhile could be given it and wipe this folder.
            let dir = std::env::temp_dir().join(format!(
                "agent-e2e-sparql-{}-{port}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("data")).unwrap();
            let mut server = SparqlServer {
                kind,
                child: None,
                port: kept,
                dir,
            };
            match server.launch() {
                Ok(()) => return server,
                // The port was free when chosen, but another process may take it before the JVM
                // binds it (Fuseki then exits 2: a CI run failed so, 2026-12-05): another port.
                Err(exited) if attempt < 3 => {
                    eprintln!("{exited}; trying another port");
                    attempt += 1;
                }
                Err(exited) => panic!("{exited}"),
            }
        }
    }

    /// The one this test run asks for (`AGENT_E2E_STORE`), if any.
    pub fn of_this_run() -> Option<SparqlServer> {
        Kind::of_this_run().map(SparqlServer::start)
    }

    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Its base URL, as `GRAPH_STORE` takes it.
    pub fn endpoint(&self) -> String {
        format!(
            "http://127.0.0.1:{}{}",
            self.port.port(),
            self.kind.base_path()
        )
    }

    /// SIGKILL, then start again on the same data and port (the aggregator was told it). A port
    /// taken meanwhile is asked for again for a while: what holds it may be gone soon.
    pub fn restart(&mut self) {
        self.kill();
        let started = Instant::now();
        while let Err(exited) = self.launch() {
            if started.elapsed() > Duration::from_secs(60) {
                panic!("{exited}");
            }
            eprintln!("{exited}; trying the same port again");
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// Starts the server; `Err` says why it exited before it was ready.
    fn launch(&mut self) -> Result<(), String> {
        let log = std::fs::File::create(self.dir.join("server.log")).unwrap();
        let data = self.dir.join("data");
        let mut command = match self.kind {
            Kind::Fuseki => {
                let jars = crate::installed_path("fuseki.sh");
                let mut java = Command::new("java");
                java.args([
                    "-Xms64m",
                    "-Xmx384m",
                    "-XX:TieredStopAtLevel=1",
                    "-Xshare:auto",
                ])
                .arg("-cp")
                .arg(format!("{}/*", jars.display()))
                .arg("org.apache.jena.fuseki.main.cmds.FusekiMainCmd")
                .args([
                    "--localhost",
                    "--port",
                    &self.port.port().to_string(),
                    "--update",
                ])
                .arg("--tdb2")
                .arg("--loc")
                .arg(&data)
                .arg("/ds");
                java
            }
            Kind::Oxigraph => {
                let bin = crate::installed_path("oxigraph-server.sh");
                let mut oxigraph = Command::new(bin.join("oxigraph"));
                oxigraph
                    .arg("serve")
                    .arg("--location")
                    .arg(&data)
                    .args(["--bind", &format!("127.0.0.1:{}", self.port.port())]);
                oxigraph
            }
        };
        let child = agent_bus::orphans::owned(&mut command)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.kind.name()));
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), String> {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                return Err(self.exit_report(status));
            }
            // The server we started answers, not another one on the port it failed to bind.
            let ours = self.child.as_ref().is_some_and(|child| {
                agent_bus::embedded::process_listens_on(child.id(), self.port.port())
            });
            if ours && self.answers() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("{} was not ready within 120 s", self.kind.name());
    }

    /// Why the server exited before it was ready: the end of its log (CI keeps only the test's
    /// output) and who listens on its port, if anyone does.
    fn exit_report(&self, status: std::process::ExitStatus) -> String {
        let log_path = self.dir.join("server.log");
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        // A Java stack's frames say less than its exceptions' messages.
        let lines: Vec<&str> = log
            .lines()
            .filter(|line| !line.trim_start().starts_with("at ") && !line.contains("... "))
            .collect();
        let tail = lines[lines.len().saturating_sub(12)..].join("\n  ");
        let holders = agent_bus::embedded::processes_listening_on(self.port.port());
        format!(
            "{} exited ({status}) on port {}; listening there: {holders:?}; the end of {}:\n  {tail}",
            self.kind.name(),
            self.port.port(),
            log_path.display()
        )
    }

    /// Whether `ASK {}` is answered 200.
    fn answers(&self) -> bool {
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port.port())) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let request = format!(
            "GET {}/query?query=ASK%7B%7D HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n",
            self.kind.base_path()
        );
        if stream.write_all(request.as_bytes()).is_err() {
            return false;
        }
        let mut head = [0u8; 12];
        stream.read_exact(&mut head).is_ok() && head.ends_with(b" 200")
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for SparqlServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
