//! Deep-research decision logic: reading a round's gap check and the tool calls it chose, the
//! notes the rounds gathered (numbered, for the writer to cite), and where a dialog stands.

use std::collections::BTreeMap;

use agent_schema::{AgentStep, StepType};

/// The most tool calls one round runs (in parallel).
pub const MAX_CALLS_PER_ROUND: usize = 4;
/// The most research rounds a dialog runs before it writes, whatever `max_iterations` allows.
pub const MAX_ROUNDS: usize = 5;

/// `action` of a round that ran calls, and of the round that judged the research complete.
pub const RESEARCH_ACTION: &str = "research";
pub const COMPLETE_ACTION: &str = "complete";
/// `arguments` key of a round: the calls it ran, as JSON.
pub const CALLS_KEY: &str = "calls";
/// `arguments` key of a round: the gaps it saw, as JSON.
pub const GAPS_KEY: &str = "gaps";

/// One tool call a round chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub tool: String,
    pub arguments: BTreeMap<String, String>,
}

/// What a round's LLM call decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Round {
    pub thought: String,
    /// The notes are enough to answer (or nothing more can be looked up).
    pub complete: bool,
    /// What is still unknown.
    pub gaps: Vec<String>,
    /// At most `max_calls`, run in parallel.
    pub calls: Vec<Call>,
    /// Calls it asked for beyond `max_calls`, dropped (said, not hidden).
    pub dropped: usize,
    /// Why the reply could not be read, when it could not (the research is then taken as
    /// complete: the writer answers from the notes there are).
    pub unreadable: Option<String>,
}

/// Reads a round's reply: a JSON object `{thought, complete, gaps, calls: [{tool, arguments}]}`.
/// A round with no calls is complete.
pub fn parse_round(text: &str, max_calls: usize) -> Round {
    let unreadable = |why: &str| Round {
        thought: String::new(),
        complete: true,
        gaps: Vec::new(),
        calls: Vec::new(),
        dropped: 0,
        unreadable: Some(why.to_owned()),
    };
    if !text.contains('{') {
        return unreadable("the reply holds no JSON object");
    }
    let Some(o) = crate::react::first_object_with(text, &["calls", "complete", "gaps", "thought"])
    else {
        return unreadable("the reply holds no JSON object of a round");
    };
    let gaps: Vec<String> = o
        .get("gaps")
        .and_then(|g| g.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|g| g.as_str().map(str::trim))
                .filter(|g| !g.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    let all: Vec<Call> = o
        .get("calls")
        .and_then(|c| c.as_array())
        .map(|list| {
            list.iter()
                .filter_map(|c| {
                    let tool = c.get("tool").and_then(|t| t.as_str())?.trim().to_owned();
                    if tool.is_empty() {
                        return None;
                    }
                    let arguments = c
                        .get("arguments")
                        .and_then(|a| a.as_object())
                        .map(|a| {
                            a.iter()
                                .map(|(k, v)| {
                                    let v = match v {
                                        serde_json::Value::String(s) => s.clone(),
                                        other => other.to_string(),
                                    };
                                    (k.clone(), v)
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    Some(Call { tool, arguments })
                })
                .collect()
        })
        .unwrap_or_default();
    let dropped = all.len().saturating_sub(max_calls);
    let calls: Vec<Call> = all.into_iter().take(max_calls).collect();
    let complete = calls.is_empty() || o.get("complete").and_then(|c| c.as_bool()) == Some(true);
    Round {
        thought: o
            .get("thought")
            .and_then(|t| t.as_str())
            .unwrap_or_default()
            .to_owned(),
        complete,
        calls: if complete { Vec::new() } else { calls },
        gaps,
        dropped,
        unreadable: None,
    }
}

fn rounds(history: &[AgentStep]) -> impl Iterator<Item = &AgentStep> {
    history
        .iter()
        .filter(|s| StepType::parse(&s.step_type) == Some(StepType::Research))
}

/// Rounds that ran calls so far.
pub fn rounds_done(history: &[AgentStep]) -> usize {
    rounds(history)
        .filter(|s| s.action == RESEARCH_ACTION)
        .count()
}

/// Whether the last step judged the research complete: the writer's turn.
pub fn research_complete(history: &[AgentStep]) -> bool {
    history.last().is_some_and(|s| {
        StepType::parse(&s.step_type) == Some(StepType::Research) && s.action == COMPLETE_ACTION
    })
}

/// The notes so far, one per call, numbered across rounds (`[k] tool(arguments): result`), as the
/// round and the writer prompts show them.
pub fn notes(history: &[AgentStep]) -> String {
    let lines: Vec<&str> = rounds(history)
        .filter(|s| s.action == RESEARCH_ACTION)
        .flat_map(|s| s.observation.lines())
        .filter(|l| !l.trim().is_empty())
        .collect();
    if lines.is_empty() {
        "(no notes yet)".to_owned()
    } else {
        lines.join("\n")
    }
}

/// How many notes the rounds so far hold: the next note's number is one more.
pub fn notes_taken(history: &[AgentStep]) -> usize {
    rounds(history)
        .filter(|s| s.action == RESEARCH_ACTION)
        .map(|s| s.arguments.get(CALLS_KEY).map_or(0, |c| count_calls(c)))
        .sum()
}

fn count_calls(json: &str) -> usize {
    serde_json::from_str::<Vec<serde_json::Value>>(json).map_or(0, |v| v.len())
}

/// One note: its number, the call and what it returned, on one line (newlines in the result
/// flattened, so notes stay one per line).
pub fn note(number: usize, call: &Call, result: &str) -> String {
    let arguments = serde_json::to_string(&call.arguments).unwrap_or_default();
    let flat = result.split_whitespace().collect::<Vec<_>>().join(" ");
    format!("[{number}] {}({arguments}): {flat}", call.tool)
}

/// The calls as a round's `arguments` keep them.
pub fn calls_json(calls: &[Call]) -> String {
    let list: Vec<serde_json::Value> = calls
        .iter()
        .map(|c| serde_json::json!({"tool": c.tool, "arguments": c.arguments}))
        .collect();
    serde_json::Value::Array(list).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_is_read_bounded_and_a_round_without_calls_is_complete() {
        let round = parse_round(
            r#"Plan: {"thought": "two gaps", "complete": false, "gaps": ["alpha", " "],
               "calls": [{"tool": "search", "arguments": {"q": "alpha", "n": 3}},
                         {"tool": "search", "arguments": {"q": "beta"}},
                         {"tool": "", "arguments": {}},
                         {"tool": "llm", "arguments": {"question": "gamma"}}]}"#,
            2,
        );
        assert!(!round.complete);
        assert_eq!(round.gaps, ["alpha"]);
        assert_eq!(round.calls.len(), 2);
        assert_eq!(round.dropped, 1);
        assert_eq!(
            round.calls[0].arguments.get("n").map(String::as_str),
            Some("3")
        );
        assert!(parse_round(r#"{"complete": false, "calls": []}"#, 2).complete);
        assert!(
            parse_round(r#"{"complete": true, "calls": [{"tool": "x"}]}"#, 2)
                .calls
                .is_empty()
        );
        // An object of the round after prose that holds braces is still read.
        let after_braces = parse_round(
            r#"Looking at {alpha}: {"complete": false, "calls": [{"tool": "search", "arguments": {}}]}"#,
            2,
        );
        assert!(!after_braces.complete && after_braces.unreadable.is_none());
        assert_eq!(after_braces.calls.len(), 1);
        let unreadable = parse_round("no idea", 2);
        assert!(unreadable.complete && unreadable.unreadable.is_some());
    }

    #[test]
    fn notes_are_numbered_across_rounds() {
        let call = Call {
            tool: "search".into(),
            arguments: [("q".to_owned(), "alpha".to_owned())].into(),
        };
        let round = |notes: &[String], calls: &[Call]| AgentStep {
            action: RESEARCH_ACTION.into(),
            arguments: [(CALLS_KEY.to_owned(), calls_json(calls))].into(),
            observation: notes.join("\n"),
            step_type: StepType::Research.as_str().into(),
            ..AgentStep::default()
        };
        assert_eq!(notes(&[]), "(no notes yet)");
        let first = note(1, &call, "alpha\ncosts 3");
        assert_eq!(first, "[1] search({\"q\":\"alpha\"}): alpha costs 3");
        let history = vec![round(
            std::slice::from_ref(&first),
            std::slice::from_ref(&call),
        )];
        assert_eq!(notes_taken(&history), 1);
        assert_eq!(rounds_done(&history), 1);
        assert!(!research_complete(&history));
        let mut done = history.clone();
        done.push(AgentStep {
            action: COMPLETE_ACTION.into(),
            step_type: StepType::Research.as_str().into(),
            ..AgentStep::default()
        });
        assert!(research_complete(&done));
        assert_eq!(notes(&done), first);
    }
}
