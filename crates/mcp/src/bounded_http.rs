//! MCP's streamable HTTP transport with what a server sends bounded, as stdio's lines are: a JSON
//! answer at [`crate::MAX_MESSAGE_BYTES`], and each line of an event stream the same. `rmcp`'s own
//! reqwest client reads a JSON body whole and an event's line without end, so a server that
//! answered without end grew this process's memory until it died (every dialog on it with it, and
//! again on the replica that took them up). Each request is answered on a stream of its own, so
//! calls on one session run side by side whether the server answers in JSON or with events.

use std::sync::Arc;

use futures::stream::BoxStream;
use futures::StreamExt;
use rmcp::model::{ClientJsonRpcMessage, ServerJsonRpcMessage};
use rmcp::transport::common::http_header::{
    EVENT_STREAM_MIME_TYPE, HEADER_LAST_EVENT_ID, HEADER_SESSION_ID, JSON_MIME_TYPE,
};
use rmcp::transport::streamable_http_client::{
    AuthRequiredError, SseError, StreamableHttpClient, StreamableHttpError,
    StreamableHttpPostResponse,
};
use sse_stream::{Sse, SseStream};

/// A reqwest client whose reads of an MCP server's answers stop at `most` bytes a message.
#[derive(Clone)]
pub struct BoundedHttp {
    client: reqwest::Client,
    most: usize,
    answer_within: std::time::Duration,
    /// The session's event streams opened lately (shared by its clones: `rmcp` clones the client
    /// for each stream it reads).
    reopened: Arc<std::sync::Mutex<Reopened>>,
}

/// Paces the opening of event streams (`GET`): `rmcp` opens one again at once whenever one fails
/// part way, with no wait, however often it fails. A server whose stream broke each time just
/// after it opened (a cut connection, a line it cannot read) kept a core busy reconnecting for
/// the session's life. The first opening in a while goes at once; each one soon after the last
/// waits twice as long as the one before, up to [`Reopened::MOST_WAIT`].
#[derive(Debug, Default)]
struct Reopened {
    last: Option<std::time::Instant>,
    soon: u32,
}

impl Reopened {
    /// An opening this long after the one before is not soon: it goes at once.
    const CALM: std::time::Duration = std::time::Duration::from_secs(10);
    const FIRST_WAIT: std::time::Duration = std::time::Duration::from_millis(200);
    const MOST_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

    /// How long to wait before opening a stream now.
    fn wait(&mut self, now: std::time::Instant) -> std::time::Duration {
        let soon = self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < Self::CALM);
        self.soon = if soon { self.soon.saturating_add(1) } else { 0 };
        let wait = match self.soon {
            0 => std::time::Duration::ZERO,
            n => Self::FIRST_WAIT
                .saturating_mul(1u32 << (n - 1).min(16))
                .min(Self::MOST_WAIT),
        };
        // Counted from when it opens, so a wait is not taken for calm.
        self.last = Some(now + wait);
        wait
    }
}

/// How long a request's answer may take to start (its headers; a JSON answer, whole). `rmcp`
/// waits for it with no limit of its own, so a server that took a call and never answered held
/// a task and its connection for good (and, before each call was answered apart, the session's
/// worker), one more each time a step's timeout gave up on it and the session was opened again. A server
/// that answers as an event stream starts at once and is not held to it, however long its tool
/// runs; one answering in JSON must answer within it, whatever `tool_timeout_secs` allows.
pub const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(15 * 60);

impl BoundedHttp {
    pub fn new(client: reqwest::Client, most: usize) -> BoundedHttp {
        BoundedHttp {
            client,
            most,
            answer_within: ANSWER_WITHIN,
            reopened: Arc::default(),
        }
    }

    /// The `POST` of `message`.
    fn post(
        &self,
        uri: &str,
        message: &ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
    ) -> reqwest::RequestBuilder {
        let accept = format!("{EVENT_STREAM_MIME_TYPE}, {JSON_MIME_TYPE}");
        let mut request = self
            .client
            .post(uri)
            .header(reqwest::header::ACCEPT, accept)
            .json(message);
        if let Some(token) = auth_header {
            request = request.bearer_auth(token);
        }
        if let Some(session) = session_id {
            request = request.header(HEADER_SESSION_ID, session.as_ref());
        }
        request
    }

    /// Sends `request` and reads how the server answers it, its body bounded.
    async fn answer(
        &self,
        request: reqwest::RequestBuilder,
        id: Option<serde_json::Value>,
    ) -> Result<Answer, Failed> {
        let no_answer = || StreamableHttpError::Client(HttpError::NoAnswer(self.answer_within));
        let response = tokio::time::timeout(self.answer_within, request.send())
            .await
            .map_err(|_| no_answer())?
            .map_err(http)?;
        let status = response.status();
        if status == reqwest::StatusCode::UNAUTHORIZED {
            if let Some(challenge) = response.headers().get(reqwest::header::WWW_AUTHENTICATE) {
                return Err(StreamableHttpError::AuthRequired(AuthRequiredError {
                    www_authenticate_header: String::from_utf8_lossy(challenge.as_bytes())
                        .into_owned(),
                }));
            }
        }
        if matches!(
            status,
            reqwest::StatusCode::ACCEPTED | reqwest::StatusCode::NO_CONTENT
        ) {
            return Ok(Answer::Accepted);
        }
        let response = response.error_for_status().map_err(http)?;
        let session = response
            .headers()
            .get(HEADER_SESSION_ID)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if is(&response, EVENT_STREAM_MIME_TYPE) {
            return Ok(Answer::Events(
                bounded_events(response, self.most, id),
                session,
            ));
        }
        if is(&response, JSON_MIME_TYPE) {
            let body = tokio::time::timeout(self.answer_within, bounded_body(response, self.most))
                .await
                .map_err(|_| no_answer())??;
            return Ok(Answer::Json(body, session));
        }
        Err(StreamableHttpError::UnexpectedContentType(content_type(
            &response,
        )))
    }

    /// The answer to the request `request` (JSON-RPC id `id`) as an event stream, sent when the
    /// stream is first read: a JSON answer is its one event, an event stream passes as it is.
    /// Whatever keeps the server's answer from being read (no connection, a status, a JSON body
    /// past the bound, no answer in time, a body that is no message) is an error answer to `id`
    /// marked as not the server's ([`unanswered`]): `rmcp` would only log a stream's failure,
    /// and the call would wait out its timeout. An event stream's own failures are
    /// [`bounded_events`]'s, as before. The `POST` now starts when `rmcp` first reads the stream,
    /// in a task of its own, so a `notifications/cancelled` for a call dropped at once (sent by
    /// the worker itself) can reach the server before the call; the server then ignores it and
    /// the tool runs to its end, as a call cancelled after its answer would.
    fn answer_apart(
        self,
        request: reqwest::RequestBuilder,
        id: serde_json::Value,
    ) -> BoxStream<'static, Result<Sse, SseError>> {
        let event = |data: String| Sse {
            event: None,
            data: Some(data),
            id: None,
            retry: None,
        };
        let failed = move |id: serde_json::Value, why: String| {
            let answer = serde_json::json!({"jsonrpc": "2.0", "id": id,
                "error": {"code": -32603, "message": why, "data": {UNANSWERED: unanswered_mark()}}});
            futures::stream::iter([Ok(event(answer.to_string()))]).boxed()
        };
        futures::stream::once(async move {
            match self.answer(request, Some(id.clone())).await {
                Ok(Answer::Events(events, _)) => events,
                Ok(Answer::Json(body, _)) => {
                    let read = serde_json::from_slice::<ServerJsonRpcMessage>(&body)
                        .map_err(|e| e.to_string())
                        .and_then(|_| String::from_utf8(body).map_err(|e| e.to_string()));
                    match read {
                        Ok(text) => futures::stream::iter([Ok(event(text))]).boxed(),
                        Err(e) => failed(id, format!("the server's answer is no message: {e}")),
                    }
                }
                // Against the protocol, but the answer may still come on the session's own
                // event stream, as it could when the worker waited for this itself.
                Ok(Answer::Accepted) => futures::stream::empty().boxed(),
                Err(e) => failed(id, e.to_string()),
            }
        })
        .flatten()
        .boxed()
    }

    /// With another bound than [`ANSWER_WITHIN`] on an answer's start.
    #[cfg(test)]
    pub fn answering_within(self, answer_within: std::time::Duration) -> BoundedHttp {
        BoundedHttp {
            answer_within,
            ..self
        }
    }
}

/// What went wrong talking to the server.
#[derive(Debug)]
pub enum HttpError {
    /// Without its URL, whose query may hold a credential (`?api_key=`): the text reaches the
    /// LLM, the provenance and the logs.
    Http(reqwest::Error),
    /// A message (a JSON body, or a line of an event stream) ran past the bound.
    TooLong { most: usize },
    /// No answer began within its bound ([`ANSWER_WITHIN`]).
    NoAnswer(std::time::Duration),
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HttpError::Http(e) => write!(f, "{e}"),
            HttpError::TooLong { most } => write!(
                f,
                "the server's message ran past {most} bytes; the rest was not read"
            ),
            HttpError::NoAnswer(within) => {
                write!(f, "the server did not answer within {} s", within.as_secs())
            }
        }
    }
}

impl std::error::Error for HttpError {}

type Failed = StreamableHttpError<HttpError>;

/// How a server answered a message, its body read: the body, or its events, and the session id
/// it gave.
enum Answer {
    Accepted,
    Json(Vec<u8>, Option<String>),
    Events(BoxStream<'static, Result<Sse, SseError>>, Option<String>),
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Accepted => f.write_str("Accepted"),
            Answer::Json(body, session) => f
                .debug_tuple("Json")
                .field(&String::from_utf8_lossy(body))
                .field(session)
                .finish(),
            Answer::Events(_, session) => f.debug_tuple("Events").field(session).finish(),
        }
    }
}

/// The key in an error answer's `data` that says the answer is this client's, made because the
/// server's could not be read (see [`unanswered`]).
const UNANSWERED: &str = "pulsar-agents-unanswered";

/// The value under [`UNANSWERED`]: drawn once a process, so that a server cannot make its own
/// error answers pass for this client's (it would only have cost the server its session).
pub(crate) fn unanswered_mark() -> &'static str {
    static MARK: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    MARK.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut drawn = std::collections::hash_map::RandomState::new().build_hasher();
        drawn.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |since| since.as_nanos()),
        );
        format!("{:016x}", drawn.finish())
    })
}

/// Whether `error` is an answer this client made for a request whose own answer could not be
/// read ([`BoundedHttp::answer_apart`]): a transport's failure, as it was when the worker
/// waited for the answer itself, so the session is dropped and the next call connects again.
pub fn unanswered(error: &rmcp::model::ErrorData) -> bool {
    error
        .data
        .as_ref()
        .and_then(|data| data.get(UNANSWERED))
        .and_then(serde_json::Value::as_str)
        .is_some_and(|mark| mark == unanswered_mark())
}

fn http(e: reqwest::Error) -> Failed {
    StreamableHttpError::Client(HttpError::Http(e.without_url()))
}

/// Whether the response's content type starts with `mime`.
fn is(response: &reqwest::Response, mime: &str) -> bool {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .is_some_and(|ct| ct.as_bytes().starts_with(mime.as_bytes()))
}

fn content_type(response: &reqwest::Response) -> Option<String> {
    response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .map(|ct| String::from_utf8_lossy(ct.as_bytes()).into_owned())
}

/// The body of `response`, read a chunk at a time and given up past `most` bytes.
async fn bounded_body(mut response: reqwest::Response, most: usize) -> Result<Vec<u8>, Failed> {
    let too_long = || StreamableHttpError::Client(HttpError::TooLong { most });
    if response.content_length().is_some_and(|n| n > most as u64) {
        return Err(too_long());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(http)? {
        if body.len() + chunk.len() > most {
            return Err(too_long());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

/// Bytes of an event stream since its last event ended (a blank line): the event parser keeps an
/// event's lines until it ends, so a line without end, or data lines without a blank one, would
/// grow without bound.
struct OpenEvent {
    most: usize,
    bytes: usize,
    /// Nothing but the line's end seen on the current line.
    line_empty: bool,
    /// The last byte was a CR (a LF after it ends the same line).
    after_cr: bool,
}

impl OpenEvent {
    fn new(most: usize) -> OpenEvent {
        OpenEvent {
            most,
            bytes: 0,
            line_empty: true,
            after_cr: false,
        }
    }

    /// Counts `chunk`; whether the event it is part of is still within the bound.
    fn within(&mut self, chunk: &[u8]) -> bool {
        for &b in chunk {
            self.bytes += 1;
            match b {
                b'\n' if self.after_cr => self.after_cr = false,
                b'\r' | b'\n' => {
                    self.after_cr = b == b'\r';
                    if self.line_empty {
                        self.bytes = 0;
                    }
                    self.line_empty = true;
                }
                _ => {
                    self.after_cr = false;
                    self.line_empty = false;
                }
            }
            if self.bytes > self.most {
                return false;
            }
        }
        true
    }
}

/// Events passed on one after another, all ready, before the stream gives way once (pending, and
/// woken at once).
const EVENTS_A_POLL: usize = 64;

/// An event stream that gives way every [`EVENTS_A_POLL`] events. `rmcp` passes over an event
/// that is no message (a control event, data that is not JSON-RPC) by calling its own
/// `poll_next` again from inside itself, so a server that sent a run of such events, all ready at
/// once (a few hundred kilobytes of `data: x`), deepened the stack a call an event until the
/// process overflowed its stack and aborted, with every dialog it ran. Giving way unwinds it.
struct GiveWay<S> {
    events: S,
    run: usize,
}

impl<S> GiveWay<S> {
    fn new(events: S) -> GiveWay<S> {
        GiveWay { events, run: 0 }
    }
}

impl<S: futures::Stream + Unpin> futures::Stream for GiveWay<S> {
    type Item = S::Item;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<S::Item>> {
        if self.run >= EVENTS_A_POLL {
            self.run = 0;
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        let next = self.events.poll_next_unpin(cx);
        match next {
            std::task::Poll::Ready(Some(_)) => self.run += 1,
            _ => self.run = 0,
        }
        next
    }
}

/// The events of `response`'s stream, failing once an event runs past `most` bytes before its
/// end (see [`OpenEvent`]). On the stream that answers the request
/// `answering` (its JSON-RPC id), that failure becomes an error answer to it and the stream's
/// end: `rmcp` only logs a stream's failure, and the call would wait out its timeout.
fn bounded_events(
    response: reqwest::Response,
    most: usize,
    answering: Option<serde_json::Value>,
) -> BoxStream<'static, Result<Sse, SseError>> {
    let mut open = OpenEvent::new(most);
    let bytes = response.bytes_stream().map(move |chunk| {
        let chunk = chunk.map_err(|e| HttpError::Http(e.without_url()))?;
        if !open.within(&chunk) {
            return Err(HttpError::TooLong { most });
        }
        Ok(chunk)
    });
    let events = GiveWay::new(SseStream::from_bytes_stream(bytes).boxed());
    let Some(id) = answering else {
        return events.boxed();
    };
    events
        .scan(false, move |failed, event| {
            let next = match event {
                _ if *failed => None,
                // Only a message over the bound: a connection lost mid-stream goes to `rmcp`,
                // which resumes the stream (`Last-Event-ID`) and may still get the tool's result.
                // Answered as an error here, the LLM read "refused" of a call that may have run.
                Err(SseError::Body(e))
                    if e.downcast_ref::<HttpError>()
                        .is_some_and(|e| matches!(e, HttpError::TooLong { .. })) =>
                {
                    *failed = true;
                    let answer = serde_json::json!({"jsonrpc": "2.0", "id": id,
                        "error": {"code": -32603, "message": e.to_string()}});
                    Some(Ok(Sse {
                        event: None,
                        data: Some(answer.to_string()),
                        id: None,
                        retry: None,
                    }))
                }
                event => Some(event),
            };
            futures::future::ready(next)
        })
        .boxed()
}

impl StreamableHttpClient for BoundedHttp {
    type Error = HttpError;

    async fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
    ) -> Result<StreamableHttpPostResponse, Failed> {
        let sent = serde_json::to_value(&message).ok();
        let id = sent.as_ref().and_then(|m| m.get("id").cloned());
        let method = sent
            .as_ref()
            .and_then(|m| m.get("method"))
            .and_then(|m| m.as_str().map(str::to_owned));
        let request = self.post(&uri, &message, session_id, auth_header);
        match (id, method) {
            // `rmcp`'s worker waits for this call's return before it sends anything else, so a
            // request answered here would hold every other call of the session until the server
            // answered it (a JSON answer comes whole, after the tool has run). A request is
            // answered on a stream of its own instead, as one answered with an event stream is:
            // the worker goes on at once. `initialize` is not: the worker reads the session's id
            // from its answer before the loop that sends the rest.
            (Some(id), Some(method)) if method != "initialize" => Ok(
                StreamableHttpPostResponse::Sse(self.clone().answer_apart(request, id), None),
            ),
            // Only a request of ours is answered: a message we send with an id and no method is
            // our answer to the server's own request, whose id is not ours to answer.
            (id, method) => match self
                .answer(request, id.filter(|_| method.is_some()))
                .await?
            {
                Answer::Accepted => Ok(StreamableHttpPostResponse::Accepted),
                Answer::Json(body, session) => Ok(StreamableHttpPostResponse::Json(
                    serde_json::from_slice(&body)?,
                    session,
                )),
                Answer::Events(events, session) => {
                    Ok(StreamableHttpPostResponse::Sse(events, session))
                }
            },
        }
    }

    async fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
    ) -> Result<(), Failed> {
        let mut request = self
            .client
            .delete(uri.as_ref())
            .header(HEADER_SESSION_ID, session_id.as_ref());
        if let Some(token) = auth_header {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(http)?;
        // A server that keeps no sessions to end says so; that is no failure.
        if response.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Ok(());
        }
        response.error_for_status().map_err(http)?;
        Ok(())
    }

    async fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
    ) -> Result<BoxStream<'static, Result<Sse, SseError>>, Failed> {
        let wait = self
            .reopened
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .wait(std::time::Instant::now());
        if !wait.is_zero() {
            tracing::debug!(
                ?wait,
                "an MCP server's event stream opened again soon after the last; waiting"
            );
            tokio::time::sleep(wait).await;
        }
        let accept = format!("{EVENT_STREAM_MIME_TYPE}, {JSON_MIME_TYPE}");
        let mut request = self
            .client
            .get(uri.as_ref())
            .header(reqwest::header::ACCEPT, accept)
            .header(HEADER_SESSION_ID, session_id.as_ref());
        if let Some(last) = last_event_id {
            request = request.header(HEADER_LAST_EVENT_ID, last);
        }
        if let Some(token) = auth_header {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.map_err(http)?;
        if response.status() == reqwest::StatusCode::METHOD_NOT_ALLOWED {
            return Err(StreamableHttpError::ServerDoesNotSupportSse);
        }
        let response = response.error_for_status().map_err(http)?;
        if !is(&response, EVENT_STREAM_MIME_TYPE) && !is(&response, JSON_MIME_TYPE) {
            return Err(StreamableHttpError::UnexpectedContentType(content_type(
                &response,
            )));
        }
        Ok(bounded_events(response, self.most, None))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Streams opened again soon wait longer each time, up to the most; one after a calm goes at
    /// once.
    #[test]
    fn event_streams_opened_again_soon_are_paced() {
        let start = std::time::Instant::now();
        let mut reopened = Reopened::default();
        let mut now = start;
        let mut waits = Vec::new();
        for _ in 0..12 {
            let wait = reopened.wait(now);
            waits.push(wait.as_millis());
            now += wait;
        }
        assert_eq!(
            waits,
            [0, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000, 30000, 30000]
        );
        let later = now + Reopened::CALM + std::time::Duration::from_secs(1);
        assert_eq!(reopened.wait(later), std::time::Duration::ZERO);
    }

    /// Serves one HTTP answer with `content_type` and `body` to whoever connects first.
    async fn answering(content_type: &'static str, body: Vec<u8>) -> String {
        answering_with("200 OK", content_type, body).await
    }

    /// Serves one HTTP answer with `status` to whoever connects first.
    async fn answering_with(
        status: &'static str,
        content_type: &'static str,
        body: Vec<u8>,
    ) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 64 * 1024];
            let _ = socket.read(&mut request).await;
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\nmcp-session-id: s1\r\nconnection: close\r\n\r\n"
            );
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(&body).await;
        });
        url
    }

    fn ping() -> ClientJsonRpcMessage {
        serde_json::from_str(r#"{"jsonrpc": "2.0", "id": 1, "method": "ping"}"#).unwrap()
    }

    async fn post(url: &str, most: usize) -> Result<Answer, Failed> {
        let client = BoundedHttp::new(reqwest::Client::new(), most);
        let request = client.post(url, &ping(), None, None);
        client.answer(request, Some(1.into())).await
    }

    /// The messages of an event stream, as `rmcp` reads them.
    async fn messages(
        events: BoxStream<'static, Result<Sse, SseError>>,
    ) -> Vec<ServerJsonRpcMessage> {
        events
            .map(|event| serde_json::from_str(&event.unwrap().data.unwrap()).unwrap())
            .collect()
            .await
    }

    const ANSWER: &str = r#"{"jsonrpc": "2.0", "id": 1, "result": {}}"#;

    #[test]
    fn an_event_is_bounded_from_its_start_to_the_blank_line_that_ends_it() {
        let mut open = OpenEvent::new(20);
        // Lines of an event add up, whatever their ends; a blank line starts the count again.
        assert!(open.within(b"data: 12345\r\n"));
        assert!(!open.within(b"data: 12345\n"));
        let mut open = OpenEvent::new(20);
        for ending in ["\n\n", "\r\n\r\n", "\r\r"] {
            for _ in 0..10 {
                assert!(
                    open.within(format!("data: 12345{ending}").as_bytes()),
                    "{ending:?}"
                );
            }
        }
        // Split anywhere, the same.
        let mut open = OpenEvent::new(20);
        for _ in 0..10 {
            assert!(open.within(b"data: 12345\r"));
            assert!(open.within(b"\n\r"));
            assert!(open.within(b"\n"));
        }
    }

    #[tokio::test]
    async fn a_json_answer_within_the_bound_is_read_and_one_past_it_is_not() {
        let url = answering("application/json", ANSWER.into()).await;
        let answered = post(&url, 1024).await;
        assert!(
            matches!(&answered, Ok(Answer::Json(body, Some(session)))
                if session == "s1" && body == ANSWER.as_bytes()),
            "{answered:?}"
        );
        let long = format!(
            r#"{{"jsonrpc": "2.0", "id": 1, "result": {{"x": "{}"}}}}"#,
            "x".repeat(4096)
        );
        let url = answering("application/json", long.into()).await;
        let failed = post(&url, 1024).await;
        assert!(
            matches!(
                failed,
                Err(StreamableHttpError::Client(HttpError::TooLong {
                    most: 1024
                }))
            ),
            "{failed:?}"
        );
    }

    #[tokio::test]
    async fn a_server_that_takes_a_request_and_never_answers_is_given_up_on() {
        // It reads the request and holds the connection, answering nothing.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0u8; 64 * 1024];
            let _ = socket.read(&mut request).await;
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        });
        let within = std::time::Duration::from_millis(300);
        let client = BoundedHttp::new(reqwest::Client::new(), 1024).answering_within(within);
        let request = client.post(&url, &ping(), None, None);
        let posted = tokio::time::timeout(
            std::time::Duration::from_secs(30),
            client.answer(request, Some(1.into())),
        )
        .await
        .expect("the answer was given up on, as its bound says");
        assert!(
            matches!(
                posted,
                Err(StreamableHttpError::Client(HttpError::NoAnswer(w))) if w == within
            ),
            "{posted:?}"
        );
    }

    #[tokio::test]
    async fn a_failure_does_not_quote_the_urls_query() {
        // Nothing listens on port 1: the connection is refused.
        let failed = post("http://127.0.0.1:1/mcp?api_key=SECRET", 1024).await;
        let Err(failed) = failed else {
            panic!("a refused connection answered");
        };
        let text = format!("{failed} {failed:?}");
        assert!(!text.contains("SECRET"), "{text}");
    }

    /// A request is answered on a stream of its own, which `post_message` returns at once: `rmcp`
    /// waits for `post_message` before it sends anything else on the session. The stream holds
    /// the server's JSON answer as its one event, or, when the answer could not be read, an error
    /// answer to the request marked as the client's ([`unanswered`]), without the URL's query.
    #[tokio::test]
    async fn a_request_is_answered_on_a_stream_of_its_own() {
        let posted = |url: String| async move {
            tokio::time::timeout(
                std::time::Duration::from_secs(5),
                BoundedHttp::new(reqwest::Client::new(), 1024).post_message(
                    url.into(),
                    ping(),
                    None,
                    None,
                ),
            )
            .await
            .expect("post_message waited for the answer")
        };
        // A server that takes the request and never answers: post_message still returns.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent = format!("http://{}/mcp", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let _held = listener.accept().await;
            tokio::time::sleep(std::time::Duration::from_secs(3600)).await;
        });
        assert!(matches!(
            posted(silent).await,
            Ok(StreamableHttpPostResponse::Sse(..))
        ));
        let url = answering("application/json", ANSWER.into()).await;
        let Ok(StreamableHttpPostResponse::Sse(events, _)) = posted(url).await else {
            panic!("a request was answered in the call");
        };
        let answer: ServerJsonRpcMessage = serde_json::from_str(ANSWER).unwrap();
        assert_eq!(
            serde_json::to_value(messages(events).await).unwrap(),
            serde_json::to_value([answer]).unwrap()
        );
        let Ok(StreamableHttpPostResponse::Sse(events, _)) =
            posted("http://127.0.0.1:1/mcp?api_key=SECRET".to_owned()).await
        else {
            panic!("a request was answered in the call");
        };
        let read = messages(events).await;
        let [ServerJsonRpcMessage::Error(error)] = read.as_slice() else {
            panic!("{read:?}");
        };
        assert_eq!(error.id, rmcp::model::RequestId::Number(1));
        assert!(unanswered(&error.error), "{error:?}");
        assert!(!error.error.message.contains("SECRET"), "{error:?}");
        // A request taken and not answered (against the protocol) may still be answered on the
        // session's own event stream, as before: nothing is made up for it.
        let url = answering_with("202 Accepted", "application/json", Vec::new()).await;
        let Ok(StreamableHttpPostResponse::Sse(events, _)) = posted(url).await else {
            panic!("a request was answered in the call");
        };
        assert!(messages(events).await.is_empty());
        // A server's own error answer is the server's.
        let refused = r#"{"jsonrpc": "2.0", "id": 1, "error": {"code": -32601, "message": "no"}}"#;
        let url = answering("application/json", refused.into()).await;
        let Ok(StreamableHttpPostResponse::Sse(events, _)) = posted(url).await else {
            panic!("a request was answered in the call");
        };
        let read = messages(events).await;
        let [ServerJsonRpcMessage::Error(error)] = read.as_slice() else {
            panic!("{read:?}");
        };
        assert!(!unanswered(&error.error), "{error:?}");
    }

    /// A long run of events all ready at once is passed on with the stream giving way between
    /// them, every event still read in order.
    #[test]
    fn a_run_of_ready_events_gives_way_now_and_then() {
        let mut events = GiveWay::new(futures::stream::iter(0..1000));
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        let (mut read, mut gave_way, mut run, mut longest) = (Vec::new(), 0, 0, 0);
        loop {
            match events.poll_next_unpin(&mut cx) {
                std::task::Poll::Ready(Some(n)) => {
                    read.push(n);
                    run += 1;
                    longest = longest.max(run);
                }
                std::task::Poll::Ready(None) => break,
                std::task::Poll::Pending => {
                    gave_way += 1;
                    run = 0;
                }
            }
        }
        assert_eq!(read, (0..1000).collect::<Vec<_>>());
        assert_eq!(longest, EVENTS_A_POLL);
        assert_eq!(gave_way, 1000 / EVENTS_A_POLL);
    }

    #[tokio::test]
    async fn an_event_line_past_the_bound_fails_the_stream_and_short_ones_are_read() {
        let events = format!("data: {ANSWER}\n\ndata: {ANSWER}\n\n");
        let url = answering("text/event-stream", events.into()).await;
        let Ok(Answer::Events(stream, _)) = post(&url, 1024).await else {
            panic!("no event stream");
        };
        let read: Vec<_> = stream.collect().await;
        assert_eq!(read.len(), 2, "{read:?}");
        assert!(read.iter().all(Result::is_ok), "{read:?}");

        let endless = format!("data: {}", "x".repeat(8192));
        let url = answering("text/event-stream", endless.into()).await;
        let Ok(Answer::Events(stream, _)) = post(&url, 1024).await else {
            panic!("no event stream");
        };
        let read: Vec<_> = stream.collect().await;
        // The request's answer: an error saying why, and nothing after it.
        let [Ok(Sse {
            data: Some(answer), ..
        })] = &read[..]
        else {
            panic!("{read:?}");
        };
        let answer: serde_json::Value = serde_json::from_str(answer).unwrap();
        assert_eq!(answer["id"], 1);
        assert!(
            answer["error"]["message"]
                .as_str()
                .unwrap()
                .contains("1024 bytes"),
            "{answer}"
        );
    }
}
