//! What a query holds besides its rows is spent from its budget, and the caps on strings refuse
//! only what a query grows: a property path's closure, the store's own long literals, the text
//! one evaluation of a deep expression holds. Apart from
//! `in_memory.rs`, whose test measures the process's CPU time and must be alone in its binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_graph::{GraphError, QueryBounds};
use common::default_bounds;

mod common;

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
    let bounds = default_bounds(600, 10);
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

/// The peak of the process's resident memory so far (`VmHWM`), in bytes.
fn peak_resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

/// A query that binds `?x` to `bytes` of text (doubled from 16 bytes, within the 1 MiB a
/// function may make), then `?y` as `shape` says, and answers the length of `?y`.
fn query_over_x(bytes: usize, shape: &str) -> String {
    let mut binds = String::from("BIND(\"0123456789abcdef\" AS ?x0) ");
    let mut width = 16;
    let mut step = 0;
    while width < bytes {
        binds += &format!("BIND(CONCAT(?x{step}, ?x{step}) AS ?x{}) ", step + 1);
        width *= 2;
        step += 1;
    }
    binds += &format!("BIND(?x{step} AS ?x) ");
    format!("SELECT (STRLEN(?y) AS ?n) WHERE {{ {binds} {shape} }}")
}

/// Each operand an expression has computed stays held while it computes the next, so a 1 MiB
/// `?x` nested 1,500 deep (`CONCAT(?x, CONCAT(?x, ...))`, `?x < (?x < ...)`, the same of a blank
/// node made of `?x` or of a literal whose language tag is: 15 KB of text each) held 1.5 GB at
/// once, within the caps on rows and on each string (without the bound on what one evaluation
/// holds, the process's peak memory rose by about that). Such a query is stopped at the budget,
/// holding at most 64 MiB; the same expressions of a 16-byte `?x` are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_one_evaluation_holds_is_bounded() {
    let store = agent_graph::GraphStore::in_memory().unwrap();
    let bounds = default_bounds(600, 10);
    let deep = 1_500;
    let nested_concat = format!("{}\"\"{}", "CONCAT(?x, ".repeat(deep), ")".repeat(deep));
    // `<` keeps its operands in order (`=` may be turned round), so the left is held each level.
    let nested_less = |term: &str| {
        format!(
            "BIND({term} AS ?t) BIND(STR({}?t{}) AS ?y)",
            "?t < (".repeat(deep),
            ")".repeat(deep)
        )
    };
    let shapes = [
        format!("BIND(({nested_concat}) AS ?y)"),
        nested_less("?x"),
        nested_less("BNODE(?x)"),
        // A private-use tag of subtags of eight.
        nested_less(
            r#"STRLANG("a", CONCAT("x-", REPLACE(SUBSTR(?x, 1, 900000), "(.{8})", "$1-"), "a"))"#,
        ),
    ];
    let before = peak_resident_bytes();
    for shape in &shapes {
        let answered = store
            .query_bounded(query_over_x(1 << 20, shape), bounds)
            .await;
        let Err(refused) = answered else {
            panic!("{}: answered", &shape[..60]);
        };
        assert!(
            matches!(refused, GraphError::TooMuchWork(_)),
            "{}: {refused}",
            &shape[..40]
        );
    }
    let grown = peak_resident_bytes().saturating_sub(before);
    assert!(
        grown < 512 << 20,
        "the peak memory grew by {} MiB",
        grown >> 20
    );
    let rows = store
        .query_bounded(query_over_x(16, &shapes[0]), bounds)
        .await
        .unwrap()
        .rows();
    let n = rows.rows[0][0].clone().unwrap().to_string();
    assert!(n.starts_with(&format!("\"{}\"", 16 * deep)), "{n}");
    // Not refused (a string compared with a boolean leaves `?y` unbound).
    for shape in &shapes[1..] {
        store
            .query_bounded(query_over_x(16, shape), bounds)
            .await
            .unwrap_or_else(|e| panic!("{}: {e}", &shape[..40]));
    }
}

/// What an evaluation held is given back when it ends, stopped or not: queries shallow enough to
/// run on the blocking pool's reused threads, each reading a 1 MiB `?x` 72 times (refused) or 39
/// times (answered), in turn, eight times. A count left behind on a thread would refuse the later ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_evaluation_held_is_given_back() {
    let store = agent_graph::GraphStore::in_memory().unwrap();
    let bounds = default_bounds(600, 10);
    // `(?x < ?x) IN (?x, ...)` reads `?x` three times an element (the left is copied into each
    // comparison) with few brackets and no `|`: up to 96 of those and its operands, a query runs
    // on the pool rather than on a deep stack's own thread.
    let reads = |n: usize| {
        format!(
            "BIND(STR((?x < ?x) IN ({})) AS ?y)",
            vec!["?x"; n / 3].join(", ")
        )
    };
    for _ in 0..8 {
        let refused = store
            .query_bounded(query_over_x(1 << 20, &reads(72)), bounds)
            .await
            .unwrap_err();
        assert!(matches!(refused, GraphError::TooMuchWork(_)), "{refused}");
        let rows = store
            .query_bounded(query_over_x(1 << 20, &reads(39)), bounds)
            .await
            .unwrap()
            .rows();
        // A boolean compared with a string: unbound, and answered.
        assert_eq!(rows.rows.len(), 1);
    }
}
