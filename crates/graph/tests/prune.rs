//! The journal's prune, a page at a time: entries of concluded dialogs past the retention go, and
//! those of dialogs that never concluded past seven; nothing else, and each entry whole.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use agent_graph::{journal, GraphStore};

/// One retention (a day) and seven before 2026-12-02.
const FINISHED_BEFORE: &str = "2026-12-01T00:00:00.000000Z";
const ANY_BEFORE: &str = "2026-11-25T00:00:00.000000Z";

/// What becomes of each kind of entry, and what it is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// Two days old, its dialog concluded: goes.
    ConcludedPast,
    /// Two days old, its dialog never concluded: stays until seven retentions.
    UnconcludedPast,
    /// Eight days old, never concluded: goes.
    UnconcludedLongPast,
    /// An hour old, concluded: stays.
    ConcludedRecent,
    /// Two days old and concluded, but never marked published: stays (its outcome may still be
    /// on its way).
    Unpublished,
    /// Eight days old, concluded, never marked published (its process stopped between the ack
    /// and the mark): goes, as any entry past seven retentions.
    UnpublishedLongPast,
}

const KINDS: [Kind; 6] = [
    Kind::ConcludedPast,
    Kind::UnconcludedPast,
    Kind::UnconcludedLongPast,
    Kind::ConcludedRecent,
    Kind::Unpublished,
    Kind::UnpublishedLongPast,
];

fn kind_of(i: usize) -> Kind {
    KINDS[i % KINDS.len()]
}

fn session(i: usize) -> String {
    format!("urn:trustgraph:agent:prune-{i}")
}

fn entry(i: usize) -> String {
    format!("{}/journal/1-d{i}", session(i))
}

async fn journal_with(entries: usize) -> GraphStore {
    let store = GraphStore::in_memory().unwrap();
    let mut data = String::from("PREFIX tg: <https://trustgraph.ai/ns/>\nPREFIX xsd: <http://www.w3.org/2001/XMLSchema#>\nINSERT DATA {\n");
    for i in 0..entries {
        let kind = kind_of(i);
        let at = match kind {
            Kind::UnconcludedLongPast | Kind::UnpublishedLongPast => "2026-11-24T00:00:00.000000Z",
            Kind::ConcludedRecent => "2026-12-01T23:00:00.000000Z",
            _ => "2026-11-30T00:00:00.000000Z",
        };
        let unpublished = matches!(kind, Kind::Unpublished | Kind::UnpublishedLongPast);
        let published = if unpublished {
            ""
        } else {
            "; tg:published true "
        };
        data.push_str(&format!(
            "GRAPH <urn:graph:agent-journal> {{ <{}> tg:outcome \"{{}}\" ; tg:delivery \"d\" ; tg:attempt \"1\" ; tg:recordedAt \"{at}\"^^xsd:dateTime {published}}}\n",
            entry(i)
        ));
        if matches!(
            kind,
            Kind::ConcludedPast
                | Kind::ConcludedRecent
                | Kind::Unpublished
                | Kind::UnpublishedLongPast
        ) {
            data.push_str(&format!(
                "GRAPH <urn:graph:retrieval> {{ <{}/final> tg:document \"done\" }}\n",
                session(i)
            ));
        }
    }
    data.push('}');
    store.update(data).await.unwrap();
    store
}

async fn quads_of(store: &GraphStore, i: usize) -> usize {
    let rows = store
        .query(format!(
            "SELECT ?p WHERE {{ GRAPH <urn:graph:agent-journal> {{ <{}> ?p ?o }} }}",
            entry(i)
        ))
        .await
        .unwrap()
        .rows();
    rows.rows.len()
}

#[tokio::test]
async fn a_journal_larger_than_a_page_is_pruned_to_what_must_stay() {
    const ENTRIES: usize = 1_000;
    let store = journal_with(ENTRIES).await;
    let goes = |i: usize| {
        matches!(
            kind_of(i),
            Kind::ConcludedPast | Kind::UnconcludedLongPast | Kind::UnpublishedLongPast
        )
    };
    let expected = (0..ENTRIES).filter(|i| goes(*i)).count();

    // Pages of 64: the 500 entries that go take eight pages.
    let pruned = journal::prune(&store, FINISHED_BEFORE, ANY_BEFORE, 64)
        .await
        .unwrap();
    assert_eq!(pruned, expected);
    for i in 0..ENTRIES {
        let quads = quads_of(&store, i).await;
        let whole = if matches!(kind_of(i), Kind::Unpublished | Kind::UnpublishedLongPast) {
            4
        } else {
            5
        };
        let left = if goes(i) { 0 } else { whole };
        assert_eq!(quads, left, "entry {i}, {:?}", kind_of(i));
    }
    // Nothing more to do, and a page as large as the journal does it in one.
    assert_eq!(
        journal::prune(&store, FINISHED_BEFORE, ANY_BEFORE, ENTRIES)
            .await
            .unwrap(),
        0
    );
    let fresh = journal_with(ENTRIES).await;
    assert_eq!(
        journal::prune(&fresh, FINISHED_BEFORE, ANY_BEFORE, ENTRIES)
            .await
            .unwrap(),
        expected
    );
    // Pages of one: each search finds 64, so the 500 take eight searches and 500 deletes.
    let one_at_a_time = journal_with(ENTRIES).await;
    assert_eq!(
        journal::prune(&one_at_a_time, FINISHED_BEFORE, ANY_BEFORE, 1)
            .await
            .unwrap(),
        expected
    );
    for i in 0..ENTRIES {
        assert_eq!(
            quads_of(&one_at_a_time, i).await == 0,
            goes(i),
            "entry {i}, {:?}",
            kind_of(i)
        );
    }
    // The provenance graph is the record: never pruned.
    let finals = store
        .query("SELECT ?f WHERE { GRAPH <urn:graph:retrieval> { ?f ?p ?o } }".into())
        .await
        .unwrap()
        .rows();
    assert_eq!(finals.rows.len(), ENTRIES * 4 / 6);
}
