//! Asking a service over its non-persistent request topic, as TrustGraph's services are asked: a
//! request the broker found no room for is lost, not kept, so it is sent again under its id until
//! an answer comes or the time is up.

use std::future::Future;
use std::time::Duration;

use tokio::time::{timeout_at, Instant};

use crate::{BusError, Properties, Publisher};

/// Sends `payload` (its properties carry the id the answer will name) up to `sends` times, after
/// each `timeout / sends` without an answer, and waits for `answer` until `timeout` is up. Sends
/// are bounded by the same deadline, so a broker that takes a request and never confirms it
/// cannot hold the caller past it. `Ok(None)`: no answer in time.
pub(crate) async fn ask<A>(
    requests: &Publisher,
    payload: &[u8],
    properties: &Properties,
    sends: u32,
    timeout: Duration,
    answer: &mut (impl Future<Output = Result<A, BusError>> + Unpin),
) -> Result<Option<A>, BusError> {
    let sends = sends.max(1);
    let deadline = Instant::now() + timeout;
    for sent in 1..=sends {
        if sent > 1 && Instant::now() >= deadline {
            break;
        }
        match timeout_at(deadline, requests.send(payload.to_vec(), properties)).await {
            Ok(result) => result?,
            Err(_) => return Ok(None),
        }
        let until = if sent == sends {
            deadline
        } else {
            (Instant::now() + timeout / sends).min(deadline)
        };
        if let Ok(answered) = timeout_at(until, &mut *answer).await {
            return answered.map(Some);
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::embedded::EmbeddedBroker;
    use crate::{Bus, Listener};

    /// The requests the broker carried to `heard` within a short wait.
    async fn carried(heard: &mut Listener) -> usize {
        let mut count = 0;
        while let Ok(Ok(payload)) =
            tokio::time::timeout(Duration::from_millis(400), heard.next_payload()).await
        {
            assert_eq!(payload, b"question");
            count += 1;
        }
        count
    }

    #[tokio::test]
    async fn a_request_is_sent_again_until_answered_and_not_after() {
        let broker = EmbeddedBroker::start(0, None).unwrap();
        let bus = Bus::connect(&broker.url(), None).await.unwrap();
        let topic = "non-persistent://public/default/resend-test";
        let mut heard = Listener::subscribe(&bus, topic, "heard").await.unwrap();
        let requests = Publisher::new(&bus, topic).await.unwrap();
        let properties = Properties::new();
        // Margins of a second: a loaded machine may not poll the caller for a while.
        let timeout = Duration::from_secs(3);

        let mut never = std::future::pending::<Result<u8, BusError>>();
        let answer = ask(&requests, b"question", &properties, 3, timeout, &mut never).await;
        assert!(answer.unwrap().is_none());
        assert_eq!(carried(&mut heard).await, 3);

        // Answered after the second send (each waits a third of the timeout).
        let mut later = Box::pin(async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            Ok::<u8, BusError>(7)
        });
        let answer = ask(&requests, b"question", &properties, 3, timeout, &mut later).await;
        assert_eq!(answer.unwrap(), Some(7));
        assert_eq!(carried(&mut heard).await, 2);

        // A request that must not be repeated is sent once, and waits the whole timeout.
        let mut late = Box::pin(async {
            tokio::time::sleep(Duration::from_millis(2000)).await;
            Ok::<u8, BusError>(8)
        });
        let answer = ask(&requests, b"question", &properties, 1, timeout, &mut late).await;
        assert_eq!(answer.unwrap(), Some(8));
        assert_eq!(carried(&mut heard).await, 1);
    }
}
