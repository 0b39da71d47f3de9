//! The critic on Plan-then-Execute steps, end to end on a real broker: each verdict leads to its
//! own recovery (`EXECUTION_ERROR` reruns the step with the lesson, `INPUT_DATA_ERROR` reruns the
//! step that produced the bad input and then its dependents, `JOB_TOO_COMPLICATED_ERROR` splits the
//! step), the retry limit ends the dialog with an answer that says it is unverified, and the life
//! cycle stops repeated splitting. The graph records every verdict, lesson and rerun. The answer
//! critic also reviews a ReACT agent's final answer and a supervisor's synthesis.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse, Triple};

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

/// A config with the critic switched on for plan-then-execute and the given limits.
fn critic_config(name: &str, limits: &str) -> PathBuf {
    config_dir(
        name,
        &[
            (
                "agent-pattern",
                r#"{"plan-then-execute": {"description": "plan first", "critic": ["step"]}}"#,
            ),
            ("agent-limits", limits),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    )
}

async fn run(
    script: &str,
    config: &std::path::Path,
    question: &str,
) -> (Vec<AgentResponse>, Vec<String>) {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, config, &[]);
    let mut requests = read_from_start(
        &broker,
        "persistent://tg/request/agent:default:default",
        "critic-test-reader",
    )
    .await;
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "plan-then-execute".into(),
        ..request(question, false)
    };
    client.send("c", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "c", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert!(last.end_of_dialog && last.error.is_none(), "{responses:#?}");
    let prompts = llm.calls().into_iter().map(|c| c.last_user).collect();
    // The history the last message carried matches the graph, step by step.
    let history = last_request(&mut requests).await.unwrap().history;
    let session = session_of(&responses);
    let t = explained(&responses);
    for (k, step) in history.iter().enumerate() {
        let node = format!("{session}/i{}", k + 1);
        match step.step_type.as_str() {
            "evaluate" => assert_eq!(
                values(&t, &node, tg::EVALUATION_STATUS),
                std::slice::from_ref(&step.action),
                "{node}"
            ),
            "plan" => assert_eq!(
                values(&t, &node, tg::HAS_STEP).len(),
                step.plan.as_ref().unwrap().len(),
                "{node}"
            ),
            _ => {}
        }
        assert_eq!(
            values(&t, &format!("{node}/observation"), tg::CONTENT),
            std::slice::from_ref(&step.observation),
            "{node}"
        );
    }
    (responses, prompts)
}

/// The verdicts in iteration order: (iteration node, status, retry count).
fn verdicts(t: &[Triple], session: &str) -> Vec<(usize, String, String)> {
    (1..40)
        .filter_map(|n| {
            let node = format!("{session}/i{n}");
            let status = values(t, &node, tg::EVALUATION_STATUS).pop()?;
            Some((
                n,
                status,
                values(t, &node, tg::RETRY_COUNT).pop().unwrap_or_default(),
            ))
        })
        .collect()
}

#[tokio::test]
async fn an_execution_error_reruns_the_step_with_the_lesson() {
    // The evaluator names two statuses; the error outranks the success.
    let config = critic_config("exec", r#"{"default": {"max_iterations": 20}}"#);
    let (responses, prompts) = run(
        r#"{"rules": [
      {"match": "Request to plan: Count", "reply": "[{\"goal\": \"count the sheep\"}]"},
      {"match": "Step goal: count the sheep", "and": ["- count twice"], "reply": "Thought: carefully.\nFinal Answer: 42 sheep"},
      {"match": "Step goal: count the sheep", "reply": "Thought: quickly.\nFinal Answer: about 40"},
      {"match": "Result to evaluate: about 40", "reply": "{\"status\": \"SUCCESS, EXECUTION_ERROR\", \"evaluation\": \"not an exact count\", \"lesson\": \"count twice\"}"},
      {"match": "Result to evaluate: 42 sheep", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"exact\"}"},
      {"match": "Request to answer: Count", "and": ["42 sheep"], "reply": "There are 42 sheep."}
    ]}"#,
        &config,
        "Count the sheep.",
    )
    .await;
    assert_eq!(responses.last().unwrap().content, "There are 42 sheep.");
    let session = session_of(&responses);
    let t = explained(&responses);
    assert_eq!(
        verdicts(&t, &session),
        [
            (3, "EXECUTION_ERROR".to_owned(), "1".to_owned()),
            (5, "SUCCESS".to_owned(), "1".to_owned())
        ]
    );
    let rejected = format!("{session}/i3");
    assert_eq!(values(&t, &rejected, tg::LESSON), ["count twice"]);
    assert_eq!(
        values(&t, &rejected, tg::EVALUATION_TEXT),
        ["not an exact count"]
    );
    assert_eq!(values(&t, &rejected, tg::RERUN_STEP), ["0"]);
    // The rerun records the lesson it was given.
    assert_eq!(
        values(&t, &format!("{session}/i4"), tg::LESSON_APPLIED),
        ["count twice"]
    );
    assert!(values(&t, &format!("{session}/i2"), tg::LESSON_APPLIED).is_empty());
    assert_eq!(
        values(&t, &rejected, tg::EVALUATES),
        [format!("{session}/i2")]
    );
    // The rerun's prompt carried the lesson; the first did not.
    let runs: Vec<&String> = prompts
        .iter()
        .filter(|p| p.contains("Step goal: count the sheep"))
        .collect();
    assert_eq!(runs.len(), 2);
    assert!(!runs[0].contains("- count twice") && runs[1].contains("- count twice"));
    assert_no_dangling_links(&t);
    assert_thoughts_explained(&responses, &t);
}

#[tokio::test]
async fn an_input_data_error_reruns_the_culprit_then_its_dependents() {
    let config = critic_config("input", r#"{"default": {"max_iterations": 20}}"#);
    let (responses, prompts) = run(
        r#"{"rules": [
      {"match": "Request to plan: Carpet", "reply": "[{\"goal\": \"measure the room\"}, {\"goal\": \"order carpet\", \"depends_on\": [0]}]"},
      {"match": "Step goal: measure the room", "and": ["- give metres"], "reply": "Thought: metric.\nFinal Answer: 20 m2"},
      {"match": "Step goal: measure the room", "reply": "Thought: imperial.\nFinal Answer: 200 sq ft"},
      {"match": "Step goal: order carpet", "and": ["20 m2"], "reply": "Thought: ok.\nFinal Answer: ordered 20 m2"},
      {"match": "Step goal: order carpet", "reply": "Thought: hmm.\nFinal Answer: ordered 200"},
      {"match": "Result to evaluate: ordered 200", "reply": "{\"status\": [\"JOB_TOO_COMPLICATED_ERROR\", \"INPUT_DATA_ERROR\"], \"evaluation\": \"the area is in the wrong unit\", \"lesson\": \"give metres\", \"culprits\": [0]}"},
      {"match": "Result to evaluate: ", "reply": "{\"status\": \"SUCCESS\"}"},
      {"match": "Request to answer: Carpet", "and": ["ordered 20 m2"], "reply": "Carpet ordered: 20 m2."}
    ]}"#,
        &config,
        "Carpet the room.",
    )
    .await;
    assert_eq!(responses.last().unwrap().content, "Carpet ordered: 20 m2.");
    let session = session_of(&responses);
    let t = explained(&responses);
    // Two statuses given: INPUT_DATA_ERROR comes before JOB_TOO_COMPLICATED_ERROR.
    let statuses: Vec<String> = verdicts(&t, &session).into_iter().map(|v| v.1).collect();
    assert_eq!(
        statuses,
        ["SUCCESS", "INPUT_DATA_ERROR", "SUCCESS", "SUCCESS"]
    );
    let rejected = format!("{session}/i5");
    let rerun: BTreeSet<String> = values(&t, &rejected, tg::RERUN_STEP).into_iter().collect();
    assert_eq!(rerun, ["0".to_owned(), "1".to_owned()].into());
    // The culprit ran again with the lesson, before its dependent ran again on its new result.
    let order: Vec<&str> = prompts
        .iter()
        .filter_map(|p| {
            if p.contains("Step goal: measure the room") {
                Some(if p.contains("- give metres") {
                    "measure+lesson"
                } else {
                    "measure"
                })
            } else if p.contains("Step goal: order carpet") {
                Some(if p.contains("20 m2") {
                    "order(20 m2)"
                } else {
                    "order"
                })
            } else {
                None
            }
        })
        .collect();
    assert_eq!(
        order,
        ["measure", "order", "measure+lesson", "order(20 m2)"]
    );
    // The lesson was for the culprit: the judged step's rerun does not carry it.
    let last_order = prompts
        .iter()
        .rfind(|p| p.contains("Step goal: order carpet"))
        .unwrap();
    assert!(!last_order.contains("- give metres"), "{last_order}");
    assert_no_dangling_links(&t);
    assert_thoughts_explained(&responses, &t);
}

#[tokio::test]
async fn a_job_too_complicated_is_split_into_sub_steps() {
    let config = critic_config("split", r#"{"default": {"max_iterations": 20}}"#);
    let (responses, _) = run(
        r#"{"rules": [
      {"match": "Request to plan: Report", "reply": "[{\"goal\": \"write the report\"}]"},
      {"match": "Step goal: write the report", "and": ["INTRO", "BODY"], "reply": "Thought: assemble.\nFinal Answer: REPORT"},
      {"match": "Step goal: write the report", "reply": "Thought: all at once.\nFinal Answer: draft"},
      {"match": "Step goal: write the intro", "reply": "Thought: intro.\nFinal Answer: INTRO"},
      {"match": "Step goal: write the body", "reply": "Thought: body.\nFinal Answer: BODY"},
      {"match": "Result to evaluate: draft", "reply": "{\"status\": \"JOB_TOO_COMPLICATED_ERROR\", \"evaluation\": \"too much at once\", \"lesson\": \"split it\", \"sub_steps\": [{\"goal\": \"write the intro\"}, {\"goal\": \"write the body\"}]}"},
      {"match": "Result to evaluate: ", "reply": "{\"status\": \"SUCCESS\"}"},
      {"match": "Request to answer: Report", "and": ["REPORT"], "reply": "The report is written."}
    ]}"#,
        &config,
        "Report on it.",
    )
    .await;
    assert_eq!(responses.last().unwrap().content, "The report is written.");
    let session = session_of(&responses);
    let t = explained(&responses);
    let split = format!("{session}/i3");
    assert_eq!(
        values(&t, &split, tg::EVALUATION_STATUS),
        ["JOB_TOO_COMPLICATED_ERROR"]
    );
    let subs: BTreeSet<String> = values(&t, &split, tg::SUB_STEP).into_iter().collect();
    assert_eq!(
        subs,
        ["write the body".to_owned(), "write the intro".to_owned()].into()
    );
    // The split names the new plan's steps; the sub-steps' executions point at them.
    assert_eq!(values(&t, &split, tg::HAS_STEP).len(), 3);
    assert_eq!(
        values(&t, &format!("{split}/step/0"), tg::DEPENDS_ON),
        ["1", "2"]
    );
    assert_eq!(
        values(&t, &format!("{session}/i4"), tg::EXECUTES_STEP),
        [format!("{split}/step/1")]
    );
    // The split step ran again last, on its sub-steps' results.
    assert_eq!(
        values(&t, &format!("{session}/i8"), tg::EXECUTES_STEP),
        [format!("{split}/step/0")]
    );
    assert_no_dangling_links(&t);
    assert_thoughts_explained(&responses, &t);
}

#[tokio::test]
async fn the_retry_limit_ends_with_an_unverified_answer() {
    let config = critic_config(
        "retries",
        r#"{"default": {"max_iterations": 20, "max_retries": 2}}"#,
    );
    let (responses, _) = run(
        r#"{"rules": [
      {"match": "Request to plan: Guess", "reply": "[{\"goal\": \"guess the number\"}]"},
      {"match": "Step goal: guess the number", "reply": "Thought: guess.\nFinal Answer: 7"},
      {"match": "Result to evaluate: ", "reply": "{\"status\": \"EXECUTION_ERROR\", \"lesson\": \"guess better\"}"},
      {"match": "Request to answer: Guess", "and": ["could not be verified", "result (not accepted by the evaluator): 7"], "reply": "Perhaps 7."}
    ]}"#,
        &config,
        "Guess the number.",
    )
    .await;
    let answer = responses.last().unwrap().content.clone();
    assert!(answer.starts_with("Perhaps 7."), "{answer}");
    assert!(
        answer.contains("the evaluator rejected work 3 times, more than max_retries 2, so the answer could not be verified"),
        "{answer}"
    );
    let session = session_of(&responses);
    let t = explained(&responses);
    // Two reruns allowed; the third rejection ends the dialog.
    assert_eq!(verdicts(&t, &session).len(), 3);
    assert_eq!(
        values(&t, &format!("{session}/final"), tg::TERMINATION_REASON),
        ["max-retries"]
    );
}

#[tokio::test]
async fn the_life_cycle_stops_repeated_splitting() {
    let config = critic_config(
        "lifecycle",
        r#"{"default": {"max_iterations": 30, "step_life_cycle": 1, "max_replan_depth": 0}}"#,
    );
    let (responses, _) = run(
        r#"{"rules": [
      {"match": "Request to plan: Solve", "reply": "[{\"goal\": \"solve it\"}]"},
      {"match": "Step goal: ", "reply": "Thought: try.\nFinal Answer: partial"},
      {"match": "Result to evaluate: ", "reply": "{\"status\": \"JOB_TOO_COMPLICATED_ERROR\", \"sub_steps\": [{\"goal\": \"a smaller piece\"}]}"},
      {"match": "Request to answer: Solve", "reply": "Only partly solved."}
    ]}"#,
        &config,
        "Solve everything.",
    )
    .await;
    let answer = responses.last().unwrap().content.clone();
    assert!(answer.starts_with("Only partly solved."), "{answer}");
    assert!(answer.contains("step life cycle 1"), "{answer}");
    let session = session_of(&responses);
    let t = explained(&responses);
    // One split allowed: the sub-step's own split is refused and it fails.
    let splits: Vec<usize> = verdicts(&t, &session).into_iter().map(|v| v.0).collect();
    assert_eq!(splits, [3, 5]);
    assert_eq!(
        values(&t, &format!("{session}/i3"), tg::SUB_STEP),
        ["a smaller piece"]
    );
    assert_eq!(
        values(&t, &format!("{session}/i5"), tg::LIFE_CYCLE_EXHAUSTED),
        ["true"]
    );
    assert!(values(&t, &format!("{session}/i5"), tg::SUB_STEP).is_empty());
    assert_eq!(
        values(&t, &format!("{session}/final"), tg::TERMINATION_REASON),
        ["max-replan-depth"]
    );
    assert_no_dangling_links(&t);
    assert_thoughts_explained(&responses, &t);
}

/// With the critic on plans, a rejected plan is revised with the lesson in the revision's prompt;
/// the revision is reviewed again, accepted, and runs.
#[tokio::test]
async fn a_rejected_plan_is_revised_with_the_lesson() {
    let config = config_dir(
        "review",
        &[
            (
                "agent-pattern",
                r#"{"plan-then-execute": {"description": "plan first", "critic": ["plan"]}}"#,
            ),
            ("agent-limits", r#"{"default": {"max_iterations": 20}}"#),
        ],
    );
    let (responses, prompts) = run(
        r#"{"rules": [
      {"match": "Request to plan: Ship", "reply": "[{\"goal\": \"ship it\"}]"},
      {"match": "Request to re-plan: Ship", "and": ["Lesson: test before shipping"], "reply": "{\"rationale\": \"test first\", \"steps\": [{\"goal\": \"test it\"}, {\"goal\": \"ship it\", \"depends_on\": [0]}]}"},
      {"match": "Plan to review for: Ship", "and": ["0. [pending] ship it"], "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"nothing is tested\", \"lesson\": \"test before shipping\"}"},
      {"match": "Plan to review for: Ship", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"tested first\"}"},
      {"match": "Step goal: test it", "reply": "Thought: testing.\nFinal Answer: TESTED"},
      {"match": "Step goal: ship it", "and": ["TESTED"], "reply": "Thought: shipping.\nFinal Answer: SHIPPED"},
      {"match": "Request to answer: Ship", "and": ["SHIPPED"], "reply": "Shipped after testing."}
    ]}"#,
        &config,
        "Ship the release.",
    )
    .await;
    assert_eq!(responses.last().unwrap().content, "Shipped after testing.");
    let session = session_of(&responses);
    let t = explained(&responses);
    let statuses: Vec<(usize, String)> = verdicts(&t, &session)
        .into_iter()
        .map(|v| (v.0, v.1))
        .collect();
    assert_eq!(
        statuses,
        [(2, "EXECUTION_ERROR".to_owned()), (4, "SUCCESS".to_owned())]
    );
    assert_eq!(
        values(&t, &format!("{session}/i2"), tg::EVALUATES),
        [format!("{session}/i1")]
    );
    let revision = format!("{session}/i3");
    assert!(values(&t, &revision, tg::REVISION_REASON)[0].contains("Lesson: test before shipping"));
    assert_eq!(values(&t, &revision, tg::HAS_STEP).len(), 2);
    assert!(prompts
        .iter()
        .any(|p| p.contains("Request to re-plan: Ship")));
    assert_no_dangling_links(&t);
    assert_thoughts_explained(&responses, &t);
}

/// With the critic on answers, a draft answer is reviewed before it is given: a rejected draft is
/// written again with the lesson, and only the accepted one reaches the client.
#[tokio::test]
async fn a_rejected_answer_is_written_again_with_the_lesson() {
    let config = config_dir(
        "answer",
        &[
            (
                "agent-pattern",
                r#"{"plan-then-execute": {"description": "plan first", "critic": ["answer"]}}"#,
            ),
            ("agent-limits", r#"{"default": {"max_iterations": 20}}"#),
        ],
    );
    let (responses, prompts) = run(
        r#"{"rules": [
      {"match": "Request to plan: Sum", "reply": "[{\"goal\": \"add them\"}]"},
      {"match": "Step goal: add them", "reply": "Thought: adding.\nFinal Answer: 12"},
      {"match": "Request to answer: Sum", "and": ["lessons: give the number"], "reply": "The sum is 12."},
      {"match": "Request to answer: Sum", "reply": "It is a number."},
      {"match": "Draft answer to review: It is a number.", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"vague\", \"lesson\": \"give the number\"}"},
      {"match": "Draft answer to review: The sum is 12.", "reply": "{\"status\": \"SUCCESS\"}"}
    ]}"#,
        &config,
        "Sum the numbers.",
    )
    .await;
    assert_eq!(responses.last().unwrap().content, "The sum is 12.");
    assert!(
        !responses
            .iter()
            .any(|r| r.message_type == "answer" && r.content.contains("It is a number")),
        "the rejected draft reached the client as an answer"
    );
    let session = session_of(&responses);
    let t = explained(&responses);
    // i1 plan, i2 step, i3 draft, i4 review (rejected), i5 draft, i6 review (accepted), final.
    let statuses: Vec<(usize, String)> = verdicts(&t, &session)
        .into_iter()
        .map(|v| (v.0, v.1))
        .collect();
    assert_eq!(
        statuses,
        [(4, "EXECUTION_ERROR".to_owned()), (6, "SUCCESS".to_owned())]
    );
    assert_eq!(
        values(&t, &format!("{session}/i4"), tg::EVALUATES),
        [format!("{session}/i3")]
    );
    assert_eq!(
        values(&t, &format!("{session}/i3/observation"), tg::CONTENT),
        ["It is a number."]
    );
    assert!(t.iter().any(|x| x.s.iri == format!("{session}/final")
        && x.p.iri.ends_with("wasDerivedFrom")
        && x.o.iri == format!("{session}/i6/observation")));
    assert_eq!(
        prompts
            .iter()
            .filter(|p| p.contains("Request to answer: Sum"))
            .count(),
        2
    );
    assert_no_dangling_links(&t);
    assert_thoughts_explained(&responses, &t);
}

/// A plan's long draft answer (over 4 KiB, so the message after it carries an excerpt and the
/// whole text is checked in as a document) is reviewed whole and given whole. Until 2026-12-04 the
/// plan's review read the draft from the message as it came: the judge was shown its first
/// kilobyte, and an accepted draft reached the client as that excerpt with its claim-check mark.
#[tokio::test]
async fn a_plans_long_draft_is_reviewed_whole_and_given_whole() {
    const TOKEN: &str = "critic-long-token";
    let config = config_dir(
        "answer-long",
        &[
            (
                "agent-pattern",
                r#"{"plan-then-execute": {"description": "plan first", "critic": ["answer"]}}"#,
            ),
            ("agent-limits", r#"{"default": {"max_iterations": 20}}"#),
        ],
    );
    let draft = format!(
        "The sum is 12. {}END-OF-DRAFT.",
        "Here is how it was added up. ".repeat(200)
    );
    assert!(draft.len() > agent_core::documents::CHECK_IN_OVER);
    let script = format!(
        r#"{{"rules": [
      {{"match": "Request to plan: Sum", "reply": "[{{\"goal\": \"add them\"}}]"}},
      {{"match": "Step goal: add them", "reply": "Thought: adding.\nFinal Answer: 12"}},
      {{"match": "Request to answer: Sum", "reply": "{draft}"}},
      {{"match": "Draft answer to review: The sum is 12.", "and": ["END-OF-DRAFT."], "reply": "{{\"status\": \"SUCCESS\"}}"}}
    ]}}"#
    );
    let Stack {
        broker,
        aggregator: _aggregator,
        llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, &script, &config, &[]).await;
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "plan-then-execute".into(),
        ..request("Sum the numbers.", false)
    };
    client.send("long-draft", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "long-draft", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let calls = llm.calls();
    let last = responses.last().unwrap();
    assert!(last.error.is_none(), "{responses:#?}\n{calls:#?}");
    assert_eq!(
        last.content, draft,
        "the answer given is not the whole draft"
    );
    // The judge was asked once, and answered (its rule needs the draft's end).
    assert_eq!(calls.iter().filter(|c| c.rule == Some(3)).count(), 1);
    assert!(calls.iter().all(|c| c.rule.is_some()), "{calls:#?}");
}

/// The answer critic on ReACT, switched on by the task type: the first draft is rejected with a
/// lesson, the agent looks the fact up, and the second draft is accepted. Only the accepted
/// answer reaches the client as the answer; the graph records both drafts and both verdicts.
#[tokio::test]
async fn a_react_answer_is_given_only_once_the_critic_accepts_it() {
    const TOKEN: &str = "critic-token";
    let config = config_dir(
        "react-answer-critic",
        &[
            (
                "agent-task-type",
                r#"{"checked": {"description": "answers that must be checked", "valid_patterns": ["react"], "critic": ["answer"]}}"#,
            ),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let script = r#"{"rules": [
      {"match": "Draft answer to review: Mars has two moons.", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"it matches the lookup\"}"},
      {"match": "Draft answer to review: Mars has one moon.", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"not checked\", \"lesson\": \"look it up with the llm tool\"}"},
      {"match": "moons of Mars", "exact": true, "reply": "Phobos and Deimos"},
      {"match": "Observation: Phobos and Deimos", "reply": "Thought: Two names.\nFinal Answer: Mars has two moons."},
      {"match": "Review of the draft: EXECUTION_ERROR", "reply": "Thought: Look it up.\nAction: llm\nArgs: {\"question\": \"moons of Mars\"}"},
      {"match": "Question: How many moons has Mars?", "reply": "Thought: I recall.\nFinal Answer: Mars has one moon."}
    ]}"#;
    let Stack {
        broker,
        aggregator,
        llm: _llm,
        orchestrator: _orchestrator,
    } = Stack::journaled(TOKEN, script, &config, &[]).await;
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "react".into(),
        task_type: "checked".into(),
        ..request("How many moons has Mars?", true)
    };
    client.send("moons", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "moons", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let answer: String = responses
        .iter()
        .filter(|r| r.message_type == "answer")
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(answer, "Mars has two moons.", "{responses:#?}");
    assert!(
        !responses
            .iter()
            .any(|r| r.message_type == "answer" && r.content.contains("one moon")),
        "the rejected draft never went out as the answer"
    );
    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    // Draft, rejection, lookup, draft, acceptance, conclusion: each verdict judges the draft
    // before it, and the conclusion derives from the accepting review.
    let dag = format!(
        "{prefixes}SELECT ?n WHERE {{ GRAPH <urn:graph:retrieval> {{
           <{session}/i1> a tg:Synthesis .
           <{session}/i2> a tg:Evaluation ; tg:evaluates <{session}/i1> ; tg:evaluationStatus \"EXECUTION_ERROR\" ; tg:lesson \"look it up with the llm tool\" .
           <{session}/i3> tg:action \"llm\" .
           <{session}/i4> a tg:Synthesis .
           <{session}/i5> a tg:Evaluation ; tg:evaluates <{session}/i4> ; tg:evaluationStatus \"SUCCESS\" .
           <{session}/final> prov:wasDerivedFrom <{session}/i5/observation> ; tg:terminationReason \"answer\" ;
             tg:document ?n . ?n tg:content \"Mars has two moons.\" }} }}"
    );
    assert_eq!(count_reaching(&aggregator.store(), dag, 1).await, 1);
}

/// The review is one more LLM call, held to the run's limits as every call is: deep research's
/// draft written in the dialog's last iteration is given, saying it was not reviewed, and the
/// judge is not asked (before, the writer and the judge ran past `max_iterations` and the run's
/// budget, up to twice `max_retries` calls more).
#[tokio::test]
async fn a_draft_at_the_iteration_limit_is_given_unreviewed_without_asking_the_judge() {
    let config = config_dir(
        "research-judge-limit",
        &[("agent-limits", r#"{"default": {"max_iterations": 2}}"#)],
    );
    let script = r#"{"rules": [
      {"match": "Request to research: What does alpha cost?", "reply": "{\"thought\": \"Known.\", \"complete\": true, \"gaps\": []}"},
      {"match": "Request to write up: What does alpha cost?", "reply": "Alpha costs 3."},
      {"match": "Review a draft answer", "reply": "{\"status\": \"SUCCESS\"}"}
    ]}"#;
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "deep-research".into(),
        ..request("What does alpha cost?", false)
    };
    client.send("limit", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "limit", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        outcome(&responses),
        "Alpha costs 3.\n\n(This answer was not reviewed: the dialog used its 2 iterations (max_iterations).)",
        "{responses:#?}"
    );
    let calls = llm.calls();
    assert!(
        !calls
            .iter()
            .any(|c| c.last_user.contains("Review a draft answer")),
        "{calls:#?}"
    );
    let session = session_of(&responses);
    assert_eq!(
        values(
            &explained(&responses),
            &format!("{session}/final"),
            tg::TERMINATION_REASON
        ),
        ["max-iterations"]
    );
}

/// The same for Plan-then-Execute and ReACT. A plan whose last step ends at the limit has no
/// iteration left for a draft's review, so its answer is given at once, saying so (before
/// 2026-12-02 the draft was queued past `max_iterations` and refused: the client got an error);
/// a plan's draft written in the last iteration is given unreviewed (before, it was thrown away and
/// a new answer written, saying the plan could not be finished); a ReACT draft written in the
/// last iteration is given unreviewed (before, the dialog said it could not reach an answer,
/// with the draft as its last observation).
#[tokio::test]
async fn a_plans_or_react_draft_at_the_iteration_limit_is_given_unreviewed() {
    let config = |max_iterations: usize| {
        config_dir(
            &format!("answer-critic-limit-{max_iterations}"),
            &[
                (
                    "agent-pattern",
                    r#"{"plan-then-execute": {"description": "plan first", "critic": ["answer"]},
                        "react": {"description": "step by step", "critic": ["answer"]}}"#,
                ),
                (
                    "agent-limits",
                    &format!(r#"{{"default": {{"max_iterations": {max_iterations}}}}}"#),
                ),
                (
                    "tool",
                    r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
                ),
            ],
        )
    };
    let plan_script = r#"{"rules": [
      {"match": "Request to plan: Sum", "reply": "[{\"goal\": \"add them\"}]"},
      {"match": "Step goal: add them", "reply": "Thought: adding.\nFinal Answer: 12"},
      {"match": "Request to answer: Sum", "reply": "The sum is 12."},
      {"match": "Draft answer to review", "reply": "{\"status\": \"SUCCESS\"}"}
    ]}"#;
    // Two iterations: plan, step, and no room for a draft. Three: plan, step, draft, and no
    // room for its review.
    for max_iterations in [2, 3] {
        let (responses, prompts) =
            run(plan_script, &config(max_iterations), "Sum the numbers.").await;
        assert_eq!(
            outcome(&responses),
            format!("The sum is 12.\n\n(This answer was not reviewed: the dialog used its {max_iterations} iterations (max_iterations).)"),
            "{responses:#?}"
        );
        assert_eq!(
            prompts
                .iter()
                .filter(|p| p.contains("Request to answer: Sum"))
                .count(),
            1,
            "{prompts:#?}"
        );
        assert!(
            !prompts.iter().any(|p| p.contains("Draft answer to review")),
            "{prompts:#?}"
        );
        let session = session_of(&responses);
        assert_eq!(
            values(
                &explained(&responses),
                &format!("{session}/final"),
                tg::TERMINATION_REASON
            ),
            ["max-iterations"]
        );
    }

    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Question: What does alpha cost?", "reply": "Thought: I know.\nFinal Answer: Alpha costs 3."},
      {"match": "Draft answer to review", "reply": "{\"status\": \"SUCCESS\"}"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config(1), &[]);
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "react".into(),
        ..request("What does alpha cost?", false)
    };
    client.send("react-limit", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "react-limit", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        outcome(&responses),
        "Alpha costs 3.\n\n(This answer was not reviewed: the dialog used its 1 iterations (max_iterations).)",
        "{responses:#?}"
    );
    assert!(
        !llm.calls()
            .iter()
            .any(|c| c.last_user.contains("Draft answer to review")),
        "{:#?}",
        llm.calls()
    );
}

/// A ReACT draft the reviewer rejects in the last iterations the limits allow is given, saying
/// the reviewer did not accept it. Before, the dialog said it could not reach an answer, with the
/// review's lesson as its last observation, and the draft was lost.
#[tokio::test]
async fn a_react_draft_rejected_at_the_iteration_limit_is_given_saying_so() {
    let config = config_dir(
        "react-rejected-at-limit",
        &[
            (
                "agent-pattern",
                r#"{"react": {"description": "step by step", "critic": ["answer"]}}"#,
            ),
            ("agent-limits", r#"{"default": {"max_iterations": 2}}"#),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let script = r#"{"rules": [
      {"match": "Draft answer to review", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"not checked\", \"lesson\": \"look the price up\"}"},
      {"match": "Question: What does alpha cost?", "reply": "Thought: I know.\nFinal Answer: Alpha costs 3."}
    ]}"#;
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "react".into(),
        ..request("What does alpha cost?", false)
    };
    client.send("react-rejected", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "react-rejected", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let answer = outcome(&responses);
    assert!(
        answer.starts_with("Alpha costs 3.") && answer.contains("did not accept"),
        "{responses:#?}"
    );
    assert!(!answer.contains("look the price up"), "{answer}");
    // The draft and its review, and no LLM call past them.
    assert_eq!(llm.calls().len(), 2, "{:#?}", llm.calls());
}

/// The answer critic on a supervisor's synthesis: the first synthesis is rejected with a lesson and
/// written again from the same subagent results (no subagent runs again); only the accepted one
/// is the answer. The draft derives from the synthesis node, so the DAG stays whole.
#[tokio::test]
async fn a_supervisors_synthesis_is_written_again_until_the_critic_accepts_it() {
    let config = config_dir(
        "supervisor-answer-critic",
        &[
            (
                "agent-pattern",
                r#"{"react": {"description": "reason and act"},
                    "supervisor": {"description": "fan out", "critic": ["answer"]}}"#,
            ),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let script = r#"{"rules": [
      {"match": "Draft answer to review: Alpha 1, beta 2.", "reply": "{\"status\": \"SUCCESS\"}"},
      {"match": "Draft answer to review: Alpha 1.", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"beta is missing\", \"lesson\": \"mention beta too\"}"},
      {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
      {"match": "Question: price of alpha", "reply": "Thought: known.\nFinal Answer: alpha costs 1"},
      {"match": "Question: price of beta", "reply": "Thought: known.\nFinal Answer: beta costs 2"},
      {"match": "lessons: mention beta too", "reply": "Alpha 1, beta 2."},
      {"match": "Request to answer from the subagents: Compare", "reply": "Alpha 1."}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "supervisor".into(),
        ..request("Compare the prices of alpha and beta", false)
    };
    client.send("prices", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "prices", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        responses.last().unwrap().content,
        "Alpha 1, beta 2.",
        "{responses:#?}"
    );
    let asked = |what: &str| {
        llm.calls()
            .iter()
            .filter(|c| c.last_user.contains(what))
            .count()
    };
    assert_eq!(asked("Question: price of"), 2, "each subagent ran once");
    assert_eq!(
        asked("Request to answer from the subagents"),
        2,
        "two syntheses"
    );
    let t = explained(&responses);
    assert_no_dangling_links(&t);
    let session = session_of(&responses);
    let prefixes = agent_core::vocab::SPARQL_PREFIXES;
    let dag = format!(
        "{prefixes}SELECT ?draft WHERE {{ GRAPH <urn:graph:retrieval> {{
           ?draft a tg:Synthesis ; tg:action \"synthesise\" ; prov:wasDerivedFrom ?synthesis .
           ?synthesis a tg:Synthesis ; tg:correlationId ?cid .
           ?rejection tg:evaluates ?draft ; tg:evaluationStatus \"EXECUTION_ERROR\" ; tg:lesson \"mention beta too\" .
           ?second a tg:Synthesis ; prov:wasDerivedFrom ?rejectionObs .
           ?rejectionObs prov:wasDerivedFrom ?rejection .
           ?acceptance tg:evaluates ?second ; tg:evaluationStatus \"SUCCESS\" .
           <{session}/final> prov:wasDerivedFrom ?acceptanceObs . ?acceptanceObs prov:wasDerivedFrom ?acceptance .
           FILTER(STRSTARTS(STR(?draft), \"{session}/i\"))
        }} }}"
    );
    assert_eq!(count_reaching(&aggregator.store(), dag, 1).await, 1);
    // The second synthesis's call is recorded on its draft, the judge's on their verdicts.
    let closing = responses.last().unwrap();
    let total = closing.in_token.unwrap_or(0) + closing.out_token.unwrap_or(0);
    assert_graph_tokens(&aggregator.store(), &session, total).await;
}

/// A synthesis written again after the critic rejected a draft may ask for another round, or
/// ask for one past the limits: either way each LLM call is counted once, on one node, and the
/// closing counts what the graph records. Until 2026-12-05 the synthesis node was written again
/// with a second (zero) cost when the rewrite asked for a round, and with no room for one the
/// closing counted the rewrite's call while no node recorded it.
async fn rewritten_synthesis_asks_for_another_round(max_iterations: u64) -> Vec<AgentResponse> {
    let config = config_dir(
        &format!("supervisor-answer-critic-round-{max_iterations}"),
        &[
            (
                "agent-pattern",
                r#"{"react": {"description": "reason and act"},
                    "supervisor": {"description": "fan out", "critic": ["answer"]}}"#,
            ),
            (
                "agent-limits",
                &format!(r#"{{"default": {{"max_iterations": {max_iterations}}}}}"#),
            ),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let script = r#"{"rules": [
      {"match": "Draft answer to review: Alpha 1, beta 2, gamma 3.", "reply": "{\"status\": \"SUCCESS\"}"},
      {"match": "Draft answer to review: Alpha 1.", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"gamma is missing\", \"lesson\": \"price gamma too\"}"},
      {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
      {"match": "Question: price of alpha", "reply": "Thought: known.\nFinal Answer: alpha costs 1"},
      {"match": "Question: price of beta", "reply": "Thought: known.\nFinal Answer: beta costs 2"},
      {"match": "Question: price of gamma", "reply": "Thought: known.\nFinal Answer: gamma costs 3"},
      {"match": "gamma costs 3", "reply": "Alpha 1, beta 2, gamma 3."},
      {"match": "lessons: price gamma too", "reply": "{\"goals\": [{\"goal\": \"price of gamma\", \"pattern\": \"react\"}]}"},
      {"match": "Request to answer from the subagents: Compare", "reply": "Alpha 1."}
    ]}"#;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "supervisor".into(),
        ..request("Compare the prices of alpha, beta and gamma", false)
    };
    client.send("prices-again", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "prices-again", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let closings = responses.iter().filter(|r| r.end_of_dialog).count();
    assert_eq!(closings, 1, "{responses:#?}");
    let rewrites = llm
        .calls()
        .iter()
        .filter(|c| {
            c.last_user.contains("lessons: price gamma too")
                && !c.last_user.contains("gamma costs 3")
        })
        .count();
    assert_eq!(rewrites, 1, "the rejected draft was written again once");
    assert_no_dangling_links(&explained(&responses));
    let closing = responses.last().unwrap();
    let total = closing.in_token.unwrap_or(0) + closing.out_token.unwrap_or(0);
    assert_graph_tokens(&aggregator.store(), &session_of(&responses), total).await;
    responses
}

#[tokio::test]
async fn a_rewritten_synthesis_that_asks_for_another_round_records_its_cost_once() {
    let responses = rewritten_synthesis_asks_for_another_round(12).await;
    assert_eq!(
        outcome(&responses),
        "Alpha 1, beta 2, gamma 3.",
        "{responses:#?}"
    );
}

#[tokio::test]
async fn a_rewritten_synthesis_that_asks_for_a_round_past_the_limit_is_counted_on_the_conclusion() {
    let responses = rewritten_synthesis_asks_for_another_round(5).await;
    let answer = outcome(&responses);
    assert!(
        answer.starts_with("I could not run another round of subagents"),
        "{responses:#?}"
    );
}

/// A supervisor's synthesis written in the dialog's last iteration has no iteration left for its
/// review: it is given at once, saying it was not reviewed, and the judge is not asked, as a
/// plan's is.
#[tokio::test]
async fn a_supervisors_synthesis_at_the_iteration_limit_is_given_unreviewed() {
    let config = config_dir(
        "supervisor-answer-critic-limit",
        &[
            (
                "agent-pattern",
                r#"{"react": {"description": "reason and act"},
                    "supervisor": {"description": "fan out", "critic": ["answer"]}}"#,
            ),
            ("agent-limits", r#"{"default": {"max_iterations": 2}}"#),
            (
                "tool",
                r#"{"llm": {"name": "llm", "description": "ask", "type": "text-completion"}}"#,
            ),
        ],
    );
    let script = r#"{"rules": [
      {"match": "Draft answer to review", "reply": "{\"status\": \"SUCCESS\"}"},
      {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
      {"match": "Question: price of alpha", "reply": "Thought: known.\nFinal Answer: alpha costs 1"},
      {"match": "Question: price of beta", "reply": "Thought: known.\nFinal Answer: beta costs 2"},
      {"match": "Request to answer from the subagents: Compare", "reply": "Alpha 1, beta 2."}
    ]}"#;
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(script).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let request = AgentRequest {
        pattern: "supervisor".into(),
        ..request("Compare the prices of alpha and beta", false)
    };
    client.send("prices-at-limit", &request).await.unwrap();
    let responses = collect_dialog(&mut client, "prices-at-limit", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        outcome(&responses),
        "Alpha 1, beta 2.\n\n(This answer was not reviewed: the dialog used its 2 iterations (max_iterations).)",
        "{responses:#?}"
    );
    assert!(
        !llm.calls()
            .iter()
            .any(|c| c.last_user.contains("Draft answer to review")),
        "{:#?}",
        llm.calls()
    );
}
