//! Fork and replay end to end on a real broker: `agentctl fork SESSION --from 2` with an edited
//! observation runs a new session from step 2's recorded input (step 1 is not asked again), whose
//! root records where it came from and what was changed, and `agentctl explain` shows both
//! branches; `--reuse all` replays the same step without calling the LLM or the tool again, the
//! graph saying what was reused from where.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use agent_core::vocab::SPARQL_PREFIXES;
use agent_e2e::*;
use agent_schema::AgentRequest;

const TOKEN: &str = "fork-token";

/// A three-step dialog: two tool calls (each tool answer is an LLM call of its own), then the
/// answer. The rules that follow an observation come first: a later prompt holds the earlier
/// observations too.
const ARITHMETIC: &str = r#"{"rules": [
  {"match": "Observation: 43", "reply": "Thought: That is it.\nFinal Answer: 43"},
  {"match": "Observation: 51", "reply": "Thought: That is it.\nFinal Answer: 51"},
  {"match": "Observation: 42", "reply": "Thought: Add one.\nAction: llm\nArgs: {\"question\": \"compute 42+1\"}"},
  {"match": "Observation: 50", "reply": "Thought: Add one.\nAction: llm\nArgs: {\"question\": \"compute 50+1\"}"},
  {"match": "compute 6*7", "exact": true, "reply": "42"},
  {"match": "compute 42+1", "exact": true, "reply": "43"},
  {"match": "compute 50+1", "exact": true, "reply": "51"},
  {"match": "Question: What is six times seven, plus one?", "reply": "Thought: Multiply first.\nAction: llm\nArgs: {\"question\": \"compute 6*7\"}"}
]}"#;

/// Runs `agentctl` against the aggregator's graph (and the broker, when given); what it printed.
/// It runs off the test's thread, which serves the scripted LLM meanwhile.
async fn agentctl(broker: Option<&Broker>, aggregator: &Aggregator, args: &[&str]) -> String {
    let mut command = Command::new(binary("agentctl"));
    command.args(args);
    if let Some(broker) = broker {
        command.args(["--pulsar-url", &broker.url()]);
    }
    command
        .args(["--store", &aggregator.endpoint, "--token", TOKEN])
        .env("RUST_LOG", "warn");
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .unwrap()
        .unwrap();
    assert!(
        out.status.success(),
        "agentctl {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The session id `agentctl fork` printed for the fork.
fn fork_session(said: &str) -> String {
    said.lines()
        .find_map(|l| l.split(" as session ").nth(1))
        .unwrap_or_else(|| panic!("no fork session in: {said}"))
        .trim()
        .to_owned()
}

/// Runs the three-step dialog; its session's URI.
async fn original(broker: &Broker, aggregator: &Aggregator) -> String {
    let question = AgentRequest {
        pattern: "react".into(),
        ..request("What is six times seven, plus one?", false)
    };
    ran(broker, aggregator, "original", &question, "43").await
}

/// Runs `question` as dialog `id` to its `answer`, and waits for the graph to show its end (a
/// fork reads what the graph holds); its session's URI.
async fn ran(
    broker: &Broker,
    aggregator: &Aggregator,
    id: &str,
    question: &AgentRequest,
    answer: &str,
) -> String {
    let mut client = client(broker).await;
    client.send(id, question).await.unwrap();
    let responses = collect_dialog(&mut client, id, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, answer, "{responses:#?}");
    let session = session_of(&responses);
    let concluded = format!(
        "{SPARQL_PREFIXES}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{ <{session}/final> ?p ?c }} }}"
    );
    assert!(count_reaching(&aggregator.store(), concluded, 1).await >= 1);
    session
}

fn calls_matching(llm: &scripted_llm::ScriptedLlm, text: &str) -> usize {
    llm.calls()
        .iter()
        .filter(|c| c.last_user.contains(text))
        .count()
}

#[tokio::test]
async fn a_fork_from_step_two_with_an_edited_observation_runs_from_there_and_both_branches_show() {
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, ARITHMETIC, &seed_dir(), &[]).await;
    let source = original(&broker, &aggregator).await;
    let first_questions = calls_matching(&llm, "Question: What is six times seven");
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &["fork", &source, "--from", "2", "--observation", "50"],
    )
    .await;
    assert!(said.contains("51"), "the fork's answer: {said}");
    let fork = fork_session(&said);
    // Step 1 was not run again: only steps 2 and 3 asked the LLM, and the tool once.
    let step_one_asked = llm
        .calls()
        .iter()
        .filter(|c| {
            c.last_user.contains("Question: What is six times seven")
                && !c.last_user.contains("Observation:")
        })
        .count();
    assert_eq!(step_one_asked, 1, "step 1 ran once, in the original");
    assert_eq!(
        calls_matching(&llm, "Question: What is six times seven"),
        first_questions + 2
    );
    let tool_runs = |what: &str| llm.calls().iter().filter(|c| c.last_user == what).count();
    assert_eq!(tool_runs("compute 50+1"), 1);
    assert_eq!(
        tool_runs("compute 6*7"),
        1,
        "step 1's tool ran once, in the original"
    );

    // The fork's root says where it came from and what was changed there (as the orchestrator
    // found by comparing with the recorded input), and derives from the source's step 1
    // observation; its first iteration is step 2, following the edited observation.
    let store = aggregator.store();
    let shape = format!(
        "{SPARQL_PREFIXES}SELECT ?f WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?f a tg:Fork, tg:AgentQuestion ; tg:forkedFrom <{source}> ; tg:forkedAtStep 2 ;
              tg:forkEdit \"observation of step 1\" ;
              prov:wasDerivedFrom <{source}/i1/observation> ;
              tg:query \"What is six times seven, plus one?\" .
           ?o prov:wasDerivedFrom ?f ; a tg:Observation ; tg:content \"50\" ;
              tg:forkedFrom <{source}/i1/observation> .
           ?i2 prov:wasDerivedFrom ?o ; tg:arguments ?args .
           ?i2obs prov:wasDerivedFrom ?i2 ; tg:content \"51\" .
           FILTER(CONTAINS(?args, \"compute 50+1\"))
           FILTER(STRSTARTS(STR(?f), \"urn:trustgraph:agent:{fork}\"))
        }} }}"
    );
    assert_eq!(count_reaching(&store, shape, 1).await, 1);
    let edits = format!(
        "{SPARQL_PREFIXES}SELECT ?e WHERE {{ GRAPH <urn:graph:retrieval> {{ <urn:trustgraph:agent:{fork}> tg:forkEdit ?e }} }}"
    );
    assert_eq!(
        count(&store, edits).await,
        1,
        "only the observation was changed"
    );
    // The fork's own step inputs are recorded too, so it can be forked in turn.
    let inputs = format!(
        "{SPARQL_PREFIXES}SELECT ?i WHERE {{ GRAPH <urn:graph:retrieval> {{ ?i a tg:StepInput ; tg:step ?n .
           FILTER(STRSTARTS(STR(?i), \"urn:trustgraph:agent:{fork}/input/\")) }} }}"
    );
    assert_eq!(count_reaching(&store, inputs, 2).await, 2, "steps 2 and 3");

    // The source's explain tree shows both branches; the fork's shows where it came from.
    let tree = agentctl(None, &aggregator, &["explain", &source]).await;
    assert!(
        tree.contains(&format!(
            "fork at step 2: urn:trustgraph:agent:{fork} -> answer: 51"
        )),
        "{tree}"
    );
    assert!(tree.contains("answer:  43"), "{tree}");
    let forked = agentctl(None, &aggregator, &["explain", &fork]).await;
    assert!(
        forked.contains(&format!(
            "forked from: {source} at step 2 (changed: observation of step 1)"
        )),
        "{forked}"
    );
    assert!(forked.contains("given observation 1: 50"), "{forked}");
}

/// A fork on another model (`--model`, one config names: here an `llm-model` entry): every LLM
/// call of the fork asks for it, the tool's included, and the graph names it on each call node;
/// the original ran on the orchestrator's model.
#[tokio::test]
async fn a_fork_on_another_model_asks_that_model_for_every_call() {
    let config = seed_with("fork-model", &[("llm-model", r#"{"larger-model": {}}"#)]);
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, ARITHMETIC, &config, &[]).await;
    let source = original(&broker, &aggregator).await;
    let before = llm.calls().len();
    assert!(llm.calls().iter().all(|c| c.model == "scripted"));
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &["fork", &source, "--from", "2", "--model", "larger-model"],
    )
    .await;
    assert!(said.contains("43"), "the fork's answer: {said}");
    let fork = fork_session(&said);
    let forked: Vec<String> = llm.calls()[before..]
        .iter()
        .map(|c| c.model.clone())
        .collect();
    // Step 2, its tool's own call, and step 3.
    assert_eq!(forked, ["larger-model"; 3], "{:#?}", llm.calls());
    let models = format!(
        "{SPARQL_PREFIXES}SELECT DISTINCT ?m WHERE {{ GRAPH <urn:graph:retrieval> {{ ?n tg:model ?m .
           FILTER(STRSTARTS(STR(?n), \"urn:trustgraph:agent:{fork}/\")) }} }}"
    );
    assert_eq!(
        count_reaching(&aggregator.store(), models.clone(), 1).await,
        1
    );
    let rows = aggregator.store().query(models).await.unwrap().rows();
    match rows.first("m") {
        Some(agent_graph::model::Term::Literal(m)) => assert_eq!(m.value(), "larger-model"),
        other => panic!("no model recorded: {other:?}"),
    }
}

#[tokio::test]
async fn a_replay_with_reuse_gives_recorded_answers_without_calling_again() {
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, ARITHMETIC, &seed_dir(), &[]).await;
    let source = original(&broker, &aggregator).await;
    let calls_before = llm.calls().len();
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &["fork", &source, "--from", "2", "--reuse", "all"],
    )
    .await;
    assert!(said.contains("43"), "the replay's answer: {said}");
    let replay = fork_session(&said);
    assert_eq!(
        llm.calls().len(),
        calls_before,
        "nothing was asked of the LLM again"
    );
    let store = aggregator.store();
    // Step 2's LLM call and step 3's were given from the record, and step 2's tool result too.
    let reused_calls = format!(
        "{SPARQL_PREFIXES}SELECT ?call WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?call tg:reusedFrom ?source ; tg:promptDigest ?d . ?source tg:promptDigest ?d .
           FILTER(STRSTARTS(STR(?call), \"urn:trustgraph:agent:{replay}/llm/\"))
           FILTER(STRSTARTS(STR(?source), \"{source}/llm/\")) }} }}"
    );
    assert_eq!(count_reaching(&store, reused_calls, 2).await, 2);
    let reused_tool = format!(
        "{SPARQL_PREFIXES}ASK {{ GRAPH <urn:graph:retrieval> {{
           <urn:trustgraph:agent:{replay}/i2/observation> tg:reusedFrom <{source}/i2/observation> ;
             tg:content \"43\" }} }}"
    );
    assert!(matches!(
        store.query(reused_tool).await.unwrap(),
        agent_graph::QueryAnswer::Boolean(true)
    ));
    // Nothing was charged: the replay's nodes record no tokens.
    let charged = format!(
        "{SPARQL_PREFIXES}SELECT ?n WHERE {{ GRAPH <urn:graph:retrieval> {{ ?n tg:inToken ?t .
           FILTER(?t > 0) FILTER(STRSTARTS(STR(?n), \"urn:trustgraph:agent:{replay}\")) }} }}"
    );
    assert_eq!(count(&store, charged).await, 0);
    let replayed = agentctl(None, &aggregator, &["explain", &replay]).await;
    assert!(
        replayed.contains("(changed: (none); reuses recorded all)"),
        "{replayed}"
    );

    // The whole dialog again from step 1, reusing LLM answers only: the tool is itself an LLM
    // call asking what was asked before, so nothing is asked again either.
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &["fork", &source, "--from", "1", "--reuse", "llm"],
    )
    .await;
    assert!(said.contains("43"), "the rerun's answer: {said}");
    assert_eq!(llm.calls().len(), calls_before, "still nothing asked again");
    let rerun = fork_session(&said);
    let from_the_start = format!(
        "{SPARQL_PREFIXES}ASK {{ GRAPH <urn:graph:retrieval> {{
           <urn:trustgraph:agent:{rerun}> a tg:Fork ; tg:forkedAtStep 1 ; tg:reuses \"llm\" ;
             prov:wasDerivedFrom <{source}> .
           <urn:trustgraph:agent:{rerun}/i1> tg:arguments ?a .
           <urn:trustgraph:agent:{rerun}/final> ?p ?o }} }}"
    );
    for _ in 0..50 {
        if matches!(
            store.query(from_the_start.clone()).await.unwrap(),
            agent_graph::QueryAnswer::Boolean(true)
        ) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the rerun from step 1 is not recorded as a fork of the source");
}

/// A fork asked for as soon as the source answered, while the graph does not show the source yet
/// (the aggregator that writes it is stopped): the fork waits for the source's records to show,
/// and then reuses all of them. It used to fail at once, the step "not recorded" (or, reusing,
/// called the LLM again for what the source's last steps had not shown yet).
#[tokio::test]
async fn a_fork_asked_for_on_the_answer_waits_for_its_source_to_show() {
    let broker = Broker::start().unwrap();
    let store_host = Aggregator::store_host(Place::InProcess, &broker, TOKEN, "fork-store-only");
    let writer = Aggregator::replica_on(&broker, &store_host, TOKEN);
    let llm = scripted_llm(ARITHMETIC).await;
    let _orchestrator =
        Orchestrator::journaled(Place::InProcess, &broker, &llm, &store_host, TOKEN, &[]);
    let mut client = client(&broker).await;
    writer.freeze(true);
    client
        .send(
            "lagging",
            &AgentRequest {
                pattern: "react".into(),
                ..request("What is six times seven, plus one?", false)
            },
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "lagging", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, "43", "{responses:#?}");
    let source = session_of(&responses);
    let calls_before = llm.calls().len();
    let asked = ["fork", &source, "--from", "3", "--reuse", "llm"];
    let fork = agentctl(Some(&broker), &store_host, &asked);
    let (said, ()) = tokio::join!(fork, async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        writer.freeze(false);
    });
    assert!(said.contains("43"), "the fork's answer: {said}");
    assert_eq!(
        llm.calls().len(),
        calls_before,
        "the source's last answer was reused, not asked again"
    );
}

/// A fork that reuses recordings, asked for while its source still runs (its second step's LLM
/// call takes 3 s): the fork waits for the source to end, so that the source's later answers are
/// reused rather than asked again. It used to start at once and ask them again.
#[tokio::test]
async fn a_fork_reusing_a_running_source_waits_for_it_to_end() {
    let slow = ARITHMETIC.replace(
        r#"{"match": "Observation: 42", "reply""#,
        r#"{"match": "Observation: 42", "delay_ms": 3000, "reply""#,
    );
    assert_ne!(slow, ARITHMETIC);
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &slow, &seed_dir(), &[]).await;
    let mut client = client(&broker).await;
    client
        .send(
            "running",
            &AgentRequest {
                pattern: "react".into(),
                ..request("What is six times seven, plus one?", false)
            },
        )
        .await
        .unwrap();
    let source = loop {
        let (id, response) = client.next().await.unwrap();
        let root = response.explain_id.filter(|e| {
            e.strip_prefix(agent_core::vocab::SESSION_PREFIX)
                .is_some_and(|rest| !rest.contains('/'))
        });
        if let (true, Some(root)) = (id == "running", root) {
            break root;
        }
    };
    // Step 2's input shows in the graph; its LLM call has 3 s to go.
    let store = aggregator.store();
    let mut shown = false;
    for _ in 0..100 {
        if let Ok(Ok(_)) = agent_graph::recorded::step_input(&store, &source, 2).await {
            shown = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(shown, "step 2's input of {source} never showed");
    let asked = ["fork", &source, "--from", "2", "--reuse", "llm"];
    let (said, ended) = tokio::join!(
        agentctl(Some(&broker), &aggregator, &asked),
        collect_dialog(&mut client, "running", Duration::from_secs(60))
    );
    assert_eq!(ended.unwrap().last().unwrap().content, "43");
    assert!(said.contains("43"), "the fork's answer: {said}");
    // The source's five calls (three steps, and the two tool calls, which ask the LLM too), and
    // none of the fork's.
    assert_eq!(llm.calls().len(), 5, "{:#?}", llm.calls());
}

/// A supervisor with two subagents, whose synthesis is asked after the fan-in.
const TWO_PRICES: &str = r#"{"rules": [
  {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
  {"match": "Question: price of alpha", "reply": "Thought: known.\nFinal Answer: alpha costs 1"},
  {"match": "Question: price of beta", "reply": "Thought: known.\nFinal Answer: beta costs 2"},
  {"match": "Request to answer from the subagents: Compare", "and": ["alpha costs 1", "beta costs 2"], "reply": "Alpha 1, beta 2."}
]}"#;

#[tokio::test]
async fn a_supervisor_forked_at_its_synthesis_does_not_run_its_subagents_again() {
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, TWO_PRICES, &seed_dir(), &[]).await;
    let mut client = client(&broker).await;
    client
        .send(
            "prices",
            &AgentRequest {
                pattern: "supervisor".into(),
                ..request("Compare the prices of alpha and beta", false)
            },
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "prices", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, "Alpha 1, beta 2.");
    let source = session_of(&responses);
    // The aggregator records the input it gives the supervisor after the fan-in: the last step.
    let store = aggregator.store();
    let last_input = format!(
        "{SPARQL_PREFIXES}SELECT ?n WHERE {{ GRAPH <urn:graph:retrieval> {{ ?i a tg:StepInput ; tg:step ?n .
           FILTER(STRSTARTS(STR(?i), \"{source}/input/\")) }} }} ORDER BY DESC(?n) LIMIT 1"
    );
    assert_eq!(count_reaching(&store, last_input.clone(), 1).await, 1);
    let rows = store.query(last_input).await.unwrap().rows();
    let step = match rows.first("n") {
        Some(agent_graph::model::Term::Literal(l)) => l.value().to_owned(),
        other => panic!("no step: {other:?}"),
    };
    let asked = |what: &str| {
        llm.calls()
            .iter()
            .filter(|c| c.last_user.contains(what))
            .count()
    };
    let (subagents, syntheses) = (
        asked("Question: price of"),
        asked("Request to answer from the subagents"),
    );
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &["fork", &source, "--from", &step],
    )
    .await;
    assert!(said.contains("Alpha 1, beta 2."), "{said}");
    assert_eq!(
        asked("Question: price of"),
        subagents,
        "no subagent ran again"
    );
    assert_eq!(
        asked("Request to answer from the subagents"),
        syntheses + 1,
        "the synthesis was asked again"
    );
    // Replayed from its first step reusing everything, the supervisor's split, its subagents
    // and its synthesis (which the aggregator asks for) are all given again without a call.
    let calls = llm.calls().len();
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &["fork", &source, "--from", "1", "--reuse", "all"],
    )
    .await;
    assert!(said.contains("Alpha 1, beta 2."), "{said}");
    assert_eq!(
        llm.calls().len(),
        calls,
        "a replay reusing all asked the LLM again: {:#?}",
        &llm.calls()[calls..]
    );
}

/// A long dialog's inputs are read a page at a time: asked for all at once, a fork past about 450
/// steps sent the aggregator a query text over the 32 KiB it takes from anyone without the
/// services' token, and was refused (413). Records of steps 1, 150 and 600 (each continuing the
/// one before it, across pages) are written with the token; step 600's input is rebuilt by a
/// reader without it.
#[tokio::test]
async fn a_long_dialogs_input_is_read_a_page_at_a_time() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let writer =
        agent_graph::GraphStore::open(&aggregator.endpoint, Some(TOKEN.to_owned())).unwrap();
    let session = "5e1f0c2a-7b3d-4e9f-8a6b-1c2d3e4f5a6b";
    let node = agent_core::vocab::session_uri(session);
    let request = AgentRequest {
        question: "A long one.".to_owned(),
        ..AgentRequest::default()
    };
    // A JSON literal of the request's JSON.
    let literal = serde_json::to_string(&serde_json::to_string(&request).unwrap()).unwrap();
    let records = format!(
        "{SPARQL_PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{
           <{node}/input/1> tg:step 1 ; tg:request {} .
           <{node}/input/150> tg:step 150 ; tg:request {} ;
             tg:continuesInput <{node}/input/1> ; tg:continuedSteps 0 .
           <{node}/input/600> tg:step 600 ; tg:request {} ;
             tg:continuesInput <{node}/input/150> ; tg:continuedSteps 0 . }} }}",
        literal, literal, literal
    );
    writer.update(records).await.unwrap();
    let reader = agent_graph::GraphStore::open(&aggregator.endpoint, None).unwrap();
    let input = agent_graph::recorded::step_input(&reader, session, 600)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(input.question, "A long one.");
}

/// A dialog whose one tool call was refused (its group may not use the tool), then answered
/// without it; and what the tool answers when it runs.
const REFUSED_THEN_RUN: &str = r#"{"rules": [
  {"match": "Observation: 42", "reply": "Thought: That is it.\nFinal Answer: 42"},
  {"match": "not available to this request", "reply": "Thought: No tool for it.\nFinal Answer: unknown"},
  {"match": "compute 6*7", "exact": true, "reply": "42"},
  {"match": "Question: What is six times seven?", "reply": "Thought: Multiply.\nAction: llm\nArgs: {\"question\": \"compute 6*7\"}"}
]}"#;

#[tokio::test]
async fn a_replay_runs_a_call_the_source_was_refused_rather_than_reuse_the_refusal() {
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, REFUSED_THEN_RUN, &seed_dir(), &[]).await;
    let question = AgentRequest {
        pattern: "react".into(),
        group: Some(vec!["no-such-group".into()]),
        ..request("What is six times seven?", false)
    };
    let source = ran(&broker, &aggregator, "refused", &question, "unknown").await;
    // The tool is an LLM call asking exactly this.
    let tool_calls = || {
        llm.calls()
            .iter()
            .filter(|c| c.last_user.trim() == "compute 6*7")
            .count()
    };
    assert_eq!(tool_calls(), 0, "the tool never ran");
    // Replayed with every group, reusing what was recorded: the refusal is not a result of the
    // tool, so the tool runs this time and the dialog answers from what it said.
    let said = agentctl(
        Some(&broker),
        &aggregator,
        &[
            "fork", &source, "--from", "1", "--reuse", "all", "--group", "*",
        ],
    )
    .await;
    assert!(
        said.contains("42") && !said.contains("unknown"),
        "the replay's answer: {said}"
    );
    assert_eq!(tool_calls(), 1, "the tool ran once");
    // The source's observation records the refusal as such.
    let refused = format!(
        "{SPARQL_PREFIXES}ASK {{ GRAPH <urn:graph:retrieval> {{
           <{source}/i1/observation> tg:toolOutcome \"refused\" }} }}"
    );
    assert!(matches!(
        aggregator.store().query(refused).await.unwrap(),
        agent_graph::QueryAnswer::Boolean(true)
    ));
}

/// A die rolled twice: the same tool with the same arguments (an LLM call asking the same) answers
/// 3, then 5.
const DICE: &str = r#"{"rules": [
  {"match": "Observation: 3", "and": ["Observation: 5"], "reply": "Thought: Both rolled.\nFinal Answer: 3 then 5"},
  {"match": "Observation: 3", "reply": "Thought: Once more.\nAction: llm\nArgs: {\"question\": \"roll a die\"}"},
  {"match": "roll a die", "exact": true, "replies": ["3", "5"]},
  {"match": "Question: Roll a die twice", "reply": "Thought: Roll.\nAction: llm\nArgs: {\"question\": \"roll a die\"}"}
]}"#;

/// A run that asked the same question twice and was answered differently is replayed as it ran:
/// each call is given the answer recorded at its own place (step 1's roll 3, step 2's roll 5),
/// whether the tool's result is reused or the LLM call inside it. Before, the record kept one
/// node for both of the session's calls asking "roll a die" (two answers on it, no telling which
/// step had which), and a replay gave one recorded answer to both: the replay went another way
/// and asked the LLM again.
#[tokio::test]
async fn a_question_asked_twice_is_replayed_with_each_answer_in_its_place() {
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, DICE, &seed_dir(), &[]).await;
    let question = AgentRequest {
        pattern: "react".into(),
        ..request("Roll a die twice.", false)
    };
    let source = ran(&broker, &aggregator, "dice", &question, "3 then 5").await;
    let store = aggregator.store();
    // Each call is a node of its own, with its one answer.
    let conflated = format!(
        "{SPARQL_PREFIXES}SELECT ?call WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?call tg:run <{source}> ; tg:completion ?a , ?b . FILTER(?a != ?b) }} }}"
    );
    assert_eq!(
        count(&store, conflated).await,
        0,
        "a call node with two answers"
    );
    let calls_before = llm.calls().len();

    let mut replay = String::new();
    for reuse in ["all", "llm"] {
        let said = agentctl(
            Some(&broker),
            &aggregator,
            &["fork", &source, "--from", "1", "--reuse", reuse],
        )
        .await;
        assert!(said.contains("3 then 5"), "--reuse {reuse}: {said}");
        assert_eq!(
            llm.calls().len(),
            calls_before,
            "--reuse {reuse}: nothing asked of the LLM again"
        );
        replay = fork_session(&said);
        let observed = |n: usize, text: &str| {
            format!(
                "{SPARQL_PREFIXES}ASK {{ GRAPH <urn:graph:retrieval> {{
                   <urn:trustgraph:agent:{replay}/i{n}/observation> tg:content \"{text}\" }} }}"
            )
        };
        for (n, text) in [(1, "3"), (2, "5")] {
            assert!(
                matches!(
                    store.query(observed(n, text)).await.unwrap(),
                    agent_graph::QueryAnswer::Boolean(true)
                ),
                "--reuse {reuse}: step {n} of the replay did not observe {text}"
            );
        }
    }
    // The replay reusing LLM answers ran the tool: its call at step 2 was given the answer of
    // the source's call at step 2, which said 5.
    let second_roll = format!(
        "{SPARQL_PREFIXES}SELECT ?call WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?call tg:reusedFrom ?source . ?source tg:completion ?said .
           FILTER(STRSTARTS(STR(?call), \"urn:trustgraph:agent:{replay}/llm/2/\"))
           FILTER(STRSTARTS(STR(?source), \"{source}/llm/2/\"))
           FILTER(CONTAINS(?said, '\"text\":\"5\"')) }} }}"
    );
    assert_eq!(count_reaching(&store, second_roll, 1).await, 1);
}
