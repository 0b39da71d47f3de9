//! Apache Pulsar's message size limit (`maxMessageSize`, 5 MiB by default), on Apache Pulsar
//! itself. A message over it is not sent: the broker would drop the connection, and the send
//! would fail only at the 30 s operation timeout, looking like an outage. A dialog whose history
//! grows towards the limit ends with an error naming it as soon as its next request would pass it,
//! and the orchestrator goes on serving. With the shipped limits a dialog never gets near: its
//! history is bounded by `max_iterations` x `max_observation_bytes`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use agent_bus::{AgentClient, Bus, BusError, Properties, Publisher, Topics};
use agent_e2e::apache::ApacheBroker;
use agent_e2e::*;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(180);

#[tokio::test]
async fn a_message_over_the_brokers_limit_is_refused_before_it_is_sent() {
    let broker = ApacheBroker::start(0, None).unwrap();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let publisher = Publisher::new(&bus, &topics.request).await.unwrap();
    assert_eq!(publisher.max_message_bytes(), 5 * 1024 * 1024);

    let started = Instant::now();
    let refused = publisher
        .send(vec![b'x'; 6 * 1024 * 1024], &Properties::new())
        .await
        .unwrap_err();
    println!("6 MiB: {refused} ({:?})", started.elapsed());
    assert!(matches!(refused, BusError::TooLarge { .. }), "{refused}");
    assert!(!refused.passes(), "a message too large is not an outage");
    // Refused before the broker saw it: the connection is whole, the next message goes at once.
    let started = Instant::now();
    publisher
        .send(b"{}".to_vec(), &Properties::new())
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(10));
    // Up to the limit is taken.
    publisher
        .send(vec![b'y'; 4 * 1024 * 1024], &Properties::new())
        .await
        .unwrap();
}

/// Observations of 1 MB each and a config that would let the history grow to 8 MiB: the dialog
/// ends with an error naming the broker's limit once its next request would pass 5 MiB, not after
/// an outage window, and the next dialog is served.
#[tokio::test]
async fn a_dialog_growing_towards_the_limit_ends_with_an_error_naming_it() {
    let broker = ApacheBroker::start(0, None).unwrap();
    let megabyte: String = "0123456789".repeat(100_000);
    let script = serde_json::json!({"rules": [
        {"match": "Question: ping", "reply": "Thought: easy.\nFinal Answer: pong"},
        {"match": "fetch", "exact": true, "reply": megabyte},
        {"match": "Question: ", "reply": "Thought: more.\nAction: llm\nArgs: {\"question\": \"fetch\"}"}
    ]});
    let llm = scripted_llm(&script.to_string()).await;
    let limits = r#"{"default": {"max_iterations": 30, "max_message_bytes": 8388608,
        "max_observation_bytes": 1100000, "max_tokens": 0}}"#;
    let config = seed_with("message-limits", &[("agent-limits", limits)]);
    let _orchestrator = Orchestrator::spawn_on_url(&broker.url(), &llm, &config, &[], &[]);
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let mut client = AgentClient::connect(&bus, &Topics::trustgraph("default", "default"))
        .await
        .unwrap();

    let started = Instant::now();
    client
        .send("grows", &request("Fetch until it is too much", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "grows", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    let error = last
        .error
        .as_ref()
        .expect("the dialog did not end with an error");
    println!(
        "ended after {:?} and {} observations: {}",
        started.elapsed(),
        responses
            .iter()
            .filter(|r| r.message_type == "observation" && r.end_of_message)
            .count(),
        error.message
    );
    assert!(last.end_of_dialog);
    assert!(
        error.message.contains("maxMessageSize"),
        "{}",
        error.message
    );
    assert!(error.message.contains("history"), "{}", error.message);
    assert!(
        !error.message.contains("unavailable"),
        "treated as an outage: {}",
        error.message
    );
    // The history reached 4 MB before the fifth observation would have passed 5 MiB.
    assert!(
        llm.calls()
            .iter()
            .filter(|c| c.last_user == "fetch")
            .count()
            >= 5,
        "{} LLM calls",
        llm.calls().len()
    );

    client.send("after", &request("ping", false)).await.unwrap();
    let after = collect_dialog(&mut client, "after", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(after.last().unwrap().content, "pong");
}
