//! The meta-router end to end on a real broker: seeded task types route to a pattern in their valid
//! set with the decision recorded; bad LLM answers get a recorded fallback; no config still answers
//! as general/react; a requested pattern bypasses routing; config changes through the REST API
//! change the next request's routing with no restart.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use agent_bus::AgentClient;
use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse};
use serde_json::json;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);
use agent_core::vocab::TG;

/// The pattern decision of a dialog as predicate (without the `tg:` prefix) -> values.
type DecisionFacts = BTreeMap<String, BTreeSet<String>>;

/// Runs one dialog and returns its responses and its pattern decision.
async fn routed(
    client: &mut AgentClient,
    id: &str,
    request: &AgentRequest,
) -> (Vec<AgentResponse>, DecisionFacts) {
    client.send(id, request).await.unwrap();
    let responses = collect_dialog(client, id, DIALOG_TIMEOUT).await.unwrap();
    let decision = responses
        .iter()
        .find(|r| {
            r.explain_id
                .as_deref()
                .is_some_and(|e| e.ends_with("/pattern-decision"))
        })
        .unwrap_or_else(|| panic!("no pattern decision in {responses:#?}"));
    let mut facts = DecisionFacts::new();
    for t in &decision.explain_triples {
        let value = if t.o.kind == "i" {
            t.o.iri.clone()
        } else {
            t.o.value.clone()
        };
        let key = t.p.iri.strip_prefix(TG).unwrap_or(&t.p.iri).to_owned();
        facts.entry(key).or_default().insert(value);
    }
    (responses, facts)
}

fn one(facts: &DecisionFacts, key: &str) -> String {
    let values = facts.get(key).cloned().unwrap_or_default();
    assert!(values.len() <= 1, "{key}: {values:?}");
    values.into_iter().next().unwrap_or_default()
}

fn set(facts: &DecisionFacts, key: &str) -> BTreeSet<String> {
    facts.get(key).cloned().unwrap_or_default()
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| (*s).to_owned()).collect()
}

fn answer(responses: &[AgentResponse]) -> String {
    let closing = responses.last().unwrap();
    assert!(closing.end_of_dialog, "{responses:#?}");
    assert!(closing.error.is_none(), "{responses:#?}");
    text_of(responses, "answer")
}

const SEEDED_TASK_TYPES: [&str; 4] = ["general", "research", "risk-assessment", "summarisation"];

/// Each seeded task type, from the LLM answering in a different accepted form (JSON, JSON in a
/// code fence, `Choice:` lines, TrustGraph's bare name), routes to a pattern of its valid set; the
/// decision records candidates, choice, method and rationale; the framing reaches the ReACT prompt;
/// the first iteration derives from the decision.
#[tokio::test]
async fn seeded_task_types_route_within_their_valid_patterns() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to classify: What is the capital of France", "reply": "{\"choice\": \"general\", \"rationale\": \"a single plain fact\"}"},
      {"match": "Request to classify: Find sources on the history", "reply": "```json\n{\"choice\": \"research\", \"rationale\": \"asks for sources\"}\n```"},
      {"match": "Request to classify: What could go wrong", "reply": "Choice: risk assessment\nRationale: asks what could go wrong"},
      {"match": "Request to classify: Summarise the plot", "reply": "summarisation"},
      {"match": "Request to work on: What is the capital of France", "reply": "{\"choice\": \"react\", \"rationale\": \"one lookup at most\"}"},
      {"match": "Request to work on: Find sources on the history", "reply": "{\"choice\": \"supervisor\", \"rationale\": \"fan out\"}"},
      {"match": "Request to work on: What could go wrong", "reply": "react"},
      {"match": "This is a research request", "and": ["Question: Find sources"], "reply": "Thought: framed as research.\nFinal Answer: research framing seen"},
      {"match": "This is a risk assessment", "and": ["Question: What could go wrong"], "reply": "Thought: framed as risk.\nFinal Answer: risk framing seen"},
      {"match": "This is a summarisation request", "and": ["Question: Summarise"], "reply": "Thought: framed as summary.\nFinal Answer: summary framing seen"},
      {"match": "Question: What is the capital of France?", "reply": "Thought: known.\nFinal Answer: Paris"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let seed: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(seed_dir().join("agent-task-type.json")).unwrap(),
    )
    .unwrap();

    // The pattern is asked for too where a task type allows two patterns that run here: an
    // answer with a rationale, an answer outside the candidates (a recorded fallback to the first
    // runnable valid pattern), a bare name, and no question at all for one candidate.
    for (id, question, task_type, rationale, expected_answer, pattern_method) in [
        (
            "r-general",
            "What is the capital of France?",
            "general",
            "a single plain fact",
            "Paris",
            "llm",
        ),
        (
            "r-research",
            "Find sources on the history of Apache Pulsar.",
            "research",
            "asks for sources",
            "research framing seen",
            "fallback",
        ),
        (
            "r-risk",
            "What could go wrong if we run one broker?",
            "risk-assessment",
            "asks what could go wrong",
            "risk framing seen",
            "llm",
        ),
        (
            "r-summary",
            "Summarise the plot of Hamlet.",
            "summarisation",
            "",
            "summary framing seen",
            "only-candidate",
        ),
    ] {
        let (responses, facts) = routed(&mut client, id, &request(question, false)).await;
        assert_eq!(answer(&responses), expected_answer, "{id}");
        assert_eq!(one(&facts, "taskType"), task_type, "{id}");
        assert_eq!(
            set(&facts, "taskTypeCandidate"),
            names(&SEEDED_TASK_TYPES),
            "{id}"
        );
        assert_eq!(one(&facts, "taskTypeMethod"), "llm", "{id}");
        assert_eq!(one(&facts, "taskTypeRationale"), rationale, "{id}");
        assert_eq!(one(&facts, "patternMethod"), pattern_method, "{id}");
        assert_eq!(
            one(&facts, "fallback"),
            (pattern_method == "fallback").to_string(),
            "{id}"
        );
        let valid: BTreeSet<String> = seed[task_type]["valid_patterns"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_str().unwrap().to_owned())
            .collect();
        let pattern = one(&facts, "pattern");
        assert!(valid.contains(&pattern), "{id}: {pattern} not in {valid:?}");
        // Offered: the valid patterns this orchestrator runs; the others are recorded as such.
        let offered = set(&facts, "patternCandidate");
        let unavailable = set(&facts, "patternUnavailable");
        assert!(offered.contains(&pattern));
        assert_eq!(
            offered
                .union(&unavailable)
                .cloned()
                .collect::<BTreeSet<_>>(),
            valid,
            "{id}"
        );
        let framing = seed[task_type]["framing"].as_str().unwrap();
        assert_eq!(one(&facts, "framing"), framing, "{id}");

        let session = session_of(&responses);
        assert_eq!(
            one(&facts, "http://www.w3.org/ns/prov#wasDerivedFrom"),
            session
        );
        let first = responses
            .iter()
            .find(|r| r.explain_id.as_deref() == Some(&format!("{session}/final")))
            .unwrap();
        assert!(
            first
                .explain_triples
                .iter()
                .any(|t| t.p.iri.ends_with("wasDerivedFrom")
                    && t.o.iri == format!("{session}/pattern-decision")),
            "{id}: the first iteration does not derive from the decision"
        );
    }
    // Research's fallback names the answer it refused; general's pattern rationale is kept.
    let calls = llm.calls();
    let asked = |marker: &str| {
        calls
            .iter()
            .filter(|c| c.last_user.contains(marker))
            .count()
    };
    assert_eq!(asked("Request to classify: "), 4);
    // Summarisation allows one pattern only, so it was not asked about.
    assert_eq!(asked("Request to work on: "), 3);
}

/// The pattern choice's own record: rationale when the LLM chose, the refused answer and the
/// reason when it fell back.
#[tokio::test]
async fn pattern_choices_record_their_rationale_or_fallback() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"research\", \"rationale\": \"sources\"}"},
      {"match": "Request to work on: ", "and": ["nonsense"], "reply": "{\"choice\": \"telepathy\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"react\", \"rationale\": \"a quick lookup\"}"},
      {"match": "Question: ", "reply": "Thought: ok.\nFinal Answer: done"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let (_, chose) = routed(&mut client, "p-llm", &request("Look this up.", false)).await;
    assert_eq!(one(&chose, "pattern"), "react");
    assert_eq!(one(&chose, "patternMethod"), "llm");
    assert_eq!(one(&chose, "patternRationale"), "a quick lookup");
    assert_eq!(
        set(&chose, "patternCandidate"),
        names(&["react", "plan-then-execute", "reflexion", "deep-research"])
    );
    assert_eq!(one(&chose, "rationale"), "sources a quick lookup");
    let (_, refused) = routed(&mut client, "p-bad", &request("Do nonsense.", false)).await;
    assert_eq!(
        one(&refused, "pattern"),
        "react",
        "the first runnable valid pattern"
    );
    assert_eq!(one(&refused, "patternMethod"), "fallback");
    assert!(
        one(&refused, "patternFallbackReason").contains("'telepathy' is not one of the candidates")
    );
    assert!(one(&refused, "patternAnswer").contains("telepathy"));
}

/// A task type outside the candidates, prose, and a failing LLM each get the recorded fallback to
/// `general`, and the dialog still answers.
#[tokio::test]
async fn bad_routing_answers_fall_back_and_are_recorded() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to classify: ", "and": ["stars"], "reply": "{\"choice\": \"astrology\", \"rationale\": \"it is about stars\"}"},
      {"match": "Request to classify: ", "and": ["prose"], "reply": "Well, I would say this is a rather interesting question to think about."},
      {"match": "Request to classify: ", "and": ["broken"], "reply": "unused", "faults": ["400"]},
      {"match": "Question: ", "reply": "Thought: fine.\nFinal Answer: answered anyway"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    for (id, question, reason, raw) in [
        (
            "f-outside",
            "What do the stars say?",
            "'astrology' is not one of the candidates",
            Some("astrology"),
        ),
        (
            "f-prose",
            "Answer this in prose",
            "the answer names no choice",
            Some("rather interesting"),
        ),
        (
            "f-broken",
            "The LLM is broken for this",
            "the LLM call failed",
            None,
        ),
    ] {
        let (responses, facts) = routed(&mut client, id, &request(question, false)).await;
        assert_eq!(answer(&responses), "answered anyway", "{id}");
        assert_eq!(one(&facts, "taskType"), "general", "{id}");
        assert_eq!(one(&facts, "pattern"), "react", "{id}");
        assert_eq!(one(&facts, "taskTypeMethod"), "fallback", "{id}");
        assert_eq!(one(&facts, "fallback"), "true", "{id}");
        let why = one(&facts, "taskTypeFallbackReason");
        assert!(why.contains(reason), "{id}: {why}");
        match raw {
            Some(text) => assert!(one(&facts, "taskTypeAnswer").contains(text), "{id}"),
            None => assert!(!facts.contains_key("taskTypeAnswer"), "{id}"),
        }
        assert_eq!(
            set(&facts, "taskTypeCandidate"),
            names(&SEEDED_TASK_TYPES),
            "{id}"
        );
    }
}

/// With no config at all the service answers, as `general` / `react`, without a routing LLM call.
#[tokio::test]
async fn without_config_the_service_answers_as_general_react() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: Hello?", "reply": "Thought: greet.\nFinal Answer: Hello."}]}"#,
    )
    .await;
    let empty = config_dir("none", &[]);
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &empty, &[]);
    let mut client = client(&broker).await;
    let (responses, facts) = routed(&mut client, "n-1", &request("Hello?", true)).await;
    assert_eq!(answer(&responses), "Hello.");
    assert_eq!(one(&facts, "taskType"), "general");
    assert_eq!(one(&facts, "pattern"), "react");
    assert_eq!(one(&facts, "taskTypeMethod"), "only-candidate");
    assert_eq!(one(&facts, "patternMethod"), "only-candidate");
    assert_eq!(one(&facts, "fallback"), "false");
    assert_eq!(llm.calls().len(), 1, "only the ReACT turn asked the LLM");
}

/// A request that names its pattern is not routed (its decision says so); one that names its task
/// type skips classification but gets the framing; an unknown task type is refused clearly.
#[tokio::test]
async fn requested_patterns_and_task_types_bypass_routing() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "This is a research request", "reply": "Thought: framed.\nFinal Answer: framed"},
      {"match": "Question: ", "reply": "Thought: plain.\nFinal Answer: plain"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;

    let with_pattern = AgentRequest {
        pattern: "react".into(),
        ..request("Just answer.", false)
    };
    let (responses, facts) = routed(&mut client, "b-pattern", &with_pattern).await;
    assert_eq!(answer(&responses), "plain");
    assert_eq!(one(&facts, "pattern"), "react");
    assert_eq!(one(&facts, "patternMethod"), "requested");
    assert!(!facts.contains_key("taskType"));
    assert!(!facts.contains_key("taskTypeMethod"));

    // Pattern and task type both named: no routing, but the task type's framing applies.
    let both = AgentRequest {
        pattern: "react".into(),
        task_type: "research".into(),
        ..request("Look into it as research.", false)
    };
    let (responses, facts) = routed(&mut client, "b-both", &both).await;
    assert_eq!(answer(&responses), "framed");
    assert_eq!(one(&facts, "taskType"), "research");
    assert_eq!(one(&facts, "taskTypeMethod"), "requested");
    assert!(one(&facts, "framing").starts_with("This is a research request"));

    let with_task_type = AgentRequest {
        task_type: "research".into(),
        ..request("Look into it.", true)
    };
    let (responses, facts) = routed(&mut client, "b-task", &with_task_type).await;
    assert_eq!(answer(&responses), "framed");
    assert_eq!(one(&facts, "taskType"), "research");
    assert_eq!(one(&facts, "taskTypeMethod"), "requested");
    assert_eq!(one(&facts, "pattern"), "react");

    assert!(!llm
        .calls()
        .iter()
        .any(|c| c.last_user.contains("Request to classify: ")));

    // An unknown task type is refused, with or without a pattern.
    for (id, pattern) in [("b-unknown", ""), ("b-unknown-pattern", "react")] {
        let unknown = AgentRequest {
            task_type: "astrology".into(),
            pattern: pattern.into(),
            ..request("Read my stars.", false)
        };
        client.send(id, &unknown).await.unwrap();
        let responses = collect_dialog(&mut client, id, DIALOG_TIMEOUT)
            .await
            .unwrap();
        let error = responses.last().unwrap().error.clone().unwrap();
        assert!(
            error.message.contains("'astrology' is not configured"),
            "{id}: {error:?}"
        );
    }
}

/// Task types and their `valid_patterns` changed through config-svc's REST API change the routing
/// of the next requests with no restart; a task type naming an unknown pattern is refused and the
/// last good config stays in force.
#[tokio::test]
async fn routing_follows_config_changes_without_a_restart() {
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::spawn(&broker, Some(&seed_dir()));
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to classify: ", "and": ["pager"], "reply": "{\"choice\": \"incident-response\", \"rationale\": \"an outage is under way\"}"},
      {"match": "Request to classify: ", "reply": "{\"choice\": \"general\", \"rationale\": \"nothing special\"}"},
      {"match": "This is an incident", "reply": "Thought: incident.\nFinal Answer: incident handled"},
      {"match": "Question: ", "reply": "Thought: plain.\nFinal Answer: plain"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let pager = "The pager went off: the API is down.";

    let (_, before) = routed(&mut client, "c-before", &request(pager, false)).await;
    assert_eq!(one(&before, "taskType"), "general");
    assert_eq!(
        set(&before, "patternCandidate"),
        names(&["react", "plan-then-execute", "supervisor", "llm-router"])
    );
    assert!(one(&before, "taskTypeFallbackReason").contains("'incident-response' is not one"));

    let http = reqwest::Client::new();
    let put = |kind: &str, key: &str, value: serde_json::Value| {
        http.put(format!("{}/api/v1/config/{kind}/{key}", svc.url))
            .bearer_auth(&svc.token)
            .json(&value)
            .send()
    };
    let incident = json!({
        "description": "Something is broken in production right now.",
        "framing": "This is an incident: restore service first, explain later.",
        "valid_patterns": ["react"]
    });
    let written = put("agent-task-type", "incident-response", incident)
        .await
        .unwrap();
    assert_eq!(written.status(), 200);
    let written: serde_json::Value = written.json().await.unwrap();
    assert!(written.get("agent_config_problems").is_none(), "{written}");
    let mut after = None;
    for attempt in 0..50 {
        let (responses, facts) = routed(
            &mut client,
            &format!("c-after-{attempt}"),
            &request(pager, false),
        )
        .await;
        if one(&facts, "taskType") == "incident-response" {
            assert_eq!(answer(&responses), "incident handled");
            after = Some(facts);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let after = after.expect("the new task type never became a candidate");
    assert!(set(&after, "taskTypeCandidate").contains("incident-response"));
    assert_eq!(one(&after, "taskTypeMethod"), "llm");

    // `general` allowed react, plan-then-execute and supervisor; now it allows react only: the
    // next decision offers react only and asks the LLM nothing about the pattern.
    let general = json!({
        "description": "Anything else.",
        "valid_patterns": ["react"]
    });
    let written = put("agent-task-type", "general", general).await.unwrap();
    assert_eq!(written.status(), 200);
    let mut changed = None;
    for attempt in 0..50 {
        let (_, facts) = routed(
            &mut client,
            &format!("c-general-{attempt}"),
            &request("Anything at all?", false),
        )
        .await;
        if set(&facts, "patternCandidate") == names(&["react"]) {
            changed = Some(facts);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let changed = changed.expect("the new valid_patterns never applied");
    assert_eq!(one(&changed, "taskType"), "general");
    assert!(set(&changed, "patternUnavailable").is_empty());
    assert_eq!(one(&changed, "pattern"), "react");
    assert_eq!(one(&changed, "patternMethod"), "only-candidate");

    // A task type naming an unknown pattern: config-svc stores it (it is a general config store)
    // but says at once what is wrong, and the orchestrator refuses the whole config, so routing
    // stays as it was.
    let unknown = json!({"description": "x", "valid_patterns": ["telepathy"]});
    let written = put("agent-task-type", "incident-response", unknown)
        .await
        .unwrap();
    assert_eq!(written.status(), 200);
    let written: serde_json::Value = written.json().await.unwrap();
    let problems = written["agent_config_problems"].to_string();
    assert!(
        problems.contains(
            "agent-task-type/incident-response: valid_patterns names the unknown pattern 'telepathy'"
        ),
        "{written}"
    );
    // As long as the good change above took to apply, every request keeps the last good config.
    for attempt in 0..10 {
        let (responses, facts) = routed(
            &mut client,
            &format!("c-refused-{attempt}"),
            &request(pager, false),
        )
        .await;
        assert_eq!(one(&facts, "taskType"), "incident-response");
        assert_eq!(answer(&responses), "incident handled");
        let (_, facts) = routed(
            &mut client,
            &format!("c-kept-{attempt}"),
            &request("Anything at all?", false),
        )
        .await;
        assert_eq!(set(&facts, "patternCandidate"), names(&["react"]));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}
