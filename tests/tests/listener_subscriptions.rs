//! A reader's subscription on Apache Pulsar itself: every reader of responses, controls, config
//! answers and pushes (`agent_bus::Listener`) reads from the moment it subscribes and never comes
//! back for what it missed, so its subscription must end with it. A durable one stays after its
//! reader has gone; on a persistent topic (the topics are configurable) each `agentctl invoke` or
//! replica restart would then leave a subscription holding every later message for good.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::{AgentClient, Bus, Topics};
use agent_e2e::apache::ApacheBroker;

const RESPONSES: &str = "persistent://tg/response/agent:default:default";

/// The subscriptions the response topic has, by the broker's topic stats (empty while the topic
/// is not there).
fn subscriptions_of_responses(broker: &ApacheBroker) -> Vec<String> {
    let (status, stats) = broker
        .admin(
            "GET",
            "/admin/v2/persistent/tg/response/agent:default:default/stats",
            "",
        )
        .unwrap();
    if status != 200 {
        return Vec::new();
    }
    let stats: serde_json::Value = serde_json::from_str(&stats).unwrap();
    stats["subscriptions"]
        .as_object()
        .map(|subscriptions| subscriptions.keys().cloned().collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_readers_subscription_on_a_persistent_topic_ends_with_the_reader() {
    let broker = ApacheBroker::start(0, None).unwrap();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics {
        response: RESPONSES.to_owned(),
        ..Topics::trustgraph("default", "default")
    };
    let client = AgentClient::connect(&bus, &topics).await.unwrap();
    let subscribed = subscriptions_of_responses(&broker);
    assert_eq!(
        subscribed.len(),
        1,
        "the client's subscription of {RESPONSES} is not in the broker's stats: {subscribed:?}"
    );

    drop(client);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let left = subscriptions_of_responses(&broker);
        if left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "30 s after its reader went, the subscription is still there, holding what is published: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
