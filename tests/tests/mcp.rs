//! MCP tools over a real broker, calling the reference "everything" MCP server from the npm registry
//! (`tests/mcp-servers`, installed by `scripts/setup.sh`; not written by this project): over
//! streamable HTTP behind a gate that checks the bearer token, and as a stdio child process. The
//! tools are configured without arguments, so the prompt shows the server's schema; the LLM's
//! string arguments reach the server as numbers. A server killed mid-dialog costs an error
//! observation and the dialog goes on once it is back; one restarted between iterations, or a stdio
//! server killed, costs nothing (the session is opened again).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_e2e::*;
use agent_schema::AgentResponse;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

const DIALOG_TIMEOUT: Duration = Duration::from_secs(90);
const TOKEN: &str = "s3cret-mcp-token";

/// A reverse proxy in front of the HTTP server that lets in only requests bearing `TOKEN`, so the
/// test sees the orchestrator send it (the everything server checks no token).
#[derive(Clone)]
struct Gate {
    upstream: String,
    http: reqwest::Client,
    let_in: Arc<AtomicUsize>,
    turned_away: Arc<AtomicUsize>,
    /// Answers whose body is still being passed on.
    open_bodies: Arc<AtomicUsize>,
}

/// Counts an answer's body as open until it is dropped (ended, or its client gone).
struct OpenBody(Arc<AtomicUsize>);

impl Drop for OpenBody {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn gate(State(gate): State<Gate>, request: Request) -> Response {
    let bearer = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    if bearer != Some(&format!("Bearer {TOKEN}")) {
        gate.turned_away.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::UNAUTHORIZED, "wrong or missing bearer token").into_response();
    }
    gate.let_in.fetch_add(1, Ordering::SeqCst);
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, 16 << 20).await.unwrap();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut headers = parts.headers.clone();
    headers.remove("host");
    headers.remove("content-length");
    let upstream = gate
        .http
        .request(parts.method, format!("{}{path}", gate.upstream))
        .headers(headers)
        .body(body)
        .send()
        .await;
    let upstream = match upstream {
        Ok(u) => u,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let mut response = Response::builder().status(upstream.status());
    for (name, value) in upstream.headers() {
        if !["content-length", "transfer-encoding", "connection"].contains(&name.as_str()) {
            response = response.header(name, value);
        }
    }
    gate.open_bodies.fetch_add(1, Ordering::SeqCst);
    let open = OpenBody(gate.open_bodies.clone());
    let body = futures::StreamExt::map(upstream.bytes_stream(), move |chunk| {
        let _open = &open;
        chunk
    });
    response.body(Body::from_stream(body)).unwrap()
}

async fn start_gate(upstream_port: u16) -> (String, Gate) {
    let state = Gate {
        upstream: format!("http://127.0.0.1:{upstream_port}"),
        http: reqwest::Client::new(),
        let_in: Arc::default(),
        turned_away: Arc::default(),
        open_bodies: Arc::default(),
    };
    let app = axum::Router::new().fallback(gate).with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/mcp", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, state)
}

/// The stdio server's process id, found by the marker on its command line.
fn stdio_server_pid(marker: &str) -> Option<u32> {
    let out = Command::new("pgrep").args(["-f", marker]).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .and_then(|l| l.trim().parse().ok())
}

fn script() -> String {
    let listed = |tool: &str, description: &str| {
        format!("- {tool}: {description}\n  arguments: a (number): First number; b (number): Second number")
    };
    serde_json::json!({"rules": [
        // Killed mid-dialog: the error, then the answer once the server is back.
        {"match": "Observation: The sum of 3 and 4 is 7.", "reply": "Thought: it is back\nFinal Answer: recovered: 7"},
        {"match": "Observation: Error:", "and": ["Question: add 17 and 25 over http"], "delay_ms": 1500,
         "reply": "Thought: try again once it is back\nAction: add_http\nArgs: {\"a\": 3, \"b\": 4}"},
        {"match": "Observation: The sum of 17 and 25 is 42.", "and": ["over http"], "delay_ms": 1500,
         "reply": "Thought: another one\nAction: add_http\nArgs: {\"a\": \"3\", \"b\": 4}"},
        {"match": "Question: add 17 and 25 over http", "and": [listed("add_http", "Add two numbers on the HTTP server")],
         "reply": "Thought: the server adds\nAction: add_http\nArgs: {\"a\": 17, \"b\": \"25\"}"},
        // Restarted between iterations: the stale session is replaced without an error.
        {"match": "Observation: The sum of 2 and 2 is 4.", "reply": "Thought: done\nFinal Answer: 4 after a restart"},
        {"match": "Observation: The sum of 1 and 2 is 3.", "and": ["twice over http"], "delay_ms": 3000,
         "reply": "Thought: again\nAction: add_http\nArgs: {\"a\": 2, \"b\": 2}"},
        {"match": "Question: add twice over http",
         "reply": "Thought: first\nAction: add_http\nArgs: {\"a\": 1, \"b\": 2}"},
        // stdio: the child killed between iterations is started again.
        {"match": "Observation: The sum of 7 and 8 is 15.", "reply": "Thought: done\nFinal Answer: 15 after a respawn"},
        {"match": "Observation: The sum of 5 and 6 is 11.", "delay_ms": 1500,
         "reply": "Thought: again\nAction: add_stdio\nArgs: {\"a\": 7, \"b\": 8}"},
        {"match": "Question: add 5 and 6 over stdio", "and": [listed("add_stdio", "Add two numbers on the stdio server")],
         "reply": "Thought: the child adds\nAction: add_stdio\nArgs: {\"a\": 5, \"b\": 6}"},
        // The wrong token is turned away, and a wrongly typed argument is refused before the call.
        {"match": "Observation: Error:", "and": ["Question: add with the wrong token"], "reply": "Thought: refused\nFinal Answer: refused"},
        {"match": "Question: add with the wrong token",
         "reply": "Thought: try\nAction: add_intruder\nArgs: {\"a\": 1, \"b\": 1}"},
        {"match": "Observation: Error:", "and": ["Question: add words for numbers"], "reply": "Thought: typed\nFinal Answer: numbers only"},
        {"match": "Question: add words for numbers",
         "reply": "Thought: try\nAction: add_stdio\nArgs: {\"a\": \"two\", \"b\": 1}"}
    ]})
    .to_string()
}

/// Reads dialog `id` until an observation containing `needle`, and returns what it read.
async fn until_observation(
    client: &mut agent_bus::AgentClient,
    id: &str,
    needle: &str,
) -> Vec<AgentResponse> {
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + DIALOG_TIMEOUT;
    loop {
        let (rid, response) = tokio::time::timeout_at(deadline, client.next())
            .await
            .unwrap_or_else(|_| panic!("no observation with '{needle}' in {id}: {seen:#?}"))
            .unwrap();
        if rid != id {
            continue;
        }
        assert!(!response.end_of_dialog, "{id} ended early: {seen:#?}");
        let found = response.message_type == "observation" && response.content.contains(needle);
        seen.push(response);
        if found {
            return seen;
        }
    }
}

#[tokio::test]
async fn mcp_tools_on_a_real_server_over_http_and_stdio_survive_its_restarts() {
    let server_port = agent_bus::embedded::free_port().unwrap();
    let mut server = EverythingHttp::start(server_port);
    let (gate_url, gate) = start_gate(server_port).await;
    let marker = format!("agent-e2e-mcp-{}", std::process::id());
    let mcp = serde_json::json!({
        "sum-http": {"remote-name": "get-sum", "url": gate_url, "auth-token": TOKEN},
        "sum-intruder": {"remote-name": "get-sum", "url": gate_url, "auth-token": "not-the-token"},
        // The marker is an argument the server ignores, so the test can find and kill it.
        "sum-stdio": {"remote-name": "get-sum", "command": "node",
                      "args": [everything_server().to_str().unwrap(), "stdio", marker]}
    });
    let tools = serde_json::json!({
        "add-http": {"name": "add_http", "description": "Add two numbers on the HTTP server",
                     "type": "mcp-tool", "mcp-tool": "sum-http"},
        "add-stdio": {"name": "add_stdio", "description": "Add two numbers on the stdio server",
                      "type": "mcp-tool", "mcp-tool": "sum-stdio"},
        "add-intruder": {"name": "add_intruder", "description": "Add two numbers with the wrong token",
                         "type": "mcp-tool", "mcp-tool": "sum-intruder",
                         "arguments": [{"name": "a", "type": "number"}, {"name": "b", "type": "number"}]}
    });
    let limits = r#"{"default": {"tool_timeout_secs": 15}}"#;
    let config = seed_with(
        "mcp",
        &[
            ("mcp", &mcp.to_string()),
            ("tool", &tools.to_string()),
            ("agent-limits", limits),
        ],
    );
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(&script()).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;

    // Over HTTP, with the schema from the server and the token sent; then the server is killed
    // after the first call (an error observation) and started again (the dialog goes on).
    client
        .send("m-http", &request("add 17 and 25 over http", false))
        .await
        .unwrap();
    let mut http = until_observation(&mut client, "m-http", "The sum of 17 and 25 is 42.").await;
    server.kill();
    http.extend(until_observation(&mut client, "m-http", "Error:").await);
    server = EverythingHttp::start(server_port);
    http.extend(
        collect_dialog(&mut client, "m-http", DIALOG_TIMEOUT)
            .await
            .unwrap(),
    );
    assert_eq!(http.last().unwrap().content, "recovered: 7", "{http:#?}");
    let (triples, first) = observation(&http, 1);
    assert_eq!(first, "The sum of 17 and 25 is 42.");
    let (_, lost) = observation(&http, 2);
    assert!(lost.starts_with("Error: the MCP server"), "{lost}");
    duration_ms(&explained(&http), &http, 2);
    let (_, back) = observation(&http, 3);
    assert_eq!(back, "The sum of 3 and 4 is 7.");
    let iteration = format!("{}/i1", session_of(&http));
    let candidates = values(&triples, &iteration, tg::TOOL_CANDIDATE);
    for tool in ["add_http", "add_stdio", "add_intruder"] {
        assert!(candidates.contains(&tool.to_owned()), "{candidates:?}");
    }
    assert!(gate.let_in.load(Ordering::SeqCst) > 0);
    assert_eq!(gate.turned_away.load(Ordering::SeqCst), 0);

    // Restarted between two calls: the second goes to a new session without an error.
    client
        .send("m-restart", &request("add twice over http", false))
        .await
        .unwrap();
    let mut twice = until_observation(&mut client, "m-restart", "The sum of 1 and 2 is 3.").await;
    server.restart();
    twice.extend(
        collect_dialog(&mut client, "m-restart", DIALOG_TIMEOUT)
            .await
            .unwrap(),
    );
    assert_eq!(
        twice.last().unwrap().content,
        "4 after a restart",
        "{twice:#?}"
    );
    assert!(
        !text_of(&twice, "observation").contains("Error"),
        "{twice:#?}"
    );

    // Over stdio: the child is killed between two calls and started again for the second.
    client
        .send("m-stdio", &request("add 5 and 6 over stdio", false))
        .await
        .unwrap();
    let mut stdio = until_observation(&mut client, "m-stdio", "The sum of 5 and 6 is 11.").await;
    let first_child = stdio_server_pid(&marker).expect("the stdio server is running");
    Command::new("pkill")
        .args(["-KILL", "-f", &marker])
        .status()
        .unwrap();
    stdio.extend(
        collect_dialog(&mut client, "m-stdio", DIALOG_TIMEOUT)
            .await
            .unwrap(),
    );
    assert_eq!(
        stdio.last().unwrap().content,
        "15 after a respawn",
        "{stdio:#?}"
    );
    assert!(
        !text_of(&stdio, "observation").contains("Error"),
        "{stdio:#?}"
    );
    let second_child = stdio_server_pid(&marker).expect("the stdio server runs again");
    assert_ne!(first_child, second_child);

    // A token the server's gate does not accept, and an argument that is not a number.
    client
        .send("m-intruder", &request("add with the wrong token", false))
        .await
        .unwrap();
    let intruder = collect_dialog(&mut client, "m-intruder", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(intruder.last().unwrap().content, "refused", "{intruder:#?}");
    let (_, turned_away) = observation(&intruder, 1);
    assert!(turned_away.contains("401"), "{turned_away}");
    assert!(gate.turned_away.load(Ordering::SeqCst) > 0);
    client
        .send("m-typed", &request("add words for numbers", false))
        .await
        .unwrap();
    let typed = collect_dialog(&mut client, "m-typed", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(typed.last().unwrap().content, "numbers only", "{typed:#?}");
    let (_, wrong) = observation(&typed, 1);
    assert!(
        wrong.contains("the argument 'a' must be of type number, and 'two' is not"),
        "{wrong}"
    );

    drop(server);
    let _ = Command::new("pkill")
        .args(["-KILL", "-f", &marker])
        .status();
}

/// Over HTTP, a call given up on (at the tool's timeout) leaves no connection behind: the
/// server streams its answer, never answers a cancelled call (the TypeScript SDK's does not), and
/// the client's transport ends such a stream only with its session, which a ping kept. Each
/// timed-out call held a connection, and a task, for as long as the session lived.
#[tokio::test]
async fn an_http_call_given_up_on_leaves_no_stream_open() {
    let server_port = agent_bus::embedded::free_port().unwrap();
    let _server = EverythingHttp::start(server_port);
    let (gate_url, gate) = start_gate(server_port).await;
    let pool = agent_mcp::McpPool::new();
    let endpoint = agent_mcp::Endpoint::Http {
        url: gate_url,
        auth_token: Some(TOKEN.to_owned()),
    };
    let arguments = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<std::collections::BTreeMap<_, _>>()
    };
    let sum = arguments(&[("a", "1"), ("b", "2")]);
    let said = pool.call(&endpoint, "get-sum", &sum).await.unwrap();
    assert!(said.contains('3'), "{said}");
    const GIVEN_UP: usize = 4;
    let long = arguments(&[("duration", "60"), ("steps", "2")]);
    for _ in 0..GIVEN_UP {
        let call = pool.call(&endpoint, "trigger-long-running-operation", &long);
        assert!(
            tokio::time::timeout(Duration::from_secs(1), call)
                .await
                .is_err(),
            "the long operation answered within a second"
        );
    }
    let said = pool.call(&endpoint, "get-sum", &sum).await.unwrap();
    assert!(said.contains('3'), "{said}");
    // The session's own event stream may stay open; the given-up calls' must not.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let open = gate.open_bodies.load(Ordering::SeqCst);
        if open <= 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{open} answers still streaming after {GIVEN_UP} calls were given up on"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One of `tests/mcp-servers`' HTTP servers, `script` run by `program` on a free port with
/// `extra` arguments after it, once it listens; and its endpoint, without a token.
fn http_test_server(
    program: &str,
    script: &str,
    extra: &[&str],
) -> (std::process::Child, agent_mcp::Endpoint) {
    let port = agent_bus::embedded::free_port().unwrap();
    let mut command = Command::new(program);
    agent_bus::orphans::owned(&mut command)
        .arg(repo_root().join("tests/mcp-servers").join(script))
        .arg(port.to_string())
        .args(extra);
    let server = command.spawn().unwrap();
    wait_listening(&format!("127.0.0.1:{port}"), script);
    let endpoint = agent_mcp::Endpoint::Http {
        url: format!("http://127.0.0.1:{port}/mcp"),
        auth_token: None,
    };
    (server, endpoint)
}

/// A server whose event stream (`GET`) breaks each time just after it opens is asked for it
/// again at a pace, not at once for ever: `rmcp` reconnects without a wait, and kept a core
/// busy opening streams for the session's life, while its calls still worked.
#[tokio::test]
async fn an_event_stream_that_keeps_breaking_is_opened_again_at_a_pace() {
    let (mut server, endpoint) =
        http_test_server("python3", "misbehaving_http.py", &["broken-get"]);
    let pool = agent_mcp::McpPool::new();
    let none = std::collections::BTreeMap::new();
    assert_eq!(pool.call(&endpoint, "echo", &none).await.unwrap(), "echoed");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let gets: u64 = pool
        .call(&endpoint, "gets", &none)
        .await
        .unwrap()
        .parse()
        .unwrap();
    let _ = server.kill();
    let _ = server.wait();
    // Paced: at once, then 0.2, 0.4, 0.8 and 1.6 s later.
    assert!(
        (1..=8).contains(&gets),
        "{gets} event streams asked for in 3 s"
    );
}

/// Calls to a server that answers in JSON run side by side on its one session, as they do on a
/// server that answers with an event stream. `rmcp`'s HTTP worker sends a message and waits for
/// its answer before it takes the next, so until 2026-12-07 every dialog of an orchestrator
/// process queued behind every other's call to such a server: four 5 s searches took 20 s, and
/// the last of a busy process's calls ran out of `tool_timeout_secs` waiting for its turn. Here
/// each call waits for four to be under way at once (`meet`); one at a time, each saw only
/// itself. Two servers: one on the TypeScript SDK with its JSON answers on
/// (`tests/mcp-servers/json_answers.mjs`), and a bare one (`misbehaving_http.py`).
#[tokio::test]
async fn calls_to_a_server_answering_in_json_run_side_by_side() {
    for (program, script) in [
        ("node", "json_answers.mjs"),
        ("python3", "misbehaving_http.py"),
    ] {
        let (mut server, endpoint) = http_test_server(program, script, &[]);
        let pool = agent_mcp::McpPool::new();
        let none = std::collections::BTreeMap::new();
        // The session is opened first, so that the four share it.
        assert_eq!(pool.call(&endpoint, "echo", &none).await.unwrap(), "echoed");
        let answers =
            futures::future::join_all((0..4).map(|_| pool.call(&endpoint, "meet", &none))).await;
        // On the one session, which still answers.
        let sessions = pool.call(&endpoint, "sessions", &none).await;
        let _ = server.kill();
        let _ = server.wait();
        assert_eq!(sessions.unwrap(), "1", "{program}");
        for answer in answers {
            assert_eq!(
                answer.unwrap(),
                "met 4",
                "the calls to the {program} server were not under way at once"
            );
        }
    }
}

/// A session no call has used for the pool's idle time is ended when the pool is next asked for
/// another, a stdio server's process with it: an endpoint is read from the live config at each
/// call, so a config change (a token rotated, arguments edited) leaves the old one unused for good.
#[tokio::test]
async fn a_session_left_unused_is_ended_with_its_stdio_server() {
    let pool = agent_mcp::McpPool::with_idle(Duration::from_millis(300))
        .trusting(agent_mcp::StdioTrust::any());
    let server = |marker: &str| agent_mcp::Endpoint::Stdio {
        command: "node".to_owned(),
        args: vec![
            everything_server().to_str().unwrap().to_owned(),
            "stdio".to_owned(),
            marker.to_owned(),
        ],
        env: Default::default(),
    };
    let (old, new) = (
        format!("mcp-idle-old-{}", std::process::id()),
        format!("mcp-idle-new-{}", std::process::id()),
    );
    let sum = |a: &str, b: &str| {
        [
            ("a".to_owned(), a.to_owned()),
            ("b".to_owned(), b.to_owned()),
        ]
        .into_iter()
        .collect::<std::collections::BTreeMap<_, _>>()
    };
    let said = pool
        .call(&server(&old), "get-sum", &sum("1", "2"))
        .await
        .unwrap();
    assert!(said.contains('3'), "{said}");
    assert!(
        stdio_server_pid(&old).is_some(),
        "the first server is not running"
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    let said = pool
        .call(&server(&new), "get-sum", &sum("2", "2"))
        .await
        .unwrap();
    assert!(said.contains('4'), "{said}");
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while stdio_server_pid(&old).is_some() {
        assert!(
            std::time::Instant::now() < deadline,
            "the unused session's server still runs"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        stdio_server_pid(&new).is_some(),
        "the server in use was stopped"
    );
}

/// A stdio server is started with what a program needs to run (`PATH`, `HOME`...), its config's
/// `env` and what `MCP_STDIO_PASS_ENV` names: never the rest of the orchestrator's environment,
/// which holds its secrets (the everything server's `get-env` tool shows what it was given).
#[tokio::test]
async fn a_stdio_server_is_not_given_the_orchestrators_secrets() {
    let mcp = serde_json::json!({
        "env-stdio": {"remote-name": "get-env", "command": "node",
                      "args": [everything_server().to_str().unwrap(), "stdio"],
                      "env": {"FROM_CONFIG": "configured"}}
    });
    let tools = serde_json::json!({
        "show-env": {"name": "show_env", "description": "Show the server's environment",
                     "type": "mcp-tool", "mcp-tool": "env-stdio"}
    });
    let config = seed_with(
        "mcp-env",
        &[("mcp", &mcp.to_string()), ("tool", &tools.to_string())],
    );
    let script = serde_json::json!({"rules": [
        {"match": "Observation:", "reply": "Thought: seen\nFinal Answer: seen"},
        {"match": "Question: show the environment", "reply": "Thought: look\nAction: show_env\nArgs: {}"}
    ]});
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(&script.to_string()).await;
    let _orchestrator = Orchestrator::start(
        Place::Child,
        &broker.url(),
        &llm.base_url(),
        "scripted",
        &config,
        &[],
        &[
            ("OPENAI_API_KEY", "sk-secret-of-the-orchestrator"),
            ("MCP_STDIO_PASS_ENV", "WANTED_BY_THE_SERVER"),
            ("WANTED_BY_THE_SERVER", "passed"),
        ],
    );
    let mut client = client(&broker).await;
    client
        .send("m-env", &request("show the environment", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "m-env", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, environment) = observation(&responses, 1);
    for wanted in [
        "\"FROM_CONFIG\"",
        "configured",
        "\"WANTED_BY_THE_SERVER\"",
        "passed",
        "\"PATH\"",
    ] {
        assert!(environment.contains(wanted), "{wanted}: {environment}");
    }
    assert!(
        !environment.contains("sk-secret-of-the-orchestrator")
            && !environment.contains("OPENAI_API_KEY"),
        "{environment}"
    );
}

/// A server that misbehaves (`tests/mcp-servers/misbehaving.py`) costs a step its tool's time and
/// no more. A call given up at the tool's timeout is cancelled on the server (MCP's
/// `notifications/cancelled`), so it may stop the work and the session forgets the call; a
/// result that never ends ends the session once it passes 16 MiB, rather than grow the
/// orchestrator's memory until the tool's timeout (or, for a server that keeps writing, until
/// the process dies). Until 2026-12-02 neither was done.
#[tokio::test]
async fn a_misbehaving_stdio_server_is_told_of_a_timeout_and_cut_off_when_it_floods() {
    let notes = std::env::temp_dir().join(format!(
        "agent-e2e-misbehaving-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let script = repo_root().join("tests/mcp-servers/misbehaving.py");
    // One server (the same program and arguments: one session) serving two tools.
    let server = |tool: &str| {
        serde_json::json!({"command": "python3", "remote-name": tool,
                           "args": [script.to_str().unwrap(), notes.to_str().unwrap()]})
    };
    let mcp = serde_json::json!({"slow": server("slow"), "flood": server("flood")});
    let tools = serde_json::json!({
        "slow": {"name": "slow", "description": "Never answers", "type": "mcp-tool"},
        "flood": {"name": "flood", "description": "Answers without end", "type": "mcp-tool"}
    });
    let config = seed_with(
        "mcp-misbehaving",
        &[
            ("mcp", &mcp.to_string()),
            ("tool", &tools.to_string()),
            (
                "agent-limits",
                r#"{"default": {"max_iterations": 4, "tool_timeout_secs": 5}}"#,
            ),
        ],
    );
    let script_rules = serde_json::json!({"rules": [
        {"match": "Observation:", "reply": "Thought: seen\nFinal Answer: seen"},
        {"match": "Question: call the slow tool", "reply": "Thought: call\nAction: slow\nArgs: {}"},
        {"match": "Question: call the flooding tool", "reply": "Thought: call\nAction: flood\nArgs: {}"}
    ]});
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(&script_rules.to_string()).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;

    client
        .send("m-flood", &request("call the flooding tool", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "m-flood", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, flooded) = observation(&responses, 1);
    assert!(
        flooded.starts_with("Error:") && !flooded.contains("timed out"),
        "the flood was not cut off: {flooded}"
    );

    client
        .send("m-slow", &request("call the slow tool", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "m-slow", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let (_, slow) = observation(&responses, 1);
    assert!(slow.contains("timed out"), "{slow}");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let noted = loop {
        let noted = std::fs::read_to_string(&notes).unwrap_or_default();
        if noted.contains("cancelled") || std::time::Instant::now() > deadline {
            break noted;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let called: Vec<&str> = noted
        .lines()
        .filter_map(|l| l.strip_prefix("called "))
        .collect();
    assert_eq!(called.len(), 1, "{noted}");
    assert!(
        noted
            .lines()
            .any(|l| l == format!("cancelled {}", called[0])),
        "the server was not told the call was given up: {noted}"
    );
}

/// A server that adds a tool while its session is open, and says so
/// (`notifications/tools/list_changed`, `tests/mcp-servers/changing_tools.py`): the next step
/// lists the tools again, shows the new one's arguments to the LLM and calls it. Until 2026-12-03
/// a session's tool list was read once, so the new tool had no arguments in the prompt and its
/// call failed ("has no tool 'later'") for as long as the session was used.
#[tokio::test]
async fn a_tool_a_server_adds_while_its_session_is_open_is_listed_and_called() {
    let script = repo_root().join("tests/mcp-servers/changing_tools.py");
    let server = |tool: &str| {
        serde_json::json!({"command": "python3", "remote-name": tool,
                           "args": [script.to_str().unwrap()]})
    };
    let mcp = serde_json::json!({"evolve": server("evolve"), "later": server("later")});
    let tools = serde_json::json!({
        "evolve": {"name": "evolve", "description": "Adds a tool", "type": "mcp-tool"},
        "later": {"name": "later", "description": "Runs once added", "type": "mcp-tool"}
    });
    let config = seed_with(
        "mcp-changing-tools",
        &[("mcp", &mcp.to_string()), ("tool", &tools.to_string())],
    );
    let script_rules = serde_json::json!({"rules": [
        {"match": "Observation:", "reply": "Thought: seen\nFinal Answer: seen"},
        {"match": "Question: add the later tool", "reply": "Thought: call\nAction: evolve\nArgs: {}"},
        {"match": "Question: call the later tool", "reply": "Thought: call\nAction: later\nArgs: {\"city\": \"Paris\"}"}
    ]});
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(&script_rules.to_string()).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;

    client
        .send("m-evolve", &request("add the later tool", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "m-evolve", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(observation(&responses, 1).1, "evolved", "{responses:#?}");

    client
        .send("m-later", &request("call the later tool", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "m-later", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        observation(&responses, 1).1,
        "later ran for Paris",
        "{responses:#?}"
    );
    let listed = "- later: Runs once added\n  arguments: city (string): The city";
    assert!(
        llm.calls()
            .iter()
            .any(|c| c.last_user.contains("Question: call the later tool")
                && c.last_user.contains(listed)),
        "the prompt did not list the new tool's arguments: {:#?}",
        llm.calls().last()
    );
}

/// A server over HTTP whose answer runs past 16 MiB (`tests/mcp-servers/misbehaving_http.py`: one
/// JSON message, or one line of an event stream, of 64 MiB) costs its call an error rather than
/// this process's memory: the read stops at the bound, as a stdio server's line does. The server's
/// next call is answered. Until 2026-12-03 such an answer was read whole (a server that never
/// ended it grew the orchestrator until it died), and here the LLM was given its first bytes as
/// the tool's result. A call answered after 400,000 events that are no message is answered:
/// until 2026-12-05 `rmcp` passed over each such event by calling itself once more, and the run
/// overflowed the stack of the process, which aborted.
#[tokio::test]
async fn an_http_server_whose_answer_runs_past_the_bound_is_cut_off() {
    let port = agent_bus::embedded::free_port().unwrap();
    let script = repo_root().join("tests/mcp-servers/misbehaving_http.py");
    let mut command = Command::new("python3");
    agent_bus::orphans::owned(&mut command)
        .arg(&script)
        .arg(port.to_string());
    let mut server = command.spawn().unwrap();
    wait_listening(
        &format!("127.0.0.1:{port}"),
        "the misbehaving MCP server over HTTP",
    );
    let url = format!("http://127.0.0.1:{port}/mcp");
    let names = ["flood-json", "flood-events", "junk-events", "echo"];
    let mut mcp = serde_json::Map::new();
    let mut tools = serde_json::Map::new();
    for name in names {
        mcp.insert(
            name.into(),
            serde_json::json!({"url": url, "remote-name": name}),
        );
        tools.insert(
            name.into(),
            serde_json::json!({"name": name, "description": name, "type": "mcp-tool"}),
        );
    }
    let config = seed_with(
        "mcp-misbehaving-http",
        &[
            ("mcp", &serde_json::Value::Object(mcp).to_string()),
            ("tool", &serde_json::Value::Object(tools).to_string()),
            (
                "agent-limits",
                r#"{"default": {"max_iterations": 4, "tool_timeout_secs": 30}}"#,
            ),
        ],
    );
    let mut rules = vec![serde_json::json!(
        {"match": "Observation:", "reply": "Thought: seen\nFinal Answer: seen"}
    )];
    for name in names {
        rules.push(
            serde_json::json!({"match": format!("Question: call {name}"),
            "reply": format!("Thought: call\nAction: {name}\nArgs: {{}}")}),
        );
    }
    let script_rules = serde_json::json!({ "rules": rules });
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(&script_rules.to_string()).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &config, &[]);
    let mut client = client(&broker).await;
    let mut observed = Vec::new();
    for name in names {
        let id = format!("m-{name}");
        client
            .send(&id, &request(&format!("call {name}"), false))
            .await
            .unwrap();
        let responses = collect_dialog(&mut client, &id, DIALOG_TIMEOUT)
            .await
            .unwrap();
        observed.push(observation(&responses, 1).1);
    }
    let _ = server.kill();
    let _ = server.wait();
    for flooded in &observed[..2] {
        assert!(
            flooded.starts_with("Error:") && !flooded.contains("timed out"),
            "the flood was not cut off: {}",
            &flooded[..flooded.len().min(300)]
        );
    }
    assert_eq!(observed[2], "after the junk");
    assert_eq!(observed[3], "echoed");
}
