//! Knowledge tools over a real broker and graph store: an RDF file loaded into a collection with
//! `agentctl load` answers a `knowledge-query`; a `sparql-query` that tries to delete is refused
//! and the data stays; a tool that sleeps past its timeout and one that returns 10 MB are both
//! bounded, and both are in the provenance with their durations.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use agent_e2e::*;
use agent_schema::AgentResponse;

const TOKEN: &str = "knowledge-token";
const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);
const MAX_OBSERVATION_BYTES: usize = 4096;

/// Facts that exist only in this file.
const ACME_TTL: &str = r#"
@prefix ex: <http://example.org/acme/> .
@prefix rdfs: <http://www.w3.org/2000/01/rdf-schema#> .
ex:zorblax rdfs:label "Zorblax Company" ;
    ex:foundedBy ex:quentin ;
    ex:foundedIn "1987" ;
    ex:makes ex:gizmo .
ex:quentin rdfs:label "Quentin Varga" .
ex:gizmo rdfs:label "Hyperflux Gizmo" .
"#;

const TOOLS: &str = r#"{
  "facts": {"name": "facts", "description": "Look facts up in the ACME knowledge collection", "type": "knowledge-query",
            "collection": "acme", "arguments": [{"name": "question", "type": "string", "description": "What to look up"}]},
  "sparql": {"name": "sparql", "description": "Run a SPARQL query on the ACME collection", "type": "sparql-query",
             "collection": "acme", "arguments": [{"name": "query", "type": "string", "description": "A SPARQL query"}]},
  "slow": {"name": "slow", "description": "A tool that takes its time", "type": "text-completion",
           "arguments": [{"name": "question", "type": "string", "description": "Anything"}]},
  "huge": {"name": "huge", "description": "A tool that says a lot", "type": "text-completion",
           "arguments": [{"name": "question", "type": "string", "description": "Anything"}]}
}"#;

/// The scripted LLM: it can only answer from what the tools put into its prompt.
fn script() -> String {
    let huge = "x".repeat(10 * 1024 * 1024);
    serde_json::json!({"rules": [
        {"match": "be slow", "exact": true, "reply": "too late", "delay_ms": 8000},
        {"match": "make it huge", "exact": true, "reply": huge},
        {"match": "Zorblax Company foundedBy Quentin Varga", "reply": "Thought: the collection says who\nFinal Answer: Quentin Varga founded Zorblax in 1987"},
        {"match": "Question: Who founded Zorblax", "reply": "Thought: look it up\nAction: facts\nArgs: {\"question\": \"Who founded Zorblax?\"}"},
        {"match": "Observation: Error: refused", "reply": "Thought: that is not allowed\nFinal Answer: deletion refused"},
        {"match": "Question: wipe the data", "reply": "Thought: delete everything\nAction: sparql\nArgs: {\"query\": \"DELETE WHERE { ?s ?p ?o }\"}"},
        {"match": "output cut at", "reply": "Thought: both were bounded\nFinal Answer: bounded"},
        {"match": "timed out after", "reply": "Thought: now the big one\nAction: huge\nArgs: {\"question\": \"make it huge\"}"},
        {"match": "Question: try the bounded tools", "reply": "Thought: first the slow one\nAction: slow\nArgs: {\"question\": \"be slow\"}"}
    ]})
    .to_string()
}

async fn ask(client: &mut agent_bus::AgentClient, id: &str, question: &str) -> Vec<AgentResponse> {
    client.send(id, &request(question, false)).await.unwrap();
    collect_dialog(client, id, DIALOG_TIMEOUT).await.unwrap()
}

#[tokio::test]
async fn knowledge_tools_answer_from_a_loaded_collection_and_every_tool_is_bounded() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let file = std::env::temp_dir().join(format!("acme-{}.ttl", std::process::id()));
    std::fs::write(&file, ACME_TTL).unwrap();
    let loaded = Command::new(binary("agentctl"))
        .args(["load", file.to_str().unwrap(), "--collection", "acme"])
        .args(["--store", &aggregator.endpoint, "--token", TOKEN])
        .output()
        .unwrap();
    assert!(
        loaded.status.success(),
        "{}",
        String::from_utf8_lossy(&loaded.stderr)
    );
    let said = String::from_utf8_lossy(&loaded.stdout);
    assert!(said.contains("now 6 triples"), "{said}");

    let llm = scripted_llm(&script()).await;
    // No token budget: the huge tool's 10 MB are 2.6M tokens of LLM output, which would end the
    // dialog on its budget (correctly) before the loop could show the observation was cut. The
    // tools' timeout is 4 s: the huge tool's answer must come within it, and at 1 s a loaded
    // machine (the suite's tests four at a time) once took longer (2026-12-05).
    let limits = format!(
        r#"{{"default": {{"tool_timeout_secs": 4, "max_observation_bytes": {MAX_OBSERVATION_BYTES}, "max_tokens": 0}}}}"#
    );
    let config = seed_with("knowledge", &[("tool", TOOLS), ("agent-limits", &limits)]);
    let _orchestrator = Orchestrator::spawn(
        &broker,
        &llm,
        &config,
        &[
            "--graph-store",
            &aggregator.endpoint,
            "--config-token",
            TOKEN,
        ],
    );
    let mut client = client(&broker).await;

    // The answer holds facts only the loaded file has, found by the knowledge query.
    let founded = ask(&mut client, "k-1", "Who founded Zorblax?").await;
    assert_eq!(
        founded.last().unwrap().content,
        "Quentin Varga founded Zorblax in 1987",
        "{founded:#?}"
    );
    let (triples, facts) = observation(&founded, 1);
    assert!(
        facts.contains("Zorblax Company foundedIn \"1987\""),
        "{facts}"
    );
    assert!(facts.contains("makes Hyperflux Gizmo"), "{facts}");
    // What the agent could have done is on record, not only what it did.
    let iteration = format!("{}/i1", session_of(&founded));
    let candidates = values(&triples, &iteration, tg::TOOL_CANDIDATE);
    for tool in ["facts", "sparql", "slow", "huge"] {
        assert!(candidates.contains(&tool.to_owned()), "{candidates:?}");
    }

    // An update written by the LLM is refused, and the data is still there.
    let wiped = ask(&mut client, "k-2", "wipe the data").await;
    assert_eq!(wiped.last().unwrap().content, "deletion refused");
    let (_, refusal) = observation(&wiped, 1);
    assert!(refusal.contains("read-only"), "{refusal}");
    let still_there = count(
        &aggregator.store(),
        "SELECT ?s WHERE { GRAPH <urn:collection:acme> { ?s ?p ?o } }".to_owned(),
    )
    .await;
    assert_eq!(still_there, 6);

    // A tool past its timeout and one that returns 10 MB: both bounded, both on record.
    let bounded = ask(&mut client, "k-3", "try the bounded tools").await;
    assert_eq!(bounded.last().unwrap().content, "bounded", "{bounded:#?}");
    let (triples, slow) = observation(&bounded, 1);
    assert!(slow.contains("timed out after 4s"), "{slow}");
    let slow_ms = duration_ms(&triples, &bounded, 1);
    assert!(
        (4000..7000).contains(&slow_ms),
        "the slow tool ran {slow_ms} ms"
    );
    let (triples, huge) = observation(&bounded, 2);
    assert!(
        huge.contains("output cut at"),
        "{}",
        &huge[huge.len().saturating_sub(200)..]
    );
    assert!(
        huge.len() < MAX_OBSERVATION_BYTES + 200,
        "{} bytes",
        huge.len()
    );
    duration_ms(&triples, &bounded, 2);
    let _ = std::fs::remove_file(file);
}

/// `agentctl tools list` shows what a request with a group and state would see, and why the rest
/// is hidden.
#[test]
fn tools_list_shows_what_a_group_and_state_would_see() {
    let tools = r#"{
      "facts": {"name": "facts", "description": "Look facts up", "type": "knowledge-query", "group": ["research"],
                "arguments": [{"name": "question", "type": "string", "description": "What"}]},
      "triage": {"name": "triage", "description": "Sort a ticket", "type": "text-completion", "group": ["ops"],
                 "applicable-states": ["new"], "state": "sorted"}
    }"#;
    let config = seed_with("tools-list", &[("tool", tools)]);
    let list = |extra: &[&str]| {
        let out = Command::new(binary("agentctl"))
            .args(["tools", "list", "--config-dir", config.to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let research = list(&["--group", "research"]);
    assert!(
        research.contains("  facts (knowledge-query) [question: string]"),
        "{research}"
    );
    assert!(
        research.contains("hidden: triage (groups ops; states new)"),
        "{research}"
    );
    let ops = list(&["--group", "ops,research", "--state", "new"]);
    assert!(
        ops.contains("  triage (text-completion) [] -> state 'sorted'"),
        "{ops}"
    );
    assert!(ops.contains("  facts (knowledge-query)"), "{ops}");
    let later = list(&["--group", "ops", "--state", "sorted"]);
    assert!(later.contains("no tool"), "{later}");
}

/// A collection's file larger than axum's 2 MB default loads through the running aggregator's
/// endpoint (it was refused with 413, and a store an aggregator owns can be loaded no other way).
#[tokio::test]
async fn a_file_of_several_megabytes_loads_through_the_aggregator() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let file = std::env::temp_dir().join(format!("large-{}.nt", std::process::id()));
    let lines: String = (0..40_000)
        .map(|i| {
            format!(
                "<http://example.org/large/item{i}> <http://www.w3.org/2000/01/rdf-schema#label> \"item number {i} of the large collection\" .\n"
            )
        })
        .collect();
    assert!(lines.len() > 4 * 1024 * 1024, "{}", lines.len());
    std::fs::write(&file, lines).unwrap();
    let loaded = Command::new(binary("agentctl"))
        .args(["load", file.to_str().unwrap(), "--collection", "large"])
        .args(["--store", &aggregator.endpoint, "--token", TOKEN])
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(
        loaded.status.success(),
        "{}",
        String::from_utf8_lossy(&loaded.stderr)
    );
    let said = String::from_utf8_lossy(&loaded.stdout);
    assert!(said.contains("now 40000 triples"), "{said}");
}
