//! Test harness for end-to-end tests: a real broker (`pulsar-lite` on a free loopback port, or
//! Apache Pulsar's standalone), the scripted LLM, and the services: in the test process where a
//! test only talks to them (`run(settings, shutdown)`, as their binaries run it), the real binaries
//! as child processes where it SIGKILLs them, reads their exit status, CPU or metrics.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub use agent_bus::apache;

pub mod in_process;
pub mod librarian;
pub mod raw_pulsar;
mod running;
pub mod sparql_server;

use running::{NotListening, Running};

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agent_bus::embedded::EmbeddedBroker;
use agent_bus::{AgentClient, Bus, Topics};
use agent_schema::{AgentRequest, AgentResponse};
use anyhow::Context;
use scripted_llm::{Script, ScriptedLlm};

/// The repository root.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The broker of one test, on a free loopback port with a temporary data folder: pulsar-lite, or
/// Apache Pulsar's standalone when `AGENT_E2E_BROKER=apache` (the tier `scripts/test.sh` runs on
/// it).
pub enum Broker {
    Lite(EmbeddedBroker),
    Apache(apache::ApacheBroker),
}

/// Whether this test run is the Apache Pulsar tier.
pub fn on_apache_pulsar() -> bool {
    std::env::var("AGENT_E2E_BROKER").is_ok_and(|b| b == "apache")
}

/// The Apache Pulsar tier's broker settings over standalone's defaults: `key=value` items, split
/// on whitespace, in `AGENT_E2E_APACHE_SETTINGS`, or `compose` for what `docker-compose.yml` ships
/// ([`compose_apache_settings`]). `scripts/test.sh` runs one tier with `compose` and the others
/// with the defaults an existing cluster most likely has.
pub fn apache_settings() -> anyhow::Result<Vec<String>> {
    let given = std::env::var("AGENT_E2E_APACHE_SETTINGS").unwrap_or_default();
    if given.trim() == "compose" {
        return compose_apache_settings();
    }
    Ok(given.split_whitespace().map(str::to_owned).collect())
}

/// The broker settings `docker-compose.yml` gives Apache Pulsar, as `key=value` items: its
/// `PULSAR_PREFIX_key: "value"` lines (quotes optional, a trailing comment allowed), which the
/// image's `apply-config-from-env.py` writes into `standalone.conf`. None found is an error, not a
/// broker on defaults.
pub fn compose_apache_settings() -> anyhow::Result<Vec<String>> {
    let compose = std::fs::read_to_string(repo_root().join("docker-compose.yml"))?;
    let settings: Vec<String> = compose
        .lines()
        .filter_map(|line| line.trim().strip_prefix("PULSAR_PREFIX_"))
        .filter_map(|setting| {
            let (key, value) = setting.split_once(':')?;
            let value = value.split('#').next()?.trim().trim_matches(['"', '\'']);
            (!value.is_empty()).then(|| format!("{key}={value}"))
        })
        .collect();
    anyhow::ensure!(
        !settings.is_empty(),
        "no PULSAR_PREFIX_ setting in docker-compose.yml"
    );
    Ok(settings)
}

impl Broker {
    pub fn start() -> anyhow::Result<Broker> {
        Self::start_on(0)
    }

    /// A broker set up as the project ships it, whatever the tier: pulsar-lite with the settings
    /// `scripts/pulsar-lite.sh` starts it with, or Apache Pulsar with `docker-compose.yml`'s.
    pub fn start_as_shipped() -> anyhow::Result<Broker> {
        Self::start_configured(0, compose_apache_settings)
    }

    /// A broker on `port`, for a test that starts a service before its broker.
    pub fn start_on(port: u16) -> anyhow::Result<Broker> {
        Self::start_configured(port, apache_settings)
    }

    /// pulsar-lite, or Apache Pulsar with `apache_settings` when this is its tier.
    fn start_configured(
        port: u16,
        apache_settings: fn() -> anyhow::Result<Vec<String>>,
    ) -> anyhow::Result<Broker> {
        Ok(if on_apache_pulsar() {
            Broker::Apache(apache::ApacheBroker::start_with(
                port,
                None,
                &apache_settings()?,
            )?)
        } else {
            Broker::Lite(EmbeddedBroker::start(port, None)?)
        })
    }

    pub fn url(&self) -> String {
        match self {
            Broker::Lite(b) => b.url(),
            Broker::Apache(b) => b.url(),
        }
    }

    /// SIGKILL (unless [`Broker::stop`] did) and start again on the same data.
    pub fn restart(&mut self) -> anyhow::Result<()> {
        match self {
            Broker::Lite(b) => Ok(b.restart()?),
            Broker::Apache(b) => b.restart(),
        }
    }

    /// Freezes it (SIGSTOP) or lets it go on (SIGCONT): its connections stay open and it reads
    /// nothing from them, as a broker whose host hangs.
    pub fn freeze(&self, frozen: bool) {
        let pid = match self {
            Broker::Lite(b) => b.pid(),
            Broker::Apache(b) => b.pid(),
        }
        .expect("a running broker");
        let signal = if frozen { "-STOP" } else { "-CONT" };
        let status = std::process::Command::new("kill")
            .args([signal, &pid.to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {signal} {pid}");
    }

    /// SIGKILL, leaving it down until [`Broker::restart`]: an outage of the test's length.
    pub fn stop(&mut self) {
        match self {
            Broker::Lite(b) => b.stop(),
            Broker::Apache(b) => b.stop(),
        }
    }

    /// Evidence of pulsar-lite's ghost-consumer bug: connections it dropped on a reset without
    /// removing their consumers (see [`EmbeddedBroker::reset_connections`]). Apache Pulsar removes
    /// a consumer when its connection dies: never any.
    pub fn reset_connections(&self) -> Vec<String> {
        match self {
            Broker::Lite(b) => b.reset_connections(),
            Broker::Apache(_) => Vec::new(),
        }
    }
}

/// Where cargo put the binaries of this workspace (next to the test executable's `deps/`).
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: build the binaries first (cargo build --workspace --bins)",
        path.display()
    );
    path
}

/// The seal key every orchestrator and aggregator the harness starts shares (`AGENT_SEAL_KEY`).
pub const SEAL_KEY: &str = "e2e-seal-key";

/// The properties of an explainability message `payload` as the services send it: sealed with
/// [`SEAL_KEY`], so the aggregator writes the agent's records from it.
pub fn sealed_explain(payload: &[u8]) -> agent_bus::Properties {
    let key = agent_bus::seal::SealKey::new(SEAL_KEY.as_bytes());
    [(
        agent_bus::seal::EXPLAIN_SEAL_PROPERTY.to_owned(),
        key.seal_explain(payload),
    )]
    .into()
}

/// An orchestrator: inside the test process ([`in_process::InProcess`]) unless the test asked for a
/// child process (one it SIGKILLs, SIGTERMs, gives environment or scrapes: the metrics registry is
/// per process); either way it is stopped without draining on drop.
pub struct Orchestrator {
    running: Running,
    /// What it was started with, to start it again.
    launch: Vec<std::ffi::OsString>,
    env: Vec<(String, String)>,
}

/// Where a service runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// A thread of the test process.
    InProcess,
    /// Its binary, for tests that SIGKILL or SIGTERM it, read its exit status, process id or
    /// CPU, scrape its metrics (the registry is per process) or give it environment.
    Child,
}

impl Orchestrator {
    pub fn spawn(
        broker: &Broker,
        llm: &ScriptedLlm,
        config_dir: &std::path::Path,
        extra: &[&str],
    ) -> Orchestrator {
        Self::spawn_with_env(broker, llm, config_dir, extra, &[])
    }

    /// The `agent-orchestrator` binary as a child process, for a test that SIGKILLs or SIGTERMs it.
    pub fn child(
        broker: &Broker,
        llm: &ScriptedLlm,
        config_dir: &std::path::Path,
        extra: &[&str],
    ) -> Orchestrator {
        Self::start(
            Place::Child,
            &broker.url(),
            &llm.base_url(),
            "scripted",
            config_dir,
            extra,
            &[],
        )
    }

    /// An orchestrator that journals its iterations in `aggregator`'s store (which must have been
    /// started with `--config-token token`), with extra environment (such as `AGENT_FAULT`, which
    /// makes it a child process).
    pub fn spawn_journaled(
        broker: &Broker,
        llm: &ScriptedLlm,
        aggregator: &Aggregator,
        token: &str,
        env: &[(&str, &str)],
    ) -> Orchestrator {
        Self::journaled(Place::InProcess, broker, llm, aggregator, token, env)
    }

    /// [`Orchestrator::spawn_journaled`] in `place`.
    pub fn journaled(
        place: Place,
        broker: &Broker,
        llm: &ScriptedLlm,
        aggregator: &Aggregator,
        token: &str,
        env: &[(&str, &str)],
    ) -> Orchestrator {
        Self::journaled_with(place, broker, llm, aggregator, token, &seed_dir(), env)
    }

    /// [`Orchestrator::journaled`] with the configuration in `config_dir`.
    pub fn journaled_with(
        place: Place,
        broker: &Broker,
        llm: &ScriptedLlm,
        aggregator: &Aggregator,
        token: &str,
        config_dir: &std::path::Path,
        env: &[(&str, &str)],
    ) -> Orchestrator {
        let extra = [
            "--graph-store",
            &aggregator.endpoint,
            "--config-token",
            token,
        ];
        Self::start(
            place,
            &broker.url(),
            &llm.base_url(),
            "scripted",
            config_dir,
            &extra,
            env,
        )
    }

    pub fn spawn_with_env(
        broker: &Broker,
        llm: &ScriptedLlm,
        config_dir: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Orchestrator {
        Self::spawn_on_url(&broker.url(), llm, config_dir, extra, env)
    }

    /// An orchestrator for a broker at `url` that may not be up yet.
    pub fn spawn_on_url(
        url: &str,
        llm: &ScriptedLlm,
        config_dir: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Orchestrator {
        Self::spawn_for_llm(url, &llm.base_url(), "scripted", config_dir, extra, env)
    }

    /// An orchestrator for a broker at `url` calling any OpenAI-compatible server at `llm_url`.
    pub fn spawn_for_llm(
        url: &str,
        llm_url: &str,
        model: &str,
        config_dir: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Orchestrator {
        Self::start(
            Place::InProcess,
            url,
            llm_url,
            model,
            config_dir,
            extra,
            env,
        )
    }

    /// An orchestrator in `place`. Environment is per process: one given any runs as a child.
    pub fn start(
        place: Place,
        url: &str,
        llm_url: &str,
        model: &str,
        config_dir: &std::path::Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Orchestrator {
        let mut launch: Vec<std::ffi::OsString> = vec![
            "--pulsar-url".into(),
            url.into(),
            "--llm-base-url".into(),
            llm_url.into(),
            "--llm-model".into(),
            model.into(),
            "--config-dir".into(),
            config_dir.into(),
        ];
        launch.extend(extra.iter().map(Into::into));
        // A tier of the suite runs every orchestrator with its dialogs continued in process.
        if std::env::var("AGENT_E2E_CONTINUE_IN_PROCESS").is_ok_and(|v| v == "1") {
            launch.push("--continue-in-process".into());
        }
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let place = if env.is_empty() { place } else { Place::Child };
        let running = Self::launch(place, &launch, &env);
        Orchestrator {
            running,
            launch,
            env,
        }
    }

    fn launch(place: Place, args: &[std::ffi::OsString], env: &[(String, String)]) -> Running {
        match place {
            Place::Child => Running::Child(Self::launch_child(args, env)),
            Place::InProcess => Running::InProcess(Self::launch_in_process(args)),
        }
    }

    fn launch_in_process(args: &[std::ffi::OsString]) -> in_process::InProcess {
        // The same settings as a child's: its own free port and sealed unless the test says
        // otherwise, and no journal unless asked (clap would otherwise take GRAPH_STORE from the
        // test's environment).
        let given = |flag: &str| {
            args.iter()
                .any(|a| a.to_str().is_some_and(|a| a.starts_with(flag)))
        };
        let mut full: Vec<std::ffi::OsString> = Vec::new();
        if !given("--http-addr") {
            full.extend(["--http-addr".into(), "127.0.0.1:0".into()]);
        }
        if !given("--seal-key") {
            full.extend(["--seal-key".into(), SEAL_KEY.into()]);
        }
        full.extend(args.iter().cloned());
        let asked_for_store = given("--graph-store");
        let mut settings: agent_orchestrator::Settings =
            running::settings("agent-orchestrator", full);
        if !asked_for_store {
            settings.graph_store = None;
        }
        in_process::InProcess::start("agent-orchestrator", move |shutdown| {
            agent_orchestrator::run(settings, shutdown)
        })
    }

    fn launch_child(args: &[std::ffi::OsString], env: &[(String, String)]) -> Child {
        running::command("agent-orchestrator")
            // Only what the test asks for: no journal or fault from the caller's environment.
            .env_remove("GRAPH_STORE")
            .env_remove("AGENT_FAULT")
            // Many orchestrators run at once: each its own free port unless a test names one.
            .env("AGENT_HTTP_ADDR", "127.0.0.1:0")
            // Sealed as in production; a test may override or clear it.
            .env("AGENT_SEAL_KEY", SEAL_KEY)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .args(args)
            .spawn()
            .unwrap()
    }

    /// Stops it without draining (SIGKILL for a child), then starts it again with the same
    /// settings, in the same place.
    pub fn kill_and_restart(&mut self) {
        self.kill();
        self.running = Self::launch(self.running.place(), &self.launch, &self.env);
    }

    /// Asks for a graceful stop (SIGTERM for a child): it then drains and exits by itself.
    pub fn terminate(&self) {
        self.running.terminate();
    }

    /// Freezes a child (SIGSTOP) or lets it go on (SIGCONT), as a long pause of the process
    /// would: its connections stay open and its timers run late.
    pub fn freeze(&self, frozen: bool) {
        self.running.freeze(frozen, "an orchestrator");
    }

    /// Stops it at once: SIGKILL for a child (no drain, no goodbye to the broker); in process, its
    /// runtime is torn down with its connections.
    pub fn kill(&mut self) {
        self.running.kill();
    }

    pub fn is_running(&mut self) -> bool {
        self.running.is_running()
    }

    /// Waits up to `timeout` for it to exit by itself; whether it did. Async, so the test's
    /// in-process services (the scripted LLM) keep running meanwhile.
    pub async fn exited_within(&mut self, timeout: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if !self.is_running() {
                return true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        false
    }
}

impl Drop for Orchestrator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// An aggregator with its own store directory and SPARQL endpoint: in the test process unless
/// the test asks for a child ([`Place::Child`]: one it SIGKILLs, reads the exit status or CPU of,
/// or scrapes, since the metrics registry is per process).
pub struct Aggregator {
    running: Running,
    pub endpoint: String,
    store_dir: PathBuf,
    /// `--graph-store`: its own directory, or another aggregator's endpoint.
    graph_store: String,
    broker_url: String,
    addr: String,
    extra: Vec<String>,
    /// The SPARQL server holding the graph, in the tiers that keep it in one we do not own.
    server: Option<sparql_server::SparqlServer>,
    /// Where a child's standard error goes, when a test reads it ([`Aggregator::log`]).
    stderr_log: Option<PathBuf>,
    /// Its port, held for it across its restarts.
    _port: agent_bus::embedded::KeptPort,
}

impl Aggregator {
    pub fn spawn(broker: &Broker) -> Aggregator {
        Self::spawn_with(broker, &[])
    }

    /// An aggregator with extra flags (such as `--fanout-timeout-secs`).
    pub fn spawn_with(broker: &Broker, extra: &[&str]) -> Aggregator {
        Self::start(Place::InProcess, broker, extra)
    }

    /// [`Aggregator::spawn_with`] in `place`.
    pub fn start(place: Place, broker: &Broker, extra: &[&str]) -> Aggregator {
        Self::start_over(
            place,
            broker,
            sparql_server::SparqlServer::of_this_run(),
            extra,
            None,
        )
    }

    /// An aggregator whose graph `server` holds (its own embedded store without one).
    pub fn spawn_over(
        broker: &Broker,
        server: Option<sparql_server::SparqlServer>,
        extra: &[&str],
    ) -> Aggregator {
        Self::start_over(Place::InProcess, broker, server, extra, None)
    }

    /// An aggregator in `place` whose graph `server` holds.
    pub fn start_over_server(
        place: Place,
        broker: &Broker,
        server: sparql_server::SparqlServer,
        extra: &[&str],
    ) -> Aggregator {
        Self::start_over(place, broker, Some(server), extra, None)
    }

    /// An aggregator in `place` whose graph `server` holds, its standard error going to
    /// `stderr_log` when given.
    fn start_over(
        place: Place,
        broker: &Broker,
        server: Option<sparql_server::SparqlServer>,
        extra: &[&str],
        stderr_log: Option<PathBuf>,
    ) -> Aggregator {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        let remote = server.as_ref().map(sparql_server::SparqlServer::endpoint);
        Self::start_logged(place, broker, remote, extra, server, stderr_log)
    }

    /// An aggregator that only serves its store (started with `--config-token token`): it
    /// consumes an explainability topic of its own, `name`, on which nobody publishes, so the
    /// agents' records reach its graph only through replicas on it ([`Aggregator::replica_on`]),
    /// which a test may kill, or freeze to hold the graph behind the responses.
    pub fn store_host(place: Place, broker: &Broker, token: &str, name: &str) -> Aggregator {
        let topic = format!("persistent://tg/flow/{name}");
        let flags = [
            "--config-token",
            token,
            "--explain-topic",
            &topic,
            "--subscription",
            name,
        ];
        Self::start(place, broker, &flags)
    }

    /// One more aggregator replica on the same subscriptions, writing to `store`'s graph over
    /// SPARQL with `token` (which `store` must have been given as `--config-token`). Always a
    /// child: a replica's updates go through `store`'s `/update`, and one process serialises its
    /// updates to endpoints (`agent_graph`'s process-wide lock), so a replica in the process of
    /// a `store` whose graph is itself an endpoint would hold that lock while `store` waits for it.
    pub fn replica_on(broker: &Broker, store: &Aggregator, token: &str) -> Aggregator {
        Self::replica_with(broker, store, token, &[])
    }

    /// [`Aggregator::replica_on`] with extra flags.
    pub fn replica_with(
        broker: &Broker,
        store: &Aggregator,
        token: &str,
        extra: &[&str],
    ) -> Aggregator {
        let mut flags = vec!["--config-token".to_owned(), token.to_owned()];
        flags.extend(extra.iter().map(|s| (*s).to_owned()));
        let extra = flags;
        Self::start_on_a_free_port(
            Place::Child,
            broker,
            Some(store.endpoint.clone()),
            extra,
            None,
        )
    }

    /// [`Aggregator::spawn_with`] in a child process, its standard error kept for
    /// [`Aggregator::log`].
    pub fn logged_child(broker: &Broker, extra: &[&str]) -> Aggregator {
        Self::start_over(
            Place::Child,
            broker,
            sparql_server::SparqlServer::of_this_run(),
            extra,
            Some(stderr_log_path()),
        )
    }

    /// An aggregator in a child process whose graph is in the SPARQL server at `endpoint`,
    /// which another aggregator may own already (a second owner of one server).
    /// Its standard error is kept for [`Aggregator::log`].
    pub fn child_over_endpoint(broker: &Broker, endpoint: &str, extra: &[&str]) -> Aggregator {
        let extra = extra.iter().map(|s| (*s).to_owned()).collect();
        Self::start_logged(
            Place::Child,
            broker,
            Some(endpoint.to_owned()),
            extra,
            None,
            Some(stderr_log_path()),
        )
    }

    /// One more journal owner on `broker`'s subscriptions and the graph of this run (a child, its
    /// standard error kept for [`Aggregator::log`]), which is expected to refuse to run: it is
    /// handed back once it listens or once it has stood down, whichever is seen first.
    pub fn second_owner(broker: &Broker, extra: &[&str]) -> Aggregator {
        Self::logged_child(broker, extra)
    }

    /// What a child started with its standard error kept has written there so far.
    pub fn log(&self) -> String {
        self.stderr_log
            .as_ref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .unwrap_or_default()
    }

    /// Starts one on a port that was free a moment ago. Between choosing the port and binding it,
    /// another test's outgoing connection may take it: the aggregator then stops at once, and
    /// another port is tried rather than fail the test (seen once in CI).
    fn start_on_a_free_port(
        place: Place,
        broker: &Broker,
        remote_store: Option<String>,
        extra: Vec<String>,
        server: Option<sparql_server::SparqlServer>,
    ) -> Aggregator {
        Self::start_logged(place, broker, remote_store, extra, server, None)
    }

    /// [`Aggregator::start_on_a_free_port`], a child's standard error going to `stderr_log`.
    fn start_logged(
        place: Place,
        broker: &Broker,
        remote_store: Option<String>,
        extra: Vec<String>,
        server: Option<sparql_server::SparqlServer>,
        stderr_log: Option<PathBuf>,
    ) -> Aggregator {
        let mut last = String::new();
        for _ in 0..3 {
            // Kept across its restarts: outside the range an outgoing connection is given.
            let kept = agent_bus::embedded::KeptPort::choose(&[]).unwrap();
            let port = kept.port();
            // Not named by the port alone: an aggregator killed and restarted leaves its port
            // free for a moment, and one started meanwhile could be given it and wipe the store.
            let store_dir = std::env::temp_dir().join(format!(
                "agent-e2e-graph-{}-{port}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            let _ = std::fs::remove_dir_all(&store_dir);
            let addr = format!("127.0.0.1:{port}");
            let graph_store = remote_store
                .clone()
                .unwrap_or_else(|| store_dir.display().to_string());
            let mut running = Self::launch(
                place,
                &broker.url(),
                &graph_store,
                &addr,
                &extra,
                stderr_log.as_deref(),
            );
            let answered = match running.wait_listening(&addr, "the aggregator") {
                Ok(()) => true,
                // A second journal owner may stand down within moments of binding its port,
                // before this loop sees it listen: that exit is the answer its test waits for.
                Err(NotListening::Exited(_)) if refused_as_second_owner(stderr_log.as_deref()) => {
                    true
                }
                Err(why) => {
                    last = why.to_string();
                    false
                }
            };
            if answered {
                return Aggregator {
                    running,
                    endpoint: format!("http://{addr}"),
                    store_dir,
                    graph_store,
                    broker_url: broker.url(),
                    addr,
                    extra,
                    server,
                    stderr_log,
                    _port: kept,
                };
            }
            drop(running);
            let _ = std::fs::remove_dir_all(&store_dir);
        }
        panic!("the aggregator stopped before listening, on three ports; the last {last}");
    }

    fn launch(
        place: Place,
        broker_url: &str,
        graph_store: &str,
        addr: &str,
        extra: &[String],
        stderr_log: Option<&std::path::Path>,
    ) -> Running {
        let args: Vec<&str> = [
            "--pulsar-url",
            broker_url,
            "--graph-store",
            graph_store,
            "--http-addr",
            addr,
        ]
        .into_iter()
        .chain(extra.iter().map(String::as_str))
        .collect();
        match place {
            Place::Child => {
                let mut command = running::command("agent-aggregator");
                command.env("AGENT_SEAL_KEY", SEAL_KEY).args(&args);
                if let Some(path) = stderr_log {
                    command.stderr(std::fs::File::create(path).unwrap());
                    // What a test reads of its journal owner's fence: when it listens, and when
                    // it owns the journal.
                    if std::env::var_os("RUST_LOG").is_none() {
                        command.env("RUST_LOG", "warn,agent_bus::owner_fence=info");
                    }
                }
                Running::Child(command.spawn().unwrap())
            }
            Place::InProcess => {
                // Sealed as in production unless the test gives a key (or none) itself.
                let sealed = !args.iter().any(|a| a.starts_with("--seal-key"));
                let full = sealed
                    .then_some(["--seal-key", SEAL_KEY])
                    .into_iter()
                    .flatten()
                    .chain(args)
                    .map(Into::into);
                let settings: agent_aggregator::AggregatorSettings =
                    running::settings("agent-aggregator", full);
                Running::InProcess(in_process::InProcess::start(
                    "agent-aggregator",
                    move |shutdown| agent_aggregator::run(settings, shutdown),
                ))
            }
        }
    }

    /// Stops it at once (SIGKILL for a child), then starts it again on the same store, in the
    /// same place.
    pub fn kill_and_restart(&mut self) {
        self.kill();
        self.running = Self::launch(
            self.running.place(),
            &self.broker_url,
            &self.graph_store,
            &self.addr,
            &self.extra,
            self.stderr_log.as_deref(),
        );
        if let Err(why) = self.running.wait_listening(&self.addr, "the aggregator") {
            panic!(
                "the aggregator stopped before listening on {}: {why}",
                self.addr
            );
        }
    }

    pub fn kill(&mut self) {
        self.running.kill();
    }

    pub fn is_running(&mut self) -> bool {
        self.running.is_running()
    }

    /// How it exited, if it did within `timeout` (a child's: see [`Place::Child`]).
    pub async fn exit_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        assert_eq!(
            self.running.place(),
            Place::Child,
            "only a child has an exit status"
        );
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if let Some(status) = self.running.exit_status() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Its process id, to watch its CPU (a child's: see [`Place::Child`]).
    pub fn pid(&self) -> u32 {
        self.running
            .pid()
            .expect("only an aggregator started as a child has a process id")
    }

    /// Freezes a child (SIGSTOP) or lets it go on (SIGCONT): its timers run late, as after a
    /// long pause or an outage.
    pub fn freeze(&self, frozen: bool) {
        self.running.freeze(frozen, "an aggregator");
    }

    /// The SPARQL server that holds its graph, when it is not its own store.
    pub fn sparql_server(&mut self) -> Option<&mut sparql_server::SparqlServer> {
        self.server.as_mut()
    }

    /// A client of its SPARQL endpoint.
    pub fn store(&self) -> agent_graph::GraphStore {
        agent_graph::GraphStore::open(&self.endpoint, None).unwrap()
    }
}

/// A fresh file for a child's standard error.
fn stderr_log_path() -> PathBuf {
    std::env::temp_dir().join(format!(
        "agent-e2e-aggregator-{}-{:08x}.log",
        std::process::id(),
        rand::random::<u32>()
    ))
}

/// Whether the aggregator that wrote `log` exited because another owns the journal (the refusal
/// `owner_fence` and the store's beacon give), rather than for a port taken under it.
fn refused_as_second_owner(log: Option<&std::path::Path>) -> bool {
    log.and_then(|path| std::fs::read_to_string(path).ok())
        .is_some_and(|text| text.contains("already owns the journal"))
}

impl Drop for Aggregator {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.store_dir);
        if let Some(log) = &self.stderr_log {
            let _ = std::fs::remove_file(log);
        }
    }
}

/// The share of one core process `pid` used over the next `window` (user and system time, from
/// /proc).
pub async fn cpu_share(pid: u32, window: Duration) -> f64 {
    let seconds = || agent_bus::embedded::cpu_seconds(&pid.to_string()).unwrap_or(0.0);
    let before = seconds();
    tokio::time::sleep(window).await;
    (seconds() - before) / window.as_secs_f64()
}

/// What most end-to-end tests talk to: a broker, an aggregator holding the graph and the journal,
/// the scripted LLM, and one journaled orchestrator. The services run in the test process.
/// Fields drop in their order: the orchestrator first, the broker last.
pub struct Stack {
    pub orchestrator: Orchestrator,
    pub llm: ScriptedLlm,
    pub aggregator: Aggregator,
    pub broker: Broker,
}

impl Stack {
    /// The aggregator takes `token` for its journal and its writes (`--config-token`) and
    /// `aggregator_flags` besides; the orchestrator reads its configuration from `config_dir`
    /// (such as [`seed_dir`]) and `script` is the LLM's.
    pub async fn journaled(
        token: &str,
        script: &str,
        config_dir: &std::path::Path,
        aggregator_flags: &[&str],
    ) -> Stack {
        let broker = Broker::start().unwrap();
        let flags: Vec<&str> = ["--config-token", token]
            .into_iter()
            .chain(aggregator_flags.iter().copied())
            .collect();
        let aggregator = Aggregator::spawn_with(&broker, &flags);
        let llm = scripted_llm(script).await;
        let orchestrator = Orchestrator::journaled_with(
            Place::InProcess,
            &broker,
            &llm,
            &aggregator,
            token,
            config_dir,
            &[],
        );
        Stack {
            orchestrator,
            llm,
            aggregator,
            broker,
        }
    }
}

/// A scripted LLM on a free port.
pub async fn scripted_llm(script: &str) -> ScriptedLlm {
    ScriptedLlm::start(
        Script::from_json(script).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap()
}

/// A config directory holding `files` (`(type, json)`), for tests that need their own tools or limits.
pub fn config_dir(name: &str, files: &[(&str, &str)]) -> PathBuf {
    // Unique per call: two tests of one process that pick the same name must not rewrite the
    // folder while the other's orchestrator reads it (seen: a limit missing from one of them).
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "agent-e2e-config-{}-{call}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (kind, json) in files {
        std::fs::write(dir.join(format!("{kind}.json")), json).unwrap();
    }
    dir
}

/// The seed configuration with some of its files replaced by `overrides` (`(type, json)`).
pub fn seed_with(name: &str, overrides: &[(&str, &str)]) -> PathBuf {
    let mut files: Vec<(String, String)> = std::fs::read_dir(seed_dir())
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let kind = path.file_stem().unwrap().to_string_lossy().into_owned();
            (kind, std::fs::read_to_string(&path).unwrap())
        })
        .filter(|(kind, _)| !overrides.iter().any(|(k, _)| k == kind))
        .collect();
    files.extend(
        overrides
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    let borrowed: Vec<(&str, &str)> = files
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    config_dir(name, &borrowed)
}

/// The entry point of the reference "everything" MCP server from the npm registry
/// (`tests/mcp-servers`, installed by `scripts/setup.sh`).
pub fn everything_server() -> PathBuf {
    let path = repo_root().join(
        "tests/mcp-servers/node_modules/@modelcontextprotocol/server-everything/dist/index.js",
    );
    assert!(
        path.exists(),
        "{} is missing: run scripts/setup.sh",
        path.display()
    );
    path
}

/// What `scripts/<script> path` prints (it installs what it names first, once): a path.
pub fn installed_path(script: &str) -> PathBuf {
    let out = Command::new(repo_root().join("scripts").join(script))
        .arg("path")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/{script} path failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// The everything server over streamable HTTP (at `/mcp`) on `port`; SIGKILLed on drop.
pub struct EverythingHttp {
    child: Child,
    pub port: u16,
}

impl EverythingHttp {
    pub fn start(port: u16) -> EverythingHttp {
        let child = agent_bus::orphans::owned(&mut Command::new("node"))
            .arg(everything_server())
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_listening(&format!("127.0.0.1:{port}"), "the MCP everything server");
        EverythingHttp { child, port }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn restart(&mut self) {
        self.kill();
        *self = EverythingHttp::start(self.port);
    }
}

impl Drop for EverythingHttp {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The seeded config directory of the repository.
pub fn seed_dir() -> PathBuf {
    repo_root().join("config-seed")
}

/// A client on the default topics.
pub async fn client(broker: &Broker) -> AgentClient {
    // Just after a broker restart, a connection can be refused for a moment (a client tries again
    // as a user's would); a refusal that lasts is the failure.
    let started = Instant::now();
    loop {
        let attempt = async {
            let bus = Bus::connect(&broker.url(), None).await?;
            AgentClient::connect(&bus, &Topics::trustgraph("default", "default")).await
        };
        match attempt.await {
            Ok(client) => return client,
            // A broker restarting on a loaded machine (Apache Pulsar's JVM) can let one attempt
            // time out after 30 s by itself: the window allows for more than one.
            Err(e) if started.elapsed() < Duration::from_secs(90) => {
                eprintln!("client: {e}; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("no client on {}: {e}", broker.url()),
        }
    }
}

pub fn request(question: &str, streaming: bool) -> AgentRequest {
    AgentRequest {
        question: question.into(),
        collection: "default".into(),
        streaming,
        ..AgentRequest::default()
    }
}

/// Reads responses of dialog `id` until `end_of_dialog`, failing after `timeout`.
pub async fn collect_dialog(
    client: &mut AgentClient,
    id: &str,
    timeout: Duration,
) -> anyhow::Result<Vec<AgentResponse>> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let (rid, response) = tokio::time::timeout_at(deadline, client.next())
            .await
            .with_context(|| format!("dialog {id} did not end; got {out:#?}"))??;
        if rid != id {
            continue;
        }
        let done = response.end_of_dialog;
        out.push(response);
        if done {
            return Ok(out);
        }
    }
}

/// Reads responses until every dialog in `ids` has ended, then two quiet seconds longer to catch
/// a second ending; fails after `timeout`, saying where each open dialog stood.
pub async fn collect_dialogs<S: AsRef<str>>(
    client: &mut AgentClient,
    ids: &[S],
    timeout: Duration,
) -> std::collections::BTreeMap<String, Vec<AgentResponse>> {
    let mut dialogs: std::collections::BTreeMap<String, Vec<AgentResponse>> = Default::default();
    let open = |dialogs: &std::collections::BTreeMap<String, Vec<AgentResponse>>| -> Vec<String> {
        ids.iter()
            .map(|id| id.as_ref().to_owned())
            .filter(|id| {
                !dialogs
                    .get(id)
                    .is_some_and(|r| r.iter().any(|r| r.end_of_dialog))
            })
            .collect()
    };
    let deadline = tokio::time::Instant::now() + timeout;
    while !open(&dialogs).is_empty() {
        let Ok(next) = tokio::time::timeout_at(deadline, client.next()).await else {
            let state: Vec<String> = open(&dialogs)
                .iter()
                .map(|id| {
                    let got = dialogs.get(id).map(Vec::as_slice).unwrap_or_default();
                    let last = got.last().map(|r| {
                        format!(
                            "{} {:?}",
                            r.message_type,
                            r.content.chars().take(120).collect::<String>()
                        )
                    });
                    format!("{id}: {} messages, last {last:?}", got.len())
                })
                .collect();
            panic!(
                "dialogs still open after {timeout:?}:\n{}",
                state.join("\n")
            );
        };
        let (id, response) = next.expect("a response");
        dialogs.entry(id).or_default().push(response);
    }
    let quiet = tokio::time::Instant::now() + Duration::from_secs(2);
    while let Ok(Ok((id, response))) = tokio::time::timeout_at(quiet, client.next()).await {
        dialogs.entry(id).or_default().push(response);
    }
    dialogs
}

/// The dialog's answer, or its error message prefixed with `error: `.
pub fn outcome(responses: &[AgentResponse]) -> String {
    match responses.last().and_then(|last| last.error.as_ref()) {
        Some(error) => format!("error: {}", error.message),
        None => text_of(responses, "answer"),
    }
}

/// Waits, at most `within`, until the scripted LLM has been asked something containing `text`.
pub async fn wait_for_call(llm: &ScriptedLlm, text: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while !llm.calls().iter().any(|c| c.last_user.contains(text)) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no call asked about {text} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads responses of dialog `id` for `quiet` and returns them (to check nothing more arrives).
pub async fn drain_for(client: &mut AgentClient, id: &str, quiet: Duration) -> Vec<AgentResponse> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + quiet;
    while let Ok(Ok((rid, response))) = tokio::time::timeout_at(deadline, client.next()).await {
        if rid == id {
            out.push(response);
        }
    }
    out
}

/// Concatenated content of the messages of one type.
pub fn text_of(responses: &[AgentResponse], kind: &str) -> String {
    responses
        .iter()
        .filter(|r| r.message_type == kind)
        .map(|r| r.content.as_str())
        .collect()
}

/// A config service with its own store directory, REST API and token: in the test process unless
/// the test asks for a child ([`Place::Child`]: one it SIGKILLs or scrapes).
pub struct ConfigSvc {
    running: Running,
    pub url: String,
    pub token: String,
    data_dir: PathBuf,
    broker_url: String,
    addr: String,
    seed: Option<PathBuf>,
    /// Its port, held for it across its restarts.
    _port: agent_bus::embedded::KeptPort,
}

impl ConfigSvc {
    pub fn spawn(broker: &Broker, seed: Option<&std::path::Path>) -> ConfigSvc {
        Self::start(Place::InProcess, broker, seed)
    }

    /// [`ConfigSvc::spawn`] in `place`.
    pub fn start(place: Place, broker: &Broker, seed: Option<&std::path::Path>) -> ConfigSvc {
        // Kept across its restarts (see `Aggregator::start_logged`).
        let kept = agent_bus::embedded::KeptPort::choose(&[]).unwrap();
        let port = kept.port();
        // Not named by the port alone (see `Aggregator::start_logged`).
        let data_dir = std::env::temp_dir().join(format!(
            "agent-e2e-config-{}-{port}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let _ = std::fs::remove_dir_all(&data_dir);
        let addr = format!("127.0.0.1:{port}");
        let token = format!("{:032x}", uuid::Uuid::new_v4().as_u128());
        let seed = seed.map(|s| s.to_path_buf());
        let running = Self::launch(place, &broker.url(), &data_dir, &addr, &token, &seed);
        let mut svc = ConfigSvc {
            running,
            url: format!("http://{addr}"),
            token,
            data_dir,
            broker_url: broker.url(),
            addr,
            seed,
            _port: kept,
        };
        svc.wait_ready();
        svc
    }

    fn launch(
        place: Place,
        broker_url: &str,
        data_dir: &std::path::Path,
        addr: &str,
        token: &str,
        seed: &Option<PathBuf>,
    ) -> Running {
        let mut args: Vec<std::ffi::OsString> = vec![
            "--pulsar-url".into(),
            broker_url.into(),
            "--data-dir".into(),
            data_dir.into(),
            "--http-addr".into(),
            addr.into(),
        ];
        if let Some(seed) = seed {
            args.extend(["--seed".into(), seed.into()]);
        }
        match place {
            // Sealed as in production: its announcements to other config services.
            Place::Child => Running::Child(
                running::command("config-svc")
                    .args(&args)
                    .env("CONFIG_TOKEN", token)
                    .env("AGENT_SEAL_KEY", SEAL_KEY)
                    .spawn()
                    .unwrap(),
            ),
            Place::InProcess => {
                let full = [
                    "--config-token".into(),
                    token.into(),
                    "--seal-key".into(),
                    SEAL_KEY.into(),
                ]
                .into_iter()
                .chain(args);
                let settings: config_svc::ConfigSvcSettings = running::settings("config-svc", full);
                Running::InProcess(in_process::InProcess::start(
                    "config-svc",
                    move |shutdown| config_svc::run(settings, shutdown),
                ))
            }
        }
    }

    fn wait_ready(&mut self) {
        if let Err(why) = self.running.wait_listening(&self.addr, "config-svc") {
            panic!(
                "config-svc stopped before listening on {}: {why}",
                self.addr
            );
        }
    }

    /// Stops it at once (SIGKILL for a child), then starts it again on the same store, in the
    /// same place.
    pub fn kill_and_restart(&mut self) {
        self.kill();
        self.running = Self::launch(
            self.running.place(),
            &self.broker_url,
            &self.data_dir,
            &self.addr,
            &self.token,
            &self.seed,
        );
        self.wait_ready();
    }

    pub fn kill(&mut self) {
        self.running.kill();
    }

    /// Freezes a child (SIGSTOP) or lets it go on (SIGCONT): what is sent to it meanwhile is
    /// answered late.
    pub fn freeze(&self, frozen: bool) {
        self.running.freeze(frozen, "a config service");
    }

    /// Where its store lives.
    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// Its process id (a child's: see [`Place::Child`]).
    pub fn pid(&self) -> u32 {
        self.running
            .pid()
            .expect("only a config service started as a child has a process id")
    }
}

impl Drop for ConfigSvc {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.data_dir);
    }
}

/// Waits up to 30 s for something to accept connections on `addr`.
pub fn wait_listening(addr: &str, what: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never listened on {addr}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Every message of `topic` from its first one (of a non-persistent topic: from the moment it
/// subscribes), on a subscription of the test's own.
pub async fn read_from_start(
    broker: &Broker,
    topic: &str,
    subscription: &str,
) -> pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor> {
    // pulsar-lite has been seen to drop a new connection while it subscribed (`Disconnected`,
    // once in a suite run): tried again on a new connection, as `client` does.
    let started = Instant::now();
    loop {
        let attempt = async {
            let pulsar: pulsar::Pulsar<pulsar::TokioExecutor> =
                pulsar::Pulsar::builder(broker.url(), pulsar::TokioExecutor)
                    .build()
                    .await?;
            pulsar
                .consumer()
                .with_topic(topic)
                .with_subscription(subscription)
                .with_subscription_type(pulsar::SubType::Exclusive)
                .with_options(pulsar::consumer::ConsumerOptions {
                    initial_position: pulsar::consumer::InitialPosition::Earliest,
                    ..pulsar::consumer::ConsumerOptions::default()
                })
                .build()
                .await
        };
        match attempt.await {
            Ok(consumer) => return consumer,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("reader of {topic}: {e}; trying again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("no reader of {topic} on {}: {e}", broker.url()),
        }
    }
}

/// The compression named by each message the witness is handed until it hears nothing for 2 s.
pub async fn compressions_seen(
    witness: &mut pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor>,
) -> Vec<Option<i32>> {
    use futures::StreamExt;
    let mut seen = Vec::new();
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_secs(2), witness.next()).await
    {
        witness.ack(&message).await.unwrap();
        seen.push(message.payload.metadata.compression);
    }
    seen
}

pub use agent_core::vocab::NamedNodeRef;
/// The `tg:` namespace, for reading explain triples.
pub use agent_core::vocab::{prov, tg, TG};

/// Every explain triple a dialog's responses carried.
pub fn explained(responses: &[AgentResponse]) -> Vec<agent_schema::Triple> {
    responses
        .iter()
        .flat_map(|r| r.explain_triples.iter().cloned())
        .collect()
}

/// The values (IRIs or literal texts) of `predicate` on `node`.
pub fn values(
    triples: &[agent_schema::Triple],
    node: &str,
    predicate: NamedNodeRef<'_>,
) -> Vec<String> {
    triples
        .iter()
        .filter(|t| t.s.iri == node && t.p.iri == predicate.as_str())
        .map(|t| {
            if t.o.kind == "i" {
                t.o.iri.clone()
            } else {
                t.o.value.clone()
            }
        })
        .collect()
}

/// The text a provenance node stands for: a short one beside it (`tg:content` of the node it
/// names as its `tg:document`, or of itself), a long one in the document named by its digest.
pub fn node_text(triples: &[agent_schema::Triple], node: &str) -> String {
    let own = values(triples, node, tg::CONTENT).concat();
    if !own.is_empty() {
        return own;
    }
    values(triples, node, tg::DOCUMENT)
        .iter()
        .map(|doc| values(triples, doc, tg::CONTENT).concat())
        .collect()
}

/// Whether `node` has the type `class`.
pub fn has_type(triples: &[agent_schema::Triple], node: &str, class: NamedNodeRef<'_>) -> bool {
    triples.iter().any(|t| {
        t.s.iri == node
            && t.p.iri == agent_core::vocab::RDF_TYPE.as_str()
            && t.o.iri == class.as_str()
    })
}

/// No link points at a node the dialog did not describe.
pub fn assert_no_dangling_links(triples: &[agent_schema::Triple]) {
    let subjects: std::collections::BTreeSet<&str> =
        triples.iter().map(|x| x.s.iri.as_str()).collect();
    let linking = [
        "wasDerivedFrom",
        "thought",
        "document",
        "hasStep",
        "executesStep",
        "evaluates",
    ];
    for x in triples {
        if linking.iter().any(|p| x.p.iri.ends_with(p)) {
            assert!(
                subjects.contains(x.o.iri.as_str()),
                "dangling {} -> {}",
                x.p.iri,
                x.o.iri
            );
        }
    }
}

/// Every thought the client was sent names a node the graph holds.
pub fn assert_thoughts_explained(responses: &[AgentResponse], triples: &[agent_schema::Triple]) {
    let subjects: std::collections::BTreeSet<&str> =
        triples.iter().map(|x| x.s.iri.as_str()).collect();
    for r in responses.iter().filter(|r| r.message_type == "thought") {
        assert!(
            subjects.contains(r.message_id.as_str()),
            "no node for {}",
            r.message_id
        );
    }
}

/// The last request on a topic read from its start, once nothing more arrives for two seconds.
pub async fn last_request(
    requests: &mut pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor>,
) -> Option<AgentRequest> {
    use futures::StreamExt;
    let mut last = None;
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_secs(2), requests.next()).await
    {
        requests.ack(&message).await.unwrap();
        last = Some(serde_json::from_slice(&message.payload.data).unwrap());
    }
    last
}

/// The explain tree of `session`, as `agentctl explain` prints it.
pub async fn explain_tree(store: &agent_graph::GraphStore, session: &str) -> String {
    let rows = store
        .query(agent_graph::queries::session_triples(
            &agent_graph::queries::session_node(session).unwrap(),
        ))
        .await
        .unwrap()
        .rows();
    agent_graph::explain::render_tree(&agent_graph::explain::session_view(session, &rows))
}

/// The nodes of `session` (its own, not its subagents') that no `prov:wasDerivedFrom` path leads
/// from to the session: a provenance DAG with every node reachable has none. The graph-only
/// records (step inputs, LLM calls, the journal) are not provenance nodes and are left out, and a
/// document counts as reached through the node it is the text of (`tg:document`).
pub async fn unreachable_nodes(store: &agent_graph::GraphStore, session: &str) -> Vec<String> {
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let sparql = format!(
        "{prefixes}SELECT DISTINCT ?n WHERE {{ GRAPH <urn:graph:retrieval> {{ ?n ?p ?o .
           FILTER (STRSTARTS(STR(?n), \"{session}/\"))
           FILTER (!CONTAINS(STR(?n), \"/input/\") && !CONTAINS(STR(?n), \"/llm/\"))
           FILTER NOT EXISTS {{ ?n prov:wasDerivedFrom+ <{session}> }}
           FILTER NOT EXISTS {{ ?m tg:document ?n . ?m prov:wasDerivedFrom+ <{session}> }} }} }}"
    );
    // The aggregator may still be writing what the client has already seen: the links arrive
    // after their nodes, so wait (a while) for the set to empty before answering it.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let rows = store.query(sparql.clone()).await.unwrap().rows();
        let unreached: Vec<String> = rows
            .column("n")
            .into_iter()
            .flatten()
            .map(ToString::to_string)
            .collect();
        if unreached.is_empty() || std::time::Instant::now() > deadline {
            return unreached;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The root session of a dialog: the explained node that is a session (`urn:trustgraph:agent:{id}`,
/// no path). Explain messages are published when an iteration commits, after its streamed chunks.
pub fn session_of(responses: &[AgentResponse]) -> String {
    responses
        .iter()
        .filter_map(|r| r.explain_id.clone())
        .find(|e| {
            e.strip_prefix(agent_core::vocab::SESSION_PREFIX)
                .is_some_and(|rest| !rest.contains('/'))
        })
        .unwrap_or_else(|| panic!("no session was explained: {responses:#?}"))
}

/// The explain triples of a dialog and the recorded text of iteration `n`'s observation.
pub fn observation(responses: &[AgentResponse], n: usize) -> (Vec<agent_schema::Triple>, String) {
    let triples = explained(responses);
    let node = format!("{}/i{n}/observation", session_of(responses));
    let text = node_text(&triples, &node);
    (triples, text)
}

/// How long iteration `n`'s tool ran, as its provenance records it.
pub fn duration_ms(triples: &[agent_schema::Triple], responses: &[AgentResponse], n: usize) -> u64 {
    let node = format!("{}/i{n}/observation", session_of(responses));
    values(triples, &node, tg::TOOL_DURATION_MS)
        .first()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no tool duration on {node}"))
}

/// Every sample of a Prometheus `/metrics` page under `base`: `name{labels}` -> value.
pub async fn scrape(base: &str) -> std::collections::BTreeMap<String, f64> {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// Waits until the orchestrator whose operator endpoints are at `base` says it is ready
/// (`/readyz`: subscribed, its store reached), for at most `within`.
pub async fn until_ready(base: &str, within: Duration) {
    let deadline = tokio::time::Instant::now() + within;
    while !reqwest::get(format!("{base}/readyz"))
        .await
        .is_ok_and(|r| r.status().is_success())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{base} was not ready within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The counter `name` on the metrics page under `base`: 0 until the process listens (a child
/// still starting) and reports it.
pub async fn counter_once_listening(base: &str, name: &str) -> f64 {
    if reqwest::get(format!("{base}/metrics")).await.is_err() {
        return 0.0;
    }
    scrape(base).await.get(name).copied().unwrap_or(0.0)
}

/// How many request messages the orchestrator under `base` counts with the fate `fate`
/// (`received`, `acked`, ...), 0 until it listens.
pub async fn requests_with_fate(base: &str, fate: &str) -> f64 {
    counter_once_listening(
        base,
        &format!("agent_request_messages_total{{fate=\"{fate}\"}}"),
    )
    .await
}

/// The default flow's request topic's dead-letter topic.
pub const DEAD_LETTER_TOPIC: &str = "persistent://tg/dead-letter/agent:default:default";

/// Publishes `payload` under the correlation `id` to [`DEAD_LETTER_TOPIC`], as the `pulsar`
/// client does with a request past its redelivery bound.
pub async fn send_dead_lettered(broker: &Broker, id: &str, payload: Vec<u8>) {
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let dead_letters = agent_bus::Publisher::new(&bus, DEAD_LETTER_TOPIC)
        .await
        .unwrap();
    let properties: agent_bus::Properties = [("id".to_owned(), id.to_owned())].into();
    dead_letters.send(payload, &properties).await.unwrap();
}

/// One sample of a scrape, which must be there.
pub fn sample(all: &std::collections::BTreeMap<String, f64>, series: &str) -> f64 {
    *all.get(series)
        .unwrap_or_else(|| panic!("no {series} in {all:#?}"))
}

/// Three ReACT iterations through the seeded `llm` tool: two tool calls, then the answer
/// "alpha and beta, combined.". The first iteration's call is rule 4, the second's rule 1, the
/// answer's rule 0.
pub const THREE_STEPS: &str = r#"{"rules": [
  {"match": "Observation: beta-result", "reply": "Thought: I have both parts now.\nFinal Answer: alpha and beta, combined."},
  {"match": "Observation: alpha-result", "reply": "Thought: Now the second part.\nAction: llm\nArgs: {\"question\": \"fetch beta\"}"},
  {"match": "fetch alpha", "exact": true, "reply": "alpha-result"},
  {"match": "fetch beta", "exact": true, "reply": "beta-result"},
  {"match": "", "reply": "Thought: Start with the first part.\nAction: llm\nArgs: {\"question\": \"fetch alpha\"}"}
]}"#;

/// Checks, within [`holds_within`]'s wait, that the tokens the graph records on the nodes of the
/// run rooted at the session `root` (its URI; a subagent's nodes are named after it) add up to
/// `total`, the closing's.
pub async fn assert_graph_tokens(store: &agent_graph::GraphStore, root: &str, total: u64) {
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let summed = format!(
        "SELECT (SUM(?v) AS ?total) WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?n ?p ?v . FILTER(?p IN (tg:inToken, tg:outToken) && STRSTARTS(STR(?n), \"{root}\"))
         }} }}"
    );
    let adds_up = format!("{prefixes}ASK {{ {{ {summed} }} FILTER(?total = {total}) }}");
    if !holds_within(store, adds_up).await {
        let rows = store.query(format!("{prefixes}{summed}")).await.unwrap();
        panic!("the closing counts {total} tokens; the graph: {rows:?}");
    }
    // A node holds one cost: one written twice with two makes a join over a node's in and out
    // tokens (the run's spend against max_tokens) count each of them twice.
    let twice = format!(
        "{prefixes}SELECT ?n ?p (COUNT(?v) AS ?values) WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?n ?p ?v . FILTER(?p IN (tg:inToken, tg:outToken) && STRSTARTS(STR(?n), \"{root}\"))
         }} }} GROUP BY ?n ?p HAVING (COUNT(?v) > 1)"
    );
    let rows = store.query(twice).await.unwrap();
    assert!(
        matches!(&rows, agent_graph::QueryAnswer::Rows(r) if r.rows.is_empty()),
        "nodes with more than one cost: {rows:?}"
    );
}

/// Rows a SPARQL query over the aggregator's store returns.
pub async fn count(store: &agent_graph::GraphStore, sparql: String) -> usize {
    match store.query(sparql).await.unwrap() {
        agent_graph::QueryAnswer::Rows(rows) => rows.rows.len(),
        _ => 0,
    }
}

/// Whether the ASK query `sparql` holds within five seconds (the aggregator may still be writing
/// what the client has already seen).
pub async fn holds_within(store: &agent_graph::GraphStore, sparql: String) -> bool {
    holds_within_for(store, sparql, Duration::from_secs(5)).await
}

/// Whether the ASK query `sparql` holds within `window` (an aggregator that subscribes again
/// after a broker restart writes later still). A query that fails counts as not holding yet.
pub async fn holds_within_for(
    store: &agent_graph::GraphStore,
    sparql: String,
    window: Duration,
) -> bool {
    let deadline = Instant::now() + window;
    loop {
        if matches!(
            store.query(sparql.clone()).await,
            Ok(agent_graph::QueryAnswer::Boolean(true))
        ) {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Rows the query returns once they reach `expected` (the aggregator writes what the client has
/// already seen a moment later), or after 10 s whatever it returns then.
pub async fn count_reaching(
    store: &agent_graph::GraphStore,
    sparql: String,
    expected: usize,
) -> usize {
    for _ in 0..100 {
        if count(store, sparql.clone()).await >= expected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    count(store, sparql).await
}

/// The explainability stream, read from its start in the background: which dialogs concluded.
/// A test whose client hears nothing for a while tells with it a dialog that ended (its closing
/// never reached the client: the response topic is non-persistent) from one that did not.
pub struct Conclusions {
    published: tokio::sync::mpsc::UnboundedReceiver<Vec<String>>,
    subjects: std::collections::BTreeSet<String>,
    reader: tokio::task::JoinHandle<()>,
}

impl Conclusions {
    pub async fn watch(broker: &Broker) -> Conclusions {
        use futures::StreamExt;
        let topic = Topics::trustgraph("default", "default").explainability;
        let mut stream = read_from_start(broker, &topic, "test-conclusions").await;
        let (tx, published) = tokio::sync::mpsc::unbounded_channel();
        let reader = tokio::spawn(async move {
            while let Some(Ok(message)) = stream.next().await {
                let subjects = agent_schema::decode::<agent_schema::Triples>(&message.payload.data)
                    .map(|t| {
                        t.triples
                            .into_iter()
                            .filter(|t| t.s.kind == "i")
                            .map(|t| t.s.iri)
                            .collect()
                    })
                    .unwrap_or_default();
                if tx.send(subjects).is_err() {
                    break;
                }
            }
        });
        Conclusions {
            published,
            subjects: Default::default(),
            reader,
        }
    }

    /// Reads what was published until the stream has been quiet for 2 s.
    pub async fn catch_up(&mut self) {
        while let Ok(Some(subjects)) =
            tokio::time::timeout(Duration::from_secs(2), self.published.recv()).await
        {
            self.subjects.extend(subjects);
        }
    }

    /// Whether dialog `session` had concluded at the last [`Conclusions::catch_up`].
    pub fn concluded(&self, session: &str) -> bool {
        let uris = agent_core::provenance::SessionUris::new(session);
        self.subjects.contains(&uris.conclusion())
    }
}

/// Waits for the closing of each dialog of `open` (request id -> session), handing each to
/// `closed`, until the client hears nothing for `silence`. A dialog whose closing never came but
/// which concluded in the explainability stream has ended (the response topic is non-persistent:
/// a closing that does not reach the client is gone) and is reported; one that never concluded
/// fails the test.
pub async fn await_endings(
    client: &mut AgentClient,
    conclusions: &mut Conclusions,
    mut open: std::collections::BTreeMap<String, String>,
    silence: Duration,
    mut closed: impl FnMut(&str, &AgentResponse),
) {
    let dialogs = open.len();
    while !open.is_empty() {
        let Ok(next) = tokio::time::timeout(silence, client.next()).await else {
            break;
        };
        let (id, response) = next.unwrap();
        if response.end_of_dialog && open.remove(&id).is_some() {
            closed(&id, &response);
        }
    }
    if open.is_empty() {
        return;
    }
    conclusions.catch_up().await;
    let unfinished: Vec<&String> = open
        .iter()
        .filter(|(_, session)| !conclusions.concluded(session))
        .map(|(id, _)| id)
        .collect();
    assert!(
        unfinished.is_empty(),
        "nothing reached the client for {silence:?} and {} of {dialogs} dialogs never concluded, e.g. {:?}",
        unfinished.len(),
        unfinished.iter().take(3).collect::<Vec<_>>()
    );
    eprintln!(
        "{} of {dialogs} dialogs concluded but their closing never reached the client: {:?}",
        open.len(),
        open.keys().collect::<Vec<_>>()
    );
}

impl Drop for Conclusions {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

/// A private CA made in a directory with the `openssl` tool (installed by `scripts/setup.sh`), and
/// the certificates it signs: a broker's or a collector's for `127.0.0.1`, a client's.
pub struct PrivateCa {
    dir: PathBuf,
}

impl PrivateCa {
    /// A new CA in `dir` (`ca.pem`, `ca.key`), valid for two days.
    pub fn new(dir: &std::path::Path) -> PrivateCa {
        std::fs::create_dir_all(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let ca = PrivateCa {
            dir: dir.to_owned(),
        };
        ca.openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=agent tests CA",
        ]);
        ca
    }

    /// The CA's certificate (PEM).
    pub fn certificate(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// A certificate for `name` the CA signed, with `extensions` (an `openssl x509 -extfile`'s
    /// lines: `subjectAltName=IP:127.0.0.1`, `extendedKeyUsage=serverAuth`...): its certificate
    /// and its key, both PEM (the key PKCS#8, as `req -newkey` writes it and Apache Pulsar reads).
    pub fn issue(&self, name: &str, extensions: &str) -> (PathBuf, PathBuf) {
        let [key, csr, ext, pem] = ["key", "csr", "ext", "pem"].map(|e| format!("{name}.{e}"));
        self.openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            &format!("/CN={name}"),
        ]);
        std::fs::write(self.dir.join(&ext), extensions)
            .unwrap_or_else(|e| panic!("{}: {e}", self.dir.display()));
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ]);
        (self.dir.join(pem), self.dir.join(key))
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .current_dir(&self.dir)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("the openssl tool does not run: {e}"));
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
