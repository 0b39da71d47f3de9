//! One ReACT iteration: prompt the LLM with the question, the visible tools and the history; stream its
//! thought (and answer); then either answer and close the dialog, or run the chosen tool and queue the
//! next iteration with the grown history.

use agent_bus::BusError;
use agent_core::config::ToolCalling;
use agent_core::pattern::Termination;
use agent_core::provenance::{self, CallStats, SessionUris, ToolStats};
use agent_core::react::{
    parse, strip_echoed_observation, tool_call_arguments, ReactDelta, ReactParseError, ReactStream,
    ReactTurn,
};
use agent_core::tools::{Scope, ToolDef};
use agent_llm::{CallOptions, ChatMessage, Completion, LlmClient, LlmError, ToolCall, ToolSpec};
use agent_schema::{AgentStep, MessageType, StepType};
use tokio::sync::mpsc;

use crate::output::DialogOutput;
use crate::tool_exec::run_scoped_tool;
use crate::Turn;

/// What the model writes when it runs on past its action: a stop sequence there saves the tokens
/// (the parser discards that text either way).
pub const OBSERVATION_STOP: &str = "\nObservation:";

/// Runs the iteration. `Err` only for publish failures: the message is then nacked and redone.
pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        llm,
        ..
    } = turn;
    let n = request.history.len() + 1;
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let candidates: Vec<&str> = visible.iter().map(|t| t.name.as_str()).collect();
    let native = calls_natively(turn);
    let streamed = request.streaming && !native;
    let last_observation = request
        .history
        .last()
        .map_or("", |step| step.observation.as_str());
    let completion = if native {
        let messages = native_messages(turn, &visible);
        let options = CallOptions {
            tools: visible
                .iter()
                .map(|t| ToolSpec {
                    name: t.name.clone(),
                    description: t.description.clone(),
                    parameters: t.parameters_schema(),
                })
                .collect(),
            ..CallOptions::default()
        };
        if request.streaming {
            // Deltas are gathered by the client and not passed on (see `streamed`).
            let (tx, _) = mpsc::channel::<String>(1);
            llm.stream_with(&messages, &options, tx).await
        } else {
            llm.complete_with(&messages, &options).await
        }
    } else {
        let (system, user) = agent_core::prompt::react_prompt(
            &config.prompts.react,
            &request.question,
            &request.framing,
            &visible,
            &request.history,
        );
        let messages = [ChatMessage::system(system), ChatMessage::user(user)];
        let options = turn.react_call();
        if request.streaming {
            stream_turn(llm, &messages, &options, out, uris, n, last_observation).await?
        } else {
            llm.complete_with(&messages, &options).await
        }
    };
    let completion = match completion {
        Ok(c) => c,
        Err(e) => return llm_failed(turn, n, &e).await,
    };
    let stats = crate::call_stats(&completion);
    let tokens = turn
        .tokens_before
        .plus(completion.in_token, completion.out_token);

    let parsed = if native {
        read_native(&completion, &candidates)
    } else {
        read_text(&completion, last_observation)
    };
    match parsed {
        Ok(ReactTurn::Final { thought, answer }) => {
            if !streamed && !thought.is_empty() {
                out.chunk(MessageType::Thought, &thought, &uris.thought(n), true)
                    .await?;
            }
            if request.streaming && !streamed {
                out.chunk(MessageType::Answer, &answer, &uris.conclusion(), false)
                    .await?;
            }
            let triples = provenance::conclusion(
                uris,
                n,
                &thought,
                &answer,
                Termination::Answer,
                &candidates,
                &stats,
            );
            out.explain(&uris.conclusion(), triples)?;
            crate::finish::answer(turn, &answer, tokens, &completion.model).await
        }
        Ok(ReactTurn::Action {
            thought,
            action,
            arguments,
            discarded,
        }) => {
            if !streamed && !thought.is_empty() {
                out.chunk(MessageType::Thought, &thought, &uris.thought(n), true)
                    .await?;
            }
            let (run, next_state) =
                run_scoped_tool(turn, &scope, &action, &arguments, &candidates).await;
            // The tool's LLM is down: the step waits for it rather than observe the outage.
            if turn.out.parked().is_some() {
                return Ok(());
            }
            let arguments_json = serde_json::to_string(&arguments).unwrap_or_default();
            let step = AgentStep {
                thought,
                action,
                arguments,
                observation: run.observation,
                step_type: StepType::React.as_str().to_owned(),
                plan: None,
                subagent_results: None,
            };
            let tool = ToolStats {
                duration_ms: run.duration.as_millis() as u64,
                in_token: run.in_token,
                out_token: run.out_token,
            };
            let tokens = tokens.plus(run.in_token, run.out_token);
            record_step(
                turn,
                n,
                step,
                &arguments_json,
                &discarded,
                &candidates,
                &stats,
                tool,
                next_state,
                tokens,
            )
            .await
        }
        Err(observation) => {
            record_unusable(
                turn,
                n,
                &completion,
                observation,
                &candidates,
                &stats,
                tokens,
            )
            .await
        }
    }
}

/// Whether the LLM's text reaches the client as the model writes it. Only under the text protocol,
/// where the parser knows at once what is thought and what is answer: a native answer's text is
/// held until the model has decided, as text it wrote before a tool call is thought, not answer.
fn streams_text(turn: &Turn<'_>) -> bool {
    turn.request.streaming && !calls_natively(turn)
}

/// Whether the model is asked to call tools natively (`tool-calling: native`).
fn calls_natively(turn: &Turn<'_>) -> bool {
    turn.config.model_options(turn.llm.model()).tool_calling == ToolCalling::Native
}

/// The decision in a text-protocol completion, or the observation that tells the LLM why there is
/// none. An echo of the last real observation at its start is not an invented one. A cut-off
/// answer is never acted on: half a final answer or half an action's arguments would pass for
/// whole ones.
fn read_text(completion: &Completion, last_observation: &str) -> Result<ReactTurn, String> {
    if completion.cut_off {
        return Err("Error: your response was cut off before it ended. Reply again, more briefly, with 'Thought:' followed by either 'Action:' and 'Args:', or 'Final Answer:'.".to_owned());
    }
    parse(strip_echoed_observation(&completion.text, last_observation)).map_err(|e| format!(
        "Error: your response could not be parsed ({e}). Reply with 'Thought:' followed by either 'Action:' and 'Args:', or 'Final Answer:'."
    ))
}

/// The decision in a native-tool-calling completion. The first tool call wins (others are
/// discarded, as text after a text-protocol action is); without one, text that follows the text
/// protocol is read by it when its action names one of `tools` (small models fall back to it),
/// and plain text is the answer.
fn read_native(completion: &Completion, tools: &[&str]) -> Result<ReactTurn, String> {
    if completion.cut_off {
        return Err(
            "Error: your response was cut off before it ended. Reply again, more briefly."
                .to_owned(),
        );
    }
    let text = completion.text.trim();
    if let Some((first, rest)) = completion.tool_calls.split_first() {
        let name = first.function.name.trim();
        if name.is_empty() {
            return Err("Error: your tool call names no tool.".to_owned());
        }
        let arguments = tool_call_arguments(&first.function.arguments).map_err(|e| {
            format!("Error: the arguments of your call to '{name}' could not be read ({e}). Call it again with a JSON object.")
        })?;
        let discarded = if rest.is_empty() {
            String::new()
        } else {
            serde_json::to_string(rest).unwrap_or_default()
        };
        return Ok(ReactTurn::Action {
            thought: text.to_owned(),
            action: name.to_owned(),
            arguments,
            discarded,
        });
    }
    match parse(text) {
        // Prose that happens to hold an `Action:` line naming no tool is an answer, not a call.
        Ok(ReactTurn::Action { ref action, .. }) if !tools.contains(&action.as_str()) => {}
        Ok(turn) => return Ok(turn),
        Err(ReactParseError::NoDecision) if !text.is_empty() => {}
        Err(ReactParseError::NoDecision) => {
            return Err(
                "Error: your response was empty. Call a tool, or reply with the answer.".to_owned(),
            )
        }
        Err(e) => {
            return Err(format!(
            "Error: your response could not be read ({e}). Call a tool, or reply with the answer."
        ))
        }
    }
    Ok(ReactTurn::Final {
        thought: String::new(),
        answer: text.to_owned(),
    })
}

/// The conversation of a native-tool-calling dialog: each earlier step as the assistant's tool
/// call and the tool's result (or, for a step that called nothing, what the assistant wrote and
/// the observation that answered it).
fn native_messages(turn: &Turn<'_>, visible: &[ToolDef]) -> Vec<ChatMessage> {
    let request = turn.request;
    let template = &turn.config.prompts.react_native;
    let vars: std::collections::BTreeMap<&str, String> = [
        ("question", request.question.clone()),
        (
            "framing",
            agent_core::prompt::framing_block(&request.framing),
        ),
        ("tools", agent_core::prompt::describe_tools(visible)),
    ]
    .into_iter()
    .collect();
    let mut messages = vec![
        ChatMessage::system(template.system.clone()),
        ChatMessage::user(agent_core::prompt::render(&template.template, &vars)),
    ];
    for (i, step) in request.history.iter().enumerate() {
        if step.action.is_empty() {
            messages.push(ChatMessage::assistant(step.thought.clone()));
            messages.push(ChatMessage::user(step.observation.clone()));
        } else {
            // Nine letters and digits: Mistral's templates refuse any other shape of id.
            let id = format!("call{:05}", i + 1);
            let arguments = serde_json::to_string(&step.arguments).unwrap_or_default();
            messages.push(ChatMessage::assistant_call(
                step.thought.clone(),
                ToolCall::function(&id, &step.action, arguments),
            ));
            messages.push(ChatMessage::tool_result(id, step.observation.clone()));
        }
    }
    messages
}

/// Records an answer the loop cannot act on (unparsable, or cut off) as an iteration whose
/// observation tells the LLM what was wrong, and queues the next iteration: a bad answer costs an
/// iteration, not the dialog.
async fn record_unusable(
    turn: &Turn<'_>,
    n: usize,
    completion: &Completion,
    observation: String,
    candidates: &[&str],
    stats: &CallStats,
    tokens: crate::budget::Tokens,
) -> Result<(), BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    if !streams_text(turn) && !completion.text.trim().is_empty() {
        out.chunk(
            MessageType::Thought,
            completion.text.trim(),
            &uris.thought(n),
            true,
        )
        .await?;
    }
    let step = AgentStep {
        thought: completion.text.trim().chars().take(4000).collect(),
        observation,
        step_type: StepType::React.as_str().to_owned(),
        ..AgentStep::default()
    };
    let state = Scope::new(request.group.as_deref(), request.state.as_deref())
        .state()
        .to_owned();
    record_step(
        turn,
        n,
        step,
        "{}",
        "",
        candidates,
        stats,
        ToolStats::default(),
        state,
        tokens,
    )
    .await
}

/// Publishes the iteration's provenance and observation, then queues the next iteration.
#[allow(clippy::too_many_arguments)]
async fn record_step(
    turn: &Turn<'_>,
    n: usize,
    step: AgentStep,
    arguments_json: &str,
    discarded: &str,
    candidates: &[&str],
    stats: &CallStats,
    tool: ToolStats,
    next_state: String,
    tokens: crate::budget::Tokens,
) -> Result<(), BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    let mut triples = provenance::tool_iteration(
        uris,
        n,
        &step.thought,
        &step.action,
        arguments_json,
        candidates,
        stats,
    );
    triples.extend(provenance::discarded(uris, n, discarded));
    out.explain(&uris.iteration(n), triples)?;
    out.chunk(
        MessageType::Observation,
        &step.observation,
        &uris.observation(n),
        true,
    )
    .await?;
    let triples = provenance::observation(uris, n, &step.observation, tool);
    out.explain(&uris.observation(n), triples)?;
    let mut next = (*request).clone();
    next.history.push(step);
    next.state = Some(next_state);
    next.session_id = turn.session_id.to_owned();
    out.next(&next, tokens, &[])
}

/// Streams the LLM's answer, passing thought and answer text to the client as soon as it is certain.
/// The last thought chunk is held back so it can carry `end_of_message`. A stream that breaks off
/// before any answer text went out becomes a cut-off completion of what arrived (the client saw a
/// thought end early, and the next iteration says why); once answer text went out, the break is an
/// error, since the client cannot be told to forget part of an answer.
async fn stream_turn(
    llm: &LlmClient,
    messages: &[ChatMessage],
    options: &CallOptions,
    out: &DialogOutput<'_>,
    uris: &SessionUris,
    n: usize,
    last_observation: &str,
) -> Result<Result<Completion, LlmError>, BusError> {
    let (tx, mut rx) = mpsc::channel::<String>(64);
    let call = llm.stream_with(messages, options, tx);
    tokio::pin!(call);
    let mut parser = ReactStream::after_observation(last_observation);
    let mut held_thought: Option<String> = None;
    let thought_id = uris.thought(n);
    let answer_id = uris.conclusion();
    let mut result = None;
    let mut received = String::new();
    let mut answer_started = false;
    // Publish while the LLM is still writing: deltas flow through a bounded channel.
    loop {
        tokio::select! {
            r = &mut call, if result.is_none() => result = Some(r),
            delta = rx.recv() => match delta {
                Some(text) => {
                    received.push_str(&text);
                    for d in parser.push(&text) {
                        answer_started |= matches!(d, ReactDelta::Answer(_));
                        publish_delta(out, d, &mut held_thought, &thought_id, &answer_id).await?;
                    }
                }
                None => break,
            },
        }
    }
    let result = match result {
        Some(r) => r,
        None => call.await,
    };
    let result = match result {
        Err(LlmError::Truncated(why)) if !answer_started => {
            tracing::warn!(%why, "the LLM's stream broke off in the thought; keeping it as a cut-off answer");
            Ok(Completion {
                out_token: (received.len() as u64).div_ceil(4),
                text: received,
                model: llm.model().to_owned(),
                cut_off: true,
                ..Completion::default()
            })
        }
        other => other,
    };
    if matches!(&result, Ok(c) if !c.cut_off) {
        for d in parser.finish() {
            publish_delta(out, d, &mut held_thought, &thought_id, &answer_id).await?;
        }
    }
    if let Some(last) = held_thought.take() {
        out.chunk(MessageType::Thought, &last, &thought_id, true)
            .await?;
    }
    Ok(result)
}

async fn publish_delta(
    out: &DialogOutput<'_>,
    delta: ReactDelta,
    held_thought: &mut Option<String>,
    thought_id: &str,
    answer_id: &str,
) -> Result<(), BusError> {
    match delta {
        ReactDelta::Thought(text) => {
            if let Some(previous) = held_thought.replace(text) {
                out.chunk(MessageType::Thought, &previous, thought_id, false)
                    .await?;
            }
        }
        ReactDelta::Answer(text) => {
            if let Some(last) = held_thought.take() {
                out.chunk(MessageType::Thought, &last, thought_id, true)
                    .await?;
            }
            out.chunk(MessageType::Answer, &text, answer_id, false)
                .await?;
        }
    }
    Ok(())
}

/// Ends the dialog when it has used all its iterations or a budget, before any LLM call; `None`
/// when it may go on. Every pattern checks this first.
pub async fn conclude_if_limited(turn: &Turn<'_>) -> Option<Result<(), BusError>> {
    if turn.abandoned {
        let n = turn.request.history.len() + 1;
        let why = "the supervisor stopped waiting for this subagent: its fan-out timed out and was answered without it";
        return Some(fail(turn, n, why).await);
    }
    let limits = &turn.config.limits;
    if turn.request.history.len() >= limits.max_iterations {
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
    let answer = match request.history.last() {
        Some(step) => format!("{why} The last observation was: {}", step.observation),
        None => why.to_owned(),
    };
    let n = request.history.len() + 1;
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
        out.chunk(MessageType::Answer, &answer, &uris.conclusion(), false)
            .await?;
    }
    crate::finish::answer(turn, &answer, turn.tokens_before, llm.model()).await
}

/// An LLM call of iteration `n` failed with `e`. An outage, while the step may still wait it out,
/// parks the step (nothing it did is committed, and it runs again later); anything else ends the
/// dialog with the error.
pub async fn llm_failed(turn: &Turn<'_>, n: usize, e: &LlmError) -> Result<(), BusError> {
    if !e.is_outage() {
        return fail(turn, n, &format!("the LLM call failed: {e}")).await;
    }
    if turn.may_park && !turn.out.answer_streamed() {
        turn.out.park(crate::output::Park {
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

/// Ends the dialog with an error response and records why.
pub async fn fail(turn: &Turn<'_>, n: usize, message: &str) -> Result<(), BusError> {
    let Turn { uris, out, .. } = turn;
    let triples = provenance::conclusion(
        uris,
        n,
        "",
        message,
        Termination::Error,
        &[],
        &CallStats::default(),
    );
    out.explain(&uris.conclusion(), triples)?;
    crate::finish::error(turn, message).await
}
