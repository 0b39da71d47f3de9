//! Long texts as documents (claim-check): the names, excerpts and references that let a message or
//! a provenance node carry a long text's start and where the whole of it is kept.
//!
//! A document is named by its text's SHA-256, so whoever writes it (the step that checks an
//! observation in, the aggregator storing provenance, a redelivered copy of either) writes the
//! same quad: the store holds each text once and no writer needs a compare-and-set.
//!
//! A long ReACT history is also folded: its older steps become one step whose observation is a
//! bounded digest of them and whose arguments name the document holding them, so a message stays
//! bounded however long the dialog runs (see [`fold`]).

use agent_schema::{AgentStep, StepType};
use sha2::{Digest, Sha256};

use crate::vocab::DOCUMENT_PREFIX;

/// Texts longer than this are kept as documents, apart from the messages and nodes that cite them.
pub const CHECK_IN_OVER: usize = 4096;
/// How much of a checked-in text a message keeps.
pub const EXCERPT_BYTES: usize = 1024;

/// Starts the line that ends an excerpt: `[claim-check: {bytes} bytes in {uri}]`.
const MARK: &str = "\n[claim-check: ";

/// Whether `text` is long enough to be kept as a document.
pub fn is_long(text: &str) -> bool {
    text.len() > CHECK_IN_OVER
}

/// Whether `text` is to be claim-checked: long, and not already an excerpt with its reference.
pub fn wants_check_in(text: &str) -> bool {
    is_long(text) && reference(text).is_none()
}

/// The IRI of the document holding `text`.
pub fn document_uri(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{DOCUMENT_PREFIX}{hex}")
}

/// The first `max` bytes of `text`, cut at a character boundary.
pub fn prefix(text: &str, max: usize) -> &str {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// What a message keeps of a checked-in text: its start, and where the rest is.
pub fn excerpt_with_reference(text: &str, uri: &str) -> String {
    format!(
        "{}…{MARK}{} bytes in {uri}]",
        prefix(text, EXCERPT_BYTES),
        text.len()
    )
}

/// The document an excerpt refers to, and the whole text's length.
pub fn reference(excerpt: &str) -> Option<(&str, usize)> {
    let at = excerpt.rfind(MARK)?;
    let line = excerpt[at + MARK.len()..].strip_suffix(']')?;
    let (bytes, uri) = line.split_once(" bytes in ")?;
    let uri = uri.trim();
    // Exactly the names `document_uri` gives (it is pasted into queries as an IRI): anything else
    // in a text that came from a tool, a model or a client is no reference.
    let digest = uri.strip_prefix(DOCUMENT_PREFIX)?;
    if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some((uri, bytes.parse().ok()?))
}

/// The argument of a folded step that says how many steps it stands for.
pub const FOLDED_STEPS: &str = "folded-steps";
/// The argument of a folded step that names the document holding the steps it replaced.
pub const FOLDED_DOCUMENT: &str = "document";
/// How many of the newest steps a folded history keeps as they are; the history is folded when
/// twice as many have gathered after its folded step, so a fold happens once every `FOLD_KEEP + 1`
/// iterations (and only then does the journal keep a whole request rather than the new step).
pub const FOLD_KEEP: usize = 8;
/// How many of the folded steps the digest lists, newest last; the rest are counted.
const DIGEST_STEPS: usize = 8;
/// How much of a folded step's observation and arguments its digest line keeps.
const DIGEST_OBSERVATION_BYTES: usize = 240;
const DIGEST_ARGUMENTS_BYTES: usize = 120;

/// How many steps `step` stands for, when it is a folded step.
pub fn folded_count(step: &AgentStep) -> Option<usize> {
    if !step.action.is_empty() {
        return None;
    }
    // A client writes the history: a count of zero or past any real dialog is not a fold, so
    // sums over a history and the iteration after it cannot overflow.
    step.arguments
        .get(FOLDED_STEPS)?
        .parse()
        .ok()
        .filter(|count| (1..=MAX_FOLDED).contains(count))
}

/// The most steps one folded step may stand for.
const MAX_FOLDED: usize = u32::MAX as usize;

/// How many iterations a history stands for: a folded step counts the steps it replaced. The
/// iteration a request asks for is one more.
pub fn steps_taken(history: &[AgentStep]) -> usize {
    history.iter().fold(0, |sum: usize, step| {
        sum.saturating_add(folded_count(step).unwrap_or(1))
    })
}

/// A history with its older steps folded into one.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    /// The folded step, then the newest [`FOLD_KEEP`] steps as they were.
    pub history: Vec<AgentStep>,
    /// The document to keep before the history is sent: the folded steps as JSON (an earlier
    /// folded step first, so the documents chain back to the first step).
    pub document: String,
    /// Its name, as the folded step's arguments give it.
    pub uri: String,
}

/// Whether `history` with `more` steps after it is long enough for [`fold`] to fold (which also
/// needs every step after its folded one to be a ReACT step).
pub fn long_enough_to_fold(history: &[AgentStep], more: usize, keep: usize) -> bool {
    (history.len() + more).saturating_sub(after_fold(history)) > 2 * keep.max(1)
}

/// Where the steps after `history`'s folded step (if it starts with one) begin.
fn after_fold(history: &[AgentStep]) -> usize {
    usize::from(history.first().is_some_and(|s| folded_count(s).is_some()))
}

/// Folds `history` when more than `2 * keep` ReACT steps follow its folded step (if any): all but
/// the newest `keep` become one step, so a message carries at most `2 * keep + 1` steps. The folded
/// step is a valid TrustGraph step (empty action, a thought, an observation), whose observation is
/// a bounded digest of what was done (the newest folded steps one line each, the rest counted)
/// and whose arguments say how many steps it stands for and where they are kept whole. The digest
/// is made from the steps, not by asking the LLM: free, and a redelivered step folds the same
/// history to the same bytes. Plans and supervisors keep their steps (their decisions read them).
pub fn fold(history: &[AgentStep], keep: usize) -> Option<Folded> {
    let keep = keep.max(1);
    let start = after_fold(history);
    if !long_enough_to_fold(history, 0, keep) {
        return None;
    }
    let cut = history.len() - keep;
    let reacting = |s: &AgentStep| matches!(StepType::parse(&s.step_type), Some(StepType::React));
    if !history[start..].iter().all(reacting) {
        return None;
    }
    let gone = &history[..cut];
    let document = serde_json::to_string(gone).ok()?;
    let uri = document_uri(&document);
    let count = steps_taken(gone);
    let before = count - (cut - start);
    let mut digest = format!(
        "{count} earlier steps were folded to keep the message short; all of them are kept in {uri}.\n"
    );
    let listed = (cut - start).min(DIGEST_STEPS);
    let unlisted = count - listed;
    if unlisted > 0 {
        digest.push_str(&format!("Steps 1-{unlisted}: not listed.\n"));
    }
    for (i, step) in history[cut - listed..cut].iter().enumerate() {
        let number = before + (cut - start - listed) + i + 1;
        let arguments = serde_json::to_string(&step.arguments).unwrap_or_default();
        let observation = step.observation.replace('\n', " ");
        digest.push_str(&format!(
            "Step {number}: {} {} -> {}\n",
            step.action,
            clipped(&arguments, DIGEST_ARGUMENTS_BYTES),
            clipped(&observation, DIGEST_OBSERVATION_BYTES)
        ));
    }
    let folded = AgentStep {
        thought: format!("Steps 1-{count} of this dialog, folded."),
        action: String::new(),
        arguments: [
            (FOLDED_STEPS.to_owned(), count.to_string()),
            (FOLDED_DOCUMENT.to_owned(), uri.clone()),
        ]
        .into_iter()
        .collect(),
        observation: digest.trim_end().to_owned(),
        step_type: StepType::React.as_str().to_owned(),
        plan: None,
        subagent_results: None,
    };
    let mut folded_history = Vec::with_capacity(keep + 1);
    folded_history.push(folded);
    folded_history.extend_from_slice(&history[cut..]);
    Some(Folded {
        history: folded_history,
        document,
        uri,
    })
}

/// `text` cut to `max` bytes, with an ellipsis when cut.
fn clipped(text: &str, max: usize) -> String {
    let cut = prefix(text, max);
    if cut.len() < text.len() {
        format!("{cut}…")
    } else {
        cut.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(i: usize) -> AgentStep {
        AgentStep {
            thought: format!("thinking {i}"),
            action: "search".into(),
            arguments: [("q".to_owned(), format!("query {i}"))]
                .into_iter()
                .collect(),
            observation: format!("found {i} {}", "x".repeat(500)),
            ..AgentStep::default()
        }
    }

    #[test]
    fn a_long_react_history_folds_to_a_bounded_one_that_counts_every_step() {
        let mut history: Vec<AgentStep> = Vec::new();
        let mut documents = Vec::new();
        let mut largest = 0;
        for i in 1..=200 {
            history.push(step(i));
            if let Some(folded) = fold(&history, FOLD_KEEP) {
                // The document holds what was folded, an earlier folded step first.
                let kept: Vec<AgentStep> = serde_json::from_str(&folded.document).unwrap();
                assert_eq!(steps_taken(&kept), i - FOLD_KEEP);
                assert_eq!(folded.uri, document_uri(&folded.document));
                documents.push(folded.uri.clone());
                history = folded.history;
            }
            assert_eq!(steps_taken(&history), i, "every step counted");
            assert!(history.len() <= 2 * FOLD_KEEP + 1);
            largest = largest.max(serde_json::to_string(&history).unwrap().len());
        }
        // Folded at steps 17, 26, ..., 197: each time all but the newest eight.
        assert_eq!(documents.len(), 21);
        assert!(largest < 16 * 1024, "{largest}");
        let first = &history[0];
        assert_eq!(folded_count(first), Some(189));
        assert!(first.observation.starts_with("189 earlier steps"));
        assert!(first.observation.contains("Steps 1-181: not listed"));
        assert!(first
            .observation
            .contains("Step 182: search {\"q\":\"query 182\"} -> found 182"));
        assert!(first.observation.contains("Step 189: search"));
        assert!(
            first.observation.len() < 4096,
            "{}",
            first.observation.len()
        );
        // The newest steps are as they were.
        assert_eq!(history.last(), Some(&step(200)));
    }

    #[test]
    fn plans_and_short_histories_are_not_folded_and_folding_is_deterministic() {
        let short: Vec<AgentStep> = (1..=2 * FOLD_KEEP).map(step).collect();
        assert_eq!(fold(&short, FOLD_KEEP), None);
        let mut planned: Vec<AgentStep> = (1..=40).map(step).collect();
        planned[0].step_type = "plan".into();
        assert_eq!(fold(&planned, FOLD_KEEP), None);
        let long: Vec<AgentStep> = (1..=40).map(step).collect();
        assert_eq!(fold(&long, FOLD_KEEP), fold(&long, FOLD_KEEP));
        // A step that only looks folded (an action) counts as one.
        let mut tool = step(1);
        tool.arguments.insert(FOLDED_STEPS.into(), "50".into());
        assert_eq!(steps_taken(&[tool]), 1);
        // Forged counts neither overflow nor count as folds.
        let forged = |count: &str| AgentStep {
            arguments: [(FOLDED_STEPS.to_owned(), count.to_owned())]
                .into_iter()
                .collect(),
            ..AgentStep::default()
        };
        let huge = usize::MAX.to_string();
        assert_eq!(steps_taken(&[forged(&huge), forged(&huge), forged("0")]), 3);
        let most = MAX_FOLDED.to_string();
        assert_eq!(steps_taken(&[forged(&most), forged(&most)]), 2 * MAX_FOLDED);
    }

    #[test]
    fn an_excerpt_names_its_document_and_length() {
        let text = "é".repeat(3000);
        let uri = document_uri(&text);
        assert!(uri.starts_with(DOCUMENT_PREFIX) && uri.len() == DOCUMENT_PREFIX.len() + 64);
        let excerpt = excerpt_with_reference(&text, &uri);
        assert!(excerpt.len() < EXCERPT_BYTES + 200);
        assert_eq!(reference(&excerpt), Some((uri.as_str(), 6000)));
        assert_eq!(reference("an observation\n[claim-check: x]"), None);
        assert_eq!(
            reference("[claim-check: 5 bytes in <urn:other> ]"),
            None,
            "only our documents"
        );
    }

    #[test]
    fn a_reference_names_a_document_and_nothing_else() {
        let good = document_uri("some text");
        let excerpt = excerpt_with_reference("some text", &good);
        assert_eq!(reference(&excerpt), Some((good.as_str(), 9)));
        for forged in [
            format!("{DOCUMENT_PREFIX}x>}}?a ?b ?c . ?d ?e ?f}}#"),
            format!("{DOCUMENT_PREFIX}{}", "a".repeat(63)),
            format!("{DOCUMENT_PREFIX}{}>", "a".repeat(64)),
        ] {
            let excerpt = format!("text{MARK}1 bytes in {forged}]");
            assert_eq!(reference(&excerpt), None, "{forged}");
        }
    }

    #[test]
    fn the_name_is_the_texts_sha256() {
        assert_eq!(
            document_uri("abc"),
            format!(
                "{DOCUMENT_PREFIX}ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            )
        );
        assert_eq!(prefix("aé", 2), "a");
    }
}
