//! What an operator sees of a running orchestrator: `/healthz` answers from the start, `/readyz`
//! says "not ready" until the broker it was started for comes up, and `/metrics` after a few dialogs
//! (answered, failed, with tool calls, and a message that does not decode) has every series with
//! the counts those dialogs must have produced.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::time::Duration;

use agent_e2e::*;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

/// THREE_STEPS (two `llm` tool calls, then an answer), and a question whose first ReACT call the
/// LLM refuses with a 400 (not retried: the dialog ends with an error).
fn script() -> String {
    let mut script: serde_json::Value = serde_json::from_str(THREE_STEPS).unwrap();
    let rules = script["rules"].as_array_mut().unwrap();
    rules.insert(
        0,
        serde_json::json!({"match": "Question: please fail", "reply": "never", "faults": ["400"]}),
    );
    script.to_string()
}

async fn get(url: &str) -> (u16, String) {
    match reqwest::get(url).await {
        Ok(response) => {
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        }
        Err(e) => (0, e.to_string()),
    }
}

/// The sum of every series of `family` whose labels include `with`.
fn sum(all: &BTreeMap<String, f64>, family: &str, with: &str) -> f64 {
    all.iter()
        .filter(|(k, _)| k.starts_with(&format!("{family}{{")) && k.contains(with))
        .map(|(_, v)| v)
        .sum()
}

#[tokio::test]
async fn readiness_follows_the_broker_and_metrics_count_the_dialogs() {
    let broker_port = agent_bus::embedded::free_port().unwrap();
    let http_port = agent_bus::embedded::free_port().unwrap();
    let base = format!("http://127.0.0.1:{http_port}");
    let llm = scripted_llm(&script()).await;
    let http_addr = format!("127.0.0.1:{http_port}");
    // A child: the metrics registry is per process, and other tests' orchestrators would count in
    // this one's if it ran in the test process.
    let _orchestrator = Orchestrator::start(
        Place::Child,
        &format!("pulsar://127.0.0.1:{broker_port}"),
        &llm.base_url(),
        "scripted",
        &seed_dir(),
        &["--http-addr", &http_addr],
        &[],
    );
    wait_listening(&http_addr, "the orchestrator's health endpoint");

    // No broker yet: alive, not ready, and the families are already listed.
    assert_eq!(
        get(&format!("{base}/healthz")).await,
        (200, "ok".to_owned())
    );
    let (status, why) = get(&format!("{base}/readyz")).await;
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("broker"), "{why}");
    let (_, listed) = get(&format!("{base}/metrics")).await;
    for family in [
        "agent_dialogs_started_total",
        "agent_dialogs_finished_total",
        "agent_iterations_total",
        "agent_iteration_duration_seconds",
        "agent_llm_call_duration_seconds",
        "agent_llm_tokens_total",
        "agent_tool_calls_total",
        "agent_request_messages_total",
    ] {
        assert!(
            listed.contains(&format!("# TYPE {family} ")),
            "{family}: {listed}"
        );
    }

    // The broker comes up: ready within the connection backoff.
    let broker = Broker::start_on(broker_port).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (status, why) = get(&format!("{base}/readyz")).await;
        if status == 200 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never ready: {status} {why}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let mut client = client(&broker).await;
    for id in ["o-1", "o-2"] {
        client
            .send(id, &request("combine the parts", false))
            .await
            .unwrap();
        let dialog = collect_dialog(&mut client, id, DIALOG_TIMEOUT)
            .await
            .unwrap();
        assert_eq!(dialog.last().unwrap().content, "alpha and beta, combined.");
    }
    client
        .send("o-3", &request("please fail", false))
        .await
        .unwrap();
    let failed = collect_dialog(&mut client, "o-3", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert!(failed.last().unwrap().error.is_some(), "{failed:#?}");
    client.send_raw("o-4", b"{not json".to_vec()).await.unwrap();

    // The counters are updated after each commit; give the dead letter a moment.
    let mut all = BTreeMap::new();
    for _ in 0..50 {
        all = scrape(&base).await;
        if all.get("agent_request_messages_total{fate=\"dead_lettered\"}") == Some(&1.0) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        sample(&all, "agent_dialogs_started_total{pattern=\"react\"}"),
        3.0
    );
    assert_eq!(
        sample(
            &all,
            "agent_dialogs_finished_total{pattern=\"react\",outcome=\"answer\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(
            &all,
            "agent_dialogs_finished_total{pattern=\"react\",outcome=\"error\"}"
        ),
        1.0
    );
    assert_eq!(
        sample(&all, "agent_iterations_total{pattern=\"router\"}"),
        3.0
    );
    // Three iterations per answered dialog, one for the failed one.
    let react = sample(&all, "agent_iterations_total{pattern=\"react\"}");
    assert_eq!(react, 7.0);
    assert_eq!(
        sample(
            &all,
            "agent_iteration_duration_seconds_count{pattern=\"react\"}"
        ),
        react
    );
    assert_eq!(
        sample(
            &all,
            "agent_iteration_duration_seconds_bucket{pattern=\"react\",le=\"+Inf\"}"
        ),
        react
    );
    assert_eq!(
        sample(&all, "agent_tool_calls_total{tool=\"llm\",outcome=\"ok\"}"),
        4.0
    );
    assert_eq!(
        sample(&all, "agent_tool_call_duration_seconds_count{tool=\"llm\"}"),
        4.0
    );
    // Routing (2 per dialog), the ReACT turns and the tools' own calls, all answered but one.
    assert_eq!(
        sum(&all, "agent_llm_call_duration_seconds_count", "model="),
        6.0 + 7.0 - 1.0 + 4.0
    );
    assert_eq!(sum(&all, "agent_llm_call_errors_total", "model="), 1.0);
    assert!(sum(&all, "agent_llm_tokens_total", "direction=\"in\"") > 0.0);
    assert!(sum(&all, "agent_llm_tokens_total", "direction=\"out\"") > 0.0);
    assert_eq!(
        sample(&all, "agent_request_messages_total{fate=\"dead_lettered\"}"),
        1.0
    );
    assert!(sample(&all, "agent_request_messages_total{fate=\"acked\"}") >= 10.0);
}
