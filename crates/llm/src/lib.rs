//! Client for OpenAI-compatible `/v1/chat/completions` endpoints: whole or streamed (SSE) answers,
//! retries with exponential backoff and jitter on 429, 5xx and timeouts (honouring `Retry-After`), a
//! bound on concurrent calls, and token usage carried back to the caller.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, Semaphore};

pub mod tape;
use tape::{Tape, TapedCall};

/// A secret that never shows in logs or debug output.
#[derive(Clone, Default)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Secret {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Where and how to call the LLM.
#[derive(Debug, Clone)]
pub struct LlmConfig {
    /// e.g. `http://127.0.0.1:8080/v1`; `/chat/completions` is appended.
    pub base_url: String,
    pub api_key: Option<Secret>,
    pub model: String,
    pub temperature: Option<f32>,
    /// The most tokens one answer may have (`max_tokens`); none sends none.
    pub max_output_tokens: Option<u64>,
    /// Calls in flight at once across the process.
    pub max_concurrency: usize,
    /// Attempts after the first one.
    pub max_retries: u32,
    pub initial_backoff: Duration,
    pub max_backoff: Duration,
    /// Longest wait for a streamed answer's headers, and between two of its chunks.
    pub idle_timeout: Duration,
    /// Longest a whole call may take. A whole (not streamed) answer has only this: its server
    /// sends the headers once the model has written the last token, which a local model may take
    /// minutes to do.
    pub request_timeout: Duration,
}

impl Default for LlmConfig {
    fn default() -> Self {
        LlmConfig {
            base_url: "http://127.0.0.1:8080/v1".to_owned(),
            api_key: None,
            model: "default".to_owned(),
            temperature: None,
            max_output_tokens: None,
            max_concurrency: 16,
            max_retries: 4,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(20),
            idle_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(300),
        }
    }
}

/// One chat message. An assistant message may carry the tool calls it made, and a `tool` message
/// answers one of them by its id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    fn new(role: &str, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.to_owned(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    pub fn system(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("user", content)
    }
    /// What the LLM said earlier in the conversation, for a follow-up question about it.
    pub fn assistant(content: impl Into<String>) -> ChatMessage {
        ChatMessage::new("assistant", content)
    }
    /// An earlier assistant turn that called a tool (native tool calling).
    pub fn assistant_call(content: impl Into<String>, call: ToolCall) -> ChatMessage {
        ChatMessage {
            tool_calls: vec![call],
            ..ChatMessage::new("assistant", content)
        }
    }
    /// A tool's result, answering the call with id `call_id`.
    pub fn tool_result(call_id: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            tool_call_id: Some(call_id.into()),
            ..ChatMessage::new("tool", content)
        }
    }
}

/// A tool call in OpenAI's shape: `{"id", "type": "function", "function": {"name", "arguments"}}`,
/// `arguments` being JSON text as the model wrote it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default)]
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_type() -> String {
    "function".to_owned()
}

/// The function a [`ToolCall`] names, and its arguments as JSON text.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

impl ToolCall {
    pub fn function(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> ToolCall {
        ToolCall {
            id: id.into(),
            kind: function_type(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

/// A tool offered to the model for native tool calling; `parameters` is a JSON Schema object.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    pub parameters: Value,
}

/// What one call asks of the server besides the messages.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CallOptions {
    /// Sequences at which the server stops writing (`stop`); servers honour at most four.
    pub stop: Vec<String>,
    /// Tools the model may call (`tools`, `tool_choice: "auto"`).
    pub tools: Vec<ToolSpec>,
    /// Ask for a JSON object (`response_format: {"type": "json_object"}`).
    pub json_object: bool,
}

/// A failure a server reported in what it sent with status 200: an error event in a stream
/// (vLLM, llama.cpp), or a whole answer that is `{"error": ...}`. One that names a client
/// error (its `code` or `status` a 4xx other than 408 and 429, or the `invalid_request_error`
/// type: a prompt over the context, a parameter the model refuses) is that status: asking again
/// gives the same, so it is neither retried nor an outage. Before 2026-12-05 every such report
/// was taken as a malformed answer, asked five times, then parked as an outage of the LLM and
/// asked again until `max_outage_secs` ran out. Anything else stays malformed and retried.
fn reported_error(error: &Value) -> LlmError {
    let number = |v: &Value| {
        v.as_u64()
            .or_else(|| v.as_str().and_then(|s| s.trim().parse::<u64>().ok()))
    };
    let kind = error["type"].as_str().unwrap_or_default();
    let status = number(&error["code"])
        .or_else(|| number(&error["status"]))
        .or_else(|| matches!(kind, "invalid_request_error" | "BadRequestError").then_some(400));
    match status.and_then(|s| u16::try_from(s).ok()) {
        Some(status @ 400..=499) if status != 408 && status != 429 => LlmError::Status {
            status,
            retry_after: None,
            body: preview(&error.to_string()),
        },
        _ => LlmError::Malformed(format!("error event: {}", preview(&error.to_string()))),
    }
}

/// About how many tokens a prompt takes (its messages and the tools offered), for a call whose
/// server reported none: four bytes a token, as for an answer's text. Counted from the JSON the
/// server is sent, so it errs high, which is the safe side for a budget.
pub fn estimated_prompt_tokens(messages: &[ChatMessage], options: &CallOptions) -> u64 {
    let messages = serde_json::to_vec(messages).map_or(0, |m| m.len());
    let tools: usize = options
        .tools
        .iter()
        .map(|t| t.name.len() + t.description.len() + t.parameters.to_string().len())
        .sum();
    (messages.saturating_add(tools) as u64).div_ceil(4)
}

/// A finished completion.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Completion {
    pub text: String,
    pub in_token: u64,
    pub out_token: u64,
    pub model: String,
    /// Wall time of the successful attempt plus the retries before it.
    pub duration: Duration,
    /// Attempts that failed before this one succeeded.
    pub retries: u32,
    /// The text is incomplete: the model stopped at its length limit (`finish_reason: length`), or
    /// the caller kept what a broken stream had passed on.
    pub cut_off: bool,
    /// The tools the model called (native tool calling), in the order it wrote them.
    pub tool_calls: Vec<ToolCall>,
}

/// Why a call failed. `retryable()` decides between another attempt and giving up.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum LlmError {
    #[error("the LLM answered HTTP {status}: {body}")]
    Status {
        status: u16,
        retry_after: Option<Duration>,
        body: String,
    },
    #[error("the LLM did not answer within {0:?}")]
    Timeout(Duration),
    #[error("cannot reach the LLM: {0}")]
    Transport(String),
    #[error("the LLM's answer is malformed: {0}")]
    Malformed(String),
    /// A well-formed answer without text (tool calls, a content filter): asking again gives the same.
    #[error("the LLM's answer has no text: {0}")]
    NoContent(String),
    /// The stream broke after some text had been passed on; retrying would repeat it.
    #[error("the LLM's stream ended early: {0}")]
    Truncated(String),
    /// An answer (or one line of a stream) longer than this client takes
    /// ([`MAX_ANSWER_BYTES`], [`MAX_LINE_BYTES`]): asking again would bring as much.
    #[error("the LLM's answer is too long: {0}")]
    TooLong(String),
    #[error("giving up after {attempts} attempts: {last}")]
    Exhausted { attempts: u32, last: Box<LlmError> },
}

impl LlmError {
    pub fn retryable(&self) -> bool {
        match self {
            LlmError::Status { status, .. } => *status == 429 || *status >= 500,
            LlmError::Timeout(_) | LlmError::Transport(_) | LlmError::Malformed(_) => true,
            LlmError::Truncated(_)
            | LlmError::NoContent(_)
            | LlmError::TooLong(_)
            | LlmError::Exhausted { .. } => false,
        }
    }

    /// Whether the provider is unavailable rather than the request wrong: a retryable failure,
    /// also after the client's own retries ran out. Such a call is worth asking again later.
    ///
    /// ```
    /// use agent_llm::LlmError;
    /// let busy = LlmError::Status { status: 503, retry_after: None, body: String::new() };
    /// let exhausted = LlmError::Exhausted { attempts: 4, last: Box::new(busy) };
    /// assert!(exhausted.is_outage());
    /// assert!(!LlmError::NoContent("filtered".into()).is_outage());
    /// ```
    pub fn is_outage(&self) -> bool {
        match self {
            LlmError::Exhausted { last, .. } => last.is_outage(),
            other => other.retryable(),
        }
    }

    /// How long the provider asked callers to wait (`Retry-After`), if it did.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LlmError::Status { retry_after, .. } => *retry_after,
            LlmError::Exhausted { last, .. } => last.retry_after(),
            _ => None,
        }
    }
}

/// The client. Cloning shares the connection pool and the concurrency bound.
#[derive(Debug, Clone)]
pub struct LlmClient {
    http: reqwest::Client,
    config: Arc<LlmConfig>,
    permits: Arc<Semaphore>,
    /// Where this handle records its calls, and answers it may give again (see [`tape`]).
    tape: Option<Arc<Tape>>,
}

impl LlmClient {
    pub fn new(config: LlmConfig) -> Result<LlmClient, LlmError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| LlmError::Transport(e.to_string()))?;
        let permits = Arc::new(Semaphore::new(config.max_concurrency.max(1)));
        Ok(LlmClient {
            http,
            config: Arc::new(config),
            permits,
            tape: None,
        })
    }

    pub fn model(&self) -> &str {
        &self.config.model
    }

    /// A handle on the same connections and bound whose calls ask for `model` (an
    /// OpenAI-compatible endpoint serves several by name).
    pub fn for_model(&self, model: &str) -> LlmClient {
        let mut config = (*self.config).clone();
        config.model = model.to_owned();
        LlmClient {
            config: Arc::new(config),
            ..self.clone()
        }
    }

    /// A handle on the same connections and bound whose answers are held to `most` tokens each
    /// (`max_tokens`), or to none (0: the server's own default).
    pub fn with_max_output_tokens(&self, most: u64) -> LlmClient {
        let most = (most > 0).then_some(most);
        if most == self.config.max_output_tokens {
            return self.clone();
        }
        let mut config = (*self.config).clone();
        config.max_output_tokens = most;
        LlmClient {
            config: Arc::new(config),
            ..self.clone()
        }
    }

    /// A handle on the same connections and bound whose calls go on `tape`: each one recorded,
    /// and one asking what the tape has an answer for given that answer without a call.
    pub fn taped(&self, tape: Arc<Tape>) -> LlmClient {
        LlmClient {
            tape: Some(tape),
            ..self.clone()
        }
    }

    /// A whole answer.
    pub async fn complete(&self, messages: &[ChatMessage]) -> Result<Completion, LlmError> {
        self.with_retries(messages, &CallOptions::default(), None)
            .await
    }

    /// A whole answer, with stop sequences, tools or JSON mode.
    pub async fn complete_with(
        &self,
        messages: &[ChatMessage],
        options: &CallOptions,
    ) -> Result<Completion, LlmError> {
        self.with_retries(messages, options, None).await
    }

    /// A streamed answer: each text delta goes to `deltas` as it arrives; the whole text is returned.
    /// An attempt that fails before any delta was passed on is retried; one that fails after is not,
    /// because the receiver already has part of it.
    pub async fn stream(
        &self,
        messages: &[ChatMessage],
        deltas: mpsc::Sender<String>,
    ) -> Result<Completion, LlmError> {
        self.with_retries(messages, &CallOptions::default(), Some(deltas))
            .await
    }

    /// A streamed answer with stop sequences, tools or JSON mode. Tool calls are not passed on as
    /// deltas: they are gathered and returned whole in [`Completion::tool_calls`].
    pub async fn stream_with(
        &self,
        messages: &[ChatMessage],
        options: &CallOptions,
        deltas: mpsc::Sender<String>,
    ) -> Result<Completion, LlmError> {
        self.with_retries(messages, options, Some(deltas)).await
    }

    async fn with_retries(
        &self,
        messages: &[ChatMessage],
        options: &CallOptions,
        deltas: Option<mpsc::Sender<String>>,
    ) -> Result<Completion, LlmError> {
        let Some(tape) = &self.tape else {
            let result = self.retrying(messages, options, deltas).await;
            record_call(&self.config.model, &result);
            return result;
        };
        let digest = tape::call_digest(
            &self.config.model,
            messages,
            options,
            self.config.max_output_tokens,
        );
        let (repeat, answer) = tape.ask(&digest);
        if let Some((source, recorded)) = answer {
            let completion = recorded.completion();
            if let (Some(deltas), false) = (&deltas, completion.text.is_empty()) {
                // A receiver gone is the caller's business, as for a live stream.
                let _ = deltas.send(completion.text.clone()).await;
            }
            tape.push(TapedCall {
                digest,
                repeat,
                recorded,
                reused_from: Some(source),
            });
            return Ok(completion);
        }
        let result = self.retrying(messages, options, deltas).await;
        record_call(&self.config.model, &result);
        if let Ok(completion) = &result {
            tape.push(TapedCall {
                digest,
                repeat,
                recorded: tape::Recorded::of(completion),
                reused_from: None,
            });
        }
        result
    }

    async fn retrying(
        &self,
        messages: &[ChatMessage],
        options: &CallOptions,
        deltas: Option<mpsc::Sender<String>>,
    ) -> Result<Completion, LlmError> {
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            let result = {
                // Bound the calls in flight; the permit is released during backoff.
                let _permit = self
                    .permits
                    .acquire()
                    .await
                    .map_err(|e| LlmError::Transport(e.to_string()))?;
                let call = self.attempt(messages, options, deltas.as_ref());
                // A streamed call enforces the whole-call limit itself, so that a timeout after text
                // was passed on is not retried (the receiver would get the text twice).
                if deltas.is_some() {
                    call.await
                } else {
                    match tokio::time::timeout(self.config.request_timeout, call).await {
                        Ok(r) => r,
                        Err(_) => Err(LlmError::Timeout(self.config.request_timeout)),
                    }
                }
            };
            match result {
                Ok(mut completion) => {
                    completion.duration = started.elapsed();
                    completion.retries = attempt;
                    return Ok(completion);
                }
                Err(e) if e.retryable() && attempt < self.config.max_retries => {
                    let wait = self.backoff(attempt, &e);
                    tracing::warn!(error = %e, attempt, wait_ms = wait.as_millis() as u64, "LLM call failed; retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(e) if e.retryable() => {
                    return Err(LlmError::Exhausted {
                        attempts: attempt + 1,
                        last: Box::new(e),
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Exponential backoff with full jitter, or the server's `Retry-After` when it gave one.
    fn backoff(&self, attempt: u32, error: &LlmError) -> Duration {
        if let LlmError::Status {
            retry_after: Some(after),
            ..
        } = error
        {
            return when_asked(*after, self.config.max_backoff);
        }
        let ceiling = self
            .config
            .initial_backoff
            .saturating_mul(1u32 << attempt.min(16))
            .min(self.config.max_backoff);
        let millis = ceiling.as_millis().max(1) as u64;
        Duration::from_millis(rand::thread_rng().gen_range(millis / 2..=millis))
    }

    async fn attempt(
        &self,
        messages: &[ChatMessage],
        options: &CallOptions,
        deltas: Option<&mpsc::Sender<String>>,
    ) -> Result<Completion, LlmError> {
        let url = format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        );
        let mut body = json!({
            "model": self.config.model,
            "messages": messages,
            "stream": deltas.is_some(),
        });
        if deltas.is_some() {
            body["stream_options"] = json!({"include_usage": true});
        }
        if let Some(t) = self.config.temperature {
            body["temperature"] = json!(t);
        }
        if let Some(most) = self.config.max_output_tokens {
            body["max_tokens"] = json!(most);
        }
        if !options.stop.is_empty() {
            body["stop"] = json!(options.stop);
        }
        if !options.tools.is_empty() {
            let tools: Vec<Value> = options
                .tools
                .iter()
                .map(|t| {
                    json!({"type": "function", "function": {
                        "name": t.name, "description": t.description, "parameters": t.parameters,
                    }})
                })
                .collect();
            body["tools"] = json!(tools);
            body["tool_choice"] = json!("auto");
        }
        if options.json_object {
            body["response_format"] = json!({"type": "json_object"});
        }
        let mut request = self.http.post(&url).json(&body);
        if let Some(key) = &self.config.api_key {
            request = request.bearer_auth(key.expose());
        }
        let idle = self.config.idle_timeout;
        // A whole answer's headers come after its last token: only the call's own limit
        // (`request_timeout`, in `retrying`) holds it. Before, a local model that wrote for more
        // than `idle_timeout` was timed out and asked again, each time, for ever.
        let headers_within = match deltas {
            Some(_) => idle,
            None => self.config.request_timeout,
        };
        let response = tokio::time::timeout(headers_within, request.send())
            .await
            .map_err(|_| LlmError::Timeout(headers_within))?
            .map_err(|e| LlmError::Transport(e.to_string()))?;
        let status = response.status();
        if !status.is_success() {
            let retry_after = response
                .headers()
                .get(reqwest::header::RETRY_AFTER)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<u64>().ok())
                .map(Duration::from_secs);
            // Only the start of an error's body is kept: the rest is not read.
            let text = tokio::time::timeout(idle, read_body(response, ERROR_BODY_BYTES))
                .await
                .ok()
                .and_then(Result::ok)
                .map(|body| String::from_utf8_lossy(&body).into_owned())
                .unwrap_or_default();
            return Err(LlmError::Status {
                status: status.as_u16(),
                retry_after,
                body: text.chars().take(500).collect(),
            });
        }
        match deltas {
            None => {
                let body = read_body(response, MAX_ANSWER_BYTES).await?;
                if body.len() > MAX_ANSWER_BYTES {
                    return Err(LlmError::TooLong(format!(
                        "an answer of more than {MAX_ANSWER_BYTES} bytes"
                    )));
                }
                let text = String::from_utf8_lossy(&body);
                let value: Value = serde_json::from_str(&text)
                    .map_err(|e| LlmError::Malformed(format!("{e}: {}", preview(&text))))?;
                if !value["error"].is_null() && value["choices"].is_null() {
                    return Err(reported_error(&value["error"]));
                }
                let message = &value["choices"][0]["message"];
                // Read as leniently as a stream's deltas: servers differ (arguments as an object,
                // `null` ids).
                let mut calls = ToolCallDeltas::default();
                calls.add(&message["tool_calls"]);
                if let Some(refused) = calls.refused() {
                    return Err(refused);
                }
                let tool_calls = calls.finish();
                // With tool calls, servers send `content: null`.
                let content = match content_text(&message["content"]) {
                    Some(content) => content,
                    None if !tool_calls.is_empty() => String::new(),
                    // A well-formed answer with no text (a refusal, a content filter, a model
                    // that spent its length on reasoning) is the same when asked again: before,
                    // it was asked five times and then taken for an outage of the LLM.
                    None if value["choices"].is_array() => {
                        return Err(LlmError::NoContent(format!(
                            "finish_reason {}{}",
                            value["choices"][0]["finish_reason"],
                            match message["refusal"].as_str() {
                                Some(refusal) => format!(", refusal: {}", preview(refusal)),
                                None => String::new(),
                            }
                        )))
                    }
                    None => {
                        return Err(LlmError::Malformed(format!(
                            "no message content: {}",
                            preview(&text)
                        )))
                    }
                };
                filtered(value["choices"][0]["finish_reason"].as_str(), &content)?;
                let mut completion = self.completion(content, &value, messages, options);
                completion.tool_calls = tool_calls;
                Ok(completion)
            }
            Some(deltas) => self.read_stream(response, deltas, messages, options).await,
        }
    }

    async fn read_stream(
        &self,
        response: reqwest::Response,
        deltas: &mpsc::Sender<String>,
        messages: &[ChatMessage],
        options: &CallOptions,
    ) -> Result<Completion, LlmError> {
        let idle = self.config.idle_timeout;
        let deadline = tokio::time::Instant::now() + self.config.request_timeout;
        let mut finish_reason: Option<String> = None;
        let mut bytes = response.bytes_stream();
        let mut pending: Vec<u8> = Vec::new();
        // How far `pending` is known to hold no newline: each byte is looked at once.
        let mut scanned = 0;
        let mut text = String::new();
        let mut usage = Value::Null;
        let mut sent_any = false;
        let mut calls = ToolCallDeltas::default();
        // Before anything was passed on, a failure is an ordinary retryable one.
        let fail = |sent_any: bool, e: LlmError| {
            if sent_any {
                LlmError::Truncated(e.to_string())
            } else {
                e
            }
        };
        loop {
            let wait_until = deadline.min(tokio::time::Instant::now() + idle);
            let next = tokio::time::timeout_at(wait_until, bytes.next())
                .await
                .map_err(|_| fail(sent_any, LlmError::Timeout(idle)))?;
            let at_end = match next {
                Some(chunk) => {
                    let chunk =
                        chunk.map_err(|e| fail(sent_any, LlmError::Transport(e.to_string())))?;
                    pending.extend_from_slice(&chunk);
                    false
                }
                // A last line without its newline still counts.
                None => {
                    pending.push(b'\n');
                    true
                }
            };
            let mut line_start = 0;
            while let Some(end) = pending[scanned..].iter().position(|b| *b == b'\n') {
                let end = scanned + end;
                let line = String::from_utf8_lossy(&pending[line_start..end]).into_owned();
                line_start = end + 1;
                scanned = line_start;
                let line = line.trim();
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim();
                if data == "[DONE]" {
                    filtered(finish_reason.as_deref(), &text).map_err(|e| fail(sent_any, e))?;
                    return Ok(self.streamed(
                        text,
                        &usage,
                        &finish_reason,
                        calls,
                        messages,
                        options,
                    ));
                }
                let event: Value = serde_json::from_str(data).map_err(|e| {
                    fail(
                        sent_any,
                        LlmError::Malformed(format!("{e}: {}", preview(data))),
                    )
                })?;
                // Servers report a failure inside the stream as an error event.
                if !event["error"].is_null() {
                    return Err(fail(sent_any, reported_error(&event["error"])));
                }
                if !event["usage"].is_null() {
                    usage = event["usage"].clone();
                }
                if let Some(reason) = event["choices"][0]["finish_reason"].as_str() {
                    finish_reason = Some(reason.to_owned());
                }
                calls.add(&event["choices"][0]["delta"]["tool_calls"]);
                if let Some(refused) = calls.refused() {
                    return Err(fail(sent_any, refused));
                }
                if text.len() + calls.bytes() > MAX_ANSWER_BYTES {
                    return Err(fail(
                        sent_any,
                        LlmError::TooLong(format!(
                            "a stream of more than {MAX_ANSWER_BYTES} bytes of text and arguments"
                        )),
                    ));
                }
                if let Some(delta) = content_text(&event["choices"][0]["delta"]["content"]) {
                    if !delta.is_empty() {
                        text.push_str(&delta);
                        // Only text someone received makes a later failure unretryable; a receiver
                        // that went away (or never listened) saw nothing, so the call may be redone.
                        if deltas.send(delta).await.is_ok() {
                            sent_any = true;
                        }
                    }
                }
            }
            // The lines taken go in one move, not one each (which moved the rest every time).
            pending.drain(..line_start);
            scanned = pending.len();
            if pending.len() > MAX_LINE_BYTES {
                return Err(fail(
                    sent_any,
                    LlmError::TooLong(format!(
                        "a line of more than {MAX_LINE_BYTES} bytes in its stream"
                    )),
                ));
            }
            if at_end {
                // Some servers end a complete answer without `[DONE]`; a finish reason is enough.
                if finish_reason.is_some() {
                    filtered(finish_reason.as_deref(), &text).map_err(|e| fail(sent_any, e))?;
                    return Ok(self.streamed(
                        text,
                        &usage,
                        &finish_reason,
                        calls,
                        messages,
                        options,
                    ));
                }
                return Err(fail(
                    sent_any,
                    LlmError::Malformed("the stream ended without [DONE]".into()),
                ));
            }
        }
    }

    /// The completion a finished stream gathered: its text, what a whole answer would say besides
    /// it (`usage`, `finish_reason`), and its tool calls.
    fn streamed(
        &self,
        text: String,
        usage: &Value,
        finish_reason: &Option<String>,
        calls: ToolCallDeltas,
        messages: &[ChatMessage],
        options: &CallOptions,
    ) -> Completion {
        let summary = json!({"usage": usage, "model": self.config.model, "choices": [{"finish_reason": finish_reason}]});
        let mut completion = self.completion(text, &summary, messages, options);
        completion.tool_calls = calls.finish();
        completion
    }

    /// A completion from an answer's text and its whole body (`usage`, `model`, `finish_reason`).
    fn completion(
        &self,
        text: String,
        value: &Value,
        messages: &[ChatMessage],
        options: &CallOptions,
    ) -> Completion {
        let usage = &value["usage"];
        // Servers that report no usage (or a stream that ended before its usage event) get an
        // estimate, so budgets still count: the prompt is most of a call's tokens, and before
        // 2026-12-05 it counted as none, so `max_tokens` hardly held against such a server.
        let in_token = usage["prompt_tokens"]
            .as_u64()
            .unwrap_or_else(|| estimated_prompt_tokens(messages, options));
        let out_token = usage["completion_tokens"]
            .as_u64()
            .unwrap_or((text.len() as u64).div_ceil(4));
        Completion {
            model: value["model"]
                .as_str()
                .unwrap_or(&self.config.model)
                .to_owned(),
            text,
            in_token,
            out_token,
            duration: Duration::ZERO,
            retries: 0,
            cut_off: value["choices"][0]["finish_reason"].as_str() == Some("length"),
            tool_calls: Vec::new(),
        }
    }
}

/// A message's text: a string, or a list of content parts (`[{"type": "text", "text": ...}]`, as
/// Mistral's reasoning models and some proxies send), whose text parts are joined. Parts of other
/// types (a reasoning trace, an image) are not the answer. Before, a list was taken for no text:
/// streamed, the answer came back empty without a word.
fn content_text(content: &Value) -> Option<String> {
    match content {
        Value::String(text) => Some(text.clone()),
        // A list without text (only a reasoning trace) is no text, as `null` is.
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter(|part| matches!(part["type"].as_str(), None | Some("text")))
                .filter_map(|part| part["text"].as_str())
                .collect::<String>(),
        )
        .filter(|text| !text.is_empty()),
        _ => None,
    }
}

/// An answer the provider's content filter stopped (`finish_reason: content_filter`) is refused
/// with what came of it: a part, never the answer, which half a final answer would pass for.
/// Asked again, the filter decides the same.
fn filtered(finish_reason: Option<&str>, text: &str) -> Result<(), LlmError> {
    match finish_reason {
        Some(reason @ "content_filter") => Err(LlmError::NoContent(format!(
            "finish_reason {reason}: the provider's filter stopped the answer after {} bytes of text",
            text.len()
        ))),
        _ => Ok(()),
    }
}

/// Tool calls arriving in pieces over a stream: each delta names the call's `index`; the id and
/// name come once, the arguments' JSON text in fragments to be joined.
///
/// What they hold is counted as it comes: a call's id, name and arguments, and
/// [`ToolCallDeltas::CALL_BYTES`] for the call itself. Before 2026-12-05 only the text was
/// counted, and each time over all the calls, so a server sending deltas of nothing but a new
/// index (`{"index": 7}`, a few bytes each) gathered calls without bound, and its reading slowed
/// with every one. Past [`MAX_TOOL_CALLS`] calls the answer is too long.
#[derive(Debug, Default)]
struct ToolCallDeltas {
    calls: BTreeMap<u64, ToolCall>,
    bytes: usize,
    too_many: bool,
    /// A call without an index came after one at `u64::MAX`: there is no place after it, and
    /// taking it into that call would change a call the model made.
    unplaced: bool,
}

/// The most tool calls taken from one answer; a model's parallel calls are a handful.
pub const MAX_TOOL_CALLS: usize = 256;

impl ToolCallDeltas {
    /// What a call counts for besides its text.
    const CALL_BYTES: usize = 64;

    fn add(&mut self, deltas: &Value) {
        let Value::Array(deltas) = deltas else {
            return;
        };
        for (position, delta) in deltas.iter().enumerate() {
            let id = delta["id"].as_str().filter(|id| !id.is_empty());
            let index = match delta["index"].as_u64() {
                Some(index) => index,
                // Without an index: a whole list's position, or, in a stream, a new call when the
                // id changes (else the same call goes on).
                None => match (self.calls.last_key_value(), id) {
                    (Some((last, call)), Some(id)) if call.id != id => match last.checked_add(1) {
                        Some(next) => next,
                        None => {
                            self.unplaced = true;
                            return;
                        }
                    },
                    (Some((last, _)), _) if deltas.len() == 1 => *last,
                    _ => position as u64,
                },
            };
            if !self.calls.contains_key(&index) {
                if self.calls.len() >= MAX_TOOL_CALLS {
                    self.too_many = true;
                    return;
                }
                self.bytes += Self::CALL_BYTES;
            }
            let call = self.calls.entry(index).or_insert_with(|| ToolCall {
                kind: function_type(),
                ..ToolCall::default()
            });
            // Some servers repeat the id and the name in every delta of a call.
            if let Some(id) = id {
                if call.id.is_empty() {
                    id.clone_into(&mut call.id);
                    self.bytes += id.len();
                }
            }
            if let Some(name) = delta["function"]["name"].as_str() {
                if call.function.name != name {
                    call.function.name.push_str(name);
                    self.bytes += name.len();
                }
            }
            match &delta["function"]["arguments"] {
                Value::String(fragment) => {
                    call.function.arguments.push_str(fragment);
                    self.bytes += fragment.len();
                }
                Value::Null => {}
                // Some servers send the arguments as an object rather than JSON text.
                whole => {
                    self.bytes -= call.function.arguments.len();
                    call.function.arguments = whole.to_string();
                    self.bytes += call.function.arguments.len();
                }
            }
        }
    }

    /// What the calls gathered so far count for (see [`ToolCallDeltas`]).
    fn bytes(&self) -> usize {
        self.bytes
    }

    /// Why the calls cannot be taken, if they cannot: more of them than [`MAX_TOOL_CALLS`], or one
    /// that has no place.
    fn refused(&self) -> Option<LlmError> {
        if self.unplaced {
            return Some(LlmError::Malformed(
                "a tool call without an index after one at the largest index".to_owned(),
            ));
        }
        self.too_many.then(|| {
            LlmError::TooLong(format!(
                "more than {MAX_TOOL_CALLS} tool calls in one answer"
            ))
        })
    }

    fn finish(self) -> Vec<ToolCall> {
        self.calls.into_values().collect()
    }
}

/// The most of an answer taken: its text and its tool calls' arguments together, whole or
/// streamed (a server that sends on for ever is stopped here, not by the memory).
pub const MAX_ANSWER_BYTES: usize = 16 * 1024 * 1024;
/// The longest line of a stream taken (one event, which may carry a whole tool call's arguments).
pub const MAX_LINE_BYTES: usize = 8 * 1024 * 1024;
/// The most of an error's body read: its start is all that is reported.
const ERROR_BODY_BYTES: usize = 4096;

/// A response's body, read until its end or until it is longer than `most` (then `most + 1`
/// bytes or more: the caller tells too long from whole).
async fn read_body(response: reqwest::Response, most: usize) -> Result<Vec<u8>, LlmError> {
    let mut body = Vec::new();
    let mut chunks = response.bytes_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(|e| LlmError::Transport(e.to_string()))?;
        body.extend_from_slice(&chunk);
        if body.len() > most {
            break;
        }
    }
    Ok(body)
}

fn preview(text: &str) -> String {
    text.chars().take(200).collect()
}

/// Metric of answered LLM calls' latency (seconds, retries included), by model.
pub const LLM_LATENCY: &str = "agent_llm_call_duration_seconds";
/// Metric of tokens by model and direction (`in`, `out`).
pub const LLM_TOKENS: &str = "agent_llm_tokens_total";

/// Declares this crate's metrics in the process registry.
pub fn describe_metrics() {
    let registry = agent_metrics::global();
    registry.describe(
        LLM_LATENCY,
        agent_metrics::Kind::Histogram,
        "Answered LLM calls by model, their retries included.",
    );
    registry.describe(
        LLM_LATENCY_ERRORS,
        agent_metrics::Kind::Counter,
        "LLM calls that failed after their retries, by model.",
    );
    registry.describe(
        LLM_TOKENS,
        agent_metrics::Kind::Counter,
        "Tokens the LLM read (in) and wrote (out), by model.",
    );
}

/// The most distinct model names a server's answers may add to the metrics' labels, and the
/// longest: each is a series of its own for as long as the process runs, and a server that named
/// a new model in every answer grew them without end.
const MOST_REPORTED_MODELS: usize = 32;
const LONGEST_REPORTED_MODEL: usize = 128;

/// Whether the model a server reported labels the call's metrics (else the one configured does).
fn reported_model_labels(reported: &str) -> bool {
    static SEEN: std::sync::OnceLock<std::sync::Mutex<std::collections::HashSet<String>>> =
        std::sync::OnceLock::new();
    if reported.is_empty() || reported.len() > LONGEST_REPORTED_MODEL {
        return false;
    }
    let Ok(mut seen) = SEEN.get_or_init(Default::default).lock() else {
        return false;
    };
    if seen.contains(reported) {
        return true;
    }
    if seen.len() >= MOST_REPORTED_MODELS {
        return false;
    }
    seen.insert(reported.to_owned());
    true
}

fn record_call(model: &str, result: &Result<Completion, LlmError>) {
    let registry = agent_metrics::global();
    match result {
        Ok(completion) => {
            // The model the server says answered, which may differ from the one asked for.
            let model = if reported_model_labels(&completion.model) {
                completion.model.as_str()
            } else {
                model
            };
            registry.observe(LLM_LATENCY, &[("model", model)], completion.duration);
            registry.add(
                LLM_TOKENS,
                &[("model", model), ("direction", "in")],
                completion.in_token as f64,
            );
            registry.add(
                LLM_TOKENS,
                &[("model", model), ("direction", "out")],
                completion.out_token as f64,
            );
        }
        Err(_) => registry.inc(LLM_LATENCY_ERRORS, &[("model", model)]),
    }
}

/// Metric of LLM calls that failed after their retries, by model.
pub const LLM_LATENCY_ERRORS: &str = "agent_llm_call_errors_total";

/// `wait` and up to a quarter more at random: callers told to wait the same (by one busy
/// server, or parked by one outage) otherwise came back in the same instant, as one burst.
pub fn spread(wait: Duration) -> Duration {
    wait + wait.mul_f64(rand::thread_rng().gen_range(0.0..=0.25))
}

/// The wait before trying again that a server's `Retry-After` of `after` asks for (at most
/// `most`), [`spread`]: every caller a busy server answered in the same second otherwise came
/// back to it in the same instant, the burst it shed.
fn when_asked(after: Duration, most: Duration) -> Duration {
    let after = after.min(most);
    spread(after).min(most.max(after))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gathered(events: &[Value]) -> Vec<ToolCall> {
        let mut calls = ToolCallDeltas::default();
        for event in events {
            calls.add(event);
        }
        calls.finish()
    }

    #[test]
    fn streamed_tool_calls_are_joined_by_index_and_by_id() {
        let calls = gathered(&[
            json!([{"index": 0, "id": "call_a", "function": {"name": "add", "arguments": ""}}]),
            json!([{"index": 0, "function": {"arguments": "{\"a\": "}}]),
            json!([{"index": 0, "id": "call_a", "function": {"name": "add", "arguments": "1}"}}]),
            json!([{"index": 1, "id": "call_b", "function": {"name": "now", "arguments": "{}"}}]),
        ]);
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (
                calls[0].id.as_str(),
                calls[0].function.name.as_str(),
                calls[0].function.arguments.as_str()
            ),
            ("call_a", "add", "{\"a\": 1}")
        );
        assert_eq!(calls[1].function.name, "now");
        // No index: a new id starts a new call.
        let calls = gathered(&[
            json!([{"id": "x", "function": {"name": "a", "arguments": "{}"}}]),
            json!([{"id": "y", "function": {"name": "b", "arguments": "{}"}}]),
        ]);
        assert_eq!(calls.len(), 2, "{calls:?}");
    }

    #[test]
    fn whole_tool_calls_with_object_arguments_and_null_ids_are_read() {
        let calls = gathered(&[json!([
            {"id": null, "type": null, "function": {"name": "add", "arguments": {"a": 1}}},
            {"function": {"name": "now"}}
        ])]);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.arguments, "{\"a\":1}");
        assert_eq!(calls[0].kind, "function");
        assert_eq!(calls[1].function.arguments, "");
    }

    /// A server's `Retry-After` is waited for in full, never past the most allowed, and spread:
    /// callers told the same do not come back together.
    #[test]
    fn a_retry_after_is_waited_for_and_spread() {
        let (after, most) = (Duration::from_secs(2), Duration::from_secs(10));
        let waits: std::collections::BTreeSet<Duration> =
            (0..50).map(|_| when_asked(after, most)).collect();
        assert!(waits.len() > 10, "{waits:?}");
        assert!(
            waits
                .iter()
                .all(|w| *w >= after && *w <= after.mul_f64(1.25)),
            "{waits:?}"
        );
        assert!((0..50).all(|_| when_asked(Duration::from_secs(60), most) == most));
    }

    #[test]
    fn calls_of_nothing_count_and_too_many_are_refused() {
        let mut calls = ToolCallDeltas::default();
        for index in 0..MAX_TOOL_CALLS {
            calls.add(&json!([{ "index": index }]));
        }
        assert!(calls.refused().is_none());
        assert_eq!(calls.bytes(), MAX_TOOL_CALLS * ToolCallDeltas::CALL_BYTES);
        calls.add(&json!([{"index": 0, "function": {"arguments": "{}"}}]));
        assert!(calls.refused().is_none(), "a call already open goes on");
        calls.add(&json!([{ "index": MAX_TOOL_CALLS }]));
        assert!(matches!(calls.refused(), Some(LlmError::TooLong(_))));
        // Arguments given whole replace what they count for.
        let mut calls = ToolCallDeltas::default();
        calls.add(&json!([{"index": 0, "function": {"name": "f", "arguments": "{\"a\""}}]));
        calls.add(&json!([{"index": 0, "function": {"arguments": {"a": 1}}}]));
        assert_eq!(
            calls.bytes(),
            ToolCallDeltas::CALL_BYTES + "f".len() + "{\"a\":1}".len()
        );
    }
}
