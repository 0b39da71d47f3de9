//! Conversations: a request's `conversation_id` joins it to the conversation's earlier dialogs. A
//! new dialog is given a bounded summary of their questions and answers, read from the graph, as
//! part of its framing (so every pattern's prompts, and its subagents', see it), and its session
//! node links to them (`tg:follows`). A dialog that starts while another of its conversation still
//! runs follows the configured policy (`conversation_policy`: queue, reject or interrupt).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_core::provenance::SessionUris;
use agent_graph::model::{NamedNode, Term};
use agent_graph::{queries, GraphError, GraphStore, QueryAnswer};

/// How many earlier dialogs a new one is told about (the newest).
pub const EARLIER_DIALOGS: usize = 5;

/// The most dialogs of a conversation not ended that a new dialog reads besides the newest
/// [`EARLIER_DIALOGS`] (each runs, or ran until a crash, and is waited for).
const UNENDED_DIALOGS: usize = 16;
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
    let newest = queries::conversation_dialogs(conversation_id, &current, EARLIER_DIALOGS);
    // A dialog still running may be older than the newest few, which then all ended (requests
    // cancelled or given up at their first step, another replica's clock ahead): read apart, or
    // a new dialog would start beside it. Its rows have no answer.
    let unended = queries::conversation_unended(conversation_id, &current, UNENDED_DIALOGS);
    let mut dialogs: Vec<Earlier> = Vec::new();
    for query in [newest, unended] {
        if let QueryAnswer::Rows(rows) = store.query(query).await? {
            add_dialogs(&rows, &mut dialogs);
        }
    }
    dialogs
        .sort_by_key(|d| std::cmp::Reverse(chrono::DateTime::parse_from_rfc3339(&d.started).ok()));
    Ok(dialogs)
}

/// Adds the dialogs `rows` name (`?s ?question ?started`, and `?answer` or `?ended` once ended)
/// to `dialogs`, each once.
fn add_dialogs(rows: &agent_graph::Rows, dialogs: &mut Vec<Earlier>) {
    let text = |t: Option<&Term>| match t {
        Some(Term::Literal(l)) => Some(l.value().to_owned()),
        Some(Term::NamedNode(n)) => Some(n.as_str().to_owned()),
        _ => None,
    };
    let columns = ["s", "question", "started", "answer", "ended"].map(|c| rows.column(c));
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
}

/// How long a new dialog waits for the graph to show the end of an earlier one the journal says
/// ended: its conclusion is on its way there (a message through the broker and one write).
pub const ENDED_SHOWN_WITHIN: Duration = Duration::from_secs(10);

/// `earlier` read again until it shows each of the dialogs `ended` ended (a dialog of one step
/// shows there only then), for [`ENDED_SHOWN_WITHIN`] at most: past it, the new dialog goes on
/// without their answers.
pub async fn once_shown_ended(
    store: &GraphStore,
    conversation_id: &str,
    session_id: &str,
    mut earlier: Vec<Earlier>,
    ended: &[String],
) -> Result<Vec<Earlier>, GraphError> {
    let unshown = |earlier: &[Earlier]| {
        ended.iter().any(|e| {
            !earlier
                .iter()
                .any(|d| d.session_id() == e && d.answer.is_some())
        })
    };
    let deadline = Instant::now() + ENDED_SHOWN_WITHIN;
    let mut pause = Duration::from_millis(20);
    while unshown(&earlier) {
        if Instant::now() + pause > deadline {
            tracing::warn!(conversation = conversation_id, ?ended, "the graph does not show the end of an earlier dialog of the conversation, which the journal recorded; the new dialog goes on without its answer");
            break;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
        earlier = self::earlier(store, conversation_id, session_id).await?;
    }
    Ok(earlier)
}

/// How long a request waiting for its turn may go without asking again before it is taken for
/// gone (its process stopped, its message went to another replica), so that it does not block
/// the line behind it. Those behind the first ask every half second; the first asks as its step
/// is tried again, and one whose step is parked longer than this (an outage) loses its place:
/// the order is kept while things run, and two never start together either way.
const GONE_AFTER: Duration = Duration::from_secs(10);
/// This replica's lines, one per conversation: its requests check a conversation one at a time,
/// and those that wait take their turns in the order they came. Whether one may start, and its
/// start, are the journal's owner's to give (`agent_graph::turns`), for every replica at once:
/// the graph alone cannot keep two of a conversation's dialogs from starting side by side, as a
/// dialog shows there only once the aggregator has written its first step.
#[derive(Default)]
pub struct Turns {
    lines: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Line>>>>,
    /// Holds since the lines nobody uses were last looked through.
    holds: std::sync::atomic::AtomicUsize,
    /// Requests that stopped waiting while their conversation's line was held, by conversation:
    /// taken out of it as that hold ends, or by the next.
    left: Mutex<HashMap<String, Vec<String>>>,
}

/// How many holds pass between looks through every line for those left with only stale entries
/// (a conversation that sent nothing since its last dialog started here).
const TIDY_EVERY: usize = 64;

/// One conversation's line on this replica.
#[derive(Debug, Default)]
pub struct Line {
    /// Requests waiting, first come first, each with when it last asked.
    waiting: VecDeque<(String, Instant)>,
}

/// A conversation's line, held: nobody else here checks or changes it meanwhile.
pub struct HeldLine<'t> {
    turns: &'t Turns,
    conversation: String,
    line: tokio::sync::OwnedMutexGuard<Line>,
}

impl Turns {
    /// Waits for the conversation's line and holds it.
    pub async fn hold(&self, conversation: &str) -> HeldLine<'_> {
        let line = {
            let mut lines = locked(&self.lines);
            let holds = self
                .holds
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if holds.is_multiple_of(TIDY_EVERY) {
                tidy(&mut lines);
                // One that left a line gone since (it left as the line's last hold ended).
                locked(&self.left).retain(|conversation, _| lines.contains_key(conversation));
            }
            lines.entry(conversation.to_owned()).or_default().clone()
        };
        let mut line = line.lock_owned().await;
        self.apply_left(conversation, &mut line);
        line.forget_stale(Instant::now());
        HeldLine {
            turns: self,
            conversation: conversation.to_owned(),
            line,
        }
    }

    /// Returns once `session` is first in its conversation's line (or no longer in it: taken for
    /// gone meanwhile), asking every `pause`: until then it need not check the conversation.
    pub async fn until_first(&self, conversation: &str, session: &str, pause: Duration) {
        loop {
            tokio::time::sleep(pause).await;
            if self.hold(conversation).await.ask(session) {
                return;
            }
        }
    }

    /// Takes `session` out of its conversation's line (it stopped waiting): at once, or as soon
    /// as whoever holds the line this instant lets it go. (Left in it, it stayed first until it
    /// was taken for gone, [`GONE_AFTER`] later, and the requests behind it waited that long.)
    pub fn leave(&self, conversation: &str, session: &str) {
        let Some(line) = locked(&self.lines).get(conversation).cloned() else {
            return;
        };
        let left_now = match line.try_lock() {
            Ok(mut held) => {
                held.waiting.retain(|(s, _)| s != session);
                true
            }
            Err(_) => false,
        };
        if !left_now {
            locked(&self.left)
                .entry(conversation.to_owned())
                .or_default()
                .push(session.to_owned());
        }
    }

    /// Takes out of `line` the requests that left it while it was held.
    fn apply_left(&self, conversation: &str, line: &mut Line) {
        if let Some(sessions) = locked(&self.left).remove(conversation) {
            line.waiting.retain(|(s, _)| !sessions.contains(s));
        }
    }

    /// Conversations with a line here.
    #[cfg(test)]
    fn count(&self) -> usize {
        locked(&self.lines).len()
    }
}

/// Forgets what went stale in the lines nobody holds or waits for, and the lines left empty.
fn tidy(lines: &mut HashMap<String, Arc<tokio::sync::Mutex<Line>>>) {
    let now = Instant::now();
    lines.retain(|_, line| {
        if Arc::strong_count(line) > 1 {
            return true;
        }
        match line.try_lock() {
            Ok(mut unused) => {
                unused.forget_stale(now);
                !unused.is_empty()
            }
            Err(_) => true,
        }
    });
}

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl HeldLine<'_> {
    /// The request first in line, if it is not `session`.
    pub fn ahead_of(&self, session: &str) -> Option<String> {
        match self.line.waiting.front() {
            Some((first, _)) if first != session => Some(first.clone()),
            _ => None,
        }
    }

    /// Says `session` asked again; whether it is first in line (or not in it at all).
    pub fn ask(&mut self, session: &str) -> bool {
        match self.line.waiting.iter().position(|(s, _)| s == session) {
            Some(at) => {
                self.line.waiting[at].1 = Instant::now();
                at == 0
            }
            None => true,
        }
    }

    /// Puts `session` at the end of the line, unless it is in it already.
    pub fn wait(&mut self, session: &str) {
        if !self.line.waiting.iter().any(|(s, _)| s == session) {
            self.line
                .waiting
                .push_back((session.to_owned(), Instant::now()));
        }
    }

    /// Takes `session` out of the line (it starts, or stops waiting).
    pub fn leave(&mut self, session: &str) {
        self.line.waiting.retain(|(s, _)| s != session);
    }
}

impl Line {
    fn forget_stale(&mut self, now: Instant) {
        self.waiting
            .retain(|(_, asked)| now.duration_since(*asked) < GONE_AFTER);
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

impl Drop for HeldLine<'_> {
    fn drop(&mut self) {
        self.turns.apply_left(&self.conversation, &mut self.line);
        if !self.line.is_empty() {
            return;
        }
        // Held by the map and by this guard only: nobody else waits for it, so it can go (one
        // who asks for it from now on makes a new one, empty as this one is).
        let mut lines = locked(&self.turns.lines);
        if lines
            .get(&self.conversation)
            .is_some_and(|line| Arc::strong_count(line) == 2)
        {
            lines.remove(&self.conversation);
        }
    }
}

/// A new dialog's start in its conversation, renewed with the journal's owner every third of its
/// lease while its first step runs or is parked: the graph shows the dialog only once that step
/// has committed, which a slow model can put off for longer than any fixed wait. Dropped when
/// the step settles; a replica that crashes stops renewing, and the start lapses a lease later.
pub struct KeptStart(tokio::task::AbortHandle);

impl Drop for KeptStart {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl KeptStart {
    /// Renews the start of `session` in `conversation` until dropped or the session is cancelled
    /// (kept by this process alone without a journal, as its start was), at once too if
    /// `at_once` (a start taken before, whose lease may be near its end).
    pub fn renewing(
        journal: Option<crate::journal::Journal>,
        conversation: &str,
        session: &str,
        lease: Duration,
        at_once: bool,
        cancellations: Arc<crate::cancel::Cancellations>,
    ) -> KeptStart {
        let lease = lease.clamp(
            agent_graph::turns::LEASE_BOUNDS.0,
            agent_graph::turns::LEASE_BOUNDS.1,
        );
        let asked = agent_graph::turns::TurnAsked {
            conversation: conversation.to_owned(),
            session: session.to_owned(),
            shown: Vec::new(),
            shown_running: false,
            running: None,
            start: agent_graph::turns::StartIf::Running,
            for_ms: Some(u64::try_from(lease.as_millis()).unwrap_or(u64::MAX)),
        };
        // A renewal that gets no answer gives up in half a period, so the next is still in time
        // (a third of the lease later, on the beat, not after the failure).
        let every = lease / 3;
        let within = every / 2;
        let renewing = tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            if !at_once {
                ticks.tick().await;
            }
            let mut failing = false;
            loop {
                ticks.tick().await;
                // Cancelled (interrupted, say) while it waits out a park: it ends at its next
                // try, and holds its conversation no longer than a lease meanwhile.
                if cancellations.of(&asked.session).is_some() {
                    return;
                }
                let renewed = match &journal {
                    Some(journal) => {
                        match tokio::time::timeout(within, journal.take_turn(asked.clone())).await {
                            Ok(renewed) => renewed,
                            Err(_) => Err(GraphError::Transport(format!(
                                "no answer within {within:?}"
                            ))),
                        }
                    }
                    None => Ok(agent_graph::turns::take_turn_here("", &asked)),
                };
                match renewed {
                    Ok(turn) => {
                        failing = false;
                        if turn.started && !turn.unseen.is_empty() {
                            tracing::warn!(conversation = %asked.conversation, session = %asked.session, others = ?turn.unseen, "a running first step's start had lapsed with the journal's owner (a restart, or renewals that failed): another dialog of the conversation may have started beside it");
                        }
                    }
                    Err(e) if !failing => {
                        failing = true;
                        tracing::warn!(conversation = %asked.conversation, session = %asked.session, error = %e, "cannot renew a running first step's start with the journal's owner: once it lapses, another dialog of the conversation may start beside it");
                    }
                    Err(_) => {}
                }
            }
        });
        KeptStart(renewing.abort_handle())
    }
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

    /// `dialogs` of conversation `c`: (session, started at, answer once ended).
    async fn conversation_of(dialogs: &[(&str, &str, Option<&str>)]) -> GraphStore {
        let store = GraphStore::in_memory().unwrap();
        let mut data = String::new();
        for (session, started, answer) in dialogs {
            let s = format!("{}{session}", agent_core::vocab::SESSION_PREFIX);
            data.push_str(&format!(
                "<{s}> a tg:AgentQuestion ; tg:conversation \"c\" ; tg:query \"question {session}\" ;
                   prov:startedAtTime \"{started}\"^^<http://www.w3.org/2001/XMLSchema#dateTime> .\n"
            ));
            if let Some(answer) = answer {
                data.push_str(&format!(
                    "<{s}/final> tg:terminationReason \"final-answer\" ; tg:document <{s}/answer> .
                     <{s}/answer> tg:content \"{answer}\" .\n"
                ));
            }
        }
        store
            .update(format!(
                "{}INSERT DATA {{ GRAPH <{}> {{ {data} }} }}",
                agent_core::vocab::SPARQL_PREFIXES,
                agent_core::vocab::PROVENANCE_GRAPH
            ))
            .await
            .unwrap();
        store
    }

    #[tokio::test]
    async fn a_running_dialog_is_seen_past_the_newest_that_ended() {
        let now = chrono::Utc::now();
        let at = |secs_ago: i64| {
            (now - chrono::Duration::seconds(secs_ago))
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
        };
        // The first still runs; five more started after it and ended at once.
        let mut dialogs = vec![("first", at(60), None)];
        for i in 0..EARLIER_DIALOGS {
            dialogs.push((
                ["a", "b", "c", "d", "e"][i],
                at(50 - i as i64),
                Some("cancelled"),
            ));
        }
        let dialogs: Vec<(&str, &str, Option<&str>)> = dialogs
            .iter()
            .map(|(s, t, a)| (*s, t.as_str(), *a))
            .collect();
        let store = conversation_of(&dialogs).await;
        let earlier = earlier(&store, "c", "new").await.unwrap();
        let running: Vec<&str> = earlier
            .iter()
            .filter(|d| d.running(Duration::ZERO))
            .map(Earlier::session_id)
            .collect();
        assert_eq!(running, ["first"], "{earlier:?}");
        // Newest first, the running one last.
        assert_eq!(earlier.len(), EARLIER_DIALOGS + 1);
        assert_eq!(earlier.last().map(Earlier::session_id), Some("first"));
    }

    #[tokio::test]
    async fn waiting_requests_take_their_turns_in_the_order_they_came() {
        let turns = Turns::default();
        let mut line = turns.hold("c").await;
        line.wait("b");
        line.wait("c2");
        line.wait("b");
        assert_eq!(line.ahead_of("c2").as_deref(), Some("b"));
        assert_eq!(line.ahead_of("b"), None);
        // A newcomer queues behind those already waiting.
        assert_eq!(line.ahead_of("d").as_deref(), Some("b"));
        assert!(line.ask("b"));
        assert!(!line.ask("c2"));
        line.leave("b");
        assert_eq!(line.ahead_of("d").as_deref(), Some("c2"));
        assert!(line.ask("c2"));
        drop(line);
        assert_eq!(turns.count(), 1);
    }

    #[tokio::test]
    async fn a_request_that_stops_waiting_while_the_line_is_held_leaves_it_once_let_go() {
        let turns = Turns::default();
        let mut line = turns.hold("c").await;
        line.wait("first");
        line.wait("second");
        turns.leave("c", "first");
        drop(line);
        let mut line = turns.hold("c").await;
        assert_eq!(line.ahead_of("second"), None, "it stayed first in line");
        assert!(line.ask("second"));
    }

    #[tokio::test]
    async fn a_request_that_stops_asking_leaves_the_line_and_an_empty_line_goes() {
        let turns = Turns::default();
        {
            let mut line = turns.hold("c").await;
            line.wait("gone");
            line.wait("next");
            line.line.forget_stale(Instant::now() + GONE_AFTER);
            assert_eq!(line.ahead_of("next"), None);
            line.leave("next");
        }
        assert_eq!(turns.count(), 0, "an empty line is not kept");
        // A line left with only what went stale since (nobody of its conversation came again) is
        // let go by the next tidying.
        {
            let mut line = turns.hold("quiet").await;
            let long_ago = Instant::now().checked_sub(GONE_AFTER * 2).unwrap();
            line.line.waiting.push_back(("a".into(), long_ago));
        }
        assert_eq!(turns.count(), 1);
        tidy(&mut locked(&turns.lines));
        assert_eq!(turns.count(), 0);
        // One that is not in line at all goes as far as the line is concerned.
        assert!(turns.hold("c").await.ask("never-queued"));
        assert_eq!(turns.count(), 0);
    }

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
