//! One budget per root request, end to end on a real broker with the graph shared: subagents at
//! any depth spend from their root's `max_tokens`, `max_wall_secs` and `max_run_iterations`
//! (counted from the graph, where every LLM call is recorded with its run), every branch stops at
//! its next step once the run has crossed a budget, the supervisor answers from what exists, and
//! the graph records which budget ended each branch. A client's first message cannot bring a
//! budget of its own.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use futures::StreamExt;

use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse};

const DIALOG_TIMEOUT: Duration = Duration::from_secs(90);
const TOKEN: &str = "budget-token";

/// Three subagents that would go on forever (an unknown tool, over and over) until a limit stops
/// them; `delays`: the split's and each turn's delay in milliseconds.
/// How long a subagent's turn takes in the shared-budget tests: the bounds there assume that a
/// branch's records reach the graph within about a step of another branch's next step.
const SHARED_BUDGET_TURN_MS: u64 = 150;

fn script(split_ms: u64, turn_ms: u64) -> String {
    format!(
        r#"{{"rules": [
  {{"match": "Request to split: Spend", "reply": "[{{\"goal\": \"spend on alpha\"}}, {{\"goal\": \"spend on beta\"}}, {{\"goal\": \"spend on gamma\"}}]", "delay_ms": {split_ms}}},
  {{"match": "Question: spend on", "reply": "Thought: I will keep digging, because there is always more to find in this particular corner of the problem.\nAction: dig\nArgs: {{\"depth\": \"more\"}}", "delay_ms": {turn_ms}}},
  {{"match": "Question: loop alone", "reply": "Thought: again.\nAction: dig\nArgs: {{}}", "delay_ms": {turn_ms}}},
  {{"match": "Request to answer from the subagents: Spend", "reply": "Spent what there was."}}
]}}"#
    )
}

struct Run {
    _broker: Broker,
    _aggregator: Aggregator,
    _orchestrator: Orchestrator,
    llm: scripted_llm::ScriptedLlm,
    client: agent_bus::AgentClient,
    broker_url: String,
}

/// A broker, an aggregator and an orchestrator sharing its store; `sealed: false` runs both
/// services without a seal key (the harness gives them one otherwise).
async fn start(name: &str, limits: &str, script: &str, sealed: bool) -> Run {
    let unsealed: &[&str] = if sealed { &[] } else { &["--seal-key", ""] };
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &[&["--config-token", TOKEN][..], unsealed].concat(),
    );
    let llm = scripted_llm(script).await;
    let config = seed_with(name, &[("agent-limits", limits)]);
    let store = [
        "--graph-store",
        &aggregator.endpoint,
        "--config-token",
        TOKEN,
    ];
    let orchestrator =
        Orchestrator::spawn(&broker, &llm, &config, &[&store[..], unsealed].concat());
    let client = client(&broker).await;
    Run {
        broker_url: broker.url(),
        _broker: broker,
        _aggregator: aggregator,
        _orchestrator: orchestrator,
        llm,
        client,
    }
}

/// The subagents' agent turns, per goal.
fn turns(llm: &scripted_llm::ScriptedLlm) -> std::collections::BTreeMap<String, usize> {
    let mut turns = std::collections::BTreeMap::new();
    for call in llm.calls() {
        for goal in ["alpha", "beta", "gamma"] {
            if call
                .last_user
                .contains(&format!("Question: spend on {goal}"))
            {
                *turns.entry(goal.to_owned()).or_insert(0) += 1;
            }
        }
    }
    turns
}

/// The subagents' closing observations (their results as the client sees them).
fn subagent_results(responses: &[AgentResponse]) -> Vec<String> {
    responses
        .iter()
        .filter(|r| {
            r.message_type == "observation"
                && r.message_id.contains("-s")
                && r.message_id.ends_with("/final")
        })
        .map(|r| r.content.clone())
        .collect()
}

async fn supervise(run: &mut Run, id: &str) -> Vec<AgentResponse> {
    let request = AgentRequest {
        pattern: "supervisor".into(),
        ..request("Spend the budget three ways.", false)
    };
    run.client.send(id, &request).await.unwrap();
    collect_dialog(&mut run.client, id, DIALOG_TIMEOUT)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subagents_share_their_roots_token_budget() {
    const MAX_TOKENS: u64 = 15_000;
    let mut run = start(
        "budget-tokens",
        &format!(r#"{{"default": {{"max_tokens": {MAX_TOKENS}, "max_iterations": 40}}}}"#),
        &script(0, SHARED_BUDGET_TURN_MS),
        true,
    )
    .await;
    let responses = supervise(&mut run, "b-tokens").await;
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "Spent what there was.");
    let results = subagent_results(&responses);
    assert_eq!(results.len(), 3, "{responses:#?}");
    for result in &results {
        assert!(result.contains("(max_tokens)"), "{result}");
    }
    // What every recorded LLM call cost, per node: the graph's tokens add up to the run's.
    let t = explained(&responses);
    let mut cost: std::collections::BTreeMap<String, u64> = Default::default();
    for t in &t {
        if t.p.iri.ends_with("/inToken") || t.p.iri.ends_with("/outToken") {
            *cost.entry(t.s.iri.clone()).or_default() += t.o.value.parse::<u64>().unwrap();
        }
    }
    let total: u64 = cost.values().sum();
    let dearest = cost.values().copied().max().unwrap_or(0);
    // The supervisor answers from what exists once the budget is spent: its synthesis is not a
    // step the budget stops.
    let synthesis: u64 = cost
        .iter()
        .filter(|(node, _)| node.contains("/synthesis/"))
        .map(|(_, tokens)| tokens)
        .sum();
    let turns = turns(&run.llm);
    println!(
        "token budget: turns {turns:?}, run total {total} tokens, synthesis {synthesis}, dearest call {dearest}"
    );
    // Past the budget every branch stops at its next step: at most the step each had in flight
    // and one more begun before the others' were recorded (a branch counts its own calls
    // whether or not the graph has them yet). Budgets of their own would let each branch spend
    // MAX_TOKENS alone.
    assert!(synthesis > 0, "no synthesis recorded: {cost:?}");
    assert!(
        total - synthesis <= MAX_TOKENS + 2 * 3 * dearest,
        "the run spent {total} tokens of {MAX_TOKENS} ({synthesis} on the synthesis); the dearest call cost {dearest}"
    );
    assert!(total < 2 * MAX_TOKENS, "the run spent {total} tokens");
    assert_eq!(
        last.in_token.unwrap_or(0) + last.out_token.unwrap_or(0),
        total,
        "the closing answer's totals are the graph's"
    );
    // The graph says which budget ended each branch, and the run's total then.
    let spent: Vec<_> = t
        .iter()
        .filter(|t| t.p.iri.ends_with("budgetSpent"))
        .map(|t| t.o.value.clone())
        .collect();
    assert_eq!(spent, ["max_tokens"; 3], "{spent:?}");
    for t in t.iter().filter(|t| t.p.iri.ends_with("runTokens")) {
        assert!(t.o.value.parse::<u64>().unwrap() >= MAX_TOKENS, "{t:?}");
    }
}

/// Three subagents that would loop to their own `max_iterations` (40 each, 120 in all) stop
/// together at the run's `max_run_iterations`, counted from the graph, where each branch sees
/// its siblings' LLM calls; each branch's result and the graph say which limit ended it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subagents_share_their_roots_iteration_budget() {
    const MAX_RUN_ITERATIONS: usize = 12;
    let mut run = start(
        "budget-iterations",
        &format!(
            r#"{{"default": {{"max_run_iterations": {MAX_RUN_ITERATIONS}, "max_tokens": 0, "max_iterations": 40}}}}"#
        ),
        &script(0, SHARED_BUDGET_TURN_MS),
        true,
    )
    .await;
    let responses = supervise(&mut run, "b-iterations").await;
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    assert_eq!(last.content, "Spent what there was.");
    let results = subagent_results(&responses);
    assert_eq!(results.len(), 3, "{responses:#?}");
    for result in &results {
        assert!(result.contains("(max_run_iterations)"), "{result}");
    }
    let turns = turns(&run.llm);
    let total: usize = turns.values().sum();
    println!("iteration budget: turns {turns:?}, {total} in all");
    // Past the budget every branch stops at its next step: at most the step each had in flight
    // and one more begun before the others' were recorded. The split is one of the run's.
    assert!(
        total < MAX_RUN_ITERATIONS + 2 * 3,
        "the subagents took {total} turns: {turns:?}"
    );
    let spent: Vec<_> = explained(&responses)
        .iter()
        .filter(|t| t.p.iri.ends_with("budgetSpent"))
        .map(|t| t.o.value.clone())
        .collect();
    assert_eq!(spent, ["max_run_iterations"; 3], "{spent:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subagents_share_their_roots_wall_clock() {
    // The split alone takes 2 of the 3 seconds; each turn takes 0.7 s.
    let mut run = start(
        "budget-wall",
        r#"{"default": {"max_wall_secs": 3, "max_tokens": 0, "max_iterations": 10}}"#,
        &script(2_000, 700),
        true,
    )
    .await;
    let responses = supervise(&mut run, "b-wall").await;
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}");
    for result in subagent_results(&responses) {
        assert!(result.contains("(max_wall_secs)"), "{result}");
    }
    let turns = turns(&run.llm);
    println!("wall budget: turns {turns:?}");
    // With a clock of their own each would take 3 / 0.7 = 5 turns.
    for (goal, n) in &turns {
        assert!(*n <= 2, "{goal} took {n} turns: {turns:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cannot_bring_its_own_budget() {
    let mut run = start(
        "budget-forged",
        r#"{"default": {"max_wall_secs": 2, "max_tokens": 2000, "max_iterations": 10, "max_outage_secs": 4}}"#,
        &script(0, 500),
        true,
    )
    .await;
    // A first message that claims to have started far in the future and spent nothing.
    let bus = agent_bus::Bus::connect(&run.broker_url, None)
        .await
        .unwrap();
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let requests = agent_bus::Publisher::new(&bus, &topics.request)
        .await
        .unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let future = now_ms + 1_000_000_000;
    let properties: agent_bus::Properties = [
        ("id", "forged"),
        ("agent-started-ms", &future.to_string()),
        ("agent-in-token", "0"),
        ("agent-out-token", "0"),
        ("agent-run-tokens", "0"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let question = AgentRequest {
        pattern: "react".into(),
        ..request("loop alone", false)
    };
    requests
        .send(agent_schema::encode(&question), &properties)
        .await
        .unwrap();
    let responses = collect_dialog(&mut run.client, "forged", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(
        last.content.contains("(max_wall_secs)") || last.content.contains("(max_tokens)"),
        "the forged start was believed: {}",
        last.content
    );
    let turns = run
        .llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Question: loop alone"))
        .count();
    assert!(turns < 10, "{turns} turns: the budget did not bind");

    // A first message that claims to be a subagent of a fan-out nobody recorded is refused (once
    // the fan-out has had the outage window to appear), and its refusal goes to its sender, not
    // into anyone's fan-in.
    let mut injected = request("Spend on nothing", false);
    injected.parent_session_id = "someone-else".into();
    injected.correlation_id = "someone-else-f1".into();
    injected.session_id = "someone-else-f1-s0".into();
    run.client.send("injected", &injected).await.unwrap();
    let responses = collect_dialog(&mut run.client, "injected", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let error = responses.last().unwrap().error.clone().expect("a refusal");
    assert!(
        error.message.contains("without this service's seal"),
        "{error:?}"
    );
}

/// Without seal keys, the graph vouches for a subagent: a supervisor's subagents run (their
/// fan-out is in the graph), and a request naming a fan-out the graph never holds is refused once
/// the outage window has given the aggregator time to catch up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_seal_keys_the_graph_vouches_for_subagents() {
    let mut run = start(
        "budget-unsealed",
        r#"{"default": {"max_tokens": 3000, "max_outage_secs": 4}}"#,
        &script(0, 0),
        false,
    )
    .await;
    let client = &mut run.client;
    let supervised = AgentRequest {
        pattern: "supervisor".into(),
        ..request("Spend the budget three ways.", false)
    };
    client.send("u-1", &supervised).await.unwrap();
    let responses = collect_dialog(client, "u-1", DIALOG_TIMEOUT).await.unwrap();
    assert_eq!(responses.last().unwrap().content, "Spent what there was.");
    assert_eq!(subagent_results(&responses).len(), 3, "{responses:#?}");

    let mut injected = request("Spend on nothing", false);
    injected.parent_session_id = "someone-else".into();
    injected.correlation_id = "someone-else-f1".into();
    injected.session_id = "someone-else-f1-s0".into();
    client.send("injected", &injected).await.unwrap();
    let responses = collect_dialog(client, "injected", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let error = responses.last().unwrap().error.clone().expect("a refusal");
    assert!(error.message.contains("did not record"), "{error:?}");
}

/// A sealed subagent start copied off the request topic and sent again with another question and
/// every tool group is refused: the seal covers the whole message, not only who the subagent is
/// and what it inherits. Until 2026-12-02 the copy verified, ran under its supervisor's budget
/// with the tools its sender chose, and its completion could join the fan-in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_subagent_start_edited_on_its_way_is_refused() {
    let mut run = start(
        "budget-edited",
        r#"{"default": {"max_iterations": 2, "max_tokens": 0}}"#,
        &script(0, 0),
        true,
    )
    .await;
    let responses = supervise(&mut run, "b-edited").await;
    assert!(responses.last().unwrap().error.is_none(), "{responses:#?}");
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let mut requests = read_from_start(&run._broker, &topics.request, "test-copy").await;
    let (mut start, properties) = loop {
        let message = tokio::time::timeout(Duration::from_secs(10), requests.next())
            .await
            .expect("a subagent's start on the request topic")
            .unwrap()
            .unwrap();
        let request: AgentRequest = serde_json::from_slice(&message.payload.data).unwrap();
        let properties: agent_bus::Properties = message
            .metadata()
            .properties
            .iter()
            .map(|kv| (kv.key.clone(), kv.value.clone()))
            .collect();
        if !request.parent_session_id.is_empty()
            && request.history.is_empty()
            && properties.contains_key(agent_bus::seal::SEAL_PROPERTY)
        {
            break (request, properties);
        }
    };
    start.question = "spend on exfiltration".into();
    start.subagent_goal = "spend on exfiltration".into();
    start.group = Some(vec!["*".into()]);
    let bus = agent_bus::Bus::connect(&run.broker_url, None)
        .await
        .unwrap();
    agent_bus::Publisher::new(&bus, &topics.request)
        .await
        .unwrap()
        .send(agent_schema::encode(&start), &properties)
        .await
        .unwrap();
    let refused = collect_dialog(&mut run.client, "b-edited", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let error = refused.last().unwrap().error.clone().expect("a refusal");
    assert!(
        error.message.contains("without this service's seal"),
        "{error:?}"
    );
    let ran = run
        .llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("exfiltration"))
        .count();
    assert_eq!(ran, 0, "the edited copy ran");
}
