//! Long observations out of the messages (claim-check): a `next` request carries an excerpt and a
//! reference for each long observation, whose whole text is kept as a document in the shared
//! graph store; the prompt sees the newest steps whole again.
//!
//! The documents are kept in the shared graph store's documents graph, or, with
//! `DOCUMENT_STORE=librarian`, in TrustGraph's librarian (the document store of a TrustGraph
//! deployment), through its protocol ([`DocumentStore`]).
//!
//! A long ReACT history is folded here too (older steps into one, kept as a document), so a
//! message stays bounded however long the dialog.
//!
//! The document is the one provenance names for the observation (`agent_core::documents`: the
//! text's SHA-256), so checking it in here and storing provenance write the same quad, once, with
//! no journal or compare-and-set, whoever writes first and however often a step is redelivered.
//! Only the step that adds an observation checks it in, so between folds a message's history only
//! grows at its end, and the journal keeps only each step's new steps; a step that folds changes
//! the history's start, so its entry keeps the whole (bounded) request.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use agent_core::documents::{excerpt_with_reference, reference, FOLD_KEEP};
use agent_core::vocab::{tg, DOCUMENTS_GRAPH};
use agent_graph::model::Term;
use agent_graph::GraphStore;
use agent_schema::{AgentStep, PlanStep};

/// The newest steps a prompt sees whole.
pub const WHOLE_RECENT: usize = 3;

/// Where long texts are kept as documents.
#[derive(Clone)]
pub enum DocumentStore {
    /// The shared graph store's documents graph (`tg:content`), beside provenance.
    Graph(GraphStore),
    /// TrustGraph's librarian. What an aggregator keeps (a fan-in's long subagent results) is in
    /// the graph, so a document the librarian does not have is looked for there too.
    Librarian {
        librarian: Arc<agent_bus::Librarian>,
        graph: Option<GraphStore>,
    },
}

impl DocumentStore {
    /// The librarian, when documents are kept there.
    pub fn librarian(&self) -> Option<&agent_bus::Librarian> {
        match self {
            DocumentStore::Graph(_) => None,
            DocumentStore::Librarian { librarian, .. } => Some(librarian),
        }
    }

    /// Keeps `text` as the document `uri` (its text's digest: keeping it again changes nothing).
    /// The error keeps its kind (a store's or the librarian's), which decides whether the step
    /// waits out an outage. A text too long for one librarian request goes to the graph when
    /// there is one (readers look there for what the librarian lacks), as provenance's do.
    pub async fn keep(&self, uri: &str, text: &str) -> anyhow::Result<()> {
        match self {
            DocumentStore::Graph(store) => Ok(store.keep_document(uri, text).await?),
            DocumentStore::Librarian {
                librarian,
                graph: Some(graph),
            } if !librarian.takes(text) => Ok(graph.keep_document(uri, text).await?),
            DocumentStore::Librarian { librarian, .. } => Ok(librarian.keep(uri, text).await?),
        }
    }

    /// Claim-check of a long text named `uri`: kept, and its excerpt with the reference carried
    /// instead. Should the store refuse, the text stays whole (bounded by the message size
    /// limit): a message is not lost for want of a smaller one.
    pub async fn check_in_as(&self, text: String, uri: &str) -> String {
        match self.keep(uri, &text).await {
            Ok(()) => excerpt_with_reference(&text, uri),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), bytes = text.len(), "a long text could not be kept as a document; the message carries it whole");
                text
            }
        }
    }

    /// The whole texts of the documents `uris` that could be read, by IRI, and why any other
    /// could not be. A document no store has is simply absent; one that a store did not answer
    /// for, and that no other store gave, is a failure: it may exist, so the caller should not
    /// take its absence for an answer.
    pub async fn fetch(&self, uris: &[String]) -> Fetched {
        let (librarian, graph) = match self {
            DocumentStore::Graph(store) => {
                return match fetch(store, uris.iter().map(String::as_str)).await {
                    Ok(texts) => Fetched::all(texts),
                    Err(e) => Fetched {
                        texts: HashMap::new(),
                        failure: Some(e.to_string()),
                    },
                };
            }
            DocumentStore::Librarian { librarian, graph } => (librarian, graph),
        };
        // Many at a time, in rounds (each read is a request on the librarian's topic and its
        // whole answer); once a round meets a failure (the librarian down: each read waits out its
        // timeout), the rest are not asked, and are looked for in the graph.
        let mut reading = Reading::default();
        let mut rounds = uris.chunks(32);
        for some in rounds.by_ref() {
            let reads = futures::future::join_all(some.iter().map(|uri| librarian.read(uri))).await;
            for (uri, read) in some.iter().zip(reads) {
                match read {
                    Ok(Some(text)) if agent_core::documents::document_uri(&text) == *uri => {
                        reading.texts.insert(uri.clone(), text);
                    }
                    // Named by its text's digest, as in the graph: another text under the name
                    // (the librarian keeps what anyone asks it to) is not the document.
                    Ok(Some(_)) => {
                        tracing::warn!(document = %uri, "the librarian's text is not the one its name is the digest of; not used");
                        reading.absent.push(uri.clone());
                    }
                    Ok(None) => reading.absent.push(uri.clone()),
                    Err(e) => {
                        reading.librarian_failure.get_or_insert(e.to_string());
                        reading.unanswered.push(uri.clone());
                    }
                }
            }
            if reading.librarian_failure.is_some() {
                break;
            }
        }
        reading.unanswered.extend(rounds.flatten().cloned());
        // A document the librarian did not answer for may be in the graph all the same: a
        // fan-in keeps there what the librarian did not take in time.
        if let (Some(graph), false) = (
            graph,
            reading.absent.is_empty() && reading.unanswered.is_empty(),
        ) {
            let rest = reading.absent.iter().chain(&reading.unanswered);
            match fetch(graph, rest.map(String::as_str)).await {
                Ok(in_graph) => reading.texts.extend(in_graph),
                Err(e) => reading.graph_failure = Some(e.to_string()),
            }
        }
        reading.settle()
    }
}

/// What the librarian and then the graph gave for a fetch.
#[derive(Default)]
struct Reading {
    texts: HashMap<String, String>,
    /// What the librarian does not have.
    absent: Vec<String>,
    /// What the librarian did not answer for.
    unanswered: Vec<String>,
    librarian_failure: Option<String>,
    graph_failure: Option<String>,
}

impl Reading {
    fn settle(self) -> Fetched {
        let unread = |uris: &[String]| uris.iter().any(|uri| !self.texts.contains_key(uri));
        // The librarian's failure comes first: it is what the step waits out. A document the
        // librarian lacks is a failure only if the graph could not be asked.
        let failure = if unread(&self.unanswered) {
            self.librarian_failure
        } else if unread(&self.absent) {
            self.graph_failure
        } else {
            None
        };
        Fetched {
            texts: self.texts,
            failure,
        }
    }
}

/// What [`DocumentStore::fetch`] read.
#[derive(Debug, Default)]
pub struct Fetched {
    /// The documents read, by IRI.
    pub texts: HashMap<String, String>,
    /// Why some document that may exist could not be read.
    pub failure: Option<String>,
}

impl Fetched {
    fn all(texts: HashMap<String, String>) -> Fetched {
        Fetched {
            texts,
            failure: None,
        }
    }
}

/// `history` with its older steps folded into one, their whole form kept as a document, when it
/// has grown long enough (see [`agent_core::documents::fold`]). Should the store refuse, the
/// history goes on unfolded: the next step tries again.
pub async fn fold(store: &DocumentStore, history: Vec<AgentStep>) -> Vec<AgentStep> {
    let Some(folded) = agent_core::documents::fold(&history, FOLD_KEEP) else {
        return history;
    };
    match store.keep(&folded.uri, &folded.document).await {
        Ok(()) => folded.history,
        Err(e) => {
            tracing::warn!(error = %e, steps = history.len(), "the history's older steps could not be kept as a document; it goes on unfolded");
            history
        }
    }
}

/// The history a prompt sees: the newest [`WHOLE_RECENT`] steps with their checked-in
/// observations whole again, older ones as their excerpts. Without a store, or should it not
/// answer, the excerpts stand.
pub async fn resolve_recent<'h>(
    store: Option<&DocumentStore>,
    history: &'h [AgentStep],
) -> Cow<'h, [AgentStep]> {
    let start = history.len().saturating_sub(WHOLE_RECENT);
    observations_whole_from(store, history, start).await
}

/// `history` with every step's checked-in observation whole again, for a prompt that must read
/// them all (deep research's notes, at most its rounds' worth); the next message keeps the
/// excerpts. Bounded as every resolution is ([`MOST_BYTES_RESOLVED`]).
pub async fn observations_whole<'h>(
    store: Option<&DocumentStore>,
    history: &'h [AgentStep],
) -> Cow<'h, [AgentStep]> {
    observations_whole_from(store, history, 0).await
}

/// `history` with the checked-in observations of its steps from `start` on whole again.
async fn observations_whole_from<'h>(
    store: Option<&DocumentStore>,
    history: &'h [AgentStep],
    start: usize,
) -> Cow<'h, [AgentStep]> {
    if store.is_none()
        || !history[start..]
            .iter()
            .any(|step| reference(&step.observation).is_some())
    {
        return Cow::Borrowed(history);
    }
    let mut resolved = history.to_vec();
    let texts = resolved[start..]
        .iter_mut()
        .map(|step| &mut step.observation)
        .collect();
    resolve_texts(store, texts).await;
    Cow::Owned(resolved)
}

/// `history` with every subagent result it carries whole again (the aggregator checks long ones
/// in when it resumes a supervisor), for a prompt; the next message keeps the excerpts.
pub async fn results_whole<'h>(
    store: Option<&DocumentStore>,
    history: &'h [AgentStep],
) -> Cow<'h, [AgentStep]> {
    let referenced = history
        .iter()
        .filter_map(|s| s.subagent_results.as_ref())
        .flat_map(|r| r.values())
        .any(|r| reference(r).is_some());
    if store.is_none() || !referenced {
        return Cow::Borrowed(history);
    }
    let mut resolved = history.to_vec();
    let texts = resolved
        .iter_mut()
        .filter_map(|s| s.subagent_results.as_mut())
        .flat_map(|r| r.values_mut())
        .collect();
    resolve_texts(store, texts).await;
    Cow::Owned(resolved)
}

/// A plan with its steps' checked-in results whole again, for a prompt (the plan the next
/// message carries keeps the excerpts).
pub async fn resolve_plan(store: Option<&DocumentStore>, plan: &[PlanStep]) -> Vec<PlanStep> {
    let mut resolved = plan.to_vec();
    resolve_texts(store, resolved.iter_mut().map(|s| &mut s.result).collect()).await;
    resolved
}

/// Replaces each excerpt among `texts` by its document's whole text. Without a store, or for a
/// document it does not give, the excerpt stands: a prompt with an excerpt beats no step at all.
async fn resolve_texts(store: Option<&DocumentStore>, mut texts: Vec<&mut String>) {
    let Some(store) = store else {
        return;
    };
    // Each document once, and no more of them than a prompt can use: a request names what it
    // likes (a client's history is not this service's), and the same reference thousands of
    // times over, resolved each time, filled the memory.
    let wanted: Vec<String> = texts
        .iter()
        .filter_map(|text| reference(text).map(|(uri, _)| uri.to_owned()))
        .collect::<std::collections::BTreeSet<String>>()
        .into_iter()
        .take(MOST_DOCUMENTS_RESOLVED)
        .collect();
    if wanted.is_empty() {
        return;
    }
    let Fetched {
        texts: whole,
        failure,
    } = store.fetch(&wanted).await;
    if let Some(e) = failure {
        tracing::warn!(error = %e, read = whole.len(), wanted = wanted.len(), "some checked-in texts could not be read; the prompt sees their excerpts");
    }
    let mut resolved = 0usize;
    let mut kept_short = 0usize;
    for text in &mut texts {
        let found = reference(text).and_then(|(uri, _)| whole.get(uri));
        if let Some(found) = found {
            if resolved.saturating_add(found.len()) > MOST_BYTES_RESOLVED {
                kept_short += 1;
                continue;
            }
            resolved += found.len();
            found.clone_into(text);
        }
    }
    if kept_short > 0 {
        tracing::warn!(
            kept_short,
            resolved,
            "a prompt's checked-in texts come to more than {MOST_BYTES_RESOLVED} bytes whole; the rest stay excerpts"
        );
    }
}

/// The most distinct documents one prompt's texts are resolved from.
const MOST_DOCUMENTS_RESOLVED: usize = 256;

/// The most bytes of whole text one prompt's excerpts are replaced with; past it they stay
/// excerpts. Far above what a model reads in one prompt.
const MOST_BYTES_RESOLVED: usize = 16 * 1024 * 1024;

/// The whole texts of the documents `uris` in the graph's documents graph, by IRI.
async fn fetch<'u>(
    store: &GraphStore,
    uris: impl Iterator<Item = &'u str>,
) -> Result<HashMap<String, String>, agent_graph::GraphError> {
    let values: Vec<String> = uris.map(|uri| format!("<{uri}>")).collect();
    let sparql = format!(
        "SELECT ?d ?text WHERE {{ VALUES ?d {{ {} }} GRAPH <{DOCUMENTS_GRAPH}> {{ ?d {} ?text }} }}",
        values.join(" "),
        tg::CONTENT
    );
    let rows = store.query(sparql).await?.rows();
    let documents = rows.column("d");
    let texts = rows.column("text");
    Ok(documents
        .into_iter()
        .zip(texts)
        .filter_map(|(d, text)| match (d?, text?) {
            // A document is named by its text's digest: one whose text is not the named one (the
            // graph takes what anyone publishes) is not taken for it.
            (Term::NamedNode(d), Term::Literal(text))
                if agent_core::documents::document_uri(text.value()) == d.as_str() =>
            {
                Some((d.as_str().to_owned(), text.value().to_owned()))
            }
            (Term::NamedNode(d), Term::Literal(text)) => {
                // With the librarian, the graph keeps only the excerpt: no document, no warning.
                if agent_core::documents::reference(text.value()).is_none() {
                    tracing::warn!(document = %d, "a document whose text is not the one its name is the digest of; not used");
                }
                None
            }
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_prompt_resolves_each_document_once_and_within_a_bound() {
        let store = GraphStore::in_memory().unwrap();
        let text = "x".repeat(1024 * 1024);
        let uri = agent_core::documents::document_uri(&text);
        store.keep_document(&uri, &text).await.unwrap();
        let documents = DocumentStore::Graph(store);
        // The same reference forty times over: a client's history names what it likes.
        let excerpt = agent_core::documents::excerpt_with_reference(&text, &uri);
        let mut texts: Vec<String> = vec![excerpt.clone(); 40];
        resolve_texts(Some(&documents), texts.iter_mut().collect()).await;
        let whole = texts.iter().filter(|t| **t == text).count();
        assert_eq!(whole, MOST_BYTES_RESOLVED / text.len());
        assert!(texts.iter().skip(whole).all(|t| *t == excerpt));
    }

    #[test]
    fn a_fetch_fails_only_for_a_document_that_may_exist_and_keeps_what_it_read() {
        let read = |uri: &str| (uri.to_owned(), format!("text of {uri}"));
        let outage = || Some("the librarian did not answer".to_owned());
        let graph_down = || Some("the graph did not answer".to_owned());
        // The librarian lacks `a` (the graph too) and did not answer for `b`, found in the graph:
        // nothing that may exist is unread.
        let settled = Reading {
            texts: HashMap::from([read("b")]),
            absent: vec!["a".into()],
            unanswered: vec!["b".into()],
            librarian_failure: outage(),
            graph_failure: None,
        }
        .settle();
        assert_eq!(settled.failure, None);
        assert_eq!(settled.texts, HashMap::from([read("b")]));
        // `c` was not answered for and is not in the graph: the librarian's outage, and what was
        // read is kept.
        let settled = Reading {
            texts: HashMap::from([read("b")]),
            absent: vec!["a".into()],
            unanswered: vec!["c".into()],
            librarian_failure: outage(),
            graph_failure: graph_down(),
        }
        .settle();
        assert_eq!(settled.failure, outage());
        assert_eq!(settled.texts, HashMap::from([read("b")]));
        // The librarian lacks `a` and the graph could not be asked.
        let settled = Reading {
            absent: vec!["a".into()],
            graph_failure: graph_down(),
            ..Reading::default()
        }
        .settle();
        assert_eq!(settled.failure, graph_down());
    }

    #[tokio::test]
    async fn long_observations_go_out_and_the_newest_come_back_whole() {
        let store = GraphStore::in_memory().unwrap();
        let short = "short".to_owned();
        assert_eq!(store.check_in(short.clone()).await, short);
        let longs: Vec<String> = (0..5)
            .map(|i| format!("{i} {}", "word ".repeat(2000)))
            .collect();
        let mut history = Vec::new();
        for long in &longs {
            let carried = store.check_in(long.clone()).await;
            assert!(carried.len() < 1200, "{}", carried.len());
            // Checked in twice (a redelivery): one document.
            assert_eq!(store.check_in(long.clone()).await, carried);
            history.push(AgentStep {
                observation: carried,
                ..AgentStep::default()
            });
        }
        let documents = DocumentStore::Graph(store.clone());
        let seen = resolve_recent(Some(&documents), &history).await;
        for (i, step) in seen.iter().enumerate() {
            if i >= 5 - WHOLE_RECENT {
                assert_eq!(step.observation, longs[i]);
            } else {
                assert_eq!(step.observation, history[i].observation);
            }
        }
        assert!(matches!(
            resolve_recent(None, &history).await,
            Cow::Borrowed(_)
        ));
    }

    #[tokio::test]
    async fn subagent_results_come_back_whole_for_a_prompt() {
        let store = GraphStore::in_memory().unwrap();
        let long = format!("result {}", "word ".repeat(2000));
        let carried = store.check_in(long.clone()).await;
        let history = vec![AgentStep {
            subagent_results: Some(
                [
                    ("00. a".to_owned(), carried),
                    ("01. b".to_owned(), "short".to_owned()),
                ]
                .into(),
            ),
            ..AgentStep::default()
        }];
        let seen = results_whole(Some(&DocumentStore::Graph(store.clone())), &history).await;
        let results = seen[0].subagent_results.as_ref().unwrap();
        assert_eq!(results["00. a"], long);
        assert_eq!(results["01. b"], "short");
    }
}
