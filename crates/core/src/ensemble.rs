//! Ensemble decision logic: one goal per perspective (the same question each time), how the
//! answers are shown to the reconciling LLM, and what it said agreed, disagreed and concluded.

use std::collections::BTreeMap;

use crate::pattern::Pattern;
use crate::supervisor::Goal;

/// The perspectives an ensemble takes when config names none: three independent agents.
pub const DEFAULT_PERSPECTIVES: [&str; 3] = [
    "Take the direct route: answer from the evidence you can find, and say what it is.",
    "Be a skeptic: before you settle, look for reasons the obvious answer could be wrong.",
    "Reason from first principles: work the answer out step by step and check each step.",
];

/// The most agents one ensemble starts, whatever config lists.
pub const MAX_AGENTS: usize = 8;

/// The perspectives configured for the ensemble (`agent-pattern` entry `ensemble`,
/// `perspectives`), or the built-in ones; at most [`MAX_AGENTS`] and `max_subagents`.
pub fn perspectives(configured: &[String], max_subagents: usize) -> Vec<String> {
    let chosen: Vec<String> = configured
        .iter()
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect();
    let chosen = if chosen.is_empty() {
        DEFAULT_PERSPECTIVES.map(str::to_owned).to_vec()
    } else {
        chosen
    };
    chosen
        .into_iter()
        .take(MAX_AGENTS.min(max_subagents.max(1)))
        .collect()
}

/// One goal per perspective: the question itself, answered step by step with tools.
pub fn goals(question: &str, perspectives: &[String]) -> Vec<Goal> {
    perspectives
        .iter()
        .map(|p| Goal {
            perspective: Some(p.clone()),
            ..Goal::independent(question, Pattern::React)
        })
        .collect()
}

/// Agent `i` asks `models[i % len]`: independent agents can be different models as well as
/// different framings. No models: every agent keeps the orchestrator's.
pub fn with_models(goals: Vec<Goal>, models: &[String]) -> Vec<Goal> {
    let models: Vec<&String> = models.iter().filter(|m| !m.trim().is_empty()).collect();
    if models.is_empty() {
        return goals;
    }
    goals
        .into_iter()
        .enumerate()
        .map(|(i, goal)| Goal {
            model: Some(models[i % models.len()].trim().to_owned()),
            ..goal
        })
        .collect()
}

/// The most debate rounds an ensemble runs, whatever config says.
pub const MAX_DEBATE_ROUNDS: usize = 3;

/// A debate round's goals: each agent again, from its perspective, shown every agent's answer of
/// the round before (`answers`, as [`describe_answers`] writes them) and asked to defend or revise
/// its own.
pub fn debate_goals(question: &str, perspectives: &[String], answers: &str) -> Vec<Goal> {
    perspectives
        .iter()
        .enumerate()
        .map(|(i, p)| Goal {
            perspective: Some(p.clone()),
            briefing: Some(format!(
                "You are agent {}. In the previous round the agents answered:\n{answers}\n\nWeigh the other agents' arguments: keep your answer if you still think it right, or revise it, and say why.",
                i + 1
            )),
            ..Goal::independent(question, Pattern::React)
        })
        .collect()
}

/// The agents' answers as the reconciliation prompt shows them: `Agent {k} ({perspective}):
/// {answer}` in the order they were started. `results` are keyed as the fan-in keys them (the
/// agent's index first, `NN. goal`), and each answer is told by the index its key names, so an
/// agent missing from them shifts no other; `perspectives` by index.
pub fn describe_answers(results: &BTreeMap<String, String>, perspectives: &[String]) -> String {
    results
        .iter()
        .enumerate()
        .map(|(place, (key, answer))| {
            let index = key
                .split_once(". ")
                .and_then(|(index, _)| index.parse::<usize>().ok())
                .unwrap_or(place);
            (index, answer)
        })
        .map(|(i, answer)| match perspectives.get(i) {
            Some(p) => format!("Agent {} ({p}): {answer}", i + 1),
            None => format!("Agent {}: {answer}", i + 1),
        })
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// Whether an agent's result, as the fan-in hands it on, is an answer: the aggregator puts a
/// failed agent's (`Error: the subagent failed: ...`), a timed-out one's (`Error: no result
/// within ...`) and a cancelled one's (`The subagent was cancelled ...`) in its place.
pub fn gave_an_answer(result: &str) -> bool {
    !result.starts_with("Error:") && !result.starts_with("The subagent was ")
}

/// What the reconciliation concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciliation {
    pub answer: String,
    /// Points the agents agreed on.
    pub agreed: Vec<String>,
    /// Points they disagreed on.
    pub disagreed: Vec<String>,
    /// Whether the reply was the JSON object asked for; if not, the whole reply is the answer
    /// and nothing is claimed about agreement.
    pub read: bool,
}

/// Reads the reconciliation: a JSON object `{agreed, disagreed, answer}` (prose or a code fence
/// around it allowed). A reply without one, or without an answer in it, is taken whole as the
/// answer, with no agreement recorded.
pub fn parse_reconciliation(text: &str) -> Reconciliation {
    let whole = || Reconciliation {
        answer: text.trim().to_owned(),
        agreed: Vec::new(),
        disagreed: Vec::new(),
        read: false,
    };
    // The first object that carries an answer: prose before it may hold braces of its own.
    let Some(value) = crate::react::first_object_with(text, &["answer"]) else {
        return whole();
    };
    let answer = value
        .get("answer")
        .and_then(|a| a.as_str())
        .map(str::trim)
        .unwrap_or_default();
    if answer.is_empty() {
        return whole();
    }
    let points = |key: &str| -> Vec<String> {
        value
            .get(key)
            .and_then(|v| v.as_array())
            .map(|list| {
                list.iter()
                    .filter_map(|p| p.as_str().map(str::trim))
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    Reconciliation {
        answer: answer.to_owned(),
        agreed: points("agreed"),
        disagreed: points("disagreed"),
        read: true,
    }
}

/// What the client is shown of the reconciliation before the answer.
pub fn summary(reconciliation: &Reconciliation) -> String {
    if !reconciliation.read {
        return "The reconciliation did not say where the agents agreed.".to_owned();
    }
    let list = |points: &[String]| {
        if points.is_empty() {
            "nothing".to_owned()
        } else {
            points.join("; ")
        }
    };
    format!(
        "Agreed: {}\nDisagreed: {}",
        list(&reconciliation.agreed),
        list(&reconciliation.disagreed)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perspectives_are_configured_or_built_in_and_bounded() {
        assert_eq!(perspectives(&[], 5).len(), 3);
        let configured = vec![" a ".to_owned(), String::new(), "b".to_owned()];
        assert_eq!(perspectives(&configured, 5), ["a", "b"]);
        let many: Vec<String> = (0..20).map(|i| i.to_string()).collect();
        assert_eq!(perspectives(&many, 20).len(), MAX_AGENTS);
        assert_eq!(perspectives(&many, 2).len(), 2);
        let goals = goals("Q?", &perspectives(&[], 5));
        assert!(goals.iter().all(|g| g.goal == "Q?" && g.needs.is_empty()));
        assert_eq!(
            goals[1].perspective.as_deref(),
            Some(DEFAULT_PERSPECTIVES[1])
        );
    }

    #[test]
    fn a_reconciliation_is_read_or_taken_whole() {
        let read = parse_reconciliation(
            "Here:\n```json\n{\"agreed\": [\"it is safe\", \" \"], \"disagreed\": [\"the cost\"], \"answer\": \" Safe, cost unclear. \"}\n```",
        );
        assert_eq!(
            read,
            Reconciliation {
                answer: "Safe, cost unclear.".into(),
                agreed: vec!["it is safe".into()],
                disagreed: vec!["the cost".into()],
                read: true,
            }
        );
        assert_eq!(summary(&read), "Agreed: it is safe\nDisagreed: the cost");
        let prose = parse_reconciliation("They mostly agree: it is safe.");
        assert!(!prose.read);
        assert_eq!(prose.answer, "They mostly agree: it is safe.");
        assert!(!parse_reconciliation("{\"agreed\": [\"x\"]}").read);
        // Braces in the prose before the object do not hide it.
        let after_prose = parse_reconciliation(
            "Agents {1, 2} agree.\n{\"agreed\": [], \"disagreed\": [], \"answer\": \"Yes.\"}",
        );
        assert!(after_prose.read);
        assert_eq!(after_prose.answer, "Yes.");
        assert!(gave_an_answer("yes"));
        assert!(!gave_an_answer(
            "Error: no result within 30 s (the subagent timed out)"
        ));
        assert!(!gave_an_answer("The subagent was cancelled by ops at ..."));
        let results: BTreeMap<String, String> = [
            ("00. Q".to_owned(), "yes".to_owned()),
            ("01. Q".to_owned(), "no".to_owned()),
        ]
        .into();
        assert_eq!(
            describe_answers(&results, &["direct".to_owned()]),
            "Agent 1 (direct): yes\n\nAgent 2: no"
        );
        // An agent missing from the results shifts no other agent's number or perspective.
        let gap: BTreeMap<String, String> = [
            ("00. Q".to_owned(), "yes".to_owned()),
            ("02. Q".to_owned(), "maybe".to_owned()),
        ]
        .into();
        let perspectives = ["a", "b", "c"].map(str::to_owned);
        assert_eq!(
            describe_answers(&gap, &perspectives),
            "Agent 1 (a): yes\n\nAgent 3 (c): maybe"
        );
    }

    #[test]
    fn agents_take_the_configured_models_in_turn() {
        let perspectives: Vec<String> = ["a", "b", "c"].map(str::to_owned).to_vec();
        let models = vec!["small".to_owned(), " ".to_owned(), "large".to_owned()];
        let goals = with_models(goals("Q?", &perspectives), &models);
        let chosen: Vec<Option<&str>> = goals.iter().map(|g| g.model.as_deref()).collect();
        assert_eq!(chosen, [Some("small"), Some("large"), Some("small")]);
        let kept = with_models(goals.clone(), &[]);
        assert_eq!(kept, goals);
        assert!(with_models(super::goals("Q?", &perspectives), &[])
            .iter()
            .all(|g| g.model.is_none()));
    }

    #[test]
    fn a_debate_round_shows_each_agent_the_others_answers() {
        let perspectives = vec!["direct".to_owned(), "skeptic".to_owned()];
        let goals = debate_goals(
            "Q?",
            &perspectives,
            "Agent 1 (direct): yes\n\nAgent 2 (skeptic): no",
        );
        assert_eq!(goals.len(), 2);
        let supervisor = agent_schema::AgentRequest {
            question: "Q?".into(),
            framing: "Be brief.".into(),
            ..agent_schema::AgentRequest::default()
        };
        let second = crate::supervisor::subagent_request(&supervisor, "s", "s-f1", 1, &goals[1], 2);
        assert!(
            second
                .framing
                .starts_with("Be brief.\n\nskeptic\n\nYou are agent 2."),
            "{}",
            second.framing
        );
        assert!(second.framing.contains("Agent 1 (direct): yes"));
        assert!(goals.iter().all(|g| g.goal == "Q?"));
        // The fan-out keeps each agent's perspective, not the answers told to every agent.
        let kept = crate::supervisor::goals_json(&goals);
        assert!(
            kept.contains("skeptic") && !kept.contains("Agent 1 (direct)"),
            "{kept}"
        );
    }
}
