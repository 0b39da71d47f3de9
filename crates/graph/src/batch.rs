//! Group commit for calls to a remote service: a call made while none is on its way goes at once;
//! calls made while one is on its way wait for it and then go together in one. So an idle caller
//! pays no added latency, and a busy one pays one round trip (and one store transaction at the
//! other end) for many calls instead of one each.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use tokio::sync::{mpsc, oneshot};

use crate::GraphError;

type Reply<A> = oneshot::Sender<Result<A, GraphError>>;
type Call<Q, A> = Arc<
    dyn Fn(Vec<Q>) -> Pin<Box<dyn Future<Output = Result<Vec<A>, GraphError>> + Send>>
        + Send
        + Sync,
>;

/// Calls of one kind, batched. The worker starts with the first call (so constructing one needs no
/// runtime) and ends when the batcher is dropped.
pub struct Batcher<Q, A> {
    max: usize,
    call: Call<Q, A>,
    queue: OnceLock<mpsc::UnboundedSender<(Q, Reply<A>)>>,
}

impl<Q: Send + 'static, A: Send + 'static> Batcher<Q, A> {
    /// `call` sends one batch (at most `max` calls) and answers each, in order.
    pub fn new<F, Fut>(max: usize, call: F) -> Batcher<Q, A>
    where
        F: Fn(Vec<Q>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<A>, GraphError>> + Send + 'static,
    {
        Batcher {
            max: max.max(1),
            call: Arc::new(move |batch| Box::pin(call(batch))),
            queue: OnceLock::new(),
        }
    }

    /// Makes one call, in whichever batch it joins.
    pub async fn call(&self, question: Q) -> Result<A, GraphError> {
        let (reply, answer) = oneshot::channel();
        let queue = self.queue.get_or_init(|| self.start());
        queue
            .send((question, reply))
            .map_err(|_| GraphError::Transport("the batching worker has stopped".to_owned()))?;
        answer
            .await
            .map_err(|_| GraphError::Transport("the batching worker dropped a call".to_owned()))?
    }

    fn start(&self) -> mpsc::UnboundedSender<(Q, Reply<A>)> {
        let (queue, mut calls) = mpsc::unbounded_channel::<(Q, Reply<A>)>();
        let (max, call) = (self.max, self.call.clone());
        tokio::spawn(async move {
            while let Some(first) = calls.recv().await {
                let batch = gather(first, max, || calls.try_recv().ok());
                let (questions, replies): (Vec<Q>, Vec<Reply<A>>) = batch.into_iter().unzip();
                let asked = questions.len();
                match call(questions).await {
                    Ok(answers) if answers.len() == asked => {
                        for (reply, answer) in replies.into_iter().zip(answers) {
                            // A caller that went away no longer wants its answer.
                            let _ = reply.send(Ok(answer));
                        }
                    }
                    Ok(answers) => {
                        let wrong = GraphError::Malformed(format!(
                            "{} answers to a batch of {asked} calls",
                            answers.len()
                        ));
                        for reply in replies {
                            let _ = reply.send(Err(wrong.clone()));
                        }
                    }
                    Err(e) => {
                        for reply in replies {
                            let _ = reply.send(Err(e.clone()));
                        }
                    }
                }
            }
        });
        queue
    }
}

/// A batch: `first`, then what `waiting` still has at hand, `max` in all at most.
pub(crate) fn gather<T>(first: T, max: usize, mut waiting: impl FnMut() -> Option<T>) -> Vec<T> {
    let mut batch = vec![first];
    while batch.len() < max {
        match waiting() {
            Some(next) => batch.push(next),
            None => break,
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn calls_made_while_one_is_on_its_way_share_the_next() {
        let batches = Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
        let seen = batches.clone();
        let batcher = Arc::new(Batcher::new(100, move |batch: Vec<u32>| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(batch.len());
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                Ok(batch.into_iter().map(|q| q * 2).collect())
            }
        }));
        let first = {
            let batcher = batcher.clone();
            tokio::spawn(async move { batcher.call(1).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        let rest: Vec<_> = (2..=9)
            .map(|q| {
                let batcher = batcher.clone();
                tokio::spawn(async move { batcher.call(q).await })
            })
            .collect();
        assert_eq!(first.await.unwrap().unwrap(), 2);
        for (q, call) in (2..=9).zip(rest) {
            assert_eq!(call.await.unwrap().unwrap(), q * 2);
        }
        assert_eq!(*batches.lock().unwrap(), vec![1, 8]);
    }

    #[tokio::test]
    async fn a_failed_batch_fails_each_of_its_calls_and_the_next_goes_on() {
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        let batcher = Batcher::new(10, move |batch: Vec<u32>| {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    Err(GraphError::Transport("down".into()))
                } else {
                    Ok(batch)
                }
            }
        });
        assert!(matches!(
            batcher.call(1).await,
            Err(GraphError::Transport(_))
        ));
        assert_eq!(batcher.call(2).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn a_short_answer_is_an_error_not_a_misattribution() {
        let batcher = Batcher::new(10, |_batch: Vec<u32>| async { Ok(Vec::<u32>::new()) });
        assert!(matches!(
            batcher.call(1).await,
            Err(GraphError::Malformed(_))
        ));
    }
}
