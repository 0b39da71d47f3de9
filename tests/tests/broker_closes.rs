//! A consumer the broker closes, on Apache Pulsar itself: a topic unloaded (a load balancer moving
//! it, a broker stopping cleanly) tells its consumers to go and subscribe again. When that
//! subscribing is refused, the `pulsar` crate's consumer went on subscribed to nothing, its stream
//! open for ever (our patch of the crate now ends the stream); the orchestrator must subscribe
//! again, or it would serve nothing more while looking alive.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::{AgentClient, Bus, Topics};
use agent_e2e::apache::ApacheBroker;
use agent_e2e::*;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

const SCRIPT: &str = r#"{"rules": [
    {"match": "Question: ", "reply": "Thought: easy.\nFinal Answer: pong"}
]}"#;

/// Calls the broker's admin API, which must answer 2xx.
fn admin(broker: &ApacheBroker, method: &str, path: &str, body: &str) {
    let (status, answer) = broker.admin(method, path, body).unwrap();
    assert!(
        (200..300).contains(&status),
        "{method} {path}: {status} {answer}"
    );
}

/// How many consumers the orchestrator's subscription of the request topic has, by the broker's
/// topic stats (`None` while the topic or the subscription is not there).
fn consumers_of_requests(broker: &ApacheBroker) -> Option<usize> {
    let (status, stats) = broker
        .admin(
            "GET",
            "/admin/v2/persistent/tg/request/agent:default:default/stats",
            "",
        )
        .ok()?;
    if status != 200 {
        return None;
    }
    let stats: serde_json::Value = serde_json::from_str(&stats).ok()?;
    stats["subscriptions"]["agent-orchestrator"]["consumers"]
        .as_array()
        .map(Vec::len)
}

/// The request topic is unloaded while its namespace allows only Exclusive subscriptions, so the
/// orchestrator's Shared subscription is refused when the crate subscribes again; once allowed
/// again, the next dialog is served.
#[tokio::test]
async fn a_consumer_the_broker_closes_and_refuses_is_subscribed_again() {
    let broker = ApacheBroker::start(0, None).unwrap();
    let llm = scripted_llm(SCRIPT).await;
    let _orchestrator = Orchestrator::spawn_on_url(&broker.url(), &llm, &seed_dir(), &[], &[]);
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let mut client = AgentClient::connect(&bus, &Topics::trustgraph("default", "default"))
        .await
        .unwrap();
    client
        .send("before", &request("ping", false))
        .await
        .unwrap();
    let before = collect_dialog(&mut client, "before", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(outcome(&before), "pong");

    let namespace = "/admin/v2/namespaces/tg/request";
    admin(
        &broker,
        "POST",
        &format!("{namespace}/subscriptionTypesEnabled"),
        r#"["Exclusive"]"#,
    );
    admin(
        &broker,
        "PUT",
        "/admin/v2/persistent/tg/request/agent:default:default/unload",
        "",
    );
    // The crate's subscribing again is refused (NotAllowed): the subscription is left with no
    // consumer, and our own tries are refused too while the policy stands.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while consumers_of_requests(&broker) != Some(0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the orchestrator's subscription kept a consumer: the unload or the refusal did not happen"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    admin(
        &broker,
        "DELETE",
        &format!("{namespace}/subscriptionTypesEnabled"),
        "",
    );

    client.send("after", &request("ping", false)).await.unwrap();
    let after = collect_dialog(&mut client, "after", DIALOG_TIMEOUT)
        .await
        .unwrap_or_else(|e| panic!("the dialog after the unload was not served: {e}"));
    assert_eq!(outcome(&after), "pong");
}
