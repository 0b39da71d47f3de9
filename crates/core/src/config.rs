//! The agent configuration the orchestrator works from: tools, MCP servers, patterns, task types,
//! limits and prompts, in the shape of TrustGraph's config store (type -> key -> JSON value),
//! validated with every error reported at once.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::pattern::Pattern;
use crate::prompt::Prompts;
use crate::tools::{ToolDef, MCP_TOOL};

/// The task type used when config defines none, and the preferred fallback task type.
pub const GENERAL: &str = "general";

/// The built-in task type of a service without task type config.
pub fn general_task_type() -> TaskTypeDef {
    TaskTypeDef {
        name: GENERAL.to_owned(),
        description: "Any request".to_owned(),
        when_to_use: String::new(),
        examples: Vec::new(),
        framing: String::new(),
        valid_patterns: vec![Pattern::React.name().to_owned()],
        critic: Vec::new(),
    }
}

/// Config type of tool definitions.
pub const TOOL_TYPE: &str = "tool";
/// Config type of MCP servers that `mcp-tool` tools call.
pub const MCP_TYPE: &str = "mcp";
/// Config type of prompt templates; see [`Prompts::KEYS`].
pub const PROMPT_TYPE: &str = "prompt";
/// Config type of agent limits; key `default` holds them.
pub const LIMITS_TYPE: &str = "agent-limits";
/// Config type of the patterns a request can be worked with (key = pattern name).
pub const PATTERN_TYPE: &str = "agent-pattern";
/// Config type of the task types the meta-router classifies requests into (key = task type name).
pub const TASK_TYPE_TYPE: &str = "agent-task-type";
/// Config type of per-model options (key = the model name as `LLM_MODEL` gives it, or `default`).
pub const MODEL_TYPE: &str = "llm-model";

/// The config types the orchestrator reads. A config service holds many more (TrustGraph keeps
/// flows, prompts of its own services, ...); their values are none of our business, so one that
/// is not JSON must not stop our config from being read.
pub const READ_TYPES: [&str; 7] = [
    TOOL_TYPE,
    MCP_TYPE,
    PROMPT_TYPE,
    LIMITS_TYPE,
    PATTERN_TYPE,
    TASK_TYPE_TYPE,
    MODEL_TYPE,
];

/// How the LLM is asked to call tools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ToolCalling {
    /// TrustGraph's `Thought/Action/Args` text protocol: works with every model.
    #[default]
    Text,
    /// OpenAI-style `tools` in the request and `tool_calls` in the answer, for servers and models
    /// that support function calling (vLLM, llama.cpp's server with `--jinja`, Ollama, OpenAI).
    Native,
}

/// What a model (and the server that runs it) supports. Every field has a default, so a partial
/// entry is valid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelOptions {
    #[serde(rename = "tool-calling")]
    pub tool_calling: ToolCalling,
    /// Ask for `response_format: {"type": "json_object"}` where a JSON answer is expected (the
    /// meta-router, planner and critic).
    #[serde(rename = "json-mode")]
    pub json_mode: bool,
    /// Send `stop: ["\nObservation:"]` on ReACT calls, so a model that runs on past its action
    /// stops there. The parser never relies on it; turn it off for servers that refuse `stop`.
    #[serde(rename = "stop-sequences")]
    pub stop_sequences: bool,
    /// The most tokens one call may write (`max_tokens`); 0 sends none, and the server's own
    /// default applies (for some local servers, the whole context: a model that runs on writes
    /// until it is full).
    #[serde(rename = "max-output-tokens")]
    pub max_output_tokens: u64,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            tool_calling: ToolCalling::Text,
            json_mode: false,
            stop_sequences: true,
            max_output_tokens: 0,
        }
    }
}

/// A budget a run has used up: which limit, and the sentence that says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpentBudget {
    /// The limit's name in `agent-limits` (`max_tokens`, `max_wall_secs`, `max_run_iterations`).
    pub limit: &'static str,
    pub sentence: String,
}

impl std::fmt::Display for SpentBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.sentence)
    }
}

/// Bounds on a dialog. Every field has a default so a partial config is valid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Iterations per dialog; reaching it ends the dialog with a clear answer.
    pub max_iterations: usize,
    /// Largest accepted question, in bytes.
    pub max_question_bytes: usize,
    /// Largest accepted request message (question, history and all), in bytes; a dialog whose
    /// history outgrows it ends with a clear error rather than growing without bound.
    pub max_message_bytes: usize,
    /// Largest tool output kept as an observation, in bytes; longer output is cut and marked.
    pub max_observation_bytes: usize,
    /// Tool call timeout, in seconds.
    pub tool_timeout_secs: u64,
    /// Times a Plan-then-Execute plan may be revised.
    pub max_replan_depth: usize,
    /// Goals a supervisor may fan out at once.
    pub max_subagents: usize,
    /// How deep subagents may fan out again.
    pub max_fanout_depth: usize,
    /// Reruns the critic may ask for in one request; the rejection past them ends the dialog.
    pub max_retries: usize,
    /// How many times one plan step (and the sub-steps it was split into) may be split.
    pub step_life_cycle: usize,
    /// Tokens (input plus output) a root request may use; 0 means no bound.
    pub max_tokens: u64,
    /// Wall-clock seconds a root request may run; 0 means no bound.
    pub max_wall_secs: u64,
    /// Iterations a root request and its subagents at every depth may take together, counted
    /// from the graph as the run's nodes that record an LLM call's cost (a thought, a routing or
    /// pattern decision, a plan, a synthesis; a critic's verdict on each result is one each; a
    /// tool's observation is not). 0 (the default) means no bound beyond what `max_iterations`,
    /// `max_subagents` and `max_fanout_depth` allow each dialog.
    pub max_run_iterations: usize,
    /// Seconds a step waits out an unavailable LLM or store (parked, tried again with growing
    /// backoff) before its dialog ends with an error naming the cause; 0 ends it at once.
    pub max_outage_secs: u64,
    /// Seconds a tool call parked for approval (a tool with `requires-approval`) waits for its
    /// answer; then its dialog ends (a subagent's with a completion its supervisor synthesises
    /// around). The run's wall-time budget (`max_wall_secs`) counts the wait too.
    pub approval_timeout_secs: u64,
    /// Tool groups whose every tool waits for a person's approval, as if each had
    /// `requires-approval` (a tool with no group is in `default`).
    pub approval_groups: Vec<String>,
    /// What a dialog that starts while another of its conversation (`conversation_id`) still
    /// runs does: wait for it, be refused, or cancel it.
    pub conversation_policy: ConversationPolicy,
}

/// What a second request in a conversation does while an earlier one still runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ConversationPolicy {
    /// It waits (its first step is set aside and tried again) until the earlier ends.
    #[default]
    Queue,
    /// It ends at once with an error naming the dialog that runs.
    Reject,
    /// The earlier is cancelled (as `agentctl cancel` would), and it starts.
    Interrupt,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_iterations: 10,
            max_question_bytes: 64 * 1024,
            max_message_bytes: 1024 * 1024,
            max_observation_bytes: 16 * 1024,
            tool_timeout_secs: 60,
            max_replan_depth: 2,
            max_subagents: 5,
            max_fanout_depth: 2,
            max_retries: 5,
            step_life_cycle: 3,
            max_tokens: 200_000,
            max_wall_secs: 600,
            max_run_iterations: 0,
            max_outage_secs: 300,
            approval_timeout_secs: 300,
            approval_groups: Vec::new(),
            conversation_policy: ConversationPolicy::Queue,
        }
    }
}

impl Limits {
    /// The budget a run (the root request and its subagents) has used up, having spent `tokens`
    /// (input plus output) and `iterations` over `elapsed`; `None` while it may go on.
    ///
    /// ```
    /// use std::time::Duration;
    /// let limits = agent_core::config::Limits {
    ///     max_tokens: 100,
    ///     max_wall_secs: 60,
    ///     max_run_iterations: 12,
    ///     ..Default::default()
    /// };
    /// assert!(limits.spent_budget(99, 11, Duration::from_secs(59)).is_none());
    /// let spent = limits.spent_budget(100, 0, Duration::ZERO).unwrap();
    /// assert_eq!(spent.limit, "max_tokens");
    /// assert!(spent.to_string().contains("100 tokens"));
    /// assert_eq!(limits.spent_budget(0, 0, Duration::from_secs(60)).unwrap().limit, "max_wall_secs");
    /// let spent = limits.spent_budget(0, 12, Duration::ZERO).unwrap();
    /// assert_eq!(spent.limit, "max_run_iterations");
    /// assert!(spent.to_string().contains("12 iterations"));
    /// ```
    pub fn spent_budget(
        &self,
        tokens: u64,
        iterations: usize,
        elapsed: std::time::Duration,
    ) -> Option<SpentBudget> {
        if self.max_tokens > 0 && tokens >= self.max_tokens {
            return Some(SpentBudget {
                limit: "max_tokens",
                sentence: format!(
                    "the request and its subagents used {tokens} tokens, its budget is {} (max_tokens)",
                    self.max_tokens
                ),
            });
        }
        if self.max_run_iterations > 0 && iterations >= self.max_run_iterations {
            return Some(SpentBudget {
                limit: "max_run_iterations",
                sentence: format!(
                    "the request and its subagents took {iterations} iterations, its budget is {} (max_run_iterations)",
                    self.max_run_iterations
                ),
            });
        }
        if self.max_wall_secs > 0 && elapsed.as_secs() >= self.max_wall_secs {
            return Some(SpentBudget {
                limit: "max_wall_secs",
                sentence: format!(
                    "the request has run for {} s, its budget is {} s (max_wall_secs)",
                    elapsed.as_secs(),
                    self.max_wall_secs
                ),
            });
        }
        None
    }

    /// Values that cannot work, each as a message.
    fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, value) in [
            ("max_iterations", self.max_iterations),
            ("max_question_bytes", self.max_question_bytes),
            ("max_message_bytes", self.max_message_bytes),
            ("max_observation_bytes", self.max_observation_bytes),
            ("max_subagents", self.max_subagents),
        ] {
            if value == 0 {
                out.push(format!("{name} must be at least 1"));
            }
        }
        if self.tool_timeout_secs == 0 {
            out.push("tool_timeout_secs must be at least 1".to_owned());
        }
        out
    }
}

/// A way of working on a request (config type `agent-pattern`, key = its name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PatternDef {
    /// Defaults to the key; when given it must equal the key.
    #[serde(default)]
    pub name: String,
    /// What the pattern is good for; the meta-router shows it to the LLM.
    pub description: String,
    /// Critic stages switched on for every dialog of this pattern (see [`crate::pattern::Stage`]).
    #[serde(default)]
    pub critic: Vec<String>,
    /// The ensemble's perspectives: one independent agent per entry, told to take it; empty, the
    /// built-in ones (see [`crate::ensemble::DEFAULT_PERSPECTIVES`]). Other patterns ignore it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub perspectives: Vec<String>,
    /// The ensemble's debate: rounds in which every agent is shown the others' answers and may
    /// revise its own, before the reconciliation (0, the default: none). Other patterns ignore it.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub debate_rounds: usize,
    /// The ensemble's models: agent `i` asks `models[i % len]` (an OpenAI-compatible endpoint
    /// serves several by name), so independent agents can be different models; empty, every agent
    /// asks the orchestrator's `LLM_MODEL`. Other patterns ignore it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// A kind of request (config type `agent-task-type`, key = its name).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskTypeDef {
    /// Defaults to the key; when given it must equal the key.
    #[serde(default)]
    pub name: String,
    /// What requests of this type look like; the meta-router shows it to the LLM.
    pub description: String,
    /// When to choose it, said plainly (small models follow a rule better than a description).
    #[serde(default)]
    pub when_to_use: String,
    /// Requests of this type, shown to the meta-router as examples.
    #[serde(default)]
    pub examples: Vec<String>,
    /// Put before the pattern's prompt, to frame the work.
    #[serde(default)]
    pub framing: String,
    /// The patterns a request of this type may be worked with, the preferred fallback first.
    pub valid_patterns: Vec<String>,
    /// Critic stages switched on for every dialog of this task type.
    #[serde(default)]
    pub critic: Vec<String>,
}

/// A tool on an MCP server (config type `mcp`, key = the id `mcp-tool` tools refer to). TrustGraph
/// reaches servers over streamable HTTP (`url`, `auth-token`); `command` (with `args` and `env`)
/// starts a local server as a stdio child process instead.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct McpServer {
    /// The server's streamable-HTTP endpoint.
    #[serde(default)]
    pub url: String,
    /// The tool's name on the server, when it differs from the key.
    #[serde(default, rename = "remote-name")]
    pub remote_name: Option<String>,
    /// Sent as `Authorization: Bearer <token>` on every HTTP request.
    #[serde(default, rename = "auth-token")]
    pub auth_token: Option<String>,
    /// A program that serves MCP on its stdin and stdout.
    #[serde(default)]
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Environment variables the stdio server gets on top of the orchestrator's.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Other settings, kept as given.
    #[serde(flatten)]
    pub settings: BTreeMap<String, serde_json::Value>,
}

// Config is logged when it changes; a bearer token must not end up in the logs.
impl std::fmt::Debug for McpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServer")
            .field("url", &self.url)
            .field("remote_name", &self.remote_name)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .field("command", &self.command)
            .field("args", &self.args)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("settings", &self.settings)
            .finish()
    }
}

impl McpServer {
    /// What is wrong with how the server is reached, if anything.
    pub fn problem(&self) -> Option<String> {
        match &self.command {
            Some(command) if command.trim().is_empty() => Some("the command is empty".to_owned()),
            Some(_) if !self.url.is_empty() => {
                Some("give either a url (HTTP) or a command (stdio), not both".to_owned())
            }
            Some(_) => None,
            None if self.url.starts_with("http://") || self.url.starts_with("https://") => None,
            None if self.url.is_empty() => {
                Some("the server has neither a url (HTTP) nor a command (stdio)".to_owned())
            }
            None => Some(format!("the url '{}' is not http(s)", self.url)),
        }
    }
}

/// Everything an iteration needs from config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentConfig {
    /// Tools by tool id.
    pub tools: BTreeMap<String, ToolDef>,
    /// MCP servers by id.
    pub mcp: BTreeMap<String, McpServer>,
    /// Patterns by name, as configured (which of them this orchestrator runs is
    /// [`Pattern`]).
    pub patterns: BTreeMap<String, PatternDef>,
    /// Task types by name; empty means the built-in `general` task type.
    pub task_types: BTreeMap<String, TaskTypeDef>,
    pub limits: Limits,
    pub prompts: Prompts,
    /// Options by model name; see [`AgentConfig::model_options`].
    pub models: BTreeMap<String, ModelOptions>,
    /// TrustGraph's prompt templates by id (`prompt` / `template.<id>`, its `prompt` text): what a
    /// `prompt` tool's `template` names in TrustGraph's config.
    pub prompt_templates: BTreeMap<String, String>,
}

/// One problem in a config set, located by type and key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kind}/{key}: {message}")]
pub struct ConfigError {
    pub kind: String,
    pub key: String,
    pub message: String,
}

/// Raw config values: type -> key -> JSON value.
pub type ConfigValues = BTreeMap<String, BTreeMap<String, serde_json::Value>>;

/// Collects the problems of one config set.
#[derive(Default)]
struct Problems(Vec<ConfigError>);

impl Problems {
    fn push(&mut self, kind: &str, key: &str, message: impl Into<String>) {
        self.0.push(ConfigError {
            kind: kind.to_owned(),
            key: key.to_owned(),
            message: message.into(),
        });
    }

    /// Decodes every entry of `kind`, recording those that do not decode.
    fn decode<T: serde::de::DeserializeOwned>(
        &mut self,
        values: &ConfigValues,
        kind: &str,
    ) -> BTreeMap<String, T> {
        let mut out = BTreeMap::new();
        for (key, value) in values.get(kind).into_iter().flatten() {
            match serde_json::from_value::<T>(value.clone()) {
                Ok(v) => {
                    out.insert(key.clone(), v);
                }
                Err(e) => self.push(kind, key, e.to_string()),
            }
        }
        out
    }

    /// A `name` field must be empty (then it becomes the key) or equal the key.
    fn name_matches_key(&mut self, kind: &str, key: &str, name: &mut String) {
        if name.is_empty() {
            key.clone_into(name);
        } else if name != key {
            self.push(
                kind,
                key,
                format!("the name '{name}' differs from the key '{key}'"),
            );
        }
    }
}

impl AgentConfig {
    /// Whether a call of `tool` waits for a person's approval: the tool says so, or one of its
    /// groups is in `approval_groups`.
    pub fn needs_approval(&self, tool: &ToolDef) -> bool {
        if tool.requires_approval {
            return true;
        }
        let groups = &self.limits.approval_groups;
        match &tool.group {
            Some(own) => own.iter().any(|g| groups.contains(g)),
            None => groups.iter().any(|g| g == crate::tools::DEFAULT_GROUP),
        }
    }

    /// Builds the config from raw values, reporting every invalid entry at once.
    pub fn from_values(values: &ConfigValues) -> Result<AgentConfig, Vec<ConfigError>> {
        let mut problems = Problems::default();
        let mut config = AgentConfig {
            tools: problems.decode(values, TOOL_TYPE),
            mcp: problems.decode(values, MCP_TYPE),
            patterns: problems.decode(values, PATTERN_TYPE),
            task_types: problems.decode(values, TASK_TYPE_TYPE),
            models: problems.decode(values, MODEL_TYPE),
            ..AgentConfig::default()
        };
        check_tools(&config, &mut problems);
        for (key, server) in &config.mcp {
            if let Some(problem) = server.problem() {
                problems.push(MCP_TYPE, key, problem);
            }
        }
        for (key, pattern) in config.patterns.iter_mut() {
            problems.name_matches_key(PATTERN_TYPE, key, &mut pattern.name);
            for stage in unknown_stages(&pattern.critic) {
                problems.push(PATTERN_TYPE, key, stage);
            }
        }
        for (key, task) in &config.task_types {
            for stage in unknown_stages(&task.critic) {
                problems.push(TASK_TYPE_TYPE, key, stage);
            }
        }
        let known = |name: &String| config.patterns.contains_key(name) || Pattern::runs(name);
        let mut task_problems = Vec::new();
        for (key, task) in &config.task_types {
            let mut say = |message: String| task_problems.push((key.clone(), message));
            if task.valid_patterns.is_empty() {
                say("valid_patterns is empty".to_owned());
            }
            let mut seen = std::collections::BTreeSet::new();
            for pattern in &task.valid_patterns {
                if !known(pattern) {
                    say(format!("valid_patterns names the unknown pattern '{pattern}' (no agent-pattern/{pattern})"));
                } else if !seen.insert(pattern.as_str()) {
                    say(format!("valid_patterns names '{pattern}' twice"));
                }
            }
            // The router only ever runs a pattern the task type allows, so one of them must run.
            let runs = |p: &String| Pattern::runs(p);
            if !task.valid_patterns.is_empty()
                && task.valid_patterns.iter().all(known)
                && !task.valid_patterns.iter().any(runs)
            {
                say(format!(
                    "none of valid_patterns ({}) runs in this orchestrator, which runs: {}",
                    task.valid_patterns.join(", "),
                    Pattern::all_names()
                ));
            }
        }
        for (key, message) in task_problems {
            problems.push(TASK_TYPE_TYPE, &key, message);
        }
        for (key, task) in config.task_types.iter_mut() {
            problems.name_matches_key(TASK_TYPE_TYPE, key, &mut task.name);
        }
        if let Some(value) = values.get(LIMITS_TYPE).and_then(|m| m.get("default")) {
            match serde_json::from_value::<Limits>(value.clone()) {
                Ok(limits) => {
                    let found = limits.problems();
                    for message in &found {
                        problems.push(LIMITS_TYPE, "default", message.clone());
                    }
                    if found.is_empty() {
                        config.limits = limits;
                    }
                }
                Err(e) => problems.push(LIMITS_TYPE, "default", e.to_string()),
            }
        }
        for key in values.get(LIMITS_TYPE).into_iter().flat_map(|m| m.keys()) {
            if key != "default" {
                problems.push(LIMITS_TYPE, key, "only the key 'default' is read");
            }
        }
        // TrustGraph's prompt service keeps its own entries under this type too (`system`,
        // `template-index`, `template.<id>`), so keys that are not ours are left alone.
        for (key, value) in values.get(PROMPT_TYPE).into_iter().flatten() {
            if let Some(slot) = config.prompts.slot(key) {
                match serde_json::from_value(value.clone()) {
                    Ok(p) => *slot = p,
                    Err(e) => problems.push(PROMPT_TYPE, key, e.to_string()),
                }
            } else if let Some(id) = key.strip_prefix("template.") {
                if let Some(text) = value.get("prompt").and_then(serde_json::Value::as_str) {
                    config
                        .prompt_templates
                        .insert(id.to_owned(), text.to_owned());
                }
            }
        }
        if problems.0.is_empty() {
            Ok(config)
        } else {
            Err(problems.0)
        }
    }

    /// Builds the config from values as a config store keeps them (type -> key -> JSON text),
    /// reporting text that is not JSON along with every other problem.
    pub fn from_texts(
        texts: &BTreeMap<String, BTreeMap<String, String>>,
    ) -> Result<AgentConfig, Vec<ConfigError>> {
        let mut values = ConfigValues::new();
        let mut problems = Problems::default();
        let read = texts
            .iter()
            .filter(|(kind, _)| READ_TYPES.contains(&kind.as_str()));
        for (kind, entries) in read {
            for (key, text) in entries {
                match serde_json::from_str(text) {
                    Ok(value) => {
                        values
                            .entry(kind.clone())
                            .or_default()
                            .insert(key.clone(), value);
                    }
                    Err(e) => problems.push(kind, key, format!("not JSON: {e}")),
                }
            }
        }
        match AgentConfig::from_values(&values) {
            Ok(config) if problems.0.is_empty() => Ok(config),
            Ok(_) => Err(problems.0),
            Err(more) => {
                problems.0.extend(more);
                Err(problems.0)
            }
        }
    }

    /// Keys under type `prompt` that neither this orchestrator nor TrustGraph's prompt service
    /// reads: likely typos, which validation warns about.
    pub fn unread_prompt_keys(values: &ConfigValues) -> Vec<String> {
        let trustgraph =
            |k: &str| k == "system" || k == "template-index" || k.starts_with("template.");
        values
            .get(PROMPT_TYPE)
            .into_iter()
            .flat_map(|m| m.keys())
            .filter(|k| !Prompts::KEYS.contains(&k.as_str()) && !trustgraph(k))
            .cloned()
            .collect()
    }

    /// The options of `model`: its own entry, else the `default` entry, else the defaults (the
    /// text protocol, which every model can follow).
    pub fn model_options(&self, model: &str) -> ModelOptions {
        self.models
            .get(model)
            .or_else(|| self.models.get("default"))
            .cloned()
            .unwrap_or_default()
    }

    /// Whether config names `model`: a pattern lists it for its agents (see
    /// [`PatternDef::models`]) or it has an `llm-model` entry of its own. A request may ask for a
    /// model only from these, never one config does not name.
    pub fn lists_model(&self, model: &str) -> bool {
        (model != "default" && self.models.contains_key(model))
            || self
                .patterns
                .values()
                .any(|p| p.models.iter().any(|m| m == model))
    }

    /// The tool the LLM named, by its `name`.
    pub fn tool_by_name(&self, name: &str) -> Option<&ToolDef> {
        self.tools.values().find(|t| t.name == name)
    }

    /// The `mcp` entry a configured `mcp-tool` calls ([`ToolDef::mcp_id`]) and that entry's key.
    pub fn mcp_server_for(&self, tool: &ToolDef) -> Option<(&str, &McpServer)> {
        let key = self
            .tools
            .iter()
            .find(|(_, t)| t.name == tool.name)
            .map(|(key, _)| key.as_str())?;
        self.mcp
            .get_key_value(tool.mcp_id(key))
            .map(|(key, server)| (key.as_str(), server))
    }

    /// The config service's config (`self`) with what the orchestrator's own config directory
    /// (`local`) sets that the service may not take away. The service is written by anyone who
    /// may publish on the broker, and TrustGraph's own knows nothing of `agent-limits`:
    /// - without `agent-limits` of its own (`service_sets_limits` false), the local limits stay
    ///   in force rather than the built-in defaults;
    /// - the local `approval_groups` always apply, beside the service's;
    /// - a tool the local config has wait for approval still waits when the service defines it,
    ///   found by its key, by its name, or (an `mcp-tool`) by the MCP tool it calls, so a
    ///   definition under another name does not call it unapproved.
    pub fn under_local_floor(
        mut self,
        local: &AgentConfig,
        service_sets_limits: bool,
    ) -> AgentConfig {
        if service_sets_limits {
            for group in &local.limits.approval_groups {
                if !self.limits.approval_groups.contains(group) {
                    self.limits.approval_groups.push(group.clone());
                }
            }
        } else {
            self.limits = local.limits.clone();
        }
        let gated: Vec<(&String, &ToolDef)> = local
            .tools
            .iter()
            .filter(|(_, tool)| local.needs_approval(tool))
            .collect();
        if gated.is_empty() {
            return self;
        }
        let gated_targets: Vec<McpTarget> = gated
            .iter()
            .filter_map(|(key, tool)| local.mcp_target(key, tool))
            .collect();
        let mut floor = Vec::new();
        for (key, tool) in &self.tools {
            let same_tool = gated
                .iter()
                .any(|(gated_key, gated_tool)| *gated_key == key || gated_tool.name == tool.name);
            let same_target = self
                .mcp_target(key, tool)
                .is_some_and(|target| gated_targets.contains(&target));
            if !tool.requires_approval && (same_tool || same_target) {
                floor.push(key.clone());
            }
        }
        for key in floor {
            if let Some(tool) = self.tools.get_mut(&key) {
                tool.requires_approval = true;
            }
        }
        self
    }

    /// What an `mcp-tool` with id `key` reaches: its server (URL, or program and arguments) and
    /// the tool's name there.
    fn mcp_target(&self, key: &str, tool: &ToolDef) -> Option<McpTarget> {
        if tool.kind != MCP_TOOL {
            return None;
        }
        let id = tool.mcp_id(key);
        let server = self.mcp.get(id)?;
        Some(McpTarget {
            url: server_of_url(&server.url),
            command: server.command.clone(),
            args: server.args.clone(),
            remote_name: server.remote_name.clone().unwrap_or_else(|| id.to_owned()),
        })
    }

    /// The task types the meta-router chooses from: the configured ones, or the built-in `general`.
    pub fn task_types_or_general(&self) -> Vec<TaskTypeDef> {
        if self.task_types.is_empty() {
            vec![general_task_type()]
        } else {
            self.task_types.values().cloned().collect()
        }
    }
}

/// The server a URL reaches, as far as its text can tell: its scheme and host in lower case, its
/// port (the scheme's default when none is given) and its path without empty segments, its user,
/// query and fragment left out. Two spellings of one server (`HTTPS://Mcp.Example:443//mcp/?x`)
/// come out the same, so a definition cannot call a gated tool by spelling its URL otherwise;
/// taking the query away makes more definitions match, which only gates more.
fn server_of_url(url: &str) -> String {
    // Read as the HTTP client reads it (WHATWG URL), so that every spelling it connects alike
    // comes out alike: a port written `0443`, a host with a trailing dot, an IPv4 address in
    // hex or as one number. Compared as text, those called a gated tool without approval.
    if let Ok(parsed) = url::Url::parse(url.trim()) {
        if let Some(host) = parsed.host_str() {
            let host = host.trim_end_matches('.').to_ascii_lowercase();
            let port = parsed
                .port_or_known_default()
                .map(|port| port.to_string())
                .unwrap_or_default();
            let path: Vec<&str> = parsed.path().split('/').filter(|s| !s.is_empty()).collect();
            return format!("{}://{host}:{port}/{}", parsed.scheme(), path.join("/"));
        }
    }
    let url = url.trim();
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let scheme = scheme.to_ascii_lowercase();
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
    let host_port = authority.rsplit('@').next().unwrap_or_default();
    let (host, port) = match host_port.rsplit_once(':') {
        // An IPv6 literal's colons are inside its brackets.
        Some((host, port)) if !port.contains(']') => (host, port.to_owned()),
        _ => (host_port, String::new()),
    };
    let port = match (port.as_str(), scheme.as_str()) {
        ("", "https") => "443".to_owned(),
        ("", "http") => "80".to_owned(),
        _ => port,
    };
    let path: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    format!(
        "{scheme}://{}:{port}/{}",
        host.to_ascii_lowercase(),
        path.join("/")
    )
}

/// The MCP tool an `mcp-tool` definition calls, whatever the definition is named.
#[derive(Debug, PartialEq, Eq)]
struct McpTarget {
    url: String,
    command: Option<String>,
    args: Vec<String>,
    remote_name: String,
}

fn unknown_stages(stages: &[String]) -> Vec<String> {
    stages
        .iter()
        .filter(|s| crate::pattern::Stage::from_name(s).is_none())
        .map(|s| {
            format!(
                "critic names the unknown stage '{s}'; the stages are: {}",
                crate::pattern::Stage::all_names()
            )
        })
        .collect()
}

impl AgentConfig {
    /// Whether the critic evaluates the steps of a dialog of this pattern and task type: switched on
    /// by either.
    pub fn critic_on(&self, pattern: &str, task_type: &str, stage: crate::pattern::Stage) -> bool {
        let on = |stages: &[String]| stages.iter().any(|s| s == stage.name());
        self.patterns.get(pattern).is_some_and(|p| on(&p.critic))
            || self
                .task_types
                .get(task_type)
                .is_some_and(|t| on(&t.critic))
    }
}

fn check_tools(config: &AgentConfig, problems: &mut Problems) {
    let mut names: BTreeMap<&str, &str> = BTreeMap::new();
    for (key, tool) in &config.tools {
        if tool.name.trim().is_empty() {
            problems.push(TOOL_TYPE, key, "the tool has an empty name");
        } else if let Some(other) = names.insert(&tool.name, key) {
            problems.push(
                TOOL_TYPE,
                key,
                format!("tool name '{}' is also used by '{other}'", tool.name),
            );
        }
        if tool.kind == MCP_TOOL {
            let server = tool.mcp_id(key);
            if !config.mcp.contains_key(server) {
                problems.push(
                    TOOL_TYPE,
                    key,
                    format!("the mcp-tool refers to '{server}', which is not in the mcp config"),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn server(value: serde_json::Value) -> McpServer {
        serde_json::from_value(value).unwrap_or_else(|_| McpServer {
            url: "unreadable".into(),
            remote_name: None,
            auth_token: None,
            command: None,
            args: Vec::new(),
            env: BTreeMap::new(),
            settings: BTreeMap::new(),
        })
    }

    #[test]
    fn a_tool_waits_for_approval_when_it_says_so_or_one_of_its_groups_does() {
        let tool = |group: Option<&[&str]>, own: bool| ToolDef {
            group: group.map(|g| g.iter().map(|s| (*s).to_owned()).collect()),
            requires_approval: own,
            ..serde_json::from_value(json!({"type": "llm", "name": "t", "description": "d"}))
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let mut config = AgentConfig::default();
        assert!(!config.needs_approval(&tool(Some(&["payments"]), false)));
        assert!(config.needs_approval(&tool(None, true)));
        config.limits.approval_groups = vec!["payments".into()];
        assert!(config.needs_approval(&tool(Some(&["read", "payments"]), false)));
        assert!(!config.needs_approval(&tool(Some(&["read"]), false)));
        assert!(!config.needs_approval(&tool(None, false)));
        config.limits.approval_groups = vec!["default".into()];
        assert!(
            config.needs_approval(&tool(None, false)),
            "no group is the default group"
        );
    }

    /// A tool the local config has wait for approval waits under the service's definition too:
    /// by its key, its name, or the MCP tool it calls under any name; others are left as the
    /// service defines them.
    #[test]
    fn the_local_approvals_are_a_floor_under_the_services_config() {
        let config = |values: serde_json::Value| {
            let values: ConfigValues = serde_json::from_value(values).unwrap();
            AgentConfig::from_values(&values).unwrap()
        };
        assert_eq!(
            server_of_url("HTTPS://user:pw@Mcp.Example:443//mcp/?x=1#f"),
            server_of_url("https://mcp.example/mcp")
        );
        assert_eq!(
            server_of_url("http://[::1]/a"),
            server_of_url("http://[::1]:80/a/")
        );
        assert_ne!(
            server_of_url("https://mcp.example:8443/mcp"),
            server_of_url("https://mcp.example/mcp")
        );
        // Spellings the HTTP client connects alike (before, each read as another server).
        for spelling in [
            "https://mcp.example:0443/mcp",
            "https://mcp.example./mcp",
            "https://MCP.example:443/./mcp",
        ] {
            assert_eq!(
                server_of_url(spelling),
                server_of_url("https://mcp.example/mcp"),
                "{spelling}"
            );
        }
        assert_eq!(
            server_of_url("http://0x7f.1:8080/mcp"),
            server_of_url("http://127.0.0.1:8080/mcp")
        );
        let mcp = json!({"ledger": {"url": "https://mcp.example/mcp/", "remote-name": "transfer"},
                         "other": {"url": "https://mcp.example/mcp", "remote-name": "balance"}});
        let local = config(json!({
            "mcp": mcp,
            "tool": {
                "transfer": {"name": "transfer", "description": "d", "type": "mcp-tool",
                             "mcp-tool": "ledger", "requires-approval": true},
                "refund": {"name": "refund", "description": "d", "type": "llm", "group": ["money"]},
                "search": {"name": "search", "description": "d", "type": "llm"}
            },
            "agent-limits": {"default": {"approval_groups": ["money"]}}
        }));
        let service = config(json!({
            "mcp": {"ledger-2": {"url": "https://MCP.example:443//mcp?via=2", "remote-name": "transfer"},
                    "other": {"url": "https://mcp.example/mcp", "remote-name": "balance"}},
            "tool": {
                "move-money": {"name": "move_money", "description": "d", "type": "mcp-tool",
                               "mcp-tool": "ledger-2"},
                "balance": {"name": "balance", "description": "d", "type": "mcp-tool",
                            "mcp-tool": "other"},
                "refunds": {"name": "refund", "description": "d", "type": "llm"},
                "search": {"name": "search", "description": "d", "type": "llm"}
            }
        }));
        let merged = service.under_local_floor(&local, false);
        let waits = |key: &str| merged.needs_approval(&merged.tools[key]);
        assert!(waits("move-money"), "the same MCP tool under another name");
        assert!(waits("refunds"), "the same name under another key");
        assert!(!waits("balance"));
        assert!(!waits("search"));
        assert_eq!(merged.limits.approval_groups, ["money"]);
    }

    #[test]
    fn an_mcp_server_is_reached_over_http_or_stdio_and_its_token_is_not_logged() {
        let http = server(
            json!({"url": "https://mcp.example/mcp", "remote-name": "get-sum", "auth-token": "t0ken"}),
        );
        assert_eq!(http.problem(), None);
        assert_eq!(http.auth_token.as_deref(), Some("t0ken"));
        assert!(!format!("{http:?}").contains("t0ken"));
        let stdio =
            server(json!({"command": "node", "args": ["server.js", "stdio"], "env": {"K": "v"}}));
        assert_eq!(stdio.problem(), None);
        let neither = server(json!({}));
        assert!(neither.problem().is_some_and(|p| p.contains("neither")));
        let both = server(json!({"url": "http://x/mcp", "command": "node"}));
        assert!(both.problem().is_some_and(|p| p.contains("not both")));
        let ftp = server(json!({"url": "ftp://x"}));
        assert!(ftp.problem().is_some_and(|p| p.contains("not http(s)")));
    }

    #[test]
    fn an_mcp_tool_finds_its_server_by_setting_or_by_its_own_id() {
        let values: ConfigValues = [
            (
                TOOL_TYPE.to_owned(),
                [
                    ("sum".to_owned(), json!({"name": "add", "description": "", "type": "mcp-tool", "mcp-tool": "remote"})),
                    ("direct".to_owned(), json!({"name": "direct", "description": "", "type": "mcp-tool"})),
                ]
                .into(),
            ),
            (
                MCP_TYPE.to_owned(),
                [
                    ("remote".to_owned(), json!({"url": "http://a/mcp"})),
                    ("direct".to_owned(), json!({"command": "srv"})),
                ]
                .into(),
            ),
        ]
        .into();
        let config = AgentConfig::from_values(&values).unwrap_or_default();
        let key = |name: &str| {
            config
                .tool_by_name(name)
                .and_then(|t| config.mcp_server_for(t))
                .map(|(key, _)| key.to_owned())
        };
        assert_eq!(key("add").as_deref(), Some("remote"));
        assert_eq!(key("direct").as_deref(), Some("direct"));
    }

    #[test]
    fn reports_every_error_at_once() {
        let values: ConfigValues = [
            (
                "tool".to_owned(),
                [
                    (
                        "a".to_owned(),
                        json!({"name": "x", "description": "", "type": "text-completion"}),
                    ),
                    (
                        "b".to_owned(),
                        json!({"name": "x", "description": "", "type": "text-completion"}),
                    ),
                    ("c".to_owned(), json!({"description": 3})),
                ]
                .into(),
            ),
            (
                "agent-limits".to_owned(),
                [("default".to_owned(), json!({"max_iteration": 3}))].into(),
            ),
        ]
        .into();
        let errors = AgentConfig::from_values(&values).unwrap_err();
        assert_eq!(errors.len(), 3, "{errors:?}");
    }

    #[test]
    fn task_types_must_name_known_distinct_patterns_one_of_which_runs() {
        let values: ConfigValues = [
            (
                "agent-pattern".to_owned(),
                [(
                    "negotiator".to_owned(),
                    json!({"description": "not built here", "max_rounds": 5}),
                )]
                .into(),
            ),
            (
                "agent-task-type".to_owned(),
                [
                    (
                        "a".to_owned(),
                        json!({"description": "", "valid_patterns": ["react", "telepathy"]}),
                    ),
                    (
                        "b".to_owned(),
                        json!({"description": "", "valid_patterns": ["react", "react"]}),
                    ),
                    (
                        "c".to_owned(),
                        json!({"description": "", "valid_patterns": ["negotiator"]}),
                    ),
                    (
                        "d".to_owned(),
                        json!({"description": "", "valid_patterns": []}),
                    ),
                    (
                        "e".to_owned(),
                        json!({"name": "f", "description": "", "valid_patterns": ["react"]}),
                    ),
                    (
                        "ok".to_owned(),
                        json!({"description": "", "valid_patterns": ["negotiator", "react"]}),
                    ),
                ]
                .into(),
            ),
        ]
        .into();
        let errors = AgentConfig::from_values(&values).unwrap_err();
        let keys: Vec<&str> = errors.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c", "d", "e"], "{errors:?}");
        assert!(errors[0].message.contains("unknown pattern 'telepathy'"));
        assert!(errors[1].message.contains("'react' twice"));
        assert!(errors[2].message.contains("runs in this orchestrator"));
    }

    #[test]
    fn trustgraph_prompt_entries_are_left_alone() {
        let values: ConfigValues = [(
            "prompt".to_owned(),
            [
                ("system".to_owned(), json!("You are helpful.")),
                ("template-index".to_owned(), json!(["agent-react"])),
                ("template.agent-react".to_owned(), json!({"prompt": "x"})),
                ("reactt".to_owned(), json!({"prompt": "x"})),
                (
                    "task-type-classify".to_owned(),
                    json!({"system": "S", "template": "T {{question}}"}),
                ),
            ]
            .into(),
        )]
        .into();
        let config = AgentConfig::from_values(&values).unwrap();
        assert_eq!(config.prompts.task_type_selection.system, "S");
        assert_eq!(AgentConfig::unread_prompt_keys(&values), ["reactt"]);
    }

    #[test]
    fn partial_limits_keep_defaults() {
        let values: ConfigValues = [(
            "agent-limits".to_owned(),
            [("default".to_owned(), json!({"max_iterations": 3}))].into(),
        )]
        .into();
        let config = AgentConfig::from_values(&values).unwrap();
        assert_eq!(config.limits.max_iterations, 3);
        assert_eq!(config.limits.tool_timeout_secs, 60);
    }
}
