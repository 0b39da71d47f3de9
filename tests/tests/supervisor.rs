//! Supervisor/Subagent end to end on a real broker, with the aggregator doing fan-in by querying the
//! graph: subagents run concurrently and the synthesis cites every result; a failing subagent is a
//! completion the synthesis sees, not the end of the client's dialog; a completion delivered twice
//! still gives one synthesis and one final answer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::Publisher;
use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse, Metadata, Triples};
use futures::StreamExt;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

fn supervised(question: &str) -> AgentRequest {
    AgentRequest {
        pattern: "supervisor".into(),
        ..request(question, false)
    }
}

const FOUR: &str = r#"{"rules": [
  {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}, {\"goal\": \"price of gamma\"}, {\"goal\": \"price of delta\"}]"},
  {"match": "Question: price of alpha", "reply": "Thought: known.\nFinal Answer: alpha costs 1", "delay_ms": 400},
  {"match": "Question: price of beta", "reply": "Thought: known.\nFinal Answer: beta costs 2", "delay_ms": 400},
  {"match": "Question: price of gamma", "reply": "Thought: known.\nFinal Answer: gamma costs 3", "delay_ms": 400},
  {"match": "Question: price of delta", "reply": "unused", "faults": ["400"]},
  {"match": "Request to answer from the subagents: Compare", "and": ["alpha costs 1", "beta costs 2", "gamma costs 3", "price of delta: Error: the subagent failed"], "reply": "Alpha 1, beta 2, gamma 3; delta unknown."}
]}"#;

fn closings(responses: &[AgentResponse]) -> usize {
    responses.iter().filter(|r| r.end_of_dialog).count()
}

/// A supervisor dialog with the step critic on (a risk assessment's).
fn critiqued(question: &str) -> AgentRequest {
    AgentRequest {
        task_type: "risk-assessment".into(),
        ..supervised(question)
    }
}

/// One dialog on a broker, aggregator (embedded store) and orchestrator of its own: the services,
/// still running to be looked into, and what the client received.
struct Dialog {
    _broker: Broker,
    aggregator: Aggregator,
    _orchestrator: Orchestrator,
    llm: scripted_llm::ScriptedLlm,
    responses: Vec<AgentResponse>,
}

/// Runs `request` under `id` with the scripted LLM `script`, and checks that it ended once, with
/// `answer`.
async fn answered(script: &str, id: &str, request: AgentRequest, answer: &str) -> Dialog {
    answered_under(&seed_dir(), script, id, request, answer).await
}

/// [`answered`], the orchestrator reading its config from `config`.
async fn answered_under(
    config: &std::path::Path,
    script: &str,
    id: &str,
    request: AgentRequest,
    answer: &str,
) -> Dialog {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let orchestrator = Orchestrator::spawn(&broker, &llm, config, &[]);
    let mut client = client(&broker).await;
    client.send(id, &request).await.unwrap();
    let responses = collect_dialog(&mut client, id, DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, answer);
    assert_eq!(closings(&responses), 1, "{responses:#?}");
    Dialog {
        _broker: broker,
        aggregator,
        _orchestrator: orchestrator,
        llm,
        responses,
    }
}

/// Subagents' results carried whole (no shared store to check them in) that together are over
/// the broker's message limit are cut to fit the synthesis request, each saying so, and the
/// supervisor answers. Until 2026-12-04 the aggregator's request was refused by its publisher
/// (too large) on every try: the completion came back for ever and the client never heard.
#[tokio::test]
async fn results_over_the_message_limit_together_are_cut_to_fit_the_synthesis() {
    let long = |what: &str| format!("{what} ").repeat(3_000);
    let script = serde_json::json!({"rules": [
      {"match": "Request to split: Summarise", "reply": "[{\"goal\": \"read the north report\"}, {\"goal\": \"read the south report\"}]"},
      {"match": "Question: read the north report", "reply": format!("Thought: read.\nFinal Answer: {}", long("north"))},
      {"match": "Question: read the south report", "reply": format!("Thought: read.\nFinal Answer: {}", long("south"))},
      {"match": "Request to answer from the subagents: Summarise", "and": ["north north", "south south", "[cut to fit the broker's message limit: "], "reply": "Both reports, in part."}
    ]})
    .to_string();
    let broker = Broker::start().unwrap();
    // Each result is about 18 KB; together they are over this aggregator's 32 KB.
    let _aggregator = Aggregator::spawn_with(&broker, &["--pulsar-max-message-bytes", "32768"]);
    let llm = scripted_llm(&script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("cut-results", &supervised("Summarise both reports."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "cut-results", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        outcome(&responses),
        "Both reports, in part.",
        "{:?}",
        responses.last()
    );
    assert_eq!(closings(&responses), 1);
}

/// A client that names its own session id and uses it again for another dialog is refused: every
/// node of a session is named after its id, so the second dialog's fan-out landed on the first's,
/// already synthesised, which resumed nobody, and the client waited for ever (checked: without
/// the refusal this test timed out waiting for the second dialog's end). The earlier dialog's
/// record is left as it was.
#[tokio::test]
async fn a_session_id_used_again_for_another_dialog_is_refused() {
    const TOKEN: &str = "reuse-token";
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(FOUR).await;
    let _orchestrator = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let in_session = |question: &str| AgentRequest {
        session_id: "chat-7".into(),
        ..supervised(question)
    };
    let mut client = client(&broker).await;
    client
        .send("chat-7-first", &in_session("Compare the four prices."))
        .await
        .unwrap();
    let first = collect_dialog(&mut client, "chat-7-first", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        first.last().unwrap().content,
        "Alpha 1, beta 2, gamma 3; delta unknown.",
        "{first:#?}"
    );
    // The same question, asked again by another request: another dialog.
    client
        .send("chat-7-second", &in_session("Compare the four prices."))
        .await
        .unwrap();
    let refused = collect_dialog(&mut client, "chat-7-second", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = refused.last().unwrap();
    let error = last.error.as_ref().map(|e| e.message.clone());
    assert!(
        error
            .as_deref()
            .is_some_and(|e| e.contains("already names another dialog")),
        "{refused:#?}"
    );
    assert_eq!(closings(&refused), 1, "{refused:#?}");
    let store = aggregator.store();
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let session = "urn:trustgraph:agent:chat-7";
    let recorded = format!(
        "{prefixes}SELECT ?q ?client WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{session}> tg:query ?q ; tg:clientId ?client }} }}"
    );
    assert_eq!(count(&store, recorded).await, 1);
    let fan_outs = format!(
        "{prefixes}SELECT ?f WHERE {{ GRAPH <urn:graph:retrieval> {{ ?f a tg:FanOut .
           FILTER(STRSTARTS(STR(?f), \"{session}/\")) }} }}"
    );
    assert_eq!(count(&store, fan_outs).await, 1);
    let splits = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Request to split"))
        .count();
    assert_eq!(splits, 1, "the second dialog ran");
}

/// Two requests resuming one fan-out with different results (the aggregator's partial answer at
/// the timeout and a complete one, as a claim that lapsed while the first was published would send)
/// are one journaled step: the first recorded stands and the second makes no second synthesis and
/// no second answer. Keyed by their bytes, both ran (checked: two synthesis calls).
#[tokio::test]
async fn a_second_resumption_of_a_fan_out_with_other_results_is_the_same_step() {
    const TOKEN: &str = "resume-token";
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(FOUR).await;
    let _orchestrator = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let mut requests = read_from_start(&broker, &topics.request, "resume-reader").await;
    let mut client = client(&broker).await;
    client
        .send("r-1", &supervised("Compare the four prices."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "r-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&responses), 1, "{responses:#?}");
    let answer = responses.last().unwrap().content.clone();
    let synthesis_calls = |llm: &scripted_llm::ScriptedLlm| {
        llm.calls()
            .iter()
            .filter(|c| c.last_user.contains("Request to answer from the subagents"))
            .count()
    };
    assert_eq!(synthesis_calls(&llm), 1);
    // The resumption the aggregator published, as it was sent.
    let (resumption, mut properties) = synthesis_sent(&mut requests, None).await;
    // Another with one result changed, sealed as the aggregator seals one.
    let mut other = resumption.clone();
    let results = other
        .history
        .last_mut()
        .and_then(|step| step.subagent_results.as_mut())
        .unwrap();
    let first = results.values_mut().next().unwrap();
    *first = format!("{first} (a later copy)");
    let payload = agent_schema::encode(&other);
    properties.remove(agent_bus::seal::STEP_SEAL_PROPERTY);
    let key = agent_bus::seal::SealKey::new(SEAL_KEY.as_bytes());
    let seal = key.seal_step(&payload, &properties);
    properties.insert(agent_bus::seal::STEP_SEAL_PROPERTY.to_owned(), seal);
    let mut dead_letters = read_from_start(&broker, DEAD_LETTER_TOPIC, "resume-dlq").await;
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    Publisher::new(&bus, &topics.request)
        .await
        .unwrap()
        .send(payload, &properties)
        .await
        .unwrap();
    // Taken up as a copy of the step (not refused: its seal holds), and nothing new made of it.
    let more = drain_for(&mut client, "r-1", Duration::from_secs(5)).await;
    let refused = tokio::time::timeout(Duration::from_secs(1), dead_letters.next()).await;
    assert!(refused.is_err(), "the copy was dead-lettered: {refused:?}");
    assert_eq!(synthesis_calls(&llm), 1, "a second synthesis");
    for closing in more.iter().filter(|r| r.end_of_dialog) {
        assert_eq!(closing.content, answer, "{more:#?}");
    }
}

/// The next synthesis on the request topic (of `session`, if one is named), as the aggregator
/// sent it, with its properties.
async fn synthesis_sent(
    requests: &mut pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor>,
    session: Option<&str>,
) -> (AgentRequest, agent_bus::Properties) {
    loop {
        let message = tokio::time::timeout(DIALOG_TIMEOUT, requests.next())
            .await
            .expect("no synthesis on the request topic")
            .unwrap()
            .unwrap();
        let request: AgentRequest = agent_schema::decode(&message.payload.data).unwrap();
        if session.is_none_or(|session| request.session_id == session)
            && agent_core::supervisor::pending_synthesis(&request.history).is_some()
        {
            let properties = message
                .payload
                .metadata
                .properties
                .iter()
                .map(|kv| (kv.key.clone(), kv.value.clone()))
                .collect();
            return (request, properties);
        }
    }
}

/// The synthesis the aggregator sends is the input recorded first for its step: an attempt that
/// built other input (after one that recorded and then stopped, or whose claim lapsed) sends the
/// recorded one, and the graph names one input for the step, so a fork from it starts from what
/// ran. The earlier attempt's record is planted here before the fan-in completes; without the
/// check the aggregator sent its own and recorded a second input beside the first.
#[tokio::test]
async fn the_synthesis_sent_is_the_input_recorded_first() {
    const TOKEN: &str = "recorded-token";
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let llm = scripted_llm(FOUR).await;
    let _orchestrator = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let mut requests = read_from_start(&broker, &topics.request, "recorded-reader").await;
    let mut client = client(&broker).await;
    let question = "Compare the four prices.";
    let first_session = "recorded-first";
    client
        .send(
            "rec-1",
            &AgentRequest {
                session_id: first_session.into(),
                ..supervised(question)
            },
        )
        .await
        .unwrap();
    let first = collect_dialog(&mut client, "rec-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&first), 1, "{first:#?}");
    let (earlier, _) = synthesis_sent(&mut requests, Some(first_session)).await;
    // The second dialog's synthesis step, recorded by "an earlier attempt" with the first
    // dialog's results (the same question, so the synthesis answers it alike).
    let second_session = "recorded-second";
    let planted = AgentRequest {
        session_id: second_session.into(),
        ..earlier
    };
    let step = agent_core::fork::step_of(&planted);
    let input = agent_core::fork::RecordedInput {
        step,
        continues: None,
        request: planted.clone(),
    };
    let uris = agent_core::provenance::SessionUris::new(second_session);
    let store =
        agent_graph::GraphStore::open(&aggregator.endpoint, Some(TOKEN.to_owned())).unwrap();
    client
        .send(
            "rec-2",
            &AgentRequest {
                session_id: second_session.into(),
                ..supervised(question)
            },
        )
        .await
        .unwrap();
    // Before its subagents answer (each takes 400 ms).
    store
        .insert(
            agent_graph::convert::into_quads(agent_core::provenance::step_input(&uris, &input))
                .unwrap(),
        )
        .await
        .unwrap();
    let second = collect_dialog(&mut client, "rec-2", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&second), 1, "{second:#?}");
    let (sent, _) = synthesis_sent(&mut requests, Some(second_session)).await;
    assert_eq!(
        agent_schema::encode(&sent),
        agent_schema::encode(&planted),
        "the aggregator sent another input than the one recorded"
    );
    let recorded = store
        .query(format!(
            "SELECT (COUNT(?r) AS ?n) WHERE {{ GRAPH ?g {{ <{}> <https://trustgraph.ai/ns/request> ?r }} }}",
            uris.input(step)
        ))
        .await
        .unwrap()
        .rows();
    let count = recorded
        .first("n")
        .map(|n| n.to_string())
        .unwrap_or_default();
    assert!(
        count.starts_with("\"1\""),
        "inputs recorded for the step: {count}"
    );
}

/// Four subagents, one of which fails: they run at once, the synthesis cites the three results and
/// the failure, exactly one message ends the dialog, and a completion delivered again changes
/// nothing.
#[tokio::test]
async fn a_four_way_fan_out_is_synthesised_once() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::start(Place::Child, &broker, &[]);
    let llm = scripted_llm(FOUR).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("s-1", &supervised("Compare the four prices."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "s-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "Alpha 1, beta 2, gamma 3; delta unknown.");
    // The subagents' LLM calls overlapped.
    assert!(llm.max_concurrent() >= 2, "subagents ran one after another");
    // Their ends reached the client as observations under their own message ids.
    let subagent_ends: Vec<&AgentResponse> = responses
        .iter()
        .filter(|r| {
            r.message_type == "observation"
                && r.message_id.contains("-s")
                && r.message_id.ends_with("/final")
        })
        .collect();
    assert_eq!(subagent_ends.len(), 4, "{responses:#?}");

    // A completion published again: no second synthesis, no second answer.
    let completion = responses
        .iter()
        .find(|r| {
            r.explain_id
                .as_deref()
                .is_some_and(|e| e.ends_with("/completion"))
        })
        .unwrap();
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let explain = Publisher::new(&bus, &topics.explainability).await.unwrap();
    let again = Triples {
        metadata: Metadata {
            id: completion.explain_id.clone().unwrap(),
            root: String::new(),
            collection: "default".into(),
        },
        triples: completion.explain_triples.clone(),
    };
    let again = agent_schema::encode(&again);
    explain
        .enqueue(again.clone(), &sealed_explain(&again))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
    let more = drain_for(&mut client, "s-1", Duration::from_secs(3)).await;
    assert_eq!(closings(&more), 0, "{more:#?}");
    let synthesis_calls = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Request to answer from the subagents"))
        .count();
    assert_eq!(synthesis_calls, 1);

    // The graph: the fan-out, four completions and the synthesis derived from all of them.
    let session = session_of(&responses);
    let store = aggregator.store();
    let derived = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT DISTINCT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?s a tg:Synthesis ; prov:wasDerivedFrom ?c . ?c a tg:SubagentCompletion .
           ?s prov:wasDerivedFrom ?f . ?f a tg:FanOut ; prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, derived, 4).await, 4);
    // Each subagent's run hangs off the fan-out, so the whole run is one DAG from the root.
    let subagent_roots = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT DISTINCT ?q WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?q a tg:AgentQuestion ; prov:wasDerivedFrom ?f . ?f a tg:FanOut ;
              prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, subagent_roots, 4).await, 4);

    // The operator's view: ready (consuming, the store answers), one fan-in done, none open, the
    // explain messages written.
    let ready = reqwest::get(format!("{}/readyz", aggregator.endpoint))
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let metrics = scrape(&aggregator.endpoint).await;
    assert_eq!(
        sample(
            &metrics,
            "agent_fanin_duration_seconds_count{outcome=\"complete\"}"
        ),
        1.0
    );
    assert_eq!(sample(&metrics, "agent_fanouts_open"), 0.0);
    assert!(sample(&metrics, "agent_explain_messages_total{fate=\"acked\"}") > 10.0);
}

/// A subagent that never finishes: after the fan-out timeout the aggregator's sweep gives the
/// supervisor a partial synthesis that names it, and the dialog ends once.
#[tokio::test]
async fn a_stalled_subagent_gets_a_partial_synthesis_after_the_timeout() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::start(Place::Child, &broker, &["--fanout-timeout-secs", "3"]);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Survey", "reply": "[{\"goal\": \"ask the quick one\"}, {\"goal\": \"ask the slow one\"}]"},
      {"match": "Question: ask the quick one", "reply": "Thought: quick.\nFinal Answer: QUICK"},
      {"match": "Question: ask the slow one", "reply": "unused", "faults": ["stall"], "stall_ms": 120000},
      {"match": "Request to answer from the subagents: Survey", "and": ["QUICK", "ask the slow one: Error: no result within 3 s (the subagent timed out)"], "reply": "Only the quick one answered."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(
        &broker,
        &llm,
        &seed_dir(),
        &["--llm-idle-timeout-secs", "300"],
    );
    let mut client = client(&broker).await;
    client
        .send("t-1", &supervised("Survey both."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "t-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "Only the quick one answered.");
    // No second synthesis from a later sweep.
    let more = drain_for(&mut client, "t-1", Duration::from_secs(5)).await;
    assert_eq!(closings(&more), 0, "{more:#?}");
    let metrics = scrape(&aggregator.endpoint).await;
    assert_eq!(
        sample(
            &metrics,
            "agent_fanin_duration_seconds_count{outcome=\"timed_out\"}"
        ),
        1.0
    );
    assert_eq!(sample(&metrics, "agent_fanouts_open"), 0.0);
}

/// A supervised trip under way: its services, and the client that asked.
struct Trip {
    broker: Broker,
    aggregator: Aggregator,
    orchestrator: Orchestrator,
    llm: scripted_llm::ScriptedLlm,
    client: agent_bus::AgentClient,
}

/// A supervised "Plan the trip to Rome." sent under `id`, on an aggregator with the fan-out timeout
/// and nested grace `(timeout, grace)` (seconds) and an orchestrator that reads the graph (where
/// it learns whether anyone still waits) through it.
async fn start_nested_trip((timeout, grace): (&str, &str), script: &str, id: &str) -> Trip {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::start(
        Place::Child,
        &broker,
        &[
            "--fanout-timeout-secs",
            timeout,
            "--fanout-nested-grace-secs",
            grace,
            "--config-token",
            "nest-token",
        ],
    );
    let llm = scripted_llm(script).await;
    let orchestrator = Orchestrator::spawn(
        &broker,
        &llm,
        &seed_dir(),
        &[
            "--llm-idle-timeout-secs",
            "300",
            "--graph-store",
            &aggregator.endpoint,
            "--config-token",
            "nest-token",
        ],
    );
    let client = client(&broker).await;
    client
        .send(id, &supervised("Plan the trip to Rome."))
        .await
        .unwrap();
    Trip {
        broker,
        aggregator,
        orchestrator,
        llm,
        client,
    }
}

/// `trip`'s dialog `id`, checked to end without error with `answer`.
async fn trip_answered(mut trip: Trip, id: &str, answer: &str) -> (Dialog, agent_bus::AgentClient) {
    let responses = collect_dialog(&mut trip.client, id, DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, answer);
    let dialog = Dialog {
        _broker: trip.broker,
        aggregator: trip.aggregator,
        _orchestrator: trip.orchestrator,
        llm: trip.llm,
        responses,
    };
    (dialog, trip.client)
}

/// [`start_nested_trip`], then [`trip_answered`].
async fn nested_trip(
    deadlines: (&str, &str),
    script: &str,
    id: &str,
    answer: &str,
) -> (Dialog, agent_bus::AgentClient) {
    trip_answered(start_nested_trip(deadlines, script, id).await, id, answer).await
}

/// A nested supervisor whose own supervisor stopped waiting for it makes no synthesis call. With
/// no grace (`--fanout-nested-grace-secs 0`) the nested fan-out is due when the outer one is, the
/// sweep answers the outer one first and the root answers without the branch; when the nested
/// fan-in closes its answer would be read by no one, and the nested supervisor ends saying why.
/// Without the check it asked the LLM to synthesise.
#[tokio::test]
async fn a_nested_supervisor_whose_supervisor_stopped_waiting_makes_no_synthesis_call() {
    let (dialog, mut client) = nested_trip(
        ("3", "0"),
        r#"{"rules": [
      {"match": "Request to split: Plan the trip", "reply": "[{\"goal\": \"Organise travel\", \"pattern\": \"supervisor\"}, {\"goal\": \"book the hotel\"}]"},
      {"match": "Request to split: Organise travel", "reply": "[{\"goal\": \"book the train\"}]"},
      {"match": "Question: book the hotel", "reply": "Thought: done.\nFinal Answer: hotel booked"},
      {"match": "Question: book the train", "reply": "unused", "faults": ["stall"], "stall_ms": 120000},
      {"match": "Request to answer from the subagents: Organise travel", "reply": "Travel sorted."},
      {"match": "Request to answer from the subagents: Plan the trip", "and": ["hotel booked"], "reply": "Trip planned without travel."}
    ]}"#,
        "n-2",
        "Trip planned without travel.",
    )
    .await;
    let (aggregator, llm, responses) = (&dialog.aggregator, &dialog.llm, &dialog.responses);
    // The nested fan-out times out too; its supervisor ends without a synthesis.
    let nested = format!("{}-f1-s0", session_of(responses));
    let ended = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?c a tg:Conclusion ; tg:document ?d . ?d tg:content ?why .
           FILTER(STRSTARTS(STR(?c), \"{nested}/\") && CONTAINS(?why, \"stopped waiting\")) }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), ended, 1).await, 1);
    let more = drain_for(&mut client, "n-2", Duration::from_secs(2)).await;
    assert_eq!(closings(&more), 0, "{more:#?}");
    let nested_syntheses = llm
        .calls()
        .iter()
        .filter(|c| {
            c.last_user
                .contains("Request to answer from the subagents: Organise travel")
        })
        .count();
    assert_eq!(nested_syntheses, 0, "a synthesis no one reads");
}

/// The trip of the nested-fan-out tests: the nested train booking stalls, the taxi answers.
const NESTED_TRIP: &str = r#"{"rules": [
      {"match": "Request to split: Plan the trip", "reply": "[{\"goal\": \"Organise travel\", \"pattern\": \"supervisor\"}, {\"goal\": \"book the hotel\"}]"},
      {"match": "Request to split: Organise travel", "reply": "[{\"goal\": \"book the train\"}, {\"goal\": \"book the taxi\"}]"},
      {"match": "Question: book the hotel", "reply": "Thought: done.\nFinal Answer: hotel booked"},
      {"match": "Question: book the taxi", "reply": "Thought: done.\nFinal Answer: taxi booked"},
      {"match": "Question: book the train", "reply": "unused", "faults": ["stall"], "stall_ms": 120000},
      {"match": "Request to answer from the subagents: Organise travel", "and": ["taxi booked", "book the train: Error: no result within"], "reply": "Taxi booked, the train not."},
      {"match": "Request to answer from the subagents: Plan the trip", "and": ["hotel booked", "Taxi booked, the train not."], "reply": "Trip planned with a taxi."}
    ]}"#;

/// Checks that [`NESTED_TRIP`]'s nested synthesis was partial and the outer one had every result.
async fn nested_partial_outer_complete(dialog: &Dialog) {
    let session = session_of(&dialog.responses);
    let syntheses = |supervisor: &str, partial: bool| {
        format!(
            "{}SELECT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{ ?s a tg:Synthesis .
               FILTER(STRSTARTS(STR(?s), \"{supervisor}/synthesis/\"))
               FILTER({} EXISTS {{ ?s tg:partial true }}) }} }}",
            agent_core::vocab::SPARQL_PREFIXES,
            if partial { "" } else { "NOT" }
        )
    };
    let store = dialog.aggregator.store();
    let nested = format!("{session}-f1-s0");
    assert_eq!(count_reaching(&store, syntheses(&nested, true), 1).await, 1);
    assert_eq!(
        count_reaching(&store, syntheses(&session, false), 1).await,
        1
    );
    assert_eq!(
        count_reaching(&store, syntheses(&session, true), 0).await,
        0
    );
}

/// A nested fan-out stops waiting before the fan-out holding it does, so one stalled leaf costs
/// its own result, not its whole branch: timed from its own start, the nested fan-out outlived
/// the outer one (which started first), and the root answered without the nested supervisor's
/// partial answer. Timeout 12 s, grace 6 s: the nested fan-out is due 6 s after the outer one
/// started, and its partial synthesis reaches the outer fan-in before the outer's timeout.
#[tokio::test]
async fn a_nested_fan_out_stops_waiting_before_the_fan_out_holding_it() {
    let (dialog, _client) =
        nested_trip(("12", "6"), NESTED_TRIP, "n-3", "Trip planned with a taxi.").await;
    nested_partial_outer_complete(&dialog).await;
}

/// An aggregator away past both deadlines finds the nested fan-out and the one holding it due in
/// the same sweep: the nested one is answered, and the one holding it waits a grace for that
/// answer. Frozen from when the quick results are in until after the outer fan-out's deadline
/// (timeout 12 s, grace 6 s). Without holding it back, the sweep answered the outer fan-out first
/// (it started first) and the root answered without the branch.
#[tokio::test]
async fn a_fan_out_found_due_with_a_nested_one_waits_for_its_answer() {
    let trip = start_nested_trip(("12", "6"), NESTED_TRIP, "n-4").await;
    let completions = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{ ?c a tg:SubagentCompletion }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    // The hotel's and the taxi's; the outer fan-out started before either.
    assert_eq!(
        count_reaching(&trip.aggregator.store(), completions, 2).await,
        2
    );
    // Frozen before the nested fan-out is due (6 s after the outer one started), or the test
    // would show nothing.
    let syntheses = format!(
        "{}SELECT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{ ?s a tg:Synthesis }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count(&trip.aggregator.store(), syntheses).await, 0);
    trip.aggregator.freeze(true);
    tokio::time::sleep(Duration::from_secs(13)).await;
    trip.aggregator.freeze(false);
    let (dialog, _client) = trip_answered(trip, "n-4", "Trip planned with a taxi.").await;
    nested_partial_outer_complete(&dialog).await;
}

/// The hold of [`a_fan_out_found_due_with_a_nested_one_waits_for_its_answer`] outlives the
/// aggregator that made it. Killed (SIGKILL) while the nested supervisor writes its partial
/// answer (9 s), the aggregator comes back to a nested fan-out answered and nothing open below the
/// outer one, and still holds that one until the time the graph records (a grace, 12 s, from the
/// sweep that found them due). Held in memory alone, the restarted aggregator's first sweep
/// (6 s after it started) answered the outer fan-out before the nested answer came, and the root
/// answered without the branch.
#[tokio::test]
async fn a_fan_out_held_for_a_nested_answer_stays_held_after_the_aggregator_restarts() {
    let slow_nested_answer = NESTED_TRIP.replace(
        r#""reply": "Taxi booked, the train not.""#,
        r#""reply": "Taxi booked, the train not.", "delay_ms": 9000"#,
    );
    assert_ne!(slow_nested_answer, NESTED_TRIP);
    let mut trip = start_nested_trip(("24", "12"), &slow_nested_answer, "n-5").await;
    let completions = format!(
        "{}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{ ?c a tg:SubagentCompletion }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(
        count_reaching(&trip.aggregator.store(), completions, 2).await,
        2
    );
    let syntheses = format!(
        "{}SELECT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{ ?s a tg:Synthesis }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count(&trip.aggregator.store(), syntheses).await, 0);
    // Away past both deadlines (the nested one's at 12 s, the outer one's at 24 s).
    trip.aggregator.freeze(true);
    tokio::time::sleep(Duration::from_secs(25)).await;
    trip.aggregator.freeze(false);
    let nested_synthesis = "Request to answer from the subagents: Organise travel";
    let asked = tokio::time::Instant::now() + Duration::from_secs(30);
    while !trip
        .llm
        .calls()
        .iter()
        .any(|c| c.last_user.contains(nested_synthesis))
    {
        assert!(
            tokio::time::Instant::now() < asked,
            "the nested synthesis was never asked for"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    trip.aggregator.kill_and_restart();
    let (dialog, _client) = trip_answered(trip, "n-5", "Trip planned with a taxi.").await;
    nested_partial_outer_complete(&dialog).await;
}

/// A fan-out that times out is answered honestly: two subagents with the same goal keep two
/// results, the synthesis derives only from the completions it was given, says it is partial and
/// names the subagent it went without, and that subagent, told its supervisor stopped waiting,
/// stops at its next step instead of spending on; its late completion derives nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_fan_out_is_answered_partially_and_its_laggard_stops() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &["--fanout-timeout-secs", "3", "--config-token", "fan-token"],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Survey", "reply": "[{\"goal\": \"same question\"}, {\"goal\": \"same question\"}, {\"goal\": \"slow loop\"}]"},
      {"match": "Question: same question", "reply": "Thought: known.\nFinal Answer: SAME"},
      {"match": "Question: slow loop", "reply": "Thought: keep digging.\nAction: dig\nArgs: {}", "delay_ms": 1000},
      {"match": "Request to answer from the subagents: Survey", "and": ["- same question: SAME\n- same question: SAME", "slow loop: Error: no result within 3 s"], "reply": "Partial answer."}
    ]}"#,
    )
    .await;
    let limits = seed_with(
        "fan-in-honest",
        &[("agent-limits", r#"{"default": {"max_iterations": 12}}"#)],
    );
    let _orchestrator = Orchestrator::spawn(
        &broker,
        &llm,
        &limits,
        &[
            "--graph-store",
            &aggregator.endpoint,
            "--config-token",
            "fan-token",
        ],
    );
    let mut client = client(&broker).await;
    client
        .send("p-1", &supervised("Survey three ways."))
        .await
        .unwrap();
    let mut responses = collect_dialog(&mut client, "p-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "Partial answer.");
    // The laggard's own end comes after the synthesis.
    responses.extend(drain_for(&mut client, "p-1", Duration::from_secs(4)).await);
    let t = explained(&responses);
    let session = session_of(&responses);
    let id = session.trim_start_matches("urn:trustgraph:agent:");
    let cid = format!("{id}-f1");
    let synthesis = format!("{session}/synthesis/{cid}");
    let laggard = format!("urn:trustgraph:agent:{cid}-s2");
    assert_eq!(values(&t, &synthesis, tg::PARTIAL), ["true"]);
    assert_eq!(
        values(&t, &synthesis, tg::MISSING_SUBAGENT),
        std::slice::from_ref(&laggard)
    );
    let derived: Vec<String> = t
        .iter()
        .filter(|x| x.s.iri == synthesis && x.p.iri.ends_with("wasDerivedFrom"))
        .map(|x| x.o.iri.clone())
        .collect();
    assert!(derived.contains(&format!("urn:trustgraph:agent:{cid}-s0/completion")));
    assert!(derived.contains(&format!("urn:trustgraph:agent:{cid}-s1/completion")));
    assert!(
        !derived.iter().any(|d| d.starts_with(&laggard)),
        "{derived:?}"
    );
    // The laggard stopped soon after the timeout (it would loop to max_iterations otherwise), and
    // its completion says why.
    let turns = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Question: slow loop"))
        .count();
    assert!(turns <= 6, "the laggard took {turns} turns");
    let ended = values(&t, &format!("{laggard}/final"), tg::TERMINATION_REASON);
    assert_eq!(ended, ["error"], "{turns} turns");
    assert_eq!(closings(&responses), 1);
    // The closing counts what the laggard had spent by the time-out (its first call took 1 s of
    // the 3), not what it spent after: more than the rest of the run records, and no more than
    // the whole. Until 2026-12-05 the laggard's calls were in the graph and left out of the
    // closing.
    let closing = responses.iter().find(|r| r.end_of_dialog).unwrap();
    let total = closing.in_token.unwrap_or(0) + closing.out_token.unwrap_or(0);
    let store = aggregator.store();
    let laggards = format!("STRSTARTS(STR(?n), \"{laggard}/\")");
    let others = tokens_recorded(
        &store,
        &format!("STRSTARTS(STR(?n), \"{session}\") && !{laggards}"),
    )
    .await;
    let lagging = tokens_recorded(&store, &laggards).await;
    assert!(lagging > 0, "the laggard recorded no call");
    assert!(
        total > others && total <= others + lagging,
        "the closing counts {total} tokens; the graph: {others} outside the laggard, {lagging} in it"
    );
}

/// The tokens recorded on the nodes `filter` (on `?n`) keeps.
async fn tokens_recorded(store: &agent_graph::GraphStore, filter: &str) -> u64 {
    let sparql = format!(
        "{}SELECT (SUM(?v) AS ?total) WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?n ?p ?v . FILTER(?p IN (tg:inToken, tg:outToken) && {filter})
         }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    match store.query(sparql).await.unwrap() {
        agent_graph::QueryAnswer::Rows(rows) => rows
            .rows
            .first()
            .and_then(|row| row.first().cloned().flatten())
            .map_or(0, |term| match term {
                agent_graph::model::Term::Literal(l) => l.value().parse().unwrap(),
                other => panic!("not a number: {other}"),
            }),
        other => panic!("not rows: {other:?}"),
    }
}

/// Fan-in straight from the explainability topic: completions that arrive before their fan-out,
/// each delivered twice, give exactly one synthesis request, carrying every result, sent to the
/// client's id once the fan-out is known.
#[tokio::test]
async fn completions_before_their_fan_out_and_twice_give_one_synthesis() {
    use agent_core::provenance::{self, CallStats, SessionUris};
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let explain = Publisher::new(&bus, &topics.explainability).await.unwrap();
    let mut requests = read_from_start(&broker, &topics.request, "fan-in-reader").await;
    let publish = |node: String, triples: Vec<agent_schema::Triple>| {
        let explain = explain.clone();
        async move { publish_explained(&explain, node, triples).await }
    };
    let key = agent_bus::seal::SealKey::new(SEAL_KEY.as_bytes());
    let supervisor = SessionUris::new("sup");
    let cid = "sup-f1";
    // Two subagents with the same goal keep two results.
    let goals = ["one", "two", "one"];
    for (i, goal) in goals.iter().enumerate() {
        let sub = SessionUris::new(&format!("{cid}-s{i}"));
        let result = format!("R{i}");
        let node = sub.completion();
        let mut triples =
            provenance::completion(&sub, cid, "sup", goal, "answer", &result, (10, 1));
        let parts = agent_core::supervisor::completion_seal_parts(&node, cid, "answer", &result);
        triples.extend(provenance::sealed(&node, &key.seal(&parts)));
        publish(node.clone(), triples.clone()).await;
        publish(node, triples).await;
    }
    // A result slipped onto a real subagent's completion without its seal does not count.
    let second = SessionUris::new(&format!("{cid}-s1"));
    publish(
        second.completion(),
        provenance::completion(&second, cid, "sup", "two", "answer", "FORGED", (1, 1)),
    )
    .await;
    // A fan-out nobody sealed resumes nobody, even with all its completions there.
    let evil = SessionUris::new("evil");
    let evil_sessions = [("x".to_owned(), "evil-f1-s0".to_owned())];
    let evil_continuation = AgentRequest {
        question: "Q".into(),
        session_id: "evil".into(),
        pattern: "supervisor".into(),
        ..AgentRequest::default()
    };
    publish(
        evil.fanout("evil-f1"),
        provenance::fanout(
            &evil,
            1,
            "evil-f1",
            &evil.pattern_decision(),
            &evil_sessions,
            &String::from_utf8_lossy(&agent_schema::encode(&evil_continuation)),
            "victim",
            "2026-01-01T00:00:00Z",
            provenance::DialogSoFar::default(),
            &CallStats::default(),
        ),
    )
    .await;
    let evil_sub = SessionUris::new("evil-f1-s0");
    publish(
        evil_sub.completion(),
        provenance::completion(&evil_sub, "evil-f1", "evil", "x", "answer", "R", (1, 1)),
    )
    .await;
    // A completion that names the fan-out but comes from no session it started never counts.
    let intruder = SessionUris::new("intruder");
    publish(
        intruder.completion(),
        provenance::completion(&intruder, cid, "sup", "one", "answer", "FORGED", (1, 1)),
    )
    .await;
    // Nothing can be synthesised yet: the fan-out is unknown.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let continuation = AgentRequest {
        question: "Q".into(),
        session_id: "sup".into(),
        pattern: "supervisor".into(),
        ..AgentRequest::default()
    };
    let sessions: Vec<(String, String)> = goals
        .iter()
        .enumerate()
        .map(|(i, g)| ((*g).to_owned(), format!("{cid}-s{i}")))
        .collect();
    let continuation = String::from_utf8_lossy(&agent_schema::encode(&continuation)).into_owned();
    let mut fanout = provenance::fanout(
        &supervisor,
        1,
        cid,
        &supervisor.pattern_decision(),
        &sessions,
        &continuation,
        "client-7",
        "2026-01-01T00:00:00Z",
        provenance::DialogSoFar {
            in_token: 100,
            out_token: 20,
            started_ms: 1_700_000_000_000,
        },
        &CallStats::default(),
    );
    let node = supervisor.fanout(cid);
    let parts = agent_core::supervisor::fanout_seal_parts(&node, cid, &continuation, "client-7");
    fanout.extend(provenance::sealed(&node, &key.seal(&parts)));
    publish(supervisor.fanout(cid), fanout.clone()).await;
    publish(supervisor.fanout(cid), fanout).await;

    let mut syntheses = Vec::new();
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_secs(4), requests.next()).await
    {
        requests.ack(&message).await.unwrap();
        let id = message
            .metadata()
            .properties
            .iter()
            .find(|p| p.key == "id")
            .map(|p| p.value.clone());
        let property = |key: &str| {
            message
                .metadata()
                .properties
                .iter()
                .find(|p| p.key == key)
                .map(|p| p.value.clone())
        };
        // The supervisor's tokens plus each completion's, once.
        assert_eq!(property("agent-in-token").as_deref(), Some("130"));
        assert_eq!(property("agent-out-token").as_deref(), Some("23"));
        assert_eq!(
            property("agent-started-ms").as_deref(),
            Some("1700000000000")
        );
        let request: AgentRequest = serde_json::from_slice(&message.payload.data).unwrap();
        syntheses.push((id, request));
    }
    assert_eq!(syntheses.len(), 1, "{syntheses:#?}");
    let (id, request) = &syntheses[0];
    assert_eq!(id.as_deref(), Some("client-7"));
    let results = request
        .history
        .last()
        .unwrap()
        .subagent_results
        .clone()
        .unwrap();
    assert_eq!(
        results,
        [
            ("00. one".to_owned(), "R0".to_owned()),
            ("01. two".to_owned(), "R1".to_owned()),
            ("02. one".to_owned(), "R2".to_owned())
        ]
        .into()
    );
}

/// A fan-out the aggregator will never synthesise (no valid seal; sealed, but its continuation is
/// not a request) is marked so in the graph by the timeout sweep, which then stops looking at it:
/// it came back to both every round, for good, each time with an error in the log.
#[tokio::test]
async fn a_fan_out_that_can_never_be_synthesised_is_marked_once_not_swept_for_ever() {
    use agent_core::provenance::{self, CallStats, SessionUris};
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::logged_child(&broker, &["--fanout-timeout-secs", "1"]);
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let explain = Publisher::new(&bus, &topics.explainability).await.unwrap();
    let key = agent_bus::seal::SealKey::new(SEAL_KEY.as_bytes());
    let request = String::from_utf8_lossy(&agent_schema::encode(&AgentRequest {
        question: "Q".into(),
        session_id: "forged".into(),
        pattern: "supervisor".into(),
        ..AgentRequest::default()
    }))
    .into_owned();
    for (session, continuation, sealed) in [
        ("forged", request.as_str(), false),
        ("garbled", "{not a request", true),
    ] {
        let uris = SessionUris::new(session);
        let cid = format!("{session}-f1");
        let node = uris.fanout(&cid);
        let mut triples = provenance::fanout(
            &uris,
            1,
            &cid,
            &uris.pattern_decision(),
            &[("x".to_owned(), format!("{cid}-s0"))],
            continuation,
            "client-9",
            "2026-01-01T00:00:00Z",
            provenance::DialogSoFar::default(),
            &CallStats::default(),
        );
        if sealed {
            let parts =
                agent_core::supervisor::fanout_seal_parts(&node, &cid, continuation, "client-9");
            triples.extend(provenance::sealed(&node, &key.seal(&parts)));
        }
        publish_explained(&explain, node, triples).await;
    }
    let refused = format!(
        "{}SELECT ?why WHERE {{ GRAPH <urn:graph:retrieval> {{ ?f a tg:FanOut ; tg:fanInRefused ?why }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), refused, 2).await, 2);
    // Said as each came in and as the sweep marked it; six more rounds of the sweep (every half
    // second with this timeout) say nothing more.
    let said = [
        "a fan-out without a valid seal",
        "the fan-out's continuation is not a request",
    ];
    let counts = |log: &str| said.map(|s| log.matches(s).count());
    let before = counts(&aggregator.log());
    assert!(before.iter().all(|&n| (1..=2).contains(&n)), "{before:?}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = aggregator.log();
    assert_eq!(counts(&log), before, "{log}");
    let metrics = scrape(&aggregator.endpoint).await;
    assert_eq!(sample(&metrics, "agent_fanouts_open"), 0.0);
}

/// Publishes `triples` about `node` on the explainability topic, sealed as the orchestrator does,
/// and waits for the broker's receipt.
async fn publish_explained(explain: &Publisher, node: String, triples: Vec<agent_schema::Triple>) {
    let message = Triples {
        metadata: Metadata {
            id: node,
            root: String::new(),
            collection: "default".into(),
        },
        triples,
    };
    let message = agent_schema::encode(&message);
    explain
        .enqueue(message.clone(), &sealed_explain(&message))
        .await
        .unwrap()
        .wait()
        .await
        .unwrap();
}

/// A later step of subagent session `victim-f1-s0` that no orchestrator sent: its history is at
/// the iteration limit, so it would be concluded at once.
fn forged_subagent_step() -> AgentRequest {
    let step = agent_schema::AgentStep {
        thought: "Look it up.".into(),
        action: "llm".into(),
        arguments: [("question".to_owned(), "x".to_owned())].into(),
        observation: "FORGED RESULT".into(),
        ..Default::default()
    };
    AgentRequest {
        question: "Survey".into(),
        pattern: "react".into(),
        session_id: "victim-f1-s0".into(),
        parent_session_id: "victim".into(),
        correlation_id: "victim-f1".into(),
        subagent_goal: "x".into(),
        expected_siblings: 1,
        history: vec![step; 10],
        ..AgentRequest::default()
    }
}

/// With `--step-seals warn` (a rolling upgrade from a build that did not seal steps), such a step
/// is run as before: its subagent completes.
#[tokio::test]
async fn with_step_seals_warned_of_an_unsealed_subagent_step_still_runs() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(r#"{"rules": []}"#).await;
    let _orchestrator = Orchestrator::spawn_with_env(
        &broker,
        &llm,
        &seed_dir(),
        &[],
        &[("AGENT_STEP_SEALS", "warn")],
    );
    let client = client(&broker).await;
    client
        .send("forger", &forged_subagent_step())
        .await
        .unwrap();
    let completion = format!(
        "{}ASK {{ GRAPH <urn:graph:retrieval> {{ <urn:trustgraph:agent:victim-f1-s0/completion> ?p ?o }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert!(holds_within(&aggregator.store(), completion).await);
}

/// A later step of a subagent's dialog that the orchestrator did not seal (anyone who can publish
/// to the request topic can send one) is dead-lettered, and nothing is made of it: a history at
/// the iteration limit would otherwise be concluded at once, and its last observation sealed as the
/// subagent's result for its supervisor's fan-in.
#[tokio::test]
async fn a_subagent_step_the_orchestrator_did_not_seal_is_dead_lettered_and_makes_nothing() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(r#"{"rules": []}"#).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut dead_letters = read_from_start(&broker, DEAD_LETTER_TOPIC, "test-dlq").await;
    let mut client = client(&broker).await;
    let forged = forged_subagent_step();
    client.send("forger", &forged).await.unwrap();
    let message = tokio::time::timeout(Duration::from_secs(30), dead_letters.next())
        .await
        .expect("nothing was dead-lettered")
        .unwrap()
        .unwrap();
    let reason = message
        .metadata()
        .properties
        .iter()
        .find(|p| p.key == agent_bus::DEAD_LETTER_REASON)
        .map(|p| p.value.clone())
        .unwrap_or_default();
    assert!(reason.contains("without this service's seal"), "{reason}");
    // Nothing to the client, no LLM call, nothing of that session in the graph.
    let more = drain_for(&mut client, "forger", Duration::from_secs(3)).await;
    assert!(more.is_empty(), "{more:#?}");
    assert!(llm.calls().is_empty());
    let anything = "SELECT ?s WHERE { GRAPH ?g { ?s ?p ?o FILTER (STRSTARTS(STR(?s), \"urn:trustgraph:agent:victim\")) } } LIMIT 1";
    assert_eq!(count(&aggregator.store(), anything.to_owned()).await, 0);
}

/// Under `max_iterations: 1` a supervisor has no room for its subagents' results (they come back
/// as a second step), so it ends at once, saying so, and makes no call: before 2026-12-05 it
/// split the request, every subagent ran, and the request bringing their results was refused
/// ("more than max_iterations"), so the client got an error after all the spending.
#[tokio::test]
async fn a_supervisor_without_room_for_its_results_ends_before_any_subagent_runs() {
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let config = config_dir(
        "no-room",
        &[("agent-limits", r#"{"default": {"max_iterations": 1}}"#)],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
      {"match": "Question: price of", "reply": "Thought: known.\nFinal Answer: 1"},
      {"match": "Request to answer from the subagents: Compare", "reply": "Both cost 1."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("n-1", &supervised("Compare the prices of alpha and beta."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "n-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&responses), 1, "{responses:#?}");
    let last = responses.last().unwrap();
    assert!(
        last.error.is_none()
            && last.content.contains("could not start subagents")
            && last.content.contains("max_iterations"),
        "{responses:#?}"
    );
    assert!(llm.calls().is_empty(), "{:#?}", llm.calls());
}

/// The synthesis may send subagents out again under a new correlation id; the second round's
/// synthesis sees both rounds, and the new fan-out hangs off the synthesis that asked for it. An LLM
/// that always wants one more round is stopped by `max_iterations` with an answer naming what the
/// subagents found.
#[tokio::test]
async fn a_synthesis_fans_out_again_within_the_iteration_limit() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let config = config_dir(
        "refanout",
        &[("agent-limits", r#"{"default": {"max_iterations": 6}}"#)],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Investigate", "reply": "[{\"goal\": \"find the suspect\"}, {\"goal\": \"find the motive\"}]"},
      {"match": "Question: find the suspect", "reply": "Thought: seen.\nFinal Answer: the butler"},
      {"match": "Question: find the motive in the will", "reply": "Thought: read it.\nFinal Answer: an inheritance"},
      {"match": "Question: find the motive", "reply": "Thought: unclear.\nFinal Answer: unknown"},
      {"match": "Request to answer from the subagents: Investigate", "and": ["Round 2:", "the butler", "an inheritance"], "reply": "The butler, for an inheritance."},
      {"match": "Request to answer from the subagents: Investigate", "and": ["new goals for another round"], "reply": "{\"goals\": [{\"goal\": \"find the motive in the will\"}]}"},
      {"match": "Request to split: Dig", "reply": "[\"dig here\"]"},
      {"match": "Question: dig", "reply": "Thought: dug.\nFinal Answer: a layer of clay"},
      {"match": "Request to answer from the subagents: Dig", "reply": "{\"goals\": [\"dig deeper\"]}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    // One after the other: `collect_dialog` drops other dialogs' responses.
    client
        .send("r-1", &supervised("Investigate the theft."))
        .await
        .unwrap();
    let investigated = collect_dialog(&mut client, "r-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    client
        .send("r-2", &supervised("Dig for the treasure."))
        .await
        .unwrap();
    let dug = collect_dialog(&mut client, "r-2", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let answer = investigated.last().unwrap();
    assert!(answer.error.is_none(), "{investigated:#?}");
    assert_eq!(answer.content, "The butler, for an inheritance.");
    assert_eq!(closings(&investigated), 1);

    // Two rounds, then the limit: the second synthesis is not offered a third round, and the
    // answer says so and carries what both rounds found.
    let last = dug.last().unwrap();
    assert!(last.error.is_none(), "{dug:#?}");
    assert!(
        last.content.contains("could not run another round")
            && last
                .content
                .contains("Round 1:\n- dig here: a layer of clay")
            && last
                .content
                .contains("Round 2:\n- dig deeper: a layer of clay"),
        "{}",
        last.content
    );
    let digs: Vec<String> = llm
        .calls()
        .iter()
        .filter(|c| {
            c.last_user
                .contains("Request to answer from the subagents: Dig")
        })
        .map(|c| c.last_user.clone())
        .collect();
    assert_eq!(digs.len(), 2, "{digs:#?}");
    assert!(digs[0].contains("another round") && !digs[1].contains("another round"));
    let more = drain_for(&mut client, "r-2", Duration::from_secs(2)).await;
    assert_eq!(closings(&more), 0, "{more:#?}");

    // The second fan-out derives from the first synthesis, and the answer from the second.
    let session = session_of(&investigated);
    let store = aggregator.store();
    let chain = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT ?f2 WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?final a tg:Conclusion ; prov:wasDerivedFrom ?s2 .
           ?s2 a tg:Synthesis ; prov:wasDerivedFrom ?f2 . ?f2 a tg:FanOut ; prov:wasDerivedFrom ?s1 .
           ?s1 a tg:Synthesis ; prov:wasDerivedFrom ?f1 . ?f1 a tg:FanOut ;
               prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, chain, 1).await, 1);
}

/// Streamed, a supervisor's synthesis reaches the client as it is written, in several chunks,
/// while a reply that asks for another round (JSON goals) is held back and never shown as an
/// answer.
#[tokio::test]
async fn a_streamed_synthesis_streams_and_a_request_for_another_round_does_not() {
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Investigate", "reply": "[{\"goal\": \"find the suspect\"}, {\"goal\": \"find the motive\"}]"},
      {"match": "Question: find the suspect", "reply": "Thought: seen.\nFinal Answer: the butler"},
      {"match": "Question: find the motive in the will", "reply": "Thought: read it.\nFinal Answer: an inheritance"},
      {"match": "Question: find the motive", "reply": "Thought: unclear.\nFinal Answer: unknown"},
      {"match": "Request to answer from the subagents: Investigate", "and": ["Round 2:"], "reply": "The butler, for an inheritance, as the will shows."},
      {"match": "Request to answer from the subagents: Investigate", "reply": "{\"goals\": [{\"goal\": \"find the motive in the will\"}]}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let streamed = AgentRequest {
        streaming: true,
        ..supervised("Investigate the theft.")
    };
    client.send("st-1", &streamed).await.unwrap();
    let responses = collect_dialog(&mut client, "st-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let chunks: Vec<&str> = responses
        .iter()
        .filter(|r| r.message_type == "answer" && !r.message_id.contains("-s"))
        .map(|r| r.content.as_str())
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        chunks.concat(),
        "The butler, for an inheritance, as the will shows.",
        "{responses:#?}"
    );
    assert!(
        chunks.len() > 1,
        "written in pieces, sent in pieces: {chunks:?}"
    );
    assert!(
        !chunks.iter().any(|c| c.contains("goals")),
        "the request for another round was not shown as an answer"
    );
    assert_eq!(closings(&responses), 1);
}

/// Streamed, a supervisor's subagents stream too: each one's thought reaches the client in pieces
/// under the subagent's own message id (so a client can tell the branches apart), while a
/// subagent's answer is never an `answer` message (a client would join it to its own answer): it
/// arrives whole as the observation of its completion, and only the synthesis is the answer.
#[tokio::test]
async fn streamed_subagents_stream_their_thoughts_under_their_own_ids() {
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Survey", "reply": "[{\"goal\": \"count the owls\"}, {\"goal\": \"count the larks\"}]"},
      {"match": "Question: count the owls", "reply": "Thought: the owls roost in the old barn, so I count them at dusk.\nFinal Answer: eleven owls"},
      {"match": "Question: count the larks", "reply": "Thought: the larks sing over the meadow at dawn, so I count them then.\nFinal Answer: forty larks"},
      {"match": "Request to answer from the subagents: Survey", "and": ["eleven owls", "forty larks"], "reply": "Eleven owls and forty larks."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let streamed = AgentRequest {
        streaming: true,
        ..supervised("Survey the birds.")
    };
    client.send("sb-1", &streamed).await.unwrap();
    let responses = collect_dialog(&mut client, "sb-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&responses), 1, "{responses:#?}");
    let session = session_of(&responses);
    for (index, thought, answer) in [
        (
            0,
            "the owls roost in the old barn, so I count them at dusk.",
            "eleven owls",
        ),
        (
            1,
            "the larks sing over the meadow at dawn, so I count them then.",
            "forty larks",
        ),
    ] {
        let branch = format!("{session}-f1-s{index}");
        let pieces: Vec<&AgentResponse> = responses
            .iter()
            .filter(|r| {
                r.message_type == "thought" && r.message_id == format!("{branch}/i1/thought")
            })
            .collect();
        assert!(
            pieces.len() > 1,
            "subagent {index}'s thought came whole: {responses:#?}"
        );
        assert_eq!(
            pieces
                .iter()
                .map(|r| r.content.as_str())
                .collect::<String>(),
            thought
        );
        assert!(pieces.last().unwrap().end_of_message);
        assert!(pieces[..pieces.len() - 1].iter().all(|r| !r.end_of_message));
        // The subagent's answer: one whole observation under its own conclusion's id.
        let given: Vec<&str> = responses
            .iter()
            .filter(|r| r.message_id.starts_with(&format!("{branch}/")) && r.content == answer)
            .map(|r| r.message_type.as_str())
            .collect();
        assert_eq!(given, ["observation"], "{responses:#?}");
    }
    // Every answer chunk is the supervisor's own.
    let answers: Vec<&AgentResponse> = responses
        .iter()
        .filter(|r| r.message_type == "answer")
        .collect();
    assert!(
        answers.iter().all(|r| !r.message_id.contains("-f1-s")),
        "a subagent sent an answer: {answers:#?}"
    );
    assert_eq!(
        answers
            .iter()
            .map(|r| r.content.as_str())
            .collect::<String>(),
        "Eleven owls and forty larks."
    );
}

/// A subagent may itself be a supervisor, one level down under the default `max_fanout_depth` of
/// 2: the nested supervisor fans out, its synthesis becomes its completion, and its own subagents
/// are not offered (nor given) the supervisor pattern. The whole run is one DAG from the root.
#[tokio::test]
async fn a_nested_fan_out_stops_at_the_depth_limit() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Plan the trip", "reply": "[{\"goal\": \"Organise travel\", \"pattern\": \"supervisor\"}, {\"goal\": \"book the hotel\"}]"},
      {"match": "Request to split: Organise travel", "reply": "[{\"goal\": \"book the train\"}, {\"goal\": \"Organise tickets\", \"pattern\": \"supervisor\"}]"},
      {"match": "Request to split: Organise tickets", "reply": "[\"never\"]"},
      {"match": "Question: book the hotel", "reply": "Thought: done.\nFinal Answer: hotel booked"},
      {"match": "Question: book the train", "reply": "Thought: done.\nFinal Answer: train booked"},
      {"match": "Question: Organise tickets", "reply": "Thought: done.\nFinal Answer: tickets printed"},
      {"match": "Request to answer from the subagents: Organise travel", "and": ["train booked", "tickets printed"], "reply": "Travel sorted: train and tickets."},
      {"match": "Request to answer from the subagents: Plan the trip", "and": ["Travel sorted: train and tickets.", "hotel booked"], "reply": "Trip planned."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("n-1", &supervised("Plan the trip to Rome."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "n-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "Trip planned.");
    assert_eq!(closings(&responses), 1);
    let calls = llm.calls();
    let split = |what: &str| {
        calls
            .iter()
            .filter(|c| c.last_user.contains(&format!("Request to split: {what}")))
            .map(|c| c.last_user.clone())
            .collect::<Vec<_>>()
    };
    let (root, nested) = (split("Plan the trip"), split("Organise travel"));
    assert_eq!((root.len(), nested.len()), (1, 1));
    assert!(root[0].contains("pattern supervisor"), "{}", root[0]);
    assert!(!nested[0].contains("pattern supervisor"), "{}", nested[0]);
    assert!(
        split("Organise tickets").is_empty(),
        "the depth limit was passed"
    );

    let session = session_of(&responses);
    let store = aggregator.store();
    let fanouts = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT DISTINCT ?f WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?f a tg:FanOut ; prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, fanouts, 2).await, 2);
    let syntheses = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT DISTINCT ?s WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?s a tg:Synthesis ; prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, syntheses, 2).await, 2);
    let concluded = format!("SELECT ?a WHERE {{ GRAPH ?g {{ <{session}/final> ?p ?a }} }}");
    assert!(count_reaching(&store, concluded, 1).await > 0);

    // `agentctl explain` draws the run: each fan-out with its subagents' own runs inside, nested
    // one level, and the supervisor's own conclusion.
    let explain = |format: &str| {
        let out = std::process::Command::new(binary("agentctl"))
            .args([
                "explain",
                &session,
                "--store",
                &aggregator.endpoint,
                "--format",
                format,
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let tree = explain("tree");
    for expected in [
        "subagent 0: Organise travel -> answer: Travel sorted: train and tickets.",
        "subagent 1: book the hotel -> answer: hotel booked",
        "│  │  ├─ fan-out ",
        "subagent 0: book the train -> answer: train booked",
        "subagent 1: Organise tickets -> answer: tickets printed",
        "└─ conclusion (answer",
        "   └─ answer:  Trip planned.",
    ] {
        assert!(tree.contains(expected), "{expected:?} not in:\n{tree}");
    }
    let mermaid = explain("mermaid");
    assert!(
        mermaid.matches("Fan-out").count() == 2 && mermaid.matches("[\"Synthesis\"]").count() == 2,
        "{mermaid}"
    );
    assert!(
        mermaid.contains("Completion (answer): tickets printed"),
        "{mermaid}"
    );

    // The nested supervisor's resume, which the aggregator sends, carries what the run spent
    // outside its dialog (the root's split): with no shared store to count the run from, its
    // budget counts from that. Until 2026-12-05 it carried none, and from its fan-in on the
    // nested supervisor counted only its own tokens against the run's max_tokens.
    let mut requests = read_from_start(
        &broker,
        "persistent://tg/request/agent:default:default",
        "nested-run-tokens",
    )
    .await;
    let mut resumes = Vec::new();
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_secs(2), requests.next()).await
    {
        let request: AgentRequest = serde_json::from_slice(&message.payload.data).unwrap();
        let resumed = request.history.last().is_some_and(|step| {
            step.step_type == agent_schema::StepType::Synthesise.as_str()
                && step.subagent_results.is_some()
        });
        if resumed && !request.parent_session_id.is_empty() {
            let properties = &message.payload.metadata.properties;
            let run_tokens = properties
                .iter()
                .find(|kv| kv.key == agent_schema::RUN_TOKENS_PROPERTY)
                .map(|kv| kv.value.parse::<u64>().unwrap());
            resumes.push(run_tokens);
        }
    }
    assert_eq!(resumes.len(), 1, "{resumes:?}");
    assert!(resumes[0].is_some_and(|t| t > 0), "{resumes:?}");
}

/// Two orchestrators and two aggregators share the subscriptions (the aggregators one graph store,
/// served by a third that consumes nothing of this dialog). One aggregator is SIGKILLed once three
/// of the four completions are stored: the survivor (and the broker's redelivery of what the dead
/// one held) completes the fan-in, with exactly one synthesis and one final answer.
#[tokio::test]
async fn two_replicas_each_and_a_killed_aggregator_give_one_synthesis() {
    let broker = Broker::start().unwrap();
    let token = "replica-test-token";
    let store_host = Aggregator::spawn_with(
        &broker,
        &[
            "--config-token",
            token,
            "--explain-topic",
            "persistent://tg/flow/store-host-only",
            "--subscription",
            "store-host-only",
        ],
    );
    let mut first = Aggregator::replica_on(&broker, &store_host, token);
    let mut second = Aggregator::replica_on(&broker, &store_host, token);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Tally", "reply": "[\"count apples\", \"count pears\", \"count plums\", \"count figs\"]"},
      {"match": "Question: count apples", "reply": "Thought: counted.\nFinal Answer: 3 apples", "delay_ms": 200},
      {"match": "Question: count pears", "reply": "Thought: counted.\nFinal Answer: 5 pears", "delay_ms": 200},
      {"match": "Question: count plums", "reply": "Thought: counted.\nFinal Answer: 7 plums", "delay_ms": 200},
      {"match": "Question: count figs", "reply": "Thought: counted.\nFinal Answer: 11 figs", "delay_ms": 4000},
      {"match": "Request to answer from the subagents: Tally", "and": ["3 apples", "5 pears", "7 plums", "11 figs"], "reply": "26 fruits."}
    ]}"#,
    )
    .await;
    let _one = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let _two = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("k-1", &supervised("Tally the fruit."))
        .await
        .unwrap();

    let store = store_host.store();
    let completions = "PREFIX tg: <https://trustgraph.ai/ns/>
        SELECT DISTINCT ?c WHERE { GRAPH ?g { ?c a tg:SubagentCompletion } }";
    let mut stored = 0;
    for _ in 0..300 {
        stored = count(&store, completions.to_owned()).await;
        if stored >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stored, 3, "the slow subagent finished too early to test");
    first.kill();

    let responses = collect_dialog(&mut client, "k-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "26 fruits.");
    let more = drain_for(&mut client, "k-1", Duration::from_secs(3)).await;
    assert_eq!(closings(&responses) + closings(&more), 1, "{more:#?}");
    let syntheses = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Request to answer from the subagents"))
        .count();
    assert_eq!(syntheses, 1);
    assert!(llm.max_concurrent() >= 2, "subagents ran one after another");
    assert!(second.is_running());
    assert_eq!(count_reaching(&store, completions.to_owned(), 4).await, 4);
    let marked = "PREFIX tg: <https://trustgraph.ai/ns/>
        SELECT ?f WHERE { GRAPH ?g { ?f a tg:FanOut ; tg:synthesisRequested ?done } }";
    assert_eq!(count_reaching(&store, marked.to_owned(), 1).await, 1);
}

const CHAIN: &str = r#"{"rules": [
  {"match": "Request to split: Chain", "reply": "[{\"id\": \"a\", \"goal\": \"find alpha\"}, {\"id\": \"b\", \"goal\": \"double alpha\", \"needs\": [\"a\"]}, {\"id\": \"c\", \"goal\": \"halve alpha\", \"needs\": [\"a\"]}, {\"id\": \"d\", \"goal\": \"add the double and the half\", \"needs\": [\"b\", \"c\"]}]"},
  {"match": "Question: find alpha", "reply": "Thought: known.\nFinal Answer: alpha is 8", "delay_ms": 200},
  {"match": "Question: double alpha", "and": ["- find alpha: alpha is 8"], "reply": "Thought: from alpha.\nFinal Answer: the double is 16", "delay_ms": 1000},
  {"match": "Question: halve alpha", "and": ["- find alpha: alpha is 8"], "reply": "Thought: from alpha.\nFinal Answer: the half is 4", "delay_ms": 1000},
  {"match": "Question: add the double and the half", "and": ["- double alpha: the double is 16", "- halve alpha: the half is 4"], "reply": "Thought: both known.\nFinal Answer: the sum is 20"},
  {"match": "Request to answer from the subagents: Chain", "and": ["alpha is 8", "the double is 16", "the half is 4", "the sum is 20"], "reply": "Alpha 8, double 16, half 4, sum 20."}
]}"#;

/// Subagents that need each other's results (A -> B, C -> D): B and C start once A has completed,
/// with A's result, and run at the same time; D starts once both have, with both results; the
/// supervisor synthesises once from all four. The graph says who needed whom and what each waiting
/// subagent started after.
#[tokio::test]
async fn subagents_start_when_the_results_they_need_are_in() {
    let dialog = answered(
        CHAIN,
        "chain-1",
        supervised("Chain the four steps."),
        "Alpha 8, double 16, half 4, sum 20.",
    )
    .await;
    let Dialog {
        aggregator,
        llm,
        responses,
        ..
    } = dialog;
    // Each subagent's LLM call matched its rule: B and C were given A's result, D both of theirs
    // (a call without them would match no rule, and its subagent would fail).
    let calls = llm.calls();
    for rule in 1..=4 {
        assert_eq!(
            calls.iter().filter(|c| c.rule == Some(rule)).count(),
            1,
            "rule {rule}: {calls:#?}"
        );
    }
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    // B and C (a second each) overlapped; nothing else could.
    assert_eq!(llm.max_concurrent(), 2, "B and C did not run side by side");
    // The fan-out's listing says who waits for whom.
    let listing = responses
        .iter()
        .find(|r| r.message_type == "observation" && r.message_id.contains("/fanout/"))
        .unwrap();
    assert!(
        listing
            .content
            .contains("3. add the double and the half (react), after 1, 2"),
        "{}",
        listing.content
    );

    let session = session_of(&responses);
    let store = aggregator.store();
    let needs = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT ?waiting ?needed WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?f a tg:FanOut ; prov:wasDerivedFrom+ <{session}> ; tg:subagentSession ?waiting, ?needed .
           ?waiting tg:needs ?needed }} }}"
    );
    assert_eq!(count(&store, needs).await, 4);
    // Each waiting subagent started after the completions of exactly those it needed.
    let started = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/>
         SELECT ?waiting ?after WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?waiting tg:needs ?needed ; tg:startedAfter ?after ; tg:startRequested true .
           ?after a tg:SubagentCompletion .
           FILTER (STR(?after) = CONCAT(STR(?needed), \"/completion\"))
           FILTER (STRSTARTS(STR(?waiting), \"{session}\")) }} }}"
    );
    assert_eq!(count(&store, started).await, 4);
    // Every subagent's run hangs off the fan-out, and the synthesis derives from all four.
    let derived = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT DISTINCT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?s a tg:Synthesis ; prov:wasDerivedFrom ?c . ?c a tg:SubagentCompletion .
           ?s prov:wasDerivedFrom ?f . ?f a tg:FanOut ; prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, derived, 4).await, 4);
    let subagent_roots = format!(
        "PREFIX tg: <https://trustgraph.ai/ns/> PREFIX prov: <http://www.w3.org/ns/prov#>
         SELECT DISTINCT ?q WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?q a tg:AgentQuestion ; prov:wasDerivedFrom ?f . ?f a tg:FanOut ;
              prov:wasDerivedFrom+ <{session}> }} }}"
    );
    assert_eq!(count_reaching(&store, subagent_roots, 4).await, 4);
    // Every node of the dialog reaches its session.
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
    // The explain tree says who waited for whom.
    let tree = explain_tree(&store, &session).await;
    assert!(
        tree.contains("subagent 3: add the double and the half (after 1, 2) -> answer"),
        "{tree}"
    );
}

const RECOVERY: &str = r#"{"rules": [
  {"match": "Request to split: Measure", "reply": "[{\"goal\": \"measure alpha\"}, {\"goal\": \"measure beta\"}]"},
  {"match": "Result to evaluate: alpha is 1 metre", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"it has its unit\"}"},
  {"match": "Result to evaluate: alpha is 1", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"no unit given\", \"lesson\": \"state the unit\"}"},
  {"match": "Result to evaluate: beta is 2 metres", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"fine\"}"},
  {"match": "Question: measure alpha", "and": ["Lesson: state the unit"], "reply": "Thought: with its unit.\nFinal Answer: alpha is 1 metre"},
  {"match": "Question: measure alpha", "reply": "Thought: quick.\nFinal Answer: alpha is 1"},
  {"match": "Question: measure beta", "reply": "Thought: known.\nFinal Answer: beta is 2 metres"},
  {"match": "Request to answer from the subagents: Measure", "and": ["alpha is 1 metre", "beta is 2 metres"], "reply": "Alpha is 1 m and beta 2 m."}
]}"#;

/// With the step critic on (risk assessments), a supervisor judges each subagent's result before
/// it synthesises: the one the critic rejects goes out again in a recovery round, told the lesson,
/// the one it accepts does not run again, and the synthesis sees both rounds. Each verdict is a
/// node in the graph, and the recovery round's fan-out derives from them.
#[tokio::test]
async fn a_rejected_subagent_result_is_sent_out_again_with_the_lesson() {
    let dialog = answered(
        RECOVERY,
        "recover-1",
        critiqued("Measure both."),
        "Alpha is 1 m and beta 2 m.",
    )
    .await;
    let Dialog {
        aggregator,
        llm,
        responses,
        ..
    } = dialog;
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    let ran = |rule: usize| calls.iter().filter(|c| c.rule == Some(rule)).count();
    // Alpha ran twice (the second time with the lesson), beta once; three verdicts in all.
    assert_eq!((ran(4), ran(5), ran(6)), (1, 1, 1), "{calls:#?}");
    assert_eq!((ran(1), ran(2), ran(3)), (1, 1, 1), "{calls:#?}");
    assert!(
        responses.iter().any(|r| r.message_type == "thought"
            && r.content
                .contains("Subagent 0 (measure alpha): EXECUTION_ERROR — no unit given")),
        "{responses:#?}"
    );

    let session = session_of(&responses);
    let store = aggregator.store();
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let verdicts = format!(
        "{prefixes}SELECT ?status WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?e a tg:Evaluation ; tg:evaluationStatus ?status ; prov:wasDerivedFrom ?c .
           ?c a tg:SubagentCompletion .
           FILTER (STRSTARTS(STR(?e), \"{session}/fanout/\")) }} }}"
    );
    assert_eq!(count_reaching(&store, verdicts, 3).await, 3);
    let recovery = format!(
        "{prefixes}ASK {{ GRAPH <urn:graph:retrieval> {{
           ?first a tg:FanOut ; prov:wasDerivedFrom+ <{session}> .
           ?e a tg:Evaluation ; tg:evaluationStatus \"EXECUTION_ERROR\" ; tg:lesson \"state the unit\" .
           ?s a tg:Synthesis ; prov:wasDerivedFrom ?first, ?e .
           ?second a tg:FanOut ; prov:wasDerivedFrom ?s ; tg:expectedSiblings 1 .
           <{session}/final> prov:wasDerivedFrom+ ?second }} }}"
    );
    assert!(
        holds_within(&store, recovery).await,
        "the recovery round is not in the graph as expected: {responses:#?}"
    );
    let tree = explain_tree(&store, &session).await;
    assert!(
        tree.contains("critic: EXECUTION_ERROR: state the unit"),
        "{tree}"
    );
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
    // Every LLM call is counted once: the graph's tokens (each call on its own node, the critic's
    // on its verdicts) add up to the closing's. Until 2026-12-04 the critic's calls before the
    // synthesis were left out of the closing, and those before the recovery round were recorded
    // twice (on the verdicts and on the round's fan-out).
    let closing = responses.last().unwrap();
    let total = closing.in_token.unwrap_or(0) + closing.out_token.unwrap_or(0);
    assert_graph_tokens(&store, &session, total).await;
}

/// A synthesis whose LLM call fails after the step critic judged the results ends the dialog with
/// an error that counts the critic's calls, as their verdict nodes do. Until 2026-12-05 the
/// closing (and a nested supervisor's completion, and the run's budget) had only the tokens from
/// before the step: the graph counted more than the closing.
#[tokio::test]
async fn a_synthesis_that_fails_after_the_critic_judged_counts_the_critics_calls() {
    // No rule for the synthesis: its call is refused (400), which is no outage to wait out.
    const SCRIPT: &str = r#"{"rules": [
  {"match": "Request to split: Measure", "reply": "[{\"goal\": \"measure alpha\"}, {\"goal\": \"measure beta\"}]"},
  {"match": "Result to evaluate: alpha is 1 metre", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"it has its unit\"}"},
  {"match": "Result to evaluate: beta is 2 metres", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"fine\"}"},
  {"match": "Question: measure alpha", "reply": "Thought: known.\nFinal Answer: alpha is 1 metre"},
  {"match": "Question: measure beta", "reply": "Thought: known.\nFinal Answer: beta is 2 metres"}
]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(SCRIPT).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("critic-then-fail", &critiqued("Measure both."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "critic-then-fail", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&responses), 1, "{responses:#?}");
    let closing = responses.last().unwrap();
    assert!(closing.error.is_some(), "{responses:#?}");
    let verdicts = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Result to evaluate"))
        .count();
    assert_eq!(verdicts, 2);
    let total = closing.in_token.unwrap_or(0) + closing.out_token.unwrap_or(0);
    assert_graph_tokens(&aggregator.store(), &session_of(&responses), total).await;
}

/// A recovery round's verdicts are steps of the dialog too: with `max_iterations` 5, a synthesis
/// at iteration 3 whose critic rejects both results has no room for the two verdicts, the round's
/// fan-out, its resume and the answering synthesis, so it answers from the results it has. Until
/// 2026-12-02 only the fan-out, resume and synthesis were counted: the round went out, and its
/// resume (six steps) was refused, so the client got an error and the subagents' work was lost.
#[tokio::test]
async fn a_recovery_round_that_would_outgrow_the_iteration_limit_is_not_started() {
    const SCRIPT: &str = r#"{"rules": [
  {"match": "Request to split: Measure", "reply": "[{\"goal\": \"measure alpha\"}, {\"goal\": \"measure beta\"}]"},
  {"match": "Result to evaluate: alpha is 1", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"no unit given\", \"lesson\": \"state the unit\"}"},
  {"match": "Result to evaluate: beta is 2", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"no unit given\", \"lesson\": \"state the unit\"}"},
  {"match": "Question: measure alpha", "reply": "Thought: quick.\nFinal Answer: alpha is 1"},
  {"match": "Question: measure beta", "reply": "Thought: quick.\nFinal Answer: beta is 2"},
  {"match": "Request to answer from the subagents: Measure", "and": ["alpha is 1", "beta is 2"], "reply": "Alpha is 1 and beta 2, units unknown."}
]}"#;
    let config = seed_with(
        "recovery-room",
        &[(
            "agent-limits",
            r#"{"default": {"max_iterations": 5, "max_retries": 5}}"#,
        )],
    );
    let dialog = answered_under(
        &config,
        SCRIPT,
        "recover-room",
        critiqued("Measure both."),
        "Alpha is 1 and beta 2, units unknown.",
    )
    .await;
    let calls = dialog.llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    // Each subagent ran once: no recovery round went out.
    let ran = |rule: usize| calls.iter().filter(|c| c.rule == Some(rule)).count();
    assert_eq!((ran(3), ran(4), ran(5)), (1, 1, 1), "{calls:#?}");
}

/// A subagent's long answer does not travel in the supervisor's messages: the aggregator keeps it
/// as a document and the synthesis request carries an excerpt and its reference, while the
/// synthesis prompt reads it whole.
#[tokio::test]
async fn a_long_subagent_result_travels_as_a_reference_and_is_read_whole() {
    long_result_by_reference(Documents::Graph).await;
}

/// The same with documents kept in TrustGraph's librarian (orchestrator and aggregator run with
/// `DOCUMENT_STORE=librarian`): the long result is kept there, read back whole for the synthesis,
/// and the graph holds it only as excerpts.
#[tokio::test]
async fn a_long_subagent_result_kept_in_the_librarian_is_read_whole() {
    long_result_by_reference(Documents::Librarian).await;
}

/// The aggregator keeps documents in a librarian that does not answer (none runs; the
/// orchestrators keep theirs in the graph, so nothing else waits for it): the fan-in keeps the
/// long result in the graph instead, under the same name, so the synthesis request still carries
/// a reference, and the synthesis reads it whole. (Before, the request carried it whole.)
#[tokio::test]
async fn a_long_subagent_result_the_librarian_does_not_keep_goes_to_the_graph() {
    long_result_by_reference(Documents::SilentLibrarian).await;
}

/// Where a test's documents are kept.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Documents {
    Graph,
    Librarian,
    /// The aggregator's in a librarian that is not there, the orchestrators' in the graph.
    SilentLibrarian,
}

async fn long_result_by_reference(documents: Documents) {
    let in_librarian = documents != Documents::Graph;
    let long = format!(
        "alpha in detail: {} END-OF-ALPHA",
        "lorem ipsum ".repeat(1000)
    );
    let script = format!(
        r#"{{"rules": [
      {{"match": "Request to split: Long", "reply": "[{{\"goal\": \"describe alpha\"}}, {{\"goal\": \"describe beta\"}}]"}},
      {{"match": "Question: describe alpha", "reply": "Thought: at length.\nFinal Answer: {long}"}},
      {{"match": "Question: describe beta", "reply": "Thought: briefly.\nFinal Answer: beta is short"}},
      {{"match": "Request to answer from the subagents: Long", "and": ["END-OF-ALPHA", "beta is short"], "reply": "Alpha is long, beta short."}}
    ]}}"#
    );
    let broker = Broker::start().unwrap();
    let (_config, librarian) = if documents == Documents::Librarian {
        let config = ConfigSvc::spawn(&broker, Some(&seed_dir()));
        let librarian = agent_e2e::librarian::LibrarianService::start(&broker).await;
        (Some(config), Some(librarian))
    } else {
        (None, None)
    };
    let mut flags = vec!["--config-token", "long-token"];
    let mut env = Vec::new();
    if in_librarian {
        flags.extend(["--document-store", "librarian"]);
    }
    if documents == Documents::Librarian {
        env.push(("DOCUMENT_STORE", "librarian"));
    }
    let aggregator = Aggregator::spawn_with(&broker, &flags);
    let llm = scripted_llm(&script).await;
    let mut requests = read_from_start(
        &broker,
        "persistent://tg/request/agent:default:default",
        "long-results-reader",
    )
    .await;
    // With the shared store, as the supervisor must be to read a reference back.
    let _orchestrator =
        Orchestrator::spawn_journaled(&broker, &llm, &aggregator, "long-token", &env);
    let mut client = client(&broker).await;
    client
        .send("long-1", &supervised("Long and short answers."))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "long-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    // The synthesis prompt saw the whole answer (its rule needs the end of it).
    assert_eq!(last.content, "Alpha is long, beta short.");
    // The request that resumed the supervisor carried an excerpt and a reference, not the text.
    let mut resumed = None;
    while let Some(request) = next_request(&mut requests).await {
        if request.history.iter().any(|s| s.subagent_results.is_some()) {
            resumed = Some(request);
            break;
        }
    }
    let resumed = resumed.expect("the supervisor's synthesis request");
    let bytes = agent_schema::encode(&resumed).len();
    assert!(bytes < long.len() / 2, "{bytes} bytes");
    let results = resumed
        .history
        .iter()
        .find_map(|s| s.subagent_results.clone())
        .unwrap();
    let alpha = results
        .values()
        .find(|r| r.starts_with("alpha in detail"))
        .unwrap();
    let (uri, _) = agent_core::documents::reference(alpha).expect("a reference");
    assert!(results.values().any(|r| r == "beta is short"));
    if let Some(librarian) = &librarian {
        let kept = librarian.client.read(uri).await.unwrap();
        assert_eq!(
            kept.as_deref(),
            Some(long.as_str()),
            "{uri} in the librarian"
        );
        // The graph's texts are excerpts (the recorded LLM answers, the replay tape of forks, stay
        // whole: docs/long-dialogs.md).
        let whole_in_graph = count(
            &aggregator.store(),
            format!(
                "SELECT ?d WHERE {{ GRAPH ?g {{ ?d {} ?t FILTER(CONTAINS(?t, \"END-OF-ALPHA\")) }} }}",
                tg::CONTENT
            ),
        )
        .await;
        assert_eq!(whole_in_graph, 0, "the whole result in the graph");
    }
    if documents == Documents::SilentLibrarian {
        let kept = count(
            &aggregator.store(),
            format!(
                "SELECT ?t WHERE {{ GRAPH <{}> {{ <{uri}> {} ?t FILTER(CONTAINS(?t, \"END-OF-ALPHA\")) }} }}",
                agent_core::vocab::DOCUMENTS_GRAPH,
                tg::CONTENT
            ),
        )
        .await;
        assert_eq!(kept, 1, "{uri} in the graph's documents");
    }
}

/// The next request on `requests`, if one comes within two seconds.
async fn next_request(
    requests: &mut pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor>,
) -> Option<AgentRequest> {
    let message = tokio::time::timeout(Duration::from_secs(2), requests.next())
        .await
        .ok()??
        .ok()?;
    requests.ack(&message).await.ok()?;
    serde_json::from_slice(&message.payload.data).ok()
}

const CULPRIT: &str = r#"{"rules": [
  {"match": "Request to split: Units", "reply": "[{\"id\": \"a\", \"goal\": \"find alpha\"}, {\"id\": \"b\", \"goal\": \"double alpha\", \"needs\": [\"a\"]}]"},
  {"match": "Result to evaluate: alpha is 8 metres", "reply": "{\"status\": \"SUCCESS\"}"},
  {"match": "Result to evaluate: alpha is 8", "reply": "{\"status\": \"SUCCESS\"}"},
  {"match": "Result to evaluate: the double is 16 metres", "reply": "{\"status\": \"SUCCESS\"}"},
  {"match": "Result to evaluate: the double is 16", "reply": "{\"status\": \"INPUT_DATA_ERROR\", \"evaluation\": \"alpha came without its unit\", \"lesson\": \"give alpha's unit\", \"culprits\": [0]}"},
  {"match": "Question: find alpha", "and": ["Lesson: give alpha's unit"], "reply": "Thought: with its unit.\nFinal Answer: alpha is 8 metres"},
  {"match": "Question: find alpha", "reply": "Thought: quick.\nFinal Answer: alpha is 8"},
  {"match": "Question: double alpha", "and": ["- find alpha: alpha is 8 metres"], "reply": "Thought: doubled.\nFinal Answer: the double is 16 metres"},
  {"match": "Question: double alpha", "and": ["- find alpha: alpha is 8"], "reply": "Thought: doubled.\nFinal Answer: the double is 16"},
  {"match": "Request to answer from the subagents: Units", "and": ["the double is 16 metres"], "reply": "The double of alpha is 16 metres."}
]}"#;

/// Bad input: the critic blames the subagent whose result another one used (INPUT_DATA_ERROR with
/// its culprit). The recovery round sends the culprit out again with the lesson, and the goal that
/// used it after it, given its new result (the dependency machinery).
#[tokio::test]
async fn bad_input_sends_the_culprit_back_and_the_goal_that_used_it_after_it() {
    let dialog = answered(
        CULPRIT,
        "culprit-1",
        critiqued("Units of alpha, doubled."),
        "The double of alpha is 16 metres.",
    )
    .await;
    let Dialog {
        aggregator,
        llm,
        responses,
        ..
    } = dialog;
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    let ran = |rule: usize| calls.iter().filter(|c| c.rule == Some(rule)).count();
    // Each subagent ran twice: first without the unit, then the culprit with the lesson and the
    // goal that used it with the culprit's new result.
    assert_eq!((ran(5), ran(6), ran(7), ran(8)), (1, 1, 1, 1), "{calls:#?}");
    assert_eq!(ran(4), 1, "one INPUT_DATA_ERROR verdict");
    let session = session_of(&responses);
    let store = aggregator.store();
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    // The recovery round: two subagents, the second waiting for the first.
    let recovery = format!(
        "{prefixes}SELECT ?waiting WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?s a tg:Synthesis ; prov:wasDerivedFrom ?e .
           ?e a tg:Evaluation ; tg:evaluationStatus \"INPUT_DATA_ERROR\" .
           ?second a tg:FanOut ; prov:wasDerivedFrom ?s ; tg:expectedSiblings 2 ;
             tg:subagentSession ?waiting .
           ?waiting tg:needs ?culprit ; tg:startRequested true .
           FILTER (STRSTARTS(STR(?second), \"{session}/\")) }} }}"
    );
    assert_eq!(count_reaching(&store, recovery, 1).await, 1);
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
}

const TOO_BIG: &str = r#"{"rules": [
  {"match": "Request to split: Survey", "reply": "[{\"goal\": \"survey everything\"}]"},
  {"match": "Result to evaluate: everything is fine", "reply": "{\"status\": \"JOB_TOO_COMPLICATED_ERROR\", \"evaluation\": \"too broad to check\", \"sub_steps\": [{\"goal\": \"survey the north\"}, {\"goal\": \"survey the south\"}]}"},
  {"match": "Result to evaluate: ", "reply": "{\"status\": \"SUCCESS\"}"},
  {"match": "Question: survey everything", "reply": "Thought: vague.\nFinal Answer: everything is fine"},
  {"match": "Question: survey the north", "and": ["This is part of a larger goal: survey everything"], "reply": "Thought: looked.\nFinal Answer: the north is dry"},
  {"match": "Question: survey the south", "and": ["This is part of a larger goal: survey everything"], "reply": "Thought: looked.\nFinal Answer: the south is wet"},
  {"match": "Request to answer from the subagents: Survey", "and": ["the north is dry", "the south is wet"], "reply": "North dry, south wet."}
]}"#;

/// A job too big: the critic splits the goal into the sub-goals it gives, which go out together in
/// the recovery round, each told what it is part of.
#[tokio::test]
async fn a_job_too_big_is_split_into_the_sub_goals_the_critic_gives() {
    let dialog = answered(
        TOO_BIG,
        "too-big-1",
        critiqued("Survey the land."),
        "North dry, south wet.",
    )
    .await;
    let Dialog {
        aggregator,
        llm,
        responses,
        ..
    } = dialog;
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    let ran = |rule: usize| calls.iter().filter(|c| c.rule == Some(rule)).count();
    assert_eq!((ran(3), ran(4), ran(5)), (1, 1, 1), "{calls:#?}");
    let session = session_of(&responses);
    let store = aggregator.store();
    let tree = explain_tree(&store, &session).await;
    assert!(tree.contains("critic: JOB_TOO_COMPLICATED_ERROR"), "{tree}");
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
}

/// A later supervisor step whose message says the dialog has used nearly `u64::MAX` tokens (a
/// later step's tokens come from its message, which a client can set where no seal key is
/// configured) fans out and ends with one clean closing, its counts held at the maximum. Until
/// 2026-12-05 the fan-out added them overflowing: a panic in a debug build (the step caught,
/// retried and dead-lettered after three tries, the client never answered), a wrapped count in
/// a release build.
#[tokio::test]
async fn a_later_step_that_carries_tokens_near_the_maximum_fans_out_and_ends_once() {
    let config = seed_with(
        "tokens-near-the-maximum",
        &[("agent-limits", r#"{"default": {"max_tokens": 0}}"#)],
    );
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
      {"match": "Question: price of alpha", "reply": "Thought: known.\nFinal Answer: alpha costs 1"},
      {"match": "Question: price of beta", "reply": "Thought: known.\nFinal Answer: beta costs 2"},
      {"match": "Request to answer from the subagents: Compare", "reply": "Alpha 1, beta 2."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let later = AgentRequest {
        session_id: "8d0f6c2e-4b1a-4c3e-9f5d-2a7b6c1d0e93".into(),
        history: vec![agent_schema::AgentStep {
            thought: "Look at the question first.".into(),
            action: "llm".into(),
            observation: "two prices are asked for".into(),
            ..Default::default()
        }],
        ..supervised("Compare the prices of alpha and beta")
    };
    let near = (u64::MAX - 7).to_string();
    let carried: agent_bus::Properties = [
        (agent_schema::IN_TOKEN_PROPERTY.to_owned(), near.clone()),
        (agent_schema::OUT_TOKEN_PROPERTY.to_owned(), near),
    ]
    .into();
    client
        .send_with("near-max", &later, &carried)
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "near-max", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closings(&responses), 1, "{responses:#?}");
    let closing = responses.last().unwrap();
    assert!(closing.error.is_none(), "{responses:#?}");
    assert_eq!(closing.content, "Alpha 1, beta 2.");
    assert_eq!(closing.in_token, Some(u64::MAX), "{closing:?}");
    assert_eq!(closing.out_token, Some(u64::MAX), "{closing:?}");
}
