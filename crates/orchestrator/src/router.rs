//! The meta-router step: the first message of a dialog with no pattern. It asks the LLM which of
//! the configured task types the question is, then which of that task type's patterns to work with,
//! records the decision as a `tg:PatternDecision` node, and queues the dialog's first iteration with
//! `pattern`, `task_type` and `framing` set. Routing is its own message so the decision is on the
//! broker before any work starts: once the routing message is acked, a crash redoes iterations,
//! never the choice. A crash before that ack routes again, and the LLM may choose differently;
//! first-writer-wins on the decision node is the effectively-once work of issue 7.

use agent_bus::BusError;
use agent_core::config::{AgentConfig, TaskTypeDef};
use agent_core::pattern::Pattern;
use agent_core::provenance::{self, CallStats};
use agent_core::router::{self, Candidate, Choice, Decision, Method};
use agent_llm::ChatMessage;
use agent_schema::AgentRequest;

use crate::turn::Turn;

/// Message property on the first iteration the router queued: its session and decision nodes
/// exist already.
pub const ROUTED_PROPERTY: &str = "agent-routed";

/// Routes the dialog and queues its first iteration. `Err` only for publish failures.
pub async fn route(turn: &Turn<'_>) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    let task_types = config.task_types_or_general();
    let task_candidates = router::task_type_candidates(&task_types);
    let mut cost = CallStats::default();

    // An unknown requested task type was refused by `validate` before any work.
    let task_choice = if !request.task_type.is_empty() {
        router::without_llm(&task_candidates, &request.task_type, Method::Requested)
    } else if task_candidates.len() == 1 {
        let only = task_candidates[0].name.clone();
        router::without_llm(&task_candidates, &only, Method::OnlyCandidate)
    } else {
        let (system, user) = router::task_type_prompt(
            &config.prompts.task_type_selection,
            &request.question,
            &task_candidates,
        );
        let fallback = router::fallback_task_type(&task_candidates);
        ask(turn, system, user, &task_candidates, &fallback, &mut cost).await
    };
    let task_type = task_types
        .iter()
        .find(|t| t.name == task_choice.selected)
        .cloned()
        .unwrap_or_else(agent_core::config::general_task_type);

    let (pattern_candidates, unavailable) = router::pattern_candidates(config, &task_type);
    let pattern_choice = match pattern_candidates.as_slice() {
        [] => Choice {
            candidates: Vec::new(),
            selected: Pattern::React.name().to_owned(),
            method: Method::Fallback(format!(
                "none of the task type's patterns ({}) runs here",
                unavailable.join(", ")
            )),
            rationale: String::new(),
            raw_answer: None,
        },
        [only] => router::without_llm(&pattern_candidates, &only.name, Method::OnlyCandidate),
        [first, ..] => {
            let (system, user) = router::pattern_prompt(
                &config.prompts.pattern_selection,
                &request.question,
                &task_type,
                &pattern_candidates,
            );
            let fallback = first.name.clone();
            ask(
                turn,
                system,
                user,
                &pattern_candidates,
                &fallback,
                &mut cost,
            )
            .await
        }
    };

    let decision = Decision {
        framing: framing(&task_type, &request.framing),
        task_type: task_choice,
        pattern: pattern_choice,
        unavailable_patterns: unavailable,
    };
    log_decision(&decision);
    out.explain(
        &uris.pattern_decision(),
        provenance::pattern_decision(uris, &decision, &cost),
    )?;
    let next = AgentRequest {
        pattern: decision.pattern.selected.clone(),
        task_type: decision.task_type.selected.clone(),
        framing: decision.framing.clone(),
        session_id: turn.session_id.to_owned(),
        ..(*request).clone()
    };
    let tokens = turn.tokens_before.plus(cost.in_token, cost.out_token);
    out.next(&next, tokens, &[(ROUTED_PROPERTY, "true")])
}

/// The decision for a request that named its pattern (and perhaps its task type, which `validate`
/// checked): nothing was chosen, but the audit trail still says what ran and with which framing.
pub fn requested(request: &AgentRequest, config: &AgentConfig) -> Decision {
    let requested = |name: &str| Choice {
        candidates: Vec::new(),
        selected: name.to_owned(),
        method: Method::Requested,
        rationale: String::new(),
        raw_answer: None,
    };
    let task_type = config
        .task_types_or_general()
        .into_iter()
        .find(|t| !request.task_type.is_empty() && t.name == request.task_type);
    let depth = agent_core::supervisor::fanout_depth(request);
    let max_depth = config.limits.max_fanout_depth;
    let pattern = if Pattern::from_name(&request.pattern).is_some_and(Pattern::fans_out)
        && !agent_core::supervisor::may_fan_out(request, max_depth)
    {
        // Recorded, so the graph says why a requested supervisor (or ensemble) worked alone.
        Choice {
            selected: Pattern::React.name().to_owned(),
            rationale: format!(
                "{} was asked for at fan-out depth {depth}, which max_fanout_depth ({max_depth}) does not allow to fan out again; it works as react",
                request.pattern
            ),
            ..requested(&request.pattern)
        }
    } else {
        requested(&request.pattern)
    };
    Decision {
        task_type: requested(&request.task_type),
        pattern,
        unavailable_patterns: Vec::new(),
        framing: match &task_type {
            Some(t) => framing(t, &request.framing),
            None => request.framing.clone(),
        },
    }
}

/// One routing question to the LLM, constrained to `candidates`. A failed call is a recorded
/// fallback, not a failed dialog: routing is a preference, and the fallback always works.
async fn ask(
    turn: &Turn<'_>,
    system: String,
    user: String,
    candidates: &[Candidate],
    fallback: &str,
    cost: &mut CallStats,
) -> Choice {
    ask_answered(turn, system, user, candidates, fallback, cost)
        .await
        .0
}

/// [`ask`], and the LLM's answer as it came (when the call succeeded), for what else it says.
pub(crate) async fn ask_answered(
    turn: &Turn<'_>,
    system: String,
    user: String,
    candidates: &[Candidate],
    fallback: &str,
    cost: &mut CallStats,
) -> (Choice, Option<String>) {
    let messages = [ChatMessage::system(system), ChatMessage::user(user)];
    match turn.llm.complete_with(&messages, &turn.json_call()).await {
        Ok(completion) => {
            crate::turn::add_call(cost, &completion);
            let choice = router::decide(Ok(&completion.text), candidates, fallback);
            (choice, Some(completion.text))
        }
        Err(e) => {
            // In an outage the step waits rather than routing blind; what it decides here is then
            // never committed.
            if e.is_outage() && turn.may_park {
                turn.out.park(crate::emit::Park {
                    cause: format!("the LLM is unavailable: {e}"),
                    retry_after: e.retry_after(),
                });
            }
            (
                router::decide(Err(e.to_string()), candidates, fallback),
                None,
            )
        }
    }
}

/// The task type's framing, then any framing the request brought (which a subagent inherits with
/// its task type's framing already in it).
fn framing(task_type: &TaskTypeDef, requested: &str) -> String {
    match (task_type.framing.trim(), requested.trim()) {
        ("", r) => r.to_owned(),
        (t, "") => t.to_owned(),
        (t, r) if r.contains(t) => r.to_owned(),
        (t, r) => format!("{t}\n\n{r}"),
    }
}

fn log_decision(decision: &Decision) {
    for (what, choice) in [
        ("task type", &decision.task_type),
        ("pattern", &decision.pattern),
    ] {
        match &choice.method {
            Method::Fallback(reason) => tracing::warn!(
                selected = %choice.selected,
                candidates = ?choice.candidates,
                %reason,
                "routing fell back for the {what}"
            ),
            method => tracing::debug!(
                selected = %choice.selected,
                method = method.as_str(),
                "routed the {what}"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_joins_the_task_type_and_the_request() {
        let mut task = agent_core::config::general_task_type();
        assert_eq!(framing(&task, ""), "");
        assert_eq!(framing(&task, "Be brief."), "Be brief.");
        task.framing = "Research.".into();
        assert_eq!(framing(&task, ""), "Research.");
        assert_eq!(framing(&task, "Be brief."), "Research.\n\nBe brief.");
    }
}
