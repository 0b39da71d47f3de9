//! What the bounded-query tests share: a small store, and how busy this process's cores are.
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
