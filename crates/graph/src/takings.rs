//! How many times each step's message was taken up without an outcome, as its journal's owner
//! counts them: a bound on a message that crashes every process that takes it, which a broker's
//! redelivery count may not see (Apache Pulsar counts nacks and ack timeouts, not a consumer that
//! died).
//!
//! A taking is a process beginning to run a step from a delivery of its message, named by a token
//! of that process's own (its `taker`): a parked step's retries are the same taker, counted once.
//! Counts are by message (the broker's id of the delivery), so a copy of a request (a client's
//! retry) has a count of its own. They are kept where the journal is decided, so a process that
//! dies with the step in hand does not take the count with it. A record of the step forgets its
//! counts: from then on every copy settles from the entry. Kept in memory, by store
//! (`GraphStore::identity`), for a bounded number of steps, oldest forgotten first: an owner that
//! restarts, or forgets a step, only bounds its loop later. Also bounded: the messages counted for
//! one step (a 17th copy unrecorded at once is not counted) and the takers remembered for one
//! message (past 64, a parked step's retries count too).

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

/// How many unrecorded steps' counts are kept: far more than the steps in flight.
const REMEMBERED: usize = 65_536;

/// The most takers remembered for one message: past them each taking counts, retry or not.
const TAKERS_REMEMBERED: usize = 64;

/// The most messages counted for one step (copies of it); later ones are not counted.
const MESSAGES_REMEMBERED: usize = 16;

type Step = (u64, Arc<str>);

/// One step's counts, by message.
struct StepTakings {
    /// Which insertion of the step this is (see `Counts::oldest_first`).
    generation: u64,
    messages: Vec<MessageTakings>,
}

struct MessageTakings {
    delivery: Box<str>,
    takers: Vec<Box<str>>,
    count: u32,
}

struct Counts {
    by_step: HashMap<Step, StepTakings>,
    /// Steps in the order they were first taken, each with its generation: an entry whose step
    /// was recorded (or recorded and taken again since) is stale and skipped.
    oldest_first: VecDeque<(Step, u64)>,
    next_generation: u64,
    bound: usize,
}

impl Counts {
    fn new(bound: usize) -> Counts {
        Counts {
            by_step: HashMap::new(),
            oldest_first: VecDeque::new(),
            next_generation: 0,
            bound,
        }
    }

    fn taken(&mut self, step: Step, delivery: &str, taker: &str) -> u32 {
        let step_takings = match self.by_step.entry(step) {
            Entry::Occupied(known) => known.into_mut(),
            Entry::Vacant(new) => {
                let generation = self.next_generation;
                self.next_generation += 1;
                self.oldest_first.push_back((new.key().clone(), generation));
                new.insert(StepTakings {
                    generation,
                    messages: Vec::new(),
                })
            }
        };
        let message = match step_takings
            .messages
            .iter()
            .position(|m| &*m.delivery == delivery)
        {
            Some(at) => &mut step_takings.messages[at],
            // No room: the first copies keep their counts, and this one is not counted.
            None if step_takings.messages.len() >= MESSAGES_REMEMBERED => return 1,
            None => {
                step_takings.messages.push(MessageTakings {
                    delivery: delivery.into(),
                    takers: Vec::new(),
                    count: 0,
                });
                let last = step_takings.messages.len() - 1;
                &mut step_takings.messages[last]
            }
        };
        if !message.takers.iter().any(|t| &**t == taker) {
            message.count = message.count.saturating_add(1);
            if message.takers.len() < TAKERS_REMEMBERED {
                message.takers.push(taker.into());
            }
        }
        let count = message.count;
        self.keep_within_bound();
        count
    }

    fn keep_within_bound(&mut self) {
        while self.by_step.len() > self.bound {
            let Some((step, generation)) = self.oldest_first.pop_front() else {
                break;
            };
            if self
                .by_step
                .get(&step)
                .is_some_and(|known| known.generation == generation)
            {
                self.by_step.remove(&step);
            }
        }
        // Recorded steps leave stale places behind; the queue is swept once they outnumber the
        // steps counted, so it stays within twice the bound.
        if self.oldest_first.len() > 2 * self.by_step.len() + 1024 {
            let by_step = &self.by_step;
            self.oldest_first.retain(|(step, generation)| {
                by_step
                    .get(step)
                    .is_some_and(|known| known.generation == *generation)
            });
        }
    }

    fn recorded(&mut self, steps: impl Iterator<Item = Step>) {
        if self.by_step.is_empty() {
            return;
        }
        for step in steps {
            self.by_step.remove(&step);
        }
    }
}

static COUNTS: LazyLock<Mutex<Counts>> = LazyLock::new(|| Mutex::new(Counts::new(REMEMBERED)));

fn counts() -> MutexGuard<'static, Counts> {
    // Every holder leaves the counts whole: a poisoned lock still guards sound counts.
    COUNTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts `taker`'s taking of `entry` from the message `delivery`, in the journal over `store`;
/// returns how many takers that message has had, this one included.
pub(crate) fn taken(store: u64, entry: &str, delivery: &str, taker: &str) -> u32 {
    counts().taken((store, Arc::from(entry)), delivery, taker)
}

/// Forgets the counts of steps being recorded in the journal over `store`.
pub(crate) fn recorded<'e>(store: u64, entries: impl Iterator<Item = &'e str>) {
    counts().recorded(entries.map(|entry| (store, Arc::from(entry))));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(store: u64, entry: &str) -> Step {
        (store, Arc::from(entry))
    }

    #[test]
    fn each_taker_of_a_message_counts_once_until_the_step_is_recorded() {
        let mut counts = Counts::new(16);
        let entry = "urn:test:takings:step";
        assert_eq!(counts.taken(step(1, entry), "m1", "p1"), 1);
        // A parked step's retry is the same taker.
        assert_eq!(counts.taken(step(1, entry), "m1", "p1"), 1);
        assert_eq!(counts.taken(step(1, entry), "m1", "p2"), 2);
        // A copy of the message (a client's retry) has a count of its own.
        assert_eq!(counts.taken(step(1, entry), "m2", "p3"), 1);
        // The same step in another store is another step.
        assert_eq!(counts.taken(step(2, entry), "m1", "p4"), 1);
        // Past the copies remembered, a copy is not counted; the first ones still are.
        for copy in 2..=MESSAGES_REMEMBERED + 1 {
            counts.taken(step(1, entry), &format!("m{copy}"), "p");
        }
        let unremembered = format!("m{}", MESSAGES_REMEMBERED + 1);
        assert_eq!(counts.taken(step(1, entry), &unremembered, "q"), 1);
        assert_eq!(counts.taken(step(1, entry), "m1", "p5"), 3);
        counts.recorded([step(1, entry)].into_iter());
        assert_eq!(counts.taken(step(1, entry), "m1", "p6"), 1);
        assert_eq!(counts.taken(step(2, entry), "m1", "p6"), 2);
    }

    #[test]
    fn the_oldest_unrecorded_steps_are_forgotten_past_the_bound() {
        let mut counts = Counts::new(4);
        let first = "urn:test:takings:first";
        counts.taken(step(1, first), "m", "p1");
        counts.taken(step(1, first), "m", "p2");
        // Recorded steps do not take room from the ones still counted.
        for n in 0..100 {
            let done = format!("urn:test:takings:done-{n}");
            counts.taken(step(1, &done), "m", "p");
            counts.recorded([step(1, &done)].into_iter());
        }
        assert_eq!(counts.taken(step(1, first), "m", "p3"), 3);
        for n in 0..4 {
            counts.taken(step(1, &format!("urn:test:takings:{n}")), "m", "p");
        }
        assert_eq!(counts.by_step.len(), 4);
        assert_eq!(
            counts.taken(step(1, first), "m", "p4"),
            1,
            "forgotten, it counts from one again"
        );
    }

    #[test]
    fn stale_places_in_the_queue_are_swept() {
        let mut counts = Counts::new(4);
        for n in 0..5_000 {
            let done = format!("urn:test:takings:swept-{n}");
            counts.taken(step(1, &done), "m", "p");
            counts.recorded([step(1, &done)].into_iter());
        }
        assert!(
            counts.oldest_first.len() < 1100,
            "{}",
            counts.oldest_first.len()
        );
    }

    #[test]
    fn the_owners_counts_are_kept_by_store() {
        // No real store has this identity (see `GraphStore::identity`).
        let store = u64::MAX - 7;
        let entry = "urn:test:takings:shared";
        assert_eq!(taken(store, entry, "m", "p1"), 1);
        assert_eq!(taken(store, entry, "m", "p2"), 2);
        recorded(store, [entry].into_iter());
        assert_eq!(taken(store, entry, "m", "p3"), 1);
    }
}
