//! A journal owner in this process is asked directly by callers of its endpoint that carry its
//! token, and over HTTP by anyone else, and once it stops.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use agent_graph::journal::RecordRequest;
use agent_graph::{in_process, GraphStore};

/// A loopback address where nothing listens: a call that goes over HTTP fails there.
fn nobody_listening() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    drop(listener);
    base
}

fn record(entry: &str, attempt: &str) -> RecordRequest {
    RecordRequest {
        entry: entry.to_owned(),
        outcome: format!("outcome of {attempt}"),
        delivery: "1:2:3".to_owned(),
        attempt: attempt.to_owned(),
        next: Vec::new(),
        ends: None,
    }
}

#[tokio::test]
async fn an_owner_in_this_process_is_asked_directly_with_its_token_only() {
    let store = GraphStore::in_memory().unwrap();
    let base = nobody_listening();
    static RECORDS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let served = in_process::serve(
        vec![format!("{base}/")],
        Some("services".to_owned()),
        store.owned_journal(),
        |_| {
            RECORDS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        },
        Box::new(|| !REFUSED.load(std::sync::atomic::Ordering::SeqCst)),
    )
    .expect("an owner's journal is served");
    let entry = "urn:trustgraph:agent:s/journal/i1-x";
    let node = agent_graph::model::NamedNode::new(entry).unwrap();

    // Its endpoint with its token: answered here, though nothing listens on the address.
    let caller = GraphStore::open(&base, Some("services".to_owned()))
        .unwrap()
        .journal();
    let first = caller.record(record(entry, "a1")).await.unwrap();
    assert_eq!(first.attempt, "a1");
    // First writer wins, as over HTTP.
    let second = caller.record(record(entry, "a2")).await.unwrap();
    assert_eq!(second.attempt, "a1");
    assert_eq!(RECORDS.load(std::sync::atomic::Ordering::SeqCst), 2);
    let found = caller.entry(&node).await.unwrap().expect("the entry");
    assert_eq!(found.outcome, "outcome of a1");
    assert!(!found.published);
    caller.mark_published(&node).await.unwrap();
    assert!(caller.entry(&node).await.unwrap().unwrap().published);
    // The owner's store holds it.
    let kept = agent_graph::journal::read_entry(&store, &node)
        .await
        .unwrap();
    assert_eq!(kept.unwrap().attempt, "a1");

    // Another token goes over HTTP, where the owner's checks are (here nobody answers).
    let stranger = GraphStore::open(&base, Some("someone".to_owned()))
        .unwrap()
        .journal();
    assert!(stranger.entry(&node).await.is_err());
    let anonymous = GraphStore::open(&base, None).unwrap().journal();
    assert!(anonymous.entry(&node).await.is_err());

    // Refused by its fence later (an elder owner heard), it decides nothing more here.
    REFUSED.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(caller.entry(&node).await.is_err());
    REFUSED.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(caller.entry(&node).await.is_ok());

    // Once the owner stops, its callers go over HTTP again.
    drop(served);
    assert!(caller.entry(&node).await.is_err());
}

#[tokio::test]
async fn an_owner_without_a_token_is_not_served_in_process() {
    // Its journal API refuses every call without a token; so does this.
    let base = nobody_listening();
    let store = GraphStore::in_memory().unwrap();
    let served = in_process::serve(
        vec![base],
        None,
        store.owned_journal(),
        |_| {},
        Box::new(|| true),
    );
    assert!(served.is_none());
}

#[tokio::test]
async fn a_forwarding_journal_is_not_served_in_process() {
    let base = nobody_listening();
    let forwarding = GraphStore::open(&base, None).unwrap().journal();
    let served = in_process::serve(
        vec![base],
        Some("services".to_owned()),
        forwarding,
        |_| {},
        Box::new(|| true),
    );
    assert!(served.is_none());
}
