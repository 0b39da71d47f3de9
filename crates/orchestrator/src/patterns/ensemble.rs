//! One Ensemble iteration: put the question to one subagent per perspective, all at once (then
//! stop: the aggregator resumes the dialog when every one has completed), or, resumed with their
//! answers, reconcile them: where they agreed, where they disagreed, and the answer.

use agent_bus::BusError;
use agent_core::documents::steps_taken;
use agent_core::ensemble;
use agent_core::pattern::{Pattern, Termination};
use agent_core::prompt::framing_block;
use agent_core::provenance::{self, CallStats};
use agent_core::supervisor as supervising;
use agent_llm::CallOptions;
use agent_schema::MessageType;

use crate::finish::conclude_if_no_room_to_fan_out;
use crate::patterns::supervisor::{
    conclude_from_synthesis, fan_in, fan_out, room_for_another_round, Concluded, FanIn,
};
use crate::turn::Turn;

pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let n = steps_taken(&turn.request.history) + 1;
    // The agents' answers are reconciled whatever the limits say: their work is already done. A
    // debate round comes first while config asks for one and the limits leave room.
    if supervising::pending_synthesis(&turn.request.history).is_some() {
        if debate_rounds_left(turn) && room_for_another_round(turn, n, 0) {
            return debate(turn, n).await;
        }
        return reconcile(turn, n).await;
    }
    if let Some(done) = conclude_if_no_room_to_fan_out(turn).await {
        return done;
    }
    let configured = ensemble_config(turn)
        .map(|p| p.perspectives.as_slice())
        .unwrap_or_default();
    let perspectives = ensemble::perspectives(configured, turn.config.limits.max_subagents);
    let goals = ensemble::with_models(
        ensemble::goals(&turn.request.question, &perspectives),
        ensemble_models(turn),
    );
    let thought = format!(
        "Asking {} independent agents the same question, each from its own perspective.",
        goals.len()
    );
    let after = turn.uris.previous(n - 1);
    // No LLM call decided the fan-out: the perspectives are configured.
    fan_out(
        turn,
        n,
        &goals,
        &thought,
        &after,
        &CallStats::default(),
        &CallStats::default(),
        Vec::new(),
    )
    .await
}

fn ensemble_models<'t>(turn: &Turn<'t>) -> &'t [String] {
    ensemble_config(turn)
        .map(|p| p.models.as_slice())
        .unwrap_or_default()
}

fn ensemble_config<'t>(turn: &Turn<'t>) -> Option<&'t agent_core::config::PatternDef> {
    turn.config.patterns.get(Pattern::Ensemble.name())
}

/// Whether the debate config asks for still has rounds to run: the first fan-out and one per
/// debate round so far are the decompose steps in the history.
fn debate_rounds_left(turn: &Turn<'_>) -> bool {
    let wanted = ensemble_config(turn)
        .map_or(0, |p| p.debate_rounds)
        .min(ensemble::MAX_DEBATE_ROUNDS);
    let rounds = supervising::decompose_steps(&turn.request.history).count();
    rounds < 1 + wanted
}

/// A debate round: every agent again, shown all the answers of the round before.
async fn debate(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    let (
        FanIn {
            correlation_id: cid,
            completions,
            missing,
        },
        answers,
        perspectives,
        (answered, agents),
    ) = answered_round(turn).await;
    // The round answered is closed by a synthesis node, as a supervisor's another round is.
    out.explain(
        &uris.synthesis(&cid),
        provenance::synthesis(uris, &cid, &completions, &missing, &CallStats::default()),
    )?;
    if answered == 0 {
        return nothing_to_reconcile(turn, n, agents).await;
    }
    // Each agent debates as the model it answered as.
    let goals = ensemble::with_models(
        ensemble::debate_goals(&request.question, &perspectives, &answers),
        ensemble_models(turn),
    );
    let thought = format!(
        "A debate round: each of the {} agents sees the others' answers and defends or revises its own.",
        goals.len()
    );
    let after = uris.synthesis(&cid);
    fan_out(
        turn,
        n,
        &goals,
        &thought,
        &after,
        &CallStats::default(),
        &CallStats::default(),
        Vec::new(),
    )
    .await
}

/// The perspectives of the ensemble's first fan-out (a debate round's goals keep the same ones;
/// the answers each agent is shown travel in its request only, as its briefing).
fn kept_perspectives(request: &agent_schema::AgentRequest) -> Vec<String> {
    supervising::decompose_steps(&request.history)
        .next()
        .map(supervising::kept_goals)
        .unwrap_or_default()
        .into_iter()
        .map(|g| g.perspective.unwrap_or_default())
        .collect()
}

/// The round the dialog was resumed with: its fan-in, the agents' answers as the prompts show
/// them (long ones read whole; they travel as excerpts), the agents' perspectives, and how many
/// of the agents gave an answer of how many there were.
async fn answered_round(turn: &Turn<'_>) -> (FanIn, String, Vec<String>, (usize, usize)) {
    let request = turn.request;
    let fan_in = fan_in(request, turn.config.limits.max_subagents);
    let perspectives = kept_perspectives(request);
    let whole = crate::documents::results_whole(turn.documents, &request.history).await;
    let results = supervising::pending_synthesis(&whole)
        .cloned()
        .unwrap_or_default();
    let answers = ensemble::describe_answers(&results, &perspectives);
    let answered = results
        .values()
        .filter(|r| ensemble::gave_an_answer(r))
        .count();
    (fan_in, answers, perspectives, (answered, results.len()))
}

/// Ends the dialog with an error when none of its `agents` answered: asked to reconcile nothing,
/// the LLM would make an answer up, and it would read as the agents'.
async fn nothing_to_reconcile(turn: &Turn<'_>, n: usize, agents: usize) -> Result<(), BusError> {
    let why = format!(
        "None of the ensemble's {agents} agents gave an answer (each failed, timed out or was cancelled), so there is nothing to reconcile."
    );
    crate::finish::fail(turn, n, &why).await
}

async fn reconcile(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    let (
        FanIn {
            correlation_id: cid,
            completions,
            missing,
        },
        answers,
        _,
        (answered, agents),
    ) = answered_round(turn).await;
    if answered == 0 {
        out.explain(
            &uris.synthesis(&cid),
            provenance::synthesis(uris, &cid, &completions, &missing, &CallStats::default()),
        )?;
        return nothing_to_reconcile(turn, n, agents).await;
    }
    let template = &config.prompts.ensemble_reconcile;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("answers", answers),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn
        .ask_for_answer(n, template, &vars, &CallOptions::default())
        .await?
    else {
        return Ok(());
    };
    let mut reconciliation = ensemble::parse_reconciliation(&completion.text);
    // Stopped at the model's length limit: given saying it is incomplete.
    reconciliation
        .answer
        .push_str(crate::patterns::plan::cut_off_note(completion.cut_off));
    let mut recorded = provenance::synthesis(uris, &cid, &completions, &missing, &stats);
    recorded.extend(provenance::reconciliation(uris, &cid, &reconciliation));
    out.explain(&uris.synthesis(&cid), recorded)?;
    let mut summary = ensemble::summary(&reconciliation);
    if answered < agents {
        summary.push_str(&format!(
            "\n{} of the {agents} agents gave no answer (failed, timed out or cancelled); the answer reconciles the other {answered}.",
            agents - answered
        ));
    }
    out.chunk_with_outcome(
        MessageType::Observation,
        &summary,
        &uris.synthesis(&cid),
        true,
    )
    .await?;
    let concluded = Concluded {
        correlation_id: &cid,
        answer: &reconciliation.answer,
        termination: Termination::Answer,
        streamed: false,
        unrecorded: &CallStats::default(),
    };
    conclude_from_synthesis(turn, n, concluded, &stats, &completion.model).await
}
