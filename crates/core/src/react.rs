//! The ReACT text protocol (TrustGraph's `Thought/Action/Args` or `Thought/Final Answer`), parsed
//! incrementally so thoughts and answers can be streamed while the LLM is still writing.

use std::collections::BTreeMap;

/// What the LLM decided in one ReACT turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReactTurn {
    /// Call a tool.
    Action {
        thought: String,
        action: String,
        arguments: BTreeMap<String, String>,
    },
    /// Answer and end the dialog.
    Final { thought: String, answer: String },
}

/// Why an LLM answer does not follow the protocol; it becomes an `Error: ...` observation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReactParseError {
    #[error("the response has neither an 'Action:' nor a 'Final Answer:' line")]
    NoDecision,
    #[error("the 'Action:' line names no tool")]
    EmptyAction,
    #[error("'Args:' is not a JSON object: {0}")]
    BadArgs(String),
}

/// A piece of text to stream to the client as soon as it is certain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReactDelta {
    Thought(String),
    Answer(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Section {
    Thought,
    Action,
    Args,
    Answer,
}

const MARKERS: [(&str, Section); 5] = [
    ("Thought:", Section::Thought),
    ("Action:", Section::Action),
    ("Args:", Section::Args),
    ("Action Input:", Section::Args),
    ("Final Answer:", Section::Answer),
];

/// Section texts of a (possibly incomplete) response. `complete` is false while the text may still grow.
#[derive(Debug, Default)]
struct Sections {
    thought: Option<String>,
    action: Option<String>,
    args: Option<String>,
    answer: Option<String>,
    /// Bytes at the end that may be the start of a marker, held back while streaming.
    held_back: bool,
}

fn split_sections(text: &str, complete: bool) -> Sections {
    let mut sections = Sections::default();
    let mut current: Option<(Section, String)> = None;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        let is_last = lines.peek().is_none();
        let trimmed = line.trim_start();
        // Once the answer has started, everything after it belongs to the answer.
        let in_answer = matches!(current, Some((Section::Answer, _)));
        let marker = if in_answer {
            None
        } else {
            MARKERS
                .iter()
                .find(|(m, _)| trimmed.starts_with(m))
                .map(|(m, s)| (*s, &trimmed[m.len()..]))
        };
        if let Some((section, rest)) = marker {
            store(&mut sections, current.take());
            current = Some((section, rest.trim_start_matches([' ', '\t']).to_owned()));
            continue;
        }
        if !complete && is_last && !line.ends_with('\n') && !in_answer {
            // An unfinished line that could still become a marker is not yet content.
            let could_be_marker = MARKERS
                .iter()
                .any(|(m, _)| m.starts_with(trimmed) || trimmed.is_empty());
            if could_be_marker {
                sections.held_back = true;
                break;
            }
        }
        match current.as_mut() {
            Some((_, body)) => body.push_str(line),
            // Text before any marker is thought, as TrustGraph reads it.
            None => current = Some((Section::Thought, line.to_owned())),
        }
    }
    store(&mut sections, current);
    sections
}

fn store(sections: &mut Sections, current: Option<(Section, String)>) {
    let Some((section, body)) = current else {
        return;
    };
    let slot = match section {
        Section::Thought => &mut sections.thought,
        Section::Action => &mut sections.action,
        Section::Args => &mut sections.args,
        Section::Answer => &mut sections.answer,
    };
    match slot {
        Some(existing) => existing.push_str(&body),
        None => *slot = Some(body),
    }
}

/// Parses a complete ReACT response.
///
/// ```
/// use agent_core::react::{parse, ReactTurn};
/// let turn = parse("Thought: add\nAction: calc\nArgs: {\"expr\": \"1+1\"}").unwrap();
/// assert!(matches!(turn, ReactTurn::Action { ref action, .. } if action == "calc"));
/// ```
pub fn parse(text: &str) -> Result<ReactTurn, ReactParseError> {
    let sections = split_sections(text, true);
    let thought = sections.thought.unwrap_or_default().trim().to_owned();
    if let Some(answer) = sections.answer {
        return Ok(ReactTurn::Final {
            thought,
            answer: answer.trim().to_owned(),
        });
    }
    let Some(action) = sections.action else {
        return Err(ReactParseError::NoDecision);
    };
    let action = action.trim().trim_matches('`').trim().to_owned();
    if action.is_empty() {
        return Err(ReactParseError::EmptyAction);
    }
    let arguments = match sections.args {
        Some(args) => parse_args(&args)?,
        None => BTreeMap::new(),
    };
    Ok(ReactTurn::Action {
        thought,
        action,
        arguments,
    })
}

/// Reads the `Args:` JSON object; non-string values are kept as their JSON text because the wire
/// carries arguments as `{str: str}`.
fn parse_args(text: &str) -> Result<BTreeMap<String, String>, ReactParseError> {
    let text = strip_code_fence(text.trim());
    if text.is_empty() {
        return Ok(BTreeMap::new());
    }
    let value = first_json_value(text)
        .ok_or_else(|| ReactParseError::BadArgs("no JSON object".into()))?
        .map_err(|e| ReactParseError::BadArgs(e.to_string()))?;
    let serde_json::Value::Object(map) = value else {
        return Err(ReactParseError::BadArgs(format!(
            "expected an object, got {value}"
        )));
    };
    Ok(map
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (k, v)
        })
        .collect())
}

/// The first JSON value in `text` from its start: models often go on writing after it, and only it
/// counts. `None` when `text` holds no value at all.
pub(crate) fn first_json_value(text: &str) -> Option<Result<serde_json::Value, serde_json::Error>> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<serde_json::Value>()
        .next()
}

fn strip_code_fence(text: &str) -> &str {
    let Some(inner) = text.strip_prefix("```") else {
        return text;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.strip_suffix("```").unwrap_or(inner).trim()
}

/// Feeds streamed chunks and yields the thought and answer text as soon as it is certain.
///
/// ```
/// use agent_core::react::{ReactDelta, ReactStream};
/// let mut stream = ReactStream::default();
/// let mut deltas = stream.push("Thought: hmm\nFinal Ans");
/// deltas.extend(stream.push("wer: 42"));
/// deltas.extend(stream.finish());
/// assert_eq!(deltas, vec![ReactDelta::Thought("hmm".into()), ReactDelta::Answer("42".into())]);
/// ```
#[derive(Debug, Default)]
pub struct ReactStream {
    text: String,
    thought_sent: usize,
    answer_sent: usize,
}

impl ReactStream {
    pub fn push(&mut self, chunk: &str) -> Vec<ReactDelta> {
        self.text.push_str(chunk);
        self.deltas(false)
    }

    /// Flushes what was held back at the end of the stream.
    pub fn finish(&mut self) -> Vec<ReactDelta> {
        self.deltas(true)
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// True once any thought text has been streamed.
    pub fn thought_started(&self) -> bool {
        self.thought_sent > 0
    }

    fn deltas(&mut self, complete: bool) -> Vec<ReactDelta> {
        let sections = split_sections(&self.text, complete);
        let mut out = Vec::new();
        if let Some(thought) = &sections.thought {
            // Trailing whitespace may turn out to end the thought; it is sent only once text follows it.
            let certain = thought.trim_start().trim_end();
            if let Some(delta) = certain.get(self.thought_sent..) {
                if !delta.is_empty() {
                    out.push(ReactDelta::Thought(delta.to_owned()));
                    self.thought_sent = certain.len();
                }
            }
        }
        if let Some(answer) = &sections.answer {
            let answer = answer.trim_start();
            let certain = answer.trim_end();
            if let Some(delta) = certain.get(self.answer_sent..) {
                if !delta.is_empty() {
                    out.push(ReactDelta::Answer(delta.to_owned()));
                    self.answer_sent = certain.len();
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream_all(chunks: &[&str]) -> (Vec<ReactDelta>, String) {
        let mut s = ReactStream::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(s.push(c));
        }
        out.extend(s.finish());
        (out, s.text().to_owned())
    }

    fn joined(deltas: &[ReactDelta], want_answer: bool) -> String {
        deltas
            .iter()
            .filter_map(|d| match (d, want_answer) {
                (ReactDelta::Thought(t), false) => Some(t.as_str()),
                (ReactDelta::Answer(a), true) => Some(a.as_str()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn parses_action_with_multiline_args() {
        let turn = parse("Thought: I need to call the tool (step 1)\nAction: llm\nArgs: {\n  \"question\": \"step 1\"\n}").unwrap();
        assert_eq!(
            turn,
            ReactTurn::Action {
                thought: "I need to call the tool (step 1)".into(),
                action: "llm".into(),
                arguments: [("question".to_owned(), "step 1".to_owned())].into(),
            }
        );
    }

    #[test]
    fn parses_final_answer_with_colons_and_markers_inside() {
        let turn = parse("Thought: done\nFinal Answer: Result:\nAction: none, it is 42.").unwrap();
        assert_eq!(
            turn,
            ReactTurn::Final {
                thought: "done".into(),
                answer: "Result:\nAction: none, it is 42.".into()
            }
        );
    }

    #[test]
    fn non_string_args_keep_their_json_text() {
        let turn = parse("Action: calc\nArgs: ```json\n{\"n\": 3, \"deep\": [1]}\n```").unwrap();
        let ReactTurn::Action { arguments, .. } = turn else {
            panic!("expected action")
        };
        assert_eq!(arguments["n"], "3");
        assert_eq!(arguments["deep"], "[1]");
    }

    #[test]
    fn text_after_the_args_object_is_ignored() {
        let turn = parse(
            "Action: llm\nArgs: {\"question\": \"x\"} and then I will see\nObservation: made up",
        )
        .unwrap();
        let ReactTurn::Action { arguments, .. } = turn else {
            panic!("expected action")
        };
        assert_eq!(arguments["question"], "x");
    }

    #[test]
    fn rejects_text_without_decision_and_bad_args() {
        assert_eq!(
            parse("I am just chatting"),
            Err(ReactParseError::NoDecision)
        );
        assert_eq!(
            parse("Thought: x\nAction:   \n"),
            Err(ReactParseError::EmptyAction)
        );
        assert!(matches!(
            parse("Action: t\nArgs: {not json"),
            Err(ReactParseError::BadArgs(_))
        ));
        assert!(matches!(
            parse("Action: t\nArgs: [1]"),
            Err(ReactParseError::BadArgs(_))
        ));
    }

    #[test]
    fn streaming_splits_anywhere_give_the_same_text() {
        let text =
            "Thought: I should look\nthis up carefully\nFinal Answer: It is\n42: the answer.\n";
        let expected_thought = "I should look\nthis up carefully";
        let expected_answer = "It is\n42: the answer.";
        for size in 1..text.len() {
            let chunks: Vec<&str> = text
                .as_bytes()
                .chunks(size)
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect();
            let (deltas, _) = stream_all(&chunks);
            assert_eq!(
                joined(&deltas, false),
                expected_thought,
                "chunk size {size}"
            );
            assert_eq!(joined(&deltas, true), expected_answer, "chunk size {size}");
        }
    }

    #[test]
    fn streaming_never_leaks_a_marker_into_the_thought() {
        let (deltas, _) = stream_all(&["Thought: a\nAc", "tion: llm\nArgs: {}"]);
        assert_eq!(deltas, vec![ReactDelta::Thought("a".into())]);
    }

    #[test]
    fn thought_streams_before_the_line_ends() {
        let mut s = ReactStream::default();
        assert_eq!(
            s.push("Thought: thinking hard"),
            vec![ReactDelta::Thought("thinking hard".into())]
        );
        assert_eq!(s.push(" still"), vec![ReactDelta::Thought(" still".into())]);
    }
}
