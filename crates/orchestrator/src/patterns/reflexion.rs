//! One Reflexion iteration: ReACT, with a self-critique after each action. When the newest history
//! step is an action and its observation, this iteration asks the LLM (prompt `reflexion-reflect`)
//! what the step taught and carries the lesson forward as a `reflect` step, which the ReACT prompt
//! shows as `Reflection: ...`; otherwise it is a ReACT iteration. Bounded as ReACT is: a reflection
//! is an iteration, and `max_iterations` counts it.

use agent_bus::BusError;
use agent_core::documents::steps_taken;
use agent_core::prompt::{framing_block, render_history};
use agent_core::provenance::{self, ToolStats};
use agent_llm::CallOptions;
use agent_schema::{AgentStep, MessageType, StepType};

use crate::finish::conclude_if_limited;
use crate::turn::{tokens_after, Turn};

/// The longest lesson carried forward, in characters: it travels in every later message.
const MAX_LESSON_CHARS: usize = 600;

pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    let acted = request.history.last().is_some_and(|step| {
        StepType::parse(&step.step_type) == Some(StepType::React) && !step.action.is_empty()
    });
    if !acted {
        return super::react::iterate(turn).await;
    }
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    let n = steps_taken(&request.history) + 1;
    let history = crate::documents::resolve_recent(turn.documents, &request.history).await;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("history", render_history(&history)),
    ]
    .into_iter()
    .collect();
    let template = &config.prompts.reflexion_reflect;
    let Some((completion, stats)) = turn
        .ask(n, template, &vars, &CallOptions::default())
        .await?
    else {
        return Ok(());
    };
    let lesson: String = completion
        .text
        .trim()
        .chars()
        .take(MAX_LESSON_CHARS)
        .collect();
    out.chunk_with_outcome(
        MessageType::Thought,
        &format!("Reflection: {lesson}"),
        &uris.thought(n),
        true,
    )
    .await?;
    out.explain(
        &uris.iteration(n),
        provenance::reflection(uris, n, &lesson, &stats),
    )?;
    let step = AgentStep {
        observation: lesson,
        step_type: StepType::Reflect.as_str().to_owned(),
        ..AgentStep::default()
    };
    let tokens = tokens_after(turn, &stats, &ToolStats::default());
    turn.observe_and_continue(n, step, ToolStats::default(), Vec::new(), None, tokens)
        .await
}
