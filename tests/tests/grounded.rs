//! Grounded answers: an answer comes only from what really ran. Over a real broker, the real
//! `agent-orchestrator` binary and a real MCP server (the npm "everything" server over stdio,
//! whose `get-sum` tool is configured as `add`), the LLM answers with completions real models
//! write: a 1.5B model's action followed by an answer it invented, and OpenAI-style native tool
//! calls. The tool must run, its result must be the observation, and the answer must come from a
//! later iteration; what the model wrote past its first decision is discarded and recorded.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_e2e::*;
use agent_schema::AgentResponse;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(90);

const QUESTION: &str = "Use the add tool to add 98765 and 12345, then tell me the result.";

/// What the `add` tool (the everything server's `get-sum`) returns.
const SUM: &str = "The sum of 98765 and 12345 is 111110.";

/// The whole completion a real 1.5B instruction model (served by llama.cpp) wrote for `QUESTION`:
/// an action, then an answer it made up without seeing the tool's result.
const RUNS_ON_PAST_ITS_ACTION: &str = "Thought: To add 98765 and 12345, I need to add the two numbers together.\nAction: add\nArgs: {\"a\": 98765, \"b\": 12345}\nFinal Answer: 111110";

/// The answer the dialog must end with: written after the tool's result was seen.
const GROUNDED_ANSWER: &str = "98765 + 12345 = 111110, as the add tool computed.";

/// The seed config with one tool, `add`, on the everything server over stdio, and `models` as
/// the `llm-model` config.
fn config(name: &str, models: &str) -> std::path::PathBuf {
    let mcp = serde_json::json!({
        "sum": {"remote-name": "get-sum", "command": "node",
                "args": [everything_server().to_str().unwrap(), "stdio"]}
    });
    let tools = serde_json::json!({
        "add": {"name": "add", "description": "Add two numbers", "type": "mcp-tool", "mcp-tool": "sum"}
    });
    seed_with(
        name,
        &[
            ("mcp", &mcp.to_string()),
            ("tool", &tools.to_string()),
            ("llm-model", models),
        ],
    )
}

fn react_request(question: &str, streaming: bool) -> agent_schema::AgentRequest {
    let mut r = request(question, streaming);
    r.pattern = "react".into();
    r
}

fn position(responses: &[AgentResponse], kind: &str) -> Option<usize> {
    responses.iter().position(|r| r.message_type == kind)
}

/// The invariant of the issue: the tool ran, its result is iteration 1's observation, no answer
/// text reached the client before it, and the answer is the one written after it.
fn assert_grounded(responses: &[AgentResponse]) {
    let ends = responses.iter().filter(|r| r.end_of_dialog).count();
    assert_eq!(ends, 1, "{responses:#?}");
    let (_, observed) = observation(responses, 1);
    assert_eq!(observed, SUM, "{responses:#?}");
    let observed_at = responses
        .iter()
        .position(|r| r.message_type == "observation" && r.content == SUM)
        .unwrap_or_else(|| panic!("the tool's result was not observed: {responses:#?}"));
    let answered_at = position(responses, "answer").unwrap();
    assert!(
        answered_at > observed_at,
        "answer text went out before the tool's result: {responses:#?}"
    );
    assert_eq!(text_of(responses, "answer"), GROUNDED_ANSWER);
    let session = session_of(responses);
    assert!(
        responses
            .iter()
            .filter(|r| r.message_type == "answer")
            .all(|r| r.message_id == format!("{session}/final")),
        "{responses:#?}"
    );
}

/// Runs dialog `id` to its end and checks it is grounded; its responses for further checks.
async fn ask_grounded(
    client: &mut agent_bus::AgentClient,
    id: &str,
    request: &agent_schema::AgentRequest,
) -> Vec<AgentResponse> {
    client.send(id, request).await.unwrap();
    let responses = collect_dialog(client, id, DIALOG_TIMEOUT).await.unwrap();
    assert_grounded(&responses);
    responses
}

#[tokio::test]
async fn an_action_followed_by_an_invented_answer_runs_the_tool_and_answers_from_its_result() {
    let script = serde_json::json!({"rules": [
        {"match": format!("Observation: {SUM}"),
         "reply": format!("Thought: The tool gave the sum.\nFinal Answer: {GROUNDED_ANSWER}"), "chunk_size": 5},
        {"match": format!("Question: {QUESTION}"), "reply": RUNS_ON_PAST_ITS_ACTION, "chunk_size": 5}
    ]});
    let llm = scripted_llm(&script.to_string()).await;
    let broker = Broker::start().unwrap();
    let config = config("grounded-text", "{}");
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;

    for (id, streaming) in [("g-whole", false), ("g-streamed", true)] {
        let responses = ask_grounded(&mut client, id, &react_request(QUESTION, streaming)).await;
        // The discarded text is on the iteration that acted, with its length.
        let triples = explained(&responses);
        let iteration = format!("{}/i1", session_of(&responses));
        assert_eq!(values(&triples, &iteration, tg::ACTION), ["add"]);
        assert_eq!(
            values(&triples, &iteration, tg::DISCARDED_TEXT),
            ["Final Answer: 111110"]
        );
        assert_eq!(values(&triples, &iteration, tg::DISCARDED_CHARS), ["20"]);
        assert_eq!(
            values(&triples, &iteration, tg::ARGUMENTS),
            [r#"{"a":"98765","b":"12345"}"#]
        );
        // The thought streamed is the model's, never the invented answer.
        assert!(!text_of(&responses, "thought").contains("111110"));
    }
    // The server was asked to stop where models invent observations; the parser did not rely
    // on it (the scripted server ignores `stop`).
    let calls = llm.calls();
    assert_eq!(calls.len(), 4, "{calls:#?}");
    assert!(
        calls.iter().all(|c| c.stop == ["\nObservation:"]),
        "{calls:#?}"
    );
    assert!(calls.iter().all(|c| c.tools.is_empty()));
    // No bound on an answer was configured: the server's own applies.
    assert!(calls.iter().all(|c| c.max_tokens.is_none()), "{calls:#?}");
}

#[tokio::test]
async fn native_tool_calls_run_the_tool_and_answer_from_its_result() {
    let script = serde_json::json!({"default_reply": "I could not add them.", "rules": [
        // The router, in JSON mode.
        {"match": format!("Request to classify: {QUESTION}"),
         "reply": "{\"choice\": \"general\", \"rationale\": \"a calculation\"}"},
        {"match": format!("Request to work on: {QUESTION}"),
         "reply": "{\"choice\": \"react\", \"rationale\": \"one tool call\"}"},
        // The tool's result comes back as a `tool` message.
        {"match": SUM, "exact": true, "reply": GROUNDED_ANSWER, "chunk_size": 5},
        {"match": format!("Question: {QUESTION}"), "reply": "I will add them with the tool.",
         "tool_calls": [{"name": "add", "arguments": {"a": 98765, "b": 12345}},
                        {"name": "add", "arguments": {"a": 1, "b": 1}}],
         "chunk_size": 5},
        // A model asked for native calls that writes the text protocol instead, running on past
        // its action: read by the text parser, same rule.
        {"match": "Question: Add them in text", "reply": RUNS_ON_PAST_ITS_ACTION.replace("Final Answer: 111110", "Observation: 111110\nFinal Answer: 111110")},
        // The text protocol naming the tool in another case, or naming a tool there is not:
        // calls both (the first runs `add`, the second is refused), never the answer.
        {"match": "Question: Add them in capitals", "reply": RUNS_ON_PAST_ITS_ACTION.replace("Action: add", "Action: Add")},
        {"match": "Question: Add them elsewhere", "reply": "Thought: I will use the calculator.\nAction: calculator\nArgs: {\"a\": 98765, \"b\": 12345}"},
        {"match": "there is no tool named 'calculator'", "reply": "Sorry, I have no calculator."},
        // Arguments that are not JSON cost an iteration with an error observation.
        {"match": "Question: Broken arguments", "reply": "",
         "tool_calls": [{"name": "add", "arguments": "{\"a\": 1,"}]}
    ]});
    let llm = scripted_llm(&script.to_string()).await;
    let broker = Broker::start().unwrap();
    let config = config(
        "grounded-native",
        r#"{"default": {"tool-calling": "native", "json-mode": true, "max-output-tokens": 700}}"#,
    );
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;

    for (id, streaming) in [("n-whole", false), ("n-streamed", true)] {
        let responses = ask_grounded(&mut client, id, &request(QUESTION, streaming)).await;
        let triples = explained(&responses);
        let session = session_of(&responses);
        let iteration = format!("{session}/i1");
        assert_eq!(values(&triples, &iteration, tg::ACTION), ["add"]);
        assert_eq!(
            values(&triples, &iteration, tg::ARGUMENTS),
            [r#"{"a":"98765","b":"12345"}"#]
        );
        // The second call was not made, and provenance says it was dropped.
        let dropped = values(&triples, &iteration, tg::DISCARDED_TEXT).concat();
        assert!(
            dropped.contains(r#""arguments":"{\"a\":1,\"b\":1}""#),
            "{dropped}"
        );
        // The text beside the call is the thought, never an answer chunk.
        assert_eq!(
            text_of(&responses, "thought"),
            "I will add them with the tool."
        );
    }
    let calls = llm.calls();
    let routing: Vec<_> = calls
        .iter()
        .filter(|c| c.last_user.contains("Request to"))
        .collect();
    assert_eq!(routing.len(), 4, "{calls:#?}");
    assert!(routing.iter().all(|c| c.json_mode && c.tools.is_empty()));
    // The model's bound on an answer goes with every call, the router's too.
    assert!(
        calls.iter().all(|c| c.max_tokens == Some(700)),
        "{calls:#?}"
    );
    let agent: Vec<_> = calls
        .iter()
        .filter(|c| !c.last_user.contains("Request to"))
        .collect();
    assert_eq!(agent.len(), 4, "{calls:#?}");
    assert!(
        agent
            .iter()
            .all(|c| c.tools == ["add"] && c.stop.is_empty()),
        "{calls:#?}"
    );

    client
        .send("n-text", &react_request("Add them in text", true))
        .await
        .unwrap();
    let text = collect_dialog(&mut client, "n-text", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, observed) = observation(&text, 1);
    assert_eq!(observed, SUM, "{text:#?}");
    let iteration = format!("{}/i1", session_of(&text));
    assert_eq!(
        values(&explained(&text), &iteration, tg::DISCARDED_TEXT),
        ["Observation: 111110\nFinal Answer: 111110"]
    );

    client
        .send("n-capitals", &react_request("Add them in capitals", false))
        .await
        .unwrap();
    let capitals = collect_dialog(&mut client, "n-capitals", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, observed) = observation(&capitals, 1);
    assert_eq!(observed, SUM, "{capitals:#?}");
    let iteration = format!("{}/i1", session_of(&capitals));
    assert_eq!(
        values(&explained(&capitals), &iteration, tg::ACTION),
        ["add"]
    );

    client
        .send("n-elsewhere", &react_request("Add them elsewhere", false))
        .await
        .unwrap();
    let elsewhere = collect_dialog(&mut client, "n-elsewhere", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, observed) = observation(&elsewhere, 1);
    assert_eq!(
        observed, "Error: there is no tool named 'calculator'; available tools: add",
        "{elsewhere:#?}"
    );
    assert_eq!(outcome(&elsewhere), "Sorry, I have no calculator.");

    client
        .send("n-broken", &react_request("Broken arguments", false))
        .await
        .unwrap();
    let broken = collect_dialog(&mut client, "n-broken", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, observed) = observation(&broken, 1);
    assert!(
        observed.starts_with("Error: the arguments of your call to 'add' could not be read"),
        "{observed}"
    );
}

/// A reasoning model (DeepSeek-R1's distillations, Qwen3) writes its reasoning in a `<think>`
/// block and often rehearses the protocol there: a `Final Answer:` or an `Observation:` in it is
/// thinking, and the action after the block runs. Read as decisions, the rehearsed answer ended
/// the dialog and the tool never ran. Served with the opening in the prompt (R1's template), only
/// the close is written. The block is never part of the answer.
#[tokio::test]
async fn a_reasoning_models_rehearsal_in_its_think_block_decides_nothing() {
    let rehearsing = format!(
        "<think>\nI could answer directly.\nFinal Answer: 111110\nObservation: 111110\nBetter to use the tool.\n</think>\n\n{RUNS_ON_PAST_ITS_ACTION}"
    );
    let opening_in_prompt =
        format!("Let me think.\nFinal Answer: 111110\n</think>\n\n{RUNS_ON_PAST_ITS_ACTION}");
    let script = serde_json::json!({"rules": [
        {"match": format!("Observation: {SUM}"),
         "reply": format!("<think>\nThe tool said so.\nFinal Answer: 7\n</think>\n\nThought: The tool gave the sum.\nFinal Answer: {GROUNDED_ANSWER}"), "chunk_size": 5},
        {"match": format!("Question: {QUESTION} (prompted)"), "reply": opening_in_prompt, "chunk_size": 5},
        {"match": format!("Question: {QUESTION}"), "reply": rehearsing, "chunk_size": 5}
    ]});
    let llm = scripted_llm(&script.to_string()).await;
    let broker = Broker::start().unwrap();
    let config = config("grounded-think", "{}");
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    for (id, question, streaming) in [
        ("t-whole", QUESTION.to_owned(), false),
        ("t-streamed", QUESTION.to_owned(), true),
        ("t-prompted", format!("{QUESTION} (prompted)"), false),
    ] {
        let responses = ask_grounded(&mut client, id, &react_request(&question, streaming)).await;
        let triples = explained(&responses);
        let iteration = format!("{}/i1", session_of(&responses));
        assert_eq!(values(&triples, &iteration, tg::ACTION), ["add"], "{id}");
        assert!(
            !responses.iter().any(|r| r.content.contains("think>")),
            "{id}: {responses:#?}"
        );
    }
}

/// A native model's plain answer that holds lines the text protocol would read as markers (a
/// manifest's `args:`, a report's `Observation:`), after a `<think>` block, is its answer, without
/// the block, in one iteration. Refused as a malformed protocol reply, it was asked again to the
/// end of its iterations and the dialog ended with an error.
#[tokio::test]
async fn a_native_models_plain_answer_with_marker_like_lines_is_its_answer() {
    let manifest = "containers:\n  - name: web\n    image: nginx\n    args: [\"--port\", \"80\"]\nObservation: the port is 80.";
    let script = serde_json::json!({"rules": [
        {"match": "Question: Write the manifest",
         "reply": format!("<think>\nA short manifest will do.\n</think>\n\n{manifest}"), "chunk_size": 7}
    ]});
    let llm = scripted_llm(&script.to_string()).await;
    let broker = Broker::start().unwrap();
    let config = config(
        "grounded-native-prose",
        r#"{"default": {"tool-calling": "native", "json-mode": true}}"#,
    );
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    for (id, streaming) in [("m-whole", false), ("m-streamed", true)] {
        client
            .send(id, &react_request("Write the manifest", streaming))
            .await
            .unwrap();
        let responses = collect_dialog(&mut client, id, DIALOG_TIMEOUT)
            .await
            .unwrap();
        let last = responses.last().unwrap();
        assert!(
            last.end_of_dialog && last.error.is_none(),
            "{id}: {responses:#?}"
        );
        assert_eq!(
            text_of(&responses, "answer"),
            manifest,
            "{id}: {responses:#?}"
        );
    }
    assert_eq!(llm.calls().len(), 2, "one call a dialog");
}
