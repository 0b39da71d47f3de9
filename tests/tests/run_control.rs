//! Run control end to end on a real broker: `agentctl cancel` stops a supervisor's fan-out whose
//! subagents are stuck in stalled LLM calls (every branch stops, the client gets one closing
//! message, no LLM call is made after the cancel, the graph records who cancelled and when), and a
//! cancel sent while no orchestrator runs is read from the graph by the next one to start; a cancel
//! racing a dialog's steps gives exactly one ending, whichever wins.
//! Approvals: one subagent's tool call parks for approval while its siblings finish and the
//! supervisor waits only for it; the approval is answered on another replica than the one that
//! parked it, once only however often it is sent; an approval that never comes ends its branch
//! and the supervisor synthesises from the rest; a denied call is observed and the agent goes on.
//! Conversations: a second request waits for the first and is told its question and answer; the
//! other policies refuse it, or cancel the first.
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

/// Runs `agentctl` against `broker`, with the services' seal key; what it printed.
fn agentctl(broker: &Broker, args: &[&str]) -> String {
    agentctl_keyed(broker, Some(SEAL_KEY), args)
}

/// Runs `agentctl` against `broker` with the seal key `key` (or none); what it printed.
fn agentctl_keyed(broker: &Broker, key: Option<&str>, args: &[&str]) -> String {
    let mut command = Command::new(binary("agentctl"));
    command
        .args(args)
        .args(["--pulsar-url", &broker.url()])
        .env("RUST_LOG", "warn")
        .env_remove("AGENT_SEAL_KEY");
    if let Some(key) = key {
        command.env("AGENT_SEAL_KEY", key);
    }
    let out = command.output().unwrap();
    assert!(
        out.status.success(),
        "agentctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn cancel(broker: &Broker, session: &str, by: &str, reason: &str) {
    let said = agentctl(broker, &["cancel", session, "--by", by, "--reason", reason]);
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

/// A cancel heard while the model is still writing a step that would call a tool: the stream is
/// abandoned (the model's connection is closed, not read to its end), the tool is never called,
/// and the client gets one closing message.
#[tokio::test]
async fn a_cancel_abandons_a_streaming_step_and_its_tool_is_never_called() {
    // About eighteen chunks two seconds apart: read to its end, the stream would last 36 s.
    const SLOW: &str = r#"{"rules": [
      {"match": "transfer the funds", "exact": true, "reply": "funds transferred"},
      {"match": "Question: move the money", "reply": "Thought: I will move the money now, once I have checked both accounts.\nAction: llm\nArgs: {\"question\": \"transfer the funds\"}", "chunk_delay_ms": 2000}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(SLOW).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send(
            "c-5",
            &AgentRequest {
                pattern: "react".into(),
                ..request("move the money", true)
            },
        )
        .await
        .unwrap();
    // The thought is streaming.
    let mut responses = Vec::new();
    for _ in 0..100 {
        responses.extend(drain_for(&mut client, "c-5", Duration::from_millis(200)).await);
        if responses.iter().any(|r| r.message_type == "thought") {
            break;
        }
    }
    let session = responses
        .iter()
        .find_map(|r| agent_core::vocab::session_id_of(&r.message_id))
        .expect("a thought was streamed")
        .to_owned();
    assert_eq!(llm.streams_open(), 1, "the model is still writing");
    let cancelled_at = std::time::Instant::now();
    cancel(&broker, &session, "ops-carol", "changed my mind");
    responses.extend(
        collect_dialog(&mut client, "c-5", Duration::from_secs(15))
            .await
            .unwrap(),
    );
    println!(
        "closed {:?} after the cancel was sent",
        cancelled_at.elapsed()
    );
    assert_closed_by_cancel(&responses, "ops-carol", "changed my mind");
    // The connection was closed: the server stops at its next chunk, long before the stream's
    // own end.
    until("the model's stream is abandoned", || {
        llm.streams_open() == 0
    })
    .await;
    assert!(
        cancelled_at.elapsed() < Duration::from_secs(15),
        "the stream ran to its end"
    );
    responses.extend(drain_for(&mut client, "c-5", Duration::from_secs(2)).await);
    assert_eq!(
        payments(&llm, "transfer the funds"),
        0,
        "the tool was called"
    );
    assert_eq!(llm.calls().len(), 1, "{:#?}", llm.calls());
    assert_eq!(closings(&responses).len(), 1);
    assert_recorded(&aggregator, &session, "ops-carol").await;
}

/// A cancel the broker dropped on its way to a replica (the control topic is non-persistent: a
/// broker drops such a message for a consumer whose connection is backed up) is read from the
/// graph, where `agentctl cancel` recorded it, within seconds: the replica read the graph only at
/// its start and after losing the topic, so the run went on to its answer there, tool called.
#[tokio::test]
async fn a_cancel_the_broker_dropped_is_read_from_the_graph_and_acted_on() {
    const SLOW: &str = r#"{"rules": [
      {"match": "transfer the funds", "exact": true, "reply": "funds transferred"},
      {"match": "Question: move the money", "reply": "Thought: I will move the money now, once I have checked both accounts.\nAction: llm\nArgs: {\"question\": \"transfer the funds\"}", "chunk_delay_ms": 2000}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(SLOW).await;
    let _orchestrator = Orchestrator::journaled(
        Place::Child,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &[("AGENT_FAULT", "drop-control:1")],
    );
    let mut client = client(&broker).await;
    client
        .send(
            "c-dropped",
            &AgentRequest {
                pattern: "react".into(),
                ..request("move the money", true)
            },
        )
        .await
        .unwrap();
    let mut responses = Vec::new();
    for _ in 0..150 {
        responses.extend(drain_for(&mut client, "c-dropped", Duration::from_millis(200)).await);
        if responses.iter().any(|r| r.message_type == "thought") {
            break;
        }
    }
    let session = responses
        .iter()
        .find_map(|r| agent_core::vocab::session_id_of(&r.message_id))
        .expect("a thought was streamed")
        .to_owned();
    let cancelled_at = std::time::Instant::now();
    cancel(&broker, &session, "ops-dave", "dropped on its way");
    responses.extend(
        collect_dialog(&mut client, "c-dropped", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    println!(
        "closed {:?} after the cancel was sent",
        cancelled_at.elapsed()
    );
    assert_closed_by_cancel(&responses, "ops-dave", "dropped on its way");
    responses.extend(drain_for(&mut client, "c-dropped", Duration::from_secs(2)).await);
    assert_eq!(
        payments(&llm, "transfer the funds"),
        0,
        "the tool was called"
    );
    assert_eq!(closings(&responses).len(), 1);
}

/// A cancel sent while the replica running the step drains (a rolling deploy's SIGTERM) stops
/// the step as at any other time: the replica stopped hearing cancels as the drain began, so the
/// step ran on, its tool called, while the cancel waited for a next step.
#[tokio::test]
async fn a_cancel_sent_during_a_drain_stops_the_draining_step() {
    const SLOW: &str = r#"{"rules": [
      {"match": "transfer the funds", "exact": true, "reply": "funds transferred"},
      {"match": "Question: move the money", "reply": "Thought: I will move the money now, once I have checked both accounts.\nAction: llm\nArgs: {\"question\": \"transfer the funds\"}", "chunk_delay_ms": 2000}
    ]}"#;
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(SLOW).await;
    let mut draining = Orchestrator::child(&broker, &llm, &seed_dir(), &["--drain-secs", "60"]);
    let mut client = client(&broker).await;
    client
        .send(
            "c-drain",
            &AgentRequest {
                pattern: "react".into(),
                ..request("move the money", true)
            },
        )
        .await
        .unwrap();
    let mut responses = Vec::new();
    for _ in 0..150 {
        responses.extend(drain_for(&mut client, "c-drain", Duration::from_millis(200)).await);
        if responses.iter().any(|r| r.message_type == "thought") {
            break;
        }
    }
    let session = responses
        .iter()
        .find_map(|r| agent_core::vocab::session_id_of(&r.message_id))
        .expect("a thought was streamed")
        .to_owned();
    draining.terminate();
    tokio::time::sleep(Duration::from_millis(500)).await;
    cancel(&broker, &session, "ops-erin", "mid-deploy");
    responses.extend(
        collect_dialog(&mut client, "c-drain", Duration::from_secs(20))
            .await
            .unwrap(),
    );
    assert_closed_by_cancel(&responses, "ops-erin", "mid-deploy");
    assert!(
        draining.exited_within(Duration::from_secs(15)).await,
        "the orchestrator did not exit after its drain"
    );
    assert_eq!(
        payments(&llm, "transfer the funds"),
        0,
        "the tool was called"
    );
}

/// A cancel heard while a supervisor's synthesis call is in flight, after the step critic judged
/// the results in the same step: the step is abandoned with the verdict nodes that recorded the
/// critic's calls, so the closing's tokens leave those calls out too and add up to the graph's.
/// Until 2026-12-05 the closing counted the critic's tokens the graph never showed.
#[tokio::test]
async fn a_cancel_during_a_judged_synthesis_counts_only_what_the_graph_records() {
    const SCRIPT: &str = r#"{"rules": [
      {"match": "Request to split: Measure", "reply": "[{\"goal\": \"measure alpha\"}, {\"goal\": \"measure beta\"}]"},
      {"match": "Result to evaluate: alpha is 1 metre", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"it has its unit\"}"},
      {"match": "Result to evaluate: beta is 2 metres", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"fine\"}"},
      {"match": "Question: measure alpha", "reply": "Thought: known.\nFinal Answer: alpha is 1 metre"},
      {"match": "Question: measure beta", "reply": "Thought: known.\nFinal Answer: beta is 2 metres"},
      {"match": "Request to answer from the subagents: Measure", "reply": "a synthesis that is never read", "delay_ms": 60000}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(SCRIPT).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send(
            "c-judged",
            &AgentRequest {
                pattern: "supervisor".into(),
                task_type: "risk-assessment".into(),
                ..request("Measure both.", false)
            },
        )
        .await
        .unwrap();
    let asked = |llm: &scripted_llm::ScriptedLlm, what: &str| {
        llm.calls()
            .iter()
            .filter(|c| c.last_user.contains(what))
            .count()
    };
    let mut responses = Vec::new();
    for _ in 0..300 {
        responses.extend(drain_for(&mut client, "c-judged", Duration::from_millis(100)).await);
        if asked(&llm, "Request to answer from the subagents") > 0 {
            break;
        }
    }
    assert_eq!(asked(&llm, "Result to evaluate"), 2, "{:#?}", llm.calls());
    assert_eq!(
        asked(&llm, "Request to answer from the subagents"),
        1,
        "the synthesis was not asked for"
    );
    let session = session_of(&responses);
    let session_id = agent_core::vocab::session_id_of(&session)
        .expect("a session node")
        .to_owned();
    cancel(&broker, &session_id, "ops-dave", "enough");
    responses.extend(
        collect_dialog(&mut client, "c-judged", Duration::from_secs(30))
            .await
            .unwrap(),
    );
    assert_closed_by_cancel(&responses, "ops-dave", "enough");
    let closing = closings(&responses)[0];
    let total = closing.in_token.unwrap_or(0) + closing.out_token.unwrap_or(0);
    assert!(total > 0, "{closing:#?}");
    assert_graph_tokens(&aggregator.store(), &session, total).await;
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

/// A tool that pays invoices, which only runs once a person approves it, beside the seed's tools.
const PAY_TOOL: &str = r#"{
  "llm": {"name": "llm", "description": "Ask the LLM a question", "type": "text-completion",
          "arguments": [{"name": "question", "type": "string", "description": "The question"}]},
  "pay": {"name": "pay", "description": "Pay an invoice", "type": "text-completion", "requires-approval": true,
          "arguments": [{"name": "question", "type": "string", "description": "What to pay"}]}
}"#;

fn pay_config(name: &str, approval_timeout_secs: u64) -> std::path::PathBuf {
    let limits = format!(
        r#"{{"default": {{"max_iterations": 6, "approval_timeout_secs": {approval_timeout_secs}}}}}"#
    );
    pay_config_with(name, &limits)
}

/// The `pay` tool (approval required) under the `agent-limits` config `limits`.
fn pay_config_with(name: &str, limits: &str) -> std::path::PathBuf {
    seed_with(name, &[("tool", PAY_TOOL), ("agent-limits", limits)])
}

const SUPERVISED_PAYMENT: &str = r#"{"rules": [
  {"match": "Request to split: Handle", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}, {\"goal\": \"pay the gamma invoice\"}]"},
  {"match": "pay invoice gamma-7", "exact": true, "reply": "payment sent"},
  {"match": "Observation: payment sent", "reply": "Thought: Paid.\nFinal Answer: gamma invoice paid"},
  {"match": "Question: price of alpha", "reply": "Thought: Known.\nFinal Answer: alpha costs 1"},
  {"match": "Question: price of beta", "reply": "Thought: Known.\nFinal Answer: beta costs 2"},
  {"match": "Question: pay the gamma invoice", "reply": "Thought: It must be paid.\nAction: pay\nArgs: {\"question\": \"pay invoice gamma-7\"}"},
  {"match": "Request to answer from the subagents: Handle", "reply": "Alpha costs 1, beta 2; the gamma invoice: see its branch."}
]}"#;

/// Times the `pay` tool ran: its LLM call is asked exactly the tool's question.
fn payments(llm: &scripted_llm::ScriptedLlm, question: &str) -> usize {
    llm.calls()
        .iter()
        .filter(|c| c.last_user.trim() == question)
        .count()
}

fn calls_matching(llm: &scripted_llm::ScriptedLlm, text: &str) -> usize {
    llm.calls()
        .iter()
        .filter(|c| c.last_user.contains(text))
        .count()
}

/// Waits up to 30 s for `ready`.
async fn until(what: &str, mut ready: impl FnMut() -> bool) {
    for _ in 0..300 {
        if ready() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{what} did not happen within 30 s");
}

/// What dialog `id` was sent up to its approval request (read for up to 30 s).
async fn until_approval_asked(client: &mut agent_bus::AgentClient, id: &str) -> Vec<AgentResponse> {
    let mut responses = Vec::new();
    for _ in 0..100 {
        responses.extend(drain_for(client, id, Duration::from_millis(300)).await);
        if responses
            .iter()
            .any(|r| r.message_id.ends_with("/approval"))
        {
            break;
        }
    }
    responses
}

/// The approval request the client was sent: its node, and the session and step it names.
fn approval_asked(responses: &[AgentResponse]) -> (String, String, u64) {
    let asked = responses
        .iter()
        .find(|r| r.message_id.ends_with("/approval"))
        .unwrap_or_else(|| panic!("no approval was asked for: {responses:#?}"));
    assert!(
        asked.content.contains("agentctl approve"),
        "{}",
        asked.content
    );
    let session = agent_core::vocab::session_id_of(&asked.message_id)
        .unwrap()
        .to_owned();
    let step = asked
        .message_id
        .rsplit('/')
        .nth(1)
        .and_then(|i| i.strip_prefix('i'))
        .and_then(|n| n.parse().ok())
        .unwrap();
    (asked.message_id.clone(), session, step)
}

/// Denies the parked call at `session`'s `step` as ops-dan for `reason`, reads dialog `id` to its
/// end into `responses`, and checks the agent ended saying it was not allowed to pay.
async fn denied_to_the_end(
    broker: &Broker,
    client: &mut agent_bus::AgentClient,
    responses: &mut Vec<AgentResponse>,
    (session, step): (&str, u64),
    id: &str,
    reason: &str,
) {
    agentctl(
        broker,
        &[
            "deny",
            session,
            &step.to_string(),
            "--by",
            "ops-dan",
            "--reason",
            reason,
        ],
    );
    responses.extend(
        collect_dialog(client, id, Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let last = responses.last().unwrap();
    assert_eq!(last.content, "I was not allowed to pay.", "{responses:#?}");
}

/// Every completion of the dialog's subagents in the graph, as (status, result).
async fn completions(aggregator: &Aggregator, root: &str) -> Vec<(String, String)> {
    let sparql = format!(
        "{}SELECT ?status ?result WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?c a tg:SubagentCompletion ; tg:completionStatus ?status ; tg:document ?d . ?d tg:content ?result .
           FILTER(STRSTARTS(STR(?c), \"urn:trustgraph:agent:{root}-f\")) }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    let Ok(agent_graph::QueryAnswer::Rows(rows)) = aggregator.store().query(sparql).await else {
        return Vec::new();
    };
    let text = |t: Option<&agent_graph::model::Term>| match t {
        Some(agent_graph::model::Term::Literal(l)) => l.value().to_owned(),
        _ => String::new(),
    };
    rows.column("status")
        .into_iter()
        .zip(rows.column("result"))
        .map(|(s, r)| (text(s), text(r)))
        .collect()
}

#[tokio::test]
async fn one_branch_waits_for_approval_answered_on_another_replica_while_its_siblings_finish() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(SUPERVISED_PAYMENT).await;
    let config = pay_config("approve", 300);
    let mut parking = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &config,
        &[],
    );
    let mut client = client(&broker).await;
    client
        .send(
            "a-1",
            &AgentRequest {
                pattern: "supervisor".into(),
                ..request("Handle the three invoices.", false)
            },
        )
        .await
        .unwrap();
    let mut responses = Vec::new();
    until("the approval request", || {
        calls_matching(&llm, "Question: pay the gamma invoice") >= 1
    })
    .await;
    // The two siblings finish while the third waits; nothing is synthesised meanwhile.
    let mut root = None;
    for _ in 0..100 {
        responses.extend(drain_for(&mut client, "a-1", Duration::from_millis(300)).await);
        root = responses
            .iter()
            .find_map(|r| agent_core::vocab::session_id_of(&r.message_id))
            .map(|session| {
                agent_core::supervisor::place_of(session).map_or(session, |p| p.supervisor)
            })
            .map(str::to_owned);
        if root.is_some() {
            break;
        }
    }
    let root = root.unwrap_or_else(|| panic!("nothing of the dialog came back: {responses:#?}"));
    for _ in 0..100 {
        if completions(&aggregator, &root).await.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut done = completions(&aggregator, &root).await;
    done.sort();
    assert_eq!(
        done,
        vec![
            ("answer".to_owned(), "alpha costs 1".to_owned()),
            ("answer".to_owned(), "beta costs 2".to_owned())
        ]
    );
    responses.extend(drain_for(&mut client, "a-1", Duration::from_secs(1)).await);
    let (node, session, step) = approval_asked(&responses);
    assert!(closings(&responses).is_empty(), "{responses:#?}");
    assert_eq!(
        payments(&llm, "pay invoice gamma-7"),
        0,
        "paid before approval"
    );
    assert_eq!(
        calls_matching(&llm, "Request to answer from the subagents"),
        0
    );

    // The replica that parked the call goes away; another takes the answer up.
    parking.terminate();
    assert!(parking.exited_within(Duration::from_secs(30)).await);
    let _other = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &config,
        &[],
    );
    let step_text = step.to_string();
    let said = agentctl(
        &broker,
        &["approve", &session, &step_text, "--by", "ops-carol"],
    );
    assert!(said.contains("approved"), "{said}");
    // The same answer again, as a double click would send it.
    agentctl(
        &broker,
        &["approve", &session, &step_text, "--by", "ops-carol"],
    );
    responses.extend(
        collect_dialog(&mut client, "a-1", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    responses.extend(drain_for(&mut client, "a-1", Duration::from_secs(3)).await);
    let closing = closings(&responses);
    assert_eq!(closing.len(), 1, "{responses:#?}");
    assert!(closing[0].error.is_none(), "{responses:#?}");
    assert_eq!(payments(&llm, "pay invoice gamma-7"), 1, "paid once");
    assert_eq!(
        calls_matching(&llm, "Request to answer from the subagents"),
        1
    );
    let synthesis = llm
        .calls()
        .into_iter()
        .find(|c| c.last_user.contains("Request to answer from the subagents"))
        .unwrap();
    assert!(
        synthesis.last_user.contains("gamma invoice paid"),
        "{}",
        synthesis.last_user
    );

    let sparql = format!(
        "{}SELECT ?answer WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{node}> a tg:ApprovalRequest ; tg:action \"pay\" ; tg:deadline ?deadline ; tg:thought ?t .
           ?answer a tg:ApprovalAnswer ; prov:wasDerivedFrom <{node}> ; tg:decision \"approve\" ;
                   tg:answeredBy \"ops-carol\" ; prov:atTime ?at .
           ?iteration tg:approval <{node}> ; tg:action \"pay\" . }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), sparql, 1).await, 1);
}

/// A supervised payment run on a journaled stack whose approvals time out after
/// `approval_timeout_secs` and whose aggregator runs with `aggregator_args`: the stack, its
/// client, dialog `id`'s responses (closed once, without error: the supervisor answers from the
/// rest) and the prompt of the supervisor's synthesis.
async fn a_supervised_payment_answered(
    name: &str,
    approval_timeout_secs: u64,
    aggregator_args: &[&str],
    id: &str,
) -> (Stack, agent_bus::AgentClient, Vec<AgentResponse>, String) {
    let config = pay_config(name, approval_timeout_secs);
    let stack = Stack::journaled(TOKEN, SUPERVISED_PAYMENT, &config, aggregator_args).await;
    let mut client = client(&stack.broker).await;
    client
        .send(
            id,
            &AgentRequest {
                pattern: "supervisor".into(),
                ..request("Handle the three invoices.", false)
            },
        )
        .await
        .unwrap();
    let mut responses = collect_dialog(&mut client, id, Duration::from_secs(60))
        .await
        .unwrap();
    responses.extend(drain_for(&mut client, id, Duration::from_secs(2)).await);
    let closing = closings(&responses);
    assert_eq!(closing.len(), 1, "{responses:#?}");
    assert!(
        closing[0].error.is_none(),
        "the supervisor answers from the rest: {responses:#?}"
    );
    let synthesis = stack
        .llm
        .calls()
        .into_iter()
        .find(|c| c.last_user.contains("Request to answer from the subagents"))
        .unwrap()
        .last_user;
    (stack, client, responses, synthesis)
}

#[tokio::test]
async fn an_approval_that_never_comes_ends_its_branch_and_a_late_one_changes_nothing() {
    let (stack, mut client, responses, synthesis) =
        a_supervised_payment_answered("expire", 2, &["--approval-sweep-secs", "1"], "a-2").await;
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = stack;
    assert!(
        synthesis.contains("No one approved calling 'pay' within 2 s"),
        "{synthesis}"
    );
    assert_eq!(payments(&llm, "pay invoice gamma-7"), 0);

    // A late approval: the expiry answered first, so nothing runs and nothing is sent.
    let (_, session, step) = approval_asked(&responses);
    agentctl(&broker, &["approve", &session, &step.to_string()]);
    let late = drain_for(&mut client, "a-2", Duration::from_secs(3)).await;
    assert!(late.is_empty(), "{late:#?}");
    assert_eq!(payments(&llm, "pay invoice gamma-7"), 0);
    let sparql = format!(
        "{}SELECT ?answer WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?answer a tg:ApprovalAnswer ; tg:decision ?decision . }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(
        count(&aggregator.store(), sparql).await,
        1,
        "one answer counted"
    );
}

/// An approval that comes after the supervisor's fan-out timed out and was answered without the
/// branch runs nothing: the client's answer already said the branch gave no result, so a payment
/// made then would be one no answer accounts for. Without the check the approved call ran after
/// the supervisor had answered.
#[tokio::test]
async fn an_approval_after_the_supervisor_answered_without_its_branch_runs_nothing() {
    let (stack, mut client, mut responses, synthesis) =
        a_supervised_payment_answered("abandoned", 300, &["--fanout-timeout-secs", "3"], "a-3")
            .await;
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = stack;
    assert!(synthesis.contains("no result within 3 s"), "{synthesis}");
    let (node, session, step) = approval_asked(&responses);
    let said = agentctl(
        &broker,
        &["approve", &session, &step.to_string(), "--by", "ops-dave"],
    );
    assert!(said.contains("approved"), "{said}");
    // The answer is recorded, and the branch ends without the call.
    let answered = format!(
        "{}SELECT ?answer WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?answer a tg:ApprovalAnswer ; tg:decision \"approve\" ; prov:wasDerivedFrom <{node}> }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), answered, 1).await, 1);
    // Its conclusion counts the LLM call that chose the parked call: until 2026-12-05 this path
    // ended with the tokens from before it, recorded nowhere.
    let branch_ended = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?c a tg:Conclusion ; tg:document ?d ; tg:inToken ?in . ?d tg:content ?why .
           FILTER(STRSTARTS(STR(?c), \"urn:trustgraph:agent:{session}/\") && CONTAINS(?why, \"stopped waiting\") && ?in > 0) }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(
        count_reaching(&aggregator.store(), branch_ended, 1).await,
        1
    );
    responses.extend(drain_for(&mut client, "a-3", Duration::from_secs(2)).await);
    assert_eq!(
        payments(&llm, "pay invoice gamma-7"),
        0,
        "paid after the answer"
    );
    let closing = closings(&responses);
    assert_eq!(closing.len(), 1, "{responses:#?}");
    // The supervisor's closing counts the call the branch parked, though the branch was still
    // waiting at the time-out and recorded it only when answered: until 2026-12-05 the graph
    // held it and the closing did not.
    let total = closing[0].in_token.unwrap_or(0) + closing[0].out_token.unwrap_or(0);
    let root = closing[0].message_id.trim_end_matches("/final").to_owned();
    assert_graph_tokens(&aggregator.store(), &root, total).await;
}

/// A run cancelled while its call waits for approval ends at once, not at the call's deadline
/// (ten minutes here): the approvals sweep answers the calls of cancelled runs `expire` too. It
/// ends once, and the expiry is recorded as the call's answer, saying why: the sweep would
/// otherwise send one every minute, each ending the dialog again. Until 2026-12-03 such a run
/// ended only when its deadline passed, its client waiting meanwhile.
#[tokio::test]
async fn a_cancelled_run_parked_for_approval_ends_at_once_and_its_expiry_is_recorded() {
    const PAY: &str = r#"{"rules": [
      {"match": "Question: pay the gamma invoice", "reply": "Thought: It must be paid.\nAction: pay\nArgs: {\"question\": \"pay invoice gamma-7\"}"},
      {"match": "pay invoice gamma-7", "exact": true, "reply": "payment sent"}
    ]}"#;
    let config = pay_config("cancel-parked", 600);
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, PAY, &config, &["--approval-sweep-secs", "1"]).await;
    let mut client = client(&broker).await;
    client
        .send("cp-1", &request("pay the gamma invoice", false))
        .await
        .unwrap();
    let mut responses = until_approval_asked(&mut client, "cp-1").await;
    let (approval, session, _) = approval_asked(&responses);
    cancel(&broker, &session, "ops", "wrong invoice");
    responses.extend(
        collect_dialog(&mut client, "cp-1", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    responses.extend(drain_for(&mut client, "cp-1", Duration::from_secs(3)).await);
    assert_closed_by_cancel(&responses, "ops", "wrong invoice");
    assert_eq!(closings(&responses).len(), 1, "{responses:#?}");
    assert_eq!(payments(&llm, "pay invoice gamma-7"), 0);
    let answered = format!(
        "{}SELECT ?answer WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?answer a tg:ApprovalAnswer ; tg:decision \"expire\" ; prov:wasDerivedFrom <{approval}> ;
             tg:reason \"its run was cancelled while the call waited\" }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(
        count_reaching(&aggregator.store(), answered, 1).await,
        1,
        "the expiry of the cancelled run's call is not recorded as its answer"
    );
    assert_eq!(
        count(
            &aggregator.store(),
            agent_graph::queries::unanswered_approvals()
        )
        .await,
        0,
        "the approvals sweep would go on expiring the call"
    );
}

/// A cancel sent unsealed to orchestrators that take one (`--control-seals warn`, as `agentctl up`
/// runs them) while the run waits for an approval: the sender's record is not sealed, so the
/// aggregator leaves it out; the orchestrator that acts on the cancel records it itself, marked as
/// taken unsealed, so the approvals sweep sees it and the run ends at once, and an audit shows who
/// stopped it. Before, the run went on waiting for its call's ten-minute deadline.
#[tokio::test]
async fn an_unsealed_cancel_acted_on_is_recorded_and_ends_a_parked_run_at_once() {
    const PAY: &str = r#"{"rules": [
      {"match": "Question: pay the delta invoice", "reply": "Thought: It must be paid.\nAction: pay\nArgs: {\"question\": \"pay invoice delta-2\"}"},
      {"match": "pay invoice delta-2", "exact": true, "reply": "payment sent"}
    ]}"#;
    let config = pay_config("cancel-parked-unsealed", 600);
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &["--config-token", TOKEN, "--approval-sweep-secs", "1"],
    );
    let llm = scripted_llm(PAY).await;
    let _orchestrator = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &config,
        &[("AGENT_CONTROL_SEALS", "warn")],
    );
    let mut client = client(&broker).await;
    client
        .send("cu-1", &request("pay the delta invoice", false))
        .await
        .unwrap();
    let mut responses = until_approval_asked(&mut client, "cu-1").await;
    let (_, session, _) = approval_asked(&responses);
    let said = agentctl_keyed(
        &broker,
        None,
        &[
            "cancel",
            &session,
            "--by",
            "ops-eve",
            "--reason",
            "duplicate",
            "--unsealed",
        ],
    );
    assert!(
        said.contains(&format!("cancelled session {session}")),
        "{said}"
    );
    responses.extend(
        collect_dialog(&mut client, "cu-1", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    assert_closed_by_cancel(&responses, "ops-eve", "duplicate");
    assert_eq!(payments(&llm, "pay invoice delta-2"), 0);
    assert_recorded(&aggregator, &session, "ops-eve").await;
    let marked = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?c a tg:Cancellation ; tg:controlSealed false ; tg:reason \"duplicate\" ;
             prov:wasDerivedFrom <urn:trustgraph:agent:{session}> }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(
        count_reaching(&aggregator.store(), marked, 1).await,
        1,
        "the cancel is not marked as taken unsealed"
    );
}

/// A supervisor cancelled while one of its branches waits for approval (a ten-minute deadline):
/// the branch ends at once as cancelled, so the fan-in closes and the client gets its one
/// closing, the cancel, with nothing paid and nothing synthesised.
#[tokio::test]
async fn a_supervisor_cancelled_while_a_branch_waits_for_approval_ends_at_once() {
    let config = pay_config("cancel-parked-branch", 600);
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(
        TOKEN,
        SUPERVISED_PAYMENT,
        &config,
        &["--approval-sweep-secs", "1"],
    )
    .await;
    let mut client = client(&broker).await;
    client
        .send(
            "cb-1",
            &AgentRequest {
                pattern: "supervisor".into(),
                ..request("Handle the three invoices.", false)
            },
        )
        .await
        .unwrap();
    let mut responses = until_approval_asked(&mut client, "cb-1").await;
    let (_, branch, _) = approval_asked(&responses);
    let root = agent_core::supervisor::place_of(&branch)
        .expect("the call waits in a branch")
        .supervisor
        .to_owned();
    cancel(&broker, &root, "ops", "wrong invoices");
    responses.extend(
        collect_dialog(&mut client, "cb-1", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    responses.extend(drain_for(&mut client, "cb-1", Duration::from_secs(3)).await);
    assert_closed_by_cancel(&responses, "ops", "wrong invoices");
    assert_eq!(payments(&llm, "pay invoice gamma-7"), 0);
    assert_eq!(
        calls_matching(&llm, "Request to answer from the subagents"),
        0
    );
    assert_recorded(&aggregator, &root, "ops").await;
}

/// A dialog `id` asked to pay the invoice `name`-`number` (its LLM calls `pay`, and answers that
/// it was not allowed when told the call was not approved), parked for approval: its stack, its
/// client, what the client got so far, and the session and step whose call waits.
async fn a_payment_awaiting_approval(
    config: &str,
    name: &str,
    number: u32,
    id: &str,
) -> (
    Stack,
    agent_bus::AgentClient,
    Vec<AgentResponse>,
    String,
    u64,
) {
    a_payment_awaiting_approval_within(config, name, number, id, 300, &[]).await
}

/// [`a_payment_awaiting_approval`], its call taking an answer for `approval_timeout_secs`, the
/// aggregator started with `aggregator_flags`.
async fn a_payment_awaiting_approval_within(
    config: &str,
    name: &str,
    number: u32,
    id: &str,
    approval_timeout_secs: u64,
    aggregator_flags: &[&str],
) -> (
    Stack,
    agent_bus::AgentClient,
    Vec<AgentResponse>,
    String,
    u64,
) {
    let config = pay_config(config, approval_timeout_secs);
    a_payment_awaiting_approval_under(&config, name, number, id, aggregator_flags).await
}

/// [`a_payment_awaiting_approval`] with the configuration in `config_dir`.
async fn a_payment_awaiting_approval_under(
    config_dir: &std::path::Path,
    name: &str,
    number: u32,
    id: &str,
    aggregator_flags: &[&str],
) -> (
    Stack,
    agent_bus::AgentClient,
    Vec<AgentResponse>,
    String,
    u64,
) {
    let script = format!(
        r#"{{"rules": [
      {{"match": "did not approve calling 'pay'", "reply": "Thought: Not allowed.\nFinal Answer: I was not allowed to pay."}},
      {{"match": "pay invoice {name}-{number}", "exact": true, "reply": "payment sent"}},
      {{"match": "Question: pay the {name} invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {{\"question\": \"pay invoice {name}-{number}\"}}"}}
    ]}}"#
    );
    let stack = Stack::journaled(TOKEN, &script, config_dir, aggregator_flags).await;
    let mut client = client(&stack.broker).await;
    client
        .send(
            id,
            &AgentRequest {
                pattern: "react".into(),
                ..request(&format!("pay the {name} invoice"), false)
            },
        )
        .await
        .unwrap();
    let responses = until_approval_asked(&mut client, id).await;
    let (_, session, step) = approval_asked(&responses);
    (stack, client, responses, session, step)
}

/// The run's wall-time budget counts the wait for an approval, also for a client's first step:
/// approved (within its deadline) after the budget is spent, the call is made, as it was
/// approved, and the dialog ends on the budget at its next step. Until 2026-12-02 a client's
/// first step resumed with the run's clock started again at the answer (its message carries no
/// start of its own), so the next step went on and asked to pay again.
#[tokio::test]
async fn the_wait_for_an_approval_counts_against_the_runs_wall_time() {
    let config = pay_config_with(
        "wall-approval",
        r#"{"default": {"max_iterations": 6, "max_wall_secs": 4, "approval_timeout_secs": 300}}"#,
    );
    let (
        Stack {
            broker,
            llm,
            aggregator: _aggregator,
            orchestrator: _orchestrator,
        },
        mut client,
        mut responses,
        session,
        step,
    ) = a_payment_awaiting_approval_under(&config, "omega", 4, "a-wall", &[]).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    agentctl(&broker, &["approve", &session, &step.to_string()]);
    responses.extend(
        collect_dialog(&mut client, "a-wall", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let last = responses.last().unwrap();
    assert!(last.content.contains("(max_wall_secs)"), "{responses:#?}");
    assert_eq!(payments(&llm, "pay invoice omega-4"), 1);
}

/// An approval sent after the deadline its request showed runs nothing, though no expiry came
/// first (here the aggregator's sweep would look in an hour): the dialog ends saying it came too
/// late. Without the check the late approval paid.
#[tokio::test]
async fn an_approval_sent_after_its_deadline_runs_nothing() {
    let (
        Stack {
            broker,
            llm,
            aggregator: _aggregator,
            orchestrator: _orchestrator,
        },
        mut client,
        mut responses,
        session,
        step,
    ) = a_payment_awaiting_approval_within(
        "late",
        "epsilon",
        5,
        "a-6",
        2,
        &["--approval-sweep-secs", "3600"],
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let said = agentctl(
        &broker,
        &["approve", &session, &step.to_string(), "--by", "ops-eve"],
    );
    assert!(said.contains("approved"), "{said}");
    responses.extend(
        collect_dialog(&mut client, "a-6", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let ended = responses.last().unwrap().error.as_ref().expect("an error");
    assert!(
        ended.message.contains("after its deadline"),
        "{}",
        ended.message
    );
    assert_eq!(
        payments(&llm, "pay invoice epsilon-5"),
        0,
        "paid after the deadline"
    );
}

#[tokio::test]
async fn a_denied_call_is_not_run_and_the_agent_goes_on() {
    let (
        Stack {
            broker,
            llm,
            aggregator: _aggregator,
            orchestrator: _orchestrator,
        },
        mut client,
        mut responses,
        session,
        step,
    ) = a_payment_awaiting_approval("deny", "delta", 9, "a-3").await;
    denied_to_the_end(
        &broker,
        &mut client,
        &mut responses,
        (&session, step),
        "a-3",
        "over budget",
    )
    .await;
    assert_eq!(payments(&llm, "pay invoice delta-9"), 0);
    assert_eq!(
        calls_matching(
            &llm,
            "ops-dan did not approve calling 'pay'; it was not run (over budget)"
        ),
        1
    );
}

/// A call parked for approval that no one answers in time ends the dialog counting the LLM call
/// that chose it: the closing's tokens are the graph's, and not nothing. Until 2026-12-04 the
/// expiry (as a late answer and a cancel) ended with the tokens from before that call, which no
/// node recorded either: the closing, a subagent's completion and the run's budget left it out.
#[tokio::test]
async fn an_expired_approval_counts_the_call_that_asked_for_it() {
    let (stack, mut client, mut responses, session, _) = a_payment_awaiting_approval_within(
        "expire-tokens",
        "theta",
        3,
        "a-9",
        2,
        &["--approval-sweep-secs", "1"],
    )
    .await;
    responses.extend(
        collect_dialog(&mut client, "a-9", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let closing = closings(&responses);
    assert_eq!(closing.len(), 1, "{responses:#?}");
    assert!(
        closing[0].content.contains("No one approved calling 'pay'"),
        "{:?}",
        closing[0]
    );
    let total = closing[0].in_token.unwrap_or(0) + closing[0].out_token.unwrap_or(0);
    assert!(total > 0, "the deciding call is counted: {:?}", closing[0]);
    let root = agent_core::provenance::SessionUris::new(&session).session();
    assert_graph_tokens(&stack.aggregator.store(), &root, total).await;
    assert_eq!(payments(&stack.llm, "pay invoice theta-3"), 0);
}

/// An approved call whose resumed step is refused (its history outgrew `max_iterations`, lowered
/// through the config service while the call waited) ends counting the LLM call that chose the
/// tool: the conclusion records it and the closing's tokens are the graph's. Until 2026-12-05 the
/// refusal (as a step given up after its redeliveries) ended with the tokens from before that
/// call, which no node recorded either.
#[tokio::test]
async fn an_approved_call_refused_as_it_resumes_counts_the_call_that_asked_for_it() {
    let limits = |max_iterations: usize| {
        format!(r#"{{"max_iterations": {max_iterations}, "approval_timeout_secs": 300}}"#)
    };
    let seeded = format!(r#"{{"default": {}}}"#, limits(6));
    let local = pay_config_with("refused-resume-local", &seeded);
    let service = pay_config_with("refused-resume-service", &seeded);
    let (stack, svc) = following_a_config_service(
        &local,
        &service,
        r#"{"rules": [
      {"match": "Observation: beta-result", "reply": "Thought: Now pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice kappa-4\"}"},
      {"match": "Observation: alpha-result", "reply": "Thought: And beta.\nAction: llm\nArgs: {\"question\": \"fetch beta\"}"},
      {"match": "Observation: second-probe-result", "reply": "Thought: Done.\nFinal Answer: probed"},
      {"match": "Observation: probe-result", "reply": "Thought: Again.\nAction: llm\nArgs: {\"question\": \"fetch second probe\"}"},
      {"match": "fetch alpha", "exact": true, "reply": "alpha-result"},
      {"match": "fetch beta", "exact": true, "reply": "beta-result"},
      {"match": "fetch probe", "exact": true, "reply": "probe-result"},
      {"match": "fetch second probe", "exact": true, "reply": "second-probe-result"},
      {"match": "pay invoice kappa-4", "exact": true, "reply": "payment sent"},
      {"match": "Question: probe the limits", "reply": "Thought: Look.\nAction: llm\nArgs: {\"question\": \"fetch probe\"}"},
      {"match": "Question: pay the kappa invoice", "reply": "Thought: Look first.\nAction: llm\nArgs: {\"question\": \"fetch alpha\"}"}
    ]}"#,
    )
    .await;
    let mut client = client(&stack.broker).await;
    client
        .send(
            "k-1",
            &AgentRequest {
                pattern: "react".into(),
                ..request("pay the kappa invoice", false)
            },
        )
        .await
        .unwrap();
    let mut responses = until_approval_asked(&mut client, "k-1").await;
    let (_, session, step) = approval_asked(&responses);
    assert_eq!(step, 3, "the call is parked at the third step");
    put_default_limits(&svc, &limits(1)).await;
    // The lowered limit is in force once a new dialog stops at it.
    let (mut in_force, mut last_probe) = (false, String::new());
    for probe in 0..40 {
        let id = format!("probe-{probe}");
        let asked = AgentRequest {
            pattern: "react".into(),
            ..request("probe the limits", false)
        };
        client.send(&id, &asked).await.unwrap();
        let probed = collect_dialog(&mut client, &id, Duration::from_secs(30))
            .await
            .unwrap();
        last_probe = outcome(&probed);
        if last_probe.contains("limit of 1 iterations") {
            in_force = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        in_force,
        "max_iterations 1 never came into force: {last_probe}"
    );
    let said = agentctl(
        &stack.broker,
        &["approve", &session, &step.to_string(), "--by", "ops-ola"],
    );
    assert!(said.contains("approved"), "{said}");
    responses.extend(
        collect_dialog(&mut client, "k-1", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let closing = closings(&responses);
    assert_eq!(closing.len(), 1, "{responses:#?}");
    assert!(
        closing[0]
            .error
            .as_ref()
            .is_some_and(|e| e.message.contains("max_iterations (1)")),
        "{:?}",
        closing[0]
    );
    assert_eq!(payments(&stack.llm, "pay invoice kappa-4"), 0);
    let uris = agent_core::provenance::SessionUris::new(&session);
    let counted = format!(
        "{}ASK {{ GRAPH <urn:graph:retrieval> {{ <{}> tg:inToken ?i . FILTER(?i > 0) }} }}",
        agent_core::vocab::SPARQL_PREFIXES,
        uris.conclusion()
    );
    assert!(
        holds_within(&stack.aggregator.store(), counted).await,
        "the conclusion does not record the call that chose the tool"
    );
    let total = closing[0].in_token.unwrap_or(0) + closing[0].out_token.unwrap_or(0);
    assert_graph_tokens(&stack.aggregator.store(), &uris.session(), total).await;
}

/// A first request that carries neither an `id` nor a session is named after its message; its
/// call parked for approval resumes in that same session when approved, and an approval sent
/// again runs nothing. Until 2026-12-04 the parked request kept its empty session and the answer
/// resumed it named after the approval's own message: the dialog went on in another session, the
/// call stayed unanswered in the first (to expire later with an error closing), and a second
/// approval ran the call again.
#[tokio::test]
async fn a_first_request_without_an_id_resumes_its_approved_call_in_its_own_session() {
    let script = r#"{"rules": [
      {"match": "Observation: payment sent", "reply": "Thought: Paid.\nFinal Answer: The omega invoice is paid."},
      {"match": "pay invoice omega-1", "exact": true, "reply": "payment sent"},
      {"match": "Question: pay the omega invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice omega-1\"}"}
    ]}"#;
    let config = pay_config("no-id", 300);
    let stack = Stack::journaled(TOKEN, script, &config, &[]).await;
    let mut client = client(&stack.broker).await;
    let bus = agent_bus::Bus::connect(&stack.broker.url(), None)
        .await
        .unwrap();
    let requests = agent_bus::Publisher::new(&bus, "persistent://tg/request/agent:default:default")
        .await
        .unwrap();
    let request = AgentRequest {
        pattern: "react".into(),
        ..request("pay the omega invoice", false)
    };
    requests
        .send(
            agent_schema::encode(&request),
            &agent_bus::Properties::new(),
        )
        .await
        .unwrap();
    // Responses to a request without an id carry none.
    let mut responses = until_approval_asked(&mut client, "").await;
    let (_, session, step) = approval_asked(&responses);
    let step = step.to_string();
    let said = agentctl(
        &stack.broker,
        &["approve", &session, &step, "--by", "ops-ola"],
    );
    assert!(said.contains("approved"), "{said}");
    responses.extend(
        collect_dialog(&mut client, "", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let closing = closings(&responses);
    assert_eq!(closing.len(), 1, "{responses:#?}");
    assert_eq!(closing[0].content, "The omega invoice is paid.");
    assert_eq!(
        agent_core::vocab::session_id_of(&closing[0].message_id),
        Some(session.as_str()),
        "the dialog ended in the session whose call was approved"
    );
    // The same answer again changes nothing.
    agentctl(
        &stack.broker,
        &["approve", &session, &step, "--by", "ops-ola"],
    );
    let again = drain_for(&mut client, "", Duration::from_secs(3)).await;
    assert!(again.is_empty(), "{again:#?}");
    assert_eq!(payments(&stack.llm, "pay invoice omega-1"), 1);
}

/// Control messages without the services' seal (sent without `AGENT_SEAL_KEY`, or with another
/// key) are ignored by orchestrators that have one: an approval sealed with the wrong key runs no
/// tool, a cancel sent unsealed stops nothing, and the sealed denial that follows is the answer
/// the dialog goes on with. Before control messages were sealed, the forged approval paid.
#[tokio::test]
async fn control_messages_without_the_services_seal_are_ignored() {
    let (
        Stack {
            broker,
            llm,
            aggregator: _aggregator,
            orchestrator: _orchestrator,
        },
        mut client,
        mut responses,
        session,
        step,
    ) = a_payment_awaiting_approval("forged-control", "epsilon", 4, "a-9").await;
    let step_number = step;
    let step = step.to_string();
    agentctl_keyed(
        &broker,
        Some("not-the-services-key"),
        &["approve", &session, &step, "--by", "mallory"],
    );
    // Without a key, and not told to send it unsealed, agentctl sends nothing and says why.
    let refused = Command::new(binary("agentctl"))
        .args(["approve", &session, &step, "--pulsar-url", &broker.url()])
        .env_remove("AGENT_SEAL_KEY")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let why = String::from_utf8_lossy(&refused.stderr);
    assert!(why.contains("--unsealed"), "{why}");
    // Acted on, the approval sealed with another key would have paid by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(payments(&llm, "pay invoice epsilon-4"), 0);
    let said = agentctl_keyed(
        &broker,
        None,
        &["cancel", &session, "--by", "mallory", "--unsealed"],
    );
    assert!(said.contains("cancelled session"), "{said}");
    // Acted on, it would end the dialog as cancelled.
    tokio::time::sleep(Duration::from_secs(2)).await;
    denied_to_the_end(
        &broker,
        &mut client,
        &mut responses,
        (&session, step_number),
        "a-9",
        "not today",
    )
    .await;
    assert_eq!(payments(&llm, "pay invoice epsilon-4"), 0);
    assert!(
        responses.iter().all(|r| r.error.is_none()),
        "{responses:#?}"
    );
}

/// An approval may change the call's arguments: the tool runs once, with the arguments the person
/// gave, never with the ones the model chose; the agent reads what that call returned, and the
/// graph records who approved, the edited arguments and the call as it ran.
#[tokio::test]
async fn an_approval_with_edited_arguments_runs_the_tool_with_them() {
    const EDITED: &str = r#"{"rules": [
      {"match": "Observation: half of it paid", "reply": "Thought: Done.\nFinal Answer: Half of the epsilon invoice is paid."},
      {"match": "pay half of invoice epsilon-1", "exact": true, "reply": "half of it paid"},
      {"match": "pay invoice epsilon-1", "exact": true, "reply": "all of it paid"},
      {"match": "Question: pay the epsilon invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice epsilon-1\"}"}
    ]}"#;
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, EDITED, &pay_config("edit", 300), &[]).await;
    let mut client = client(&broker).await;
    client
        .send(
            "a-4",
            &AgentRequest {
                pattern: "react".into(),
                ..request("pay the epsilon invoice", false)
            },
        )
        .await
        .unwrap();
    let mut responses = until_approval_asked(&mut client, "a-4").await;
    let (_, session, step) = approval_asked(&responses);
    assert_eq!(
        payments(&llm, "pay invoice epsilon-1"),
        0,
        "ran before approval"
    );
    let edited = r#"{"question": "pay half of invoice epsilon-1"}"#;
    agentctl(
        &broker,
        &[
            "approve",
            &session,
            &step.to_string(),
            "--arguments",
            edited,
            "--by",
            "ops-eve",
            "--reason",
            "only half is due",
        ],
    );
    responses.extend(
        collect_dialog(&mut client, "a-4", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    let last = responses.last().unwrap();
    assert_eq!(
        last.content, "Half of the epsilon invoice is paid.",
        "{responses:#?}"
    );
    assert_eq!(payments(&llm, "pay half of invoice epsilon-1"), 1);
    assert_eq!(payments(&llm, "pay invoice epsilon-1"), 0);

    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let uri = agent_core::provenance::SessionUris::new(&session).session();
    let recorded = format!(
        "{prefixes}ASK {{ GRAPH <urn:graph:retrieval> {{
           ?answer a tg:ApprovalAnswer ; tg:decision \"approve\" ; tg:answeredBy \"ops-eve\" ;
             tg:reason \"only half is due\" ; tg:editedArguments ?args ;
             prov:wasDerivedFrom ?asked .
           ?asked prov:wasDerivedFrom+ <{uri}> .
           FILTER (CONTAINS(?args, \"pay half of invoice epsilon-1\")) }} }}"
    );
    assert!(
        holds_within(&aggregator.store(), recorded).await,
        "the edited approval is not in the graph: {responses:#?}"
    );
}

/// An approval sent again once the journal no longer holds its resumption (pruned a retention
/// after its dialog ended, 2 s here) finds the call answered in the graph and makes nothing: the
/// tool is not run a second time, and the client hears nothing more. Until 2026-12-02 the journal
/// entry was the only guard, and a second `agentctl approve` after the retention paid again.
#[tokio::test]
async fn an_approval_sent_again_after_the_journal_was_pruned_runs_nothing() {
    const PAY_ONCE: &str = r#"{"rules": [
      {"match": "Observation: payment sent", "reply": "Thought: Done.\nFinal Answer: The zeta invoice is paid."},
      {"match": "pay invoice zeta-3", "exact": true, "reply": "payment sent"},
      {"match": "Question: pay the zeta invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice zeta-3\"}"}
    ]}"#;
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(
        TOKEN,
        PAY_ONCE,
        &pay_config("pruned", 300),
        &["--journal-retention-secs", "2"],
    )
    .await;
    let mut client = client(&broker).await;
    client
        .send(
            "a-9",
            &AgentRequest {
                pattern: "react".into(),
                ..request("pay the zeta invoice", false)
            },
        )
        .await
        .unwrap();
    let mut responses = until_approval_asked(&mut client, "a-9").await;
    let (_, session, step) = approval_asked(&responses);
    let approve = [
        "approve",
        session.as_str(),
        &step.to_string(),
        "--by",
        "ops-zoe",
    ]
    .map(str::to_owned);
    let approve: Vec<&str> = approve.iter().map(String::as_str).collect();
    agentctl(&broker, &approve);
    responses.extend(
        collect_dialog(&mut client, "a-9", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    assert_eq!(
        responses.last().unwrap().content,
        "The zeta invoice is paid.",
        "{responses:#?}"
    );
    assert_eq!(payments(&llm, "pay invoice zeta-3"), 1);
    // The dialog's journal entries are pruned once past the retention.
    let uri = agent_core::provenance::SessionUris::new(&session).session();
    let journaled = format!(
        "SELECT ?e WHERE {{ GRAPH <urn:graph:agent-journal> {{ ?e ?p ?o
           FILTER (STRSTARTS(STR(?e), \"{uri}/\")) }} }}"
    );
    let store = aggregator.store();
    let pruned_by = std::time::Instant::now() + Duration::from_secs(60);
    while count(&store, journaled.clone()).await > 0 {
        assert!(
            std::time::Instant::now() < pruned_by,
            "the journal was not pruned"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    agentctl(&broker, &approve);
    let after = drain_for(&mut client, "a-9", Duration::from_secs(8)).await;
    assert!(after.is_empty(), "{after:#?}");
    assert_eq!(payments(&llm, "pay invoice zeta-3"), 1, "paid again");
}

/// An approval that comes after its run was cancelled longer ago than a replica remembers cancels
/// (a day, `cancel::MEMORY`; approvals may wait far longer) ends the run as cancelled and pays
/// nothing: the resumed step reads its run's cancels from the graph whatever their age. Here the
/// orchestrator never heard the cancel, whose record is a year old. Until 2026-12-02 the
/// approved call was made.
#[tokio::test]
async fn an_approval_after_a_cancel_older_than_a_day_runs_nothing() {
    let (
        Stack {
            broker,
            llm,
            aggregator,
            orchestrator: _orchestrator,
        },
        mut client,
        mut responses,
        session,
        step,
    ) = a_payment_awaiting_approval("old-cancel", "theta", 4, "a-10").await;
    let uri = agent_core::provenance::SessionUris::new(&session).session();
    agent_graph::GraphStore::open(&aggregator.endpoint, Some(TOKEN.to_owned()))
        .unwrap()
        .update(format!(
            "{}PREFIX xsd: <http://www.w3.org/2001/XMLSchema#>
             INSERT DATA {{ GRAPH <urn:graph:retrieval> {{
               <{uri}/cancellation> a tg:Cancellation ; tg:cancelledBy \"ops-old\" ;
                 prov:atTime \"2025-12-01T00:00:00Z\"^^xsd:dateTime ; tg:reason \"stale run\" }} }}",
            agent_core::vocab::SPARQL_PREFIXES
        ))
        .await
        .unwrap();
    agentctl(
        &broker,
        &["approve", &session, &step.to_string(), "--by", "ops-ann"],
    );
    responses.extend(
        collect_dialog(&mut client, "a-10", Duration::from_secs(60))
            .await
            .unwrap(),
    );
    assert_closed_by_cancel(&responses, "ops-old", "stale run");
    assert_eq!(payments(&llm, "pay invoice theta-4"), 0);
}

/// Dialog A looks something up, then answers slowly (or never, when its second call stalls);
/// dialog B follows it in the same conversation.
fn conversation_script(second_call: &str) -> String {
    format!(
        r#"{{"rules": [
  {{"match": "Observation: alpha-result", "reply": "Thought: Done.\nFinal Answer: Paris", {second_call}}},
  {{"match": "fetch alpha", "exact": true, "reply": "alpha-result"}},
  {{"match": "Question: What is the capital of France?", "reply": "Thought: Look it up.\nAction: llm\nArgs: {{\"question\": \"fetch alpha\"}}"}},
  {{"match": "Question: And how many people live there?", "reply": "Thought: I know.\nFinal Answer: about two million"}}
]}}"#
    )
}

fn in_conversation(question: &str) -> AgentRequest {
    AgentRequest {
        pattern: "react".into(),
        conversation_id: "conv-7".into(),
        ..request(question, false)
    }
}

/// Starts dialog A of the conversation and waits until the graph shows it running (its first
/// step committed: a dialog is visible to its conversation from then on).
async fn start_first_dialog(
    client: &mut agent_bus::AgentClient,
    aggregator: &Aggregator,
    llm: &scripted_llm::ScriptedLlm,
) {
    client
        .send("conv-a", &in_conversation("What is the capital of France?"))
        .await
        .unwrap();
    let running = format!(
        "{}SELECT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{ ?s a tg:AgentQuestion ; tg:conversation \"conv-7\" }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), running, 1).await, 1);
    until("dialog A's second LLM call", || {
        calls_matching(llm, "Observation: alpha-result") >= 1
    })
    .await;
}

/// Sets `agent-limits/default` to `limits` through the config service's REST API.
async fn put_default_limits(svc: &ConfigSvc, limits: &str) {
    let put = reqwest::Client::new()
        .put(format!("{}/api/v1/config/agent-limits/default", svc.url))
        .bearer_auth(&svc.token)
        .body(limits.to_owned())
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
}

/// A journaled stack whose orchestrator reads its config directory `local` and follows a config
/// service seeded from `service`, started first (the orchestrator's first read must find it),
/// and the service.
async fn following_a_config_service(
    local: &std::path::Path,
    service: &std::path::Path,
    script: &str,
) -> (Stack, ConfigSvc) {
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::spawn(&broker, Some(service));
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(script).await;
    let orchestrator = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        local,
        &[],
    );
    let stack = Stack {
        orchestrator,
        llm,
        aggregator,
        broker,
    };
    (stack, svc)
}

fn conversation_config(name: &str, policy: &str) -> std::path::PathBuf {
    let limits = format!(r#"{{"default": {{"conversation_policy": "{policy}"}}}}"#);
    seed_with(name, &[("agent-limits", &limits)])
}

#[tokio::test]
async fn a_second_request_in_a_conversation_waits_and_sees_the_first_answer() {
    let config = conversation_config("queue", "queue");
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(
        TOKEN,
        &conversation_script("\"delay_ms\": 3000"),
        &config,
        &[],
    )
    .await;
    let mut client = client(&broker).await;
    start_first_dialog(&mut client, &aggregator, &llm).await;
    client
        .send(
            "conv-b",
            &in_conversation("And how many people live there?"),
        )
        .await
        .unwrap();
    let mut both =
        collect_dialogs(&mut client, &["conv-a", "conv-b"], Duration::from_secs(60)).await;
    let (first, second) = (
        both.remove("conv-a").unwrap(),
        both.remove("conv-b").unwrap(),
    );
    assert_eq!(first.last().unwrap().content, "Paris");
    assert_eq!(second.last().unwrap().content, "about two million");
    // It ran once the first had ended, and was told what it asked and answered.
    let asked = llm
        .calls()
        .into_iter()
        .find(|c| {
            c.last_user
                .contains("Question: And how many people live there?")
        })
        .unwrap();
    assert!(
        asked
            .last_user
            .contains("Earlier in this conversation:\nQ: What is the capital of France?\nA: Paris"),
        "{}",
        asked.last_user
    );
    let follows = format!(
        "{}SELECT ?b WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?b tg:follows ?a ; tg:query \"And how many people live there?\" ; tg:conversation \"conv-7\" .
           ?a tg:query \"What is the capital of France?\" }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), follows, 1).await, 1);
}

/// Requests queued behind a running dialog of their conversation leave their places among the
/// consumer's handlers to the messages they wait for: with two places, and two requests waiting
/// while the first dialog works, its next step is still taken up (it would wait behind them for
/// its whole wall-time budget). The two then run one after the other, in the order they came.
#[tokio::test]
async fn requests_queued_in_a_conversation_leave_room_for_the_dialog_they_wait_for() {
    let config = conversation_config("queue-places", "queue");
    let script = r#"{"rules": [
  {"match": "Observation: beta-result", "reply": "Thought: Done.\nFinal Answer: Paris"},
  {"match": "Observation: alpha-result", "reply": "Thought: One more.\nAction: llm\nArgs: {\"question\": \"fetch beta\"}", "delay_ms": 3000},
  {"match": "fetch alpha", "exact": true, "reply": "alpha-result"},
  {"match": "fetch beta", "exact": true, "reply": "beta-result"},
  {"match": "Question: What is the capital of France?", "reply": "Thought: Look it up.\nAction: llm\nArgs: {\"question\": \"fetch alpha\"}"},
  {"match": "Question: And how many people live there?", "reply": "Thought: I know.\nFinal Answer: about two million"},
  {"match": "Question: And which river runs through it?", "reply": "Thought: I know.\nFinal Answer: the Seine"}
]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::journaled_with(
        Place::Child,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &config,
        &[("AGENT_MAX_IN_FLIGHT", "2")],
    );
    let mut client = client(&broker).await;
    start_first_dialog(&mut client, &aggregator, &llm).await;
    for (id, question) in [
        ("conv-b", "And how many people live there?"),
        ("conv-c", "And which river runs through it?"),
    ] {
        client.send(id, &in_conversation(question)).await.unwrap();
    }
    let mut dialogs = collect_dialogs(
        &mut client,
        &["conv-a", "conv-b", "conv-c"],
        Duration::from_secs(60),
    )
    .await;
    for (id, answer) in [
        ("conv-a", "Paris"),
        ("conv-b", "about two million"),
        ("conv-c", "the Seine"),
    ] {
        let dialog = dialogs.remove(id).unwrap();
        assert_eq!(closings(&dialog).len(), 1, "{id}: {dialog:#?}");
        assert_eq!(dialog.last().unwrap().content, answer, "{id}: {dialog:#?}");
    }
    // The third ran once the second had ended: it was told the second's answer.
    let calls = llm.calls();
    let asked = |question: &str| {
        calls
            .iter()
            .position(|c| c.last_user.contains(&format!("Question: {question}")))
            .unwrap()
    };
    let (second, third) = (
        asked("And how many people live there?"),
        asked("And which river runs through it?"),
    );
    assert!(second < third, "the third request ran before the second");
    assert!(
        calls[third]
            .last_user
            .contains("Q: And how many people live there?\nA: about two million"),
        "{}",
        calls[third].last_user
    );
}

/// Dialogs of a conversation that no orchestrator ran, planted on the explainability topic (one
/// named as the agent names its sessions, unsealed; one under a name of another scheme): the
/// conversation's next request is neither refused as if one of them ran nor told what they asked.
#[tokio::test]
async fn dialogs_planted_in_a_conversation_neither_refuse_its_next_request_nor_reach_its_prompt() {
    use agent_core::vocab::{prov, tg, PROVENANCE_GRAPH, RDF_TYPE};
    use agent_schema::{Metadata, Term as WireTerm, Triple, Triples};
    let config = conversation_config("planted", "reject");
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &conversation_script("\"delay_ms\": 0"), &config, &[]).await;
    // Started a minute from now: it would count as running for as long as the wall-time budget.
    let started = (chrono::Utc::now() + chrono::Duration::seconds(60))
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let mut triples = Vec::new();
    for node in ["urn:trustgraph:agent:planted-1", "urn:planted:dialog"] {
        let triple = |p: &str, o: WireTerm| Triple {
            s: WireTerm::iri(node),
            p: WireTerm::iri(p),
            o,
            g: Some(PROVENANCE_GRAPH.into()),
        };
        triples.extend([
            triple(
                RDF_TYPE.as_str(),
                WireTerm::iri(tg::AGENT_QUESTION.as_str()),
            ),
            triple(tg::CONVERSATION.as_str(), WireTerm::literal("conv-7")),
            triple(tg::QUERY.as_str(), WireTerm::literal("PLANTED QUESTION")),
            triple(
                prov::STARTED_AT_TIME.as_str(),
                WireTerm::typed_literal(
                    started.as_str(),
                    "http://www.w3.org/2001/XMLSchema#dateTime",
                ),
            ),
        ]);
    }
    let planted = agent_schema::encode(&Triples {
        metadata: Metadata {
            id: "urn:planted:message".into(),
            root: String::new(),
            collection: "default".into(),
        },
        triples,
    });
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    agent_bus::Publisher::new(&bus, &topics.explainability)
        .await
        .unwrap()
        .send(planted, &Default::default())
        .await
        .unwrap();
    // What is not the agent's is written (in the same transaction as the rest was refused).
    let store = aggregator.store();
    let written = |node: &str| {
        format!("SELECT ?p WHERE {{ GRAPH <{PROVENANCE_GRAPH}> {{ <{node}> ?p ?o }} }}")
    };
    assert_eq!(
        count_reaching(&store, written("urn:planted:dialog"), 4).await,
        4
    );
    assert_eq!(
        count(&store, written("urn:trustgraph:agent:planted-1")).await,
        0
    );

    let mut client = client(&broker).await;
    client
        .send(
            "conv-b",
            &in_conversation("And how many people live there?"),
        )
        .await
        .unwrap();
    let dialog = collect_dialog(&mut client, "conv-b", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        dialog.last().unwrap().content,
        "about two million",
        "{dialog:#?}"
    );
    let asked = llm
        .calls()
        .into_iter()
        .find(|c| {
            c.last_user
                .contains("Question: And how many people live there?")
        })
        .unwrap();
    assert!(!asked.last_user.contains("PLANTED"), "{}", asked.last_user);
}

#[tokio::test]
async fn a_conversation_can_refuse_a_second_request_or_interrupt_the_first() {
    for policy in ["reject", "interrupt"] {
        let second_call = if policy == "reject" {
            "\"delay_ms\": 3000"
        } else {
            "\"faults\": [\"stall\"], \"stall_ms\": 120000"
        };
        let config = conversation_config(policy, policy);
        let Stack {
            broker,
            aggregator,
            llm,
            orchestrator: _orchestrator,
        } = Stack::journaled(TOKEN, &conversation_script(second_call), &config, &[]).await;
        let mut client = client(&broker).await;
        start_first_dialog(&mut client, &aggregator, &llm).await;
        client
            .send(
                "conv-b",
                &in_conversation("And how many people live there?"),
            )
            .await
            .unwrap();
        let mut both =
            collect_dialogs(&mut client, &["conv-a", "conv-b"], Duration::from_secs(60)).await;
        let (first, second) = (
            both.remove("conv-a").unwrap(),
            both.remove("conv-b").unwrap(),
        );
        assert_eq!(closings(&first).len(), 1, "{first:#?}");
        assert_eq!(closings(&second).len(), 1, "{second:#?}");
        if policy == "reject" {
            let refused = second.last().unwrap().error.as_ref().expect("refused");
            assert!(
                refused.message.contains("conversation_policy: reject"),
                "{}",
                refused.message
            );
            assert_eq!(first.last().unwrap().content, "Paris");
        } else {
            assert_eq!(second.last().unwrap().content, "about two million");
            let cancelled = first.last().unwrap().error.as_ref().expect("interrupted");
            assert_eq!(cancelled.kind, "cancelled", "{first:#?}");
            assert!(
                cancelled.message.contains("interrupted"),
                "{}",
                cancelled.message
            );
        }
    }
}

/// An interrupt is recorded in the graph even when the interrupting step then parks (here its
/// LLM answers 503 past the client's retries): the cancellation the interrupted dialog's end
/// links to is there. Before, the record was held with the step's effects and lost as it parked,
/// and its retry, let start before, interrupted nothing again (checked: no cancellation node).
#[tokio::test]
async fn an_interrupt_is_recorded_even_when_the_interrupting_step_parks() {
    let config = conversation_config("interrupt-then-park", "interrupt");
    let script = conversation_script("\"faults\": [\"stall\"], \"stall_ms\": 120000").replace(
        r#""reply": "Thought: I know.\nFinal Answer: about two million""#,
        r#""reply": "Thought: I know.\nFinal Answer: about two million", "faults": ["503", "503", "503", "503", "503", "503"]"#,
    );
    assert!(script.contains("\"503\""), "{script}");
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &script, &config, &[]).await;
    let mut client = client(&broker).await;
    start_first_dialog(&mut client, &aggregator, &llm).await;
    client
        .send(
            "conv-b",
            &in_conversation("And how many people live there?"),
        )
        .await
        .unwrap();
    let mut both =
        collect_dialogs(&mut client, &["conv-a", "conv-b"], Duration::from_secs(90)).await;
    let (first, second) = (
        both.remove("conv-a").unwrap(),
        both.remove("conv-b").unwrap(),
    );
    assert_eq!(
        second.last().unwrap().content,
        "about two million",
        "{second:#?}"
    );
    let cancelled = first.last().unwrap().error.as_ref().expect("interrupted");
    assert_eq!(cancelled.kind, "cancelled", "{first:#?}");
    let session = session_of(&first);
    let recorded = format!(
        "{}ASK {{ GRAPH <urn:graph:retrieval> {{ <{session}/cancellation> a tg:Cancellation ;
           tg:cancelledBy ?by . FILTER(STRSTARTS(?by, \"dialog \")) }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert!(
        holds_within(&aggregator.store(), recorded).await,
        "no cancellation recorded for the interrupted dialog {session}"
    );
}

/// A dialog whose later step is refused (here its history outgrew `max_iterations`, lowered
/// through the config service while it ran) ends in the graph as any error does, so its
/// conversation goes on: under `conversation_policy: reject` and no wall-time bound, the next
/// request of the conversation runs. Until 2026-12-02 the refusal only answered the client: the
/// dialog had no conclusion, counted as running for ever, and every later request of its
/// conversation was refused.
#[tokio::test]
async fn a_dialog_refused_at_a_later_step_does_not_hold_its_conversation_up() {
    let limits = |max_iterations: usize| {
        format!(
            r#"{{"conversation_policy": "reject", "max_wall_secs": 0, "max_iterations": {max_iterations}}}"#
        )
    };
    let seeded = format!(r#"{{"default": {}}}"#, limits(6));
    let local = seed_with("refused-later-local", &[("agent-limits", &seeded)]);
    let service = seed_with("refused-later-service", &[("agent-limits", &seeded)]);
    let (
        Stack {
            broker,
            aggregator: _aggregator,
            llm,
            orchestrator: _orchestrator,
        },
        svc,
    ) = following_a_config_service(
        &local,
        &service,
        r#"{"rules": [
      {"match": "Observation: beta-result", "reply": "Thought: Done.\nFinal Answer: Paris"},
      {"match": "Observation: alpha-result", "reply": "Thought: And beta.\nAction: llm\nArgs: {\"question\": \"fetch beta\"}"},
      {"match": "fetch alpha", "exact": true, "reply": "alpha-result"},
      {"match": "fetch beta", "exact": true, "reply": "beta-result", "delay_ms": 8000},
      {"match": "Question: What is the capital of France?", "reply": "Thought: Look it up.\nAction: llm\nArgs: {\"question\": \"fetch alpha\"}"},
      {"match": "Question: And how many people live there?", "reply": "Thought: I know.\nFinal Answer: about two million"}
    ]}"#,
    )
    .await;
    let mut client = client(&broker).await;
    client
        .send("conv-a", &in_conversation("What is the capital of France?"))
        .await
        .unwrap();
    // The dialog's second step is under way (its tool call takes 8 s): its third will find
    // max_iterations 1 in force, with two steps in its history.
    until("dialog A's second tool call", || {
        calls_matching(&llm, "fetch beta") >= 1
    })
    .await;
    put_default_limits(&svc, &limits(1)).await;
    let first = collect_dialog(&mut client, "conv-a", Duration::from_secs(60))
        .await
        .unwrap();
    let refused = first
        .last()
        .unwrap()
        .error
        .as_ref()
        .unwrap_or_else(|| panic!("not refused: {first:#?}"));
    assert!(refused.message.contains("max_iterations (1)"), "{first:#?}");
    client
        .send(
            "conv-b",
            &in_conversation("And how many people live there?"),
        )
        .await
        .unwrap();
    let second = collect_dialog(&mut client, "conv-b", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        second.last().unwrap().content,
        "about two million",
        "{second:#?}"
    );
}

/// A client sends its next question on the closing of its last, while the graph does not show
/// that dialog yet: its provenance travels to the store behind the closing, and here the only
/// writer of the store (an aggregator of its own) is frozen meanwhile. Under
/// `conversation_policy: reject` the next dialog is not refused for one that has ended, and it is
/// told the earlier answer once the graph shows it. Before, the first dialog's start (kept until
/// the graph showed the dialog) refused the second as running beside it.
#[tokio::test]
async fn a_question_sent_on_the_last_answer_is_taken_while_the_graph_lags() {
    let config = conversation_config("sent-on-the-answer", "reject");
    let broker = Broker::start().unwrap();
    let store_host = Aggregator::store_host(Place::InProcess, &broker, TOKEN, "lagging-store-only");
    let writer = Aggregator::replica_on(&broker, &store_host, TOKEN);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Question: What is the capital of France?", "reply": "Thought: I know.\nFinal Answer: Paris"},
      {"match": "Question: And how many people live there?", "reply": "Thought: I know.\nFinal Answer: about two million"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &store_host,
        TOKEN,
        &config,
        &[],
    );
    let mut client = client(&broker).await;
    writer.freeze(true);
    client
        .send("conv-a", &in_conversation("What is the capital of France?"))
        .await
        .unwrap();
    let first = collect_dialog(&mut client, "conv-a", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(first.last().unwrap().content, "Paris", "{first:#?}");
    client
        .send(
            "conv-b",
            &in_conversation("And how many people live there?"),
        )
        .await
        .unwrap();
    // Taken up, and waiting for the graph to show the first dialog's end.
    tokio::time::sleep(Duration::from_secs(2)).await;
    writer.freeze(false);
    let second = collect_dialog(&mut client, "conv-b", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        second.last().unwrap().content,
        "about two million",
        "{second:#?}"
    );
    let asked = llm
        .calls()
        .into_iter()
        .find(|c| {
            c.last_user
                .contains("Question: And how many people live there?")
        })
        .unwrap();
    assert!(
        asked
            .last_user
            .contains("Earlier in this conversation:\nQ: What is the capital of France?\nA: Paris"),
        "{}",
        asked.last_user
    );
}

/// Two replicas, each handed one of two requests of a conversation sent together: neither finds
/// the other's dialog in the graph (a dialog shows there once its first step is written, behind
/// its LLM call, 15 s here, so that both are judged within it), so each replica, keeping its own
/// record of the dialogs it let start, let its own start, whatever the policy. The journal's owner now gives every replica its turn: under
/// `conversation_policy: reject` one runs and the other is refused. The broker chooses which
/// replica takes which request; a try in which one replica took both (it then judges the second
/// after the first ended) proves nothing, so the conversation is tried again until the two
/// requests went to the two replicas.
#[tokio::test]
async fn two_replicas_let_one_dialog_of_a_conversation_start_at_a_time() {
    let config = conversation_config("reject-replicas", "reject");
    let script = r#"{"rules": [{"match": "", "reply": "Thought: I know.\nFinal Answer: done", "delay_ms": 15000}]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(script).await;
    let (_replicas, bases) = two_replicas(&broker, &llm, &aggregator, &config, 1).await;
    let received = |base: String| async move { requests_with_fate(&base, "received").await };
    let mut client = client(&broker).await;
    for attempt in 0..6 {
        let before = (
            received(bases[0].clone()).await,
            received(bases[1].clone()).await,
        );
        let ids = [
            format!("together-{attempt}-a"),
            format!("together-{attempt}-b"),
        ];
        for id in &ids {
            let request = AgentRequest {
                pattern: "react".into(),
                conversation_id: format!("together-{attempt}"),
                ..request(&format!("Which one ({id})?"), false)
            };
            client.send(id, &request).await.unwrap();
        }
        let mut both = collect_dialogs(&mut client, &ids, Duration::from_secs(60)).await;
        let split = received(bases[0].clone()).await - before.0 == 1.0
            && received(bases[1].clone()).await - before.1 == 1.0;
        if !split {
            continue;
        }
        let endings: Vec<AgentResponse> = ids
            .iter()
            .map(|id| both.remove(id).unwrap().pop().unwrap())
            .collect();
        let answered = endings.iter().filter(|e| e.content == "done").count();
        let refused: Vec<&str> = endings
            .iter()
            .filter_map(|e| e.error.as_ref().map(|e| e.message.as_str()))
            .collect();
        assert_eq!(answered, 1, "{endings:#?}");
        assert_eq!(refused.len(), 1, "{endings:#?}");
        assert!(
            refused[0].contains("conversation_policy: reject"),
            "{}",
            refused[0]
        );
        return;
    }
    panic!("in six tries the broker never handed the two requests to the two replicas");
}

/// Two journaled replicas (children, each taking up to `max_in_flight` messages at once), ready,
/// and the bases of their metrics.
async fn two_replicas(
    broker: &Broker,
    llm: &scripted_llm::ScriptedLlm,
    aggregator: &Aggregator,
    config: &std::path::Path,
    max_in_flight: usize,
) -> (Vec<Orchestrator>, Vec<String>) {
    let mut replicas = Vec::new();
    let mut bases = Vec::new();
    for _ in 0..2 {
        let http_addr = format!("127.0.0.1:{}", agent_bus::embedded::free_port().unwrap());
        replicas.push(Orchestrator::journaled_with(
            Place::Child,
            broker,
            llm,
            aggregator,
            TOKEN,
            config,
            &[
                ("AGENT_MAX_IN_FLIGHT", &max_in_flight.to_string()),
                ("AGENT_HTTP_ADDR", &http_addr),
            ],
        ));
        bases.push(format!("http://{http_addr}"));
    }
    for base in &bases {
        until_ready(base, Duration::from_secs(60)).await;
    }
    (replicas, bases)
}

/// Under `conversation_policy: interrupt`, the replica that takes a conversation's second request
/// cancels the first dialog by a control message sealed with the services' key, and the replica
/// running that dialog (which acts only on sealed control messages) ends it. The broker chooses
/// which replica takes which request; each try checks the outcome, and the test goes on until one
/// try had the two requests on the two replicas. Without the interrupt's seal the first dialog's
/// stalled LLM call would hold it for two minutes, past the wait here.
#[tokio::test]
async fn an_interrupt_sealed_on_one_replica_ends_the_dialog_running_on_another() {
    let config = conversation_config("interrupt-replicas", "interrupt");
    let script = conversation_script("\"faults\": [\"stall\"], \"stall_ms\": 120000");
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(&script).await;
    let (_replicas, bases) = two_replicas(&broker, &llm, &aggregator, &config, 2).await;
    let mut client = client(&broker).await;
    for attempt in 0..8 {
        let conversation = format!("interrupted-{attempt}");
        let ask = |question: &str| AgentRequest {
            pattern: "react".into(),
            conversation_id: conversation.clone(),
            ..request(question, false)
        };
        let ids = [format!("{conversation}-a"), format!("{conversation}-b")];
        let before = [finished(&bases[0]).await, finished(&bases[1]).await];
        client
            .send(&ids[0], &ask("What is the capital of France?"))
            .await
            .unwrap();
        let running = format!(
            "{}SELECT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{ ?s a tg:AgentQuestion ; tg:conversation \"{conversation}\" }} }}",
            agent_core::vocab::SPARQL_PREFIXES
        );
        assert_eq!(count_reaching(&aggregator.store(), running, 1).await, 1);
        until("the first dialog's stalled LLM call", || {
            calls_matching(&llm, "Observation: alpha-result") > attempt
        })
        .await;
        client
            .send(&ids[1], &ask("And how many people live there?"))
            .await
            .unwrap();
        let mut both = collect_dialogs(&mut client, &ids, Duration::from_secs(60)).await;
        let (first, second) = (both.remove(&ids[0]).unwrap(), both.remove(&ids[1]).unwrap());
        assert_eq!(closings(&first).len(), 1, "{first:#?}");
        assert_eq!(closings(&second).len(), 1, "{second:#?}");
        assert_eq!(second.last().unwrap().content, "about two million");
        let cancelled = first.last().unwrap().error.as_ref().expect("interrupted");
        assert_eq!(cancelled.kind, "cancelled", "{first:#?}");
        assert!(
            cancelled.message.contains("interrupted"),
            "{}",
            cancelled.message
        );
        // Which replica ended each dialog: the first's stalled step on the replica that ran it,
        // the second (one step) on the replica that took its request and sent the interrupt.
        let after = [finished(&bases[0]).await, finished(&bases[1]).await];
        let ended_on = |outcome: usize| {
            (0..2).find(|&replica| after[replica][outcome] - before[replica][outcome] == 1.0)
        };
        let (first_on, second_on) = (ended_on(1), ended_on(0));
        assert!(first_on.is_some() && second_on.is_some(), "{after:?}");
        if first_on != second_on {
            return;
        }
    }
    panic!("in eight tries the broker never had the two dialogs end on the two replicas");
}

/// How many dialogs the orchestrator under `base` ended with an answer, and with an error.
async fn finished(base: &str) -> [f64; 2] {
    let metrics = scrape(base).await;
    let ended = |outcome: &str| {
        metrics
            .iter()
            .filter(|(series, _)| {
                series.starts_with("agent_dialogs_finished_total")
                    && series.contains(&format!("outcome=\"{outcome}\""))
            })
            .map(|(_, n)| n)
            .sum::<f64>()
    };
    [ended("answer"), ended("error")]
}

/// A stack for a conversation under `conversation_policy: reject` whose starts are leased for
/// `lease_secs`, with one orchestrator (a child, its metrics at the base returned).
async fn conversation_with_lease(
    name: &str,
    script: &str,
    lease_secs: u64,
) -> (
    Broker,
    Aggregator,
    scripted_llm::ScriptedLlm,
    Orchestrator,
    String,
) {
    let config = conversation_config(name, "reject");
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(script).await;
    let http_addr = format!("127.0.0.1:{}", agent_bus::embedded::free_port().unwrap());
    let orchestrator = Orchestrator::journaled_with(
        Place::Child,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &config,
        &[
            (
                "AGENT_CONVERSATION_START_LEASE_SECS",
                &lease_secs.to_string(),
            ),
            ("AGENT_HTTP_ADDR", &http_addr),
        ],
    );
    let base = format!("http://{http_addr}");
    until_ready(&base, Duration::from_secs(60)).await;
    (broker, aggregator, llm, orchestrator, base)
}

fn in_slow_conversation(id: &str, question: &str) -> AgentRequest {
    AgentRequest {
        pattern: "react".into(),
        conversation_id: "slow-first".into(),
        ..request(&format!("{question} ({id})"), false)
    }
}

/// A first step slower than its start's lease (a local model can take minutes before its first
/// step commits and the graph shows the dialog): its replica renews the start with the journal's
/// owner while the step runs, so a request of the same conversation sent after the first lease
/// would have lapsed is still refused under `conversation_policy: reject`, and once the first
/// dialog has ended (and the graph shows it) the conversation takes the next one. Without the
/// renewals the start lapsed and the second request ran beside the first.
#[tokio::test]
async fn a_first_step_slower_than_its_starts_lease_keeps_its_conversation() {
    let script = r#"{"rules": [
  {"match": "Question: Slow first?", "reply": "Thought: I know.\nFinal Answer: slow done", "delay_ms": 18000},
  {"match": "", "reply": "Thought: I know.\nFinal Answer: quick done"}
]}"#;
    let (broker, aggregator, llm, _orchestrator, _base) =
        conversation_with_lease("reject-slow-first", script, 6).await;
    let mut client = client(&broker).await;
    client
        .send("slow-a", &in_slow_conversation("slow-a", "Slow first?"))
        .await
        .unwrap();
    until("the slow first step's LLM call", || {
        calls_matching(&llm, "Slow first?") >= 1
    })
    .await;
    // Past the 6 s lease taken as the step started, well before its LLM answers.
    tokio::time::sleep(Duration::from_secs(9)).await;
    client
        .send("slow-b", &in_slow_conversation("slow-b", "Beside it?"))
        .await
        .unwrap();
    let mut both =
        collect_dialogs(&mut client, &["slow-a", "slow-b"], Duration::from_secs(60)).await;
    let (first, second) = (
        both.remove("slow-a").unwrap(),
        both.remove("slow-b").unwrap(),
    );
    assert_eq!(first.last().unwrap().content, "slow done", "{first:#?}");
    let refused = second
        .last()
        .and_then(|r| r.error.as_ref())
        .unwrap_or_else(|| panic!("the second request ran beside the first: {second:#?}"));
    assert!(
        refused.message.contains("conversation_policy: reject"),
        "{}",
        refused.message
    );
    assert_eq!(calls_matching(&llm, "Beside it?"), 0);
    // The first ended, and the graph shows it: its start, no longer renewed, holds nothing up.
    let ended = format!(
        "{}SELECT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{ ?s a tg:AgentQuestion ; tg:conversation \"slow-first\" ; tg:query ?q . FILTER (CONTAINS(?q, \"Slow first?\")) BIND (IRI(CONCAT(STR(?s), \"/final\")) AS ?f) ?f tg:terminationReason ?why }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), ended, 1).await, 1);
    client
        .send("slow-c", &in_slow_conversation("slow-c", "Next?"))
        .await
        .unwrap();
    let mut next = collect_dialogs(&mut client, &["slow-c"], Duration::from_secs(60)).await;
    let next = next.remove("slow-c").unwrap();
    assert_eq!(next.last().unwrap().content, "quick done", "{next:#?}");
}

/// A first step parked while its LLM provider is down (a 503 asking for 8 s each time) keeps its
/// start through the park, longer than its lease: a request of its conversation sent meanwhile
/// is refused under `conversation_policy: reject`. Without renewals through the park the start
/// lapsed while the step waited, and the second request started beside the first.
#[tokio::test]
async fn a_parked_first_step_keeps_its_conversation() {
    let script = r#"{"rules": [
  {"match": "Question: Parked first?", "reply": "Thought: I know.\nFinal Answer: parked done"},
  {"match": "", "reply": "Thought: I know.\nFinal Answer: quick done"}
]}"#;
    let (broker, _aggregator, llm, _orchestrator, base) =
        conversation_with_lease("reject-parked-first", script, 3).await;
    let mut client = client(&broker).await;
    llm.start_outage(503, Some(8));
    client
        .send(
            "parked-a",
            &in_slow_conversation("parked-a", "Parked first?"),
        )
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while counter_once_listening(&base, "agent_steps_parked_total").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the first step was never parked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Past the 3 s lease, within the 8 s the park waits.
    tokio::time::sleep(Duration::from_millis(4500)).await;
    client
        .send("parked-b", &in_slow_conversation("parked-b", "Beside it?"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    llm.end_outage();
    let mut both = collect_dialogs(
        &mut client,
        &["parked-a", "parked-b"],
        Duration::from_secs(90),
    )
    .await;
    let (first, second) = (
        both.remove("parked-a").unwrap(),
        both.remove("parked-b").unwrap(),
    );
    assert_eq!(first.last().unwrap().content, "parked done", "{first:#?}");
    let refused = second
        .last()
        .and_then(|r| r.error.as_ref())
        .unwrap_or_else(|| panic!("the second request ran beside the first: {second:#?}"));
    assert!(
        refused.message.contains("conversation_policy: reject"),
        "{}",
        refused.message
    );
}

/// A cancel that races a dialog's steps, sent as each of its LLM calls starts: whatever wins,
/// the client gets exactly one ending (the answer or the cancel), and the graph one conclusion.
/// Each call takes 40 ms, so that the cancel lands while the dialog runs: with an instant model
/// it won none of the four (the dialog had ended before agentctl's cancel came), and the test
/// passed with cancels doing nothing.
#[tokio::test]
async fn a_cancel_racing_a_dialog_gives_exactly_one_ending() {
    let mut script: serde_json::Value = serde_json::from_str(THREE_STEPS).unwrap();
    for rule in script["rules"].as_array_mut().unwrap() {
        rule["delay_ms"] = 40.into();
    }
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &script.to_string(), &seed_dir(), &[]).await;
    let mut client = client(&broker).await;
    let mut cancelled_rounds = 0;
    for (race, calls) in [1usize, 2, 3, 4].into_iter().enumerate() {
        let id = format!("race-{race}");
        let session = format!("racing-dialog-{race}");
        let question = format!("combine (race {race})");
        let before = llm.calls().len();
        client
            .send(
                &id,
                &AgentRequest {
                    pattern: "react".into(),
                    session_id: session.clone(),
                    ..request(&question, false)
                },
            )
            .await
            .unwrap();
        until("the dialog's LLM calls", || {
            llm.calls().len() >= before + calls
        })
        .await;
        cancel(&broker, &session, "ops-erin", "racing");
        let mut responses = collect_dialog(&mut client, &id, Duration::from_secs(60))
            .await
            .unwrap();
        responses.extend(drain_for(&mut client, &id, Duration::from_secs(2)).await);
        let endings = closings(&responses);
        assert_eq!(endings.len(), 1, "race {race}: {responses:#?}");
        let ended = endings[0];
        let answered = ended.error.is_none() && ended.content == "alpha and beta, combined.";
        let cancelled = ended.error.as_ref().is_some_and(|e| e.kind == "cancelled");
        assert!(answered || cancelled, "race {race}: {ended:#?}");
        cancelled_rounds += usize::from(cancelled);
        let conclusions = format!(
            "{}SELECT ?why WHERE {{ GRAPH <urn:graph:retrieval> {{
               <urn:trustgraph:agent:{session}/final> tg:terminationReason ?why }} }}",
            agent_core::vocab::SPARQL_PREFIXES
        );
        assert_eq!(
            count_reaching(&aggregator.store(), conclusions, 1).await,
            1,
            "race {race}"
        );
    }
    println!("the cancel won {cancelled_rounds} of 4 races");
    assert!(cancelled_rounds > 0, "no race ended by its cancel");
}

/// A cancel of a dialog the graph shows ended sends and records nothing, says so and exits 1: a
/// cancellation recorded after the dialog's end would tell an auditor of a cancel that stopped
/// nothing. Until 2026-12-03 it was recorded, and agentctl said the client would get a closing.
#[tokio::test]
async fn a_cancel_of_a_dialog_that_ended_records_nothing() {
    let Stack {
        broker,
        aggregator,
        llm: _llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, THREE_STEPS, &seed_dir(), &[]).await;
    let mut client = client(&broker).await;
    client
        .send(
            "ended-1",
            &AgentRequest {
                pattern: "react".into(),
                session_id: "a-dialog-that-ended".into(),
                ..request("combine", false)
            },
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "ended-1", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        responses.last().unwrap().content,
        "alpha and beta, combined."
    );
    let store = aggregator.store();
    let concluded = format!(
        "{}SELECT ?why WHERE {{ GRAPH <urn:graph:retrieval> {{
           <urn:trustgraph:agent:a-dialog-that-ended/final> tg:terminationReason ?why }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&store, concluded, 1).await, 1);
    let out = Command::new(binary("agentctl"))
        .args([
            "cancel",
            "a-dialog-that-ended",
            "--by",
            "ops",
            "--pulsar-url",
        ])
        .arg(broker.url())
        .args(["--store", &aggregator.endpoint, "--token", TOKEN])
        .env("AGENT_SEAL_KEY", SEAL_KEY)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{said}");
    assert!(said.contains("has already ended"), "{said}");
    // A cancel sent would be recorded within this.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cancellations = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{ ?c a tg:Cancellation }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count(&store, cancellations).await, 0);
}

/// The operator's approvals hold whatever the config service says. The orchestrator's own config
/// directory puts `pay` in the `payments` group, which waits for approval; a config service like
/// TrustGraph's (tools, but no `agent-limits`) defines `pay` with no group. The call still waits
/// for a person. Until 2026-12-02 the service's config replaced the directory's wholesale: the
/// built-in limits (no approval groups) came with it and the payment was made unasked.
#[tokio::test]
async fn the_config_services_tools_do_not_lift_the_operators_approvals() {
    let local = seed_with(
        "approval-floor-local",
        &[
            (
                "tool",
                &PAY_TOOL.replace(r#""requires-approval": true"#, r#""group": ["payments"]"#),
            ),
            (
                "agent-limits",
                r#"{"default": {"max_iterations": 6, "approval_groups": ["payments"]}}"#,
            ),
        ],
    );
    let service = config_dir(
        "approval-floor-service",
        &[(
            "tool",
            &PAY_TOOL.replace(
                r#""description": "Pay an invoice", "type": "text-completion", "requires-approval": true"#,
                r#""description": "Pay an invoice, as the service defines it", "type": "text-completion""#,
            ),
        )],
    );
    let (
        Stack {
            broker,
            aggregator: _aggregator,
            llm,
            orchestrator: _orchestrator,
        },
        _svc,
    ) = following_a_config_service(
        &local,
        &service,
        r#"{"rules": [
      {"match": "pay invoice floor-1", "exact": true, "reply": "payment sent"},
      {"match": "Observation: payment sent", "reply": "Thought: Paid.\nFinal Answer: paid"},
      {"match": "Question: pay the floor invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice floor-1\"}"}
    ]}"#,
    )
    .await;
    let mut client = client(&broker).await;
    client
        .send(
            "floor",
            &AgentRequest {
                pattern: "react".into(),
                ..request("pay the floor invoice", false)
            },
        )
        .await
        .unwrap();
    let responses = until_approval_asked(&mut client, "floor").await;
    assert!(
        llm.calls()
            .iter()
            .any(|c| c.last_user.contains("as the service defines it")),
        "the service's config was not in force: {:?}",
        llm.calls()
    );
    assert_eq!(payments(&llm, "pay invoice floor-1"), 0, "paid unapproved");
    approval_asked(&responses);
}

/// An answer to an approval taken up by a replica that has just started waits for its first read
/// of the config service, as a request does: the call it resumes is the deployment's, which the
/// files that replica started with do not define. Before, the answer was taken up at once, the
/// call was refused there ("no tool"), and the approval, used up, paid nothing.
#[tokio::test]
async fn an_approval_taken_up_at_a_start_waits_for_the_config_service() {
    let service = config_dir("approval-at-start-service", &[("tool", PAY_TOOL)]);
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::start(Place::Child, &broker, Some(&service));
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "pay invoice start-1", "exact": true, "reply": "payment sent"},
      {"match": "Observation: payment sent", "reply": "Thought: Paid.\nFinal Answer: paid"},
      {"match": "Question: pay the start invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice start-1\"}"}
    ]}"#,
    )
    .await;
    // Its own files define no `pay`: only the config service does.
    let local = seed_dir();
    let mut parking = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &local,
        &[],
    );
    let mut client = client(&broker).await;
    client
        .send(
            "at-start",
            &AgentRequest {
                pattern: "react".into(),
                ..request("pay the start invoice", false)
            },
        )
        .await
        .unwrap();
    let responses = until_approval_asked(&mut client, "at-start").await;
    let (_, session, step) = approval_asked(&responses);
    // Stopped, not killed: killed, its connection may be reset, and pulsar-lite then keeps its
    // consumer of the answers' failover subscription (a ghost), to which the answer goes.
    parking.terminate();
    assert!(parking.exited_within(Duration::from_secs(30)).await);
    // Answered while no orchestrator runs: the next one finds it waiting as it subscribes.
    agentctl(&broker, &["approve", &session, &step.to_string()]);
    svc.freeze(true);
    let _resuming = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &local,
        &[],
    );
    tokio::time::sleep(Duration::from_millis(1000)).await;
    svc.freeze(false);
    let responses = collect_dialog(&mut client, "at-start", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        responses.last().map(|r| r.content.as_str()),
        Some("paid"),
        "{responses:#?}"
    );
    assert_eq!(payments(&llm, "pay invoice start-1"), 1);
}

/// A call approved after the config stopped defining its tool is refused, and the refusal names
/// the tools the config defines now. Before, it named those the LLM was shown when the call was
/// parked ("available tools: llm, pay"), so the agent was told to use the tool that had gone.
#[tokio::test]
async fn a_call_approved_after_its_tool_was_removed_is_refused_with_the_tools_there_are_now() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "pay invoice gone-1", "exact": true, "reply": "payment sent"},
      {"match": "no tool named 'pay'", "reply": "Thought: It cannot be paid.\nFinal Answer: not paid"},
      {"match": "Question: pay the gone invoice", "reply": "Thought: Pay it.\nAction: pay\nArgs: {\"question\": \"pay invoice gone-1\"}"}
    ]}"#,
    )
    .await;
    let mut parking = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &pay_config("gone-before", 300),
        &[],
    );
    let mut client = client(&broker).await;
    client
        .send(
            "gone",
            &AgentRequest {
                pattern: "react".into(),
                ..request("pay the gone invoice", false)
            },
        )
        .await
        .unwrap();
    let responses = until_approval_asked(&mut client, "gone").await;
    let (_, session, step) = approval_asked(&responses);
    parking.terminate();
    assert!(parking.exited_within(Duration::from_secs(30)).await);
    // The deployment's config now defines `refund` beside `llm`, and no `pay`.
    let without_pay = seed_with(
        "gone-after",
        &[(
            "tool",
            r#"{
  "llm": {"name": "llm", "description": "Ask the LLM a question", "type": "text-completion",
          "arguments": [{"name": "question", "type": "string", "description": "The question"}]},
  "refund": {"name": "refund", "description": "Refund an invoice", "type": "text-completion",
          "arguments": [{"name": "question", "type": "string", "description": "What to refund"}]}
}"#,
        )],
    );
    let _resuming = Orchestrator::journaled_with(
        Place::InProcess,
        &broker,
        &llm,
        &aggregator,
        TOKEN,
        &without_pay,
        &[],
    );
    agentctl(&broker, &["approve", &session, &step.to_string()]);
    let responses = collect_dialog(&mut client, "gone", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        responses.last().map(|r| r.content.as_str()),
        Some("not paid"),
        "{responses:#?}"
    );
    assert_eq!(payments(&llm, "pay invoice gone-1"), 0, "paid with no tool");
    let told = llm
        .calls()
        .into_iter()
        .find(|c| c.last_user.contains("no tool named 'pay'"))
        .map(|c| c.last_user)
        .unwrap_or_default();
    assert!(
        told.contains("no tool named 'pay'; available tools: llm, refund"),
        "{told}"
    );
}

/// A sealed approval given before the call it names was asked (beyond an hour of clocks
/// disagreeing) is an earlier call's, copied off the control topic and sent again: a session's id
/// is its client's to choose, so a new dialog under an old id could park a call where an old
/// approval answers it. It runs nothing and is dropped unanswered, so the person's own answer
/// still decides. Until 2026-12-02 an approval's seal held for any call at its session and step.
#[tokio::test]
async fn an_approval_given_before_the_call_was_asked_runs_nothing() {
    let (
        Stack {
            broker,
            llm,
            aggregator: _aggregator,
            orchestrator: _orchestrator,
        },
        mut client,
        mut responses,
        session,
        step,
    ) = a_payment_awaiting_approval("replayed-approval", "zeta", 6, "a-replay").await;
    let two_hours_ago = chrono::Utc::now() - chrono::Duration::hours(2);
    let replayed = agent_schema::AgentControl {
        operation: agent_schema::control_operation::APPROVE.to_owned(),
        session_id: session.clone(),
        by: "ops-carol".to_owned(),
        at: two_hours_ago.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
        step: Some(step),
        ..Default::default()
    };
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let key = agent_bus::seal::SealKey::new(SEAL_KEY.as_bytes());
    agent_bus::send_control(&bus, &topics, &replayed, Some(&key))
        .await
        .unwrap();
    // Acted on, it would have paid by now.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        payments(&llm, "pay invoice zeta-6"),
        0,
        "the old approval paid"
    );
    denied_to_the_end(
        &broker,
        &mut client,
        &mut responses,
        (&session, step),
        "a-replay",
        "not this one",
    )
    .await;
    assert_eq!(payments(&llm, "pay invoice zeta-6"), 0);
}
