//! Updates to SPARQL endpoints: a process's turn for them is per endpoint, so a process that is a
//! client of one endpoint and, serving it, forwards updates to another does not wait on itself.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_graph::GraphStore;
use futures::future::BoxFuture;

mod common;

/// What an endpoint does with the body of each request before it answers 204.
type Handler = Arc<dyn Fn(String) -> BoxFuture<'static, ()> + Send + Sync>;

/// An endpoint that hands each request's body to `handler`, then answers 204: its base address.
async fn endpoint(handler: Handler) -> String {
    common::raw_endpoint(Arc::new(move |_head, body| {
        let handled = handler(body);
        Box::pin(async move {
            handled.await;
            ("204 No Content", "text/plain", Vec::new())
        })
    }))
    .await
}

#[tokio::test]
async fn an_update_forwarded_to_another_endpoint_by_this_process_does_not_wait_for_its_own_caller()
{
    // The SPARQL server behind an aggregator: counts the updates it is sent.
    static STORED: AtomicUsize = AtomicUsize::new(0);
    let server = endpoint(Arc::new(|_| {
        Box::pin(async {
            STORED.fetch_add(1, Ordering::SeqCst);
        })
    }))
    .await;
    // The aggregator, in this process: forwards each update to the server as a GraphStore
    // client of it, as its `/update` does.
    let behind = GraphStore::open(&server, None).unwrap();
    let aggregator = endpoint(Arc::new(move |update| {
        let behind = behind.clone();
        Box::pin(async move { behind.update(update).await.unwrap() })
    }))
    .await;
    // A client of the aggregator, in the same process: its update waits for the forwarded one.
    let client = GraphStore::open(&aggregator, None).unwrap();
    let update = "INSERT DATA { <urn:test:s> <urn:test:p> <urn:test:o> }".to_owned();
    tokio::time::timeout(Duration::from_secs(20), client.update(update))
        .await
        .expect("the client's update ended before its 120 s timeout: the forwarding took no turn the client held")
        .unwrap();
    assert_eq!(STORED.load(Ordering::SeqCst), 1);

    // Updates to one endpoint still go one at a time: 8 at once reach the server in turn.
    static OPEN: AtomicUsize = AtomicUsize::new(0);
    static MOST_OPEN: AtomicUsize = AtomicUsize::new(0);
    let slow = endpoint(Arc::new(|_| {
        Box::pin(async {
            let open = OPEN.fetch_add(1, Ordering::SeqCst) + 1;
            MOST_OPEN.fetch_max(open, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            OPEN.fetch_sub(1, Ordering::SeqCst);
        })
    }))
    .await;
    let updates = (0..8).map(|i| {
        let store = GraphStore::open(&slow, None).unwrap();
        async move {
            store
                .update(format!(
                    "INSERT DATA {{ <urn:test:s{i}> <urn:test:p> <urn:test:o> }}"
                ))
                .await
        }
    });
    for done in futures::future::join_all(updates).await {
        done.unwrap();
    }
    assert_eq!(MOST_OPEN.load(Ordering::SeqCst), 1);
}
