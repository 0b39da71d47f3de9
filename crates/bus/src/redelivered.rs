//! The messages a consumer has in hand or has just handled, so that one the broker delivers
//! again is not handled a second time by the same consumer.
//!
//! A persistent topic's broker sends again what a consumer did not ack once its connection is
//! gone: pulsar-lite closes a whole connection on any subscribe error of another consumer sharing
//! it, and any broker drops connections when it restarts. The consumer subscribes again, and the
//! message whose handler still runs (its ack not yet sent) comes back to it; so does one whose ack
//! left on the connection that dropped. Either was handled a second time, at once: two answers
//! for one request where no shared journal stands behind the handler (seen: a dead-lettered
//! request ended its dialog twice, 10 ms apart). What another consumer gets again is the
//! journal's to settle, not this.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pulsar::consumer::Message;
use tokio::task::Id;

/// One message of a persistent topic, as the broker stores it: its place (topic, ledger, entry,
/// index in a batch) and what its producer stamped on it. The stamp keeps a broker that lost its
/// data and numbers its ledgers from the start again from passing a new message for an old one.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct MessageKey {
    topic: String,
    ledger: u64,
    entry: u64,
    batch_index: i32,
    producer: String,
    sequence: u64,
    published: u64,
}

impl MessageKey {
    /// `None` for a non-persistent topic's message: the broker never sends one again, and gives
    /// them all the same place.
    pub(crate) fn of(message: &Message<Vec<u8>>) -> Option<MessageKey> {
        if crate::consumer::is_non_persistent(&message.topic) {
            return None;
        }
        let id = &message.message_id.id;
        let stamp = &message.payload.metadata;
        Some(MessageKey {
            topic: message.topic.clone(),
            ledger: id.ledger_id,
            entry: id.entry_id,
            batch_index: id.batch_index.unwrap_or(-1),
            producer: stamp.producer_name.clone(),
            sequence: stamp.sequence_id,
            published: stamp.publish_time,
        })
    }
}

/// A message whose handler runs, its payload taken out of it (its task shares it), and its key,
/// made once for its insert, its removal and its being remembered as handled.
pub(crate) struct Held {
    pub(crate) message: Message<Vec<u8>>,
    pub(crate) payload: Arc<[u8]>,
    pub(crate) key: Option<MessageKey>,
}

/// What this consumer knows of a message it receives.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    /// Not in hand, not handled lately: it is handled.
    New,
    /// Its handler runs (or its dead letter is on its way): the ack or nack that ends it goes to
    /// the broker by the message's id, and settles this copy too.
    InHand,
    /// Handled and acked lately; the ack was lost with a connection. Acked again, not handled.
    Handled,
}

/// The messages whose handlers run or whose dead letters are on their way, by task, each with its
/// payload taken out of the message (the task shares it); and the last [`InFlight::REMEMBERED`]
/// messages handled, for [`InFlight::REMEMBERED_FOR`]. Kept across subscribing again: that is
/// when the broker sends them again.
#[derive(Default)]
pub(crate) struct InFlight {
    by_task: HashMap<Id, Held>,
    in_hand: HashSet<MessageKey>,
    handled: HashMap<MessageKey, Instant>,
    handled_order: VecDeque<MessageKey>,
}

impl InFlight {
    /// Messages handled that are remembered. A lost ack comes back as the consumer subscribes
    /// again, seconds later: what it had acked in the moments before the connection dropped.
    pub(crate) const REMEMBERED: usize = 4096;

    /// How long a message handled is remembered. Bounded in time too, because the broker also
    /// sends acked messages again on purpose: a subscription an operator resets to an earlier
    /// point (a replay) is handled again but for what this consumer handled in this last while.
    /// The price: an ack lost at the start of an outage longer than this is handled again when
    /// the broker is back (at-least-once, as before; the orchestrator's journal, when on, still
    /// keeps the step from running twice).
    pub(crate) const REMEMBERED_FOR: Duration = Duration::from_secs(300);

    /// `message` is in hand: its handler (or its dead letter's publishing) runs as `task`.
    pub(crate) fn insert(&mut self, task: Id, message: Message<Vec<u8>>, payload: Arc<[u8]>) {
        let key = MessageKey::of(&message);
        if let Some(key) = &key {
            self.in_hand.insert(key.clone());
        }
        let held = Held {
            message,
            payload,
            key,
        };
        self.by_task.insert(task, held);
    }

    /// The message of `task`, no longer in hand.
    pub(crate) fn remove(&mut self, task: &Id) -> Option<Held> {
        let held = self.by_task.remove(task)?;
        if let Some(key) = &held.key {
            self.in_hand.remove(key);
        }
        Some(held)
    }

    /// Remembers the message of `key` ([`MessageKey::of`]) as handled: a copy that comes again is
    /// acked, not handled.
    pub(crate) fn handled(&mut self, key: Option<MessageKey>) {
        let Some(key) = key else {
            return;
        };
        if self.handled.insert(key.clone(), Instant::now()).is_some() {
            return;
        }
        self.handled_order.push_back(key);
        if self.handled_order.len() > Self::REMEMBERED {
            if let Some(oldest) = self.handled_order.pop_front() {
                self.handled.remove(&oldest);
            }
        }
    }

    /// What this consumer knows of `message`, received now.
    pub(crate) fn seen(&self, message: &Message<Vec<u8>>) -> Seen {
        self.seen_at(message, Instant::now())
    }

    fn seen_at(&self, message: &Message<Vec<u8>>, now: Instant) -> Seen {
        let Some(key) = MessageKey::of(message) else {
            return Seen::New;
        };
        if self.in_hand.contains(&key) {
            Seen::InHand
        } else if self
            .handled
            .get(&key)
            .is_some_and(|at| now.saturating_duration_since(*at) < Self::REMEMBERED_FOR)
        {
            Seen::Handled
        } else {
            Seen::New
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(topic: &str, entry: u64, sequence: u64) -> Message<Vec<u8>> {
        Message::new(
            topic,
            pulsar::consumer::data::MessageData {
                id: pulsar::proto::MessageIdData {
                    ledger_id: 3,
                    entry_id: entry,
                    ..Default::default()
                },
                batch_size: None,
            },
            pulsar::Payload {
                metadata: pulsar::proto::MessageMetadata {
                    producer_name: "p".to_owned(),
                    sequence_id: sequence,
                    publish_time: 1_700_000_000_000,
                    ..Default::default()
                },
                data: Vec::new(),
            },
        )
    }

    async fn task_id() -> Id {
        tokio::spawn(async { tokio::task::id() }).await.unwrap()
    }

    const TOPIC: &str = "persistent://tg/request/agent";

    #[tokio::test]
    async fn a_copy_of_a_message_in_hand_is_known_until_its_handler_ends() {
        let mut in_flight = InFlight::default();
        let task = task_id().await;
        in_flight.insert(task, message(TOPIC, 1, 1), Arc::from(Vec::new()));
        assert_eq!(in_flight.seen(&message(TOPIC, 1, 1)), Seen::InHand);
        assert_eq!(in_flight.seen(&message(TOPIC, 2, 2)), Seen::New);
        assert!(in_flight.remove(&task).is_some());
        assert_eq!(in_flight.seen(&message(TOPIC, 1, 1)), Seen::New);
    }

    #[test]
    fn a_message_handled_is_known_as_such_while_among_the_last_remembered() {
        let mut in_flight = InFlight::default();
        in_flight.handled(MessageKey::of(&message(TOPIC, 0, 0)));
        assert_eq!(in_flight.seen(&message(TOPIC, 0, 0)), Seen::Handled);
        for entry in 1..=InFlight::REMEMBERED as u64 {
            in_flight.handled(MessageKey::of(&message(TOPIC, entry, entry)));
        }
        assert_eq!(in_flight.seen(&message(TOPIC, 0, 0)), Seen::New);
        assert_eq!(
            in_flight.seen(&message(TOPIC, InFlight::REMEMBERED as u64, 0)),
            Seen::New,
            "a message in the same place with another stamp is another message"
        );
        assert_eq!(
            in_flight.seen(&message(
                TOPIC,
                InFlight::REMEMBERED as u64,
                InFlight::REMEMBERED as u64
            )),
            Seen::Handled
        );
        assert_eq!(in_flight.handled.len(), InFlight::REMEMBERED);
    }

    #[test]
    fn a_message_handled_longer_ago_than_remembered_is_handled_again() {
        let mut in_flight = InFlight::default();
        let once = message(TOPIC, 5, 5);
        in_flight.handled(MessageKey::of(&once));
        let later = Instant::now() + InFlight::REMEMBERED_FOR;
        assert_eq!(in_flight.seen(&once), Seen::Handled);
        assert_eq!(in_flight.seen_at(&once, later), Seen::New);
    }

    #[tokio::test]
    async fn a_non_persistent_topics_messages_are_never_taken_for_one_another() {
        let topic = "non-persistent://tg/request/config";
        let mut in_flight = InFlight::default();
        in_flight.insert(task_id().await, message(topic, 0, 0), Arc::from(Vec::new()));
        in_flight.handled(MessageKey::of(&message(topic, 0, 0)));
        assert_eq!(in_flight.seen(&message(topic, 0, 0)), Seen::New);
    }
}
