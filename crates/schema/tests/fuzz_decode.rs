//! Property-based fuzzing of the request decoder: whatever bytes arrive on the request topic,
//! decoding returns a value or an error, never panics, and whatever decodes re-encodes to itself.
//! `PROPTEST_CASES` sets how many inputs each property tries (CI runs the default below).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use agent_schema::{AgentRequest, AgentStep, PlanStep};
use proptest::prelude::*;
use serde_json::Value;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// The captured TrustGraph requests, as seeds to mutate.
fn seeds() -> Vec<Vec<u8>> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");
    let mut out = Vec::new();
    for name in ["wire_nonstream.jsonl", "wire_stream3.jsonl"] {
        let text = std::fs::read_to_string(format!("{dir}/{name}")).unwrap();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let record: Value = serde_json::from_str(line).unwrap();
            if record["topic"].as_str().unwrap().contains("/request/agent") {
                out.push(record["bytes"].as_str().unwrap().as_bytes().to_vec());
            }
        }
    }
    assert!(!out.is_empty());
    out
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let fragment = prop_oneof![
        prop::collection::vec(any::<u8>(), 1..8),
        prop::sample::select(vec![
            b"\"".to_vec(),
            b"{".to_vec(),
            b"}".to_vec(),
            b"[".to_vec(),
            b"null".to_vec(),
            b"1e999".to_vec(),
            b"-0".to_vec(),
            b"\\u0000".to_vec(),
            b"\\ud800".to_vec(),
            b",\"history\":[{}]".to_vec(),
            b",\"group\":\"*\"".to_vec(),
            b"\xff\xfe".to_vec(),
        ]),
    ];
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<usize>(), fragment).prop_map(|(i, f)| Mutation::Insert(i, f)),
        (any::<usize>(), 1usize..16).prop_map(|(i, n)| Mutation::Delete(i, n)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = bytes.len().max(1);
        match m {
            Mutation::Flip(i, b) if !bytes.is_empty() => bytes[i % len] ^= b | 1,
            Mutation::Insert(i, f) => {
                let at = i % (bytes.len() + 1);
                bytes.splice(at..at, f.iter().copied());
            }
            Mutation::Delete(i, n) if !bytes.is_empty() => {
                let at = i % len;
                let end = (at + n).min(bytes.len());
                bytes.drain(at..end);
            }
            Mutation::Truncate(i) => bytes.truncate(i % (bytes.len() + 1)),
            _ => {}
        }
    }
    bytes
}

/// Any JSON value, nested a few levels, with the request's own field names as likely keys.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
    ];
    let key = prop::sample::select(vec![
        "question",
        "state",
        "group",
        "history",
        "streaming",
        "session_id",
        "pattern",
        "plan",
        "arguments",
        "depends_on",
        "subagent_results",
        "expected_siblings",
        "other",
    ]);
    leaf.prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(key.clone().prop_map(str::to_owned), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![".{0,24}", "[a-z0-9:_.-]{0,12}"]
}

fn plan_step() -> impl Strategy<Value = PlanStep> {
    (
        text(),
        text(),
        prop::collection::vec(any::<i64>(), 0..4),
        text(),
        text(),
    )
        .prop_map(|(goal, tool_hint, depends_on, status, result)| PlanStep {
            goal,
            tool_hint,
            depends_on,
            status,
            result,
        })
}

fn agent_step() -> impl Strategy<Value = AgentStep> {
    (
        (
            text(),
            text(),
            prop::collection::btree_map(text(), text(), 0..3),
        ),
        (text(), text()),
        prop::option::of(prop::collection::vec(plan_step(), 0..3)),
        prop::option::of(prop::collection::btree_map(text(), text(), 0..3)),
    )
        .prop_map(
            |((thought, action, arguments), (observation, step_type), plan, subagent_results)| {
                AgentStep {
                    thought,
                    action,
                    arguments,
                    observation,
                    step_type,
                    plan,
                    subagent_results,
                }
            },
        )
}

fn request() -> impl Strategy<Value = AgentRequest> {
    (
        (
            text(),
            prop::option::of(text()),
            prop::option::of(prop::collection::vec(text(), 0..3)),
        ),
        prop::collection::vec(agent_step(), 0..3),
        (text(), any::<bool>(), text(), text(), text(), text()),
        (text(), text(), text(), text(), any::<i64>()),
    )
        .prop_map(
            |(
                (question, state, group),
                history,
                (collection, streaming, session_id, conversation_id, pattern, task_type),
                (framing, correlation_id, parent_session_id, subagent_goal, expected_siblings),
            )| AgentRequest {
                question,
                state,
                group,
                history,
                collection,
                streaming,
                session_id,
                conversation_id,
                pattern,
                task_type,
                framing,
                correlation_id,
                parent_session_id,
                subagent_goal,
                expected_siblings,
            },
        )
}

/// Whatever decodes re-encodes to a payload that decodes to the same request.
fn assert_stable(bytes: &[u8]) {
    if let Ok(decoded) = agent_schema::decode::<AgentRequest>(bytes) {
        let again: AgentRequest = agent_schema::decode(&agent_schema::encode(&decoded)).unwrap();
        assert_eq!(again, decoded);
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        assert_stable(&bytes);
    }

    #[test]
    fn mutated_trustgraph_requests_never_panic(
        seed in any::<prop::sample::Index>(),
        mutations in prop::collection::vec(mutation(), 1..6),
    ) {
        let seeds = seeds();
        let bytes = apply(seed.get(&seeds).clone(), &mutations);
        assert_stable(&bytes);
    }

    #[test]
    fn arbitrary_json_never_panics(value in json_value()) {
        assert_stable(&serde_json::to_vec(&value).unwrap());
    }

    #[test]
    fn every_request_roundtrips(request in request()) {
        let decoded: AgentRequest = agent_schema::decode(&agent_schema::encode(&request)).unwrap();
        prop_assert_eq!(decoded, request);
    }
}

/// Keys the decoder does not know are ignored, so a newer peer's fields do not poison a message.
#[test]
fn unknown_fields_are_ignored() {
    let request: AgentRequest =
        agent_schema::decode(br#"{"question": "q", "brand_new": {"x": [1]}}"#).unwrap();
    assert_eq!(request.question, "q");
}
