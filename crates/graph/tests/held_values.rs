//! What a query holds besides its rows is spent from its budget, and the caps on strings refuse
//! only what a query grows: a property path's closure, the store's own long literals. Apart from
//! `in_memory.rs`, whose test measures the process's CPU time and must be alone in its binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_graph::{GraphError, QueryBounds};

/// A property path's closure holds every pair it finds before it gives one: it is spent from the
/// budget as it grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_closure_is_held_to_the_budget() {
    let store = agent_graph::GraphStore::in_memory().unwrap();
    let chain: String = (0..1000)
        .map(|i| format!("<urn:n:{i}> <urn:next> <urn:n:{}> <urn:g:1> .\n", i + 1))
        .collect();
    store
        .load(chain.into_bytes(), "application/n-quads", None)
        .await
        .unwrap();
    let pairs = "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?a <urn:next>+ ?b } }";
    let small = QueryBounds {
        timeout: Duration::from_secs(600),
        max_rows: 100,
        max_bindings: 100_000,
    };
    let refused = store
        .query_bounded(pairs.to_owned(), small)
        .await
        .unwrap_err();
    assert!(
        matches!(refused, GraphError::TooMuchWork(100_000)),
        "{refused}"
    );
    let enough = QueryBounds {
        max_bindings: QueryBounds::DEFAULT_MAX_BINDINGS,
        ..small
    };
    let counted = store
        .query_bounded(pairs.to_owned(), enough)
        .await
        .unwrap()
        .rows();
    let n = counted.rows[0][0].clone().unwrap();
    assert!(n.to_string().starts_with("\"500500\""), "{n}");
}

/// The caps refuse strings a query grows, not the store's own long literals: a 2 MiB literal is
/// lower-cased and cut down by `REPLACE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_literals_of_the_store_are_not_refused() {
    let store = agent_graph::GraphStore::in_memory().unwrap();
    let long = "Ab".repeat(1 << 20);
    store
        .load(
            format!("<urn:doc> <urn:text> \"{long}\" <urn:g:1> .\n").into_bytes(),
            "application/n-quads",
            None,
        )
        .await
        .unwrap();
    let bounds = QueryBounds {
        timeout: Duration::from_secs(600),
        max_rows: 10,
        max_bindings: QueryBounds::DEFAULT_MAX_BINDINGS,
    };
    let sparql = r#"SELECT (STRLEN(LCASE(?t)) AS ?lower) (REPLACE(?t, "^(.{6}).*$", "$1", "s") AS ?head)
        WHERE { GRAPH ?g { <urn:doc> <urn:text> ?t } }"#;
    let rows = store
        .query_bounded(sparql.to_owned(), bounds)
        .await
        .unwrap()
        .rows();
    let [lower, head] = [0, 1].map(|i| rows.rows[0][i].clone().unwrap().to_string());
    assert!(lower.starts_with("\"2097152\""), "{lower}");
    assert_eq!(head, "\"AbAbAb\"");
}
