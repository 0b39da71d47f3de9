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

/// What a raw server does with each request it takes: it writes to the connection itself, so a
/// test can answer what the scripted server never would (headers late, lines without end).
type Respond = fn(tokio::net::TcpStream) -> futures::future::BoxFuture<'static, ()>;

/// A server on a free loopback port answering every request with `respond`; the count of the
/// requests it took.
async fn raw_server(respond: Respond) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = requests.clone();
    tokio::spawn(async move {
        while let Ok((mut connection, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                // The request's head and body (its length from the head), then the answer.
                let mut request = Vec::new();
                let mut buffer = [0u8; 8192];
                loop {
                    let n = connection.read(&mut buffer).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buffer[..n]);
                    let text = String::from_utf8_lossy(&request).to_lowercase();
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|l| l.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if request.len() >= head_end + 4 + length {
                            break;
                        }
                    }
                }
                respond(connection).await;
            });
        }
    });
    (url, requests)
}

fn raw_client(url: &str, request_timeout: Duration) -> LlmClient {
    LlmClient::new(LlmConfig {
        base_url: url.to_owned(),
        model: "test-model".into(),
        max_retries: 3,
        initial_backoff: Duration::from_millis(10),
        idle_timeout: Duration::from_millis(500),
        request_timeout,
        ..LlmConfig::default()
    })
    .unwrap()
}

async fn write_answer(mut connection: tokio::net::TcpStream, content_type: &str, body: &[u8]) {
    use tokio::io::AsyncWriteExt;
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let _ = connection.write_all(head.as_bytes()).await;
    let _ = connection.write_all(body).await;
    let _ = connection.shutdown().await;
}

#[tokio::test]
async fn a_refusal_is_asked_once_and_is_not_an_outage() {
    let (url, requests) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"refusal":"I cannot help with that"},"finish_reason":"content_filter"}]}"#,
        ))
    })
    .await;
    let err = raw_client(&url, Duration::from_secs(30))
        .complete(&ask("q"))
        .await
        .unwrap_err();
    assert!(matches!(err, LlmError::NoContent(_)), "{err:?}");
    assert!(err.to_string().contains("content_filter") && err.to_string().contains("cannot help"));
    assert!(
        !err.is_outage(),
        "a refusal is the model's answer, not an outage"
    );
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_whole_answer_slower_than_the_idle_limit_is_waited_for() {
    // A local model writing a long answer sends the headers only once it is done.
    let (url, requests) = raw_server(|connection| {
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            write_answer(
                connection,
                "application/json",
                br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Final Answer: slow but sure"},"finish_reason":"stop"}]}"#,
            )
            .await;
        })
    })
    .await;
    let client = raw_client(&url, Duration::from_secs(30));
    let completion = client.complete(&ask("q")).await.unwrap();
    assert_eq!(completion.text, "Final Answer: slow but sure");
    assert_eq!(completion.retries, 0);
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The call's own limit still holds it.
    let err = raw_client(&url, Duration::from_millis(700))
        .complete(&ask("q"))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, LlmError::Exhausted { last, .. } if matches!(**last, LlmError::Timeout(_))),
        "{err:?}"
    );
}

#[tokio::test]
async fn a_stream_line_without_end_is_stopped_not_held() {
    let (url, requests) = raw_server(|mut connection| {
        Box::pin(async move {
            use tokio::io::AsyncWriteExt;
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\ndata: ";
            if connection.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let endless = vec![b'x'; 64 * 1024];
            while connection.write_all(&endless).await.is_ok() {}
        })
    })
    .await;
    let (result, deltas) = stream(&raw_client(&url, Duration::from_secs(60)), "q").await;
    assert!(matches!(result, Err(LlmError::TooLong(_))), "{result:?}");
    assert!(deltas.is_empty());
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_whole_answer_too_long_is_refused_unread() {
    let (url, requests) = raw_server(|connection| {
        Box::pin(async move {
            let mut body = br#"{"choices":[{"message":{"content":""#.to_vec();
            body.resize(body.len() + agent_llm::MAX_ANSWER_BYTES + 1, b'y');
            body.extend_from_slice(br#""}}]}"#);
            write_answer(connection, "application/json", &body).await;
        })
    })
    .await;
    let err = raw_client(&url, Duration::from_secs(60))
        .complete(&ask("q"))
        .await
        .unwrap_err();
    assert!(matches!(err, LlmError::TooLong(_)), "{err:?}");
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_stream_of_many_lines_in_few_chunks_is_read_whole() {
    // Blank lines and comments between events, split anywhere by the network: the text is
    // gathered in order, each line read once.
    let (url, _) = raw_server(|connection| {
        Box::pin(async move {
            let mut body = Vec::new();
            // Fewer events than the test's channel holds (it is read after the call).
            for n in 0..500 {
                body.extend_from_slice(&b"\n".repeat(40));
                body.extend_from_slice(b": keep-alive\n");
                let event = serde_json::json!({"choices": [{"delta": {"content": format!("{n},")}}]});
                body.extend_from_slice(format!("data: {event}\n").as_bytes());
            }
            body.extend_from_slice(b"data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
            write_answer(connection, "text/event-stream", &body).await;
        })
    })
    .await;
    let (result, deltas) = stream(&raw_client(&url, Duration::from_secs(60)), "q").await;
    let completion = result.unwrap();
    let expected: String = (0..500).map(|n| format!("{n},")).collect();
    assert_eq!(completion.text, expected);
    assert_eq!(deltas.concat(), expected);
}

/// A question long enough that its estimate cannot be mistaken for a count of nothing.
fn long_question() -> String {
    "how much is the invoice in the attached statement? ".repeat(80)
}

/// `c`'s input tokens are the estimate of a prompt asking `question`: about four bytes a token,
/// from the JSON sent, so at least the question's own share.
fn assert_prompt_estimated(c: &agent_llm::Completion, question: &str) {
    let least = (question.len() as u64) / 4;
    assert!(
        c.in_token >= least && c.in_token < least + 50,
        "{} tokens for a prompt of {} bytes",
        c.in_token,
        question.len()
    );
}

#[tokio::test]
async fn a_whole_answer_without_usage_counts_an_estimate_of_its_prompt() {
    let (url, _) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Final Answer: 12"},"finish_reason":"stop"}]}"#,
        ))
    })
    .await;
    let question = long_question();
    let c = raw_client(&url, Duration::from_secs(30))
        .complete(&ask(&question))
        .await
        .unwrap();
    assert_prompt_estimated(&c, &question);
    assert_eq!(c.out_token, ("Final Answer: 12".len() as u64).div_ceil(4));
}

#[tokio::test]
async fn a_stream_without_usage_counts_an_estimate_of_its_prompt() {
    let (url, _) = raw_server(|connection| {
        Box::pin(async move {
            let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"Final Answer: 12\"}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
            write_answer(connection, "text/event-stream", body).await;
        })
    })
    .await;
    let question = long_question();
    let (result, _) = stream(&raw_client(&url, Duration::from_secs(30)), &question).await;
    let c = result.unwrap();
    assert_prompt_estimated(&c, &question);
    assert_eq!(c.text, "Final Answer: 12");
}

#[tokio::test]
async fn usage_the_server_reports_is_taken_as_it_is() {
    let (url, _) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"model":"m","usage":{"prompt_tokens":7,"completion_tokens":3},"choices":[{"index":0,"message":{"role":"assistant","content":"Final Answer: 12"},"finish_reason":"stop"}]}"#,
        ))
    })
    .await;
    let c = raw_client(&url, Duration::from_secs(30))
        .complete(&ask(&long_question()))
        .await
        .unwrap();
    assert_eq!((c.in_token, c.out_token), (7, 3));
}

#[tokio::test]
async fn a_client_error_reported_in_a_stream_is_asked_once_and_is_not_an_outage() {
    // vLLM's way: the headers said 200, then the stream's one event is the error.
    let (url, requests) = raw_server(|connection| {
        Box::pin(async move {
            let body = b"data: {\"error\":{\"object\":\"error\",\"message\":\"This model's maximum context length is 2048 tokens\",\"type\":\"BadRequestError\",\"param\":null,\"code\":400}}\n\n";
            write_answer(connection, "text/event-stream", body).await;
        })
    })
    .await;
    let (result, deltas) = stream(&raw_client(&url, Duration::from_secs(30)), "q").await;
    let err = result.unwrap_err();
    assert!(
        matches!(err, LlmError::Status { status: 400, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("maximum context length"), "{err}");
    assert!(!err.is_outage());
    assert!(deltas.is_empty());
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_whole_answer_that_is_a_client_error_is_asked_once() {
    // llama.cpp's way, a type and a code given as text.
    let (url, requests) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"error":{"code":"400","message":"the request exceeds the available context size","type":"invalid_request_error"}}"#,
        ))
    })
    .await;
    let err = raw_client(&url, Duration::from_secs(30))
        .complete(&ask("q"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, LlmError::Status { status: 400, .. }),
        "{err:?}"
    );
    assert!(!err.is_outage());
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_server_error_reported_in_a_stream_is_still_retried() {
    let (url, requests) = raw_server(|connection| {
        Box::pin(async move {
            let body =
                b"data: {\"error\":{\"message\":\"the engine is overloaded\",\"code\":503}}\n\n";
            write_answer(connection, "text/event-stream", body).await;
        })
    })
    .await;
    let (result, _) = stream(&raw_client(&url, Duration::from_secs(30)), "q").await;
    let err = result.unwrap_err();
    assert!(err.is_outage(), "{err:?}");
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 4);
}

/// One line of many deltas, each only a new call's index; made once.
fn empty_tool_calls() -> &'static [u8] {
    static BODY: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    BODY.get_or_init(|| {
        let deltas: Vec<_> = (0..100_000)
            .map(|index| serde_json::json!({ "index": index }))
            .collect();
        let event = serde_json::json!({"choices": [{"delta": {"tool_calls": deltas}}]});
        format!("data: {event}\n\ndata: [DONE]\n\n").into_bytes()
    })
}

#[tokio::test]
async fn a_stream_of_empty_tool_calls_without_end_is_refused() {
    // Made before any request: made for each, in a debug build under the suite's load, it took
    // longer than the client's idle timeout (500 ms) to start the answer, and the client asked
    // again.
    empty_tool_calls();
    let (url, requests) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "text/event-stream",
            empty_tool_calls(),
        ))
    })
    .await;
    let (result, _) = stream(&raw_client(&url, Duration::from_secs(30)), "q").await;
    let err = match result {
        Ok(taken) => panic!("{} tool calls were taken", taken.tool_calls.len()),
        Err(err) => err,
    };
    assert!(matches!(err, LlmError::TooLong(_)), "{err:?}");
    assert!(err.to_string().contains("tool calls"), "{err}");
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// An answer the provider's content filter stopped part way (`finish_reason: content_filter`,
/// as Azure OpenAI sends) is no answer: its part was taken as whole, so half a final answer
/// could be given as the answer. Whole and streamed, it is an error that says why, asked once.
#[tokio::test]
async fn an_answer_a_content_filter_stopped_is_not_taken_as_whole() {
    let (url, requests) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Final Answer: The sec"},"finish_reason":"content_filter"}]}"#,
        ))
    })
    .await;
    let err = raw_client(&url, Duration::from_secs(30))
        .complete(&ask("q"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("content_filter"), "{err:?}");
    assert!(!err.is_outage(), "{err:?}");
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);

    let (url, requests) = raw_server(|connection| {
        Box::pin(async move {
            let body = b"data: {\"choices\":[{\"delta\":{\"content\":\"Final Answer: The sec\"}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"content_filter\"}]}\n\ndata: [DONE]\n\n";
            write_answer(connection, "text/event-stream", body).await;
        })
    })
    .await;
    let (result, _) = stream(&raw_client(&url, Duration::from_secs(30)), "q").await;
    let err = result.unwrap_err();
    assert!(err.to_string().contains("content_filter"), "{err:?}");
    assert!(!err.is_outage(), "{err:?}");
    assert_eq!(requests.load(std::sync::atomic::Ordering::SeqCst), 1);
}

/// A call without an index after one at the largest index has no place: its index overflowed
/// (a panic in debug builds; in release it took the place of the first call). It is refused.
#[tokio::test]
async fn a_tool_call_with_no_place_after_the_largest_index_is_refused() {
    let (url, _) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"index":18446744073709551615,"id":"a","type":"function","function":{"name":"one","arguments":"{}"}},{"id":"b","type":"function","function":{"name":"two","arguments":"{}"}}]},"finish_reason":"tool_calls"}]}"#,
        ))
    })
    .await;
    let err = raw_client(&url, Duration::from_secs(30))
        .complete(&ask("q"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("largest index"), "{err:?}");
}

/// Text sent as a list of content parts (`[{"type": "text", "text": ...}]`) is the answer, its
/// text parts joined and its other parts (a reasoning trace) left out, whole and streamed.
/// Streamed, it was taken for no text: the answer came back empty without a word.
#[tokio::test]
async fn text_sent_as_content_parts_is_the_answer() {
    let (url, _) = raw_server(|connection| {
        Box::pin(write_answer(
            connection,
            "application/json",
            br#"{"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":[{"type":"thinking","thinking":"hmm"},{"type":"text","text":"Final Answer: "},{"type":"text","text":"42"}]},"finish_reason":"stop"}]}"#,
        ))
    })
    .await;
    let c = raw_client(&url, Duration::from_secs(30))
        .complete(&ask("q"))
        .await
        .unwrap();
    assert_eq!(c.text, "Final Answer: 42");

    let (url, _) = raw_server(|connection| {
        Box::pin(async move {
            let body = b"data: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"thinking\",\"thinking\":\"hmm\"}]}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"text\",\"text\":\"Final Answer: \"}]}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":[{\"type\":\"text\",\"text\":\"42\"}]}}]}\n\ndata: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";
            write_answer(connection, "text/event-stream", body).await;
        })
    })
    .await;
    let (result, deltas) = stream(&raw_client(&url, Duration::from_secs(30)), "q").await;
    assert_eq!(result.unwrap().text, "Final Answer: 42");
    assert_eq!(deltas.concat(), "Final Answer: 42");
}
