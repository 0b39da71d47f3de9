//! End-to-end ReACT dialogs over a real pulsar-lite broker, the scripted LLM and the real
//! `agent-orchestrator` binary.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_e2e::*;
use agent_schema::AgentResponse;
use futures::StreamExt;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

fn kinds(responses: &[AgentResponse]) -> Vec<&str> {
    responses.iter().map(|r| r.message_type.as_str()).collect()
}

/// The dialog ends exactly once, with the closing message last.
fn assert_closed_once(responses: &[AgentResponse]) {
    let ends = responses.iter().filter(|r| r.end_of_dialog).count();
    assert_eq!(ends, 1, "{responses:#?}");
    assert!(responses.last().unwrap().end_of_dialog);
}

#[tokio::test]
async fn one_iteration_answer_without_streaming() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to classify: What is six times seven?", "reply": "{\"choice\": \"general\", \"rationale\": \"arithmetic\"}"},
      {"match": "Question: What is six times seven?", "reply": "Thought: I know this one.\nFinal Answer: 42."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("q-1", &request("What is six times seven?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-1", DIALOG_TIMEOUT)
        .await
        .unwrap();

    // The question, the routing decision, the thought, the conclusion, the answer.
    assert_eq!(
        kinds(&responses),
        ["explain", "explain", "thought", "explain", "answer"]
    );
    assert_closed_once(&responses);
    let session = session_of(&responses);
    assert!(session.starts_with("urn:trustgraph:agent:"));
    assert_eq!(
        responses[1].explain_id.as_deref(),
        Some(format!("{session}/pattern-decision").as_str())
    );
    assert_eq!(responses[2].content, "I know this one.");
    assert!(responses[2].end_of_message);
    assert_eq!(responses[2].message_id, format!("{session}/i1/thought"));
    assert_eq!(
        responses[3].explain_id.as_deref(),
        Some(format!("{session}/final").as_str())
    );
    let answer = &responses[4];
    assert_eq!(answer.content, "42.");
    assert!(answer.end_of_message);
    assert_eq!(answer.message_id, format!("{session}/final"));
    assert!(answer.in_token.unwrap() > 0 && answer.out_token.unwrap() > 0);
    assert_eq!(answer.model.as_deref(), Some("scripted"));
    // Routing (task type, then pattern: unscripted here, so it fell back to react), then one
    // agent turn; none streamed.
    assert_eq!(llm.calls().len(), 3);
    assert!(llm.calls().iter().all(|c| !c.stream));
}

const THREE_STEPS: &str = r#"{"rules": [
  {"match": "Observation: beta-result", "reply": "Thought: I have both parts now.\nFinal Answer: alpha and beta, combined at last.", "chunk_size": 4},
  {"match": "Observation: alpha-result", "reply": "Thought: Now the second part.\nAction: llm\nArgs: {\"question\": \"fetch beta\"}", "chunk_size": 4},
  {"match": "fetch alpha", "exact": true, "reply": "alpha-result"},
  {"match": "fetch beta", "exact": true, "reply": "beta-result"},
  {"match": "Question: combine", "reply": "Thought: Start with the first part.\nAction: llm\nArgs: {\n  \"question\": \"fetch alpha\"\n}", "chunk_size": 4}
]}"#;

/// Three iterations, two tool calls, streamed with TrustGraph's chunk semantics: thought chunks with
/// the last one marked `end_of_message`, observations whole, answer chunks unmarked, and a closing
/// empty answer with `end_of_dialog` and the dialog's token counts.
#[tokio::test]
async fn three_iteration_dialog_with_tools_streams_chunks() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(THREE_STEPS).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("q-3", &request("combine alpha and beta", true))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-3", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_closed_once(&responses);

    let session = session_of(&responses);
    let observations: Vec<&AgentResponse> = responses
        .iter()
        .filter(|r| r.message_type == "observation")
        .collect();
    assert_eq!(observations.len(), 2);
    assert_eq!(observations[0].content, "alpha-result");
    assert_eq!(
        observations[0].message_id,
        format!("{session}/i1/observation")
    );
    assert!(observations.iter().all(|o| o.end_of_message));
    assert_eq!(observations[1].content, "beta-result");

    for (i, expected) in [
        (1, "Start with the first part."),
        (2, "Now the second part."),
        (3, "I have both parts now."),
    ] {
        let id = format!("{session}/i{i}/thought");
        let chunks: Vec<&AgentResponse> = responses
            .iter()
            .filter(|r| r.message_type == "thought" && r.message_id == id)
            .collect();
        assert!(chunks.len() > 1, "thought {i} was not streamed in chunks");
        let text: String = chunks.iter().map(|c| c.content.as_str()).collect();
        assert_eq!(text, expected);
        assert!(chunks.last().unwrap().end_of_message);
        assert!(chunks[..chunks.len() - 1].iter().all(|c| !c.end_of_message));
    }

    let answers: Vec<&AgentResponse> = responses
        .iter()
        .filter(|r| r.message_type == "answer")
        .collect();
    assert!(answers.len() > 2, "the answer was not streamed");
    assert!(answers[..answers.len() - 1]
        .iter()
        .all(|a| !a.end_of_message && !a.end_of_dialog));
    assert_eq!(
        text_of(&responses, "answer"),
        "alpha and beta, combined at last."
    );
    let closing = answers.last().unwrap();
    assert_eq!(closing.content, "");
    assert!(closing.end_of_message && closing.end_of_dialog);
    assert_eq!(closing.message_id, format!("{session}/final"));
    // Routing (two questions, unscripted here, so it fell back), three agent turns and two tool
    // calls.
    let calls = llm.calls();
    assert_eq!(calls.len(), 7);
    assert!(closing.in_token.unwrap() >= 5 && closing.out_token.unwrap() >= 5);

    // Provenance arrived inline: session, two iterations with observations, the conclusion.
    let explained: Vec<String> = responses
        .iter()
        .filter_map(|r| r.explain_id.clone())
        .collect();
    for node in [
        "",
        "/i1",
        "/i1/observation",
        "/i2",
        "/i2/observation",
        "/final",
    ] {
        assert!(
            explained.contains(&format!("{session}{node}")),
            "no explain for {node}: {explained:?}"
        );
    }
    let i2 = responses
        .iter()
        .find(|r| r.explain_id.as_deref() == Some(&format!("{session}/i2")))
        .unwrap();
    assert!(i2
        .explain_triples
        .iter()
        .any(|t| t.p.iri.ends_with("wasDerivedFrom")
            && t.o.iri == format!("{session}/i1/observation")));
}

/// A response that breaks the protocol and a tool that does not exist both become `Error: ...`
/// observations, and the dialog goes on to an answer.
#[tokio::test]
async fn parse_errors_and_unknown_tools_become_observations() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Observation: Error: there is no tool named 'teleport'", "reply": "Thought: fine.\nFinal Answer: recovered"},
      {"match": "Observation: Error: your response could not be parsed", "reply": "Thought: use a tool\nAction: teleport\nArgs: {\"to\": \"mars\"}"},
      {"match": "Question: broken", "reply": "I refuse to follow the format."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("q-e", &request("broken please", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-e", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_closed_once(&responses);
    let observations: Vec<&str> = responses
        .iter()
        .filter(|r| r.message_type == "observation")
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(observations.len(), 2, "{observations:?}");
    assert!(observations[0].starts_with("Error: your response could not be parsed"));
    assert!(observations[1].starts_with("Error: there is no tool named 'teleport'"));
    assert!(observations[1].contains("available tools: llm"));
    assert_eq!(responses.last().unwrap().content, "recovered");
}

/// A tool outside the request's group is refused when the LLM names it anyway.
#[tokio::test]
async fn tools_outside_the_requests_group_are_refused_at_execution() {
    let broker = Broker::start().unwrap();
    let config = config_dir(
        "scoped",
        &[(
            "tool",
            r#"{"ops-only": {"name": "restart", "description": "restart a service", "type": "text-completion", "group": ["ops"]},
                "llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
        )],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Observation: Error: the tool 'restart' is not available", "reply": "Thought: not allowed.\nFinal Answer: refused"},
      {"match": "restart it", "exact": true, "reply": "restarted!"},
      {"match": "Question: restart", "reply": "Thought: do it\nAction: restart\nArgs: {\"question\": \"restart it\"}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("q-s", &request("restart the database", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-s", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, "refused");
    let observation = text_of(&responses, "observation");
    assert!(
        observation.contains("not available to this request"),
        "{observation}"
    );
    assert!(!observation.contains("restarted!"));
    // The prompt never offered the tool either.
    assert!(llm.calls().iter().all(|c| c.last_user != "restart it"));
    assert!(!llm.calls()[0].last_user.contains("restart a service"));
}

/// `max_iterations` ends a dialog that never answers with a clear answer, not a crash.
#[tokio::test]
async fn max_iterations_ends_the_dialog_with_a_clear_answer() {
    let broker = Broker::start().unwrap();
    let config = config_dir(
        "limits",
        &[
            ("agent-limits", r#"{"default": {"max_iterations": 2}}"#),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "again", "exact": true, "reply": "more"},
      {"match": "Question: loop", "reply": "Thought: once more\nAction: llm\nArgs: {\"question\": \"again\"}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("q-m", &request("loop forever", true))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-m", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_closed_once(&responses);
    assert_eq!(
        responses
            .iter()
            .filter(|r| r.message_type == "observation")
            .count(),
        2
    );
    let answer = text_of(&responses, "answer");
    assert!(
        answer.contains("within the limit of 2 iterations"),
        "{answer}"
    );
    let conclusion = responses
        .iter()
        .rev()
        .find(|r| r.message_type == "explain")
        .unwrap();
    assert!(conclusion
        .explain_triples
        .iter()
        .any(|t| t.p.iri.ends_with("terminationReason") && t.o.value == "max-iterations"));
    // Two agent turns and two tool calls: the limit stopped a third turn.
    assert_eq!(llm.calls().len(), 4);
}

/// A dialog ended at its iteration limit whose last observation was long (over 4 KiB, so the
/// message after it carried an excerpt, its text checked in as a document) answers with that
/// observation whole. Until 2026-12-04 the answer held the excerpt and its claim-check mark.
#[tokio::test]
async fn an_answer_at_the_limit_gives_a_long_last_observation_whole() {
    const TOKEN: &str = "limit-long-token";
    let config = config_dir(
        "limit-long",
        &[
            ("agent-limits", r#"{"default": {"max_iterations": 1}}"#),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let observation = format!("{}END-OF-OBSERVATION", "a long result line. ".repeat(300));
    let script = format!(
        r#"{{"rules": [
      {{"match": "fetch it", "exact": true, "reply": "{observation}"}},
      {{"match": "Question: fetch", "reply": "Thought: fetch\nAction: llm\nArgs: {{\"question\": \"fetch it\"}}"}}
    ]}}"#
    );
    let Stack {
        broker,
        aggregator: _aggregator,
        llm: _llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &script, &config, &[]).await;
    let mut client = client(&broker).await;
    client
        .send("q-long", &request("fetch the long thing", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-long", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_closed_once(&responses);
    let closing = responses.last().unwrap();
    assert!(closing.error.is_none(), "{responses:#?}");
    assert!(observation.len() > agent_core::documents::CHECK_IN_OVER);
    assert!(
        closing
            .content
            .ends_with(&format!("The last observation was: {observation}")),
        "{}",
        closing.content
    );
}

/// A token budget (`max_tokens`) counted across iterations ends the dialog with a clear answer and
/// a `budget` termination once it is used up, before another LLM call.
#[tokio::test]
async fn a_spent_token_budget_ends_the_dialog() {
    let broker = Broker::start().unwrap();
    let config = config_dir(
        "budget",
        &[
            ("agent-limits", r#"{"default": {"max_tokens": 1}}"#),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "again", "exact": true, "reply": "more"},
      {"match": "Question: spend", "reply": "Thought: once more\nAction: llm\nArgs: {\"question\": \"again\"}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("q-b", &request("spend tokens", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-b", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_closed_once(&responses);
    let closing = responses.last().unwrap();
    assert!(closing.error.is_none());
    assert!(
        closing.content.contains("(max_tokens)"),
        "{}",
        closing.content
    );
    assert!(closing.content.contains("The last observation was: more"));
    let conclusion = responses
        .iter()
        .rev()
        .find(|r| r.message_type == "explain")
        .unwrap();
    assert!(conclusion
        .explain_triples
        .iter()
        .any(|t| t.p.iri.ends_with("terminationReason") && t.o.value == "budget"));
    // One agent turn and its tool call; the budget stopped the second turn before the LLM.
    assert_eq!(llm.calls().len(), 2);
}

/// Requests with invalid fields get an `error` response that ends the dialog.
#[tokio::test]
async fn invalid_requests_get_an_error_response() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(r#"{"rules": []}"#).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("q-empty", &request("   ", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "q-empty", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(kinds(&responses), ["error"]);
    let error = responses[0].error.as_ref().unwrap();
    assert_eq!(error.kind, "agent-error");
    assert!(error.message.contains("empty question"));
    assert!(responses[0].end_of_dialog);
    assert!(llm.calls().is_empty());
}

/// A drop-in for TrustGraph with no settings: a first message published where TrustGraph's clients
/// publish (its non-persistent request topic) is answered, and the dialog's later iterations run
/// on the persistent request topic.
#[tokio::test]
async fn a_request_on_trustgraphs_client_topic_is_answered() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Observation: fetched", "reply": "Thought: done.\nFinal Answer: from the client topic"},
      {"match": "fetch", "exact": true, "reply": "fetched"},
      {"match": "Question: ", "reply": "Thought: look.\nAction: llm\nArgs: {\"question\": \"fetch\"}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let mut iterations = read_from_start(&broker, &topics.request, "client-topic-reader").await;
    // Once this dialog is answered, the orchestrator consumes (a non-persistent message sent
    // before it subscribed would be dropped by the broker).
    client
        .send("warm-up", &request("warm up", false))
        .await
        .unwrap();
    collect_dialog(&mut client, "warm-up", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let trustgraph_client = agent_bus::Publisher::new(&bus, &topics.client_request)
        .await
        .unwrap();
    let properties: agent_bus::Properties = [("id".to_owned(), "tg-1".to_owned())].into();
    trustgraph_client
        .send(
            agent_schema::encode(&request("Where do clients publish?", false)),
            &properties,
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "tg-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "from the client topic");
    // Its later iterations went through the persistent topic.
    let mut later = 0;
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_secs(2), iterations.next()).await
    {
        iterations.ack(&message).await.unwrap();
        let id = agent_bus::message_property(&message, "id").unwrap_or_default();
        let request: agent_schema::AgentRequest =
            serde_json::from_slice(&message.payload.data).unwrap();
        if id == "tg-1" && !request.history.is_empty() {
            later += 1;
        }
    }
    assert!(later >= 1, "no iteration of tg-1 on the persistent topic");
}

/// TrustGraph's clients publish first messages on a non-persistent topic, whose broker drops what
/// a subscription has no flow permits for. A burst of 500 at once, far more than the orchestrator
/// runs at a time, is taken whole (forwarded to the persistent topic) and answered (a window of
/// `max_in_flight` permits left 457-462 of them never taken up).
#[tokio::test]
async fn a_burst_on_trustgraphs_client_topic_is_taken_whole() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: ", "reply": "Thought: known.\nFinal Answer: burst"}]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    // Once this dialog is answered, the orchestrator consumes (a non-persistent message sent
    // before it subscribed would be dropped by the broker).
    client
        .send("warm-up", &request("warm up", false))
        .await
        .unwrap();
    collect_dialog(&mut client, "warm-up", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let trustgraph_clients = agent_bus::Publisher::new(
        &bus,
        &agent_bus::Topics::trustgraph("default", "default").client_request,
    )
    .await
    .unwrap();

    // Half the broker's limit of non-persistent messages in flight on one publishing connection
    // (1,000 in Apache Pulsar and pulsar-lite; past it the broker drops them itself).
    let burst = 500;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let session_of = |i: usize| format!("burst-{run}-{i}");
    let mut conclusions = Conclusions::watch(&broker).await;
    let sends = (0..burst).map(|i| {
        let properties: agent_bus::Properties = [("id".to_owned(), format!("b-{i}"))].into();
        let asked = agent_schema::AgentRequest {
            session_id: session_of(i),
            ..request(&format!("burst #{i}"), false)
        };
        let payload = agent_schema::encode(&asked);
        let publisher = &trustgraph_clients;
        async move { publisher.send(payload, &properties).await }
    });
    for sent in futures::future::join_all(sends).await {
        sent.unwrap();
    }
    // What the test is about is that each first message was taken up: a dialog that concluded
    // was, even should its closing not reach the client (the response topic is non-persistent too).
    let open = (0..burst)
        .map(|i| (format!("b-{i}"), session_of(i)))
        .collect();
    await_endings(
        &mut client,
        &mut conclusions,
        open,
        Duration::from_secs(20),
        |id, response| assert_eq!(response.content, "burst", "{id}: {response:?}"),
    )
    .await;
}
