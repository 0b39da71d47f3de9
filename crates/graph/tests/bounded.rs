//! Bounded queries and updates on the embedded store: a query past its time limit, or whose
//! caller went away, stops evaluating (the core is free again at once), and a result over the row
//! limit is refused; an update stopped at its bounds writes nothing.
//! Alone in its test binary, so the process's CPU time is this test's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use agent_graph::{GraphError, QueryBounds};
use common::{cpu_share, store_with_triples};

mod common;

/// A four-way cross product over a few hundred triples: hours of work if nothing stops it.
const RUNAWAY: &str =
    "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?a ?b ?c . ?d ?e ?f . ?h ?i ?j . ?k ?l ?m } }";

/// Checks that the process's cores are free again 300 ms after an evaluation was stopped
/// (`failing`: the failure's message).
async fn idle_again(failing: &str) {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = cpu_share(Duration::from_secs(1)).await;
    assert!(idle < 0.3, "{failing}: {idle:.2} of a core");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runaway_queries_stop_and_large_results_are_refused() {
    let store = store_with_triples(300).await;
    let bounds = QueryBounds {
        timeout: Duration::from_millis(800),
        max_rows: 100,
        // The time limit is what is tested here (the budget is in `in_memory.rs`).
        max_bindings: u64::MAX,
    };

    // Past its time limit: an error at the limit, and the evaluation stops with it.
    let started = Instant::now();
    let timed_out = store
        .query_bounded(RUNAWAY.into(), bounds)
        .await
        .unwrap_err();
    assert!(matches!(timed_out, GraphError::TimedOut(_)), "{timed_out}");
    assert!(started.elapsed() < Duration::from_secs(5));
    idle_again("still busy after the time limit").await;

    // Its caller went away: dropping the future stops the evaluation, long before the limit.
    let long = QueryBounds {
        timeout: Duration::from_secs(600),
        ..bounds
    };
    let abandoned = tokio::spawn({
        let store = store.clone();
        async move { store.query_bounded(RUNAWAY.into(), long).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Running means above the idle ceiling checked after it: `scripts/test.sh` runs a real model
    // beside these tests, so the query gets a share of a core, not the whole (0.50 seen).
    let busy = cpu_share(Duration::from_secs(1)).await;
    assert!(busy > 0.3, "the runaway query was not running: {busy:.2}");
    abandoned.abort();
    idle_again("still busy after its caller went").await;

    // Over the row limit: refused; within it: answered.
    let all = "SELECT * WHERE { GRAPH ?g { ?s ?p ?o } }";
    let refused = store.query_bounded(all.into(), bounds).await.unwrap_err();
    assert!(matches!(refused, GraphError::TooManyRows(100)), "{refused}");
    let few = "SELECT * WHERE { GRAPH ?g { ?s ?p ?o } } LIMIT 100";
    assert_eq!(
        store
            .query_bounded(few.into(), bounds)
            .await
            .unwrap()
            .rows()
            .rows
            .len(),
        100
    );

    // An update is held to the same bounds (it holds the store's one turn for updates), and one
    // stopped writes nothing of itself: its marker, in the same transaction, is not there after.
    let marked = "ASK { GRAPH <urn:g:runaway> { ?s ?p ?o } }";
    let runaway_update =
        "INSERT DATA { GRAPH <urn:g:runaway> { <urn:s:marker> <urn:p:by> \"the runaway\" } } ;
DELETE { GRAPH ?g { ?a ?b ?c } } WHERE {
  GRAPH ?g { ?a ?b ?c . ?d ?e ?f . ?h ?i ?j . ?k ?l ?m }
  FILTER(STRLEN(?c) + STRLEN(?m) < 0)
}";
    let started = Instant::now();
    let timed_out = store
        .update_bounded(runaway_update.into(), bounds)
        .await
        .unwrap_err();
    assert!(matches!(timed_out, GraphError::TimedOut(_)), "{timed_out}");
    assert!(started.elapsed() < Duration::from_secs(5));
    idle_again("an update still busy after the time limit").await;
    let budgeted = QueryBounds {
        timeout: Duration::from_secs(60),
        max_bindings: 1_000_000,
        ..bounds
    };
    let too_much = store
        .update_bounded(runaway_update.into(), budgeted)
        .await
        .unwrap_err();
    assert!(matches!(too_much, GraphError::TooMuchWork(_)), "{too_much}");
    let written = |answer: agent_graph::QueryAnswer| match answer {
        agent_graph::QueryAnswer::Boolean(b) => b,
        other => panic!("{other:?}"),
    };
    assert!(!written(store.query(marked.into()).await.unwrap()));
    // Within its bounds an update is done, and the turn was given back by those stopped.
    let small =
        "INSERT DATA { GRAPH <urn:g:runaway> { <urn:s:marker> <urn:p:by> \"a small one\" } }";
    store.update_bounded(small.into(), bounds).await.unwrap();
    assert!(written(store.query(marked.into()).await.unwrap()));

    // An update's time limit runs from its turn: one queued behind a runaway is done once the
    // runaway is stopped, though it waited five times its own limit.
    let longer = QueryBounds {
        timeout: Duration::from_millis(1500),
        ..bounds
    };
    let first = tokio::spawn({
        let store = store.clone();
        async move { store.update_bounded(runaway_update.into(), longer).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let queued = "INSERT DATA { GRAPH <urn:g:runaway> { <urn:s:queued> <urn:p:by> \"queued\" } }";
    let shorter = QueryBounds {
        timeout: Duration::from_millis(300),
        ..bounds
    };
    store.update_bounded(queued.into(), shorter).await.unwrap();
    let stopped = first.await.unwrap().unwrap_err();
    assert!(matches!(stopped, GraphError::TimedOut(_)), "{stopped}");
    // A syntax error is one, and a pattern too large to plan is refused before it runs.
    let broken = store
        .update_bounded("DELETE WHERE { ?s ".into(), bounds)
        .await
        .unwrap_err();
    assert!(matches!(broken, GraphError::Syntax(_)), "{broken}");
    let patterns: String = (0..300).map(|i| format!("?s{i} ?p{i} ?o{i} . ")).collect();
    let huge = format!("DELETE {{ ?s0 ?p0 ?o0 }} WHERE {{ {patterns} }}");
    let refused = store.update_bounded(huge, bounds).await.unwrap_err();
    assert!(matches!(refused, GraphError::Syntax(_)), "{refused}");
}
