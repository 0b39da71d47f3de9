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
    let ops = format!("127.0.0.1:{}", agent_bus::embedded::free_port().unwrap());
    let _orchestrator = Orchestrator::spawn_on_url(
        &broker.url(),
        &llm,
        &seed_dir(),
        &["--http-addr", &ops],
        &[],
    );
    let ops = format!("http://{ops}");
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
    // Meanwhile, once the crate gives up its own tries and ours begin, the orchestrator says it
    // is not ready: it takes nothing (its readiness said "consuming" all along).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let readiness = reqwest::get(format!("{ops}/readyz")).await.unwrap();
        if readiness.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "ready for 60 s while subscribed to nothing: {}",
            readiness.text().await.unwrap_or_default()
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
    until_ready(&ops, Duration::from_secs(10)).await;
}

/// The backlog of the `kept` subscription of `topic` (in `tg/flow`), by the broker's topic
/// stats; `None` while the topic or the subscription is not there.
fn kept_backlog(broker: &ApacheBroker, topic: &str) -> Option<u64> {
    let (status, stats) = broker
        .admin(
            "GET",
            &format!("/admin/v2/persistent/tg/flow/{topic}/stats"),
            "",
        )
        .ok()?;
    if status != 200 {
        return None;
    }
    let stats: serde_json::Value = serde_json::from_str(&stats).ok()?;
    stats["subscriptions"][agent_bus::DEAD_LETTERS_KEPT]["msgBacklog"].as_u64()
}

/// What a service dead-letters is kept until someone reads it. Apache Pulsar keeps a topic's
/// messages only for its subscriptions (no retention policy, as it ships), and no service
/// subscribed to the aggregator's or config-svc's dead-letter topics: a dead letter, which the
/// services send "to be seen", was trimmed at the topic's next ledger roll-over. Each service now
/// subscribes `kept` to its dead-letter topic as it starts; the letter waits there through an
/// unload (which rolls the ledger over) and is read with its reason.
#[tokio::test]
async fn what_a_service_dead_letters_waits_in_the_kept_subscription() {
    let broker = ApacheBroker::start(0, None).unwrap();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let (topic, letters) = ("kept-test", "kept-test-dead-letter");
    let config = agent_bus::SubscriptionConfig {
        topic: format!("persistent://tg/flow/{topic}"),
        subscription: "under-test".to_owned(),
        max_in_flight: 1,
        max_redeliveries: None,
        dead_letter_topic: format!("persistent://tg/flow/{letters}"),
        drain_deadline: Duration::from_secs(1),
        nack_delay: Duration::from_millis(100),
        one_at_a_time: false,
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let stats = std::sync::Arc::new(agent_bus::ConsumerStats::default());
    let consumer = tokio::spawn({
        let (bus, stats, shutdown) = (bus.clone(), stats.clone(), shutdown.clone());
        async move {
            agent_bus::run_consumer(
                &bus,
                config,
                stats,
                shutdown,
                |_: agent_bus::Delivery<serde_json::Value>| async { agent_bus::Disposition::Ack },
            )
            .await
        }
    });
    // Not JSON: dead-lettered by the consumer itself.
    let publisher = agent_bus::Publisher::new(&bus, &format!("persistent://tg/flow/{topic}"))
        .await
        .unwrap();
    publisher
        .send(b"not json".to_vec(), &Default::default())
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while kept_backlog(&broker, letters) != Some(1) {
        assert!(
            std::time::Instant::now() < deadline,
            "no dead letter waits in a subscription {} of {letters}",
            agent_bus::DEAD_LETTERS_KEPT
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    shutdown.cancel();
    consumer.await.unwrap().unwrap();
    admin(
        &broker,
        "PUT",
        &format!("/admin/v2/persistent/tg/flow/{letters}/unload"),
        "",
    );
    let mut kept: pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor> = bus
        .client()
        .consumer()
        .with_topic(format!("persistent://tg/flow/{letters}"))
        .with_subscription(agent_bus::DEAD_LETTERS_KEPT)
        .with_subscription_type(pulsar::SubType::Shared)
        .build()
        .await
        .unwrap();
    let letter = tokio::time::timeout(Duration::from_secs(30), futures::StreamExt::next(&mut kept))
        .await
        .expect("the dead letter, after the unload")
        .unwrap()
        .unwrap();
    assert_eq!(letter.payload.data, b"not json");
    let reason = agent_bus::message_property(&letter, "dead-letter-reason").unwrap_or_default();
    assert!(!reason.is_empty(), "a dead letter without its reason");
}
