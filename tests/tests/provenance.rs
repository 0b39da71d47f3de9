//! Provenance end to end: the orchestrator's explainability stream, written by the aggregator into
//! the graph store and read back over its SPARQL endpoint.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::time::Duration;

use agent_e2e::*;
use agent_graph::convert::into_quads;
use agent_graph::explain::session_view;
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore, QueryAnswer};
use agent_schema::Triples;
use futures::StreamExt;

const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);
const EXPLAIN_TOPIC: &str = "persistent://tg/flow/triples-store:default:default";

/// Waits until the aggregator has written the node.
async fn wait_for_node(store: &GraphStore, node: &str) {
    let node = agent_graph::model::NamedNode::new(node).unwrap();
    for _ in 0..400 {
        if let Ok(QueryAnswer::Boolean(true)) = store.query(queries::node_exists(&node)).await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{node} never reached the graph");
}

/// Every triple of one session, read from its root.
async fn session_rows(store: &GraphStore, session: &str) -> agent_graph::Rows {
    store
        .query(queries::session_triples(
            &queries::session_node(session).unwrap(),
        ))
        .await
        .unwrap()
        .rows()
}

fn iri(t: &Term) -> String {
    match t {
        Term::NamedNode(n) => n.as_str().to_owned(),
        other => other.to_string(),
    }
}

/// Every quad of the provenance graph, as N-Quads lines.
async fn all_quads(store: &GraphStore) -> BTreeSet<String> {
    let rows = store
        .query(format!(
            "SELECT ?s ?p ?o WHERE {{ GRAPH <{}> {{ ?s ?p ?o }} }}",
            agent_core::vocab::PROVENANCE_GRAPH
        ))
        .await
        .unwrap()
        .rows();
    rows.rows
        .iter()
        .map(|r| {
            let t = |i: usize| r[i].as_ref().unwrap().to_string();
            format!(
                "{} {} {} <{}> .",
                t(0),
                t(1),
                t(2),
                agent_core::vocab::PROVENANCE_GRAPH
            )
        })
        .collect()
}

/// After a three-iteration dialog, following `prov:wasDerivedFrom` (and `tg:thought`) from the
/// conclusion reaches every iteration, thought, observation and the session; nothing points at a
/// node that is not there; and the tokens in the graph add up to those of the final response.
#[tokio::test]
async fn the_graph_explains_a_three_iteration_dialog() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(THREE_STEPS).await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("p-3", &request("combine alpha and beta", true))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "p-3", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let session = session_of(&responses);
    let store = aggregator.store();
    wait_for_node(&store, &format!("{session}/final")).await;

    let conclusion = queries::session_node(&format!("{session}/final")).unwrap();
    let reached: BTreeSet<String> = store
        .query(queries::derivation_closure(&conclusion))
        .await
        .unwrap()
        .rows()
        .column("n")
        .into_iter()
        .map(|t| iri(t.unwrap()))
        .collect();
    for node in [
        "",
        "/pattern-decision",
        "/i1",
        "/i1/thought",
        "/i1/observation",
        "/i2",
        "/i2/thought",
        "/i2/observation",
        "/i3/thought",
        "/final",
    ] {
        assert!(
            reached.contains(&format!("{session}{node}")),
            "{node} not reached: {reached:#?}"
        );
    }

    // No dangling node: every node an edge points at exists in the graph.
    let rows = session_rows(&store, &session).await;
    let subjects: BTreeSet<String> = rows
        .column("s")
        .into_iter()
        .map(|t| iri(t.unwrap()))
        .collect();
    let linking = [
        "http://www.w3.org/ns/prov#wasDerivedFrom",
        "https://trustgraph.ai/ns/thought",
        "https://trustgraph.ai/ns/document",
    ];
    for (p, o) in rows.column("p").into_iter().zip(rows.column("o")) {
        if linking.contains(&iri(p.unwrap()).as_str()) {
            let target = iri(o.unwrap());
            assert!(subjects.contains(&target), "dangling link to {target}");
        }
    }

    let view = session_view(&session, &rows);
    assert_eq!(view.question, "combine alpha and beta");
    assert_eq!(view.iterations.len(), 2);
    assert_eq!(view.iterations[0].observation, "alpha-result");
    assert_eq!(view.iterations[1].thought, "Now the second part.");
    assert_eq!(view.iterations[0].candidates, ["llm", "summarise"]);
    let conclusion = view.conclusion.as_ref().unwrap();
    assert_eq!(conclusion.answer, "alpha and beta, combined.");
    assert_eq!(conclusion.termination, "answer");
    let closing = responses.last().unwrap();
    assert_eq!(
        (view.in_token, view.out_token),
        (closing.in_token.unwrap(), closing.out_token.unwrap())
    );
}

/// A question full of quotes, brackets, newlines and SPARQL is stored verbatim as a literal, and the
/// same explainability message delivered twice leaves the graph unchanged.
#[tokio::test]
async fn hostile_text_is_stored_verbatim_and_duplicates_change_nothing() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm =
        scripted_llm(r#"{"rules": [{"match": "", "reply": "Thought: ok\nFinal Answer: fine"}]}"#)
            .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let hostile =
        "He said \"hi\" <b>bold</b> 'single'\nsecond line \\ backslash \"} ; DROP ALL ; {\"";
    client.send("p-h", &request(hostile, false)).await.unwrap();
    let responses = collect_dialog(&mut client, "p-h", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let session = session_of(&responses);
    let store = aggregator.store();
    wait_for_node(&store, &format!("{session}/final")).await;
    let rows = session_rows(&store, &session).await;
    assert_eq!(session_view(&session, &rows).question, hostile);
    let before = all_quads(&store).await;
    assert!(before.len() > 20);

    // Publish one of the session's messages again, as a redelivery would.
    let explain = responses
        .iter()
        .find(|r| r.message_type == "explain")
        .unwrap();
    let duplicate = Triples {
        metadata: agent_schema::Metadata {
            id: explain.explain_id.clone().unwrap(),
            root: session.clone(),
            collection: "default".into(),
        },
        triples: explain.explain_triples.clone(),
    };
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let publisher = agent_bus::Publisher::new(&bus, EXPLAIN_TOPIC)
        .await
        .unwrap();
    let duplicate = agent_schema::encode(&duplicate);
    for _ in 0..2 {
        publisher
            .send(duplicate.clone(), &sealed_explain(&duplicate))
            .await
            .unwrap();
    }
    // A marker message after the duplicates: once it is in, the duplicates were processed too.
    let marker = Triples {
        metadata: Default::default(),
        triples: vec![agent_schema::Triple {
            s: agent_schema::Term::iri("urn:test:marker"),
            p: agent_schema::Term::iri("urn:test:p"),
            o: agent_schema::Term::literal("m"),
            g: Some(agent_core::vocab::PROVENANCE_GRAPH.into()),
        }],
    };
    publisher
        .send(agent_schema::encode(&marker), &Default::default())
        .await
        .unwrap();
    wait_for_node(&store, "urn:test:marker").await;
    let mut after = all_quads(&store).await;
    after.retain(|q| !q.contains("urn:test:marker"));
    assert_eq!(before, after);
}

/// A triple that is not valid RDF (an IRI with a space in it), or that only the aggregator may
/// write (in the journal's graph: a planted entry would be re-emitted as the service's own; a
/// fan-in mark), keeps only itself out of the graph: the other triples of its message are written, and the
/// message goes to the dead-letter topic saying how many were left out. A fan-out, which drives
/// fan-in, is written whole or not at all.
#[tokio::test]
async fn a_triple_that_may_not_be_written_keeps_only_itself_out_of_the_graph() {
    use agent_core::vocab::{tg, JOURNAL_GRAPH, RDF_TYPE};
    use agent_schema::{Metadata, Term as WireTerm, Triple};
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let store = aggregator.store();
    let mut dead_letters = read_from_start(
        &broker,
        &agent_bus::dead_letter_of(EXPLAIN_TOPIC),
        "test-dead-letters",
    )
    .await;
    let message = |id: &str, triples: Vec<Triple>| Triples {
        metadata: Metadata {
            id: id.to_owned(),
            root: "urn:test:root".to_owned(),
            collection: "default".to_owned(),
        },
        triples,
    };
    let step = message(
        "urn:test:step-message",
        vec![
            triple("urn:test:thought", "urn:test:p", WireTerm::literal("one")),
            triple(
                "urn:test:thought",
                "urn:test:not rdf",
                WireTerm::literal("x"),
            ),
            triple(
                "urn:test:observation",
                "urn:test:p",
                WireTerm::literal("two"),
            ),
            triple(
                "urn:test:observation",
                "urn:test:q",
                WireTerm::iri("urn:test:thought"),
            ),
        ],
    );
    let fan_out = message(
        "urn:test:fanout-message",
        vec![
            triple(
                "urn:test:fanout",
                RDF_TYPE.as_str(),
                WireTerm::iri(tg::FAN_OUT.as_str()),
            ),
            triple(
                "urn:test:fanout",
                tg::CORRELATION_ID.as_str(),
                WireTerm::literal("c1"),
            ),
            triple(
                "urn:test:fanout",
                "urn:test:not rdf",
                WireTerm::literal("x"),
            ),
        ],
    );
    let planted = message(
        "urn:test:journal-message",
        vec![
            triple("urn:test:beside", "urn:test:p", WireTerm::literal("kept")),
            Triple {
                g: Some(JOURNAL_GRAPH.into()),
                ..triple("urn:test:planted", "urn:test:p", WireTerm::literal("entry"))
            },
            triple(
                "urn:test:beside",
                tg::SYNTHESIS_REQUESTED.as_str(),
                WireTerm::literal("true"),
            ),
        ],
    );
    let marker = message(
        "urn:test:marker-message",
        vec![triple(
            "urn:test:marker",
            "urn:test:p",
            WireTerm::literal("m"),
        )],
    );
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let publisher = agent_bus::Publisher::new(&bus, EXPLAIN_TOPIC)
        .await
        .unwrap();
    // Sealed as the services' own: what only the aggregator writes is refused all the same.
    for m in [&step, &fan_out, &planted, &marker] {
        let m = agent_schema::encode(m);
        publisher
            .send(m.clone(), &sealed_explain(&m))
            .await
            .unwrap();
    }
    // A message is dead-lettered only after what is written of it committed, so the graph is
    // read once both dead letters are in (the marker could be written before them: the
    // aggregator handles messages side by side).
    let reasons = dead_letter_reasons(&mut dead_letters, 3).await;
    wait_for_node(&store, "urn:test:marker").await;
    let stored = all_quads(&store).await;
    let about = |node: &str| {
        let subject = format!("<{node}>");
        stored.iter().filter(|q| q.starts_with(&subject)).count()
    };
    assert_eq!(about("urn:test:thought"), 1, "{stored:#?}");
    assert_eq!(about("urn:test:observation"), 2, "{stored:#?}");
    assert_eq!(about("urn:test:fanout"), 0, "{stored:#?}");
    // Only its own triple: the synthesis mark, which only the aggregator writes, is left out.
    assert_eq!(about("urn:test:beside"), 1, "{stored:#?}");
    let in_journal =
        format!("SELECT ?o WHERE {{ GRAPH <{JOURNAL_GRAPH}> {{ <urn:test:planted> ?p ?o }} }}");
    assert_eq!(count(&store, in_journal).await, 0);
    let reason_of = |id: &str| {
        reasons
            .iter()
            .find(|r| r.contains(id))
            .unwrap_or_else(|| panic!("no dead letter of {id}: {reasons:#?}"))
            .clone()
    };
    let step_reason = reason_of("urn:test:step-message");
    assert!(
        step_reason.contains("1 of the 4 triples") && step_reason.contains("the other 3 written"),
        "{step_reason}"
    );
    assert!(step_reason.contains("triple 2"), "{step_reason}");
    let planted_reason = reason_of("urn:test:journal-message");
    assert!(
        planted_reason.contains("2 of the 3 triples")
            && planted_reason.contains("only the aggregator writes")
            && planted_reason.contains("the other 1 written"),
        "{planted_reason}"
    );
    let fan_out_reason = reason_of("urn:test:fanout-message");
    assert!(
        fan_out_reason.contains("none is written"),
        "{fan_out_reason}"
    );
}

/// A replica writes each explainability message through the owner's endpoint as one update: one
/// of several MB (the broker takes 5 MB by default) reaches the owner's store whole. The owner's
/// `/update` took at most 2 MB, and the replica could never write such a message. Its text is
/// code-like, with brackets and operators in every line (700,000 in all): the owner counted them
/// inside the literal as levels of nesting and refused the update past 100,000, and the replica
/// dead-lettered the message (a tool's result, a fan-out, a completion lost).
#[tokio::test]
async fn a_replica_writes_a_message_of_several_megabytes_through_its_owner() {
    use agent_schema::{Metadata, Term as WireTerm};
    const TOKEN: &str = "replica-token";
    let broker = Broker::start().unwrap();
    // The owner reads another topic, so the message is the replica's to write.
    let owner = Aggregator::spawn_with(
        &broker,
        &[
            "--config-token",
            TOKEN,
            "--explain-topic",
            "persistent://tg/flow/owner-only-explain",
        ],
    );
    let _replica = Aggregator::replica_with(&broker, &owner, TOKEN, &[]);
    // Quotes and line breaks: each escaped in the update, so its text is larger still.
    let text = "a \"quoted\" line: f(x) - {y} / [z]\n".repeat(100_000);
    assert!(text.len() > 3 * 1024 * 1024, "{}", text.len());
    let message = Triples {
        metadata: Metadata {
            id: "urn:test:large-message".to_owned(),
            root: "urn:test:root".to_owned(),
            collection: "default".to_owned(),
        },
        triples: vec![triple(
            "urn:test:large",
            "urn:test:text",
            WireTerm::literal(&text),
        )],
    };
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let publisher = agent_bus::Publisher::new(&bus, EXPLAIN_TOPIC)
        .await
        .unwrap();
    let payload = agent_schema::encode(&message);
    publisher
        .send(payload.clone(), &sealed_explain(&payload))
        .await
        .unwrap();
    let store = GraphStore::open(&owner.endpoint, Some(TOKEN.to_owned())).unwrap();
    wait_for_node(&store, "urn:test:large").await;
    let stored = store
        .query("SELECT ?o WHERE { GRAPH ?g { <urn:test:large> <urn:test:text> ?o } }".to_owned())
        .await
        .unwrap()
        .rows();
    match stored.first("o") {
        Some(Term::Literal(l)) => assert_eq!(l.value(), text),
        other => panic!("{other:?}"),
    }
}

/// Only a message the orchestrators sealed writes the agent's records: from one without the seal
/// (anyone who can publish to the topic), triples naming an agent node (as subject or object) or
/// a long text's node are left out and the message dead-lettered, the rest written (TrustGraph's
/// other services share the topic); a fan-out without it is written not at all, whatever it
/// names. The same message sealed is written whole.
#[tokio::test]
async fn only_sealed_explainability_writes_the_agents_records() {
    use agent_core::vocab::{tg, PROVENANCE_GRAPH, RDF_TYPE};
    use agent_schema::{Metadata, Term as WireTerm, Triple};
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let store = aggregator.store();
    let mut dead_letters = read_from_start(
        &broker,
        &agent_bus::dead_letter_of(EXPLAIN_TOPIC),
        "test-dead-letters",
    )
    .await;
    let message = |id: &str, triples: Vec<Triple>| {
        agent_schema::encode(&Triples {
            metadata: Metadata {
                id: id.to_owned(),
                root: String::new(),
                collection: "default".to_owned(),
            },
            triples,
        })
    };
    let agent_node = "urn:trustgraph:agent:victim/final";
    let records = vec![
        triple(
            agent_node,
            tg::TERMINATION_REASON.as_str(),
            WireTerm::literal("answer"),
        ),
        triple(
            "urn:test:knowledge",
            "urn:test:about",
            WireTerm::iri(agent_node),
        ),
        triple(
            &agent_core::documents::document_uri("forged"),
            tg::CONTENT.as_str(),
            WireTerm::literal("forged"),
        ),
        triple(
            "urn:test:knowledge",
            "urn:test:p",
            WireTerm::literal("kept"),
        ),
    ];
    let unsealed = message("urn:test:unsealed", records.clone());
    let fan_out = message(
        "urn:test:unsealed-fanout",
        vec![
            triple(
                "urn:test:fanout",
                RDF_TYPE.as_str(),
                WireTerm::iri(tg::FAN_OUT.as_str()),
            ),
            triple(
                "urn:test:fanout",
                tg::CORRELATION_ID.as_str(),
                WireTerm::literal("victim-f1"),
            ),
        ],
    );
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let publisher = agent_bus::Publisher::new(&bus, EXPLAIN_TOPIC)
        .await
        .unwrap();
    for m in [unsealed, fan_out] {
        publisher.send(m, &Default::default()).await.unwrap();
    }
    let reasons = dead_letter_reasons(&mut dead_letters, 2).await;
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("urn:test:unsealed-fanout")
                && r.contains("without the orchestrators' seal; none of it is written")),
        "{reasons:#?}"
    );
    assert!(
        reasons
            .iter()
            .any(|r| r.contains("3 of the 4 triples of urn:test:unsealed ")
                && r.contains("the other 1 written")),
        "{reasons:#?}"
    );
    let stored = all_quads(&store).await;
    let mentioning = |text: &str| stored.iter().filter(|q| q.contains(text)).count();
    assert_eq!(mentioning("urn:test:knowledge"), 1, "{stored:#?}");
    assert_eq!(mentioning("urn:trustgraph:agent:victim"), 0, "{stored:#?}");
    assert_eq!(mentioning("urn:trustgraph:doc:"), 0, "{stored:#?}");
    assert_eq!(mentioning("urn:test:fanout"), 0, "{stored:#?}");

    // Sealed as the orchestrators seal: all of it.
    let sealed = message("urn:test:sealed", records);
    publisher
        .send(sealed.clone(), &sealed_explain(&sealed))
        .await
        .unwrap();
    let about_victim =
        format!("SELECT ?o WHERE {{ GRAPH <{PROVENANCE_GRAPH}> {{ <{agent_node}> ?p ?o }} }}");
    assert_eq!(count_reaching(&store, about_victim, 1).await, 1);
    let stored = all_quads(&store).await;
    assert_eq!(
        stored
            .iter()
            .filter(|q| q.contains("urn:test:knowledge"))
            .count(),
        2
    );
    assert_eq!(
        stored
            .iter()
            .filter(|q| q.contains("urn:trustgraph:doc:"))
            .count(),
        1
    );
}

/// A triple of the provenance graph, as a test publishes it.
fn triple(s: &str, p: &str, o: agent_schema::Term) -> agent_schema::Triple {
    agent_schema::Triple {
        s: agent_schema::Term::iri(s),
        p: agent_schema::Term::iri(p),
        o,
        g: Some(agent_core::vocab::PROVENANCE_GRAPH.into()),
    }
}

/// The reasons of the next `count` distinct dead letters (each acked), within 30 s.
async fn dead_letter_reasons(
    dead_letters: &mut pulsar::Consumer<Vec<u8>, pulsar::TokioExecutor>,
    count: usize,
) -> BTreeSet<String> {
    let mut reasons = BTreeSet::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while reasons.len() < count {
        let letter = tokio::time::timeout_at(deadline, dead_letters.next())
            .await
            .unwrap_or_else(|_| panic!("dead letters so far: {reasons:#?}"))
            .unwrap()
            .unwrap();
        dead_letters.ack(&letter).await.unwrap();
        reasons.insert(
            agent_bus::message_property(&letter, agent_bus::DEAD_LETTER_REASON)
                .unwrap_or_default()
                .to_owned(),
        );
    }
    reasons
}

/// Waits until every expected quad is stored (or `patience` passes) and returns what is stored.
async fn stored_when_complete(
    store: &GraphStore,
    expected: &BTreeSet<String>,
    patience: Duration,
) -> BTreeSet<String> {
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let stored = all_quads(store).await;
        if expected.is_subset(&stored) || tokio::time::Instant::now() > deadline {
            return stored;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// An aggregator SIGKILLed while triples flow, then restarted, ends with exactly the triples that
/// were published: the union of every explainability message (what a run without the kill writes).
///
/// pulsar-lite 0.2.0 has a bug that Apache Pulsar has not: when a killed consumer's connection is
/// reset (it died with data in flight), the broker never removes that consumer, and the messages
/// it held stay with the ghost until the broker restarts. When quads are missing, the test looks
/// for that evidence in the broker's log: without it the aggregator is at fault and the test
/// fails; with it, the test reports the broker bug and restarts the broker (which an
/// at-least-once pipeline must survive anyway), after which nothing may be missing.
#[tokio::test]
async fn a_killed_aggregator_loses_and_duplicates_nothing() {
    let mut broker = Broker::start().unwrap();
    let mut ground_truth = read_from_start(&broker, EXPLAIN_TOPIC, "test-ground-truth").await;
    let mut aggregator = Aggregator::start(Place::Child, &broker, &[]);
    let llm = scripted_llm(THREE_STEPS).await;
    let mut orchestrator =
        Orchestrator::spawn(&broker, &llm, &seed_dir(), &["--max-in-flight", "16"]);
    let mut client = client(&broker).await;
    let dialogs = 24;
    let run = uuid::Uuid::new_v4().simple().to_string();
    let session_of = |i: usize| format!("kill-{run}-{i}");
    for i in 0..dialogs {
        let asked = agent_schema::AgentRequest {
            session_id: session_of(i),
            ..request(&format!("combine #{i}"), false)
        };
        client.send(&format!("k-{i}"), &asked).await.unwrap();
    }
    let mut conclusions = Conclusions::watch(&broker).await;
    // Kill while the stream is flowing.
    let store = aggregator.store();
    for _ in 0..400 {
        if store.count().await.unwrap_or(0) > 100 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    aggregator.kill_and_restart();

    // This test is about the aggregator: a dialog that concluded has ended, even should its
    // closing not reach the client.
    let open = (0..dialogs)
        .map(|i| (format!("k-{i}"), session_of(i)))
        .collect();
    await_endings(
        &mut client,
        &mut conclusions,
        open,
        DIALOG_TIMEOUT,
        |_, _| {},
    )
    .await;
    drop(conclusions);

    // What a run without the kill writes: every published message, in a store of its own (the
    // store's canonical literal forms, e.g. of xsd:dateTime, are then the same on both sides).
    let reference = GraphStore::in_memory().unwrap();
    let mut published = 0;
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_secs(2), ground_truth.next()).await
    {
        published += 1;
        let triples: Triples = agent_schema::decode(&message.payload.data).unwrap();
        reference
            .insert(into_quads(triples.triples).unwrap())
            .await
            .unwrap();
    }
    let expected = all_quads(&reference).await;
    assert!(
        expected.len() > dialogs * 40,
        "{} quads expected",
        expected.len()
    );
    eprintln!(
        "{published} explainability messages, {} quads",
        expected.len()
    );
    let store = aggregator.store();
    let mut stored = stored_when_complete(&store, &expected, Duration::from_secs(20)).await;
    if !expected.is_subset(&stored) {
        let evidence = broker.reset_connections();
        let missing = expected.difference(&stored).count();
        assert!(
            !evidence.is_empty(),
            "{missing} quads never reached the store and the broker reset no connection: the aggregator lost them: {:#?}",
            expected.difference(&stored).take(5).collect::<Vec<_>>()
        );
        eprintln!(
            "pulsar-lite bug: {missing} quads missing after 20 s, held by a ghost consumer of a reset connection:\n  {}\nrestarting the broker to recover them",
            evidence.join("\n  ")
        );
        // Every dialog has ended; the orchestrator goes first so that requests whose acks
        // pulsar-lite also dropped are not run again after the restart (effectively-once
        // iterations are issue 7's, not this test's).
        orchestrator.kill();
        broker.restart().unwrap();
        stored = stored_when_complete(&store, &expected, Duration::from_secs(60)).await;
    }
    let missing: Vec<_> = expected.difference(&stored).take(5).collect();
    let extra: Vec<_> = stored.difference(&expected).take(5).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:#?}\nextra {extra:#?}"
    );
}

/// `conversation_id` joins dialogs: every node a dialog (and each of its subagents) records is
/// tagged with it, so one lookup lists the whole conversation, and `agentctl explain
/// --conversation` shows each of its sessions; a dialog of another conversation is not among them.
#[tokio::test]
async fn a_conversation_is_one_lookup() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn(&broker);
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "Request to split: Compare", "reply": "[{\"goal\": \"left side\"}, {\"goal\": \"right side\"}]"},
      {"match": "Question: left side", "reply": "Thought: known.\nFinal Answer: LEFT"},
      {"match": "Question: right side", "reply": "Thought: known.\nFinal Answer: RIGHT"},
      {"match": "Request to answer from the subagents: Compare", "reply": "Both sides compared."},
      {"match": "Question: ", "reply": "Thought: easy.\nFinal Answer: fine"}
    ]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let mut dialogs = Vec::new();
    for (id, question, pattern, conversation) in [
        ("c-1", "Hello there", "react", "conv-7"),
        ("c-2", "Compare both sides", "supervisor", "conv-7"),
        ("c-3", "Someone else", "react", "conv-8"),
    ] {
        let mut request = request(question, false);
        request.pattern = pattern.into();
        request.conversation_id = conversation.into();
        client.send(id, &request).await.unwrap();
        let responses = collect_dialog(&mut client, id, DIALOG_TIMEOUT)
            .await
            .unwrap();
        assert!(responses.last().unwrap().error.is_none(), "{responses:#?}");
        dialogs.push(responses);
    }
    let store = aggregator.store();
    for responses in &dialogs {
        wait_for_node(&store, &format!("{}/final", session_of(responses))).await;
    }
    // Every node the first two dialogs explained (subagents' included) carries the tag.
    for responses in &dialogs[..2] {
        for node in explained(responses)
            .iter()
            .map(|t| t.s.iri.clone())
            .collect::<BTreeSet<_>>()
        {
            assert_eq!(
                values(&explained(responses), &node, tg::CONVERSATION),
                ["conv-7"],
                "{node}"
            );
        }
    }
    let sessions: BTreeSet<String> = store
        .query(queries::conversation_sessions("conv-7"))
        .await
        .unwrap()
        .rows()
        .column("s")
        .into_iter()
        .map(|t| iri(t.unwrap()))
        .collect();
    let root = |r: &[agent_schema::AgentResponse]| session_of(r);
    assert!(sessions.contains(&root(&dialogs[0])), "{sessions:?}");
    assert!(sessions.contains(&root(&dialogs[1])), "{sessions:?}");
    assert!(!sessions.contains(&root(&dialogs[2])), "{sessions:?}");
    assert_eq!(
        sessions.len(),
        2,
        "two dialogs (their subagents are in their trees): {sessions:?}"
    );
    let shown = std::process::Command::new(binary("agentctl"))
        .args([
            "explain",
            "--conversation",
            "conv-7",
            "--store",
            &aggregator.endpoint,
        ])
        .output()
        .unwrap();
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    let shown = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.contains("Hello there") && shown.contains("Compare both sides"),
        "{shown}"
    );
    assert!(!shown.contains("Someone else"), "{shown}");
}

/// What the aggregator writes to its embedded store is on the disk before the message is acked:
/// RocksDB's write-ahead log is synced (fdatasync) as each write returns. Without it (RocksDB's
/// default and oxigraph's) a write returned once in the page cache: it survived the process's
/// crash but not the machine's (power, kernel, a VM's hard reset), while the broker had dropped
/// the message. Seen with strace on the running aggregator; `--sync-writes false` shows no sync
/// of the log.
#[tokio::test]
async fn an_embedded_stores_writes_reach_the_disk_before_they_are_acknowledged() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::start(Place::Child, &broker, &[]);
    let trace = std::env::temp_dir().join(format!(
        "agent-e2e-syncs-{}-{:08x}.txt",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut strace = std::process::Command::new("strace")
        .args(["-f", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-o"])
        .arg(&trace)
        .args(["-p", &aggregator.pid().to_string()])
        .spawn()
        .expect("strace (scripts/setup.sh --tests installs it)");
    // strace writes nothing until a call is traced: give it time to attach to every thread.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // One that could not attach (ptrace not allowed here) has ended: the test would show nothing.
    if let Some(status) = strace.try_wait().unwrap() {
        panic!("strace could not attach to the aggregator ({status}): ptrace must be allowed");
    }
    let bus = agent_bus::Bus::connect(&broker.url(), None).await.unwrap();
    let publisher = agent_bus::Publisher::new(&bus, EXPLAIN_TOPIC)
        .await
        .unwrap();
    let marker = Triples {
        metadata: Default::default(),
        triples: vec![triple(
            "urn:test:durable",
            "urn:test:p",
            agent_schema::Term::literal("on disk"),
        )],
    };
    publisher
        .send(agent_schema::encode(&marker), &Default::default())
        .await
        .unwrap();
    wait_for_node(&aggregator.store(), "urn:test:durable").await;
    let _ = std::process::Command::new("kill")
        .args(["-INT", &strace.id().to_string()])
        .status();
    let _ = strace.wait();
    let traced = std::fs::read_to_string(&trace).unwrap_or_default();
    let _ = std::fs::remove_file(&trace);
    let log_syncs = traced
        .lines()
        .filter(|line| line.contains("sync(") && line.contains(".log>"))
        .count();
    assert!(
        log_syncs > 0,
        "no sync of the store's write-ahead log while a write was acknowledged:\n{traced}"
    );
}
