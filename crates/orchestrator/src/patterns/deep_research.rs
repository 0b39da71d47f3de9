//! One deep-research iteration: a round (the LLM checks what the notes still leave unknown and
//! chooses tool calls, which run in parallel within the round, each result a numbered note), or,
//! once the research is complete or out of rounds, the writer's draft from the notes, which the
//! judge (the answer critic) accepts or sends back with a lesson.

use agent_bus::BusError;
use agent_core::critic;
use agent_core::deep_research::{self as research, Call, Round};
use agent_core::documents::steps_taken;
use agent_core::prompt::{describe_tools, framing_block};
use agent_core::provenance::{self, ToolStats};
use agent_core::tools::Scope;
use agent_schema::{AgentStep, StepType};

use crate::finish::conclude_if_limited;
use crate::tools::{run_scoped_tool_parking, truncate};
use crate::turn::{tokens_after, Turn};

pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let request = turn.request;
    let n = steps_taken(&request.history) + 1;
    // The judge reads the draft against every note, whole: a long round travels as an excerpt,
    // and a claim taken from past it must not look unsupported (or an invented one supported).
    if critic::awaiting_draft_review(&request.history).is_some() {
        let history = crate::documents::observations_whole(turn.documents, &request.history).await;
        let notes = research::notes(&history);
        return crate::review::review_draft(turn, n, notes).await;
    }
    if critic::draft_rejected(&request.history) {
        if let Some(done) = crate::review::give_rejected_draft_at_a_limit(turn, n).await {
            return done;
        }
        return write(turn, n).await;
    }
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    // Complete, or out of rounds: the writer answers from the notes there are.
    if research::research_complete(&request.history)
        || research::rounds_done(&request.history) >= max_rounds(turn)
    {
        return write(turn, n).await;
    }
    round(turn, n).await
}

/// Rounds a dialog may run: leave room for the writer and the judge within `max_iterations`.
fn max_rounds(turn: &Turn<'_>) -> usize {
    research::MAX_ROUNDS.min(turn.config.limits.max_iterations.saturating_sub(3).max(1))
}

async fn round(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request, config, ..
    } = turn;
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let candidates: Vec<&str> = visible.iter().map(|t| t.name.as_str()).collect();
    // Every round's notes whole, not only the newest steps': the notes are what the research
    // knows, and there are at most its rounds' worth.
    let history = crate::documents::observations_whole(turn.documents, &request.history).await;
    let max_calls = research::MAX_CALLS_PER_ROUND;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("round", (research::rounds_done(&history) + 1).to_string()),
        ("max_rounds", max_rounds(turn).to_string()),
        ("max_calls", max_calls.to_string()),
        ("tools", describe_tools(&visible)),
        ("notes", research::notes(&history)),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn
        .ask(
            n,
            &config.prompts.deep_research_round,
            &vars,
            &turn.json_call(),
        )
        .await?
    else {
        return Ok(());
    };
    let round = research::parse_round(&completion.text, max_calls);
    if let Some(why) = &round.unreadable {
        tracing::info!(iteration = n, %why, "the round's reply could not be read; the research is taken as complete");
    }
    let mut recorded = provenance::research_round(turn.uris, n, &round, &candidates, &stats);
    if round.complete {
        turn.out.explain(&turn.uris.iteration(n), recorded)?;
        let step = AgentStep {
            thought: round.thought.clone(),
            action: research::COMPLETE_ACTION.to_owned(),
            arguments: gaps_argument(&round),
            observation: match round.gaps.as_slice() {
                [] => "The research is complete.".to_owned(),
                gaps => format!("The research stops here; still open: {}", gaps.join("; ")),
            },
            step_type: StepType::Research.as_str().to_owned(),
            ..AgentStep::default()
        };
        let tokens = tokens_after(turn, &stats, &ToolStats::default());
        return turn
            .observe_and_continue(n, step, ToolStats::default(), Vec::new(), None, tokens)
            .await;
    }
    let (notes, spent, call_records) = run_calls(turn, n, &scope, &candidates, &round.calls).await;
    // A tool's LLM is down: the round waits for it rather than note the outage.
    if turn.out.parked().is_some() {
        return Ok(());
    }
    recorded.extend(call_records);
    turn.out.explain(&turn.uris.iteration(n), recorded)?;
    let mut arguments = gaps_argument(&round);
    arguments.insert(
        research::CALLS_KEY.to_owned(),
        research::calls_json(&round.calls),
    );
    let step = AgentStep {
        thought: round.thought.clone(),
        action: research::RESEARCH_ACTION.to_owned(),
        arguments,
        observation: notes.join("\n"),
        step_type: StepType::Research.as_str().to_owned(),
        ..AgentStep::default()
    };
    let tokens = tokens_after(turn, &stats, &spent);
    turn.observe_and_continue(n, step, spent, Vec::new(), None, tokens)
        .await
}

/// Runs a round's calls side by side, each bounded by the tool timeout and its share of the
/// observation limit: the notes (numbered on from the dialog's earlier ones), what they cost in
/// all, and a node per call. A tool that needs a person's approval is not run (a round cannot wait
/// for one), and says so in its note.
async fn run_calls(
    turn: &Turn<'_>,
    n: usize,
    scope: &Scope,
    candidates: &[&str],
    calls: &[Call],
) -> (Vec<String>, ToolStats, Vec<agent_schema::Triple>) {
    // A round of one call may wait out its tool's LLM (parked, the step runs that call again,
    // which had not run); beside others it is noted as failed, since the step parked would run
    // the others again too.
    let may_park = turn.may_park && calls.len() == 1;
    let runs = futures::future::join_all(calls.iter().map(|call| {
        run_scoped_tool_parking(
            turn,
            scope,
            (&call.tool, &call.arguments),
            candidates,
            false,
            may_park,
        )
    }))
    .await;
    let share = turn.config.limits.max_observation_bytes / calls.len().max(1);
    let first = research::notes_taken(&turn.request.history) + 1;
    let mut notes = Vec::new();
    let mut spent = ToolStats::default();
    let mut records = Vec::new();
    for (k, (call, (run, _))) in calls.iter().zip(runs).enumerate() {
        let tool = run.stats();
        // The round's wall time is its slowest call's; the tokens add up.
        spent.duration_ms = spent.duration_ms.max(tool.duration_ms);
        spent.in_token = spent.in_token.saturating_add(tool.in_token);
        spent.out_token = spent.out_token.saturating_add(tool.out_token);
        let number = first + k;
        notes.push(research::note(
            number,
            call,
            &truncate(run.observation, share),
        ));
        records.extend(provenance::research_call(
            turn.uris,
            n,
            k + 1,
            call,
            tool,
            number,
        ));
    }
    (notes, spent, records)
}

fn gaps_argument(round: &Round) -> std::collections::BTreeMap<String, String> {
    [(
        research::GAPS_KEY.to_owned(),
        serde_json::to_string(&round.gaps).unwrap_or_default(),
    )]
    .into()
}

/// The writer: a draft from the notes (told the judge's lessons when it writes again), which the
/// next iteration's judge reviews.
async fn write(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    // Every round's notes whole, not only the newest steps': the notes are what the research
    // knows, and there are at most its rounds' worth.
    let history = crate::documents::observations_whole(turn.documents, &request.history).await;
    let lessons = critic::answer_lessons(&history);
    let lessons = if lessons.is_empty() {
        String::new()
    } else {
        format!(
            " A reviewer rejected an earlier answer; lessons: {}.",
            lessons.join("; ")
        )
    };
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("notes", research::notes(&history)),
        ("lessons", lessons),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn
        .ask_for_answer(
            n,
            &config.prompts.deep_research_write,
            &vars,
            &Default::default(),
        )
        .await?
    else {
        return Ok(());
    };
    out.explain(
        &uris.iteration(n),
        provenance::draft_answer(uris, n, &stats),
    )?;
    // A draft stopped at the model's length limit says so, to the judge and, given, to the
    // client.
    let draft = AgentStep {
        observation: format!(
            "{}{}",
            completion.text.trim(),
            crate::patterns::plan::cut_off_note(completion.cut_off)
        ),
        step_type: StepType::Synthesise.as_str().to_owned(),
        ..AgentStep::default()
    };
    let tokens = tokens_after(turn, &stats, &ToolStats::default());
    turn.observe_and_continue(n, draft, ToolStats::default(), Vec::new(), None, tokens)
        .await
}
