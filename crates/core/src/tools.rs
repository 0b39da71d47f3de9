//! Tool definitions (TrustGraph's `tool` config values) and the group/state scoping that decides which
//! tools a request may see and call.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The state a request is in when it names none.
pub const UNDEFINED_STATE: &str = "undefined";
/// The group a tool or request belongs to when it names none.
pub const DEFAULT_GROUP: &str = "default";
/// The tool type that calls a tool on an MCP server; also its setting naming the `mcp` entry.
pub const MCP_TOOL: &str = "mcp-tool";

/// One configured tool: config type `tool`, key = tool id.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDef {
    /// The name the LLM uses in `Action:`.
    pub name: String,
    pub description: String,
    /// The tool kind: `text-completion`, `prompt`, `mcp-tool`, `knowledge-query`, ...
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub arguments: Vec<ToolArgument>,
    /// `None` means `["default"]`.
    #[serde(default)]
    pub group: Option<Vec<String>>,
    /// The state the dialog moves to after this tool ran.
    #[serde(default)]
    pub state: Option<String>,
    /// `None` means `["*"]`.
    #[serde(default, rename = "applicable-states")]
    pub applicable_states: Option<Vec<String>>,
    /// A call of this tool waits for a person's approval (`agentctl approve` / `deny`) before it
    /// runs; the step parks meanwhile, holding nothing.
    #[serde(
        default,
        rename = "requires-approval",
        skip_serializing_if = "std::ops::Not::not"
    )]
    pub requires_approval: bool,
    /// Kind-specific settings (`template`, `collection`, `mcp-tool`, ...), kept as given.
    #[serde(flatten)]
    pub settings: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolArgument {
    pub name: String,
    #[serde(rename = "type", default = "string_type")]
    pub kind: String,
    #[serde(default)]
    pub description: String,
}

impl ToolDef {
    /// The `mcp` entry an `mcp-tool` with id `key` calls: its `mcp-tool` setting, else its own id.
    pub fn mcp_id<'a>(&'a self, key: &'a str) -> &'a str {
        self.settings
            .get(MCP_TOOL)
            .and_then(|v| v.as_str())
            .unwrap_or(key)
    }
}

impl ToolDef {
    /// The tool's arguments as the JSON Schema object native tool calling offers the model. Types
    /// JSON Schema does not know are offered as strings; every argument is required unless its
    /// description marks it optional.
    pub fn parameters_schema(&self) -> serde_json::Value {
        let mut properties = serde_json::Map::new();
        let mut required = Vec::new();
        for argument in &self.arguments {
            let kind = match argument.kind.as_str() {
                k @ ("string" | "number" | "integer" | "boolean" | "object" | "array") => k,
                _ => "string",
            };
            let mut property =
                serde_json::json!({"type": kind, "description": argument.description});
            // OpenAI refuses an array schema without `items`.
            if kind == "array" {
                property["items"] = serde_json::json!({});
            }
            properties.insert(argument.name.clone(), property);
            if !argument
                .description
                .to_ascii_lowercase()
                .contains("optional")
            {
                required.push(serde_json::Value::String(argument.name.clone()));
            }
        }
        serde_json::json!({"type": "object", "properties": properties, "required": required})
    }
}

fn string_type() -> String {
    "string".to_owned()
}

/// The request's view of tool scoping, normalised as TrustGraph does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    groups: Vec<String>,
    state: String,
}

impl Scope {
    /// `group: null` means `["default"]`; an empty or missing state means `"undefined"`.
    pub fn new(group: Option<&[String]>, state: Option<&str>) -> Scope {
        let groups = match group {
            Some(g) => g.to_vec(),
            None => vec![DEFAULT_GROUP.to_owned()],
        };
        let state = match state {
            Some(s) if !s.is_empty() => s.to_owned(),
            _ => UNDEFINED_STATE.to_owned(),
        };
        Scope { groups, state }
    }

    pub fn state(&self) -> &str {
        &self.state
    }

    /// A tool is visible when its groups meet the request's (`"*"` in the request means all) and the
    /// request's state is among its applicable states (`"*"` means any).
    ///
    /// ```
    /// use agent_core::tools::{Scope, ToolDef};
    /// let tool: ToolDef = serde_json::from_str(
    ///     r#"{"name":"t","description":"","type":"text-completion","group":["ops"],"applicable-states":["triage"]}"#,
    /// ).unwrap();
    /// assert!(Scope::new(Some(&["ops".into()]), Some("triage")).allows(&tool));
    /// assert!(!Scope::new(None, Some("triage")).allows(&tool));
    /// assert!(!Scope::new(Some(&["*".into()]), None).allows(&tool));
    /// ```
    pub fn allows(&self, tool: &ToolDef) -> bool {
        let group_ok = self.groups.iter().any(|g| g == "*")
            || match &tool.group {
                Some(tool_groups) => tool_groups.iter().any(|g| self.groups.contains(g)),
                None => self.groups.iter().any(|g| g == DEFAULT_GROUP),
            };
        let state_ok = match &tool.applicable_states {
            Some(states) => states.iter().any(|s| s == "*" || *s == self.state),
            None => true,
        };
        group_ok && state_ok
    }

    /// The tools visible to this request, in a stable order (by tool id).
    pub fn visible<'a>(&self, tools: &'a BTreeMap<String, ToolDef>) -> Vec<&'a ToolDef> {
        tools.values().filter(|t| self.allows(t)).collect()
    }

    /// The state after `tool` ran: its `state` if set, else unchanged.
    pub fn next_state(&self, tool: &ToolDef) -> String {
        match &tool.state {
            Some(s) if !s.is_empty() => s.clone(),
            _ => self.state.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(group: Option<&[&str]>, states: Option<&[&str]>, next: Option<&str>) -> ToolDef {
        ToolDef {
            name: "t".into(),
            description: String::new(),
            kind: "text-completion".into(),
            arguments: vec![],
            group: group.map(|g| g.iter().map(|s| s.to_string()).collect()),
            state: next.map(str::to_owned),
            applicable_states: states.map(|g| g.iter().map(|s| s.to_string()).collect()),
            requires_approval: false,
            settings: BTreeMap::new(),
        }
    }

    fn groups(g: &[&str]) -> Vec<String> {
        g.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn default_group_and_state_apply_to_both_sides() {
        let plain = tool(None, None, None);
        assert!(Scope::new(None, None).allows(&plain));
        assert!(Scope::new(Some(&groups(&["default"])), Some("")).allows(&plain));
        assert!(!Scope::new(Some(&groups(&["research"])), None).allows(&plain));
        assert!(Scope::new(Some(&groups(&["*"])), None).allows(&plain));
    }

    #[test]
    fn groups_must_intersect() {
        let t = tool(Some(&["a", "b"]), None, None);
        assert!(Scope::new(Some(&groups(&["b", "z"])), None).allows(&t));
        assert!(!Scope::new(Some(&groups(&["z"])), None).allows(&t));
        assert!(!Scope::new(None, None).allows(&t));
        assert!(!Scope::new(Some(&[]), None).allows(&t));
    }

    #[test]
    fn applicable_states_gate_tools_and_state_moves_on() {
        let t = tool(None, Some(&["undefined"]), Some("analysis"));
        let scope = Scope::new(None, None);
        assert!(scope.allows(&t));
        assert_eq!(scope.next_state(&t), "analysis");
        let later = Scope::new(None, Some("analysis"));
        assert!(!later.allows(&t));
        assert!(later.allows(&tool(None, Some(&["*"]), None)));
        assert_eq!(later.next_state(&tool(None, None, None)), "analysis");
    }

    #[test]
    fn tool_config_keeps_kind_specific_settings() {
        let t: ToolDef = serde_json::from_str(
            r#"{"name":"p","description":"d","type":"prompt","template":"Hi {{x}}","arguments":[{"name":"x"}]}"#,
        )
        .unwrap();
        assert_eq!(t.settings["template"], "Hi {{x}}");
        assert_eq!(t.arguments[0].kind, "string");
    }
}
