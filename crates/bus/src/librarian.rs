//! A client of TrustGraph's librarian, the document store of a TrustGraph deployment: long texts
//! are kept there as documents named by their IRI, and read back. Many steps share one client:
//! answers are matched to requests by the `id` property, whoever waits for them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_schema::{
    librarian_operation, DocumentMetadata, LibrarianRequest, LibrarianResponse, ID_PROPERTY,
};
use base64::Engine as _;
use tokio::sync::oneshot;

use crate::client::{message_property, Listener};
use crate::{Bus, BusError, Properties, Publisher, Topics};

type Waiting = Arc<Mutex<HashMap<String, oneshot::Sender<LibrarianResponse>>>>;

/// Asks the librarian; any number of requests at once.
pub struct Librarian {
    requests: Publisher,
    waiting: Waiting,
    answers: tokio::task::JoinHandle<()>,
    /// How long a request waits for its answer.
    timeout: Duration,
}

impl Drop for Librarian {
    fn drop(&mut self) {
        self.answers.abort();
    }
}

/// What the librarian said about a document.
#[derive(Debug)]
pub enum LibrarianError {
    /// Nothing came back in time, or the broker failed.
    Bus(BusError),
    /// The librarian answered with an error.
    Refused { kind: String, message: String },
}

impl std::fmt::Display for LibrarianError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LibrarianError::Bus(e) => write!(f, "{e}"),
            LibrarianError::Refused { kind, message } => {
                write!(f, "the librarian refused ({kind}): {message}")
            }
        }
    }
}

impl std::error::Error for LibrarianError {}

impl LibrarianError {
    /// Whether trying again may succeed: a refusal is the librarian's store failing (its
    /// Cassandra or object store unreachable), an outage like the broker's; a message over the
    /// broker's size limit is refused the same way every time.
    pub fn passes(&self) -> bool {
        match self {
            LibrarianError::Bus(e) => e.passes(),
            LibrarianError::Refused { .. } => true,
        }
    }
}

impl From<BusError> for LibrarianError {
    fn from(e: BusError) -> Self {
        LibrarianError::Bus(e)
    }
}

/// Room for a librarian request's fields beside a document's base64 bytes.
const ENVELOPE_BYTES: usize = 8 * 1024;

/// Whether a request keeping `text` stays within `max_message_bytes`.
fn fits_one_request(text: &str, max_message_bytes: usize) -> bool {
    text.len().div_ceil(3) * 4 + ENVELOPE_BYTES < max_message_bytes
}

impl Librarian {
    /// Whether `text` fits one request to the librarian: its bytes travel in base64 (a third
    /// more) inside a message the broker bounds. A text that does not is kept elsewhere (the
    /// graph's documents), since the librarian would be asked in vain.
    pub fn takes(&self, text: &str) -> bool {
        fits_one_request(text, self.requests.max_message_bytes())
    }

    /// A client of the librarian of `topics`' workspace; each request waits up to `timeout`.
    pub async fn connect(
        bus: &Bus,
        topics: &Topics,
        timeout: Duration,
    ) -> Result<Librarian, BusError> {
        let responses =
            Listener::subscribe(bus, &topics.librarian_response, "librarian-client").await?;
        let requests = Publisher::new(bus, &topics.librarian_request).await?;
        let waiting: Waiting = Arc::default();
        let answers = tokio::spawn(deliver_answers(bus.clone(), responses, waiting.clone()));
        Ok(Librarian {
            requests,
            waiting,
            answers,
            timeout,
        })
    }

    /// Keeps `text` as the document `uri` (plain text). A document of that IRI kept before is
    /// this same text (documents are named by their text's digest), so finding it there is done.
    pub async fn keep(&self, uri: &str, text: &str) -> Result<(), LibrarianError> {
        let request = LibrarianRequest {
            operation: librarian_operation::ADD_DOCUMENT.to_owned(),
            document_metadata: Some(DocumentMetadata {
                id: uri.to_owned(),
                time: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs()),
                kind: "text/plain".to_owned(),
                title: format!("agent text, {} bytes", text.len()),
                comments: "kept by the agent orchestrator (claim-check of a long text)".to_owned(),
                tags: vec!["agent".to_owned()],
            }),
            content: Some(base64::engine::general_purpose::STANDARD.encode(text)),
            ..LibrarianRequest::default()
        };
        match self.call(&request).await?.error {
            None => Ok(()),
            Some(e) if e.message.contains("already exists") => Ok(()),
            Some(e) => Err(LibrarianError::Refused {
                kind: e.kind,
                message: e.message,
            }),
        }
    }

    /// The text of the document `uri`; `None` when the librarian has no such document.
    pub async fn read(&self, uri: &str) -> Result<Option<String>, LibrarianError> {
        let request = LibrarianRequest {
            operation: librarian_operation::GET_DOCUMENT_CONTENT.to_owned(),
            document_id: Some(uri.to_owned()),
            ..LibrarianRequest::default()
        };
        let answer = self.call(&request).await?;
        if let Some(e) = answer.error {
            // TrustGraph 2.11 answers a missing document this way (`unexpected-error`).
            if e.message.contains("No such document") {
                return Ok(None);
            }
            return Err(LibrarianError::Refused {
                kind: e.kind,
                message: e.message,
            });
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(answer.content.unwrap_or_default())
            .map_err(|e| LibrarianError::Refused {
                kind: "bad-content".to_owned(),
                message: format!("the document's content is not base64: {e}"),
            })?;
        Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
    }

    /// Sends `request` and waits for its answer. The librarian's topics are non-persistent, as
    /// TrustGraph's are: a request the broker found no room for is lost, so it is sent again,
    /// under the same id, after each third of the timeout (both operations are safe to repeat).
    async fn call(&self, request: &LibrarianRequest) -> Result<LibrarianResponse, BusError> {
        let id = format!("{:032x}", rand::random::<u128>());
        let (answered, answer) = oneshot::channel();
        waiting_for(&self.waiting).insert(id.clone(), answered);
        // However the call ends (answered, timed out, failed, or dropped by a step that was
        // abandoned), nobody waits for its id any more.
        let _forget = Forget {
            waiting: &self.waiting,
            id: &id,
        };
        let mut properties = Properties::new();
        properties.insert(ID_PROPERTY.to_owned(), id.clone());
        // The answer's reader drops a sender whose answer did not decode (and says so).
        let mut answer = Box::pin(async {
            answer.await.map_err(|_| BusError::ConsumerStopped {
                topic: "librarian responses".into(),
                message: format!(
                    "the librarian's answer to '{}' does not decode",
                    request.operation
                ),
            })
        });
        let payload = agent_schema::encode(request);
        // Both operations are safe to repeat.
        crate::resend::ask(
            &self.requests,
            &payload,
            &properties,
            3,
            self.timeout,
            &mut answer,
        )
        .await?
        .ok_or_else(|| BusError::Timeout {
            what: format!("the librarian's answer to '{}'", request.operation),
            after: self.timeout,
        })
    }
}

/// Forgets a call's id when the call ends.
struct Forget<'c> {
    waiting: &'c Waiting,
    id: &'c str,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        waiting_for(self.waiting).remove(self.id);
    }
}

fn waiting_for(
    waiting: &Waiting,
) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<LibrarianResponse>>> {
    waiting
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Hands each answer to whoever waits for its id; listens again if the subscription is lost (a
/// broker restart), since the requests of that moment are sent again anyway.
async fn deliver_answers(bus: Bus, mut responses: Listener, waiting: Waiting) {
    loop {
        let message = match responses.next().await {
            Ok(message) => message,
            Err(e) => {
                tracing::warn!(error = %e, "lost the librarian's answers; listening again");
                responses
                    .subscribe_again_until_taken(&bus, "the librarian")
                    .await;
                continue;
            }
        };
        let Some(id) = message_property(&message, ID_PROPERTY) else {
            continue;
        };
        let Some(answered) = waiting_for(&waiting).remove(id) else {
            continue;
        };
        match agent_schema::decode::<LibrarianResponse>(&message.payload.data) {
            Ok(response) => {
                let _ = answered.send(response);
            }
            Err(e) => {
                tracing::warn!(error = %e, "skipping a librarian answer that does not decode")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_fits_a_request_with_its_base64_and_the_envelope() {
        let limit = 64 * 1024;
        // 42,000 bytes are 56,000 in base64; with the envelope's 8,192 that is 64,192 < 65,536.
        assert!(fits_one_request(&"a".repeat(42_000), limit));
        // 43,000 bytes: 57,336 in base64, 65,528 with the envelope: still under.
        assert!(fits_one_request(&"a".repeat(43_000), limit));
        // 43,008 bytes: 57,344, 65,536 with the envelope: at the limit, refused.
        assert!(!fits_one_request(&"a".repeat(43_008), limit));
        assert!(!fits_one_request(&"a".repeat(60_000), limit));
        // The last partial group of three bytes takes four characters.
        assert!(!fits_one_request("a", 4 + ENVELOPE_BYTES));
        assert!(fits_one_request("a", 5 + ENVELOPE_BYTES));
    }
}
