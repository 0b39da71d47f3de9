//! A record of the calls one step makes, and answers recorded earlier to give again instead of
//! calling: what lets a replayed step reuse an LLM's answer to the very same question (no second
//! charge, the same words) while any other question is asked afresh.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{CallOptions, ChatMessage, Completion, ToolCall};

/// What a completion said, as the graph keeps it: enough to give it again.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    pub text: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default)]
    pub model: String,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub cut_off: bool,
}

impl Recorded {
    pub fn of(completion: &Completion) -> Recorded {
        Recorded {
            text: completion.text.clone(),
            tool_calls: completion.tool_calls.clone(),
            model: completion.model.clone(),
            cut_off: completion.cut_off,
        }
    }

    /// The answer given again: it cost nothing and took no time this time.
    pub fn completion(&self) -> Completion {
        Completion {
            text: self.text.clone(),
            model: self.model.clone(),
            cut_off: self.cut_off,
            tool_calls: self.tool_calls.clone(),
            ..Completion::default()
        }
    }
}

/// One call made through a taped client.
#[derive(Debug, Clone, PartialEq)]
pub struct TapedCall {
    /// The digest of what was asked (see [`call_digest`]).
    pub digest: String,
    /// Which of the step's calls asking the same this was: 0 the first.
    pub repeat: usize,
    pub recorded: Recorded,
    /// The recorded call whose answer was given instead of calling, if one was.
    pub reused_from: Option<String>,
}

/// The recorded answers one digest may be given: the first call asking it the first, the second
/// the second, and any call past the last the last.
pub type AnswersByRepeat = Vec<(String, Recorded)>;

/// Where a replaying step's recorded answers come from, looked up as each call asks: a source
/// run's record is shared by the steps that replay it, and a step takes a copy of only the answers
/// to the questions it asks (copied up front, every step held one of every answer in the run).
pub trait RecordedAnswers: Send + Sync {
    /// The recorded calls' names and answers for `digest`, by repeat (empty: none recorded).
    fn answers(&self, digest: &str) -> AnswersByRepeat;
}

/// The calls of one step, and the recorded answers it may give again.
#[derive(Default)]
pub struct Tape {
    /// The recorded answers it may give, by digest.
    replay: Option<Box<dyn RecordedAnswers>>,
    /// Digest -> how many of the step's calls asked it so far.
    asked: Mutex<HashMap<String, usize>>,
    calls: Mutex<Vec<TapedCall>>,
}

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tape")
            .field("replaying", &self.replay.is_some())
            .field("asked", &self.asked)
            .field("calls", &self.calls)
            .finish()
    }
}

impl Tape {
    /// A tape that records and reuses nothing recorded.
    pub fn recording() -> Tape {
        Tape::default()
    }

    /// A tape that gives `recorded` answers to the same questions again.
    pub fn replaying(recorded: impl RecordedAnswers + 'static) -> Tape {
        Tape {
            replay: Some(Box::new(recorded)),
            ..Tape::default()
        }
    }

    /// A call asking what `digest` names: which repeat of it in this step it is, and the
    /// recorded answer it is given, if any.
    pub(crate) fn ask(&self, digest: &str) -> (usize, Option<(String, Recorded)>) {
        let repeat = {
            let mut asked = self.asked.lock().unwrap_or_else(PoisonError::into_inner);
            let count = asked.entry(digest.to_owned()).or_insert(0);
            *count += 1;
            *count - 1
        };
        let answer = self.replay.as_ref().and_then(|replay| {
            let mut answers = replay.answers(digest);
            if repeat < answers.len() {
                Some(answers.swap_remove(repeat))
            } else {
                answers.pop()
            }
        });
        (repeat, answer)
    }

    pub(crate) fn push(&self, call: TapedCall) {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(call);
    }

    /// The calls made so far, taken off the tape.
    pub fn take(&self) -> Vec<TapedCall> {
        std::mem::take(&mut *self.calls.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// The SHA-256 (hex) of what a call asks: the model, every message and the options that change
/// the answer, its bound on the answer's tokens among them (where one is set: a call without one
/// digests as it did before there was one). The same question to the same model digests the same
/// in any process.
pub fn call_digest(
    model: &str,
    messages: &[ChatMessage],
    options: &CallOptions,
    max_output_tokens: Option<u64>,
) -> String {
    let mut hash = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    part(model.as_bytes());
    for message in messages {
        part(&serde_json::to_vec(message).unwrap_or_default());
    }
    for stop in &options.stop {
        part(stop.as_bytes());
    }
    for tool in &options.tools {
        part(tool.name.as_bytes());
        part(tool.description.as_bytes());
        part(tool.parameters.to_string().as_bytes());
    }
    part(&[u8::from(options.json_object)]);
    if let Some(most) = max_output_tokens {
        part(b"max_tokens");
        part(&most.to_le_bytes());
    }
    hash.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_digest_follows_what_is_asked() {
        let ask = |text: &str| vec![ChatMessage::system("s"), ChatMessage::user(text)];
        let plain = CallOptions::default();
        let d = call_digest("m", &ask("a"), &plain, None);
        assert_eq!(d, call_digest("m", &ask("a"), &plain, None));
        assert_eq!(d.len(), 64);
        assert_ne!(d, call_digest("m", &ask("b"), &plain, None));
        assert_ne!(d, call_digest("other", &ask("a"), &plain, None));
        let json = CallOptions {
            json_object: true,
            ..CallOptions::default()
        };
        assert_ne!(d, call_digest("m", &ask("a"), &json, None));
        // A bound on the answer's tokens changes what is asked: an answer cut at 200 tokens is
        // not the answer to a call that allows 4,000.
        assert_ne!(d, call_digest("m", &ask("a"), &plain, Some(200)));
        assert_ne!(
            call_digest("m", &ask("a"), &plain, Some(200)),
            call_digest("m", &ask("a"), &plain, Some(4000))
        );
    }

    #[test]
    fn each_repeat_of_a_question_is_given_its_own_recorded_answer() {
        let answer = |text: &str| {
            (
                format!("node-{text}"),
                Recorded {
                    text: text.into(),
                    ..Recorded::default()
                },
            )
        };
        let tape = Tape::replaying(HashMap::from([(
            "d".to_owned(),
            vec![answer("3"), answer("5")],
        )]));
        let text = |(repeat, answer): (usize, Option<(String, Recorded)>)| {
            (repeat, answer.map(|(_, r)| r.text.clone()))
        };
        assert_eq!(text(tape.ask("d")), (0, Some("3".into())));
        assert_eq!(text(tape.ask("d")), (1, Some("5".into())));
        assert_eq!(text(tape.ask("d")), (2, Some("5".into())));
        assert_eq!(text(tape.ask("other")), (0, None));
        assert_eq!(text(Tape::recording().ask("d")), (0, None));
    }

    impl RecordedAnswers for HashMap<String, AnswersByRepeat> {
        fn answers(&self, digest: &str) -> AnswersByRepeat {
            self.get(digest).cloned().unwrap_or_default()
        }
    }

    /// What asks a replaying tape for the answers to `digest`, and which digests it asked.
    struct Counted(Mutex<Vec<String>>);

    impl RecordedAnswers for std::sync::Arc<Counted> {
        fn answers(&self, digest: &str) -> AnswersByRepeat {
            self.0.lock().unwrap().push(digest.to_owned());
            vec![(
                format!("node-{digest}"),
                Recorded {
                    text: digest.to_owned(),
                    ..Recorded::default()
                },
            )]
        }
    }

    #[test]
    fn a_replaying_tape_looks_up_only_what_its_calls_ask() {
        let source = std::sync::Arc::new(Counted(Mutex::new(Vec::new())));
        let tape = Tape::replaying(source.clone());
        assert!(
            source.0.lock().unwrap().is_empty(),
            "looked up before any call"
        );
        let (_, answer) = tape.ask("d2");
        assert_eq!(answer.map(|(_, r)| r.text), Some("d2".into()));
        assert_eq!(*source.0.lock().unwrap(), ["d2"]);
    }
}
