//! The meta-router's decision logic: which task type a request is, then which pattern works on it.
//! The LLM only ever chooses among candidates that config defines; anything else it says is
//! rejected and a recorded fallback is used, so a run is never steered outside configuration.

use std::collections::BTreeMap;

use crate::config::{AgentConfig, TaskTypeDef, GENERAL};
use crate::pattern::Pattern;
use crate::prompt::{render, PromptTemplate};

/// Longest LLM text kept in a decision record (the rationale and the raw answer).
const MAX_RECORDED_CHARS: usize = 2000;

/// One option put to the LLM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub name: String,
    pub description: String,
}

/// How a choice was made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Method {
    /// The LLM chose a candidate.
    Llm,
    /// There was one candidate, so no LLM call was made.
    OnlyCandidate,
    /// The request named it.
    Requested,
    /// The LLM's answer was unusable; the reason says why, and the fallback was taken.
    Fallback(String),
}

impl Method {
    /// The method as recorded in provenance.
    pub fn as_str(&self) -> &'static str {
        match self {
            Method::Llm => "llm",
            Method::OnlyCandidate => "only-candidate",
            Method::Requested => "requested",
            Method::Fallback(_) => "fallback",
        }
    }
}

/// One constrained choice and everything needed to audit it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    /// The names the choice was made among, in the order they were offered.
    pub candidates: Vec<String>,
    pub selected: String,
    pub method: Method,
    /// The LLM's reason (empty when no LLM chose).
    pub rationale: String,
    /// What the LLM said, kept when it was not a usable choice.
    pub raw_answer: Option<String>,
}

/// The meta-router's whole decision for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub task_type: Choice,
    pub pattern: Choice,
    /// Patterns the task type allows that this orchestrator cannot run, so were not offered.
    pub unavailable_patterns: Vec<String>,
    /// The framing the dialog runs with.
    pub framing: String,
}

/// The task types offered for a request, by name with their descriptions.
pub fn task_type_candidates(task_types: &[TaskTypeDef]) -> Vec<Candidate> {
    task_types
        .iter()
        .map(|t| Candidate {
            name: t.name.clone(),
            description: describe_task_type(t),
        })
        .collect()
}

/// A task type as the meta-router is shown it: its description, then when to use it and examples,
/// each on its own indented line.
fn describe_task_type(task_type: &TaskTypeDef) -> String {
    let mut text = task_type.description.trim().to_owned();
    if !task_type.when_to_use.trim().is_empty() {
        text.push_str(&format!(
            "\n  Use it when: {}",
            task_type.when_to_use.trim()
        ));
    }
    let examples: Vec<String> = task_type
        .examples
        .iter()
        .filter(|e| !e.trim().is_empty())
        .map(|e| format!("\"{}\"", e.trim()))
        .collect();
    if !examples.is_empty() {
        text.push_str(&format!("\n  For example: {}", examples.join("; ")));
    }
    text
}

/// The fallback among task types: `general` when offered, else the first.
pub fn fallback_task_type(candidates: &[Candidate]) -> String {
    candidates
        .iter()
        .find(|c| c.name == GENERAL)
        .or_else(|| candidates.first())
        .map(|c| c.name.clone())
        .unwrap_or_else(|| GENERAL.to_owned())
}

/// The patterns offered for `task_type`: its `valid_patterns` that this orchestrator runs, in the
/// task type's order, and separately those it cannot run.
pub fn pattern_candidates(
    config: &AgentConfig,
    task_type: &TaskTypeDef,
) -> (Vec<Candidate>, Vec<String>) {
    let mut runnable = Vec::new();
    let mut unavailable = Vec::new();
    for name in &task_type.valid_patterns {
        // With no fan-out depth allowed, a supervisor or an ensemble could not do what its name
        // says.
        let pattern = Pattern::from_name(name);
        let fans_out_unallowed =
            pattern.is_some_and(Pattern::fans_out) && config.limits.max_fanout_depth == 0;
        if let Some(pattern) = pattern.filter(|_| !fans_out_unallowed) {
            let description = config
                .patterns
                .get(name)
                .map(|p| p.description.clone())
                .unwrap_or_else(|| pattern.description().to_owned());
            runnable.push(Candidate {
                name: name.clone(),
                description,
            });
        } else {
            unavailable.push(name.clone());
        }
    }
    (runnable, unavailable)
}

/// The prompt asking which task type `question` is.
pub fn task_type_prompt(
    template: &PromptTemplate,
    question: &str,
    candidates: &[Candidate],
) -> (String, String) {
    let vars = choice_vars(question, candidates);
    (template.system.clone(), render(&template.template, &vars))
}

/// The prompt asking which pattern to work on `question` with, as a task of `task_type`.
pub fn pattern_prompt(
    template: &PromptTemplate,
    question: &str,
    task_type: &TaskTypeDef,
    candidates: &[Candidate],
) -> (String, String) {
    let mut vars = choice_vars(question, candidates);
    vars.insert("task_type", task_type.name.clone());
    vars.insert("task_type_description", task_type.description.clone());
    (template.system.clone(), render(&template.template, &vars))
}

fn choice_vars<'a>(question: &str, candidates: &[Candidate]) -> BTreeMap<&'a str, String> {
    let lines: Vec<String> = candidates
        .iter()
        .map(|c| {
            if c.description.is_empty() {
                format!("- {}", c.name)
            } else {
                format!("- {}: {}", c.name, c.description)
            }
        })
        .collect();
    let names: Vec<&str> = candidates.iter().map(|c| c.name.as_str()).collect();
    [
        ("question", question.to_owned()),
        ("candidates", lines.join("\n")),
        ("candidate_names", names.join(", ")),
    ]
    .into_iter()
    .collect()
}

/// What the LLM-as-router may hand a request to: a tool (`tool:<name>`) or another pattern this
/// orchestrator runs (`pattern:<name>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dispatch {
    Tool(String),
    Pattern(Pattern),
}

impl Dispatch {
    /// The candidate's name, as offered and recorded.
    pub fn name(&self) -> String {
        match self {
            Dispatch::Tool(tool) => format!("tool:{tool}"),
            Dispatch::Pattern(pattern) => format!("pattern:{}", pattern.name()),
        }
    }

    /// The dispatch a candidate name stands for.
    pub fn parse(name: &str) -> Option<Dispatch> {
        if let Some(tool) = name.strip_prefix("tool:") {
            return Some(Dispatch::Tool(tool.to_owned()));
        }
        let pattern = Pattern::from_name(name.strip_prefix("pattern:")?)?;
        (pattern != Pattern::LlmRouter).then_some(Dispatch::Pattern(pattern))
    }
}

/// The LLM-as-router's candidates: the tools the request may use, then the patterns config
/// defines that this orchestrator runs (not itself), each with what it does. Patterns that fan
/// out are offered only where the request `may_fan_out` (within `max_fanout_depth`): chosen past
/// it, they would run as ReACT while the graph recorded them as chosen.
pub fn dispatch_candidates(
    config: &AgentConfig,
    tools: &[crate::tools::ToolDef],
    may_fan_out: bool,
) -> Vec<Candidate> {
    let tools = tools.iter().map(|t| Candidate {
        name: Dispatch::Tool(t.name.clone()).name(),
        description: t.description.clone(),
    });
    let patterns = Pattern::ALL
        .into_iter()
        .filter(|p| *p != Pattern::LlmRouter)
        .filter(|p| may_fan_out || !p.fans_out())
        .filter(|p| config.patterns.is_empty() || config.patterns.contains_key(p.name()))
        .map(|p| Candidate {
            name: Dispatch::Pattern(p).name(),
            description: config
                .patterns
                .get(p.name())
                .map_or(p.description().to_owned(), |d| d.description.clone()),
        });
    tools.chain(patterns).collect()
}

/// The prompt of the LLM-as-router's choice.
pub fn dispatch_prompt(
    template: &PromptTemplate,
    question: &str,
    framing: &str,
    candidates: &[Candidate],
) -> (String, String) {
    let mut vars = choice_vars(question, candidates);
    vars.insert("framing", crate::prompt::framing_block(framing));
    (template.system.clone(), render(&template.template, &vars))
}

/// The tool arguments an answer gives (`arguments`, a JSON object of strings; other values are
/// kept as their JSON text), if any.
pub fn dispatch_arguments(text: &str) -> BTreeMap<String, String> {
    // The answer's object, wherever it stands: read from the first `{` to the last `}`, a brace
    // in the prose after it (`computes {2+2}`) left the tool to run with no arguments at all.
    let Some(object) = crate::react::first_object_with(text, &["arguments"]) else {
        return BTreeMap::new();
    };
    let Some(arguments) = object.get("arguments").and_then(|a| a.as_object()) else {
        return BTreeMap::new();
    };
    arguments
        .iter()
        .map(|(k, v)| {
            let value = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            (k.clone(), value)
        })
        .collect()
}

/// A choice made without the LLM: the only candidate, or the one the request named.
pub fn without_llm(candidates: &[Candidate], selected: &str, method: Method) -> Choice {
    Choice {
        candidates: names(candidates),
        selected: selected.to_owned(),
        method,
        rationale: String::new(),
        raw_answer: None,
    }
}

/// Reads the LLM's answer (`Err` when the call itself failed) and keeps its choice only when it is
/// one of `candidates`; otherwise `fallback` is selected and the reason recorded.
pub fn decide(answer: Result<&str, String>, candidates: &[Candidate], fallback: &str) -> Choice {
    let fallback_choice = |reason: String, raw: Option<&str>| Choice {
        candidates: names(candidates),
        selected: fallback.to_owned(),
        method: Method::Fallback(reason),
        rationale: String::new(),
        raw_answer: raw.map(clip),
    };
    let text = match answer {
        Ok(text) => text,
        Err(e) => return fallback_choice(format!("the LLM call failed: {e}"), None),
    };
    let (said, rationale) = read_answer(text);
    let Some(said) = said else {
        return fallback_choice("the answer names no choice".to_owned(), Some(text));
    };
    let normalised = normalise(&said);
    match candidates.iter().find(|c| normalise(&c.name) == normalised) {
        Some(c) => Choice {
            candidates: names(candidates),
            selected: c.name.clone(),
            method: Method::Llm,
            rationale: clip(&rationale),
            raw_answer: None,
        },
        None => fallback_choice(
            format!("'{}' is not one of the candidates", clip(&said)),
            Some(text),
        ),
    }
}

fn names(candidates: &[Candidate]) -> Vec<String> {
    candidates.iter().map(|c| c.name.clone()).collect()
}

fn clip(text: &str) -> String {
    text.trim().chars().take(MAX_RECORDED_CHARS).collect()
}

/// Compares names the way a person would: case, surrounding quotes, markup and a final full stop
/// do not matter; `_` and spaces read as `-`.
fn normalise(name: &str) -> String {
    name.trim()
        .trim_matches(|c: char| matches!(c, '"' | '\'' | '`' | '*' | '.' | '<' | '>'))
        .trim()
        .to_lowercase()
        .replace(['_', ' '], "-")
}

/// The choice and the rationale in an answer: a JSON object (`choice`, `rationale`, possibly in a
/// code fence or with text around it), `Choice:`/`Rationale:` lines, or a bare name.
fn read_answer(text: &str) -> (Option<String>, String) {
    if let Some(found) = json_answer(text) {
        return found;
    }
    let mut choice = None;
    let mut rationale = String::new();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key.trim().trim_matches('*').to_lowercase().as_str() {
            "choice" | "task type" | "task_type" | "pattern" => {
                choice.get_or_insert_with(|| value.to_owned());
            }
            "rationale" | "reason" => value.clone_into(&mut rationale),
            _ => {}
        }
    }
    if choice.is_some() {
        return (choice, rationale);
    }
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().map(str::to_owned);
    // A bare name is one short line; prose is not a choice.
    let bare = first.filter(|l| l.split_whitespace().count() <= 3);
    (bare, lines.collect::<Vec<_>>().join(" "))
}

fn json_answer(text: &str) -> Option<(Option<String>, String)> {
    // The first object that names a choice: prose (or a `<think>` block) with braces before or
    // after it made the text from the first `{` to the last `}` unreadable, and the router fell
    // back to its default.
    let object = crate::react::first_object_with(text, &["choice", "task_type", "pattern"])?;
    let object = &object;
    let field = |keys: &[&str]| {
        keys.iter()
            .find_map(|k| object.get(*k).and_then(|v| v.as_str()))
            .map(str::to_owned)
    };
    let choice = field(&["choice", "task_type", "pattern"]);
    let rationale = field(&["rationale", "reason", "why"]).unwrap_or_default();
    Some((choice, rationale))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A choice with braces in the prose around it: before, the text from the first `{` to the
    /// last `}` did not parse, the router fell back to its default and a dispatched tool ran
    /// with no arguments.
    #[test]
    fn a_choice_with_braces_in_the_prose_around_it_is_read() {
        let (choice, rationale) = read_answer(
            "{\"choice\":\"research\",\"rationale\":\"facts\"}\nI did not pick {general}.",
        );
        assert_eq!(
            (choice.as_deref(), rationale.as_str()),
            (Some("research"), "facts")
        );
        let (choice, _) = read_answer("<think>{maybe}</think> {\"choice\": \"general\"}");
        assert_eq!(choice.as_deref(), Some("general"));
        let arguments = dispatch_arguments(
            "{\"choice\":\"tool:calc\",\"arguments\":{\"expr\":\"2+2\"}} computes {2+2}",
        );
        assert_eq!(arguments.get("expr").map(String::as_str), Some("2+2"));
    }

    fn candidates(names: &[&str]) -> Vec<Candidate> {
        names
            .iter()
            .map(|n| Candidate {
                name: (*n).to_owned(),
                description: format!("about {n}"),
            })
            .collect()
    }

    #[test]
    fn the_llm_router_offers_tools_and_other_patterns_and_reads_their_names_back() {
        let config = AgentConfig::default();
        let tool: crate::tools::ToolDef = serde_json::from_value(serde_json::json!(
            {"type": "text-completion", "name": "llm", "description": "ask"}
        ))
        .unwrap_or_else(|e| panic!("{e}"));
        let offered = |may_fan_out: bool| -> Vec<String> {
            dispatch_candidates(&config, std::slice::from_ref(&tool), may_fan_out)
                .into_iter()
                .map(|c| c.name)
                .collect()
        };
        assert_eq!(
            offered(true),
            [
                "tool:llm",
                "pattern:react",
                "pattern:plan-then-execute",
                "pattern:supervisor",
                "pattern:reflexion",
                "pattern:ensemble",
                "pattern:deep-research"
            ]
        );
        // Past the fan-out depth, no pattern that fans out is offered.
        assert_eq!(
            offered(false),
            [
                "tool:llm",
                "pattern:react",
                "pattern:plan-then-execute",
                "pattern:reflexion",
                "pattern:deep-research"
            ]
        );
        assert_eq!(
            Dispatch::parse("tool:llm"),
            Some(Dispatch::Tool("llm".into()))
        );
        assert_eq!(
            Dispatch::parse("pattern:react"),
            Some(Dispatch::Pattern(Pattern::React))
        );
        assert_eq!(Dispatch::parse("pattern:llm-router"), None, "never itself");
        assert_eq!(Dispatch::parse("react"), None);
        let answer =
            r#"{"choice": "tool:llm", "rationale": "r", "arguments": {"question": "q", "n": 2}}"#;
        let arguments = dispatch_arguments(answer);
        assert_eq!(arguments.get("question").map(String::as_str), Some("q"));
        assert_eq!(arguments.get("n").map(String::as_str), Some("2"));
        assert!(dispatch_arguments("tool:llm").is_empty());
    }

    #[test]
    fn a_json_answer_among_the_candidates_is_taken_with_its_rationale() {
        let c = candidates(&["general", "research"]);
        let choice = decide(
            Ok("```json\n{\"choice\": \"Research\", \"rationale\": \"asks for sources\"}\n```"),
            &c,
            "general",
        );
        assert_eq!(choice.selected, "research");
        assert_eq!(choice.method, Method::Llm);
        assert_eq!(choice.rationale, "asks for sources");
        assert_eq!(choice.candidates, ["general", "research"]);
    }

    #[test]
    fn line_and_bare_answers_are_read() {
        let c = candidates(&["risk-assessment", "general"]);
        let lines = decide(
            Ok("Choice: risk assessment\nRationale: names a hazard"),
            &c,
            "general",
        );
        assert_eq!(lines.selected, "risk-assessment");
        assert_eq!(lines.rationale, "names a hazard");
        let bare = decide(Ok("`risk_assessment`."), &c, "general");
        assert_eq!(bare.selected, "risk-assessment");
    }

    #[test]
    fn anything_outside_the_candidates_falls_back_and_says_why() {
        let c = candidates(&["react"]);
        for (answer, why) in [
            (
                Ok("{\"choice\": \"supervisor\"}"),
                "not one of the candidates",
            ),
            (Ok("I think you should just answer it."), "names no choice"),
            (Ok("{\"rationale\": \"no choice here\"}"), "names no choice"),
            (Ok(""), "names no choice"),
            (Err("HTTP 500".to_owned()), "the LLM call failed"),
        ] {
            let choice = decide(answer.as_deref().map_err(Clone::clone), &c, "react");
            assert_eq!(choice.selected, "react");
            match &choice.method {
                Method::Fallback(reason) => assert!(reason.contains(why), "{reason}"),
                other => panic!("expected a fallback, got {other:?}"),
            }
        }
    }

    #[test]
    fn general_is_the_preferred_task_type_fallback() {
        assert_eq!(
            fallback_task_type(&candidates(&["a", "general"])),
            "general"
        );
        assert_eq!(fallback_task_type(&candidates(&["a", "b"])), "a");
        assert_eq!(fallback_task_type(&[]), "general");
    }

    #[test]
    fn the_router_is_shown_when_to_use_a_task_type_and_examples() {
        let task = TaskTypeDef {
            name: "general".into(),
            description: "Anything else.".into(),
            when_to_use: "calculations and short factual questions".into(),
            examples: vec!["What is 17 times 23?".into()],
            framing: String::new(),
            valid_patterns: vec!["react".into()],
            critic: Vec::new(),
        };
        let candidates = task_type_candidates(&[task]);
        let (_, user) = task_type_prompt(
            &crate::prompt::Prompts::default().task_type_selection,
            "Add 2 and 3",
            &candidates,
        );
        assert!(user.contains("- general: Anything else.\n  Use it when: calculations and short factual questions\n  For example: \"What is 17 times 23?\""), "{user}");
    }

    #[test]
    fn only_implemented_patterns_are_offered() {
        let task = TaskTypeDef {
            name: "research".into(),
            description: "d".into(),
            when_to_use: String::new(),
            examples: Vec::new(),
            framing: String::new(),
            valid_patterns: vec!["negotiator".into(), "react".into()],
            critic: Vec::new(),
        };
        let (runnable, unavailable) = pattern_candidates(&AgentConfig::default(), &task);
        assert_eq!(names(&runnable), ["react"]);
        assert_eq!(unavailable, ["negotiator"]);
        let task = TaskTypeDef {
            valid_patterns: vec!["plan-then-execute".into(), "react".into()],
            ..task
        };
        let (runnable, _) = pattern_candidates(&AgentConfig::default(), &task);
        assert_eq!(names(&runnable), ["plan-then-execute", "react"]);
    }

    #[test]
    fn prompts_list_the_candidates_and_keep_user_text_literal() {
        let prompts = crate::prompt::Prompts::default();
        let (_, user) = task_type_prompt(
            &prompts.task_type_selection,
            "{{candidates}}?",
            &candidates(&["general", "research"]),
        );
        assert!(user.contains("- general: about general\n- research: about research"));
        assert!(user.contains("one of: general, research"));
        assert!(user.ends_with("{{candidates}}?"));
    }
}
