//! Bounded queries on a SPARQL server, which cannot be told to stop: a query this side stopped
//! waiting for keeps its permit until the server answers, so no more run there at once than
//! there are permits.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use agent_graph::{GraphError, GraphStore};

mod common;

/// A SPARQL server that takes `slow` to answer a query (as a runaway evaluation does), over an
/// empty store.
async fn slow_server(slow: Duration) -> String {
    let backing = GraphStore::in_memory().unwrap();
    common::raw_endpoint(Arc::new(move |_head: String, body: String| {
        let backing = backing.clone();
        Box::pin(async move {
            tokio::time::sleep(slow).await;
            let answer = backing.query(body).await.unwrap();
            let (bytes, content_type) = agent_graph::serialize_answer(&answer).unwrap();
            ("200 OK", content_type, bytes)
        })
    }))
    .await
}

#[tokio::test]
async fn a_query_past_its_limit_holds_its_permit_until_the_server_answers() {
    let server = slow_server(Duration::from_secs(2)).await;
    let store = GraphStore::open(&server, None).unwrap();
    let permits = Arc::new(tokio::sync::Semaphore::new(1));
    let permit = permits.clone().acquire_owned().await.unwrap();

    let answer = store
        .query_bounded_holding(
            "SELECT * WHERE { ?s ?p ?o }".to_owned(),
            common::default_bounds(0, 10),
            permit,
        )
        .await;
    assert!(matches!(answer, Err(GraphError::TimedOut(_))), "{answer:?}");
    assert_eq!(
        permits.available_permits(),
        0,
        "the permit was given back while the server still evaluated the query"
    );
    // Given back once the server answers.
    let back = tokio::time::timeout(Duration::from_secs(30), permits.acquire()).await;
    assert!(back.is_ok(), "the permit never came back");
}
