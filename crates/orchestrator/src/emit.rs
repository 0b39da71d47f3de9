//! Everything an iteration publishes: responses to the client, the `next` request, provenance.
//! Streamed chunks go out at once (they are a view of the work in progress), unless nothing but
//! the step's commit follows them; everything durable (provenance, next requests, subagents, the
//! closing response) is held until [`DialogOutput::commit`], which journals it (see `journal`),
//! publishes it in order and waits for every receipt; only then may the iteration's input be
//! acked.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use agent_bus::{BusError, Properties, Publisher, Receipt};
pub use agent_core::supervisor::{legacy_subagent_seal_parts, subagent_seal_parts};
use agent_core::vocab::{tg, NamedNodeRef, PROVENANCE_GRAPH as GRAPH};
use agent_graph::model::NamedNode;
use agent_schema::{
    AgentRequest, AgentResponse, MessageType, Metadata, Triple, Triples, ANSWER_CHUNKS_PROPERTY,
    ANSWER_CHUNK_PROPERTY, ATTEMPT_PROPERTY, EFFECT_ID_PROPERTY, ID_PROPERTY,
};
use anyhow::Context as _;

use crate::journal::{self, Channel, Effect, Journal};

pub use agent_schema::{
    IN_TOKEN_PROPERTY, MODEL_PROPERTY, OUT_TOKEN_PROPERTY, RUN_TOKENS_PROPERTY, STARTED_PROPERTY,
};

/// Where a step's messages go.
#[derive(Clone)]
pub enum Outputs {
    /// The broker's topics: what the service runs with.
    Broker(Publishers),
    /// Kept in memory in the order they were sent, so pattern code is tested without a broker.
    Memory(MemorySink),
}

/// The three publishers of the orchestrator.
#[derive(Clone)]
pub struct Publishers {
    pub responses: Publisher,
    pub requests: Publisher,
    pub explainability: Publisher,
    /// Seals every explainability message as it goes out (a journal entry's re-emitted ones
    /// included): the aggregator writes the agent's records only from sealed ones.
    pub explain_seal: Option<std::sync::Arc<agent_bus::seal::SealKey>>,
}

/// One message as a [`MemorySink`] received it.
#[derive(Debug, Clone)]
pub struct Sent {
    pub channel: Channel,
    pub payload: Vec<u8>,
    pub properties: Properties,
}

/// The messages a step sent, when its outputs are [`Outputs::Memory`].
#[derive(Clone, Default)]
pub struct MemorySink {
    sent: Arc<Mutex<Vec<Sent>>>,
}

impl MemorySink {
    /// Everything sent so far, in order.
    pub fn sent(&self) -> Vec<Sent> {
        locked(&self.sent).clone()
    }

    /// The messages sent to `channel` that decode as `T`, in order.
    pub fn decoded<T: serde::de::DeserializeOwned>(&self, channel: Channel) -> Vec<T> {
        self.sent()
            .into_iter()
            .filter(|s| s.channel == channel)
            .filter_map(|s| serde_json::from_slice(&s.payload).ok())
            .collect()
    }
}

impl Outputs {
    /// The largest request the outputs take (the broker's limit; none in memory).
    fn max_request_bytes(&self) -> usize {
        match self {
            Outputs::Broker(p) => p.requests.max_message_bytes(),
            Outputs::Memory(_) => usize::MAX,
        }
    }

    /// Why the broker would refuse `effect`, if it would: over its topic's limit, with room kept
    /// for the seal an explainability message is given as it is sent ([`SEAL_PROPERTY_BYTES`]).
    fn refusal(&self, effect: &Effect) -> Option<BusError> {
        let Outputs::Broker(p) = self else {
            return None;
        };
        let (to, room) = match effect.channel {
            Channel::Responses => (&p.responses, 0),
            Channel::Requests => (&p.requests, 0),
            Channel::Explainability => (&p.explainability, SEAL_PROPERTY_BYTES),
        };
        let bytes =
            agent_bus::Publisher::message_bytes(effect.payload.as_bytes(), &effect.properties);
        let max = to.max_message_bytes();
        (bytes.saturating_add(room) > max).then(|| BusError::TooLarge {
            topic: to.topic().to_owned(),
            bytes,
            max,
            limit: agent_bus::BROKER_MESSAGE_LIMIT.to_owned(),
        })
    }

    fn requests_topic(&self) -> &str {
        match self {
            Outputs::Broker(p) => p.requests.topic(),
            Outputs::Memory(_) => "memory:requests",
        }
    }

    /// Hands a recorded effect over as it was recorded; its receipt comes back to be awaited.
    pub(crate) async fn publish_effect(
        &self,
        effect: &Effect,
    ) -> Result<Option<Receipt>, BusError> {
        self.enqueue(
            effect.channel,
            effect.payload.clone().into_bytes(),
            &effect.properties,
        )
        .await
    }

    /// Hands a message over; the broker's receipt comes back to be awaited.
    async fn enqueue(
        &self,
        channel: Channel,
        payload: Vec<u8>,
        properties: &Properties,
    ) -> Result<Option<Receipt>, BusError> {
        let to = match (self, channel) {
            (Outputs::Memory(sink), _) => {
                locked(&sink.sent).push(Sent {
                    channel,
                    payload,
                    properties: properties.clone(),
                });
                return Ok(None);
            }
            (Outputs::Broker(p), Channel::Responses) => &p.responses,
            (Outputs::Broker(p), Channel::Requests) => &p.requests,
            (Outputs::Broker(p), Channel::Explainability) => {
                let seal = agent_bus::seal::EXPLAIN_SEAL_PROPERTY;
                let mut properties = properties.clone();
                match &p.explain_seal {
                    Some(key) => properties.insert(seal.to_owned(), key.seal_explain(&payload)),
                    None => properties.remove(seal),
                };
                return p
                    .explainability
                    .enqueue(payload, &properties)
                    .await
                    .map(Some);
            }
        };
        to.enqueue(payload, properties).await.map(Some)
    }
}

/// The outputs bound to one dialog: its `id` property and collection.
pub struct DialogOutput<'a> {
    outputs: &'a Outputs,
    properties: Properties,
    collection: String,
    root: String,
    started_ms: u64,
    /// The run's root session URI: every node that records an LLM call's tokens is tagged with
    /// it, so the run's spend is one query.
    run: String,
    /// The run's tokens outside this dialog when it started (a subagent's supervisor and theirs).
    run_base: u64,
    /// The request's `conversation_id`: every node this dialog records is tagged with it.
    conversation: String,
    pending: Mutex<Vec<Receipt>>,
    /// Durable effects waiting for the commit.
    effects: Mutex<HeldEffects>,
    /// The journal entries the held requests will be taken up as (told to the journal's owner
    /// with the record, which then answers their lookups without a read).
    next_steps: Mutex<Vec<String>>,
    /// Whether the step is journaled: only then are `next_steps` told to anyone.
    journaled: bool,
    /// Whether the step is given up (see [`DialogOutput::giving_up`]).
    given_up: bool,
    /// How the dialog ended in this step (`answer` or `error`), if it did: for the metrics.
    ended: Mutex<Option<&'static str>>,
    /// Set when its closing answers a request refused without ending any dialog (see
    /// [`DialogOutput::respond_ending_nothing`]).
    ends_nothing: std::sync::atomic::AtomicBool,
    /// Set when the step met an outage it is to wait out: nothing it held is committed.
    parked: Mutex<Option<Park>>,
    /// How many chunks of answer text went to the client (see [`ANSWER_CHUNK_PROPERTY`]): a step
    /// that streamed some cannot run again without repeating it, so it does not park.
    answer_chunks: std::sync::atomic::AtomicU64,
    /// The largest request this dialog may queue, and which limit that is.
    request_limit: (usize, &'static str),
    /// The history of the message being handled: a journaled request that continues it keeps
    /// only its new steps.
    input_history: Vec<agent_schema::AgentStep>,
    /// Whether this step starts subagents: their fan-out node must be on the broker before them.
    spawned: std::sync::atomic::AtomicBool,
    /// The step the handled message is the input of.
    input_step: usize,
    /// Triples for the graph only (inputs, LLM calls, fork records), written in one message with
    /// the step's commit.
    kept: Mutex<Vec<Triple>>,
    /// Where provenance's long texts go instead of the graph, when that is TrustGraph's librarian.
    librarian: Option<&'a crate::documents::DocumentStore>,
    /// Provenance's long texts to keep in the librarian before the step commits, by document.
    to_keep: Mutex<std::collections::BTreeMap<String, String>>,
    /// Whether the dialog is a subagent's: its answer is a result for its supervisor, never an
    /// `answer` message to the client (see [`DialogOutput::chunk`]).
    subagent: bool,
    /// The model this dialog's LLM calls ask for, when it is not the orchestrator's: carried on
    /// to every next request of the dialog.
    model: Option<String>,
    /// This delivery's attempt at the step: on its streamed chunks and its closing (see
    /// [`ATTEMPT_PROPERTY`]), and the attempt its journal record names.
    attempt: String,
    /// The chain this step may continue in this process (see [`CHAIN_PROPERTY`]), when it may.
    chain: Option<String>,
    /// The next step to run here, once the commit held back its request (see [`Continuation`]).
    continuation: Mutex<Option<Continuation>>,
    /// This process stopping: a copy of a step waiting for its recorder (see
    /// [`DialogOutput::settle`]) then hands its message back.
    stopping: tokio_util::sync::CancellationToken,
    /// Seals the dialog's next requests (see [`agent_bus::seal::STEP_SEAL_PROPERTY`]).
    step_seal: Option<agent_bus::seal::SealKey>,
}

/// The property naming the chain a request belongs to: the broker message (the chain's root)
/// whose delivery carries the steps one process ran one after another without putting their
/// requests on the broker. A step recorded by any delivery of a chain is that delivery's own for
/// [`Recorder::Unknown`]: the root's redelivery re-emits the chain's steps at once, one hop each,
/// instead of waiting out [`journal::PUBLISH_LEASE`] at each.
pub const CHAIN_PROPERTY: &str = "agent-chain";

/// A journaled step whose next request was recorded but not published: the process runs that
/// request itself, while the delivery it took stays unacked. Its other messages were sent; their
/// receipts are awaited before that delivery is acked.
pub struct Continuation {
    /// The next request, as it would have been published (its effect id and chain included).
    pub request: Effect,
    /// Receipts of the step's other messages.
    pub receipts: Vec<Receipt>,
    /// The step's entry: marked published once the chain's messages are all on the broker.
    pub node: NamedNode,
    pub journal: Journal,
    /// The chain, held (named in this process's beats) from before the step was recorded.
    pub held: crate::chains::Holding,
}

impl std::fmt::Debug for Continuation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Continuation")
            .field("node", &self.node.as_str())
            .finish_non_exhaustive()
    }
}

/// A step's explained nodes and graph-only records join its shared graph message only while it
/// stays smaller than this: two large texts (a long observation, a request near its limit) never
/// share one message.
const MERGE_BELOW_BYTES: usize = 256 * 1024;

/// The largest chunk [`DialogOutput::chunk_with_outcome`] holds for the commit.
const HELD_CHUNK_BYTES: usize = 64 * 1024;

/// A step's durable effects, in the order they will be published.
#[derive(Default)]
struct HeldEffects {
    /// Chunks held for the commit (see [`DialogOutput::chunk_with_outcome`]): published before
    /// `list`, where they would have been had they gone out at once.
    chunks: Vec<Effect>,
    list: Vec<Effect>,
    /// The graph message the step's next explained node joins (see
    /// [`DialogOutput::hold_graph`]), by its place in `list`.
    graph_to_join: Option<usize>,
}

impl HeldEffects {
    /// Holds a message at the end of the list.
    fn push(&mut self, channel: Channel, payload: Vec<u8>, properties: Properties) {
        self.list.push(Effect::held(channel, payload, properties));
    }

    /// Everything held, in the order it is published.
    fn into_list(self) -> Vec<Effect> {
        let mut all = self.chunks;
        all.extend(self.list);
        all
    }
}

impl Effect {
    fn held(channel: Channel, payload: Vec<u8>, properties: Properties) -> Effect {
        let payload = String::from_utf8(payload)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        Effect {
            channel,
            payload,
            properties,
            history_from_input: None,
        }
    }
}

/// Why a step set itself aside to be tried again: an outage of something it needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Park {
    /// What failed, as the error the dialog ends with if the outage outlasts its window.
    pub cause: String,
    /// How long the failing service asked callers to wait, if it said.
    pub retry_after: Option<std::time::Duration>,
}

/// How a step's effects go to the broker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// Requests only once everything before them has its receipt.
    RequestsLast,
    /// All sent at once in order, every receipt awaited at the end.
    Pipelined,
    /// All sent at once in order, the receipts left pending for whoever takes them (a chain
    /// awaits its steps' receipts before its root is acked).
    Unawaited,
}

/// Who recorded a journal entry that a delivery finds in its way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorder {
    /// Found before any work: if it was this very delivery (same broker message id), the process
    /// that recorded it has died (the message came back), so its outcome can go out at once.
    Unknown,
    /// Recorded while this delivery was working: a copy that is alive, whatever its message id.
    LiveCopy,
}

/// Where a step's outcome is journaled: the entry node and the delivery it is for.
pub struct JournalSlot<'a> {
    pub journal: &'a Journal,
    pub node: NamedNode,
    pub delivery: String,
    /// The session URI of the dialog the step belongs to.
    pub session: String,
}

/// A copy of a step was waiting for its recorder (a live copy, a chain) when this process began
/// to stop: its message goes back to the broker rather than hold the stop up to the drain's end.
#[derive(Debug, thiserror::Error)]
#[error("this process is stopping while the step {entry} waits for the delivery that recorded it; handing it back")]
pub struct StoppedWaiting {
    pub entry: String,
}

/// Whether the chain that recorded `entry`, if one did, may still be running (see `chains`):
/// recorded just now, or its process still beats.
async fn chain_running(
    slot: &JournalSlot<'_>,
    entry: &journal::Entry,
    seen: std::time::Instant,
) -> Result<bool, agent_graph::GraphError> {
    let Some(root) = entry.chain() else {
        return Ok(false);
    };
    if !entry.older_than(crate::chains::FIRST_BEAT_GRACE, seen) {
        return Ok(true);
    }
    slot.journal
        .chain_held(&crate::chains::key(&slot.session, root))
        .await
}

impl<'a> DialogOutput<'a> {
    pub fn new(
        outputs: &'a Outputs,
        id: Option<&str>,
        collection: &str,
        root: &str,
        started_ms: u64,
    ) -> Self {
        let mut properties = Properties::new();
        if let Some(id) = id {
            properties.insert(ID_PROPERTY.to_owned(), id.to_owned());
        }
        DialogOutput {
            outputs,
            properties,
            collection: collection.to_owned(),
            root: root.to_owned(),
            started_ms,
            run: root.to_owned(),
            run_base: 0,
            conversation: String::new(),
            pending: Mutex::new(Vec::new()),
            effects: Mutex::new(HeldEffects::default()),
            next_steps: Mutex::new(Vec::new()),
            journaled: false,
            given_up: false,
            ended: Mutex::new(None),
            ends_nothing: std::sync::atomic::AtomicBool::new(false),
            parked: Mutex::new(None),
            answer_chunks: std::sync::atomic::AtomicU64::new(0),
            request_limit: (outputs.max_request_bytes(), agent_bus::BROKER_MESSAGE_LIMIT),
            input_history: Vec::new(),
            spawned: std::sync::atomic::AtomicBool::new(false),
            input_step: 1,
            kept: Mutex::new(Vec::new()),
            librarian: None,
            to_keep: Mutex::default(),
            subagent: false,
            model: None,
            attempt: uuid::Uuid::new_v4().simple().to_string(),
            chain: None,
            continuation: Mutex::new(None),
            stopping: tokio_util::sync::CancellationToken::new(),
            step_seal: None,
        }
    }

    /// Hands back the message of a step that is waiting for its recorder once `stopping` is
    /// cancelled (see [`DialogOutput::settle`]).
    pub fn stopping_on(mut self, stopping: &tokio_util::sync::CancellationToken) -> Self {
        self.stopping = stopping.clone();
        self
    }

    /// Lets this step continue the dialog in this process, as part of `chain` (see
    /// [`CHAIN_PROPERTY`]), when its only durable request is the dialog's next step.
    pub fn continuing_in(mut self, chain: Option<String>) -> Self {
        self.chain = chain;
        self
    }

    /// The next step to run in this process, if the commit held its request back.
    pub fn take_continuation(&self) -> Option<Continuation> {
        locked(&self.continuation).take()
    }

    /// Keeps provenance's long texts in `documents` instead of the graph when it is the
    /// librarian: a document's literal becomes its excerpt with the reference (as in messages),
    /// and the whole text is kept before the step commits.
    pub fn keeping_documents_in(
        mut self,
        documents: Option<&'a crate::documents::DocumentStore>,
    ) -> Self {
        self.librarian = documents.filter(|d| d.librarian().is_some());
        self
    }

    /// Whether `text`, a document's, goes to the librarian: long texts do when documents are
    /// kept there, unless already an excerpt, or too long for the librarian's message (its bytes
    /// go in base64), which stays whole in the graph, as without the librarian.
    fn goes_to_librarian(&self, text: &str) -> bool {
        agent_core::documents::wants_check_in(text)
            && self
                .librarian
                .and_then(|documents| documents.librarian())
                .is_some_and(|librarian| librarian.takes(text))
    }

    /// `text` as the graph will hold it when it is a document's: its excerpt with the reference
    /// when it goes to the librarian. What seals a recorded text must seal this form, which still
    /// binds the whole (the reference is the text's digest).
    pub fn as_recorded<'t>(&self, text: &'t str) -> std::borrow::Cow<'t, str> {
        use agent_core::documents::{document_uri, excerpt_with_reference};
        if self.goes_to_librarian(text) {
            std::borrow::Cow::Owned(excerpt_with_reference(text, &document_uri(text)))
        } else {
            std::borrow::Cow::Borrowed(text)
        }
    }

    /// Claim-check of the documents among `triples` (see [`DialogOutput::keeping_documents_in`]).
    fn check_in_documents(&self, triples: &mut [Triple]) {
        if self.librarian.is_none() {
            return;
        }
        for t in triples.iter_mut() {
            let document = t.g.as_deref() == Some(agent_core::vocab::DOCUMENTS_GRAPH)
                && t.p.iri == tg::CONTENT.as_str()
                && t.o.kind == "l"
                && self.goes_to_librarian(&t.o.value);
            if document {
                let text = std::mem::take(&mut t.o.value);
                t.o.value = agent_core::documents::excerpt_with_reference(&text, &t.s.iri);
                locked(&self.to_keep).insert(t.s.iri.clone(), text);
            }
        }
    }

    /// Keeps the documents provenance names in the librarian, before anything names them.
    async fn keep_documents(&self) -> anyhow::Result<()> {
        let Some(documents) = self.librarian else {
            return Ok(());
        };
        let texts = std::mem::take(&mut *locked(&self.to_keep));
        let kept =
            futures::future::join_all(texts.iter().map(|(uri, text)| documents.keep(uri, text)))
                .await;
        for (result, uri) in kept.into_iter().zip(texts.keys()) {
            // The error keeps its kind: a librarian that does not answer parks the step.
            result.with_context(|| format!("keeping the document {uri} in the librarian"))?;
        }
        Ok(())
    }

    /// Set up for a step of `request`: its run (and what the run spent outside this dialog), its
    /// conversation, the history it was given, and the largest request the broker takes.
    pub fn for_step(
        mut self,
        request: &agent_schema::AgentRequest,
        run: &str,
        run_base: u64,
        max_message_bytes: usize,
    ) -> Self {
        self.set_run(run, run_base);
        self.set_conversation(&request.conversation_id);
        self.set_input_history(&request.history);
        self.limit_requests(max_message_bytes);
        self.subagent = agent_core::supervisor::is_subagent(request);
        self
    }

    /// The history of the message this step handles: what a next request it queues continues
    /// (recorded, and journaled, as only its new steps).
    fn set_input_history(&mut self, history: &[agent_schema::AgentStep]) {
        self.input_history = history.to_vec();
        self.input_step = agent_core::documents::steps_taken(history) + 1;
    }

    /// Marks the step as journaled, so its next steps are named to the journal's owner.
    pub fn journaled(mut self, journaled: bool) -> Self {
        self.journaled = journaled;
        self
    }

    /// Marks the step as given up (its dialog ends with an error). Its outcome is recorded like
    /// any other, so that no copy of the step still running elsewhere (a redelivery after a
    /// broker restart, say) can answer after the error, nor the error follow its answer: the
    /// first record stands, and the other copy settles from it. But when the journal does not
    /// take the record (the store may be what is down), its commit publishes the error
    /// unrecorded, as before there was a journal: a dialog that cannot go on must still end.
    pub fn giving_up(mut self, given_up: bool) -> Self {
        self.given_up = given_up;
        self
    }

    /// Whether the step is given up ([`DialogOutput::giving_up`]).
    pub fn is_given_up(&self) -> bool {
        self.given_up
    }

    /// Seals the dialog's next requests with `key`: a subagent's later step is taken only sealed.
    pub fn sealing_steps_with(mut self, key: Option<&agent_bus::seal::SealKey>) -> Self {
        self.step_seal = key.cloned();
        self
    }

    /// What the requests the aggregator sends for this step's fan-out (its synthesis, the
    /// subagents it starts) carry on from it: a replay's reuse and the model this dialog asks for.
    pub fn carried_on(&self) -> Properties {
        let mut carried: Properties = [
            agent_schema::REUSE_PROPERTY,
            agent_schema::REUSE_FROM_PROPERTY,
        ]
        .into_iter()
        .filter_map(|key| Some((key.to_owned(), self.properties.get(key)?.clone())))
        .collect();
        if let Some(model) = &self.model {
            carried.insert(MODEL_PROPERTY.to_owned(), model.clone());
        }
        // A subagent's run spent this much outside its dialog: its next steps carry it (see
        // `emit`), the one the aggregator sends included, or a nested supervisor without a
        // shared store to count its run from would count only its own tokens after its fan-in.
        if self.run_base > 0 {
            carried.insert(RUN_TOKENS_PROPERTY.to_owned(), self.run_base.to_string());
        }
        carried
    }

    /// The model this dialog asks for (see [`agent_schema::MODEL_PROPERTY`]), carried to its next
    /// requests.
    pub fn with_model(mut self, model: Option<&str>) -> Self {
        self.model = model.map(str::to_owned);
        self
    }

    /// Holds `triples` for the graph only, written with the step's commit (and dropped with the
    /// step, should it be abandoned or parked).
    pub fn keep(&self, mut triples: Vec<Triple>) {
        self.check_in_documents(&mut triples);
        locked(&self.kept).extend(triples);
    }

    /// Adds the kept triples to the graph message the step's nodes share (a message and a store
    /// transaction fewer per step than one of their own), or sends them alone if it has none.
    fn add_kept(&self, held: &mut HeldEffects) {
        let kept = std::mem::take(&mut *locked(&self.kept));
        if kept.is_empty() {
            return;
        }
        let shared = held.graph_to_join.and_then(|i| held.list.get_mut(i));
        if let Some(effect) = shared.filter(|e| e.payload.len() < MERGE_BELOW_BYTES) {
            if let Some(merged) = agent_schema::append_triples(&effect.payload, &kept) {
                effect.payload = merged;
                return;
            }
        }
        let message = self.triples_about(&self.root, kept);
        held.push(
            Channel::Explainability,
            agent_schema::encode(&message),
            Properties::new(),
        );
    }

    /// Bounds the requests this dialog queues by `max_message_bytes` (the config's), or by the
    /// broker's limit when that is smaller: a dialog whose history outgrows it ends now with an
    /// error naming the limit, instead of queuing a message that would be refused later (or that
    /// the broker would not take at all).
    fn limit_requests(&mut self, max_message_bytes: usize) {
        if max_message_bytes <= self.request_limit.0 {
            self.request_limit = (max_message_bytes, "max_message_bytes");
        }
    }

    /// Refuses a request over the limit before it is held, keeping room for the properties its
    /// commit adds after this check ([`COMMIT_PROPERTY_BYTES`]).
    fn within_limit(&self, payload: &[u8], properties: &Properties) -> Result<(), BusError> {
        let bytes = agent_bus::Publisher::message_bytes(payload, properties)
            .saturating_add(COMMIT_PROPERTY_BYTES);
        let (max, limit) = self.request_limit;
        if bytes > max {
            return Err(BusError::TooLarge {
                topic: self.outputs.requests_topic().to_owned(),
                bytes,
                max,
                limit: format!("{limit}: the dialog's history has outgrown it"),
            });
        }
        Ok(())
    }

    /// Sets the step aside: its held effects will not be committed, and the step is tried again
    /// later. The first cause is kept.
    pub fn park(&self, park: Park) {
        locked(&self.parked).get_or_insert(park);
    }

    /// Forgets what an abandoned step held (a cancel overtook it): its effects (the chunks held
    /// with them too), its park and how it ended. Chunks it streamed are out already and stay out.
    pub fn discard(&self) {
        *locked(&self.effects) = HeldEffects::default();
        locked(&self.kept).clear();
        locked(&self.to_keep).clear();
        *locked(&self.parked) = None;
        *locked(&self.ended) = None;
        self.spawned
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether answer text of this step already went to the client, or is held to go with its
    /// commit (a step that parked would drop it: it errs towards ending the dialog).
    pub fn answer_streamed(&self) -> bool {
        self.answer_chunks.load(std::sync::atomic::Ordering::SeqCst) > 0
    }

    /// Why the step set itself aside, if it did.
    pub fn parked(&self) -> Option<Park> {
        locked(&self.parked).clone()
    }

    /// The run this dialog belongs to (its root session URI) and the run's tokens outside it.
    fn set_run(&mut self, run: &str, run_base: u64) {
        run.clone_into(&mut self.run);
        self.run_base = run_base;
    }

    /// The conversation the dialog belongs to (`conversation_id`; empty for none).
    fn set_conversation(&mut self, conversation: &str) {
        conversation.clone_into(&mut self.conversation);
    }

    /// A property every message of this step carries from now on.
    pub fn set_property(&mut self, key: &str, value: String) {
        self.properties.insert(key.to_owned(), value);
    }

    /// How the dialog ended in this step, if it did.
    pub fn ended(&self) -> Option<&'static str> {
        *locked(&self.ended)
    }

    /// Holds a durable effect for the commit.
    fn hold(&self, channel: Channel, payload: Vec<u8>, properties: &Properties) {
        locked(&self.effects).push(channel, payload, properties.clone());
    }

    /// Holds `message` for the graph. The nodes a step explains share one graph message, held
    /// where the first of them was, so it still precedes every node's `explain` copy to the
    /// client: a step's nodes go to the broker, through the aggregator and into the store as one
    /// message instead of one each. A fan-out or a completion keeps a message of its own, since
    /// the aggregator reads the correlation id it answers to from the message
    /// ([`agent_core::provenance::drives_fan_in`]). A node that would take the shared message to
    /// [`MERGE_BELOW_BYTES`] goes alone, and the step's later nodes join it instead.
    fn hold_graph(&self, message: &Triples, properties: &Properties) {
        let mut held = locked(&self.effects);
        let alone = agent_core::provenance::drives_fan_in(&message.triples);
        if !alone {
            let shared = held.graph_to_join.and_then(|i| held.list.get_mut(i));
            if let Some(shared) = shared {
                let joined = agent_schema::append_triples_below(
                    &shared.payload,
                    &message.triples,
                    MERGE_BELOW_BYTES,
                );
                if let Some(joined) = joined {
                    shared.payload = joined;
                    return;
                }
            }
        }
        if !alone {
            held.graph_to_join = Some(held.list.len());
        }
        held.push(
            Channel::Explainability,
            agent_schema::encode(message),
            properties.clone(),
        );
    }

    /// Journals the held effects (when there is a journal), publishes them unless another delivery
    /// of the same message recorded its outcome first, and marks them published. A record the
    /// journal does not take fails the commit (the step is settled as an outage), unless the
    /// step is given up ([`DialogOutput::giving_up`]).
    // One function, not a wrapper per case: in a debug build each layer of a step's futures adds
    // a frame to a worker's stack, which a step with the librarian's calls overflowed.
    pub async fn commit(&self, mut slot: Option<&JournalSlot<'_>>) -> anyhow::Result<()> {
        self.keep_documents().await?;
        let mut staged = std::mem::take(&mut *locked(&self.effects));
        if let (Some(slot), true) = (slot, locked(&self.ended).is_some()) {
            // The closing travels on a non-persistent topic, which a broker may drop for a
            // reader that falls behind; this link lets such a client read it back from the
            // journal (see `journal::recorded_closing`).
            locked(&self.kept).push(Triple {
                s: agent_schema::Term::iri(&slot.session),
                p: agent_schema::Term::iri(tg::CLOSING_ENTRY.as_str()),
                o: agent_schema::Term::iri(slot.node.as_str()),
                g: Some(GRAPH.to_owned()),
            });
        }
        self.add_kept(&mut staged);
        let mut effects = staged.into_list();
        let mut continuing = None;
        let mut held = None;
        let mut outcome = None;
        if let Some(slot) = slot {
            // A crash between publishing and marking re-emits these same messages; their ids let
            // consumers (the client, the journal) tell the copy from a new message.
            for (i, effect) in effects.iter_mut().enumerate() {
                effect.properties.insert(
                    EFFECT_ID_PROPERTY.to_owned(),
                    format!("{}#{i}", slot.node.as_str()),
                );
            }
            continuing = self.continues_with(&effects);
            if let (Some(i), Some(chain)) = (continuing, &self.chain) {
                // Recorded with the request, so that its re-emission belongs to the chain too.
                effects[i]
                    .properties
                    .insert(CHAIN_PROPERTY.to_owned(), chain.clone());
                // Held before the record: a copy that finds it must find the chain held too,
                // however long the rest of this commit takes (a broker reconnecting).
                held = Some(
                    slot.journal
                        .chains()
                        .hold(crate::chains::key(&slot.session, chain)),
                );
            }
            // Encoded while the streamed messages' receipts are on their way.
            let journaled = effects
                .iter()
                .map(|e| e.compacted(&self.input_history))
                .collect();
            outcome = Some(journal::Outcome::encode(journaled)?);
        }
        // A message the broker would refuse fails the step here, before its outcome is recorded:
        // recorded, it was refused at every re-emission, the step's give-up found the entry and
        // re-emitted it again, and the client never got a closing (an answer of the LLM's longer
        // than the broker's limit). Refused now, nothing is sent and the give-up ends the dialog
        // with the error.
        if let Some(refused) = effects.iter().find_map(|e| self.outputs.refusal(e)) {
            return Err(refused.into());
        }
        // The streamed chunks are not journaled: they must be on the broker before the outcome is
        // recorded, or a crash after recording would re-emit a closing message without its text.
        self.flush().await?;
        let mut published_unrecorded = false;
        if let (Some(slot), Some(outcome)) = (slot, outcome) {
            let attempt = self.attempt.clone();
            let next = std::mem::take(&mut *locked(&self.next_steps));
            // Its conversation's next dialog may be asked for on the closing, before the graph
            // shows the conclusion: the journal's owner answers for it meanwhile.
            let ends = (locked(&self.ended).is_some()
                && !self.ends_nothing.load(std::sync::atomic::Ordering::SeqCst)
                && !self.conversation.is_empty()
                && !self.subagent)
                .then(|| agent_core::vocab::session_id_of(&slot.session))
                .flatten()
                .map(str::to_owned);
            let recorded = slot
                .journal
                .record(&slot.node, outcome, &slot.delivery, &attempt, next, ends)
                .await;
            let standing = match recorded {
                Ok(standing) => Some(standing),
                // An entry another build recorded (which this one cannot read) is an outcome
                // that stands: a give-up must not publish beside it, but hand its message back.
                Err(e) if self.given_up && !e.is::<journal::UnreadableEntry>() => {
                    tracing::warn!(entry = %slot.node.as_str(), error = %e, "the journal did not take this given-up step's outcome; publishing it unrecorded");
                    None
                }
                Err(e) => return Err(e),
            };
            match standing {
                Some(standing) if standing.attempt != attempt => {
                    // A live copy of this message (a redelivery overlapping a slow first delivery,
                    // or a broker handing one message to two consumers) got there first. Acking
                    // now would be wrong if that copy dies before publishing and its message is
                    // this one.
                    tracing::info!(entry = %slot.node.as_str(), "another delivery recorded this step first; settling its outcome");
                    return self.settle(slot, standing, Recorder::LiveCopy).await;
                }
                Some(_) => {}
                None => published_unrecorded = true,
            }
        }
        if published_unrecorded {
            // Published as a step without a journal: no chain, no mark.
            slot = None;
            held = None;
        }
        let commit = fault::next_commit();
        fault::crash_if(fault::Stage::Recorded, commit);
        if let (Some(slot), Some(i), Some(held)) = (slot, continuing, held) {
            // The next step runs here: its request stays off the broker (the entry holds it, for
            // a redelivery of this chain's root to re-emit), and nothing waits for the receipts
            // of the rest, which the chain awaits before its root is acked.
            let request = effects.remove(i);
            self.publish_in(&effects, Order::Unawaited).await?;
            fault::crash_if(fault::Stage::Published, commit);
            // Nothing is marked yet (the chain marks its steps once it ends): a crash here is
            // this commit's last point, as before the mark of a step that did not continue.
            fault::crash_if(fault::Stage::Marked, commit);
            *locked(&self.continuation) = Some(Continuation {
                request,
                receipts: std::mem::take(&mut *locked(&self.pending)),
                node: slot.node.clone(),
                journal: slot.journal.clone(),
                held,
            });
            return Ok(());
        }
        // A journaled step's effects go out in one stream: if it dies halfway, the redelivered
        // message re-emits them all from the journal, so its next request need not wait for the
        // receipts of its provenance. Subagents still wait for their fan-out's node.
        let order = if slot.is_some() && !self.spawned.load(std::sync::atomic::Ordering::SeqCst) {
            Order::Pipelined
        } else {
            Order::RequestsLast
        };
        self.publish_in(&effects, order).await?;
        fault::crash_if(fault::Stage::Published, commit);
        if let Some(slot) = slot {
            mark_published_aside(slot.journal.clone(), slot.node.clone());
        }
        fault::crash_if(fault::Stage::Marked, commit);
        Ok(())
    }

    /// The index of the request this step's dialog continues with, when the step may run it here:
    /// a chain was offered, the dialog goes on, and its only request is its own next step (not
    /// subagents, whose fan-out must be on the broker before them).
    fn continues_with(&self, effects: &[Effect]) -> Option<usize> {
        self.chain.as_ref()?;
        if locked(&self.ended).is_some() || self.spawned.load(std::sync::atomic::Ordering::SeqCst) {
            return None;
        }
        let mut requests = effects
            .iter()
            .enumerate()
            .filter(|(_, e)| e.channel == Channel::Requests);
        match (requests.next(), requests.next()) {
            (Some((i, _)), None) => Some(i),
            _ => None,
        }
    }

    /// Settles a step whose outcome is already journaled: done once the entry is published;
    /// published from the journal when this delivery recorded it before a crash, or when the
    /// recorder had time enough ([`journal::PUBLISH_LEASE`]) and still has not. Waiting here rather
    /// than nacking keeps the redelivery count, and with it the dead-letter bound, out of it,
    /// unless this process stops while it waits: the message is then handed back (a nack, which
    /// counts), as a stop hands back a parked step.
    pub async fn settle(
        &self,
        slot: &JournalSlot<'_>,
        mut entry: journal::Entry,
        recorder: Recorder,
    ) -> anyhow::Result<()> {
        let node = slot.node.as_str();
        let mut told_waiting = false;
        let seen = std::time::Instant::now();
        loop {
            if entry.published {
                tracing::info!(entry = %node, "this step's outcome is already published; dropping the message");
                return Ok(());
            }
            // A chain publishes its steps only when it ends: while it runs (beats), a copy of
            // one of its steps waits, whoever's it is, or the rest of the dialog would run twice.
            let running = chain_running(slot, &entry, seen).await?;
            if running && !told_waiting {
                told_waiting = true;
                crate::events::CopyWaitsForChain { entry: node }.emit();
            }
            let ours = recorder == Recorder::Unknown && entry.delivery == slot.delivery;
            if !running && (ours || entry.lease_expired(seen)) {
                tracing::info!(entry = %node, "re-emitting this step's recorded outcome");
                let mut effects = entry
                    .effects
                    .iter()
                    .map(|e| e.expanded(&self.input_history))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| anyhow::anyhow!("the journal entry {node}: {e}"))?;
                self.seal_again(&mut effects);
                self.publish(&effects).await?;
                mark_published_aside(slot.journal.clone(), slot.node.clone());
                return Ok(());
            }
            tokio::select! {
                // Nothing here is this process's to finish: another replica takes it up.
                _ = self.stopping.cancelled() => return Err(StoppedWaiting { entry: node.to_owned() }.into()),
                _ = tokio::time::sleep(std::time::Duration::from_millis(250)) => {}
            }
            match slot.journal.entry(&slot.node).await? {
                Some(now) => entry = now,
                None => anyhow::bail!("the journal entry {node} went away"),
            }
        }
    }

    /// Publishes effects in order and waits for them. What a request will act on is on the broker
    /// before the request is (a fan-out's node before its subagents, an iteration's provenance
    /// before the next iteration).
    pub async fn publish(&self, effects: &[Effect]) -> Result<(), BusError> {
        self.publish_in(effects, Order::RequestsLast).await
    }

    async fn publish_in(&self, effects: &[Effect], order: Order) -> Result<(), BusError> {
        for effect in effects {
            if effect.channel == Channel::Requests && order == Order::RequestsLast {
                self.flush().await?;
            }
            if let Some(receipt) = self.outputs.publish_effect(effect).await? {
                locked(&self.pending).push(receipt);
            }
        }
        if order == Order::Unawaited {
            return Ok(());
        }
        self.flush().await
    }

    async fn send(
        &self,
        to: Channel,
        payload: Vec<u8>,
        properties: &Properties,
    ) -> Result<(), BusError> {
        if let Some(receipt) = self.outputs.enqueue(to, payload, properties).await? {
            locked(&self.pending).push(receipt);
        }
        Ok(())
    }

    /// Waits until the broker has every message sent so far.
    pub async fn flush(&self) -> Result<(), BusError> {
        let receipts = std::mem::take(&mut *locked(&self.pending));
        for receipt in receipts {
            receipt.wait().await?;
        }
        Ok(())
    }

    /// A closing error for a request refused without ending the dialog it names, which may run
    /// (a new dialog refused, or a step of a session that is not this service's to end): the
    /// journal's owner is not told that dialog ended.
    pub fn respond_ending_nothing(&self, response: &AgentResponse) -> Result<(), BusError> {
        self.ends_nothing
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.respond(response)
    }

    /// A durable response: the closing answer or an error.
    pub fn respond(&self, response: &AgentResponse) -> Result<(), BusError> {
        let properties = if response.end_of_dialog {
            *locked(&self.ended) = Some(if response.error.is_some() {
                "error"
            } else {
                "answer"
            });
            // Names whose streamed text is the answer: this attempt's, the one that commits it,
            // and how many chunks of it there were.
            let mut properties = self.attempted();
            if response.error.is_none() {
                let chunks = self.answer_chunks.load(std::sync::atomic::Ordering::SeqCst);
                properties.insert(ANSWER_CHUNKS_PROPERTY.to_owned(), chunks.to_string());
            }
            properties
        } else {
            self.properties.clone()
        };
        self.hold(
            Channel::Responses,
            agent_schema::encode(response),
            &properties,
        );
        Ok(())
    }

    /// Sends a chunk of a message now. A subagent's answer text is not sent: a client takes every
    /// `answer` chunk as part of its dialog's answer (TrustGraph's client joins them), and the
    /// subagent's answer reaches it whole as the observation of its completion. Its thoughts
    /// stream under its own `message_id`s, so a client can tell the branches apart.
    pub async fn chunk(
        &self,
        kind: MessageType,
        content: &str,
        message_id: &str,
        end_of_message: bool,
    ) -> Result<(), BusError> {
        self.send_held_chunks().await?;
        for (payload, properties) in self.chunk_messages(kind, content, message_id, end_of_message)
        {
            self.send(Channel::Responses, payload, &properties).await?;
        }
        Ok(())
    }

    /// A chunk after which the step waits on nothing but its commit (an observation, the thought
    /// before a final answer or a fan-out, an answer sent whole, a subagent's result): held and
    /// journaled with the step's outcome, ahead of everything else it holds, instead of sent now.
    /// Sent now, the commit would wait for its receipt before recording the outcome (a chunk that
    /// is not journaled must be on the broker first, or a crash after the record would leave it
    /// out for good), about half a broker round trip on every such step. Journaled, a crash after
    /// the record re-emits it with the rest (under the same effect id). The client gets it once
    /// the outcome is recorded, and not while the journal's store is out of reach (the step
    /// parks). A chunk over [`HELD_CHUNK_BYTES`] is sent now (after the chunks held before it),
    /// so the journal carries at most that much text of a chunk; with a librarian, which keeps
    /// texts over 4 KiB out of the graph as documents, that is text the journal did not carry.
    pub async fn chunk_with_outcome(
        &self,
        kind: MessageType,
        content: &str,
        message_id: &str,
        end_of_message: bool,
    ) -> Result<(), BusError> {
        for (payload, properties) in self.chunk_messages(kind, content, message_id, end_of_message)
        {
            if payload.len() > HELD_CHUNK_BYTES {
                self.send_held_chunks().await?;
                self.send(Channel::Responses, payload, &properties).await?;
            } else {
                locked(&self.effects).chunks.push(Effect::held(
                    Channel::Responses,
                    payload,
                    properties,
                ));
            }
        }
        Ok(())
    }

    /// Sends the chunks held so far, so that a chunk sent now does not overtake them.
    async fn send_held_chunks(&self) -> Result<(), BusError> {
        let held = std::mem::take(&mut locked(&self.effects).chunks);
        for chunk in held {
            self.send(
                Channel::Responses,
                chunk.payload.into_bytes(),
                &chunk.properties,
            )
            .await?;
        }
        Ok(())
    }

    /// The messages a chunk goes as: none (a subagent's answer text, a chunk the test faults
    /// drop), one, or two (a repeated chunk).
    fn chunk_messages(
        &self,
        kind: MessageType,
        content: &str,
        message_id: &str,
        end_of_message: bool,
    ) -> Vec<(Vec<u8>, Properties)> {
        if self.subagent && kind == MessageType::Answer {
            return Vec::new();
        }
        let mut properties = self.attempted();
        let mut chunk_fault = None;
        if kind == MessageType::Answer && !content.is_empty() {
            let place = self
                .answer_chunks
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            properties.insert(ANSWER_CHUNK_PROPERTY.to_owned(), place.to_string());
            chunk_fault = fault::answer_chunk_fault();
            if chunk_fault == Some(fault::ChunkFault::Dropped) {
                return Vec::new();
            }
        }
        let mut r = AgentResponse::new(kind, content);
        r.message_id = message_id.to_owned();
        r.end_of_message = end_of_message;
        let payload = agent_schema::encode(&r);
        if chunk_fault == Some(fault::ChunkFault::Repeated) {
            return vec![(payload.clone(), properties.clone()), (payload, properties)];
        }
        vec![(payload, properties)]
    }

    /// The dialog's properties and this delivery's attempt (see [`ATTEMPT_PROPERTY`]).
    fn attempted(&self) -> Properties {
        let mut properties = self.properties.clone();
        properties.insert(ATTEMPT_PROPERTY.to_owned(), self.attempt.clone());
        properties
    }

    /// The explainability message of `triples` about `node`, in this dialog's collection.
    fn triples_about(&self, node: &str, triples: Vec<Triple>) -> Triples {
        Triples {
            metadata: Metadata {
                id: node.to_owned(),
                root: self.root.clone(),
                collection: self.collection.clone(),
            },
            triples,
        }
    }

    /// Writes `triples` about `node` to the graph only (not to the client): what the service keeps
    /// for itself, such as a parked step's continuation.
    pub fn record(&self, node: &str, triples: Vec<Triple>) -> Result<(), BusError> {
        let message = self.triples_about(node, triples);
        self.hold(
            Channel::Explainability,
            agent_schema::encode(&message),
            &Properties::new(),
        );
        Ok(())
    }

    /// [`DialogOutput::record`], sent now and awaited rather than held for the commit: for what
    /// has already happened whatever becomes of the step (an interrupt, whose cancel went out at
    /// once), and which a step that parks must not take back with its held effects.
    pub async fn record_now(&self, node: &str, triples: Vec<Triple>) -> Result<(), BusError> {
        let message = self.triples_about(node, triples);
        self.send(
            Channel::Explainability,
            agent_schema::encode(&message),
            &Properties::new(),
        )
        .await?;
        self.flush().await
    }

    /// Records provenance about `node`: inline to the client as an `explain` response, and on the
    /// explainability topic for the graph store, as TrustGraph does.
    pub fn explain(&self, node: &str, mut triples: Vec<Triple>) -> Result<(), BusError> {
        self.check_in_documents(&mut triples);
        let costed: std::collections::BTreeSet<String> = triples
            .iter()
            .filter(|t| t.p.iri == tg::IN_TOKEN.as_str())
            .map(|t| t.s.iri.clone())
            .collect();
        let tag = |s: &str, p: NamedNodeRef<'_>, o: agent_schema::Term| Triple {
            s: agent_schema::Term::iri(s),
            p: agent_schema::Term::iri(p.as_str()),
            o,
            g: Some(GRAPH.to_owned()),
        };
        let subjects: std::collections::BTreeSet<String> = triples
            .iter()
            .filter(|t| !self.conversation.is_empty() && t.s.kind == "i")
            .map(|t| t.s.iri.clone())
            .collect();
        for subject in subjects {
            triples.push(tag(
                &subject,
                tg::CONVERSATION,
                agent_schema::Term::literal(&self.conversation),
            ));
        }
        for subject in costed {
            triples.push(tag(&subject, tg::RUN, agent_schema::Term::iri(&self.run)));
        }
        let message = self.triples_about(node, triples);
        // The graph copy is published before the client's, so a client that saw a node can find it.
        // It carries only the trace context: the aggregator's write joins this step's trace.
        let mut properties = Properties::new();
        let trace = agent_telemetry::trace::TRACEPARENT_PROPERTY;
        if let Some(context) = self.properties.get(trace) {
            properties.insert(trace.to_owned(), context.clone());
        }
        self.hold_graph(&message, &properties);
        let mut r = AgentResponse::new(MessageType::Explain, "");
        r.explain_id = Some(node.to_owned());
        r.explain_graph = Some(GRAPH.to_owned());
        r.explain_triples = message.triples;
        self.respond(&r)
    }

    /// Starts a subagent's dialog under the caller's `id`, so its messages reach the same client.
    /// It inherits the run's start and `run_tokens`, the run's spend so far (where there is no
    /// graph to read them from).
    pub fn spawn(
        &self,
        request: &AgentRequest,
        run_tokens: u64,
        seal: Option<&agent_bus::seal::SealKey>,
        model: Option<&str>,
    ) -> Result<(), BusError> {
        let mut properties = self.properties.clone();
        properties.insert(STARTED_PROPERTY.to_owned(), self.started_ms.to_string());
        properties.insert(RUN_TOKENS_PROPERTY.to_owned(), run_tokens.to_string());
        // A goal's own model, else the one this dialog asked for: a fork or replay on another
        // model runs its subagents on it too.
        if let Some(model) = model.or(self.model.as_deref()) {
            properties.insert(MODEL_PROPERTY.to_owned(), model.to_owned());
        }
        let payload = agent_schema::encode(request);
        if let Some(key) = seal {
            let text = |name: &str| properties.get(name).map_or("", String::as_str);
            let parts = subagent_seal_parts(
                request,
                &payload,
                self.started_ms,
                run_tokens,
                text(MODEL_PROPERTY),
                text(ID_PROPERTY),
            );
            let sealed = key.seal(&parts.each_ref().map(String::as_str));
            let legacy = legacy_subagent_seal_parts(request, self.started_ms, run_tokens);
            let legacy = key.seal(&legacy.each_ref().map(String::as_str));
            properties.insert(agent_bus::seal::SUBAGENT_SEAL_PROPERTY.to_owned(), sealed);
            properties.insert(agent_bus::seal::SEAL_PROPERTY.to_owned(), legacy);
        }
        self.within_limit(&payload, &properties)?;
        self.spawned
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.expect_step(request, &properties, &payload);
        self.hold(Channel::Requests, payload, &properties);
        Ok(())
    }

    /// When the dialog's first message was taken up (Unix milliseconds).
    pub fn started_ms(&self) -> u64 {
        self.started_ms
    }

    /// The caller's `id`, which a fan-out records so its synthesis reaches the same client.
    pub fn client_id(&self) -> &str {
        self.properties
            .get(ID_PROPERTY)
            .map(String::as_str)
            .unwrap_or_default()
    }

    /// Queues the next iteration of this dialog, carrying the tokens used so far, when it started,
    /// and any `extra` properties.
    pub fn next(
        &self,
        request: &AgentRequest,
        tokens: crate::budget::Tokens,
        extra: &[(&str, &str)],
    ) -> Result<(), BusError> {
        self.queue(request, tokens, extra, true)
    }

    /// Hands the dialog to another pattern as its first iteration ([`DialogOutput::next`], but the
    /// request is not recorded as a step's input: the step that hands it over is step 1's).
    pub fn dispatch(
        &self,
        request: &AgentRequest,
        tokens: crate::budget::Tokens,
        extra: &[(&str, &str)],
    ) -> Result<(), BusError> {
        self.queue(request, tokens, extra, false)
    }

    fn queue(
        &self,
        request: &AgentRequest,
        tokens: crate::budget::Tokens,
        extra: &[(&str, &str)],
        record_input: bool,
    ) -> Result<(), BusError> {
        let mut properties = self.properties.clone();
        for (key, value) in extra {
            properties.insert((*key).to_owned(), (*value).to_owned());
        }
        properties.insert(IN_TOKEN_PROPERTY.to_owned(), tokens.input.to_string());
        properties.insert(OUT_TOKEN_PROPERTY.to_owned(), tokens.output.to_string());
        properties.insert(STARTED_PROPERTY.to_owned(), self.started_ms.to_string());
        if let Some(model) = &self.model {
            properties.insert(MODEL_PROPERTY.to_owned(), model.clone());
        }
        if self.run_base > 0 {
            properties.insert(RUN_TOKENS_PROPERTY.to_owned(), self.run_base.to_string());
        }
        let payload = agent_schema::encode(request);
        match &self.step_seal {
            Some(key) => {
                let seal = key.seal_step(&payload, &properties);
                properties.insert(agent_bus::seal::STEP_SEAL_PROPERTY.to_owned(), seal);
            }
            // Not carried over from the message being handled, where it sealed another step.
            None => {
                properties.remove(agent_bus::seal::STEP_SEAL_PROPERTY);
            }
        }
        self.within_limit(&payload, &properties)?;
        // What the next step is given, kept as what it adds to this step's input: a fork or replay
        // of that step starts from it.
        if record_input {
            let input = agent_core::fork::record(self.input_step, &self.input_history, request);
            self.keep(agent_core::provenance::step_input(
                &agent_core::provenance::SessionUris::new(&self.root),
                &input,
            ));
        }
        self.expect_step(request, &properties, &payload);
        self.hold(Channel::Requests, payload, &properties);
        Ok(())
    }

    /// Seals again the sealed requests among `effects`, re-encoded from the journal: a build other
    /// than the recorder's may not encode them as it did.
    fn seal_again(&self, effects: &mut [journal::Effect]) {
        let Some(key) = &self.step_seal else {
            return;
        };
        let seal = agent_bus::seal::STEP_SEAL_PROPERTY;
        for effect in effects
            .iter_mut()
            .filter(|e| e.channel == Channel::Requests && e.properties.contains_key(seal))
        {
            let sealed = key.seal_step(effect.payload.as_bytes(), &effect.properties);
            effect.properties.insert(seal.to_owned(), sealed);
        }
    }

    /// Notes the journal entry a held request will be taken up as.
    fn expect_step(&self, request: &AgentRequest, properties: &Properties, encoded: &[u8]) {
        if !self.journaled {
            return;
        }
        if let Some(entry) = crate::step::entry_of_request(request, properties, encoded) {
            locked(&self.next_steps).push(entry);
        }
    }
}

/// The value behind `mutex`, even if a task panicked while holding it: every holder only pushes
/// or takes whole values, so what is there is sound, and treating a poisoned lock as empty would
/// ack a step whose effects were never published.
pub(crate) fn locked<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Room each request keeps for what its commit adds once its size was checked: its effect id
/// (`agent-effect-id`, the journal entry's name and its place: a few hundred bytes, the session
/// id being at most 240) and the chain it continues (`agent-chain`, a message id). A request that
/// fit only without them was recorded, then refused by the publisher at every try: the step was
/// given up, found its own entry, re-emitted it, was refused again, for ever, its client told
/// nothing.
const COMMIT_PROPERTY_BYTES: usize = 2048;

/// Room an explainability message keeps, once its commit stamped it, for the seal it is given as
/// it is sent (`agent-explain-seal`, an HMAC in base64).
const SEAL_PROPERTY_BYTES: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    /// A request that fits only without the properties its commit adds is refused when it is
    /// queued (the dialog ends with an error naming the limit), not once it is recorded.
    #[test]
    fn a_request_keeps_room_for_what_its_commit_adds() {
        let outputs = Outputs::Memory(MemorySink::default());
        let session = "urn:trustgraph:agent:near-the-limit";
        let request = |bytes: usize| agent_schema::AgentRequest {
            question: "q".repeat(bytes),
            session_id: "near-the-limit".to_owned(),
            ..Default::default()
        };
        let max = 64 * 1024;
        let out = DialogOutput::new(&outputs, Some("client-1"), "default", session, 0).for_step(
            &request(1),
            session,
            0,
            max,
        );
        let near = request(max - 600);
        let queued = out.next(&near, Default::default(), &[]);
        assert!(
            matches!(queued, Err(BusError::TooLarge { .. })),
            "{queued:?}"
        );
        let out = DialogOutput::new(&outputs, Some("client-1"), "default", session, 0).for_step(
            &request(1),
            session,
            0,
            max,
        );
        let within = request(max - 4 * COMMIT_PROPERTY_BYTES);
        assert!(out.next(&within, Default::default(), &[]).is_ok());
    }

    /// Where a test's step of `session` is journaled, taken up as `delivery`.
    fn slot_of<'j>(
        journal: &'j Journal,
        node: &NamedNode,
        delivery: &str,
        session: &str,
    ) -> JournalSlot<'j> {
        JournalSlot {
            journal,
            node: node.clone(),
            delivery: delivery.to_owned(),
            session: session.to_owned(),
        }
    }

    #[test]
    fn a_poisoned_lock_still_yields_what_was_held() {
        let effects = std::sync::Arc::new(Mutex::new(vec![1, 2]));
        let holder = effects.clone();
        let poisoned = std::thread::spawn(move || {
            let mut held = holder.lock().unwrap_or_else(PoisonError::into_inner);
            held.push(3);
            panic!("a holder dies");
        })
        .join();
        assert!(poisoned.is_err() && effects.is_poisoned());
        assert_eq!(std::mem::take(&mut *locked(&effects)), [1, 2, 3]);
        locked(&effects).push(4);
        assert_eq!(*locked(&effects), [4]);
    }

    #[tokio::test]
    async fn a_copy_waiting_for_its_recorder_hands_its_message_back_when_the_process_stops() {
        let journal = Journal::new(agent_graph::GraphStore::in_memory().unwrap().journal());
        let session = "urn:trustgraph:agent:stopping";
        let node = journal::entry_node(session, "i1-x").unwrap();
        let effect = Effect {
            channel: Channel::Requests,
            payload: "{}".to_owned(),
            properties: Default::default(),
            history_from_input: None,
        };
        let outcome = journal::Outcome::encode(vec![effect]).unwrap();
        // Recorded just now by another delivery, which is alive as far as anyone knows: a copy
        // waits for it (up to `PUBLISH_LEASE`) instead of publishing its outcome.
        let entry = journal
            .record(&node, outcome, "the-first-delivery", "a1", Vec::new(), None)
            .await
            .unwrap();
        let sink = MemorySink::default();
        let outputs = Outputs::Memory(sink.clone());
        let stopping = tokio_util::sync::CancellationToken::new();
        let out = DialogOutput::new(&outputs, Some("client-1"), "default", session, 0)
            .stopping_on(&stopping);
        let slot = slot_of(&journal, &node, "a-copy", session);
        let stop = async {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            stopping.cancel();
        };
        let (settled, ()) = tokio::join!(out.settle(&slot, entry, Recorder::Unknown), stop);
        let error = settled.unwrap_err();
        assert!(error.is::<StoppedWaiting>(), "{error:#}");
        assert!(sink.sent().is_empty(), "nothing published by the copy");
        assert!(!journal.entry(&node).await.unwrap().unwrap().published);
    }

    /// A chunk held for the commit is journaled with the step's outcome (a crash after the record
    /// re-emits it) and goes out after the chunks sent before it, ahead of what the step held; a
    /// long one is sent at once, after the chunks held before it, and is not journaled.
    #[tokio::test]
    async fn a_chunk_held_for_the_commit_is_journaled_and_keeps_its_place() {
        let journal = Journal::new(agent_graph::GraphStore::in_memory().unwrap().journal());
        let session = "urn:trustgraph:agent:held-chunks";
        let node = journal::entry_node(session, "i1-x").unwrap();
        let slot = slot_of(&journal, &node, "the-delivery", session);
        let sink = MemorySink::default();
        let outputs = Outputs::Memory(sink.clone());
        let out = DialogOutput::new(&outputs, Some("client-1"), "default", session, 0);
        let long = "x".repeat(HELD_CHUNK_BYTES);
        let contents = || {
            sink.decoded::<AgentResponse>(Channel::Responses)
                .into_iter()
                .map(|r| r.content)
                .collect::<Vec<_>>()
        };
        out.chunk(MessageType::Thought, "thinking", "t", true)
            .await
            .unwrap();
        out.chunk_with_outcome(MessageType::Thought, "held", "t2", true)
            .await
            .unwrap();
        assert_eq!(contents(), ["thinking"], "held");
        // A chunk too long to hold goes now, and the one held before it goes first.
        out.chunk_with_outcome(MessageType::Observation, &long, "o-long", true)
            .await
            .unwrap();
        assert_eq!(contents(), ["thinking", "held", long.as_str()]);
        out.chunk_with_outcome(MessageType::Observation, "seen", "o", true)
            .await
            .unwrap();
        let mut closing = AgentResponse::new(MessageType::Answer, "done");
        closing.end_of_dialog = true;
        out.respond(&closing).unwrap();
        assert_eq!(
            contents(),
            ["thinking", "held", long.as_str()],
            "before the commit"
        );

        out.commit(Some(&slot)).await.unwrap();
        assert_eq!(
            contents(),
            ["thinking", "held", long.as_str(), "seen", "done"]
        );
        let entry = journal.entry(&node).await.unwrap().unwrap();
        let journaled: Vec<(String, Option<&String>)> = entry
            .effects
            .iter()
            .filter(|e| e.channel == Channel::Responses)
            .map(|e| {
                let response = serde_json::from_str::<AgentResponse>(&e.payload).unwrap();
                (response.content, e.properties.get(ATTEMPT_PROPERTY))
            })
            .collect();
        let attempt = Some(&entry.attempt);
        assert_eq!(
            journaled,
            [("seen".to_owned(), attempt), ("done".to_owned(), attempt)],
            "journaled first, under the attempt that recorded them"
        );
        assert_eq!(
            entry.effects[0].properties.get(EFFECT_ID_PROPERTY),
            Some(&format!("{}#0", node.as_str()))
        );
    }

    /// A journal whose lookups answer and whose records fail: an embedded store opened for
    /// reading only.
    fn journal_that_cannot_record() -> (Journal, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "emit-unrecorded-{}-{}",
            std::process::id(),
            chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default()
        ));
        drop(agent_graph::GraphStore::open(dir.to_str().unwrap(), None).unwrap());
        let store = agent_graph::GraphStore::open_read_only(&dir).unwrap();
        (Journal::new(store.journal()), dir)
    }

    #[tokio::test]
    async fn a_step_given_up_publishes_its_error_unrecorded_when_the_journal_does_not_take_it() {
        let (journal, dir) = journal_that_cannot_record();
        let session = "urn:trustgraph:agent:unrecorded";
        let node = journal::entry_node(session, "i1-x").unwrap();
        assert!(
            journal.entry(&node).await.unwrap().is_none(),
            "lookups answer"
        );
        let slot = slot_of(&journal, &node, "the-dead-letter", session);
        let sink = MemorySink::default();
        let outputs = Outputs::Memory(sink.clone());
        let error = AgentResponse {
            end_of_dialog: true,
            error: Some(agent_schema::ErrorInfo {
                message: "given up".to_owned(),
                ..Default::default()
            }),
            ..Default::default()
        };

        // Any other step fails (it is settled as an outage), and publishes nothing.
        let running = DialogOutput::new(&outputs, Some("client-1"), "default", session, 0);
        running.respond(&error).unwrap();
        assert!(running.commit(Some(&slot)).await.is_err());
        assert!(sink.sent().is_empty());

        // A step given up publishes its error all the same: its dialog must end.
        let giving_up =
            DialogOutput::new(&outputs, Some("client-1"), "default", session, 0).giving_up(true);
        giving_up.respond(&error).unwrap();
        giving_up.commit(Some(&slot)).await.unwrap();
        let closings: Vec<AgentResponse> = sink.decoded(Channel::Responses);
        assert_eq!(closings.len(), 1, "{closings:?}");
        assert_eq!(closings[0].error.as_ref().unwrap().message, "given up");
        assert!(journal.entry(&node).await.unwrap().is_none());
        drop(journal);
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Marks a published step's entry off the step's path (its message is acked without waiting).
/// Published is done: a mark that fails must not park or fail the step, whose every retry would
/// send its whole outcome again. Unmarked, a later copy re-emits the same effects (same effect
/// ids, which consumers drop).
fn mark_published_aside(journal: Journal, node: NamedNode) {
    tokio::spawn(async move {
        if let Err(e) = journal.mark_published(&node).await {
            tracing::warn!(entry = %node.as_str(), error = %e, "published, but not marked in the journal");
        }
    });
}

/// A chaos hook for crash tests and soaks: `AGENT_FAULT=<stage>:<n>` aborts the process (as a
/// SIGKILL would: nothing acked, nothing flushed) at that stage of its `n`-th commit, counted from
/// one. Stages: `after-record` (the outcome journaled, nothing published), `after-publish`
/// (published, not marked), `before-ack` (marked, the message not yet acked). Unset, it costs one
/// atomic add. `drop-answer-chunk:<n>` instead leaves out the process's `n`-th streamed chunk of
/// answer text, as a broker drops a message on a non-persistent topic, and `repeat-answer-chunk:<n>`
/// sends it twice, as a producer sending it again after a reconnection would. `drop-control:<n>`
/// leaves out the `n`-th control message heard, as a broker drops one on its non-persistent topic.
pub(crate) mod fault {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::OnceLock;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Stage {
        Recorded,
        Published,
        Marked,
        /// Not a crash: an answer chunk left out or sent twice.
        AnswerChunk(ChunkFault),
        /// Not a crash: a control message left out.
        ControlDropped,
    }

    /// What happens to an answer chunk on its way, by the plan.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum ChunkFault {
        Dropped,
        Repeated,
    }

    static COMMITS: AtomicUsize = AtomicUsize::new(0);
    static ANSWER_CHUNKS: AtomicUsize = AtomicUsize::new(0);
    static CONTROLS: AtomicUsize = AtomicUsize::new(0);

    fn planned() -> Option<(Stage, usize)> {
        static PLAN: OnceLock<Option<(Stage, usize)>> = OnceLock::new();
        *PLAN.get_or_init(|| {
            let value = std::env::var("AGENT_FAULT").ok()?;
            let (stage, n) = value.split_once(':')?;
            let stage = match stage {
                "after-record" => Stage::Recorded,
                "after-publish" => Stage::Published,
                "before-ack" => Stage::Marked,
                "drop-answer-chunk" => Stage::AnswerChunk(ChunkFault::Dropped),
                "repeat-answer-chunk" => Stage::AnswerChunk(ChunkFault::Repeated),
                "drop-control" => Stage::ControlDropped,
                _ => return None,
            };
            Some((stage, n.parse().ok()?))
        })
    }

    pub fn next_commit() -> usize {
        COMMITS.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether the answer chunk about to be sent is the one to leave out or to send twice.
    pub fn answer_chunk_fault() -> Option<ChunkFault> {
        let n = ANSWER_CHUNKS.fetch_add(1, Ordering::Relaxed) + 1;
        let fault = match planned() {
            Some((Stage::AnswerChunk(fault), m)) if m == n => fault,
            _ => return None,
        };
        tracing::error!(chunk = n, ?fault, "AGENT_FAULT: an answer chunk");
        Some(fault)
    }

    /// Whether the control message just heard is the one to leave out.
    pub fn control_dropped() -> bool {
        let n = CONTROLS.fetch_add(1, Ordering::Relaxed) + 1;
        let dropped = planned() == Some((Stage::ControlDropped, n));
        if dropped {
            tracing::error!(control = n, "AGENT_FAULT: a control message left out");
        }
        dropped
    }

    pub fn crash_if(stage: Stage, commit: usize) {
        if planned() == Some((stage, commit)) {
            tracing::error!(?stage, commit, "AGENT_FAULT: aborting");
            std::process::abort();
        }
    }
}
