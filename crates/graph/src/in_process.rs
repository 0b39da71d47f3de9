//! A journal's owner reached inside its own process: an orchestrator whose journal endpoint is an
//! aggregator running in the same process (`agentctl up`, `agentctl bench`) makes its calls to it
//! directly instead of over loopback HTTP, which cost about 0.3 ms a call (a lookup and a record a
//! step). The same calls, batched the same way, reach the same owner and its locks; only the
//! transport is skipped. The owner registers once it knows it is the only owner (its fence
//! admitted it) and is forgotten when it stops; a caller whose token is not the owner's, or that
//! finds no owner here, goes over HTTP as before and meets the same checks there.

use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::journal::{Journal, JournalEntry, RecordRequest, Taking, TakingRef};
use crate::GraphError;

/// An owner this process serves: the endpoints it answers on, its token and its journal.
struct Served {
    id: u64,
    bases: Vec<String>,
    token: String,
    journal: Journal,
    on_record: fn(bool),
    /// Whether it may still decide: false once its fence refused it (an elder owner heard late),
    /// after which its callers go over HTTP and are refused there.
    still_owner: Box<dyn Fn() -> bool + Send + Sync>,
    /// Whether its first caller here was logged.
    heard: bool,
}

static SERVED: Mutex<Vec<Served>> = Mutex::new(Vec::new());

fn served() -> MutexGuard<'static, Vec<Served>> {
    SERVED.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Keeps an owner reachable in this process while it lives.
pub struct Registration {
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        served().retain(|s| s.id != self.id);
    }
}

/// Serves `journal` (an owner's: a forwarding journal is refused) to callers of this process that
/// name one of `bases` (an endpoint's base URL, such as `http://127.0.0.1:7878`) with `token`,
/// while `still_owner` says so. `on_record` is told of each record whether it stood (the owner's
/// metric). `None` for a journal that is not an owner's, or without a token (the journal API then
/// refuses every call, and so does this).
pub fn serve(
    bases: Vec<String>,
    token: Option<String>,
    journal: Journal,
    on_record: fn(bool),
    still_owner: Box<dyn Fn() -> bool + Send + Sync>,
) -> Option<Registration> {
    let token = token.filter(|t| !t.is_empty())?;
    if !matches!(journal, Journal::Owner(_)) {
        return None;
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let bases = bases
        .into_iter()
        .map(|b| b.trim_end_matches('/').to_owned())
        .collect();
    served().push(Served {
        id,
        bases,
        token,
        journal,
        on_record,
        still_owner,
        heard: false,
    });
    Some(Registration { id })
}

/// The owner behind `base` in this process, if there is one and `token` is its token.
pub(crate) fn owner(base: &str, token: Option<&str>) -> Option<InProcessOwner> {
    let base = base.trim_end_matches('/');
    let mut served = served();
    let owner = served
        .iter_mut()
        .find(|s| s.bases.iter().any(|b| b == base) && Some(s.token.as_str()) == token)
        .filter(|s| (s.still_owner)())?;
    if !owner.heard {
        owner.heard = true;
        tracing::info!(endpoint = %base, "the journal's owner runs in this process: asked directly, not over HTTP");
    }
    Some(InProcessOwner {
        journal: owner.journal.clone(),
        on_record: owner.on_record,
    })
}

/// An owner's journal as the journal API serves it: entries named by text, checked as there.
pub(crate) struct InProcessOwner {
    journal: Journal,
    on_record: fn(bool),
}

fn nodes(entries: &[String]) -> Result<Vec<oxigraph::model::NamedNode>, GraphError> {
    entries
        .iter()
        .map(|entry| crate::journal::node(entry))
        .collect()
}

impl InProcessOwner {
    pub(crate) async fn entries(
        &self,
        entries: Vec<String>,
    ) -> Result<Vec<Option<JournalEntry>>, GraphError> {
        self.journal.entries(&nodes(&entries)?).await
    }

    /// Whether this is the first lookup of a step the owner expects, answered "nothing yet"
    /// without a read (see `journal::ExpectedSteps`).
    pub(crate) fn expects(&self, entry: &str) -> bool {
        crate::journal::node(entry).is_ok_and(|entry| self.journal.first_lookup_expected(&entry))
    }

    pub(crate) async fn takings(&self, takings: Vec<TakingRef>) -> Result<Vec<Taking>, GraphError> {
        self.journal.take_all(&takings).await
    }

    /// [`InProcessOwner::expects`] for a step being taken up, its taking counted (see
    /// `Journal::take_expected`).
    pub(crate) fn take_expected(&self, taking: &TakingRef) -> Option<Taking> {
        self.journal.take_expected(taking)
    }

    pub(crate) async fn records(
        &self,
        records: Vec<RecordRequest>,
    ) -> Result<Vec<JournalEntry>, GraphError> {
        // Its entries are checked where they are decided, as for the journal API's.
        self.journal
            .record_all_reporting(records, self.on_record)
            .await
    }

    // Beats are kept by the process, whichever owner handle takes them (an owner's: see `serve`).
    pub(crate) fn beat(&self, beat: crate::journal::ChainBeat) -> Result<(), GraphError> {
        crate::journal::take_beat(beat)
    }

    pub(crate) fn held(&self, asked: &crate::journal::ChainRefs) -> Vec<bool> {
        crate::journal::held_now(asked)
    }

    pub(crate) fn turn(&self, asked: &crate::turns::TurnAsked) -> crate::turns::Turn {
        self.journal.owner_turn(asked)
    }

    pub(crate) async fn marks(&self, entries: Vec<String>) -> Result<Vec<()>, GraphError> {
        let marked = entries.len();
        self.journal.mark_all_published(&nodes(&entries)?).await?;
        Ok(vec![(); marked])
    }
}
