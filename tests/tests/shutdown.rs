//! Graceful shutdown over a real broker: on SIGTERM the orchestrator stops taking messages,
//! finishes what it has in flight (or, past its drain deadline, leaves it un-acked for another
//! replica) and exits in time, and no message is lost.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_e2e::*;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

fn calls_about(llm: &scripted_llm::ScriptedLlm, text: &str) -> usize {
    llm.calls()
        .iter()
        .filter(|c| c.last_user.contains(text))
        .count()
}

/// An iteration in flight when SIGTERM arrives is finished and acked before the process exits; a
/// dialog sent after the signal is left for the next replica. Each LLM turn runs exactly once.
#[tokio::test]
async fn sigterm_finishes_in_flight_iterations_and_takes_no_new_ones() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Question: slow", "reply": "Thought: this takes a while\nFinal Answer: finished in the drain", "delay_ms": 2500},
      {"match": "Question: later", "reply": "Thought: quick\nFinal Answer: served by the next replica"}
    ]}"#,
    )
    .await;
    let mut first = Orchestrator::child(&broker, &llm, &seed_dir(), &["--drain-secs", "20"]);
    let mut client = client(&broker).await;
    client
        .send("slow", &request("slow one", true))
        .await
        .unwrap();
    wait_for_call(&llm, "Question: slow", DIALOG_TIMEOUT).await;
    first.terminate();
    // Give the signal a moment to land (the turn takes 2.5 s, so the drain is still going).
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Sent while the first process drains: it must not take this one.
    client
        .send("later", &request("later one", false))
        .await
        .unwrap();

    let slow = collect_dialog(&mut client, "slow", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(text_of(&slow, "answer"), "finished in the drain");
    assert!(
        first.exited_within(Duration::from_secs(10)).await,
        "the orchestrator did not exit after draining"
    );
    assert_eq!(
        calls_about(&llm, "later one"),
        0,
        "a draining orchestrator took a new dialog"
    );

    let _second = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let later = collect_dialog(&mut client, "later", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(later.last().unwrap().content, "served by the next replica");
    let more = drain_for(&mut client, "slow", Duration::from_secs(2)).await;
    assert!(more.is_empty(), "the drained dialog went on: {more:#?}");
    // The slow turn was asked once: the drain finished it rather than leaving it to be redone.
    assert_eq!(calls_about(&llm, "Question: slow"), 1);
}

/// An iteration that outlives the drain deadline is abandoned un-acked: the process still exits
/// on time, and the message is redelivered to the next replica, which finishes the dialog once.
#[tokio::test]
async fn sigterm_past_the_drain_deadline_leaves_the_message_for_another_replica() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Question: stuck", "reply": "Thought: second try\nFinal Answer: redelivered", "faults": ["stall"], "stall_ms": 120000}
    ]}"#,
    )
    .await;
    let mut first = Orchestrator::child(&broker, &llm, &seed_dir(), &["--drain-secs", "2"]);
    let mut client = client(&broker).await;
    client
        .send("stuck", &request("stuck one", false))
        .await
        .unwrap();
    wait_for_call(&llm, "Question: stuck", DIALOG_TIMEOUT).await;
    first.terminate();
    assert!(
        first.exited_within(Duration::from_secs(8)).await,
        "the orchestrator did not exit at its drain deadline"
    );

    let _second = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let responses = collect_dialog(&mut client, "stuck", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, "redelivered");
    let more = drain_for(&mut client, "stuck", Duration::from_secs(2)).await;
    assert!(
        !responses
            .iter()
            .chain(more.iter())
            .any(|r| r.error.is_some()),
        "{responses:#?} {more:#?}"
    );
    assert_eq!(
        responses
            .iter()
            .chain(more.iter())
            .filter(|r| r.end_of_dialog)
            .count(),
        1
    );
    assert_eq!(calls_about(&llm, "Question: stuck"), 2);
}

/// A consumer asked to stop while far behind its backlog (an aggregator whose store is slower than
/// the dialogs) stops in time, and what it had not acked is handled by the next consumer, and
/// only that: what it finished while draining was acked. Closing such a consumer used to wait
/// for ever: its connection's reader was held up by buffered messages nobody read any more, so
/// the broker's answer to the close never came through; and the acks of the drain waited in the
/// same queue, never sent, so the next consumer handled those messages again.
#[tokio::test]
async fn a_consumer_far_behind_its_backlog_stops_in_time_and_loses_nothing() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use agent_bus::{run_consumer, Bus, ConsumerStats, Disposition, Properties, Publisher};
    use tokio_util::sync::CancellationToken;

    const MESSAGES: usize = 300;
    let broker = Broker::start().unwrap();
    let topic = "persistent://tg/flow/backlog-test";
    let config = agent_bus::SubscriptionConfig {
        topic: topic.to_owned(),
        subscription: "slow-writer".to_owned(),
        max_in_flight: 4,
        max_redeliveries: None,
        dead_letter_topic: String::new(),
        drain_deadline: Duration::from_secs(2),
        nack_delay: Duration::from_millis(100),
        one_at_a_time: false,
    };
    // How often each message was handled.
    let handled: Arc<Mutex<HashMap<u64, usize>>> = Arc::default();
    let consume = |bus: Bus, shutdown: CancellationToken, pause: Duration| {
        let (config, handled) = (config.clone(), handled.clone());
        tokio::spawn(async move {
            run_consumer(
                &bus,
                config,
                Arc::new(ConsumerStats::default()),
                shutdown,
                move |delivery: agent_bus::Delivery<u64>| {
                    let handled = handled.clone();
                    async move {
                        tokio::time::sleep(pause).await;
                        *handled.lock().unwrap().entry(delivery.payload).or_default() += 1;
                        Disposition::Ack
                    }
                },
            )
            .await
        })
    };
    let first_bus = Bus::connect(&broker.url(), None).await.unwrap();
    let stop_first = CancellationToken::new();
    let first = consume(first_bus, stop_first.clone(), Duration::from_millis(50));
    let publisher = Publisher::new(&Bus::connect(&broker.url(), None).await.unwrap(), topic)
        .await
        .unwrap();
    for n in 0..MESSAGES as u64 {
        publisher
            .send(n.to_string().into_bytes(), &Properties::new())
            .await
            .unwrap();
    }
    while handled.lock().unwrap().len() < 8 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_first.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(20), first).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "a consumer far behind did not stop within 20 s: {stopped:?}"
    );
    let behind = MESSAGES - handled.lock().unwrap().len();
    assert!(
        behind > 100,
        "the first consumer was not behind ({behind} left)"
    );

    let stop_second = CancellationToken::new();
    let second = consume(
        Bus::connect(&broker.url(), None).await.unwrap(),
        stop_second.clone(),
        Duration::ZERO,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handled.lock().unwrap().len() < MESSAGES {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {MESSAGES} messages handled",
            handled.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_second.cancel();
    second.await.unwrap().unwrap();
    let twice: Vec<_> = handled
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, times)| **times > 1)
        .map(|(n, times)| (*n, *times))
        .collect();
    assert!(
        twice.is_empty(),
        "acked by the first consumer and handled again: {twice:?}"
    );
}

/// A consumer of a non-persistent topic (TrustGraph's client requests come on one) that stops
/// with messages waiting for its handlers: it closes at once, so that what is published during
/// its drain goes to the consumer that stays, and handles everything it had been sent before
/// the close. Nothing is delivered twice on such a topic, so until 2026-12-06 what waited in its
/// intake was dropped at the stop and what came during the drain was let go: a rolling restart
/// lost the requests queued at the replica that stopped, and those sent while it drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_persistent_consumer_that_stops_handles_what_it_was_sent_and_lets_the_rest_go_elsewhere(
) {
    use std::collections::HashMap;
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};

    use agent_bus::{run_consumer, Bus, ConsumerStats, Disposition, Properties, Publisher};
    use tokio_util::sync::CancellationToken;

    const BEFORE_THE_STOP: u64 = 60;
    const DURING_THE_DRAIN: u64 = 40;
    let broker = Broker::start().unwrap();
    let topic = "non-persistent://tg/request/stop-test";
    let config = agent_bus::SubscriptionConfig {
        topic: topic.to_owned(),
        subscription: "replicas".to_owned(),
        max_in_flight: 1,
        max_redeliveries: None,
        dead_letter_topic: String::new(),
        drain_deadline: Duration::from_secs(30),
        nack_delay: Duration::from_millis(100),
        one_at_a_time: false,
    };
    // Who handled each message, and how often.
    let handled: Arc<Mutex<HashMap<u64, Vec<&'static str>>>> = Arc::default();
    let consume = |name: &'static str, shutdown: CancellationToken, pause: Duration| {
        let (config, handled) = (config.clone(), handled.clone());
        let stats = Arc::new(ConsumerStats::default());
        let url = broker.url();
        let running = {
            let stats = stats.clone();
            tokio::spawn(async move {
                let bus = Bus::connect(&url, None).await.unwrap();
                run_consumer(
                    &bus,
                    config,
                    stats,
                    shutdown,
                    move |delivery: agent_bus::Delivery<u64>| {
                        let handled = handled.clone();
                        async move {
                            tokio::time::sleep(pause).await;
                            handled
                                .lock()
                                .unwrap()
                                .entry(delivery.payload)
                                .or_default()
                                .push(name);
                            Disposition::Ack
                        }
                    },
                )
                .await
            })
        };
        (running, stats)
    };
    async fn until(what: &str, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let stop_first = CancellationToken::new();
    let (first, first_stats) = consume("first", stop_first.clone(), Duration::from_millis(100));
    until("the first never subscribed", || {
        first_stats.consuming.load(Ordering::SeqCst)
    })
    .await;
    let publisher = Publisher::new(&Bus::connect(&broker.url(), None).await.unwrap(), topic)
        .await
        .unwrap();
    for n in 0..BEFORE_THE_STOP {
        publisher
            .send(n.to_string().into_bytes(), &Properties::new())
            .await
            .unwrap();
    }
    // All of them sent to the first, most waiting for its one handler.
    until("the first was not sent them all", || {
        ConsumerStats::get(&first_stats.received) >= BEFORE_THE_STOP
    })
    .await;
    let stop_second = CancellationToken::new();
    let (second, second_stats) = consume("second", stop_second.clone(), Duration::ZERO);
    until("the second never subscribed", || {
        second_stats.consuming.load(Ordering::SeqCst)
    })
    .await;
    let waiting = BEFORE_THE_STOP as usize - handled.lock().unwrap().len();
    stop_first.cancel();
    until("the first never began to stop", || {
        !first_stats.consuming.load(Ordering::SeqCst)
    })
    .await;
    // Its close (one round trip) has been answered well before this, its drain (a handler's 100
    // ms for each message waiting) goes on for seconds after.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for n in BEFORE_THE_STOP..BEFORE_THE_STOP + DURING_THE_DRAIN {
        publisher
            .send(n.to_string().into_bytes(), &Properties::new())
            .await
            .unwrap();
    }
    let stopped = tokio::time::timeout(Duration::from_secs(60), first).await;
    assert!(matches!(stopped, Ok(Ok(Ok(())))), "{stopped:?}");
    let all = (BEFORE_THE_STOP + DURING_THE_DRAIN) as usize;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while handled.lock().unwrap().len() < all && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_second.cancel();
    second.await.unwrap().unwrap();
    let handled = handled.lock().unwrap().clone();
    let lost: Vec<u64> = (0..all as u64)
        .filter(|n| !handled.contains_key(n))
        .collect();
    println!(
        "{waiting} waiting at the stop; lost {} of {all}; the first handled {}",
        lost.len(),
        handled.values().filter(|by| by.contains(&"first")).count()
    );
    assert!(waiting > 10, "the first was not behind ({waiting} waiting)");
    assert!(lost.is_empty(), "never handled: {lost:?}");
    let twice: Vec<_> = handled.iter().filter(|(_, by)| by.len() > 1).collect();
    assert!(twice.is_empty(), "handled twice: {twice:?}");
    // What was published once the first had closed went to the second.
    let late_at_first: Vec<_> = handled
        .iter()
        .filter(|(n, by)| **n >= BEFORE_THE_STOP && by.contains(&"first"))
        .collect();
    assert!(
        late_at_first.len() < DURING_THE_DRAIN as usize / 2,
        "the first kept taking messages while it drained: {late_at_first:?}"
    );
}

/// Several requests a client sent as one batch (one broker entry: Java's and Go's clients batch by
/// default) are each handled even if the consumer stops while one of them is still in flight: the
/// members done wait to be acked until all are. The `pulsar` crate acks a member by its entry
/// without the batch's ack set, which the broker takes as the whole entry's ack, so before
/// 2026-12-05 the first member done acked the one still in flight, and it was never handled.
#[tokio::test]
async fn a_batch_member_in_flight_at_a_stop_is_handled_after_it() {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use agent_bus::{run_consumer, Bus, ConsumerStats, Disposition};
    use tokio_util::sync::CancellationToken;

    let broker = Broker::start().unwrap();
    let topic = "persistent://tg/flow/batch-test";
    let config = agent_bus::SubscriptionConfig {
        topic: topic.to_owned(),
        subscription: "batch-taker".to_owned(),
        max_in_flight: 4,
        max_redeliveries: None,
        dead_letter_topic: String::new(),
        drain_deadline: Duration::from_millis(300),
        nack_delay: Duration::from_millis(100),
        one_at_a_time: false,
    };
    // How often each message was handled to its end.
    let handled: Arc<Mutex<HashMap<u64, usize>>> = Arc::default();
    // The first consumer never finishes message 2 (a process stopped in its middle).
    let consume = |bus: Bus, shutdown: CancellationToken, stuck: Option<u64>| {
        let (config, handled) = (config.clone(), handled.clone());
        tokio::spawn(async move {
            run_consumer(
                &bus,
                config,
                Arc::new(ConsumerStats::default()),
                shutdown,
                move |delivery: agent_bus::Delivery<u64>| {
                    let handled = handled.clone();
                    async move {
                        if Some(delivery.payload) == stuck {
                            std::future::pending::<()>().await;
                        }
                        *handled.lock().unwrap().entry(delivery.payload).or_default() += 1;
                        Disposition::Ack
                    }
                },
            )
            .await
        })
    };
    let stop_first = CancellationToken::new();
    let first = consume(
        Bus::connect(&broker.url(), None).await.unwrap(),
        stop_first.clone(),
        Some(2),
    );
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let mut batcher = bus
        .client()
        .producer()
        .with_topic(topic)
        .with_options(pulsar::producer::ProducerOptions {
            batch_size: Some(4),
            ..pulsar::producer::ProducerOptions::default()
        })
        .build()
        .await
        .unwrap();
    let mut receipts = Vec::new();
    for n in 0..4u64 {
        receipts.push(
            batcher
                .send_non_blocking(n.to_string().into_bytes())
                .await
                .unwrap(),
        );
    }
    let mut entries = std::collections::HashSet::new();
    for receipt in receipts {
        let id = receipt.await.unwrap().message_id.unwrap();
        entries.insert((id.ledger_id, id.entry_id));
    }
    assert_eq!(entries.len(), 1, "the four were not sent as one batch");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while handled.lock().unwrap().len() < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the batch's members were not handled: {:?}",
            handled.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop_first.cancel();
    first.await.unwrap().unwrap();
    assert!(!handled.lock().unwrap().contains_key(&2));

    let stop_second = CancellationToken::new();
    let second = consume(
        Bus::connect(&broker.url(), None).await.unwrap(),
        stop_second.clone(),
        None,
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !handled.lock().unwrap().contains_key(&2) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the member in flight at the stop was lost: {:?}",
            handled.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_second.cancel();
    second.await.unwrap().unwrap();
}

/// A consumer whose broker went away, asked to stop while it subscribes again, stops then: one try
/// to subscribe against a broker that is down takes a minute or more, and the stop used to be
/// heard only between tries, so a pod told to stop during an outage was killed at the end of
/// its grace instead of draining.
#[tokio::test]
async fn a_consumer_stops_while_its_broker_is_away() {
    use std::sync::Arc;

    use agent_bus::{run_consumer, Bus, ConsumerStats, Disposition};
    use tokio_util::sync::CancellationToken;

    let mut broker = Broker::start().unwrap();
    let config = agent_bus::SubscriptionConfig {
        topic: "persistent://tg/flow/outage-test".to_owned(),
        subscription: "outage".to_owned(),
        max_in_flight: 2,
        max_redeliveries: None,
        dead_letter_topic: String::new(),
        drain_deadline: Duration::from_secs(2),
        nack_delay: Duration::from_millis(100),
        one_at_a_time: false,
    };
    let stats = Arc::new(ConsumerStats::default());
    let stop = CancellationToken::new();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let consuming = {
        let (stats, stop) = (stats.clone(), stop.clone());
        tokio::spawn(async move {
            run_consumer(
                &bus,
                config,
                stats,
                stop,
                |_: agent_bus::Delivery<u64>| async { Disposition::Ack },
            )
            .await
        })
    };
    while !stats.consuming.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let address = broker
        .url()
        .trim_start_matches("pulsar://")
        .trim_end_matches('/')
        .to_owned();
    broker.stop();
    // A broker that is down behind a load balancer: connections are taken and never answered,
    // so each try to subscribe waits out the client's own time limits.
    let silent = tokio::net::TcpListener::bind(&address).await.unwrap();
    let holding = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((connection, _)) = silent.accept().await {
            held.push(connection);
        }
    });
    // The stream ends and the consumer tries again; the stop comes mid-try.
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(15), consuming).await;
    assert!(
        matches!(stopped, Ok(Ok(Ok(())))),
        "the consumer did not stop within 15 s of being asked, its broker away: {stopped:?}"
    );
    holding.abort();
}

/// A client that sent half a request and went quiet does not keep the aggregator from exiting on
/// SIGTERM: its HTTP server is given a grace, then closed with its connections (it waited for
/// that request for ever). The time for a request's head is set longer than the grace here, so
/// that the grace is what ends the wait.
#[tokio::test]
async fn a_half_sent_http_request_does_not_hold_up_a_stop() {
    let broker = Broker::start().unwrap();
    // Stopped while it serves, and while it still listens for another journal owner (a stop
    // there waited on its HTTP server with no bound too).
    for serving in [true, false] {
        stopped_with_a_half_sent_request(&broker, serving).await;
    }
}

async fn stopped_with_a_half_sent_request(broker: &Broker, serving: bool) {
    use tokio::io::AsyncWriteExt;
    let mut aggregator = Aggregator::logged_child(
        broker,
        &[
            "--owner-listen-ms",
            "3000",
            "--http-head-timeout-secs",
            "60",
        ],
    );
    if serving {
        let ready = format!("{}/readyz", aggregator.endpoint);
        let http = reqwest::Client::new();
        let mut tries = 0;
        while !http
            .get(&ready)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            tries += 1;
            assert!(tries < 300, "the aggregator never became ready");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let address = aggregator.endpoint.trim_start_matches("http://").to_owned();
    let mut quiet = tokio::net::TcpStream::connect(&address).await.unwrap();
    quiet
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: aggregator\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &aggregator.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let exited = aggregator.exit_within(Duration::from_secs(60)).await;
    assert!(
        exited.is_some(),
        "the aggregator (serving: {serving}) still runs a minute after SIGTERM:\n{}",
        aggregator.log()
    );
    assert!(
        aggregator.log().contains("HTTP connections still open"),
        "{}",
        aggregator.log()
    );
    drop(quiet);
}
