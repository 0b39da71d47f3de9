//! Run control: messages that steer dialogs already running. They travel on topics of their own,
//! so a TrustGraph client never sees them and the request topics stay TrustGraph's: a cancel on
//! `non-persistent://tg/notify/agent-control:{workspace}:{flow}`, which every orchestrator replica
//! hears; an approval's answer on `persistent://tg/request/agent-control:{workspace}:{flow}`, which
//! one replica takes up and which survives a restart.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// What a control message asks for.
pub mod control_operation {
    /// Stop the session and every subagent under it, at every depth.
    pub const CANCEL: &str = "cancel";
    /// Run the tool call parked for approval at `step` (with `arguments` instead, when given).
    pub const APPROVE: &str = "approve";
    /// Do not run it: the agent is told, and goes on without it.
    pub const DENY: &str = "deny";
    /// No answer came in time (sent by the aggregator's sweep): the dialog ends.
    pub const EXPIRE: &str = "expire";
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
    /// The iteration an approval answers (1 is the first).
    pub step: Option<u64>,
    /// An approval's edited arguments for the tool, replacing those the agent chose.
    pub arguments: Option<std::collections::BTreeMap<String, String>>,
}
