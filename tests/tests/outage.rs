//! An LLM provider outage, end to end on a real broker: steps that meet it are parked and tried
//! again with growing pauses, so ReACT, plan and supervisor dialogs in flight when the provider
//! goes down all finish with their answers once it is back, each exactly once; with an outage
//! window shorter than the outage, each dialog ends once with an error that names the cause.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_e2e::*;
use agent_schema::AgentRequest;

/// How long the provider is down in the first test; the LLM client's own retries last ~4 s, so
/// every step that meets the outage is parked several times.
const OUTAGE: Duration = Duration::from_secs(25);

const SCRIPT: &str = r#"{"rules": [
  {"match": "Observation: fetched", "reply": "Thought: I have it.\nFinal Answer: react done", "delay_ms": 150},
  {"match": "fetch it", "exact": true, "reply": "fetched", "delay_ms": 150},
  {"match": "Question: react", "reply": "Thought: look it up.\nAction: llm\nArgs: {\"question\": \"fetch it\"}", "delay_ms": 150},
  {"match": "Request to plan: plan", "reply": "{\"rationale\": \"two steps\", \"steps\": [{\"goal\": \"first part\", \"depends_on\": []}, {\"goal\": \"second part\", \"depends_on\": [0]}]}", "delay_ms": 150},
  {"match": "Step goal: first part", "reply": "Thought: easy.\nFinal Answer: PART1", "delay_ms": 150},
  {"match": "Step goal: second part", "reply": "Thought: easy.\nFinal Answer: PART2", "delay_ms": 150},
  {"match": "Request to answer: plan", "and": ["PART1", "PART2"], "reply": "plan done", "delay_ms": 150},
  {"match": "Request to split: supervise", "reply": "[{\"goal\": \"left half\"}, {\"goal\": \"right half\"}]", "delay_ms": 150},
  {"match": "Question: left half", "reply": "Thought: known.\nFinal Answer: LEFT", "delay_ms": 150},
  {"match": "Question: right half", "reply": "Thought: known.\nFinal Answer: RIGHT", "delay_ms": 150},
  {"match": "Request to answer from the subagents: supervise", "and": ["LEFT", "RIGHT"], "reply": "supervisor done", "delay_ms": 150}
]}"#;

/// Twenty dialogs: (client id, request, expected answer).
fn dialogs() -> Vec<(String, AgentRequest, &'static str)> {
    (0..20)
        .map(|i| {
            let (pattern, question, answer) = match i % 3 {
                0 => ("react", format!("react {i}"), "react done"),
                1 => ("plan-then-execute", format!("plan {i}"), "plan done"),
                _ => ("supervisor", format!("supervise {i}"), "supervisor done"),
            };
            let request = AgentRequest {
                pattern: pattern.into(),
                ..request(&question, i % 4 == 0)
            };
            (format!("outage-{i}"), request, answer)
        })
        .collect()
}

fn outage_limits(name: &str, max_outage_secs: u64) -> std::path::PathBuf {
    seed_with(
        name,
        &[(
            "agent-limits",
            &format!(
                r#"{{"default": {{"max_outage_secs": {max_outage_secs}, "max_wall_secs": 0}}}}"#
            ),
        )],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialogs_in_flight_wait_out_an_llm_outage_and_finish_once() {
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(SCRIPT).await;
    let http_port = agent_bus::embedded::free_port().unwrap();
    let http_addr = format!("127.0.0.1:{http_port}");
    // A child: its metrics are read, and the registry is per process.
    let _orchestrator = Orchestrator::child(
        &broker,
        &llm,
        &outage_limits("outage-waited", 300),
        &["--max-in-flight", "32", "--http-addr", &http_addr],
    );
    let mut client = client(&broker).await;
    let dialogs = dialogs();
    for (id, request, _) in &dialogs {
        client.send(id, request).await.unwrap();
    }
    // The provider goes down once the dialogs are under way, and comes back after OUTAGE.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while llm.calls().len() < 15 {
        assert!(
            tokio::time::Instant::now() < until,
            "the dialogs did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    llm.start_outage(503, Some(1));
    tokio::time::sleep(OUTAGE).await;
    llm.end_outage();

    let ids: Vec<&str> = dialogs.iter().map(|(id, _, _)| id.as_str()).collect();
    let ended = collect_dialogs(&mut client, &ids, Duration::from_secs(120)).await;
    for (id, _, answer) in &dialogs {
        let responses = &ended[id];
        let ends = responses.iter().filter(|r| r.end_of_dialog).count();
        assert_eq!(ends, 1, "{id} ended {ends} times: {responses:#?}");
        assert_eq!(outcome(responses), *answer, "{id}: {responses:#?}");
        // A tool whose LLM was down made the step wait; the outage was never an observation.
        assert!(
            !responses
                .iter()
                .any(|r| r.content.contains("failed: the LLM")),
            "{id}: {responses:#?}"
        );
    }
    let refused = llm
        .calls()
        .iter()
        .filter(|c| c.fault.as_deref() == Some("outage 503"))
        .count();
    assert!(refused > 0, "the outage met no call");
    let metrics = scrape(&format!("http://{http_addr}")).await;
    assert!(sample(&metrics, "agent_steps_parked_total") >= 1.0);
    println!("outage: 20 dialogs finished once each; {refused} calls met the outage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_past_its_window_ends_each_dialog_once_with_the_cause() {
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(SCRIPT).await;
    llm.start_outage(503, None);
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &outage_limits("outage-window", 2), &[]);
    let mut client = client(&broker).await;
    let dialogs: Vec<_> = dialogs().into_iter().take(6).collect();
    for (id, request, _) in &dialogs {
        client.send(id, request).await.unwrap();
    }
    let ids: Vec<&str> = dialogs.iter().map(|(id, _, _)| id.as_str()).collect();
    let ended = collect_dialogs(&mut client, &ids, Duration::from_secs(90)).await;
    for (id, _, _) in &dialogs {
        let responses = &ended[id];
        let ends = responses.iter().filter(|r| r.end_of_dialog).count();
        assert_eq!(ends, 1, "{id} ended {ends} times: {responses:#?}");
        let error = outcome(responses);
        assert!(
            error.starts_with("error: ")
                && error.contains("max_outage_secs")
                && error.contains("503"),
            "{id}: {error}"
        );
    }
    // The end is recorded: the conclusion says it was an error, with the cause.
    for (id, _, _) in &dialogs {
        let t = explained(&ended[id]);
        let session = session_of(&ended[id]);
        let conclusion = format!("{session}/final");
        assert_eq!(
            values(&t, &conclusion, tg::TERMINATION_REASON),
            ["error"],
            "{id}"
        );
    }
}

/// Documents kept in TrustGraph's librarian, which does not answer (none runs on the broker): a
/// document the graph holds (a fan-in keeps there what the librarian did not take) is read from
/// the graph all the same; one the graph lacks is the librarian's outage, reported as such.
#[tokio::test]
async fn a_document_the_librarian_does_not_answer_for_is_read_from_the_graph() {
    use agent_orchestrator::documents::DocumentStore;
    let broker = Broker::start().unwrap();
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let librarian = agent_bus::Librarian::connect(&bus, &topics, Duration::from_millis(300))
        .await
        .unwrap();
    let graph = agent_graph::GraphStore::in_memory().unwrap();
    let text = format!("kept in the graph {}", "at length ".repeat(500));
    let kept = agent_core::documents::document_uri(&text);
    graph.keep_document(&kept, &text).await.unwrap();
    let documents = DocumentStore::Librarian {
        librarian: std::sync::Arc::new(librarian),
        graph: Some(graph),
    };
    let read = documents.fetch(std::slice::from_ref(&kept)).await;
    assert_eq!(read.failure, None);
    assert_eq!(read.texts.get(&kept), Some(&text));
    // One in neither store may be in the librarian: a failure, but what was read is kept.
    let absent = agent_core::documents::document_uri("kept nowhere");
    let outage = documents.fetch(&[kept.clone(), absent]).await;
    assert!(outage.failure.is_some(), "{outage:?}");
    assert_eq!(outage.texts.get(&kept), Some(&text));
}
