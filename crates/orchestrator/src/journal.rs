//! Effectively-once iterations. An iteration's durable effects (provenance, the next request or
//! subagents, the closing response) are recorded in the graph store under a key of the message
//! that caused them, first writer wins, before any of them is published; then published; then the
//! entry is marked published and the message acked. A message whose entry is published is dropped
//! (its successor is out); one whose entry was recorded by this very delivery before a crash
//! re-emits the recorded effects without calling the LLM; one whose entry another copy recorded is
//! held while that copy may still be publishing ([`PUBLISH_LEASE`]), then dropped if the entry got
//! published or re-emitted if not.
//! Every re-emitted message carries the original's effect id. So whatever happens, one outcome per
//! message, the same content every time it is sent.

use std::collections::BTreeMap;

use agent_core::documents::steps_taken;
use agent_graph::journal::{JournalEntry, RecordRequest};
use agent_graph::model::NamedNode;
use agent_graph::GraphError;
use agent_schema::{AgentRequest, AgentStep};
use serde::{Deserialize, Serialize};

/// Which publisher an effect goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Channel {
    Responses,
    Requests,
    Explainability,
}

/// One message an iteration publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Effect {
    pub channel: Channel,
    /// The JSON payload (every payload here is UTF-8 JSON).
    pub payload: String,
    pub properties: BTreeMap<String, String>,
    /// Set on a journaled request whose history begins with this many steps of the input's: the
    /// payload holds only the steps after them, so an entry is the size of its step, not of the
    /// dialog. The input is at hand whenever an entry is re-emitted (the same message again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history_from_input: Option<usize>,
}

impl Effect {
    /// The form to journal: a request that extends the input's history keeps only its new steps.
    /// For a resumption of a supervisor, the history before its results: two resumptions of one
    /// fan-out are one step (see [`key_of_encoded`]) whose results may differ, and a copy must
    /// re-emit the request the first published, its results included, byte for byte.
    pub fn compacted(&self, input_history: &[AgentStep]) -> Effect {
        let input_history = match agent_core::supervisor::pending_synthesis(input_history) {
            Some(_) => &input_history[..input_history.len() - 1],
            None => input_history,
        };
        if self.channel != Channel::Requests || input_history.is_empty() {
            return self.clone();
        }
        let Ok(request) = serde_json::from_str::<AgentRequest>(&self.payload) else {
            return self.clone();
        };
        let compact = agent_core::fork::record(0, input_history, &request);
        let Some((_, n)) = compact.continues else {
            return self.clone();
        };
        Effect {
            payload: String::from_utf8_lossy(&agent_schema::encode(&compact.request)).into_owned(),
            history_from_input: Some(n),
            ..self.clone()
        }
    }

    /// The message as it was published, from its journaled form and the input's history.
    pub fn expanded(&self, input_history: &[AgentStep]) -> Result<Effect, String> {
        let Some(n) = self.history_from_input else {
            return Ok(self.clone());
        };
        let Some(prefix) = input_history.get(..n) else {
            return Err(format!(
                "the entry continues {n} steps of history and the input has {}",
                input_history.len()
            ));
        };
        let mut request = serde_json::from_str::<AgentRequest>(&self.payload)
            .map_err(|e| format!("a journaled request does not decode: {e}"))?;
        let added = std::mem::take(&mut request.history);
        request.history = prefix.iter().cloned().chain(added).collect();
        Ok(Effect {
            payload: String::from_utf8_lossy(&agent_schema::encode(&request)).into_owned(),
            history_from_input: None,
            ..self.clone()
        })
    }
}

/// A journal entry as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub effects: Vec<Effect>,
    /// The broker's id of the delivery that recorded it.
    pub delivery: String,
    /// Which attempt of that delivery recorded it.
    pub attempt: String,
    /// When it was recorded.
    pub recorded_at: Option<chrono::DateTime<chrono::Utc>>,
    pub published: bool,
}

/// How long the delivery that recorded an entry has to publish it. Past this, another delivery of
/// the same step takes it as dead and publishes the entry itself: the copies are identical and
/// carry the same effect ids, so nothing is doubled, and nothing waits for a process that is gone.
pub const PUBLISH_LEASE: std::time::Duration = std::time::Duration::from_secs(5);

impl Entry {
    /// Whether the recorder has had time enough to publish, for a copy that first saw the entry
    /// at `seen`.
    pub fn lease_expired(&self, seen: std::time::Instant) -> bool {
        self.older_than(PUBLISH_LEASE, seen)
    }

    /// Whether it was recorded at least `age` ago (an entry with no time of its own is old), for a
    /// copy that first saw it at `seen`. Its time is the journal owner's clock, and this process's
    /// may run behind it (by hours, with a broken NTP): it was recorded before it was first seen,
    /// so `age` since then is enough, whatever the clocks say.
    pub fn older_than(&self, age: std::time::Duration, seen: std::time::Instant) -> bool {
        let Some(at) = self.recorded_at else {
            return true;
        };
        seen.elapsed() >= age
            || chrono::Utc::now()
                .signed_duration_since(at)
                .to_std()
                .is_ok_and(|elapsed| elapsed >= age)
    }

    /// The chain that recorded it, if a step continued in process did (see
    /// `emit::CHAIN_PROPERTY`): its request names the chain.
    pub fn chain(&self) -> Option<&str> {
        self.effects.iter().find_map(|effect| {
            (effect.channel == Channel::Requests)
                .then(|| effect.properties.get(crate::emit::CHAIN_PROPERTY))
                .flatten()
                .map(String::as_str)
        })
    }
}

/// The key of the step a message asks for: the step (`route` for a new dialog that names no
/// pattern, or `i{n}`) and a digest of the message, so a redelivery or a copy of it shares the
/// key while a different request that happens to name the same session (a reused `id`) does not.
/// A new dialog's digest takes in its client's `id` (`client`, empty: none) too: two clients
/// that send the same question under one session id of their choosing are two requests, and the
/// second, taken for a copy of the first, got nothing (what the first's entry re-emitted went
/// to the first's `id`). A redelivery carries the `id` it was sent with.
pub fn key(request: &AgentRequest, new_dialog: bool, client: &str) -> String {
    key_of_encoded(request, new_dialog, client, &agent_schema::encode(request))
}

/// [`key`], given the request's encoding (`agent_schema::encode`), as its sender has it.
///
/// A request resuming a supervisor with its subagents' results is keyed without them: it is the
/// step after its fan-out, whatever results it carries. The aggregator sends one per fan-out, but
/// two can differ (a partial answer at the timeout and a complete one, should the first's claim
/// lapse while it was published), and keyed by their bytes both would run: two syntheses, two
/// answers. Keyed so, the first recorded stands and the other is its copy.
pub fn key_of_encoded(
    request: &AgentRequest,
    new_dialog: bool,
    client: &str,
    encoded: &[u8],
) -> String {
    let step = if new_dialog && request.pattern.is_empty() {
        "route".to_owned()
    } else {
        format!("i{}", steps_taken(&request.history) + 1)
    };
    let digest = if agent_core::supervisor::pending_synthesis(&request.history).is_some() {
        let mut fanned_out = request.clone();
        fanned_out.history.pop();
        let encoded = agent_schema::encode(&fanned_out);
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, &encoded)
    } else if new_dialog && !client.is_empty() {
        let mut named = Vec::with_capacity(client.len() + 1 + encoded.len());
        named.extend_from_slice(client.as_bytes());
        named.push(0);
        named.extend_from_slice(encoded);
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, &named)
    } else {
        uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, encoded)
    };
    format!("{step}-{}", digest.simple())
}

/// The journal entry node of step `key` of the session `session_uri`.
pub fn entry_node(session_uri: &str, key: &str) -> Result<NamedNode, GraphError> {
    NamedNode::new(format!("{session_uri}/journal/{key}"))
        .map_err(|e| GraphError::Syntax(format!("not a journal node: {e}")))
}

/// Marks the outcome text of an entry written as [`encode_outcome`] does.
const FRAMED: &str = "frames+zstd+base64:";
/// Marks an outcome framed as now but deflated (entries recorded before zstd).
const FRAMED_DEFLATED: &str = "frames+deflate+base64:";
/// Marks an outcome written as one deflated JSON document (entries recorded before framing).
const DEFLATED: &str = "deflate+base64:";
/// zstd's fastest level: on a step's outcome it took a quarter of deflate's ("fast") time and
/// gave 40% fewer bytes (62 KB of captured TrustGraph messages: 26 us and 3.0 KB, against
/// 119 us and 5.1 KB).
const ZSTD_LEVEL: i32 = 1;

/// What an effect says besides its payload: the header of its frame.
#[derive(Serialize, Deserialize)]
struct FrameHeader {
    channel: Channel,
    properties: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    history_from_input: Option<usize>,
}

/// An outcome as the journal keeps it: each effect as a frame (its header's JSON, then its
/// payload as it is, each after its length in four bytes), compressed by zstd, in base64. The
/// payloads are JSON already: framed, they are copied, where one JSON document around them escaped
/// every quote in them (a tenth of the orchestrator's time in a journaled throughput run).
/// Compressed, provenance that travels twice (to the graph and inline to the client) is kept about
/// once; base64 needs no escaping in the HTTP body or in a SPARQL literal.
fn encode_outcome(effects: &[Effect]) -> std::io::Result<String> {
    use base64::Engine;
    let compressed = with_compressor(|compressor| compressor.compress(&frames_of(effects)?))?;
    Ok(format!(
        "{FRAMED}{}",
        base64::engine::general_purpose::STANDARD.encode(compressed)
    ))
}

/// Runs `compress` with this thread's zstd compressor. A context made for each outcome cost
/// more than compressing it: `ZSTD_createCCtx` alone, which allocates and zeroes its tables, was
/// 0.8% of a journaled throughput run's CPU, compressing 0.6%.
fn with_compressor<T>(
    compress: impl FnOnce(&mut zstd::bulk::Compressor<'static>) -> std::io::Result<T>,
) -> std::io::Result<T> {
    thread_local! {
        static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    COMPRESSOR.with(|cell| {
        let mut slot = cell.try_borrow_mut().map_err(std::io::Error::other)?;
        let compressor = match &mut *slot {
            Some(compressor) => compressor,
            empty => empty.insert(zstd::bulk::Compressor::new(ZSTD_LEVEL)?),
        };
        compress(compressor)
    })
}

/// The effects as frames, uncompressed.
fn frames_of(effects: &[Effect]) -> std::io::Result<Vec<u8>> {
    let mut frames = Vec::new();
    for effect in effects {
        let header = serde_json::to_vec(&FrameHeader {
            channel: effect.channel,
            properties: effect.properties.clone(),
            history_from_input: effect.history_from_input,
        })?;
        for part in [header.as_slice(), effect.payload.as_bytes()] {
            let length = u32::try_from(part.len()).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "an effect over 4 GiB")
            })?;
            frames.extend_from_slice(&length.to_le_bytes());
            frames.extend_from_slice(part);
        }
    }
    Ok(frames)
}

/// A step's outcome as it is recorded: its effects, and their encoding for the journal, made
/// apart from the record so that a step encodes while its streamed messages are on their way.
pub struct Outcome {
    effects: Vec<Effect>,
    encoded: String,
}

impl Outcome {
    pub fn encode(effects: Vec<Effect>) -> Result<Outcome, GraphError> {
        let encoded = encode_outcome(&effects)
            .map_err(|e| GraphError::Syntax(format!("cannot encode the outcome: {e}")))?;
        Ok(Outcome { effects, encoded })
    }
}

/// The effects of an outcome written by [`encode_outcome`], or by the encodings before it (the
/// same frames deflated, one deflated JSON document, or plain JSON).
pub fn decode_outcome(outcome: &str) -> Result<Vec<Effect>, String> {
    if let Some(encoded) = outcome.strip_prefix(FRAMED) {
        return read_frames(&decompress(encoded)?);
    }
    if let Some(encoded) = outcome.strip_prefix(FRAMED_DEFLATED) {
        return read_frames(&inflate(encoded)?);
    }
    if let Some(encoded) = outcome.strip_prefix(DEFLATED) {
        return serde_json::from_slice(&inflate(encoded)?).map_err(|e| e.to_string());
    }
    serde_json::from_str(outcome).map_err(|e| e.to_string())
}

fn decompress(encoded: &str) -> Result<Vec<u8>, String> {
    // A stream decoder, so no size has to be guessed (zstd's frame may not state its own).
    zstd::stream::decode_all(from_base64(encoded)?.as_slice()).map_err(|e| e.to_string())
}

fn inflate(encoded: &str) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let mut bytes = Vec::new();
    flate2::read::DeflateDecoder::new(from_base64(encoded)?.as_slice())
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    Ok(bytes)
}

fn from_base64(encoded: &str) -> Result<Vec<u8>, String> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|e| e.to_string())
}

fn read_frames(mut bytes: &[u8]) -> Result<Vec<Effect>, String> {
    fn part<'b>(bytes: &mut &'b [u8]) -> Result<&'b [u8], String> {
        let (length, rest) = bytes
            .split_first_chunk::<4>()
            .ok_or("a frame is cut short")?;
        let length = u32::from_le_bytes(*length) as usize;
        if rest.len() < length {
            return Err("a frame is cut short".to_owned());
        }
        let (part, rest) = rest.split_at(length);
        *bytes = rest;
        Ok(part)
    }
    let mut effects = Vec::new();
    while !bytes.is_empty() {
        let header: FrameHeader =
            serde_json::from_slice(part(&mut bytes)?).map_err(|e| e.to_string())?;
        let payload = String::from_utf8(part(&mut bytes)?.to_vec()).map_err(|e| e.to_string())?;
        effects.push(Effect {
            channel: header.channel,
            payload,
            properties: header.properties,
            history_from_input: header.history_from_input,
        });
    }
    Ok(effects)
}

/// The closing message of the dialog of session `session_id` as it was published under the
/// correlation `id`, read back from the journal, byte for byte what the broker was given: for a
/// client that lost it (the response topic is non-persistent, and a broker drops what a reader
/// that falls behind has no room for). `None` while the dialog has not ended, or when its last
/// step was not journaled or its entry has been pruned.
pub async fn recorded_closing(
    store: &agent_graph::GraphStore,
    session_id: &str,
    id: &str,
) -> Result<Option<agent_schema::AgentResponse>, GraphError> {
    Ok(recorded_closing_received(store, session_id, id)
        .await?
        .map(|closing| closing.response))
}

/// [`recorded_closing`] as a client would have received it: with the attempt it names
/// ([`agent_schema::ATTEMPT_PROPERTY`], whose streamed text is the answer) and how many answer
/// chunks that attempt streamed ([`agent_schema::ANSWER_CHUNKS_PROPERTY`]).
pub async fn recorded_closing_received(
    store: &agent_graph::GraphStore,
    session_id: &str,
    id: &str,
) -> Result<Option<agent_bus::Received>, GraphError> {
    use agent_core::vocab::{tg, PROVENANCE_GRAPH};
    use agent_graph::model::Term;
    let session = agent_graph::queries::session_node(session_id)?;
    let graph = NamedNode::new_unchecked(PROVENANCE_GRAPH);
    let said = store
        .about_each(std::slice::from_ref(&session), &graph)
        .await?;
    let entries = said
        .into_iter()
        .flatten()
        .filter(|(p, _)| p.as_ref() == tg::CLOSING_ENTRY)
        .filter_map(|(_, o)| match o {
            Term::NamedNode(entry) => Some(entry),
            _ => None,
        });
    for entry in entries {
        let Some(stored) = agent_graph::journal::read_entry(store, &entry).await? else {
            continue;
        };
        let Ok(effects) = decode_outcome(&stored.outcome) else {
            continue;
        };
        let closing = effects
            .iter()
            .filter(|e| e.channel == Channel::Responses)
            .filter(|e| {
                e.properties
                    .get(agent_schema::ID_PROPERTY)
                    .map(String::as_str)
                    == Some(id)
            })
            .filter_map(|e| {
                let response =
                    serde_json::from_str::<agent_schema::AgentResponse>(&e.payload).ok()?;
                Some(agent_bus::Received::with_properties(
                    id.to_owned(),
                    response,
                    |key| e.properties.get(key).map(String::as_str),
                ))
            })
            .find(|closing| closing.response.end_of_dialog);
        if closing.is_some() {
            return Ok(closing);
        }
    }
    Ok(None)
}

/// A step's journal entry whose outcome this build cannot read: recorded by a newer build (a
/// rolling upgrade that changed the entries' form) or by something else. Its step is left to
/// another delivery (the message is nacked), so a replica that can read it settles it: taken as
/// published it would be dropped, and run again it could make a second outcome.
#[derive(Debug, thiserror::Error)]
#[error("the journal entry {entry} is in a form this build cannot read ({reason}); leaving its step to a replica that can")]
pub struct UnreadableEntry {
    pub entry: String,
    pub reason: String,
}

/// The journal every orchestrator replica shares: its owner (the aggregator in front of the graph
/// store) decides which record of a step stands, in one call per record.
#[derive(Clone)]
pub struct Journal {
    book: agent_graph::journal::Journal,
    /// This process, as its chains' beats name it (see `chains`).
    process: std::sync::Arc<str>,
    /// The chains this process runs, which its beats name.
    chains: std::sync::Arc<crate::chains::HeldChains>,
}

impl Journal {
    pub fn new(book: agent_graph::journal::Journal) -> Journal {
        let process = format!("orchestrator-{}", uuid::Uuid::new_v4().simple());
        Journal {
            book,
            process: process.into(),
            chains: Default::default(),
        }
    }

    /// The chains this process runs.
    pub fn chains(&self) -> &std::sync::Arc<crate::chains::HeldChains> {
        &self.chains
    }

    /// Whether the journal's owner answers as one (see [`agent_graph::journal::Journal::check`]).
    pub async fn check(&self) -> Result<(), GraphError> {
        self.book.check().await
    }

    /// The entry of a step, if one was recorded; [`UnreadableEntry`] for one in a form this
    /// build cannot read.
    pub async fn entry(&self, node: &NamedNode) -> anyhow::Result<Option<Entry>> {
        match self.book.entry(node).await? {
            Some(stored) => Ok(Some(Self::read(node, stored)?)),
            None => Ok(None),
        }
    }

    /// [`Journal::entry`] for a step `taker` (a token of this process's handling of the message)
    /// is taking up from the message `delivery`: with, when no entry stands, how many takers
    /// the owner has seen that message have without an outcome, this one included (see
    /// [`agent_graph::journal::Taking`]).
    pub async fn take(
        &self,
        node: &NamedNode,
        delivery: &str,
        taker: &str,
    ) -> anyhow::Result<(Option<Entry>, u32)> {
        let taking = agent_graph::journal::TakingRef {
            entry: node.as_str().to_owned(),
            delivery: delivery.to_owned(),
            taker: taker.to_owned(),
        };
        let taken = self.book.take(&taking).await?;
        match taken.entry {
            Some(stored) => Ok((Some(Self::read(node, stored)?), 0)),
            None => Ok((None, taken.takings)),
        }
    }

    fn recorded_at(stored: &JournalEntry) -> Option<chrono::DateTime<chrono::Utc>> {
        stored
            .recorded_at
            .as_deref()
            .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&chrono::Utc))
    }

    fn read(node: &NamedNode, stored: JournalEntry) -> Result<Entry, UnreadableEntry> {
        let recorded_at = Self::recorded_at(&stored);
        let effects = decode_outcome(&stored.outcome).map_err(|reason| UnreadableEntry {
            entry: node.as_str().to_owned(),
            reason,
        })?;
        Ok(Entry {
            effects,
            delivery: stored.delivery,
            attempt: stored.attempt,
            recorded_at,
            published: stored.published,
        })
    }

    /// Records `outcome` as the step's outcome unless another is recorded; returns the entry that
    /// stands (compare its `attempt` with `attempt` to know whose it is). `ends` names the
    /// session of a conversation's dialog the outcome ends (see [`RecordRequest::ends`]).
    pub async fn record(
        &self,
        node: &NamedNode,
        outcome: Outcome,
        delivery: &str,
        attempt: &str,
        next: Vec<String>,
        ends: Option<String>,
    ) -> anyhow::Result<Entry> {
        let Outcome { effects, encoded } = outcome;
        let standing = self
            .book
            .record(RecordRequest {
                entry: node.as_str().to_owned(),
                outcome: encoded,
                delivery: delivery.to_owned(),
                attempt: attempt.to_owned(),
                next,
                ends,
            })
            .await?;
        if standing.attempt == attempt {
            // Ours stands: what was recorded is what we hold, no need to decode it back.
            return Ok(Entry {
                effects,
                recorded_at: Self::recorded_at(&standing),
                delivery: standing.delivery,
                attempt: standing.attempt,
                published: standing.published,
            });
        }
        Ok(Self::read(node, standing)?)
    }

    /// Marks the step's outcome as published.
    pub async fn mark_published(&self, node: &NamedNode) -> Result<(), GraphError> {
        self.book.mark_published(node).await
    }

    /// Tells the owner that this process runs the chains with these roots, for `lasts` (see
    /// `chains`).
    pub async fn beat(
        &self,
        holding: Vec<String>,
        lasts: std::time::Duration,
    ) -> Result<(), GraphError> {
        let beat = agent_graph::journal::ChainBeat {
            process: self.process.to_string(),
            holding,
            for_ms: u64::try_from(lasts.as_millis()).unwrap_or(u64::MAX),
        };
        self.book.beat(beat).await
    }

    /// A new dialog's turn in its conversation, from the journal's owner (see
    /// [`agent_graph::turns`]).
    pub async fn take_turn(
        &self,
        asked: agent_graph::turns::TurnAsked,
    ) -> Result<agent_graph::turns::Turn, GraphError> {
        self.book.take_turn(asked).await
    }

    /// Whether another live process has said it still runs the chain `root`. This process's
    /// own word does not count: a chain of its own that meets a step recorded by a second line
    /// of the same chain waits for that line's process, never for itself.
    pub async fn chain_held(&self, root: &str) -> Result<bool, GraphError> {
        let asked = agent_graph::journal::ChainRefs {
            chains: vec![root.to_owned()],
            except: Some(self.process.to_string()),
        };
        let held = self.book.held(asked).await?;
        Ok(held.first().copied().unwrap_or(false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An entry stamped by an owner whose clock runs an hour ahead of this process's is old once
    /// it has been seen for the age asked: before, a copy of a step whose recorder died waited
    /// the hour out.
    #[test]
    fn an_entry_from_a_clock_ahead_ages_from_when_it_was_seen() {
        let ahead = Entry {
            effects: Vec::new(),
            delivery: "d".into(),
            attempt: "a".into(),
            recorded_at: Some(chrono::Utc::now() + chrono::Duration::hours(1)),
            published: false,
        };
        let now = std::time::Instant::now();
        assert!(!ahead.lease_expired(now));
        let Some(six_seconds_ago) = now.checked_sub(std::time::Duration::from_secs(6)) else {
            return;
        };
        assert!(ahead.lease_expired(six_seconds_ago));
        let behind = Entry {
            recorded_at: Some(chrono::Utc::now() - chrono::Duration::seconds(6)),
            ..ahead
        };
        assert!(
            behind.lease_expired(now),
            "an old entry is old at first sight"
        );
        assert!(!Entry {
            recorded_at: Some(chrono::Utc::now()),
            ..behind
        }
        .lease_expired(now));
    }

    #[test]
    fn keys_follow_the_step_and_the_message() {
        let first = AgentRequest {
            question: "Q".into(),
            ..AgentRequest::default()
        };
        assert!(key(&first, true, "").starts_with("route-"));
        assert!(key(&first, false, "").starts_with("i1-"));
        assert_eq!(key(&first, false, ""), key(&first.clone(), false, ""));
        // A new dialog is its client's: the same question sent under another id is another
        // request; a later step is told by its history, whoever's it is.
        assert_eq!(key(&first, true, "a"), key(&first, true, "a"));
        assert_ne!(key(&first, true, "a"), key(&first, true, "b"));
        assert_ne!(key(&first, true, "a"), key(&first, true, ""));
        assert_eq!(key(&first, false, "a"), key(&first, false, "b"));
        let other = AgentRequest {
            question: "R".into(),
            ..AgentRequest::default()
        };
        assert_ne!(key(&first, false, ""), key(&other, false, ""));
        assert!(entry_node("urn:trustgraph:agent:s", &key(&first, false, "")).is_ok());
    }

    #[test]
    fn resumptions_of_one_fan_out_are_one_step_whatever_results_they_carry() {
        let continuation = AgentRequest {
            question: "Q".into(),
            session_id: "sup".into(),
            pattern: "supervisor".into(),
            ..AgentRequest::default()
        };
        let resumed = |result: &str, missing: &[usize]| {
            agent_core::supervisor::synthesis_request(
                &continuation,
                [("00. a".to_owned(), result.to_owned())].into(),
                missing,
            )
        };
        let partial = resumed("Error: no result within 3 s", &[0]);
        let complete = resumed("A", &[]);
        assert_eq!(key(&partial, false, ""), key(&complete, false, ""));
        // Another fan-out (another question) is another step.
        let elsewhere = agent_core::supervisor::synthesis_request(
            &AgentRequest {
                question: "R".into(),
                ..continuation.clone()
            },
            [("00. a".to_owned(), "A".to_owned())].into(),
            &[],
        );
        assert_ne!(key(&elsewhere, false, ""), key(&complete, false, ""));
        // The continuation itself (as it fanned out) is not the step after it.
        assert_ne!(key(&continuation, false, ""), key(&complete, false, ""));
    }

    #[test]
    fn the_entry_a_sender_names_for_its_request_is_the_one_its_consumer_looks_up() {
        let request = AgentRequest {
            question: "q".into(),
            session_id: "s-1".into(),
            pattern: "react".into(),
            history: vec![agent_schema::AgentStep {
                thought: "t".into(),
                observation: "o \"quoted\" é".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let properties: agent_bus::Properties = [("id".to_owned(), "c".to_owned())].into();
        let encoded = agent_schema::encode(&request);
        let named = crate::step::entry_of_request(&request, &properties, &encoded).unwrap();
        // The consumer decodes the message and names the entry from what it decoded.
        let decoded: AgentRequest = serde_json::from_slice(&encoded).unwrap();
        let looked_up = entry_node(
            &agent_core::provenance::SessionUris::new("s-1").session(),
            &key(&decoded, false, "c"),
        )
        .unwrap();
        assert_eq!(named, looked_up.as_str());
        assert!(named.contains("/journal/i2-"), "{named}");
        // A dialog's first request (a subagent's start, queued by its supervisor) too, whose
        // key takes in its client's id.
        let first = AgentRequest {
            history: Vec::new(),
            ..request
        };
        let encoded = agent_schema::encode(&first);
        let named = crate::step::entry_of_request(&first, &properties, &encoded).unwrap();
        let decoded: AgentRequest = serde_json::from_slice(&encoded).unwrap();
        let looked_up = entry_node(
            &agent_core::provenance::SessionUris::new("s-1").session(),
            &key(&decoded, true, "c"),
        )
        .unwrap();
        assert_eq!(named, looked_up.as_str());
    }

    #[test]
    fn a_journaled_request_keeps_only_its_new_steps_and_expands_to_the_same_bytes() {
        let step = |thought: &str| AgentStep {
            thought: thought.to_owned(),
            observation: "o".repeat(10_000),
            ..AgentStep::default()
        };
        let input: Vec<AgentStep> = (0..8).map(|i| step(&format!("t{i}"))).collect();
        let next = AgentRequest {
            question: "q".into(),
            history: input.iter().cloned().chain([step("new")]).collect(),
            ..AgentRequest::default()
        };
        let published = Effect {
            channel: Channel::Requests,
            payload: String::from_utf8(agent_schema::encode(&next)).unwrap(),
            properties: BTreeMap::new(),
            history_from_input: None,
        };
        let journaled = published.compacted(&input);
        assert_eq!(journaled.history_from_input, Some(8));
        // One step's size, not the dialog's.
        assert!(journaled.payload.len() < published.payload.len() / 5);
        assert_eq!(journaled.expanded(&input).unwrap(), published);
        // Another input (it cannot happen for one message) is refused, not guessed.
        assert!(journaled.expanded(&input[..3]).is_err());
        // A request that does not continue the input (a subagent's) is kept whole.
        let other = AgentRequest {
            question: "sub".into(),
            history: vec![step("elsewhere")],
            ..AgentRequest::default()
        };
        let spawned = Effect {
            payload: String::from_utf8(agent_schema::encode(&other)).unwrap(),
            ..published.clone()
        };
        assert_eq!(spawned.compacted(&input), spawned);
        // Responses are never touched.
        let response = Effect {
            channel: Channel::Responses,
            ..published.clone()
        };
        assert_eq!(response.compacted(&input), response);
    }

    #[test]
    fn a_copy_of_a_resumption_re_emits_the_request_the_first_published() {
        let continuation = AgentRequest {
            question: "Q".into(),
            session_id: "sup".into(),
            pattern: "supervisor".into(),
            ..AgentRequest::default()
        };
        let resumed = |result: &str| {
            agent_core::supervisor::synthesis_request(
                &continuation,
                [("00. a".to_owned(), result.to_owned())].into(),
                &[],
            )
        };
        let (first, copy) = (resumed("partial"), resumed("complete"));
        // The first's step queued one more (a draft for the answer critic, say).
        let next = AgentRequest {
            history: first
                .history
                .iter()
                .cloned()
                .chain([AgentStep {
                    thought: "draft".into(),
                    ..AgentStep::default()
                }])
                .collect(),
            ..first.clone()
        };
        let published = Effect {
            channel: Channel::Requests,
            payload: String::from_utf8(agent_schema::encode(&next)).unwrap(),
            properties: BTreeMap::new(),
            history_from_input: None,
        };
        let journaled = published.compacted(&first.history);
        assert_eq!(journaled.expanded(&copy.history).unwrap(), published);
        assert_eq!(journaled.expanded(&first.history).unwrap(), published);
    }

    fn deflated(bytes: &[u8]) -> String {
        use base64::Engine;
        use std::io::Write;
        let mut deflater =
            flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::fast());
        deflater.write_all(bytes).unwrap();
        base64::engine::general_purpose::STANDARD.encode(deflater.finish().unwrap())
    }

    #[test]
    fn outcomes_are_stored_compressed_and_read_back_whole() {
        let effect = Effect {
            channel: Channel::Explainability,
            payload: format!(
                "{{\"triples\": [{}]}}",
                vec!["{\"s\": \"urn:x\"}"; 200].join(",")
            ),
            properties: [("id".to_owned(), "c".to_owned())].into(),
            history_from_input: Some(3),
        };
        let effects = vec![
            effect.clone(),
            Effect {
                channel: Channel::Responses,
                ..effect
            },
        ];
        let encoded = encode_outcome(&effects).unwrap();
        assert!(encoded.starts_with(FRAMED));
        let plain = serde_json::to_string(&effects).unwrap();
        assert!(
            encoded.len() * 5 < plain.len(),
            "{} vs {}",
            encoded.len(),
            plain.len()
        );
        assert_eq!(decode_outcome(&encoded).unwrap(), effects);
        // Entries written before zstd (the same frames deflated), before framing (one deflated
        // JSON document) or before deflating (plain JSON) are still read.
        let frames = frames_of(&effects).unwrap();
        let framed_deflated = format!("{FRAMED_DEFLATED}{}", deflated(&frames));
        assert_eq!(decode_outcome(&framed_deflated).unwrap(), effects);
        let document = format!("{DEFLATED}{}", deflated(plain.as_bytes()));
        assert_eq!(decode_outcome(&document).unwrap(), effects);
        assert_eq!(decode_outcome(&plain).unwrap(), effects);
        assert!(decode_outcome("deflate+base64:not base64!").is_err());
        assert!(decode_outcome("frames+zstd+base64:bm90IHpzdGQ=").is_err());
        // A frame cut short is an error, never a shorter outcome, in either framed form.
        let cut = &frames[..frames.len() - 1];
        let cut_compressed = {
            use base64::Engine;
            let compressed = zstd::bulk::compress(cut, ZSTD_LEVEL).unwrap();
            format!(
                "{FRAMED}{}",
                base64::engine::general_purpose::STANDARD.encode(compressed)
            )
        };
        assert!(decode_outcome(&cut_compressed).is_err());
        assert!(decode_outcome(&format!("{FRAMED_DEFLATED}{}", deflated(cut))).is_err());
    }

    fn outcome(effect: Effect) -> Outcome {
        Outcome::encode(vec![effect]).unwrap()
    }

    #[tokio::test]
    async fn the_first_outcome_recorded_stands() {
        let journal = Journal::new(agent_graph::GraphStore::in_memory().unwrap().journal());
        let node = entry_node("urn:trustgraph:agent:s", "i1-x").unwrap();
        assert_eq!(journal.entry(&node).await.unwrap(), None);
        let effect = |payload: &str| Effect {
            channel: Channel::Requests,
            payload: payload.to_owned(),
            properties: [("id".to_owned(), "c".to_owned())].into(),
            history_from_input: None,
        };
        let first = journal
            .record(
                &node,
                outcome(effect("{\"a\": 1}")),
                "m1",
                "a1",
                Vec::new(),
                None,
            )
            .await
            .unwrap();
        assert_eq!((first.attempt.as_str(), first.published), ("a1", false));
        let second = journal
            .record(
                &node,
                outcome(effect("{\"b\": 2}")),
                "m2",
                "a2",
                Vec::new(),
                None,
            )
            .await
            .unwrap();
        assert_eq!(second.attempt, "a1", "the first writer wins");
        assert_eq!(second.effects, [effect("{\"a\": 1}")]);
        journal.mark_published(&node).await.unwrap();
        assert!(journal.entry(&node).await.unwrap().unwrap().published);
    }

    #[tokio::test]
    async fn an_entry_in_a_form_this_build_cannot_read_is_neither_published_nor_replaced() {
        let book = agent_graph::GraphStore::in_memory().unwrap().journal();
        let journal = Journal::new(book.clone());
        let node = entry_node("urn:trustgraph:agent:s", "i2-x").unwrap();
        // What a later build might write: a form this one does not know.
        book.record(RecordRequest {
            entry: node.as_str().to_owned(),
            outcome: "frames+future+base64:AAAA".to_owned(),
            delivery: "m1".to_owned(),
            attempt: "a1".to_owned(),
            next: Vec::new(),
            ends: None,
        })
        .await
        .unwrap();
        let unreadable = |e: anyhow::Error| {
            e.downcast_ref::<UnreadableEntry>()
                .is_some_and(|u| u.entry == node.as_str())
        };
        // Before the step runs, and when its record finds the entry in its way.
        assert!(unreadable(journal.entry(&node).await.unwrap_err()));
        let effect = Effect {
            channel: Channel::Requests,
            payload: "{}".to_owned(),
            properties: Default::default(),
            history_from_input: None,
        };
        assert!(unreadable(
            journal
                .record(&node, outcome(effect), "m2", "a2", Vec::new(), None)
                .await
                .unwrap_err()
        ));
        // The entry that stands is still the other build's.
        let stored = book.entry(&node).await.unwrap().unwrap();
        assert_eq!(stored.attempt, "a1");
        assert!(!stored.published);
    }
}
