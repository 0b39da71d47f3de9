//! The ReACT text protocol (TrustGraph's `Thought/Action/Args` or `Thought/Final Answer`), parsed
//! incrementally so thoughts and answers can be streamed while the LLM is still writing.
//!
//! **The first decision wins.** Models, small ones most, often run on past an action: they write
//! its arguments, then an `Observation:` they imagine and a `Final Answer:` built on it. Such an
//! answer comes from a tool result that was never produced, so the first `Action:` or `Final
//! Answer:` decides the turn, and everything after an action's arguments is discarded (and
//! reported, so provenance can say how much was dropped). Streaming follows the same rule: no
//! answer text is ever streamed for a turn whose first decision is an action.

use std::collections::BTreeMap;
use std::ops::Range;

/// What the LLM decided in one ReACT turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReactTurn {
    /// Call a tool.
    Action {
        thought: String,
        action: String,
        arguments: BTreeMap<String, String>,
        /// What the LLM wrote after the action's arguments (an imagined observation, a premature
        /// final answer, further actions), trimmed; dropped unread, kept for provenance.
        discarded: String,
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
    #[error("'Args:' came before any 'Action:' line")]
    ArgsWithoutAction,
    #[error("the response wrote an 'Observation:' before deciding; observations come only from tools, after an 'Action:'")]
    InventedObservation,
    #[error("the 'Final Answer:' is empty")]
    EmptyAnswer,
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
    /// Written by the model itself, never by a tool: it ends whatever came before.
    Observation,
}

/// Marker words, matched case-insensitively at the start of a line, with markdown emphasis around
/// them tolerated (`**Action:**`, `### Final Answer:`). Longer words first: `action input` must
/// win over `action`.
const MARKERS: [(&str, Section); 6] = [
    ("thought", Section::Thought),
    ("action input", Section::Args),
    ("action", Section::Action),
    ("args", Section::Args),
    ("final answer", Section::Answer),
    ("observation", Section::Observation),
];

/// Characters of markdown decoration that may surround a marker.
fn is_decoration(c: char) -> bool {
    c == '*' || c == '#' || c == '_'
}

/// The section a line opens and the offset (within `line`) where its content starts.
fn marker(line: &str) -> Option<(Section, usize)> {
    let body = line.trim_start_matches(|c: char| c.is_whitespace() || is_decoration(c));
    for (word, section) in MARKERS {
        let Some(head) = body.get(..word.len()) else {
            continue;
        };
        if !head.eq_ignore_ascii_case(word) {
            continue;
        }
        let Some(rest) = body[word.len()..]
            .trim_start_matches(is_decoration)
            .strip_prefix(':')
        else {
            continue;
        };
        let rest = rest
            .trim_start_matches(is_decoration)
            .trim_start_matches([' ', '\t']);
        return Some((section, line.len() - rest.len()));
    }
    None
}

/// Whether an unfinished last line could still grow into a marker (so it is not content yet).
fn could_become_marker(line: &str) -> bool {
    let body: String = line
        .trim_start_matches(|c: char| c.is_whitespace() || is_decoration(c))
        .chars()
        .filter(|c| !is_decoration(*c))
        .collect::<String>()
        .to_ascii_lowercase();
    body.is_empty()
        || MARKERS
            .iter()
            .any(|(word, _)| format!("{word}:").starts_with(&body))
}

/// One marked part of a response: its section and the byte range of its content.
#[derive(Debug, Clone)]
struct Segment {
    section: Section,
    content: Range<usize>,
}

/// The segments of a (possibly incomplete) response, in order. Text before any marker is thought,
/// as TrustGraph reads it; once a final answer starts, everything after it is the answer. While
/// streaming (`complete` false), an unfinished last line that could become a marker is held back
/// (left out of every segment).
fn segments(text: &str, complete: bool) -> Vec<Segment> {
    let mut out: Vec<Segment> = Vec::new();
    let mut at = 0;
    if let Some(block) = think_block(text, complete) {
        if !block.inner.is_empty() {
            out.push(Segment {
                section: Section::Thought,
                content: block.inner,
            });
        }
        at = block.end;
    }
    // The think block's segment ends at its close: what follows is a segment of its own.
    let after_think = out.len();
    for line in text[at..].split_inclusive('\n') {
        let start = at;
        at += line.len();
        let in_answer = out.last().is_some_and(|s| s.section == Section::Answer);
        if !in_answer {
            if let Some((section, offset)) = marker(line) {
                out.push(Segment {
                    section,
                    content: start + offset..at,
                });
                continue;
            }
            let unfinished = !complete && at == text.len() && !line.ends_with('\n');
            if unfinished && could_become_marker(line) {
                break;
            }
        }
        let extends = out.len() > after_think;
        match out.last_mut() {
            Some(segment) if extends => segment.content.end = at,
            _ => out.push(Segment {
                section: Section::Thought,
                content: start..at,
            }),
        }
    }
    out
}

/// A reasoning model's `<think>` block at the start of a response: its text, and where what
/// follows it begins.
struct ThinkBlock {
    inner: Range<usize>,
    end: usize,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// The `<think>` block a response starts with, if it does. Reasoning models (DeepSeek-R1 and its
/// small distillations, Qwen3) served with the block in the message's content rehearse the
/// protocol in it: a `Final Answer:` or `Observation:` line there is thinking, not a decision, and
/// read as one it ended the turn before the tool the model then called ran. Served with the
/// opening in the prompt (R1's chat template), only the close is written, at the start of a line
/// (and taken as one only when a decision follows it).
/// While streaming, a block not closed yet runs to the text's end, less what may be its close.
fn think_block(text: &str, complete: bool) -> Option<ThinkBlock> {
    think_block_before(text, complete, true)
}

/// `text` without the `<think>` block it starts with (see [`think_block`]), for a reply given
/// whole as an answer (a synthesis, a plan's answer, a native model's text): the client was given
/// the model's reasoning, tags and all, as the answer. Here a close at a line's start ends the
/// block whatever follows it, as an answer has no decision to follow it.
///
/// ```
/// use agent_core::react::without_think;
/// assert_eq!(without_think("<think>\nhm\n</think>\n\n42"), "42");
/// assert_eq!(without_think("hm, so\n</think>\n42"), "42");
/// assert_eq!(without_think("42, as <think> says"), "42, as <think> says");
/// ```
pub fn without_think(text: &str) -> &str {
    match think_block_before(text, true, false) {
        Some(block) => text[block.end..].trim_start(),
        None => text,
    }
}

/// Streamed text as [`without_think`] reads it whole, given as it comes: a `<think>` block the
/// reply opens with is held back, and what follows its close goes on from its first visible
/// character. A reply given whole as the answer (a synthesis, a plan's answer) was streamed raw,
/// so the client was sent the model's reasoning, tags and all, where the graph recorded the
/// answer without it. (A close written without its opening, the opening being in the prompt, is
/// told only once the text has gone: that form is not held back.)
///
/// ```
/// use agent_core::react::ThinkSkipping;
/// let mut skipping = ThinkSkipping::default();
/// let shown: String = ["<thi", "nk>\nhm, 41?", "\n</think>", "\n\nThe answer", " is 42"]
///     .iter()
///     .map(|delta| skipping.push(delta))
///     .collect();
/// assert_eq!(shown + &skipping.finish(), "The answer is 42");
/// ```
#[derive(Debug, Default)]
pub struct ThinkSkipping {
    held: String,
    state: Skipping,
}

#[derive(Debug, Default, PartialEq, Eq)]
enum Skipping {
    /// Nothing but whitespace, or what may yet be the opening, has come.
    #[default]
    Undecided,
    /// In the block: held until its close.
    Thinking,
    /// After the close, until the first visible character.
    AfterThinking,
    /// Everything goes on as it comes.
    Passing,
}

impl ThinkSkipping {
    /// What of `delta` may be shown now.
    pub fn push(&mut self, delta: &str) -> String {
        match self.state {
            Skipping::Passing => return delta.to_owned(),
            Skipping::AfterThinking => {
                let shown = delta.trim_start();
                if !shown.is_empty() {
                    self.state = Skipping::Passing;
                }
                return shown.to_owned();
            }
            Skipping::Undecided | Skipping::Thinking => self.held.push_str(delta),
        }
        if self.state == Skipping::Undecided {
            let start = self.held.trim_start();
            if start.is_empty() || (start.len() < THINK_OPEN.len() && THINK_OPEN.starts_with(start))
            {
                return String::new();
            }
            if !start.starts_with(THINK_OPEN) {
                self.state = Skipping::Passing;
                return std::mem::take(&mut self.held);
            }
            self.state = Skipping::Thinking;
        }
        // Only where the close could have begun: the held block was searched before this delta.
        let mut from = self
            .held
            .len()
            .saturating_sub(delta.len() + THINK_CLOSE.len());
        while !self.held.is_char_boundary(from) {
            from -= 1;
        }
        match self.held[from..].find(THINK_CLOSE).map(|at| from + at) {
            Some(close) => {
                let after = self.held[close + THINK_CLOSE.len()..].to_owned();
                self.held.clear();
                self.state = Skipping::AfterThinking;
                self.push(&after)
            }
            None => String::new(),
        }
    }

    /// What is still held when the text ends: a start that only looked like an opening (`<th`).
    /// A block never closed shows nothing, as [`without_think`] reads it.
    pub fn finish(&mut self) -> String {
        match self.state {
            Skipping::Undecided => std::mem::take(&mut self.held),
            _ => String::new(),
        }
    }
}

/// [`think_block`]; with `decision_after`, a close written without its opening counts only when
/// a decision follows it.
fn think_block_before(text: &str, complete: bool, decision_after: bool) -> Option<ThinkBlock> {
    let lead = text.len() - text.trim_start().len();
    let start = &text[lead..];
    if !complete && !start.is_empty() && THINK_OPEN.starts_with(start) {
        // Perhaps an opening still being written: nothing is read yet.
        return Some(ThinkBlock {
            inner: lead..lead,
            end: text.len(),
        });
    }
    if start.starts_with(THINK_OPEN) {
        let from = lead + THINK_OPEN.len();
        return Some(match text[from..].find(THINK_CLOSE) {
            Some(close) => ThinkBlock {
                inner: from..from + close,
                end: from + close + THINK_CLOSE.len(),
            },
            None => {
                let mut until = text.len();
                if !complete {
                    // What may yet become the close is not thought.
                    let tail = (1..THINK_CLOSE.len())
                        .rev()
                        .find(|n| text[from..].ends_with(&THINK_CLOSE[..*n]))
                        .unwrap_or(0);
                    until -= tail;
                }
                ThinkBlock {
                    inner: from..until.max(from),
                    end: text.len(),
                }
            }
        });
    }
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        let body = line.trim_start();
        if body.starts_with(THINK_CLOSE) {
            let close = at + (line.len() - body.len());
            let end = close + THINK_CLOSE.len();
            // Only with a decision after it: a line of an answer that starts with the tag does
            // not make the answer thinking.
            let decided_after = !decision_after
                || text[end..]
                    .split_inclusive('\n')
                    .any(|line| marker(line).is_some_and(|(s, _)| s != Section::Thought));
            return decided_after.then_some(ThinkBlock {
                inner: 0..close,
                end,
            });
        }
        at += line.len();
    }
    None
}

/// How a response reads under the first-decision rule.
struct Reading {
    /// The thought segments before the first decision, joined.
    thought: String,
    /// The segment that decides (or breaks) the turn, and its index.
    decision: Option<(usize, Section)>,
}

fn read(text: &str, segments: &[Segment]) -> Reading {
    let mut thought = String::new();
    for (i, segment) in segments.iter().enumerate() {
        if segment.section == Section::Thought {
            thought.push_str(&text[segment.content.clone()]);
        } else if segment.section == Section::Action
            && names_no_tool(&text[segment.content.clone()])
            && !segments
                .get(i + 1)
                .is_some_and(|next| next.section == Section::Args)
        {
            // `Action: None` followed by a final answer is how small models say they call
            // nothing: it decides nothing.
            continue;
        } else {
            return Reading {
                thought,
                decision: Some((i, segment.section)),
            };
        }
    }
    Reading {
        thought,
        decision: None,
    }
}

/// Whether an `Action:` section names no tool at all (`None`, `N/A`, `no action`, ...).
fn names_no_tool(content: &str) -> bool {
    let name = content
        .trim_start()
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .trim_matches(|c: char| c == '`' || c == '"' || c == '\'' || c == '.' || is_decoration(c))
        .to_ascii_lowercase();
    matches!(
        name.as_str(),
        "none" | "n/a" | "na" | "null" | "nothing" | "no action" | "no tool" | "-"
    )
}

/// Parses a complete ReACT response under the first-decision rule.
///
/// ```
/// use agent_core::react::{parse, ReactTurn};
/// let turn = parse("Thought: add\nAction: calc\nArgs: {\"expr\": \"1+1\"}\nFinal Answer: 3").unwrap();
/// let ReactTurn::Action { action, discarded, .. } = turn else { unreachable!() };
/// assert_eq!((action.as_str(), discarded.as_str()), ("calc", "Final Answer: 3"));
/// ```
pub fn parse(text: &str) -> Result<ReactTurn, ReactParseError> {
    let segments = segments(text, true);
    let reading = read(text, &segments);
    let thought = reading.thought.trim().to_owned();
    let Some((at, section)) = reading.decision else {
        return Err(ReactParseError::NoDecision);
    };
    let body = |i: usize| &text[segments[i].content.clone()];
    match section {
        // An empty answer would end the dialog with nothing said: it costs an iteration instead.
        Section::Answer if body(at).trim().is_empty() => Err(ReactParseError::EmptyAnswer),
        Section::Answer => Ok(ReactTurn::Final {
            thought,
            answer: body(at).trim().to_owned(),
        }),
        Section::Observation => Err(ReactParseError::InventedObservation),
        Section::Args => Err(ReactParseError::ArgsWithoutAction),
        Section::Thought => Err(ReactParseError::NoDecision),
        Section::Action => {
            let content = &segments[at].content;
            // The tool's name is the first line; anything under it is not part of the decision.
            let line = text[content.clone()].trim_start();
            let line_start = content.end - line.len();
            let name_len = line.find('\n').unwrap_or(line.len());
            let action = line[..name_len]
                .trim()
                .trim_matches(|c| c == '`' || c == '"' || c == '\'' || is_decoration(c))
                .trim()
                .to_owned();
            if action.is_empty() {
                return Err(ReactParseError::EmptyAction);
            }
            let under_start = line_start + name_len;
            let (arguments, decided_to) = match segments.get(at + 1) {
                Some(args) if args.section == Section::Args => {
                    let (arguments, used) = parse_args(&text[args.content.clone()])?;
                    (arguments, args.content.start + used)
                }
                _ => match unlabelled_args(&text[under_start..content.end]) {
                    Some(from) => {
                        let (arguments, used) = parse_args(&text[under_start + from..content.end])?;
                        (arguments, under_start + from + used)
                    }
                    None => (BTreeMap::new(), under_start),
                },
            };
            Ok(ReactTurn::Action {
                thought,
                action,
                arguments,
                discarded: text[decided_to..].trim().to_owned(),
            })
        }
    }
}

/// Where arguments written under an action without the `Args:` label start in `under` (the text
/// after the action's line, up to the next marker): a JSON object (fenced or not) on the next line,
/// or one under a label of its own (`Arguments:`, `Input:`, `Parameters:`), as small models write
/// them. Dropped, the tool ran with none (`{}`), a call other than the one asked for.
fn unlabelled_args(under: &str) -> Option<usize> {
    let body = under.trim_start();
    let from = under.len() - body.len();
    if body.starts_with('{') || body.starts_with("```") {
        return Some(from);
    }
    let labelled = body.trim_start_matches(is_decoration);
    ["arguments", "input", "parameters", "params"]
        .iter()
        .find_map(|label| {
            let head = labelled.get(..label.len())?;
            if !head.eq_ignore_ascii_case(label) {
                return None;
            }
            let rest = labelled[label.len()..].trim_start_matches(is_decoration);
            rest.strip_prefix(':')
                .map(|after| under.len() - after.len())
        })
}

/// `text` without a leading `Observation:` that only repeats `last_observation` (the real one the
/// prompt ended with): small models often echo it before their `Thought:`, and it was not invented.
///
/// ```
/// use agent_core::react::strip_echoed_observation;
/// assert_eq!(strip_echoed_observation("Observation: 42\nThought: ok", "42"), "Thought: ok");
/// assert_eq!(strip_echoed_observation("Observation: 43\nFinal Answer: 43", "42"), "Observation: 43\nFinal Answer: 43");
/// ```
pub fn strip_echoed_observation<'a>(text: &'a str, last_observation: &str) -> &'a str {
    let segments = segments(text, true);
    match segments.first() {
        Some(first)
            if first.section == Section::Observation
                && !last_observation.trim().is_empty()
                && text[first.content.clone()].trim() == last_observation.trim() =>
        {
            &text[first.content.end..]
        }
        _ => text,
    }
}

/// Reads the `Args:` JSON object and how many bytes of `text` it took (a closing code fence
/// included); non-string values are kept as their JSON text because the wire carries arguments as
/// `{str: str}`. Prose before the object on the same section is skipped.
fn parse_args(text: &str) -> Result<(BTreeMap<String, String>, usize), ReactParseError> {
    let fence_end = fence_opening(text);
    let inner = &text[fence_end..];
    if inner.trim().is_empty() || inner.trim() == "```" {
        return Ok((BTreeMap::new(), text.len()));
    }
    let Some(open) = inner.find('{') else {
        return Err(ReactParseError::BadArgs(format!(
            "expected an object, got {}",
            inner.trim().chars().take(80).collect::<String>()
        )));
    };
    if !inner[..open].trim().is_empty() && inner.trim_start().starts_with(['[', '"']) {
        return Err(ReactParseError::BadArgs(format!(
            "expected an object, got {}",
            inner.trim().chars().take(80).collect::<String>()
        )));
    }
    let start = fence_end + open;
    let mut values = serde_json::Deserializer::from_str(&text[start..]).into_iter();
    let value: serde_json::Value = match values.next() {
        Some(Ok(value)) => value,
        Some(Err(e)) => return Err(ReactParseError::BadArgs(e.to_string())),
        None => return Err(ReactParseError::BadArgs("no JSON object".into())),
    };
    let mut used = start + values.byte_offset();
    let rest = &text[used..];
    if fence_end > 0 {
        if let Some(after) = rest.trim_start().strip_prefix("```") {
            used = text.len() - after.len();
        }
    }
    Ok((object_arguments(value)?, used))
}

/// The arguments of a native tool call (`function.arguments`, JSON text), read as `Args:` is.
///
/// ```
/// let args = agent_core::react::tool_call_arguments("{\"a\": 1, \"b\": \"x\"}").unwrap();
/// assert_eq!((args["a"].as_str(), args["b"].as_str()), ("1", "x"));
/// assert!(agent_core::react::tool_call_arguments("[1]").is_err());
/// ```
pub fn tool_call_arguments(text: &str) -> Result<BTreeMap<String, String>, ReactParseError> {
    if text.trim().is_empty() || text.trim() == "null" {
        return Ok(BTreeMap::new());
    }
    let value = serde_json::from_str(text).map_err(|e| ReactParseError::BadArgs(e.to_string()))?;
    object_arguments(value)
}

/// A JSON object as the wire's `{str: str}` arguments: strings as they are, other values as
/// their JSON text.
fn object_arguments(value: serde_json::Value) -> Result<BTreeMap<String, String>, ReactParseError> {
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

/// Where the content starts after an opening code fence (```` ``` ```` or ```` ```json ````), or 0.
fn fence_opening(text: &str) -> usize {
    let trimmed = text.trim_start();
    let Some(inner) = trimmed.strip_prefix("```") else {
        return 0;
    };
    let inner = inner
        .strip_prefix("json")
        .or_else(|| inner.strip_prefix("JSON"))
        .unwrap_or(inner);
    text.len() - inner.len()
}

/// The first JSON value in `text` from its start: models often go on writing after it, and only it
/// counts. `None` when `text` holds no value at all.
pub(crate) fn first_json_value(text: &str) -> Option<Result<serde_json::Value, serde_json::Error>> {
    serde_json::Deserializer::from_str(text)
        .into_iter::<serde_json::Value>()
        .next()
}

/// The JSON objects in `text`, wherever they start: prose before the reply may hold braces
/// ("step {0} is wrong") that open no object, or quote an object that is not the reply. Only the
/// first few openings are tried, since each is read to its end.
///
/// A reasoning model's `<think>` block is left out (see [`without_think`]): an object drafted
/// while thinking ("maybe `{"status": "SUCCESS"}`... but the sum is wrong") is not the reply, and
/// read first it was taken for it.
pub(crate) fn objects_in(
    text: &str,
) -> impl Iterator<Item = serde_json::Map<String, serde_json::Value>> + '_ {
    let text = without_think(text);
    // The first and the last openings: an answer comes after whatever it quotes (a tool's JSON,
    // code), which can hold more braces than are tried from the start.
    let starts: Vec<usize> = text.match_indices('{').map(|(start, _)| start).collect();
    let tried: Vec<usize> = match starts.len() {
        n if n <= 2 * OPENINGS_TRIED => starts,
        n => starts[..OPENINGS_TRIED]
            .iter()
            .chain(&starts[n - OPENINGS_TRIED..])
            .copied()
            .collect(),
    };
    tried
        .into_iter()
        .filter_map(|start| match first_json_value(&text[start..]) {
            Some(Ok(serde_json::Value::Object(o))) => Some(o),
            _ => None,
        })
}

/// Whether `value` is a list of objects that each have `item_key` (`goal`), or an object with
/// such a list under `list_key` (`goals`, `steps`): how a list found past the first bracket of an
/// answer must look to be taken for one. A list of strings there is more often code or prose
/// (`request_body["response_type"]`) than what was asked for.
pub(crate) fn lists_objects_with(
    value: &serde_json::Value,
    list_key: &str,
    item_key: &str,
) -> bool {
    let list = match value {
        serde_json::Value::Array(list) => list,
        serde_json::Value::Object(o) => match o.get(list_key) {
            Some(serde_json::Value::Array(list)) => list,
            _ => return false,
        },
        _ => return false,
    };
    !list.is_empty()
        && list
            .iter()
            .all(|item| item.as_object().is_some_and(|o| o.contains_key(item_key)))
}

/// How many openings of a JSON object [`objects_in`] tries from a text's start, and again from
/// its end: each is read as far as its value goes, so they are bounded.
const OPENINGS_TRIED: usize = 16;

/// The first JSON object in `text` that has one of `keys` (see [`objects_in`]).
pub(crate) fn first_object_with(
    text: &str,
    keys: &[&str],
) -> Option<serde_json::Map<String, serde_json::Value>> {
    objects_in(text).find(|o| keys.iter().any(|key| o.contains_key(*key)))
}

/// Feeds streamed chunks and yields the thought and answer text as soon as it is certain. Only the
/// thought before the first decision is streamed, and answer text only when that decision is a
/// final answer.
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
    /// The last real observation, whose echo at the start is skipped as [`parse`]'s caller does.
    echo: String,
    thought_sent: usize,
    answer_sent: usize,
    /// Once the first decision can no longer change, what is left to stream, so that the text is
    /// not read again from its start at each chunk: a model that ran on for megabytes, a few
    /// bytes a chunk, cost minutes of CPU.
    settled: Option<Settled>,
    /// How long the text was when it was last read whole (see [`READ_WHOLE_BYTES`]).
    read_at: usize,
}

/// Up to this length a stream with no settled decision is read whole at every chunk; past it,
/// only once it has grown by a sixteenth since it was last read, so that a thought running on
/// for megabytes costs a few dozen reads, not one per chunk (its deltas come in bursts then).
const READ_WHOLE_BYTES: usize = 8 * 1024;

/// What a stream whose first decision is settled has left to stream.
#[derive(Debug, Clone, Copy)]
enum Settled {
    /// A decision other than a final answer: the thought before it is all there is.
    Nothing,
    /// A final answer, whose text runs from this byte of the stream's text to its end.
    AnswerFrom(usize),
}

impl ReactStream {
    /// A stream for a turn whose prompt ended with `last_observation`; see
    /// [`strip_echoed_observation`].
    pub fn after_observation(last_observation: &str) -> ReactStream {
        ReactStream {
            echo: last_observation.to_owned(),
            ..ReactStream::default()
        }
    }

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
        match self.settled {
            Some(Settled::Nothing) => return Vec::new(),
            Some(Settled::AnswerFrom(start)) => {
                return self.answer_delta(start).into_iter().collect()
            }
            None => {}
        }
        let grown = self.text.len().saturating_sub(self.read_at);
        if !complete && self.text.len() > READ_WHOLE_BYTES && grown < self.text.len() / 16 {
            return Vec::new();
        }
        self.read_at = self.text.len();
        let text = strip_echoed_observation(&self.text, &self.echo);
        let segments = segments(text, complete);
        let reading = read(text, &segments);
        let mut out = Vec::new();
        // Trailing whitespace may turn out to end the thought; it is sent only once text follows it.
        let certain = reading.thought.trim_start().trim_end();
        if let Some(delta) = certain.get(self.thought_sent..) {
            if !delta.is_empty() {
                out.push(ReactDelta::Thought(delta.to_owned()));
                self.thought_sent = certain.len();
            }
        }
        // The echo, if one was cut, is the text's start.
        let skipped = self.text.len() - text.len();
        // A final answer is settled once its marker's line is whole: every line after it is its
        // text (where the text starts can still move while that line is written: `Final
        // answer:` then `**` that closes the marker's emphasis). Any other decision once a later
        // section has begun: its own line is then whole (`Action: None` can still turn out to
        // decide nothing while that line is written).
        match reading.decision {
            Some((at, Section::Answer)) => {
                let start = skipped + segments[at].content.start;
                if self.text[start..].contains('\n') {
                    self.settled = Some(Settled::AnswerFrom(start));
                }
                out.extend(self.answer_delta(start));
            }
            Some((at, _)) if segments.len() > at + 1 => self.settled = Some(Settled::Nothing),
            _ => {}
        }
        out
    }

    /// The final answer's text not yet streamed (its trailing whitespace held back).
    fn answer_delta(&mut self, start: usize) -> Option<ReactDelta> {
        let answer = self.text.get(start..)?.trim_start();
        let certain = answer.trim_end();
        let delta = certain.get(self.answer_sent..).filter(|d| !d.is_empty())?;
        let delta = ReactDelta::Answer(delta.to_owned());
        self.answer_sent = certain.len();
        Some(delta)
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

    /// Streamed through [`ThinkSkipping`] in chunks of any size, a reply that opens a `<think>`
    /// block (or none) shows what [`without_think`] reads from it whole: the answer without the
    /// reasoning. Before, a synthesis streamed the block to the client as answer text.
    #[test]
    fn a_think_block_is_left_out_of_a_streamed_answer_as_of_a_whole_one() {
        let texts = [
            "<think>\nhm, maybe 41\n</think>\n\nThe answer is 42",
            "  <think>plan it</think>The answer, é😀",
            "The answer is 42, as <think> says",
            "<thinking aloud> is not a block",
            "<think>never closed",
            "<th",
            "",
            "   \n  ",
        ];
        for text in texts {
            for size in 1..=9 {
                let mut skipping = ThinkSkipping::default();
                let chars: Vec<char> = text.chars().collect();
                let mut shown: String = chars
                    .chunks(size)
                    .map(|chunk| skipping.push(&chunk.iter().collect::<String>()))
                    .collect();
                shown.push_str(&skipping.finish());
                let expected = if text.trim_start().starts_with("<think>") {
                    without_think(text)
                } else {
                    text
                };
                assert_eq!(shown, expected, "{text:?} in chunks of {size}");
            }
        }
    }

    /// Settled once its first decision cannot change, a stream gives what a stream read whole
    /// gives, chunked any way.
    #[test]
    fn a_settled_stream_gives_what_the_whole_text_gives() {
        let texts = [
            "Thought: known.\nFinal Answer: Result:\nAction: none, it is 42.\n  \nmore  ",
            "Thought: look\nAction: calc\nArgs: {\"n\": 1}\nObservation: made up\nFinal Answer: 9",
            "Thought: nothing to call\nAction: None\nFinal Answer: 7",
            "Observation: 42\nThought: echoed\nFinal Answer: 42 it is",
            "Thought: first\nsecond line\nAction: No\nArgs: {}",
            "Final Answer: é😀 at once",
            "<think>\nI could answer.\nFinal Answer: 111110\nBetter check.\n</think>\nThought: check\nAction: add\nArgs: {\"a\": 1}",
            "  <think>plan it</think>\n\nFinal Answer: done",
        ];
        for text in texts {
            let whole = {
                let mut stream = ReactStream::after_observation("42");
                let mut out = stream.push(text);
                out.extend(stream.finish());
                (joined(&out, false), joined(&out, true))
            };
            for size in 1..=7 {
                let mut stream = ReactStream::after_observation("42");
                let mut out = Vec::new();
                let chars: Vec<char> = text.chars().collect();
                for chunk in chars.chunks(size) {
                    out.extend(stream.push(&chunk.iter().collect::<String>()));
                }
                out.extend(stream.finish());
                assert_eq!(
                    (joined(&out, false), joined(&out, true)),
                    whole,
                    "{text:?} in chunks of {size}"
                );
            }
        }
    }

    /// What a reasoning model writes in its `<think>` block is thinking: a rehearsed `Final
    /// Answer:` or `Observation:` there decides nothing, and the decision after the block stands.
    /// Read as one, the rehearsed answer ended the dialog and the tool the model called never ran.
    #[test]
    fn a_think_block_is_thought_whatever_it_rehearses() {
        let rehearsed = "<think>\nI could answer directly.\nFinal Answer: 111110\nObservation: 111110\nBetter verify.\n</think>\nThought: verify\nAction: add\nArgs: {\"a\": 98765, \"b\": 12345}";
        let Ok(ReactTurn::Action {
            thought,
            action,
            arguments,
            ..
        }) = parse(rehearsed)
        else {
            panic!("{:?}", parse(rehearsed))
        };
        assert_eq!((action.as_str(), arguments["a"].as_str()), ("add", "98765"));
        assert!(
            thought.contains("Better verify.") && thought.ends_with("verify"),
            "{thought}"
        );
        assert!(!thought.contains("think>"), "{thought}");
        // Served with the opening in the prompt, only the close is written.
        let closed_only = "I could answer.\nFinal Answer: 1\n</think>\n\nAction: add\nArgs: {}";
        assert!(matches!(parse(closed_only), Ok(ReactTurn::Action { .. })));
        assert!(matches!(
            parse("<think>\nFinal Answer: 2\n</think>\nFinal Answer: 3"),
            Ok(ReactTurn::Final { answer, .. }) if answer == "3"
        ));
        // A block never closed (cut off while thinking) decides nothing.
        assert_eq!(
            parse("<think>\nFinal Answer: 2"),
            Err(ReactParseError::NoDecision)
        );
        // The tag elsewhere is text like any other.
        assert!(matches!(
            parse("Final Answer: close it with </think> as HTML does\n</think> ends it"),
            Ok(ReactTurn::Final { answer, .. }) if answer.starts_with("close it")
        ));
    }

    /// A model that runs on for megabytes, a few bytes a chunk, is read once: read from its start
    /// at each chunk, this stream took hours.
    #[test]
    fn a_runaway_answer_is_streamed_without_reading_it_again() {
        let mut stream = ReactStream::default();
        let mut out = stream.push("Thought: long.\nFinal Answer: ");
        let line = "all work and no play makes a dull model\n";
        for _ in 0..50_000 {
            for chunk in line.as_bytes().chunks(4) {
                out.extend(stream.push(std::str::from_utf8(chunk).unwrap_or_default()));
            }
        }
        out.extend(stream.finish());
        assert_eq!(joined(&out, true), line.repeat(50_000).trim_end());
    }

    /// The same for a thought that runs on with no decision: read a few dozen times, and all of
    /// it streamed.
    #[test]
    fn a_runaway_thought_is_streamed_without_reading_it_at_every_chunk() {
        let mut stream = ReactStream::default();
        let mut out = stream.push("Thought: ");
        let line = "all work and no play makes a dull model\n";
        for _ in 0..50_000 {
            for chunk in line.as_bytes().chunks(4) {
                out.extend(stream.push(std::str::from_utf8(chunk).unwrap_or_default()));
            }
        }
        out.extend(stream.push("Final Answer: done"));
        out.extend(stream.finish());
        assert_eq!(joined(&out, false), line.repeat(50_000).trim_end());
        assert_eq!(joined(&out, true), "done");
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
                discarded: String::new(),
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
        let ReactTurn::Action {
            arguments,
            discarded,
            ..
        } = turn
        else {
            panic!("expected action")
        };
        assert_eq!(arguments["question"], "x");
        assert_eq!(discarded, "and then I will see\nObservation: made up");
    }

    /// Arguments written under an action without `Args:` (a JSON object on the next line, fenced
    /// or not, or under a label of its own) are the call's: dropped, the tool ran with `{}`.
    /// Arguments that do not read are refused, as under `Args:`.
    #[test]
    fn arguments_under_an_action_without_their_label_are_the_calls() {
        for text in [
            "Action: list_files\n{\"path\": \"/etc\"}\nObservation: made up",
            "Action: list_files\nArguments: {\"path\": \"/etc\"}",
            "Action: list_files\n**Input:** {\"path\": \"/etc\"}",
            "Action: list_files\n```json\n{\"path\": \"/etc\"}\n```\nFinal Answer: x",
        ] {
            let Ok(ReactTurn::Action {
                action, arguments, ..
            }) = parse(text)
            else {
                panic!("{text:?}: {:?}", parse(text))
            };
            assert_eq!(
                (action.as_str(), arguments.get("path").map(String::as_str)),
                ("list_files", Some("/etc")),
                "{text:?}"
            );
        }
        let Ok(ReactTurn::Action { discarded, .. }) =
            parse("Action: list_files\n{\"path\": \"/etc\"}\nObservation: made up")
        else {
            panic!()
        };
        assert_eq!(discarded, "Observation: made up");
        assert!(matches!(
            parse("Action: list_files\nArguments: the root folder"),
            Err(ReactParseError::BadArgs(_))
        ));
        // Prose under an action is no argument.
        assert!(matches!(
            parse("Action: now\nbecause the time matters"),
            Ok(ReactTurn::Action { arguments, .. }) if arguments.is_empty()
        ));
    }

    /// The completion a real 1.5B model wrote: the action must run, the invented answer must not
    /// be taken.
    #[test]
    fn an_action_before_a_final_answer_wins() {
        let text = "Thought: To add 98765 and 12345, I need to add the two numbers together.\nAction: add\nArgs: {\"a\": 98765, \"b\": 12345}\nFinal Answer: 111110";
        assert_eq!(
            parse(text).unwrap(),
            ReactTurn::Action {
                thought: "To add 98765 and 12345, I need to add the two numbers together.".into(),
                action: "add".into(),
                arguments: [("a".into(), "98765".into()), ("b".into(), "12345".into())].into(),
                discarded: "Final Answer: 111110".into(),
            }
        );
        let (deltas, _) = stream_all(&[text]);
        assert!(!deltas.iter().any(|d| matches!(d, ReactDelta::Answer(_))));
    }

    #[test]
    fn an_action_naming_no_tool_decides_nothing() {
        let text = "Thought: I know it.\nAction: None\nFinal Answer: 4";
        assert_eq!(
            parse(text).unwrap(),
            ReactTurn::Final {
                thought: "I know it.".into(),
                answer: "4".into()
            }
        );
        let (deltas, _) = stream_all(&[text]);
        assert!(deltas.contains(&ReactDelta::Answer("4".into())));
        assert!(matches!(
            parse("Action: **search**\nArgs: {}"),
            Ok(ReactTurn::Action { ref action, .. }) if action == "search"
        ));
    }

    #[test]
    fn an_echo_of_the_last_observation_is_not_an_invented_one() {
        let text = "Observation: 42\nThought: so it is 42.\nFinal Answer: 42";
        assert_eq!(
            parse(strip_echoed_observation(text, "42")).unwrap(),
            ReactTurn::Final {
                thought: "so it is 42.".into(),
                answer: "42".into()
            }
        );
        assert_eq!(
            parse(strip_echoed_observation(text, "41")),
            Err(ReactParseError::InventedObservation)
        );
        for size in 1..text.len() {
            let mut stream = ReactStream::after_observation("42");
            let mut deltas = Vec::new();
            for chunk in text.as_bytes().chunks(size) {
                deltas.extend(stream.push(std::str::from_utf8(chunk).unwrap()));
            }
            deltas.extend(stream.finish());
            assert_eq!(joined(&deltas, true), "42", "chunk size {size}: {deltas:?}");
        }
    }

    #[test]
    fn an_action_without_args_discards_what_follows_it() {
        let ReactTurn::Action {
            action,
            arguments,
            discarded,
            ..
        } = parse("Thought: t\nAction: now\nObservation: 12:00\nThought: ok\nFinal Answer: noon")
            .unwrap()
        else {
            panic!("expected action")
        };
        assert_eq!(action, "now");
        assert!(arguments.is_empty());
        assert_eq!(
            discarded,
            "Observation: 12:00\nThought: ok\nFinal Answer: noon"
        );
    }

    #[test]
    fn a_second_action_is_discarded_and_a_second_thought_is_not_merged() {
        let ReactTurn::Action {
            thought,
            action,
            discarded,
            ..
        } = parse("Thought: one\nAction: a\nArgs: {}\nThought: two\nAction: b\nArgs: {}").unwrap()
        else {
            panic!("expected action")
        };
        assert_eq!((thought.as_str(), action.as_str()), ("one", "a"));
        assert_eq!(discarded, "Thought: two\nAction: b\nArgs: {}");
    }

    #[test]
    fn an_observation_before_any_decision_is_refused() {
        assert_eq!(
            parse("Thought: t\nObservation: it is 5\nFinal Answer: 5"),
            Err(ReactParseError::InventedObservation)
        );
        assert_eq!(
            parse("Args: {}\nAction: x"),
            Err(ReactParseError::ArgsWithoutAction)
        );
    }

    #[test]
    fn markdown_decorated_and_lower_case_markers_are_read() {
        let ReactTurn::Action {
            thought,
            action,
            arguments,
            discarded,
        } = parse("**Thought:** look it up\n**Action:** `search`\n**Args:**\n```json\n{\"q\": \"x\"}\n```\n")
            .unwrap()
        else {
            panic!("expected action")
        };
        assert_eq!(
            (
                thought.as_str(),
                action.as_str(),
                arguments["q"].as_str(),
                discarded.as_str()
            ),
            ("look it up", "search", "x", "")
        );
        assert_eq!(
            parse("thought: x\nfinal answer: 4").unwrap(),
            ReactTurn::Final {
                thought: "x".into(),
                answer: "4".into()
            }
        );
    }

    #[test]
    fn streaming_holds_back_a_decorated_marker_until_it_is_known() {
        let (deltas, _) = stream_all(&[
            "Thought: a\n*",
            "* Act",
            "ion:** t\nArgs: {}\nFinal Answer: x",
        ]);
        assert_eq!(deltas, vec![ReactDelta::Thought("a".into())]);
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

    #[test]
    fn an_empty_final_answer_is_no_answer() {
        for text in [
            "Thought: done\nFinal Answer:",
            "Thought: done\nFinal Answer:   \n\n",
            "**Final Answer:** ",
        ] {
            assert_eq!(parse(text), Err(ReactParseError::EmptyAnswer), "{text:?}");
        }
        assert!(matches!(
            parse("Final Answer: 0"),
            Ok(ReactTurn::Final { answer, .. }) if answer == "0"
        ));
    }
}
