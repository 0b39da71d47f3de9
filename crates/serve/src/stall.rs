//! Connections whose writes must make progress: a client that stops taking what it is sent is cut
//! off after a while, instead of holding the response (and whatever the response holds) for as
//! long as it keeps its connection open. Hyper writes for as long as the socket lets it, with no
//! write timeout of its own.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

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
    pub fn new(inner: T, most_stalled: Duration) -> Self {
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

#[cfg(test)]
mod tests {
    use super::*;

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
