//! Queries too large for the store's optimizer: its join ordering grows with about the fourth
//! power of a query's patterns and is never cancelled, so before the planning bound
//! (`agent_graph::planning`) these kept a core busy for hours past their time limit. Up to its
//! bound they run as written: answered, or stopped at the limit with the core free again at once;
//! past it they are refused. Alone in its test binary, so the process's CPU time is this test's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_graph::{GraphError, QueryBounds};
use common::{cpu_share, store_with_triples};

mod common;

/// Four shapes of a query of about `size` operands: a chain of OPTIONALs, one basic graph
/// pattern of many triples, many groups joined, and a basic graph pattern inside `EXISTS` (which
/// the optimizer normalizes and the store evaluates as deep a join as anywhere).
fn shapes(size: usize) -> [String; 4] {
    let each = size / 3;
    [
        format!(
            "ASK {{ GRAPH ?g {{ ?s ?p ?o {} }} }}",
            "OPTIONAL { ?s ?p ?o } ".repeat(each)
        ),
        format!(
            "SELECT (COUNT(*) AS ?n) WHERE {{ GRAPH ?g {{ {} }} }}",
            (0..size)
                .map(|i| format!("?s{i} ?p ?o . "))
                .collect::<String>()
        ),
        format!(
            "SELECT * WHERE {{ GRAPH ?g {{ ?s ?p ?o {} }} }} LIMIT 5",
            (0..each)
                .map(|i| format!("{{ ?s ?p ?o{i} }} "))
                .collect::<String>()
        ),
        format!(
            "ASK {{ GRAPH ?g {{ ?s ?p ?o FILTER EXISTS {{ {} }} }} }}",
            (0..size)
                .map(|i| format!("?s{i} ?p ?o . "))
                .collect::<String>()
        ),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_too_large_to_plan_keeps_to_its_time_limit_and_a_larger_one_is_refused() {
    let store = store_with_triples(300).await;
    let bounds = QueryBounds {
        timeout: Duration::from_secs(2),
        max_rows: 100,
        max_bindings: QueryBounds::DEFAULT_MAX_BINDINGS,
    };
    for query in shapes(240) {
        let head: String = query.chars().take(60).collect();
        match store.query_bounded(query, bounds).await {
            Ok(_) | Err(GraphError::TimedOut(_)) => {}
            Err(e) => panic!("{head}...: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let idle = cpu_share(Duration::from_secs(1)).await;
        assert!(
            idle < 0.3,
            "{head}...: still busy after the time limit: {idle:.2} of a core"
        );
    }
    // The largest that run on the calling thread (up to 96 brackets, operators and patterns):
    // a basic graph pattern of 94 triples, joined as written, and one of 63, optimized.
    for triples in [94, 63] {
        let patterns: String = (0..triples).map(|i| format!("?s{i} ?p ?o . ")).collect();
        for query in [
            format!("ASK {{ {patterns} }}"),
            format!("SELECT * {{ {patterns} }} LIMIT 3"),
        ] {
            store.query_bounded(query, bounds).await.unwrap();
        }
    }
    for query in shapes(3_000) {
        let refused = store.query_bounded(query, bounds).await.unwrap_err();
        assert!(
            matches!(&refused, GraphError::Syntax(why) if why.contains("at most 256")),
            "{refused}"
        );
    }
    // The store answers as before.
    store
        .query_bounded("ASK { GRAPH ?g { ?s ?p ?o } }".to_owned(), bounds)
        .await
        .unwrap();
}
