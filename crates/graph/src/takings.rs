//! How many times each step was taken up without an outcome, as its journal's owner counts them: a
//! bound on a message that crashes every process that takes it, which a broker's redelivery count
//! may not see (Apache Pulsar counts nacks and ack timeouts, not a consumer that died).
//!
//! A taking is a delivery of a step's message beginning to run it (not a parked step's retry). It
//! is counted where the journal is decided, so an orchestrator that dies with the step in hand
//! does not take the count with it. A record of the step forgets its count: from then on every
//! copy settles from the entry. Kept in memory, by store (`GraphStore::identity`) and bounded,
//! oldest forgotten first: an owner that restarts or forgets a step only bounds its loop later.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};

/// How many steps' counts are kept: far more than the steps in flight.
const REMEMBERED: usize = 65_536;

type Key = (u64, Arc<str>);

struct Counts {
    by_step: HashMap<Key, u32>,
    oldest_first: VecDeque<Key>,
    bound: usize,
}

impl Counts {
    fn new(bound: usize) -> Counts {
        Counts {
            by_step: HashMap::new(),
            oldest_first: VecDeque::new(),
            bound,
        }
    }

    fn taken(&mut self, key: Key) -> u32 {
        let now = match self.by_step.get_mut(&key) {
            Some(n) => {
                *n = n.saturating_add(1);
                *n
            }
            None => {
                self.by_step.insert(key.clone(), 1);
                self.oldest_first.push_back(key);
                1
            }
        };
        // A key recorded and taken again is queued twice; its older place forgets it early,
        // which only bounds its loop later.
        while self.oldest_first.len() > self.bound {
            if let Some(oldest) = self.oldest_first.pop_front() {
                self.by_step.remove(&oldest);
            }
        }
        now
    }

    fn recorded(&mut self, keys: impl Iterator<Item = Key>) {
        if self.by_step.is_empty() {
            return;
        }
        for key in keys {
            self.by_step.remove(&key);
        }
    }
}

static COUNTS: LazyLock<Mutex<Counts>> = LazyLock::new(|| Mutex::new(Counts::new(REMEMBERED)));

fn counts() -> MutexGuard<'static, Counts> {
    // Every holder leaves the counts whole: a poisoned lock still guards sound counts.
    COUNTS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Counts a taking of `entry` in the journal over `store`; returns how many there have been,
/// this one included.
pub(crate) fn taken(store: u64, entry: &str) -> u32 {
    counts().taken((store, Arc::from(entry)))
}

/// Forgets the counts of steps being recorded in the journal over `store`.
pub(crate) fn recorded<'e>(store: u64, entries: impl Iterator<Item = &'e str>) {
    counts().recorded(entries.map(|entry| (store, Arc::from(entry))));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(store: u64, entry: &str) -> Key {
        (store, Arc::from(entry))
    }

    #[test]
    fn a_step_is_counted_each_time_it_is_taken_until_it_is_recorded() {
        let mut counts = Counts::new(16);
        let step = "urn:test:takings:step";
        assert_eq!(counts.taken(key(1, step)), 1);
        assert_eq!(counts.taken(key(1, step)), 2);
        // The same step in another store is another step.
        assert_eq!(counts.taken(key(2, step)), 1);
        counts.recorded([key(1, step)].into_iter());
        assert_eq!(counts.taken(key(1, step)), 1);
        assert_eq!(counts.taken(key(2, step)), 2);
    }

    #[test]
    fn the_oldest_counts_are_forgotten_past_the_bound() {
        let mut counts = Counts::new(4);
        let first = "urn:test:takings:first";
        counts.taken(key(1, first));
        counts.taken(key(1, first));
        for n in 0..4 {
            counts.taken(key(1, &format!("urn:test:takings:{n}")));
        }
        assert_eq!(counts.by_step.len(), 4);
        assert_eq!(
            counts.taken(key(1, first)),
            1,
            "forgotten, it counts from one again"
        );
    }

    #[test]
    fn the_owners_counts_are_kept_by_store() {
        // No real store has this identity (see `GraphStore::identity`).
        let store = u64::MAX - 7;
        let step = "urn:test:takings:shared";
        assert_eq!(taken(store, step), 1);
        assert_eq!(taken(store, step), 2);
        recorded(store, [step].into_iter());
        assert_eq!(taken(store, step), 1);
    }
}
