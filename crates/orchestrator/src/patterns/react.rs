//! One ReACT iteration: prompt the LLM with the question, the visible tools and the history; stream its
//! thought (and answer); then either answer and close the dialog, or run the chosen tool and queue the
//! next iteration with the grown history.

use agent_bus::BusError;
use agent_core::config::ToolCalling;
use agent_core::critic;
use agent_core::documents::steps_taken;
use agent_core::pattern::{Stage, Termination};
use agent_core::provenance::{self, CallStats, ToolStats};
use agent_core::react::{
    parse, strip_echoed_observation, tool_call_arguments, ReactParseError, ReactTurn,
};
use agent_core::tools::{Scope, ToolDef};
use agent_llm::{CallOptions, ChatMessage, Completion, ToolCall, ToolSpec};
use agent_schema::{AgentStep, MessageType, StepType};
use tokio::sync::mpsc;

use crate::approval::ToolDecision;
use crate::finish::{conclude_if_limited, llm_failed};
use crate::tools::run_scoped_tool;
use crate::turn::Turn;

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
    let n = steps_taken(&request.history) + 1;
    // With the answer critic on, a final answer is a draft the next iteration has reviewed; one
    // written in the last iteration the limits allow is given, saying it was not reviewed (the
    // review keeps to the limits), rather than taken for an answer never reached.
    let answer_critic = config.critic_on(&request.pattern, &request.task_type, Stage::Answer);
    if answer_critic && critic::awaiting_draft_review(&request.history).is_some() {
        // The reviewer sees the steps that led to the draft.
        let history = crate::documents::resolve_recent(turn.documents, &request.history).await;
        let before = history.split_last().map_or(&[][..], |(_, before)| before);
        let transcript = match agent_core::prompt::render_history(before) {
            t if t.is_empty() => "(no tool was used)".to_owned(),
            t => t,
        };
        return crate::review::review_draft(turn, n, transcript).await;
    }
    // A draft the reviewer rejected, at a limit: given, saying the reviewer did not accept it.
    // Before, the dialog said it could not reach an answer and gave the review's lesson as its
    // last observation, the draft lost.
    if answer_critic && critic::draft_rejected(&request.history) {
        if let Some(done) = crate::review::give_rejected_draft_at_a_limit(turn, n).await {
            return done;
        }
    }
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let candidates: Vec<&str> = visible.iter().map(|t| t.name.as_str()).collect();
    let native = calls_natively(turn);
    // A draft is not streamed as the answer: it may not be the one given.
    let streamed = request.streaming && !native && !answer_critic;
    // Long observations travel as excerpts; the prompt sees the newest whole again.
    let history = crate::documents::resolve_recent(turn.documents, &request.history).await;
    let last_observation = history.last().map_or("", |step| step.observation.as_str());
    let completion = if native {
        let messages = native_messages(
            &turn.config.prompts.react_native,
            turn.request,
            &visible,
            &history,
        );
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
            &history,
        );
        let messages = [ChatMessage::system(system), ChatMessage::user(user)];
        let options = turn.react_call();
        if streamed {
            crate::stream::react_turn(llm, &messages, &options, out, uris, n, last_observation)
                .await?
        } else {
            llm.complete_with(&messages, &options).await
        }
    };
    let completion = match completion {
        Ok(c) => c,
        Err(e) => return llm_failed(turn, n, &e).await,
    };
    let stats = crate::turn::call_stats(&completion);
    let tokens = turn
        .tokens_before
        .plus(completion.in_token, completion.out_token);

    let parsed = if native {
        read_native(&completion, &candidates)
    } else {
        read_text(&completion, last_observation)
    };
    match parsed {
        Ok(ReactTurn::Final { thought, answer }) if answer_critic => {
            if !thought.is_empty() {
                out.chunk_with_outcome(MessageType::Thought, &thought, &uris.thought(n), true)
                    .await?;
            }
            out.explain(
                &uris.iteration(n),
                provenance::draft_answer(uris, n, &stats),
            )?;
            let draft = AgentStep {
                thought,
                observation: answer,
                step_type: StepType::Synthesise.as_str().to_owned(),
                ..AgentStep::default()
            };
            turn.observe_and_continue(n, draft, ToolStats::default(), Vec::new(), None, tokens)
                .await
        }
        Ok(ReactTurn::Final { thought, answer }) => {
            if !streamed && !thought.is_empty() {
                out.chunk_with_outcome(MessageType::Thought, &thought, &uris.thought(n), true)
                    .await?;
            }
            if request.streaming && !streamed {
                out.chunk_with_outcome(MessageType::Answer, &answer, &uris.conclusion(), false)
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
                out.chunk(
                    MessageType::Thought,
                    &shown_thought(&thought),
                    &uris.thought(n),
                    true,
                )
                .await?;
            }
            let decision = ToolDecision {
                thought,
                action,
                arguments,
                discarded,
                candidates: candidates.iter().map(|c| (*c).to_owned()).collect(),
                stats,
                tokens,
            };
            if crate::approval::needed(turn, &scope, &decision.action) {
                return crate::approval::park(turn, n, decision).await;
            }
            act(turn, n, decision, false).await
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

/// Runs the tool the LLM chose in iteration `n` and records the step; `approved`: a person
/// approved the call (a tool that needs approval runs only then).
pub async fn act(
    turn: &Turn<'_>,
    n: usize,
    decision: ToolDecision,
    approved: bool,
) -> Result<(), BusError> {
    let request = turn.request;
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    // A refusal names the tools the config defines now, not those the LLM was shown: resumed after
    // an approval, the config may have changed while the call waited.
    let available: Vec<&str> = scope
        .visible(&turn.config.tools)
        .into_iter()
        .map(|tool| tool.name.as_str())
        .collect();
    let (run, next_state) = run_scoped_tool(
        turn,
        &scope,
        &decision.action,
        &decision.arguments,
        &available,
        approved,
    )
    .await;
    // The tool's LLM is down: the step waits for it rather than observe the outage.
    if turn.out.parked().is_some() {
        return Ok(());
    }
    let tool = run.stats();
    let tokens = decision.tokens.plus(run.in_token, run.out_token);
    record_decision(turn, n, decision, run.observation, tool, next_state, tokens).await
}

/// Records iteration `n` with the tool the LLM chose not run (`observation` says why): the dialog
/// goes on, in the state it was in.
pub async fn not_run(
    turn: &Turn<'_>,
    n: usize,
    decision: ToolDecision,
    observation: String,
) -> Result<(), BusError> {
    let request = turn.request;
    let state = Scope::new(request.group.as_deref(), request.state.as_deref())
        .state()
        .to_owned();
    let tokens = decision.tokens;
    let tool = ToolStats {
        outcome: Some(crate::tools::NOT_RUN),
        ..ToolStats::default()
    };
    record_decision(turn, n, decision, observation, tool, state, tokens).await
}

async fn record_decision(
    turn: &Turn<'_>,
    n: usize,
    decision: ToolDecision,
    observation: String,
    tool: ToolStats,
    next_state: String,
    tokens: crate::budget::Tokens,
) -> Result<(), BusError> {
    let ToolDecision {
        thought,
        action,
        arguments,
        discarded,
        candidates,
        stats,
        ..
    } = decision;
    let arguments_json = serde_json::to_string(&arguments).unwrap_or_default();
    let step = AgentStep {
        thought,
        action,
        arguments,
        observation,
        step_type: StepType::React.as_str().to_owned(),
        plan: None,
        subagent_results: None,
    };
    let candidates: Vec<&str> = candidates.iter().map(String::as_str).collect();
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
/// protocol is read by it (small models fall back to it) when its action names one of `tools`
/// (in any case) or comes with arguments, and plain text is the answer.
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
    // What the text says besides a reasoning model's `<think>` block: its answer, if it is one.
    let answer = agent_core::react::without_think(text);
    match parse(text) {
        Ok(ReactTurn::Action {
            thought,
            action,
            arguments,
            discarded,
        }) => {
            let named = tools
                .iter()
                .find(|tool| **tool == action.trim())
                .or_else(|| {
                    tools
                        .iter()
                        .find(|tool| tool.eq_ignore_ascii_case(action.trim()))
                });
            // A call written in the text protocol is a call, whatever it names: one naming a tool
            // the request does not have is refused as an `Error:` observation, as a native call
            // would be, never taken for the answer (a small model's misspelt call once became
            // one). Prose that happens to hold an `Action:` line, with no `Args:` and naming no
            // tool, is an answer.
            let written_as_call = !arguments.is_empty() || args_follow_action(text);
            if named.is_some() || written_as_call {
                return Ok(ReactTurn::Action {
                    thought,
                    action: named.map_or(action, |tool| (*tool).to_owned()),
                    arguments,
                    discarded,
                });
            }
        }
        Ok(turn) => return Ok(turn),
        // No call was made, and nothing before these lines was an action: a native model's plain
        // answer that holds an `args:` line (a manifest, a docstring) or a report's
        // `Observation:` line is its answer; refused, the model was asked again and again for a
        // protocol it was never taught, to the end of its iterations.
        Err(
            ReactParseError::NoDecision
            | ReactParseError::ArgsWithoutAction
            | ReactParseError::InventedObservation,
        ) if !answer.is_empty() => {}
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
        answer: answer.to_owned(),
    })
}

/// Whether the line after `text`'s first `Action:` line (blank lines aside) opens the text
/// protocol's `Args:` section: a call as the protocol writes it, not prose that shows one.
fn args_follow_action(text: &str) -> bool {
    let opens = |line: &str, marker: &str| {
        line.trim_start()
            .trim_start_matches(['*', '#', '`'])
            .trim_start()
            .get(..marker.len())
            .is_some_and(|head| head.eq_ignore_ascii_case(marker))
    };
    let mut lines = text.lines().skip_while(|line| !opens(line, "action:"));
    lines.next().is_some()
        && lines
            .find(|line| !line.trim().is_empty())
            .is_some_and(|line| opens(line, "args:"))
}

/// The conversation of a native-tool-calling dialog: each earlier step as the assistant's tool
/// call and the tool's result (or, for a step that called nothing, what the assistant wrote and
/// the observation that answered it).
fn native_messages(
    template: &agent_core::prompt::PromptTemplate,
    request: &agent_schema::AgentRequest,
    visible: &[ToolDef],
    history: &[agent_schema::AgentStep],
) -> Vec<ChatMessage> {
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
    for (i, step) in history.iter().enumerate() {
        // A draft answer (the answer critic's) is what the assistant wrote; the reviewer's
        // verdict on it and a reflection are told to it. Before, the draft went as the user's
        // words and the verdict as a call to a tool named after its status, which no tool list
        // offers (and strict chat templates refuse).
        match StepType::parse(&step.step_type) {
            Some(StepType::Synthesise) => {
                messages.push(ChatMessage::assistant(match step.thought.trim() {
                    "" => step.observation.clone(),
                    thought => format!("{thought}\n\n{}", step.observation),
                }));
                continue;
            }
            Some(StepType::Evaluate) => {
                let judged = match step.thought.trim() {
                    "" => step.action.clone(),
                    thought => format!("{} ({thought})", step.action),
                };
                messages.push(ChatMessage::user(format!(
                    "Review of your draft answer: {judged}; {}",
                    step.observation
                )));
                continue;
            }
            Some(StepType::Reflect) => {
                messages.push(ChatMessage::user(format!(
                    "Reflection: {}",
                    step.observation
                )));
                continue;
            }
            _ => {}
        }
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
/// The most of a thought sent to the client as one message: a model caught in a loop writes
/// megabytes, which as one message were over the broker's limit, and the step failed (the dialog
/// ended in an error) instead of going on to its next iteration with an `Error:` observation.
const MOST_THOUGHT_BYTES: usize = 64 * 1024;

/// `thought` as the client is sent it: whole, or its start and how long it was.
fn shown_thought(thought: &str) -> std::borrow::Cow<'_, str> {
    if thought.len() <= MOST_THOUGHT_BYTES {
        return thought.into();
    }
    let mut end = MOST_THOUGHT_BYTES;
    while !thought.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}... (the thought was {} bytes; the rest is not shown)",
        &thought[..end],
        thought.len()
    )
    .into()
}

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
            &shown_thought(completion.text.trim()),
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
    let Turn { uris, out, .. } = turn;
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
    turn.observe_and_continue(n, step, tool, Vec::new(), Some(next_state), tokens)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use agent_schema::{AgentRequest, AgentStep};

    /// Under native tool calling, a rejected draft goes back as the assistant's answer and the
    /// verdict as a note to it: no tool call names a verdict, and every call has its result.
    #[test]
    fn a_reviewed_draft_reads_as_the_assistant_s_answer_and_its_verdict_as_a_note() {
        let template = agent_core::prompt::PromptTemplate {
            system: "system".to_owned(),
            template: "{{question}}".to_owned(),
        };
        let request = AgentRequest {
            question: "What does alpha cost?".to_owned(),
            ..AgentRequest::default()
        };
        let history = [
            AgentStep {
                thought: "look it up".to_owned(),
                action: "lookup".to_owned(),
                arguments: [("item".to_owned(), "alpha".to_owned())].into(),
                observation: "alpha: 3".to_owned(),
                step_type: StepType::React.as_str().to_owned(),
                ..AgentStep::default()
            },
            AgentStep {
                observation: "Alpha costs 2.".to_owned(),
                step_type: StepType::Synthesise.as_str().to_owned(),
                ..AgentStep::default()
            },
            AgentStep {
                thought: "the number is wrong".to_owned(),
                action: "EXECUTION_ERROR".to_owned(),
                observation: "Lesson: read the lookup again".to_owned(),
                step_type: StepType::Evaluate.as_str().to_owned(),
                ..AgentStep::default()
            },
        ];
        let messages = native_messages(&template, &request, &[], &history);
        let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "assistant", "user"]
        );
        let called: Vec<&str> = messages
            .iter()
            .flat_map(|m| &m.tool_calls)
            .map(|c| c.function.name.as_str())
            .collect();
        assert_eq!(called, ["lookup"]);
        assert_eq!(messages[4].content, "Alpha costs 2.");
        assert_eq!(
            messages[5].content,
            "Review of your draft answer: EXECUTION_ERROR (the number is wrong); Lesson: read the lookup again"
        );
    }
}
