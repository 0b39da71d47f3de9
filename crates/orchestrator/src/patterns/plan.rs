//! One Plan-then-Execute iteration. The history decides which: make the plan (the LLM's plan is
//! checked as a DAG and asked for again with the reason, a bounded number of times), run the next
//! step whose dependencies are done, revise the rest of the plan after a failed step (at most
//! `max_replan_depth` times), or answer from the results. Each queues the next iteration with the
//! plan, its statuses and results carried in the history.

use agent_bus::BusError;
use agent_core::critic;
use agent_core::documents::steps_taken;
use agent_core::pattern::{Stage, Termination};
use agent_core::plan::{self as planning, plan_in_force, COMPLETED, FAILED};
use agent_core::plan_then_execute::{self as pattern_decisions, Next, Unfinished};
use agent_core::prompt::{describe_tools, framing_block, render};
use agent_core::provenance::{self, CallStats, PlanRecord, ToolStats};
use agent_core::react::{parse, ReactTurn};
use agent_core::tools::Scope;
use agent_llm::ChatMessage;
use agent_schema::{AgentStep, MessageType, PlanStep, StepType};

use crate::finish::{conclude_if_limited, fail, llm_failed};
use crate::review::{self, announce_verdict, queue_verdict};
use crate::tools::{run_scoped_tool, truncate};
use crate::turn::{add_call, tokens_after, Turn};

/// Times the LLM is asked for a plan in one iteration before a one-step plan stands in.
const PLAN_ATTEMPTS: usize = 3;

/// Runs the iteration. `Err` only for publish failures: the message is then nacked and redone.
pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let n = steps_taken(&turn.request.history) + 1;
    let config = turn.config;
    let policy = pattern_decisions::Policy {
        max_replan_depth: config.limits.max_replan_depth,
        max_retries: config.limits.max_retries,
        critic_steps: config.critic_on(&turn.request.pattern, &turn.request.task_type, Stage::Step),
        critic_plan: config.critic_on(&turn.request.pattern, &turn.request.task_type, Stage::Plan),
        critic_answer: config.critic_on(
            &turn.request.pattern,
            &turn.request.task_type,
            Stage::Answer,
        ),
    };
    let next = pattern_decisions::next(&turn.request.history, policy);
    // A draft awaiting its review is given unreviewed if the limits leave no room for the review
    // (see `review_answer`): at the limit it must not be thrown away and written again.
    if next == Next::ReviewAnswer {
        return review_answer(turn, n).await;
    }
    // A plan that used its iterations still answers from what it found, unless its budget is
    // spent too (that answer is one more LLM call) or its supervisor stopped waiting for it:
    // then it ends as any step at a limit does, without a call.
    let max_iterations = config.limits.max_iterations;
    if steps_taken(&turn.request.history) >= max_iterations
        && planning::current_plan(&turn.request.history).is_some()
        && turn.spent_budget().is_none()
        && !turn.abandoned
    {
        let unfinished = match next {
            Next::Synthesise(unfinished) => unfinished,
            _ => Some(Unfinished {
                termination: Termination::MaxIterations,
                reason: format!("the dialog used its {max_iterations} iterations (max_iterations)"),
            }),
        };
        return synthesise(turn, n, unfinished).await;
    }
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    match next {
        Next::MakePlan => make_plan(turn, n, None).await,
        Next::Evaluate(index) => evaluate(turn, n, index).await,
        Next::ReviewPlan => review_plan(turn, n).await,
        Next::ReviewAnswer => review_answer(turn, n).await,
        Next::Replan(problem) => make_plan(turn, n, Some(problem)).await,
        Next::RunStep(index) => run_step(turn, n, index).await,
        Next::Synthesise(unfinished) => synthesise(turn, n, unfinished).await,
    }
}

/// Makes the first plan, or (with `problem`) revises the rest of the current one.
async fn make_plan(turn: &Turn<'_>, n: usize, problem: Option<String>) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        llm,
        ..
    } = turn;
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let candidates: Vec<&str> = visible.iter().map(|t| t.name.as_str()).collect();
    let old_plan = planning::current_plan(&request.history)
        .map(<[PlanStep]>::to_vec)
        .unwrap_or_default();
    let kept = old_plan.iter().filter(|s| s.status == COMPLETED).count();
    let shown = whole(turn, &old_plan).await;
    let critic_steps = config.critic_on(&request.pattern, &request.task_type, Stage::Step);
    let budget = pattern_decisions::step_budget(
        steps_taken(&request.history),
        config.limits.max_iterations,
        critic_steps,
    );
    let template = if problem.is_some() {
        &config.prompts.plan_revise
    } else {
        &config.prompts.plan_create
    };
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("tools", describe_tools(&visible)),
        ("max_steps", budget.to_string()),
        ("plan", planning::describe(&shown)),
        ("completed", renumbered_completed(&shown)),
        ("problem", problem.clone().unwrap_or_default()),
        ("first_new", kept.to_string()),
    ]
    .into_iter()
    .collect();
    let mut messages = vec![
        ChatMessage::system(template.system.clone()),
        ChatMessage::user(render(&template.template, &vars)),
    ];

    let mut stats = CallStats::default();
    let mut rejected: Vec<(String, String)> = Vec::new();
    let mut chosen: Option<AcceptedPlan> = None;
    let mut call_error = None;
    for _ in 0..PLAN_ATTEMPTS {
        let completion = match llm.complete_with(&messages, &turn.json_call()).await {
            Ok(c) => c,
            // With nothing asked yet there is nothing to go on; after refused attempts, their cost
            // and record are kept and the one-step plan stands in.
            // An outage parks the step whatever was asked before: the whole step runs again.
            Err(e) if rejected.is_empty() || (e.is_outage() && turn.may_park) => {
                return llm_failed(turn, n, &e).await
            }
            Err(e) => {
                call_error = Some(e.to_string());
                break;
            }
        };
        add_call(&mut stats, &completion);
        let checked = planning::parse(&completion.text).and_then(|(steps, rationale)| {
            let (mut merged, dropped) = if problem.is_some() {
                planning::merge_revision(&old_plan, steps)
            } else {
                (steps, Vec::new())
            };
            let first_new = if problem.is_some() { kept } else { 0 };
            let repairs = planning::repair(&mut merged, first_new);
            planning::validate(&merged, kept + budget).map(|()| AcceptedPlan {
                steps: merged,
                dropped,
                rationale,
                repairs,
            })
        });
        match checked {
            Ok(plan) => {
                chosen = Some(plan);
                break;
            }
            Err(why) => {
                tracing::info!(iteration = n, %why, "refusing the LLM's plan and asking again");
                let answer: String = completion.text.chars().take(4000).collect();
                // Each request must differ from the last: a model at temperature 0 asked the same
                // thing answers the same.
                let again = rejected.iter().any(|(earlier, _)| *earlier == answer);
                let ask = if again {
                    format!("You sent a plan that was already rejected. It is still wrong: {why}. Change exactly that and reply with only the corrected JSON object.")
                } else {
                    format!("That plan was rejected: {why}. Fix exactly that and reply again with only the corrected JSON object.")
                };
                messages.push(ChatMessage::assistant(completion.text));
                messages.push(ChatMessage::user(ask));
                rejected.push((answer, why));
            }
        }
    }
    let fallback = chosen.is_none().then(|| match &call_error {
        Some(e) => format!(
            "no valid plan after {} attempts, then the LLM call failed ({e}); the whole request became one step",
            rejected.len()
        ),
        None => format!(
            "no valid plan after {PLAN_ATTEMPTS} attempts; the whole request became one step"
        ),
    });
    let AcceptedPlan {
        steps: plan,
        dropped,
        rationale,
        repairs,
    } = chosen.unwrap_or_else(|| {
        let (steps, dropped) =
            planning::merge_revision(&old_plan, planning::single_step(&request.question, kept));
        AcceptedPlan {
            steps,
            dropped,
            rationale: String::new(),
            repairs: Vec::new(),
        }
    });
    for repair in &repairs {
        tracing::info!(iteration = n, %repair, "repaired the LLM's plan");
    }

    let version = if problem.is_some() {
        pattern_decisions::replans_used(&request.history) + 1
    } else {
        0
    };
    let thought = match (&problem, rationale.is_empty()) {
        (Some(p), true) => format!("Revising the plan: {p}"),
        (Some(p), false) => format!("Revising the plan: {p}. {rationale}"),
        (None, true) if plan.len() == 1 => "A plan of one step.".to_owned(),
        (None, true) => format!("A plan of {} steps.", plan.len()),
        (None, false) => rationale.clone(),
    };
    let record = PlanRecord {
        version,
        steps: &plan,
        rationale: &rationale,
        thought: &thought,
        rejected: &rejected,
        revision_of: problem.as_deref().map(|p| (p, dropped.as_slice())),
        fallback: fallback.as_deref(),
        repairs: &repairs,
    };
    let shown = planning::describe(&plan);
    out.chunk_with_outcome(MessageType::Thought, &thought, &uris.thought(n), true)
        .await?;
    out.explain(
        &uris.iteration(n),
        provenance::plan_iteration(uris, n, &record, &candidates, &stats),
    )?;
    let step = AgentStep {
        thought,
        action: if problem.is_some() { "replan" } else { "plan" }.to_owned(),
        observation: shown,
        step_type: StepType::Plan.as_str().to_owned(),
        plan: Some(plan),
        ..AgentStep::default()
    };
    record_and_queue(turn, n, step, &stats, &ToolStats::default(), None, None).await
}

/// A plan the LLM gave that passed validation.
struct AcceptedPlan {
    steps: Vec<PlanStep>,
    /// Old step numbers a revision dropped.
    dropped: Vec<usize>,
    rationale: String,
    /// What was repaired in it first.
    repairs: Vec<String>,
}

/// The completed steps under the numbers they keep after a revision.
fn renumbered_completed(plan: &[PlanStep]) -> String {
    let kept: Vec<String> = plan
        .iter()
        .enumerate()
        .filter(|(_, s)| s.status == COMPLETED)
        .enumerate()
        .map(|(new, (old, s))| format!("{new}. (was {old}) {}\n   result: {}", s.goal, s.result))
        .collect();
    if kept.is_empty() {
        "(none: every step starts again)".to_owned()
    } else {
        kept.join("\n")
    }
}

/// Carries out step `index`: one LLM call that either answers the step or names a tool to run.
async fn run_step(turn: &Turn<'_>, n: usize, index: usize) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    let Some((plan_at, plan)) = plan_in_force(&request.history) else {
        return fail(turn, n, "the history has no consistent plan to execute").await;
    };
    let Some(goal) = plan.get(index).cloned() else {
        return fail(turn, n, &format!("the plan has no step {index}")).await;
    };
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let candidates: Vec<&str> = visible.iter().map(|t| t.name.as_str()).collect();
    let template = &config.prompts.plan_step;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("step", index.to_string()),
        ("goal", goal.goal.clone()),
        (
            "tool_hint",
            if goal.tool_hint.is_empty() {
                "(none)".to_owned()
            } else {
                goal.tool_hint.clone()
            },
        ),
        (
            "dependencies",
            planning::dependency_results(&whole(turn, &plan).await, index),
        ),
        ("lessons", lessons_block(&request.history, &goal.goal)),
        ("tools", describe_tools(&visible)),
        ("tool_names", candidates.join(", ")),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn.ask(n, template, &vars, &turn.react_call()).await? else {
        return Ok(());
    };

    let mut tool = ToolStats::default();
    let mut next_state = scope.state().to_owned();
    let mut discarded = String::new();
    // Half a result, or half a tool's arguments, must not pass for a whole one: a step the model
    // stopped at its length limit failed, and says so.
    let parsed = if completion.cut_off {
        Err(CUT_OFF.to_owned())
    } else {
        parse(&completion.text).map_err(|e| format!("could not be parsed ({e})"))
    };
    let (thought, action, arguments, result, status) = match parsed {
        Ok(ReactTurn::Final { thought, answer }) => (
            thought,
            String::new(),
            Default::default(),
            truncate(answer, config.limits.max_observation_bytes),
            COMPLETED,
        ),
        Ok(ReactTurn::Action {
            thought,
            action,
            arguments,
            discarded: dropped,
        }) => {
            discarded = dropped;
            let (run, state) =
                run_scoped_tool(turn, &scope, &action, &arguments, &candidates, false).await;
            // The tool's LLM is down: the step waits for it rather than observe the outage.
            if turn.out.parked().is_some() {
                return Ok(());
            }
            next_state = state;
            tool = run.stats();
            let status = if run.outcome.answered() {
                COMPLETED
            } else {
                FAILED
            };
            (thought, action, arguments, run.observation, status)
        }
        Err(why) => (
            completion.text.trim().chars().take(4000).collect(),
            String::new(),
            Default::default(),
            format!("Error: the step's response {why}"),
            FAILED,
        ),
    };
    // The plan travels in every later message: a long result goes in it as an excerpt and a
    // reference (the observation below is the same document, so it is kept once).
    let carried = turn.check_in(result.clone()).await;
    let mut updated = plan;
    if let Some(step) = updated.get_mut(index) {
        step.status = status.to_owned();
        step.result = carried;
    }
    if !thought.is_empty() {
        out.chunk_with_outcome(MessageType::Thought, &thought, &uris.thought(n), true)
            .await?;
    }
    let arguments_json = serde_json::to_string(&arguments).unwrap_or_default();
    let mut triples = provenance::step_execution(
        uris,
        n,
        &uris.plan_step(plan_at, index),
        index,
        &critic::all_lessons(&request.history, &goal.goal),
        &thought,
        &action,
        &arguments_json,
        &candidates,
        &stats,
    );
    triples.extend(provenance::discarded(uris, n, &discarded));
    out.explain(&uris.iteration(n), triples)?;
    let step = AgentStep {
        thought,
        action,
        arguments,
        observation: result,
        step_type: StepType::Execute.as_str().to_owned(),
        plan: Some(updated),
        subagent_results: None,
    };
    record_and_queue(turn, n, step, &stats, &tool, Some(status), Some(next_state)).await
}

/// The lessons the critic gave about a step, as lines for its prompt.
fn lessons_block(history: &[AgentStep], goal: &str) -> String {
    let lessons = critic::all_lessons(history, goal);
    if lessons.is_empty() {
        "(none)".to_owned()
    } else {
        lessons
            .iter()
            .map(|l| format!("- {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// Asks the critic about step `index`, which the previous iteration completed, and applies its
/// verdict: accept, run the step (or its input's step) again with the lesson, or split it.
async fn evaluate(turn: &Turn<'_>, n: usize, index: usize) -> Result<(), BusError> {
    let Turn {
        request, config, ..
    } = turn;
    let Some((_, queued)) = plan_in_force(&request.history) else {
        return fail(turn, n, "the history has no plan to evaluate").await;
    };
    // The critic reads the results whole; the plan the verdict queues keeps their excerpts, or
    // every later message would carry every result whole.
    let plan = whole(turn, &queued).await;
    let Some(step) = plan.get(index).cloned() else {
        return fail(turn, n, &format!("the plan has no step {index}")).await;
    };
    let template = &config.prompts.plan_evaluate;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("step", index.to_string()),
        ("goal", step.goal.clone()),
        ("dependencies", planning::dependency_results(&plan, index)),
        ("result", step.result.clone()),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn.ask(n, template, &vars, &turn.json_call()).await? else {
        return Ok(());
    };
    let verdict = critic::parse(&completion.text);
    if let Some(why) = &verdict.unreadable {
        tracing::warn!(iteration = n, %why, "the critic's answer could not be read; the step stands");
    }
    let applied = critic::apply(
        &request.history,
        &queued,
        index,
        &verdict,
        config.limits.step_life_cycle,
    );
    let subject = format!("Evaluation of step {index}");
    announce_verdict(turn, n, &subject, Some(index), &verdict, &applied, &stats).await?;
    queue_verdict(turn, n, applied, &verdict, &stats).await
}

/// Asks the critic about the plan the previous iteration made. A rejection sends it back to be
/// revised with the lesson while revisions are left; otherwise the plan runs as it is.
async fn review_plan(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request, config, ..
    } = turn;
    let plan = planning::current_plan(&request.history)
        .map(<[PlanStep]>::to_vec)
        .unwrap_or_default();
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let template = &config.prompts.plan_review;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("plan", planning::describe(&plan)),
        ("tools", describe_tools(&visible)),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn.ask(n, template, &vars, &turn.json_call()).await? else {
        return Ok(());
    };
    let verdict = critic::parse(&completion.text);
    let may_revise =
        pattern_decisions::replans_used(&request.history) < config.limits.max_replan_depth;
    let applied = critic::apply_to_plan(&plan, &verdict, may_revise);
    announce_verdict(
        turn,
        n,
        "Review of the plan",
        None,
        &verdict,
        &applied,
        &stats,
    )
    .await?;
    queue_verdict(turn, n, applied, &verdict, &stats).await
}

/// Why a step's response is not read: the model stopped at its length limit.
const CUT_OFF: &str = "was cut off at the model's length limit before it ended";

/// The note on an answer the model stopped at its length limit: it is given (the results it rests
/// on are spent), saying it is incomplete.
pub(crate) const ANSWER_CUT_OFF: &str =
    "\n\n(This answer was cut off at the model's length limit: it is incomplete.)";

/// [`ANSWER_CUT_OFF`] for a text the model stopped at its length limit (`cut_off`), else nothing.
pub(crate) fn cut_off_note(cut_off: bool) -> &'static str {
    if cut_off {
        ANSWER_CUT_OFF
    } else {
        ""
    }
}

/// Asks the critic about the draft answer the previous iteration wrote. Accepted, it is given to
/// the client and the dialog ends; rejected, it is written again with the lesson (after the steps
/// it blamed ran again, for bad input).
async fn review_answer(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    if let Some(given) = review::give_draft_unreviewed_at_a_limit(turn, n).await {
        return given;
    }
    let request = turn.request;
    // A long draft travels as an excerpt: the judge reads it whole, and whole is what is given.
    let history = crate::documents::resolve_recent(turn.documents, &request.history).await;
    let draft = history
        .last()
        .map(|s| s.observation.clone())
        .unwrap_or_default();
    let plan = planning::current_plan(&request.history)
        .map(<[PlanStep]>::to_vec)
        .unwrap_or_default();
    let results = planning::describe_results(&whole(turn, &plan).await);
    let Some(judged) = review::judge_draft(turn, n, &draft, results, &plan).await? else {
        return Ok(());
    };
    let review::Judged {
        verdict,
        applied,
        stats,
        model,
    } = judged;
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
    if verdict.status != critic::Status::Success {
        return queue_verdict(turn, n, applied, &verdict, &stats).await;
    }
    let mut note = String::new();
    if verdict.unreadable.is_some() || critic::any_unreadable(&request.history) {
        note.push_str(
            "\n\n(Some results were not checked: the evaluator's answer could not be read.)",
        );
    }
    let given = review::Given {
        answer: format!("{draft}{note}"),
        effect: &applied.effect,
        termination: Termination::Answer,
    };
    review::conclude(turn, n, given, &stats, &model).await
}

/// `plan` with its results whole, for a prompt: a long result travels as an excerpt.
async fn whole(turn: &Turn<'_>, plan: &[PlanStep]) -> Vec<PlanStep> {
    crate::documents::resolve_plan(turn.documents, plan).await
}

/// Publishes the iteration's observation (to the client and the graph), then queues the next
/// iteration with `step` added to the history.
async fn record_and_queue(
    turn: &Turn<'_>,
    n: usize,
    step: AgentStep,
    stats: &CallStats,
    tool: &ToolStats,
    status: Option<&str>,
    next_state: Option<String>,
) -> Result<(), BusError> {
    let status = status
        .map(|status| provenance::step_status(turn.uris, n, status))
        .unwrap_or_default();
    let tokens = tokens_after(turn, stats, tool);
    turn.observe_and_continue(n, step, *tool, status, next_state, tokens)
        .await
}

/// Answers from the completed steps' results; with a `caveat` the answer says the plan could not
/// be finished and why.
async fn synthesise(
    turn: &Turn<'_>,
    n: usize,
    unfinished: Option<Unfinished>,
) -> Result<(), BusError> {
    let caveat = unfinished.as_ref().map(|u| u.reason.clone());
    let Turn {
        request,
        uris,
        out,
        config,
        llm,
        ..
    } = turn;
    let plan = planning::current_plan(&request.history).unwrap_or_default();
    let template = &config.prompts.plan_synthesise;
    let mut guidance = caveat
        .as_ref()
        .map(|c| format!(" The plan could not be finished ({c}): say what is missing."))
        .unwrap_or_default();
    let lessons = critic::answer_lessons(&request.history);
    if !lessons.is_empty() {
        guidance.push_str(&format!(
            " A reviewer rejected an earlier answer; lessons: {}.",
            lessons.join("; ")
        ));
    }
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        (
            "results",
            planning::describe_results(&whole(turn, plan).await),
        ),
        ("caveat", guidance),
    ]
    .into_iter()
    .collect();
    let messages = [
        ChatMessage::system(template.system.clone()),
        ChatMessage::user(render(&template.template, &vars)),
    ];
    // With the answer critic on, a complete plan's answer is a draft until the critic accepts it;
    // a plan that could not be finished answers at once (its caveat is the verdict). A draft
    // needs the iteration after it for its review: with none left, the answer is given saying
    // it was not reviewed (a draft queued past max_iterations would be refused).
    let max_iterations = config.limits.max_iterations;
    let answer_critic = unfinished.is_none()
        && config.critic_on(&request.pattern, &request.task_type, Stage::Answer);
    let review = answer_critic && n <= max_iterations;
    let unreviewed = (answer_critic && !review)
        .then(|| format!("the dialog used its {max_iterations} iterations (max_iterations)"));
    if review {
        let mut stats = CallStats::default();
        let completion = match crate::turn::answer_text(llm.complete(&messages).await) {
            Ok(c) => c,
            Err(e) => return llm_failed(turn, n, &e).await,
        };
        add_call(&mut stats, &completion);
        out.explain(
            &uris.iteration(n),
            provenance::draft_answer(uris, n, &stats),
        )?;
        let step = AgentStep {
            observation: format!(
                "{}{}",
                completion.text.trim(),
                cut_off_note(completion.cut_off)
            ),
            step_type: StepType::Synthesise.as_str().to_owned(),
            plan: Some(plan.to_vec()),
            ..AgentStep::default()
        };
        return record_and_queue(turn, n, step, &stats, &ToolStats::default(), None, None).await;
    }
    let answer_id = uris.conclusion();
    let completion = if request.streaming {
        crate::stream::answer(llm, out, &messages, &answer_id).await?
    } else {
        llm.complete(&messages).await
    };
    let completion = match crate::turn::answer_text(completion) {
        Ok(c) => c,
        Err(e) => return llm_failed(turn, n, &e).await,
    };
    let mut stats = CallStats::default();
    add_call(&mut stats, &completion);
    // The statement that the plan was not finished does not depend on the LLM saying so.
    let mut note = caveat
        .as_ref()
        .map(|c| format!("\n\n(This answer rests on the steps that completed: {c}.)"))
        .unwrap_or_default();
    if let Some(why) = &unreviewed {
        note.push_str(&format!("\n\n(This answer was not reviewed: {why}.)"));
    }
    note.push_str(cut_off_note(completion.cut_off));
    if critic::any_unreadable(&request.history) {
        note.push_str(
            "\n\n(Some results were not checked: the evaluator's answer could not be read.)",
        );
    }
    let answer = format!("{}{note}", completion.text.trim());
    if request.streaming && !note.is_empty() {
        out.chunk_with_outcome(MessageType::Answer, &note, &answer_id, false)
            .await?;
    }
    let termination = match (unfinished, &unreviewed) {
        (Some(u), _) => u.termination,
        (None, Some(_)) => Termination::MaxIterations,
        (None, None) => Termination::Answer,
    };
    out.explain(
        &answer_id,
        provenance::conclusion(uris, n, "", &answer, termination, &[], &stats),
    )?;
    let tokens = tokens_after(turn, &stats, &ToolStats::default());
    crate::finish::answer(turn, &answer, tokens, &completion.model).await
}
