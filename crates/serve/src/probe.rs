//! A readiness probe anyone may call that does not pass every call on: an anonymous `/readyz`
//! was a query to the store each (on an orchestrator or a replica, one with the services' token,
//! which takes no turn at the store). The store is asked at most once per `every`, one probe at a
//! time, for at most `within`; while one is under way the last answer stands. A probe runs on its
//! own, so a caller that goes away does not take it (and its answer) with it.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// When the probed thing was last asked, and what it said.
type Probed = (Instant, Result<(), String>);

pub struct Probe {
    every: Duration,
    within: Duration,
    last: Arc<Mutex<Option<Probed>>>,
    probing: Arc<tokio::sync::Mutex<()>>,
}

impl Probe {
    pub fn new(every: Duration, within: Duration) -> Probe {
        Probe {
            every,
            within,
            last: Arc::default(),
            probing: Arc::default(),
        }
    }

    fn last(&self) -> Option<Probed> {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn fresh(&self) -> Option<Result<(), String>> {
        self.last()
            .filter(|(at, _)| at.elapsed() < self.every)
            .map(|(_, answer)| answer)
    }

    /// The answer of `ask`, or of a recent or concurrent call of it (see the module's note).
    pub async fn answer<F, Fut>(&self, ask: F) -> Result<(), String>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        if let Some(answer) = self.fresh() {
            return answer;
        }
        let probing = match self.probing.clone().try_lock_owned() {
            Ok(probing) => probing,
            Err(_) => match self.last() {
                Some((_, answer)) => return answer,
                // The first probe: wait for it.
                None => self.probing.clone().lock_owned().await,
            },
        };
        // Another may have probed while this one waited.
        if let Some(answer) = self.fresh() {
            return answer;
        }
        let (asked, within, last) = (ask(), self.within, self.last.clone());
        let probe = tokio::spawn(async move {
            let answer = match tokio::time::timeout(within, asked).await {
                Ok(answer) => answer,
                Err(_) => Err(format!("no answer within {within:?}")),
            };
            *last.lock().unwrap_or_else(PoisonError::into_inner) =
                Some((Instant::now(), answer.clone()));
            drop(probing);
            answer
        });
        probe
            .await
            .unwrap_or_else(|e| Err(format!("the probe failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[tokio::test]
    async fn many_callers_make_one_probe_and_a_slow_one_leaves_the_last_answer_standing() {
        let probe = Arc::new(Probe::new(
            Duration::from_millis(200),
            Duration::from_millis(500),
        ));
        let asked = Arc::new(AtomicUsize::new(0));
        let ask = |answer: Result<(), String>, taking: Duration| {
            let asked = asked.clone();
            move || async move {
                asked.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(taking).await;
                answer
            }
        };
        // The first callers all wait for the first probe.
        let first: Vec<_> = (0..20)
            .map(|_| {
                let probe = probe.clone();
                let ask = ask(Ok(()), Duration::from_millis(50));
                tokio::spawn(async move { probe.answer(ask).await })
            })
            .collect();
        for answer in first {
            assert!(matches!(answer.await, Ok(Ok(()))));
        }
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // Within `every`, the answer stands without asking.
        assert!(probe
            .answer(ask(Err("down".into()), Duration::ZERO))
            .await
            .is_ok());
        assert_eq!(asked.load(Ordering::SeqCst), 1);
        // Past it, one slow probe; meanwhile the last answer stands for everyone else.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let slow = {
            let probe = probe.clone();
            let ask = ask(Err("down".into()), Duration::from_millis(300));
            tokio::spawn(async move { probe.answer(ask).await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(probe
            .answer(ask(Err("other".into()), Duration::ZERO))
            .await
            .is_ok());
        assert_eq!(slow.await.ok(), Some(Err("down".to_owned())));
        assert_eq!(asked.load(Ordering::SeqCst), 2);
        assert_eq!(
            probe.answer(ask(Ok(()), Duration::ZERO)).await,
            Err("down".to_owned())
        );
        // A probe that takes longer than `within` is an answer too.
        tokio::time::sleep(Duration::from_millis(250)).await;
        let late = probe.answer(ask(Ok(()), Duration::from_secs(5))).await;
        assert_eq!(late, Err("no answer within 500ms".to_owned()));
    }

    #[tokio::test]
    async fn a_caller_that_goes_away_does_not_take_the_probe_with_it() {
        let probe = Arc::new(Probe::new(Duration::from_secs(60), Duration::from_secs(5)));
        let caller = {
            let probe = probe.clone();
            tokio::spawn(async move {
                let slow = || async {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Err("down".to_owned())
                };
                probe.answer(slow).await
            })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        caller.abort();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let asked_again = probe.answer(|| async { Ok(()) }).await;
        assert_eq!(
            asked_again,
            Err("down".to_owned()),
            "the probe's answer stands"
        );
    }
}
