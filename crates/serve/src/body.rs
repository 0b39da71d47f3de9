//! A request body that must come whole within a time of its head: hyper's timer stops once a
//! head is read, so a client that announced a body and sent it a byte at a time (or never) held
//! its connection, and a handler waiting for it, for as long as it liked.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use http_body::{Frame, SizeHint};
use tokio::time::{Instant, Sleep};

pub struct DeadlineBody {
    inner: Body,
    deadline: Pin<Box<Sleep>>,
    /// Set once the deadline has passed with the body not whole, for the server to answer 408
    /// whatever the handler made of the error (axum's extractors answer 400).
    late: Arc<AtomicBool>,
}

impl DeadlineBody {
    pub fn new(inner: Body, deadline: Instant, late: Arc<AtomicBool>) -> DeadlineBody {
        DeadlineBody {
            inner,
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            late,
        }
    }
}

impl http_body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => {
                    this.late.store(true, Ordering::Relaxed);
                    Poll::Ready(Some(Err(axum::Error::new(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the request's body did not come whole in time",
                    )))))
                }
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use std::time::Duration;

    #[tokio::test]
    async fn a_body_that_stops_coming_is_an_error_at_its_deadline_and_a_whole_one_is_not() {
        let (sender, mut held_back) = tokio::sync::mpsc::channel::<io::Result<Frame<Bytes>>>(4);
        let stream = futures::stream::poll_fn(move |cx| held_back.poll_recv(cx));
        let streamed = http_body_util::StreamBody::new(stream);
        let deadline = Instant::now() + Duration::from_millis(300);
        let late = Arc::new(AtomicBool::new(false));
        let mut body = DeadlineBody::new(Body::new(streamed), deadline, late.clone());
        let part = Frame::data(Bytes::from_static(b"part"));
        assert!(sender.send(Ok(part)).await.is_ok());
        assert!(matches!(body.frame().await, Some(Ok(_))));
        let started = std::time::Instant::now();
        let stalled = body.frame().await;
        assert!(matches!(stalled, Some(Err(_))), "{stalled:?}");
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(late.load(Ordering::Relaxed));
        drop(sender);

        let within = Instant::now() + Duration::from_secs(5);
        let on_time = Arc::new(AtomicBool::new(false));
        let whole = DeadlineBody::new(Body::from("all of it"), within, on_time.clone());
        let collected = whole.collect().await.map(|c| c.to_bytes());
        assert_eq!(collected.ok(), Some(Bytes::from_static(b"all of it")));
        assert!(!on_time.load(Ordering::Relaxed));
    }
}
