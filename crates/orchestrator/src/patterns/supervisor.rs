//! One Supervisor iteration: split the request into goals and start one subagent per goal (then
//! stop: the aggregator resumes the supervisor when every subagent has completed), or, resumed with
//! the subagents' results, answer from them.

use agent_bus::BusError;
use agent_core::critic;
use agent_core::documents::steps_taken;
use agent_core::pattern::{Pattern, Stage, Termination};
use agent_core::prompt::{describe_tools, framing_block};
use agent_core::provenance::{self, CallStats, SessionUris, ToolStats};
use agent_core::supervisor::{self as supervising, Goal};
use agent_core::tools::Scope;
use agent_schema::{AgentStep, MessageType, StepType};

use crate::finish::{conclude_if_no_room_to_fan_out, end_if_abandoned};
use crate::turn::Turn;
use agent_core::prompt::render;
use agent_llm::{CallOptions, ChatMessage};

/// `arguments` key of the decompose step that names its fan-out.
const CORRELATION_KEY: &str = "correlation_id";
/// `arguments` key of the decompose step that says how many subagents it started.
const EXPECTED_KEY: &str = "expected";

pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    // A nested supervisor whose own supervisor stopped waiting for it (an outer fan-out times out
    // first: each runs its timeout from its own start) ends here, before judging or synthesising
    // results no one will read.
    if let Some(ended) = end_if_abandoned(turn, None).await {
        return ended;
    }
    let n = steps_taken(&turn.request.history) + 1;
    let history = &turn.request.history;
    // Subagents' results are answered from whatever the limits say: their work is already done.
    if supervising::pending_synthesis(history).is_some() {
        // With the step critic on, each result is judged first; what it rejects goes out again.
        let judged = if step_critic(turn) {
            match recover(turn, n).await? {
                Recovery::Handled => return Ok(()),
                Recovery::Synthesise(judged) => judged,
            }
        } else {
            CallStats::default()
        };
        return synthesise(turn, n, &judged).await;
    }
    // With the answer critic on, a synthesis is a draft until the critic accepts it.
    if answer_critic(turn) {
        if critic::awaiting_draft_review(history).is_some() {
            let whole = crate::documents::results_whole(turn.documents, history).await;
            let results = supervising::describe_rounds(&whole);
            return crate::review::review_draft(turn, n, results).await;
        }
        if critic::draft_rejected(history) {
            if let Some(done) = crate::review::give_rejected_draft_at_a_limit(turn, n).await {
                return done;
            }
            return synthesise(turn, n, &CallStats::default()).await;
        }
    }
    if let Some(done) = conclude_if_no_room_to_fan_out(turn).await {
        return done;
    }
    decompose(turn, n).await
}

fn step_critic(turn: &Turn<'_>) -> bool {
    let request = turn.request;
    turn.config
        .critic_on(&request.pattern, &request.task_type, Stage::Step)
}

/// What judging a round's results came to.
#[derive(Debug, PartialEq, Eq)]
enum Recovery {
    /// Every result stands (or no retry is left): synthesise. What the critic's calls cost,
    /// which the dialog's tokens count (each verdict's node records its own call).
    Synthesise(CallStats),
    /// A recovery round went out, or the dialog ended (the critic's LLM call failed).
    Handled,
}

/// Judges each result of the round just answered (prompt `plan-evaluate`, one call per subagent)
/// and sends the subagents the verdicts reject out again in a recovery round: an execution error
/// again with the lesson, bad input's culprits first and then the goal that used them, a goal too
/// big split (see `supervisor::recovery_goals`). Bounded by `max_retries` (non-success verdicts in
/// the dialog), `step_life_cycle` (splits of one goal) and the room for another round.
async fn recover(turn: &Turn<'_>, n: usize) -> Result<Recovery, BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    let history = &request.history;
    if critic::retries_used(history) >= config.limits.max_retries
        || !room_for_another_round(turn, n, 0)
    {
        return Ok(Recovery::Synthesise(CallStats::default()));
    }
    // Long results travel as excerpts; the critic reads them whole.
    let whole = crate::documents::results_whole(turn.documents, history).await;
    let (Some(results), Some(decompose)) = (
        supervising::pending_synthesis(&whole),
        supervising::last_decompose(history),
    ) else {
        return Ok(Recovery::Synthesise(CallStats::default()));
    };
    let round = supervising::kept_goals(decompose);
    let FanIn {
        correlation_id: cid,
        completions,
        missing,
    } = fan_in(request, config.limits.max_subagents);
    let by_index: std::collections::BTreeMap<usize, &String> = results
        .iter()
        .filter_map(|(key, result)| supervising::index_of_key(key).map(|i| (i, result)))
        .collect();
    let mut verdicts = Vec::new();
    let mut spent = CallStats::default();
    let mut judged = Vec::new();
    for (&index, result) in &by_index {
        let Some(goal) = round.get(index) else {
            continue;
        };
        let dependencies: Vec<String> = goal
            .needs
            .iter()
            .filter_map(|j| Some(format!("- {}: {}", round.get(*j)?.goal, by_index.get(j)?)))
            .collect();
        let vars = [
            ("framing", framing_block(&request.framing)),
            ("question", request.question.clone()),
            ("step", index.to_string()),
            ("goal", goal.goal.clone()),
            (
                "dependencies",
                if dependencies.is_empty() {
                    "(none)".to_owned()
                } else {
                    dependencies.join("\n")
                },
            ),
            ("result", (*result).clone()),
        ]
        .into_iter()
        .collect();
        let Some((completion, stats)) = turn
            .ask(n, &config.prompts.plan_evaluate, &vars, &turn.json_call())
            .await?
        else {
            return Ok(Recovery::Handled);
        };
        let verdict = critic::parse(&completion.text);
        let session = SessionUris::new(&supervising::subagent_session(&cid, index));
        let node = provenance::subagent_evaluation_node(uris, &cid, index);
        out.explain(
            &node,
            provenance::subagent_evaluation(
                uris,
                &cid,
                index,
                &session.completion(),
                &verdict,
                &stats,
            ),
        )?;
        crate::turn::add_call(&mut spent, &completion);
        crate::turn::add_call(&mut crate::emit::locked(&turn.recorded_calls), &completion);
        judged.push(node);
        verdicts.push((index, verdict));
    }
    let nested = supervising::may_nest(request, config.limits.max_fanout_depth);
    let goals = supervising::recovery_goals(
        &round,
        &verdicts,
        |goal| critic::splits_behind(history, goal),
        config.limits.step_life_cycle,
        nested,
        config.limits.max_subagents,
    );
    let rejected: Vec<&(usize, critic::Evaluation)> = verdicts
        .iter()
        .filter(|(_, v)| v.status != critic::Status::Success)
        .collect();
    if goals.is_empty() {
        return Ok(Recovery::Synthesise(spent));
    }
    // The verdicts join the history before the new round's decompose step: retries, lessons and
    // splits are counted from there. Each says whether its goal went out again: the round is held
    // to `max_subagents`, and what did not fit is not recorded as retried.
    let going_out: std::collections::BTreeSet<&str> =
        goals.iter().map(|g| g.goal.as_str()).collect();
    let kept: Vec<AgentStep> = rejected
        .iter()
        .filter_map(|(index, verdict)| {
            let goal = round.get(*index)?;
            let split_into: Vec<String> = if verdict.status == critic::Status::JobTooComplicated {
                verdict
                    .sub_steps
                    .iter()
                    .map(|(g, _)| g.clone())
                    .filter(|g| going_out.contains(g.as_str()))
                    .collect()
            } else {
                Vec::new()
            };
            let depth = critic::splits_behind(history, &goal.goal) + 1;
            let effect = if going_out.contains(goal.goal.as_str()) || !split_into.is_empty() {
                "sent out again"
            } else if verdict.status == critic::Status::JobTooComplicated
                && depth > config.limits.step_life_cycle
            {
                "not split again: it was split step_life_cycle times already"
            } else {
                "not sent out again: the recovery round was full (max_subagents)"
            };
            Some(critic::subagent_verdict_step(
                &goal.goal,
                verdict,
                &split_into,
                depth,
                effect,
            ))
        })
        .collect();
    // Each verdict is a step of the dialog: a round that would resume past max_iterations is
    // not started, and the results are synthesised as they are.
    if !room_for_another_round(turn, n, kept.len()) {
        return Ok(Recovery::Synthesise(spent));
    }
    let mut derived = completions;
    derived.extend(judged);
    out.explain(
        &uris.synthesis(&cid),
        provenance::synthesis(uris, &cid, &derived, &missing, &CallStats::default()),
    )?;
    let mut thought = format!(
        "The critic rejected {} of {} results; {} subagents go out again.",
        rejected.len(),
        verdicts.len(),
        goals.len()
    );
    for (index, verdict) in &rejected {
        let goal = round
            .get(*index)
            .map(|g| g.goal.as_str())
            .unwrap_or_default();
        thought.push_str(&format!(
            "\nSubagent {index} ({goal}): {}",
            verdict.status.as_str()
        ));
        if !verdict.evaluation.is_empty() {
            thought.push_str(&format!(" — {}", verdict.evaluation));
        }
    }
    let after = uris.synthesis(&cid);
    // No call of its own decided the round: the verdicts' nodes record what the critic cost.
    fan_out(
        turn,
        n,
        &goals,
        &thought,
        &after,
        &CallStats::default(),
        &spent,
        kept,
    )
    .await?;
    Ok(Recovery::Handled)
}

fn answer_critic(turn: &Turn<'_>) -> bool {
    let request = turn.request;
    turn.config
        .critic_on(&request.pattern, &request.task_type, Stage::Answer)
}

/// The sentence that tells the LLM how subagents may work.
fn subagent_patterns(nested: bool) -> String {
    let mut ways = "A subagent works step by step with tools (pattern react) or by a plan (pattern plan-then-execute)".to_owned();
    if nested {
        ways.push_str(", or splits its goal again among subagents of its own (pattern supervisor; only for a goal that is itself several independent questions)");
    }
    ways.push('.');
    ways
}

async fn decompose(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        config,
        ..
    } = turn;
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let max = config.limits.max_subagents;
    let nested = supervising::may_nest(request, config.limits.max_fanout_depth);
    let template = &config.prompts.supervisor_decompose;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("max_subagents", max.to_string()),
        ("tools", describe_tools(&visible)),
        ("patterns", subagent_patterns(nested)),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn
        .ask(n, template, &vars, &CallOptions::default())
        .await?
    else {
        return Ok(());
    };
    let goals = supervising::parse_goals(&completion.text, max, nested).unwrap_or_else(|why| {
        tracing::info!(%why, "no usable goals; the whole request goes to one subagent");
        vec![Goal::independent(request.question.clone(), Pattern::React)]
    });
    let thought = format!("Splitting the request into {} goals.", goals.len());
    let after = uris.previous(n - 1);
    fan_out(
        turn,
        n,
        &goals,
        &thought,
        &after,
        &stats,
        &CallStats::default(),
        Vec::new(),
    )
    .await
}

/// Records the fan-out of iteration `n` (derived from `after`), then starts one subagent per goal
/// and stops: the aggregator resumes the supervisor. `stats`: the LLM call that decided it,
/// recorded on the fan-out's node; `judged`: the step critic's calls before it, which the
/// dialog's tokens count and the verdicts' nodes record.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn fan_out(
    turn: &Turn<'_>,
    n: usize,
    goals: &[Goal],
    thought: &str,
    after: &str,
    stats: &CallStats,
    judged: &CallStats,
    verdicts: Vec<AgentStep>,
) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        session_id,
        ..
    } = turn;
    let cid = supervising::correlation_id(session_id, n);
    let listing: Vec<String> = goals.iter().enumerate().map(listed).collect();
    let mut continuation = (*request).clone();
    continuation.session_id = session_id.to_string();
    continuation.history.extend(verdicts);
    let mut arguments: std::collections::BTreeMap<String, String> = [
        (CORRELATION_KEY.to_owned(), cid.clone()),
        (EXPECTED_KEY.to_owned(), goals.len().to_string()),
        (
            supervising::GOALS_KEY.to_owned(),
            serde_json::to_string(&goals.iter().map(|g| &g.goal).collect::<Vec<_>>())
                .unwrap_or_default(),
        ),
    ]
    .into();
    // Every goal whole but its briefing (a debate's answers, which its own request carries):
    // what the aggregator starts a waiting one from, what an ensemble reconciles by, and what a
    // recovery round sends out again.
    arguments.insert(
        supervising::SUBAGENTS_KEY.to_owned(),
        supervising::goals_json(goals),
    );
    // Only a supervisor that can read documents back is given long results as references.
    if turn.knowledge.is_some() {
        arguments.insert(
            supervising::RESULTS_BY_REFERENCE_KEY.to_owned(),
            "true".to_owned(),
        );
    }
    continuation.history.push(AgentStep {
        thought: thought.to_owned(),
        action: "decompose".to_owned(),
        arguments,
        observation: listing.join("\n"),
        step_type: StepType::Decompose.as_str().to_owned(),
        ..AgentStep::default()
    });
    let sessions: Vec<(String, String)> = goals
        .iter()
        .enumerate()
        .map(|(i, g)| (g.goal.clone(), supervising::subagent_session(&cid, i)))
        .collect();
    out.chunk_with_outcome(MessageType::Thought, thought, &uris.thought(n), true)
        .await?;
    out.chunk_with_outcome(
        MessageType::Observation,
        &listing.join("\n"),
        &uris.fanout(&cid),
        true,
    )
    .await?;
    // The fan-out is recorded (with what resumes the supervisor) before any subagent exists.
    let continuation = String::from_utf8_lossy(&agent_schema::encode(&continuation)).into_owned();
    let mut recorded = provenance::fanout(
        uris,
        n,
        &cid,
        after,
        &sessions,
        &continuation,
        out.client_id(),
        &chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        provenance::DialogSoFar {
            // Saturating: a later step's tokens come from its message, which a client can set.
            in_token: turn
                .tokens_before
                .input
                .saturating_add(stats.in_token)
                .saturating_add(judged.in_token),
            out_token: turn
                .tokens_before
                .output
                .saturating_add(stats.out_token)
                .saturating_add(judged.out_token),
            started_ms: out.started_ms(),
        },
        stats,
    );
    // A replay's reuse and the dialog's model reach the requests the aggregator sends for it.
    let carried = out.carried_on();
    if !carried.is_empty() {
        let json = serde_json::to_string(&carried).unwrap_or_default();
        recorded.extend(provenance::carried(&uris.fanout(&cid), &json));
    }
    if let Some(key) = turn.seal {
        let node = uris.fanout(&cid);
        let seal = key.seal(&supervising::fanout_seal_parts(
            &node,
            &cid,
            &continuation,
            out.client_id(),
        ));
        recorded.extend(provenance::sealed(&node, &seal));
    }
    let needs: Vec<(String, Vec<String>)> = goals
        .iter()
        .enumerate()
        .filter(|(_, g)| !g.needs.is_empty())
        .map(|(i, g)| {
            let session = |j: usize| supervising::subagent_session(&cid, j);
            (session(i), g.needs.iter().map(|&j| session(j)).collect())
        })
        .collect();
    recorded.extend(provenance::subagent_needs(&needs));
    out.explain(&uris.fanout(&cid), recorded)?;
    // Published after the fan-out node: the commit puts what a request acts on first. A subagent
    // that needs others' results is started by the aggregator once they have all completed.
    let run_tokens = [
        stats.in_token,
        stats.out_token,
        judged.in_token,
        judged.out_token,
    ]
    .into_iter()
    .fold(turn.run_tokens, u64::saturating_add);
    for (i, goal) in goals.iter().enumerate() {
        if !goal.needs.is_empty() {
            continue;
        }
        let sub = supervising::subagent_request(request, session_id, &cid, i, goal, goals.len());
        out.spawn(&sub, run_tokens, turn.seal, goal.model.as_deref())?;
    }
    Ok(())
}

/// A goal as the fan-out's observation lists it: its index, goal and pattern, and the goals it
/// waits for.
fn listed((i, goal): (usize, &Goal)) -> String {
    let mut line = format!("{i}. {} ({})", goal.goal, goal.pattern);
    if let Some(perspective) = &goal.perspective {
        line.push_str(&format!(", perspective: {perspective}"));
    }
    if goal.briefing.is_some() {
        line.push_str(", told the agents' answers of the round before");
    }
    if !goal.needs.is_empty() {
        let after: Vec<String> = goal.needs.iter().map(usize::to_string).collect();
        line.push_str(&format!(", after {}", after.join(", ")));
    }
    line
}

/// The fan-out a synthesis answers, as its request's history says: its correlation id, the
/// completions it was given (which derive the synthesis) and the subagents it went without (a
/// timed-out fan-out's synthesis is partial and names them).
pub(crate) struct FanIn {
    pub correlation_id: String,
    pub completions: Vec<String>,
    pub missing: Vec<String>,
}

pub(crate) fn fan_in(request: &agent_schema::AgentRequest, max_subagents: usize) -> FanIn {
    let history = &request.history;
    let decompose = supervising::last_decompose(history);
    let argument = |key: &str| decompose.and_then(|s| s.arguments.get(key)).cloned();
    let cid = argument(CORRELATION_KEY).unwrap_or_default();
    let expected = argument(EXPECTED_KEY)
        .and_then(|e| e.parse::<usize>().ok())
        .unwrap_or_else(|| supervising::pending_synthesis(history).map_or(0, |r| r.len()))
        .min(agent_core::plan::MAX_PLAN_STEPS.max(max_subagents));
    let missing = history
        .last()
        .map(supervising::missing_subagents)
        .unwrap_or_default();
    let session = |i: usize| SessionUris::new(&supervising::subagent_session(&cid, i));
    let completions: Vec<String> = (0..expected)
        .filter(|i| !missing.contains(i))
        .map(|i| session(i).completion())
        .collect();
    let missing: Vec<String> = missing
        .iter()
        .filter(|&&i| i < expected)
        .map(|&i| session(i).session())
        .collect();
    FanIn {
        correlation_id: cid,
        completions,
        missing,
    }
}

/// Whether the synthesis at iteration `n` may start another round whose fan-out carries
/// `verdicts` steps before it (a recovery round's critic verdicts): the verdicts, its fan-out, the
/// aggregator's resume and the answering synthesis must fit in `max_iterations` (a resume past
/// them would be refused, and the round's work lost with it), and the budget must not be spent.
pub(crate) fn room_for_another_round(turn: &Turn<'_>, n: usize, verdicts: usize) -> bool {
    n.saturating_add(verdicts).saturating_add(2) <= turn.config.limits.max_iterations
        && turn.spent_budget().is_none()
}

/// Synthesises the answer (or another round) from the subagents' results. `judged`: what the
/// step critic's calls on them cost, counted in the dialog's tokens.
async fn synthesise(turn: &Turn<'_>, n: usize, judged: &CallStats) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    let max = config.limits.max_subagents;
    // The fan-out being answered: the last decompose step names it and its size.
    let FanIn {
        correlation_id: cid,
        completions,
        missing,
    } = fan_in(request, max);
    // Long results travel as excerpts; the synthesis reads them whole.
    let whole = crate::documents::results_whole(turn.documents, &request.history).await;
    let results = supervising::describe_rounds(&whole);
    let room = room_for_another_round(turn, n, 0);
    let nested = supervising::may_nest(request, config.limits.max_fanout_depth);
    let again = if room {
        format!(" If the results leave part of the request open and more subagent work would settle it, reply instead with only a JSON object naming at most {max} new goals for another round: {{\"goals\": [{{\"goal\": \"...\", \"pattern\": \"react\"}}]}}. {}", subagent_patterns(nested))
    } else {
        String::new()
    };
    // A synthesis written again after the critic rejected one is told why.
    let lessons = critic::answer_lessons(&request.history);
    let again = if lessons.is_empty() {
        again
    } else {
        format!(
            "{again} A reviewer rejected an earlier answer; lessons: {}.",
            lessons.join("; ")
        )
    };
    // The first synthesis of a fan-in records its node; one written again only its draft.
    let fan_in = supervising::pending_synthesis(&request.history).is_some();
    // A draft needs the iteration after it for its review: with none left, the answer is given
    // saying it was not reviewed (a draft queued past max_iterations was refused, and the client
    // got that error instead of the answer).
    let max_iterations = config.limits.max_iterations;
    let review = answer_critic(turn) && n <= max_iterations;
    let unreviewed = (answer_critic(turn) && !review)
        .then(|| format!("the dialog used its {max_iterations} iterations (max_iterations)"));
    let template = &config.prompts.supervisor_synthesise;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("results", results.clone()),
        ("again", again),
    ]
    .into_iter()
    .collect();
    // Streamed as it is written unless a reviewer must see it first, or it is another round's
    // goals (a JSON reply, which is held back whole).
    let (completion, stats, streamed) = if request.streaming && !answer_critic(turn) {
        let messages = [
            ChatMessage::system(template.system.clone()),
            ChatMessage::user(render(&template.template, &vars)),
        ];
        let held = ['{', '`'];
        let asked =
            crate::stream::answer_unless(turn.llm, out, &messages, &uris.conclusion(), &held)
                .await?;
        match (crate::turn::answer_text(asked.0), asked.1) {
            (Ok(completion), streamed) => {
                let stats = crate::turn::call_stats(&completion);
                (completion, stats, streamed)
            }
            (Err(e), _) => return crate::finish::llm_failed(turn, n, &e).await,
        }
    } else {
        let Some((completion, stats)) = turn
            .ask_for_answer(n, template, &vars, &CallOptions::default())
            .await?
        else {
            return Ok(());
        };
        (completion, stats, false)
    };
    let (answer, termination) = match supervising::parse_synthesis(&completion.text, max, nested)
    {
        supervising::Synthesis::Again(goals) if room => {
            // The fan-out records the call that asked for the round. A synthesis written again
            // after a rejected draft has its node already: writing it again gave it a second
            // cost, which a join over a node's tokens counts twice.
            if fan_in {
                out.explain(
                    &uris.synthesis(&cid),
                    provenance::synthesis(
                        uris,
                        &cid,
                        &completions,
                        &missing,
                        &CallStats::default(),
                    ),
                )?;
            }
            let thought = format!(
                "The results leave the request open; another round of {} goals.",
                goals.len()
            );
            let after = uris.synthesis(&cid);
            return fan_out(turn, n, &goals, &thought, &after, &stats, judged, Vec::new()).await;
        }
        supervising::Synthesis::Again(_) => (
            format!("I could not run another round of subagents within the limits (max_iterations, or the token and time budget). What the subagents found:\n{results}"),
            Termination::MaxIterations,
        ),
        supervising::Synthesis::Answer(answer) => (answer, Termination::Answer),
    };
    // An answer the model stopped at its length limit is given saying it is incomplete (a
    // streaming client has its start already: the note follows it).
    let answer = if completion.cut_off && termination == Termination::Answer {
        if streamed {
            out.chunk_with_outcome(
                MessageType::Answer,
                crate::patterns::plan::ANSWER_CUT_OFF,
                &uris.conclusion(),
                false,
            )
            .await?;
        }
        format!("{answer}{}", crate::patterns::plan::ANSWER_CUT_OFF)
    } else {
        answer
    };
    if fan_in {
        out.explain(
            &uris.synthesis(&cid),
            provenance::synthesis(uris, &cid, &completions, &missing, &stats),
        )?;
    }
    let (answer, termination) = match (&unreviewed, termination) {
        (Some(why), Termination::Answer) => (
            format!("{answer}\n\n(This answer was not reviewed: {why}.)"),
            Termination::MaxIterations,
        ),
        _ => (answer, termination),
    };
    // The synthesis node records the first synthesis's call; one written again after a rejected
    // draft is recorded on its draft, or on the conclusion, or no node would hold what the
    // closing counts.
    let unrecorded = if fan_in {
        CallStats::default()
    } else {
        stats.clone()
    };
    if termination == Termination::Answer && review {
        // A draft: recorded, derived from the synthesis, and queued for review.
        let mut triples = provenance::draft_answer(uris, n, &unrecorded);
        if fan_in {
            // The step before is the fan-in, which has no node of its own: the synthesis stands
            // for it.
            let previous = uris.previous(n - 1);
            triples.retain(|t| t.o.iri != previous);
        }
        triples.extend(provenance::derived_from(
            &uris.iteration(n),
            &uris.synthesis(&cid),
        ));
        out.explain(&uris.iteration(n), triples)?;
        let draft = AgentStep {
            observation: answer,
            step_type: StepType::Synthesise.as_str().to_owned(),
            ..AgentStep::default()
        };
        let tokens = crate::turn::tokens_after(turn, &stats, &ToolStats::default())
            .plus(judged.in_token, judged.out_token);
        return turn
            .observe_and_continue(n, draft, ToolStats::default(), Vec::new(), None, tokens)
            .await;
    }
    let concluded = Concluded {
        correlation_id: &cid,
        answer: &answer,
        termination,
        streamed,
        unrecorded: &unrecorded,
    };
    let charged = CallStats {
        in_token: stats.in_token.saturating_add(judged.in_token),
        out_token: stats.out_token.saturating_add(judged.out_token),
        ..stats
    };
    conclude_from_synthesis(turn, n, concluded, &charged, &completion.model).await
}

/// A dialog's end drawn from the synthesis of its fan-out `correlation_id`.
pub(crate) struct Concluded<'a> {
    pub correlation_id: &'a str,
    pub answer: &'a str,
    pub termination: Termination,
    /// The answer already reached a streaming client as it was written.
    pub streamed: bool,
    /// An LLM call the closing counts that no other node records: the conclusion does.
    pub unrecorded: &'a CallStats,
}

/// Ends the dialog with `concluded`: streamed to a streaming client unless it already was, the
/// conclusion recorded as derived from the synthesis node, and the answer given. `stats`: the
/// LLM call that wrote it.
pub(crate) async fn conclude_from_synthesis(
    turn: &Turn<'_>,
    n: usize,
    concluded: Concluded<'_>,
    stats: &CallStats,
    model: &str,
) -> Result<(), BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    let Concluded {
        correlation_id,
        answer,
        termination,
        streamed,
        unrecorded,
    } = concluded;
    if request.streaming && !streamed {
        out.chunk_with_outcome(MessageType::Answer, answer, &uris.conclusion(), false)
            .await?;
    }
    out.explain(
        &uris.conclusion(),
        provenance::conclusion_from(
            uris,
            &uris.synthesis(correlation_id),
            n,
            "",
            answer,
            termination,
            &[],
            unrecorded,
        ),
    )?;
    let tokens = crate::turn::tokens_after(turn, stats, &ToolStats::default());
    crate::finish::answer(turn, answer, tokens, model).await
}
