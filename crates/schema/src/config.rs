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
}

#[cfg(test)]
mod tests {
    use super::*;

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
