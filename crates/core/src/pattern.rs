//! The closed sets the rest of the crate decides by: which reasoning patterns this orchestrator runs,
//! which critic stages a task may switch on, how a dialog ended. A leaf: names are parsed here once,
//! at the edge, and matched as enums everywhere else.

use std::fmt;

/// A reasoning pattern this orchestrator can run. A request names one by `pattern` (or the
/// meta-router chooses); config may define more names, but only these run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pattern {
    /// Reason, act with one tool, observe; until an answer.
    React,
    /// A plan of dependent steps first, then each step in order, revising on failure.
    PlanThenExecute,
    /// Independent goals fanned out to subagents, then one synthesis.
    Supervisor,
    /// No reasoning loop: one constrained choice among the tools and the other patterns, and
    /// the request handed to it.
    LlmRouter,
    /// ReACT with a self-critique after each action, whose lesson the next steps are given.
    Reflexion,
    /// The same question to several independent agents, each from its own perspective, in
    /// parallel; then one reconciliation that says where they agreed and disagreed.
    Ensemble,
    /// Research in rounds: a knowledge-gap check and the tool calls that fill the gaps (run in
    /// parallel within the round), until complete or out of rounds; then a writer, and a judge.
    DeepResearch,
}

impl Pattern {
    pub const ALL: [Pattern; 7] = [
        Pattern::React,
        Pattern::PlanThenExecute,
        Pattern::Supervisor,
        Pattern::LlmRouter,
        Pattern::Reflexion,
        Pattern::Ensemble,
        Pattern::DeepResearch,
    ];

    /// The name on the wire (`AgentRequest::pattern`), in config and in the provenance graph.
    pub const fn name(self) -> &'static str {
        match self {
            Pattern::React => "react",
            Pattern::PlanThenExecute => "plan-then-execute",
            Pattern::Supervisor => "supervisor",
            Pattern::LlmRouter => "llm-router",
            Pattern::Reflexion => "reflexion",
            Pattern::Ensemble => "ensemble",
            Pattern::DeepResearch => "deep-research",
        }
    }

    /// Whether the pattern starts subagents, so that `max_fanout_depth` bounds it.
    pub const fn fans_out(self) -> bool {
        matches!(self, Pattern::Supervisor | Pattern::Ensemble)
    }

    /// The pattern a name stands for, if this orchestrator runs it.
    pub fn from_name(name: &str) -> Option<Pattern> {
        Pattern::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether this orchestrator runs the pattern of that name.
    pub fn runs(name: &str) -> bool {
        Pattern::from_name(name).is_some()
    }

    /// What the meta-router is told of the pattern when config gives no description.
    pub const fn description(self) -> &'static str {
        match self {
            Pattern::React => {
                "Reason step by step, calling one tool at a time, until the answer is known"
            }
            Pattern::PlanThenExecute => {
                "Write a plan of dependent steps first, then carry them out one at a time, revising the rest of the plan when a step fails"
            }
            Pattern::Supervisor => {
                "Split the request into independent goals, give each to its own subagent in parallel, then combine their findings"
            }
            Pattern::LlmRouter => {
                "Make one choice among the tools and the other ways of working, without reasoning steps, and hand the request to it"
            }
            Pattern::Reflexion => {
                "Reason and act one tool at a time, and after each action reflect on what it taught, carrying the lessons forward"
            }
            Pattern::Ensemble => {
                "Put the same question to several independent agents, each from its own perspective, in parallel, then reconcile their answers, saying where they agree and disagree"
            }
            Pattern::DeepResearch => {
                "Research in rounds: check what is still unknown, look several things up at once, until the research is complete; then write the answer from the notes and have it judged"
            }
        }
    }

    /// Every pattern's name, for messages that list what would have been accepted.
    pub fn all_names() -> String {
        Pattern::ALL.map(Pattern::name).join(", ")
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A critic stage a task type or pattern may switch on; config and the history name it by
/// [`Stage::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Evaluates each completed plan step.
    Step,
    /// Reviews each plan (and revision) before it runs.
    Plan,
    /// Reviews the answer before it is given.
    Answer,
}

impl Stage {
    pub const ALL: [Stage; 3] = [Stage::Step, Stage::Plan, Stage::Answer];

    pub const fn name(self) -> &'static str {
        match self {
            Stage::Step => "step",
            Stage::Plan => "plan",
            Stage::Answer => "answer",
        }
    }

    pub fn from_name(name: &str) -> Option<Stage> {
        Stage::ALL.into_iter().find(|s| s.name() == name)
    }

    /// The stages' names, for messages that list them.
    pub fn all_names() -> String {
        Stage::ALL.map(Stage::name).join(", ")
    }
}

/// How a dialog ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    Answer,
    /// The plan could not be finished within `max_replan_depth` revisions; answered from what
    /// completed.
    ReplanLimit,
    /// The critic rejected work `max_retries` times; answered from what completed, unverified.
    RetryLimit,
    /// The plan's remaining steps could not run; answered from what completed.
    Blocked,
    MaxIterations,
    /// A token or wall-time budget was used up.
    Budget,
    /// Someone cancelled the run (see [`crate::provenance::cancellation`]).
    Cancelled,
    Error,
}

impl Termination {
    pub fn as_str(self) -> &'static str {
        match self {
            Termination::Answer => "answer",
            Termination::ReplanLimit => "max-replan-depth",
            Termination::RetryLimit => "max-retries",
            Termination::Blocked => "blocked",
            Termination::MaxIterations => "max-iterations",
            Termination::Budget => "budget",
            Termination::Cancelled => "cancelled",
            Termination::Error => "error",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_to_their_pattern_and_nothing_else_parses() {
        for p in Pattern::ALL {
            assert_eq!(Pattern::from_name(p.name()), Some(p));
            assert_eq!(p.to_string(), p.name());
        }
        for other in ["", "React", "plan", "supervisor ", "debate"] {
            assert_eq!(Pattern::from_name(other), None, "{other:?}");
        }
        assert_eq!(
            Pattern::all_names(),
            "react, plan-then-execute, supervisor, llm-router, reflexion, ensemble, deep-research"
        );
    }
}
