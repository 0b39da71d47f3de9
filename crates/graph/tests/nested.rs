//! Deep queries on the embedded store: one nested past what any stack holds is refused before the
//! parser, and deep ones are answered on a stack sized for them, the process alive after both.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
use agent_graph::GraphError;
use common::{default_bounds, store_with_triples};

mod common;

/// A query nested a hundred thousand levels deep (100 KB) is refused before the parser, which
/// would overflow its thread's stack and abort the process (this test binary aborted so without
/// the bound); queries two thousand levels deep, in brackets, operator chains and written so
/// that a reader of characters would miscount, are answered (or refused as they parse) on a stack
/// that holds them: how deep a query goes cannot be told from its characters (a `<` may compare or
/// open an IRI), so every character that may make a level counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_nested_too_deep_is_refused_and_the_process_lives() {
    let store = store_with_triples(10).await;
    let bounds = default_bounds(120, 100);
    let too_deep = 100_001;
    for query in [
        format!(
            "ASK {{ FILTER({}1{}) }}",
            "(".repeat(too_deep),
            ")".repeat(too_deep)
        ),
        format!("ASK {}{}", "{".repeat(too_deep), "}".repeat(too_deep)),
        format!("ASK {{ FILTER(1{} > 0) }}", "+1".repeat(too_deep)),
    ] {
        let refused = store.query_bounded(query, bounds).await.unwrap_err();
        assert!(
            matches!(&refused, GraphError::Syntax(why) if why.contains("at most 100000")),
            "{refused:?}"
        );
    }
    let deep = 2_000;
    let (open, close) = ("(".repeat(deep), ")".repeat(deep));
    let answered = [
        format!("ASK {{ FILTER({open}1{close} = 1) }}"),
        format!("ASK {}?s ?p ?o{}", "{".repeat(deep), "}".repeat(deep)),
        // Operator chains: flat to parse, a level of the tree each.
        format!("ASK {{ FILTER(1{} > 0) }}", "+1".repeat(deep)),
        format!(
            "ASK {{ FILTER({}1{} > 0) }}",
            "(1+".repeat(deep),
            ")".repeat(deep)
        ),
        format!("ASK {{ FILTER(?x{}) }}", " || ?x".repeat(deep)),
        // A comparison a reader could take for an IRI.
        format!("ASK {{ BIND(1 AS ?a) FILTER(?a<{open}2{close}) }}"),
        // An escaped IRI and a `#` a reader could take for a comment's.
        format!("ASK {{ <urn:\\u0061#> ?p ?o FILTER({open}1{close}) }}"),
    ];
    for query in answered {
        let head: String = query.chars().take(40).collect();
        store
            .query_bounded(query, bounds)
            .await
            .unwrap_or_else(|e| panic!("{head}...: {e}"));
    }
    // Negations, each a level of the parser's (refused as double negation without SPARQL 1.2,
    // once the parser has descended through them all): answered either way, and the store with it.
    let negated = format!("ASK {{ FILTER({}?x) }}", "!".repeat(deep));
    let _either = store.query_bounded(negated, bounds).await;
    store
        .query_bounded("ASK { ?s ?p ?o }".to_owned(), bounds)
        .await
        .unwrap();
}

/// `x IN (a, b)` is expanded to `x = a || x = b` before anything is evaluated, a copy of `x` an
/// element: thirty-four `IN`s of two, each in the left of the next (400 bytes), came to 2^34
/// nodes, built without a look at the time limit until the process ran out of memory. Refused
/// (400) before the store sees it; a long list of elements, which are not copied, is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_that_expands_past_the_bound_is_refused() {
    let store = store_with_triples(10).await;
    let bounds = default_bounds(120, 100);
    let doubling = format!(
        "ASK {{ FILTER({}1{}) }}",
        "(".repeat(34),
        " IN (1, 1))".repeat(34)
    );
    let refused = store.query_bounded(doubling, bounds).await.unwrap_err();
    assert!(
        matches!(&refused, GraphError::Syntax(why) if why.contains("once IN is expanded")),
        "{refused:?}"
    );
    let list: Vec<String> = (0..5_000).map(|i| format!("\"{i}\"")).collect();
    let long = format!(
        "ASK {{ GRAPH ?g {{ ?s ?p ?o }} FILTER(?o IN ({})) }}",
        list.join(", ")
    );
    store.query_bounded(long, bounds).await.unwrap();
}

/// The optimizer's estimate of a property path's size weighs each side of a sequence twice,
/// without a look at the time limit: sixty links inside `|` (500 bytes) took 2^60 steps before
/// anything ran. Such a query runs as written, and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_sequence_in_a_path_is_answered() {
    let store = store_with_triples(10).await;
    let bounds = default_bounds(20, 100);
    let chain = format!(
        "SELECT * WHERE {{ GRAPH ?g {{ ?s ?p ?o . ?o {}<urn:p:1>|<urn:p:2> ?x }} }}",
        "<urn:p:1>/".repeat(60)
    );
    store.query_bounded(chain, bounds).await.unwrap();
}

/// A stranger's query that calls another endpoint (`SERVICE`) is refused before it is sent to a
/// SPARQL server (Apache Jena Fuseki calls any URL it can reach by default): here the server does
/// not even exist, and the refusal says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strangers_service_call_is_refused_before_a_sparql_server_sees_it() {
    let store = agent_graph::GraphStore::open("http://127.0.0.1:9/ds", None).unwrap();
    let bounds = default_bounds(20, 100);
    let fetch = "SELECT * WHERE { SERVICE <http://169.254.169.254/latest/meta-data> { ?s ?p ?o } }";
    let refused = store
        .query_bounded(fetch.to_owned(), bounds)
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, GraphError::Syntax(why) if why.contains("SERVICE")),
        "{refused:?}"
    );
}

/// A `SERVICE` hidden from the check in a `\u` escape is refused before a SPARQL server sees it:
/// SPARQL 1.1 (19.2) has a server read such escapes before the grammar, so for one that does,
/// `"a\u0022` ends the string and the `SERVICE` after it is a clause; our parser reads the
/// escape as a quote inside the string. Before, the query went as written (Fuseki 5.6, which
/// reads the escape as we do, made no call; a server following the spec's letter would have). A
/// query whose escapes hide nothing goes to the server as written, byte for byte.
#[tokio::test]
async fn a_service_call_hidden_in_an_escape_is_not_sent_to_a_sparql_server() {
    let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let kept = received.clone();
    let respond: common::Respond = std::sync::Arc::new(move |_head, body| {
        kept.lock().unwrap().push(body);
        Box::pin(async {
            (
                "200 OK",
                "application/sparql-results+json",
                br#"{"head": {"vars": ["s"]}, "results": {"bindings": []}}"#.to_vec(),
            )
        })
    });
    let endpoint = common::raw_endpoint(respond).await;
    let store = agent_graph::GraphStore::open(&format!("{endpoint}/ds"), None).unwrap();
    let hidden = r#"SELECT * WHERE { ?s ?p "a\u0022 . SERVICE <http://169.254.169.254/latest/> { ?x ?y ?z } } #" }"#;
    // As a server following the spec reads it, the query calls out.
    let as_the_spec_reads_it = with_escapes_read(hidden);
    let parsed = spargebra::SparqlParser::new()
        .parse_query(&as_the_spec_reads_it)
        .unwrap();
    assert!(format!("{parsed:?}").contains("Service"), "{parsed:?}");
    let refused = store
        .query_bounded(hidden.to_owned(), default_bounds(20, 100))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, GraphError::Syntax(why) if why.contains("SERVICE")),
        "{refused:?}"
    );
    assert!(received.lock().unwrap().is_empty(), "the server saw it");
    // Escapes that hide nothing: sent as written.
    let harmless = r#"SELECT ?s WHERE { ?s ?p "caf\u00e9" FILTER(?p != <urn:\u0061>) }"#;
    store
        .query_bounded(harmless.to_owned(), default_bounds(20, 100))
        .await
        .unwrap();
    assert_eq!(*received.lock().unwrap(), vec![harmless.to_owned()]);
}

/// `text` with every `\uXXXX` and `\UXXXXXXXX` escape replaced by its character, as Apache Jena's
/// parser reads a query before its grammar.
fn with_escapes_read(text: &str) -> String {
    let mut read = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('\\') {
        read.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let digits = match after.chars().next() {
            Some('u') => 4,
            Some('U') => 8,
            _ => 0,
        };
        let code = after
            .get(1..1 + digits)
            .filter(|_| digits > 0)
            .and_then(|hex| u32::from_str_radix(hex, 16).ok())
            .and_then(char::from_u32);
        match code {
            Some(c) => {
                read.push(c);
                rest = &after[1 + digits..];
            }
            None => {
                read.push('\\');
                rest = after;
            }
        }
    }
    read.push_str(rest);
    read
}
