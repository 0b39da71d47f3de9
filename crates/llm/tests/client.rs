//! The LLM client against the scripted OpenAI-compatible server: streaming, usage, and every fault
//! the server can inject.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_llm::{ChatMessage, LlmClient, LlmConfig, LlmError};
use scripted_llm::{Script, ScriptedLlm};
use tokio::sync::mpsc;

async fn server(script: &str) -> ScriptedLlm {
    ScriptedLlm::start(
        Script::from_json(script).unwrap(),
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap()
}

fn client(server: &ScriptedLlm) -> LlmClient {
    LlmClient::new(LlmConfig {
        base_url: server.base_url(),
        model: "test-model".into(),
        max_retries: 3,
        initial_backoff: Duration::from_millis(10),
        idle_timeout: Duration::from_millis(500),
        ..LlmConfig::default()
    })
    .unwrap()
}

fn ask(q: &str) -> Vec<ChatMessage> {
    vec![ChatMessage::system("sys"), ChatMessage::user(q)]
}

async fn stream(
    client: &LlmClient,
    q: &str,
) -> (Result<agent_llm::Completion, LlmError>, Vec<String>) {
    let (tx, mut rx) = mpsc::channel(1024);
    let result = client.stream(&ask(q), tx).await;
    let mut deltas = Vec::new();
    while let Ok(d) = rx.try_recv() {
        deltas.push(d);
    }
    (result, deltas)
}

#[tokio::test]
async fn whole_answer_carries_usage_and_model() {
    let s = server(r#"{"rules": [{"match": "hello", "reply": "Final Answer: hi"}]}"#).await;
    let c = client(&s).complete(&ask("hello there")).await.unwrap();
    assert_eq!(c.text, "Final Answer: hi");
    assert_eq!(c.model, "test-model");
    assert!(c.in_token > 0 && c.out_token > 0);
    assert_eq!(c.retries, 0);
    assert!(!c.cut_off);
}

#[tokio::test]
async fn an_answer_stopped_at_the_length_limit_is_marked_cut_off() {
    let s = server(r#"{"rules": [{"match": "", "reply": "Final Answer: a long answer", "faults": ["truncate"]}]}"#).await;
    let c = client(&s).complete(&ask("q")).await.unwrap();
    assert!(c.cut_off, "{c:?}");
    assert!(c.text.len() < "Final Answer: a long answer".len());
    assert_eq!(
        s.calls().len(),
        1,
        "a cut-off answer is the model's, not a failure to retry"
    );
}

#[tokio::test]
async fn streamed_answer_arrives_in_chunks() {
    let s = server(r#"{"rules": [{"match": "", "reply": "Thought: a long enough thought\nFinal Answer: yes", "chunk_size": 5}]}"#).await;
    let (result, deltas) = stream(&client(&s), "q").await;
    let c = result.unwrap();
    assert!(deltas.len() > 5);
    assert_eq!(deltas.concat(), c.text);
    assert!(c.in_token > 0);
}

#[tokio::test]
async fn retries_429_and_500_then_succeeds() {
    let s = server(r#"{"rules": [{"match": "", "reply": "ok", "faults": ["429", "500", "503"], "retry_after": 0}]}"#).await;
    let c = client(&s).complete(&ask("q")).await.unwrap();
    assert_eq!(c.text, "ok");
    assert_eq!(c.retries, 3);
    assert_eq!(s.calls().len(), 4);
}

#[tokio::test]
async fn honours_retry_after() {
    let s =
        server(r#"{"rules": [{"match": "", "reply": "ok", "faults": ["429"], "retry_after": 1}]}"#)
            .await;
    let started = std::time::Instant::now();
    client(&s).complete(&ask("q")).await.unwrap();
    assert!(started.elapsed() >= Duration::from_millis(950));
}

#[tokio::test]
async fn stall_times_out_and_is_retried() {
    let s = server(
        r#"{"rules": [{"match": "", "reply": "ok", "faults": ["stall"], "stall_ms": 3000}]}"#,
    )
    .await;
    let (result, _) = stream(&client(&s), "q").await;
    assert_eq!(result.unwrap().retries, 1);
}

#[tokio::test]
async fn malformed_answers_are_retried() {
    let s = server(
        r#"{"rules": [{"match": "", "reply": "ok", "faults": ["malformed", "malformed"]}]}"#,
    )
    .await;
    let c = client(&s).complete(&ask("q")).await.unwrap();
    assert_eq!((c.text.as_str(), c.retries), ("ok", 2));
    let (result, _) = stream(&client(&s), "q").await;
    assert_eq!(result.unwrap().text, "ok");
}

#[tokio::test]
async fn truncated_stream_after_text_is_not_retried() {
    let s = server(r#"{"rules": [{"match": "", "reply": "0123456789abcdefghij", "chunk_size": 2, "faults": ["truncate"]}]}"#).await;
    let (result, deltas) = stream(&client(&s), "q").await;
    assert!(matches!(result, Err(LlmError::Truncated(_))), "{result:?}");
    assert!(!deltas.is_empty());
    assert_eq!(s.calls().len(), 1);
}

#[tokio::test]
async fn client_errors_are_not_retried_and_persistent_faults_exhaust() {
    let s = server(r#"{"rules": [{"match": "known", "reply": "x", "faults": ["500","500","500","500","500"]}]}"#).await;
    let c = client(&s);
    let err = c.complete(&ask("something else")).await.unwrap_err();
    assert!(
        matches!(err, LlmError::Status { status: 400, .. }),
        "{err:?}"
    );
    let err = c.complete(&ask("known")).await.unwrap_err();
    assert!(
        matches!(err, LlmError::Exhausted { attempts: 4, .. }),
        "{err:?}"
    );
}

#[tokio::test]
async fn concurrent_calls_are_bounded() {
    let s = server(r#"{"rules": [{"match": "", "reply": "ok", "delay_ms": 150}]}"#).await;
    let c = LlmClient::new(LlmConfig {
        base_url: s.base_url(),
        max_concurrency: 2,
        ..LlmConfig::default()
    })
    .unwrap();
    let calls = (0..6).map(|_| {
        let c = c.clone();
        async move { c.complete(&ask("q")).await }
    });
    for result in futures::future::join_all(calls).await {
        result.unwrap();
    }
    assert_eq!(s.calls().len(), 6);
    assert!(
        s.max_concurrent() <= 2,
        "{} calls ran at once",
        s.max_concurrent()
    );
}
