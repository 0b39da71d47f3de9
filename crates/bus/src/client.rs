//! The client side of the agent service: publish requests, read the response stream. Also the
//! reading half every client shares: a private Exclusive subscription from the latest message,
//! read one acked message at a time.

use futures::StreamExt;
use pulsar::consumer::{ConsumerOptions, InitialPosition, Message};
use pulsar::{Consumer, SubType, TokioExecutor};

use std::collections::{HashSet, VecDeque};

use agent_schema::{
    AgentRequest, AgentResponse, ANSWER_CHUNKS_PROPERTY, ANSWER_CHUNK_PROPERTY, ATTEMPT_PROPERTY,
    EFFECT_ID_PROPERTY, ID_PROPERTY,
};

use crate::{Bus, BusError, Properties, Publisher, Topics};

/// A subscription of this client alone (named `{prefix}-{random}`) that sees what is published
/// from now on.
///
/// Its topics are non-persistent (TrustGraph's responses, notifications): a broker drops what it
/// has no flow permits for, Apache Pulsar as pulsar-lite. The `pulsar` crate grants permits as its
/// bounded queue (1,000 messages) empties, so a reader busy elsewhere for a moment lost every
/// message after the first 1,500 or so, silently (a dialog's closing among them would leave its
/// client waiting for ever). A pump task therefore takes every message off the subscription as it arrives,
/// into a buffer bounded by bytes ([`LISTENER_BUFFER_BYTES`]); past the bound it drops and says
/// so, instead of the broker dropping unseen.
pub struct Listener {
    topic: String,
    prefix: String,
    limit: usize,
    buffered: tokio::sync::mpsc::UnboundedReceiver<Result<Message<Vec<u8>>, String>>,
    bytes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pump: tokio::task::JoinHandle<()>,
    subscribed_at: std::time::Instant,
    /// [`Listener::next`] has reported the subscription ended: nothing more will come until
    /// [`Listener::subscribe_again`].
    ended: bool,
}

/// The most bytes a listener holds that its reader has not taken yet (each message counted as
/// its payload, properties and 512 bytes).
pub const LISTENER_BUFFER_BYTES: usize = 256 << 20;

/// Flow permits a listener grants the broker (the crate's default is 1,000): what the broker may
/// send before the listener's process has run to ask for more. A process that stood still while
/// 5,000 messages came got 1,000 of them.
const LISTENER_PERMITS: u32 = 20_000;

impl Listener {
    pub async fn subscribe(bus: &Bus, topic: &str, prefix: &str) -> Result<Listener, BusError> {
        Self::subscribe_holding(bus, topic, prefix, LISTENER_BUFFER_BYTES).await
    }

    /// [`Listener::subscribe`], holding at most `limit` bytes its reader has not taken.
    async fn subscribe_holding(
        bus: &Bus,
        topic: &str,
        prefix: &str,
        limit: usize,
    ) -> Result<Listener, BusError> {
        // Just after a broker (re)starts it refuses subscriptions for a moment while it loads the
        // topic's namespace and its storage: a client tries again before it reports the refusal.
        let consumer = crate::error::until_settled(topic, || {
            bus.client()
                .consumer()
                .with_topic(topic)
                .with_subscription(format!("{prefix}-{:016x}", rand::random::<u64>()))
                .with_subscription_type(SubType::Exclusive)
                .with_consumer_id(rand::random::<u64>() >> 1)
                .with_batch_size(LISTENER_PERMITS)
                .with_options(ConsumerOptions {
                    initial_position: InitialPosition::Latest,
                    // A listener reads from now on and never comes back for what it missed, so
                    // its subscription must go with its connection: a durable one outlives a
                    // process that crashed or never closed it, and on a persistent topic would
                    // hold every message published after it for good (Apache Pulsar expires no
                    // subscription by default).
                    durable: Some(false),
                    ..ConsumerOptions::default()
                })
                .build()
        })
        .await
        .map_err(|e| BusError::Subscribe {
            topic: topic.to_owned(),
            message: e.to_string(),
        })?;
        let (tx, buffered) = tokio::sync::mpsc::unbounded_channel();
        let bytes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let pump = tokio::spawn(pump(consumer, tx, bytes.clone(), limit, topic.to_owned()));
        Ok(Listener {
            topic: topic.to_owned(),
            prefix: prefix.to_owned(),
            limit,
            buffered,
            bytes,
            pump,
            subscribed_at: std::time::Instant::now(),
            ended: false,
        })
    }

    /// A new subscription in place of this one, on the same topic: what a reader does once
    /// [`Listener::next`] reported the subscription ended (a broker restart). What was published
    /// meanwhile is lost to it, as on any non-persistent topic.
    pub async fn subscribe_again(&mut self, bus: &Bus) -> Result<(), BusError> {
        *self = Self::subscribe_holding(bus, &self.topic, &self.prefix, self.limit).await?;
        Ok(())
    }

    /// [`Listener::subscribe_again`] until the broker takes it (a broker restarting refuses for a
    /// while), once a second; `what` names what is heard, in the warnings. The first try comes
    /// after 50 ms when this subscription had lasted a while: what the broker publishes meanwhile
    /// is lost to this listener (the soak's reader, waiting a second, missed closings published
    /// 0.2-0.7 s after a restart). A subscription that ended within a second of being made waits
    /// the second, so that one that ends as soon as it is made does not spin.
    pub async fn subscribe_again_until_taken(&mut self, bus: &Bus, what: &str) {
        *self = self.subscription_again(bus, what).await;
    }

    /// A new listener on this one's topic, made as [`Listener::subscribe_again_until_taken`]
    /// makes it, by a future that borrows nothing: a loop that has other work goes on with it
    /// while the broker refuses.
    pub fn subscription_again(
        &self,
        bus: &Bus,
        what: &str,
    ) -> impl std::future::Future<Output = Listener> + Send + 'static {
        let (bus, topic, prefix, limit) = (
            bus.clone(),
            self.topic.clone(),
            self.prefix.clone(),
            self.limit,
        );
        let what = what.to_owned();
        let mut pause = if self.subscribed_at.elapsed() > std::time::Duration::from_secs(1) {
            std::time::Duration::from_millis(50)
        } else {
            std::time::Duration::from_secs(1)
        };
        async move {
            loop {
                tokio::time::sleep(pause).await;
                match Self::subscribe_holding(&bus, &topic, &prefix, limit).await {
                    Ok(listener) => return listener,
                    Err(e) => tracing::warn!(error = %e, "cannot listen to {what} yet"),
                }
                pause = std::time::Duration::from_secs(1);
            }
        }
    }

    /// The next message's payload, already acked.
    pub async fn next_payload(&mut self) -> Result<Vec<u8>, BusError> {
        Ok(self.next().await?.payload.data)
    }

    /// The next message's payload and its properties (what a seal is checked over).
    pub async fn next_with_properties(&mut self) -> Result<(Vec<u8>, crate::Properties), BusError> {
        let message = self.next().await?;
        let properties = crate::consumer::properties_of(&message);
        Ok((message.payload.data, properties))
    }

    /// Whether the subscription has ended, whether or not [`Listener::next`] has reported it yet
    /// (messages taken before may still wait); a reader that only looks now and then subscribes
    /// again when it finds it so.
    pub fn ended(&self) -> bool {
        // The pump ends only with the subscription: the listener holds what it sends to.
        self.ended || self.pump.is_finished()
    }

    /// Drops every message waiting to be read (what a reader that asks now and then has no use
    /// for: answers to others), so that they are not held until the next read; how many.
    pub fn discard_waiting(&mut self) -> usize {
        let mut discarded = 0;
        loop {
            match self.buffered.try_recv() {
                Ok(Ok(message)) => {
                    self.bytes.fetch_sub(
                        crate::consumer::held_bytes(&message),
                        std::sync::atomic::Ordering::Relaxed,
                    );
                    discarded += 1;
                }
                Ok(Err(_)) | Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    self.ended = true;
                    return discarded;
                }
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => return discarded,
            }
        }
    }

    /// The next message, already acked (a listener never wants one again).
    pub async fn next(&mut self) -> Result<Message<Vec<u8>>, BusError> {
        let message = match self.buffered.recv().await {
            Some(Ok(m)) => m,
            Some(Err(message)) => {
                self.ended = true;
                return Err(BusError::ConsumerStopped {
                    topic: self.topic.clone(),
                    message,
                });
            }
            None => {
                self.ended = true;
                return Err(BusError::ConsumerStopped {
                    topic: self.topic.clone(),
                    message: "the stream ended".into(),
                });
            }
        };
        self.bytes.fetch_sub(
            crate::consumer::held_bytes(&message),
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(message)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // The pump owns the subscription: stopping it closes the subscription.
        self.pump.abort();
    }
}

/// Moves every message of `consumer` into `tx` as it arrives, acked, while the bytes waiting stay
/// within `limit`; ends with the consumer's error, or when the listener is gone.
async fn pump(
    mut consumer: Consumer<Vec<u8>, TokioExecutor>,
    tx: tokio::sync::mpsc::UnboundedSender<Result<Message<Vec<u8>>, String>>,
    bytes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    limit: usize,
    topic: String,
) {
    let mut dropped: u64 = 0;
    loop {
        let message = match consumer.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                let _ = tx.send(Err(e.to_string()));
                return;
            }
            None => {
                let _ = tx.send(Err("the stream ended".into()));
                return;
            }
        };
        let _ = consumer.ack(&message).await;
        // Its properties and bookkeeping too: a flood of empty messages is not free to hold.
        let size = crate::consumer::held_bytes(&message);
        let waiting = bytes.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
        if waiting + size > limit {
            bytes.fetch_sub(size, std::sync::atomic::Ordering::Relaxed);
            dropped += 1;
            if dropped.is_power_of_two() {
                tracing::warn!(%topic, dropped, waiting, "a listener's reader is too far behind: messages dropped");
            }
            continue;
        }
        if tx.send(Ok(message)).is_err() {
            return;
        }
    }
}

/// The value of a message property.
pub fn message_property<'m>(message: &'m Message<Vec<u8>>, key: &str) -> Option<&'m str> {
    message
        .payload
        .metadata
        .properties
        .iter()
        .find(|kv| kv.key == key)
        .map(|kv| kv.value.as_str())
}

/// A response as a client received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// The dialog's correlation id.
    pub id: String,
    pub response: AgentResponse,
    /// Which delivery of its step sent it ([`ATTEMPT_PROPERTY`]), on streamed chunks and closings.
    pub attempt: Option<String>,
    /// On a chunk of answer text, its place among its attempt's ([`ANSWER_CHUNK_PROPERTY`]).
    pub answer_chunk: Option<u64>,
    /// On a closing, how many answer chunks its attempt streamed ([`ANSWER_CHUNKS_PROPERTY`]).
    pub answer_chunks: Option<u64>,
}

impl Received {
    /// `response` of dialog `id`, with what our properties say of it: `property` gives the value
    /// of each (a message's, or a journaled effect's).
    pub fn with_properties<'p>(
        id: String,
        response: AgentResponse,
        property: impl Fn(&str) -> Option<&'p str>,
    ) -> Received {
        let number = |key| property(key).and_then(|n: &str| n.parse().ok());
        Received {
            id,
            response,
            attempt: property(ATTEMPT_PROPERTY).map(str::to_owned),
            answer_chunk: number(ANSWER_CHUNK_PROPERTY),
            answer_chunks: number(ANSWER_CHUNKS_PROPERTY),
        }
    }
}

/// A dialog's streamed answer, kept apart by the attempt that streamed it ([`ATTEMPT_PROPERTY`]).
/// Chunks are a live view of a step at work, not journaled: a step cut short by a crash after
/// streaming part of its answer runs again and streams it again from the start, and two copies of
/// one request may stream side by side. Joined as they come (what a TrustGraph client does), the
/// text would hold the answer more than once; the closing names the attempt whose outcome stands,
/// and that attempt's text is the answer.
///
/// A chunk the broker dropped on the way (a non-persistent topic may) leaves a hole in that text:
/// the chunks' places ([`ANSWER_CHUNK_PROPERTY`]) and the closing's count
/// ([`ANSWER_CHUNKS_PROPERTY`]) show it ([`StreamedAnswer::whole`]). A chunk delivered twice (a
/// producer sending it again after a reconnection) is told by its place and kept once.
#[derive(Debug, Default, Clone)]
pub struct StreamedAnswer {
    /// Each attempt's text, in the order the attempts began.
    attempts: Vec<AttemptText>,
    /// Whether text of an attempt came after another attempt had begun (copies side by side).
    interleaved: bool,
    /// Chunks that came again at a place already taken, and were left out.
    copies: u64,
}

/// What one attempt streamed, as it came.
#[derive(Debug, Clone)]
struct AttemptText {
    attempt: Option<String>,
    text: String,
    /// How many of its chunks came.
    chunks: u64,
    /// Whether each chunk came in its place so far: the first at 0, each next at the one after.
    in_place: bool,
    /// The places of its chunks that came, to tell a copy of one (a producer sending it again
    /// after a reconnection) from text.
    places: std::collections::BTreeSet<u64>,
}

impl StreamedAnswer {
    /// Adds an answer chunk of `attempt`, at `place` among that attempt's chunks of text (when
    /// the service numbers them; a chunk without text has no place). Returns false, adding
    /// nothing, for a copy of a chunk already added (the same attempt and place): a chunk the
    /// broker delivered twice is text once.
    pub fn push(&mut self, attempt: Option<&str>, place: Option<u64>, text: &str) -> bool {
        let last = self.attempts.len().saturating_sub(1);
        let mut after_another = false;
        let at = match self
            .attempts
            .iter()
            .position(|a| a.attempt.as_deref() == attempt)
        {
            Some(at) => {
                after_another = at != last;
                at
            }
            None => {
                self.attempts.push(AttemptText {
                    attempt: attempt.map(str::to_owned),
                    text: String::new(),
                    chunks: 0,
                    in_place: true,
                    places: Default::default(),
                });
                self.attempts.len() - 1
            }
        };
        let Some(so_far) = self.attempts.get_mut(at) else {
            return true;
        };
        if text.is_empty() {
            return true;
        }
        // Our orchestrator gives each chunk of an attempt a place of its own, so a second chunk
        // at a place is that chunk again, whatever its text.
        if let Some(place) = place {
            if !so_far.places.insert(place) {
                self.copies += 1;
                return false;
            }
        }
        // A late copy left out above mixes nothing.
        self.interleaved |= after_another;
        so_far.text.push_str(text);
        so_far.in_place &= place == Some(so_far.chunks);
        so_far.chunks += 1;
        true
    }

    fn of(&self, attempt: &str) -> Option<&AttemptText> {
        self.attempts
            .iter()
            .find(|a| a.attempt.as_deref() == Some(attempt))
    }

    /// The answer a closing of `closing` (its attempt, if it names one) concludes: that attempt's
    /// text, empty if none of its chunks came; without a name, every chunk as it came.
    pub fn answer(&self, closing: Option<&str>) -> String {
        match closing {
            Some(closing) => self.of(closing).map(|a| a.text.clone()).unwrap_or_default(),
            None => self.attempts.iter().map(|a| a.text.as_str()).collect(),
        }
    }

    /// Whether the text of `closing`'s attempt is all that attempt streamed: each of the
    /// `streamed` chunks the closing counts came, once and in its place. `None` when that cannot
    /// be told (a service, such as TrustGraph's, that neither names attempts nor counts chunks);
    /// `Some(false)` means a chunk was dropped on the way and the text has a hole in it.
    pub fn whole(&self, closing: Option<&str>, streamed: Option<u64>) -> Option<bool> {
        let (closing, streamed) = (closing?, streamed?);
        Some(match self.of(closing) {
            Some(a) => a.in_place && a.chunks == streamed,
            None => streamed == 0,
        })
    }

    /// Each attempt's text, in the order the attempts began.
    pub fn texts(&self) -> impl Iterator<Item = &str> {
        self.attempts.iter().map(|a| a.text.as_str())
    }

    /// The attempt whose chunks came last began, if any came.
    pub fn latest(&self) -> Option<Option<&str>> {
        self.attempts.last().map(|a| a.attempt.as_deref())
    }

    /// Whether text of one attempt came after another attempt had begun: copies of the step
    /// streamed side by side, and what was shown as it came mixed them.
    pub fn interleaved(&self) -> bool {
        self.interleaved
    }

    /// How many chunks came again at a place already taken, and were left out: joined as they
    /// came (as a TrustGraph client joins them), the text holds them twice.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Whether more than one attempt streamed text: joined as they came, the chunks would not be
    /// the answer.
    pub fn restreamed(&self) -> bool {
        self.attempts.iter().filter(|a| !a.text.is_empty()).count() > 1
    }
}

/// Sends requests and receives every response on the response topic, tagged with its `id`.
pub struct AgentClient {
    bus: Bus,
    requests: Publisher,
    responses: Listener,
    seen: SeenEffects,
    /// When its responses' subscription last ended (a broker restart) with no message since.
    stopped_since: Option<std::time::Instant>,
    /// When it last subscribed again.
    subscribed_again_at: Option<std::time::Instant>,
    listened_again: u64,
}

/// The effect ids of the latest responses, to drop a copy that an orchestrator re-emitted after a
/// crash between publishing an iteration's outcome and marking it published.
#[derive(Default)]
struct SeenEffects {
    ids: HashSet<String>,
    order: VecDeque<String>,
    copies: u64,
}

impl SeenEffects {
    /// Re-emission follows the original within a redelivery, so a window this long is plenty.
    const WINDOW: usize = 65_536;

    /// The longest id remembered: the orchestrators' (a journal entry's node, whose session id is
    /// at most 240 bytes, and an index) are shorter, and the window must not hold whatever a
    /// producer on the shared response topic puts there (65,536 ids of 64 KiB each would be
    /// 8 GiB; of this length, at most 128 MiB).
    const LONGEST_ID: usize = 1024;

    /// Whether `id` is new; remembers it.
    fn first_time(&mut self, id: &str) -> bool {
        if id.len() > Self::LONGEST_ID {
            return true;
        }
        if self.ids.contains(id) {
            self.copies += 1;
            return false;
        }
        if self.order.len() >= Self::WINDOW {
            if let Some(old) = self.order.pop_front() {
                self.ids.remove(&old);
            }
        }
        self.ids.insert(id.to_owned());
        self.order.push_back(id.to_owned());
        true
    }
}

impl AgentClient {
    /// Subscribes to the responses first, so nothing published after this returns is missed.
    pub async fn connect(bus: &Bus, topics: &Topics) -> Result<AgentClient, BusError> {
        let responses = Listener::subscribe(bus, &topics.response, "agent-client").await?;
        let requests = Publisher::new(bus, &topics.request).await?;
        Ok(AgentClient {
            bus: bus.clone(),
            requests,
            responses,
            seen: SeenEffects::default(),
            stopped_since: None,
            subscribed_again_at: None,
            listened_again: 0,
        })
    }

    /// Publishes `request` with the correlation `id`.
    pub async fn send(&self, id: &str, request: &AgentRequest) -> Result<(), BusError> {
        self.send_raw(id, agent_schema::encode(request)).await
    }

    /// Publishes a request with the correlation `id` and our own `extra` properties (a fork's
    /// origin, a replay's reuse), which a TrustGraph service ignores.
    pub async fn send_with(
        &self,
        id: &str,
        request: &AgentRequest,
        extra: &Properties,
    ) -> Result<(), BusError> {
        self.send_with_payload(id, agent_schema::encode(request), extra)
            .await
    }

    /// Publishes any payload with the correlation `id` (used to test hostile input).
    pub async fn send_raw(&self, id: &str, payload: Vec<u8>) -> Result<(), BusError> {
        self.send_with_payload(id, payload, &Properties::new())
            .await
    }

    async fn send_with_payload(
        &self,
        id: &str,
        payload: Vec<u8>,
        extra: &Properties,
    ) -> Result<(), BusError> {
        let mut properties = extra.clone();
        properties.insert(ID_PROPERTY.to_owned(), id.to_owned());
        self.requests.send(payload, &properties).await
    }

    /// How many times its responses' subscription ended and it subscribed again.
    pub fn listened_again(&self) -> u64 {
        self.listened_again
    }

    /// Re-emitted copies of responses this client had already received, which it dropped.
    pub fn copies_dropped(&self) -> u64 {
        self.seen.copies
    }

    /// The next response of any dialog, with its `id`; responses that do not decode, and copies of
    /// responses already received, are skipped.
    pub async fn next(&mut self) -> Result<(String, AgentResponse), BusError> {
        let received = self.receive().await?;
        Ok((received.id, received.response))
    }

    /// As [`AgentClient::next`], with the attempt that sent the response, when it names one.
    pub async fn receive(&mut self) -> Result<Received, BusError> {
        loop {
            let message = match self.responses.next().await {
                Ok(message) => {
                    self.stopped_since = None;
                    message
                }
                Err(stopped) => {
                    self.listen_again(stopped).await?;
                    continue;
                }
            };
            if let Some(effect) = message_property(&message, EFFECT_ID_PROPERTY) {
                if !self.seen.first_time(effect) {
                    tracing::debug!(effect, "dropping a re-emitted copy of a response");
                    continue;
                }
            }
            let id = message_property(&message, ID_PROPERTY)
                .unwrap_or_default()
                .to_owned();
            match agent_schema::decode::<AgentResponse>(&message.payload.data) {
                Ok(response) => {
                    return Ok(Received::with_properties(id, response, |key| {
                        message_property(&message, key)
                    }))
                }
                Err(e) => tracing::warn!(error = %e, "skipping a response that does not decode"),
            }
        }
    }
}

impl AgentClient {
    /// How long a client goes on subscribing again to responses that keep stopping before it
    /// reports it (each subscription also waits out a broker that refuses, as long as this).
    const LISTEN_AGAIN_PATIENCE: std::time::Duration = crate::error::SETTLING_PATIENCE;
    /// How long a subscription made again must last to end a new outage rather than the last one.
    const SUBSCRIPTION_LASTED: std::time::Duration = std::time::Duration::from_secs(10);

    /// Subscribes to the responses again after their subscription ended: the `pulsar` crate's
    /// consumer reconnects after some broker restarts and ends its stream after others ("not
    /// retryable: connection reset"), and a client waiting for a dialog must not give up on it
    /// for that: the dialog goes on. What the broker published on the non-persistent topic
    /// meanwhile is lost to this client (a journaled closing can be read back).
    async fn listen_again(&mut self, stopped: BusError) -> Result<(), BusError> {
        // A subscription that lasted ended for a new reason (a second restart, minutes after the
        // first, with no response meanwhile on a quiet dialog): its patience starts again. Only
        // one that ends as soon as it is made counts against the first outage's.
        if self
            .subscribed_again_at
            .is_some_and(|at| at.elapsed() > Self::SUBSCRIPTION_LASTED)
        {
            self.stopped_since = None;
        }
        let since = *self
            .stopped_since
            .get_or_insert_with(std::time::Instant::now);
        if since.elapsed() > Self::LISTEN_AGAIN_PATIENCE {
            // Reported once; a later call starts trying again, so a long-lived client outlives
            // a broker outage longer than its patience.
            self.stopped_since = None;
            return Err(stopped);
        }
        tracing::warn!(error = %stopped, "the responses' subscription ended (the broker restarted?): subscribing again");
        // Not at once: a subscription that ends as soon as it is made must not spin.
        let pause = if since.elapsed() < std::time::Duration::from_millis(100) {
            std::time::Duration::from_millis(50)
        } else {
            std::time::Duration::from_millis(500)
        };
        tokio::time::sleep(pause).await;
        if let Err(e) = self.responses.subscribe_again(&self.bus).await {
            // It waited out the broker's refusals as long as the patience allows: reported now,
            // and a later call starts again.
            self.stopped_since = None;
            return Err(e);
        }
        self.subscribed_again_at = Some(std::time::Instant::now());
        self.listened_again += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{Listener, SeenEffects, StreamedAnswer};
    use crate::embedded::EmbeddedBroker;
    use crate::{Bus, Properties, Publisher};

    /// Publishes `m{i}` for each `i` of `range` to `topic`.
    async fn publish(bus: &Bus, topic: &str, range: std::ops::Range<usize>) {
        publish_each(bus, topic, range.map(|i| format!("m{i}"))).await
    }

    /// Publishes each of `messages` to `topic`, in order, each once its predecessor is received.
    async fn publish_each(bus: &Bus, topic: &str, messages: impl IntoIterator<Item = String>) {
        let publisher = Publisher::new(bus, topic).await.unwrap();
        for message in messages {
            publisher
                .send(message.into_bytes(), &Properties::new())
                .await
                .unwrap();
        }
    }

    /// What `listener` holds, in order, until it is quiet for a second.
    async fn drain(listener: &mut Listener) -> Vec<String> {
        let mut got = Vec::new();
        while let Ok(Ok(payload)) =
            tokio::time::timeout(Duration::from_secs(1), listener.next_payload()).await
        {
            got.push(String::from_utf8(payload).unwrap());
        }
        got
    }

    /// Publishes an answer under the id `after` to `topics`' response topic until `client`
    /// receives it (what is published before it has subscribed again is lost to it, on a
    /// non-persistent topic), and returns what it received.
    async fn publish_until_heard(
        bus: &Bus,
        topics: &crate::Topics,
        client: &mut super::AgentClient,
    ) -> super::Received {
        let mut properties = Properties::new();
        properties.insert(agent_schema::ID_PROPERTY.to_owned(), "after".to_owned());
        let response = agent_schema::AgentResponse::new(agent_schema::MessageType::Answer, "back");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
        loop {
            assert!(tokio::time::Instant::now() < deadline, "nothing heard");
            if let Ok(publisher) = Publisher::new(bus, &topics.response).await {
                let _ = publisher
                    .send(agent_schema::encode(&response), &properties)
                    .await;
            }
            match tokio::time::timeout(Duration::from_secs(1), client.receive()).await {
                Ok(Ok(received)) => return received,
                Ok(Err(e)) => panic!("the client gave up: {e}"),
                Err(_) => continue,
            }
        }
    }

    /// A client's responses' stream ends under it, as the `pulsar` crate's consumer's did after
    /// a broker restart reset its connection ("not retryable"): the client subscribes again and
    /// receives what is published after, instead of reporting its subscription gone.
    #[tokio::test]
    async fn a_client_subscribes_again_when_its_responses_stream_ends() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topics = crate::Topics::trustgraph("default", "default");
        let mut client = super::AgentClient::connect(&bus, &topics).await.unwrap();
        client.responses.pump.abort();
        let heard = publish_until_heard(&bus, &topics, &mut client).await;
        assert_eq!(
            (heard.id.as_str(), heard.response.content.as_str()),
            ("after", "back")
        );
        assert_eq!(client.listened_again(), 1);
    }

    /// A second outage long after the first (65 s, a quiet dialog with nothing to read between
    /// them) gets a patience of its own: the client subscribes again. Until 2026-12-02 the
    /// patience ran from the first outage until a message came, so the client gave up at once.
    #[tokio::test]
    async fn a_second_outage_long_after_the_first_has_a_patience_of_its_own() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topics = crate::Topics::trustgraph("default", "default");
        let mut client = super::AgentClient::connect(&bus, &topics).await.unwrap();
        let ago = |secs| std::time::Instant::now().checked_sub(Duration::from_secs(secs));
        // The first outage 65 s ago, subscribed again a second later, nothing heard since.
        client.stopped_since = ago(65);
        client.subscribed_again_at = ago(64);
        client.responses.pump.abort();
        let heard = publish_until_heard(&bus, &topics, &mut client).await;
        assert_eq!(
            (heard.id.as_str(), heard.response.content.as_str()),
            ("after", "back")
        );
        assert_eq!(client.listened_again(), 1);
    }

    /// A broker SIGKILLed under a client and started again 5 s later: the client hears what is
    /// published once the broker is back (the consumer reconnects, or the client subscribes again).
    #[tokio::test]
    async fn a_client_hears_responses_after_a_broker_outage() {
        let mut broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topics = crate::Topics::trustgraph("default", "default");
        let mut client = super::AgentClient::connect(&bus, &topics).await.unwrap();
        broker.stop();
        tokio::time::sleep(Duration::from_secs(5)).await;
        broker.restart().unwrap();
        let heard = publish_until_heard(&bus, &topics, &mut client).await;
        assert_eq!(
            (heard.id.as_str(), heard.response.content.as_str()),
            ("after", "back")
        );
    }

    /// A non-persistent topic's broker drops what a subscription has no permits for: a reader
    /// that looks away while 5,000 messages arrive must still get each (it got 1,501).
    #[tokio::test]
    async fn a_listener_that_reads_late_gets_a_whole_burst() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/burst-test";
        let mut late = Listener::subscribe(&bus, topic, "late").await.unwrap();
        publish(&bus, topic, 0..5_000).await;
        let got = drain(&mut late).await;
        let sent: Vec<String> = (0..5_000).map(|i| format!("m{i}")).collect();
        assert_eq!(got, sent);
    }

    /// What waits unread is dropped at once by `discard_waiting`, and what comes after is read.
    #[tokio::test]
    async fn a_listener_drops_what_waits_unread() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/discard-test";
        let mut listener = Listener::subscribe(&bus, topic, "discard").await.unwrap();
        publish(&bus, topic, 0..50).await;
        let mut discarded = 0;
        for _ in 0..100 {
            discarded += listener.discard_waiting();
            if discarded == 50 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(discarded, 50);
        assert_eq!(listener.bytes.load(std::sync::atomic::Ordering::Relaxed), 0);
        assert!(!listener.ended());
        publish_each(&bus, topic, ["after".to_owned()]).await;
        assert_eq!(listener.next_payload().await.unwrap(), b"after");
    }

    /// A process too busy to run its listener for a while (here: its runtime blocked while
    /// another publishes 5,000 messages) still gets each: the broker may send that many before
    /// the listener asks for more (it got 1,000).
    #[tokio::test]
    async fn a_listener_whose_process_stood_still_gets_a_whole_burst() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/still-test";
        let mut still = Listener::subscribe(&bus, topic, "still").await.unwrap();
        // Its first permits are asked for by a task of its own.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let url = broker.url();
        // Joined without yielding: nothing of this runtime runs while the other publishes.
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async {
                let bus = Bus::connect(&url, None).await.unwrap();
                publish(&bus, topic, 0..5_000).await;
            });
        })
        .join()
        .unwrap();
        let got = drain(&mut still).await;
        let sent: Vec<String> = (0..5_000).map(|i| format!("m{i}")).collect();
        assert_eq!(got.len(), sent.len());
        assert_eq!(got, sent);
    }

    /// The broker drops a non-persistent message, rather than queue it, for a consumer whose
    /// connection has more than a high-water mark of bytes waiting to be written to it (64 KiB by
    /// default; `scripts/pulsar-lite.toml` sets 16 MiB). Large messages sent side by side, as an
    /// orchestrator's steps send their graph messages, passed it now and then: each must arrive.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_messages_sent_side_by_side_all_arrive() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/side-by-side-test";
        let mut listener = Listener::subscribe(&bus, topic, "side").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let senders = Bus::connect(&broker.url(), None).await.unwrap();
        let padding = "x".repeat(16 * 1024);
        let mut sending = tokio::task::JoinSet::new();
        for sender in 0..16 {
            let (bus, padding) = (senders.clone(), padding.clone());
            sending.spawn(async move {
                let messages = (0..100).map(|i| format!("s{sender} m{i} {padding}"));
                publish_each(&bus, topic, messages).await
            });
        }
        sending.join_all().await;
        let got = drain(&mut listener).await;
        assert_eq!(got.len(), 1_600, "messages lost on the way");
    }

    /// Past its bound a listener drops (and says so) rather than grow without end, and goes on
    /// with what comes once its reader is back.
    #[tokio::test]
    async fn a_listener_holds_at_most_its_bound_and_goes_on() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/bound-test";
        // A message counts its payload ("m0".."m1999", 2-5 bytes) and 512 bytes more: about 100
        // fit in 52,000 bytes.
        let mut bounded = Listener::subscribe_holding(&bus, topic, "bounded", 52_000)
            .await
            .unwrap();
        publish(&bus, topic, 0..2_000).await;
        // Published messages may still be on their way to the pump.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let got = drain(&mut bounded).await;
        assert!(got.len() < 110, "held {} messages", got.len());
        assert_eq!(got.first().map(String::as_str), Some("m0"));
        publish(&bus, topic, 2_000..2_010).await;
        let after = drain(&mut bounded).await;
        let sent: Vec<String> = (2_000..2_010).map(|i| format!("m{i}")).collect();
        assert_eq!(after, sent);
    }

    /// Empty messages count against the bound too (each as 512 bytes and its metadata): a flood
    /// of them held nothing back before, counted as the zero bytes of their payloads.
    #[tokio::test]
    async fn a_listener_counts_empty_messages_against_its_bound() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/empty-bound-test";
        let mut bounded = Listener::subscribe_holding(&bus, topic, "bounded", 10 * 512)
            .await
            .unwrap();
        publish_each(&bus, topic, (0..200).map(|_| String::new())).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let got = drain(&mut bounded).await;
        // Fewer than ten: each counts its metadata (producer name, times...) besides the 512.
        assert!(
            (5..10).contains(&got.len()),
            "held {} empty messages",
            got.len()
        );
    }

    #[test]
    fn a_step_streamed_again_after_a_crash_gives_its_answer_once() {
        let mut answer = StreamedAnswer::default();
        // The first attempt was cut short; the second streams from the start.
        answer.push(Some("a1"), Some(0), "The capi");
        assert!(!answer.restreamed());
        answer.push(Some("a2"), Some(0), "The capital ");
        assert!(answer.restreamed());
        answer.push(Some("a2"), Some(1), "is Paris.");
        assert!(answer.restreamed());
        assert_eq!(answer.answer(Some("a2")), "The capital is Paris.");
        assert_eq!(answer.whole(Some("a2"), Some(2)), Some(true));
        // Joined as they came, it would hold the answer more than once.
        assert_eq!(answer.answer(None), "The capiThe capital is Paris.");
        assert_eq!(answer.latest(), Some(Some("a2")));
        // A copy running beside it may finish later but lose: the closing says which stands.
        assert!(!answer.interleaved());
        answer.push(Some("a1"), Some(1), "tal is Paris.");
        assert!(answer.interleaved());
        assert_eq!(answer.answer(Some("a1")), "The capital is Paris.");
        assert_eq!(answer.answer(Some("a3")), "");
        assert_eq!(
            answer.texts().collect::<Vec<_>>(),
            ["The capital is Paris.", "The capital is Paris."]
        );
    }

    #[test]
    fn an_answer_streamed_once_is_the_answer() {
        let mut answer = StreamedAnswer::default();
        // A service that names no attempt (TrustGraph's): every chunk as it came.
        answer.push(None, None, "Paris");
        answer.push(None, None, ".");
        assert!(!answer.restreamed());
        assert_eq!(answer.answer(None), "Paris.");
        // Nor does it count them: whether the text is whole cannot be told.
        assert_eq!(answer.whole(None, None), None);
        // An empty first chunk is not text to repeat.
        let mut answer = StreamedAnswer::default();
        answer.push(Some("a1"), None, "");
        assert!(!answer.restreamed());
        answer.push(Some("a2"), Some(0), "Paris.");
        assert!(!answer.restreamed());
        assert_eq!(answer.whole(Some("a2"), Some(1)), Some(true));
    }

    /// A chunk the broker dropped, wherever it was in the stream, shows as a hole.
    #[test]
    fn a_chunk_dropped_on_the_way_shows_in_the_count_or_the_places() {
        let chunks = ["The capi", "tal is ", "Paris."];
        let streamed = |kept: &[usize]| {
            let mut answer = StreamedAnswer::default();
            for &place in kept {
                answer.push(Some("a1"), Some(place as u64), chunks[place]);
            }
            answer.whole(Some("a1"), Some(chunks.len() as u64))
        };
        assert_eq!(streamed(&[0, 1, 2]), Some(true));
        // The first, one in the middle, the last, all of them.
        assert_eq!(streamed(&[1, 2]), Some(false));
        assert_eq!(streamed(&[0, 2]), Some(false));
        assert_eq!(streamed(&[0, 1]), Some(false));
        assert_eq!(streamed(&[]), Some(false));
        // Out of order is not the text either.
        assert_eq!(streamed(&[0, 2, 1]), Some(false));
        // A closing with nothing streamed, and none came.
        assert_eq!(
            StreamedAnswer::default().whole(Some("a1"), Some(0)),
            Some(true)
        );
        // Another attempt's chunks are not the closing's.
        let mut answer = StreamedAnswer::default();
        answer.push(Some("a1"), Some(0), "Paris.");
        assert_eq!(answer.whole(Some("a2"), Some(1)), Some(false));
    }

    /// A chunk delivered twice (a producer sending it again after a reconnection) is text once,
    /// and the answer is whole; a service that does not number its chunks keeps each as it came.
    #[test]
    fn a_chunk_delivered_twice_is_text_once() {
        let mut answer = StreamedAnswer::default();
        assert!(answer.push(Some("a1"), Some(0), "The capi"));
        assert!(answer.push(Some("a1"), Some(1), "tal is "));
        assert!(!answer.push(Some("a1"), Some(1), "tal is "));
        assert!(answer.push(Some("a1"), Some(2), "Paris."));
        assert_eq!(answer.answer(Some("a1")), "The capital is Paris.");
        assert_eq!(answer.whole(Some("a1"), Some(3)), Some(true));
        // The same place under another attempt is that attempt's text.
        assert!(answer.push(Some("a2"), Some(0), "Paris."));
        assert_eq!(answer.answer(Some("a2")), "Paris.");
        // A late copy of the first attempt's chunk mixes nothing into what was shown.
        assert!(!answer.push(Some("a1"), Some(0), "The capi"));
        assert!(!answer.interleaved());
        assert_eq!(answer.copies(), 2);
        // Unnumbered, a copy cannot be told from text.
        let mut theirs = StreamedAnswer::default();
        assert!(theirs.push(None, None, "Paris"));
        assert!(theirs.push(None, None, "Paris"));
        assert_eq!(theirs.answer(None), "ParisParis");
        assert_eq!(theirs.whole(None, None), None);
    }

    #[test]
    fn a_re_emitted_effect_is_dropped_once_seen() {
        let mut seen = SeenEffects::default();
        assert!(seen.first_time("s/journal/a#0"));
        assert!(seen.first_time("s/journal/a#1"));
        assert!(!seen.first_time("s/journal/a#0"));
        assert_eq!(seen.copies, 1);
    }

    #[test]
    fn the_window_forgets_the_oldest() {
        let mut seen = SeenEffects::default();
        for i in 0..=SeenEffects::WINDOW {
            assert!(seen.first_time(&i.to_string()));
        }
        assert_eq!(seen.ids.len(), SeenEffects::WINDOW);
        assert!(seen.first_time("0"));
    }
}
