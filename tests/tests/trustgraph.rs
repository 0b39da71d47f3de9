//! The drop-in for TrustGraph, checked with TrustGraph's own software: `trustgraph-base` and
//! `trustgraph-cli` 2.11.1 from PyPI (installed by `scripts/trustgraph-client.sh`). Its CLI
//! configures an MCP tool in config-svc through the API TrustGraph's gateway serves; an
//! orchestrator started with no settings but the broker's and the LLM's addresses reads that config
//! with TrustGraph 2.x's workspace protocol; TrustGraph's client library publishes a question on
//! TrustGraph's own topic names and streams the answer, which comes from the tool.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use agent_e2e::*;
use serde_json::Value;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

/// The folder of TrustGraph's CLI and the Python that has its client library.
fn trustgraph_bin() -> PathBuf {
    installed_path("trustgraph-client.sh")
}

/// Runs one of TrustGraph's `tg-*` commands; returns what it printed.
fn tg(bin: &std::path::Path, command: &str, args: &[&str]) -> String {
    let out = Command::new(bin.join(command)).args(args).output().unwrap();
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{command} failed: {printed}");
    printed
}

/// Asks with TrustGraph's client library (tests/trustgraph/ask_agent.py); every response it
/// streamed, then its summary line. Awaited, so the scripted LLM (served by this test's runtime)
/// answers meanwhile.
async fn ask_with_trustgraphs_client(
    bin: &std::path::Path,
    broker: &Broker,
    question: &str,
) -> Vec<Value> {
    let ask = || {
        tokio::process::Command::new(bin.join("python"))
            .arg(repo_root().join("tests/trustgraph/ask_agent.py"))
            .args(["--pulsar-host", &broker.url()])
            .args(["--timeout", &DIALOG_TIMEOUT.as_secs().to_string()])
            .arg(question)
            .output()
    };
    let mut out = ask().await.unwrap();
    // Seen in some runs on Apache Pulsar, twice in a row once: the client library's native
    // Pulsar client dies by a signal (SIGABRT, SIGSEGV) mid-stream. That is the client's own
    // fault, not the orchestrator's (what it printed before dying is a valid stream): ask again,
    // up to three times in all.
    for _ in 0..2 {
        if out.status.code().is_some() {
            break;
        }
        eprintln!("TrustGraph's client died ({}); asking again", out.status);
        out = ask().await.unwrap();
    }
    assert!(
        out.status.success(),
        "TrustGraph's client got no answer ({}): {}\nafter:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// A dialog on the persistent request topic, answered: once it is, the orchestrator consumes, and
/// TrustGraph's client may publish on its non-persistent topic, where a message sent before that
/// is dropped. Its responses.
async fn warm_up(broker: &Broker, id: &str) -> Vec<agent_schema::AgentResponse> {
    let mut client = client(broker).await;
    client.send(id, &request("warm up", false)).await.unwrap();
    collect_dialog(&mut client, id, DIALOG_TIMEOUT)
        .await
        .unwrap()
}

/// The responses TrustGraph's client streamed (its summary line taken off), once its answer is
/// `answer`, none is an error, and the answer came in more than one chunk.
fn streamed_answer<'s>(streamed: &'s [Value], answer: &str, what: &str) -> &'s [Value] {
    let (summary, responses) = streamed.split_last().unwrap();
    assert_eq!(summary["answer"], answer, "{what}: {streamed:#?}");
    assert!(
        responses.iter().all(|r| r["error"].is_null()),
        "{what}: {streamed:#?}"
    );
    let answer_chunks = responses
        .iter()
        .filter(|r| r["message_type"] == "answer")
        .count();
    assert!(answer_chunks > 1, "{what}: {streamed:#?}");
    responses
}

#[tokio::test]
async fn trustgraphs_cli_and_client_drive_an_orchestrator_with_no_settings() {
    let bin = trustgraph_bin();
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::spawn(&broker, None);
    let api = format!("{}/", svc.url);
    let server = EverythingHttp::start(agent_bus::embedded::free_port().unwrap());

    // Configured as a TrustGraph operator does it, with TrustGraph's CLI.
    let tool_url = format!("http://127.0.0.1:{}/mcp", server.port);
    tg(
        &bin,
        "tg-set-mcp-tool",
        &[
            "-u",
            &api,
            "-t",
            &svc.token,
            "--id",
            "sums",
            "--remote-name",
            "get-sum",
            "--tool-url",
            &tool_url,
        ],
    );
    let adds = [
        "-u",
        &api,
        "-t",
        &svc.token,
        "--id",
        "add",
        "--name",
        "add",
        "--type",
        "mcp-tool",
        "--mcp-tool",
        "sums",
        "--description",
        "Adds two numbers",
        "--argument",
        "a:number:the first number",
        "--argument",
        "b:number:the second number",
    ];
    assert!(tg(&bin, "tg-set-tool", &adds).contains("Tool set."));
    // Another workspace's tool is not this one's.
    tg(
        &bin,
        "tg-set-tool",
        &[
            "-u",
            &api,
            "-t",
            &svc.token,
            "-w",
            "elsewhere",
            "--id",
            "theirs",
            "--name",
            "theirs",
            "--type",
            "text-completion",
            "--description",
            "Not ours",
        ],
    );
    let shown = tg(&bin, "tg-show-tools", &["-u", &api]);
    assert!(shown.contains("Adds two numbers"), "{shown}");
    assert!(!shown.contains("Not ours"), "{shown}");
    let shown = tg(&bin, "tg-show-mcp-tools", &["-u", &api]);
    assert!(shown.contains(&tool_url), "{shown}");
    // A write without the config token is refused, and changes nothing.
    let refused = tg(
        &bin,
        "tg-set-tool",
        &[
            "-u",
            &api,
            "--id",
            "intruder",
            "--name",
            "intruder",
            "--type",
            "text-completion",
            "--description",
            "Should not be here",
        ],
    );
    assert!(!refused.contains("Tool set."), "{refused}");
    assert!(!tg(&bin, "tg-show-tools", &["-u", &api]).contains("Should not be here"));

    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "The sum of 17 and 25 is 42", "reply": "Thought: the tool added them.\nFinal Answer: 17 + 25 = 42"},
      {"match": "Question: ", "reply": "Thought: the add tool adds.\nAction: add\nArgs: {\"a\": 17, \"b\": 25}"}
    ]}"#,
    )
    .await;
    // No settings: no config folder (built-in defaults, no tools), TrustGraph's default workspace,
    // flow and topics.
    let nowhere = std::env::temp_dir().join(format!("agent-e2e-no-config-{}", std::process::id()));
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &nowhere, &[]);
    let warm = warm_up(&broker, "warm-up").await;
    assert_eq!(warm.last().unwrap().content, "17 + 25 = 42", "{warm:#?}");

    let streamed = ask_with_trustgraphs_client(&bin, &broker, "What is 17 + 25?").await;
    let responses = streamed_answer(&streamed, "17 + 25 = 42", "uncompressed");
    let last = responses.last().unwrap();
    assert_eq!(last["end_of_dialog"], true);
    let kinds: Vec<&str> = responses
        .iter()
        .filter_map(|r| r["message_type"].as_str())
        .collect();
    for kind in ["thought", "observation", "answer"] {
        assert!(kinds.contains(&kind), "no {kind} in {kinds:?}");
    }
    // The observation is the MCP server's, through the tool TrustGraph's CLI configured.
    let observed: String = responses
        .iter()
        .filter(|r| r["message_type"] == "observation")
        .filter_map(|r| r["content"].as_str())
        .collect();
    assert!(
        observed.contains("The sum of 17 and 25 is 42"),
        "{observed}"
    );
}

/// An orchestrator that compresses what it publishes (`PULSAR_COMPRESSION`, LZ4 or zstd) is still a
/// drop-in: TrustGraph's client library reads the streamed answer as it reads an uncompressed one,
/// since each message's metadata names its compression. A witness on the response topic checks
/// that the answer really came compressed.
#[tokio::test]
async fn trustgraphs_client_reads_an_answer_sent_compressed() {
    let bin = trustgraph_bin();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Question: ", "reply": "Thought: this one needs no tool.\nFinal Answer: The river that runs through Paris is the Seine."}
    ]}"#,
    )
    .await;
    let nowhere = std::env::temp_dir().join(format!("agent-e2e-no-config-{}", std::process::id()));
    let topics = agent_bus::Topics::trustgraph("default", "default");
    for (setting, kind) in [
        ("lz4", pulsar::message::proto::CompressionType::Lz4),
        ("zstd", pulsar::message::proto::CompressionType::Zstd),
    ] {
        // A broker for each: the orchestrator before, stopped without closing its consumers, can
        // stay subscribed on pulsar-lite (a ghost) and be handed the next warm-up; the likely
        // cause of a zstd warm-up that never ended, seen once in the suite with one broker.
        let broker = Broker::start().unwrap();
        let _orchestrator =
            Orchestrator::spawn(&broker, &llm, &nowhere, &["--pulsar-compression", setting]);
        warm_up(&broker, &format!("warm-up-{setting}")).await;
        let mut witness =
            read_from_start(&broker, &topics.response, &format!("witness-{setting}")).await;

        let streamed =
            ask_with_trustgraphs_client(&bin, &broker, "Which river runs through Paris?").await;
        let responses = streamed_answer(
            &streamed,
            "The river that runs through Paris is the Seine.",
            setting,
        );
        let seen = compressions_seen(&mut witness).await;
        assert!(
            seen.len() >= responses.len(),
            "{setting}: the witness saw {} messages, the client {}",
            seen.len(),
            responses.len()
        );
        assert!(
            seen.iter().all(|c| *c == Some(kind as i32)),
            "{setting}: {seen:?}"
        );
    }
}
