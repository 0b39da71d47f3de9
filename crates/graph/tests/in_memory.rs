//! Queries whose work is in memory: joins of `VALUES` lists and cross products read little from
//! the store, which is where oxigraph's evaluator otherwise checks its cancellation (before our
//! patch of spareval a cross product of four lists ran for hours past its time limit). They stop
//! at their time limit, the core free again at once, and at their budget of bindings, before
//! they fill the memory. Alone in its test binary, so the process's CPU time is this test's.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_graph::{GraphError, QueryBounds};
use common::{cpu_share, store_with_triples};

mod common;

/// `VALUES ?name { 0 1 ... }` of `n` numbers.
fn values(name: &str, n: usize) -> String {
    let numbers: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    format!("VALUES ?{name} {{ {} }}", numbers.join(" "))
}

/// Checks that `sparql` is stopped at its time limit and that the process's cores are free again
/// 300 ms later (`doing`: what it would still be doing, for the failure's message).
async fn stopped_at_the_limit_and_idle(
    store: &agent_graph::GraphStore,
    sparql: String,
    bounds: QueryBounds,
    doing: &str,
) {
    let stopped = store.query_bounded(sparql, bounds).await.unwrap_err();
    assert!(matches!(stopped, GraphError::TimedOut(_)), "{stopped}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let idle = cpu_share(Duration::from_secs(1)).await;
    assert!(
        idle < 0.3,
        "still {doing} after the time limit: {idle:.2} of a core"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_in_memory_stops_at_the_time_limit_and_at_the_budget_of_bindings() {
    let store = store_with_triples(300).await;

    // 10^12 rows counted, none read from the store: stopped at the limit, the core free after.
    let lists = format!(
        "SELECT (COUNT(*) AS ?n) WHERE {{ {} {} {} {} }}",
        values("a", 1000),
        values("b", 1000),
        values("c", 1000),
        values("d", 1000)
    );
    let unbudgeted = QueryBounds {
        timeout: Duration::from_secs(1),
        max_rows: 100,
        max_bindings: u64::MAX,
    };
    stopped_at_the_limit_and_idle(&store, lists, unbudgeted, "busy").await;

    // Finding every match of `.*[^A-Z]|[A-Z]` in 256 KiB of capitals reads to the text's end
    // for each: work squared in the text, in one function of one row, and it ran on past the limit.
    let capitals: String = (1..=8)
        .map(|i| format!("BIND(CONCAT(?c{0}, ?c{0}) AS ?c{i}) ", i - 1))
        .collect();
    let replaced = format!(
        "SELECT (STRLEN(?r) AS ?n) WHERE {{ BIND(\"{}\" AS ?c0) {capitals} \
         BIND(REPLACE(?c8, \".*[^A-Z]|[A-Z]\", \"\") AS ?r) }}",
        "A".repeat(1024)
    );
    stopped_at_the_limit_and_idle(&store, replaced, unbudgeted, "replacing").await;
    // Sorting 10^9 rows would hold them all: refused at the budget, long before the time limit.
    let budgeted = QueryBounds {
        timeout: Duration::from_secs(600),
        max_rows: 100,
        max_bindings: 1_000_000,
    };
    let sorted = format!(
        "SELECT * WHERE {{ {} {} {} }} ORDER BY ?a LIMIT 1",
        values("a", 1000),
        values("b", 1000),
        values("c", 1000)
    );
    let refused = store.query_bounded(sorted, budgeted).await.unwrap_err();
    assert!(
        matches!(refused, GraphError::TooMuchWork(1_000_000)),
        "{refused}"
    );
    // The same over the store's triples: a cross product of three patterns, sorted.
    let crossed =
        "SELECT * WHERE { GRAPH ?g { ?a ?b ?c . ?d ?e ?f . ?h ?i ?j } } ORDER BY ?c LIMIT 1";
    let refused = store
        .query_bounded(crossed.to_owned(), budgeted)
        .await
        .unwrap_err();
    assert!(
        matches!(refused, GraphError::TooMuchWork(1_000_000)),
        "{refused}"
    );

    // Within the budget the same shapes are answered.
    let small = format!(
        "SELECT (COUNT(*) AS ?n) WHERE {{ {} {} }}",
        values("a", 100),
        values("b", 100)
    );
    let answer = store.query_bounded(small, budgeted).await.unwrap();
    let count = answer.rows().rows[0][0].clone().unwrap();
    assert!(count.to_string().starts_with("\"10000\""), "{count}");
    let pairs = "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?a ?b ?c . ?d ?b ?f } }";
    store
        .query_bounded(pairs.to_owned(), budgeted)
        .await
        .unwrap();

    // Strings a query makes: each held to 1 MiB (thirty doublings would be 2 GiB), and many
    // rows of long ones meet the budget.
    let doubled = |times: usize| -> String {
        (1..=times)
            .map(|i| format!("BIND(CONCAT(?y{0}, ?y{0}) AS ?y{i}) ", i - 1))
            .collect()
    };
    let lengths = format!(
        "SELECT (STRLEN(?y18) AS ?short) (STRLEN(?y28) AS ?long) (STRLEN(REPLACE(?y18, \"\", \"xxxxxxxxxxxxxxxx\")) AS ?replaced) \
         WHERE {{ BIND(\"ab\" AS ?y0) {} }}",
        doubled(28)
    );
    let defaults = QueryBounds {
        max_bindings: QueryBounds::DEFAULT_MAX_BINDINGS,
        ..budgeted
    };
    let rows = store.query_bounded(lengths, defaults).await.unwrap().rows();
    let [short, long, replaced] = [0, 1, 2].map(|i| rows.rows[0][i].clone());
    assert!(
        short.unwrap().to_string().starts_with("\"524288\""),
        "half a megabyte is made"
    );
    assert_eq!(long, None, "half a gigabyte is not");
    assert_eq!(replaced, None, "nor 9 MB replaced");
    let many = format!(
        "SELECT ?y18 WHERE {{ {} BIND(\"ab\" AS ?y0) {} }} ORDER BY ?y18",
        values("i", 1000),
        doubled(18).replace(
            "BIND(CONCAT(?y17, ?y17)",
            "BIND(CONCAT(?y17, ?y17, STR(?i))"
        )
    );
    let refused = store.query_bounded(many, budgeted).await.unwrap_err();
    assert!(
        matches!(refused, GraphError::TooMuchWork(1_000_000)),
        "{refused}"
    );

    // What an aggregate holds: a hundred distinct long strings made in it (not held by a row),
    // counted: 96 MB held for an answer of one number, where the rows hold 13 MB.
    let sampled = format!(
        "SELECT (COUNT(DISTINCT CONCAT({}STR(?i))) AS ?n) WHERE {{ {} BIND(\"ab\" AS ?y0) {} }}",
        "?y15, ".repeat(15),
        values("i", 100),
        doubled(15)
    );
    let grouped = QueryBounds {
        max_bindings: 2_000_000,
        ..budgeted
    };
    let refused = store.query_bounded(sampled, grouped).await.unwrap_err();
    assert!(
        matches!(refused, GraphError::TooMuchWork(2_000_000)),
        "{refused}"
    );
    // What an answer copies out: a long string in each of its rows.
    let copied = format!(
        "SELECT ?y18 WHERE {{ BIND(\"ab\" AS ?y0) {} {} }}",
        doubled(18),
        values("i", 1000)
    );
    let many_rows = QueryBounds {
        max_rows: 100_000,
        ..budgeted
    };
    let refused = store.query_bounded(copied, many_rows).await.unwrap_err();
    assert!(
        matches!(refused, GraphError::TooMuchWork(1_000_000)),
        "{refused}"
    );
}
