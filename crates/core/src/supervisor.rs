//! Supervisor/Subagent decision logic: reading the goals the LLM split a request into, building one
//! subagent request per goal (deterministic session and correlation ids, so a redone fan-out names
//! the same subagents), the request that resumes the supervisor with its subagents' results, what
//! the synthesis decided (answer, or another round), and how deep fan-outs may nest.

use std::collections::BTreeMap;

use agent_schema::{AgentRequest, AgentStep, StepType};

use crate::pattern::Pattern;

/// One goal for a subagent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Goal {
    pub goal: String,
    /// The subagent's pattern: `react` unless the supervisor chose another that runs here.
    pub pattern: Pattern,
    /// The subagent's tool groups; `None` keeps the supervisor's.
    pub group: Option<Vec<String>>,
    /// The goals (by index in the fan-out) whose results this one builds on: it starts when they
    /// have completed, with their results. Empty: it starts with the fan-out.
    pub needs: Vec<usize>,
    /// A perspective the subagent is told to take (an ensemble's), after the supervisor's framing.
    pub perspective: Option<String>,
    /// The model the subagent's LLM calls ask for (an ensemble's); `None`: the orchestrator's.
    pub model: Option<String>,
    /// What the subagent is told after its perspective that the fan-out's record does not keep:
    /// an ensemble's debate, every agent's answer of the round before. Each subagent's request
    /// carries it once; kept in the goals, it went into the continuation the supervisor carries
    /// on with once per agent and twice over (its listing and [`goals_json`]), so a debate of five
    /// agents answering 10 KB each added half a megabyte a round to every later message.
    pub briefing: Option<String>,
}

impl Goal {
    /// A goal that needs no other, in the supervisor's tool groups.
    pub fn independent(goal: impl Into<String>, pattern: Pattern) -> Goal {
        Goal {
            goal: goal.into(),
            pattern,
            group: None,
            needs: Vec::new(),
            perspective: None,
            model: None,
            briefing: None,
        }
    }
}

/// Reads the goals: a JSON list of `{id?, goal, pattern?, group?, needs?}` (or of strings), or an
/// object with a `goals` list, possibly with prose around it. At most `max` goals are kept; a
/// pattern that is not a worker pattern here becomes `react` (`supervisor` is one only when
/// `nested` fan-out is allowed). `needs` names other goals by `id` (or by position, from 0); a
/// need on no kept goal, on the goal itself, or closing a cycle is dropped, so the goals always
/// form a graph that can run to its end.
pub fn parse_goals(text: &str, max: usize, nested: bool) -> Result<Vec<Goal>, String> {
    // Goals drafted in a reasoning model's `<think>` block are not the split.
    let text = crate::react::without_think(text);
    // The first JSON value that reads as goals: a bracket in the prose before them (`Split in
    // [two]:`) stood for them before, and the answer was refused.
    let mut problem = None;
    for (tried, (start, _)) in text
        .match_indices(['[', '{'])
        .take(GOAL_OPENINGS_TRIED)
        .enumerate()
    {
        match crate::react::first_json_value(&text[start..]) {
            // Past the first bracket, only goals written as objects count.
            Some(Ok(value))
                if tried > 0 && !crate::react::lists_objects_with(&value, "goals", "goal") => {}
            Some(Ok(value)) => match goals_from(value, max, nested) {
                Ok(goals) => return Ok(goals),
                Err(why) => {
                    problem.get_or_insert(why);
                }
            },
            Some(Err(e)) => {
                problem.get_or_insert(format!("the goals are not valid JSON: {e}"));
            }
            None => {}
        }
    }
    Err(problem.unwrap_or_else(|| "the answer holds no JSON list of goals".to_owned()))
}

/// How many openings of a JSON value [`parse_goals`] tries, each read as far as its value goes.
const GOAL_OPENINGS_TRIED: usize = 32;

fn goals_from(value: serde_json::Value, max: usize, nested: bool) -> Result<Vec<Goal>, String> {
    let list = match value {
        serde_json::Value::Array(list) => list,
        serde_json::Value::Object(mut o) => match o.remove("goals") {
            Some(serde_json::Value::Array(list)) => list,
            _ => return Err("the object has no 'goals' list".to_owned()),
        },
        _ => return Err("the goals are neither a list nor an object with 'goals'".to_owned()),
    };
    // Each kept goal with its id and the needs as written, resolved once all are known.
    // With its place in the list as written, which a need by position names.
    let mut written: Vec<(Goal, Option<String>, Vec<serde_json::Value>, usize)> = list
        .iter()
        .enumerate()
        .filter_map(|(place, item)| {
            let (goal, pattern, group, id, needs) = match item {
                serde_json::Value::String(g) => (g.clone(), String::new(), None, None, Vec::new()),
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
                    o.get("id").and_then(id_text),
                    o.get("needs")
                        .and_then(|n| n.as_array())
                        .cloned()
                        .unwrap_or_default(),
                ),
                _ => return None,
            };
            let goal = goal.trim().to_owned();
            if goal.is_empty() {
                return None;
            }
            let pattern = match Pattern::from_name(&pattern) {
                Some(Pattern::PlanThenExecute) => Pattern::PlanThenExecute,
                Some(Pattern::Supervisor) if nested => Pattern::Supervisor,
                _ => Pattern::React,
            };
            let goal = Goal {
                group,
                ..Goal::independent(goal, pattern)
            };
            Some((goal, id, needs, place))
        })
        .take(max)
        .collect();
    if written.is_empty() {
        return Err("no goals".to_owned());
    }
    let ids: Vec<Option<String>> = written.iter().map(|(_, id, _, _)| id.clone()).collect();
    let places: Vec<usize> = written.iter().map(|(_, _, _, place)| *place).collect();
    for (index, (goal, _, needs, _)) in written.iter_mut().enumerate() {
        let mut resolved: Vec<usize> = needs
            .iter()
            .filter_map(|need| match need {
                // A goal's id when one has it (goals numbered from 1 are common), else a position.
                serde_json::Value::Number(n) => {
                    let as_id = n.to_string();
                    // A position is the list's as written: a goal dropped before (an empty
                    // one) does not shift it onto the next.
                    ids.iter()
                        .position(|id| id.as_deref() == Some(as_id.as_str()))
                        .or_else(|| {
                            let written = usize::try_from(n.as_u64()?).ok()?;
                            places.iter().position(|&place| place == written)
                        })
                }
                other => {
                    let wanted = id_text(other)?;
                    ids.iter()
                        .position(|id| id.as_deref() == Some(wanted.as_str()))
                }
            })
            .filter(|&need| need != index && need < ids.len())
            .collect();
        resolved.sort_unstable();
        resolved.dedup();
        goal.needs = resolved;
    }
    let mut goals: Vec<Goal> = written.into_iter().map(|(goal, _, _, _)| goal).collect();
    break_cycles(&mut goals);
    Ok(goals)
}

/// A goal's id as written: a string, or a number taken as its text.
fn id_text(value: &serde_json::Value) -> Option<String> {
    match value {
        serde_json::Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_owned()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// Drops the needs that close a cycle, so that every goal can start: goals are taken in rounds
/// (each round, those whose needs are all taken); when a round takes none, the first goal left
/// loses its needs on the others left, and the rounds go on.
fn break_cycles(goals: &mut [Goal]) {
    let mut taken = vec![false; goals.len()];
    while taken.iter().any(|t| !t) {
        let ready: Vec<usize> = (0..goals.len())
            .filter(|&i| !taken[i] && goals[i].needs.iter().all(|&n| taken[n]))
            .collect();
        if ready.is_empty() {
            // The first goal left loses its needs on the others left: the fewest needs dropped
            // that let the rounds go on.
            if let Some(first) = (0..goals.len()).find(|&i| !taken[i]) {
                goals[first].needs.retain(|n| taken[*n]);
            }
            continue;
        }
        for i in ready {
            taken[i] = true;
        }
    }
}

/// Whether any goal waits for another.
pub fn has_dependencies(goals: &[Goal]) -> bool {
    goals.iter().any(|g| !g.needs.is_empty())
}

/// The goals of a fan-out with their patterns, groups, needs and perspectives, as its decompose
/// step keeps them (under [`SUBAGENTS_KEY`]): what the aggregator starts a waiting subagent from,
/// what an ensemble reconciles by, and what a recovery round sends out again.
pub fn goals_json(goals: &[Goal]) -> String {
    let list: Vec<serde_json::Value> = goals
        .iter()
        .map(|g| {
            serde_json::json!({
                "goal": g.goal,
                "pattern": g.pattern.name(),
                "group": g.group,
                "needs": g.needs,
                "perspective": g.perspective,
                "model": g.model,
            })
        })
        .collect();
    serde_json::Value::Array(list).to_string()
}

/// The goals a decompose step kept whole (see [`goals_json`]); empty for a step recorded before
/// goals were kept whole.
pub fn kept_goals(decompose: &AgentStep) -> Vec<Goal> {
    let Some(kept) = decompose.arguments.get(SUBAGENTS_KEY) else {
        return Vec::new();
    };
    let Ok(serde_json::Value::Array(list)) = serde_json::from_str::<serde_json::Value>(kept) else {
        return Vec::new();
    };
    list.iter()
        .map(|item| {
            let text = |key: &str| item.get(key).and_then(|v| v.as_str()).unwrap_or_default();
            Goal {
                goal: text("goal").to_owned(),
                pattern: Pattern::from_name(text("pattern")).unwrap_or(Pattern::React),
                group: item.get("group").and_then(|g| g.as_array()).map(|g| {
                    g.iter()
                        .filter_map(|x| x.as_str().map(str::to_owned))
                        .collect()
                }),
                needs: item
                    .get("needs")
                    .and_then(|n| n.as_array())
                    .map(|n| {
                        n.iter()
                            .filter_map(|x| x.as_u64().map(|x| x as usize))
                            .collect()
                    })
                    .unwrap_or_default(),
                perspective: item
                    .get("perspective")
                    .and_then(|p| p.as_str())
                    .map(str::to_owned),
                model: item
                    .get("model")
                    .and_then(|m| m.as_str())
                    .map(str::to_owned),
                briefing: None,
            }
        })
        .collect()
}

/// The subagents of a round a supervisor's critic sends out again, and why: each non-success
/// verdict (by subagent index) becomes goals of a recovery round. `EXECUTION_ERROR`: the goal
/// again, told the lesson. `INPUT_DATA_ERROR`: the culprits it names again with the lesson, then
/// the goal, waiting for them (a verdict naming no other subagent is taken as an execution
/// error). `JOB_TOO_COMPLICATED_ERROR`: the sub-goals it gives, or else the goal split by a subagent
/// of its own (`supervisor` while `nested`, else `plan-then-execute`); past `life_cycle` splits of
/// that goal, the result stands. At most `max` goals (the first), none waiting in a circle: the
/// critic's culprits and sub-steps are an LLM's, as unbounded as a decomposition's.
pub fn recovery_goals(
    round: &[Goal],
    verdicts: &[(usize, crate::critic::Evaluation)],
    splits_behind: impl Fn(&str) -> usize,
    life_cycle: usize,
    nested: bool,
    max: usize,
) -> Vec<Goal> {
    use crate::critic::Status;
    let mut goals: Vec<Goal> = Vec::new();
    // Round index -> index of its retry in the recovery round, so a goal is sent out once.
    let mut sent: BTreeMap<usize, usize> = BTreeMap::new();
    let told = |goal: &Goal, verdict: &crate::critic::Evaluation| {
        let mut note = format!(
            "An earlier attempt at this goal was judged {}",
            verdict.status.as_str()
        );
        if !verdict.evaluation.is_empty() {
            note.push_str(&format!(": {}", verdict.evaluation));
        }
        if !verdict.lesson.is_empty() {
            note.push_str(&format!(" Lesson: {}", verdict.lesson));
        }
        Goal {
            needs: Vec::new(),
            perspective: Some(match &goal.perspective {
                Some(p) => format!("{p}\n\n{note}"),
                None => note,
            }),
            ..goal.clone()
        }
    };
    for (index, verdict) in verdicts {
        let Some(goal) = round.get(*index) else {
            continue;
        };
        match verdict.status {
            Status::Success => {}
            Status::ExecutionError => {
                sent.entry(*index).or_insert_with(|| {
                    goals.push(told(goal, verdict));
                    goals.len() - 1
                });
            }
            Status::InputDataError => {
                let culprits: Vec<usize> = verdict
                    .culprits
                    .iter()
                    .copied()
                    .filter(|c| c != index && *c < round.len())
                    .collect();
                let mut needs = Vec::new();
                for culprit in culprits {
                    let at = *sent.entry(culprit).or_insert_with(|| {
                        goals.push(told(&round[culprit], verdict));
                        goals.len() - 1
                    });
                    needs.push(at);
                }
                let at = *sent.entry(*index).or_insert_with(|| {
                    goals.push(told(goal, verdict));
                    goals.len() - 1
                });
                needs.retain(|&n| n != at);
                needs.sort_unstable();
                needs.dedup();
                goals[at].needs.extend(needs);
            }
            Status::JobTooComplicated => {
                if splits_behind(&goal.goal) >= life_cycle || sent.contains_key(index) {
                    continue;
                }
                if verdict.sub_steps.is_empty() {
                    let pattern = if nested {
                        Pattern::Supervisor
                    } else {
                        Pattern::PlanThenExecute
                    };
                    goals.push(Goal {
                        pattern,
                        ..told(goal, verdict)
                    });
                    sent.insert(*index, goals.len() - 1);
                } else {
                    for (sub_goal, _) in &verdict.sub_steps {
                        goals.push(Goal {
                            perspective: Some(format!(
                                "This is part of a larger goal: {}",
                                goal.goal
                            )),
                            ..Goal::independent(sub_goal.clone(), Pattern::React)
                        });
                    }
                    sent.insert(*index, goals.len() - 1);
                }
            }
        }
    }
    goals.truncate(max);
    let kept = goals.len();
    for goal in &mut goals {
        goal.needs.retain(|&need| need < kept);
    }
    break_cycles(&mut goals);
    goals
}

/// The round a result key belongs to and its subagent index (`"03. goal"` -> 3).
pub fn index_of_key(key: &str) -> Option<usize> {
    let (index, _) = key.split_once(". ")?;
    index.parse().ok()
}

/// How much of a prerequisite's result a waiting subagent is given (characters); the rest is
/// named, not silently dropped.
pub const PREREQUISITE_RESULT_CHARS: usize = 4_000;

/// The request that starts subagent `index`, which waited for `prerequisites` (goal, result):
/// [`subagent_request`], told in its framing what those subagents found.
pub fn dependent_request(
    continuation: &AgentRequest,
    correlation_id: &str,
    index: usize,
    goal: &Goal,
    expected: usize,
    prerequisites: &[(String, String)],
) -> AgentRequest {
    let mut request = subagent_request(
        continuation,
        &continuation.session_id,
        correlation_id,
        index,
        goal,
        expected,
    );
    let found: Vec<String> = prerequisites
        .iter()
        .map(|(goal, result)| {
            let total = result.chars().count();
            if total > PREREQUISITE_RESULT_CHARS {
                let kept: String = result.chars().take(PREREQUISITE_RESULT_CHARS).collect();
                format!("- {goal}: {kept} [cut: {PREREQUISITE_RESULT_CHARS} of {total} characters]")
            } else {
                format!("- {goal}: {result}")
            }
        })
        .collect();
    let context = format!(
        "Your goal builds on what other subagents found:\n{}",
        found.join("\n")
    );
    request.framing = if request.framing.trim().is_empty() {
        context
    } else {
        format!("{}\n\n{context}", request.framing)
    };
    request
}

/// What a synthesis iteration decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Synthesis {
    Answer(String),
    /// Another round: the results leave the request open and these goals would settle it.
    Again(Vec<Goal>),
}

/// Reads a synthesis answer. It asks for another round only when the whole answer (a code fence
/// aside) is a JSON object with a non-empty `goals` list; anything else is the answer, so an answer
/// that merely quotes JSON is never mistaken for a request.
pub fn parse_synthesis(text: &str, max: usize, nested: bool) -> Synthesis {
    let answer = text.trim();
    let bare = answer
        .strip_prefix("```json")
        .or_else(|| answer.strip_prefix("```"))
        .and_then(|t| t.strip_suffix("```"))
        .unwrap_or(answer)
        .trim();
    let again = serde_json::from_str::<serde_json::Value>(bare)
        .ok()
        .filter(|v| v.get("goals").is_some_and(serde_json::Value::is_array))
        .and_then(|v| goals_from(v, max, nested).ok());
    match again {
        Some(goals) => Synthesis::Again(goals),
        None => Synthesis::Answer(answer.to_owned()),
    }
}

/// The results of every round so far, oldest first, as the synthesis prompt shows them: one
/// `- goal: result` line each, under a round heading once there is more than one round.
pub fn describe_rounds(history: &[AgentStep]) -> String {
    let rounds: Vec<&BTreeMap<String, String>> = history
        .iter()
        .filter(|s| StepType::parse(&s.step_type) == Some(StepType::Synthesise))
        .filter_map(|s| s.subagent_results.as_ref())
        .collect();
    let lines = |results: &BTreeMap<String, String>| {
        results
            .iter()
            .map(|(key, result)| format!("- {}: {result}", goal_of_key(key)))
            .collect::<Vec<_>>()
            .join("\n")
    };
    match rounds.as_slice() {
        [only] => lines(only),
        _ => rounds
            .iter()
            .enumerate()
            .map(|(i, r)| format!("Round {}:\n{}", i + 1, lines(r)))
            .collect::<Vec<_>>()
            .join("\n\n"),
    }
}

/// Where a session sits among fan-outs: the subagent index in each fan-out from the outermost in,
/// read from the `-f{n}-s{i}` suffixes `subagent_session` adds. Empty for a session named otherwise.
pub fn subagent_path(session_id: &str) -> Vec<usize> {
    let mut path = Vec::new();
    let mut session = session_id;
    while let Some(place) = place_of(session) {
        path.push(place.index);
        session = place.supervisor;
    }
    path.reverse();
    path
}

/// The fan-outs that hold the fan-out `correlation_id` (`{session}-f{n}`, see [`correlation_id`]),
/// the one waiting for its supervisor first, out to the client's supervisor's. Empty for a
/// fan-out of a client's supervisor, or a correlation id named otherwise.
///
/// ```
/// use agent_core::supervisor::fanouts_above;
/// assert_eq!(fanouts_above("abc-f2-s0-f4-s11-f1"), ["abc-f2-s0-f4", "abc-f2"]);
/// assert!(fanouts_above("abc-f2").is_empty() && fanouts_above("abc").is_empty());
/// ```
pub fn fanouts_above(correlation_id: &str) -> Vec<&str> {
    let number = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let mut above = Vec::new();
    let Some((mut session, step)) = correlation_id.rsplit_once("-f") else {
        return above;
    };
    if !number(step) {
        return above;
    }
    while let Some(place) = place_of(session) {
        above.push(place.correlation_id);
        session = place.supervisor;
    }
    above
}

/// Where a subagent session sits: its supervisor's session, the fan-out's correlation id and its
/// index in it, read from the last `-f{n}-s{i}` suffix; `None` for a session named otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place<'a> {
    pub supervisor: &'a str,
    pub correlation_id: &'a str,
    pub index: usize,
}

/// The [`Place`] of `session`, if it is a subagent's.
///
/// ```
/// use agent_core::supervisor::place_of;
/// let place = place_of("abc-f2-s0-f4-s11").unwrap();
/// assert_eq!((place.supervisor, place.correlation_id, place.index), ("abc-f2-s0", "abc-f2-s0-f4", 11));
/// assert!(place_of("abc-s0").is_none() && place_of("abc-fx-s0").is_none() && place_of("-f1-s0").is_none());
/// ```
pub fn place_of(session: &str) -> Option<Place<'_>> {
    let number = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    let (correlation_id, index) = session.rsplit_once("-s")?;
    let (supervisor, step) = correlation_id.rsplit_once("-f")?;
    if !number(index) || !number(step) || supervisor.is_empty() {
        return None;
    }
    Some(Place {
        supervisor,
        correlation_id,
        index: index.parse().ok()?,
    })
}

/// The run a session belongs to: its root request's session. A subagent's session is its
/// supervisor's with `-f{iteration}-s{index}` added, so the root is what is left with every such
/// pair taken off. Only a subagent's session is read this way (a client's own session is its run,
/// whatever it is called).
///
/// ```
/// use agent_core::supervisor::run_of;
/// assert_eq!(run_of("abc"), "abc");
/// assert_eq!(run_of("abc-f2-s0"), "abc");
/// assert_eq!(run_of("abc-f2-s0-f4-s11"), "abc");
/// assert_eq!(run_of("abc-s0"), "abc-s0");
/// assert_eq!(run_of("abc-fx-s0"), "abc-fx-s0");
/// ```
pub fn run_of(session_id: &str) -> &str {
    let mut run = session_id;
    while let Some(place) = place_of(run) {
        run = place.supervisor;
    }
    run
}

/// How many fan-outs lie above a request: 0 for a client's, 1 for a subagent of a client's
/// supervisor, and so on. Read from the session id, which grows by `-f{n}-s{i}` per fan-out (see
/// `subagent_session`), so it needs no extra wire field and a subagent cannot reset it.
pub fn fanout_depth(request: &AgentRequest) -> usize {
    if !is_subagent(request) {
        return 0;
    }
    subagent_path(&request.session_id).len().max(1)
}

/// Whether a supervisor at this request's depth may fan out (`max_fanout_depth` levels of fan-out
/// in all, the client's supervisor's being the first).
pub fn may_fan_out(request: &AgentRequest, max_fanout_depth: usize) -> bool {
    fanout_depth(request) < max_fanout_depth
}

/// Whether the subagents a supervisor starts may themselves be supervisors.
pub fn may_nest(request: &AgentRequest, max_fanout_depth: usize) -> bool {
    fanout_depth(request) + 1 < max_fanout_depth
}

/// The correlation id of the fan-out a supervisor makes at iteration `n`.
pub fn correlation_id(session_id: &str, n: usize) -> String {
    format!("{session_id}-f{n}")
}

/// The session of subagent `index` of a fan-out.
pub fn subagent_session(correlation_id: &str, index: usize) -> String {
    format!("{correlation_id}-s{index}")
}

/// The request that starts subagent `index` on `goal`. It inherits the collection, framing, task
/// type and streaming: a streaming client sees each subagent's thoughts as they are written, under
/// the subagent's own message ids (its answer is a result for the supervisor, not for the client).
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
        streaming: supervisor.streaming,
        session_id: subagent_session(correlation_id, index),
        conversation_id: supervisor.conversation_id.clone(),
        pattern: goal.pattern.name().to_owned(),
        task_type: supervisor.task_type.clone(),
        framing: [
            Some(supervisor.framing.as_str()),
            goal.perspective.as_deref(),
            goal.briefing.as_deref(),
        ]
        .into_iter()
        .flatten()
        .filter(|part| !part.trim().is_empty())
        .collect::<Vec<_>>()
        .join("\n\n"),
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
    missing: &[usize],
) -> AgentRequest {
    let mut next = continuation.clone();
    let mut arguments = BTreeMap::new();
    if !missing.is_empty() {
        let listed: Vec<String> = missing.iter().map(usize::to_string).collect();
        arguments.insert(MISSING_KEY.to_owned(), listed.join(","));
    }
    next.history.push(AgentStep {
        step_type: StepType::Synthesise.as_str().to_owned(),
        observation: format!("{} subagent results", results.len()),
        subagent_results: Some(results),
        arguments,
        ..AgentStep::default()
    });
    next
}

/// How a synthesis request came out against the broker's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// Every result whole.
    Whole,
    /// Results cut to fit.
    Cut,
    /// Over the limit even with every result cut to its note (the continuation alone is too
    /// large): the request is the smallest that could be built.
    Over,
}

/// [`synthesis_request`] held to `max_bytes` encoded: a request the broker refuses is refused on
/// every try, and the supervisor would never resume. Results carried whole (no shared store to
/// check them in) can outgrow the limit together; each is then cut to an equal share, its start
/// kept and the cut said, halving the shares until the request fits. Encodes the whole request
/// once when it fits, which is the common case.
pub fn synthesis_request_within(
    continuation: &AgentRequest,
    results: BTreeMap<String, String>,
    missing: &[usize],
    max_bytes: usize,
) -> (AgentRequest, Fit) {
    let fits = |request: &AgentRequest| agent_schema::encode(request).len() <= max_bytes;
    let whole = synthesis_request(continuation, results.clone(), missing);
    if fits(&whole) {
        return (whole, Fit::Whole);
    }
    let base =
        agent_schema::encode(&synthesis_request(continuation, BTreeMap::new(), missing)).len();
    let mut share = max_bytes.saturating_sub(base) / results.len().max(1);
    while share >= 64 {
        let request = synthesis_request(continuation, cut_to(&results, share), missing);
        if fits(&request) {
            return (request, Fit::Cut);
        }
        share /= 2;
    }
    // The smallest request there is (each result only its note). It may fit where no share of
    // 64 bytes or more did, when the first share was already under 64; otherwise it is sent
    // rather than the whole, as the room left for the properties may be more than they need.
    let smallest = synthesis_request(continuation, cut_to(&results, 0), missing);
    let fit = if fits(&smallest) { Fit::Cut } else { Fit::Over };
    (smallest, fit)
}

/// Each of `results` in at most about `share` bytes.
fn cut_to(results: &BTreeMap<String, String>, share: usize) -> BTreeMap<String, String> {
    results
        .iter()
        .map(|(key, result)| (key.clone(), cut_to_share(result, share)))
        .collect()
}

/// `result` in at most about `share` bytes: its start and a note of the cut.
fn cut_to_share(result: &str, share: usize) -> String {
    if result.len() <= share {
        return result.to_owned();
    }
    let mut end = share.saturating_sub(96);
    while !result.is_char_boundary(end) {
        end -= 1;
    }
    let cut = format!(
        "{} [cut to fit the broker's message limit: {end} of {} bytes]",
        &result[..end],
        result.len()
    );
    // A short result is kept whole: its note would be longer.
    if cut.len() < result.len() {
        cut
    } else {
        result.to_owned()
    }
}

/// What a subagent request's seal covers: who it is, whose fan-out it belongs to, the run's
/// start and spend it inherits, the model it asks for, the client its messages go to, and the
/// whole `payload` as sent (its goal, question, tools and all). Until 2026-12-02 only the first
/// five were covered ([`legacy_subagent_seal_parts`]): a copy of a sealed start with another
/// question or every tool group still verified, ran under the supervisor's budget, and its
/// completion could join the fan-in.
pub fn subagent_seal_parts(
    request: &AgentRequest,
    payload: &[u8],
    started_ms: u64,
    run_tokens: u64,
    model: &str,
    client: &str,
) -> [String; 8] {
    [
        request.session_id.clone(),
        request.parent_session_id.clone(),
        request.correlation_id.clone(),
        started_ms.to_string(),
        run_tokens.to_string(),
        model.to_owned(),
        client.to_owned(),
        String::from_utf8_lossy(payload).into_owned(),
    ]
}

/// What a subagent request's seal covered in builds before 2026-12-02: who it is, whose fan-out
/// it belongs to, and the run's start and spend it inherits. Still sent beside the whole seal,
/// for those builds' replicas during a rolling upgrade.
pub fn legacy_subagent_seal_parts(
    request: &AgentRequest,
    started_ms: u64,
    run_tokens: u64,
) -> [String; 5] {
    [
        request.session_id.clone(),
        request.parent_session_id.clone(),
        request.correlation_id.clone(),
        started_ms.to_string(),
        run_tokens.to_string(),
    ]
}

/// What a fan-out's seal covers (see `agent_bus::seal`): the node, its correlation id, the
/// request that resumes the supervisor, and the client its answer goes to.
pub fn fanout_seal_parts<'a>(
    node: &'a str,
    correlation_id: &'a str,
    continuation: &'a str,
    client_id: &'a str,
) -> [&'a str; 4] {
    [node, correlation_id, continuation, client_id]
}

/// What a completion's seal covers: the node, the fan-out it answers, how it ended and its result.
pub fn completion_seal_parts<'a>(
    node: &'a str,
    correlation_id: &'a str,
    status: &'a str,
    result: &'a str,
) -> [&'a str; 4] {
    [node, correlation_id, status, result]
}

/// `arguments` key of a synthesis step: the subagents (by index) whose results never came.
pub const MISSING_KEY: &str = "missing";
/// `arguments` key of a decompose step: its goals by subagent index, as a JSON list.
pub const GOALS_KEY: &str = "goals";
/// `arguments` key of a decompose step: every goal with its pattern, groups, needs and perspective
/// (see [`goals_json`]).
pub const SUBAGENTS_KEY: &str = "subagents";
/// `arguments` key of a decompose step whose supervisor reads documents from the shared store: its
/// subagents' long results may come back as excerpts with references (claim-check).
pub const RESULTS_BY_REFERENCE_KEY: &str = "results-by-reference";

/// The key of subagent `index`'s result: its place before its goal, so that two subagents with
/// the same goal keep two results.
///
/// ```
/// assert_eq!(agent_core::supervisor::result_key(3, "price of delta"), "03. price of delta");
/// ```
pub fn result_key(index: usize, goal: &str) -> String {
    format!("{index:02}. {goal}")
}

/// The goal in a result key (see [`result_key`]); a key from before results were numbered is
/// the goal itself.
fn goal_of_key(key: &str) -> &str {
    match key.split_once(". ") {
        Some((index, goal)) if !index.is_empty() && index.bytes().all(|b| b.is_ascii_digit()) => {
            goal
        }
        _ => key,
    }
}

/// The subagent index a session (or a node of it) ends with: `…-s{index}`.
///
/// ```
/// use agent_core::supervisor::subagent_index;
/// assert_eq!(subagent_index("urn:trustgraph:agent:x-f2-s11"), Some(11));
/// assert_eq!(subagent_index("urn:trustgraph:agent:x-f2-s1/completion"), Some(1));
/// assert_eq!(subagent_index("x-f2"), None);
/// ```
pub fn subagent_index(session: &str) -> Option<usize> {
    let session = session.strip_suffix("/completion").unwrap_or(session);
    place_of(session).map(|place| place.index)
}

/// The goals of a fan-out by subagent index, from its decompose step (empty for a step recorded
/// before the goals were).
pub fn decomposed_goals(decompose: &AgentStep) -> Vec<String> {
    decompose
        .arguments
        .get(GOALS_KEY)
        .and_then(|goals| serde_json::from_str(goals).ok())
        .unwrap_or_default()
}

/// The subagents (by index) a synthesis step says never answered.
pub fn missing_subagents(synthesis: &AgentStep) -> Vec<usize> {
    synthesis
        .arguments
        .get(MISSING_KEY)
        .map(|listed| {
            listed
                .split(',')
                .filter_map(|i| i.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The decompose steps of a history, one per fan-out, oldest first.
pub fn decompose_steps(history: &[AgentStep]) -> impl DoubleEndedIterator<Item = &AgentStep> {
    history
        .iter()
        .filter(|s| StepType::parse(&s.step_type) == Some(StepType::Decompose))
}

/// The decompose step of the fan-out being answered (the last one).
pub fn last_decompose(history: &[AgentStep]) -> Option<&AgentStep> {
    decompose_steps(history).next_back()
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

    /// A need by position names the goal at that place in the list as written, and goals are
    /// read after a bracket in the prose: before, a goal dropped for being empty shifted every
    /// position onto the next goal, and `[two]` in the prose stood for the goals.
    #[test]
    fn needs_by_position_count_the_list_as_written() {
        let goals = parse_goals(
            r#"[{"goal": " "}, {"goal": "A"}, {"goal": "B"}, {"goal": "C", "needs": [1]}]"#,
            5,
            false,
        )
        .unwrap();
        assert_eq!(goals[2].goal, "C");
        assert_eq!(goals[2].needs, [0], "C waits for A");
        let goals = parse_goals(
            "Split in [two]:\n[{\"goal\": \"a\"}, {\"goal\": \"b\"}]",
            5,
            false,
        )
        .unwrap();
        assert_eq!(goals.len(), 2);
        // Goals drafted while thinking are not the split (before, they were read first).
        let goals = parse_goals(
            "<think>\n[{\"goal\": \"draft\"}]\n</think>\n[{\"goal\": \"a\"}, {\"goal\": \"b\"}]",
            5,
            false,
        )
        .unwrap();
        let read: Vec<&str> = goals.iter().map(|g| g.goal.as_str()).collect();
        assert_eq!(read, ["a", "b"]);
        // Code with a list of strings in it is no list of goals (a small model's recorded reply).
        assert!(parse_goals(
            "```python\nbody = {\"h\": {\"x\",},}\nbody[\"response_type\"] = 1\n```",
            5,
            false
        )
        .is_err());
    }

    #[test]
    fn goals_are_read_bounded_and_given_worker_patterns() {
        let goals = parse_goals(
            "Split:\n[{\"goal\": \"a\", \"pattern\": \"supervisor\"}, \"b\", {\"goal\": \"c\", \"pattern\": \"plan-then-execute\", \"group\": [\"web\"]}, {\"goal\": \"d\"}] done [x]",
            3,
            false,
        )
        .unwrap();
        let names: Vec<(&str, &str)> = goals
            .iter()
            .map(|g| (g.goal.as_str(), g.pattern.name()))
            .collect();
        assert_eq!(
            names,
            [("a", "react"), ("b", "react"), ("c", "plan-then-execute")]
        );
        assert_eq!(goals[2].group.as_deref(), Some(&["web".to_owned()][..]));
        assert!(parse_goals("{\"goals\": []}", 3, false).is_err());
        assert!(parse_goals("no", 3, false).is_err());
        let nested =
            parse_goals("[{\"goal\": \"a\", \"pattern\": \"supervisor\"}]", 3, true).unwrap();
        assert_eq!(nested[0].pattern, Pattern::Supervisor);
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
        let goal = Goal::independent("g", Pattern::React);
        let sub = subagent_request(&parent, "s", &cid, 2, &goal, 4);
        assert_eq!(sub.session_id, "s-f1-s2");
        assert_eq!((sub.expected_siblings, sub.streaming), (4, true));
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
        let resumed = synthesis_request(&parent, [("g".to_owned(), "r".to_owned())].into(), &[]);
        assert_eq!(pending_synthesis(&resumed.history).unwrap()["g"], "r");
    }

    #[test]
    fn a_synthesis_asks_for_another_round_only_with_a_bare_goals_object() {
        let again = parse_synthesis(
            "```json\n{\"goals\": [{\"goal\": \"check x\"}, \"check y\"]}\n```",
            1,
            false,
        );
        let Synthesis::Again(goals) = again else {
            panic!("{again:?}")
        };
        assert_eq!(goals.len(), 1, "bounded by max_subagents");
        for answer in [
            "Alpha is 1.",
            "The data was {\"goals\": [\"x\"]} in the log.",
            "{\"goals\": []}",
            "{\"answer\": 1}",
        ] {
            assert_eq!(
                parse_synthesis(answer, 3, false),
                Synthesis::Answer(answer.to_owned())
            );
        }
    }

    #[test]
    fn rounds_are_described_oldest_first() {
        let round = |g: &str, r: &str| AgentStep {
            step_type: "synthesise".into(),
            subagent_results: Some([(g.to_owned(), r.to_owned())].into()),
            ..AgentStep::default()
        };
        assert_eq!(describe_rounds(&[round("a", "1")]), "- a: 1");
        assert_eq!(
            describe_rounds(&[round("a", "1"), AgentStep::default(), round("b", "2")]),
            "Round 1:\n- a: 1\n\nRound 2:\n- b: 2"
        );
    }

    #[test]
    fn fan_out_depth_follows_the_session_ids() {
        let root = AgentRequest {
            session_id: "abc-f1-s0".into(),
            ..AgentRequest::default()
        };
        assert_eq!(fanout_depth(&root), 0, "a client's request is a root");
        let goal = Goal::independent("g", Pattern::Supervisor);
        let child = subagent_request(
            &root,
            "abc-f1-s0",
            &correlation_id("abc-f1-s0", 1),
            0,
            &goal,
            1,
        );
        // The client's own id looked like a subagent's: it counts once more, never less.
        assert_eq!(fanout_depth(&child), 2);
        let plain = AgentRequest {
            session_id: "u".into(),
            ..AgentRequest::default()
        };
        let child = subagent_request(&plain, "u", &correlation_id("u", 1), 3, &goal, 4);
        let grandchild = subagent_request(
            &child,
            &child.session_id,
            &correlation_id(&child.session_id, 3),
            0,
            &goal,
            1,
        );
        assert_eq!((fanout_depth(&child), fanout_depth(&grandchild)), (1, 2));
        assert_eq!(subagent_path(&grandchild.session_id), [3, 0]);
        assert!(subagent_path("plain-s1").is_empty() && subagent_path("-f1-s2").is_empty());
        assert!(may_fan_out(&plain, 1) && !may_nest(&plain, 1));
        assert!(may_nest(&plain, 2) && may_fan_out(&child, 2) && !may_nest(&child, 2));
        assert!(!may_fan_out(&grandchild, 2));
    }

    #[test]
    fn goals_name_what_they_need_and_cycles_are_broken() {
        let goals = parse_goals(
            r#"[{"id": "a", "goal": "find A"},
                {"id": "b", "goal": "use A for B", "needs": ["a"]},
                {"id": "c", "goal": "use A for C", "needs": ["a", "nowhere", "c"]},
                {"id": "d", "goal": "join B and C", "needs": ["b", "c", "b"]}]"#,
            5,
            false,
        )
        .unwrap();
        let needs: Vec<&[usize]> = goals.iter().map(|g| g.needs.as_slice()).collect();
        assert_eq!(needs, [&[][..], &[0], &[0], &[1, 2]]);
        assert!(has_dependencies(&goals));
        // By position too; a cycle loses the needs that close it, so every goal can start.
        let cycle = parse_goals(
            r#"[{"goal": "x", "needs": [1]}, {"goal": "y", "needs": [0]}, {"goal": "z", "needs": [0, 1]}]"#,
            5,
            false,
        )
        .unwrap();
        let needs: Vec<&[usize]> = cycle.iter().map(|g| g.needs.as_slice()).collect();
        assert_eq!(needs, [&[][..], &[0], &[0, 1]]);
        // A need on a goal cut by the limit is dropped.
        let cut = parse_goals(r#"[{"goal": "x", "needs": [2]}, "y", "z"]"#, 2, false).unwrap();
        assert!(!has_dependencies(&cut));
    }

    #[test]
    fn a_waiting_subagent_starts_from_the_kept_goals_with_what_it_needs() {
        let goals = parse_goals(
            r#"[{"id": "a", "goal": "find A", "pattern": "plan-then-execute"},
                {"id": "b", "goal": "use A", "needs": ["a"], "group": ["web"]}]"#,
            5,
            false,
        )
        .unwrap();
        let decompose = AgentStep {
            arguments: [(SUBAGENTS_KEY.to_owned(), goals_json(&goals))].into(),
            ..AgentStep::default()
        };
        assert_eq!(kept_goals(&decompose), goals);
        assert!(kept_goals(&AgentStep::default()).is_empty());
        let supervisor = AgentRequest {
            question: "Q".into(),
            session_id: "s".into(),
            framing: "Be brief.".into(),
            group: Some(vec!["web".into()]),
            ..AgentRequest::default()
        };
        let long = "x".repeat(PREREQUISITE_RESULT_CHARS + 10);
        let request = dependent_request(
            &supervisor,
            "s-f1",
            1,
            &goals[1],
            2,
            &[("find A".into(), "A is 42".into()), ("other".into(), long)],
        );
        assert_eq!(request.session_id, "s-f1-s1");
        assert_eq!(request.question, "use A");
        assert_eq!(request.parent_session_id, "s");
        assert!(request
            .framing
            .starts_with("Be brief.\n\nYour goal builds on"));
        assert!(request.framing.contains("- find A: A is 42"));
        assert!(request.framing.contains(&format!(
            "[cut: {PREREQUISITE_RESULT_CHARS} of {} characters]",
            PREREQUISITE_RESULT_CHARS + 10
        )));
    }

    #[test]
    fn a_critic_s_verdicts_become_a_recovery_round() {
        use crate::critic::{Evaluation, Status};
        let verdict = |status: Status| Evaluation {
            status,
            evaluation: "wrong".into(),
            lesson: "check units".into(),
            culprits: Vec::new(),
            sub_steps: Vec::new(),
            unreadable: None,
        };
        let round: Vec<Goal> = ["a", "b", "c", "d"]
            .iter()
            .map(|g| Goal::independent(*g, Pattern::React))
            .collect();
        let verdicts = vec![
            (0, verdict(Status::Success)),
            (
                1,
                Evaluation {
                    culprits: vec![0, 1, 9],
                    ..verdict(Status::InputDataError)
                },
            ),
            (2, verdict(Status::ExecutionError)),
            (3, verdict(Status::JobTooComplicated)),
        ];
        let goals = recovery_goals(&round, &verdicts, |_| 0, 3, true, 5);
        let shape: Vec<(&str, &[usize], Pattern)> = goals
            .iter()
            .map(|g| (g.goal.as_str(), g.needs.as_slice(), g.pattern))
            .collect();
        assert_eq!(
            shape,
            [
                ("a", &[][..], Pattern::React),
                ("b", &[0][..], Pattern::React),
                ("c", &[][..], Pattern::React),
                ("d", &[][..], Pattern::Supervisor),
            ]
        );
        assert_eq!(
            goals[2].perspective.as_deref(),
            Some("An earlier attempt at this goal was judged EXECUTION_ERROR: wrong Lesson: check units")
        );
        // Sub-goals given split it; past its life cycle a split is not made again.
        let split = Evaluation {
            sub_steps: vec![("d1".into(), String::new()), ("d2".into(), String::new())],
            ..verdict(Status::JobTooComplicated)
        };
        let goals = recovery_goals(&round, &[(3, split.clone())], |_| 0, 3, false, 5);
        let names: Vec<&str> = goals.iter().map(|g| g.goal.as_str()).collect();
        assert_eq!(names, ["d1", "d2"]);
        assert!(recovery_goals(&round, &[(3, split)], |_| 3, 3, false, 5).is_empty());
        assert_eq!(index_of_key("03. goal"), Some(3));
        assert_eq!(index_of_key("goal"), None);
    }

    #[test]
    fn a_recovery_round_is_held_to_the_width_and_never_waits_in_a_circle() {
        use crate::critic::{Evaluation, Status};
        let round: Vec<Goal> = ["a", "b"]
            .iter()
            .map(|g| Goal::independent(*g, Pattern::React))
            .collect();
        let blames = |culprit: usize| Evaluation {
            status: Status::InputDataError,
            evaluation: String::new(),
            lesson: String::new(),
            culprits: vec![culprit],
            sub_steps: Vec::new(),
            unreadable: None,
        };
        // Each blames the other: without cycle breaking each would wait for the other for ever.
        let goals = recovery_goals(
            &round,
            &[(0, blames(1)), (1, blames(0))],
            |_| 0,
            3,
            false,
            5,
        );
        assert_eq!(goals.len(), 2);
        assert!(
            goals.iter().any(|g| g.needs.is_empty()),
            "{:?}",
            goals.iter().map(|g| &g.needs).collect::<Vec<_>>()
        );
        // Twelve sub-steps for each of two goals: held to the width.
        let split = Evaluation {
            status: Status::JobTooComplicated,
            sub_steps: (0..12)
                .map(|i| (format!("part {i}"), String::new()))
                .collect(),
            ..blames(0)
        };
        let goals = recovery_goals(
            &round,
            &[(0, split.clone()), (1, split)],
            |_| 0,
            3,
            false,
            5,
        );
        assert_eq!(goals.len(), 5);
    }

    #[test]
    fn numbered_needs_name_the_goals_numbered_so() {
        let goals = parse_goals(
            r#"[{"id": 1, "goal": "A"}, {"id": 2, "goal": "B", "needs": [1]}, {"id": 3, "goal": "C", "needs": [1, 2]}]"#,
            5,
            false,
        )
        .unwrap();
        let needs: Vec<&[usize]> = goals.iter().map(|g| g.needs.as_slice()).collect();
        assert_eq!(needs, [&[][..], &[0][..], &[0, 1][..]]);
        // Without ids, a number is a position.
        let goals =
            parse_goals(r#"[{"goal": "A"}, {"goal": "B", "needs": [0]}]"#, 5, false).unwrap();
        assert_eq!(goals[1].needs, [0]);
    }

    #[test]
    fn a_synthesis_request_of_long_results_is_cut_to_the_message_limit() {
        let continuation = AgentRequest {
            question: "Q".into(),
            session_id: "sup".into(),
            pattern: "supervisor".into(),
            ..AgentRequest::default()
        };
        let results: BTreeMap<String, String> = [
            ("00. a".to_owned(), "alpha \"quoted\" ".repeat(2_000)),
            ("01. b".to_owned(), "beta".to_owned()),
        ]
        .into();
        // Within the limit: whole.
        let (whole, fit) = synthesis_request_within(&continuation, results.clone(), &[], 1 << 20);
        assert_eq!(fit, Fit::Whole);
        assert_eq!(
            whole,
            synthesis_request(&continuation, results.clone(), &[])
        );
        // Over it: the long one cut, its start kept and the cut said; the short one whole.
        let (cut, fit) = synthesis_request_within(&continuation, results.clone(), &[], 8_000);
        assert_eq!(fit, Fit::Cut);
        assert!(agent_schema::encode(&cut).len() <= 8_000);
        let carried = cut.history[0].subagent_results.clone().unwrap_or_default();
        assert_eq!(carried["01. b"], "beta");
        assert!(carried["00. a"].starts_with("alpha \"quoted\" alpha"));
        assert!(
            carried["00. a"].ends_with(" of 30000 bytes]"),
            "{}",
            carried["00. a"]
        );
        // No room even for the continuation: the smallest request, each result only its note.
        let (over, fit) = synthesis_request_within(&continuation, results, &[], 100);
        assert_eq!(fit, Fit::Over);
        let carried = over.history[0].subagent_results.clone().unwrap_or_default();
        assert_eq!(carried["01. b"], "beta");
        assert_eq!(
            carried["00. a"],
            " [cut to fit the broker's message limit: 0 of 30000 bytes]"
        );
    }

    #[test]
    fn notes_that_fit_where_no_share_of_64_bytes_did_are_cut_not_over() {
        let continuation = AgentRequest {
            question: "Q".into(),
            session_id: "sup".into(),
            pattern: "supervisor".into(),
            ..AgentRequest::default()
        };
        // Short keys and results a little longer than their notes: each note takes under 64
        // bytes encoded, so the notes-only request fits a limit whose first share is under 64.
        let results: BTreeMap<String, String> =
            (0..10).map(|i| (i.to_string(), "x".repeat(70))).collect();
        let notes = synthesis_request(&continuation, cut_to(&results, 0), &[]);
        let limit = agent_schema::encode(&notes).len();
        let base =
            agent_schema::encode(&synthesis_request(&continuation, BTreeMap::new(), &[])).len();
        assert!((limit - base) / results.len() < 64, "{limit} {base}");
        let (request, fit) = synthesis_request_within(&continuation, results, &[], limit);
        assert_eq!(fit, Fit::Cut);
        assert_eq!(request, notes);
    }
}
