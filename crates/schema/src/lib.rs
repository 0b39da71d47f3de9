//! TrustGraph-compatible wire types of the agent service and its config service.
//!
//! Every message is plain UTF-8 JSON with every field present and `null` for None, exactly as
//! TrustGraph serialises it, so that this service is a drop-in on the same topics. The types derive
//! `JsonSchema`; `schemas/` holds the generated schemas and a test fails when they drift.

mod config;
mod control;
mod librarian;
mod request;
mod response;
mod triples;

pub use config::{
    operation, ConfigKey, ConfigPush, ConfigRequest, ConfigResponse, ConfigValue, WorkspaceChanges,
    TEMPLATE_WORKSPACE, WORKSPACES_NAMESPACE, WORKSPACE_TYPE,
};
pub use control::{control_operation, AgentControl};
pub use librarian::{librarian_operation, DocumentMetadata, LibrarianRequest, LibrarianResponse};
pub use request::{AgentRequest, AgentStep, PlanStep, StepType};
pub use response::{AgentResponse, ErrorInfo, MessageType};
pub use triples::{append_triples, append_triples_below, Metadata, Term, Triple, Triples};

/// The message property that correlates a request with its responses and `next` requests.
pub const ID_PROPERTY: &str = "id";
/// Our message property on `next` requests: input tokens the dialog used so far.
pub const IN_TOKEN_PROPERTY: &str = "agent-in-token";
/// Our message property on `next` requests: output tokens the dialog used so far.
pub const OUT_TOKEN_PROPERTY: &str = "agent-out-token";
/// Our message property on `next` requests: when the dialog's first message was taken up (Unix
/// milliseconds), for the wall-time budget.
pub const STARTED_PROPERTY: &str = "agent-started-ms";
/// Our message property on an ensemble agent's requests: the model its LLM calls ask for (one of
/// the models config lists for the ensemble; any other is ignored).
pub const MODEL_PROPERTY: &str = "agent-model";
/// Our message property on a subagent's requests: the tokens its run (the root request and every
/// subagent) had used when the subagent was started, for the shared budget.
pub const RUN_TOKENS_PROPERTY: &str = "agent-run-tokens";

/// Our message property on a fork's first request (`agentctl fork`): the session it was forked
/// from. With [`FORK_STEP_PROPERTY`], the step whose recorded input it starts from.
pub const FORK_OF_PROPERTY: &str = "agent-fork-of";
/// Our message property on a fork's first request: the step of the source it starts at.
pub const FORK_STEP_PROPERTY: &str = "agent-fork-step";
/// Our message property on every request of a replay: what it gives again from the recorded run
/// named by [`REUSE_FROM_PROPERTY`] instead of calling: `llm` (answers to the very same LLM
/// question), `tools` (results of the same tool with the same arguments) or `all`.
pub const REUSE_PROPERTY: &str = "agent-reuse";
/// Our message property on every request of a replay: the run (root session) it reuses from.
pub const REUSE_FROM_PROPERTY: &str = "agent-reuse-from";

/// Our message property on every journaled message: the same on a re-emission of it after a crash
/// (`{journal entry}#{index}`), so a consumer can drop the copy. A TrustGraph client ignores it.
pub const EFFECT_ID_PROPERTY: &str = "agent-effect-id";

/// Our message property on every streamed chunk and on the closing response: which delivery of
/// the step sent it. A step cut short by a crash after streaming some text runs again and streams
/// it again under another attempt (chunks are a live view, not journaled), and two copies of one
/// request may stream side by side; the closing names the attempt whose outcome stands, so a
/// client keeps that attempt's text as the answer. A TrustGraph client ignores it.
pub const ATTEMPT_PROPERTY: &str = "agent-attempt";

/// Our message property on every streamed chunk of answer text: its place (from 0) among the
/// answer chunks of its attempt. A non-persistent response topic may drop a message (Apache
/// Pulsar drops what a subscription has no permits or write buffer for), and a streamed answer's
/// closing carries no text, so a client that joined what came would show the answer with a hole
/// in it; the places, with [`ANSWER_CHUNKS_PROPERTY`], let it see the hole. A TrustGraph client
/// ignores it.
pub const ANSWER_CHUNK_PROPERTY: &str = "agent-answer-chunk";
/// Our message property on the closing response: how many chunks of answer text the attempt it
/// names ([`ATTEMPT_PROPERTY`]) streamed. A client that got fewer, or not each in its place, reads
/// the answer back from the graph (the dialog's conclusion). A TrustGraph client ignores it.
pub const ANSWER_CHUNKS_PROPERTY: &str = "agent-answer-chunks";

/// Why a payload could not be decoded.
pub type DecodeError = serde_json::Error;

/// Decodes a wire payload.
pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, DecodeError> {
    serde_json::from_slice(bytes)
}

/// Encodes a wire payload.
pub fn encode<T: serde::Serialize>(value: &T) -> Vec<u8> {
    // Serialising these plain data types cannot fail: every map key is a string.
    serde_json::to_vec(value).unwrap_or_default()
}

/// JSON Schemas of every wire message, by file name, as written into `schemas/`.
pub fn json_schemas() -> Vec<(&'static str, String)> {
    fn pretty<T: schemars::JsonSchema>() -> String {
        let schema = schemars::schema_for!(T);
        let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
        text.push('\n');
        text
    }
    vec![
        ("agent-request.schema.json", pretty::<AgentRequest>()),
        ("agent-response.schema.json", pretty::<AgentResponse>()),
        ("triples.schema.json", pretty::<Triples>()),
        ("config-request.schema.json", pretty::<ConfigRequest>()),
        ("config-response.schema.json", pretty::<ConfigResponse>()),
        ("config-push.schema.json", pretty::<ConfigPush>()),
        ("agent-control.schema.json", pretty::<AgentControl>()),
    ]
}
