//! The Plan-then-Execute pattern's decisions: from the history alone, what the next iteration
//! does (make a plan, run a step, ask the critic, revise, or answer) and within which bounds.

use agent_schema::{AgentStep, StepType};

use crate::critic;
use crate::pattern::Termination;
use crate::plan::{current_plan, is_open, ready_step, FAILED, MAX_PLAN_STEPS};

/// What the next iteration of a Plan-then-Execute dialog does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// No plan yet: make one.
    MakePlan,
    /// Run the step at this index.
    RunStep(usize),
    /// Revise the rest of the plan, for this reason.
    Replan(String),
    /// Ask the critic about the step at this index, which just completed.
    Evaluate(usize),
    /// Ask the critic about the plan just made.
    ReviewPlan,
    /// Ask the critic about the draft answer just written.
    ReviewAnswer,
    /// Answer from the results; `Some` when the plan could not be finished.
    Synthesise(Option<Unfinished>),
}

/// Why a plan ends before all its steps are done: the termination recorded and the reason given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfinished {
    pub termination: Termination,
    pub reason: String,
}

impl Unfinished {
    fn new(termination: Termination, reason: String) -> Option<Unfinished> {
        Some(Unfinished {
            termination,
            reason,
        })
    }
}

/// How many steps a new plan may have: what the remaining iterations allow (each step takes one,
/// two with the critic, and the answer one), within [`MAX_PLAN_STEPS`], at least one.
pub fn step_budget(history_len: usize, max_iterations: usize, critic_steps: bool) -> usize {
    // This iteration plans; the answer must come by iteration `max_iterations`.
    let left = max_iterations.saturating_sub(history_len + 2);
    let per_step = if critic_steps { 2 } else { 1 };
    (left / per_step).clamp(1, MAX_PLAN_STEPS)
}

/// Revisions made so far (plan steps after the first).
pub fn replans_used(history: &[AgentStep]) -> usize {
    history
        .iter()
        .filter(|s| StepType::parse(&s.step_type) == Some(StepType::Plan))
        .count()
        .saturating_sub(1)
}

/// The bounds and switches that shape a Plan-then-Execute dialog.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    pub max_replan_depth: usize,
    /// Reruns the critic may ask for; the rejection past them ends the dialog.
    pub max_retries: usize,
    /// Whether the critic evaluates each completed step.
    pub critic_steps: bool,
    /// Whether the critic reviews each plan before it runs.
    pub critic_plan: bool,
    /// Whether the critic reviews the answer before it is given.
    pub critic_answer: bool,
}

/// Decides the next iteration from the history.
pub fn next(history: &[AgentStep], policy: Policy) -> Next {
    let Some(plan) = current_plan(history).filter(|p| !p.is_empty()) else {
        return Next::MakePlan;
    };
    let last_is_plan = history
        .last()
        .is_some_and(|s| StepType::parse(&s.step_type) == Some(StepType::Plan));
    if policy.critic_plan && last_is_plan {
        return Next::ReviewPlan;
    }
    let last_is_draft = history
        .last()
        .is_some_and(|s| StepType::parse(&s.step_type) == Some(StepType::Synthesise));
    if last_is_draft {
        return Next::ReviewAnswer;
    }
    if policy.critic_steps {
        if let Some(i) = critic::awaiting_evaluation(history) {
            return Next::Evaluate(i);
        }
    }
    if policy.critic_steps || policy.critic_plan || policy.critic_answer {
        let retries = critic::retries_used(history);
        // `max_retries` reruns are allowed; the rejection past them ends the dialog.
        if retries > policy.max_retries {
            return Next::Synthesise(Unfinished::new(
                Termination::RetryLimit,
                format!(
                    "the evaluator rejected work {retries} times, more than max_retries {}, so the answer could not be verified",
                    policy.max_retries
                ),
            ));
        }
    }
    if let Some(rejection) = critic::rejected_plan(history) {
        if replans_used(history) < policy.max_replan_depth {
            return Next::Replan(rejection);
        }
    }
    let trouble = plan.iter().enumerate().find_map(|(i, s)| {
        if s.status == FAILED {
            Some(format!("step {i} ('{}') failed: {}", s.goal, s.result))
        } else {
            None
        }
    });
    if let Some(reason) = trouble {
        let used = replans_used(history);
        let max_replan_depth = policy.max_replan_depth;
        if used < max_replan_depth {
            return Next::Replan(reason);
        }
        return Next::Synthesise(Unfinished::new(
            Termination::ReplanLimit,
            format!(
                "{reason}; the plan was already revised {used} times (max_replan_depth {max_replan_depth})"
            ),
        ));
    }
    match ready_step(plan) {
        Some(i) => Next::RunStep(i),
        None if plan.iter().any(is_open) => Next::Synthesise(Unfinished::new(
            Termination::Blocked,
            "the remaining steps wait on each other and cannot run".to_owned(),
        )),
        None => Next::Synthesise(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::{step, with_plan};
    use crate::plan::{plan_in_force, COMPLETED, PENDING};

    #[test]
    fn failures_replan_until_the_bound_then_synthesise() {
        let failed = vec![step("a", &[], COMPLETED), step("b", &[0], FAILED)];
        let first = vec![with_plan(StepType::Plan, failed.clone())];
        let policy = |max_replan_depth| Policy {
            max_replan_depth,
            max_retries: 5,
            critic_steps: false,
            critic_plan: false,
            critic_answer: false,
        };
        assert!(
            matches!(next(&first, policy(2)), Next::Replan(r) if r.contains("step 1 ('b') failed"))
        );
        let twice = vec![
            with_plan(StepType::Plan, failed.clone()),
            with_plan(StepType::Plan, failed.clone()),
            with_plan(StepType::Plan, failed),
        ];
        assert_eq!(replans_used(&twice), 2);
        assert!(
            matches!(next(&twice, policy(2)), Next::Synthesise(Some(u)) if u.reason.contains("max_replan_depth 2") && u.termination == Termination::ReplanLimit)
        );
        assert_eq!(next(&[], policy(2)), Next::MakePlan);
        let done = vec![with_plan(
            StepType::Execute,
            vec![step("a", &[], COMPLETED)],
        )];
        assert_eq!(next(&done, policy(2)), Next::Synthesise(None));
    }

    #[test]
    fn odd_statuses_wait_and_empty_plans_are_made_again() {
        let odd = vec![with_plan(
            StepType::Plan,
            vec![step("a", &[], "running"), step("b", &[0], "")],
        )];
        let policy = Policy {
            max_replan_depth: 2,
            max_retries: 5,
            critic_steps: false,
            critic_plan: false,
            critic_answer: false,
        };
        assert_eq!(next(&odd, policy), Next::RunStep(0));
        let stuck = vec![with_plan(
            StepType::Plan,
            vec![step("a", &[1], PENDING), step("b", &[0], PENDING)],
        )];
        assert!(
            matches!(next(&stuck, policy), Next::Synthesise(Some(u)) if u.termination == Termination::Blocked)
        );
        assert_eq!(
            next(&[with_plan(StepType::Plan, vec![])], policy),
            Next::MakePlan
        );
        assert!(
            plan_in_force(&[with_plan(StepType::Execute, vec![step("a", &[], PENDING)])]).is_none()
        );
        assert_eq!(step_budget(0, 10, false), 8);
        assert_eq!(step_budget(0, 10, true), 4);
        assert_eq!(step_budget(9, 10, false), 1);
    }
}
