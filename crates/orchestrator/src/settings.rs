//! Settings every binary shares (flags with environment fallbacks, DESIGN section 7) and loading the
//! agent config from a directory of `<type>.json` files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agent_bus::{BrokerArgs, Topics};
use agent_core::config::{AgentConfig, ConfigValues};
use agent_llm::{LlmConfig, Secret};
use anyhow::Context;

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
    /// Seconds to wait for the LLM's first byte, and between streamed chunks.
    #[arg(long, env = "LLM_IDLE_TIMEOUT_SECS", default_value_t = 60)]
    pub llm_idle_timeout_secs: u64,
    /// Directory of `<config type>.json` files (`tool.json`, `prompt.json`, `agent-limits.json`).
    #[arg(long, env = "AGENT_CONFIG_DIR", default_value = "config-seed")]
    pub config_dir: PathBuf,
    /// Request messages handled at once by this process.
    #[arg(long, env = "AGENT_MAX_IN_FLIGHT", default_value_t = 8)]
    pub max_in_flight: usize,
    /// Deliveries of one request before it is moved to the dead-letter topic (0: no bound).
    #[arg(long, default_value_t = 5)]
    pub max_redeliveries: usize,
    /// Seconds in-flight iterations get to finish on shutdown.
    #[arg(long, default_value_t = 20)]
    pub drain_secs: u64,
    #[arg(long, default_value = "agent-orchestrator")]
    pub subscription: String,
    #[arg(long, env = "AGENT_REQUEST_TOPIC")]
    pub request_topic: Option<String>,
    #[arg(long, env = "AGENT_RESPONSE_TOPIC")]
    pub response_topic: Option<String>,
    #[arg(long, env = "AGENT_EXPLAIN_TOPIC")]
    pub explain_topic: Option<String>,
    #[arg(long, env = "AGENT_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,
}

impl Settings {
    pub fn topics(&self) -> Topics {
        let mut t = self.broker.topics();
        let pick = |slot: &mut String, over: &Option<String>| {
            if let Some(o) = over {
                slot.clone_from(o);
            }
        };
        pick(&mut t.request, &self.request_topic);
        pick(&mut t.response, &self.response_topic);
        pick(&mut t.explainability, &self.explain_topic);
        pick(&mut t.dead_letter, &self.dead_letter_topic);
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
            ..LlmConfig::default()
        }
    }
}

/// Reads `<type>.json` files (each an object of key -> value) from `dir`. A missing directory gives
/// the defaults; an invalid file or entry is an error naming the file and key, all reported at once.
pub fn load_config_dir(dir: &Path) -> anyhow::Result<AgentConfig> {
    let values = read_config_values(dir)?;
    AgentConfig::from_values(&values).map_err(|errors| {
        let lines: Vec<String> = errors
            .iter()
            .map(|e| format!("  {}/{}.json: {e}", dir.display(), e.kind))
            .collect();
        anyhow::anyhow!("invalid agent config:\n{}", lines.join("\n"))
    })
}

pub fn read_config_values(dir: &Path) -> anyhow::Result<ConfigValues> {
    let mut values = ConfigValues::new();
    if !dir.is_dir() {
        tracing::warn!(dir = %dir.display(), "no config directory; using built-in defaults and no tools");
        return Ok(values);
    }
    let mut errors = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    entries.sort();
    for path in entries {
        let kind = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parsed = std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|text| {
                serde_json::from_str::<std::collections::BTreeMap<String, serde_json::Value>>(&text)
                    .map_err(|e| e.to_string())
            });
        match parsed {
            Ok(map) => {
                values.insert(kind, map);
            }
            Err(e) => errors.push(format!("  {}: {e}", path.display())),
        }
    }
    if !errors.is_empty() {
        anyhow::bail!("invalid config files:\n{}", errors.join("\n"));
    }
    Ok(values)
}
