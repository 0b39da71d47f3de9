//! LLM faults over a real broker: an LLM that answers 429, 500 and 503, stalls, cuts answers
//! short, sends malformed bodies and prose that follows no protocol. Dialogs still finish (retries
//! with backoff, a cut-off or unparsable answer costs one iteration) or end with a clear error
//! within their budget; none hangs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use agent_e2e::*;
use agent_schema::AgentResponse;

/// Every dialog's budget; a dialog still open past it (plus slack) hangs.
const MAX_WALL_SECS: u64 = 60;

/// An answer longer than the broker takes (here its limit is lowered to 64 KiB: an answer of
/// 100 KB; at the default 5 MiB a model would have to write that much) ends its dialog once, with
/// an error naming the limit, journal or not, streamed or not, and the next dialog is served.
/// Before 2026-12-05 a journaled step recorded the messages carrying it before the broker refused
/// them: each re-emission was refused again, the step was given up, found its own entry and
/// re-emitted it, and the client never got a closing.
#[tokio::test]
async fn an_answer_over_the_brokers_limit_ends_its_dialog_once_with_an_error() {
    let token = "long-answer-token";
    let script = serde_json::json!({"rules": [
        {"match": "Question: ping", "reply": "Thought: easy.\nFinal Answer: pong"},
        {"match": "Question: write", "reply": format!("Thought: at length.\nFinal Answer: {}", "word ".repeat(20_000))}
    ]});
    for journaled in [true, false] {
        let broker = Broker::start().unwrap();
        let llm = scripted_llm(&script.to_string()).await;
        let aggregator = Aggregator::spawn_with(&broker, &["--config-token", token]);
        let mut extra = vec!["--pulsar-max-message-bytes", "65536"];
        if journaled {
            extra.extend([
                "--graph-store",
                &aggregator.endpoint,
                "--config-token",
                token,
            ]);
        }
        let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &extra);
        let mut client = client(&broker).await;
        for streaming in [false, true] {
            let id = format!("long-{journaled}-{streaming}");
            client
                .send(&id, &request("write at length", streaming))
                .await
                .unwrap();
            let mut responses = collect_dialog(&mut client, &id, Duration::from_secs(60))
                .await
                .unwrap();
            // Nothing follows the closing (a step re-emitted again and again would).
            responses.extend(drain_for(&mut client, &id, Duration::from_secs(3)).await);
            let closings: Vec<_> = responses.iter().filter(|r| r.end_of_dialog).collect();
            assert_eq!(closings.len(), 1, "{id}: {} responses", responses.len());
            let error = closings[0].error.as_ref().map(|e| e.message.as_str());
            assert!(
                error.is_some_and(|e| e.contains("over the limit of") && e.contains("65536")),
                "{id}: {:?}",
                closings[0]
            );
            let id = format!("ping-{journaled}-{streaming}");
            client.send(&id, &request("ping", false)).await.unwrap();
            let pinged = collect_dialog(&mut client, &id, Duration::from_secs(60))
                .await
                .unwrap();
            assert_eq!(outcome(&pinged), "pong", "{id}");
        }
    }
}

/// An answer cut off at the length limit (whole) or by a stream that broke off in the thought
/// (streamed) is never taken for the answer: the next iteration says it was cut off, and the
/// dialog finishes with the whole answer.
#[tokio::test]
async fn a_cut_off_answer_costs_an_iteration_not_the_dialog() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Observation: Error: your response was cut off", "reply": "Thought: shorter\nFinal Answer: whole"},
      {"match": "Question: cut", "reply": "Thought: this thought goes on for quite a while before it ends\nFinal Answer: never seen", "chunk_size": 4, "faults": ["truncate", "truncate"]}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    for (id, streaming) in [("cut-whole", false), ("cut-streamed", true)] {
        client
            .send(id, &request("cut me", streaming))
            .await
            .unwrap();
        let responses = collect_dialog(&mut client, id, Duration::from_secs(60))
            .await
            .unwrap();
        assert_eq!(outcome(&responses), "whole", "{id}: {responses:#?}");
        assert!(
            text_of(&responses, "observation").contains("cut off"),
            "{id}: {responses:#?}"
        );
        assert!(
            !responses.iter().any(|r| r.content.contains("never seen")),
            "{id}"
        );
        // The cut-off thought was ended for the client before the next one began.
        let thoughts: Vec<&AgentResponse> = responses
            .iter()
            .filter(|r| r.message_type == "thought")
            .collect();
        assert!(
            thoughts.iter().filter(|r| r.end_of_message).count() >= 2,
            "{id}: {thoughts:#?}"
        );
    }
    let truncated: Vec<bool> = llm
        .calls()
        .iter()
        .filter(|c| c.fault.as_deref() == Some("truncate"))
        .map(|c| c.stream)
        .collect();
    assert_eq!(truncated, [false, true]);
}

/// A streamed answer the model ends at its length limit after part of it reached the client ends
/// the dialog with an error: another iteration would stream a second answer after the first's
/// start, and a client joining the answer's chunks (as TrustGraph's do) would show both glued
/// together, an answer nobody wrote. A whole answer cut the same way costs an iteration (above).
#[tokio::test]
async fn a_streamed_answer_cut_at_the_length_limit_is_not_followed_by_a_second_one() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Observation: Error: your response was cut off", "reply": "Thought: shorter\nFinal Answer: Paris."},
      {"match": "Question: capital", "reply": "Thought: ok\nFinal Answer: The capital of France, a city on the Seine, is Paris.", "chunk_size": 4, "faults": ["length"]}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("cut-answer", &request("capital", true))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "cut-answer", Duration::from_secs(60))
        .await
        .unwrap();
    let outcome = outcome(&responses);
    assert!(
        outcome.starts_with("error:") && outcome.contains("length limit"),
        "{outcome}: {responses:#?}"
    );
    let answer = text_of(&responses, "answer");
    assert!(
        !answer.is_empty()
            && "The capital of France, a city on the Seine, is Paris.".starts_with(&answer),
        "the client holds part of the one answer, nothing after it: {answer:?}"
    );
    assert_eq!(
        responses.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "{responses:#?}"
    );
    let calls = llm.calls();
    assert!(
        !calls.iter().any(|c| c.last_user.contains("cut off")),
        "no second attempt at the answer: {calls:#?}"
    );
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.fault.as_deref() == Some("length"))
            .count(),
        1
    );
}

/// A plan's step the model stopped at its length limit is not recorded as completed with half a
/// result (it failed, and says it was cut off), and a plan's answer cut the same way is given
/// saying it is incomplete.
#[tokio::test]
async fn a_plan_step_or_answer_cut_at_the_length_limit_is_not_taken_whole() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to plan: Count", "reply": "[{\"goal\": \"count the sheep\"}]"},
      {"match": "ran into a problem", "reply": "[{\"goal\": \"count the sheep\"}]"},
      {"match": "Step goal: count the sheep", "reply": "Thought: carefully, one by one, twice over.\nFinal Answer: 42 sheep in the field", "faults": ["length"]},
      {"match": "Request to answer: Count", "reply": "There are 42 sheep in the field, counted twice.", "faults": ["length"]}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let mut plan = request("Count the sheep.", false);
    plan.pattern = "plan-then-execute".into();
    client.send("cut-plan", &plan).await.unwrap();
    let responses = collect_dialog(&mut client, "cut-plan", Duration::from_secs(60))
        .await
        .unwrap();
    let observations = text_of(&responses, "observation");
    assert!(
        observations.contains("Error: the step's response was cut off at the model's length limit"),
        "{responses:#?}"
    );
    let answer = outcome(&responses);
    assert!(
        answer
            .ends_with("(This answer was cut off at the model's length limit: it is incomplete.)"),
        "{answer}"
    );
}

/// A quarter of all LLM answers suffer a fault of every kind, across streamed and whole dialogs
/// that call a tool: each dialog ends exactly once, with the right answer or a clear error, within
/// its budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dialogs_finish_or_fail_clearly_under_llm_chaos() {
    const DIALOGS: usize = 24;
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Observation: looked-up", "reply": "Thought: I have it now\nFinal Answer: recovered"},
      {"match": "look it up", "exact": true, "reply": "looked-up"},
      {"match": "Question: chaos", "reply": "Thought: I should look this up first\nAction: llm\nArgs: {\"question\": \"look it up\"}", "chunk_size": 6}
    ],
    "chaos": {"rate": 0.3, "seed": 3, "stall_ms": 2500, "retry_after": 1}}"#,
    )
    .await;
    let limits = format!(r#"{{"default": {{"max_wall_secs": {MAX_WALL_SECS}}}}}"#);
    let config = seed_with("llm-chaos", &[("agent-limits", &limits)]);
    let mut orchestrator = Orchestrator::spawn(
        &broker,
        &llm,
        &config,
        &[
            "--llm-idle-timeout-secs",
            "1",
            // A whole answer's stall is found by the call's own limit.
            "--llm-request-timeout-secs",
            "2",
            "--max-in-flight",
            "12",
        ],
    );
    let mut client = client(&broker).await;
    let ids: Vec<String> = (0..DIALOGS).map(|i| format!("chaos-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        client
            .send(id, &request(&format!("chaos {i}"), i % 2 == 0))
            .await
            .unwrap();
    }
    let dialogs = collect_dialogs(&mut client, &ids, Duration::from_secs(MAX_WALL_SECS + 60)).await;

    let mut answered = 0;
    let mut failed = Vec::new();
    for id in &ids {
        let responses = &dialogs[id];
        let ends = responses.iter().filter(|r| r.end_of_dialog).count();
        assert_eq!(ends, 1, "{id} ended {ends} times: {responses:#?}");
        match outcome(responses).as_str() {
            "recovered" => answered += 1,
            error if error.starts_with("error: ") && error.contains("LLM") => {
                failed.push(error.to_owned());
            }
            other => panic!("{id} ended with neither the answer nor a clear error: {other:?}"),
        }
    }
    let calls = llm.calls();
    let mut faults: BTreeMap<String, usize> = BTreeMap::new();
    for fault in calls.iter().filter_map(|c| c.fault.clone()) {
        *faults.entry(fault).or_default() += 1;
    }
    println!(
        "LLM chaos: {DIALOGS} dialogs, {answered} answered, {} failed clearly, {} LLM calls, faults {faults:?}; errors: {failed:#?}",
        failed.len(),
        calls.len()
    );
    for kind in scripted_llm::Chaos::every_kind() {
        assert!(
            faults.contains_key(&kind),
            "no {kind} was injected: {faults:?}"
        );
    }
    // Retries and the loop absorb nearly all faults; an error needs five failed attempts in a row
    // or a stream that broke inside the final answer.
    assert!(
        answered * 4 >= DIALOGS * 3,
        "only {answered} of {DIALOGS} answered"
    );
    assert!(orchestrator.is_running());
}
