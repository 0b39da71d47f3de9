//! Property-based fuzzing of the parsers that read LLM text: the ReACT parser (whole and
//! streamed), the plan parser and validator, and the supervisor's goal parser. Whatever the LLM
//! writes, they return a value or an error and never panic; streaming gives the same text however
//! the answer is cut into chunks. `PROPTEST_CASES` sets how many inputs each property tries.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use agent_core::plan;
use agent_core::react::{self, ReactDelta, ReactStream, ReactTurn};
use agent_core::supervisor;
use agent_schema::PlanStep;
use proptest::prelude::*;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    ProptestConfig {
        cases,
        ..ProptestConfig::default()
    }
}

/// Text an LLM might write: the protocol's markers and JSON punctuation mixed with arbitrary text,
/// so that inputs reach deep into the parsers rather than failing on the first byte.
fn llm_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        3 => prop::sample::select(vec![
            "Thought:", "Action:", "Args:", "Action Input:", "Final Answer:", "Observation:",
            "**Action:**", "final answer:", "\n", " ", "{", "}",
            "[", "]", "\"", ":", ",", "```json\n", "```", "\"goal\"", "\"steps\"", "\"goals\"",
            "\"depends_on\"", "[0]", "[-1]", "[99999999999]", "\"rationale\"", "null", "é", "🦀",
            "\\", "\\\"", "\"pattern\": \"supervisor\"", "{\"q\": \"x\"}",
        ])
        .prop_map(str::to_owned),
        1 => ".{0,10}",
    ];
    prop::collection::vec(piece, 0..40).prop_map(|pieces| pieces.concat())
}

/// Cuts `text` at the given fractions, on character boundaries, as a streamed answer would arrive.
fn chunks(text: &str, cuts: &[prop::sample::Index]) -> Vec<String> {
    let boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
    let mut at: Vec<usize> = if boundaries.is_empty() {
        Vec::new()
    } else {
        cuts.iter().map(|c| *c.get(&boundaries)).collect()
    };
    at.sort_unstable();
    at.dedup();
    let mut out = Vec::new();
    let mut start = 0;
    for cut in at {
        out.push(text[start..cut].to_owned());
        start = cut;
    }
    out.push(text[start..].to_owned());
    out
}

fn streamed(pieces: &[String]) -> (String, String) {
    let mut stream = ReactStream::default();
    let mut deltas = Vec::new();
    for piece in pieces {
        deltas.extend(stream.push(piece));
    }
    deltas.extend(stream.finish());
    let mut thought = String::new();
    let mut answer = String::new();
    for d in deltas {
        match d {
            ReactDelta::Thought(t) => thought.push_str(&t),
            ReactDelta::Answer(a) => answer.push_str(&a),
        }
    }
    (thought, answer)
}

fn plan_step() -> impl Strategy<Value = PlanStep> {
    (
        prop_oneof![Just(String::new()), "[a-z ]{1,8}"],
        prop::collection::vec(-2i64..8, 0..4),
        prop::sample::select(vec!["pending", "running", "completed", "failed", "odd"]),
    )
        .prop_map(|(goal, depends_on, status)| PlanStep {
            goal,
            depends_on,
            status: status.to_owned(),
            ..PlanStep::default()
        })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn react_parse_never_panics(text in llm_text()) {
        if let Ok(ReactTurn::Action { action, .. }) = react::parse(&text) {
            prop_assert!(!action.trim().is_empty());
        }
    }

    #[test]
    fn react_parse_never_panics_on_any_text(text in ".{0,200}") {
        let _ = react::parse(&text);
    }

    /// However the answer is cut into chunks, the client is streamed the same thought and answer.
    #[test]
    fn react_streaming_does_not_depend_on_chunking(
        text in llm_text(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        let whole = streamed(std::slice::from_ref(&text));
        let pieces = chunks(&text, &cuts);
        prop_assert_eq!(pieces.concat(), text.clone());
        prop_assert_eq!(streamed(&pieces), whole);
    }

    /// A streamed final answer is the answer the parser reads from the whole text.
    #[test]
    fn streamed_final_answer_is_the_parsed_one(
        thought in "[a-zA-Z ,.]{0,30}",
        answer in "[a-zA-Z0-9 ,.:\n]{1,40}",
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let text = format!("Thought: {thought}\nFinal Answer: {answer}");
        let parsed = react::parse(&text);
        if let Ok(ReactTurn::Final { answer: parsed_answer, .. }) = parsed {
            let (_, streamed_answer) = streamed(&chunks(&text, &cuts));
            prop_assert_eq!(streamed_answer, parsed_answer);
        }
    }

    /// The first decision wins while streaming too: a completion whose first decision is an
    /// action never streams answer text, however it is chunked and whatever follows the action.
    #[test]
    fn no_answer_streams_when_an_action_comes_first(
        text in llm_text(),
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..12),
    ) {
        if let Ok(ReactTurn::Action { .. }) = react::parse(&text) {
            let (_, answer) = streamed(&chunks(&text, &cuts));
            prop_assert_eq!(answer, "");
        }
    }

    /// A model that runs on past its action: the action is taken, and what follows is discarded
    /// whole, never streamed as an answer.
    #[test]
    fn an_invented_answer_after_an_action_is_discarded(
        invented in "[a-zA-Z0-9 ,.:\n]{1,40}",
        cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8),
    ) {
        let tail = format!("Observation: {invented}\nFinal Answer: {invented}");
        let text = format!("Thought: t\nAction: add\nArgs: {{\"a\": 1}}\n{tail}");
        let parsed = react::parse(&text);
        let Ok(ReactTurn::Action { action, discarded, .. }) = parsed else {
            return Err(TestCaseError::fail(format!("{parsed:?}")));
        };
        prop_assert_eq!(action, "add");
        prop_assert_eq!(discarded, tail.trim());
        let (_, answer) = streamed(&chunks(&text, &cuts));
        prop_assert_eq!(answer, "");
    }

    #[test]
    fn plan_parse_never_panics_and_starts_pending(text in llm_text()) {
        if let Ok((steps, _)) = plan::parse(&text) {
            prop_assert!(steps.iter().all(|s| s.status == "pending" && s.result.is_empty()));
            let _ = plan::validate(&steps, 8);
        }
    }

    /// A plan that validates is a DAG: completing ready steps one at a time finishes all of them.
    #[test]
    fn a_valid_plan_always_runs_to_the_end(mut steps in prop::collection::vec(plan_step(), 0..8)) {
        for s in &mut steps {
            s.status = "pending".to_owned();
        }
        if plan::validate(&steps, 8).is_ok() {
            for _ in 0..steps.len() {
                let ready = plan::ready_step(&steps);
                prop_assert!(ready.is_some(), "a valid plan got stuck: {:?}", steps);
                if let Some(i) = ready {
                    steps[i].status = "completed".to_owned();
                }
            }
            prop_assert!(steps.iter().all(|s| s.status == "completed"));
            prop_assert!(plan::ready_step(&steps).is_none());
        }
    }

    #[test]
    fn plan_validation_never_panics(steps in prop::collection::vec(plan_step(), 0..10), max in 0usize..12) {
        let _ = plan::validate(&steps, max);
        let _ = plan::ready_step(&steps);
        let _ = plan::describe(&steps);
    }

    #[test]
    fn goal_parse_never_panics_and_respects_max(text in llm_text(), max in 1usize..6, nested in any::<bool>()) {
        if let Ok(goals) = supervisor::parse_goals(&text, max, nested) {
            prop_assert!(goals.len() <= max);
            prop_assert!(goals.iter().all(|g| nested || g.pattern != agent_core::pattern::Pattern::Supervisor));
        }
        let _ = supervisor::parse_synthesis(&text, max, nested);
    }
}
