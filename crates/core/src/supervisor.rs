//! Supervisor/Subagent decision logic: reading the goals the LLM split a request into, building one
//! subagent request per goal (deterministic session and correlation ids, so a redone fan-out names
//! the same subagents), and the request that resumes the supervisor with its subagents' results.

use std::collections::BTreeMap;

use agent_schema::{AgentRequest, AgentStep, StepType};

use crate::plan::PLAN_THEN_EXECUTE;
use crate::router::REACT;

/// The pattern's name in config and on the wire.
pub const SUPERVISOR: &str = "supervisor";

/// One goal for a subagent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Goal {
    pub goal: String,
    /// The subagent's pattern: `react` unless the supervisor chose another that runs here.
    pub pattern: String,
    /// The subagent's tool groups; `None` keeps the supervisor's.
    pub group: Option<Vec<String>>,
}

/// Reads the goals: a JSON list of `{goal, pattern?, group?}` (or of strings), or an object with a
/// `goals` list, possibly with prose around it. At most `max` goals are kept; a pattern that is not
/// a worker pattern here becomes `react`.
pub fn parse_goals(text: &str, max: usize) -> Result<Vec<Goal>, String> {
    let start = text
        .find(['[', '{'])
        .ok_or("the answer holds no JSON list of goals")?;
    let value = crate::react::first_json_value(&text[start..])
        .ok_or("the answer holds no JSON list of goals")?
        .map_err(|e| format!("the goals are not valid JSON: {e}"))?;
    let list = match value {
        serde_json::Value::Array(list) => list,
        serde_json::Value::Object(mut o) => match o.remove("goals") {
            Some(serde_json::Value::Array(list)) => list,
            _ => return Err("the object has no 'goals' list".to_owned()),
        },
        _ => return Err("the goals are neither a list nor an object with 'goals'".to_owned()),
    };
    let goals: Vec<Goal> = list
        .iter()
        .filter_map(|item| {
            let (goal, pattern, group) = match item {
                serde_json::Value::String(g) => (g.clone(), String::new(), None),
                serde_json::Value::Object(o) => (
                    o.get("goal").and_then(|g| g.as_str())?.to_owned(),
                    o.get("pattern")
                        .and_then(|p| p.as_str())
                        .unwrap_or_default()
                        .to_owned(),
                    o.get("group").and_then(|g| g.as_array()).map(|g| {
                        g.iter()
                            .filter_map(|x| x.as_str().map(str::to_owned))
                            .collect()
                    }),
                ),
                _ => return None,
            };
            let goal = goal.trim().to_owned();
            if goal.is_empty() {
                return None;
            }
            let pattern = if pattern == PLAN_THEN_EXECUTE {
                pattern
            } else {
                REACT.to_owned()
            };
            Some(Goal {
                goal,
                pattern,
                group,
            })
        })
        .take(max)
        .collect();
    if goals.is_empty() {
        return Err("no goals".to_owned());
    }
    Ok(goals)
}

/// The correlation id of the fan-out a supervisor makes at iteration `n`.
pub fn correlation_id(session_id: &str, n: usize) -> String {
    format!("{session_id}-f{n}")
}

/// The session of subagent `index` of a fan-out.
pub fn subagent_session(correlation_id: &str, index: usize) -> String {
    format!("{correlation_id}-s{index}")
}

/// The request that starts subagent `index` on `goal`. It inherits the collection, framing and task
/// type; it is not streamed (its answer is a result for the supervisor, not for the client).
pub fn subagent_request(
    supervisor: &AgentRequest,
    supervisor_session: &str,
    correlation_id: &str,
    index: usize,
    goal: &Goal,
    expected: usize,
) -> AgentRequest {
    AgentRequest {
        question: goal.goal.clone(),
        state: supervisor.state.clone(),
        group: narrowed_group(supervisor.group.as_deref(), goal.group.as_deref()),
        history: Vec::new(),
        collection: supervisor.collection.clone(),
        streaming: false,
        session_id: subagent_session(correlation_id, index),
        conversation_id: supervisor.conversation_id.clone(),
        pattern: goal.pattern.clone(),
        task_type: supervisor.task_type.clone(),
        framing: supervisor.framing.clone(),
        correlation_id: correlation_id.to_owned(),
        parent_session_id: supervisor_session.to_owned(),
        subagent_goal: goal.goal.clone(),
        expected_siblings: expected as i64,
    }
}

/// A subagent's tool groups: the goal's, but only those the supervisor itself may use (the LLM
/// that chose them cannot widen the request's scope); the supervisor's when none remain.
fn narrowed_group(supervisor: Option<&[String]>, goal: Option<&[String]>) -> Option<Vec<String>> {
    let allowed: Vec<String> = supervisor
        .map(<[String]>::to_vec)
        .unwrap_or_else(|| vec![crate::tools::DEFAULT_GROUP.to_owned()]);
    let Some(wanted) = goal else {
        return supervisor.map(<[String]>::to_vec);
    };
    if allowed.iter().any(|g| g == "*") {
        return Some(wanted.to_vec());
    }
    let kept: Vec<String> = wanted
        .iter()
        .filter(|g| *g != "*" && allowed.contains(g))
        .cloned()
        .collect();
    if kept.is_empty() {
        supervisor.map(<[String]>::to_vec)
    } else {
        Some(kept)
    }
}

/// Whether a request is a subagent's: its end is a completion for its supervisor, not an answer
/// for the client.
pub fn is_subagent(request: &AgentRequest) -> bool {
    !request.parent_session_id.is_empty() && !request.correlation_id.is_empty()
}

/// The request that resumes the supervisor (`continuation`, as it was when it fanned out) with its
/// subagents' results, goal -> result.
pub fn synthesis_request(
    continuation: &AgentRequest,
    results: BTreeMap<String, String>,
) -> AgentRequest {
    let mut next = continuation.clone();
    next.history.push(AgentStep {
        step_type: StepType::Synthesise.as_str().to_owned(),
        observation: format!("{} subagent results", results.len()),
        subagent_results: Some(results),
        ..AgentStep::default()
    });
    next
}

/// The subagent results the supervisor resumes with, if its last step carries them.
pub fn pending_synthesis(history: &[AgentStep]) -> Option<&BTreeMap<String, String>> {
    let last = history.last()?;
    (StepType::parse(&last.step_type) == Some(StepType::Synthesise))
        .then_some(last.subagent_results.as_ref())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn goals_are_read_bounded_and_given_worker_patterns() {
        let goals = parse_goals(
            "Split:\n[{\"goal\": \"a\", \"pattern\": \"supervisor\"}, \"b\", {\"goal\": \"c\", \"pattern\": \"plan-then-execute\", \"group\": [\"web\"]}, {\"goal\": \"d\"}] done [x]",
            3,
        )
        .unwrap();
        let names: Vec<(&str, &str)> = goals
            .iter()
            .map(|g| (g.goal.as_str(), g.pattern.as_str()))
            .collect();
        assert_eq!(
            names,
            [("a", "react"), ("b", "react"), ("c", "plan-then-execute")]
        );
        assert_eq!(goals[2].group.as_deref(), Some(&["web".to_owned()][..]));
        assert!(parse_goals("{\"goals\": []}", 3).is_err());
        assert!(parse_goals("no", 3).is_err());
    }

    #[test]
    fn subagents_and_their_synthesis_are_named_deterministically() {
        let parent = AgentRequest {
            question: "Q".into(),
            streaming: true,
            framing: "F".into(),
            ..AgentRequest::default()
        };
        let cid = correlation_id("s", 1);
        let goal = Goal {
            goal: "g".into(),
            pattern: "react".into(),
            group: None,
        };
        let sub = subagent_request(&parent, "s", &cid, 2, &goal, 4);
        assert_eq!(sub.session_id, "s-f1-s2");
        assert_eq!((sub.expected_siblings, sub.streaming), (4, false));
        assert_eq!(sub.framing, "F");
        assert!(is_subagent(&sub) && !is_subagent(&parent));
        // A goal cannot widen the supervisor's tool scope.
        let greedy = Goal {
            group: Some(vec!["*".into(), "admin".into(), "web".into()]),
            ..goal.clone()
        };
        let scoped = AgentRequest {
            group: Some(vec!["web".into(), "default".into()]),
            ..parent.clone()
        };
        let sub = subagent_request(&scoped, "s", &cid, 0, &greedy, 1);
        assert_eq!(sub.group, Some(vec!["web".to_owned()]));
        let sub = subagent_request(&parent, "s", &cid, 0, &greedy, 1);
        assert_eq!(sub.group, None, "the default group only");
        let resumed = synthesis_request(&parent, [("g".to_owned(), "r".to_owned())].into());
        assert_eq!(pending_synthesis(&resumed.history).unwrap()["g"], "r");
    }
}
