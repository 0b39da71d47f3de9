//! What the store's tests share: a small store, how busy this process's cores are, and a SPARQL
//! endpoint in a few lines of HTTP/1.1 whose answers a test decides.
#![allow(clippy::unwrap_used, dead_code)]

use std::time::Duration;

use agent_graph::{GraphStore, QueryBounds};

/// A stranger's bounds (the default budget of bindings) with `timeout_secs` and `max_rows`.
pub fn default_bounds(timeout_secs: u64, max_rows: usize) -> QueryBounds {
    QueryBounds {
        timeout: Duration::from_secs(timeout_secs),
        max_rows,
        max_bindings: QueryBounds::DEFAULT_MAX_BINDINGS,
    }
}

/// CPU seconds this process used so far (user and system), from /proc.
pub fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// The share of one core the process used over the next `window`.
pub async fn cpu_share(window: Duration) -> f64 {
    let before = cpu_seconds();
    tokio::time::sleep(window).await;
    (cpu_seconds() - before) / window.as_secs_f64()
}

/// An in-memory store of `n` triples in one named graph, over seven predicates.
pub async fn store_with_triples(n: usize) -> GraphStore {
    let store = GraphStore::in_memory().unwrap();
    let mut data = String::new();
    for i in 0..n {
        data.push_str(&format!(
            "<urn:s:{i}> <urn:p:{}> \"{i}\" <urn:g:1> .\n",
            i % 7
        ));
    }
    store
        .load(data.into_bytes(), "application/n-quads", None)
        .await
        .unwrap();
    store
}

/// What a raw endpoint answers a request: its status line (`"204 No Content"`), content type and
/// body.
pub type Answer = (&'static str, &'static str, Vec<u8>);

/// How a raw endpoint answers a request, given its head (lower-cased) and its body.
pub type Respond = std::sync::Arc<
    dyn Fn(String, String) -> futures::future::BoxFuture<'static, Answer> + Send + Sync,
>;

/// A SPARQL endpoint in a few lines of HTTP/1.1 (enough for `reqwest`, keep-alive included), each
/// request answered by `respond`: its base address.
pub async fn raw_endpoint(respond: Respond) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (_, never_down) = tokio::sync::watch::channel(false);
    tokio::spawn(serve_raw(listener, respond, never_down));
    base
}

/// The status a raw endpoint's answer gives to go down as a killed server does: the request is
/// not answered, and once `down` says so, the port is closed and every connection dropped.
pub const KILLED: &str = "killed";

/// Serves [`raw_endpoint`]'s requests on `listener` until `down` turns true.
pub async fn serve_raw(
    listener: tokio::net::TcpListener,
    respond: Respond,
    down: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let mut stopping = down.clone();
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            // A sender dropped (a server never killed) stops nothing.
            Ok(_) = stopping.wait_for(|down| *down) => return,
        };
        let Ok((mut connection, _)) = accepted else {
            return;
        };
        let respond = respond.clone();
        let mut stopping = down.clone();
        tokio::spawn(async move {
            let serving = async move {
                let mut received = Vec::new();
                loop {
                    let Some(head_end) = received.windows(4).position(|w| w == b"\r\n\r\n") else {
                        let mut chunk = [0u8; 4096];
                        match connection.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => received.extend_from_slice(&chunk[..n]),
                        }
                        continue;
                    };
                    let head = String::from_utf8_lossy(&received[..head_end]).to_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|line| line.strip_prefix("content-length:"))
                        .map(|n| n.trim().parse().unwrap())
                        .unwrap_or(0);
                    let body_start = head_end + 4;
                    while received.len() < body_start + length {
                        let mut chunk = [0u8; 4096];
                        match connection.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => received.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = String::from_utf8_lossy(&received[body_start..body_start + length])
                        .into_owned();
                    received.drain(..body_start + length);
                    let (status, content_type, answer) = respond(head, body).await;
                    if status == KILLED {
                        return;
                    }
                    let head = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
                        answer.len()
                    );
                    if connection.write_all(head.as_bytes()).await.is_err()
                        || connection.write_all(&answer).await.is_err()
                    {
                        return;
                    }
                }
            };
            tokio::select! {
                () = serving => {}
                Ok(_) = stopping.wait_for(|down| *down) => {}
            }
        });
    }
}
