//! Clients that stop taking what they are sent. A connection whose writes make no progress for a
//! while is closed, and a stranger's answer must be taken within its query's time limit, its
//! query's turn held until then: answers written to clients that do not read would otherwise
//! pile up in memory, up to `AGGREGATOR_MAX_ANSWER_BYTES` each, with nothing to bound them.
//! (Hyper, under axum, writes for as long as the socket lets it, with no write timeout of its
//! own, and does not look at a response's body while its socket is full.)

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use axum::serve::Listener;
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Accepts as `inner` does; each connection's writes are bounded by [`StallBoundedIo`].
pub struct StallBounded<L> {
    inner: L,
    most_stalled: Duration,
}

impl<L> StallBounded<L> {
    /// Connections accepted from `inner`, closed when a write waits longer than `most_stalled`.
    pub fn new(inner: L, most_stalled: Duration) -> Self {
        StallBounded {
            inner,
            most_stalled,
        }
    }
}

impl<L: Listener> Listener for StallBounded<L> {
    type Io = StallBoundedIo<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (inner, addr) = self.inner.accept().await;
        (StallBoundedIo::new(inner, self.most_stalled), addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection whose write (or flush) that cannot go on fails once it has waited
/// `most_stalled` since the last one that did: the server then drops the connection and the
/// response it was writing. Reads are as they were: an idle connection waits to be asked.
pub struct StallBoundedIo<T> {
    inner: T,
    most_stalled: Duration,
    /// Set at the first write that had to wait, cleared by the next that went on.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> StallBoundedIo<T> {
    fn new(inner: T, most_stalled: Duration) -> Self {
        StallBoundedIo {
            inner,
            most_stalled,
            stalled: None,
        }
    }

    fn bounded<R>(
        &mut self,
        cx: &mut Context<'_>,
        attempt: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        match attempt {
            Poll::Ready(done) => {
                self.stalled = None;
                Poll::Ready(done)
            }
            Poll::Pending => {
                let most = self.most_stalled;
                let timer = self
                    .stalled
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(most)));
                match timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("the client took nothing written to it for {most:?}"),
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallBoundedIo<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallBoundedIo<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let attempt = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.bounded(cx, attempt)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let attempt = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.bounded(cx, attempt)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let attempt = Pin::new(&mut this.inner).poll_flush(cx);
        this.bounded(cx, attempt)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let attempt = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.bounded(cx, attempt)
    }
}

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

    #[tokio::test]
    async fn a_write_that_cannot_go_on_fails_after_the_bound() {
        use tokio::io::AsyncWriteExt;
        // The pipe takes 1 KiB, and nobody reads the far end.
        let (near, _far) = tokio::io::duplex(1024);
        let mut io = StallBoundedIo::new(near, Duration::from_millis(300));
        let written = tokio::time::timeout(Duration::from_secs(10), io.write_all(&[1; 4096])).await;
        let refused = written.map(|w| w.map_err(|e| e.kind()));
        assert!(matches!(refused, Ok(Err(io::ErrorKind::TimedOut))));
    }

    #[tokio::test]
    async fn a_client_that_keeps_taking_is_not_cut_off() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (near, mut far) = tokio::io::duplex(1024);
        let mut io = StallBoundedIo::new(near, Duration::from_secs(2));
        let writing =
            tokio::spawn(async move { io.write_all(&[1; 6 * 1024]).await.map_err(|e| e.kind()) });
        // 1 KiB each 400 ms: 2.4 s in all, longer than the bound, each wait far shorter.
        let mut taken = 0;
        let mut some = [0; 1024];
        while taken < 6 * 1024 {
            tokio::time::sleep(Duration::from_millis(400)).await;
            match far.read(&mut some).await {
                Ok(0) | Err(_) => break,
                Ok(n) => taken += n,
            }
        }
        assert!(matches!(writing.await, Ok(Ok(()))));
    }
}
