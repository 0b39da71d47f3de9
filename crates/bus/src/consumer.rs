//! The consumer loop: one `select!` over shutdown, finished work and the next message, with a bound
//! on messages in flight. A message is acked only after its handler returned, and a handler returns
//! only after everything the message caused has been published.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use pulsar::consumer::{ConsumerOptions, DeadLetterPolicy, InitialPosition, Message};
use pulsar::{Consumer, SubType, TokioExecutor};
use serde::de::DeserializeOwned;
use tokio::task::{Id, JoinSet};
use tokio_util::sync::CancellationToken;

use crate::redelivered::{Held, InFlight, MessageKey, Seen};
use crate::{Bus, BusError, Properties, Publisher};

/// Where and how to consume.
#[derive(Debug, Clone)]
pub struct SubscriptionConfig {
    pub topic: String,
    /// Every replica uses the same name: a Shared subscription spreads messages across them.
    pub subscription: String,
    /// Messages handled at once; also the receiver queue of a persistent topic, so a crashed
    /// consumer holds few messages.
    pub max_in_flight: usize,
    /// Deliveries of one message before the broker-side count moves it to the dead-letter topic;
    /// `None` never gives up on a message that decodes (its handler decides what is poison).
    pub max_redeliveries: Option<usize>,
    /// Where messages that do not decode (and those the handler gives up on) go; empty for a
    /// consumer of a dead-letter topic itself, which logs and acks what it cannot read.
    pub dead_letter_topic: String,
    /// How long in-flight work may take to finish after shutdown is requested.
    pub drain_deadline: Duration,
    /// How long a failed message waits before it is nacked: brokers redeliver a nack at once, and a
    /// transient failure (a store restarting) needs a moment, not ten attempts in a millisecond.
    pub nack_delay: Duration,
    /// One consumer of the subscription at a time (Failover: another replica takes over when it
    /// goes), for messages that must be taken up in order and never side by side.
    pub one_at_a_time: bool,
}

/// A decoded message handed to the handler.
#[derive(Debug, Clone)]
pub struct Delivery<T> {
    pub payload: T,
    pub properties: Properties,
    /// The broker's id of the message (`topic/ledger:entry:batch`): the same on every redelivery,
    /// different for a copy published again.
    pub message_id: String,
    /// Size of the payload as it came off the wire, for limits on message size.
    pub payload_bytes: usize,
    /// The payload as it came off the wire (what a seal over it covers: a build that decodes
    /// fewer fields than its sender's would not encode it back the same).
    pub raw: Arc<[u8]>,
    /// Lets a handler that only waits give its place among the consumer's handlers to the next
    /// message (see [`Aside`]).
    pub aside: Aside,
}

/// Handlers that stepped aside from a consumer's `max_in_flight`: a handler waiting for
/// something another message must bring (a conversation's running dialog, whose next step is a
/// message on the same topic) would otherwise hold a place that message needs, and enough such
/// waits would stop the consumer for good.
#[derive(Debug, Clone, Default)]
pub struct Aside {
    /// `None` for a delivery no consumer loop counts (a step continued in process).
    shared: Option<Arc<AsideCount>>,
}

#[derive(Debug, Default)]
struct AsideCount {
    waiting: AtomicU64,
    /// The most that may stand aside at once: what waits is held in memory, so it is bounded.
    most: u64,
    /// The payload bytes of those standing aside, bounded by [`ASIDE_BYTES`]: a thousand
    /// requests of a megabyte each, decoded and held, would be gigabytes.
    bytes: AtomicU64,
    /// Wakes the loop, whose next receive was held back by the bound on handlers.
    stepped: tokio::sync::Notify,
}

/// A handler's place aside, given back when dropped.
#[derive(Debug)]
pub struct AsideLease {
    shared: Option<Arc<AsideCount>>,
    bytes: u64,
}

/// The most payload bytes that may stand aside at once, whatever their count.
const ASIDE_BYTES: u64 = 128 << 20;

impl Aside {
    fn counted(most: u64) -> Aside {
        Aside {
            shared: Some(Arc::new(AsideCount {
                most,
                ..AsideCount::default()
            })),
        }
    }

    /// Steps aside with a message of `payload_bytes` until the lease is dropped; `None` when as
    /// many as the consumer allows stand aside already, or as many bytes. One stands aside
    /// whatever its size when none does, so a message as large as the broker takes still can.
    pub fn step_aside(&self, payload_bytes: usize) -> Option<AsideLease> {
        let Some(shared) = &self.shared else {
            return Some(AsideLease {
                shared: None,
                bytes: 0,
            });
        };
        let bytes = payload_bytes as u64;
        let held = shared
            .bytes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                (held == 0 || held.saturating_add(bytes) <= ASIDE_BYTES)
                    .then_some(held.saturating_add(bytes))
            });
        held.ok()?;
        let taken = shared
            .waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < shared.most).then_some(n + 1)
            });
        if taken.is_err() {
            shared.bytes.fetch_sub(bytes, Ordering::SeqCst);
            return None;
        }
        shared.stepped.notify_one();
        Some(AsideLease {
            shared: Some(shared.clone()),
            bytes,
        })
    }

    fn waiting(&self) -> usize {
        self.shared
            .as_ref()
            .map_or(0, |s| s.waiting.load(Ordering::SeqCst) as usize)
    }

    async fn stepped(&self) {
        match &self.shared {
            Some(shared) => shared.stepped.notified().await,
            None => std::future::pending().await,
        }
    }
}

impl Drop for AsideLease {
    fn drop(&mut self) {
        if let Some(shared) = &self.shared {
            shared.waiting.fetch_sub(1, Ordering::SeqCst);
            shared.bytes.fetch_sub(self.bytes, Ordering::SeqCst);
        }
    }
}

/// How many handlers may stand aside for each place among those in flight.
const ASIDE_PER_PLACE: u64 = 32;

/// What to do with a message once its handler finished.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Disposition {
    /// Its effects are published.
    Ack,
    /// A transient failure: deliver it again.
    Nack(String),
    /// It can never succeed: move it to the dead-letter topic.
    DeadLetter(String),
}

/// Counters of one consumer, for logs, metrics and tests.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    /// Subscribed and taking messages (readiness); false again once it stops.
    pub consuming: std::sync::atomic::AtomicBool,
    pub received: AtomicU64,
    pub acked: AtomicU64,
    pub nacked: AtomicU64,
    pub dead_lettered: AtomicU64,
    /// Messages the broker delivered again while this consumer had them in hand, or after it had
    /// handled them (the ack lost with a connection): not handled again (see `redelivered`).
    pub again: AtomicU64,
    /// Sends of dead letters that failed (the message is then nacked to come back, or, of a
    /// non-persistent topic, its dead letter sent again for a while).
    pub dead_letter_sends_failed: AtomicU64,
    /// Messages of a non-persistent topic dropped because as much as the intake holds waited for
    /// a handler already (see `Intake`; also counted in [`SHED_METRIC`]).
    pub shed: AtomicU64,
}

/// The counter of messages consumers of non-persistent topics dropped for want of room, by topic.
pub const SHED_METRIC: &str = "agent_messages_shed_total";

impl ConsumerStats {
    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Copies the counts into the process's counter `family` (declared by the service), one series
    /// per fate: received, acked, nacked (to be redelivered), dead_lettered, again (delivered
    /// again and not handled again). (What a consumer of a non-persistent topic drops goes to
    /// [`SHED_METRIC`] whatever the consumer.)
    pub fn report(&self, family: &str) {
        let registry = agent_metrics::global();
        for (fate, counter) in [
            ("received", &self.received),
            ("acked", &self.acked),
            ("nacked", &self.nacked),
            ("dead_lettered", &self.dead_lettered),
            ("again", &self.again),
        ] {
            registry.set_total(
                family,
                &[("fate", fate)],
                ConsumerStats::get(counter) as f64,
            );
        }
    }
}

/// What a task of the loop ends with. A dead letter's publishing is a task like a handler, and
/// holds a place among `max_in_flight` as one: awaited in the loop, it would stop the loop from
/// taking messages off the connection for as long as the broker took to answer, and a
/// non-persistent topic's would pile up in the `pulsar` crate's queue, bounded by count only. At
/// a stop, one still on its way when the drain's deadline passes is abandoned as a handler is:
/// its message, not acked, comes back (a persistent topic's), to be dead-lettered again.
enum Finished {
    Handled(Disposition),
    /// The handler panicked, saying this; it is nacked after the nack delay, and dead-lettered
    /// once it has panicked on the same message [`PANICS_TO_DEAD_LETTER`] times.
    Panicked(String),
    /// The dead letter was published (the message is then acked) or not (nacked, to come back).
    DeadLettered(Result<(), BusError>),
}

/// The members of broker entries that hold several messages (a batch: Java's and Go's clients
/// batch by default), acked as each is done. The `pulsar` crate acks a member by its entry
/// without the batch's ack set, which the broker takes as the whole entry's ack: the first
/// member done acked every member, and those still in flight were lost if the process stopped
/// before they were done (nothing brought them back). So a member's ack waits here until every
/// member of its entry is done, and only then goes to the broker. A member nacked brings the
/// whole entry back: the members done before are not handled again (see
/// [`BatchAcks::was_done`]), unless this process forgot them (it restarted, or its entries
/// passed [`BatchAcks::MOST`]). A non-persistent topic's acks mean nothing to its broker, so its
/// members are acked as they are done.
#[derive(Default)]
struct BatchAcks {
    /// Each entry with members done: when it was first seen (a count), and the members' indexes.
    entries: HashMap<(String, u64, u64), (u64, std::collections::HashSet<i32>)>,
    seen: u64,
    /// The consumer of a non-persistent topic was closed as the service stopped, and handles
    /// what it had received: nothing is acked any more (the broker has forgotten the consumer,
    /// and would never redeliver anyway).
    closed: bool,
}

impl BatchAcks {
    /// Entries with members done kept at most; past it the oldest is forgotten, and its members
    /// come back after a reconnect instead of being lost.
    const MOST: usize = 4096;

    /// The entry of `message` and its index in it, if it is a member of a batch of several.
    fn member(message: &Message<Vec<u8>>) -> Option<((String, u64, u64), i32, usize)> {
        if is_non_persistent(&message.topic) {
            return None;
        }
        let size = usize::try_from(message.message_id.batch_size?).ok()?;
        let index = message.message_id.id.batch_index?;
        (size > 1).then(|| {
            let id = &message.message_id.id;
            (
                (message.topic.clone(), id.ledger_id, id.entry_id),
                index,
                size,
            )
        })
    }

    /// Whether `message`, done, may be acked now: it is no member of a batch, or the last
    /// member of its entry to be done.
    fn done(&mut self, message: &Message<Vec<u8>>) -> bool {
        let Some((entry, index, size)) = Self::member(message) else {
            return true;
        };
        if self.entries.len() >= Self::MOST && !self.entries.contains_key(&entry) {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, (first, _))| *first)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                self.entries.remove(&oldest);
            }
        }
        self.seen += 1;
        let seen = self.seen;
        let (_, done) = self
            .entries
            .entry(entry.clone())
            .or_insert_with(|| (seen, Default::default()));
        done.insert(index);
        if done.len() < size {
            return false;
        }
        self.entries.remove(&entry);
        true
    }

    /// Whether `message` is a member of a batch done before, its entry sent again because
    /// another member was nacked: it is acked again without its handler.
    fn was_done(&self, message: &Message<Vec<u8>>) -> bool {
        Self::member(message).is_some_and(|(entry, index, _)| {
            self.entries
                .get(&entry)
                .is_some_and(|(_, done)| done.contains(&index))
        })
    }
}

/// Acks `message` once it may be (see [`BatchAcks`]).
async fn ack(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    batches: &mut BatchAcks,
    message: &Message<Vec<u8>>,
) -> Result<(), pulsar::error::ConsumerError> {
    if batches.closed || !batches.done(message) {
        return Ok(());
    }
    consumer.ack(message).await
}

/// How often a handler may panic on one message before it is dead-lettered: a panic is a bug
/// that the same message meets again, and redelivered for ever it would hold a place and fill
/// the log (a consumer with no bound on redeliveries never stops it otherwise).
const PANICS_TO_DEAD_LETTER: u32 = 3;

/// The panics seen per message (by its id), forgotten whole past a few thousand messages.
#[derive(Default)]
struct Panics(HashMap<String, u32>);

impl Panics {
    const MOST: usize = 4096;

    /// Counts one more for `message_id`, and says how many it has now.
    fn one_more(&mut self, message_id: String) -> u32 {
        if self.0.len() >= Self::MOST && !self.0.contains_key(&message_id) {
            self.0.clear();
        }
        let count = self.0.entry(message_id).or_default();
        *count += 1;
        *count
    }
}

/// How often a handler is run on a message of a non-persistent topic that it nacks, before the
/// message goes to the dead-letter topic (see [`start`]).
const NON_PERSISTENT_TRIES: u32 = 4;

/// How long the dead letter of a non-persistent topic's message is sent again after it failed
/// (its message would be lost): longer than a broker's restart.
const NON_PERSISTENT_DEAD_LETTER_PATIENCE: Duration = Duration::from_secs(120);

/// How long a consumer's close may wait for the broker's answer.
const CLOSE_WITHIN: Duration = Duration::from_secs(5);

/// The property that says why a message was dead-lettered.
pub const DEAD_LETTER_REASON: &str = "dead-letter-reason";
/// The property naming the topic a dead-lettered message came from.
pub const DEAD_LETTER_ORIGIN: &str = "dead-letter-origin-topic";
/// The property of a dead letter cut to fit the broker's limit beside the properties that say
/// why: the payload's size as it came. Set only on one that was cut: its payload, or (when they
/// alone left no room) the message's own properties, which it then goes without.
pub const DEAD_LETTER_PAYLOAD_BYTES: &str = "dead-letter-payload-bytes";

/// Consumes `config.topic` until `shutdown`, handing each decoded message to `handler`.
///
/// Payloads that do not decode as `T` go to the dead-letter topic with the reason in a property, are
/// logged and counted, and the loop goes on.
pub async fn run_consumer<T, F, Fut>(
    bus: &Bus,
    config: SubscriptionConfig,
    stats: Arc<ConsumerStats>,
    shutdown: CancellationToken,
    handler: F,
) -> Result<(), BusError>
where
    T: DeserializeOwned + Send + 'static,
    F: Fn(Delivery<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send + 'static,
{
    let max_in_flight = config.max_in_flight.max(1);
    let dead_letters = match config.dead_letter_topic.as_str() {
        "" => None,
        topic => Some(Publisher::new(bus, topic).await?),
    };
    // The broker may be starting or restarting (its namespaces are served a moment after its port
    // opens): a service started then keeps trying for a while rather than exit.
    // A refusal for good (no token, no permission) ends it at once.
    let what = format!("subscribing to {}", config.topic);
    let first = crate::error::until_settled(&what, || build_consumer(bus, &config));
    let mut consumer = tokio::select! {
        _ = shutdown.cancelled() => return Ok(()),
        subscribed = first => subscribed.map_err(|e| subscribe_error(&config, &e))?,
    };
    stats.consuming.store(true, Ordering::SeqCst);
    tracing::info!(topic = %config.topic, subscription = %config.subscription, "consuming");
    // Once the broker serves the topic (it may have been starting), so that one try is enough.
    // In a task of its own, never dropped midway: a subscribe given up on while it makes a
    // connection leaves the crate's connection manager waiting on it for good.
    if dead_letters.is_some() {
        tokio::spawn(keep_dead_letters(
            bus.clone(),
            config.dead_letter_topic.clone(),
        ));
    }

    let handler = Arc::new(handler);
    let mut tasks: JoinSet<Finished> = JoinSet::new();
    let mut in_flight = InFlight::default();
    let mut panics = Panics::default();
    let mut batches = BatchAcks::default();
    let aside = Aside::counted(max_in_flight as u64 * ASIDE_PER_PLACE);
    // A non-persistent topic's messages are taken off the connection as they come, whether a
    // handler is free or not, so that what waits is counted here in bytes (see [`Intake`]).
    let takes_ahead = is_non_persistent(&config.topic);
    if takes_ahead {
        agent_metrics::global().describe(
            SHED_METRIC,
            agent_metrics::Kind::Counter,
            "Messages of non-persistent topics dropped, by topic: every handler of the consumer was busy and as much as PULSAR_INTAKE_MAX_BYTES waited for them.",
        );
    }
    let mut intake = Intake::new(bus.intake_bytes(), NON_PERSISTENT_WINDOW as usize);
    // A handler standing aside keeps its message unacked but not its place; one that stepped
    // aside and then went on working overdraws the bound until it ends.
    let places = || max_in_flight + aside.waiting();
    loop {
        start_waiting(
            (&mut consumer, &mut batches),
            &mut intake,
            (&handler, &aside, &dead_letters, places()),
            (&mut tasks, &mut in_flight, &stats),
            config.nack_delay,
        )
        .await;
        let free = tasks.len() < places();
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                settle((&mut consumer, &mut batches), &dead_letters, &stats, (&mut tasks, &mut in_flight, &mut panics), config.nack_delay, done).await;
            }
            // Only to look at the bound again.
            _ = aside.stepped(), if !free => {}
            next = consumer.next(), if free || takes_ahead => match next {
                // Started at the top of the loop; with a handler free the intake is empty, and an
                // empty intake takes any message.
                Some(Ok(message)) => take_in(&mut consumer, &stats, &config.topic, &mut intake, message).await,
                Some(Err(e)) => {
                    tracing::warn!(topic = %config.topic, error = %e, "receive failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                None => {
                    // The broker dropped us (a restart, a reset connection). Messages in flight
                    // stay un-acked and come back to the new subscription or another replica.
                    tracing::warn!(topic = %config.topic, "the message stream ended; subscribing again");
                    // Not ready meanwhile: a subscribing again that the broker refuses (a
                    // permission taken away, a subscription type no longer allowed) is waited
                    // out, and readiness said "consuming" all along while nothing was taken.
                    stats.consuming.store(false, Ordering::SeqCst);
                    match resubscribe(bus, &config, &shutdown).await {
                        Some(fresh) => {
                            // Entries not acked come back whole to the new subscription.
                            batches = BatchAcks::default();
                            consumer = fresh;
                            stats.consuming.store(true, Ordering::SeqCst);
                        }
                        None => break,
                    }
                }
            }
        }
    }

    // Drain: finish what is in flight so its effects are published and acked; whatever misses the
    // deadline stays un-acked and is redelivered to another replica.
    stats.consuming.store(false, Ordering::SeqCst);
    let deadline = tokio::time::sleep(config.drain_deadline);
    tokio::pin!(deadline);
    if takes_ahead {
        // A non-persistent topic's messages are never delivered again: what this consumer was
        // sent is handled here or lost. It is closed first, so that the broker sends what comes
        // next to another consumer, and then everything it was sent before the close (read off
        // the connection, in the intake, in flight) is handled within the deadline. Until
        // 2026-12-06 the intake was dropped at the stop, and what came during the drain was let
        // go: a rolling restart lost the client requests waiting for a handler.
        close_within(&mut consumer, &config.topic, "handling what it was sent").await;
        batches.closed = true;
        // The broker answers the close on the connection its messages came on, after them: what
        // it sent before is on its way to the stream, or in it, and is read until the stream
        // has been quiet a while (or ends, or the deadline passes: a close the broker did not
        // answer leaves the messages coming).
        let mut reading = true;
        let quiet = tokio::time::sleep(AFTER_CLOSE_QUIET);
        tokio::pin!(quiet);
        loop {
            start_waiting(
                (&mut consumer, &mut batches),
                &mut intake,
                (&handler, &aside, &dead_letters, places()),
                (&mut tasks, &mut in_flight, &stats),
                config.nack_delay,
            )
            .await;
            if tasks.is_empty() && !reading {
                break;
            }
            let free = tasks.len() < places();
            tokio::select! {
                _ = &mut deadline => {
                    tracing::warn!(topic = %config.topic, left = tasks.len() + intake.len(), "drain deadline passed; messages of a non-persistent topic not handled are lost");
                    tasks.abort_all();
                    break;
                }
                Some(done) = tasks.join_next_with_id(), if !tasks.is_empty() => {
                    settle((&mut consumer, &mut batches), &dead_letters, &stats, (&mut tasks, &mut in_flight, &mut panics), config.nack_delay, done).await;
                }
                // Only to look at the bound again.
                _ = aside.stepped(), if !free => {}
                _ = &mut quiet, if reading => reading = false,
                next = consumer.next(), if reading => match next {
                    Some(Ok(message)) => {
                        take_in(&mut consumer, &stats, &config.topic, &mut intake, message).await;
                        quiet.as_mut().reset(tokio::time::Instant::now() + AFTER_CLOSE_QUIET);
                    }
                    // One that cannot be read; those after it still can.
                    Some(Err(e)) => tracing::debug!(error = %e, "receive failed after the close"),
                    None => reading = false,
                }
            }
        }
        return Ok(());
    }
    if !intake.is_empty() {
        // Not acked: a persistent topic's (one at most, taken just before the stop) come back.
        tracing::warn!(topic = %config.topic, left = intake.len(), "stopping with messages not taken up");
    }
    // The `pulsar` crate's engine takes our acks in one queue with the broker's messages, and
    // waits for room in its queue to us before it takes the next: behind a backlog that queue is
    // full, so unless it is read, the drain's acks (and the close after them) never leave and
    // everything the drain finished comes back to another consumer. What is read here is let
    // go unacked: a persistent topic's comes back once this consumer closes.
    let mut let_go = 0usize;
    let mut stream_open = true;
    while !tasks.is_empty() {
        tokio::select! {
            _ = &mut deadline => {
                tracing::warn!(left = tasks.len(), "drain deadline passed; leaving messages un-acked");
                tasks.abort_all();
                break;
            }
            Some(done) = tasks.join_next_with_id() => {
                settle((&mut consumer, &mut batches), &dead_letters, &stats, (&mut tasks, &mut in_flight, &mut panics), config.nack_delay, done).await;
            }
            next = consumer.next(), if stream_open => match next {
                // One handled here lately (its ack lost with a connection) is acked again rather
                // than let go to another consumer, which would handle it again.
                Some(Ok(message)) if in_flight.seen(&message) == Seen::Handled => {
                    stats.again.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = ack(&mut consumer, &mut batches, &message).await {
                        tracing::debug!(error = %e, "ack while draining failed");
                    }
                }
                Some(Ok(_)) => let_go += 1,
                Some(Err(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
                None => stream_open = false,
            }
        }
    }
    if let_go > 0 {
        tracing::info!(topic = %config.topic, let_go, "messages received while draining were left unacked");
    }
    // A consumer stopped far behind its backlog (messages delivered to it that nobody reads any
    // more) was seen never to get the broker's answer to its close (pulsar-lite, an aggregator
    // behind a slow store): bounded, so a service behind its backlog still stops. What it did not
    // ack goes to another consumer once its connection closes, as the process exits; a process
    // that lives on keeps those messages (and a Failover subscription's turn) until then.
    close_within(
        &mut consumer,
        &config.topic,
        "stopping without the broker's answer",
    )
    .await;
    Ok(())
}

/// Counts a message received and holds it in the intake, or drops it past the intake's bound.
async fn take_in(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    stats: &ConsumerStats,
    topic: &str,
    intake: &mut Intake,
    message: Message<Vec<u8>>,
) {
    stats.received.fetch_add(1, Ordering::Relaxed);
    if let Err(message) = intake.hold(message) {
        shed(consumer, stats, topic, intake, &message).await;
    }
}

/// Starts a handler on each message of the intake while fewer than `places` run; one that does
/// not decode goes to the dead-letter topic.
async fn start_waiting<T, F, Fut>(
    (consumer, batches): (&mut Consumer<Vec<u8>, TokioExecutor>, &mut BatchAcks),
    intake: &mut Intake,
    (handler, aside, dead_letters, places): (&Arc<F>, &Aside, &Option<Publisher>, usize),
    (tasks, in_flight, stats): (&mut JoinSet<Finished>, &mut InFlight, &Arc<ConsumerStats>),
    nack_delay: Duration,
) where
    T: DeserializeOwned + Send + 'static,
    F: Fn(Delivery<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send + 'static,
{
    while tasks.len() < places {
        let Some(message) = intake.next() else { break };
        match in_flight.seen(&message) {
            Seen::New if !batches.was_done(&message) => {}
            Seen::InHand => {
                stats.again.fetch_add(1, Ordering::Relaxed);
                tracing::info!(topic = %message.topic, message_id = ?message.message_id.id, "delivered again while its handler runs: settled with it");
                continue;
            }
            seen => {
                stats.again.fetch_add(1, Ordering::Relaxed);
                // A batch's member done before whose entry came back for another member's nack
                // is expected, a line for each member: not worth the log's attention.
                if seen == Seen::New {
                    tracing::debug!(topic = %message.topic, message_id = ?message.message_id.id, "a batch member done before came back with its entry: acked again");
                } else {
                    tracing::info!(topic = %message.topic, message_id = ?message.message_id.id, "delivered again after it was handled: acked again");
                }
                if let Err(e) = ack(consumer, batches, &message).await {
                    tracing::warn!(error = %e, "ack failed; the message will be redelivered");
                }
                continue;
            }
        }
        if let Err(refused) = start(handler, tasks, in_flight, aside, nack_delay, message) {
            let (mut message, reason) = *refused;
            let letter = std::mem::take(&mut message.payload.data);
            dead_letter(
                (consumer, batches),
                dead_letters,
                (tasks, in_flight, stats),
                (message, letter),
                &reason,
                nack_delay,
            )
            .await;
        }
    }
}

/// How long a closed consumer's stream is read for what the broker sent before it took the
/// close, once nothing more comes.
const AFTER_CLOSE_QUIET: Duration = Duration::from_millis(200);

/// Closes `consumer`, waiting at most [`CLOSE_WITHIN`] for the broker's answer; `otherwise`: what
/// the stop does without it.
async fn close_within(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    topic: &str,
    otherwise: &str,
) {
    match tokio::time::timeout(CLOSE_WITHIN, consumer.close()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::debug!(error = %e, "closing the consumer"),
        Err(_) => tracing::warn!(
            %topic,
            "the consumer did not close within {} s; {otherwise}",
            CLOSE_WITHIN.as_secs()
        ),
    }
}

/// Messages a consumer of a non-persistent topic may be sent ahead of its handlers.
const NON_PERSISTENT_WINDOW: u32 = 10_000;

/// The subscription that keeps a dead-letter topic's messages until an operator reads them.
pub const DEAD_LETTERS_KEPT: &str = "kept";

/// Makes sure `topic` (a dead-letter topic) has the [`DEAD_LETTERS_KEPT`] subscription. A broker
/// keeps a topic's messages only for its subscriptions (Apache Pulsar with no retention set, as
/// it ships: a topic no one subscribes to is trimmed at its next ledger roll-over, and deleted
/// once inactive), so what a service dead-lettered "to be seen" was gone before anyone looked,
/// its trace a log line. As the Java client's `DeadLetterPolicy.initialSubscriptionName` does.
/// A failure is logged: the service still runs, as it did without the subscription.
async fn keep_dead_letters(bus: Bus, topic: String) {
    let topic = topic.as_str();
    if is_non_persistent(topic) {
        tracing::warn!(%topic, "a non-persistent dead-letter topic keeps nothing: what is dead-lettered there is lost unless someone reads it as it comes");
        return;
    }
    let subscribed = bus
        .client()
        .consumer()
        .with_topic(topic)
        .with_subscription(DEAD_LETTERS_KEPT)
        .with_subscription_type(SubType::Shared)
        .with_consumer_id(rand::random::<u64>() >> 1)
        // The broker sends as many as the batch size asks for: one, to a consumer that only
        // makes the subscription.
        .with_batch_size(1)
        .with_options(ConsumerOptions {
            receiver_queue_size: Some(1),
            initial_position: InitialPosition::Earliest,
            ..ConsumerOptions::default()
        })
        .build::<Vec<u8>>()
        .await;
    match subscribed {
        Ok(mut consumer) => {
            // Closed, not unsubscribed: the subscription stays, and with it what it has not read.
            match tokio::time::timeout(CLOSE_WITHIN, consumer.close()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(%topic, error = %e, "closing the consumer that made the kept dead-letter subscription")
                }
                Err(_) => {
                    tracing::debug!(%topic, "the consumer that made the kept dead-letter subscription did not close in time")
                }
            }
        }
        Err(e) => {
            tracing::warn!(%topic, error = %e, "could not subscribe {DEAD_LETTERS_KEPT} to the dead-letter topic: the broker may not keep what is dead-lettered");
        }
    }
}

pub(crate) fn is_non_persistent(topic: &str) -> bool {
    topic.starts_with("non-persistent://")
}

/// Messages of a non-persistent topic that came while every handler was busy, bounded in count
/// and in bytes. The broker may send a consumer of such a topic many messages ahead (it drops
/// what finds no room, and never sends it again, so the window is wide: [`NON_PERSISTENT_WINDOW`]);
/// left in the `pulsar` crate's queue, 10,000 messages as large as the broker takes would be tens
/// of gigabytes. Taken off the connection at once and held here, what does not fit is dropped and
/// counted ([`ConsumerStats::shed`]), as the broker itself would drop it. The loop does not wait
/// on the broker while it consumes (acks go to the crate's engine unanswered, a dead letter is
/// published by a task in a handler's place), so nothing piles up in the crate's queue behind
/// it. A message is counted as its payload, its properties and [`Intake::OVERHEAD`].
struct Intake {
    waiting: std::collections::VecDeque<Message<Vec<u8>>>,
    bytes: usize,
    most_bytes: usize,
    most_messages: usize,
}

impl Intake {
    /// What a held message is counted as besides its payload and properties: its id, topic and
    /// the rest of its metadata.
    const OVERHEAD: usize = 512;

    fn new(most_bytes: usize, most_messages: usize) -> Intake {
        Intake {
            waiting: std::collections::VecDeque::new(),
            bytes: 0,
            most_bytes,
            most_messages,
        }
    }

    fn size_of(message: &Message<Vec<u8>>) -> usize {
        held_bytes(message)
    }

    /// Holds `message` for a handler, or gives it back when it does not fit. One message is
    /// always taken into an empty intake, so a bound below the broker's largest message still
    /// lets such a message wait.
    fn hold(&mut self, message: Message<Vec<u8>>) -> Result<(), Box<Message<Vec<u8>>>> {
        let size = Intake::size_of(&message);
        let fits = self.waiting.len() < self.most_messages
            && self.bytes.saturating_add(size) <= self.most_bytes;
        if !fits && !self.waiting.is_empty() {
            return Err(Box::new(message));
        }
        self.bytes += size;
        self.waiting.push_back(message);
        Ok(())
    }

    fn next(&mut self) -> Option<Message<Vec<u8>>> {
        let message = self.waiting.pop_front()?;
        self.bytes -= Intake::size_of(&message);
        Some(message)
    }

    fn len(&self) -> usize {
        self.waiting.len()
    }

    fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }
}

/// What a message held in memory is counted as against a bound in bytes: its payload, its
/// metadata as encoded (its properties, and what a sender may fill besides them: a key, an
/// ordering key, a producer name, encryption keys...) and [`Intake::OVERHEAD`] (so an empty one
/// still counts). Counting the properties alone let a sender put megabytes in a message's key
/// and have it counted as 512 bytes, 10,000 of them held at once.
pub(crate) fn held_bytes(message: &Message<Vec<u8>>) -> usize {
    use prost::Message as _;
    message.payload.data.len() + message.payload.metadata.encoded_len() + Intake::OVERHEAD
}

/// A message that does not decode, and why.
type Undecodable = Box<(Message<Vec<u8>>, String)>;

/// Decodes `message` and starts its handler; a message that does not decode is given back with
/// the reason, for the dead-letter topic.
fn start<T, F, Fut>(
    handler: &Arc<F>,
    tasks: &mut JoinSet<Finished>,
    in_flight: &mut InFlight,
    aside: &Aside,
    nack_delay: Duration,
    mut message: Message<Vec<u8>>,
) -> Result<(), Undecodable>
where
    T: DeserializeOwned + Send + 'static,
    F: Fn(Delivery<T>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Disposition> + Send + 'static,
{
    let payload = match serde_json::from_slice::<T>(&message.payload.data) {
        Ok(payload) => payload,
        Err(e) => return Err(Box::new((message, format!("payload does not decode: {e}")))),
    };
    let properties = properties_of(&message);
    let message_id = message_id_of(&message);
    let payload_bytes = message.payload.data.len();
    let raw: Arc<[u8]> = std::mem::take(&mut message.payload.data).into();
    let (raw_again, aside) = (raw.clone(), aside.clone());
    let delivery = move |payload: T| Delivery {
        payload,
        properties: properties.clone(),
        message_id: message_id.clone(),
        payload_bytes,
        raw: raw_again.clone(),
        aside: aside.clone(),
    };
    let work = handler(delivery(payload));
    // A nack on a non-persistent topic would lose the message (it is never redelivered), so its
    // handler is run again here instead, and a message it still fails goes to the dead-letter
    // topic, which says so (a client's request there ends its dialog with an error).
    let again = is_non_persistent(&message.topic).then(|| handler.clone());
    let again_raw = raw.clone();
    let handle = tasks.spawn(async move {
        let mut work = work;
        let mut tries = 1;
        loop {
            // Caught here so that a panic waits the nack delay as a nack does: it would otherwise
            // come back at once, and panic again, as fast as the broker can deliver it.
            let disposition = match std::panic::AssertUnwindSafe(work).catch_unwind().await {
                Ok(disposition) => disposition,
                Err(panic) => {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "a panic".to_owned());
                    tokio::time::sleep(nack_delay).await;
                    return Finished::Panicked(what);
                }
            };
            let Disposition::Nack(reason) = disposition else {
                return Finished::Handled(disposition);
            };
            tokio::time::sleep(nack_delay).await;
            let Some(handler) = again.as_ref() else {
                return Finished::Handled(Disposition::Nack(reason));
            };
            if tries >= NON_PERSISTENT_TRIES {
                return Finished::Handled(Disposition::DeadLetter(format!(
                    "{reason} ({tries} tries: a non-persistent topic does not deliver it again)"
                )));
            }
            let Ok(payload) = serde_json::from_slice::<T>(&again_raw) else {
                return Finished::Handled(Disposition::Nack(reason));
            };
            tries += 1;
            work = handler(delivery(payload));
        }
    });
    in_flight.insert(handle.id(), message, raw);
    Ok(())
}

/// Drops a message the intake has no room for. Acked, so that a broker that counts unacked
/// messages does not hold them against the consumer; the topic never sends it again anyway.
async fn shed(
    consumer: &mut Consumer<Vec<u8>, TokioExecutor>,
    stats: &ConsumerStats,
    topic: &str,
    intake: &Intake,
    message: &Message<Vec<u8>>,
) {
    let shed = stats.shed.fetch_add(1, Ordering::Relaxed) + 1;
    // The subscription's topic, not the message's (a partition's name, for a partitioned one).
    agent_metrics::global().inc(SHED_METRIC, &[("topic", topic)]);
    if shed.is_power_of_two() {
        tracing::warn!(
            %topic,
            shed,
            waiting = intake.len(),
            waiting_bytes = intake.bytes,
            "dropping a message: every handler is busy and as much as PULSAR_INTAKE_MAX_BYTES waits for them"
        );
    }
    if let Err(e) = consumer.ack(message).await {
        tracing::debug!(error = %e, "ack of a dropped message failed");
    }
}

async fn build_consumer(
    bus: &Bus,
    config: &SubscriptionConfig,
) -> Result<Consumer<Vec<u8>, TokioExecutor>, pulsar::Error> {
    let max_in_flight = config.max_in_flight.max(1);
    // A non-persistent topic's broker drops what a subscription has no permits for (nothing is
    // redelivered there either): a window of `max_in_flight` dropped 953 of a burst of 1,000
    // first messages from TrustGraph's clients. Its messages wait in the crate's queue for a
    // handler instead. A persistent topic keeps the small window: a crashed consumer then holds
    // few messages (pulsar-lite hands them to a new consumer slowly).
    let window = if is_non_persistent(&config.topic) {
        NON_PERSISTENT_WINDOW
    } else {
        max_in_flight as u32
    };
    let mut builder = bus
        .client()
        .consumer()
        .with_topic(&config.topic)
        .with_subscription(&config.subscription)
        .with_subscription_type(if config.one_at_a_time {
            SubType::Failover
        } else {
            SubType::Shared
        })
        // Consumer ids must be unique per subscription across processes (pulsar-lite refuses a
        // second "consumer 0"), and each process numbers its own from 0.
        .with_consumer_id(rand::random::<u64>() >> 1)
        .with_batch_size(window)
        .with_options(ConsumerOptions {
            receiver_queue_size: Some(window),
            // A request published before the first replica subscribed must still be served.
            initial_position: InitialPosition::Earliest,
            ..ConsumerOptions::default()
        });
    if let Some(max_redeliver_count) = config.max_redeliveries {
        builder = builder.with_dead_letter_policy(DeadLetterPolicy {
            max_redeliver_count,
            dead_letter_topic: config.dead_letter_topic.clone(),
        });
    }
    builder.build().await
}

fn subscribe_error(config: &SubscriptionConfig, e: &pulsar::Error) -> BusError {
    BusError::Subscribe {
        topic: config.topic.clone(),
        message: e.to_string(),
    }
}

/// How long subscribing again may fail before it is logged as an error rather than a warning.
const OUTAGE_AFTER: Duration = Duration::from_secs(60);

/// Subscribes again, after the stream of a running consumer ended, until it works (backing off up
/// to 5 s between tries) or `shutdown`: a service that was consuming waits out any outage. Failures
/// are warnings for the first [`OUTAGE_AFTER`], errors after it.
async fn resubscribe(
    bus: &Bus,
    config: &SubscriptionConfig,
    shutdown: &CancellationToken,
) -> Option<Consumer<Vec<u8>, TokioExecutor>> {
    let mut wait = Duration::from_millis(100);
    let since = std::time::Instant::now();
    loop {
        // Raced against the stop: one try can take a minute against a broker that is down.
        let built = tokio::select! {
            _ = shutdown.cancelled() => return None,
            built = build_consumer(bus, config) => built,
        };
        match built {
            Ok(consumer) => {
                tracing::info!(topic = %config.topic, "subscribed again");
                return Some(consumer);
            }
            // A broker restart is over in seconds: failing for longer than a minute is an outage
            // someone should hear of.
            Err(e) if since.elapsed() > OUTAGE_AFTER => tracing::error!(
                topic = %config.topic,
                error = %e,
                failing_for_secs = since.elapsed().as_secs(),
                "subscribing again failed"
            ),
            Err(e) => tracing::warn!(topic = %config.topic, error = %e, "subscribing again failed"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return None,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = (wait * 2).min(Duration::from_secs(5));
    }
}

async fn settle(
    (consumer, batches): (&mut Consumer<Vec<u8>, TokioExecutor>, &mut BatchAcks),
    dead_letters: &Option<Publisher>,
    stats: &Arc<ConsumerStats>,
    (tasks, in_flight, panics): (&mut JoinSet<Finished>, &mut InFlight, &mut Panics),
    nack_delay: Duration,
    done: Result<(Id, Finished), tokio::task::JoinError>,
) {
    let (id, finished) = match done {
        Ok(pair) => pair,
        // A task that died is a transient failure: another attempt may succeed.
        Err(e) => (
            e.id(),
            Finished::Handled(Disposition::Nack(format!("handler failed: {e}"))),
        ),
    };
    let Some(Held {
        message,
        payload,
        key,
    }) = in_flight.remove(&id)
    else {
        return;
    };
    let disposition = match finished {
        Finished::Handled(disposition) => disposition,
        Finished::Panicked(what) => after_panic(panics, &message, &what),
        Finished::DeadLettered(Ok(())) => {
            stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
            in_flight.handled(key);
            if let Err(e) = ack(consumer, batches, &message).await {
                tracing::warn!(error = %e, "ack after dead-lettering failed");
            }
            return;
        }
        // Its dead letter was sent again until the patience ran out: nothing more to be done.
        Finished::DeadLettered(Err(e)) if is_non_persistent(&message.topic) => {
            tracing::error!(error = %e, topic = %message.topic, "dead-letter publish failed (sent again for up to {} s): the message is lost", NON_PERSISTENT_DEAD_LETTER_PATIENCE.as_secs());
            return;
        }
        // Not acked: a persistent topic's comes back and we try again rather than lose it.
        Finished::DeadLettered(Err(e)) => {
            tracing::error!(error = %e, "dead-letter publish failed");
            if let Err(e) = consumer.nack(&message).await {
                tracing::warn!(error = %e, "nack failed");
            }
            return;
        }
    };
    match disposition {
        Disposition::Ack => {
            tracing::debug!(message_id = ?message.message_id.id, "ack");
            // Whether the ack reaches the broker or not: a copy sent again is not handled again.
            in_flight.handled(key);
            if let Err(e) = ack(consumer, batches, &message).await {
                tracing::warn!(error = %e, "ack failed; the message will be redelivered");
            } else {
                stats.acked.fetch_add(1, Ordering::Relaxed);
            }
        }
        Disposition::Nack(reason) => {
            tracing::warn!(%reason, "nack");
            stats.nacked.fetch_add(1, Ordering::Relaxed);
            if let Err(e) = consumer.nack(&message).await {
                tracing::warn!(error = %e, "nack failed");
            }
        }
        Disposition::DeadLetter(reason) => {
            dead_letter(
                (consumer, batches),
                dead_letters,
                (tasks, in_flight, stats),
                (message, payload.to_vec()),
                &reason,
                nack_delay,
            )
            .await;
        }
    }
}

/// What becomes of `message`, whose handler panicked saying `what`: nacked, or dead-lettered once
/// it has panicked [`PANICS_TO_DEAD_LETTER`] times (at once on a non-persistent topic, which never
/// delivers it again: no second try to count).
fn after_panic(panics: &mut Panics, message: &Message<Vec<u8>>, what: &str) -> Disposition {
    if is_non_persistent(&message.topic) {
        return Disposition::DeadLetter(format!(
            "its handler panicked on it (a non-persistent topic does not deliver it again): {what}"
        ));
    }
    let times = panics.one_more(message_id_of(message));
    if times >= PANICS_TO_DEAD_LETTER {
        return Disposition::DeadLetter(format!(
            "its handler panicked on it {times} times: {what}"
        ));
    }
    tracing::error!(panic = %what, times, "the handler panicked");
    Disposition::Nack(format!("its handler panicked: {what}"))
}

/// Sends a message and its payload to the dead-letter topic with `reason`, in a task of the
/// loop's (see [`Finished`]); a consumer with no dead-letter topic acks and drops it at once. A
/// publish that fails waits `nack_delay` before its message is nacked, as a handler's nack does;
/// a non-persistent topic's is sent again instead, for up to
/// [`NON_PERSISTENT_DEAD_LETTER_PATIENCE`].
async fn dead_letter(
    (consumer, batches): (&mut Consumer<Vec<u8>, TokioExecutor>, &mut BatchAcks),
    dead_letters: &Option<Publisher>,
    (tasks, in_flight, stats): (&mut JoinSet<Finished>, &mut InFlight, &Arc<ConsumerStats>),
    (message, mut letter): (Message<Vec<u8>>, Vec<u8>),
    reason: &str,
    nack_delay: Duration,
) {
    // A decoding error can quote the whole payload (serde's "invalid type: string ..."): logged
    // to its start, so that it fits a log line (the dead letter's is cut in `fit_dead_letter`).
    let logged = cut_at_char(reason, MAX_REASON_BYTES);
    let Some(dead_letters) = dead_letters.clone() else {
        tracing::warn!(topic = %message.topic, reason = %logged, "dropping a message nothing can be done with");
        in_flight.handled(MessageKey::of(&message));
        if let Err(e) = ack(consumer, batches, &message).await {
            tracing::warn!(error = %e, "ack failed");
        }
        return;
    };
    tracing::warn!(topic = %message.topic, reason = %logged, "dead-lettering a message");
    let mut properties = properties_of(&message);
    properties.insert(DEAD_LETTER_ORIGIN.to_owned(), message.topic.clone());
    fit_dead_letter(
        &mut letter,
        &mut properties,
        reason,
        dead_letters.max_message_bytes(),
    );
    // A persistent topic's message, not acked, comes back to be dead-lettered again; a
    // non-persistent topic's would be lost (a client's request whose forwarding failed in a broker
    // restart, its dead letter failing in the same restart, and the client waiting for ever), so
    // its dead letter is sent again here for a while, holding its place (in a long outage every
    // place may be so held, and the consumer takes nothing more until the broker is back).
    let patience = is_non_persistent(&message.topic).then_some(NON_PERSISTENT_DEAD_LETTER_PATIENCE);
    let stats = stats.clone();
    let topic = message.topic.clone();
    let handle = tasks.spawn(async move {
        let Some(patience) = patience else {
            let published = dead_letters.send(letter, &properties).await;
            if published.is_err() {
                stats.dead_letter_sends_failed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(nack_delay).await;
            }
            return Finished::DeadLettered(published);
        };
        let since = tokio::time::Instant::now();
        let mut wait = nack_delay.clamp(Duration::from_millis(100), Duration::from_secs(5));
        loop {
            let published = dead_letters.send(letter.clone(), &properties).await;
            let Err(e) = published else {
                return Finished::DeadLettered(Ok(()));
            };
            stats.dead_letter_sends_failed.fetch_add(1, Ordering::Relaxed);
            // Too large is refused the same way every time: nothing to wait for.
            if !e.passes() || since.elapsed() >= patience {
                return Finished::DeadLettered(Err(e));
            }
            tracing::warn!(%topic, error = %e, "dead-letter publish failed; a non-persistent topic's message is lost without it, so it is sent again");
            tokio::time::sleep(wait).await;
            wait = wait.saturating_mul(2).min(Duration::from_secs(5));
        }
    });
    // The payload travels with the task alone.
    in_flight.insert(handle.id(), message, Arc::from(Vec::new()));
}

/// The most of a dead letter's reason kept (logged and sent).
const MAX_REASON_BYTES: usize = 2048;

/// The most of it kept when the whole would not leave its payload room.
const SHORT_REASON_BYTES: usize = 160;

/// `text` cut to at most `max` bytes, at a character's boundary, marked as cut.
fn cut_at_char(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... ({} bytes in all)", &text[..end], text.len()).into()
}

/// Adds `reason` to a dead letter's properties, at most [`MAX_REASON_BYTES`] of it, and cuts the
/// letter to the broker's limit `max`: a message the broker took can be too large once the
/// properties saying why are added, and a dead letter that can never be published would bring its
/// message back for ever. The reason is cut to its start first (each cut from the whole, so it
/// says the whole's size): a payload cut is one
/// the dead letter's reader cannot decode (the service that answers a client's dead-lettered
/// request with an error dropped it, and the client never heard), while the reason's start says
/// what went wrong. Then the payload is cut (its size as it came is kept in
/// [`DEAD_LETTER_PAYLOAD_BYTES`]); if the message's own properties still leave no room, only ours
/// are kept.
fn fit_dead_letter(letter: &mut Vec<u8>, properties: &mut Properties, reason: &str, max: usize) {
    properties.insert(
        DEAD_LETTER_REASON.to_owned(),
        cut_at_char(reason, MAX_REASON_BYTES).into_owned(),
    );
    if Publisher::message_bytes(letter, properties) <= max {
        return;
    }
    properties.insert(
        DEAD_LETTER_REASON.to_owned(),
        cut_at_char(reason, SHORT_REASON_BYTES).into_owned(),
    );
    if Publisher::message_bytes(letter, properties) <= max {
        return;
    }
    properties.insert(
        DEAD_LETTER_PAYLOAD_BYTES.to_owned(),
        letter.len().to_string(),
    );
    let ours = [
        DEAD_LETTER_REASON,
        DEAD_LETTER_ORIGIN,
        DEAD_LETTER_PAYLOAD_BYTES,
    ];
    if Publisher::message_bytes(&[], properties) > max {
        properties.retain(|k, _| ours.contains(&k.as_str()));
    }
    letter.truncate(max.saturating_sub(Publisher::message_bytes(&[], properties)));
}

fn message_id_of(message: &Message<Vec<u8>>) -> String {
    let id = &message.message_id.id;
    format!(
        "{}/{}:{}:{}",
        message.topic,
        id.ledger_id,
        id.entry_id,
        id.batch_index.unwrap_or(-1)
    )
}

pub(crate) fn properties_of(message: &Message<Vec<u8>>) -> Properties {
    message
        .payload
        .metadata
        .properties
        .iter()
        .map(|kv| (kv.key.clone(), kv.value.clone()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message_of(payload_bytes: usize) -> Message<Vec<u8>> {
        Message::new(
            "non-persistent://tg/request/test",
            pulsar::consumer::data::MessageData {
                id: pulsar::proto::MessageIdData::default(),
                batch_size: None,
            },
            pulsar::Payload {
                metadata: pulsar::proto::MessageMetadata::default(),
                data: vec![b'x'; payload_bytes],
            },
        )
    }

    /// A member of a batch of `size` at `index` of entry `entry`, on `topic`.
    fn member_of(topic: &str, entry: u64, index: i32, size: i32) -> Message<Vec<u8>> {
        Message::new(
            topic,
            pulsar::consumer::data::MessageData {
                id: pulsar::proto::MessageIdData {
                    ledger_id: 7,
                    entry_id: entry,
                    batch_index: Some(index),
                    ..Default::default()
                },
                batch_size: Some(size),
            },
            pulsar::Payload {
                metadata: pulsar::proto::MessageMetadata::default(),
                data: Vec::new(),
            },
        )
    }

    #[test]
    fn a_batchs_members_are_acked_once_all_are_done() {
        let topic = "persistent://tg/flow/batch";
        let mut batches = BatchAcks::default();
        // Messages of no batch, and a non-persistent topic's, are acked as they are done.
        assert!(batches.done(&message_of(0)));
        assert!(batches.done(&member_of("non-persistent://tg/x", 1, 0, 3)));
        assert!(batches.done(&member_of(topic, 1, 0, 1)));
        // Each member once, in any order; a member done twice counts once.
        assert!(!batches.done(&member_of(topic, 2, 2, 3)));
        assert!(!batches.done(&member_of(topic, 2, 0, 3)));
        assert!(!batches.done(&member_of(topic, 2, 0, 3)));
        assert!(batches.done(&member_of(topic, 2, 1, 3)));
        assert!(batches.entries.is_empty());
        // A member nacked brings the entry back: the member done before is known as done.
        assert!(!batches.done(&member_of(topic, 3, 0, 2)));
        assert!(batches.was_done(&member_of(topic, 3, 0, 2)));
        assert!(!batches.was_done(&member_of(topic, 3, 1, 2)));
        assert!(!batches.was_done(&message_of(0)));
        assert!(batches.done(&member_of(topic, 3, 1, 2)));
        assert!(!batches.was_done(&member_of(topic, 3, 0, 2)));
        // Past the bound, the oldest entry is forgotten, not the others.
        for entry in 0..BatchAcks::MOST as u64 {
            assert!(!batches.done(&member_of(topic, 100 + entry, 0, 2)));
        }
        assert!(!batches.done(&member_of(topic, 99, 0, 2)));
        assert_eq!(batches.entries.len(), BatchAcks::MOST);
        assert!(!batches.entries.contains_key(&(topic.to_owned(), 7, 100)));
        assert!(batches.done(&member_of(topic, 101, 1, 2)));
    }

    #[test]
    fn the_intake_holds_within_its_bytes_and_its_count_and_gives_back_the_rest() {
        let each = held_bytes(&message_of(1000));
        let empty = held_bytes(&message_of(0));
        assert_eq!(each, empty + 1000);
        let mut intake = Intake::new(3 * each + empty, 10);
        for _ in 0..3 {
            assert!(intake.hold(message_of(1000)).is_ok());
        }
        assert!(intake.hold(message_of(1000)).is_err(), "past the bytes");
        assert!(
            intake.hold(message_of(0)).is_ok(),
            "a smaller one still fits"
        );
        assert!(intake.hold(message_of(0)).is_err(), "full to the byte");
        assert_eq!((intake.len(), intake.bytes), (4, 3 * each + empty));
        assert_eq!(intake.next().map(|m| m.payload.data.len()), Some(1000));
        assert!(
            intake.hold(message_of(1000)).is_ok(),
            "room made by the one taken"
        );
        while intake.next().is_some() {}
        assert_eq!((intake.len(), intake.bytes), (0, 0));

        let mut by_count = Intake::new(usize::MAX, 2);
        assert!(by_count.hold(message_of(1)).is_ok());
        assert!(by_count.hold(message_of(1)).is_ok());
        assert!(by_count.hold(message_of(1)).is_err(), "past the count");
    }

    #[test]
    fn what_a_sender_puts_in_a_messages_metadata_counts_against_the_intake() {
        let keyed = |key_bytes: usize| {
            let mut message = message_of(0);
            message.payload.metadata.partition_key = Some("k".repeat(key_bytes));
            message.payload.metadata.ordering_key = Some(vec![b'o'; key_bytes]);
            message.payload.metadata.producer_name = "p".repeat(key_bytes);
            message
        };
        assert!(held_bytes(&keyed(1 << 20)) > 3 << 20);
        // Before, each counted as 512 bytes: three held in 2 MiB, 10,000 in 5 MiB.
        let mut intake = Intake::new(2 << 20, 10);
        assert!(
            intake.hold(keyed(1 << 20)).is_ok(),
            "an empty intake takes one"
        );
        assert!(intake.hold(keyed(1 << 20)).is_err(), "past the bytes");
        assert!(intake.hold(message_of(100)).is_err(), "still full");
    }

    #[test]
    fn a_dead_letter_is_cut_to_the_brokers_limit() {
        let why = |extra: &str| {
            let mut properties = Properties::new();
            properties.insert("x-origin".to_owned(), extra.to_owned());
            properties.insert(
                DEAD_LETTER_ORIGIN.to_owned(),
                "persistent://tg/request/a".to_owned(),
            );
            properties
        };
        // Within the limit: as it came.
        let (mut letter, mut properties) = (vec![b'x'; 100], why("v"));
        fit_dead_letter(
            &mut letter,
            &mut properties,
            "payload does not decode",
            1000,
        );
        assert_eq!((letter.len(), properties.len()), (100, 3));

        // The payload cut, its size kept.
        let (mut letter, mut properties) = (vec![b'x'; 1000], why("v"));
        fit_dead_letter(
            &mut letter,
            &mut properties,
            "payload does not decode",
            1000,
        );
        assert_eq!(properties[DEAD_LETTER_PAYLOAD_BYTES], "1000");
        assert_eq!(Publisher::message_bytes(&letter, &properties), 1000);
        assert!(properties.contains_key("x-origin"));

        // A long reason that leaves the payload no room is cut to its start; the payload stays
        // whole, so the dead letter's reader can still decode it.
        let (mut letter, mut properties) = (vec![b'x'; 700], why("v"));
        fit_dead_letter(&mut letter, &mut properties, &"why ".repeat(100), 1000);
        assert_eq!(letter.len(), 700);
        assert!(!properties.contains_key(DEAD_LETTER_PAYLOAD_BYTES));
        assert!(properties[DEAD_LETTER_REASON].starts_with("why why"));
        assert!(properties[DEAD_LETTER_REASON].ends_with("(400 bytes in all)"));
        assert!(Publisher::message_bytes(&letter, &properties) <= 1000);

        // A reason over the most kept is cut once, from the whole, whose size it says.
        let (mut letter, mut properties) = (vec![b'x'; 700], why("v"));
        fit_dead_letter(&mut letter, &mut properties, &"why ".repeat(1_000), 1000);
        assert_eq!(
            properties[DEAD_LETTER_REASON]
                .matches("bytes in all")
                .count(),
            1
        );
        assert!(properties[DEAD_LETTER_REASON].ends_with("(4000 bytes in all)"));

        // The message's own properties fill the limit: only ours are kept.
        let (mut letter, mut properties) = (vec![b'x'; 10], why(&"v".repeat(990)));
        // (The payload's size is said though it was not cut: something was.)
        fit_dead_letter(
            &mut letter,
            &mut properties,
            "payload does not decode",
            1000,
        );
        assert!(!properties.contains_key("x-origin"));
        assert_eq!(properties[DEAD_LETTER_PAYLOAD_BYTES], "10");
        assert_eq!(letter.len(), 10);
        assert!(Publisher::message_bytes(&letter, &properties) <= 1000);
    }

    #[test]
    fn a_long_reason_is_cut_at_a_character() {
        assert_eq!(cut_at_char("short", 10), "short");
        let long = "é".repeat(10); // two bytes each
        let cut = cut_at_char(&long, 5);
        assert!(cut.starts_with("éé..."), "{cut}");
        assert!(cut.ends_with("(20 bytes in all)"), "{cut}");
    }

    #[test]
    fn an_empty_intake_takes_one_message_whatever_its_size() {
        let mut intake = Intake::new(10, 10);
        assert!(intake.hold(message_of(1 << 20)).is_ok());
        assert!(intake.hold(message_of(1)).is_err());
        assert!(intake.next().is_some());
        assert!(intake.is_empty() && intake.bytes == 0);
    }

    #[test]
    fn handlers_stand_aside_up_to_the_bound_and_come_back() {
        let aside = Aside::counted(2);
        let first = aside.step_aside(10).unwrap();
        let second = aside.clone().step_aside(10).unwrap();
        assert_eq!(aside.waiting(), 2);
        assert!(aside.step_aside(10).is_none(), "past the bound");
        drop(first);
        assert_eq!(aside.waiting(), 1);
        let third = aside.step_aside(10).unwrap();
        drop((second, third));
        assert_eq!(aside.waiting(), 0);
        // A delivery no loop counts may always wait.
        assert!(Aside::default().step_aside(10).is_some());
        assert_eq!(Aside::default().waiting(), 0);
    }

    /// What stands aside is bounded in bytes as well as in count; the first to stand aside may
    /// be as large as any message, and a refusal takes nothing.
    #[test]
    fn handlers_stand_aside_up_to_a_bound_in_bytes() {
        let aside = Aside::counted(100);
        let half = (ASIDE_BYTES / 2) as usize;
        let first = aside.step_aside(half).unwrap();
        let second = aside.step_aside(half).unwrap();
        assert!(aside.step_aside(1).is_none(), "past the bytes");
        assert_eq!(aside.waiting(), 2);
        drop((first, second));
        let huge = aside.step_aside(ASIDE_BYTES as usize * 2).unwrap();
        assert!(aside.step_aside(1).is_none());
        drop(huge);
        assert!(aside.step_aside(1).is_some());
        let counted = Aside::counted(1);
        let _one = counted.step_aside(1).unwrap();
        assert!(counted.step_aside(1).is_none());
        assert_eq!(
            counted
                .shared
                .as_ref()
                .unwrap()
                .bytes
                .load(Ordering::SeqCst),
            1,
            "a refusal by count takes no bytes"
        );
    }
}
