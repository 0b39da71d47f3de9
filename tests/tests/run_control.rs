//! Run control end to end on a real broker: `agentctl cancel` stops a supervisor's fan-out whose
//! subagents are stuck in stalled LLM calls (every branch stops, the client gets one closing
//! message, no LLM call is made after the cancel, the graph records who cancelled and when), and a
//! cancel sent while no orchestrator runs is read from the graph by the next one to start.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse};

const TOKEN: &str = "run-control-token";

/// Three subagents whose LLM calls hang far longer than the test waits.
const STALLED_FAN_OUT: &str = r#"{"rules": [
  {"match": "Request to split: Survey", "reply": "[{\"goal\": \"topic one\"}, {\"goal\": \"topic two\"}, {\"goal\": \"topic three\"}]"},
  {"match": "Question: topic one", "reply": "unused", "faults": ["stall", "stall"], "stall_ms": 120000},
  {"match": "Question: topic two", "reply": "unused", "faults": ["stall", "stall"], "stall_ms": 120000},
  {"match": "Question: topic three", "reply": "unused", "faults": ["stall", "stall"], "stall_ms": 120000},
  {"match": "Request to answer from the subagents: Survey", "reply": "a synthesis that must not happen"}
]}"#;

fn cancel(broker: &Broker, session: &str, by: &str, reason: &str) {
    let out = Command::new(binary("agentctl"))
        .args(["cancel", session, "--by", by, "--reason", reason])
        .args(["--pulsar-url", &broker.url()])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "agentctl cancel failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains(&format!("cancelled session {session}")),
        "{said}"
    );
}

fn closings(responses: &[AgentResponse]) -> Vec<&AgentResponse> {
    responses.iter().filter(|r| r.end_of_dialog).collect()
}

/// The one closing message is a `cancelled` error naming who cancelled and why.
fn assert_closed_by_cancel(responses: &[AgentResponse], by: &str, reason: &str) {
    let closings = closings(responses);
    assert_eq!(closings.len(), 1, "{responses:#?}");
    let error = closings[0]
        .error
        .as_ref()
        .expect("a cancelled dialog ends with an error");
    assert_eq!(error.kind, "cancelled", "{responses:#?}");
    assert!(
        error.message.contains(&format!("cancelled by {by}")) && error.message.contains(reason),
        "{}",
        error.message
    );
}

/// The cancel and the conclusion it caused, as the graph holds them.
async fn assert_recorded(aggregator: &Aggregator, session: &str, by: &str) {
    let store = aggregator.store();
    let session_uri = format!("urn:trustgraph:agent:{session}");
    let recorded = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{session_uri}> prov:wasInvalidatedBy ?c .
           ?c a tg:Cancellation ; tg:cancelledBy \"{by}\" ; prov:atTime ?at ; prov:wasDerivedFrom <{session_uri}> .
           <{session_uri}/final> tg:terminationReason \"cancelled\" ; tg:cancellation ?c . }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&store, recorded, 1).await, 1, "{session}");
}

#[tokio::test]
async fn a_cancel_stops_every_branch_of_a_stalled_fan_out() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(STALLED_FAN_OUT).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send(
            "c-1",
            &AgentRequest {
                pattern: "supervisor".into(),
                ..request("Survey three topics.", false)
            },
        )
        .await
        .unwrap();
    // All three subagents are inside their stalled LLM calls.
    let stalled = |llm: &scripted_llm::ScriptedLlm| {
        llm.calls()
            .iter()
            .filter(|c| c.last_user.contains("Question: topic"))
            .count()
    };
    for _ in 0..300 {
        if stalled(&llm) >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stalled(&llm), 3, "the subagents did not start");
    let mut responses = drain_for(&mut client, "c-1", Duration::from_millis(500)).await;
    let session = responses
        .iter()
        .find_map(|r| agent_core::vocab::session_id_of(&r.message_id))
        .expect("the fan-out was reported")
        .to_owned();
    assert!(
        agent_core::supervisor::place_of(&session).is_none(),
        "{session}"
    );

    let calls_before = llm.calls().len();
    cancel(&broker, &session, "ops-alice", "wrong question");
    // The stalls last two minutes: an end within 30 s means every branch let go of its call.
    responses.extend(
        collect_dialog(&mut client, "c-1", Duration::from_secs(30))
            .await
            .unwrap(),
    );
    responses.extend(drain_for(&mut client, "c-1", Duration::from_secs(2)).await);
    assert_closed_by_cancel(&responses, "ops-alice", "wrong question");
    assert_eq!(
        llm.calls().len(),
        calls_before,
        "an LLM call was made after the cancel"
    );

    assert_recorded(&aggregator, &session, "ops-alice").await;
    // Every branch ended as cancelled, each its own completion, so the fan-in closed at once.
    let store = aggregator.store();
    let cancelled_branches = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?c a tg:SubagentCompletion ; tg:completionStatus \"cancelled\" .
           FILTER(STRSTARTS(STR(?c), \"urn:trustgraph:agent:{session}-f\")) }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&store, cancelled_branches, 3).await, 3);
    let synthesis_calls = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Request to answer from the subagents"))
        .count();
    assert_eq!(synthesis_calls, 0);
}

/// A cancel sent while no orchestrator runs is recorded in the graph; the next orchestrator to
/// start reads it there, and the dialog's waiting step ends it without calling the LLM.
#[tokio::test]
async fn a_cancel_sent_while_no_orchestrator_runs_is_read_from_the_graph() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(THREE_STEPS).await;
    // One orchestrator makes the durable subscription, then stops.
    let first = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let mut client = client(&broker).await;
    client
        .send(
            "warm",
            &AgentRequest {
                pattern: "react".into(),
                ..request("combine (warm-up)", false)
            },
        )
        .await
        .unwrap();
    collect_dialog(&mut client, "warm", Duration::from_secs(60))
        .await
        .unwrap();
    first.terminate();
    let mut first = first;
    assert!(first.exited_within(Duration::from_secs(30)).await);

    let calls_before = llm.calls().len();
    client
        .send(
            "c-2",
            &AgentRequest {
                pattern: "react".into(),
                session_id: "parked-dialog".into(),
                ..request("combine (parked)", false)
            },
        )
        .await
        .unwrap();
    cancel(&broker, "parked-dialog", "ops-bob", "not needed any more");
    let store = aggregator.store();
    let record = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{ ?c a tg:Cancellation ; tg:cancelledBy \"ops-bob\" }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&store, record, 1).await, 1);

    let _second = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let mut responses = collect_dialog(&mut client, "c-2", Duration::from_secs(60))
        .await
        .unwrap();
    responses.extend(drain_for(&mut client, "c-2", Duration::from_secs(2)).await);
    assert_closed_by_cancel(&responses, "ops-bob", "not needed any more");
    assert_eq!(llm.calls().len(), calls_before, "the cancelled step ran");
    assert_recorded(&aggregator, "parked-dialog", "ops-bob").await;
}
