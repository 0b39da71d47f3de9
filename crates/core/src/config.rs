//! The agent configuration the orchestrator works from: tools, limits and prompts, in the shape of
//! TrustGraph's config store (type -> key -> JSON value), validated with every error reported at once.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::prompt::PromptTemplate;
use crate::tools::ToolDef;

/// Config type of tool definitions.
pub const TOOL_TYPE: &str = "tool";
/// Config type of prompt templates; key `react` is the ReACT prompt.
pub const PROMPT_TYPE: &str = "prompt";
/// Config type of agent limits; key `default` holds them.
pub const LIMITS_TYPE: &str = "agent-limits";

/// Bounds on a dialog. Every field has a default so a partial config is valid.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Iterations per dialog; reaching it ends the dialog with a clear answer.
    pub max_iterations: usize,
    /// Largest accepted question, in bytes.
    pub max_question_bytes: usize,
    /// Largest tool output kept as an observation, in bytes; longer output is cut and marked.
    pub max_observation_bytes: usize,
    /// Tool call timeout, in seconds.
    pub tool_timeout_secs: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_iterations: 10,
            max_question_bytes: 64 * 1024,
            max_observation_bytes: 16 * 1024,
            tool_timeout_secs: 60,
        }
    }
}

/// Everything an iteration needs from config.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentConfig {
    /// Tools by tool id.
    pub tools: BTreeMap<String, ToolDef>,
    pub limits: Limits,
    pub react_prompt: PromptTemplate,
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

impl AgentConfig {
    /// Builds the config from raw values, reporting every invalid entry at once.
    pub fn from_values(values: &ConfigValues) -> Result<AgentConfig, Vec<ConfigError>> {
        let mut errors = Vec::new();
        let mut config = AgentConfig::default();
        let error = |kind: &str, key: &str, message: String| ConfigError {
            kind: kind.to_owned(),
            key: key.to_owned(),
            message,
        };
        for (key, value) in values.get(TOOL_TYPE).into_iter().flatten() {
            match serde_json::from_value::<ToolDef>(value.clone()) {
                Ok(tool) if tool.name.trim().is_empty() => {
                    errors.push(error(TOOL_TYPE, key, "the tool has an empty name".into()))
                }
                Ok(tool) => {
                    config.tools.insert(key.clone(), tool);
                }
                Err(e) => errors.push(error(TOOL_TYPE, key, e.to_string())),
            }
        }
        let mut names: BTreeMap<&str, &str> = BTreeMap::new();
        for (key, tool) in &config.tools {
            if let Some(other) = names.insert(&tool.name, key) {
                errors.push(error(
                    TOOL_TYPE,
                    key,
                    format!("tool name '{}' is also used by '{other}'", tool.name),
                ));
            }
        }
        if let Some(value) = values.get(LIMITS_TYPE).and_then(|m| m.get("default")) {
            match serde_json::from_value::<Limits>(value.clone()) {
                Ok(limits) if limits.max_iterations == 0 => errors.push(error(
                    LIMITS_TYPE,
                    "default",
                    "max_iterations must be at least 1".into(),
                )),
                Ok(limits) => config.limits = limits,
                Err(e) => errors.push(error(LIMITS_TYPE, "default", e.to_string())),
            }
        }
        if let Some(value) = values.get(PROMPT_TYPE).and_then(|m| m.get("react")) {
            match serde_json::from_value::<PromptTemplate>(value.clone()) {
                Ok(p) => config.react_prompt = p,
                Err(e) => errors.push(error(PROMPT_TYPE, "react", e.to_string())),
            }
        }
        if errors.is_empty() {
            Ok(config)
        } else {
            Err(errors)
        }
    }

    /// The tool the LLM named, by its `name`.
    pub fn tool_by_name(&self, name: &str) -> Option<&ToolDef> {
        self.tools.values().find(|t| t.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
