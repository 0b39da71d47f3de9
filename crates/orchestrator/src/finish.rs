//! How a dialog ends. A client's dialog ends with the closing answer (or an error) carrying
//! `end_of_dialog`; a subagent's ends with a `tg:SubagentCompletion` for its supervisor's fan-in,
//! and the client only sees it as an observation: a failing subagent never ends the client's dialog.

use agent_bus::BusError;
use agent_core::provenance;
use agent_core::supervisor::{completion_seal_parts, is_subagent};
use agent_schema::{AgentResponse, MessageType};

use crate::Turn;

/// Ends the dialog with `answer`; `tokens` are the dialog's totals.
pub async fn answer(
    turn: &Turn<'_>,
    answer: &str,
    tokens: crate::budget::Tokens,
    model: &str,
) -> Result<(), BusError> {
    if is_subagent(turn.request) {
        return complete(turn, "answer", answer, tokens).await;
    }
    let content = if turn.request.streaming { "" } else { answer };
    let mut r = AgentResponse::new(MessageType::Answer, content);
    r.end_of_message = true;
    r.end_of_dialog = true;
    r.message_id = turn.uris.conclusion();
    r.in_token = Some(tokens.input);
    r.out_token = Some(tokens.output);
    r.model = Some(model.to_owned());
    turn.out.respond(&r)
}

/// Ends the dialog with an error.
pub async fn error(turn: &Turn<'_>, message: &str) -> Result<(), BusError> {
    if is_subagent(turn.request) {
        return complete(turn, "error", message, turn.tokens_before).await;
    }
    let mut r = AgentResponse::error(message);
    r.message_id = turn.uris.conclusion();
    r.in_token = Some(turn.tokens_before.input);
    r.out_token = Some(turn.tokens_before.output);
    turn.out.respond(&r)
}

/// The subagent's end: its result and the tokens its dialog used, for the supervisor's totals.
async fn complete(
    turn: &Turn<'_>,
    status: &str,
    result: &str,
    tokens: crate::budget::Tokens,
) -> Result<(), BusError> {
    let request = turn.request;
    turn.out
        .chunk(
            MessageType::Observation,
            result,
            &turn.uris.conclusion(),
            true,
        )
        .await?;
    let node = turn.uris.completion();
    let mut recorded = provenance::completion(
        turn.uris,
        &request.correlation_id,
        &request.parent_session_id,
        &request.subagent_goal,
        status,
        result,
        tokens.pair(),
    );
    if let Some(key) = turn.seal {
        let parts = completion_seal_parts(&node, &request.correlation_id, status, result);
        recorded.extend(provenance::sealed(&node, &key.seal(&parts)));
    }
    turn.out.explain(&node, recorded)
}
