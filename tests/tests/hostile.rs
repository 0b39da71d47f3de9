//! Hostile input over a real broker: a thousand malformed, oversized or invalid messages mixed
//! with valid dialogs. Every bad one lands in the dead-letter topic or gets an `error` response,
//! the orchestrator never restarts, and the valid dialogs keep finishing.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use agent_e2e::*;
use agent_schema::{AgentRequest, AgentStep};
use futures::StreamExt;
use rand::{Rng, SeedableRng};

const BAD_MESSAGES: usize = 1000;
/// A valid dialog is sent after every this many bad messages.
const VALID_EVERY: usize = 40;
const MAX_QUESTION_BYTES: usize = 4096;
const MAX_MESSAGE_BYTES: usize = 64 * 1024;
const DEADLINE: Duration = Duration::from_secs(180);

/// Where a bad message must end up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// It does not decode: the dead-letter topic, with the reason.
    DeadLetter,
    /// It decodes but breaks a rule: an `error` response naming the rule.
    Refused(&'static str),
}

/// The `i`th bad message: its payload and where it must end up.
fn bad_message(i: usize, rng: &mut impl Rng) -> (Vec<u8>, Fate) {
    let valid = |question: String| AgentRequest {
        question,
        ..request("a fine question", false)
    };
    let encode = |r: &AgentRequest| serde_json::to_vec(r).unwrap();
    match i % 12 {
        0 => {
            let len = rng.gen_range(1..2048);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            // Never valid JSON by accident.
            bytes[0] = b'#';
            (bytes, Fate::DeadLetter)
        }
        1 => {
            let whole = encode(&valid(format!("truncated {i}")));
            let cut = rng.gen_range(1..whole.len() - 1);
            (whole[..cut].to_vec(), Fate::DeadLetter)
        }
        2 => {
            let wrong = [
                r#"{"question": 7}"#,
                r#"[1, 2, 3]"#,
                "null",
                "42",
                r#""a string""#,
                r#"{"question": "q", "history": {"not": "a list"}}"#,
                r#"{"question": "q", "streaming": "yes"}"#,
            ];
            (wrong[i % wrong.len()].as_bytes().to_vec(), Fate::DeadLetter)
        }
        // Nesting far past the decoder's recursion limit.
        3 => {
            let depth = 10_000 + i;
            let mut nested = "[".repeat(depth);
            nested.push_str(&"]".repeat(depth));
            (nested.into_bytes(), Fate::DeadLetter)
        }
        4 => {
            let mut bytes = br#"{"question": "bad utf-8 "#.to_vec();
            bytes.extend_from_slice(&[0xff, 0xfe, 0xc3]);
            bytes.extend_from_slice(br#""}"#);
            (bytes, Fate::DeadLetter)
        }
        // A megabyte of noise.
        5 if i % 120 == 5 => {
            let mut bytes = vec![b'x'; 1024 * 1024 + i];
            bytes[0] = b'{';
            (bytes, Fate::DeadLetter)
        }
        5 | 6 => (
            encode(&valid("q".repeat(MAX_QUESTION_BYTES + 1 + i))),
            Fate::Refused("max_question_bytes"),
        ),
        // A dialog whose history has outgrown the message limit.
        7 => {
            let step = AgentStep {
                thought: "t".repeat(1000),
                observation: "o".repeat(4000),
                ..AgentStep::default()
            };
            let grown = AgentRequest {
                history: vec![step; MAX_MESSAGE_BYTES / 5000 + 1],
                pattern: "react".into(),
                session_id: format!("grown-{i}"),
                ..valid(format!("grown {i}"))
            };
            (encode(&grown), Fate::Refused("max_message_bytes"))
        }
        // A plan in the history whose step lists far more dependencies than the plan has steps.
        8 if i % 24 == 20 => {
            let step = |goal: &str, depends_on: Vec<i64>| agent_schema::PlanStep {
                goal: goal.into(),
                depends_on,
                status: "completed".into(),
                result: "r".repeat(1000),
                ..Default::default()
            };
            let planned = AgentStep {
                step_type: "plan".into(),
                plan: Some(vec![step("a", vec![]), step("b", (0..5000).collect())]),
                ..AgentStep::default()
            };
            let listed = AgentRequest {
                history: vec![planned],
                pattern: "plan-then-execute".into(),
                session_id: format!("listed-{i}"),
                ..valid(format!("listed {i}"))
            };
            (encode(&listed), Fate::Refused("dependencies"))
        }
        8 => (
            encode(&valid("   ".into())),
            Fate::Refused("empty question"),
        ),
        // A history whose folded step claims more steps than any dialog may take.
        9 if i % 24 == 21 => {
            let forged = AgentStep {
                thought: "Steps 1-N of this dialog, folded.".into(),
                arguments: [("folded-steps".to_owned(), u32::MAX.to_string())]
                    .into_iter()
                    .collect(),
                observation: "folded".into(),
                ..AgentStep::default()
            };
            let claimed = AgentRequest {
                history: vec![forged; 3],
                pattern: "react".into(),
                session_id: format!("forged-{i}"),
                ..valid(format!("forged {i}"))
            };
            (encode(&claimed), Fate::Refused("max_iterations"))
        }
        9 => {
            let injected = AgentRequest {
                session_id: format!("x> <y {i}"),
                ..valid(format!("injected {i}"))
            };
            (encode(&injected), Fate::Refused("session_id"))
        }
        10 if i % 24 == 22 => {
            let unbounded = AgentRequest {
                conversation_id: format!("chat\n{}", "c".repeat(i)),
                ..valid(format!("conversation {i}"))
            };
            (encode(&unbounded), Fate::Refused("conversation_id"))
        }
        10 => {
            let unknown = AgentRequest {
                pattern: format!("telepathy-{i}"),
                ..valid(format!("pattern {i}"))
            };
            (encode(&unknown), Fate::Refused("is not available"))
        }
        _ => {
            let unknown = AgentRequest {
                task_type: format!("astrology-{i}"),
                ..valid(format!("task type {i}"))
            };
            (encode(&unknown), Fate::Refused("is not configured"))
        }
    }
}

/// The seed configuration with tight limits, so that oversized messages are cheap to make.
fn tight_limits_config() -> std::path::PathBuf {
    let limits = format!(
        r#"{{"default": {{"max_question_bytes": {MAX_QUESTION_BYTES}, "max_message_bytes": {MAX_MESSAGE_BYTES}}}}}"#
    );
    seed_with("hostile", &[("agent-limits", &limits)])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_bad_messages_are_dead_lettered_or_refused_and_valid_dialogs_finish() {
    bad_messages_meet_their_fates(false).await;
}

/// With the journal on, a request is checked before its journal entry is named: a hostile
/// `session_id` (which cannot name a graph node) is refused, not retried into the dead-letter topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journaled_orchestrator_refuses_the_same_bad_messages() {
    bad_messages_meet_their_fates(true).await;
}

async fn bad_messages_meet_their_fates(journaled: bool) {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: ping", "reply": "Thought: easy\nFinal Answer: pong"}]}"#,
    )
    .await;
    let token = "hostile-token";
    let aggregator = journaled.then(|| Aggregator::spawn_with(&broker, &["--config-token", token]));
    let extra: Vec<&str> = match &aggregator {
        Some(aggregator) => vec![
            "--graph-store",
            &aggregator.endpoint,
            "--config-token",
            token,
        ],
        None => Vec::new(),
    };
    let mut orchestrator = Orchestrator::spawn(&broker, &llm, &tight_limits_config(), &extra);
    // Subscribed before the first bad message: pulsar-lite has been seen to stall handing a new
    // subscription a backlog of hundreds (280 of 428 delivered, then nothing).
    let mut dlq = read_from_start(&broker, DEAD_LETTER_TOPIC, "test-dlq").await;
    let mut client = client(&broker).await;
    // The orchestrator too: a dialog answered shows its subscription exists before the flood.
    warm_up(&mut client).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);

    let mut fates: BTreeMap<String, Fate> = BTreeMap::new();
    let mut valid: BTreeSet<String> = BTreeSet::new();
    for i in 0..BAD_MESSAGES {
        if i % VALID_EVERY == 0 {
            let id = format!("ok-{i}");
            client
                .send(&id, &request(&format!("ping {i}"), i % 80 == 0))
                .await
                .unwrap();
            valid.insert(id);
        }
        let (payload, fate) = bad_message(i, &mut rng);
        let id = format!("bad-{i}");
        client.send_raw(&id, payload).await.unwrap();
        fates.insert(id, fate);
    }

    // Every refused message gets one error response and nothing else; every valid dialog ends
    // with "pong".
    let mut refused: BTreeMap<String, String> = BTreeMap::new();
    let mut answered: BTreeMap<String, Vec<agent_schema::AgentResponse>> = BTreeMap::new();
    let expected_refusals = fates
        .values()
        .filter(|f| matches!(f, Fate::Refused(_)))
        .count();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let ended = |answered: &BTreeMap<String, Vec<agent_schema::AgentResponse>>| {
        answered
            .values()
            .filter(|r| r.iter().any(|r| r.end_of_dialog))
            .count()
    };
    while refused.len() < expected_refusals || ended(&answered) < valid.len() {
        let Ok(next) = tokio::time::timeout_at(deadline, client.next()).await else {
            let missing: Vec<&String> = fates
                .iter()
                .filter(|(id, f)| matches!(f, Fate::Refused(_)) && !refused.contains_key(*id))
                .map(|(id, _)| id)
                .take(10)
                .collect();
            panic!(
                "{} of {expected_refusals} refusals and {} of {} valid dialogs after {DEADLINE:?}; missing refusals include {missing:?}",
                refused.len(),
                ended(&answered),
                valid.len()
            );
        };
        let (id, response) = next.unwrap();
        if valid.contains(&id) {
            answered.entry(id).or_default().push(response);
            continue;
        }
        let fate = fates.get(&id).copied();
        let Some(Fate::Refused(rule)) = fate else {
            panic!("{id} ({fate:?}) got a response: {response:?}");
        };
        assert!(response.end_of_dialog, "{id}: {response:?}");
        let error = response.error.expect("an error response");
        assert!(
            error.message.contains(rule),
            "{id} was refused for another reason than {rule}: {}",
            error.message
        );
        assert!(
            refused.insert(id.clone(), error.message).is_none(),
            "{id} was refused twice"
        );
    }
    for (id, responses) in &answered {
        let last = responses.last().unwrap();
        assert!(last.end_of_dialog && last.error.is_none(), "{id}: {last:?}");
        assert_eq!(text_of(responses, "answer"), "pong", "{id}: {responses:#?}");
        assert_eq!(responses.iter().filter(|r| r.end_of_dialog).count(), 1);
    }

    // Every message that does not decode is in the dead-letter topic, with the reason.
    let expected_dead: BTreeSet<&String> = fates
        .iter()
        .filter(|(_, f)| **f == Fate::DeadLetter)
        .map(|(id, _)| id)
        .collect();
    let mut dead: BTreeSet<String> = BTreeSet::new();
    let mut delivered: BTreeSet<String> = BTreeSet::new();
    while dead.len() < expected_dead.len() {
        let message = tokio::time::timeout_at(deadline, dlq.next())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{} of {} dead letters arrived",
                    dead.len(),
                    expected_dead.len()
                )
            })
            .unwrap()
            .unwrap();
        // The same dead letter handed to this reader again (pulsar-lite ignores acks on a busy
        // subscription and redelivers) is not a second dead-lettering: that would be a new message.
        let entry = format!("{:?}", message.message_id.id);
        if !delivered.insert(entry) {
            dlq.ack(&message).await.unwrap();
            continue;
        }
        let property = |k: &str| agent_bus::message_property(&message, k).unwrap_or_default();
        let id = property("id").to_owned();
        assert!(
            property("dead-letter-reason").contains("does not decode"),
            "{id}: {}",
            property("dead-letter-reason")
        );
        assert!(expected_dead.contains(&id), "{id} was dead-lettered");
        assert!(dead.insert(id.clone()), "{id} was dead-lettered twice");
        dlq.ack(&message).await.unwrap();
    }

    // Nothing bad reached the LLM: the calls are the valid dialogs' routing (task type, pattern)
    // and agent turns (and the warm-up's). The orchestrator never went down.
    assert_eq!(llm.calls().len(), 3 * (valid.len() + 1));
    assert!(orchestrator.is_running(), "the orchestrator exited");
    println!(
        "hostile input (journal {journaled}): {} bad messages ({} dead-lettered, {} refused), {} valid dialogs answered",
        fates.len(),
        dead.len(),
        refused.len(),
        answered.len()
    );
}

/// Requests refused for a session id long enough that their journal entry is longer than the
/// journal's owner takes (1,024 bytes), sent among valid dialogs to an orchestrator that reaches
/// the owner over HTTP (a process of its own, as in compose and Kubernetes), are each refused,
/// and every valid dialog is answered. Until 2026-12-05 such a request's taking went to the owner
/// in a batch with other steps' takings, the owner refused the whole batch, and the valid
/// dialogs' steps in it ended with "the step failed: ... longer than 1024 bytes".
#[tokio::test]
async fn requests_refused_for_long_session_ids_fail_no_other_dialog() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: ping", "reply": "Thought: easy\nFinal Answer: pong"}]}"#,
    )
    .await;
    let token = "long-ids-token";
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", token]);
    let mut orchestrator =
        Orchestrator::journaled(Place::Child, &broker, &llm, &aggregator, token, &[]);
    let mut client = client(&broker).await;
    warm_up(&mut client).await;
    let (mut valid, mut refused) = (Vec::new(), Vec::new());
    for i in 0..60 {
        let id = format!("fine-{i}");
        client
            .send(&id, &request(&format!("ping {i}"), false))
            .await
            .unwrap();
        valid.push(id);
        let id = format!("long-{i}");
        let long = AgentRequest {
            session_id: format!("{i}{}", "a".repeat(2000)),
            ..request("ping long", false)
        };
        client.send(&id, &long).await.unwrap();
        refused.push(id);
    }
    let ids: Vec<&str> = valid.iter().chain(&refused).map(String::as_str).collect();
    let ended = collect_dialogs(&mut client, &ids, Duration::from_secs(120)).await;
    for id in &valid {
        let responses = &ended[id];
        let last = responses.last().unwrap();
        assert!(
            last.end_of_dialog && last.error.is_none(),
            "{id}: {responses:#?}"
        );
        assert_eq!(text_of(responses, "answer"), "pong", "{id}");
    }
    for id in &refused {
        let last = ended[id].last().unwrap();
        let error = last.error.as_ref().map(|e| e.message.as_str());
        assert!(
            last.end_of_dialog && error.is_some_and(|e| e.contains("session_id")),
            "{id}: {:?}",
            ended[id]
        );
    }
    assert!(orchestrator.is_running(), "the orchestrator exited");
}

/// A message whose metadata no client of ours can decode (a property that is not UTF-8, as a Go or
/// C++ producer may send; the broker stores and delivers it as it is) is dropped by the consumer
/// that reads it, and the orchestrator goes on answering: its connection to the broker, shared by
/// every consumer and producer of the process, is kept. Such a frame failed the whole connection,
/// and again at every redelivery of the message, so no request after it was ever answered.
#[tokio::test]
async fn a_message_whose_metadata_does_not_decode_takes_no_connection_down() {
    let broker = Broker::start().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: ping", "reply": "Thought: easy\nFinal Answer: pong"}]}"#,
    )
    .await;
    let mut orchestrator = Orchestrator::child(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    warm_up(&mut client).await;
    let topics = agent_bus::Topics::trustgraph("default", "default");
    let unreadable = agent_schema::encode(&request("ping unreadable", false));
    agent_e2e::raw_pulsar::send_with_unreadable_metadata(
        &broker.url(),
        &topics.request,
        "unreadable",
        &unreadable,
    )
    .await
    .unwrap();
    let ids: Vec<String> = (0..5).map(|i| format!("after-{i}")).collect();
    for id in &ids {
        client
            .send(id, &request(&format!("ping {id}"), false))
            .await
            .unwrap();
    }
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    let ended = collect_dialogs(&mut client, &ids, Duration::from_secs(60)).await;
    for id in &ids {
        assert_eq!(
            text_of(&ended[*id], "answer"),
            "pong",
            "{id}: {:?}",
            ended[*id]
        );
    }
    assert!(orchestrator.is_running(), "the orchestrator exited");
}

/// Sends a ping and waits for its "pong": the orchestrator consumes before what the test sends.
async fn warm_up(client: &mut agent_bus::AgentClient) {
    client
        .send("warm-up", &request("ping warm-up", false))
        .await
        .unwrap();
    let warm = collect_dialog(client, "warm-up", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(warm.last().unwrap().content, "pong");
}

/// A subscription to `topic` with one handler place, sending what does not decode to
/// `dead_letter_topic` (none when empty), as the intake tests use it.
fn one_handler_on(topic: &str, dead_letter_topic: &str) -> agent_bus::SubscriptionConfig {
    agent_bus::SubscriptionConfig {
        topic: topic.to_owned(),
        subscription: "intake".to_owned(),
        max_in_flight: 1,
        max_redeliveries: None,
        dead_letter_topic: dead_letter_topic.to_owned(),
        drain_deadline: Duration::from_secs(2),
        nack_delay: Duration::from_millis(100),
        one_at_a_time: false,
    }
}

/// A burst of large messages on a non-persistent topic (TrustGraph's request topics are) while
/// every handler is busy: the consumer holds what waits for its handlers only up to its intake's
/// bound in bytes, drops and counts the rest (as the broker drops what a consumer has no room
/// for), and goes on taking messages. Without the bound the `pulsar` crate's queue held whatever
/// the broker sent ahead: up to 10,000 messages, each as large as the broker takes.
#[tokio::test]
async fn a_burst_of_large_messages_on_a_non_persistent_topic_is_held_within_the_intake_bound() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use agent_bus::{run_consumer, Bus, ConsumerStats, Disposition, Properties, Publisher};
    use tokio_util::sync::CancellationToken;

    const MESSAGES: usize = 40;
    const MESSAGE_BYTES: usize = 512 * 1024;
    const INTAKE_BYTES: usize = 4 * 1024 * 1024;
    // Held at most: what fits the bound (a message counts its JSON quotes and 512 bytes more),
    // besides the one message the handler has.
    const HELD_AT_MOST: usize = INTAKE_BYTES / (MESSAGE_BYTES + 2 + 512);

    // As shipped: Apache Pulsar's default write-buffer marks (64 KiB) would have the broker drop
    // most of a burst of 512 KiB messages itself, before the consumer sees them.
    let broker = Broker::start_as_shipped().unwrap();
    let topic = "non-persistent://tg/request/intake-bound-test";
    let config = one_handler_on(topic, "");
    let bus = Bus::connect(&broker.url(), None)
        .await
        .unwrap()
        .with_intake_bytes(INTAKE_BYTES);
    let stats = Arc::new(ConsumerStats::default());
    let handled = Arc::new(AtomicUsize::new(0));
    let busy = Arc::new(tokio::sync::Semaphore::new(0));
    let shutdown = CancellationToken::new();
    let consumer = {
        let (stats, handled, busy, shutdown) = (
            stats.clone(),
            handled.clone(),
            busy.clone(),
            shutdown.clone(),
        );
        tokio::spawn(async move {
            run_consumer(
                &bus,
                config,
                stats,
                shutdown,
                move |delivery: agent_bus::Delivery<String>| {
                    let (handled, busy) = (handled.clone(), busy.clone());
                    async move {
                        if let Ok(permit) = busy.acquire().await {
                            permit.forget();
                        }
                        if delivery.payload != "after" {
                            assert_eq!(delivery.payload.len(), MESSAGE_BYTES);
                        }
                        handled.fetch_add(1, Ordering::SeqCst);
                        Disposition::Ack
                    }
                },
            )
            .await
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !stats.consuming.load(Ordering::SeqCst) {
        assert!(tokio::time::Instant::now() < deadline, "never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let publisher = Publisher::new(&Bus::connect(&broker.url(), None).await.unwrap(), topic)
        .await
        .unwrap();
    let large = serde_json::to_vec(&"x".repeat(MESSAGE_BYTES)).unwrap();
    for _ in 0..MESSAGES {
        publisher
            .send(large.clone(), &Properties::new())
            .await
            .unwrap();
    }
    // Every message that reached the consumer is either held or dropped, while the one handler
    // waits.
    let received = || ConsumerStats::get(&stats.received) as usize;
    let shed = || ConsumerStats::get(&stats.shed) as usize;
    let settled_at = tokio::time::Instant::now() + Duration::from_secs(30);
    while tokio::time::Instant::now() < settled_at && received() < MESSAGES {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (received_while_busy, shed_while_busy) = (received(), shed());
    println!("received {received_while_busy} of {MESSAGES}, dropped {shed_while_busy}");
    assert!(
        received_while_busy > HELD_AT_MOST + 1,
        "{received_while_busy} of {MESSAGES} taken off the connection while the handler was busy: \
         the rest wait in the crate's queue, unbounded in bytes, or the broker dropped them"
    );
    assert!(
        received_while_busy - shed_while_busy <= HELD_AT_MOST + 1,
        "{} messages kept while the handler was busy: more than the bound holds",
        received_while_busy - shed_while_busy
    );
    assert!(handled.load(Ordering::SeqCst) == 0);

    // The handler frees up: what was held is handled, and the consumer takes new messages.
    busy.add_permits(10_000);
    publisher
        .send(serde_json::to_vec("after").unwrap(), &Properties::new())
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while handled.load(Ordering::SeqCst) + shed() < received() || received() <= received_while_busy
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handled {} + dropped {} of {} received",
            handled.load(Ordering::SeqCst),
            shed(),
            received()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(shed(), shed_while_busy, "dropped with a handler free");
    // Counted where an operator looks.
    let metrics = agent_metrics::global().render();
    let series = format!("{}{{topic=\"{topic}\"}} {}", agent_bus::SHED_METRIC, shed());
    assert!(metrics.contains(&series), "no `{series}` in:\n{metrics}");
    assert!(handled.load(Ordering::SeqCst) <= HELD_AT_MOST + 2);
    shutdown.cancel();
    consumer.await.unwrap().unwrap();
}

/// A burst of large messages that do not decode, on a non-persistent topic: each goes to the
/// dead-letter topic, and while one is on its way the consumer goes on taking messages off the
/// connection, holding within its intake's bound and dropping the rest. Until 2026-12-02 the loop
/// awaited each dead letter's receipt, and meanwhile the `pulsar` crate's queue took whatever the
/// broker sent, up to 10,000 messages as large as it takes: a flood of garbage grew the process
/// without bound (the loop then never held more than one, so it dropped none).
#[tokio::test]
async fn a_burst_of_large_messages_that_do_not_decode_is_dead_lettered_within_the_intake_bound() {
    use std::sync::Arc;

    use agent_bus::{run_consumer, Bus, ConsumerStats, Disposition, Properties, Publisher};
    use tokio_util::sync::CancellationToken;

    const MESSAGES: usize = 60;
    const MESSAGE_BYTES: usize = 512 * 1024;
    const INTAKE_BYTES: usize = 2 * 1024 * 1024;

    let broker = Broker::start_as_shipped().unwrap();
    let topic = "non-persistent://tg/request/dead-letter-intake-test";
    let config = one_handler_on(topic, "persistent://tg/request/dead-letter-intake-test-dlq");
    let bus = Bus::connect(&broker.url(), None)
        .await
        .unwrap()
        .with_intake_bytes(INTAKE_BYTES);
    let stats = Arc::new(ConsumerStats::default());
    let shutdown = CancellationToken::new();
    let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel::<String>();
    let consumer = {
        let (stats, shutdown) = (stats.clone(), shutdown.clone());
        tokio::spawn(async move {
            run_consumer(
                &bus,
                config,
                stats,
                shutdown,
                move |delivery: agent_bus::Delivery<String>| {
                    let answered = answered_tx.clone();
                    async move {
                        let _ = answered.send(delivery.payload);
                        Disposition::Ack
                    }
                },
            )
            .await
        })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !stats.consuming.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(tokio::time::Instant::now() < deadline, "never subscribed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let publisher = Publisher::new(&Bus::connect(&broker.url(), None).await.unwrap(), topic)
        .await
        .unwrap();
    // Not JSON: every one is for the dead-letter topic. Sent pipelined, as a flood would come.
    let garbage = vec![b'{'; MESSAGE_BYTES];
    let mut receipts = Vec::new();
    for _ in 0..MESSAGES {
        receipts.push(
            publisher
                .enqueue(garbage.clone(), &Properties::new())
                .await
                .unwrap(),
        );
    }
    for receipt in receipts {
        receipt.wait().await.unwrap();
    }
    // Every message that reached the consumer is dead-lettered or dropped. (A broker drops a
    // non-persistent message for a connection with over 16 MiB waiting to be written to it: a
    // slow reader may see fewer than were sent.)
    let count = |counter: &std::sync::atomic::AtomicU64| ConsumerStats::get(counter) as usize;
    let settled = || count(&stats.dead_lettered) + count(&stats.shed) == count(&stats.received);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut last = usize::MAX;
    while count(&stats.received) != last || !settled() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "received {}, dead-lettered {}, dropped {} of {MESSAGES}",
            count(&stats.received),
            count(&stats.dead_lettered),
            count(&stats.shed)
        );
        last = count(&stats.received);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (received, dead_lettered, shed) = (
        count(&stats.received),
        count(&stats.dead_lettered),
        count(&stats.shed),
    );
    println!("received {received}, dead-lettered {dead_lettered}, dropped {shed} of {MESSAGES}");
    // More than the bound holds reached the consumer, so some had to be dropped.
    assert!(
        received > INTAKE_BYTES / MESSAGE_BYTES + 1,
        "received {received}"
    );
    assert!(dead_lettered > 0, "nothing reached the dead-letter topic");
    assert!(
        shed > 0,
        "all {received} were kept: the loop took each message only after the last dead letter's \
         receipt, leaving the rest in the crate's queue"
    );
    assert_eq!(count(&stats.nacked), 0);

    // The consumer goes on: a message that decodes is handled.
    publisher
        .send(serde_json::to_vec("after").unwrap(), &Properties::new())
        .await
        .unwrap();
    let after = tokio::time::timeout(Duration::from_secs(30), answered.recv())
        .await
        .expect("the consumer stopped taking messages")
        .unwrap();
    assert_eq!(after, "after");
    shutdown.cancel();
    consumer.await.unwrap().unwrap();
}
