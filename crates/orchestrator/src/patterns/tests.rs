//! The patterns' decisions, step by step, with their effects kept in memory: a scripted
//! OpenAI-compatible server answers the LLM calls (real HTTP), the seed config is the one shipped,
//! and nothing goes to a broker. The end-to-end tests (`tests/tests`) cover the same patterns on a
//! real broker with their provenance in a real store.

use std::path::Path;

use agent_core::config::AgentConfig;
use agent_core::provenance::SessionUris;
use agent_llm::{LlmClient, LlmConfig};
use agent_schema::{AgentRequest, AgentResponse, AgentStep, Triples};
use scripted_llm::{Script, ScriptedLlm};

use crate::emit::{DialogOutput, MemorySink, Outputs};
use crate::journal::Channel;
use crate::turn::Turn;

const SCRIPT: &str = r#"{"rules": [
  {"match": "Its steps so far:", "reply": "Ask the tool a sharper question."},
  {"match": "Request to route: route me to the tool", "reply": "{\"choice\": \"tool:llm\", \"rationale\": \"one lookup\", \"arguments\": {\"question\": \"inner?\"}}"},
  {"match": "Request to route: route me nowhere", "reply": "{\"choice\": \"tool:shell\", \"rationale\": \"not offered\"}"},
  {"match": "Request to research: Prices", "and": ["(no notes yet)"], "reply": "{\"thought\": \"both unknown\", \"complete\": false, \"gaps\": [\"a\", \"b\"], \"calls\": [{\"tool\": \"llm\", \"arguments\": {\"question\": \"inner?\"}}, {\"tool\": \"llm\", \"arguments\": {\"question\": \"outer?\"}}]}"},
  {"match": "outer?", "exact": true, "reply": "OUTER"},
  {"match": "Request to research: Outage", "and": ["(no notes yet)"], "reply": "{\"thought\": \"two lookups\", \"complete\": false, \"gaps\": [\"a\"], \"calls\": [{\"tool\": \"llm\", \"arguments\": {\"question\": \"down?\"}}, {\"tool\": \"llm\", \"arguments\": {\"question\": \"outer?\"}}]}"},
  {"match": "down?", "exact": true, "reply": "DOWN", "faults": ["503", "503", "503", "503"]},
  {"match": "Question: greet the reader", "reply": "Thought: the greeting tool.\nAction: greet\nArgs: {\"w\": \"reader\"}"},
  {"match": "Say hello to reader", "reply": "HELLO READER"},
  {"match": "Question: verify the order", "reply": "Thought: verify it first.\nAction: verify\nArgs: {\"question\": \"order 7\"}"},
  {"match": "Question: what is one", "reply": "Thought: I know it.\nFinal Answer: ONE"},
  {"match": "Question: ask the tool", "reply": "Thought: the tool knows.\nAction: llm\nArgs: {\"question\": \"inner?\"}"},
  {"match": "inner?", "exact": true, "reply": "INNER"},
  {"match": "Step goal: find a", "reply": "Thought: the tool knows.\nAction: llm\nArgs: {\"question\": \"inner?\"}"},
  {"match": "Request to plan: Combine", "reply": "{\"rationale\": \"a then b\", \"steps\": [{\"goal\": \"find a\", \"depends_on\": []}, {\"goal\": \"find b\", \"depends_on\": [0]}]}"},
  {"match": "Request to split: Compare", "reply": "[{\"goal\": \"price of alpha\"}, {\"goal\": \"price of beta\"}]"},
  {"match": "Draft answer to review: ONE", "reply": "{\"status\": \"SUCCESS\", \"evaluation\": \"right\"}"},
  {"match": "Draft answer to review: TWO", "reply": "{\"status\": \"EXECUTION_ERROR\", \"evaluation\": \"wrong number\", \"lesson\": \"count again\"}"},
  {"match": "Draft answer to review: THREE", "reply": "I would rather not say."},
  {"match": "Question to reconcile: Is it safe?", "reply": "{\"agreed\": [\"it depends\"], \"disagreed\": [], \"answer\": \"Mostly safe.\"}"},
  {"match": "Request to answer from the subagents: Empty", "reply": ""},
  {"match": "Question to reconcile: Empty?", "reply": "   "},
  {"match": "Think, then answer", "reply": "<think>\nhm, maybe 41\n</think>\n\nThe answer is 42", "chunk_size": 3},
  {"match": "Think, then split", "reply": "<think>\nsplit it?\n</think>\n{\"goals\": [{\"goal\": \"a\"}]}", "chunk_size": 3},
  {"match": "Request to split: Chain", "reply": "[{\"id\": \"a\", \"goal\": \"find a\"}, {\"id\": \"b\", \"goal\": \"use a\", \"needs\": [\"a\"]}]"}
]}"#;

/// What one step sent, by kind.
struct Sent {
    responses: Vec<AgentResponse>,
    requests: Vec<AgentRequest>,
    explained: Vec<Triples>,
    /// Which channel each message went to, in the order sent.
    channels: Vec<Channel>,
}

struct Harness {
    llm: ScriptedLlm,
    client: LlmClient,
    config: AgentConfig,
    mcp: agent_mcp::McpPool,
}

impl Harness {
    async fn start() -> Harness {
        let script = Script::from_json(SCRIPT).expect("the script is valid JSON");
        let llm = ScriptedLlm::start(script, "127.0.0.1:0".parse().expect("an address"))
            .await
            .expect("the scripted LLM starts");
        let client = LlmClient::new(LlmConfig {
            base_url: llm.base_url(),
            model: "scripted".to_owned(),
            max_retries: 0,
            ..LlmConfig::default()
        })
        .expect("a client");
        let seed = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config-seed");
        let config = crate::settings::load_config_dir(&seed).expect("the seed config loads");
        Harness {
            llm,
            client,
            config,
            mcp: agent_mcp::McpPool::new(),
        }
    }

    /// Runs one step of `request` as the engine would (its pattern's iteration, then the commit,
    /// without a journal) and returns what it sent.
    async fn step(&self, request: &AgentRequest) -> Sent {
        let (sent, parked) = self.step_parking(request, false).await;
        assert!(!parked, "nothing here is an outage");
        sent
    }

    /// [`Harness::step`] in a step that `may_park`: what it sent, and whether it parked (it then
    /// sends nothing).
    async fn step_parking(&self, request: &AgentRequest, may_park: bool) -> (Sent, bool) {
        let sink = MemorySink::default();
        let outputs = Outputs::Memory(sink.clone());
        let uris = SessionUris::new(&request.session_id);
        let out = DialogOutput::new(&outputs, Some("client-1"), "default", &uris.session(), 0)
            .for_step(
                request,
                &uris.session(),
                0,
                self.config.limits.max_message_bytes,
            );
        let delivered = agent_bus::Properties::new();
        let replay = crate::replay::StepReplay::recording();
        let turn = Turn {
            request,
            session_id: &request.session_id,
            uris: &uris,
            out: &out,
            config: &self.config,
            llm: &self.client,
            knowledge: None,
            documents: None,
            mcp: &self.mcp,
            tokens_before: Default::default(),
            run_tokens: 0,
            run_iterations: 0,
            abandoned: false,
            seal: None,
            elapsed: std::time::Duration::ZERO,
            may_park,
            cancelled: None,
            delivered: &delivered,
            replay: &replay,
            kept_documents: Default::default(),
            recorded_calls: Default::default(),
        };
        super::iterate(&turn).await.expect("the step runs");
        let parked = out.parked().is_some();
        if !parked {
            out.commit(None).await.expect("the commit publishes");
        }
        let sent = Sent {
            responses: sink.decoded(Channel::Responses),
            requests: sink.decoded(Channel::Requests),
            explained: sink.decoded(Channel::Explainability),
            channels: sink.sent().iter().map(|s| s.channel).collect(),
        };
        (sent, parked)
    }
}

fn request(question: &str, pattern: &str) -> AgentRequest {
    AgentRequest {
        question: question.to_owned(),
        pattern: pattern.to_owned(),
        session_id: "0b7d0c1e-5f5e-4c2a-9a57-3b0c8b2d1e01".to_owned(),
        collection: "default".to_owned(),
        ..AgentRequest::default()
    }
}

fn closing(sent: &Sent) -> Vec<&AgentResponse> {
    sent.responses.iter().filter(|r| r.end_of_dialog).collect()
}

#[tokio::test]
async fn react_answers_and_closes_the_dialog_without_queueing_more() {
    let harness = Harness::start().await;
    let sent = harness.step(&request("what is one", "react")).await;
    let closing = closing(&sent);
    assert_eq!(
        closing.len(),
        1,
        "one closing message: {:?}",
        sent.responses
    );
    assert_eq!(closing[0].content, "ONE");
    assert!(sent.requests.is_empty(), "an answer queues nothing");
    assert!(
        !sent.explained.is_empty(),
        "the conclusion is recorded as provenance"
    );
    assert_eq!(harness.llm.calls().len(), 1);
}

#[tokio::test]
async fn react_runs_the_chosen_tool_and_queues_the_next_iteration_with_its_observation() {
    let harness = Harness::start().await;
    let sent = harness.step(&request("ask the tool", "react")).await;
    assert!(closing(&sent).is_empty(), "the dialog goes on");
    assert_eq!(sent.requests.len(), 1, "one next iteration");
    let next = &sent.requests[0];
    assert_eq!(next.history.len(), 1);
    assert_eq!(next.history[0].action, "llm");
    assert_eq!(next.history[0].observation, "INNER");
    assert_eq!(next.session_id, "0b7d0c1e-5f5e-4c2a-9a57-3b0c8b2d1e01");
    assert!(
        sent.responses
            .iter()
            .any(|r| r.message_type == "observation" && r.content == "INNER"),
        "the client sees the observation: {:?}",
        sent.responses
    );
    // The iteration and its observation are two nodes of the graph, in one graph message (one
    // delivery and one write for the aggregator), sent before either node's `explain` copy to the
    // client, and each node is its own `explain` message there, as TrustGraph's clients read them.
    let uris = SessionUris::new(&next.session_id);
    assert_eq!(sent.explained.len(), 1, "{:?}", sent.explained);
    for node in [uris.iteration(1), uris.observation(1)] {
        assert!(
            sent.explained[0].triples.iter().any(|t| t.s.iri == node),
            "{node} is in the graph message: {:?}",
            sent.explained[0]
        );
        let copies = sent
            .responses
            .iter()
            .filter(|r| r.explain_id.as_deref() == Some(node.as_str()))
            .count();
        assert_eq!(copies, 1, "{node} goes to the client once");
    }
    let graph_message = sent
        .channels
        .iter()
        .position(|c| *c == Channel::Explainability);
    let first_copy = sent
        .responses
        .iter()
        .position(|r| r.message_type == "explain")
        .and_then(|n| {
            sent.channels
                .iter()
                .enumerate()
                .filter(|(_, c)| **c == Channel::Responses)
                .nth(n)
                .map(|(i, _)| i)
        });
    assert!(graph_message < first_copy, "{:?}", sent.channels);
    // The ReACT call, then the tool's own LLM call.
    assert_eq!(harness.llm.calls().len(), 2);
}

/// With the answer critic on for ReACT, a final answer is a draft: queued for review, not given.
/// Accepted, it is the answer; rejected, the agent goes on with the lesson in its history, until
/// the retries are used and the last draft is given marked as not accepted.
#[tokio::test]
async fn react_with_the_answer_critic_gives_only_a_reviewed_answer() {
    let mut harness = Harness::start().await;
    if let Some(react) = harness.config.patterns.get_mut("react") {
        react.critic = vec!["answer".to_owned()];
    }
    harness.config.limits.max_retries = 1;
    let drafted = harness
        .step(&AgentRequest {
            streaming: true,
            ..request("what is one", "react")
        })
        .await;
    assert!(
        closing(&drafted).is_empty(),
        "a draft is not given: {:?}",
        drafted.responses
    );
    assert!(
        drafted.responses.iter().all(|r| r.message_type != "answer"),
        "nor streamed as the answer"
    );
    let review = &drafted.requests[0];
    assert_eq!(review.history[0].step_type, "synthesise");
    assert_eq!(review.history[0].observation, "ONE");
    let reviewed = harness.step(review).await;
    assert_eq!(closing(&reviewed).len(), 1);
    // Streamed, the accepted answer goes out as its chunk before the closing message.
    let answer: String = reviewed
        .responses
        .iter()
        .filter(|r| r.message_type == "answer")
        .map(|r| r.content.as_str())
        .collect();
    assert_eq!(answer, "ONE");

    // A rejected draft: the lesson goes into the history and the agent goes on.
    let mut rejected = review.clone();
    rejected.streaming = false;
    rejected.history[0].observation = "TWO".to_owned();
    let verdict = harness.step(&rejected).await;
    assert!(closing(&verdict).is_empty());
    let again = &verdict.requests[0];
    assert_eq!(again.history[1].step_type, "evaluate");
    assert!(
        again.history[1].observation.contains("Lesson: count again"),
        "{:?}",
        again.history
    );
    // Rejected once more than max_retries allows: the draft is given, marked as not accepted.
    let mut last = again.clone();
    last.history.push(rejected.history[0].clone());
    let given = harness.step(&last).await;
    let closing = closing(&given);
    assert_eq!(closing.len(), 1);
    assert!(
        closing[0].content.starts_with("TWO"),
        "{}",
        closing[0].content
    );
    assert!(closing[0]
        .content
        .contains("A reviewer did not accept this answer: wrong number"));
}

/// What the next step is given is recorded for the graph (a fork starts from it), riding on the
/// graph message the step's nodes share rather than a message of its own, and never sent to the
/// client.
#[tokio::test]
async fn the_next_steps_input_is_kept_for_the_graph_only() {
    let harness = Harness::start().await;
    let sent = harness.step(&request("ask the tool", "react")).await;
    let step_input = agent_core::vocab::tg::STEP_INPUT.as_str();
    let is_input = |t: &agent_schema::Triple| t.o.iri == step_input;
    let graph_messages: Vec<&Triples> = sent
        .explained
        .iter()
        .filter(|m| m.triples.iter().any(is_input))
        .collect();
    assert_eq!(graph_messages.len(), 1, "{:?}", sent.explained);
    assert!(
        graph_messages[0]
            .triples
            .iter()
            .any(|t| !is_input(t) && t.s.iri.ends_with("/i1/observation")),
        "it rides on the step's graph message"
    );
    let last_graph = sent.explained.last().map(|m| m.metadata.id.clone());
    assert_eq!(last_graph, Some(graph_messages[0].metadata.id.clone()));
    assert!(
        sent.responses
            .iter()
            .all(|r| !r.explain_triples.iter().any(is_input)),
        "the client is not sent it"
    );
    let recorded = graph_messages[0]
        .triples
        .iter()
        .find(|t| t.p.iri.ends_with("ns/request"))
        .map(|t| serde_json::from_str::<AgentRequest>(&t.o.value).unwrap());
    assert_eq!(recorded.as_ref(), sent.requests.first());
}

/// A tool that needs approval is not run on the LLM's word: without a shared store to park the
/// call in, the step observes why and goes on (with one, see `tests/tests/run_control.rs`).
#[tokio::test]
async fn a_tool_that_needs_approval_is_not_run_without_it() {
    let mut harness = Harness::start().await;
    for tool in harness.config.tools.values_mut() {
        if tool.name == "llm" {
            tool.requires_approval = true;
        }
    }
    assert_refused_for_approval(&harness).await;
}

/// The same for a tool whose group needs approval (`approval_groups`): the seed's `llm` tool has
/// no group, so it is in `default`.
#[tokio::test]
async fn a_tool_in_a_group_that_needs_approval_is_not_run_without_it() {
    let mut harness = Harness::start().await;
    harness.config.limits.approval_groups = vec!["default".to_owned()];
    assert_refused_for_approval(&harness).await;
}

async fn assert_refused_for_approval(harness: &Harness) {
    let sent = harness.step(&request("ask the tool", "react")).await;
    assert_eq!(sent.requests.len(), 1, "the dialog goes on");
    let observed = &sent.requests[0].history[0].observation;
    assert!(
        observed.contains("runs only with a person's approval"),
        "{observed}"
    );
    // Only the ReACT call: the tool's own LLM call was never made.
    assert_eq!(harness.llm.calls().len(), 1);
}

#[tokio::test]
async fn a_dialog_at_its_iteration_limit_concludes_without_an_llm_call() {
    let harness = Harness::start().await;
    let mut at_limit = request("ask the tool", "react");
    at_limit.history = vec![
        AgentStep {
            thought: "again".to_owned(),
            action: "llm".to_owned(),
            observation: "LAST".to_owned(),
            ..AgentStep::default()
        };
        harness.config.limits.max_iterations
    ];
    let sent = harness.step(&at_limit).await;
    let closing = closing(&sent);
    assert_eq!(closing.len(), 1);
    assert!(
        closing[0].content.contains("max_iterations") && closing[0].content.contains("LAST"),
        "the answer says why it stopped and what it knew last: {}",
        closing[0].content
    );
    assert!(sent.requests.is_empty());
    assert!(harness.llm.calls().is_empty(), "no LLM call past the limit");
}

#[tokio::test]
async fn plan_then_execute_first_makes_a_plan_and_carries_it_in_the_history() {
    let harness = Harness::start().await;
    let sent = harness
        .step(&request("Combine a and b", "plan-then-execute"))
        .await;
    assert!(closing(&sent).is_empty());
    assert_eq!(sent.requests.len(), 1, "the first step is queued");
    let plan = sent.requests[0].history[0]
        .plan
        .as_ref()
        .expect("the history carries the plan");
    let goals: Vec<&str> = plan.iter().map(|s| s.goal.as_str()).collect();
    assert_eq!(goals, ["find a", "find b"]);
    assert_eq!(plan[1].depends_on, [0]);
}

/// A plan step cannot park for approval: its call of a tool that needs approval is refused where
/// tools run, whichever pattern asks.
#[tokio::test]
async fn a_plan_step_never_runs_a_tool_that_needs_approval() {
    let mut harness = Harness::start().await;
    for tool in harness.config.tools.values_mut() {
        if tool.name == "llm" {
            tool.requires_approval = true;
        }
    }
    let planned = harness
        .step(&request("Combine a and b", "plan-then-execute"))
        .await;
    let executed = harness.step(&planned.requests[0]).await;
    let text = format!("{:?}", executed.requests);
    assert!(
        text.contains("runs only with a person's approval, which this step cannot wait for"),
        "{text}"
    );
    // The plan call and the step's call: the tool's own LLM call was never made.
    let calls = harness.llm.calls();
    assert!(
        calls.iter().all(|c| c.last_user.trim() != "inner?"),
        "{calls:?}"
    );
}

#[tokio::test]
async fn a_supervisor_starts_one_subagent_per_goal_and_waits() {
    let harness = Harness::start().await;
    let sent = harness
        .step(&request("Compare alpha and beta", "supervisor"))
        .await;
    assert!(closing(&sent).is_empty(), "the supervisor waits for fan-in");
    let goals: Vec<&str> = sent
        .requests
        .iter()
        .map(|r| r.subagent_goal.as_str())
        .collect();
    assert_eq!(goals, ["price of alpha", "price of beta"]);
    assert!(sent.requests.iter().all(|r| {
        r.parent_session_id == "0b7d0c1e-5f5e-4c2a-9a57-3b0c8b2d1e01"
            && r.expected_siblings == 2
            && !r.correlation_id.is_empty()
    }));
    // The fan-out's node is sent before the subagents: fan-in counts their completions against it.
    let first_subagent = sent.channels.iter().position(|c| *c == Channel::Requests);
    let first_node = sent
        .channels
        .iter()
        .position(|c| *c == Channel::Explainability);
    assert!(first_node < first_subagent, "{:?}", sent.channels);
    // The aggregator reads the correlation id fan-in answers to from the fan-out's message: it is
    // a message of its own, not shared with the step's other nodes.
    let fan_outs: Vec<&Triples> = sent
        .explained
        .iter()
        .filter(|m| agent_core::provenance::drives_fan_in(&m.triples))
        .collect();
    assert_eq!(fan_outs.len(), 1, "{:?}", sent.explained);
    let subjects: std::collections::BTreeSet<&str> = fan_outs[0]
        .triples
        .iter()
        .filter(|t| t.p.iri == agent_core::vocab::RDF_TYPE.as_str())
        .map(|t| t.s.iri.as_str())
        .collect();
    let fan_out = SessionUris::new(&sent.requests[0].parent_session_id)
        .fanout(&sent.requests[0].correlation_id);
    assert_eq!(subjects.into_iter().collect::<Vec<_>>(), [fan_out.as_str()]);
}

#[tokio::test]
async fn a_draft_the_reviewer_s_unreadable_reply_let_stand_says_it_was_not_checked() {
    let mut harness = Harness::start().await;
    if let Some(react) = harness.config.patterns.get_mut("react") {
        react.critic = vec!["answer".to_owned()];
    }
    let mut review = request("what is three", "react");
    review.history.push(AgentStep {
        observation: "THREE".to_owned(),
        step_type: "synthesise".to_owned(),
        ..AgentStep::default()
    });
    let given = harness.step(&review).await;
    let closing = closing(&given);
    assert_eq!(closing.len(), 1);
    assert_eq!(
        closing[0].content,
        "THREE\n\n(This answer was not checked: the reviewer's answer could not be read.)"
    );
}

#[tokio::test]
async fn a_supervisor_starts_only_the_goals_that_need_no_other_and_keeps_them_all() {
    let harness = Harness::start().await;
    let sent = harness.step(&request("Chain a to b", "supervisor")).await;
    let started: Vec<&str> = sent
        .requests
        .iter()
        .map(|r| r.subagent_goal.as_str())
        .collect();
    assert_eq!(started, ["find a"], "b waits for a");
    assert!(sent.requests.iter().all(|r| r.expected_siblings == 2));
    // What the aggregator starts b from: every goal with its needs, in the fan-out's continuation.
    let listed = sent
        .responses
        .iter()
        .find(|r| r.message_id.contains("/fanout/"))
        .map(|r| r.content.clone())
        .unwrap_or_default();
    assert!(listed.contains("1. use a (react), after 0"), "{listed}");
    let needs = sent
        .explained
        .iter()
        .flat_map(|t| t.triples.iter())
        .filter(|t| t.p.iri.ends_with("/needs"))
        .count();
    assert_eq!(needs, 1);
}

/// A decompose step as a fan-out of `goals` keeps it, under correlation id `cid`.
fn decompose_step(cid: &str, goals: &[agent_core::supervisor::Goal]) -> AgentStep {
    let texts: Vec<&str> = goals.iter().map(|g| g.goal.as_str()).collect();
    AgentStep {
        action: "decompose".to_owned(),
        step_type: "decompose".to_owned(),
        arguments: [
            ("correlation_id".to_owned(), cid.to_owned()),
            ("expected".to_owned(), goals.len().to_string()),
            (
                agent_core::supervisor::GOALS_KEY.to_owned(),
                serde_json::to_string(&texts).unwrap_or_default(),
            ),
            (
                agent_core::supervisor::SUBAGENTS_KEY.to_owned(),
                agent_core::supervisor::goals_json(goals),
            ),
        ]
        .into(),
        ..AgentStep::default()
    }
}

#[tokio::test]
async fn an_ensemble_debates_for_its_rounds_then_reconciles() {
    use agent_core::{ensemble, supervisor};
    let mut harness = Harness::start().await;
    if let Some(def) = harness.config.patterns.get_mut("ensemble") {
        def.debate_rounds = 1;
    }
    let question = "Is it safe?";
    let perspectives = ensemble::perspectives(&[], 2);
    let mut first = request(question, "ensemble");
    let session = first.session_id.clone();
    first.history.push(decompose_step(
        &format!("{session}-f1"),
        &ensemble::goals(question, &perspectives),
    ));
    let answers = |a: &str, b: &str| -> std::collections::BTreeMap<String, String> {
        [
            (supervisor::result_key(0, question), a.to_owned()),
            (supervisor::result_key(1, question), b.to_owned()),
        ]
        .into()
    };
    let resumed = supervisor::synthesis_request(&first, answers("yes", "no"), &[]);
    let debate = harness.step(&resumed).await;
    assert!(closing(&debate).is_empty(), "a debate round comes first");
    assert_eq!(debate.requests.len(), 2);
    for (i, r) in debate.requests.iter().enumerate() {
        assert_eq!(r.question, question);
        assert!(
            r.framing.contains(&format!("You are agent {}.", i + 1))
                && r.framing.contains(": yes")
                && r.framing.contains(": no"),
            "{}",
            r.framing
        );
    }
    // After the debate round the answers are reconciled.
    let mut second = resumed.clone();
    second.history.push(decompose_step(
        &format!("{session}-f3"),
        &ensemble::debate_goals(question, &perspectives, "..."),
    ));
    let resumed = supervisor::synthesis_request(&second, answers("yes, mostly", "yes"), &[]);
    let reconciled = harness.step(&resumed).await;
    let closing = closing(&reconciled);
    assert_eq!(closing.len(), 1);
    assert_eq!(closing[0].content, "Mostly safe.");
    assert!(reconciled.requests.is_empty());
}

/// A synthesis or a reconciliation the model wrote without text (`content: ""`, as a content
/// filter or a model that spent its length on reasoning leaves it) ends the dialog with an error
/// saying so: before, the client was given an empty answer, recorded as the dialog's conclusion.
#[tokio::test]
async fn an_empty_synthesis_or_reconciliation_is_an_error_not_an_empty_answer() {
    use agent_core::{ensemble, supervisor};
    let harness = Harness::start().await;
    let resumed = |question: &str, pattern: &str, goals: &[supervisor::Goal]| {
        let mut first = request(question, pattern);
        let cid = format!("{}-f1", first.session_id);
        first.history.push(decompose_step(&cid, goals));
        let results = goals
            .iter()
            .enumerate()
            .map(|(i, goal)| (supervisor::result_key(i, &goal.goal), "found".to_owned()))
            .collect();
        supervisor::synthesis_request(&first, results, &[])
    };
    let goal =
        |text: &str| supervisor::Goal::independent(text, agent_core::pattern::Pattern::React);
    let question = "Empty?";
    let cases = [
        resumed("Empty sums", "supervisor", &[goal("price of alpha")]),
        resumed(
            question,
            "ensemble",
            &ensemble::goals(question, &ensemble::perspectives(&[], 2)),
        ),
    ];
    for case in cases {
        let sent = harness.step(&case).await;
        let closing = closing(&sent);
        assert_eq!(closing.len(), 1, "{:?}", sent.responses);
        let error = closing[0].error.as_ref().map(|e| e.message.as_str());
        assert!(
            error.is_some_and(|e| e.contains("no text: an empty answer")),
            "{:?}",
            sent.responses
        );
        assert!(sent.requests.is_empty());
    }
}

/// Reflexion: after an action, the step is a reflection whose lesson joins the history (and is
/// shown to the client as a thought); it runs no tool.
#[tokio::test]
async fn reflexion_reflects_on_an_action_and_carries_the_lesson_forward() {
    let harness = Harness::start().await;
    let mut acted = request("ask the tool", "reflexion");
    acted.history.push(AgentStep {
        thought: "the tool knows.".to_owned(),
        action: "llm".to_owned(),
        arguments: [("question".to_owned(), "inner?".to_owned())].into(),
        observation: "INNER".to_owned(),
        step_type: "react".to_owned(),
        ..AgentStep::default()
    });
    let sent = harness.step(&acted).await;
    assert!(closing(&sent).is_empty());
    assert_eq!(sent.requests.len(), 1);
    let lesson = &sent.requests[0].history[1];
    assert_eq!(lesson.step_type, "reflect");
    assert_eq!(lesson.observation, "Ask the tool a sharper question.");
    assert!(sent.responses.iter().any(|r| r.message_type == "thought"
        && r.content == "Reflection: Ask the tool a sharper question."));
    assert_eq!(harness.llm.calls().len(), 1, "no tool ran");
    // With no action before it, a Reflexion step is a ReACT step.
    let answered = harness.step(&request("what is one", "reflexion")).await;
    assert_eq!(closing(&answered)[0].content, "ONE");
}

/// The LLM-as-router hands a request to a tool in one step (the tool's answer is the dialog's),
/// and a choice outside the candidates it was offered is not run.
#[tokio::test]
async fn the_llm_router_dispatches_to_an_offered_tool_only() {
    let harness = Harness::start().await;
    let sent = harness
        .step(&request("route me to the tool", "llm-router"))
        .await;
    assert_eq!(closing(&sent).len(), 1, "{:?}", sent.responses);
    assert_eq!(closing(&sent)[0].content, "INNER");
    assert!(sent.requests.is_empty());
    let dispatched = sent
        .explained
        .iter()
        .flat_map(|t| &t.triples)
        .any(|t| t.o.value == "tool:llm");
    assert!(dispatched, "the dispatch is recorded: {:?}", sent.explained);

    let before = harness.llm.calls().len();
    let refused = harness
        .step(&request("route me nowhere", "llm-router"))
        .await;
    // Not offered: nothing runs; the request goes on as the fallback pattern, ReACT.
    assert_eq!(
        harness.llm.calls().len(),
        before + 1,
        "only the router was asked"
    );
    assert!(closing(&refused).is_empty(), "{:?}", refused.responses);
    assert_eq!(refused.requests.len(), 1);
    assert_eq!(refused.requests[0].pattern, "react");
}

/// Deep research: a round with two calls runs both in the same step and queues the next round
/// with both notes.
#[tokio::test]
async fn a_deep_research_round_runs_its_calls_and_queues_the_next_round() {
    let harness = Harness::start().await;
    let sent = harness.step(&request("Prices", "deep-research")).await;
    assert!(closing(&sent).is_empty(), "{:?}", sent.responses);
    assert_eq!(sent.requests.len(), 1);
    let next = serde_json::to_string(&sent.requests[0].history).expect("history encodes");
    assert!(next.contains("INNER") && next.contains("OUTER"), "{next}");
    // The round's question, then its two calls.
    assert_eq!(harness.llm.calls().len(), 3);
}

/// A research round whose one call meets an outage of its tool's LLM, beside another call, does
/// not park: parked, the step would run every call of the round again, and a tool with effects
/// would act once more at each try. The failed call is noted as failed; the other's answer
/// stands. (Until 2026-12-02 the round parked, and its other calls ran again.)
#[tokio::test]
async fn a_research_round_with_one_call_meeting_an_outage_notes_it_and_does_not_park() {
    let harness = Harness::start().await;
    let (sent, parked) = harness
        .step_parking(&request("Outage", "deep-research"), true)
        .await;
    assert!(!parked, "the round parked");
    assert_eq!(sent.requests.len(), 1);
    let next = serde_json::to_string(&sent.requests[0].history).expect("history encodes");
    assert!(next.contains("OUTER"), "{next}");
    assert!(next.contains("the tool 'llm' failed"), "{next}");
    let outer = harness
        .llm
        .calls()
        .iter()
        .filter(|c| c.last_user.contains("outer?"))
        .count();
    assert_eq!(outer, 1);
}

/// A tool that fails does not move the dialog to its `state`: the tools gated on that state stay
/// closed (TrustGraph moves the state only when the tool ran well). Until 2026-12-02 a failed or
/// timed-out call moved it all the same.
#[tokio::test]
async fn a_failed_tool_leaves_the_dialog_in_its_state() {
    let mut harness = Harness::start().await;
    // A knowledge query with no store to ask: it fails whenever it is called.
    let verify: agent_core::tools::ToolDef = serde_json::from_str(
        r#"{"name": "verify", "description": "check an order", "type": "knowledge-query",
            "state": "verified", "arguments": [{"name": "question", "type": "string"}]}"#,
    )
    .expect("a tool");
    harness.config.tools.insert("verify".to_owned(), verify);
    let asked = AgentRequest {
        state: Some("new".to_owned()),
        ..request("verify the order", "react")
    };
    let sent = harness.step(&asked).await;
    assert_eq!(sent.requests.len(), 1);
    let next = &sent.requests[0];
    assert!(
        next.history
            .last()
            .is_some_and(|step| step.observation.starts_with("Error:")),
        "{:?}",
        next.history
    );
    assert_eq!(next.state.as_deref(), Some("new"));
}

/// A `prompt` tool's `template` names one of TrustGraph's prompt templates (`prompt` /
/// `template.<id>`), as in TrustGraph's own config: the template's text, filled with the call's
/// arguments, goes to the LLM. Until 2026-12-02 the id itself was sent as the prompt.
#[tokio::test]
async fn a_prompt_tool_fills_the_trustgraph_template_it_names() {
    let mut harness = Harness::start().await;
    let values: agent_core::config::ConfigValues = serde_json::from_value(serde_json::json!({
        "prompt": {"template.greeting": {"prompt": "Say hello to {{w}}.", "response-type": "text"}},
        "tool": {"greet": {"name": "greet", "description": "greet someone", "type": "prompt",
                           "template": "greeting", "arguments": [{"name": "w", "type": "string"}]}}
    }))
    .expect("config values");
    let theirs = AgentConfig::from_values(&values).expect("TrustGraph's config reads");
    harness.config.prompt_templates = theirs.prompt_templates;
    harness.config.tools.extend(theirs.tools);
    let sent = harness.step(&request("greet the reader", "react")).await;
    assert_eq!(sent.requests.len(), 1);
    let observed = sent.requests[0]
        .history
        .last()
        .map(|step| step.observation.clone());
    assert_eq!(observed.as_deref(), Some("HELLO READER"));
}

/// A subagent of a streaming supervisor streams its thought under its own message id, but never
/// sends an `answer`: its answer is the observation of its completion.
#[tokio::test]
async fn a_streaming_subagent_streams_its_thought_but_sends_no_answer() {
    let harness = Harness::start().await;
    let subagent = AgentRequest {
        streaming: true,
        parent_session_id: "0b7d0c1e-5f5e-4c2a-9a57-3b0c8b2d1e00".to_owned(),
        correlation_id: "0b7d0c1e-5f5e-4c2a-9a57-3b0c8b2d1e00-f1".to_owned(),
        subagent_goal: "what is one".to_owned(),
        expected_siblings: 2,
        ..request("what is one", "react")
    };
    let sent = harness.step(&subagent).await;
    assert!(
        sent.responses.iter().all(|r| r.message_type != "answer"),
        "{:?}",
        sent.responses
    );
    let thought: Vec<&AgentResponse> = sent
        .responses
        .iter()
        .filter(|r| r.message_type == "thought")
        .collect();
    assert!(thought.len() > 1, "streamed in pieces: {thought:?}");
    assert_eq!(
        thought
            .iter()
            .map(|r| r.content.as_str())
            .collect::<String>(),
        "I know it."
    );
    assert!(sent
        .responses
        .iter()
        .any(|r| r.message_type == "observation" && r.content == "ONE"));
    assert!(
        closing(&sent).is_empty(),
        "a subagent never ends the client's dialog"
    );
}

/// A reply a reasoning model opens with its `<think>` block is streamed as the answer without it,
/// as the answer is recorded; one whose text after the block is JSON (a supervisor's request for
/// another round) is held back whole. Before, the block went to the client as answer text, and a
/// reply of a block and JSON was streamed as the answer before it was read as JSON.
#[tokio::test]
async fn a_streamed_answer_leaves_out_the_models_think_block() {
    let harness = Harness::start().await;
    let sink = MemorySink::default();
    let outputs = Outputs::Memory(sink.clone());
    let streaming = AgentRequest {
        streaming: true,
        ..request("think", "plan-then-execute")
    };
    let uris = SessionUris::new(&streaming.session_id);
    let out = DialogOutput::new(&outputs, Some("client-1"), "default", &uris.session(), 0)
        .for_step(
            &streaming,
            &uris.session(),
            0,
            harness.config.limits.max_message_bytes,
        );
    let answered = crate::stream::answer(
        &harness.client,
        &out,
        &[agent_llm::ChatMessage::user("Think, then answer")],
        &uris.conclusion(),
    )
    .await
    .expect("the chunks are sent")
    .expect("the LLM answers");
    assert!(answered.text.starts_with("<think>"), "{}", answered.text);
    let (split, streamed) = crate::stream::answer_unless(
        &harness.client,
        &out,
        &[agent_llm::ChatMessage::user("Think, then split")],
        &uris.conclusion(),
        &['{', '`'],
    )
    .await
    .expect("the chunks are sent");
    assert!(split.is_ok(), "{split:?}");
    assert!(!streamed, "JSON after the block was streamed as the answer");
    let answer: String = sink
        .decoded::<AgentResponse>(Channel::Responses)
        .iter()
        .filter(|r| r.message_type == "answer")
        .map(|r| r.content.clone())
        .collect();
    assert_eq!(answer, "The answer is 42");
    assert_eq!(agent_core::react::without_think(&answered.text), answer);
}
