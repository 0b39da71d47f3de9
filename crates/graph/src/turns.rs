//! Which dialogs of each conversation were let start and may not show in the graph yet, kept where
//! the journal is decided so that every replica asks the one place. A dialog shows in the graph
//! only once the aggregator has written its first step, so two of a conversation's dialogs taken
//! up by two replicas in one instant each found the other absent there and both started, whatever
//! the conversation's policy. Here the question "may it start?" and the start are one step under
//! one lock. Kept in memory, by store (`GraphStore::identity`), each start until an asker's graph
//! shows its dialog or its lease lapses: the replica running a first step renews the lease
//! ([`StartIf::Running`]) until the step has committed, so a slow first step (a local model can
//! take minutes) keeps its start, and a crashed replica's start lapses. An owner that restarts
//! forgets the starts, and has each back at its next renewal.
//!
//! The graph also shows a dialog's end late: its conclusion travels to the store behind the
//! closing the client already holds, so a client that sent its next question on the answer found
//! the conversation still taken (refused under `reject`). The journal records a closing before it
//! is published, so its owner notes the dialog ended ([`note_ended`]) and answers askers with it
//! until their graph shows it too.

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// How long a start counts, unless its asker says ([`TurnAsked::for_ms`]), while the graph does
/// not show its dialog and nobody renews it; past it, the graph alone decides.
pub const SHOWN_WITHIN: Duration = Duration::from_secs(30);

/// The shortest and longest lease an asker may ask for a start.
pub const LEASE_BOUNDS: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(600));

/// The most conversations with starts kept at once: past it, a start is answered but not kept.
const MAX_CONVERSATIONS: usize = 65_536;

/// The most starts kept for one conversation: one at a time under `queue` and `reject`, one more
/// under `interrupt` for each interrupted dialog whose first step still runs.
const MAX_STARTS: usize = 64;

/// How long the owner keeps a dialog's end while the graph may not show it: far past the
/// graph's lag, which is a message through the broker and one write.
pub const ENDED_KEPT: Duration = Duration::from_secs(300);

/// The most ended dialogs kept at once: past it, the oldest go first.
const MAX_ENDED: usize = 65_536;

/// How many questions pass between sweeps of lapsed starts while the map is full (a sweep reads
/// every conversation under the lock).
const SWEEP_EVERY: u64 = 1024;

/// The longest conversation or dialog id one question may name (an orchestrator accepts ids of
/// 240 bytes).
pub const MAX_ID_BYTES: usize = 256;

/// The most dialogs one question may say its graph shows (an orchestrator reads five).
pub const MAX_SHOWN: usize = 64;

/// When the asking dialog may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartIf {
    /// Only if no other dialog of the conversation runs: none the asker's graph shows running, and
    /// none let start that it does not show yet.
    Clear,
    /// Whatever runs: the asker has interrupted the others, which stay here until their dialogs
    /// show (each runs until it hears its cancel).
    Anyway,
    /// Not at all: the asker only wants to know (a cancelled request, which ends at once, or a
    /// queued one with another waiting ahead of it on its replica).
    Never,
    /// It runs already (its first step, let start before, is under way on the asker's replica):
    /// its lease is renewed, and its start kept again if it had lapsed or the owner restarted.
    Running,
}

/// A dialog's question to its conversation.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TurnAsked {
    pub conversation: String,
    /// The asking dialog's session id.
    pub session: String,
    /// The conversation's other dialogs the asker's graph shows, ended or not: from now on the
    /// graph judges them.
    pub shown: Vec<String>,
    /// Whether one of them runs, as the graph shows it.
    pub shown_running: bool,
    /// Which of them run, as the graph shows them: an owner that knows one ended judges without
    /// it (an asker of an earlier build sends only `shown_running`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<Vec<String>>,
    pub start: StartIf,
    /// How long the start is kept unless renewed, in milliseconds (within [`LEASE_BOUNDS`];
    /// [`SHOWN_WITHIN`] when not given, as an asker of an earlier build sends it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_ms: Option<u64>,
}

impl TurnAsked {
    fn lease(&self) -> Duration {
        self.for_ms.map_or(SHOWN_WITHIN, |ms| {
            Duration::from_millis(ms).clamp(LEASE_BOUNDS.0, LEASE_BOUNDS.1)
        })
    }
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Turn {
    /// It was let start before (its first step was parked or handed back): it goes on.
    pub started_before: bool,
    /// It was let start now.
    pub started: bool,
    /// The other dialogs let start that the asker's graph does not show yet: they run.
    pub unseen: Vec<String>,
    /// The conversation's other dialogs the journal has recorded a closing of, which the asker's
    /// graph shows running or does not show yet: they ended, and the graph will show it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ended: Vec<String>,
}

/// Starts by store and conversation, each with when its lease lapses.
#[derive(Default)]
pub(crate) struct Starts {
    by_conversation: HashMap<(u64, String), HashMap<String, Instant>>,
    /// Questions answered while the map was full, for [`SWEEP_EVERY`].
    asked_while_full: u64,
    /// Dialogs whose closing was recorded, by store and session, each with when it is forgotten.
    ended: HashMap<(u64, String), Instant>,
    /// The same, oldest first (all are kept equally long), for forgetting them in order.
    ended_in_order: std::collections::VecDeque<(Instant, (u64, String))>,
}

impl Starts {
    /// Answers `asked` over the store `store`, at `now`, starting the dialog when it may.
    pub(crate) fn take_turn(&mut self, store: u64, asked: &TurnAsked, now: Instant) -> Turn {
        let key = (store, asked.conversation.clone());
        let fresh = |lapses: &Instant| now < *lapses;
        if self.by_conversation.len() >= MAX_CONVERSATIONS
            && !self.by_conversation.contains_key(&key)
        {
            let sweep = self.asked_while_full.is_multiple_of(SWEEP_EVERY);
            if sweep {
                self.by_conversation
                    .retain(|_, starts| starts.values().any(fresh));
            }
            // A sweep that made room starts the count again, so that the first question once the
            // map is full again sweeps at once: a count left where it was answered up to
            // `SWEEP_EVERY - 1` starts without keeping them (two replicas could each start a
            // dialog of one conversation) each time the map filled up with lapsed starts.
            self.asked_while_full = if sweep && self.by_conversation.len() < MAX_CONVERSATIONS {
                0
            } else {
                self.asked_while_full.wrapping_add(1)
            };
        }
        let room = self.by_conversation.len() < MAX_CONVERSATIONS
            || self.by_conversation.contains_key(&key);
        self.forget_ended(now);
        if let Some(running) = &asked.running {
            // Shown, and not running there: from now on the graph judges it.
            for shown in asked.shown.iter().filter(|s| !running.contains(s)) {
                self.ended.remove(&(store, shown.clone()));
            }
        }
        let is_ended = |session: &String| self.ended.contains_key(&(store, session.clone()));
        let mut ended: Vec<String> = asked
            .running
            .iter()
            .flatten()
            .filter(|session| is_ended(session))
            .cloned()
            .collect();
        let shown_running = match &asked.running {
            Some(running) => running.iter().any(|session| !ended.contains(session)),
            None => asked.shown_running,
        };
        let mut starts = self.by_conversation.remove(&key).unwrap_or_default();
        starts.retain(|session, at| {
            let unshown = fresh(at) && !asked.shown.contains(session);
            if unshown && is_ended(session) {
                if *session != asked.session {
                    ended.push(session.clone());
                }
                return false;
            }
            unshown
        });
        let started_before = starts.contains_key(&asked.session);
        let unseen: Vec<String> = starts
            .keys()
            .filter(|session| **session != asked.session)
            .cloned()
            .collect();
        let started = !started_before
            && match asked.start {
                StartIf::Clear => unseen.is_empty() && !shown_running,
                StartIf::Anyway | StartIf::Running => true,
                StartIf::Never => false,
            };
        // Asked again with a will to start (its step parked or handed back), it is still starting.
        let renewed = started_before && asked.start != StartIf::Never;
        if renewed || (started && starts.len() < MAX_STARTS) {
            starts.insert(asked.session.clone(), now + asked.lease());
        }
        if room && !starts.is_empty() {
            self.by_conversation.insert(key, starts);
        }
        Turn {
            started_before,
            started,
            unseen,
            ended,
        }
    }

    /// Keeps that the dialog `session` over the store `store` ended (its closing is recorded).
    pub(crate) fn note_ended(&mut self, store: u64, session: &str, now: Instant) {
        self.forget_ended(now);
        while self.ended_in_order.len() >= MAX_ENDED {
            self.forget_oldest();
        }
        let until = now + ENDED_KEPT;
        let key = (store, session.to_owned());
        self.ended.insert(key.clone(), until);
        self.ended_in_order.push_back((until, key));
    }

    fn forget_ended(&mut self, now: Instant) {
        while self
            .ended_in_order
            .front()
            .is_some_and(|(until, _)| *until <= now)
        {
            self.forget_oldest();
        }
    }

    fn forget_oldest(&mut self) {
        if let Some((until, key)) = self.ended_in_order.pop_front() {
            // Unless noted again since (a copy of the step recorded later keeps it longer).
            if self.ended.get(&key) == Some(&until) {
                self.ended.remove(&key);
            }
        }
    }
}

/// The starts this process keeps as an owner of journals, for all of them (keyed by store).
static OWNED: LazyLock<Mutex<Starts>> = LazyLock::new(Default::default);

fn owned() -> MutexGuard<'static, Starts> {
    // Every holder leaves the map whole: a poisoned lock still guards a sound map.
    OWNED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An owner's answer to `asked` over its store `store`.
pub(crate) fn take_turn(store: u64, asked: &TurnAsked) -> Turn {
    owned().take_turn(store, asked, Instant::now())
}

/// An owner's note that the dialogs `sessions` over its store `store` ended: their closings are
/// recorded.
pub(crate) fn note_ended<'s>(store: u64, sessions: impl IntoIterator<Item = &'s str>) {
    let now = Instant::now();
    let mut owned = owned();
    for session in sessions {
        owned.note_ended(store, session, now);
    }
}

/// The starts kept by this process alone, for an asker whose journal's owner does not keep them
/// (an earlier build), or that has no journal: as before, two replicas can each let one start in
/// the same instant.
static OWN_ONLY: LazyLock<Mutex<Starts>> = LazyLock::new(Default::default);

/// [`take_turn`] kept by this process alone, for the store named `store` (its endpoint), so that
/// askers of two stores in one process do not share conversations.
pub fn take_turn_here(store: &str, asked: &TurnAsked) -> Turn {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    store.hash(&mut hasher);
    OWN_ONLY
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take_turn(hasher.finish(), asked, Instant::now())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(session: &str, shown: &[&str], shown_running: bool, start: StartIf) -> TurnAsked {
        TurnAsked {
            conversation: "c".into(),
            session: session.into(),
            shown: shown.iter().map(|s| (*s).to_owned()).collect(),
            shown_running,
            running: None,
            start,
            for_ms: None,
        }
    }

    #[test]
    fn a_start_is_kept_each_time_the_map_fills_up_with_lapsed_starts() {
        let mut starts = Starts::default();
        let mut now = Instant::now();
        let lone = |conversation: String, session: &str| TurnAsked {
            conversation,
            ..asked(session, &[], false, StartIf::Clear)
        };
        for round in 0..2 {
            // A long run's conversations of one dialog each, never asked again, their starts
            // lapsed by the time the map is full.
            let held = starts.by_conversation.len();
            for k in held..MAX_CONVERSATIONS {
                let turn = starts.take_turn(1, &lone(format!("{round}-{k}"), "s"), now);
                assert!(turn.started);
            }
            assert_eq!(starts.by_conversation.len(), MAX_CONVERSATIONS);
            now += LEASE_BOUNDS.1 + Duration::from_secs(1);
            let new = format!("new-{round}");
            assert!(starts.take_turn(1, &lone(new.clone(), "a"), now).started);
            // Kept: a second dialog of that conversation asking at once waits for it.
            let second = starts.take_turn(1, &lone(new, "b"), now);
            assert!(!second.started, "round {round}: {second:?}");
            assert_eq!(second.unseen, ["a"], "round {round}");
        }
    }

    #[test]
    fn of_two_dialogs_asking_at_once_only_the_first_starts_until_the_graph_shows_it() {
        let mut starts = Starts::default();
        let now = Instant::now();
        let first = starts.take_turn(1, &asked("a", &[], false, StartIf::Clear), now);
        assert!(first.started && !first.started_before && first.unseen.is_empty());
        let second = starts.take_turn(1, &asked("b", &[], false, StartIf::Clear), now);
        assert!(!second.started, "{second:?}");
        assert_eq!(second.unseen, ["a"]);
        // The first asking again (its step was handed back) goes on.
        let again = starts.take_turn(1, &asked("a", &[], false, StartIf::Clear), now);
        assert!(again.started_before && !again.started);
        // Another store's conversation of the same name is another conversation.
        assert!(
            starts
                .take_turn(2, &asked("b", &[], false, StartIf::Clear), now)
                .started
        );
        // Once the graph shows the first, the graph judges it: running, the second still waits.
        let shown = starts.take_turn(1, &asked("b", &["a"], true, StartIf::Clear), now);
        assert!(!shown.started && shown.unseen.is_empty());
        // Ended there, the second starts.
        assert!(
            starts
                .take_turn(1, &asked("b", &["a"], false, StartIf::Clear), now)
                .started
        );
    }

    #[test]
    fn a_start_the_graph_never_shows_lapses_and_an_interrupt_takes_the_conversation_over() {
        let mut starts = Starts::default();
        let now = Instant::now();
        assert!(
            starts
                .take_turn(1, &asked("a", &[], false, StartIf::Clear), now)
                .started
        );
        let asking = starts.take_turn(1, &asked("b", &[], false, StartIf::Never), now);
        assert!(!asking.started && asking.unseen == ["a"]);
        let later = now + SHOWN_WITHIN;
        assert!(
            starts
                .take_turn(1, &asked("b", &[], false, StartIf::Clear), later)
                .started
        );
        let interrupting = starts.take_turn(1, &asked("c", &[], true, StartIf::Anyway), later);
        assert!(interrupting.started);
        assert_eq!(interrupting.unseen, ["b"]);
        // Asked again (its step handed back), it goes on; the interrupted one is still kept.
        let again = starts.take_turn(1, &asked("c", &[], true, StartIf::Anyway), later);
        assert!(again.started_before && again.unseen == ["b"]);
        // Once the graph shows the interrupted one, the next asks only about the interrupter.
        let next = starts.take_turn(1, &asked("d", &["b"], false, StartIf::Clear), later);
        assert_eq!(next.unseen, ["c"]);
        // Nothing kept for a conversation with no starts.
        let mut empty = Starts::default();
        empty.take_turn(1, &asked("x", &[], true, StartIf::Clear), now);
        assert!(empty.by_conversation.is_empty());
    }

    #[test]
    fn a_dialog_whose_closing_is_recorded_holds_its_conversation_no_longer() {
        let mut starts = Starts::default();
        let now = Instant::now();
        let showing = |session: &str, shown: &[&str], running: &[&str]| TurnAsked {
            running: Some(running.iter().map(|s| (*s).to_owned()).collect()),
            ..asked(session, shown, !running.is_empty(), StartIf::Clear)
        };
        // A one-step dialog: its start is kept, and it ends before the graph shows it.
        assert!(
            starts
                .take_turn(1, &asked("a", &[], false, StartIf::Clear), now)
                .started
        );
        starts.note_ended(1, "a", now);
        let next = starts.take_turn(1, &showing("b", &[], &[]), now);
        assert!(next.started && next.unseen.is_empty(), "{next:?}");
        assert_eq!(next.ended, ["a"]);
        // A longer one the graph shows running, ended: the next starts, told it ended.
        starts.note_ended(1, "b", now);
        let after = starts.take_turn(1, &showing("c", &["b"], &["b"]), now);
        assert!(after.started, "{after:?}");
        assert_eq!(after.ended, ["b"]);
        // Another store's dialog of the same session did not end.
        let elsewhere = starts.take_turn(2, &showing("c", &["b"], &["b"]), now);
        assert!(!elsewhere.started && elsewhere.ended.is_empty());
        // An asker of an earlier build, which sends no list, is judged as before.
        let earlier_build = TurnAsked {
            conversation: "another".into(),
            ..asked("d", &["b"], true, StartIf::Clear)
        };
        let judged = starts.take_turn(1, &earlier_build, now);
        assert!(!judged.started && judged.unseen.is_empty() && judged.ended.is_empty());
        // Once an asker's graph shows the end, it is forgotten here; one not shown lapses.
        starts.take_turn(1, &showing("e", &["b"], &[]), now);
        assert!(!starts.ended.contains_key(&(1, "b".to_owned())));
        starts.note_ended(1, "f", now);
        let later = starts.take_turn(1, &showing("g", &["f"], &["f"]), now + ENDED_KEPT);
        assert!(later.ended.is_empty() && starts.ended.is_empty());
        // Bounded: past the most kept, the oldest go first.
        for i in 0..=MAX_ENDED {
            starts.note_ended(3, &i.to_string(), now);
        }
        assert_eq!(starts.ended.len(), MAX_ENDED);
        assert!(!starts.ended.contains_key(&(3, "0".to_owned())));
    }

    #[test]
    fn a_renewed_start_outlives_its_first_lease_and_one_forgotten_is_kept_again() {
        let mut starts = Starts::default();
        let now = Instant::now();
        let lease = |session: &str, start: StartIf| TurnAsked {
            for_ms: Some(2_000),
            ..asked(session, &[], false, start)
        };
        assert!(
            starts
                .take_turn(1, &lease("a", StartIf::Clear), now)
                .started
        );
        let second = Duration::from_secs(1);
        let renewed = starts.take_turn(1, &lease("a", StartIf::Running), now + second);
        assert!(renewed.started_before && !renewed.started);
        // Asked again to start (its step parked, then tried again), it is renewed as well.
        let again = starts.take_turn(1, &lease("a", StartIf::Clear), now + 2 * second);
        assert!(again.started_before);
        // Past the first leases, within the renewed one: the conversation is still taken.
        let waiting = starts.take_turn(1, &lease("b", StartIf::Clear), now + 3 * second);
        assert!(!waiting.started && waiting.unseen == ["a"], "{waiting:?}");
        // Not renewed, it lapses.
        assert!(
            starts
                .take_turn(1, &lease("b", StartIf::Clear), now + 4 * second)
                .started
        );
        // An owner that forgot a running dialog (it restarted) keeps it again at its renewal.
        let mut restarted = Starts::default();
        let back = restarted.take_turn(1, &lease("a", StartIf::Running), now);
        assert!(back.started && !back.started_before);
        assert_eq!(
            restarted
                .take_turn(1, &lease("c", StartIf::Clear), now)
                .unseen,
            ["a"]
        );
        // A lease asked beyond the bounds is held to them.
        let long = TurnAsked {
            for_ms: Some(u64::MAX),
            ..asked("d", &[], false, StartIf::Clear)
        };
        assert_eq!(long.lease(), LEASE_BOUNDS.1);
    }
}
