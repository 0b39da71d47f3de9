//! The service: connects to the broker and the store, consumes requests, control messages and
//! dead letters, and serves health, readiness and metrics until told to stop.

use std::sync::Arc;
use std::time::Duration;

use agent_bus::{
    run_consumer, ConsumerStats, Delivery, Disposition, Publisher, SubscriptionConfig,
};
use agent_llm::LlmClient;
use agent_schema::AgentRequest;
use tokio_util::sync::CancellationToken;

use crate::documents::DocumentStore;
use crate::emit::{Outputs, Publishers};
use crate::engine::Engine;
use crate::journal::Journal;
use crate::live_config::LiveConfig;
use crate::settings::{load_config_dir, DocumentStoreKind, Settings};
use crate::{approval, cancel, live_config, metrics, ops};

/// Runs the orchestrator until `shutdown`; in-flight iterations finish (or are left for redelivery)
/// within the drain deadline.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    agent_bus::seal::refuse_published_secrets(&[
        ("CONFIG_TOKEN", settings.config_token.as_deref()),
        ("AGENT_SEAL_KEY", settings.seal_key.as_deref()),
    ])
    .map_err(anyhow::Error::msg)?;
    let config = load_config_dir(&settings.config_dir)?;
    // Only the stdio servers the operator defined here (or whose programs MCP_STDIO_COMMANDS
    // names) start: the config service, which anyone on the broker can write, may define others.
    let stdio_trust = agent_mcp::StdioTrust::from_env(
        config
            .mcp
            .values()
            .filter_map(|s| agent_mcp::Endpoint::of(s).ok()),
    );
    let llm = LlmClient::new(settings.llm_config())?;
    let topics = settings.topics();
    metrics::describe();
    let stats = Arc::new(ConsumerStats::default());
    let knowledge = settings.shared_store()?;
    let ops = Arc::new(ops::OpsState::new(stats.clone(), knowledge.clone()));
    let listener = tokio::net::TcpListener::bind(settings.http_addr)
        .await
        .map_err(|e| {
            anyhow::anyhow!("cannot listen on {} (--http-addr): {e}", settings.http_addr)
        })?;
    tracing::info!(addr = %listener.local_addr()?, "health and metrics endpoint listening");
    let ops_server = tokio::spawn(ops::serve(listener, ops, settings.http.clone()));
    let Some(bus) = connect_until_up(&settings, &shutdown).await else {
        ops_server.abort();
        return Ok(());
    };
    let seal_key =
        agent_bus::seal::SealKey::configured(settings.seal_key.as_deref(), "agent-orchestrator");
    let publishers = Publishers {
        responses: Publisher::new(&bus, &topics.response).await?,
        requests: Publisher::new(&bus, &topics.request).await?,
        explainability: Publisher::new(&bus, &topics.explainability).await?,
        explain_seal: seal_key.clone().map(Arc::new),
    };
    // The dead letters' forwarder republishes requests as they are.
    let forward_requests = publishers.requests.clone();
    let outputs = Outputs::Broker(publishers);
    let live = Arc::new(LiveConfig::new(config));
    let first_read = Arc::new(tokio::sync::Notify::new());
    let follower = tokio::spawn(live_config::follow(
        live.clone(),
        bus.clone(),
        topics.clone(),
        settings.broker.workspace.clone(),
        first_read.clone(),
        shutdown.clone(),
    ));
    // The deployment's tools and prompts are in force before the first request is handled. The
    // subscriptions are made at once all the same: pulsar-lite has been seen to stall handing a
    // subscription made late a backlog of hundreds.
    let (config_read, config_ready) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(live_config::FIRST_READ_WAIT, first_read.notified()).await;
        let _ = config_read.send(true);
    });
    let journal = knowledge
        .as_ref()
        .map(|store| Journal::new(store.journal()));
    match &journal {
        None => tracing::warn!("no shared graph store (GRAPH_STORE as an http(s) SPARQL endpoint): iterations are at-least-once"),
        // A SPARQL server that is not an aggregator cannot decide who wins a record: refusing to
        // start beats a guarantee that silently does not hold.
        Some(journal) => match journal.check().await {
            Err(e @ agent_graph::GraphError::NoJournal(_)) => return Err(e.into()),
            // Refused, the journal would fail every step: better said once, at start.
            Err(e @ agent_graph::GraphError::Http { status: 401 | 403, .. }) => {
                anyhow::bail!("the aggregator at GRAPH_STORE refuses this orchestrator's CONFIG_TOKEN for its journal: {e}")
            }
            Err(e) => tracing::warn!(error = %e, "the journal does not answer yet; steps wait for it"),
            Ok(()) => {}
        },
    }
    // Cancels are heard from now on; those sent before are read from the graph after subscribing,
    // so none falls between the two.
    let cancellations = Arc::new(cancel::Cancellations::default());
    let subscribed = match agent_bus::ControlListener::subscribe(&bus, &topics).await {
        Ok(listener) => Some(listener),
        Err(e) => {
            tracing::warn!(error = %e, "cannot hear the control topic yet; trying again");
            None
        }
    };
    // Cancels are heard until the consumers have drained, not only until the shutdown begins:
    // a step still running in the drain must stop at a cancel as any other does.
    let stop_hearing = CancellationToken::new();
    let _stop_hearing_on_return = stop_hearing.clone().drop_guard();
    let hearing = tokio::spawn(cancel::listen(
        bus.clone(),
        topics.clone(),
        (subscribed, knowledge.clone()),
        cancellations.clone(),
        (seal_key.clone(), settings.control_seals),
        stop_hearing.clone(),
    ));
    if let Some(store) = &knowledge {
        match cancel::load(store, &cancellations).await {
            Ok(0) => {}
            Ok(loaded) => tracing::info!(loaded, "cancelled runs read from the graph"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read earlier cancels from the graph yet; reading again in the background")
            }
        }
        // Again until a read succeeds, and once more a moment later for a record that reached
        // the graph after its message.
        tokio::spawn(cancel::catch_up(
            store.clone(),
            cancellations.clone(),
            shutdown.clone(),
        ));
    }
    let documents = match settings.document_store {
        DocumentStoreKind::Graph => knowledge.clone().map(DocumentStore::Graph),
        DocumentStoreKind::Librarian => {
            let timeout = Duration::from_secs(settings.librarian_timeout_secs.max(1));
            let librarian = agent_bus::Librarian::connect(&bus, &topics, timeout).await?;
            tracing::info!(topic = %topics.librarian_request, "long texts are kept in TrustGraph's librarian");
            Some(DocumentStore::Librarian {
                librarian: Arc::new(librarian),
                graph: knowledge.clone(),
            })
        }
    };
    let engine = Arc::new(Engine {
        config: live,
        llm,
        outputs,
        journal,
        knowledge,
        replays: crate::replay::KeptRecords::default(),
        documents,
        mcp: agent_mcp::McpPool::new().trusting(stdio_trust),
        shutdown: shutdown.clone(),
        seal: seal_key,
        cancellations,
        answering: approval::OneAtATime::default(),
        control: Some(Publisher::new(&bus, &topics.control).await?),
        continue_in_process: settings.continue_in_process,
        handling: Default::default(),
        max_takings: u32::try_from(settings.max_redeliveries)
            .ok()
            .filter(|&n| n > 0),
        turns: Default::default(),
        start_lease: Duration::from_secs(settings.conversation_start_lease_secs).clamp(
            agent_graph::turns::LEASE_BOUNDS.0,
            agent_graph::turns::LEASE_BOUNDS.1,
        ),
        answers_waiting: Default::default(),
        step_seals: settings.step_seals,
        subagent_seals: settings.subagent_seals,
        control_seals: settings.control_seals,
    });
    if let (true, Some(journal)) = (settings.continue_in_process, &engine.journal) {
        tokio::spawn(crate::chains::beat(
            journal.clone(),
            Duration::from_secs(settings.chain_lease_secs.max(1)),
            shutdown.clone(),
        ));
    }
    if settings.continue_in_process
        && settings.max_redeliveries > 0
        && settings.broker_redelivery_bound().is_none()
    {
        tracing::info!(max_takings = settings.max_redeliveries, "continuing in process: the journal's owner alone bounds a step's takings; the broker's redelivery count, which a chain's unacked root gathers from every crash, dead-letters nothing here");
    }
    let subscription = SubscriptionConfig {
        topic: topics.request.clone(),
        subscription: settings.subscription.clone(),
        max_in_flight: settings.max_in_flight,
        max_redeliveries: settings.broker_redelivery_bound(),
        dead_letter_topic: topics.dead_letter.clone(),
        drain_deadline: std::time::Duration::from_secs(settings.drain_secs),
        nack_delay: std::time::Duration::from_secs(1),
        one_at_a_time: false,
    };
    let answering = tokio::spawn(answer_dead_letters(
        bus.clone(),
        engine.clone(),
        topics.dead_letter.clone(),
        format!("{}-dead-letters", settings.subscription),
        settings.max_redeliveries,
        shutdown.clone(),
    ));
    // TrustGraph's clients publish on its non-persistent request topic: first messages are taken
    // there too, and everything they cause goes on the persistent one. On a connection of their
    // own: a broker drops a non-persistent message for a consumer whose connection has too much
    // waiting to be written to it (Apache Pulsar: Netty's 64 KiB write-buffer mark), and on the
    // shared one the persistent topic's dispatches of this very burst are what fills it.
    let taking_from_clients =
        !topics.client_request.is_empty() && topics.client_request != topics.request;
    let client_bus = if taking_from_clients {
        let Some(client_bus) = connect_until_up(&settings, &shutdown).await else {
            ops_server.abort();
            return Ok(());
        };
        Some(client_bus)
    } else {
        None
    };
    let from_clients = client_bus.as_ref().map(|client_bus| {
        let config = SubscriptionConfig {
            topic: topics.client_request.clone(),
            subscription: format!("{}-clients", settings.subscription),
            max_in_flight: settings.max_in_flight,
            // Non-persistent: nothing is redelivered, so no delivery count.
            max_redeliveries: None,
            dead_letter_topic: topics.dead_letter.clone(),
            drain_deadline: std::time::Duration::from_secs(settings.drain_secs),
            nack_delay: std::time::Duration::from_secs(1),
            one_at_a_time: false,
        };
        // Forwarded at once to the persistent topic and only then acked: a message of a
        // non-persistent topic is never redelivered, so it must not wait (park) there.
        let requests = forward_requests.clone();
        spawn_consumer(
            client_bus,
            config,
            &shutdown,
            "taking requests on the client topic stopped",
            move |delivery: Delivery<AgentRequest>| {
                let requests = requests.clone();
                async move {
                    let payload = agent_schema::encode(&delivery.payload);
                    // Only this service's chains name one (see `emit::CHAIN_PROPERTY`).
                    let mut properties = delivery.properties;
                    properties.remove(crate::emit::CHAIN_PROPERTY);
                    match requests.send(payload, &properties).await {
                        Ok(()) => Disposition::Ack,
                        Err(e) => Disposition::Nack(format!(
                            "forwarding a client's request to the request topic: {e}"
                        )),
                    }
                }
            },
        )
    });
    // Answers to approvals: one replica takes each up, whichever parked the call.
    let answering_approvals = {
        let config = SubscriptionConfig {
            topic: topics.control_request.clone(),
            subscription: format!("{}-control", settings.subscription),
            max_in_flight: 4,
            max_redeliveries: None,
            dead_letter_topic: String::new(),
            drain_deadline: std::time::Duration::from_secs(settings.drain_secs),
            nack_delay: std::time::Duration::from_secs(1),
            // One replica takes answers up at a time, so two copies of one never run side by side.
            one_at_a_time: true,
        };
        let engine = engine.clone();
        let config_ready = config_ready.clone();
        spawn_consumer(
            &bus,
            config,
            &shutdown,
            "taking answers to approvals stopped",
            move |delivery: Delivery<agent_schema::AgentControl>| {
                let engine = engine.clone();
                let mut ready = config_ready.clone();
                async move {
                    // As for requests: a call resumed on its answer is checked against the
                    // deployment's tools and limits, not the files this replica started with.
                    let _ = ready.wait_for(|read| *read).await;
                    engine.answer(delivery).await
                }
            },
        )
    };
    tracing::info!(request = %topics.request, client_request = %topics.client_request, response = %topics.response, "agent-orchestrator ready");
    let consumed = run_consumer(
        &bus,
        subscription,
        stats,
        shutdown.clone(),
        move |delivery| {
            let engine = engine.clone();
            let mut ready = config_ready.clone();
            async move {
                // Resolves at once after the first read (the value stays true).
                let _ = ready.wait_for(|read| *read).await;
                engine.handle(delivery).await
            }
        },
    )
    .await;
    // The follower stops with the consumer, so its subscriptions close before the process ends.
    shutdown.cancel();
    let _ = follower.await;
    let mut side_consumers = vec![answering.await, answering_approvals.await];
    if let Some(from_clients) = from_clients {
        side_consumers.push(from_clients.await);
    }
    stop_hearing.cancel();
    let _ = hearing.await;
    ops_server.abort();
    consumed?;
    for stopped in side_consumers {
        // Its failure was logged as it happened, and stopped the service.
        stopped.map_err(anyhow::Error::from)??;
    }
    Ok(())
}

/// Runs a consumer beside the main one until `shutdown`. If it fails (its first subscription
/// refused, or not served within the bus's patience), `stopped` is logged and the whole service
/// stops with the error: a service that went on without it looked ready while it took no
/// clients' requests, or no answers to approvals, or answered no dead-lettered request.
pub(crate) fn spawn_consumer<T, F, Fut>(
    bus: &agent_bus::Bus,
    config: SubscriptionConfig,
    shutdown: &CancellationToken,
    stopped: &'static str,
    handler: F,
) -> tokio::task::JoinHandle<Result<(), agent_bus::BusError>>
where
    T: serde::de::DeserializeOwned + Send + 'static,
    F: Fn(Delivery<T>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Disposition> + Send + 'static,
{
    let bus = bus.clone();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        let taken = run_consumer(
            &bus,
            config,
            Arc::new(ConsumerStats::default()),
            shutdown.clone(),
            handler,
        )
        .await;
        if let Err(e) = &taken {
            tracing::error!(error = %e, "{stopped}; the service stops");
            shutdown.cancel();
        }
        taken
    })
}

/// Answers for requests the broker moved to the dead-letter topic (its redelivery limit: a step
/// that crashed its process, or was handed to lost consumers, `max_redeliveries` times): each
/// ends its dialog with an error, or fails its subagent's completion, so no client or supervisor
/// waits forever. A step whose outcome was journaled goes out as recorded instead. What does not
/// decode is acked and dropped here (it stays in the topic for other readers): it never was a
/// dialog.
pub(crate) async fn answer_dead_letters(
    bus: agent_bus::Bus,
    engine: Arc<Engine>,
    topic: String,
    subscription: String,
    max_redeliveries: usize,
    shutdown: CancellationToken,
) -> Result<(), agent_bus::BusError> {
    let config = SubscriptionConfig {
        topic,
        subscription,
        max_in_flight: 4,
        max_redeliveries: None,
        dead_letter_topic: String::new(),
        drain_deadline: Duration::from_secs(5),
        nack_delay: Duration::from_secs(1),
        one_at_a_time: false,
    };
    let answered = run_consumer(
        &bus,
        config,
        Arc::new(ConsumerStats::default()),
        shutdown.clone(),
        move |delivery: Delivery<AgentRequest>| {
            let engine = engine.clone();
            async move {
                let why = match delivery.properties.get(agent_bus::DEAD_LETTER_REASON) {
                    Some(reason) => format!("the step was given up on: {reason}"),
                    None => format!("the step did not finish in {max_redeliveries} deliveries (its process crashed or lost its broker connection each time); it was moved to the dead-letter topic"),
                };
                engine.give_up(delivery, &why, None).await
            }
        },
    )
    .await;
    if let Err(e) = &answered {
        // As a consumer beside the main one (see `spawn_consumer`): the service stops with it.
        tracing::error!(error = %e, "answering dead-lettered requests stopped; the service stops");
        shutdown.cancel();
    }
    answered
}

/// The broker connection, tried again with backoff until it is up (a pod may start before its
/// broker); `None` when shut down first.
pub(crate) async fn connect_until_up(
    settings: &Settings,
    shutdown: &CancellationToken,
) -> Option<agent_bus::Bus> {
    let mut wait = Duration::from_millis(250);
    loop {
        match settings.broker.connect().await {
            Ok(bus) => return Some(bus),
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "the broker is not reachable yet");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(Duration::from_secs(5));
            }
        }
    }
}

#[cfg(test)]
mod seed_tests {
    /// Every file in `config-seed/` loads into a valid config.
    #[test]
    fn the_seed_directory_loads() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config-seed");
        let config = crate::load_config_dir(&dir).unwrap();
        assert!(config.tool_by_name("llm").is_some());
        assert_eq!(config.prompts, agent_core::prompt::Prompts::default());
        for task in config.task_types.values() {
            let (runnable, _) = agent_core::router::pattern_candidates(&config, task);
            assert!(
                !runnable.is_empty(),
                "{} has no runnable pattern",
                task.name
            );
        }
        for name in ["general", "research", "risk-assessment", "summarisation"] {
            assert!(config.task_types.contains_key(name), "{name} is not seeded");
        }
        for name in ["react", "plan-then-execute", "supervisor", "llm-router"] {
            assert!(config.patterns.contains_key(name), "{name} is not seeded");
        }
        assert_eq!(config.limits, agent_core::config::Limits::default());
    }
}
