//! `AgentRequest` and the history it carries between iterations.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
    pub question: String,
    /// The tool state; `null` or empty means `"undefined"`.
    pub state: Option<String>,
    /// The tool groups the request may use; `null` means `["default"]`, `"*"` means all.
    pub group: Option<Vec<String>>,
    pub history: Vec<AgentStep>,
    pub collection: String,
    pub streaming: bool,
    pub session_id: String,
    pub conversation_id: String,
    pub pattern: String,
    pub task_type: String,
    pub framing: String,
    pub correlation_id: String,
    pub parent_session_id: String,
    pub subagent_goal: String,
    pub expected_siblings: i64,
}

/// One completed step of the dialog.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct AgentStep {
    pub thought: String,
    pub action: String,
    pub arguments: BTreeMap<String, String>,
    pub observation: String,
    /// One of [`StepType`] as text; TrustGraph sends `""` for a ReACT step.
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
    pub goal: String,
    pub tool_hint: String,
    pub depends_on: Vec<i64>,
    /// pending | running | completed | failed
    pub status: String,
    pub result: String,
}
