//! Prompt templates and the rendering of the ReACT prompt from a request, its tools and its history.

use std::collections::BTreeMap;

use agent_schema::{AgentStep, StepType};

use crate::tools::ToolDef;

/// Config key (type `prompt`) of the ReACT prompt.
pub const REACT_KEY: &str = "react";
/// Config key of the ReACT prompt for models that call tools natively (`tool-calling: native`):
/// the tools go in the request's `tools`, so the prompt has no protocol to teach.
pub const REACT_NATIVE_KEY: &str = "react-native";
/// Config key of the meta-router's first question: which task type a request is (TrustGraph's
/// prompt id).
pub const TASK_TYPE_SELECTION_KEY: &str = "task-type-classify";
/// Config key of the meta-router's second question: which pattern to work on a task type with
/// (TrustGraph's prompt id).
pub const PATTERN_SELECTION_KEY: &str = "pattern-select";
/// Config key of the Plan-then-Execute planning prompt (TrustGraph's prompt id).
pub const PLAN_CREATE_KEY: &str = "plan-create";
/// Config key of the prompt that carries out one plan step.
pub const PLAN_STEP_KEY: &str = "plan-step";
/// Config key of the prompt that revises the rest of a plan after a failure.
pub const PLAN_REVISE_KEY: &str = "plan-revise";
/// Config key of the critic's prompt on a plan step.
pub const PLAN_EVALUATE_KEY: &str = "plan-evaluate";
/// Config key of the critic's prompt on a whole plan.
pub const PLAN_REVIEW_KEY: &str = "plan-review";
/// Config key of the critic's prompt on a draft answer.
pub const ANSWER_REVIEW_KEY: &str = "answer-review";
/// Config key of the prompt that answers from the plan's results (TrustGraph's prompt id).
pub const PLAN_SYNTHESISE_KEY: &str = "plan-synthesise";
/// Config key of the supervisor's prompt that splits a request into goals (TrustGraph's prompt id).
pub const SUPERVISOR_DECOMPOSE_KEY: &str = "supervisor-decompose";
/// Config key of the supervisor's prompt that answers from its subagents' results (TrustGraph's id).
pub const SUPERVISOR_SYNTHESISE_KEY: &str = "supervisor-synthesise";
/// Config key of the prompt around a tool's LLM call (`text-completion` and `prompt` tools).
pub const TOOL_CALL_KEY: &str = "tool-call";
/// Config key of the LLM-as-router's one choice.
pub const LLM_ROUTER_KEY: &str = "llm-router";
/// Config key of Reflexion's self-critique after an action.
pub const REFLEXION_REFLECT_KEY: &str = "reflexion-reflect";
pub const ENSEMBLE_RECONCILE_KEY: &str = "ensemble-reconcile";
pub const DEEP_RESEARCH_ROUND_KEY: &str = "deep-research-round";
pub const DEEP_RESEARCH_WRITE_KEY: &str = "deep-research-write";

/// The ReACT system prompt used when config gives none.
pub const DEFAULT_REACT_SYSTEM: &str = "You are a careful assistant that answers questions by reasoning step by step and using tools when they help.";

/// The ReACT user prompt used when config gives none. `{{name}}` placeholders are filled in.
pub const DEFAULT_REACT_TEMPLATE: &str = "{{framing}}Answer the question below. You may use these tools:\n\n{{tools}}\n\nRespond in exactly one of these two forms.\n\nTo use a tool:\nThought: <your reasoning>\nAction: <one of: {{tool_names}}>\nArgs: <a JSON object with the tool's arguments>\n\nTo answer:\nThought: <your reasoning>\nFinal Answer: <the answer>\n\nQuestion: {{question}}\n{{history}}";

/// The native-tool-calling ReACT prompt used when config gives none. Placeholders: `framing`,
/// `question`.
pub const DEFAULT_REACT_NATIVE_TEMPLATE: &str = "{{framing}}Answer the question below. Call one of the tools you are given when it helps, one call at a time, and wait for its result; never guess what a tool would return. When you know the answer, reply with the answer itself.\n\nQuestion: {{question}}";

/// The routing system prompt used when config gives none (both routing questions share it).
pub const DEFAULT_ROUTING_SYSTEM: &str = "You route requests to the way of working that suits them best. You choose only among the options you are given and you explain your choice in one sentence.";

/// Which task type a request is. Placeholders: `question`, `candidates` (one line per option with
/// its description), `candidate_names`.
pub const DEFAULT_TASK_TYPE_TEMPLATE: &str = "Classify the request below as exactly one of these task types:\n\n{{candidates}}\n\nReply with only a JSON object: {\"choice\": \"<one of: {{candidate_names}}>\", \"rationale\": \"<one sentence: which signals in the request led to the choice>\"}\n\nRequest to classify: {{question}}";

/// Which pattern to work with. Placeholders: `question`, `task_type`, `task_type_description`,
/// `candidates`, `candidate_names`.
pub const DEFAULT_PATTERN_TEMPLATE: &str = "The request below is a '{{task_type}}' task ({{task_type_description}}). Choose how to work on it, exactly one of these patterns:\n\n{{candidates}}\n\nReply with only a JSON object: {\"choice\": \"<one of: {{candidate_names}}>\", \"rationale\": \"<one sentence: which signals in the request led to the choice>\"}\n\nRequest to work on: {{question}}";

/// The planning system prompt used when config gives none (every Plan-then-Execute call shares it).
pub const DEFAULT_PLAN_SYSTEM: &str = "You are a careful planner and executor. You break work into small steps that each need at most one tool, and you report only what the steps found.";

/// Planning. Placeholders: `framing`, `question`, `tools`, `max_steps`.
pub const DEFAULT_PLAN_CREATE_TEMPLATE: &str = "{{framing}}Make a plan to answer the request below. Each step has a goal, an optional tool hint, and the numbers of the other steps whose results it needs (steps are numbered from 0; no step may depend on itself, and the dependencies must not go round in a circle). Use at most {{max_steps}} steps.\n\nTools the steps can use:\n{{tools}}\n\nReply with only a JSON object: {\"rationale\": \"<one sentence>\", \"steps\": [{\"goal\": \"...\", \"tool_hint\": \"...\", \"depends_on\": []}]}\n\nRequest to plan: {{question}}";

/// One step. Placeholders: `framing`, `question`, `step`, `goal`, `tool_hint`, `dependencies`,
/// `lessons`, `tools`, `tool_names`.
pub const DEFAULT_PLAN_STEP_TEMPLATE: &str = "{{framing}}You are carrying out step {{step}} of a plan for the request: {{question}}\n\nResults of the steps it depends on:\n{{dependencies}}\n\nLessons from earlier attempts at this step:\n{{lessons}}\n\nYou may use these tools:\n{{tools}}\n\nRespond in exactly one of these two forms.\n\nTo use a tool:\nThought: <your reasoning>\nAction: <one of: {{tool_names}}>\nArgs: <a JSON object with the tool's arguments>\n\nTo give the step's result directly:\nThought: <your reasoning>\nFinal Answer: <the result>\n\nStep goal: {{goal}}\nSuggested tool: {{tool_hint}}";

/// Revising. Placeholders: `framing`, `question`, `plan`, `completed`, `problem`, `first_new`,
/// `tools`.
pub const DEFAULT_PLAN_REVISE_TEMPLATE: &str = "{{framing}}A plan for the request below ran into a problem: {{problem}}\n\nThe plan so far:\n{{plan}}\n\nThe completed steps are kept and renumbered as follows:\n{{completed}}\n\nWrite the remaining steps only. Number them from {{first_new}}; depends_on may name kept steps and earlier new steps.\n\nTools the steps can use:\n{{tools}}\n\nReply with only a JSON object: {\"rationale\": \"<what changed and why>\", \"steps\": [{\"goal\": \"...\", \"tool_hint\": \"...\", \"depends_on\": []}]}\n\nRequest to re-plan: {{question}}";

/// The critic's system prompt used when config gives none.
pub const DEFAULT_CRITIC_SYSTEM: &str = "You are a strict reviewer. You judge whether work achieves its goal, and when it does not you say what went wrong and what to do differently.";

/// The critic on one step. Placeholders: `framing`, `question`, `step`, `goal`, `dependencies`,
/// `result`.
pub const DEFAULT_PLAN_EVALUATE_TEMPLATE: &str = "{{framing}}Evaluate the result of one step of a plan for the request: {{question}}\n\nStep {{step}}: {{goal}}\n\nResults of the steps it depends on:\n{{dependencies}}\n\nResult to evaluate: {{result}}\n\nSUCCESS: the result achieves the goal. EXECUTION_ERROR: the step was done badly and doing it again better would work. INPUT_DATA_ERROR: the results it was given were wrong. JOB_TOO_COMPLICATED_ERROR: the step is too big to do in one go. When several apply, give the first in that order.\n\nReply with only a JSON object: {\"status\": \"<one of the four>\", \"evaluation\": \"<what is right or wrong>\", \"lesson\": \"<what to do differently>\", \"culprits\": [<for INPUT_DATA_ERROR: the numbers of the steps whose results were wrong>], \"sub_steps\": [<for JOB_TOO_COMPLICATED_ERROR: objects with goal and tool_hint>]}";

/// The critic on a whole plan. Placeholders: `framing`, `question`, `plan`, `tools`.
pub const DEFAULT_PLAN_REVIEW_TEMPLATE: &str = "{{framing}}Review the plan below, made to answer a request.\n\nThe plan:\n{{plan}}\n\nTools the steps can use:\n{{tools}}\n\nSUCCESS: carrying out the plan will answer the request. EXECUTION_ERROR: the plan is badly made and a better one would work. INPUT_DATA_ERROR: the request lacks what the plan needs. JOB_TOO_COMPLICATED_ERROR: the plan's steps are too big. When several apply, give the first in that order.\n\nReply with only a JSON object: {\"status\": \"<one of the four>\", \"evaluation\": \"<what is right or wrong>\", \"lesson\": \"<what the next plan should do differently>\"}\n\nPlan to review for: {{question}}";

/// The critic on a draft answer. Placeholders: `framing`, `question`, `results`, `answer`.
pub const DEFAULT_ANSWER_REVIEW_TEMPLATE: &str = "{{framing}}Review a draft answer to a request, written from the results of the steps taken for it.\n\nThe steps' results:\n{{results}}\n\nSUCCESS: the answer is right and answers the request. EXECUTION_ERROR: the answer is badly written from good results. INPUT_DATA_ERROR: results it rests on are wrong (name their step numbers in culprits). JOB_TOO_COMPLICATED_ERROR: the answer tries to do too much at once. When several apply, give the first in that order.\n\nReply with only a JSON object: {\"status\": \"<one of the four>\", \"evaluation\": \"<what is right or wrong>\", \"lesson\": \"<what to do differently>\", \"culprits\": [<step numbers>]}\n\nDraft answer to review: {{answer}}\n\nRequest it answers: {{question}}";

/// The LLM-as-router's one choice. Placeholders: `framing`, `question`, `candidates` (one line each:
/// `tool:<name>` or `pattern:<name>` and what it does), `candidate_names`.
pub const DEFAULT_LLM_ROUTER_TEMPLATE: &str = "{{framing}}Choose the one option below that should handle the request: a tool answers it directly with the arguments you give; a pattern works on it as it would.\n\n{{candidates}}\n\nReply with only a JSON object: {\"choice\": \"<one of: {{candidate_names}}>\", \"rationale\": \"<one sentence>\", \"arguments\": {\"<argument>\": \"<value>\"}}\n\nRequest to route: {{question}}";

/// Reflexion's self-critique after an action. Placeholders: `framing`, `question`, `history` (the
/// steps so far, the newest last).
pub const DEFAULT_REFLEXION_REFLECT_TEMPLATE: &str = "{{framing}}An agent is working on the request below, one tool at a time. Look at its newest step: was the action a good one, and did its result move the work forward? Reply with one sentence: the lesson the agent should carry into its next steps.\n\nIts steps so far:\n{{history}}\nRequest it works on: {{question}}";

/// The ensemble's reconciler. Placeholders: `framing`, `question`, `answers`.
pub const DEFAULT_ENSEMBLE_SYSTEM: &str = "You reconcile the work of independent agents: you weigh their answers fairly, name where they agree and disagree, and never invent what none of them found.";
pub const DEFAULT_ENSEMBLE_RECONCILE_TEMPLATE: &str = "{{framing}}Several independent agents answered the question below, each from its own perspective.\n\nQuestion: {{question}}\n\nTheir answers:\n{{answers}}\n\nReconcile them: list the points they agree on and the points they disagree on, then give the answer their work best supports, saying where it remains uncertain. Reply with only a JSON object: {\"agreed\": [\"...\"], \"disagreed\": [\"...\"], \"answer\": \"...\"}\n\nQuestion to reconcile: {{question}}";

/// Deep research. Round placeholders: `framing`, `question`, `round`, `max_rounds`, `max_calls`,
/// `tools`, `notes`; writer: `framing`, `question`, `notes`, `lessons`.
pub const DEFAULT_DEEP_RESEARCH_SYSTEM: &str = "You research carefully: you look for what is missing, use tools to find it, and write only what the evidence supports.";
pub const DEFAULT_DEEP_RESEARCH_ROUND_TEMPLATE: &str = "{{framing}}You are researching the request below in rounds (this is round {{round}} of at most {{max_rounds}}). Read the notes gathered so far and decide whether they are enough to answer the request well. If they are not, name the gaps and choose at most {{max_calls}} tool calls that would fill them; the calls run in parallel, so none may need another's result.\n\nTools:\n{{tools}}\n\nNotes so far:\n{{notes}}\n\nReply with only a JSON object: {\"thought\": \"...\", \"complete\": false, \"gaps\": [\"...\"], \"calls\": [{\"tool\": \"...\", \"arguments\": {}}]}\n\nRequest to research: {{question}}";
pub const DEFAULT_DEEP_RESEARCH_WRITE_TEMPLATE: &str = "{{framing}}Write the answer to the request below from the research notes only. Cite the notes you use by their numbers, like [2], and say plainly what the notes leave unknown.{{lessons}}\n\nResearch notes:\n{{notes}}\n\nRequest to write up: {{question}}";

/// Synthesis. Placeholders: `framing`, `question`, `results`, `caveat`.
pub const DEFAULT_PLAN_SYNTHESISE_TEMPLATE: &str = "{{framing}}Answer the request below from the results of the plan's steps. Use only these results; say so if they are not enough.{{caveat}}\n\nResults:\n{{results}}\n\nRequest to answer: {{question}}";

/// The supervisor's system prompt used when config gives none.
pub const DEFAULT_SUPERVISOR_SYSTEM: &str =
    "You coordinate subagents: you split work into independent goals and combine what they find.";

/// Splitting. Placeholders: `framing`, `question`, `max_subagents`, `tools`, `patterns` (the ways a
/// subagent may work, a sentence).
pub const DEFAULT_SUPERVISOR_DECOMPOSE_TEMPLATE: &str = "{{framing}}Split the request below into at most {{max_subagents}} goals, each of which a subagent can pursue on its own. The subagents run in parallel. Only a goal that cannot be done without another goal's result names that goal in \"needs\" (by its id): its subagent then starts once those have finished, and is given their results. {{patterns}}\n\nTools the subagents can use:\n{{tools}}\n\nReply with only a JSON list: [{\"id\": \"g1\", \"goal\": \"...\", \"pattern\": \"react\", \"needs\": []}]\n\nRequest to split: {{question}}";

/// Combining. Placeholders: `framing`, `question`, `results`, `again` (the offer of another round of
/// subagents, empty when the limits leave no room for one).
pub const DEFAULT_SUPERVISOR_SYNTHESISE_TEMPLATE: &str = "{{framing}}Answer the request below from what the subagents found. Use only their results, say which goals failed, and do not invent what is missing.{{again}}\n\nResults by goal:\n{{results}}\n\nRequest to answer from the subagents: {{question}}";

/// The system prompt of a tool's LLM call; its user prompt is the tool's own (`{{prompt}}`).
pub const DEFAULT_TOOL_CALL_SYSTEM: &str = "You are a helpful assistant.";

/// A system and user prompt pair.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptTemplate {
    pub system: String,
    pub template: String,
}

impl PromptTemplate {
    fn new(system: &str, template: &str) -> PromptTemplate {
        PromptTemplate {
            system: system.to_owned(),
            template: template.to_owned(),
        }
    }
}

/// The prompt of every LLM call the orchestrator makes, so wording changes need no rebuild.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prompts {
    pub react: PromptTemplate,
    pub react_native: PromptTemplate,
    pub task_type_selection: PromptTemplate,
    pub pattern_selection: PromptTemplate,
    pub plan_create: PromptTemplate,
    pub plan_step: PromptTemplate,
    pub plan_revise: PromptTemplate,
    pub plan_evaluate: PromptTemplate,
    pub plan_review: PromptTemplate,
    pub answer_review: PromptTemplate,
    pub plan_synthesise: PromptTemplate,
    pub supervisor_decompose: PromptTemplate,
    pub supervisor_synthesise: PromptTemplate,
    pub tool_call: PromptTemplate,
    pub llm_router: PromptTemplate,
    pub reflexion_reflect: PromptTemplate,
    pub ensemble_reconcile: PromptTemplate,
    pub deep_research_round: PromptTemplate,
    pub deep_research_write: PromptTemplate,
}

impl Default for Prompts {
    fn default() -> Self {
        Prompts {
            react: PromptTemplate::new(DEFAULT_REACT_SYSTEM, DEFAULT_REACT_TEMPLATE),
            react_native: PromptTemplate::new(DEFAULT_REACT_SYSTEM, DEFAULT_REACT_NATIVE_TEMPLATE),
            task_type_selection: PromptTemplate::new(
                DEFAULT_ROUTING_SYSTEM,
                DEFAULT_TASK_TYPE_TEMPLATE,
            ),
            pattern_selection: PromptTemplate::new(
                DEFAULT_ROUTING_SYSTEM,
                DEFAULT_PATTERN_TEMPLATE,
            ),
            plan_create: PromptTemplate::new(DEFAULT_PLAN_SYSTEM, DEFAULT_PLAN_CREATE_TEMPLATE),
            plan_step: PromptTemplate::new(DEFAULT_PLAN_SYSTEM, DEFAULT_PLAN_STEP_TEMPLATE),
            plan_revise: PromptTemplate::new(DEFAULT_PLAN_SYSTEM, DEFAULT_PLAN_REVISE_TEMPLATE),
            plan_evaluate: PromptTemplate::new(
                DEFAULT_CRITIC_SYSTEM,
                DEFAULT_PLAN_EVALUATE_TEMPLATE,
            ),
            plan_review: PromptTemplate::new(DEFAULT_CRITIC_SYSTEM, DEFAULT_PLAN_REVIEW_TEMPLATE),
            answer_review: PromptTemplate::new(
                DEFAULT_CRITIC_SYSTEM,
                DEFAULT_ANSWER_REVIEW_TEMPLATE,
            ),
            plan_synthesise: PromptTemplate::new(
                DEFAULT_PLAN_SYSTEM,
                DEFAULT_PLAN_SYNTHESISE_TEMPLATE,
            ),
            supervisor_decompose: PromptTemplate::new(
                DEFAULT_SUPERVISOR_SYSTEM,
                DEFAULT_SUPERVISOR_DECOMPOSE_TEMPLATE,
            ),
            supervisor_synthesise: PromptTemplate::new(
                DEFAULT_SUPERVISOR_SYSTEM,
                DEFAULT_SUPERVISOR_SYNTHESISE_TEMPLATE,
            ),
            tool_call: PromptTemplate::new(DEFAULT_TOOL_CALL_SYSTEM, "{{prompt}}"),
            llm_router: PromptTemplate::new(DEFAULT_ROUTING_SYSTEM, DEFAULT_LLM_ROUTER_TEMPLATE),
            reflexion_reflect: PromptTemplate::new(
                DEFAULT_CRITIC_SYSTEM,
                DEFAULT_REFLEXION_REFLECT_TEMPLATE,
            ),
            ensemble_reconcile: PromptTemplate::new(
                DEFAULT_ENSEMBLE_SYSTEM,
                DEFAULT_ENSEMBLE_RECONCILE_TEMPLATE,
            ),
            deep_research_round: PromptTemplate::new(
                DEFAULT_DEEP_RESEARCH_SYSTEM,
                DEFAULT_DEEP_RESEARCH_ROUND_TEMPLATE,
            ),
            deep_research_write: PromptTemplate::new(
                DEFAULT_DEEP_RESEARCH_SYSTEM,
                DEFAULT_DEEP_RESEARCH_WRITE_TEMPLATE,
            ),
        }
    }
}

impl Prompts {
    /// The prompt stored under config key `key`, if the orchestrator makes such a call.
    pub fn slot(&mut self, key: &str) -> Option<&mut PromptTemplate> {
        match key {
            REACT_KEY => Some(&mut self.react),
            REACT_NATIVE_KEY => Some(&mut self.react_native),
            TASK_TYPE_SELECTION_KEY => Some(&mut self.task_type_selection),
            PATTERN_SELECTION_KEY => Some(&mut self.pattern_selection),
            PLAN_CREATE_KEY => Some(&mut self.plan_create),
            PLAN_STEP_KEY => Some(&mut self.plan_step),
            PLAN_REVISE_KEY => Some(&mut self.plan_revise),
            PLAN_EVALUATE_KEY => Some(&mut self.plan_evaluate),
            PLAN_REVIEW_KEY => Some(&mut self.plan_review),
            ANSWER_REVIEW_KEY => Some(&mut self.answer_review),
            PLAN_SYNTHESISE_KEY => Some(&mut self.plan_synthesise),
            SUPERVISOR_DECOMPOSE_KEY => Some(&mut self.supervisor_decompose),
            SUPERVISOR_SYNTHESISE_KEY => Some(&mut self.supervisor_synthesise),
            TOOL_CALL_KEY => Some(&mut self.tool_call),
            LLM_ROUTER_KEY => Some(&mut self.llm_router),
            REFLEXION_REFLECT_KEY => Some(&mut self.reflexion_reflect),
            ENSEMBLE_RECONCILE_KEY => Some(&mut self.ensemble_reconcile),
            DEEP_RESEARCH_ROUND_KEY => Some(&mut self.deep_research_round),
            DEEP_RESEARCH_WRITE_KEY => Some(&mut self.deep_research_write),
            _ => None,
        }
    }

    /// The config keys of every prompt.
    pub const KEYS: [&'static str; 19] = [
        REACT_KEY,
        REACT_NATIVE_KEY,
        TASK_TYPE_SELECTION_KEY,
        PATTERN_SELECTION_KEY,
        PLAN_CREATE_KEY,
        PLAN_STEP_KEY,
        PLAN_REVISE_KEY,
        PLAN_EVALUATE_KEY,
        PLAN_REVIEW_KEY,
        ANSWER_REVIEW_KEY,
        PLAN_SYNTHESISE_KEY,
        SUPERVISOR_DECOMPOSE_KEY,
        SUPERVISOR_SYNTHESISE_KEY,
        TOOL_CALL_KEY,
        LLM_ROUTER_KEY,
        REFLEXION_REFLECT_KEY,
        ENSEMBLE_RECONCILE_KEY,
        DEEP_RESEARCH_ROUND_KEY,
        DEEP_RESEARCH_WRITE_KEY,
    ];
}

/// Fills `{{name}}` placeholders in one pass, so a value that itself contains `{{...}}` (user text)
/// is never expanded again. Unknown placeholders are left as they are.
///
/// ```
/// let vars = [("q", "{{q}}".to_owned())].into_iter().collect();
/// assert_eq!(agent_core::prompt::render("Q: {{q}} {{x}}", &vars), "Q: {{q}} {{x}}");
/// ```
pub fn render(template: &str, vars: &BTreeMap<&str, String>) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        match after.find("}}") {
            Some(end) => {
                let name = after[..end].trim();
                match vars.get(name) {
                    Some(value) => out.push_str(value),
                    None => out.push_str(&rest[start..start + 2 + end + 2]),
                }
                rest = &after[end + 2..];
            }
            None => {
                out.push_str(&rest[start..]);
                rest = "";
            }
        }
    }
    out.push_str(rest);
    out
}

/// The tools as the LLM sees them: one line per tool with its arguments.
pub fn describe_tools(tools: &[ToolDef]) -> String {
    if tools.is_empty() {
        return "(no tools are available: answer directly)".to_owned();
    }
    tools
        .iter()
        .map(|t| {
            let args: Vec<String> = t
                .arguments
                .iter()
                .map(|a| format!("{} ({}): {}", a.name, a.kind, a.description))
                .collect();
            if args.is_empty() {
                format!("- {}: {}", t.name, t.description)
            } else {
                format!(
                    "- {}: {}\n  arguments: {}",
                    t.name,
                    t.description,
                    args.join("; ")
                )
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The history as a continued ReACT transcript.
pub fn render_history(history: &[AgentStep]) -> String {
    let mut out = String::new();
    for step in history {
        // A draft answer and the reviewer's verdict on it (the answer critic) read as what they are.
        match StepType::parse(&step.step_type) {
            Some(StepType::Synthesise) => {
                if !step.thought.is_empty() {
                    out.push_str(&format!("Thought: {}\n", step.thought));
                }
                out.push_str(&format!("Draft answer: {}\n", step.observation));
                continue;
            }
            Some(StepType::Reflect) => {
                out.push_str(&format!("Reflection: {}\n", step.observation));
                continue;
            }
            Some(StepType::Evaluate) => {
                let judged = if step.thought.is_empty() {
                    step.action.clone()
                } else {
                    format!("{} ({})", step.action, step.thought)
                };
                out.push_str(&format!(
                    "Review of the draft: {judged}; {}\n",
                    step.observation
                ));
                continue;
            }
            _ => {}
        }
        if !step.thought.is_empty() {
            out.push_str(&format!("Thought: {}\n", step.thought));
        }
        if !step.action.is_empty() {
            out.push_str(&format!("Action: {}\n", step.action));
            let args = serde_json::to_string(&step.arguments).unwrap_or_default();
            out.push_str(&format!("Args: {args}\n"));
        }
        out.push_str(&format!("Observation: {}\n", step.observation));
    }
    out
}

/// The framing as it opens a prompt: nothing, or the framing and a blank line.
pub fn framing_block(framing: &str) -> String {
    if framing.trim().is_empty() {
        String::new()
    } else {
        format!("{}\n\n", framing.trim())
    }
}

/// Renders the ReACT prompt for one iteration.
pub fn react_prompt(
    template: &PromptTemplate,
    question: &str,
    framing: &str,
    tools: &[ToolDef],
    history: &[AgentStep],
) -> (String, String) {
    let framing = framing_block(framing);
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    let vars: BTreeMap<&str, String> = [
        ("question", question.to_owned()),
        ("framing", framing),
        ("tools", describe_tools(tools)),
        ("tool_names", names.join(", ")),
        ("history", render_history(history)),
    ]
    .into_iter()
    .collect();
    (template.system.clone(), render(&template.template, &vars))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_is_rendered_as_a_transcript() {
        let step = AgentStep {
            thought: "look it up".into(),
            action: "llm".into(),
            arguments: [("question".to_owned(), "x?".to_owned())].into(),
            observation: "42".into(),
            ..AgentStep::default()
        };
        let (_, prompt) = react_prompt(&Prompts::default().react, "Q?", "", &[], &[step]);
        assert!(prompt.contains("Question: Q?\nThought: look it up\nAction: llm\nArgs: {\"question\":\"x?\"}\nObservation: 42\n"));
        assert!(prompt.contains("no tools are available"));
    }

    #[test]
    fn user_text_is_not_expanded_as_a_placeholder() {
        let (_, prompt) = react_prompt(&Prompts::default().react, "{{tools}}", "", &[], &[]);
        assert!(prompt.contains("Question: {{tools}}"));
    }
}
