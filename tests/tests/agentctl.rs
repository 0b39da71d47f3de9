//! Every `agentctl` command the README documents runs as documented, in a short mode: `up` with a
//! question, `invoke` against a running `up --stay`, `explain` and `sparql` on what `up` left in its
//! store, `bench`, `bench-graph` and `bench-long` with small counts. (`config`, `load` and `tools` have their own
//! tests in config.rs and knowledge.rs, `cancel`, `approve` and `deny` in run_control.rs, `fork` in
//! fork.rs.)
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use agent_e2e::{binary, repo_root, wait_listening};

/// Runs `agentctl` from the repository root (the README's commands name files relative to it), with
/// no real LLM configured and nothing inherited that points it elsewhere.
fn agentctl(args: &[&str]) -> Command {
    let mut command = Command::new(binary("agentctl"));
    agent_bus::orphans::owned(&mut command)
        .args(args)
        .current_dir(repo_root())
        .env_remove("OPENAI_BASE_URL")
        .env_remove("PULSAR_URL")
        .env_remove("GRAPH_STORE")
        .env_remove("CONFIG_TOKEN");
    command
}

fn run(args: &[&str]) -> (String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = agentctl(args).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    );
    assert!(
        status.success(),
        "agentctl {args:?} exited with {status}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    (stdout, stderr)
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("agentctl-{name}-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The README's first command, then a look at what it left behind.
#[test]
fn up_answers_and_its_store_is_explained_and_queried() {
    let dir = scratch("up");
    let broker = dir.join("broker").display().to_string();
    let graph = dir.join("graph").display().to_string();
    let (stdout, _) = run(&[
        "up",
        "--port",
        "0",
        "--sparql-port",
        "0",
        "--data-dir",
        &broker,
        "--graph-dir",
        &graph,
        "--question",
        "How many hours are in a leap year?",
    ]);
    assert!(stdout.contains("8,784 hours"), "{stdout}");

    let (tree, _) = run(&["explain", "--last", "--store", &graph]);
    for part in ["How many hours are in a leap year?", "8,784 hours"] {
        assert!(
            tree.contains(part),
            "explain --last lacks {part:?}:\n{tree}"
        );
    }
    let (mermaid, _) = run(&[
        "explain", "--last", "--format", "mermaid", "--store", &graph,
    ]);
    assert!(
        mermaid.contains("flowchart") || mermaid.contains("graph"),
        "{mermaid}"
    );

    let (table, _) = run(&[
        "sparql",
        "PREFIX tg: <https://trustgraph.ai/ns/> SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?s a tg:AgentQuestion } }",
        "--store",
        &graph,
    ]);
    assert!(table.lines().any(|l| l.trim() == "1"), "{table}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a model wrote reaches the terminal shown, never acted on, in the provenance tree `up`
/// prints after the dialog as in the dialog itself: an escape that erases a line or retitles the
/// window is written out as text. Before, the tree went out raw (`explain` cleaned it; `up` did not).
#[test]
fn up_shows_a_models_control_characters_as_text_in_its_provenance() {
    let dir = scratch("up-escapes");
    let script = dir.join("script.json");
    // JSON escapes, which the script reads into the characters.
    let reply =
        r"Thought: Checking \u001b]0;owned\u0007 the ledger.\nFinal Answer: 42 \u001b[2K\r(forged)";
    std::fs::write(
        &script,
        format!(r#"{{"rules": [{{"match": "", "reply": "{reply}"}}]}}"#),
    )
    .unwrap();
    let (stdout, _) = run(&[
        "up",
        "--port",
        "0",
        "--sparql-port",
        "0",
        "--data-dir",
        &dir.join("broker").display().to_string(),
        "--graph-dir",
        &dir.join("graph").display().to_string(),
        "--script",
        &script.display().to_string(),
        "--question",
        "What does the ledger say?",
    ]);
    let tree = stdout
        .split("Provenance, read back from the graph store:")
        .nth(1)
        .unwrap_or_else(|| panic!("no provenance shown:\n{stdout}"));
    assert!(tree.contains("the ledger"), "{tree}");
    let raw: Vec<char> = stdout
        .chars()
        .filter(|c| c.is_control() && !matches!(c, '\n' | '\t'))
        .collect();
    assert!(
        raw.is_empty(),
        "control characters reached the terminal: {raw:?}\n{stdout:?}"
    );
}

/// `agentctl sparql ... | head` ends quietly when its reader goes, as other tools do. Before, the
/// write to the closed pipe panicked ("failed printing to stdout: Broken pipe") and the command
/// exited 101, which fails a script run with `pipefail`.
#[test]
fn sparql_into_a_reader_that_goes_ends_quietly() {
    let dir = scratch("sparql-pipe");
    let values: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    let values = values.join(" ");
    // 90,000 rows: more than a pipe holds, so the command writes to it after the reader went.
    let query =
        format!("SELECT ?a ?b WHERE {{ VALUES ?a {{ {values} }} VALUES ?b {{ {values} }} }}");
    let store = dir.join("graph").display().to_string();
    // An empty store, made and let go.
    drop(agent_graph::GraphStore::open(&store, None).unwrap());
    let mut child = agentctl(&["sparql", "--store", &store, &query])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let output = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && !stderr.contains("panicked"),
        "exited with {}: {stderr}",
        output.status
    );
}

/// `up --stay` serves until stopped; `invoke` streams a dialog through it.
#[test]
fn invoke_streams_a_dialog_through_a_running_stack() {
    let dir = scratch("invoke");
    let port = agent_bus::embedded::free_port().unwrap().to_string();
    let sparql_port = agent_bus::embedded::free_port().unwrap().to_string();
    let mut up = agentctl(&[
        "up",
        "--port",
        &port,
        "--sparql-port",
        &sparql_port,
        "--data-dir",
        &dir.join("broker").display().to_string(),
        "--graph-dir",
        &dir.join("graph").display().to_string(),
        "--stay",
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    wait_listening(
        &format!("127.0.0.1:{sparql_port}"),
        "agentctl up's SPARQL endpoint",
    );
    let url = format!("pulsar://127.0.0.1:{port}");
    // The orchestrator subscribes a moment after the endpoint listens; the request waits on the
    // persistent topic either way, but a first try may race the broker's own start.
    let mut answer = None;
    for _ in 0..3 {
        let out = agentctl(&[
            "invoke",
            "--question",
            "How many hours are in a leap year?",
            "--pulsar-url",
            &url,
            "--timeout",
            "60",
        ])
        .output()
        .unwrap();
        if out.status.success() {
            answer = Some(String::from_utf8_lossy(&out.stdout).into_owned());
            break;
        }
        std::thread::sleep(Duration::from_secs(2));
    }
    // Stopped as a user stops it (SIGTERM), so it stops its broker too: a SIGKILL left the
    // pulsar-lite it started running after every test run.
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &up.id().to_string()])
        .status();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while matches!(up.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = up.kill();
    let _ = up.wait();
    let answer = answer.expect("agentctl invoke never got an answer");
    assert!(answer.contains("8,784 hours"), "{answer}");
    // The session is shown, for `agentctl cancel` and `explain`.
    assert!(answer.contains("; session "), "{answer}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `agentctl invoke` with the aggregator's endpoint returns once the graph shows its dialog's
/// end, so `explain --last` run next shows that dialog, even while the aggregator that writes the
/// graph is behind (stopped for 2 s here). It returned on the answer, and `--last` showed the
/// dialog before.
#[tokio::test]
async fn explain_last_after_invoke_shows_that_dialog_while_the_graph_lags() {
    use agent_e2e::{scripted_llm, Aggregator, Broker, Orchestrator, Place};
    const TOKEN: &str = "last-token";
    let broker = Broker::start().unwrap();
    let store_host = Aggregator::store_host(Place::InProcess, &broker, TOKEN, "last-store-only");
    let writer = Aggregator::replica_on(&broker, &store_host, TOKEN);
    let llm = scripted_llm(
        r#"{"rules": [{"match": "", "reply": "Thought: I know.\nFinal Answer: done"}]}"#,
    )
    .await;
    let _orchestrator =
        Orchestrator::journaled(Place::InProcess, &broker, &llm, &store_host, TOKEN, &[]);
    let (url, endpoint) = (broker.url(), store_host.endpoint.clone());
    // Runs agentctl off the test's thread, which serves the scripted LLM meanwhile.
    let run_off = |args: Vec<String>| {
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            run(&args).0
        })
    };
    let invoke = |question: &str| {
        let args = [
            "invoke",
            "--question",
            question,
            "--pattern",
            "react",
            "--pulsar-url",
            &url,
            "--graph-store",
            &endpoint,
            "--graph-token",
            TOKEN,
            "--timeout",
            "60",
        ];
        run_off(args.map(str::to_owned).to_vec())
    };
    let last = || {
        let args = ["explain", "--last", "--store", &endpoint, "--token", TOKEN];
        run_off(args.map(str::to_owned).to_vec())
    };
    invoke("the first question").await.unwrap();
    assert!(last().await.unwrap().contains("the first question"));
    writer.freeze(true);
    let (shown, ()) = tokio::join!(
        async {
            invoke("the second question").await.unwrap();
            last().await.unwrap()
        },
        async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            writer.freeze(false);
        }
    );
    assert!(shown.contains("the second question"), "{shown}");
}

/// `bench` with small counts prints both journal modes side by side.
#[test]
fn bench_prints_both_journal_modes() {
    let (stdout, _) = run(&[
        "bench",
        "--round-trips",
        "50",
        "--one-iteration",
        "5",
        "--three-iteration",
        "3",
        "--dialogs",
        "12",
        "--concurrency",
        "4",
        "--journal",
        "both",
    ]);
    assert!(stdout.contains("steps/s"), "{stdout}");
    assert!(stdout.contains("journal"), "{stdout}");
}

/// `bench --graph-server` keeps the graph in a SPARQL server the project does not own (Oxigraph's
/// own server) behind the aggregator, and counts what each run added: a second run on the same
/// server reports about what the first did, not their sum.
#[test]
fn bench_keeps_the_graph_in_a_sparql_server() {
    use agent_e2e::sparql_server::{Kind, SparqlServer};
    let server = SparqlServer::start(Kind::Oxigraph);
    let endpoint = server.endpoint();
    let bench = || {
        let (stdout, _) = run(&[
            "bench",
            "--round-trips",
            "20",
            "--one-iteration",
            "3",
            "--three-iteration",
            "2",
            "--dialogs",
            "8",
            "--concurrency",
            "4",
            "--journal",
            "on",
            "--graph-server",
            &endpoint,
        ]);
        assert!(stdout.contains("steps/s"), "{stdout}");
        assert!(
            stdout.contains(&format!("over the SPARQL server {endpoint}")),
            "{stdout}"
        );
        let figure = |prefix: &str| -> u64 {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(prefix))
                .unwrap_or_else(|| panic!("no line starting {prefix:?}:\n{stdout}"));
            line[prefix.len()..]
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no figure in {line:?}"))
        };
        (figure("store: "), figure("journal: "))
    };
    let (quads, entries) = bench();
    // Every dialog's provenance and one entry for each of its steps landed in the server.
    assert!(quads > 1_000, "{quads} quads");
    assert!(entries >= 18 * 2, "{entries} entries");
    let (again, entries_again) = bench();
    assert!(
        again < quads * 3 / 2,
        "the second run counted {again} quads, the first {quads}"
    );
    assert_eq!(entries_again, entries);
}

/// `bench-graph` with small sizes: the write rate, then the explain query at each size, which
/// must return the whole session every time.
#[test]
fn bench_graph_times_writes_and_the_explain_query() {
    let (stdout, _) = run(&[
        "bench-graph",
        "--messages",
        "100",
        "--sizes",
        "1000,4000",
        "--runs",
        "3",
    ]);
    assert_eq!(
        stdout.matches("explain query (").count(),
        2,
        "one line per size:\n{stdout}"
    );
}

/// `bench-long` with a short dialog: it answers after every observation, and the sizes and step
/// times are printed per iteration.
#[test]
fn bench_long_follows_one_dialog_as_it_grows() {
    let (stdout, _) = run(&["bench-long", "--iterations", "3", "--observation-kib", "2"]);
    assert!(
        stdout.contains("ended: answered after 3 observations"),
        "{stdout}"
    );
    assert!(
        stdout.contains("next request after iteration    3:"),
        "{stdout}"
    );
    assert!(stdout.contains("step    3:"), "{stdout}");
    assert!(stdout.contains("store: "), "{stdout}");
}

/// A broker address that takes connections and never answers (a hung broker, a load balancer in
/// front of none): each command that needs the broker says so within its patience (30 s) and
/// exits non-zero, instead of trying in silence for minutes (its connection error, after about
/// nine, named no timeout).
#[test]
fn a_broker_that_never_answers_is_reported_not_waited_on() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("pulsar://{}", silent.local_addr().unwrap());
    let output = agentctl(&["invoke", "--question", "hello?", "--pulsar-url", &url])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("no answer from the broker") && stderr.contains(&url),
        "{stderr}"
    );
    drop(silent);
}

/// `up` whose SPARQL port another process holds: the aggregator cannot start, and `up` says why
/// and exits at once. It asked its question all the same and waited out the dialog's timeout (300
/// s), then reported only that timeout: the start-up error was never shown.
#[test]
fn up_reports_a_service_that_cannot_start_instead_of_waiting() {
    let dir = scratch("up-taken");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let sparql_port = taken.local_addr().unwrap().port().to_string();
    let mut up = agentctl(&[
        "up",
        "--port",
        "0",
        "--sparql-port",
        &sparql_port,
        "--data-dir",
        &dir.join("broker").display().to_string(),
        "--graph-dir",
        &dir.join("graph").display().to_string(),
        "--question",
        "How many hours are in a leap year?",
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Well inside the dialog's timeout, so that waiting it out fails here.
    let patience = std::time::Instant::now() + Duration::from_secs(90);
    while up.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > patience {
            up.kill().unwrap();
            let output = up.wait_with_output().unwrap();
            panic!(
                "agentctl up still running after 90 s with its SPARQL port taken; stderr:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let output = up.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("binding 127.0.0.1:{sparql_port}")),
        "the start-up error is not shown:\n{stderr}"
    );
    drop(taken);
}
