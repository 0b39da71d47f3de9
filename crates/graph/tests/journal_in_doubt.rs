//! The journal's owner over a SPARQL server whose answer to a write is lost while the write
//! itself still commits, later (a timeout, a proxy's 502): a retry of the step must not write a
//! second outcome beside it. And over one killed with the write on its way and started again:
//! the step goes on as soon as the server is back, not a minute later.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_graph::journal::RecordRequest;
use agent_graph::{GraphStore, QueryAnswer};

mod common;

/// A SPARQL server over `backing` (queries at `/query`, updates at `/update`) that answers its
/// first journal write with 502 at once and applies it a second later.
async fn server_losing_an_answer(backing: GraphStore) -> String {
    let lost_one = Arc::new(AtomicBool::new(false));
    common::raw_endpoint(Arc::new(move |head, body| {
        let (backing, lost_one) = (backing.clone(), lost_one.clone());
        Box::pin(async move {
            if head.starts_with("post /query") {
                let answer = backing.query(body).await.unwrap();
                let (bytes, content_type) = agent_graph::serialize_answer(&answer).unwrap();
                return ("200 OK", content_type, bytes);
            }
            if body.contains(agent_core::vocab::JOURNAL_GRAPH)
                && !lost_one.swap(true, Ordering::SeqCst)
            {
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    backing.update(body).await.unwrap();
                });
                return ("502 Bad Gateway", "text/plain", b"lost".to_vec());
            }
            backing.update(body).await.unwrap();
            ("204 No Content", "text/plain", Vec::new())
        })
    }))
    .await
}

fn record(attempt: &str) -> RecordRequest {
    RecordRequest {
        entry: "urn:trustgraph:agent:in-doubt/journal/step-1".to_owned(),
        outcome: format!("the outcome of attempt {attempt}"),
        delivery: format!("delivery-{attempt}"),
        attempt: attempt.to_owned(),
        next: Vec::new(),
        ends: None,
    }
}

#[tokio::test]
async fn a_write_whose_answer_was_lost_is_waited_for_not_written_again() {
    let backing = GraphStore::in_memory().unwrap();
    let server = server_losing_an_answer(backing.clone()).await;
    let journal = GraphStore::open(&server, None).unwrap().owned_journal();

    let first = journal.record(record("a")).await;
    assert!(first.is_err(), "{first:?}");
    // Retried at once (the step ran again): whether the first write stands is not known yet.
    let again = journal.record(record("b")).await;
    assert!(
        matches!(&again, Err(e) if e.retryable()),
        "a second outcome was decided while the first write was in doubt: {again:?}"
    );
    let entry = agent_graph::model::NamedNode::new(record("b").entry).unwrap();
    assert!(
        journal.entry(&entry).await.is_err(),
        "a lookup says nothing stands"
    );

    // The server applies the first write; the step's record then finds it standing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let standing = journal.record(record("b")).await.unwrap();
    assert_eq!(standing.attempt, "a");
    let outcomes = backing
        .query(format!(
            "SELECT (COUNT(?o) AS ?n) WHERE {{ GRAPH <{}> {{ <{}> ?p ?o FILTER(CONTAINS(STR(?o), \"the outcome\")) }} }}",
            agent_core::vocab::JOURNAL_GRAPH,
            entry.as_str()
        ))
        .await
        .unwrap();
    let QueryAnswer::Rows(rows) = outcomes else {
        panic!("{outcomes:?}")
    };
    let n = rows.first("n").map(|t| t.to_string()).unwrap_or_default();
    assert!(
        n.starts_with("\"1\""),
        "outcomes of the step in the store: {n}"
    );
}

#[tokio::test]
async fn a_write_cut_by_the_servers_crash_is_in_doubt_only_until_the_server_is_back() {
    let backing = GraphStore::in_memory().unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (kill, down) = tokio::sync::watch::channel(false);
    let first_life = {
        let plain = plain_server(backing.clone());
        Arc::new(move |head: String, body: String| {
            if !head.starts_with("post /query") && body.contains(agent_core::vocab::JOURNAL_GRAPH) {
                // SIGKILLed with the write received and not committed.
                kill.send_replace(true);
                return Box::pin(async { (common::KILLED, "text/plain", Vec::new()) })
                    as futures::future::BoxFuture<'static, common::Answer>;
            }
            plain(head, body)
        })
    };
    tokio::spawn(common::serve_raw(listener, first_life, down));
    let journal = GraphStore::open(&format!("http://{address}"), None)
        .unwrap()
        .owned_journal();

    let first = journal.record(record("a")).await;
    assert!(first.is_err(), "{first:?}");
    // Down: its port refuses connections.
    let while_down = journal.record(record("b")).await;
    assert!(
        matches!(&while_down, Err(e) if e.retryable()),
        "{while_down:?}"
    );

    // Started again on the same store: what the killed server had not committed never will be.
    let listener = tokio::net::TcpListener::bind(address).await.unwrap();
    let (_, never_down) = tokio::sync::watch::channel(false);
    tokio::spawn(common::serve_raw(
        listener,
        plain_server(backing.clone()),
        never_down,
    ));
    let decided = journal.record(record("b")).await;
    assert!(
        matches!(&decided, Ok(entry) if entry.attempt == "b"),
        "the step waits for a write its crashed server can no longer commit: {decided:?}"
    );
}

/// A SPARQL server over `backing` that answers every request.
fn plain_server(backing: GraphStore) -> common::Respond {
    Arc::new(move |head: String, body: String| {
        let backing = backing.clone();
        Box::pin(async move {
            if head.starts_with("post /query") {
                let answer = backing.query(body).await.unwrap();
                let (bytes, content_type) = agent_graph::serialize_answer(&answer).unwrap();
                return ("200 OK", content_type, bytes);
            }
            backing.update(body).await.unwrap();
            ("204 No Content", "text/plain", Vec::new())
        })
    })
}

/// An owner whose journal answered, refused later (404) by something in front of it (a proxy or
/// an ingress with no backend while the owner restarts), is out, not an owner of an earlier
/// build: the chains are not taken as held by nobody (which would run a live dialog's root
/// again), and the call is an outage, tried again. Before, the 404 read as "no journal", and the
/// answer was that no chain was held.
#[tokio::test]
async fn a_journal_refused_after_it_answered_is_an_outage_not_an_old_owner() {
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = asked.clone();
    let server = common::raw_endpoint(std::sync::Arc::new(move |head: String, _body: String| {
        let n = counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Box::pin(async move {
            assert!(head.contains("/journal/chains/held"), "{head}");
            if n == 0 {
                ("200 OK", "application/json", b"[true]".to_vec())
            } else {
                ("404 Not Found", "text/plain", b"no backend".to_vec())
            }
        })
    }))
    .await;
    let journal = GraphStore::open(&server, None).unwrap().journal();
    let chains = || agent_graph::journal::ChainRefs {
        chains: vec!["urn:trustgraph:agent:live".to_owned()],
        except: None,
    };
    assert_eq!(journal.held(chains()).await.unwrap(), vec![true]);
    let then = journal.held(chains()).await;
    assert!(
        matches!(&then, Err(e) if e.retryable()),
        "a chain read as not held while its owner was out: {then:?}"
    );
}
