//! Run control: messages that steer dialogs already running. They travel on their own topic
//! (`non-persistent://tg/notify/agent-control:{workspace}:{flow}`), which every orchestrator
//! replica hears, so a TrustGraph client never sees them and the request topics stay TrustGraph's.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a control message asks for.
pub mod control_operation {
    /// Stop the session and every subagent under it, at every depth.
    pub const CANCEL: &str = "cancel";
}

/// A control message.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct AgentControl {
    /// See [`control_operation`].
    pub operation: String,
    /// The session it applies to (and so its subagents).
    pub session_id: String,
    /// Who asked (recorded in the provenance graph).
    pub by: String,
    /// Why, in the asker's words; may be empty.
    pub reason: String,
    /// When it was asked (RFC 3339, UTC).
    pub at: String,
}
