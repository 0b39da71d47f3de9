//! More patterns end to end on a real broker, each chosen by the meta-router from config and its
//! provenance checked by SPARQL. The LLM-as-router: one constrained choice, no reasoning loop; it
//! hands a request to a tool (whose answer is the dialog's answer) or to another pattern (which
//! runs it as its first iteration). Reflexion: ReACT with a self-critique after each action, whose
//! lesson the next step is given.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_e2e::*;

const TOKEN: &str = "llm-router-token";

const SCRIPT: &str = r#"{"rules": [
  {"match": "Request to classify: ", "reply": "{\"choice\": \"general\", \"rationale\": \"plain\"}"},
  {"match": "Request to work on: ", "reply": "{\"choice\": \"llm-router\", \"rationale\": \"one step will do\"}"},
  {"match": "Request to route: What is two plus two?", "reply": "{\"choice\": \"tool:llm\", \"rationale\": \"a single lookup\", \"arguments\": {\"question\": \"2+2\"}}"},
  {"match": "Request to route: Explain why the sky is blue.", "reply": "{\"choice\": \"pattern:react\", \"rationale\": \"needs reasoning\"}"},
  {"match": "2+2", "exact": true, "reply": "4"},
  {"match": "Question: Explain why the sky is blue.", "reply": "Thought: I know this.\nFinal Answer: Rayleigh scattering."}
]}"#;

fn config() -> std::path::PathBuf {
    config_dir(
        "llm-router",
        &[
            (
                "agent-task-type",
                r#"{"general": {"description": "anything", "valid_patterns": ["react", "llm-router"]}}"#,
            ),
            (
                "agent-pattern",
                r#"{"react": {"description": "reason and act"}, "llm-router": {"description": "one choice"}}"#,
            ),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask the LLM", "type": "text-completion", "arguments": [{"name": "question", "type": "string", "description": "the question"}]}}"#,
            ),
        ],
    )
}

#[tokio::test]
async fn the_meta_router_chooses_the_llm_router_which_hands_requests_to_a_tool_or_a_pattern() {
    let config = config();
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, SCRIPT, &config, &[]).await;
    let mut client = client(&broker).await;
    client
        .send("sum", &request("What is two plus two?", false))
        .await
        .unwrap();
    client
        .send("sky", &request("Explain why the sky is blue.", true))
        .await
        .unwrap();
    let mut both = collect_dialogs(&mut client, &["sum", "sky"], Duration::from_secs(60)).await;
    let (sum, sky) = (both.remove("sum").unwrap(), both.remove("sky").unwrap());
    assert_eq!(sum.last().unwrap().content, "4", "{sum:#?}");
    assert_eq!(text_of(&sky, "answer"), "Rayleigh scattering.", "{sky:#?}");
    // No reasoning loop for the tool: the ReACT prompt was never asked for it.
    assert!(!llm
        .calls()
        .iter()
        .any(|c| c.last_user.contains("Question: What is two plus two?")));

    let store = aggregator.store();
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let (sum_session, sky_session) = (session_of(&sum), session_of(&sky));
    // The tool: the meta-router's choice, then the dispatch decision with every candidate, then
    // the tool call derived from it, its observation and the conclusion.
    let to_tool = format!(
        "{prefixes}SELECT ?d WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{sum_session}/pattern-decision> tg:pattern \"llm-router\" ; tg:patternMethod \"llm\" ;
             tg:patternCandidate \"react\", \"llm-router\" .
           ?d a tg:DispatchDecision ; prov:wasDerivedFrom <{sum_session}/pattern-decision> ;
              tg:dispatch \"tool:llm\" ; tg:dispatchMethod \"llm\" ; tg:dispatchRationale \"a single lookup\" ;
              tg:dispatchCandidate \"tool:llm\", \"pattern:react\" ;
              tg:arguments \"{{\\\"question\\\":\\\"2+2\\\"}}\" .
           <{sum_session}/i1> prov:wasDerivedFrom ?d ; tg:action \"llm\" .
           <{sum_session}/i1/observation> tg:content \"4\" .
           <{sum_session}/final> prov:wasDerivedFrom <{sum_session}/i1/observation> ; tg:terminationReason \"answer\" .
           FILTER(?d = <{sum_session}/dispatch>)
        }} }}"
    );
    assert_eq!(count_reaching(&store, to_tool, 1).await, 1);
    // The pattern: the dispatch decision, then ReACT's own first iteration and conclusion.
    let to_pattern = format!(
        "{prefixes}SELECT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{sky_session}/dispatch> tg:dispatch \"pattern:react\" ; tg:dispatchCandidate ?c .
           <{sky_session}/final> tg:terminationReason \"answer\" ; tg:document ?a . ?a tg:content \"Rayleigh scattering.\"
        }} }}"
    );
    // Every candidate offered: the tool and the one other pattern config defines.
    assert_eq!(count_reaching(&store, to_pattern, 2).await, 2);
    // The explain tree shows the choice.
    let tree = explain_tree(&store, &sum_session).await;
    assert!(tree.contains("dispatched: tool:llm (llm)"), "{tree}");
    assert!(
        tree.contains("offered:   pattern:react, tool:llm"),
        "{tree}"
    );
    // Every node of both dialogs reaches its session.
    for session in [&sum_session, &sky_session] {
        assert_eq!(
            unreachable_nodes(&store, session).await,
            Vec::<String>::new()
        );
    }
}

/// A tool's model that stops at its length limit gave half a reply: the router does not give it as
/// the dialog's answer. The tool failed, saying what it wrote, and ReACT goes on from there.
#[tokio::test]
async fn the_llm_router_does_not_answer_with_a_tool_reply_cut_at_the_length_limit() {
    let script = r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"general\", \"rationale\": \"plain\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"llm-router\", \"rationale\": \"one step will do\"}"},
      {"match": "Request to route: Name the planets.", "reply": "{\"choice\": \"tool:llm\", \"rationale\": \"a single lookup\", \"arguments\": {\"question\": \"planets?\"}}"},
      {"match": "planets?", "exact": true, "reply": "Mercury, Venus, Earth, Mars, Jupiter, Saturn, Uranus and Neptune.", "faults": ["length"]},
      {"match": "was cut off at the model's length limit before it ended; what it wrote: Mercury", "reply": "Thought: The list was cut short; I know the rest.\nFinal Answer: The eight planets, Mercury to Neptune."}
    ]}"#;
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, script, &config(), &[]).await;
    let mut client = client(&broker).await;
    client
        .send("planets", &request("Name the planets.", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "planets", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        responses.last().unwrap().content,
        "The eight planets, Mercury to Neptune.",
        "{responses:#?}"
    );
    assert_eq!(
        llm.calls()
            .iter()
            .filter(|c| c.fault.as_deref() == Some("length"))
            .count(),
        1
    );
    // Recorded as the failed call it was, and the answer came after it.
    let session = session_of(&responses);
    let failed = format!(
        "{}SELECT ?o WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{session}/i1> tg:action \"llm\" .
           <{session}/i1/observation> tg:content ?o .
           FILTER(STRSTARTS(?o, \"Error: the reply of the tool 'llm' was cut off\"))
           <{session}/final> tg:terminationReason \"answer\" ;
             prov:wasDerivedFrom+ <{session}/i1/observation> .
        }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    assert_eq!(count_reaching(&aggregator.store(), failed, 1).await, 1);
}

#[tokio::test]
async fn reflexion_reflects_after_each_action_and_the_next_step_is_given_the_lesson() {
    let script = r#"{"rules": [
      {"match": "Its steps so far:", "reply": "Check the answer against a second source."},
      {"match": "Reflection: Check the answer against a second source.", "reply": "Thought: Confirmed twice.\nFinal Answer: William Shakespeare."},
      {"match": "author of Hamlet?", "exact": true, "reply": "Shakespeare"},
      {"match": "Request to classify: ", "reply": "{\"choice\": \"research\", \"rationale\": \"a fact with a source\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"reflexion\", \"rationale\": \"worth checking\"}"},
      {"match": "Question: Who wrote Hamlet?", "reply": "Thought: Look it up.\nAction: llm\nArgs: {\"question\": \"author of Hamlet?\"}"}
    ]}"#;
    let Stack {
        broker,
        aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, script, &seed_dir(), &[]).await;
    let mut client = client(&broker).await;
    client
        .send("hamlet", &request("Who wrote Hamlet?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "hamlet", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        responses.last().unwrap().content,
        "William Shakespeare.",
        "{responses:#?}"
    );
    // The step after the reflection was given its lesson.
    assert!(llm.calls().iter().any(|c| c.last_user.contains(
        "Observation: Shakespeare\nReflection: Check the answer against a second source."
    )));
    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let dag = format!(
        "{prefixes}ASK {{ GRAPH <urn:graph:retrieval> {{
           <{session}/pattern-decision> tg:pattern \"reflexion\" ; tg:taskType \"research\" ;
             tg:patternCandidate \"react\", \"plan-then-execute\", \"reflexion\", \"deep-research\" .
           <{session}/i1> a tg:ToolUse ; tg:action \"llm\" .
           <{session}/i2> a tg:Critique ; tg:action \"reflect\" ;
             tg:lesson \"Check the answer against a second source.\" ;
             prov:wasDerivedFrom <{session}/i1/observation> .
           <{session}/final> prov:wasDerivedFrom <{session}/i2/observation> ; tg:terminationReason \"answer\" }} }}"
    );
    let store = aggregator.store();
    assert!(
        holds_within(&store, dag).await,
        "the reflection is not in the graph as expected: {responses:#?}"
    );
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
}

/// The ensemble, chosen by the meta-router for a risk assessment: the same question to one agent
/// per built-in perspective, side by side, then one reconciliation that says where they agreed and
/// disagreed, recorded on its synthesis node.
#[tokio::test]
async fn an_ensemble_asks_independent_agents_and_reconciles_where_they_agree_and_disagree() {
    let script = r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"risk-assessment\", \"rationale\": \"what could go wrong\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"ensemble\", \"rationale\": \"a judgement call\"}"},
      {"match": "Question to reconcile: Is it safe to migrate our database this weekend?", "and": ["Safe with a backup.", "Risky: the window is short.", "Safe if the backup is verified."], "reply": "{\"agreed\": [\"a backup must come first\"], \"disagreed\": [\"whether the window is long enough\"], \"answer\": \"Safe only with a verified backup; the window may be too short.\"}"},
      {"match": "Take the direct route", "reply": "Thought: direct.\nFinal Answer: Safe with a backup.", "delay_ms": 600},
      {"match": "Be a skeptic", "reply": "Thought: doubtful.\nFinal Answer: Risky: the window is short.", "delay_ms": 600},
      {"match": "Reason from first principles", "reply": "Thought: stepwise.\nFinal Answer: Safe if the backup is verified.", "delay_ms": 600}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send(
            "ensemble",
            &request("Is it safe to migrate our database this weekend?", false),
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "ensemble", Duration::from_secs(60))
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert_eq!(
        last.content, "Safe only with a verified backup; the window may be too short.",
        "{responses:#?}"
    );
    assert_eq!(responses.iter().filter(|r| r.end_of_dialog).count(), 1);
    assert!(
        responses.iter().any(|r| {
            r.message_type == "observation"
            && r.content
                == "Agreed: a backup must come first\nDisagreed: whether the window is long enough"
        }),
        "{responses:#?}"
    );
    // Every call matched its rule (each agent was told its perspective), and the agents overlapped.
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    assert_eq!(calls.len(), 6, "{calls:#?}");
    assert!(
        llm.max_concurrent() >= 2,
        "the agents ran one after another"
    );

    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let store = aggregator.store();
    let reconciled = format!(
        "{prefixes}SELECT DISTINCT ?c WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{session}/pattern-decision> tg:pattern \"ensemble\" ; tg:taskType \"risk-assessment\" ;
             tg:patternCandidate \"supervisor\", \"plan-then-execute\", \"react\", \"ensemble\" .
           ?r a tg:Reconciliation, tg:Synthesis ; tg:reconciliationRead true ;
             tg:agreement \"a backup must come first\" ;
             tg:disagreement \"whether the window is long enough\" ;
             prov:wasDerivedFrom ?c, ?f .
           ?c a tg:SubagentCompletion .
           ?f a tg:FanOut ; prov:wasDerivedFrom+ <{session}> .
           <{session}/final> prov:wasDerivedFrom ?r ; tg:terminationReason \"answer\" }} }}"
    );
    assert_eq!(count_reaching(&store, reconciled, 3).await, 3);
    // Each LLM call (routing, the agents', the reconciliation) is counted once, on one node.
    let total = last.in_token.unwrap_or(0) + last.out_token.unwrap_or(0);
    assert_graph_tokens(&store, &session, total).await;
    // Every node of the dialog reaches its session.
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
    let tree = explain_tree(&store, &session).await;
    assert!(
        tree.contains("agreed: a backup must come first")
            && tree.contains("disagreed: whether the window is long enough"),
        "{tree}"
    );
}

/// Deep research, chosen by the meta-router for a research request: a round checks what is unknown
/// and runs two lookups side by side, the next round finds the research complete, the writer
/// answers from the numbered notes, and the judge accepts it. Each round, call and note is in the
/// graph.
#[tokio::test]
async fn deep_research_runs_rounds_of_parallel_lookups_then_writes_and_is_judged() {
    let script = r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"research\", \"rationale\": \"facts with sources\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"deep-research\", \"rationale\": \"several lookups\"}"},
      {"match": "Request to research: What do alpha and beta cost?", "and": ["(no notes yet)"], "reply": "{\"thought\": \"Both prices are unknown.\", \"complete\": false, \"gaps\": [\"price of alpha\", \"price of beta\"], \"calls\": [{\"tool\": \"llm\", \"arguments\": {\"question\": \"price of alpha?\"}}, {\"tool\": \"llm\", \"arguments\": {\"question\": \"price of beta?\"}}]}"},
      {"match": "Request to research: What do alpha and beta cost?", "and": ["[1] llm(", "alpha costs 3", "[2] llm(", "beta costs 4"], "reply": "{\"thought\": \"Both known.\", \"complete\": true, \"gaps\": []}"},
      {"match": "price of alpha?", "exact": true, "reply": "alpha costs 3", "delay_ms": 600},
      {"match": "price of beta?", "exact": true, "reply": "beta costs 4", "delay_ms": 600},
      {"match": "Request to write up: What do alpha and beta cost?", "and": ["[1] llm(", "[2] llm("], "reply": "Alpha costs 3 [1] and beta costs 4 [2]."},
      {"match": "Review a draft answer", "and": ["Alpha costs 3 [1] and beta costs 4 [2]."], "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"cites both notes\"}"}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("research", &request("What do alpha and beta cost?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "research", Duration::from_secs(60))
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert_eq!(
        last.content, "Alpha costs 3 [1] and beta costs 4 [2].",
        "{responses:#?}"
    );
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    // Routing (2), two rounds, two lookups, the writer and the judge: each once.
    for rule in 0..8 {
        assert_eq!(
            calls.iter().filter(|c| c.rule == Some(rule)).count(),
            1,
            "rule {rule}: {calls:#?}"
        );
    }
    assert!(
        llm.max_concurrent() >= 2,
        "the round's lookups ran one after another"
    );

    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let dag = format!(
        "{prefixes}ASK {{ GRAPH <urn:graph:retrieval> {{
           <{session}/pattern-decision> tg:pattern \"deep-research\" ; tg:taskType \"research\" ;
             tg:patternCandidate \"react\", \"plan-then-execute\", \"reflexion\", \"deep-research\" .
           <{session}/i1> a tg:ResearchRound ; tg:researchComplete false ;
             tg:gap \"price of alpha\", \"price of beta\" .
           <{session}/i1/call/1> a tg:ToolUse ; tg:action \"llm\" ; tg:toolOutcome \"ok\" ; tg:note 1 ;
             prov:wasDerivedFrom <{session}/i1> .
           <{session}/i1/call/2> tg:note 2 .
           <{session}/i2> a tg:ResearchRound ; tg:researchComplete true ;
             prov:wasDerivedFrom <{session}/i1/observation> .
           <{session}/i3> a tg:Synthesis ; prov:wasDerivedFrom <{session}/i2/observation> .
           <{session}/i4> a tg:Evaluation ; tg:evaluationStatus \"SUCCESS\" .
           <{session}/final> tg:terminationReason \"answer\" }} }}"
    );
    let store = aggregator.store();
    assert!(
        holds_within(&store, dag).await,
        "the research is not in the graph as expected: {responses:#?}"
    );
    // Every node of the dialog (rounds, calls, draft, review, answer) reaches its session.
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
}

/// Deep research whose first round brought back a long note (checked in as a document, so the
/// messages after it carry an excerpt) and three more rounds after it: the writer and the judge
/// still read that note whole. Until 2026-12-04 the writer saw only the newest three steps' notes
/// whole and the judge every note as its excerpt, so a claim from past the excerpt's first
/// kilobyte could not be checked against what the lookup really returned.
#[tokio::test]
async fn deep_researchs_writer_and_judge_read_an_old_long_note_whole() {
    let filler = "more about alpha ".repeat(400);
    let long_note = format!("alpha costs 3. {filler}The alpha price was set in 2019.");
    let round = |calls: &str, complete: bool| {
        format!(
            r#"{{\"thought\": \"next\", \"complete\": {complete}, \"gaps\": [], \"calls\": [{calls}]}}"#
        )
    };
    let call =
        |q: &str| format!(r#"{{\"tool\": \"llm\", \"arguments\": {{\"question\": \"{q}\"}}}}"#);
    let script = format!(
        r#"{{"rules": [
      {{"match": "Request to classify: ", "reply": "{{\"choice\": \"research\", \"rationale\": \"facts\"}}"}},
      {{"match": "Request to work on: ", "reply": "{{\"choice\": \"deep-research\", \"rationale\": \"lookups\"}}"}},
      {{"match": "Request to research: What do alpha, beta and gamma cost?", "replies": ["{r1}", "{r2}", "{r3}", "{r4}"]}},
      {{"match": "price of alpha?", "exact": true, "reply": "{long_note}"}},
      {{"match": "price of beta?", "exact": true, "reply": "beta costs 4"}},
      {{"match": "price of gamma?", "exact": true, "reply": "gamma costs 5"}},
      {{"match": "Request to write up: What do alpha, beta and gamma cost?", "and": ["[3] llm(", "The alpha price was set in 2019."], "reply": "Alpha costs 3 since 2019 [1], beta 4 [2], gamma 5 [3]."}},
      {{"match": "Review a draft answer", "and": ["Alpha costs 3 since 2019 [1]", "The alpha price was set in 2019."], "reply": "{{\"status\": \"SUCCESS\", \"evaluation\": \"every claim is in a note\"}}"}}
    ]}}"#,
        r1 = round(&call("price of alpha?"), false),
        r2 = round(&call("price of beta?"), false),
        r3 = round(&call("price of gamma?"), false),
        r4 = round("", true),
    );
    // With a graph store, as deployed: long texts are checked in as documents there.
    let Stack {
        broker,
        aggregator: _aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &script, &seed_dir(), &[]).await;
    let mut client = client(&broker).await;
    client
        .send(
            "research-long",
            &request("What do alpha, beta and gamma cost?", false),
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "research-long", Duration::from_secs(60))
        .await
        .unwrap();
    let calls = llm.calls();
    assert_eq!(
        responses.last().map(|r| r.content.as_str()),
        Some("Alpha costs 3 since 2019 [1], beta 4 [2], gamma 5 [3]."),
        "{responses:#?}\n{calls:#?}"
    );
    // The round's note was long enough to travel as an excerpt (else this shows nothing).
    assert!(long_note.len() > agent_core::documents::CHECK_IN_OVER);
    // Routing (2), four rounds, three lookups, the writer and the judge; nothing unanswered.
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    assert_eq!(calls.iter().filter(|c| c.rule == Some(2)).count(), 4);
    for rule in [6, 7] {
        assert_eq!(calls.iter().filter(|c| c.rule == Some(rule)).count(), 1);
    }
}

/// An ensemble none of whose agents answered (each agent's LLM call fails) ends with an error
/// that says so, and the reconciliation is never asked: until 2026-12-02 the failures were handed
/// to it as the agents' positions, and its reply came back as the ensemble's answer.
#[tokio::test]
async fn an_ensemble_whose_agents_all_failed_ends_with_an_error_not_a_reconciled_answer() {
    // No rule answers the agents (each of their calls gets HTTP 400, and each agent fails).
    let script = r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"risk-assessment\", \"rationale\": \"what could go wrong\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"ensemble\", \"rationale\": \"a judgement call\"}"},
      {"match": "Question to reconcile: ", "reply": "{\"agreed\": [\"everything\"], \"disagreed\": [], \"answer\": \"All agents agree it is safe.\"}"}
    ]}"#;
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send(
            "ensemble-failed",
            &request("Is it safe to migrate our database this weekend?", false),
        )
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "ensemble-failed", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        outcome(&responses),
        "error: None of the ensemble's 3 agents gave an answer (each failed, timed out or was cancelled), so there is nothing to reconcile.",
        "{responses:#?}"
    );
    assert_eq!(responses.iter().filter(|r| r.end_of_dialog).count(), 1);
    assert!(
        llm.calls()
            .iter()
            .all(|c| !c.last_user.contains("Question to reconcile")),
        "the reconciliation was asked"
    );
}

/// An ensemble that debates (`debate_rounds: 1`): after the first round every agent is sent out
/// again, shown all the answers of that round, and may revise its own; only the revised answers
/// are reconciled. The round that was debated is closed by a synthesis node, and the debate's
/// fan-out derives from it.
#[tokio::test]
async fn an_ensemble_debates_a_round_then_reconciles_the_revised_answers() {
    // Rules are tried in order: a debate prompt also names the agent's perspective, so the
    // debate's rules come before the first round's.
    let script = r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"risk-assessment\", \"rationale\": \"weigh it\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"ensemble\", \"rationale\": \"opinions differ\"}"},
      {"match": "Question to reconcile: Should we ship on Friday?", "and": ["Yes, with a rollback plan.", "Acceptable with a rollback plan."], "reply": "{\"agreed\": [\"a rollback plan is needed\"], \"disagreed\": [], \"answer\": \"Ship on Friday with a rollback plan.\"}"},
      {"match": "You are agent 1.", "and": ["Agent 1 (Be an optimist.): Yes, go ahead.", "Agent 2 (Be a pessimist.): No: too risky."], "reply": "Thought: the risk is real.\nFinal Answer: Yes, with a rollback plan."},
      {"match": "You are agent 2.", "and": ["Agent 1 (Be an optimist.): Yes, go ahead.", "Agent 2 (Be a pessimist.): No: too risky."], "reply": "Thought: a rollback plan answers my worry.\nFinal Answer: Acceptable with a rollback plan."},
      {"match": "Be an optimist.", "reply": "Thought: fine.\nFinal Answer: Yes, go ahead."},
      {"match": "Be a pessimist.", "reply": "Thought: Fridays go wrong.\nFinal Answer: No: too risky."}
    ]}"#;
    let patterns: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(seed_dir().join("agent-pattern.json")).unwrap(),
    )
    .unwrap();
    let mut patterns = patterns;
    patterns["ensemble"]["perspectives"] =
        serde_json::json!(["Be an optimist.", "Be a pessimist."]);
    patterns["ensemble"]["debate_rounds"] = 1.into();
    let config = seed_with("debate", &[("agent-pattern", &patterns.to_string())]);
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("debate", &request("Should we ship on Friday?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "debate", Duration::from_secs(60))
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert_eq!(
        last.content, "Ship on Friday with a rollback plan.",
        "{responses:#?}"
    );
    assert_eq!(responses.iter().filter(|r| r.end_of_dialog).count(), 1);
    // Routing (2), the first round (2), the debate (2) and one reconciliation: each rule once,
    // every call matched (each debating agent saw both answers of the first round).
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    for rule in 0..7 {
        assert_eq!(
            calls.iter().filter(|c| c.rule == Some(rule)).count(),
            1,
            "rule {rule}: {calls:#?}"
        );
    }

    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let store = aggregator.store();
    let debated = format!(
        "{prefixes}ASK {{ GRAPH <urn:graph:retrieval> {{
           <{session}/pattern-decision> tg:pattern \"ensemble\" ; tg:patternCandidate \"ensemble\" .
           ?first a tg:FanOut ; tg:expectedSiblings 2 ; prov:wasDerivedFrom+ <{session}> .
           ?closed a tg:Synthesis ; prov:wasDerivedFrom ?c1 .
           ?c1 a tg:SubagentCompletion ; tg:correlationId ?cid1 .
           ?first tg:correlationId ?cid1 .
           ?debate a tg:FanOut ; tg:expectedSiblings 2 ; prov:wasDerivedFrom ?closed ;
             tg:correlationId ?cid2 .
           ?r a tg:Reconciliation, tg:Synthesis ; tg:agreement \"a rollback plan is needed\" ;
             prov:wasDerivedFrom ?c2 .
           ?c2 a tg:SubagentCompletion ; tg:correlationId ?cid2 .
           <{session}/final> prov:wasDerivedFrom ?r ; tg:terminationReason \"answer\" .
           FILTER (?cid1 != ?cid2) }} }}"
    );
    assert!(
        holds_within(&store, debated).await,
        "the debate is not in the graph as expected: {responses:#?}"
    );
    let total = last.in_token.unwrap_or(0) + last.out_token.unwrap_or(0);
    assert_graph_tokens(&store, &session, total).await;
    assert_eq!(
        unreachable_nodes(&store, &session).await,
        Vec::<String>::new()
    );
}

/// A debate tells each agent every agent's answer of the round before, in that agent's own
/// request: the supervisor's record of the round keeps the perspectives, not the answers once per
/// agent. Until 2026-12-04 it kept them in every goal, twice over, so each debate round added
/// agents x answers x 2 to every later message, and a debate of long answers ended with the
/// dialog's history over `max_message_bytes` after every agent had run.
#[tokio::test]
async fn an_ensembles_debate_of_long_answers_stays_within_the_message_limit() {
    let long = |who: &str| format!("{who}: {}", "a long considered argument ".repeat(400));
    let script = serde_json::json!({"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"risk-assessment\", \"rationale\": \"weigh it\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"ensemble\", \"rationale\": \"opinions differ\"}"},
      {"match": "Question to reconcile: Should we ship on Friday?", "reply": "{\"agreed\": [\"it can wait\"], \"disagreed\": [], \"answer\": \"Ship on Monday.\"}"},
      {"match": "You are agent 1.", "reply": format!("Thought: still.\nFinal Answer: {}", long("optimist revised"))},
      {"match": "You are agent 2.", "reply": format!("Thought: still.\nFinal Answer: {}", long("pessimist revised"))},
      {"match": "You are agent 3.", "reply": format!("Thought: still.\nFinal Answer: {}", long("realist revised"))},
      {"match": "Be an optimist.", "reply": format!("Thought: fine.\nFinal Answer: {}", long("optimist"))},
      {"match": "Be a pessimist.", "reply": format!("Thought: no.\nFinal Answer: {}", long("pessimist"))},
      {"match": "Be a realist.", "reply": format!("Thought: hm.\nFinal Answer: {}", long("realist"))}
    ]})
    .to_string();
    let mut patterns: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(seed_dir().join("agent-pattern.json")).unwrap(),
    )
    .unwrap();
    patterns["ensemble"]["perspectives"] =
        serde_json::json!(["Be an optimist.", "Be a pessimist.", "Be a realist."]);
    patterns["ensemble"]["debate_rounds"] = 2.into();
    // Answers of about 10 KB: a round's record of them told to all three agents, twice over,
    // is about 180 KB.
    let config = seed_with(
        "long-debate",
        &[
            ("agent-pattern", &patterns.to_string()),
            (
                "agent-limits",
                r#"{"default": {"max_message_bytes": 204800, "max_iterations": 20}}"#,
            ),
        ],
    );
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(&script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("long-debate", &request("Should we ship on Friday?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "long-debate", Duration::from_secs(90))
        .await
        .unwrap();
    assert_eq!(
        outcome(&responses),
        "Ship on Monday.",
        "{:?}",
        responses.last()
    );
    // Both debate rounds ran, each agent told the others' answers.
    let calls = llm.calls();
    for rule in 3..6 {
        assert_eq!(
            calls.iter().filter(|c| c.rule == Some(rule)).count(),
            2,
            "rule {rule}"
        );
    }
    assert!(calls
        .iter()
        .filter(|c| c.rule == Some(3))
        .all(|c| c.last_user.contains("pessimist") && c.last_user.contains("realist")));
}

/// An ensemble whose agents are different models (`models` in its config): each agent's every
/// LLM call asks for its own model, the reconciliation for the orchestrator's, and the graph
/// records which model answered each agent's step. A request cannot pick a model config does not
/// list.
#[tokio::test]
async fn an_ensembles_agents_can_be_different_models() {
    let script = r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"risk-assessment\", \"rationale\": \"weigh it\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"ensemble\", \"rationale\": \"two opinions\"}"},
      {"match": "Question to reconcile: Is the bridge safe?", "and": ["Yes.", "Mostly."], "reply": "{\"agreed\": [\"it stands\"], \"disagreed\": [], \"answer\": \"It is safe enough.\"}"},
      {"match": "Look at the load.", "reply": "Thought: loads are fine.\nFinal Answer: Yes."},
      {"match": "Look at the rust.", "reply": "Thought: some rust.\nFinal Answer: Mostly."},
      {"match": "Question: A plain question", "reply": "Thought: easy.\nFinal Answer: plain"}
    ]}"#;
    let mut patterns: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(seed_dir().join("agent-pattern.json")).unwrap(),
    )
    .unwrap();
    patterns["ensemble"]["perspectives"] =
        serde_json::json!(["Look at the load.", "Look at the rust."]);
    patterns["ensemble"]["models"] = serde_json::json!(["model-a", "model-b"]);
    let config = seed_with("models", &[("agent-pattern", &patterns.to_string())]);
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("models", &request("Is the bridge safe?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "models", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        responses.last().unwrap().content,
        "It is safe enough.",
        "{responses:#?}"
    );
    let calls = llm.calls();
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
    let model_of = |rule: usize| -> Vec<String> {
        calls
            .iter()
            .filter(|c| c.rule == Some(rule))
            .map(|c| c.model.clone())
            .collect()
    };
    assert_eq!(model_of(3), ["model-a"]);
    assert_eq!(model_of(4), ["model-b"]);
    // The router and the reconciliation are the orchestrator's own model.
    assert_eq!(model_of(2), ["scripted"]);
    assert_eq!(model_of(0), ["scripted"]);

    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let store = aggregator.store();
    // Every node of each agent's dialog that records an LLM call names that agent's model.
    let answered_by = format!(
        "{prefixes}SELECT DISTINCT ?m WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?n tg:model ?m .
           FILTER (STRSTARTS(STR(?n), \"{session}-f\")) }} }}"
    );
    assert_eq!(count_reaching(&store, answered_by.clone(), 2).await, 2);
    let models = store.query(answered_by.clone()).await.unwrap().rows();
    let mut seen: Vec<String> = models
        .column("m")
        .into_iter()
        .flatten()
        .map(|t| match t {
            agent_graph::model::Term::Literal(l) => l.value().to_owned(),
            other => other.to_string(),
        })
        .collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen, ["model-a", "model-b"], "{answered_by}");

    // A request that asks for a model no config lists gets the orchestrator's.
    let mut properties = agent_bus::Properties::new();
    properties.insert(
        agent_schema::MODEL_PROPERTY.to_owned(),
        "an-expensive-model".to_owned(),
    );
    client
        .send_with(
            "unlisted",
            &agent_schema::AgentRequest {
                pattern: "react".into(),
                ..request("A plain question", false)
            },
            &properties,
        )
        .await
        .unwrap();
    let plain = collect_dialog(&mut client, "unlisted", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(plain.last().unwrap().content, "plain", "{plain:#?}");
    let asked: Vec<String> = llm
        .calls()
        .iter()
        .filter(|c| c.rule == Some(5))
        .map(|c| c.model.clone())
        .collect();
    assert_eq!(asked, ["scripted"]);
}
