//! Conversations: a request's `conversation_id` joins it to the conversation's earlier dialogs. A
//! new dialog is given a bounded summary of their questions and answers, read from the graph, as
//! part of its framing (so every pattern's prompts, and its subagents', see it), and its session
//! node links to them (`tg:follows`). A dialog that starts while another of its conversation still
//! runs follows the configured policy (`conversation_policy`: queue, reject or interrupt).

use std::time::Duration;

use agent_core::provenance::SessionUris;
use agent_graph::model::{NamedNode, Term};
use agent_graph::{queries, GraphError, GraphStore, QueryAnswer};

/// How many earlier dialogs a new one is told about (the newest).
pub const EARLIER_DIALOGS: usize = 5;
/// How much of each earlier question and answer the summary keeps.
const EXCERPT_CHARS: usize = 600;

/// An earlier dialog of the conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Earlier {
    pub session_uri: String,
    pub question: String,
    pub started: String,
    /// Its answer (or error), once it ended.
    pub answer: Option<String>,
}

impl Earlier {
    /// Whether it is still running: not ended, and started within `max_wall` (a dialog past its
    /// wall-time budget ends at its next step; one that never took it is not waited for).
    pub fn running(&self, max_wall: Duration) -> bool {
        if self.answer.is_some() {
            return false;
        }
        let Ok(started) = chrono::DateTime::parse_from_rfc3339(&self.started) else {
            return false;
        };
        let age = chrono::Utc::now().signed_duration_since(started);
        max_wall.is_zero()
            || age < chrono::Duration::from_std(max_wall).unwrap_or(chrono::Duration::MAX)
    }

    pub fn session_id(&self) -> &str {
        agent_core::vocab::session_id_of(&self.session_uri).unwrap_or_default()
    }
}

/// The conversation's dialogs other than `session_id`'s, newest first.
pub async fn earlier(
    store: &GraphStore,
    conversation_id: &str,
    session_id: &str,
) -> Result<Vec<Earlier>, GraphError> {
    let Ok(current) = NamedNode::new(SessionUris::new(session_id).session()) else {
        return Ok(Vec::new());
    };
    let query = queries::conversation_dialogs(conversation_id, &current, EARLIER_DIALOGS);
    let QueryAnswer::Rows(rows) = store.query(query).await? else {
        return Ok(Vec::new());
    };
    let text = |t: Option<&Term>| match t {
        Some(Term::Literal(l)) => Some(l.value().to_owned()),
        Some(Term::NamedNode(n)) => Some(n.as_str().to_owned()),
        _ => None,
    };
    let columns = ["s", "question", "started", "answer", "ended"].map(|c| rows.column(c));
    let mut dialogs: Vec<Earlier> = Vec::new();
    for i in 0..rows.rows.len() {
        let cell = |c: usize| text(columns[c].get(i).copied().flatten());
        let Some(session_uri) = cell(0) else {
            continue;
        };
        // A dialog that ended without a text (none is written) still ended.
        let answer = cell(3).or_else(|| cell(4).map(|why| format!("(ended: {why})")));
        if let Some(seen) = dialogs.iter_mut().find(|d| d.session_uri == session_uri) {
            if seen.answer.is_none() {
                seen.answer = answer;
            }
            continue;
        }
        dialogs.push(Earlier {
            session_uri,
            question: cell(1).unwrap_or_default(),
            started: cell(2).unwrap_or_default(),
            answer,
        });
    }
    Ok(dialogs)
}

/// The summary a new dialog is given: the earlier dialogs oldest first, each question and answer
/// cut to a bounded excerpt. Empty when there are none.
pub fn context(earlier: &[Earlier]) -> String {
    if earlier.is_empty() {
        return String::new();
    }
    let cut = |text: &str| {
        let mut kept: String = text.chars().take(EXCERPT_CHARS).collect();
        if kept.len() < text.len() {
            kept.push_str(" [...]");
        }
        kept
    };
    let mut summary = String::from("Earlier in this conversation:\n");
    for dialog in earlier.iter().rev() {
        summary.push_str(&format!("Q: {}\n", cut(&dialog.question)));
        match &dialog.answer {
            Some(answer) => summary.push_str(&format!("A: {}\n", cut(answer))),
            None => summary.push_str("A: (not answered yet)\n"),
        }
    }
    summary
}

/// The request's framing with the summary added.
pub fn framed(framing: &str, summary: &str) -> String {
    match (framing.trim().is_empty(), summary.is_empty()) {
        (_, true) => framing.to_owned(),
        (true, false) => summary.to_owned(),
        (false, false) => format!("{}\n\n{summary}", framing.trim_end()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dialog(question: &str, answer: Option<&str>, started: &str) -> Earlier {
        Earlier {
            session_uri: "urn:trustgraph:agent:s1".into(),
            question: question.into(),
            started: started.into(),
            answer: answer.map(str::to_owned),
        }
    }

    #[test]
    fn the_summary_is_oldest_first_and_bounded() {
        let long = "x".repeat(5000);
        let newest_first = [
            dialog("second?", None, "2026-11-25T10:01:00Z"),
            dialog("first?", Some(&long), "2026-11-25T10:00:00Z"),
        ];
        let summary = context(&newest_first);
        assert!(summary.find("first?").unwrap() < summary.find("second?").unwrap());
        assert!(summary.contains("A: (not answered yet)"));
        assert!(summary.len() < 1000, "{}", summary.len());
        assert!(summary.contains("[...]"));
        assert_eq!(context(&[]), "");
    }

    #[test]
    fn only_an_unended_recent_dialog_runs() {
        let now = chrono::Utc::now().to_rfc3339();
        let wall = Duration::from_secs(600);
        assert!(dialog("q", None, &now).running(wall));
        assert!(!dialog("q", Some("a"), &now).running(wall));
        assert!(!dialog("q", None, "2020-01-01T00:00:00Z").running(wall));
    }

    #[test]
    fn framing_keeps_what_was_there() {
        assert_eq!(framed("", "S"), "S");
        assert_eq!(framed("F", ""), "F");
        assert_eq!(framed("F\n", "S"), "F\n\nS");
    }
}
