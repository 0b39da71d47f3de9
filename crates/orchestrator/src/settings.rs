//! Settings every binary shares (flags with environment fallbacks, DESIGN section 7) and loading the
//! agent config from a directory of `<type>.json` files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agent_bus::{BrokerArgs, Topics};
use agent_core::config::AgentConfig;
use agent_graph::GraphStore;
use agent_llm::{LlmConfig, Secret};

#[derive(clap::Args, Debug, Clone)]
pub struct Settings {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// OpenAI-compatible endpoint, up to and including `/v1`.
    #[arg(
        long,
        env = "OPENAI_BASE_URL",
        default_value = "http://127.0.0.1:8080/v1"
    )]
    pub llm_base_url: String,
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub llm_api_key: Option<String>,
    #[arg(long, env = "LLM_MODEL", default_value = "default")]
    pub llm_model: String,
    /// LLM calls in flight at once in this process.
    #[arg(long, env = "LLM_MAX_CONCURRENCY", default_value_t = 16)]
    pub llm_max_concurrency: usize,
    /// Seconds to wait for a streamed LLM answer's first byte, and between its chunks.
    #[arg(long, env = "LLM_IDLE_TIMEOUT_SECS", default_value_t = 60)]
    pub llm_idle_timeout_secs: u64,
    /// Seconds an LLM call may take in all (a whole answer, which comes at once when the model
    /// has written it, has no other limit).
    #[arg(long, env = "LLM_REQUEST_TIMEOUT_SECS", default_value_t = 300)]
    pub llm_request_timeout_secs: u64,
    /// Directory of `<config type>.json` files (`tool.json`, `prompt.json`, `agent-limits.json`).
    #[arg(long, env = "AGENT_CONFIG_DIR", default_value = "config-seed")]
    pub config_dir: PathBuf,
    /// Request messages handled at once by this process. 32 rather than 8: with an instantly
    /// answering LLM (`agentctl bench`, 2026-11-27) 8 left a fifth of two cores idle, and 32 took
    /// journaled throughput from about 770 to 1,120-1,150 steps/s; with a real model a step waits
    /// seconds on it, and `--llm-max-concurrency` bounds the calls in flight on its own.
    #[arg(long, env = "AGENT_MAX_IN_FLIGHT", default_value_t = 32)]
    pub max_in_flight: usize,
    /// Deliveries of one request before it is moved to the dead-letter topic (0: no bound). Only
    /// crashes, lost consumers and steps handed back (a journal entry this build cannot read, or
    /// a copy waiting for its recorder when its process stops) count: an outage parks a step
    /// without a redelivery. What a broker counts differs (Apache Pulsar does not count a crash),
    /// so with a journal its owner counts the deliveries that took a step up too, and a step taken
    /// up this many times without an outcome ends its dialog with an error when taken up again.
    /// Continuing in process with the journal's owner in another process, only the owner's count
    /// applies (see [`Settings::broker_redelivery_bound`]).
    #[arg(long, env = "AGENT_MAX_REDELIVERIES", default_value_t = 10)]
    pub max_redeliveries: usize,
    /// With a journal, run a dialog's next step in the process that recorded the step before it,
    /// instead of putting its request on the broker for any replica: the request is in the
    /// journal, and the broker's delivery of the dialog's earlier message stays unacked until the
    /// chain ends, so a crash hands that message to another replica, which re-emits the recorded
    /// steps and goes on (docs/effectively-once.md, "Continuing in process"). Off by default.
    #[arg(long, env = "AGENT_CONTINUE_IN_PROCESS")]
    pub continue_in_process: bool,
    /// Continuing in process, how long one of this process's beats tells the journal's owner its
    /// chains still run (it beats every second): a copy of a chain's message waits that long
    /// after the last beat before it takes the dialog over. Longer rides out longer pauses of a
    /// process; a crashed chain's dialog then goes on later.
    #[arg(long, env = "AGENT_CHAIN_LEASE_SECS", default_value_t = 5)]
    pub chain_lease_secs: u64,
    /// How long the journal's owner keeps a new dialog of a conversation counted as started
    /// while its first step has not shown in the graph, unless renewed: this process renews it
    /// every third of that while the step runs, so it only bounds how long a replica that crashed
    /// in a first step holds its conversation up. Held to 1-600 s.
    #[arg(
        long,
        env = "AGENT_CONVERSATION_START_LEASE_SECS",
        default_value_t = 30
    )]
    pub conversation_start_lease_secs: u64,
    /// Whether the journal's owner (the aggregator at `GRAPH_STORE`) runs in this very process,
    /// as `agentctl up`, `agentctl bench` and `agentctl bench-long` run it: its count of takings
    /// then dies with a crash of this process, so the broker's count must still bound a step that
    /// crashes it. Not a flag: only the code that starts both services in one process knows.
    #[arg(skip)]
    pub journal_owner_in_process: bool,
    /// What becomes of a later step of a subagent's dialog without this service's step seal (with
    /// a seal key): `require` dead-letters it; `warn` logs it and runs it, for a rolling upgrade
    /// from a build that did not seal steps (its replicas and its journal entries send them).
    #[arg(long, env = "AGENT_STEP_SEALS", value_enum, default_value_t = SealRule::Require)]
    pub step_seals: SealRule,
    /// What becomes of a subagent's first request whose seal covers only who it is and what it
    /// inherits, as builds before 2026-12-02 sealed it (with a seal key): `require` refuses it;
    /// `warn` logs it and runs it, for a rolling upgrade from such a build (its replicas and its
    /// journal entries send them). Under `warn` a copy of any start with another question runs
    /// too, so it is for the upgrade's while only.
    #[arg(long, env = "AGENT_SUBAGENT_SEALS", value_enum, default_value_t = SealRule::Require)]
    pub subagent_seals: SealRule,
    /// What becomes of a control message (a cancel, an approval's answer) without the seal of
    /// this service's key (with a seal key): `require` ignores it, said at warning level;
    /// `warn` logs it and acts on it, for a rolling upgrade from a build that did not seal them
    /// (its orchestrators' interrupts, its aggregators' expiries, its `agentctl`).
    #[arg(long, env = "AGENT_CONTROL_SEALS", value_enum, default_value_t = SealRule::Require)]
    pub control_seals: SealRule,
    /// Seconds in-flight iterations get to finish on shutdown.
    #[arg(long, default_value_t = 20)]
    pub drain_secs: u64,
    #[arg(long, default_value = "agent-orchestrator")]
    pub subscription: String,
    #[arg(long, env = "AGENT_REQUEST_TOPIC")]
    pub request_topic: Option<String>,
    /// Where TrustGraph's clients publish first messages (its non-persistent request topic);
    /// an empty value takes requests only on the persistent request topic.
    #[arg(long, env = "AGENT_CLIENT_REQUEST_TOPIC")]
    pub client_request_topic: Option<String>,
    #[arg(long, env = "AGENT_RESPONSE_TOPIC")]
    pub response_topic: Option<String>,
    #[arg(long, env = "AGENT_EXPLAIN_TOPIC")]
    pub explain_topic: Option<String>,
    #[arg(long, env = "AGENT_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,
    /// Where run control (cancel) is heard; every replica hears every message.
    #[arg(long, env = "AGENT_CONTROL_TOPIC")]
    pub control_topic: Option<String>,
    /// Where answers to approvals are taken up (one replica each).
    #[arg(long, env = "AGENT_CONTROL_REQUEST_TOPIC")]
    pub control_request_topic: Option<String>,
    /// The graph store shared with the aggregator, which holds the iteration journal that makes
    /// iterations effectively-once and the collections the knowledge tools read: an `http(s)://`
    /// SPARQL endpoint. A directory is its aggregator's own store and cannot be shared, so it
    /// means neither.
    #[arg(long, env = "GRAPH_STORE")]
    pub graph_store: Option<String>,
    /// Bearer token for the graph store's writes.
    #[arg(long, env = "CONFIG_TOKEN", hide_env_values = true)]
    pub config_token: Option<String>,
    /// Secret shared with the aggregators that seals subagent requests, fan-outs and completions
    /// (see `agent_bus::seal`); without it they can be forged by anyone who can publish.
    #[arg(long, env = "AGENT_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<String>,
    /// Where long texts are kept as documents (claim-check): `graph`, the shared graph store's
    /// documents graph (needs GRAPH_STORE); or `librarian`, TrustGraph's librarian on the broker
    /// (its protocol, the workspace's librarian topics), for deployments that run one.
    #[arg(long, env = "DOCUMENT_STORE", value_enum, default_value_t = DocumentStoreKind::Graph)]
    pub document_store: DocumentStoreKind,
    /// Seconds a request to the librarian waits for its answer.
    #[arg(long, env = "LIBRARIAN_TIMEOUT_SECS", default_value_t = 30)]
    pub librarian_timeout_secs: u64,
    /// Where `/healthz`, `/readyz` and `/metrics` listen.
    #[arg(long, env = "AGENT_HTTP_ADDR", default_value = "0.0.0.0:8090")]
    pub http_addr: std::net::SocketAddr,
    #[command(flatten)]
    pub http: agent_serve::HttpBounds,
}

/// Where long texts are kept (see [`Settings::document_store`]).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DocumentStoreKind {
    Graph,
    Librarian,
}

impl Settings {
    /// The graph store shared with the aggregator (for the iteration journal and the knowledge
    /// tools), when one is configured.
    pub fn shared_store(&self) -> anyhow::Result<Option<GraphStore>> {
        match self.graph_store.as_deref().filter(|s| !s.is_empty()) {
            Some(url) if GraphStore::is_endpoint(url) => {
                let token = self.config_token.clone().filter(|t| !t.is_empty());
                Ok(Some(GraphStore::open(url, token)?))
            }
            Some(dir) => {
                tracing::warn!(%dir, "GRAPH_STORE is a directory, which only its aggregator may open; no journal and no knowledge tools");
                Ok(None)
            }
            None => Ok(None),
        }
    }

    /// The bound on a request's deliveries the broker's count enforces (the `pulsar` crate moves a
    /// message delivered that often to the dead-letter topic as it arrives, before it is handled),
    /// if any. Continuing in process, a dialog's first request stays unacked for the whole
    /// dialog, so every crash of a process running its chain, and every dispatch pulsar-lite
    /// bounces off a ghost consumer, counts against it: at the bound a dialog still running was
    /// dead-lettered (a soak, 2026-11-30), its message acked while its chain could still have been
    /// running elsewhere.
    ///
    /// So there, with the journal's owner in another process, the owner's count of takings alone
    /// bounds a step that crashes every process taking it up, as it does on Apache Pulsar, which
    /// does not count a crash at all. An owner in this process loses its count with a crash of
    /// it, so the broker's count stays.
    pub fn broker_redelivery_bound(&self) -> Option<usize> {
        let journaled = self
            .graph_store
            .as_deref()
            .is_some_and(GraphStore::is_endpoint);
        if self.continue_in_process && journaled && !self.journal_owner_in_process {
            return None;
        }
        Some(self.max_redeliveries).filter(|&n| n > 0)
    }

    pub fn topics(&self) -> Topics {
        let mut t = self.broker.topics();
        let pick = |slot: &mut String, over: &Option<String>| {
            if let Some(o) = over {
                slot.clone_from(o);
            }
        };
        pick(&mut t.request, &self.request_topic);
        pick(&mut t.client_request, &self.client_request_topic);
        pick(&mut t.response, &self.response_topic);
        pick(&mut t.explainability, &self.explain_topic);
        pick(&mut t.dead_letter, &self.dead_letter_topic);
        pick(&mut t.control, &self.control_topic);
        pick(&mut t.control_request, &self.control_request_topic);
        t
    }

    pub fn llm_config(&self) -> LlmConfig {
        LlmConfig {
            base_url: self.llm_base_url.clone(),
            api_key: self
                .llm_api_key
                .clone()
                .filter(|k| !k.is_empty())
                .map(Secret::new),
            model: self.llm_model.clone(),
            max_concurrency: self.llm_max_concurrency,
            idle_timeout: Duration::from_secs(self.llm_idle_timeout_secs),
            request_timeout: Duration::from_secs(self.llm_request_timeout_secs),
            ..LlmConfig::default()
        }
    }
}

/// The config made by the `<type>.json` files in `dir`, or every problem with them at once, each
/// naming its file (and key).
pub fn check_config_dir(dir: &Path) -> Result<AgentConfig, Vec<String>> {
    let (values, file_errors) = agent_config_files::read_dir_all(dir);
    let mut problems: Vec<String> = file_errors.iter().map(ToString::to_string).collect();
    match AgentConfig::from_values(&values) {
        Ok(config) if problems.is_empty() => Ok(config),
        Ok(_) => Err(problems),
        Err(errors) => {
            problems.extend(
                errors
                    .iter()
                    .map(|e| format!("{}/{}.json: {e}", dir.display(), e.kind)),
            );
            Err(problems)
        }
    }
}

/// Loads the config from `dir`; a missing directory gives the built-in defaults.
pub fn load_config_dir(dir: &Path) -> anyhow::Result<AgentConfig> {
    if !dir.is_dir() {
        tracing::warn!(dir = %dir.display(), "no config directory; using built-in defaults and no tools");
        return Ok(AgentConfig::default());
    }
    check_config_dir(dir)
        .map_err(|problems| anyhow::anyhow!("invalid agent config:\n  {}", problems.join("\n  ")))
}

/// Whether what a rule covers must carry this service's seal (see `Settings::step_seals` and
/// `Settings::control_seals`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealRule {
    Require,
    Warn,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(args: &[&str]) -> Settings {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            settings: Settings,
        }
        let line = ["agent-orchestrator"].iter().chain(args);
        <Cli as clap::Parser>::try_parse_from(line)
            .unwrap()
            .settings
    }

    /// Continuing in process, a dialog's root is unacked for the whole dialog: only a journal's
    /// owner that outlives this process may take the broker's count's place.
    #[test]
    fn the_broker_bounds_deliveries_unless_a_chains_root_would_gather_every_crash_of_its_dialog() {
        let mut chained = settings(&[
            "--graph-store",
            "http://127.0.0.1:7878",
            "--max-redeliveries",
            "4",
        ]);
        chained.continue_in_process = false;
        chained.journal_owner_in_process = false;
        assert_eq!(chained.broker_redelivery_bound(), Some(4), "step by step");
        chained.continue_in_process = true;
        assert_eq!(
            chained.broker_redelivery_bound(),
            None,
            "continuing in process"
        );
        chained.journal_owner_in_process = true;
        assert_eq!(
            chained.broker_redelivery_bound(),
            Some(4),
            "continuing in process, the owner's count dying with this process"
        );
        chained.journal_owner_in_process = false;
        chained.graph_store = None;
        assert_eq!(
            chained.broker_redelivery_bound(),
            Some(4),
            "no journal, so no chain and no count of takings"
        );
        chained.graph_store = Some("/var/lib/agent-graph".to_owned());
        assert_eq!(
            chained.broker_redelivery_bound(),
            Some(4),
            "a directory, which only its aggregator opens: no journal here"
        );
        chained.max_redeliveries = 0;
        assert_eq!(chained.broker_redelivery_bound(), None, "no bound asked");
    }
}
