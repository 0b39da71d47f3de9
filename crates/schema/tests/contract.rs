//! Contract tests: the wire types match TrustGraph's real messages and the committed JSON Schemas.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use agent_schema::{AgentRequest, AgentResponse, Triples};
use serde_json::Value;

fn fixture_lines() -> Vec<(String, Value)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let mut lines = Vec::new();
    for name in ["wire_nonstream.jsonl", "wire_stream3.jsonl"] {
        let text = std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let record: Value = serde_json::from_str(line).unwrap();
            let topic = record["topic"].as_str().unwrap().to_owned();
            let payload: Value = serde_json::from_str(record["bytes"].as_str().unwrap()).unwrap();
            lines.push((topic, payload));
        }
    }
    lines
}

fn roundtrip<T: serde::de::DeserializeOwned + serde::Serialize>(payload: &Value) -> Value {
    let bytes = serde_json::to_vec(payload).unwrap();
    let decoded: T = agent_schema::decode(&bytes).unwrap();
    serde_json::from_slice(&agent_schema::encode(&decoded)).unwrap()
}

/// Every agent request, agent response and triples message TrustGraph 2.11 put on the broker decodes
/// into our types and re-encodes to an equal JSON value (all fields present, nulls kept).
#[test]
fn every_captured_message_roundtrips() {
    let (mut requests, mut responses, mut triples) = (0, 0, 0);
    for (topic, payload) in fixture_lines() {
        let reencoded = if topic.ends_with("/request/agent:default:default") {
            requests += 1;
            roundtrip::<AgentRequest>(&payload)
        } else if topic.ends_with("/response/agent:default:default") {
            responses += 1;
            roundtrip::<AgentResponse>(&payload)
        } else if topic.contains("/triples-store:") {
            triples += 1;
            roundtrip::<Triples>(&payload)
        } else {
            continue;
        };
        assert_eq!(reencoded, payload, "on topic {topic}");
    }
    assert_eq!((requests, responses, triples), (4, 17, 8));
}

/// `schemas/` is generated from the types; regenerate with `UPDATE_SCHEMAS=1 cargo test -p agent-schema`.
#[test]
fn committed_schemas_match_the_types() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../schemas");
    let update = std::env::var_os("UPDATE_SCHEMAS").is_some();
    for (name, text) in agent_schema::json_schemas() {
        let path = format!("{dir}/{name}");
        if update {
            std::fs::write(&path, &text).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == text,
            "{path} drifted from the Rust types; run UPDATE_SCHEMAS=1 cargo test -p agent-schema"
        );
    }
}
