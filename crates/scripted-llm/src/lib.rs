//! An OpenAI-compatible `/v1/chat/completions` server that answers from a script, for tests, benchmarks
//! and offline demos. It streams (SSE) or answers whole, and injects faults on demand: HTTP errors
//! with `Retry-After`, stalls, malformed bodies and truncated streams.
//!
//! A script is JSON: `{"rules": [Rule...], "default_reply": "..."}`. The first rule whose `match` is
//! found in the last user message (or equals it, with `"exact": true`), along with every text of its
//! `and`, answers (with `reply`, or the n-th of its `replies` for its n-th request). The n-th request a
//! rule answers suffers `faults[n]` when there is one: `"429"`, `"500"` (any status), `"stall"`,
//! `"malformed"`, `"truncate"` (a stream that breaks off; whole, a length cut), `"length"` (half
//! the reply, then `finish_reason: "length"`, streamed or whole, as a model at its length limit
//! ends) or `"garbage"` (prose that follows no protocol); later requests get the reply. `"chaos": {"rate": 0.2, "seed": 7}` also injects a fault, drawn from `kinds`, into that
//! share of all answers, reproducibly for a seed.
//!
//! A rule with `tool_calls` answers with OpenAI-style tool calls (native tool calling), streamed
//! in fragments as real servers do. In a conversation with tool results, a rule is matched against
//! the last `user` or `tool` message, so a script can answer a tool's result.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

/// A whole script.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// The reply when no rule matches; without one such a request gets HTTP 400.
    #[serde(default)]
    pub default_reply: Option<String>,
    /// Faults at a rate, on top of the rules' own.
    #[serde(default)]
    pub chaos: Option<Chaos>,
}

/// Faults injected into a share of all answers.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Chaos {
    /// The share of answers that suffer a fault, 0 to 1.
    pub rate: f64,
    /// The faults to draw from (default: every kind).
    #[serde(default = "Chaos::every_kind")]
    pub kinds: Vec<String>,
    /// The same seed gives the same faults for the same sequence of requests.
    #[serde(default)]
    pub seed: u64,
    /// How long a `stall` holds the request (default 60 s).
    #[serde(default)]
    pub stall_ms: Option<u64>,
    /// `Retry-After` seconds sent with a 429.
    #[serde(default)]
    pub retry_after: Option<u64>,
}

impl Chaos {
    /// Every fault kind chaos can inject.
    pub fn every_kind() -> Vec<String> {
        [
            "429",
            "500",
            "503",
            "stall",
            "truncate",
            "malformed",
            "garbage",
        ]
        .map(str::to_owned)
        .to_vec()
    }

    /// The fault of the `n`-th request, if it gets one: a hash of seed and `n`, so runs repeat.
    fn fault(&self, n: u64) -> Option<String> {
        let draw = splitmix(self.seed ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let unit = (draw >> 11) as f64 / (1u64 << 53) as f64;
        if self.kinds.is_empty() || unit >= self.rate {
            return None;
        }
        let pick = splitmix(draw) as usize % self.kinds.len();
        self.kinds.get(pick).cloned()
    }
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One scripted answer.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Text looked for in the last user message; empty matches everything.
    #[serde(rename = "match", default)]
    pub pattern: String,
    /// Match the whole last user message instead of a part of it.
    #[serde(default)]
    pub exact: bool,
    /// More texts that must all be found in the last user message too.
    #[serde(default)]
    pub and: Vec<String>,
    /// The answer's text (the content beside tool calls, which may be empty).
    #[serde(default)]
    pub reply: String,
    /// Answers for the rule's successive requests, in order, the last for every request after
    /// it (a die rolled twice answering 3, then 5); `reply` when empty.
    #[serde(default)]
    pub replies: Vec<String>,
    /// Tool calls the answer makes (native tool calling).
    #[serde(default)]
    pub tool_calls: Vec<ScriptedToolCall>,
    /// Faults for the first requests this rule answers, in order.
    #[serde(default)]
    pub faults: Vec<String>,
    /// Bytes per streamed chunk (default 8).
    #[serde(default)]
    pub chunk_size: Option<usize>,
    /// Delay before answering, in milliseconds.
    #[serde(default)]
    pub delay_ms: u64,
    /// Delay between streamed chunks, in milliseconds (a slow model).
    #[serde(default)]
    pub chunk_delay_ms: u64,
    /// How long a `stall` fault holds the request before dropping it (default 60 s).
    #[serde(default)]
    pub stall_ms: Option<u64>,
    /// `Retry-After` seconds sent with a 429 or 503 fault.
    #[serde(default)]
    pub retry_after: Option<u64>,
}

/// A tool call a rule answers with; `arguments` is sent as JSON text (a string is sent as is, so a
/// script can send arguments that are not JSON).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedToolCall {
    pub name: String,
    #[serde(default)]
    pub arguments: Value,
}

impl ScriptedToolCall {
    fn arguments_text(&self) -> String {
        match &self.arguments {
            Value::String(text) => text.clone(),
            Value::Null => "{}".to_owned(),
            other => other.to_string(),
        }
    }
}

impl Script {
    pub fn from_json(text: &str) -> Result<Script, serde_json::Error> {
        serde_json::from_str(text)
    }
}

/// What the server saw, for tests to assert on.
#[derive(Debug, Clone)]
pub struct Call {
    pub last_user: String,
    pub stream: bool,
    /// The matched rule, if any.
    pub rule: Option<usize>,
    /// The fault it suffered, if any.
    pub fault: Option<String>,
    /// The names of the tools offered for native tool calling.
    pub tools: Vec<String>,
    /// The stop sequences the request asked for.
    pub stop: Vec<String>,
    /// Whether it asked for a JSON object (`response_format`).
    pub json_mode: bool,
    /// The model it asked for.
    pub model: String,
    /// The most tokens it asked the answer to have (`max_tokens`), if it said.
    pub max_tokens: Option<u64>,
}

struct Shared {
    script: Script,
    hits: Vec<AtomicUsize>,
    /// Requests seen, numbering the chaos draws.
    requests: AtomicUsize,
    calls: Mutex<CallLog>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Streamed answers whose body is still being sent (until done, or the client hangs up).
    streams_open: AtomicUsize,
    /// While set, every request is answered with this status and `Retry-After` (a provider
    /// outage, switched on and off by a test).
    outage: Mutex<Option<(u16, Option<u64>)>>,
}

/// The requests served, the newest of them kept for a test to read.
struct CallLog {
    served: usize,
    kept: std::collections::VecDeque<Call>,
    /// The most kept: a server that runs for days (`agentctl up`, a bench) must not keep them all.
    most: usize,
}

impl CallLog {
    fn new(most: usize) -> CallLog {
        CallLog {
            served: 0,
            kept: std::collections::VecDeque::new(),
            most,
        }
    }

    /// Notes a request served; its number, for [`CallLog::get_mut`].
    fn push(&mut self, call: Call) -> usize {
        let number = self.served;
        self.served += 1;
        if self.most > 0 {
            if self.kept.len() == self.most {
                self.kept.pop_front();
            }
            self.kept.push_back(call);
        }
        number
    }

    /// Request `number`, if it is still kept.
    fn get_mut(&mut self, number: usize) -> Option<&mut Call> {
        let first_kept = self.served - self.kept.len();
        number
            .checked_sub(first_kept)
            .and_then(|i| self.kept.get_mut(i))
    }
}

/// Counts a request as in flight until dropped.
struct InFlight<'a>(&'a Shared);

impl<'a> InFlight<'a> {
    fn enter(shared: &'a Shared) -> InFlight<'a> {
        let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        shared.max_in_flight.fetch_max(now, Ordering::SeqCst);
        InFlight(shared)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Counts a streamed answer as open for as long as its body lives: the server drops it when the
/// last chunk is sent or when the client has gone.
struct OpenStream(Arc<Shared>);

impl OpenStream {
    fn enter(shared: Arc<Shared>) -> OpenStream {
        shared.streams_open.fetch_add(1, Ordering::SeqCst);
        OpenStream(shared)
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.streams_open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running server; stops when dropped or on [`ScriptedLlm::stop`].
pub struct ScriptedLlm {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
}

impl ScriptedLlm {
    /// Serves `script` on `addr` (port 0 picks a free port), keeping every request for
    /// [`ScriptedLlm::calls`]: for a test, which reads them.
    pub async fn start(script: Script, addr: SocketAddr) -> std::io::Result<ScriptedLlm> {
        Self::start_keeping(script, addr, usize::MAX).await
    }

    /// [`ScriptedLlm::start`], keeping only the newest `most` requests (none with 0): for a
    /// server that runs for long, whose memory would otherwise grow with every request.
    pub async fn start_keeping(
        script: Script,
        addr: SocketAddr,
        most: usize,
    ) -> std::io::Result<ScriptedLlm> {
        let hits = script.rules.iter().map(|_| AtomicUsize::new(0)).collect();
        let shared = Arc::new(Shared {
            script,
            hits,
            requests: AtomicUsize::new(0),
            calls: Mutex::new(CallLog::new(most)),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            streams_open: AtomicUsize::new(0),
            outage: Mutex::new(None),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat))
            .route("/chat/completions", post(chat))
            .route("/v1/models", get(models))
            // Real providers take prompts of many megabytes; axum's default stops at 2 MB.
            .layer(axum::extract::DefaultBodyLimit::max(64 * 1024 * 1024))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let stop = CancellationToken::new();
        let until = stop.clone();
        tokio::spawn(async move {
            let served = axum::serve(listener, app)
                .with_graceful_shutdown(async move { until.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!(error = %e, "scripted LLM server failed");
            }
        });
        Ok(ScriptedLlm { addr, shared, stop })
    }

    /// The base URL clients use (`http://127.0.0.1:PORT/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The requests served so far, as many of the newest as it keeps (all, started with
    /// [`ScriptedLlm::start`]).
    pub fn calls(&self) -> Vec<Call> {
        self.shared
            .calls
            .lock()
            .map(|c| c.kept.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// How many requests it has served, kept or not.
    pub fn served(&self) -> usize {
        self.shared.calls.lock().map(|c| c.served).unwrap_or(0)
    }

    /// The most requests that were being answered at the same moment (whole answers and the
    /// preparation of streamed ones).
    pub fn max_concurrent(&self) -> usize {
        self.shared.max_in_flight.load(Ordering::SeqCst)
    }

    /// Streamed answers still being sent: a client that abandons a stream closes its connection,
    /// and the stream stops at its next chunk.
    pub fn streams_open(&self) -> usize {
        self.shared.streams_open.load(Ordering::SeqCst)
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Starts an outage: every request is answered with `status` (and `Retry-After:
    /// retry_after_secs`) until [`ScriptedLlm::end_outage`].
    pub fn start_outage(&self, status: u16, retry_after_secs: Option<u64>) {
        if let Ok(mut outage) = self.shared.outage.lock() {
            *outage = Some((status, retry_after_secs));
        }
    }

    pub fn end_outage(&self) {
        if let Ok(mut outage) = self.shared.outage.lock() {
            *outage = None;
        }
    }
}

impl Drop for ScriptedLlm {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn models() -> Json<Value> {
    Json(json!({"object": "list", "data": [{"id": "scripted", "object": "model"}]}))
}

fn last_user_message(body: &Value) -> String {
    body["messages"]
        .as_array()
        .and_then(|m| {
            m.iter()
                .rev()
                .find(|m| m["role"] == "user" || m["role"] == "tool")
        })
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

async fn chat(State(shared): State<Arc<Shared>>, Json(body): Json<Value>) -> Response {
    let _in_flight = InFlight::enter(&shared);
    let last_user = last_user_message(&body);
    let stream = body["stream"].as_bool().unwrap_or(false);
    let model = body["model"].as_str().unwrap_or("scripted").to_owned();
    let rule_index = shared.script.rules.iter().position(|r| {
        let first = if r.exact {
            last_user == r.pattern
        } else {
            last_user.contains(&r.pattern)
        };
        first && r.and.iter().all(|text| last_user.contains(text.as_str()))
    });
    let call_index = match shared.calls.lock() {
        Ok(mut calls) => {
            let strings = |v: &Value| -> Vec<String> {
                match v {
                    Value::String(s) => vec![s.clone()],
                    Value::Array(items) => items
                        .iter()
                        .filter_map(|i| i.as_str().map(str::to_owned))
                        .collect(),
                    _ => Vec::new(),
                }
            };
            Some(
                calls.push(Call {
                    last_user: last_user.clone(),
                    stream,
                    rule: rule_index,
                    fault: None,
                    tools: body["tools"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
                        .collect(),
                    stop: strings(&body["stop"]),
                    json_mode: body["response_format"]["type"] == "json_object",
                    model: model.clone(),
                    max_tokens: body["max_tokens"].as_u64(),
                }),
            )
        }
        Err(_) => None,
    };
    let outage = shared.outage.lock().ok().and_then(|o| *o);
    if let Some((status, retry_after)) = outage {
        if let (Ok(mut calls), Some(i)) = (shared.calls.lock(), call_index) {
            if let Some(call) = calls.get_mut(i) {
                call.fault = Some(format!("outage {status}"));
            }
        }
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
        let mut response = (
            status,
            Json(json!({"error": {"message": "the scripted provider is down", "type": "server_error"}})),
        )
            .into_response();
        if let Some(secs) = retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        return response;
    }
    let (reply, fault, rule) = match rule_index {
        Some(i) => {
            let rule = &shared.script.rules[i];
            let n = shared.hits[i].fetch_add(1, Ordering::SeqCst);
            let reply = rule.replies.get(n).or(rule.replies.last());
            (
                reply.unwrap_or(&rule.reply).clone(),
                rule.faults.get(n).cloned(),
                Some(rule.clone()),
            )
        }
        None => match &shared.script.default_reply {
            Some(reply) => (reply.clone(), None, None),
            None => {
                let error = json!({"error": {"message": "no scripted reply matches", "type": "invalid_request_error"}});
                return (StatusCode::BAD_REQUEST, Json(error)).into_response();
            }
        },
    };
    let mut rule = rule.unwrap_or_default();
    let fault = match (fault, &shared.script.chaos) {
        (None, Some(chaos)) => {
            let n = shared.requests.fetch_add(1, Ordering::SeqCst) as u64;
            let fault = chaos.fault(n);
            if fault.is_some() {
                rule.stall_ms = rule.stall_ms.or(chaos.stall_ms);
                rule.retry_after = rule.retry_after.or(chaos.retry_after);
            }
            fault
        }
        (fault, _) => fault,
    };
    if let (Ok(mut calls), Some(i)) = (shared.calls.lock(), call_index) {
        if let Some(call) = calls.get_mut(i) {
            call.fault.clone_from(&fault);
        }
    }
    let reply = if fault.as_deref() == Some("garbage") {
        "Sorry, I am not sure what you are asking. Could you say more?".to_owned()
    } else {
        reply
    };
    if rule.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(rule.delay_ms)).await;
    }
    let prompt_tokens = (body["messages"].to_string().len() / 4).max(1) as u64;
    let completion_tokens = (reply.len() / 4).max(1) as u64;
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens});
    match fault.as_deref() {
        Some("stall") => {
            tokio::time::sleep(Duration::from_millis(rule.stall_ms.unwrap_or(60_000))).await;
            return StatusCode::GATEWAY_TIMEOUT.into_response();
        }
        Some("malformed") if !stream => {
            return (
                [(header::CONTENT_TYPE, "application/json")],
                "{\"choices\": [{\"message\": ",
            )
                .into_response();
        }
        Some(code) if code.parse::<u16>().is_ok() => {
            let status = code
                .parse::<u16>()
                .ok()
                .and_then(|c| StatusCode::from_u16(c).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut response = (
                status,
                Json(json!({"error": {"message": format!("scripted fault {code}"), "type": "server_error"}})),
            )
                .into_response();
            if let Some(secs) = rule.retry_after {
                if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                    response.headers_mut().insert(header::RETRY_AFTER, v);
                }
            }
            return response;
        }
        _ => {}
    }
    if !stream {
        // A whole answer cut short: the model hit its length limit.
        let (reply, finish) = if matches!(fault.as_deref(), Some("truncate" | "length")) {
            let cut = reply
                .char_indices()
                .map(|(i, _)| i)
                .nth(reply.chars().count() / 2)
                .unwrap_or(0);
            (reply[..cut].to_owned(), "length")
        } else {
            (reply, "stop")
        };
        let mut message = json!({"role": "assistant", "content": reply});
        let mut finish = finish;
        if !rule.tool_calls.is_empty() && finish != "length" {
            let calls: Vec<Value> = rule
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    json!({"id": format!("call_{i}"), "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments_text()}})
                })
                .collect();
            message["tool_calls"] = json!(calls);
            if message["content"] == "" {
                message["content"] = Value::Null;
            }
            finish = "tool_calls";
        }
        return Json(json!({
            "id": "chatcmpl-scripted",
            "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        }))
        .into_response();
    }
    let chunks = split_chunks(&reply, rule.chunk_size.unwrap_or(8));
    let mut events: Vec<String> = Vec::with_capacity(chunks.len() + 3);
    let truncate = fault.as_deref() == Some("truncate");
    let malformed = fault.as_deref() == Some("malformed");
    let length = fault.as_deref() == Some("length");
    let keep = if truncate || length {
        chunks.len() / 2
    } else {
        chunks.len()
    };
    for chunk in chunks.iter().take(keep) {
        let event = json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": {"content": chunk}, "finish_reason": null}]});
        events.push(format!("data: {event}\n\n"));
    }
    if malformed {
        events.push("data: {\"choices\": [{\"delta\": \n\n".to_owned());
    }
    // Tool calls stream as OpenAI's do: the id and name first, then the arguments in fragments.
    if !truncate && !malformed && !length {
        for (i, call) in rule.tool_calls.iter().enumerate() {
            let first = json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": model,
                "choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "id": format!("call_{i}"),
                    "type": "function", "function": {"name": call.name, "arguments": ""}}]}, "finish_reason": null}]});
            events.push(format!("data: {first}\n\n"));
            for piece in split_chunks(&call.arguments_text(), rule.chunk_size.unwrap_or(8)) {
                let event = json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": model,
                    "choices": [{"index": 0, "delta": {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}, "finish_reason": null}]});
                events.push(format!("data: {event}\n\n"));
            }
        }
    }
    if !truncate && !malformed {
        let finish = if length {
            "length"
        } else if rule.tool_calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        };
        let last = json!({"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": model,
            "choices": [{"index": 0, "delta": {}, "finish_reason": finish}], "usage": usage});
        events.push(format!("data: {last}\n\n"));
        events.push("data: [DONE]\n\n".to_owned());
    }
    let pause = Duration::from_millis(rule.chunk_delay_ms);
    let open = OpenStream::enter(shared.clone());
    let body = futures::stream::iter(events).then(move |e| {
        let _open = &open;
        async move {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            Ok::<_, std::convert::Infallible>(bytes::Bytes::from(e))
        }
    });
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// Splits on character boundaries into pieces of about `size` bytes.
fn split_chunks(text: &str, size: usize) -> Vec<String> {
    let size = size.max(1);
    let mut out = Vec::new();
    let mut current = String::new();
    for c in text.chars() {
        current.push(c);
        if current.len() >= size {
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_call_log_keeps_only_its_newest() {
        let call = |text: &str| Call {
            last_user: text.to_owned(),
            stream: false,
            rule: None,
            fault: None,
            tools: Vec::new(),
            stop: Vec::new(),
            json_mode: false,
            model: "m".to_owned(),
            max_tokens: None,
        };
        let mut log = CallLog::new(2);
        let first = log.push(call("a"));
        log.push(call("b"));
        let third = log.push(call("c"));
        assert_eq!(log.served, 3);
        let kept: Vec<_> = log.kept.iter().map(|c| c.last_user.as_str()).collect();
        assert_eq!(kept, ["b", "c"]);
        assert!(log.get_mut(first).is_none());
        assert_eq!(
            log.get_mut(third).map(|c| c.last_user.clone()),
            Some("c".into())
        );
        let mut none = CallLog::new(0);
        let only = none.push(call("a"));
        assert!(none.kept.is_empty() && none.get_mut(only).is_none());
        assert_eq!(none.served, 1);
    }

    #[test]
    fn chunks_respect_char_boundaries() {
        let chunks = split_chunks("héllo wörld", 3);
        assert_eq!(chunks.concat(), "héllo wörld");
        assert!(chunks
            .iter()
            .all(|c| c.len() >= 3 || c == chunks.last().unwrap()));
    }

    #[test]
    fn chaos_hits_about_its_rate_and_repeats_for_a_seed() {
        let chaos = Chaos {
            rate: 0.25,
            kinds: Chaos::every_kind(),
            seed: 3,
            stall_ms: None,
            retry_after: None,
        };
        let faults: Vec<Option<String>> = (0..4000).map(|n| chaos.fault(n)).collect();
        let hit = faults.iter().filter(|f| f.is_some()).count();
        assert!((800..1200).contains(&hit), "{hit} of 4000");
        assert_eq!(
            faults,
            (0..4000).map(|n| chaos.fault(n)).collect::<Vec<_>>()
        );
        for kind in Chaos::every_kind() {
            assert!(faults.iter().any(|f| f.as_deref() == Some(kind.as_str())));
        }
    }

    #[test]
    fn scripts_reject_unknown_fields() {
        assert!(Script::from_json(r#"{"rules": [{"reply": "x", "fualts": []}]}"#).is_err());
    }
}
