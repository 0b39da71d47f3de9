//! How a dialog ends. A client's dialog ends with the closing answer (or an error) carrying
//! `end_of_dialog`; a subagent's ends with a `tg:SubagentCompletion` for its supervisor's fan-in,
//! and the client only sees it as an observation: a failing subagent never ends the client's dialog.
//! Every pattern ends through here: an answer, an error, a limit reached, a failed LLM call.

use agent_bus::BusError;
use agent_core::documents::steps_taken;
use agent_core::pattern::Termination;
use agent_core::provenance::{self, CallStats};
use agent_core::supervisor::{completion_seal_parts, is_subagent};
use agent_llm::LlmError;
use agent_schema::{AgentResponse, MessageType};

use crate::turn::Turn;

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
    error_with(turn, message, turn.tokens_before).await
}

/// [`error`], the dialog having used `tokens` in all.
async fn error_with(
    turn: &Turn<'_>,
    message: &str,
    tokens: crate::budget::Tokens,
) -> Result<(), BusError> {
    if is_subagent(turn.request) {
        return complete(turn, "error", message, tokens).await;
    }
    let mut r = AgentResponse::error(message);
    r.message_id = turn.uris.conclusion();
    r.in_token = Some(tokens.input);
    r.out_token = Some(tokens.output);
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
        .chunk_with_outcome(
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
        // Sealed as the aggregator will read it from the graph.
        let recorded_result = turn.out.as_recorded(result);
        let parts = completion_seal_parts(&node, &request.correlation_id, status, &recorded_result);
        recorded.extend(provenance::sealed(&node, &key.seal(&parts)));
    }
    turn.out.explain(&node, recorded)
}

/// Ends a subagent's dialog whose supervisor stopped waiting for it (its fan-out timed out and
/// was answered without it); `None` while it is waited for. `parked`: the call parked for
/// approval it ends at, whose choosing is counted (see [`fail_parked`]).
pub async fn end_if_abandoned(
    turn: &Turn<'_>,
    parked: Option<&crate::approval::ToolDecision>,
) -> Option<Result<(), BusError>> {
    if !turn.abandoned {
        return None;
    }
    let n = steps_taken(&turn.request.history) + 1;
    let why = "the supervisor stopped waiting for this subagent: its fan-out timed out and was answered without it";
    Some(fail_parked(turn, n, why, parked).await)
}

/// Ends the dialog when it has used all its iterations or a budget, before any LLM call; `None`
/// when it may go on. Every pattern checks this first.
pub async fn conclude_if_limited(turn: &Turn<'_>) -> Option<Result<(), BusError>> {
    if let Some(ended) = end_if_abandoned(turn, None).await {
        return Some(ended);
    }
    let limits = &turn.config.limits;
    if steps_taken(&turn.request.history) >= limits.max_iterations {
        let max = limits.max_iterations;
        let why = format!(
            "I could not reach a final answer within the limit of {max} iterations (max_iterations)."
        );
        return Some(conclude_at_limit(turn, Termination::MaxIterations, &why, Vec::new()).await);
    }
    let spent = turn.spent_budget()?;
    let why = format!("I stopped before reaching a final answer: {spent}.");
    let record = provenance::budget_spent(
        turn.uris,
        spent.limit,
        turn.run_tokens,
        turn.elapsed.as_millis() as u64,
    );
    Some(conclude_at_limit(turn, Termination::Budget, &why, record).await)
}

/// [`conclude_if_limited`] for a step that would fan out. Its subagents' results come back as
/// the step after it (the fan-out and the results are two steps of the history), which
/// `max_iterations` must leave room for: before 2026-12-05 a supervisor or an ensemble under
/// `max_iterations: 1` ran every subagent, and the request that brought their results was then
/// refused ("more than max_iterations"), so the client got an error after all the spending.
pub async fn conclude_if_no_room_to_fan_out(turn: &Turn<'_>) -> Option<Result<(), BusError>> {
    if let Some(done) = conclude_if_limited(turn).await {
        return Some(done);
    }
    let max = turn.config.limits.max_iterations;
    let back = steps_taken(&turn.request.history).saturating_add(2);
    if back <= max {
        return None;
    }
    let why = format!(
        "I could not start subagents within the limit of {max} iterations (max_iterations): their results would come back as iteration {back}."
    );
    Some(conclude_at_limit(turn, Termination::MaxIterations, &why, Vec::new()).await)
}

/// Ends a dialog that reached a limit (`why`) with a clear answer, what it knew last, and a
/// provenance record of the reason.
async fn conclude_at_limit(
    turn: &Turn<'_>,
    termination: Termination,
    why: &str,
    record: Vec<agent_schema::Triple>,
) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        llm,
        ..
    } = turn;
    // A long observation travels as an excerpt: the answer gives it whole, as the client saw it.
    let history = crate::documents::resolve_recent(turn.documents, &request.history).await;
    let answer = match history.last() {
        Some(step) => format!("{why} The last observation was: {}", step.observation),
        None => why.to_owned(),
    };
    let n = steps_taken(&request.history) + 1;
    let mut triples = provenance::conclusion(
        uris,
        n,
        "",
        &answer,
        termination,
        &[],
        &CallStats::default(),
    );
    triples.extend(record);
    out.explain(&uris.conclusion(), triples)?;
    if request.streaming {
        out.chunk_with_outcome(MessageType::Answer, &answer, &uris.conclusion(), false)
            .await?;
    }
    self::answer(turn, &answer, turn.tokens_before, llm.model()).await
}

/// An LLM call of iteration `n` failed with `e`. An outage, while the step may still wait it out,
/// parks the step (nothing it did is committed, and it runs again later); anything else ends the
/// dialog with the error.
pub async fn llm_failed(turn: &Turn<'_>, n: usize, e: &LlmError) -> Result<(), BusError> {
    if !e.is_outage() {
        return fail(turn, n, &format!("the LLM call failed: {e}")).await;
    }
    if turn.may_park && !turn.out.answer_streamed() {
        turn.out.park(crate::emit::Park {
            cause: format!("the LLM is unavailable: {e}"),
            retry_after: e.retry_after(),
        });
        return Ok(());
    }
    let window = turn.config.limits.max_outage_secs;
    fail(
        turn,
        n,
        &format!("the LLM stayed unavailable past the outage window of {window} s (max_outage_secs): {e}"),
    )
    .await
}

/// Ends a cancelled dialog: the client's with one error response of type `cancelled` (a
/// subagent's with a `cancelled` completion, so its supervisor, cancelled too, closes at once),
/// its conclusion linked to the cancellation that ended it. Nothing else of the step is kept.
pub async fn cancelled(
    turn: &Turn<'_>,
    cancel: &crate::cancel::Cancel,
    parked: Option<&crate::approval::ToolDecision>,
) -> Result<(), BusError> {
    let Turn { uris, out, .. } = turn;
    let message = cancel.message();
    let n = steps_taken(&turn.request.history) + 1;
    let (cost, tokens) = cost_of(turn, parked);
    let mut triples =
        provenance::conclusion(uris, n, "", &message, Termination::Cancelled, &[], &cost);
    triples.extend(provenance::cancelled_by(uris, &cancel.node()));
    out.explain(&uris.conclusion(), triples)?;
    if is_subagent(turn.request) {
        return complete(turn, Termination::Cancelled.as_str(), &message, tokens).await;
    }
    let mut r = AgentResponse::error(message);
    if let Some(error) = &mut r.error {
        error.kind = Termination::Cancelled.as_str().to_owned();
    }
    r.message_id = turn.uris.conclusion();
    r.in_token = Some(tokens.input);
    r.out_token = Some(tokens.output);
    turn.out.respond(&r)
}

/// What a dialog ending at a call parked for approval (`parked`) costs beyond its tokens before:
/// the LLM call that chose the tool, which no node records until the call is answered (approved
/// or denied). Without it the closing, a subagent's completion and the run's budget left it out.
fn cost_of(
    turn: &Turn<'_>,
    parked: Option<&crate::approval::ToolDecision>,
) -> (CallStats, crate::budget::Tokens) {
    // The step's calls whose nodes record their cost are counted in the tokens only.
    let recorded = crate::emit::locked(&turn.recorded_calls).clone();
    let (cost, tokens) = match parked {
        Some(decision) => (decision.stats.clone(), decision.tokens),
        None => (CallStats::default(), turn.tokens_before),
    };
    (cost, tokens.plus(recorded.in_token, recorded.out_token))
}

/// Ends the dialog with an error response and records why.
pub async fn fail(turn: &Turn<'_>, n: usize, message: &str) -> Result<(), BusError> {
    fail_parked(turn, n, message, None).await
}

/// [`fail`] at a call parked for approval (`parked`) that is not made (no answer in time, one
/// too late): the call that chose it is counted (see [`cost_of`]).
pub async fn fail_parked(
    turn: &Turn<'_>,
    n: usize,
    message: &str,
    parked: Option<&crate::approval::ToolDecision>,
) -> Result<(), BusError> {
    let Turn { uris, out, .. } = turn;
    let (cost, tokens) = cost_of(turn, parked);
    let triples = provenance::conclusion(uris, n, "", message, Termination::Error, &[], &cost);
    out.explain(&uris.conclusion(), triples)?;
    error_with(turn, message, tokens).await
}
