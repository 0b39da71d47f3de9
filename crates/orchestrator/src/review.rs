//! The critic's verdicts as every pattern announces and records them (a thought to the client, an
//! evaluation node in the graph, the verdict in the history), and a reviewed draft given as the
//! dialog's answer.

use agent_bus::BusError;
use agent_core::critic;
use agent_core::pattern::Termination;
use agent_core::provenance::{self, CallStats, ToolStats};
use agent_schema::MessageType;

use crate::turn::{tokens_after, Turn};

/// Tells the client the critic's verdict on what the previous iteration did (`subject`, and the
/// step `index` when it judged a step) and records it in the graph.
pub async fn announce_verdict(
    turn: &Turn<'_>,
    n: usize,
    subject: &str,
    index: Option<usize>,
    verdict: &critic::Evaluation,
    applied: &critic::Applied,
    stats: &CallStats,
) -> Result<(), BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    let retries = critic::retries_used(&request.history)
        + usize::from(verdict.status != critic::Status::Success);
    let thought = match verdict.evaluation.as_str() {
        "" => format!("{subject}: {}", verdict.status.as_str()),
        text => format!("{subject}: {} — {text}", verdict.status.as_str()),
    };
    out.chunk(MessageType::Thought, &thought, &uris.thought(n), true)
        .await?;
    out.explain(
        &uris.iteration(n),
        provenance::evaluation(
            uris,
            n,
            &uris.iteration(n - 1),
            index,
            &thought,
            verdict,
            applied,
            retries,
            stats,
        ),
    )
}

/// Queues the next iteration with the verdict in the history (its lesson in the observation).
pub async fn queue_verdict(
    turn: &Turn<'_>,
    n: usize,
    applied: critic::Applied,
    verdict: &critic::Evaluation,
    stats: &CallStats,
) -> Result<(), BusError> {
    let mut step = applied.step;
    if !verdict.lesson.is_empty() {
        step.observation = format!("{} Lesson: {}", applied.effect, verdict.lesson);
    }
    let tool = ToolStats::default();
    let tokens = tokens_after(turn, stats, &tool);
    turn.observe_and_continue(n, step, tool, Vec::new(), None, tokens)
        .await
}

/// A reviewed draft as it is given.
pub struct Given<'a> {
    /// The answer, with any note on what was not checked.
    pub answer: String,
    /// What the verdict did, as the review's observation says it.
    pub effect: &'a str,
    /// `Answer`, or `RetryLimit` for a draft given without the reviewer's acceptance.
    pub termination: Termination,
}

/// Ends the dialog with a reviewed draft: the review's observation (iteration `n`), then the
/// conclusion that derives from it, streamed when the client streams (the draft was not).
pub async fn conclude(
    turn: &Turn<'_>,
    n: usize,
    given: Given<'_>,
    stats: &CallStats,
    model: &str,
) -> Result<(), BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    out.explain(
        &uris.observation(n),
        provenance::observation(uris, n, given.effect, ToolStats::default()),
    )?;
    let answer_id = uris.conclusion();
    if request.streaming {
        out.chunk_with_outcome(MessageType::Answer, &given.answer, &answer_id, false)
            .await?;
    }
    out.explain(
        &answer_id,
        provenance::conclusion(
            uris,
            n + 1,
            "",
            &given.answer,
            given.termination,
            &[],
            &CallStats::default(),
        ),
    )?;
    let tokens = tokens_after(turn, stats, &ToolStats::default());
    crate::finish::answer(turn, &given.answer, tokens, model).await
}

/// Which limit the run reached, if any, and why in words: its iterations (`max_iterations`) or
/// its budget (tokens, wall time, the run's iterations).
fn out_of_limits(turn: &Turn<'_>) -> Option<(Termination, String)> {
    let max = turn.config.limits.max_iterations;
    if agent_core::documents::steps_taken(&turn.request.history) >= max {
        return Some((
            Termination::MaxIterations,
            format!("the dialog used its {max} iterations (max_iterations)"),
        ));
    }
    turn.spent_budget()
        .map(|spent| (Termination::Budget, spent.sentence))
}

/// When a draft awaits its review but the run reached a limit (or was abandoned): the review is
/// one more LLM call, and the run's limits hold for the critic as for every other call, so the
/// draft is given, saying it was not reviewed. `None`: the review may go ahead.
pub async fn give_draft_unreviewed_at_a_limit(
    turn: &Turn<'_>,
    n: usize,
) -> Option<Result<(), BusError>> {
    give_draft_at_a_limit(turn, n, critic::awaiting_draft_review, |why| {
        (
            format!("the draft was not reviewed: {why}"),
            format!("This answer was not reviewed: {why}."),
        )
    })
    .await
}

/// When a rejected draft is to be written again but the run reached a limit (or was abandoned):
/// the dialog ends with the last draft, saying the reviewer did not accept it, instead of one more
/// LLM call past the limit. `None`: the draft may be written again.
pub async fn give_rejected_draft_at_a_limit(
    turn: &Turn<'_>,
    n: usize,
) -> Option<Result<(), BusError>> {
    fn last_draft(history: &[agent_schema::AgentStep]) -> Option<&agent_schema::AgentStep> {
        history.iter().rev().find(|s| critic::is_draft(s))
    }
    give_draft_at_a_limit(turn, n, last_draft, |why| {
        (
            format!("the rejected draft was not written again: {why}"),
            format!("A reviewer did not accept this answer, and it was not written again: {why}."),
        )
    })
    .await
}

/// Ends an abandoned dialog, or one past a limit with the draft `draft_of` finds in its history
/// and what `said` makes of why (the review's observation, the note the answer ends with).
/// `None`: within its limits, or no such draft.
async fn give_draft_at_a_limit(
    turn: &Turn<'_>,
    n: usize,
    draft_of: impl Fn(&[agent_schema::AgentStep]) -> Option<&agent_schema::AgentStep>,
    said: impl Fn(&str) -> (String, String),
) -> Option<Result<(), BusError>> {
    if let Some(ended) = crate::finish::end_if_abandoned(turn, None).await {
        return Some(ended);
    }
    let (termination, why) = out_of_limits(turn)?;
    let history = crate::documents::resolve_recent(turn.documents, &turn.request.history).await;
    let draft = draft_of(&history)?;
    let (effect, note) = said(&why);
    let unjudged = Unjudged {
        effect,
        note,
        termination,
    };
    Some(give_unjudged(turn, n, &draft.observation, unjudged).await)
}

/// A draft given at a limit without the reviewer's acceptance: what the review's observation
/// says, the note the answer ends with, and why the dialog ended.
struct Unjudged {
    effect: String,
    note: String,
    termination: Termination,
}

/// Ends the dialog with `draft` and its note, no LLM call made for it.
async fn give_unjudged(
    turn: &Turn<'_>,
    n: usize,
    draft: &str,
    unjudged: Unjudged,
) -> Result<(), BusError> {
    let given = Given {
        answer: format!("{draft}\n\n({})", unjudged.note),
        effect: &unjudged.effect,
        termination: unjudged.termination,
    };
    conclude(turn, n, given, &CallStats::default(), turn.llm.model()).await
}

/// The critic's verdict on a draft answer, what it does to the plan, and what asking cost.
pub struct Judged {
    pub verdict: critic::Evaluation,
    pub applied: critic::Applied,
    pub stats: CallStats,
    pub model: String,
}

/// Asks `answer-review` about `draft`, written from `results`, and applies the verdict to `plan`
/// (empty for a pattern without one). `None` when the call failed: the dialog has then ended, or
/// the step was parked by an outage.
pub async fn judge_draft(
    turn: &Turn<'_>,
    n: usize,
    draft: &str,
    results: String,
    plan: &[agent_schema::PlanStep],
) -> Result<Option<Judged>, BusError> {
    let request = turn.request;
    let vars = [
        (
            "framing",
            agent_core::prompt::framing_block(&request.framing),
        ),
        ("question", request.question.clone()),
        ("results", results),
        ("answer", draft.to_owned()),
    ]
    .into_iter()
    .collect();
    let template = &turn.config.prompts.answer_review;
    let Some((completion, stats)) = turn.ask(n, template, &vars, &turn.json_call()).await? else {
        return Ok(None);
    };
    let verdict = critic::parse(&completion.text);
    let applied = critic::apply_to_answer(plan, &verdict);
    Ok(Some(Judged {
        verdict,
        applied,
        stats,
        model: completion.model,
    }))
}

/// Asks the critic (`answer-review`) about the draft answer the previous iteration wrote, given
/// `results`, what it was written from. Accepted, it is the answer; rejected, the lesson joins the
/// history and the pattern goes on (a ReACT agent reasons again, a supervisor writes its
/// synthesis again), until `max_retries` rejections: then the last draft is given, marked as not
/// accepted.
pub async fn review_draft(turn: &Turn<'_>, n: usize, results: String) -> Result<(), BusError> {
    let Turn {
        request, config, ..
    } = turn;
    // A long draft travels as an excerpt; the reviewer reads it whole.
    let history = crate::documents::resolve_recent(turn.documents, &request.history).await;
    let Some(draft) = critic::awaiting_draft_review(&history) else {
        return Ok(());
    };
    if let Some(given) = give_draft_unreviewed_at_a_limit(turn, n).await {
        return given;
    }
    let Some(judged) = judge_draft(turn, n, &draft.observation, results, &[]).await? else {
        return Ok(());
    };
    let Judged {
        verdict,
        mut applied,
        stats,
        model,
    } = judged;
    // Only a plan's history carries the plan.
    applied.step.plan = None;
    let fate = critic::draft_fate(&request.history, verdict.status, config.limits.max_retries);
    if fate == critic::DraftFate::Unverified {
        applied.effect = format!(
            "the answer was rejected more than max_retries ({}) times, so the last draft is given unverified",
            config.limits.max_retries
        );
    }
    announce_verdict(
        turn,
        n,
        "Review of the answer",
        None,
        &verdict,
        &applied,
        &stats,
    )
    .await?;
    let (answer, termination) = match fate {
        critic::DraftFate::WriteAgain => {
            return queue_verdict(turn, n, applied, &verdict, &stats).await;
        }
        // An answer the reviewer's unreadable reply let stand says it was not checked, as a
        // plan's does.
        critic::DraftFate::Accepted if verdict.unreadable.is_some() => (
            format!(
                "{}\n\n(This answer was not checked: the reviewer's answer could not be read.)",
                draft.observation
            ),
            Termination::Answer,
        ),
        critic::DraftFate::Accepted => (draft.observation.clone(), Termination::Answer),
        critic::DraftFate::Unverified => (
            format!(
                "{}\n\n(A reviewer did not accept this answer: {})",
                draft.observation,
                if verdict.evaluation.is_empty() {
                    verdict.status.as_str()
                } else {
                    verdict.evaluation.as_str()
                }
            ),
            Termination::RetryLimit,
        ),
    };
    let given = Given {
        answer,
        effect: &applied.effect,
        termination,
    };
    conclude(turn, n, given, &stats, &model).await
}
