//! The effectively-once journal's store side: one entry per step, first writer wins. The
//! first-writer-wins decision is made in the one process that owns the journal (the aggregator, or
//! whoever holds an embedded store), by locking the step's key there around a read and a plain
//! insert. So the store needs no isolation of its own: any SPARQL 1.1 server can hold the entries.
//! Everyone else reaches the owner's journal API over HTTP (`/journal/...`), one call per record
//! (or directly when the owner runs in the same process: `in_process`).

use std::sync::Arc;

use oxigraph::model::{Literal, NamedNode, Quad, Term};
use serde::{Deserialize, Serialize};

use crate::remote::RemoteSparql;
use crate::{GraphError, GraphStore};
use agent_core::vocab::{tg, NamedNodeRef, JOURNAL_GRAPH};

/// An entry as the journal keeps it; the outcome is opaque here (its writer's JSON).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JournalEntry {
    pub outcome: String,
    /// The broker's id of the delivery that recorded it.
    pub delivery: String,
    /// Which attempt of that delivery recorded it.
    pub attempt: String,
    /// When it was recorded (RFC 3339).
    #[serde(default)]
    pub recorded_at: Option<String>,
    #[serde(default)]
    pub published: bool,
}

/// A step taken up: its entry, the broker's id of the message it is run from (a chain's root,
/// for a step continued in process), and a token of the process taking it up, the same on each of
/// its retries of that message (see `takings`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TakingRef {
    pub entry: String,
    pub delivery: String,
    pub taker: String,
}

/// Several steps taken up (batched).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TakingRefs {
    pub takings: Vec<TakingRef>,
}

/// A step's entry looked up as it is taken up: what stands, and when nothing does, how many
/// processes have taken the step up from that message without an outcome, this one included
/// (see `takings`). Zero when an entry stands, or from an owner that does not count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taking {
    pub entry: Option<JournalEntry>,
    #[serde(default)]
    pub takings: u32,
}

/// A request to record `outcome` as the step `entry`'s, unless one is recorded already.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordRequest {
    pub entry: String,
    pub outcome: String,
    pub delivery: String,
    pub attempt: String,
    /// The entries of the steps the outcome's requests will be taken up as (its next iteration,
    /// its subagents), when the recorder knows them: see [`ExpectedSteps`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub next: Vec<String>,
    /// The session (its id, not its URI) of the conversation's dialog the outcome ends, if it
    /// ends one (an id longer than [`crate::turns::MAX_ID_BYTES`] is not kept): the owner
    /// keeps that it ended for the conversation's next dialog (see [`crate::turns`]), which the
    /// graph shows only once the conclusion has travelled there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ends: Option<String>,
}

/// Names one entry (lookups and the published mark).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EntryRef {
    pub entry: String,
}

/// Names several entries (batched lookups and marks).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EntryRefs {
    pub entries: Vec<String>,
}

/// Several records, decided in one call; the entries that stand come back in the same order.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RecordRequests {
    pub records: Vec<RecordRequest>,
}

/// The most calls of one kind a remote journal sends together.
pub const MAX_BATCH: usize = 64;

/// The longest entry, delivery id or taker a taking may name: the owner keeps these names while
/// a step is unrecorded, and refuses a call that names a longer one (every taking in its batch).
pub const MAX_TAKING_NAME: usize = 1024;

/// How many locks the keys are spread over: records of different steps rarely wait for each
/// other, records of one step always do.
const STRIPES: usize = 64;

/// Shared by every owner in the process, so two handles on one store cannot both win.
static STRIPE_LOCKS: [tokio::sync::Mutex<()>; STRIPES] =
    [const { tokio::sync::Mutex::const_new(()) }; STRIPES];

/// Steps whose entry's write to a SPARQL server failed without saying whether it was applied (a
/// timeout, a connection lost, a proxy's 502): the server may still commit it, later, beside the
/// entry a retry of the step would write, and a step would then hold two outcomes. While one is
/// in doubt, what stands for it is not told from a read that finds nothing: its lookups and
/// records fail as an outage (the step waits, its LLM not asked again) until a read finds the
/// entry, [`IN_DOUBT_FOR`] has passed since the failure, or the read began after the server
/// refused a connection that came after the failure: the process that may have held the write
/// had stopped (a crash, a restart), so the read is the truth. Without that, every step whose
/// write a store's crash cut waited the whole minute after the store was back.
struct InDoubt {
    since: std::collections::HashMap<(u64, String), std::time::Instant>,
}

/// How long a failed write stays in doubt: a write still queued on the server commits within it,
/// or not at all. Well within the outage a step waits out (`max_outage_secs`, 300 by default).
const IN_DOUBT_FOR: std::time::Duration = std::time::Duration::from_secs(60);
/// The most steps in doubt remembered (a store down for long fails every write).
const MOST_IN_DOUBT: usize = 65_536;

static IN_DOUBT: std::sync::LazyLock<std::sync::Mutex<InDoubt>> = std::sync::LazyLock::new(|| {
    std::sync::Mutex::new(InDoubt {
        since: Default::default(),
    })
});
/// Whether any step is in doubt: read without the lock on every lookup.
static ANY_IN_DOUBT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl InDoubt {
    fn lock() -> std::sync::MutexGuard<'static, InDoubt> {
        IN_DOUBT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `nodes`, whose write to the store `identity` failed just now, are in doubt.
    fn mark<'a>(identity: u64, nodes: impl Iterator<Item = &'a NamedNode>) {
        let mut doubts = InDoubt::lock();
        let now = std::time::Instant::now();
        doubts
            .since
            .retain(|_, at| now.duration_since(*at) < IN_DOUBT_FOR);
        for node in nodes {
            if doubts.since.len() >= MOST_IN_DOUBT {
                tracing::warn!("more journal writes in doubt than are remembered; a step's later record may not wait for its first");
                break;
            }
            doubts
                .since
                .insert((identity, node.as_str().to_owned()), now);
        }
        ANY_IN_DOUBT.store(
            !doubts.since.is_empty(),
            std::sync::atomic::Ordering::SeqCst,
        );
    }

    /// Of what a read of the store `identity` found for `nodes`: an outage if a step found without
    /// an entry is in doubt; a step found with one is in doubt no more, nor one whose doubt began
    /// before the server last `refused` a connection ahead of the read.
    fn check(
        identity: u64,
        nodes: &[NamedNode],
        read: &[Option<JournalEntry>],
        refused: Option<std::time::Instant>,
    ) -> Result<(), GraphError> {
        if !ANY_IN_DOUBT.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        let mut doubts = InDoubt::lock();
        let mut waiting = None;
        for (node, found) in nodes.iter().zip(read) {
            let key = (identity, node.as_str().to_owned());
            let Some(since) = doubts.since.get(&key) else {
                continue;
            };
            let server_restarted = refused.is_some_and(|refused| refused > *since);
            if found.is_some() || server_restarted || since.elapsed() >= IN_DOUBT_FOR {
                doubts.since.remove(&key);
            } else {
                waiting.get_or_insert(node.as_str().to_owned());
            }
        }
        ANY_IN_DOUBT.store(
            !doubts.since.is_empty(),
            std::sync::atomic::Ordering::SeqCst,
        );
        match waiting {
            None => Ok(()),
            Some(node) => Err(GraphError::Http {
                status: 503,
                body: format!(
                    "the journal's write of {node} failed without saying whether the store applied it; it is waited for, up to {} s",
                    IN_DOUBT_FOR.as_secs()
                ),
            }),
        }
    }
}

/// How many expected steps are remembered: far more than the steps in flight, so one is
/// forgotten before it is taken up (and its lookup then reads the store) only if its dialog stalled.
const EXPECTED_STEPS: usize = 65_536;

/// The most next steps one record may name (a fan-out's subagents); more are not remembered.
const MAX_NEXT: usize = 256;

/// The longest step name remembered as expected (an orchestrator's are a few hundred bytes);
/// longer ones are not, so the set's memory is bounded by more than its count.
const MAX_EXPECTED_NAME_BYTES: usize = 1024;

/// Steps known to have no entry without reading the store: the next steps of outcomes this
/// process wrote into a store, not recorded since. Such a step's message can exist only once the
/// outcome that carries it was recorded (an outcome is published only after its record), and
/// every record goes through the owner, which forgets a step (for every store) as it records it;
/// so until then nothing can have been recorded for it, and its first lookup is answered without a
/// read (one store read, or one query to a SPARQL server, less a step). The answer only spares a
/// lookup: a record still reads what stands, under the key's lock, so a wrong "nothing yet" (an
/// entry pruned and its step's message come back, which makes its next steps expected again while
/// their own entries stand) could only cost a step's work, never a second outcome. Kept for the
/// whole process, as the locks are, and by store (`GraphStore::identity`): a step expected of one
/// store says nothing of another. Bounded, oldest forgotten first; forgetting only costs reads.
struct ExpectedSteps {
    /// For each step, the stores it is expected of, and whether it was looked up there yet.
    entries: std::collections::HashMap<Arc<str>, Vec<Expected>>,
    oldest_first: std::collections::VecDeque<Arc<str>>,
}

struct Expected {
    store: u64,
    looked_up: bool,
}

static EXPECTED: std::sync::LazyLock<std::sync::Mutex<ExpectedSteps>> =
    std::sync::LazyLock::new(|| {
        std::sync::Mutex::new(ExpectedSteps {
            entries: Default::default(),
            oldest_first: Default::default(),
        })
    });

fn expected() -> std::sync::MutexGuard<'static, ExpectedSteps> {
    // Every holder leaves the set whole: a poisoned lock still guards a sound set.
    EXPECTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl ExpectedSteps {
    fn expect<'e>(store: u64, entries: impl Iterator<Item = &'e str>) {
        let mut known = expected();
        let named = entries.filter(|e| e.len() <= MAX_EXPECTED_NAME_BYTES && node(e).is_ok());
        for entry in named {
            let entry: Arc<str> = Arc::from(entry);
            let stores = known.entries.entry(entry.clone()).or_default();
            let new = stores.is_empty();
            if !stores.iter().any(|e| e.store == store) {
                stores.push(Expected {
                    store,
                    looked_up: false,
                });
            }
            if new {
                known.oldest_first.push_back(entry);
            }
        }
        while known.oldest_first.len() > EXPECTED_STEPS {
            if let Some(oldest) = known.oldest_first.pop_front() {
                known.entries.remove(&oldest);
            }
        }
    }

    /// Forgets each of `entries` for every store, as they are recorded (under their keys' locks).
    fn recorded(entries: &[NamedNode]) {
        let mut known = expected();
        for entry in entries {
            known.entries.remove(entry.as_str());
        }
    }

    /// Whether `entry` is expected of `store` and not looked up there yet: only the first lookup
    /// is answered without a read. A second one is a copy or a redelivery of the step, which may
    /// overlap a delivery that is running it; it reads what stands, as before (on a slow store,
    /// answering it at once would let copies reach the LLM that a read would have stopped).
    fn first_lookup(store: u64, entry: &NamedNode) -> bool {
        let mut known = expected();
        let Some(here) = known
            .entries
            .get_mut(entry.as_str())
            .and_then(|stores| stores.iter_mut().find(|e| e.store == store))
        else {
            return false;
        };
        !std::mem::replace(&mut here.looked_up, true)
    }
}

/// A process's word that it is still running the chains it names (an orchestrator that continues
/// dialogs in process: each chain is named by the broker message that started it, its root). A
/// redelivery of a root, handed to another replica by a broker restart while the chain still runs,
/// finds its steps recorded by the root's own delivery; without this word it could not tell a
/// chain whose process died (re-emit and go on) from one still running (wait, or the rest of the
/// dialog runs twice). Held by the owner in memory, for [`ChainBeat::for_ms`] of its own clock:
/// an owner that restarts forgets them until the next beats, and a wrong "not held" only costs
/// steps run twice (their first record still stands), never a second outcome.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChainBeat {
    /// The beating process, named once at its start.
    pub process: String,
    /// The roots of the chains it runs; empty when it runs none any more.
    pub holding: Vec<String>,
    /// How long the word holds without another beat.
    pub for_ms: u64,
}

/// Names chains by their roots (asking which are held).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChainRefs {
    pub chains: Vec<String>,
    /// A process whose own beats do not count (the asker's: a chain of its own that finds a step
    /// recorded by another line of the same chain must not wait for itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub except: Option<String>,
}

/// The most chains one beat may name: far more than a process keeps in flight.
pub const MAX_CHAINS_HELD: usize = 4096;

/// The most processes whose beats are kept at once; a beat from one more is refused. Far more
/// orchestrator processes than a deployment runs, and few enough that the beats' memory (each
/// names at most `MAX_CHAINS_HELD` roots of at most `MAX_ROOT_BYTES`) and the cost of asking
/// which chains are held stay bounded.
const MAX_BEATING: usize = 256;

/// The longest one beat may hold.
const MAX_BEAT: std::time::Duration = std::time::Duration::from_secs(60);

/// The longest root a beat may name (an orchestrator names a chain by its session's URI and a
/// broker's message id: a few hundred bytes at most); longer ones are not kept, so a beat's
/// memory is bounded by more than its count.
const MAX_ROOT_BYTES: usize = 1024;

/// For this long after it first hears of chains, an owner answers every chain held: one that
/// just started (or took over) has not heard the beats of the processes running chains yet, and
/// "not held" then would let a copy run beside a live chain.
const WARM_UP: std::time::Duration = std::time::Duration::from_secs(5);

/// When this process first heard of chains (a beat or a question).
static FIRST_HEARD: std::sync::LazyLock<tokio::time::Instant> =
    std::sync::LazyLock::new(tokio::time::Instant::now);

/// Each beating process's chains, until when (the owner's clock).
type Beats =
    std::collections::HashMap<String, (tokio::time::Instant, std::collections::HashSet<String>)>;

/// Kept for the whole process, as the locks are, so two owner handles share it.
static BEATS: std::sync::LazyLock<std::sync::Mutex<Beats>> =
    std::sync::LazyLock::new(Default::default);

fn beats() -> std::sync::MutexGuard<'static, Beats> {
    // Every holder leaves the map whole: a poisoned lock still guards a sound map.
    BEATS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

pub(crate) fn take_beat(beat: ChainBeat) -> Result<(), GraphError> {
    if beat.process.len() > MAX_ROOT_BYTES {
        return Err(GraphError::Malformed(format!(
            "a beating process's name is at most {MAX_ROOT_BYTES} bytes"
        )));
    }
    std::sync::LazyLock::force(&FIRST_HEARD);
    let now = tokio::time::Instant::now();
    let mut beats = beats();
    beats.retain(|_, (until, _)| *until > now);
    if beat.holding.is_empty() {
        beats.remove(&beat.process);
        return Ok(());
    }
    if beats.len() >= MAX_BEATING && !beats.contains_key(&beat.process) {
        return Err(GraphError::Storage(format!(
            "the journal keeps the beats of at most {MAX_BEATING} processes"
        )));
    }
    let lasts = std::time::Duration::from_millis(beat.for_ms).min(MAX_BEAT);
    // The journal API refuses more; a caller in process is held to the same bound.
    let holding = beat
        .holding
        .into_iter()
        .filter(|root| root.len() <= MAX_ROOT_BYTES)
        .take(MAX_CHAINS_HELD)
        .collect();
    beats.insert(beat.process, (now + lasts, holding));
    Ok(())
}

pub(crate) fn held_now(asked: &ChainRefs) -> Vec<bool> {
    held_since(asked, *FIRST_HEARD)
}

/// [`held_now`] for an owner that first heard of chains at `first_heard`.
fn held_since(asked: &ChainRefs, first_heard: tokio::time::Instant) -> Vec<bool> {
    let now = tokio::time::Instant::now();
    if now < first_heard + WARM_UP {
        return vec![true; asked.chains.len()];
    }
    let beats = beats();
    let live: Vec<&std::collections::HashSet<String>> = beats
        .iter()
        .filter(|(process, (until, _))| {
            *until > now && asked.except.as_deref() != Some(process.as_str())
        })
        .map(|(_, (_, holding))| holding)
        .collect();
    let chains = &asked.chains;
    chains
        .iter()
        // A longer root is never kept, so it is not looked up (each look-up hashes it again).
        .map(|chain| chain.len() <= MAX_ROOT_BYTES && live.iter().any(|h| h.contains(chain)))
        .collect()
}

fn stripe_of(entry: &NamedNode) -> usize {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    entry.as_str().hash(&mut hasher);
    // The modulo keeps the index below STRIPES, so the index is always in range.
    (hasher.finish() % STRIPES as u64) as usize
}

/// A journal: owned here over a store, or another process's reached over HTTP.
#[derive(Clone)]
pub enum Journal {
    /// This process decides who wins; `store` only keeps the entries.
    Owner(GraphStore),
    /// The owner's journal API (an aggregator's endpoint).
    Remote(Arc<RemoteSparql>),
}

fn text(term: Option<&Term>) -> String {
    match term {
        Some(Term::Literal(l)) => l.value().to_owned(),
        Some(Term::NamedNode(n)) => n.as_str().to_owned(),
        _ => String::new(),
    }
}

pub(crate) fn node(entry: &str) -> Result<NamedNode, GraphError> {
    NamedNode::new(entry).map_err(|e| GraphError::Syntax(format!("not a journal entry: {e}")))
}

impl Journal {
    /// The entry of a step, if one was recorded.
    pub async fn entry(&self, entry: &NamedNode) -> Result<Option<JournalEntry>, GraphError> {
        match self {
            Journal::Owner(_) => Ok(self
                .entries(std::slice::from_ref(entry))
                .await?
                .pop()
                .flatten()),
            Journal::Remote(remote) => remote.journal_entry(entry.as_str()).await,
        }
    }

    /// Whether this is an owner's first lookup of a step it expects: nothing can stand for it, and
    /// no read is needed to say so (see [`ExpectedSteps`]).
    pub(crate) fn first_lookup_expected(&self, entry: &NamedNode) -> bool {
        match self {
            Journal::Owner(store) => ExpectedSteps::first_lookup(store.identity, entry),
            Journal::Remote(_) => false,
        }
    }

    /// The entries of several steps, in order (`None` where nothing was recorded).
    pub async fn entries(
        &self,
        entries: &[NamedNode],
    ) -> Result<Vec<Option<JournalEntry>>, GraphError> {
        match self {
            // One read of the store for all the steps not expected.
            Journal::Owner(store) => {
                let expected: Vec<bool> = entries
                    .iter()
                    .map(|entry| ExpectedSteps::first_lookup(store.identity, entry))
                    .collect();
                let unknown: Vec<NamedNode> = entries
                    .iter()
                    .zip(&expected)
                    .filter(|(_, expected)| !**expected)
                    .map(|(entry, _)| entry.clone())
                    .collect();
                // `stored_entries` reads nothing for no entries.
                let stored = stored_unless_in_doubt(store, &unknown).await?;
                let mut stored = stored.into_iter();
                Ok(expected
                    .iter()
                    .map(|&expected| {
                        if expected {
                            None
                        } else {
                            stored.next().flatten()
                        }
                    })
                    .collect())
            }
            // Made together, the calls share the remote's batches.
            Journal::Remote(_) => {
                futures::future::try_join_all(entries.iter().map(|entry| self.entry(entry))).await
            }
        }
    }

    /// The entry of a step being taken up, its taking counted when none stands.
    pub async fn take(&self, taking: &TakingRef) -> Result<Taking, GraphError> {
        match self {
            Journal::Owner(_) => self
                .take_all(std::slice::from_ref(taking))
                .await?
                .pop()
                .ok_or_else(|| {
                    GraphError::Storage("a taking was looked up without an answer".to_owned())
                }),
            Journal::Remote(remote) => remote.journal_take(taking.clone()).await,
        }
    }

    /// [`Journal::take`] for several steps, in order.
    pub async fn take_all(&self, takings: &[TakingRef]) -> Result<Vec<Taking>, GraphError> {
        match self {
            Journal::Owner(store) => {
                let entries = takings
                    .iter()
                    .map(|t| node(&t.entry))
                    .collect::<Result<Vec<_>, _>>()?;
                let found = self.entries(&entries).await?;
                Ok(found
                    .into_iter()
                    .zip(takings)
                    .map(|(entry, taking)| {
                        let takings = match entry {
                            Some(_) => 0,
                            None => count_taking(store.identity, taking),
                        };
                        Taking { entry, takings }
                    })
                    .collect())
            }
            // Made together, the calls share the remote's batches.
            Journal::Remote(_) => {
                futures::future::try_join_all(takings.iter().map(|taking| self.take(taking))).await
            }
        }
    }

    /// [`Journal::take`] of a step this owner knows has no entry: its first lookup of a step it
    /// expects (see [`ExpectedSteps`]), counted, or `None` (a journal that is not an owner's,
    /// or a step it does not expect, is asked as any other).
    pub(crate) fn take_expected(&self, taking: &TakingRef) -> Option<Taking> {
        let Journal::Owner(store) = self else {
            return None;
        };
        let entry = node(&taking.entry).ok()?;
        ExpectedSteps::first_lookup(store.identity, &entry).then(|| Taking {
            entry: None,
            takings: count_taking(store.identity, taking),
        })
    }

    /// Records the outcome unless another is recorded; returns the entry that stands (its
    /// `attempt` says whose it is).
    pub async fn record(&self, request: RecordRequest) -> Result<JournalEntry, GraphError> {
        match self {
            Journal::Owner(store) => {
                let mut standing = record_all(store, vec![request]).await?;
                standing.pop().ok_or_else(|| {
                    GraphError::Storage("a record was decided without an answer".to_owned())
                })
            }
            Journal::Remote(remote) => remote.journal_record(request).await,
        }
    }

    /// Records several steps' outcomes at once, each unless another is recorded (the first of
    /// two records of one step in the same call stands): the entries that stand, in order. The
    /// new entries are written in one store transaction.
    pub async fn record_all(
        &self,
        requests: Vec<RecordRequest>,
    ) -> Result<Vec<JournalEntry>, GraphError> {
        match self {
            Journal::Owner(store) => record_all(store, requests).await,
            // Made together, the calls share the remote's batches.
            Journal::Remote(remote) => {
                futures::future::try_join_all(
                    requests.into_iter().map(|r| remote.journal_record(r)),
                )
                .await
            }
        }
    }

    /// [`Journal::record_all`], telling `stood` of each record whether it is the one that stands
    /// (the owner's metric of first records and of copies that found one).
    pub async fn record_all_reporting(
        &self,
        requests: Vec<RecordRequest>,
        stood: fn(bool),
    ) -> Result<Vec<JournalEntry>, GraphError> {
        let attempts: Vec<String> = requests.iter().map(|r| r.attempt.clone()).collect();
        let standing = self.record_all(requests).await?;
        for (entry, attempt) in standing.iter().zip(&attempts) {
            stood(&entry.attempt == attempt);
        }
        Ok(standing)
    }

    /// Marks the step's outcome as published.
    pub async fn mark_published(&self, entry: &NamedNode) -> Result<(), GraphError> {
        match self {
            Journal::Owner(_) => self.mark_all_published(std::slice::from_ref(entry)).await,
            Journal::Remote(remote) => remote.journal_published(entry.as_str()).await,
        }
    }

    /// Marks several steps' outcomes as published, in one store transaction.
    pub async fn mark_all_published(&self, entries: &[NamedNode]) -> Result<(), GraphError> {
        match self {
            Journal::Owner(store) => {
                let graph = NamedNode::new_unchecked(JOURNAL_GRAPH);
                let marks = entries
                    .iter()
                    .map(|entry| {
                        Quad::new(
                            entry.clone(),
                            tg::PUBLISHED,
                            Literal::from(true),
                            graph.clone(),
                        )
                    })
                    .collect();
                store.insert(marks).await
            }
            Journal::Remote(remote) => futures::future::try_join_all(
                entries.iter().map(|e| remote.journal_published(e.as_str())),
            )
            .await
            .map(|_| ()),
        }
    }

    /// Tells the owner that `beat.process` still runs the chains it names (see [`ChainBeat`]).
    pub async fn beat(&self, beat: ChainBeat) -> Result<(), GraphError> {
        match self {
            Journal::Owner(_) => take_beat(beat),
            Journal::Remote(remote) => remote.journal_beat(beat).await,
        }
    }

    /// Whether a live process (other than `asked.except`) says it still runs each chain named,
    /// in order.
    pub async fn held(&self, asked: ChainRefs) -> Result<Vec<bool>, GraphError> {
        match self {
            Journal::Owner(_) => Ok(held_now(&asked)),
            Journal::Remote(remote) => remote.journal_held(asked).await,
        }
    }

    /// A dialog's question to its conversation, whether it may start, and its start when it may
    /// (see [`crate::turns`]).
    pub async fn take_turn(
        &self,
        asked: crate::turns::TurnAsked,
    ) -> Result<crate::turns::Turn, GraphError> {
        match self {
            Journal::Owner(_) => Ok(self.owner_turn(&asked)),
            Journal::Remote(remote) => remote.journal_turn(asked).await,
        }
    }

    /// [`Journal::take_turn`] answered here, by an owner (a journal that is not one keeps the
    /// starts for this process alone).
    pub(crate) fn owner_turn(&self, asked: &crate::turns::TurnAsked) -> crate::turns::Turn {
        match self {
            Journal::Owner(store) => crate::turns::take_turn(store.identity, asked),
            Journal::Remote(remote) => crate::turns::take_turn_here(remote.base(), asked),
        }
    }

    /// Whether the journal can be reached and answers as a journal: a SPARQL server that is not
    /// an aggregator answers its API with 404, which is an error here, not an outage.
    pub async fn check(&self) -> Result<(), GraphError> {
        let probe = NamedNode::new_unchecked("urn:agent:journal-probe");
        self.entry(&probe).await.map(|_| ())
    }
}

/// Counts a taking in the journal over the store `identity` (see `takings`).
fn count_taking(identity: u64, taking: &TakingRef) -> u32 {
    crate::takings::taken(identity, &taking.entry, &taking.delivery, &taking.taker)
}

/// The owner's decision on several records, run to its end even if its caller goes away (an HTTP
/// client that gave up): its insert may already be on its way, so the keys' locks must be held
/// until it is settled, or a retry of the same step could read nothing and write a second entry.
async fn record_all(
    store: &GraphStore,
    requests: Vec<RecordRequest>,
) -> Result<Vec<JournalEntry>, GraphError> {
    let identity = store.identity;
    // An embedded store is decided in one task of the blocking pool, locks, read and write: a
    // record then waits for one hand-over between threads instead of three.
    if let Some(embedded) = store.embedded_writable() {
        return crate::blocking(move || decide_in(identity, &embedded, requests)).await;
    }
    let store = store.clone();
    tokio::spawn(async move { decide(&store, requests).await })
        .await
        .map_err(|e| GraphError::Storage(format!("a journal decision failed: {e}")))?
}

/// A batch of records being decided: each one's key, and the locks they are under.
struct Deciding {
    requests: Vec<RecordRequest>,
    nodes: Vec<NamedNode>,
    stripes: std::collections::BTreeSet<usize>,
}

impl Deciding {
    fn of(requests: Vec<RecordRequest>) -> Result<Deciding, GraphError> {
        let nodes = requests
            .iter()
            .map(|r| node(&r.entry))
            .collect::<Result<Vec<_>, _>>()?;
        let stripes = nodes.iter().map(stripe_of).collect();
        Ok(Deciding {
            requests,
            nodes,
            stripes,
        })
    }

    /// Under the keys' locks, claims the steps for their records: from now on they are no
    /// longer known to have no entry (in any store), nor counted as taken up without one (in
    /// `store`). Returns the steps whose standing entries must be read.
    fn claim(&self, store: u64) -> &[NamedNode] {
        ExpectedSteps::recorded(&self.nodes);
        crate::takings::recorded(store, self.nodes.iter().map(NamedNode::as_str));
        &self.nodes
    }

    /// What stands for each record, given what was read: the first of the store's and the
    /// batch's own. Returns the quads to write and what they tell once written.
    fn settle(self, read: Vec<Option<JournalEntry>>) -> (Vec<JournalEntry>, Vec<Quad>, Written) {
        let now = canonical_instant(chrono::Utc::now());
        let mut decided: std::collections::HashMap<String, JournalEntry> = Default::default();
        let mut writes = Vec::new();
        let mut written = Written::default();
        let mut standing = Vec::with_capacity(self.requests.len());
        for ((request, entry), stored) in self.requests.into_iter().zip(&self.nodes).zip(read) {
            if let Some(first) = decided.get(entry.as_str()) {
                standing.push(first.clone());
                continue;
            }
            let stands = match stored {
                Some(stored) => stored,
                None => {
                    writes.extend(entry_quads(entry, &request, &now));
                    written.next.extend(request.next.into_iter().take(MAX_NEXT));
                    written.ends.extend(
                        request
                            .ends
                            .filter(|session| session.len() <= crate::turns::MAX_ID_BYTES),
                    );
                    JournalEntry {
                        outcome: request.outcome,
                        delivery: request.delivery,
                        attempt: request.attempt,
                        recorded_at: Some(now.clone()),
                        published: false,
                    }
                }
            };
            decided.insert(entry.as_str().to_owned(), stands.clone());
            standing.push(stands);
        }
        (standing, writes, written)
    }
}

/// What the outcomes a batch writes tell the owner once they are written.
#[derive(Default)]
struct Written {
    /// The steps their requests will be taken up as (see [`ExpectedSteps`]).
    next: Vec<String>,
    /// The sessions of the conversations' dialogs they end (see [`crate::turns`]).
    ends: Vec<String>,
}

impl Written {
    /// Only outcomes written here: their requests cannot have been taken up before now, and
    /// their closings are not published before now.
    fn tell(&self, identity: u64) {
        ExpectedSteps::expect(identity, self.next.iter().map(String::as_str));
        crate::turns::note_ended(identity, self.ends.iter().map(String::as_str));
    }
}

/// Every key's lock is held (taken in one order, so two batches cannot wait for each other)
/// around reading what stands and writing what is new. For a SPARQL server (and an embedded
/// store opened for reading, whose writes fail); a writable embedded store is decided by
/// [`decide_in`].
async fn decide(
    store: &GraphStore,
    requests: Vec<RecordRequest>,
) -> Result<Vec<JournalEntry>, GraphError> {
    let deciding = Deciding::of(requests)?;
    let mut _only_writer_of_these_keys = Vec::with_capacity(deciding.stripes.len());
    for &index in &deciding.stripes {
        _only_writer_of_these_keys.push(STRIPE_LOCKS[index].lock().await);
    }
    let read = stored_unless_in_doubt(store, deciding.claim(store.identity)).await?;
    let unwritten: Vec<NamedNode> = deciding
        .nodes
        .iter()
        .zip(&read)
        .filter(|(_, stored)| stored.is_none())
        .map(|(node, _)| node.clone())
        .collect();
    let (standing, writes, written) = deciding.settle(read);
    if !writes.is_empty() {
        if let Err(e) = store.insert(writes).await {
            // Only a failure on the way may have been applied: a refusal (a 4xx, a store opened
            // for reading) was not.
            let may_have_been_applied = match &e {
                GraphError::Transport(_) | GraphError::Storage(_) | GraphError::TimedOut(_) => true,
                GraphError::Http { status, .. } => *status >= 500,
                _ => false,
            };
            if may_have_been_applied {
                InDoubt::mark(store.identity, unwritten.iter());
            }
            return Err(e);
        }
        written.tell(store.identity);
    }
    Ok(standing)
}

/// What `store` holds for `nodes`, read as [`InDoubt`] allows: an outage while a step read
/// without its entry is in doubt.
async fn stored_unless_in_doubt(
    store: &GraphStore,
    nodes: &[NamedNode],
) -> Result<Vec<Option<JournalEntry>>, GraphError> {
    let read_from = std::time::Instant::now();
    let read = stored_entries(store, nodes).await?;
    let refused = store.refused_before(read_from);
    InDoubt::check(store.identity, nodes, &read, refused)?;
    Ok(read)
}

/// [`decide`] for an embedded store, in a thread that may block.
fn decide_in(
    identity: u64,
    store: &oxigraph::store::Store,
    requests: Vec<RecordRequest>,
) -> Result<Vec<JournalEntry>, GraphError> {
    let deciding = Deciding::of(requests)?;
    let _only_writer_of_these_keys: Vec<_> = deciding
        .stripes
        .iter()
        .map(|&index| STRIPE_LOCKS[index].blocking_lock())
        .collect();
    let read = stored_entries_in(store, deciding.claim(identity))?;
    let (standing, writes, written) = deciding.settle(read);
    if !writes.is_empty() {
        store
            .extend(writes)
            .map_err(|e| GraphError::Storage(e.to_string()))?;
        written.tell(identity);
    }
    Ok(standing)
}

/// `at` as the store gives an `xsd:dateTime` back (its canonical form: no trailing zeros in the
/// fraction of a second), so the entry a record answers equals the entry a later read finds.
fn canonical_instant(at: chrono::DateTime<chrono::Utc>) -> String {
    let micros = at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let Some(stamp) = micros.strip_suffix('Z') else {
        return micros;
    };
    let stamp = stamp.trim_end_matches('0').trim_end_matches('.');
    format!("{stamp}Z")
}

fn entry_quads(entry: &NamedNode, request: &RecordRequest, now: &str) -> Vec<Quad> {
    let graph = NamedNode::new_unchecked(JOURNAL_GRAPH);
    let quad = |p: NamedNodeRef<'_>, o: Literal| Quad::new(entry.clone(), p, o, graph.clone());
    vec![
        quad(tg::OUTCOME, Literal::new_simple_literal(&request.outcome)),
        quad(tg::DELIVERY, Literal::new_simple_literal(&request.delivery)),
        quad(tg::ATTEMPT, Literal::new_simple_literal(&request.attempt)),
        quad(
            tg::RECORDED_AT,
            Literal::new_typed_literal(now, oxigraph::model::vocab::xsd::DATE_TIME),
        ),
    ]
}

/// How many pages of entries one search for entries that may go finds: the search reads every
/// entry the journal holds (no index orders them by time), so searching once a page would read
/// the entries that stay once for each page deleted.
const PAGES_A_SEARCH: usize = 64;

/// Deletes the journal entries that may go (see [`crate::queries::journal_prunable`]; times are
/// `xsd:dateTime` texts), `page` entries an update, until none is left: each update is small, so
/// it holds the store's turn for updates (a fan-in's claim waits on it) for a moment only, keeps
/// a transaction's memory small, and stays within an endpoint's time limit whatever the journal
/// holds. Returns how many entries went. Dropped, it leaves whole entries (an update is atomic).
pub async fn prune(
    store: &GraphStore,
    finished_before: &str,
    any_before: &str,
    page: usize,
) -> Result<usize, GraphError> {
    let page = page.max(1);
    let most = page.saturating_mul(PAGES_A_SEARCH);
    let mut pruned = 0;
    let mut last: Vec<NamedNode> = Vec::new();
    loop {
        let found = store
            .query(crate::queries::journal_prunable(
                finished_before,
                any_before,
                most,
            ))
            .await?
            .rows();
        let entries: Vec<NamedNode> = found
            .column("e")
            .into_iter()
            .filter_map(|e| match e {
                Some(Term::NamedNode(n)) => Some(n.clone()),
                _ => None,
            })
            .collect();
        if entries.is_empty() {
            return Ok(pruned);
        }
        // A store that takes the delete and keeps the entries would be asked for ever.
        if entries == last {
            return Err(GraphError::Evaluation(format!(
                "the store kept {} journal entries it was asked to delete",
                entries.len()
            )));
        }
        for chunk in entries.chunks(page) {
            store.update(crate::queries::journal_delete(chunk)).await?;
            pruned += chunk.len();
        }
        if entries.len() < most {
            return Ok(pruned);
        }
        last = entries;
    }
}

/// The entry of a step as `store` holds it, read without deciding anything: what a client uses
/// to read back a message it lost.
pub async fn read_entry(
    store: &GraphStore,
    entry: &NamedNode,
) -> Result<Option<JournalEntry>, GraphError> {
    Ok(stored_entries(store, std::slice::from_ref(entry))
        .await?
        .pop()
        .flatten())
}

/// The entries of `entries` as the store holds them, in order, read in one pass.
async fn stored_entries(
    store: &GraphStore,
    entries: &[NamedNode],
) -> Result<Vec<Option<JournalEntry>>, GraphError> {
    let said = store
        .about_each(entries, &NamedNode::new_unchecked(JOURNAL_GRAPH))
        .await?;
    Ok(said.iter().map(|said| entry_of(said)).collect())
}

/// [`stored_entries`] of an embedded store, in the calling thread.
fn stored_entries_in(
    store: &oxigraph::store::Store,
    entries: &[NamedNode],
) -> Result<Vec<Option<JournalEntry>>, GraphError> {
    let said = crate::about_each_in(store, entries, &NamedNode::new_unchecked(JOURNAL_GRAPH))?;
    Ok(said.iter().map(|said| entry_of(said)).collect())
}

fn entry_of(said: &[(NamedNode, Term)]) -> Option<JournalEntry> {
    let value = |predicate: NamedNodeRef<'_>| {
        said.iter()
            .find(|(p, _)| p.as_ref() == predicate)
            .map(|(_, o)| text(Some(o)))
    };
    let outcome = value(tg::OUTCOME)?;
    Some(JournalEntry {
        outcome,
        delivery: value(tg::DELIVERY).unwrap_or_default(),
        attempt: value(tg::ATTEMPT).unwrap_or_default(),
        recorded_at: value(tg::RECORDED_AT),
        published: value(tg::PUBLISHED).is_some(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(process: &str, holding: &[&str], for_ms: u64) -> ChainBeat {
        ChainBeat {
            process: process.into(),
            holding: holding.iter().map(|c| (*c).to_owned()).collect(),
            for_ms,
        }
    }

    fn refs(chains: &[&str], except: Option<&str>) -> ChainRefs {
        ChainRefs {
            chains: chains.iter().map(|c| (*c).to_owned()).collect(),
            except: except.map(str::to_owned),
        }
    }

    /// As an owner past its warm-up answers.
    fn held_by(chains: &[&str], except: Option<&str>) -> Vec<bool> {
        let long_ago = tokio::time::Instant::now()
            .checked_sub(WARM_UP * 2)
            .unwrap();
        held_since(&refs(chains, except), long_ago)
    }

    fn held(chains: &[&str]) -> Vec<bool> {
        held_by(chains, None)
    }

    #[tokio::test]
    async fn a_beat_holds_its_chains_until_it_lapses_and_an_empty_one_lets_go_at_once() {
        let store = Journal::Owner(GraphStore::in_memory().unwrap());
        assert_eq!(held(&["beat-test-a", "beat-test-b"]), [false, false]);
        store
            .beat(beat("beat-test-p1", &["beat-test-a"], 60_000))
            .await
            .unwrap();
        take_beat(beat("beat-test-p2", &["beat-test-b"], 1_000)).unwrap();
        assert_eq!(held(&["beat-test-a", "beat-test-b"]), [true, true]);
        // A process's own beats do not hold a chain for it.
        assert_eq!(
            held_by(&["beat-test-a", "beat-test-b"], Some("beat-test-p1")),
            [false, true]
        );
        // An owner that has only just heard of chains holds every one asked about.
        let asked = refs(&["beat-test-a", "beat-test-unknown"], Some("beat-test-p1"));
        assert_eq!(
            held_since(&asked, tokio::time::Instant::now()),
            [true, true]
        );
        // The second beat lapses on its own; the first process says it holds nothing any more.
        tokio::time::sleep(std::time::Duration::from_millis(1_300)).await;
        assert_eq!(held(&["beat-test-a", "beat-test-b"]), [true, false]);
        take_beat(beat("beat-test-p1", &[], 60_000)).unwrap();
        assert_eq!(held(&["beat-test-a"]), [false]);
    }

    #[test]
    fn a_beating_process_with_an_overlong_name_is_refused() {
        let named = |process: String| ChainBeat {
            process,
            holding: vec!["beat-name-root".into()],
            for_ms: 60_000,
        };
        assert!(take_beat(named("p".repeat(MAX_ROOT_BYTES + 1))).is_err());
        assert!(take_beat(named("beat-name-p".into())).is_ok());
        take_beat(beat("beat-name-p", &[], 0)).unwrap();
    }

    #[test]
    fn a_beat_holds_for_a_minute_at_most_and_names_a_bounded_number_of_chains() {
        let mut many: Vec<String> = (0..MAX_CHAINS_HELD + 10)
            .map(|i| format!("beat-bound-{i}"))
            .collect();
        many.insert(0, "x".repeat(MAX_ROOT_BYTES + 1));
        take_beat(ChainBeat {
            process: "beat-bound-p".into(),
            holding: many,
            for_ms: u64::MAX,
        })
        .unwrap();
        let kept = beats()
            .get("beat-bound-p")
            .map(|(until, holding)| (*until, holding.len()));
        let (until, count) = kept.unwrap();
        assert_eq!(count, MAX_CHAINS_HELD);
        assert!(until <= tokio::time::Instant::now() + MAX_BEAT);
        take_beat(beat("beat-bound-p", &[], 0)).unwrap();
    }

    fn request(outcome: &str, attempt: &str) -> RecordRequest {
        RecordRequest {
            entry: "urn:trustgraph:agent:s/journal/i1-x".into(),
            outcome: outcome.into(),
            delivery: "m".into(),
            attempt: attempt.into(),
            next: Vec::new(),
            ends: None,
        }
    }

    #[test]
    fn instants_are_written_as_the_store_reads_them_back() {
        use chrono::TimeZone;
        let at = |micros: u32| {
            chrono::Utc
                .with_ymd_and_hms(2026, 11, 25, 0, 48, 33)
                .unwrap()
                .checked_add_signed(chrono::Duration::microseconds(i64::from(micros)))
                .unwrap()
        };
        assert_eq!(canonical_instant(at(719_990)), "2026-11-25T00:48:33.71999Z");
        assert_eq!(
            canonical_instant(at(719_991)),
            "2026-11-25T00:48:33.719991Z"
        );
        assert_eq!(canonical_instant(at(0)), "2026-11-25T00:48:33Z");
    }

    #[tokio::test]
    async fn a_recorded_instant_reads_back_as_it_was_answered() {
        let journal = Journal::Owner(GraphStore::in_memory().unwrap());
        for i in 0..20 {
            let mut first = request("o", "a");
            first.entry = format!("urn:trustgraph:agent:s/journal/i{i}-x");
            let answered = journal.record(first.clone()).await.unwrap();
            let stored = journal.entry(&node(&first.entry).unwrap()).await.unwrap();
            assert_eq!(Some(answered), stored);
        }
    }

    #[tokio::test]
    async fn concurrent_records_of_one_step_give_one_winner() {
        let journal = Journal::Owner(GraphStore::in_memory().unwrap());
        let mut records = tokio::task::JoinSet::new();
        for i in 0..16 {
            let journal = journal.clone();
            records.spawn(async move {
                journal
                    .record(request(&format!("o{i}"), &format!("a{i}")))
                    .await
            });
        }
        let standing: Vec<JournalEntry> = records
            .join_all()
            .await
            .into_iter()
            .map(|r| r.unwrap())
            .collect();
        assert!(standing.iter().all(|e| e.attempt == standing[0].attempt));
        let entry = node(&request("", "").entry).unwrap();
        let stored = journal.entry(&entry).await.unwrap().unwrap();
        assert_eq!(stored.outcome, standing[0].outcome);
        assert!(!stored.published);
        journal.mark_published(&entry).await.unwrap();
        assert!(journal.entry(&entry).await.unwrap().unwrap().published);
    }

    #[tokio::test]
    async fn a_batch_decides_each_step_and_the_first_of_two_records_of_one_stands() {
        let journal = Journal::Owner(GraphStore::in_memory().unwrap());
        let earlier = journal.record(request("old", "a0")).await.unwrap();
        let other = |outcome: &str, attempt: &str| RecordRequest {
            entry: "urn:trustgraph:agent:t/journal/i1-y".into(),
            ..request(outcome, attempt)
        };
        let standing = journal
            .record_all(vec![
                request("new", "a1"),
                other("o2", "a2"),
                other("o3", "a3"),
            ])
            .await
            .unwrap();
        let attempts: Vec<&str> = standing.iter().map(|e| e.attempt.as_str()).collect();
        assert_eq!(attempts, ["a0", "a2", "a2"]);
        assert_eq!(standing[0], earlier);
        let nodes = [
            node(&request("", "").entry).unwrap(),
            node(&other("", "").entry).unwrap(),
        ];
        journal.mark_all_published(&nodes).await.unwrap();
        let stored = journal.entries(&nodes).await.unwrap();
        assert!(stored.iter().all(|e| e.as_ref().unwrap().published));
        assert_eq!(stored[1].as_ref().unwrap().outcome, "o2");
    }

    #[tokio::test]
    async fn the_owner_counts_the_takings_of_a_step_until_it_is_recorded() {
        let journal = Journal::Owner(GraphStore::in_memory().unwrap());
        let entry = "urn:trustgraph:agent:takings/journal/i1-x";
        let step = node(entry).unwrap();
        let taking = |delivery: &str, taker: &str| TakingRef {
            entry: entry.to_owned(),
            delivery: delivery.to_owned(),
            taker: taker.to_owned(),
        };
        let takers = [taking("m", "p1"), taking("m", "p2"), taking("m", "p3")];
        let counted: Vec<u32> = futures::future::join_all(takers.iter().map(|t| journal.take(t)))
            .await
            .into_iter()
            .map(|taken| {
                let taken = taken.unwrap();
                assert_eq!(taken.entry, None);
                taken.takings
            })
            .collect();
        let mut sorted = counted.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, [1, 2, 3], "{counted:?}");
        // A lookup that is not a taking counts nothing, nor does a taker's retry.
        assert_eq!(journal.entry(&step).await.unwrap(), None);
        assert_eq!(journal.take(&taking("m", "p1")).await.unwrap().takings, 3);
        assert_eq!(journal.take(&taking("m", "p4")).await.unwrap().takings, 4);
        // Another message of the same step (a copy) is counted apart.
        assert_eq!(
            journal.take(&taking("copy", "p5")).await.unwrap().takings,
            1
        );
        let recorded = RecordRequest {
            entry: entry.to_owned(),
            ..request("given up", "a0")
        };
        journal.record(recorded).await.unwrap();
        // Recorded, the step settles from its entry: nothing is counted.
        let taken = journal.take(&taking("m", "p6")).await.unwrap();
        assert_eq!(taken.entry.unwrap().attempt, "a0");
        assert_eq!(taken.takings, 0);
        // In a batch, each step on its own.
        let other = TakingRef {
            entry: "urn:trustgraph:agent:takings/journal/i1-y".to_owned(),
            ..taking("m", "p7")
        };
        let batch = journal.take_all(&[taking("m", "p7"), other]).await.unwrap();
        assert_eq!(batch[0].takings, 0);
        assert_eq!(batch[1].takings, 1);
    }

    /// An entry of `entry` written into `store` as nothing but the owner could: beside it.
    async fn put_beside(store: &GraphStore, entry: &NamedNode) {
        let beside = RecordRequest {
            entry: entry.as_str().to_owned(),
            ..request("beside the owner", "b")
        };
        let quads = entry_quads(entry, &beside, "2026-11-27T00:00:00Z");
        store.insert(quads).await.unwrap();
    }

    fn record_of(entry: &NamedNode, attempt: &str) -> RecordRequest {
        RecordRequest {
            entry: entry.as_str().to_owned(),
            ..request("the step's own", attempt)
        }
    }

    #[tokio::test]
    async fn the_first_lookup_of_a_step_the_owner_expects_needs_no_read_but_its_record_reads() {
        let store = GraphStore::in_memory().unwrap();
        let journal = Journal::Owner(store.clone());
        let step = |name: &str| format!("urn:trustgraph:agent:expected/journal/{name}");
        let [next, batched, other] =
            ["i2-a", "i2-c", "i2-b"].map(|name| node(&step(name)).unwrap());
        // A record whose outcome did not stand names no step: only written outcomes do.
        journal.record(request("first", "a0")).await.unwrap();
        let lost = RecordRequest {
            next: vec![other.as_str().to_owned()],
            ..request("second", "a1")
        };
        journal.record(lost).await.unwrap();
        let written = RecordRequest {
            entry: step("i1-x"),
            next: vec![
                next.as_str().to_owned(),
                batched.as_str().to_owned(),
                "not an IRI".to_owned(),
            ],
            ..request("with next steps", "a2")
        };
        journal.record(written).await.unwrap();
        // Entries put beside the owner (as nothing can do for a real next step) show what is read:
        // a step the owner expects is answered from what it knows.
        for entry in [&next, &batched, &other] {
            put_beside(&store, entry).await;
        }
        assert_eq!(journal.entry(&next).await.unwrap(), None);
        let looked_up = journal
            .entries(&[other.clone(), batched.clone()])
            .await
            .unwrap();
        assert_eq!(
            looked_up[0].as_ref().unwrap().attempt,
            "b",
            "not expected: read"
        );
        assert_eq!(looked_up[1], None);
        // A second lookup (a copy, a redelivery) reads.
        assert_eq!(journal.entry(&next).await.unwrap().unwrap().attempt, "b");
        // A record always reads what stands, looked up before or not: the entry beside the owner
        // is answered, not replaced (as a pruned step's next steps are, when the pruned step's
        // message comes back and makes them expected again while their entries stand).
        for entry in [&next, &batched, &other] {
            let standing = journal.record(record_of(entry, "a3")).await.unwrap();
            assert_eq!(standing.attempt, "b");
        }
    }

    #[tokio::test]
    async fn each_record_of_a_batch_has_its_next_steps_expected_and_overlong_names_are_not() {
        let store = GraphStore::in_memory().unwrap();
        let journal = Journal::Owner(store.clone());
        let step = |name: &str| format!("urn:trustgraph:agent:many-next/journal/{name}");
        let fan_out = |record: usize| RecordRequest {
            entry: step(&format!("i1-{record}")),
            next: (0..200)
                .map(|i| step(&format!("i2-{record}-{i}")))
                .collect(),
            ..request("with next steps", "a0")
        };
        let long = node(&step(&"x".repeat(MAX_EXPECTED_NAME_BYTES))).unwrap();
        let with_long = RecordRequest {
            entry: step("i1-long"),
            next: vec![long.as_str().to_owned()],
            ..request("with a long next step", "a0")
        };
        journal
            .record_all(vec![fan_out(0), fan_out(1), with_long])
            .await
            .unwrap();
        // The second record's last next step: past 256 for the batch, within 256 for its record.
        let last = node(&step("i2-1-199")).unwrap();
        for entry in [&last, &long] {
            put_beside(&store, entry).await;
        }
        assert_eq!(
            journal.entry(&last).await.unwrap(),
            None,
            "expected: not read"
        );
        let read = journal.entry(&long).await.unwrap();
        assert_eq!(read.unwrap().attempt, "b", "not remembered: read");
    }

    #[tokio::test]
    async fn what_the_owner_expects_of_one_store_says_nothing_of_another() {
        let (first, second) = (
            GraphStore::in_memory().unwrap(),
            GraphStore::in_memory().unwrap(),
        );
        let (one, two) = (
            Journal::Owner(first.clone()),
            Journal::Owner(second.clone()),
        );
        let step =
            |name: &str| node(&format!("urn:trustgraph:agent:stores/journal/{name}")).unwrap();
        let (shared, only_second) = (step("i2-a"), step("i2-b"));
        let with_next = |store: &str, next: &[&NamedNode]| RecordRequest {
            entry: format!("urn:trustgraph:agent:stores-{store}/journal/i1-x"),
            next: next.iter().map(|n| n.as_str().to_owned()).collect(),
            ..request("with next steps", "a0")
        };
        one.record(with_next("one", &[&shared])).await.unwrap();
        two.record(with_next("two", &[&only_second])).await.unwrap();
        // Expected of each store only there: a lookup through the other reads.
        put_beside(&first, &only_second).await;
        assert_eq!(one.entry(&only_second).await.unwrap().unwrap().attempt, "b");
        put_beside(&second, &shared).await;
        assert_eq!(two.entry(&shared).await.unwrap().unwrap().attempt, "b");
        // And where it is expected, its first lookup needs no read.
        put_beside(&first, &shared).await;
        assert_eq!(one.entry(&shared).await.unwrap(), None);
    }
}
