//! Plan-then-Execute end to end on a real broker: a diamond plan runs in dependency order with the
//! results of each step's dependencies in its prompt; a plan with a cycle is refused and asked for
//! again; a failed step leads to a revision; failures past `max_replan_depth` end with an answer
//! that says so; the router can choose the pattern. The history carried in the messages and the
//! provenance agree.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse};

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

fn planned(question: &str, streaming: bool) -> AgentRequest {
    AgentRequest {
        pattern: "plan-then-execute".into(),
        ..request(question, streaming)
    }
}

fn closing(responses: &[AgentResponse]) -> &AgentResponse {
    let last = responses.last().unwrap();
    assert!(last.end_of_dialog, "{responses:#?}");
    assert!(last.error.is_none(), "{responses:#?}");
    last
}

const DIAMOND: &str = r#"{"rules": [
  {"match": "Request to plan: Combine", "reply": "{\"rationale\": \"alpha first, then beta and gamma from it, then join\", \"steps\": [{\"goal\": \"find alpha\", \"tool_hint\": \"llm\", \"depends_on\": []}, {\"goal\": \"find beta\", \"depends_on\": [0]}, {\"goal\": \"find gamma\", \"depends_on\": [0]}, {\"goal\": \"join them\", \"depends_on\": [1, 2]}]}"},
  {"match": "Step goal: find alpha", "reply": "Thought: ask the LLM tool.\nAction: llm\nArgs: {\"question\": \"alpha?\"}"},
  {"match": "alpha?", "exact": true, "reply": "ALPHA"},
  {"match": "Step goal: find beta", "and": ["- step 0 (find alpha): ALPHA"], "reply": "Thought: from alpha.\nFinal Answer: BETA"},
  {"match": "Step goal: find gamma", "and": ["- step 0 (find alpha): ALPHA"], "reply": "Thought: from alpha too.\nFinal Answer: GAMMA"},
  {"match": "Step goal: join them", "and": ["BETA", "GAMMA"], "reply": "Thought: both ready.\nFinal Answer: JOINED"},
  {"match": "Request to answer: Combine", "and": ["JOINED"], "reply": "All combined: JOINED", "chunk_size": 5}
]}"#;

/// A diamond (0 -> 1, 0 -> 2, 1 + 2 -> 3) runs in a valid order, each step with its dependencies'
/// results in its prompt; the last request's history holds the plan with every step completed,
/// and the graph records the plan's steps and which iteration executed each.
#[tokio::test]
async fn a_diamond_plan_runs_in_dependency_order() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(DIAMOND).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut requests = read_from_start(
        &broker,
        "persistent://tg/request/agent:default:default",
        "plan-test-reader",
    )
    .await;
    let mut client = client(&broker).await;
    client
        .send("d-1", &planned("Combine alpha, beta and gamma.", true))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "d-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    closing(&responses);
    assert_eq!(text_of(&responses, "answer"), "All combined: JOINED");

    // Order: the plan, alpha, then beta and gamma (either order), then the join.
    let order: Vec<String> = llm
        .calls()
        .iter()
        .filter_map(|c| {
            c.last_user
                .split("Step goal: ")
                .nth(1)
                .map(|g| g.lines().next().unwrap_or("").to_owned())
        })
        .collect();
    assert_eq!(order.len(), 4, "{order:?}");
    assert_eq!(order[0], "find alpha");
    assert_eq!(order[3], "join them");

    // The history in the last request on the broker matches the graph.
    let last = last_request(&mut requests).await.unwrap();
    let kinds: Vec<&str> = last.history.iter().map(|s| s.step_type.as_str()).collect();
    assert_eq!(kinds, ["plan", "execute", "execute", "execute", "execute"]);
    let plan = last.history.last().unwrap().plan.clone().unwrap();
    let results: Vec<(&str, &str)> = plan
        .iter()
        .map(|s| (s.status.as_str(), s.result.as_str()))
        .collect();
    assert_eq!(
        results,
        [
            ("completed", "ALPHA"),
            ("completed", "BETA"),
            ("completed", "GAMMA"),
            ("completed", "JOINED")
        ]
    );

    let session = session_of(&responses);
    let t = explained(&responses);
    let plan_node = format!("{session}/i1");
    assert!(has_type(&t, &plan_node, tg::PLAN));
    assert_eq!(values(&t, &plan_node, tg::HAS_STEP).len(), 4);
    assert_eq!(
        values(&t, &format!("{plan_node}/step/3"), tg::DEPENDS_ON),
        ["1", "2"]
    );
    assert_eq!(
        values(&t, &plan_node, tg::RATIONALE),
        ["alpha first, then beta and gamma from it, then join"]
    );
    assert_eq!(
        values(&t, &plan_node, tg::THOUGHT_LINK),
        [format!("{plan_node}/thought")]
    );
    assert_no_dangling_links(&t);
    // Iterations 2 to 5 executed the steps; each observation says completed and holds the result.
    let mut executed = BTreeMap::new();
    for n in 2..=5 {
        let node = format!("{session}/i{n}");
        assert!(has_type(&t, &node, tg::STEP_EXECUTION), "i{n}");
        let step = values(&t, &node, tg::EXECUTES_STEP).pop().unwrap();
        let status = values(&t, &format!("{node}/observation"), tg::STEP_STATUS);
        assert_eq!(status, ["completed"], "i{n}");
        executed.insert(step, n);
        let observation = format!("{node}/observation");
        let content = values(&t, &observation, tg::CONTENT);
        let index: usize = values(&t, &node, tg::STEP_INDEX)[0].parse().unwrap();
        assert_eq!(content, [plan[index].result.clone()], "i{n}");
    }
    assert_eq!(executed.len(), 4, "each step executed once: {executed:?}");
    assert_eq!(executed[&format!("{plan_node}/step/0")], 2);
    assert_eq!(executed[&format!("{plan_node}/step/3")], 5);
    assert_eq!(
        values(&t, &format!("{session}/final"), tg::TERMINATION_REASON),
        ["answer"]
    );
}

/// A plan with a cycle is refused with the reason and asked for again; the graph keeps the refused
/// plan and why.
#[tokio::test]
async fn a_plan_with_a_cycle_is_refused_and_asked_again() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "That plan was rejected", "and": ["cycle"], "reply": "[{\"goal\": \"just answer\", \"depends_on\": []}]"},
      {"match": "Request to plan: Loop", "reply": "[{\"goal\": \"a\", \"depends_on\": [1]}, {\"goal\": \"b\", \"depends_on\": [0]}]"},
      {"match": "Step goal: just answer", "reply": "Thought: easy.\nFinal Answer: DONE"},
      {"match": "Request to answer: Loop", "reply": "Answered: DONE"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("c-1", &planned("Loop around.", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "c-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = closing(&responses);
    assert_eq!(last.content, "Answered: DONE");
    let session = session_of(&responses);
    let t = explained(&responses);
    // Every call is counted, the refused attempt's too: the graph adds up to the closing totals.
    let total = |p: NamedNodeRef<'_>| -> u64 {
        t.iter()
            .filter(|x| x.p.iri == p.as_str())
            .map(|x| x.o.value.parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(
        (total(tg::IN_TOKEN), total(tg::OUT_TOKEN)),
        (last.in_token.unwrap(), last.out_token.unwrap())
    );
    let plan_node = format!("{session}/i1");
    let reasons = values(&t, &plan_node, tg::REJECTION_REASON);
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains("cycle: 0 -> 1 -> 0") || reasons[0].contains("cycle: 1 -> 0 -> 1"),
        "{reasons:?}"
    );
    assert!(values(&t, &plan_node, tg::REJECTED_PLAN)[0].contains("\"depends_on\": [1]"));
    assert_eq!(values(&t, &plan_node, tg::HAS_STEP).len(), 1);
    assert!(llm.calls().iter().any(|c| c
        .last_user
        .starts_with("That plan was rejected: the steps depend on each other in a cycle")));
}

/// A step that fails (its tool does not exist) leads to one revision: the completed step is kept,
/// the failed one dropped, new steps run, and the answer follows.
#[tokio::test]
async fn a_failed_step_is_replanned_once() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to re-plan: Fetch", "and": ["step 1 ('teleport there') failed"], "reply": "{\"rationale\": \"walk instead\", \"steps\": [{\"goal\": \"walk there\", \"depends_on\": [0]}]}"},
      {"match": "Request to plan: Fetch", "reply": "[{\"goal\": \"pack\"}, {\"goal\": \"teleport there\", \"depends_on\": [0]}]"},
      {"match": "Step goal: pack", "reply": "Thought: packing.\nFinal Answer: PACKED"},
      {"match": "Step goal: teleport there", "reply": "Thought: beam me.\nAction: teleport\nArgs: {\"to\": \"there\"}"},
      {"match": "Step goal: walk there", "and": ["PACKED"], "reply": "Thought: walking.\nFinal Answer: ARRIVED"},
      {"match": "Request to answer: Fetch", "and": ["ARRIVED"], "reply": "Got there on foot."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("f-1", &planned("Fetch the parcel.", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "f-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closing(&responses).content, "Got there on foot.");
    let session = session_of(&responses);
    let t = explained(&responses);
    // i1 plan, i2 pack, i3 teleport (failed), i4 revision, i5 walk, final.
    assert_eq!(
        values(&t, &format!("{session}/i3/observation"), tg::STEP_STATUS),
        ["failed"]
    );
    let revision = format!("{session}/i4");
    assert!(has_type(&t, &revision, tg::PLAN_REVISION));
    assert_eq!(values(&t, &revision, tg::PLAN_VERSION), ["1"]);
    assert!(
        values(&t, &revision, tg::REVISION_REASON)[0].contains("there is no tool named 'teleport'")
    );
    assert_eq!(values(&t, &revision, tg::DROPPED_STEP), ["1"]);
    assert_eq!(values(&t, &revision, tg::RATIONALE), ["walk instead"]);
    let kept = format!("{revision}/step/0");
    assert_eq!(values(&t, &kept, tg::STEP_STATUS), ["completed"]);
    assert_eq!(values(&t, &kept, tg::RESULT), ["PACKED"]);
    assert_eq!(
        values(&t, &format!("{session}/i5"), tg::EXECUTES_STEP),
        [format!("{revision}/step/1")]
    );
    assert_no_dangling_links(&t);
}

/// An LLM that never gives a valid plan: after three refused attempts the whole request becomes
/// one step, and the graph says why.
#[tokio::test]
async fn without_a_valid_plan_the_request_becomes_one_step() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Step goal: Just do it.", "reply": "Thought: doing.\nFinal Answer: DONE"},
      {"match": "Request to answer: Just", "reply": "Done in one go."},
      {"match": "", "reply": "I would rather not plan."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("o-1", &planned("Just do it.", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "o-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closing(&responses).content, "Done in one go.");
    let session = session_of(&responses);
    let t = explained(&responses);
    let plan_node = format!("{session}/i1");
    assert_eq!(values(&t, &plan_node, tg::REJECTION_REASON).len(), 3);
    assert!(values(&t, &plan_node, tg::PLAN_FALLBACK_REASON)[0]
        .contains("no valid plan after 3 attempts"));
    assert_eq!(
        values(&t, &format!("{plan_node}/step/0"), tg::GOAL),
        ["Just do it."]
    );
}

/// With the default `max_replan_depth` of 2, the third failure is not revised again: the dialog
/// answers from what completed, says the plan could not be finished, and records why.
#[tokio::test]
async fn failures_past_max_replan_depth_end_gracefully() {
    let broker = Broker::start().unwrap();
    let config = config_dir(
        "replan",
        &[(
            "tool",
            r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
        )],
    );
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to re-plan: Break", "reply": "[{\"goal\": \"break again\"}]"},
      {"match": "Request to plan: Break", "reply": "[{\"goal\": \"break it\"}]"},
      {"match": "Step goal: break", "reply": "Thought: try.\nAction: hammer\nArgs: {}"},
      {"match": "Request to answer: Break", "and": ["could not be finished"], "reply": "Nothing worked."}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("m-1", &planned("Break the thing.", true))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "m-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    closing(&responses);
    let answer = text_of(&responses, "answer");
    assert!(answer.starts_with("Nothing worked."), "{answer}");
    assert!(
        answer.contains(
            "(This answer rests on the steps that completed: step 0 ('break again') failed"
        ),
        "{answer}"
    );
    assert!(
        answer.contains("revised 2 times (max_replan_depth 2)"),
        "{answer}"
    );
    let session = session_of(&responses);
    let t = explained(&responses);
    assert_eq!(
        values(&t, &format!("{session}/final"), tg::TERMINATION_REASON),
        ["max-replan-depth"]
    );
    // Two revisions: plans at i1, i3 and i5; failures at i2, i4 and i6.
    let revisions = t
        .iter()
        .filter(|x| x.o.iri == tg::PLAN_REVISION.as_str())
        .count();
    assert_eq!(revisions, 2);
}

/// The router picks plan-then-execute for a research question when the LLM says so, and the plan
/// runs with the task type's framing in its prompt.
#[tokio::test]
async fn the_router_can_choose_plan_then_execute() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to classify: ", "reply": "{\"choice\": \"research\", \"rationale\": \"asks for evidence\"}"},
      {"match": "Request to work on: ", "reply": "{\"choice\": \"plan-then-execute\", \"rationale\": \"several dependent lookups\"}"},
      {"match": "This is a research request", "and": ["Request to plan: Research"], "reply": "[{\"goal\": \"look it up\"}]"},
      {"match": "Step goal: look it up", "reply": "Thought: known.\nFinal Answer: FOUND"},
      {"match": "Request to answer: Research", "and": ["FOUND"], "reply": "The evidence: FOUND"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("r-1", &request("Research the evidence.", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "r-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closing(&responses).content, "The evidence: FOUND");
    let session = session_of(&responses);
    let t = explained(&responses);
    let decision = format!("{session}/pattern-decision");
    assert_eq!(values(&t, &decision, tg::PATTERN), ["plan-then-execute"]);
    assert_eq!(values(&t, &decision, tg::PATTERN_METHOD), ["llm"]);
    assert_eq!(
        values(&t, &decision, tg::PATTERN_RATIONALE),
        ["several dependent lookups"]
    );
    assert!(has_type(&t, &format!("{session}/i1"), tg::PLAN));
}

/// Histories a client made up (a plan with nonsense dependencies and statuses, an execute step with
/// no plan behind it, an evaluate step with odd arguments) each end with a response, never a crash,
/// and the service goes on answering.
#[tokio::test]
async fn made_up_histories_end_cleanly() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Step goal: ", "reply": "Thought: ok.\nFinal Answer: R"},
      {"match": "Request to plan: ", "reply": "[{\"goal\": \"one\"}]"},
      {"match": "Request to re-plan: ", "reply": "[{\"goal\": \"again\"}]"},
      {"match": "Request to answer: ", "reply": "Answered."}
    ]}"#,
    )
    .await;
    let mut orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let step = |goal: &str, deps: Vec<i64>, status: &str| agent_schema::PlanStep {
        goal: goal.into(),
        tool_hint: String::new(),
        depends_on: deps,
        status: status.into(),
        result: String::new(),
    };
    let with =
        |kind: &str, plan: Option<Vec<agent_schema::PlanStep>>, arguments: &[(&str, &str)]| {
            agent_schema::AgentStep {
                step_type: kind.into(),
                plan,
                arguments: arguments
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
                ..agent_schema::AgentStep::default()
            }
        };
    let histories = vec![
        vec![with(
            "plan",
            Some(vec![
                step("a", vec![-5, 99, 0], "running"),
                step("b", vec![i64::MAX], "??"),
            ]),
            &[],
        )],
        vec![with(
            "execute",
            Some(vec![step("a", vec![], "completed")]),
            &[],
        )],
        vec![
            with("plan", Some(vec![step("a", vec![], "completed")]), &[]),
            with(
                "evaluate",
                Some(vec![]),
                &[
                    ("depth", "18446744073709551615"),
                    ("sub_goals", "not json"),
                    ("culprits", "x,9"),
                ],
            ),
        ],
        vec![with("plan", Some(vec![]), &[])],
    ];
    for (i, history) in histories.into_iter().enumerate() {
        let id = format!("h-{i}");
        let request = AgentRequest {
            history,
            session_id: format!("made-up-{i}"),
            ..planned("Made up.", false)
        };
        client.send(&id, &request).await.unwrap();
        let responses = collect_dialog(&mut client, &id, DIALOG_TIMEOUT)
            .await
            .unwrap();
        assert!(responses.last().unwrap().end_of_dialog, "{id}");
    }
    assert!(orchestrator.is_running());
    client
        .send("after", &planned("Still there?", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "after", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closing(&responses).content, "Answered.");
}

/// A real model's plan (issue 18: a 1.5B model, asked for a risk assessment) whose last step
/// listed itself among its dependencies is repaired, not refused: the repair is recorded, no
/// attempt is wasted asking again, and the plan runs.
#[tokio::test]
async fn a_plan_whose_last_step_lists_itself_is_repaired_and_recorded() {
    let plan = serde_json::json!({"rationale": "Assess each dimension, then combine.", "steps": [
        {"goal": "Assess the financial risk", "tool_hint": "llm", "depends_on": []},
        {"goal": "Assess the legal risk", "tool_hint": "llm", "depends_on": []},
        {"goal": "Assess the reputational risk", "tool_hint": "llm", "depends_on": []},
        {"goal": "Assess the operational risk", "tool_hint": "llm", "depends_on": []},
        {"goal": "Summarize the findings", "tool_hint": "llm", "depends_on": [1, 2, 3, 4]}
    ]});
    let script = serde_json::json!({"rules": [
        {"match": "Request to plan: Assess the risk profile", "reply": plan.to_string()},
        {"match": "Step goal: Summarize the findings", "reply": "Thought: combine.\nFinal Answer: SUMMARY"},
        {"match": "Step goal: Assess the", "reply": "Thought: assess.\nFinal Answer: LOW"},
        {"match": "Request to answer: Assess the risk profile", "reply": "The risk is low overall."}
    ]});
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(&script.to_string()).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let question = "Assess the risk profile of Company X as a potential partner across financial, legal, reputational and operational dimensions.";
    client
        .send("repair-1", &planned(question, false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "repair-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(closing(&responses).content, "The risk is low overall.");
    let session = session_of(&responses);
    let t = explained(&responses);
    let plan_node = format!("{session}/i1");
    assert!(values(&t, &plan_node, tg::REJECTION_REASON).is_empty());
    let repairs = values(&t, &plan_node, tg::PLAN_REPAIR);
    assert_eq!(repairs.len(), 1, "{repairs:?}");
    assert!(
        repairs[0].contains("step 4 ('Summarize the findings') listed itself"),
        "{repairs:?}"
    );
    let mut summary_needs = values(&t, &format!("{plan_node}/step/4"), tg::DEPENDS_ON);
    summary_needs.sort();
    assert_eq!(summary_needs, ["1", "2", "3"]);
    let planning_calls = llm
        .calls()
        .iter()
        .filter(|c| {
            c.last_user.contains("Request to plan:")
                || c.last_user.contains("That plan was rejected")
        })
        .count();
    assert_eq!(planning_calls, 1);
}

/// A plan that used its iterations answers from what it found, with one more LLM call, but not
/// when its token budget is spent as well: it then ends at the limit without the call. Before
/// 2026-12-05 the answer was written whatever the budget said, past `max_tokens`.
#[tokio::test]
async fn a_plan_at_its_iteration_limit_with_its_budget_spent_makes_no_more_calls() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(DIAMOND).await;
    let config = seed_with(
        "plan-spent",
        &[(
            "agent-limits",
            r#"{"default": {"max_iterations": 1, "max_tokens": 1}}"#,
        )],
    );
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    client
        .send("s-1", &planned("Combine alpha, beta and gamma.", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "s-1", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let answered = llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("Request to answer:"))
        .count();
    assert_eq!(answered, 0, "the answer was asked for past the budget");
    let last = closing(&responses);
    assert!(last.content.contains("max_iterations"), "{responses:#?}");
}
