//! `AgentRequest` and the history it carries between iterations.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A field sent as `null`, read as its default (a missing one, `#[serde(default)]` does it): a
/// TrustGraph 1.x client sends a field it did not set as `null`, and a request that did not
/// decode was dead-lettered, its client told nothing.
fn null_as_default<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(deserializer)?.unwrap_or_default())
}

/// One iteration's work request. The client publishes the first one; the orchestrator publishes each
/// `next` one with the grown `history`, so all dialog state travels in this message.
///
/// ```
/// let req: agent_schema::AgentRequest = serde_json::from_str(r#"{"question": "Why?"}"#).unwrap();
/// assert_eq!(req.question, "Why?");
/// assert!(req.history.is_empty());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct AgentRequest {
    #[serde(deserialize_with = "null_as_default")]
    pub question: String,
    /// The tool state; `null` or empty means `"undefined"`.
    pub state: Option<String>,
    /// The tool groups the request may use; `null` means `["default"]`, `"*"` means all.
    pub group: Option<Vec<String>>,
    #[serde(deserialize_with = "null_as_default")]
    pub history: Vec<AgentStep>,
    #[serde(deserialize_with = "null_as_default")]
    pub collection: String,
    #[serde(deserialize_with = "null_as_default")]
    pub streaming: bool,
    #[serde(deserialize_with = "null_as_default")]
    pub session_id: String,
    #[serde(deserialize_with = "null_as_default")]
    pub conversation_id: String,
    #[serde(deserialize_with = "null_as_default")]
    pub pattern: String,
    #[serde(deserialize_with = "null_as_default")]
    pub task_type: String,
    #[serde(deserialize_with = "null_as_default")]
    pub framing: String,
    #[serde(deserialize_with = "null_as_default")]
    pub correlation_id: String,
    #[serde(deserialize_with = "null_as_default")]
    pub parent_session_id: String,
    #[serde(deserialize_with = "null_as_default")]
    pub subagent_goal: String,
    #[serde(deserialize_with = "null_as_default")]
    pub expected_siblings: i64,
}

/// One completed step of the dialog.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct AgentStep {
    #[serde(deserialize_with = "null_as_default")]
    pub thought: String,
    #[serde(deserialize_with = "null_as_default")]
    pub action: String,
    #[serde(deserialize_with = "null_as_default")]
    pub arguments: BTreeMap<String, String>,
    #[serde(deserialize_with = "null_as_default")]
    pub observation: String,
    /// One of [`StepType`] as text; TrustGraph sends `""` for a ReACT step.
    #[serde(deserialize_with = "null_as_default")]
    pub step_type: String,
    pub plan: Option<Vec<PlanStep>>,
    pub subagent_results: Option<BTreeMap<String, String>>,
}

/// The kinds of [`AgentStep`]; kept as text on the wire so unknown kinds from newer peers survive a
/// round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepType {
    React,
    Plan,
    Execute,
    Decompose,
    Synthesise,
    SubagentCompletion,
    /// Our extension: the critic's verdict on a plan step (`action` holds the status).
    Evaluate,
    /// Our extension: Reflexion's self-critique after an action (`observation` holds the lesson).
    Reflect,
    /// Our extension: a deep-research round (`action` `research` with the calls it ran in
    /// parallel, or `complete` when the research is judged complete).
    Research,
}

impl StepType {
    pub fn as_str(self) -> &'static str {
        match self {
            StepType::React => "react",
            StepType::Plan => "plan",
            StepType::Execute => "execute",
            StepType::Decompose => "decompose",
            StepType::Synthesise => "synthesise",
            StepType::SubagentCompletion => "subagent-completion",
            StepType::Evaluate => "evaluate",
            StepType::Reflect => "reflect",
            StepType::Research => "research",
        }
    }

    /// Reads a wire `step_type`; `""` is a ReACT step, as TrustGraph sends it.
    pub fn parse(text: &str) -> Option<StepType> {
        Some(match text {
            "" | "react" => StepType::React,
            "plan" => StepType::Plan,
            "execute" => StepType::Execute,
            "decompose" => StepType::Decompose,
            "synthesise" => StepType::Synthesise,
            "subagent-completion" => StepType::SubagentCompletion,
            "evaluate" => StepType::Evaluate,
            "reflect" => StepType::Reflect,
            "research" => StepType::Research,
            _ => return None,
        })
    }
}

/// One step of a Plan-then-Execute plan.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct PlanStep {
    #[serde(deserialize_with = "null_as_default")]
    pub goal: String,
    #[serde(deserialize_with = "null_as_default")]
    pub tool_hint: String,
    #[serde(deserialize_with = "null_as_default")]
    pub depends_on: Vec<i64>,
    /// pending | running | completed | failed
    #[serde(deserialize_with = "null_as_default")]
    pub status: String,
    #[serde(deserialize_with = "null_as_default")]
    pub result: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fields a client left unset, sent as `null` (TrustGraph 1.x's records do), are read as
    /// their defaults: the request did not decode before, and was dead-lettered unanswered.
    #[test]
    fn fields_sent_as_null_read_as_their_defaults() {
        let request: AgentRequest = serde_json::from_str(
            r#"{"question": "Why?", "history": null, "streaming": null, "collection": null,
                "session_id": null, "expected_siblings": null}"#,
        )
        .unwrap_or_default();
        assert_eq!(request.question, "Why?");
        assert!(request.history.is_empty() && !request.streaming);
        let step: AgentStep = serde_json::from_str(
            r#"{"thought": null, "arguments": null, "observation": "o", "step_type": null}"#,
        )
        .unwrap_or_default();
        assert_eq!(step.observation, "o");
        let plan: PlanStep =
            serde_json::from_str(r#"{"goal": "g", "depends_on": null, "tool_hint": null}"#)
                .unwrap_or_default();
        assert_eq!(plan.goal, "g");
    }
}
