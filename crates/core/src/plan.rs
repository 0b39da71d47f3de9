//! Plans: reading one from the LLM, checking that it is a DAG, picking the next step whose
//! dependencies are done, and merging a revision into what was already done (what the pattern does
//! next is `plan_then_execute`). The plan lives in the history (`plan` and `execute` steps),
//! so every function here is a pure function of the request.

use std::collections::BTreeMap;

use agent_schema::{AgentStep, PlanStep, StepType};

pub const PENDING: &str = "pending";
pub const COMPLETED: &str = "completed";
pub const FAILED: &str = "failed";

/// Present on a critic's verdict that split a step: the sub-steps' goals as a JSON list. Such a
/// verdict reshapes the plan (see [`defines_structure`]).
pub const SUB_GOALS_KEY: &str = "sub_goals";

/// The most steps a plan may have, whatever `max_iterations` allows.
pub const MAX_PLAN_STEPS: usize = 20;

/// A step still to do: anything neither completed nor failed (`pending`, `running`, or a status
/// this service does not know) waits to run.
pub fn is_open(step: &PlanStep) -> bool {
    step.status != COMPLETED && step.status != FAILED
}

/// Whether this history step fixed the plan's shape, so its iteration names the step nodes: a plan
/// or revision, or a verdict that split a step.
pub fn defines_structure(step: &AgentStep) -> bool {
    match StepType::parse(&step.step_type) {
        Some(StepType::Plan) => true,
        Some(StepType::Evaluate) => step.arguments.contains_key(SUB_GOALS_KEY),
        _ => false,
    }
}

/// The plan in force and the iteration whose step nodes describe it, or `None` when the history
/// holds no plan or names its steps inconsistently.
pub fn plan_in_force(history: &[AgentStep]) -> Option<(usize, Vec<PlanStep>)> {
    let carrying = history.iter().rposition(|s| s.plan.is_some())?;
    let defining = history[..=carrying]
        .iter()
        .rposition(|s| defines_structure(s) && s.plan.is_some())?;
    let plan = history[carrying].plan.clone()?;
    let defined = history[defining].plan.as_ref()?;
    (defined.len() == plan.len()).then_some((defining + 1, plan))
}

/// The plan in force: the one on the latest history step that carries a plan.
pub fn current_plan(history: &[AgentStep]) -> Option<&[PlanStep]> {
    history.iter().rev().find_map(|s| s.plan.as_deref())
}

/// The first pending step whose dependencies are all completed.
pub fn ready_step(plan: &[PlanStep]) -> Option<usize> {
    plan.iter().position(|s| {
        is_open(s)
            && s.depends_on.iter().all(|d| {
                usize::try_from(*d)
                    .ok()
                    .and_then(|d| plan.get(d))
                    .is_some_and(|dep| dep.status == COMPLETED)
            })
    })
}

/// Checks that `plan` is a usable DAG: not empty, at most `max_steps` long, goals present, every dependency an
/// earlier-or-later existing step other than itself, and no cycle.
pub fn validate(plan: &[PlanStep], max_steps: usize) -> Result<(), String> {
    if plan.is_empty() {
        return Err("the plan has no steps".to_owned());
    }
    let max_steps = max_steps.min(MAX_PLAN_STEPS);
    if plan.len() > max_steps {
        return Err(format!(
            "the plan has {} steps; the iterations left allow at most {max_steps}",
            plan.len()
        ));
    }
    for (i, step) in plan.iter().enumerate() {
        if step.goal.trim().is_empty() {
            return Err(format!("step {i} has no goal"));
        }
        for d in &step.depends_on {
            match usize::try_from(*d) {
                Ok(d) if d == i => {
                    return Err(format!(
                        "step {i} ('{}') lists itself in depends_on {:?}; a step cannot need its own result",
                        step.goal, step.depends_on
                    ))
                }
                Ok(d) if d < plan.len() => {}
                _ => {
                    return Err(format!(
                        "step {i} depends on step {d}, which does not exist (steps are numbered 0 to {})",
                        plan.len() - 1
                    ))
                }
            }
        }
    }
    if let Some(cycle) = find_cycle(plan) {
        let path: Vec<String> = cycle.iter().map(usize::to_string).collect();
        return Err(format!(
            "the steps depend on each other in a cycle: {}",
            path.join(" -> ")
        ));
    }
    Ok(())
}

/// Repairs the unambiguous mistakes models make in `depends_on`, from step `first` on (the steps
/// before it are kept steps of a revision), and says what was changed, one sentence per repair, so
/// provenance can record it. Nothing else is guessed; what is left is for [`validate`] to refuse.
///
/// - A step that names itself: that entry is removed.
/// - A step that names a step that does not exist (negative, or past the last): that entry is removed.
/// - A step that names one step more than once: it names it once.
///
/// ```
/// use agent_core::plan::{repair, validate};
/// use agent_schema::PlanStep;
/// let step = |deps: Vec<i64>| PlanStep { goal: "g".into(), depends_on: deps, ..PlanStep::default() };
/// // The last step of a real model's plan listed itself.
/// let mut plan = vec![step(vec![]), step(vec![]), step(vec![]), step(vec![]), step(vec![0, 1, 2, 3, 4])];
/// let repairs = repair(&mut plan, 0);
/// assert_eq!(plan[4].depends_on, vec![0, 1, 2, 3]);
/// assert_eq!(repairs.len(), 1);
/// assert!(validate(&plan, 8).is_ok());
/// // One that lists a dependency twice lists it once.
/// let mut plan = vec![step(vec![]), step(vec![0, 0])];
/// assert_eq!(repair(&mut plan, 0).len(), 1);
/// assert_eq!(plan[1].depends_on, vec![0]);
/// ```
pub fn repair(plan: &mut [PlanStep], first: usize) -> Vec<String> {
    let mut repairs = Vec::new();
    let len = plan.len() as i64;
    for (i, step) in plan.iter_mut().enumerate().skip(first) {
        let before = step.depends_on.clone();
        step.depends_on.retain(|d| *d != i as i64);
        if step.depends_on.len() != before.len() {
            repairs.push(format!(
                "step {i} ('{}') listed itself among its dependencies {before:?}; that entry was removed",
                step.goal
            ));
        }
        let before = step.depends_on.clone();
        step.depends_on.retain(|d| (0..len).contains(d));
        if step.depends_on.len() != before.len() {
            let missing: Vec<i64> = before
                .iter()
                .filter(|d| !(0..len).contains(*d))
                .copied()
                .collect();
            repairs.push(format!(
                "step {i} ('{}') depended on {missing:?}, which do not exist (steps are numbered 0 to {}); those entries were removed",
                step.goal,
                len - 1
            ));
        }
        let before = step.depends_on.len();
        let mut seen = std::collections::BTreeSet::new();
        step.depends_on.retain(|d| seen.insert(*d));
        if step.depends_on.len() != before {
            repairs.push(format!(
                "step {i} ('{}') listed a dependency more than once; each is listed once now",
                step.goal
            ));
        }
    }
    repairs
}

/// A dependency cycle, as the step indices around it, if there is one.
fn find_cycle(plan: &[PlanStep]) -> Option<Vec<usize>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        New,
        Open,
        Done,
    }
    let deps = |i: usize| -> Vec<usize> {
        plan.get(i)
            .map(|s| {
                s.depends_on
                    .iter()
                    .filter_map(|d| usize::try_from(*d).ok())
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut marks = vec![Mark::New; plan.len()];
    for start in 0..plan.len() {
        if marks[start] != Mark::New {
            continue;
        }
        // Iterative depth-first search; `path` holds the open steps.
        let mut path: Vec<(usize, Vec<usize>)> = vec![(start, deps(start))];
        marks[start] = Mark::Open;
        while let Some((node, pending)) = path.last_mut() {
            let node = *node;
            match pending.pop() {
                Some(d) => match marks.get(d).copied() {
                    Some(Mark::Open) => {
                        let from = path.iter().position(|(n, _)| *n == d).unwrap_or(0);
                        let mut cycle: Vec<usize> = path[from..].iter().map(|(n, _)| *n).collect();
                        cycle.push(d);
                        return Some(cycle);
                    }
                    Some(Mark::New) => {
                        marks[d] = Mark::Open;
                        path.push((d, deps(d)));
                    }
                    _ => {}
                },
                None => {
                    marks[node] = Mark::Done;
                    path.pop();
                }
            }
        }
    }
    None
}

/// Reads a plan from the LLM: a JSON array of steps, or an object with a `steps` array (and
/// perhaps a `rationale`), possibly in a code fence or with prose around it. Statuses and results
/// are reset: a new plan starts pending. Read as small models write plans: a step may be just its
/// goal (a string), `null` for a field it leaves out, a dependency as a number in a string; and
/// the plan is the first JSON value in the answer that reads as one, so a bracket in the prose
/// or a `<think>` block before it (`steps [0] and [1]`) does not stand for it.
pub fn parse(text: &str) -> Result<(Vec<PlanStep>, String), String> {
    // A plan drafted in a reasoning model's `<think>` block is not the plan.
    let text = crate::react::without_think(text);
    let mut problem: Option<String> = None;
    let mut empty = None;
    for (tried, (start, _)) in text
        .match_indices(['[', '{'])
        .take(PLAN_OPENINGS_TRIED)
        .enumerate()
    {
        let value = match crate::react::first_json_value(&text[start..]) {
            // Past the first bracket, only steps written as objects count: a list of strings
            // there is more often code or prose than a plan.
            Some(Ok(value))
                if tried > 0 && !crate::react::lists_objects_with(&value, "steps", "goal") =>
            {
                continue
            }
            Some(Ok(value)) => value,
            Some(Err(e)) => {
                problem.get_or_insert(format!("the plan is not valid JSON: {e}"));
                continue;
            }
            None => continue,
        };
        match plan_of(value) {
            // An empty list in the prose may come before the plan.
            Ok((plan, rationale)) if plan.is_empty() => {
                empty.get_or_insert((plan, rationale));
            }
            Ok(plan) => return Ok(plan),
            Err(why) => {
                problem.get_or_insert(why);
            }
        }
    }
    match (empty, problem) {
        (Some(empty), _) => Ok(empty),
        (None, Some(problem)) => Err(problem),
        (None, None) => Err("the answer holds no JSON plan".to_owned()),
    }
}

/// How many openings of a JSON value [`parse`] tries, each read as far as its value goes.
const PLAN_OPENINGS_TRIED: usize = 32;

/// A plan from a JSON value: a list of steps, or an object with `steps` and a `rationale`.
fn plan_of(value: serde_json::Value) -> Result<(Vec<PlanStep>, String), String> {
    let (steps, rationale) = match value {
        serde_json::Value::Array(steps) => (steps, String::new()),
        serde_json::Value::Object(mut o) => {
            let rationale = o
                .get("rationale")
                .and_then(|r| r.as_str())
                .unwrap_or_default()
                .to_owned();
            match o.remove("steps") {
                Some(serde_json::Value::Array(steps)) => (steps, rationale),
                Some(_) => return Err("the plan's 'steps' is not a list".into()),
                None => return Err("the plan object has no 'steps'".into()),
            }
        }
        _ => return Err("the plan is neither a list of steps nor an object with 'steps'".into()),
    };
    let plan = steps
        .into_iter()
        .map(step_of)
        .collect::<Result<Vec<_>, _>>()?;
    Ok((plan, rationale))
}

/// One step of a plan as the LLM wrote it: `{goal, tool_hint, depends_on}` or only its goal.
fn step_of(value: serde_json::Value) -> Result<PlanStep, String> {
    use serde_json::Value;
    let pending = |goal: String, tool_hint: String, depends_on: Vec<i64>| PlanStep {
        goal,
        tool_hint,
        depends_on,
        status: PENDING.to_owned(),
        result: String::new(),
    };
    let o = match value {
        Value::String(goal) => return Ok(pending(goal, String::new(), Vec::new())),
        Value::Object(o) => o,
        other => {
            return Err(format!(
                "a step is not {{goal, tool_hint, depends_on}}: {other}"
            ))
        }
    };
    let text = |key: &str| match o.get(key) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(format!("a step's {key} is not text: {other}")),
    };
    let number = |v: &Value| {
        match v {
            Value::Number(n) => n.as_i64(),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
        .ok_or_else(|| format!("a step's depends_on holds {v}, not a step number"))
    };
    let depends_on = match o.get("depends_on") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => list.iter().map(number).collect::<Result<_, _>>()?,
        Some(one) => vec![number(one)?],
    };
    Ok(pending(text("goal")?, text("tool_hint")?, depends_on))
}

/// The plan after a revision: the completed steps, renumbered from 0 in their order, then the new
/// steps, whose `depends_on` already refer to that numbering. Returns the merged plan and the old
/// indices of the steps that were dropped.
pub fn merge_revision(old: &[PlanStep], new_steps: Vec<PlanStep>) -> (Vec<PlanStep>, Vec<usize>) {
    let renumber: BTreeMap<usize, i64> = old
        .iter()
        .enumerate()
        .filter(|(_, s)| s.status == COMPLETED)
        .enumerate()
        .map(|(new, (old, _))| (old, new as i64))
        .collect();
    let mut merged: Vec<PlanStep> = old
        .iter()
        .enumerate()
        .filter(|(_, s)| s.status == COMPLETED)
        .map(|(_, s)| PlanStep {
            depends_on: s
                .depends_on
                .iter()
                .filter_map(|d| {
                    usize::try_from(*d)
                        .ok()
                        .and_then(|d| renumber.get(&d))
                        .copied()
                })
                .collect(),
            ..s.clone()
        })
        .collect();
    let dropped = (0..old.len())
        .filter(|i| !renumber.contains_key(i))
        .collect();
    merged.extend(new_steps);
    (merged, dropped)
}

/// The completed steps of a plan as the LLM sees them: number, goal and result.
pub fn describe_completed(plan: &[PlanStep]) -> String {
    let done: Vec<String> = plan
        .iter()
        .enumerate()
        .filter(|(_, s)| s.status == COMPLETED)
        .map(|(i, s)| format!("{i}. {}\n   result: {}", s.goal, s.result))
        .collect();
    if done.is_empty() {
        "(none)".to_owned()
    } else {
        done.join("\n")
    }
}

/// What the plan found, for the answer: completed steps, and steps sent back by the critic whose
/// last result was not accepted (pending with a result: see `critic::send_back`), marked as such.
pub fn describe_results(plan: &[PlanStep]) -> String {
    let lines: Vec<String> = plan
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            if s.status == COMPLETED {
                Some(format!("{i}. {}\n   result: {}", s.goal, s.result))
            } else if s.status == PENDING && !s.result.is_empty() {
                Some(format!(
                    "{i}. {}\n   result (not accepted by the evaluator): {}",
                    s.goal, s.result
                ))
            } else {
                None
            }
        })
        .collect();
    if lines.is_empty() {
        "(none)".to_owned()
    } else {
        lines.join("\n")
    }
}

/// The whole plan with statuses, for prompts and the client.
pub fn describe(plan: &[PlanStep]) -> String {
    plan.iter()
        .enumerate()
        .map(|(i, s)| {
            let deps: Vec<String> = s.depends_on.iter().map(i64::to_string).collect();
            let mut line = format!("{i}. [{}] {}", s.status, s.goal);
            if !s.tool_hint.is_empty() {
                line.push_str(&format!(" (tool: {})", s.tool_hint));
            }
            if !deps.is_empty() {
                line.push_str(&format!(" after {}", deps.join(", ")));
            }
            if !s.result.is_empty() {
                line.push_str(&format!("\n   result: {}", s.result));
            }
            line
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The results of step `index`'s dependencies, for its prompt.
pub fn dependency_results(plan: &[PlanStep], index: usize) -> String {
    let Some(step) = plan.get(index) else {
        return String::new();
    };
    // Each once, however often it is listed: a plan from a message's history is not the LLM's
    // checked one, and a result repeated for each listing could make a prompt of any size.
    let needed: std::collections::BTreeSet<usize> = step
        .depends_on
        .iter()
        .filter_map(|d| usize::try_from(*d).ok())
        .collect();
    let lines: Vec<String> = needed
        .into_iter()
        .filter_map(|d| {
            plan.get(d)
                .map(|s| format!("- step {d} ({}): {}", s.goal, s.result))
        })
        .collect();
    if lines.is_empty() {
        "(this step depends on no other step)".to_owned()
    } else {
        lines.join("\n")
    }
}

/// The one-step plan used when the LLM cannot produce a valid one: do the whole request, on the
/// results of the first `kept` steps (those a revision keeps).
pub fn single_step(question: &str, kept: usize) -> Vec<PlanStep> {
    vec![PlanStep {
        goal: question.to_owned(),
        tool_hint: String::new(),
        depends_on: (0..kept as i64).collect(),
        status: PENDING.to_owned(),
        result: String::new(),
    }]
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Plans as small models write them: a step as its goal alone, `null` for a field left out,
    /// a dependency in a string, brackets in the prose (or a `<think>` block) before the plan.
    /// Each was refused before, which cost a re-ask and could end in the one-step fallback.
    #[test]
    fn a_plan_is_read_as_small_models_write_it() {
        let (plan, _) = parse(
            r#"{"steps": [{"goal": "a", "tool_hint": null, "depends_on": null}, "b", {"goal": "c", "depends_on": ["1", 0]}]}"#,
        )
        .unwrap();
        let read: Vec<(&str, &str, &[i64])> = plan
            .iter()
            .map(|s| {
                (
                    s.goal.as_str(),
                    s.tool_hint.as_str(),
                    s.depends_on.as_slice(),
                )
            })
            .collect();
        assert_eq!(
            read,
            [
                ("a", "", &[][..]),
                ("b", "", &[][..]),
                ("c", "", &[1, 0][..])
            ]
        );
        let (plan, rationale) = parse(
            "<think>steps [0] and [1], or {none}</think>\n{\"rationale\": \"r\", \"steps\": [{\"goal\": \"a\"}]}",
        )
        .unwrap();
        assert_eq!((plan.len(), rationale.as_str()), (1, "r"));
        // A plan drafted while thinking is not the plan (before, it was read first).
        let (plan, _) = parse(
            "<think>\nMaybe {\"steps\": [{\"goal\": \"guess\"}]}\n</think>\n{\"steps\": [{\"goal\": \"real\"}]}",
        )
        .unwrap();
        assert_eq!(plan[0].goal, "real");
        assert!(parse("no plan at all").is_err());
        assert!(parse(r#"{"steps": [{"goal": 3}]}"#).is_err());
        assert!(parse("[]").unwrap().0.is_empty());
        // Code with a list of strings in it is no plan.
        assert!(parse("body = {\"h\": {\"x\",},}\nbody[\"response_type\"] = 1").is_err());
    }

    pub(crate) fn step(goal: &str, deps: &[i64], status: &str) -> PlanStep {
        PlanStep {
            goal: goal.into(),
            tool_hint: String::new(),
            depends_on: deps.to_vec(),
            status: status.into(),
            result: if status == COMPLETED {
                format!("{goal}-result")
            } else {
                String::new()
            },
        }
    }

    pub(crate) fn with_plan(kind: StepType, plan: Vec<PlanStep>) -> AgentStep {
        AgentStep {
            step_type: kind.as_str().into(),
            plan: Some(plan),
            ..AgentStep::default()
        }
    }

    #[test]
    fn a_diamond_runs_in_dependency_order() {
        let mut plan = vec![
            step("a", &[], PENDING),
            step("b", &[0], PENDING),
            step("c", &[0], PENDING),
            step("d", &[1, 2], PENDING),
        ];
        assert!(validate(&plan, MAX_PLAN_STEPS).is_ok());
        let mut order = Vec::new();
        while let Some(i) = ready_step(&plan) {
            order.push(i);
            plan[i].status = COMPLETED.into();
        }
        assert_eq!(order, [0, 1, 2, 3]);
    }

    #[test]
    fn cycles_self_and_dangling_dependencies_are_rejected() {
        let cycle = [
            step("a", &[2], PENDING),
            step("b", &[0], PENDING),
            step("c", &[1], PENDING),
        ];
        let why = validate(&cycle, MAX_PLAN_STEPS).unwrap_err();
        assert!(why.contains("cycle"), "{why}");
        assert!(validate(&[step("a", &[0], PENDING)], 5)
            .unwrap_err()
            .contains("itself"));
        assert!(validate(&[step("a", &[3], PENDING)], 5)
            .unwrap_err()
            .contains("does not exist"));
        assert!(validate(&[step("a", &[-1], PENDING)], 5)
            .unwrap_err()
            .contains("does not exist"));
        assert!(validate(&[], 5).is_err());
        let two = [step("a", &[], PENDING), step("b", &[], PENDING)];
        assert!(validate(&two, 1).unwrap_err().contains("at most 1"));
        assert!(validate(&[step(" ", &[], PENDING)], 5).is_err());
    }

    #[test]
    fn plans_are_read_from_arrays_objects_and_fences() {
        let (plan, _) = parse(
            "Here:\n```json\n[{\"goal\": \"a\"}, {\"goal\": \"b\", \"depends_on\": [0]}]\n```",
        )
        .unwrap();
        assert_eq!(plan.len(), 2);
        assert_eq!(plan[1].depends_on, [0]);
        assert!(plan.iter().all(|s| s.status == PENDING));
        let (plan, why) =
            parse("{\"rationale\": \"two parts\", \"steps\": [{\"goal\": \"x\", \"tool_hint\": \"llm\"}]}").unwrap();
        assert_eq!(
            (plan[0].tool_hint.as_str(), why.as_str()),
            ("llm", "two parts")
        );
        assert!(parse("no plan here").is_err());
        assert!(parse("[{\"goal\": 3}]").is_err());
    }

    #[test]
    fn prose_after_the_plan_does_not_spoil_it() {
        let (plan, _) = parse("[{\"goal\": \"a\"}] as in [1].").unwrap();
        assert_eq!(plan.len(), 1);
    }

    #[test]
    fn a_revision_keeps_completed_steps_renumbered() {
        let old = vec![
            step("a", &[], COMPLETED),
            step("b", &[0], FAILED),
            step("c", &[0], COMPLETED),
            step("d", &[1, 2], PENDING),
        ];
        let (merged, dropped) = merge_revision(&old, vec![step("e", &[0, 1], PENDING)]);
        let goals: Vec<&str> = merged.iter().map(|s| s.goal.as_str()).collect();
        assert_eq!(goals, ["a", "c", "e"]);
        assert_eq!(merged[1].depends_on, [0]);
        assert_eq!(merged[1].result, "c-result");
        assert_eq!(dropped, [1, 3]);
        assert!(validate(&merged, MAX_PLAN_STEPS).is_ok());
    }
}
