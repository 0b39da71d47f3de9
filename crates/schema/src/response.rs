//! `AgentResponse`: the chunks of a dialog as the client sees them.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Triple;

/// One message of the response stream.
///
/// Streaming semantics (TrustGraph's): thought chunks, the last with `end_of_message`; observations
/// whole; answer chunks without `end_of_message`; the dialog closes with an empty answer carrying
/// `end_of_message`, `end_of_dialog` and the dialog's token counts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct AgentResponse {
    /// thought | observation | answer | explain | error
    pub message_type: String,
    pub content: String,
    pub end_of_message: bool,
    pub end_of_dialog: bool,
    pub explain_id: Option<String>,
    pub explain_graph: Option<String>,
    pub explain_triples: Vec<Triple>,
    /// The provenance URI of the message, e.g. `urn:trustgraph:agent:{sid}/i3/thought`.
    pub message_id: String,
    pub error: Option<ErrorInfo>,
    pub in_token: Option<u64>,
    pub out_token: Option<u64>,
    pub model: Option<String>,
}

/// The error carried by a `message_type: "error"` response.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct ErrorInfo {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}

/// The values of [`AgentResponse::message_type`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MessageType {
    Thought,
    Observation,
    Answer,
    Explain,
    Error,
}

impl MessageType {
    pub fn as_str(self) -> &'static str {
        match self {
            MessageType::Thought => "thought",
            MessageType::Observation => "observation",
            MessageType::Answer => "answer",
            MessageType::Explain => "explain",
            MessageType::Error => "error",
        }
    }

    pub fn parse(text: &str) -> Option<MessageType> {
        Some(match text {
            "thought" => MessageType::Thought,
            "observation" => MessageType::Observation,
            "answer" => MessageType::Answer,
            "explain" => MessageType::Explain,
            "error" => MessageType::Error,
            _ => return None,
        })
    }
}

impl AgentResponse {
    /// A response of the given type with every other field at its wire default.
    pub fn new(message_type: MessageType, content: impl Into<String>) -> Self {
        AgentResponse {
            message_type: message_type.as_str().to_owned(),
            content: content.into(),
            ..AgentResponse::default()
        }
    }

    /// The dialog-ending error response.
    pub fn error(message: impl Into<String>) -> Self {
        let message = message.into();
        AgentResponse {
            end_of_message: true,
            end_of_dialog: true,
            error: Some(ErrorInfo {
                kind: "agent-error".to_owned(),
                message: message.clone(),
            }),
            ..AgentResponse::new(MessageType::Error, message)
        }
    }

    pub fn kind(&self) -> Option<MessageType> {
        MessageType::parse(&self.message_type)
    }
}
