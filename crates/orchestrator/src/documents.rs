//! Long observations out of the messages (claim-check): a `next` request carries an excerpt and a
//! reference for each long observation, whose whole text is kept as a document in the shared
//! graph store; the prompt sees the newest steps whole again.
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

use agent_core::documents::{document_uri, excerpt_with_reference, is_long, reference, FOLD_KEEP};
use agent_core::vocab::{tg, DOCUMENTS_GRAPH};
use agent_graph::model::{Literal, NamedNode, Quad, Term};
use agent_graph::GraphStore;
use agent_schema::AgentStep;

/// The newest steps a prompt sees whole.
pub const WHOLE_RECENT: usize = 3;

/// Keeps `text` as the document `uri` (its digest's name: writing it again changes nothing).
async fn keep(store: &GraphStore, uri: &str, text: &str) -> Result<(), agent_graph::GraphError> {
    let quad = Quad::new(
        NamedNode::new_unchecked(uri),
        NamedNode::new_unchecked(tg::CONTENT),
        Literal::new_simple_literal(text),
        NamedNode::new_unchecked(DOCUMENTS_GRAPH),
    );
    store.insert(vec![quad]).await
}

/// Keeps `text` as a document and answers the excerpt to carry instead, when it is long. Should
/// the store refuse, the text stays whole in the message (bounded by the message size limit): a
/// step is not lost for want of a smaller message.
pub async fn check_in(store: &GraphStore, text: String) -> String {
    if !is_long(&text) || reference(&text).is_some() {
        return text;
    }
    let uri = document_uri(&text);
    match keep(store, &uri, &text).await {
        Ok(()) => excerpt_with_reference(&text, &uri),
        Err(e) => {
            tracing::warn!(error = %e, bytes = text.len(), "an observation could not be kept as a document; the message carries it whole");
            text
        }
    }
}

/// `history` with its older steps folded into one, their whole form kept as a document, when it
/// has grown long enough (see [`agent_core::documents::fold`]). Should the store refuse, the
/// history goes on unfolded: the next step tries again.
pub async fn fold(store: &GraphStore, history: Vec<AgentStep>) -> Vec<AgentStep> {
    let Some(folded) = agent_core::documents::fold(&history, FOLD_KEEP) else {
        return history;
    };
    match keep(store, &folded.uri, &folded.document).await {
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
    store: Option<&GraphStore>,
    history: &'h [AgentStep],
) -> Cow<'h, [AgentStep]> {
    let Some(store) = store else {
        return Cow::Borrowed(history);
    };
    let start = history.len().saturating_sub(WHOLE_RECENT);
    let wanted: Vec<(usize, String)> = history
        .iter()
        .enumerate()
        .skip(start)
        .filter_map(|(i, step)| reference(&step.observation).map(|(uri, _)| (i, uri.to_owned())))
        .collect();
    if wanted.is_empty() {
        return Cow::Borrowed(history);
    }
    let texts = match fetch(store, wanted.iter().map(|(_, uri)| uri.as_str())).await {
        Ok(texts) => texts,
        Err(e) => {
            tracing::warn!(error = %e, "checked-in observations could not be read; the prompt sees their excerpts");
            return Cow::Borrowed(history);
        }
    };
    let mut resolved = history.to_vec();
    for (i, uri) in &wanted {
        if let (Some(step), Some(text)) = (resolved.get_mut(*i), texts.get(uri)) {
            step.observation.clone_from(text);
        }
    }
    Cow::Owned(resolved)
}

/// The whole texts of the documents `uris`, by IRI (those the store holds).
pub async fn fetch<'u>(
    store: &GraphStore,
    uris: impl Iterator<Item = &'u str>,
) -> Result<HashMap<String, String>, agent_graph::GraphError> {
    let values: Vec<String> = uris.map(|uri| format!("<{uri}>")).collect();
    let sparql = format!(
        "SELECT ?d ?text WHERE {{ VALUES ?d {{ {} }} GRAPH <{DOCUMENTS_GRAPH}> {{ ?d <{}> ?text }} }}",
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
            (Term::NamedNode(d), Term::Literal(text)) => {
                Some((d.as_str().to_owned(), text.value().to_owned()))
            }
            _ => None,
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn long_observations_go_out_and_the_newest_come_back_whole() {
        let store = GraphStore::in_memory().unwrap();
        let short = "short".to_owned();
        assert_eq!(check_in(&store, short.clone()).await, short);
        let longs: Vec<String> = (0..5)
            .map(|i| format!("{i} {}", "word ".repeat(2000)))
            .collect();
        let mut history = Vec::new();
        for long in &longs {
            let carried = check_in(&store, long.clone()).await;
            assert!(carried.len() < 1200, "{}", carried.len());
            // Checked in twice (a redelivery): one document.
            assert_eq!(check_in(&store, long.clone()).await, carried);
            history.push(AgentStep {
                observation: carried,
                ..AgentStep::default()
            });
        }
        let seen = resolve_recent(Some(&store), &history).await;
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
}
