//! Answers a client must take in time. A stranger's answer is handed to the server in small
//! frames, its query's turn held for as long as any of them is, and past the query's time limit
//! the rest is an error that closes the connection: answers written to clients that do not read
//! would otherwise pile up in memory, up to `AGGREGATOR_MAX_ANSWER_BYTES` each. (The connection's
//! writes themselves are bounded by `agent_serve`.)

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Frame, SizeHint};
use tokio::time::Instant;

/// What one frame of an answer carries. The server asks for the next frame once what it has
/// queued falls under its mark (about 400 KiB), so small frames have the deadline looked at as
/// the client takes the answer, not only after hundreds of KiB more.
const ANSWER_CHUNK: usize = 16 * 1024;

/// A written answer handed to the server a chunk at a time. Past `deadline` the next chunk is an
/// error, which makes the server drop the connection. What is held with it (its query's turn)
/// lives with the answer's bytes: the server lets go of the body once it has taken the last
/// chunk, while the chunks it took may still wait to be written, each keeping the whole answer
/// in memory.
pub struct HeldAnswer {
    bytes: Bytes,
    deadline: Instant,
}

/// An answer's bytes and what is held with them.
struct HeldBytes<H> {
    bytes: Vec<u8>,
    _held: H,
}

impl<H> AsRef<[u8]> for HeldBytes<H> {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl HeldAnswer {
    pub fn new<H: Send + 'static>(bytes: Vec<u8>, within: Duration, held: H) -> Self {
        HeldAnswer {
            bytes: Bytes::from_owner(HeldBytes { bytes, _held: held }),
            deadline: Instant::now() + within,
        }
    }
}

impl http_body::Body for HeldAnswer {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if this.bytes.is_empty() {
            return Poll::Ready(None);
        }
        if Instant::now() >= this.deadline {
            return Poll::Ready(Some(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not take its answer within the query's time limit",
            ))));
        }
        let chunk = this.bytes.split_to(ANSWER_CHUNK.min(this.bytes.len()));
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.bytes.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.bytes.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body::Body;

    async fn next_frame<B: Body + Unpin>(body: &mut B) -> Option<Result<Frame<B::Data>, B::Error>> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
    }

    #[tokio::test]
    async fn an_answer_is_given_whole_in_chunks_and_holds_its_turn_while_any_is_held() {
        let turns = std::sync::Arc::new(tokio::sync::Semaphore::new(1));
        let turn = turns.clone().try_acquire_owned().ok();
        let text: Vec<u8> = (0..(3 * ANSWER_CHUNK + 5))
            .map(|i| (i % 251) as u8)
            .collect();
        let mut answer = HeldAnswer::new(text.clone(), Duration::from_secs(60), turn);
        assert_eq!(answer.size_hint().exact(), Some(text.len() as u64));
        let mut chunks = Vec::new();
        while let Some(frame) = next_frame(&mut answer).await {
            let data = frame.ok().and_then(|f| f.into_data().ok());
            chunks.push(data.unwrap_or_default());
            assert_eq!(turns.available_permits(), 0, "held while it is written");
        }
        assert_eq!(chunks.concat(), text);
        assert_eq!(chunks.len(), 4);
        drop(answer);
        // The server may still hold the last chunks it took, and with them the whole answer.
        let last = chunks.pop();
        drop(chunks);
        assert_eq!(turns.available_permits(), 0, "held while a chunk is");
        drop(last);
        assert_eq!(turns.available_permits(), 1);
    }

    #[tokio::test]
    async fn an_answer_not_taken_in_time_is_an_error() {
        let mut answer = HeldAnswer::new(vec![7; 2 * ANSWER_CHUNK], Duration::from_secs(1), ());
        assert!(matches!(next_frame(&mut answer).await, Some(Ok(_))));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(matches!(next_frame(&mut answer).await, Some(Err(_))));
    }
}
