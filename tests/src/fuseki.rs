//! Apache Jena Fuseki, a SPARQL server this project does not own, on a free loopback port with a
//! TDB2 dataset in a folder of its own: the store behind the aggregator when `AGENT_E2E_STORE=fuseki`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Whether this test run keeps the graph in Fuseki.
pub fn on_fuseki() -> bool {
    std::env::var("AGENT_E2E_STORE").is_ok_and(|s| s == "fuseki")
}

/// A Fuseki server; SIGKILLed (and its data removed) on drop.
pub struct Fuseki {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl Fuseki {
    /// A server ready for queries when this returns.
    pub fn start() -> Fuseki {
        let port = agent_bus::embedded::free_port().unwrap();
        let dir =
            std::env::temp_dir().join(format!("agent-e2e-fuseki-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tdb2")).unwrap();
        let mut fuseki = Fuseki {
            child: None,
            port,
            dir,
        };
        fuseki.launch();
        fuseki
    }

    /// The dataset's base URL: `/query`, `/update` and `/data` under it.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}/ds", self.port)
    }

    /// SIGKILL, then start again on the same data.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    fn launch(&mut self) {
        let jars = crate::installed_path("fuseki.sh");
        let log = std::fs::File::create(self.dir.join("fuseki.log")).unwrap();
        let child = Command::new("java")
            .args([
                "-Xms64m",
                "-Xmx384m",
                "-XX:TieredStopAtLevel=1",
                "-Xshare:auto",
            ])
            .arg("-cp")
            .arg(format!("{}/*", jars.display()))
            .arg("org.apache.jena.fuseki.main.cmds.FusekiMainCmd")
            .args(["--localhost", "--port", &self.port.to_string(), "--update"])
            .arg("--tdb2")
            .arg("--loc")
            .arg(self.dir.join("tdb2"))
            .arg("/ds")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("starting java (Fuseki)");
        self.child = Some(child);
        self.wait_ready();
    }

    fn wait_ready(&mut self) {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                panic!(
                    "Fuseki exited ({status}); see {}",
                    self.dir.join("fuseki.log").display()
                );
            }
            if self.answers() {
                return;
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        panic!("Fuseki was not ready within 120 s");
    }

    /// Whether `ASK {}` is answered 200.
    fn answers(&self) -> bool {
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let request = "GET /ds/query?query=ASK%7B%7D HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
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

impl Drop for Fuseki {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
