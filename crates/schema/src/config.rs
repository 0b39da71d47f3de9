//! The config service's messages: TrustGraph's config request/response protocol and its change push.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ErrorInfo;

/// Operations of [`ConfigRequest`].
pub mod operation {
    pub const GET: &str = "get";
    pub const LIST: &str = "list";
    pub const GET_VALUES: &str = "getvalues";
    pub const PUT: &str = "put";
    pub const DELETE: &str = "delete";
    pub const CONFIG: &str = "config";
    /// Every value of a type in every workspace (TrustGraph 2.x services read it at start).
    pub const GET_VALUES_ALL_WS: &str = "getvalues-all-ws";
    /// Every `(workspace, key)` of a type, without the values.
    pub const GET_KEYS_ALL_WS: &str = "getkeys-all-ws";
}

/// One entry to read or delete.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ConfigKey {
    #[serde(rename = "type")]
    pub kind: String,
    pub key: String,
}

/// One entry with its value: JSON text, as TrustGraph stores it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ConfigValue {
    #[serde(rename = "type")]
    pub kind: String,
    pub key: String,
    pub value: String,
    pub workspace: Option<String>,
}

/// `get` reads `keys`; `list` and `getvalues` read `type`; `put` writes `values`; `delete` removes
/// `keys`; `config` returns everything; all within `workspace` (TrustGraph 2.x). The `-all-ws`
/// operations read one `type` across workspaces.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ConfigRequest {
    pub operation: String,
    pub workspace: Option<String>,
    // TrustGraph 1.x's clients send a list they did not set as `null`.
    #[serde(deserialize_with = "null_as_empty")]
    pub keys: Vec<ConfigKey>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    #[serde(deserialize_with = "null_as_empty")]
    pub values: Vec<ConfigValue>,
}

/// A list, `null` read as none (missing, `#[serde(default)]` does it).
fn null_as_empty<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default())
}

/// The answer to a [`ConfigRequest`], correlated by the `id` property.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ConfigResponse {
    pub version: Option<u64>,
    pub values: Option<Vec<ConfigValue>>,
    pub directory: Option<Vec<String>>,
    /// type -> key -> value (JSON text).
    pub config: Option<BTreeMap<String, BTreeMap<String, String>>>,
    pub error: Option<ErrorInfo>,
}

/// Sent on the push topic at start and after every write that changed something (TrustGraph 2.x):
/// readers fetch what they need again. An empty `changes` means "everything".
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ConfigPush {
    pub version: u64,
    /// config type -> workspaces whose values of that type changed.
    pub changes: BTreeMap<String, Vec<String>>,
    /// Workspaces made or removed (TrustGraph 2.11): TrustGraph's services take up a workspace's
    /// queues when it is created and drop them when it is deleted. Absent (or `null`): none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_changes: Option<WorkspaceChanges>,
}

/// The workspace that lists the workspaces (TrustGraph 2.11): each key of type
/// [`WORKSPACE_TYPE`] in it is one workspace.
pub const WORKSPACES_NAMESPACE: &str = "__workspaces__";
/// The type of a workspace's key in [`WORKSPACES_NAMESPACE`].
pub const WORKSPACE_TYPE: &str = "workspace";
/// The workspace a workspace is filled from when it is listed (TrustGraph 2.11): its keys that
/// the new workspace lacks are copied in.
pub const TEMPLATE_WORKSPACE: &str = "__template__";

/// Workspaces made and removed by the write a [`ConfigPush`] announces.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct WorkspaceChanges {
    #[serde(deserialize_with = "null_as_empty")]
    pub created: Vec<String>,
    #[serde(deserialize_with = "null_as_empty")]
    pub deleted: Vec<String>,
}

impl WorkspaceChanges {
    pub fn is_empty(&self) -> bool {
        self.created.is_empty() && self.deleted.is_empty()
    }

    /// `later` after `self`, as one: what a workspace ends as wins (created then deleted is
    /// deleted; deleted then created is created), since TrustGraph's services take a push's
    /// creations before its deletions.
    pub fn then(mut self, later: WorkspaceChanges) -> WorkspaceChanges {
        for workspace in later.created {
            self.deleted.retain(|w| w != &workspace);
            if !self.created.contains(&workspace) {
                self.created.push(workspace);
            }
        }
        for workspace in later.deleted {
            self.created.retain(|w| w != &workspace);
            if !self.deleted.contains(&workspace) {
                self.deleted.push(workspace);
            }
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_carries_workspace_changes_as_trustgraph_2_11_does() {
        // As TrustGraph's config service sends them (dataclass_to_dict: None is null).
        let push: ConfigPush = serde_json::from_str(
            r#"{"version": 3, "changes": {}, "workspace_changes": {"created": ["acme"], "deleted": []}}"#,
        )
        .unwrap();
        assert_eq!(
            push.workspace_changes,
            Some(WorkspaceChanges {
                created: vec!["acme".into()],
                deleted: vec![],
            })
        );
        let none: ConfigPush =
            serde_json::from_str(r#"{"version": 3, "changes": {}, "workspace_changes": null}"#)
                .unwrap();
        assert_eq!(none.workspace_changes, None);
        // Ours names it only when there is one: a reader of an earlier build sees what it knew.
        let encoded = serde_json::to_string(&ConfigPush {
            version: 1,
            ..ConfigPush::default()
        })
        .unwrap();
        assert_eq!(encoded, r#"{"version":1,"changes":{}}"#);
    }

    #[test]
    fn workspace_changes_together_end_as_the_later_says() {
        let made = |w: &str| WorkspaceChanges {
            created: vec![w.into()],
            deleted: vec![],
        };
        let gone = |w: &str| WorkspaceChanges {
            created: vec![],
            deleted: vec![w.into()],
        };
        assert_eq!(made("a").then(gone("a")), gone("a"));
        assert_eq!(gone("a").then(made("a")), made("a"));
        let both = made("a").then(made("b")).then(gone("c"));
        assert_eq!(both.created, vec!["a".to_owned(), "b".to_owned()]);
        assert_eq!(both.deleted, vec!["c".to_owned()]);
    }

    #[test]
    fn a_trustgraph_1x_request_with_null_lists_decodes() {
        let request: ConfigRequest = serde_json::from_str(
            r#"{"operation": "config", "keys": null, "type": null, "values": null}"#,
        )
        .unwrap();
        assert_eq!(request.operation, "config");
        assert!(request.keys.is_empty() && request.values.is_empty() && request.kind.is_none());
        let request: ConfigRequest = serde_json::from_str(
            r#"{"operation": "get", "keys": [{"type": "prompt", "key": "system"}]}"#,
        )
        .unwrap();
        assert_eq!(request.keys[0].key, "system");
    }
}
