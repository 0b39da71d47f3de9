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
            false,
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

/// A SPARQL server that answers any query with rows without end (a chunked JSON answer, as a
/// short query over a cross product gets from a server no budget holds), until the connection
/// is closed: its base address, and the bytes it has sent so far.
async fn endless_rows_server() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let sent = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = sent.clone();
    tokio::spawn(async move {
        while let Ok((mut connection, _)) = listener.accept().await {
            let sent = counted.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    let mut chunk = [0u8; 4096];
                    match connection.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&chunk[..n]),
                    }
                }
                let chunked = |data: &[u8]| {
                    let mut framed = format!("{:x}\r\n", data.len()).into_bytes();
                    framed.extend_from_slice(data);
                    framed.extend_from_slice(b"\r\n");
                    framed
                };
                let mut out = b"HTTP/1.1 200 OK\r\ncontent-type: application/sparql-results+json\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
                out.extend(chunked(
                    br#"{"head": {"vars": ["n"]}, "results": {"bindings": ["#,
                ));
                let mut n = 0u64;
                loop {
                    let mut rows = String::new();
                    while rows.len() < 64 * 1024 {
                        rows.push_str(&format!(
                            r#"{{"n": {{"type": "literal", "value": "{n}"}}}},"#
                        ));
                        n += 1;
                    }
                    out.extend(chunked(rows.as_bytes()));
                    if connection.write_all(&out).await.is_err() {
                        return;
                    }
                    sent.fetch_add(out.len(), std::sync::atomic::Ordering::SeqCst);
                    out.clear();
                }
            });
        }
    });
    (base, sent)
}

/// An answer of more rows than a query may have is refused at the row past the bound, as it
/// arrives, and the server is cut off: the whole body was read (up to 256 MiB, then refused as
/// too large) and parsed before its rows were counted.
#[tokio::test]
async fn an_answer_without_end_is_refused_at_its_row_past_the_bound() {
    let (server, sent) = endless_rows_server().await;
    let store = GraphStore::open(&server, None).unwrap();
    let answer = store
        .query_bounded(
            "SELECT ?n WHERE { ?n ?p ?o }".to_owned(),
            common::default_bounds(30, 10),
        )
        .await;
    assert!(
        matches!(answer, Err(GraphError::TooManyRows(10))),
        "{answer:?}"
    );
    // What was on its way when the connection closed: far less than a bound in bytes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = sent.load(std::sync::atomic::Ordering::SeqCst);
    assert!(sent < 32 * 1024 * 1024, "{sent} bytes sent");
}
