//! The critic (evaluator) of plan steps: reading its verdict, and applying it to the plan. A
//! verdict is `SUCCESS`, `EXECUTION_ERROR` (run the step again with the lesson),
//! `INPUT_DATA_ERROR` (run the step that produced its input again with the lesson, then what
//! depends on it) or `JOB_TOO_COMPLICATED_ERROR` (split the step into sub-steps, within its life
//! cycle). Verdicts travel in the history as `evaluate` steps, so the retry count, the lessons and
//! how often a step was split are all read back from the request.

use std::collections::BTreeSet;

use agent_schema::{AgentStep, PlanStep, StepType};

use crate::pattern::Stage;
use crate::plan::{COMPLETED, FAILED, PENDING, SUB_GOALS_KEY};

/// `arguments` key naming the stage a verdict is about.
const STAGE_KEY: &str = "stage";

/// The stage a recorded verdict is about.
fn stage_of(step: &AgentStep) -> Option<Stage> {
    step.arguments
        .get(STAGE_KEY)
        .and_then(|name| Stage::from_name(name))
}

/// `arguments` keys of an `evaluate` history step.
const STEP_KEY: &str = "step";
const GOAL_KEY: &str = "goal";
const LESSON_KEY: &str = "lesson";
const CULPRITS_KEY: &str = "culprits";
const UNREADABLE_KEY: &str = "unreadable";
const DEPTH_KEY: &str = "depth";

/// A verdict, in order of priority: when an evaluator gives several, the first in this order counts
/// (the seed evaluator's rule: a failure named anywhere outweighs a success, and of the failures the
/// one that a re-run fixes most cheaply is tried first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    ExecutionError,
    InputDataError,
    JobTooComplicated,
    Success,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Success => "SUCCESS",
            Status::ExecutionError => "EXECUTION_ERROR",
            Status::InputDataError => "INPUT_DATA_ERROR",
            Status::JobTooComplicated => "JOB_TOO_COMPLICATED_ERROR",
        }
    }

    /// A status as evaluators write it: in any case, with spaces or hyphens for underscores, and
    /// in the plain words models use instead of the names asked for ("failed", "rejected",
    /// "passed"). A verdict that cannot be read lets the step stand, so a failure written in
    /// other words must not read as nothing.
    fn parse(text: &str) -> Option<Status> {
        Status::parse_words(text).or_else(|| {
            // A status followed by why: `EXECUTION_ERROR: the sum is wrong`, `FAILED (wrong)`,
            // `REJECTED - no source`.
            let head = text.split([':', '(', ';', '\n', '—']).next()?;
            Status::parse_words(head).or_else(|| Status::parse_words(head.split(" - ").next()?))
        })
    }

    fn parse_words(text: &str) -> Option<Status> {
        let t: String = text
            .trim()
            .trim_matches(|c: char| !c.is_ascii_alphabetic())
            .chars()
            .map(|c| match c {
                ' ' | '-' => '_',
                c => c.to_ascii_uppercase(),
            })
            .collect();
        Some(match t.as_str() {
            "SUCCESS" | "SUCCEEDED" | "SUCCESSFUL" | "PASS" | "PASSED" | "OK" | "ACCEPTED"
            | "APPROVED" | "CORRECT" => Status::Success,
            "EXECUTION_ERROR" | "ERROR" | "FAIL" | "FAILED" | "FAILURE" | "REJECTED" | "REJECT"
            | "INCORRECT" | "WRONG" => Status::ExecutionError,
            "INPUT_DATA_ERROR" | "INPUT_ERROR" | "DATA_ERROR" => Status::InputDataError,
            "JOB_TOO_COMPLICATED_ERROR" | "JOB_TOO_COMPLICATED" | "TOO_COMPLICATED" => {
                Status::JobTooComplicated
            }
            _ => return None,
        })
    }
}

/// What the evaluator said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub status: Status,
    pub evaluation: String,
    pub lesson: String,
    /// For `INPUT_DATA_ERROR`: the steps whose results were bad, if the evaluator named them.
    pub culprits: Vec<usize>,
    /// For `JOB_TOO_COMPLICATED_ERROR`: the sub-steps' goals and tool hints.
    pub sub_steps: Vec<(String, String)>,
    /// Why the answer could not be read, when it could not (the step then stands).
    pub unreadable: Option<String>,
}

/// The statuses an evaluator's object names (`status` a string of them or a list).
fn statuses_of(o: &serde_json::Map<String, serde_json::Value>) -> Vec<Status> {
    match o.get("status") {
        Some(serde_json::Value::String(s)) => {
            s.split([',', '|']).filter_map(Status::parse).collect()
        }
        Some(serde_json::Value::Array(list)) => list
            .iter()
            .filter_map(|v| v.as_str().and_then(Status::parse))
            .collect(),
        _ => Vec::new(),
    }
}

/// Reads the evaluator's JSON (`status` a string or a list, `evaluation`, `lesson`, `culprits`,
/// `sub_steps`). An answer that cannot be read lets the step stand, and says so.
pub fn parse(text: &str) -> Evaluation {
    let unreadable = |why: &str| Evaluation {
        status: Status::Success,
        evaluation: String::new(),
        lesson: String::new(),
        culprits: Vec::new(),
        sub_steps: Vec::new(),
        unreadable: Some(why.to_owned()),
    };
    if !text.contains('{') {
        return unreadable("the evaluation holds no JSON object");
    }
    // The verdict is an object whose status reads as one, and of those the first that also
    // evaluates or teaches: a tool's result quoted before it (`{"status": "error"}`) is not it.
    // Keys in any case (`"Status"`, `"LESSON"`): models write them so, and a rejection whose
    // status could not be read let the step stand.
    let readable: Vec<serde_json::Map<String, serde_json::Value>> = crate::react::objects_in(text)
        .map(|o| {
            o.into_iter()
                .map(|(key, value)| (key.to_ascii_lowercase(), value))
                .collect()
        })
        .filter(|o| !statuses_of(o).is_empty())
        .collect();
    // Without one that evaluates, the last: a verdict follows what it quotes.
    let verdict = readable
        .iter()
        .position(|o| o.contains_key("evaluation") || o.contains_key("lesson"))
        .unwrap_or(readable.len().saturating_sub(1));
    let Some(o) = readable.into_iter().nth(verdict) else {
        return unreadable("the evaluation holds no JSON object with a known status");
    };
    let text_of = |k: &str| {
        o.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    let Some(status) = statuses_of(&o).into_iter().min() else {
        return unreadable("the evaluation names no known status");
    };
    let culprits = o
        .get("culprits")
        .or_else(|| o.get("culprit"))
        .map(|v| match v {
            serde_json::Value::Array(list) => {
                list.iter().filter_map(|x| x.as_u64()).collect::<Vec<_>>()
            }
            other => other.as_u64().into_iter().collect(),
        })
        .unwrap_or_default()
        .into_iter()
        .filter_map(|x| usize::try_from(x).ok())
        .collect();
    let sub_steps = o
        .get("sub_steps")
        .and_then(|v| v.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|s| {
                    let goal = s.get("goal").and_then(|g| g.as_str())?.trim().to_owned();
                    let hint = s
                        .get("tool_hint")
                        .and_then(|g| g.as_str())
                        .unwrap_or_default();
                    (!goal.is_empty()).then(|| (goal, hint.to_owned()))
                })
                .collect()
        })
        .unwrap_or_default();
    Evaluation {
        status,
        evaluation: text_of("evaluation"),
        lesson: text_of("lesson"),
        culprits,
        sub_steps,
        unreadable: None,
    }
}

fn evaluations(history: &[AgentStep]) -> impl Iterator<Item = &AgentStep> {
    history
        .iter()
        .filter(|s| StepType::parse(&s.step_type) == Some(StepType::Evaluate))
}

/// Verdicts other than `SUCCESS` so far: the request's retries.
pub fn retries_used(history: &[AgentStep]) -> usize {
    evaluations(history)
        .filter(|s| s.action != Status::Success.as_str())
        .count()
}

/// The lessons recorded on verdicts about the step with this goal, oldest first.
pub fn lessons_for(history: &[AgentStep], goal: &str) -> Vec<String> {
    evaluations(history)
        .filter(|s| s.arguments.get(GOAL_KEY).map(String::as_str) == Some(goal))
        // An `INPUT_DATA_ERROR` lesson is for the culprits, not the step that was judged.
        .filter(|s| !s.arguments.contains_key(CULPRITS_KEY))
        .filter_map(|s| s.arguments.get(LESSON_KEY))
        .filter(|l| !l.is_empty())
        .cloned()
        .collect()
}

/// How many splits lie behind the step with this goal: the depth it was created at plus the times
/// it was split itself.
pub fn splits_behind(history: &[AgentStep], goal: &str) -> usize {
    let created_at = evaluations(history)
        .filter(|s| {
            s.arguments
                .get(SUB_GOALS_KEY)
                .and_then(|g| serde_json::from_str::<Vec<String>>(g).ok())
                .is_some_and(|goals| goals.iter().any(|g| g == goal))
        })
        .filter_map(|s| {
            s.arguments
                .get(DEPTH_KEY)
                .and_then(|d| d.parse::<usize>().ok())
        })
        .max()
        .unwrap_or(0);
    let split_itself = evaluations(history)
        .filter(|s| {
            s.arguments.get(GOAL_KEY).map(String::as_str) == Some(goal)
                && s.arguments.contains_key(SUB_GOALS_KEY)
        })
        .count();
    created_at.saturating_add(split_itself)
}

/// The step the last history step executed and completed, when it waits for the critic.
pub fn awaiting_evaluation(history: &[AgentStep]) -> Option<usize> {
    let (last, before) = history.split_last()?;
    if StepType::parse(&last.step_type) != Some(StepType::Execute) {
        return None;
    }
    let now = last.plan.as_deref()?;
    let earlier = crate::plan::current_plan(before).unwrap_or_default();
    now.iter().enumerate().find_map(|(i, s)| {
        let changed = earlier
            .get(i)
            .is_none_or(|e| e.status != s.status || e.result != s.result);
        (changed && s.status == COMPLETED).then_some(i)
    })
}

/// What a verdict did to the plan, for the history, the client and the graph.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    pub plan: Vec<PlanStep>,
    /// One sentence on what happens next.
    pub effect: String,
    /// The history step that records the verdict.
    pub step: AgentStep,
    /// Steps sent back to run again (with the lesson).
    pub rerun: Vec<usize>,
    /// Goals of the sub-steps a split added.
    pub sub_goals: Vec<String>,
    /// The split was refused because the step's life cycle is used up.
    pub life_cycle_exhausted: bool,
}

/// Sends a step back to run again. It keeps its last result if it had one (should the dialog end
/// before the step runs again, the answer can still use it, marked as not accepted); a failed
/// step's result is an error, which no answer uses, so it is dropped: a pending step with a result
/// is then always one the evaluator did not accept.
fn send_back(step: &mut PlanStep) {
    if step.status == FAILED {
        step.result.clear();
    }
    step.status = PENDING.to_owned();
}

/// Applies `verdict` on step `index` of `plan`. `life_cycle` bounds how many splits may lie behind
/// one step.
pub fn apply(
    history: &[AgentStep],
    plan: &[PlanStep],
    index: usize,
    verdict: &Evaluation,
    life_cycle: usize,
) -> Applied {
    let mut plan = plan.to_vec();
    let goal = plan.get(index).map(|s| s.goal.clone()).unwrap_or_default();
    let mut arguments = std::collections::BTreeMap::new();
    arguments.insert(STAGE_KEY.to_owned(), Stage::Step.name().to_owned());
    arguments.insert(STEP_KEY.to_owned(), index.to_string());
    arguments.insert(GOAL_KEY.to_owned(), goal.clone());
    let mut rerun = Vec::new();
    let mut sub_goals = Vec::new();
    let mut life_cycle_exhausted = false;
    let reset = |plan: &mut Vec<PlanStep>, i: usize| {
        if let Some(s) = plan.get_mut(i) {
            send_back(s);
        }
    };
    let effect = match verdict.status {
        Status::Success => format!("step {index} ('{goal}') is accepted"),
        Status::ExecutionError => {
            arguments.insert(LESSON_KEY.to_owned(), verdict.lesson.clone());
            reset(&mut plan, index);
            rerun.push(index);
            format!("step {index} ('{goal}') runs again with the lesson")
        }
        Status::InputDataError => {
            let deps: BTreeSet<usize> = plan
                .get(index)
                .map(|s| {
                    s.depends_on
                        .iter()
                        .filter_map(|d| usize::try_from(*d).ok())
                        .collect()
                })
                .unwrap_or_default();
            let named: BTreeSet<usize> = verdict
                .culprits
                .iter()
                .copied()
                .filter(|c| deps.contains(c))
                .collect();
            let culprits = if named.is_empty() { deps } else { named };
            if culprits.is_empty() {
                // No step produced its input: the step itself runs again.
                arguments.insert(LESSON_KEY.to_owned(), verdict.lesson.clone());
                reset(&mut plan, index);
                rerun.push(index);
                format!("step {index} ('{goal}') has no earlier step to blame and runs again with the lesson")
            } else {
                // The lesson belongs to the culprits; it is recorded under each of their goals.
                let names: Vec<String> = culprits.iter().map(usize::to_string).collect();
                arguments.insert(CULPRITS_KEY.to_owned(), names.join(","));
                arguments.insert(LESSON_KEY.to_owned(), verdict.lesson.clone());
                let affected = dependents_closure(&plan, &culprits);
                for i in &affected {
                    reset(&mut plan, *i);
                }
                rerun = affected.into_iter().collect();
                format!(
                    "step {index} ('{goal}') got bad input: step(s) {} run again with the lesson, then what depends on them",
                    names.join(", ")
                )
            }
        }
        Status::JobTooComplicated => {
            let behind = splits_behind(history, &goal);
            if verdict.sub_steps.is_empty() {
                arguments.insert(LESSON_KEY.to_owned(), verdict.lesson.clone());
                reset(&mut plan, index);
                rerun.push(index);
                format!("step {index} ('{goal}') was too complicated but no sub-steps were given; it runs again with the lesson")
            } else if behind >= life_cycle || plan.len() >= crate::plan::MAX_PLAN_STEPS {
                life_cycle_exhausted = true;
                let steps = plan.len();
                if let Some(s) = plan.get_mut(index) {
                    s.status = FAILED.to_owned();
                    s.result = if behind >= life_cycle {
                        format!("Error: split {behind} times already (step life cycle {life_cycle}); not split again")
                    } else {
                        format!("Error: the plan already has {steps} steps, no room to split")
                    };
                }
                format!("step {index} ('{goal}') may not be split again (life cycle {life_cycle}, at most {} plan steps); it failed", crate::plan::MAX_PLAN_STEPS)
            } else {
                let inputs = plan
                    .get(index)
                    .map(|s| s.depends_on.clone())
                    .unwrap_or_default();
                let first_new = plan.len();
                let room = crate::plan::MAX_PLAN_STEPS.saturating_sub(plan.len());
                for (sub_goal, hint) in verdict.sub_steps.iter().take(room) {
                    plan.push(PlanStep {
                        goal: sub_goal.clone(),
                        tool_hint: hint.clone(),
                        depends_on: inputs.clone(),
                        status: PENDING.to_owned(),
                        result: String::new(),
                    });
                    sub_goals.push(sub_goal.clone());
                }
                reset(&mut plan, index);
                let added = first_new..plan.len();
                if let Some(s) = plan.get_mut(index) {
                    s.depends_on.extend(added.map(|i| i as i64));
                }
                arguments.insert(
                    SUB_GOALS_KEY.to_owned(),
                    serde_json::to_string(&sub_goals).unwrap_or_default(),
                );
                arguments.insert(DEPTH_KEY.to_owned(), (behind + 1).to_string());
                rerun.push(index);
                format!(
                    "step {index} ('{goal}') is split into {} sub-steps; it runs again on their results",
                    sub_goals.len()
                )
            }
        }
    };
    Applied {
        rerun,
        sub_goals,
        life_cycle_exhausted,
        ..recorded(verdict, arguments, plan, effect)
    }
}

/// A verdict on a subagent's result as a supervisor's history keeps it: an `evaluate` step about
/// its `goal` (the lesson, and for a split the goals it was split into and the depth), so that
/// retries, lessons and splits are read back as a plan's are.
pub fn subagent_verdict_step(
    goal: &str,
    verdict: &Evaluation,
    split_into: &[String],
    depth: usize,
    effect: &str,
) -> AgentStep {
    let mut arguments: std::collections::BTreeMap<String, String> = [
        (STAGE_KEY.to_owned(), Stage::Step.name().to_owned()),
        (GOAL_KEY.to_owned(), goal.to_owned()),
        (LESSON_KEY.to_owned(), verdict.lesson.clone()),
    ]
    .into();
    if !split_into.is_empty() {
        arguments.insert(
            SUB_GOALS_KEY.to_owned(),
            serde_json::to_string(split_into).unwrap_or_default(),
        );
        arguments.insert(DEPTH_KEY.to_owned(), depth.to_string());
    }
    AgentStep {
        thought: verdict.evaluation.clone(),
        action: verdict.status.as_str().to_owned(),
        arguments,
        observation: effect.to_owned(),
        step_type: StepType::Evaluate.as_str().to_owned(),
        ..AgentStep::default()
    }
}

/// A verdict as the history keeps it: an `evaluate` step (the status as its action, `arguments`
/// plus why the answer was unreadable if it was) carrying the plan as it now stands.
fn recorded(
    verdict: &Evaluation,
    mut arguments: std::collections::BTreeMap<String, String>,
    plan: Vec<PlanStep>,
    effect: String,
) -> Applied {
    if let Some(why) = &verdict.unreadable {
        arguments.insert(UNREADABLE_KEY.to_owned(), why.clone());
    }
    let step = AgentStep {
        thought: verdict.evaluation.clone(),
        action: verdict.status.as_str().to_owned(),
        arguments,
        observation: effect.clone(),
        step_type: StepType::Evaluate.as_str().to_owned(),
        plan: Some(plan.clone()),
        subagent_results: None,
    };
    Applied {
        plan,
        effect,
        step,
        rerun: Vec::new(),
        sub_goals: Vec::new(),
        life_cycle_exhausted: false,
    }
}

/// Applies a verdict on a whole plan. Any rejection sends the plan back to be revised with the
/// lesson (for a plan, bad input and too big a job both call for a better plan), unless
/// `may_revise` is false: then the plan stands and runs, and that is recorded.
pub fn apply_to_plan(plan: &[PlanStep], verdict: &Evaluation, may_revise: bool) -> Applied {
    let mut arguments = std::collections::BTreeMap::new();
    arguments.insert(STAGE_KEY.to_owned(), Stage::Plan.name().to_owned());
    arguments.insert(LESSON_KEY.to_owned(), verdict.lesson.clone());
    let effect = match (verdict.status, may_revise) {
        (Status::Success, _) => "the plan is accepted".to_owned(),
        (_, true) => "the plan is sent back to be revised with the lesson".to_owned(),
        (_, false) => {
            "the plan may not be revised again (max_replan_depth), so it runs as it is".to_owned()
        }
    };
    recorded(verdict, arguments, plan.to_vec(), effect)
}

/// Applies a verdict on a draft answer. `INPUT_DATA_ERROR` sends the steps the evaluator names
/// (and what depends on them) back to run again with the lesson; any other rejection asks for the
/// answer again with the lesson.
pub fn apply_to_answer(plan: &[PlanStep], verdict: &Evaluation) -> Applied {
    let mut plan = plan.to_vec();
    let mut arguments = std::collections::BTreeMap::new();
    arguments.insert(STAGE_KEY.to_owned(), Stage::Answer.name().to_owned());
    arguments.insert(LESSON_KEY.to_owned(), verdict.lesson.clone());
    let culprits: BTreeSet<usize> = verdict
        .culprits
        .iter()
        .copied()
        .filter(|c| *c < plan.len())
        .collect();
    let mut rerun = Vec::new();
    let effect = match verdict.status {
        Status::Success => "the answer is accepted".to_owned(),
        Status::InputDataError if !culprits.is_empty() => {
            let names: Vec<String> = culprits.iter().map(usize::to_string).collect();
            arguments.insert(CULPRITS_KEY.to_owned(), names.join(","));
            for i in dependents_closure(&plan, &culprits) {
                if let Some(s) = plan.get_mut(i) {
                    send_back(s);
                }
                rerun.push(i);
            }
            format!(
                "step(s) {} run again with the lesson, then the answer is written again",
                names.join(", ")
            )
        }
        _ => "the answer is written again with the lesson".to_owned(),
    };
    Applied {
        rerun,
        ..recorded(verdict, arguments, plan, effect)
    }
}

/// What a ReACT dialog does with the reviewer's verdict on its draft answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftFate {
    /// Accepted: it is the answer.
    Accepted,
    /// Rejected: the agent goes on with the lesson and writes another.
    WriteAgain,
    /// Rejected once more than `max_retries` allows: given as it is, marked as not accepted.
    Unverified,
}

/// The fate of a draft judged `status`, after the verdicts already in `history`.
pub fn draft_fate(history: &[AgentStep], status: Status, max_retries: usize) -> DraftFate {
    if status == Status::Success {
        DraftFate::Accepted
    } else if retries_used(history) + 1 > max_retries {
        DraftFate::Unverified
    } else {
        DraftFate::WriteAgain
    }
}

/// Whether `step` is a draft answer: a `synthesise` step that carries no subagent results (one
/// that does is a supervisor's fan-in, still to be answered).
pub fn is_draft(step: &AgentStep) -> bool {
    StepType::parse(&step.step_type) == Some(StepType::Synthesise)
        && step.subagent_results.is_none()
}

/// The draft answer the last history step wrote, when it waits for review.
pub fn awaiting_draft_review(history: &[AgentStep]) -> Option<&AgentStep> {
    history.last().filter(|s| is_draft(s))
}

/// Whether the last history step is the critic's rejection of a draft answer: the draft is to be
/// written again.
pub fn draft_rejected(history: &[AgentStep]) -> bool {
    history.last().is_some_and(|s| {
        StepType::parse(&s.step_type) == Some(StepType::Evaluate)
            && stage_of(s) == Some(Stage::Answer)
            && s.action != Status::Success.as_str()
    })
}

/// Lessons from reviews of earlier answers, oldest first.
pub fn answer_lessons(history: &[AgentStep]) -> Vec<String> {
    evaluations(history)
        .filter(|s| stage_of(s) == Some(Stage::Answer))
        .filter(|s| s.action != Status::Success.as_str())
        .filter_map(|s| s.arguments.get(LESSON_KEY))
        .filter(|l| !l.is_empty())
        .cloned()
        .collect()
}

/// Whether any verdict in the history could not be read (the work it judged stood unchecked).
pub fn any_unreadable(history: &[AgentStep]) -> bool {
    evaluations(history).any(|s| s.arguments.contains_key(UNREADABLE_KEY))
}

/// When the last history step is a rejected plan review: why, with its lesson, for the revision.
pub fn rejected_plan(history: &[AgentStep]) -> Option<String> {
    let last = history.last()?;
    let rejected = StepType::parse(&last.step_type) == Some(StepType::Evaluate)
        && stage_of(last) == Some(Stage::Plan)
        && last.action != Status::Success.as_str();
    if !rejected {
        return None;
    }
    let lesson = last.arguments.get(LESSON_KEY).cloned().unwrap_or_default();
    Some(format!(
        "the critic rejected the plan ({}): {}. Lesson: {lesson}",
        last.action, last.thought
    ))
}

/// Lessons from `INPUT_DATA_ERROR` verdicts that blamed the step with this goal for bad input.
pub fn culprit_lessons(history: &[AgentStep], goal: &str) -> Vec<String> {
    evaluations(history)
        .filter(|s| s.action == Status::InputDataError.as_str())
        .filter(|s| {
            let Some(plan) = s.plan.as_deref() else {
                return false;
            };
            s.arguments
                .get(CULPRITS_KEY)
                .map(|c| {
                    c.split(',')
                        .filter_map(|i| i.parse::<usize>().ok())
                        .any(|i| plan.get(i).is_some_and(|p| p.goal == goal))
                })
                .unwrap_or(false)
        })
        .filter_map(|s| s.arguments.get(LESSON_KEY))
        .filter(|l| !l.is_empty())
        .cloned()
        .collect()
}

/// Every lesson for the step with this goal: from verdicts on it and from verdicts that blamed it.
pub fn all_lessons(history: &[AgentStep], goal: &str) -> Vec<String> {
    let mut out = lessons_for(history, goal);
    for lesson in culprit_lessons(history, goal) {
        if !out.contains(&lesson) {
            out.push(lesson);
        }
    }
    out
}

/// `roots` and every completed step that depends on them, directly or not.
fn dependents_closure(plan: &[PlanStep], roots: &BTreeSet<usize>) -> BTreeSet<usize> {
    let mut out = roots.clone();
    loop {
        let before = out.len();
        for (i, s) in plan.iter().enumerate() {
            if out.contains(&i) {
                continue;
            }
            let hit = s
                .depends_on
                .iter()
                .filter_map(|d| usize::try_from(*d).ok())
                .any(|d| out.contains(&d));
            if hit && s.status == COMPLETED {
                out.insert(i);
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(goal: &str, deps: &[i64], status: &str, result: &str) -> PlanStep {
        PlanStep {
            goal: goal.into(),
            tool_hint: String::new(),
            depends_on: deps.to_vec(),
            status: status.into(),
            result: result.into(),
        }
    }

    fn verdict(text: &str) -> Evaluation {
        parse(text)
    }

    /// A verdict a reasoning model drafts in its `<think>` block is not its verdict: the one after
    /// the block is, whether the block opens in the reply or (R1's template) in the prompt.
    /// Before, the first object read, the draft's SUCCESS, let a step the critic rejected stand.
    #[test]
    fn a_verdict_drafted_while_thinking_is_not_the_verdict() {
        let thought =
            r#"Maybe {"status": "SUCCESS", "evaluation": "looks fine"} but the sum is wrong."#;
        let given =
            r#"{"status": "EXECUTION_ERROR", "evaluation": "sum wrong", "lesson": "recompute"}"#;
        for text in [
            format!("<think>\n{thought}\n</think>\n{given}"),
            format!("{thought}\n</think>\n\n{given}"),
        ] {
            let read = verdict(&text);
            assert_eq!(read.status, Status::ExecutionError, "{text}");
            assert_eq!(read.lesson, "recompute");
        }
    }

    #[test]
    fn a_rejected_draft_is_written_again_until_the_retries_are_used() {
        let verdict = |status: Status| AgentStep {
            action: status.as_str().to_owned(),
            step_type: StepType::Evaluate.as_str().to_owned(),
            ..AgentStep::default()
        };
        let draft = AgentStep {
            observation: "42".into(),
            step_type: StepType::Synthesise.as_str().to_owned(),
            ..AgentStep::default()
        };
        assert_eq!(draft_fate(&[], Status::Success, 1), DraftFate::Accepted);
        assert_eq!(
            draft_fate(&[], Status::ExecutionError, 1),
            DraftFate::WriteAgain
        );
        let once = [
            draft.clone(),
            verdict(Status::ExecutionError),
            draft.clone(),
        ];
        assert_eq!(
            draft_fate(&once, Status::ExecutionError, 1),
            DraftFate::Unverified
        );
        assert_eq!(draft_fate(&once, Status::Success, 1), DraftFate::Accepted);
        assert_eq!(
            awaiting_draft_review(&once).map(|s| s.observation.as_str()),
            Some("42")
        );
        assert!(awaiting_draft_review(&once[..2]).is_none());
        let mut answer_rejected = verdict(Status::ExecutionError);
        answer_rejected
            .arguments
            .insert(STAGE_KEY.to_owned(), Stage::Answer.name().to_owned());
        assert!(draft_rejected(&[draft.clone(), answer_rejected]));
        assert!(!draft_rejected(&once[..2]), "a verdict on something else");
        let fan_in = AgentStep {
            subagent_results: Some(Default::default()),
            ..draft
        };
        assert!(
            awaiting_draft_review(&[fan_in]).is_none(),
            "a fan-in is no draft"
        );
    }

    #[test]
    fn statuses_follow_their_priority_and_prose_after_the_json_is_ignored() {
        let v = verdict(r#"{"status": ["JOB_TOO_COMPLICATED_ERROR", "INPUT_DATA_ERROR"]} see {x}"#);
        assert_eq!(v.status, Status::InputDataError);
        assert!(v.unreadable.is_none());
        let v = verdict(r#"{"status": "EXECUTION_ERROR, SUCCESS"}"#);
        assert_eq!(v.status, Status::ExecutionError);
        let v = verdict(r#"{"status": ["SUCCESS", "JOB_TOO_COMPLICATED_ERROR"]}"#);
        assert_eq!(v.status, Status::JobTooComplicated);
        let v = verdict(r#"{"status": "INPUT_DATA_ERROR | EXECUTION_ERROR"}"#);
        assert_eq!(v.status, Status::ExecutionError);
        let v = verdict("no idea");
        assert_eq!(v.status, Status::Success);
        assert!(v.unreadable.is_some());
        assert!(verdict(r#"{"status": "MAYBE"}"#).unreadable.is_some());
    }

    /// Rejections as models write them: a key in capitals, a status followed by why, a verdict
    /// after a quoted result with more braces than are tried from the start. Each read as
    /// unreadable before, which let the step stand as a success.
    #[test]
    fn a_rejection_with_its_reason_or_a_capital_key_or_after_many_braces_is_read() {
        let quoted = r#"{"a": {}}"#.repeat(9);
        for text in [
            r#"{"Status": "FAILED", "Evaluation": "the sum is wrong"}"#.to_owned(),
            r#"{"status": "EXECUTION_ERROR: the sum is wrong"}"#.to_owned(),
            r#"{"status": "FAILED (no source given)"}"#.to_owned(),
            r#"{"status": "REJECTED - no source"}"#.to_owned(),
            format!(r#"The tool said {quoted}. {{"status": "FAILED", "evaluation": "x"}}"#),
        ] {
            let v = verdict(&text);
            assert_eq!(v.status, Status::ExecutionError, "{text}: {v:?}");
            assert!(v.unreadable.is_none(), "{text}");
        }
        let v = verdict(r#"{"Status": "FAILED", "Evaluation": "wrong", "Lesson": "add again"}"#);
        assert_eq!(
            (v.evaluation.as_str(), v.lesson.as_str()),
            ("wrong", "add again")
        );
    }

    #[test]
    fn a_failure_in_other_words_or_after_braces_in_prose_is_still_a_failure() {
        for (text, status) in [
            (r#"{"status": "execution error"}"#, Status::ExecutionError),
            (r#"{"status": "FAILED"}"#, Status::ExecutionError),
            (r#"{"status": "Rejected"}"#, Status::ExecutionError),
            (r#"{"status": "input-data-error"}"#, Status::InputDataError),
            (r#"{"status": "passed"}"#, Status::Success),
            (
                r#"Step {0} is wrong. {"status": "EXECUTION_ERROR", "evaluation": "bad"}"#,
                Status::ExecutionError,
            ),
            (
                r#"{"note": "first"} then {"status": "INPUT_DATA_ERROR"}"#,
                Status::InputDataError,
            ),
        ] {
            let v = verdict(text);
            assert_eq!(v.status, status, "{text}");
            assert!(v.unreadable.is_none(), "{text}");
        }
        let v = verdict(r#"{"note": "no status here"}"#);
        assert!(v.unreadable.is_some());
        // A tool's result quoted before the verdict is not the verdict.
        let v = verdict(
            r#"The tool returned {"status": "error", "code": 7} but recovered. {"status": "SUCCESS", "evaluation": "fine"}"#,
        );
        assert_eq!(v.status, Status::Success);
        assert_eq!(v.evaluation, "fine");
        let v = verdict(r#"It said {"status": "error"}. Verdict: {"status": "SUCCESS"}"#);
        assert_eq!(v.status, Status::Success);
    }

    #[test]
    fn an_input_data_error_sends_back_the_culprit_and_its_completed_dependents() {
        let plan = [
            step("a", &[], COMPLETED, "A"),
            step("b", &[0], COMPLETED, "B"),
            step("c", &[1], COMPLETED, "C"),
            step("d", &[], COMPLETED, "D"),
        ];
        let v = verdict(r#"{"status": "INPUT_DATA_ERROR", "lesson": "fix a", "culprits": [0, 3]}"#);
        let applied = apply(&[], &plan, 1, &v, 3);
        // Step 3 is not an input of step 1, so only step 0 is blamed; step 2 depends on step 1.
        assert_eq!(applied.rerun, [0, 1, 2]);
        assert_eq!(applied.plan[0].status, PENDING);
        assert_eq!(applied.plan[0].result, "A", "the last result is kept");
        assert_eq!(applied.plan[3].status, COMPLETED);
        let history = [applied.step];
        assert_eq!(culprit_lessons(&history, "a"), ["fix a"]);
        assert!(
            lessons_for(&history, "c").is_empty(),
            "the judged step does not get the culprit's lesson"
        );
        assert_eq!(retries_used(&history), 1);
    }

    #[test]
    fn a_failed_step_sent_back_drops_its_error_and_the_answer_lists_only_real_results() {
        let plan = [
            step("a", &[], COMPLETED, "A"),
            step("b", &[0], FAILED, "Error: the tool timed out"),
            step("c", &[], COMPLETED, "C"),
        ];
        let v = verdict(
            r#"{"status": "INPUT_DATA_ERROR", "lesson": "fix a and b", "culprits": [0, 1]}"#,
        );
        let applied = apply_to_answer(&plan, &v);
        assert_eq!(applied.rerun, [0, 1]);
        assert_eq!(applied.plan[0].result, "A", "a rejected result is kept");
        assert!(applied.plan[1].status == PENDING && applied.plan[1].result.is_empty());
        let described = crate::plan::describe_results(&applied.plan);
        assert!(described.contains("a\n   result (not accepted by the evaluator): A"));
        assert!(described.contains("c\n   result: C"));
        assert!(!described.contains("Error"), "{described}");
    }

    #[test]
    fn splits_are_bounded_by_the_life_cycle_and_hostile_depths_do_not_overflow() {
        let plan = [step("big", &[], COMPLETED, "draft")];
        let v =
            verdict(r#"{"status": "JOB_TOO_COMPLICATED_ERROR", "sub_steps": [{"goal": "small"}]}"#);
        let first = apply(&[], &plan, 0, &v, 1);
        assert_eq!(first.sub_goals, ["small"]);
        assert_eq!(first.plan[0].depends_on, [1]);
        let history = [first.step.clone()];
        assert_eq!(splits_behind(&history, "small"), 1);
        let refused = apply(&history, &first.plan, 1, &v, 1);
        assert!(refused.life_cycle_exhausted);
        assert_eq!(refused.plan[1].status, FAILED);
        let mut hostile = first.step;
        hostile
            .arguments
            .insert(DEPTH_KEY.into(), usize::MAX.to_string());
        hostile.arguments.insert(GOAL_KEY.into(), "small".into());
        assert_eq!(splits_behind(&[hostile], "small"), usize::MAX);
    }

    #[test]
    fn each_completed_execution_is_evaluated_once() {
        let planned = AgentStep {
            step_type: "plan".into(),
            plan: Some(vec![step("a", &[], PENDING, "")]),
            ..AgentStep::default()
        };
        let executed = AgentStep {
            step_type: "execute".into(),
            plan: Some(vec![step("a", &[], COMPLETED, "A")]),
            ..AgentStep::default()
        };
        assert_eq!(
            awaiting_evaluation(&[planned.clone(), executed.clone()]),
            Some(0)
        );
        let judged = apply(
            &[],
            executed.plan.as_deref().unwrap_or_default(),
            0,
            &verdict(r#"{"status": "SUCCESS"}"#),
            3,
        )
        .step;
        assert_eq!(awaiting_evaluation(&[planned, executed, judged]), None);
    }
}
