//! The graph in a SPARQL server this project does not own: Apache Jena Fuseki (TDB2) and Oxigraph's
//! own server (RocksDB). Neither gives a compare-and-set the journal could rely on (Oxigraph's
//! server evaluates a conditional update on a snapshot and runs updates side by side), and the
//! design needs none: the aggregator in front of the server owns the journal and decides which
//! record of a step stands. Also: provenance lands in the server, the server's restart is waited
//! out, and an orchestrator pointed at the server itself refuses to start rather than run without
//! its guarantee.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_e2e::sparql_server::{Kind, SparqlServer};
use agent_e2e::*;
use agent_graph::journal::RecordRequest;
use agent_graph::GraphStore;

const TOKEN: &str = "standalone-store-token";
const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);

fn react(question: &str) -> agent_schema::AgentRequest {
    agent_schema::AgentRequest {
        pattern: "react".into(),
        ..request(question, false)
    }
}

#[tokio::test]
async fn the_aggregator_owns_the_journal_of_fuseki() {
    the_aggregator_owns_the_journal_of(Kind::Fuseki).await;
}

#[tokio::test]
async fn the_aggregator_owns_the_journal_of_oxigraphs_server() {
    the_aggregator_owns_the_journal_of(Kind::Oxigraph).await;
}

async fn the_aggregator_owns_the_journal_of(kind: Kind) {
    let broker = Broker::start().unwrap();
    let mut aggregator = Aggregator::spawn_over(
        &broker,
        Some(SparqlServer::start(kind)),
        &["--config-token", TOKEN],
    );
    let server = GraphStore::open(&aggregator.sparql_server().unwrap().endpoint(), None).unwrap();

    // Many records of one step at once, from many clients: one stands, and every answer names it.
    let entry = "urn:trustgraph:agent:race/journal/i1-x";
    let mut records = tokio::task::JoinSet::new();
    for i in 0..24 {
        let journal = GraphStore::open(&aggregator.endpoint, Some(TOKEN.into()))
            .unwrap()
            .journal();
        records.spawn(async move {
            journal
                .record(RecordRequest {
                    entry: entry.into(),
                    outcome: format!("outcome {i}"),
                    delivery: format!("delivery {i}"),
                    attempt: format!("attempt {i}"),
                    next: Vec::new(),
                    ends: None,
                })
                .await
                .unwrap()
        });
    }
    let standing = records.join_all().await;
    assert!(standing.iter().all(|e| e == &standing[0]), "{standing:#?}");
    // The server holds that one outcome and no other.
    let outcomes = format!(
        "SELECT ?o WHERE {{ GRAPH <urn:graph:agent-journal> {{ <{entry}> <https://trustgraph.ai/ns/outcome> ?o }} }}"
    );
    assert_eq!(count(&server, outcomes).await, 1);

    // Without the services' token the journal is not open.
    let stranger = GraphStore::open(&aggregator.endpoint, None)
        .unwrap()
        .journal();
    assert!(stranger.check().await.is_err());

    // A journaled dialog: its provenance and its journal are in the server.
    let llm = scripted_llm(THREE_STEPS).await;
    let _orchestrator = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let mut client = client(&broker).await;
    client
        .send("in-server", &react("combine (in the server)"))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "in-server", DIALOG_TIMEOUT)
        .await
        .unwrap();
    let last = responses.last().unwrap();
    assert_eq!(last.content, "alpha and beta, combined.");
    let session = last.message_id.split('/').next().unwrap().to_owned();
    let answer = format!(
        "SELECT ?d WHERE {{ GRAPH ?g {{ <{session}/final> <https://trustgraph.ai/ns/document> ?d }} }}"
    );
    assert_eq!(count_reaching(&server, answer, 1).await, 1);
    let journaled = format!(
        "SELECT ?e WHERE {{ GRAPH <urn:graph:agent-journal> {{ ?e <https://trustgraph.ai/ns/published> true
           FILTER(STRSTARTS(STR(?e), \"{session}/journal/\")) }} }}"
    );
    // Three iterations (the request names its pattern: no routing step).
    assert_eq!(count_reaching(&server, journaled, 3).await, 3);

    // The server restarts under a running system: the next dialog waits it out and ends once.
    aggregator.sparql_server().unwrap().restart();
    client
        .send("after-restart", &react("combine (after restart)"))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "after-restart", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        responses.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "{responses:#?}"
    );
    assert_eq!(
        responses.last().unwrap().content,
        "alpha and beta, combined."
    );

    // An orchestrator whose token the aggregator refuses says so at start and stops, rather
    // than fail every step.
    let mut refused =
        Orchestrator::spawn_journaled(&broker, &llm, &aggregator, "not-the-token", &[]);
    assert!(
        refused.exited_within(Duration::from_secs(30)).await,
        "an orchestrator whose journal is refused kept running"
    );
}

/// Two aggregators owning the journal of one SPARQL server that the broker cannot tell apart:
/// the second is on another broker altogether (as on the far side of a partition, or on another
/// subscription). It hears the first in the server and refuses to run, having decided nothing;
/// the first goes on serving a journaled dialog.
#[tokio::test]
async fn a_second_owner_of_one_server_that_the_broker_cannot_reach_refuses_to_run() {
    let broker = Broker::start().unwrap();
    let mut first = owner_of_a_new_server(&broker);
    let endpoint = first.sparql_server().unwrap().endpoint();
    // The first owns the journal (past its listening) before the second starts.
    assert!(
        owns_the_journal(&first).await,
        "the first aggregator never became ready"
    );
    a_second_owner_on_another_broker_is_refused(&endpoint, "").await;
    assert!(first.is_running(), "the first owner stopped");
    serves_one_dialog(&broker, &first, "kept").await;
}

/// As above, with the first owner's broker gone for longer than the `pulsar` crate's connection
/// retries (about 40 s) when the second starts: the first, subscribing again to the owners'
/// announcements all that while, must go on beating in the server, or the second would hear
/// nobody there and own the journal beside it.
#[tokio::test]
async fn an_owner_whose_broker_is_gone_still_refuses_a_second_owner() {
    let mut broker = Broker::start().unwrap();
    let mut first = owner_of_a_new_server(&broker);
    let endpoint = first.sparql_server().unwrap().endpoint();
    assert!(
        owns_the_journal(&first).await,
        "the first aggregator never became ready"
    );
    broker.stop();
    tokio::time::sleep(Duration::from_secs(50)).await;
    a_second_owner_on_another_broker_is_refused(&endpoint, " while the first's broker was gone")
        .await;
    broker.restart().unwrap();
    assert!(first.is_running(), "the first owner stopped");
    serves_one_dialog(&broker, &first, "kept").await;
}

/// The first owner of a server stops (SIGKILL, so its record stays behind): a new owner of the
/// server is not refused by the record of one that no longer beats.
#[tokio::test]
async fn a_dead_owners_record_does_not_refuse_the_next_owner() {
    let broker = Broker::start().unwrap();
    let mut first = owner_of_a_new_server(&broker);
    let endpoint = first.sparql_server().unwrap().endpoint();
    let server = GraphStore::open(&endpoint, None).unwrap();
    let owners = "SELECT ?o WHERE { GRAPH <urn:graph:agent-journal-owners> { ?o ?p ?v } }";
    // Its record is in the server and beating.
    assert!(
        count_reaching(&server, owners.to_owned(), 1).await > 0,
        "the first owner left no record"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.kill();
    let mut next = Aggregator::child_over_endpoint(&broker, &endpoint, &["--config-token", TOKEN]);
    serves_one_dialog(&broker, &next, "next").await;
    assert!(next.is_running(), "the next owner stopped");
}

/// An orchestrator whose GRAPH_STORE is the SPARQL server itself has nobody to decide its
/// journal's records: it refuses to start.
#[tokio::test]
async fn an_orchestrator_pointed_at_fuseki_itself_refuses_to_start() {
    an_orchestrator_pointed_at_the_server_itself_refuses_to_start(Kind::Fuseki).await;
}

#[tokio::test]
async fn an_orchestrator_pointed_at_oxigraphs_server_itself_refuses_to_start() {
    an_orchestrator_pointed_at_the_server_itself_refuses_to_start(Kind::Oxigraph).await;
}

async fn an_orchestrator_pointed_at_the_server_itself_refuses_to_start(kind: Kind) {
    let broker = Broker::start().unwrap();
    let server = SparqlServer::start(kind);
    let llm = scripted_llm(THREE_STEPS).await;
    let mut orchestrator = Orchestrator::spawn_with_env(
        &broker,
        &llm,
        &seed_dir(),
        &["--graph-store", &server.endpoint()],
        &[],
    );
    assert!(
        orchestrator.exited_within(Duration::from_secs(30)).await,
        "an orchestrator journaling on a store that cannot decide kept running"
    );
}

/// A second owner of the server at `endpoint`, on a broker and subscription of its own, exits
/// refused, for the reason the fence gives, heard in the server (the brokers have nothing in
/// common). `when` says in a failure when it kept running.
async fn a_second_owner_on_another_broker_is_refused(endpoint: &str, when: &str) {
    let elsewhere = Broker::start().unwrap();
    let mut second = Aggregator::child_over_endpoint(
        &elsewhere,
        endpoint,
        &[
            "--config-token",
            TOKEN,
            "--subscription",
            "another-deployment",
        ],
    );
    let status = second
        .exit_within(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("a second owner of the server kept running{when}"));
    assert!(!status.success(), "the second owner exited with {status}");
    let log = second.log();
    assert!(
        log.contains("already owns the journal") && log.contains("heard on the SPARQL server"),
        "{log}"
    );
}

/// An aggregator in a child process owning the journal of a new Oxigraph server.
fn owner_of_a_new_server(broker: &Broker) -> Aggregator {
    Aggregator::start_over_server(
        Place::Child,
        broker,
        SparqlServer::start(Kind::Oxigraph),
        &["--config-token", TOKEN],
    )
}

/// A journaled dialog `id`, through `aggregator`'s journal, ends once.
async fn serves_one_dialog(broker: &Broker, aggregator: &Aggregator, id: &str) {
    let llm = scripted_llm(THREE_STEPS).await;
    let _orchestrator = Orchestrator::spawn_journaled(broker, &llm, aggregator, TOKEN, &[]);
    let mut client = client(broker).await;
    client
        .send(id, &react(&format!("combine {id}")))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, id, DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        responses.iter().filter(|r| r.end_of_dialog).count(),
        1,
        "{responses:#?}"
    );
}

/// Whether `aggregator` says it is ready (it owns its journal, if any) within 30 s.
async fn owns_the_journal(aggregator: &Aggregator) -> bool {
    let ready = format!("{}/readyz", aggregator.endpoint);
    let client = reqwest::Client::new();
    for _ in 0..300 {
        if let Ok(answer) = client.get(&ready).send().await {
            if answer.status().is_success() {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// Inserts into a SPARQL server made at once share one `INSERT DATA` (group commit), and a batch
/// the server refuses is tried call by call: only the call whose quads are bad fails, the others
/// are kept.
#[tokio::test]
async fn inserts_made_together_are_kept_but_for_the_one_the_server_refuses() {
    use agent_graph::model::{Literal, NamedNode, Quad};
    let server = SparqlServer::start(Kind::Oxigraph);
    let store = GraphStore::open(&server.endpoint(), None).unwrap();
    let graph = NamedNode::new("urn:graph:batch-test").unwrap();
    let quad = |subject: NamedNode, n: usize| {
        Quad::new(
            subject,
            NamedNode::new("urn:test:n").unwrap(),
            Literal::from(n as i64),
            graph.clone(),
        )
    };
    let mut inserts = tokio::task::JoinSet::new();
    for n in 0..24 {
        let store = store.clone();
        // Not an IRI: the server refuses the update it is in.
        let subject = if n == 7 {
            NamedNode::new_unchecked("urn:test:not an iri")
        } else {
            NamedNode::new(format!("urn:test:s{n}")).unwrap()
        };
        let quads = vec![quad(subject, n)];
        inserts.spawn(async move { (n, store.insert(quads).await) });
    }
    let outcomes = inserts.join_all().await;
    for (n, outcome) in &outcomes {
        assert_eq!(outcome.is_err(), *n == 7, "insert {n}: {outcome:?}");
    }
    let count = |sparql: &'static str| {
        let store = store.clone();
        async move {
            let rows = store.query(sparql.into()).await.unwrap().rows();
            rows.first("n").map(|n| n.to_string())
        }
    };
    let counted = |n: u32| {
        Some(format!(
            "\"{n}\"^^<http://www.w3.org/2001/XMLSchema#integer>"
        ))
    };
    assert_eq!(
        count("SELECT (COUNT(*) AS ?n) WHERE { GRAPH <urn:graph:batch-test> { ?s ?p ?o } }").await,
        counted(23)
    );
    // A blank node's label names one node within one request: six calls made at once that all
    // say `_:x` keep six nodes.
    let blank = |n: usize| {
        let (store, graph) = (store.clone(), graph.clone());
        async move {
            let quad = Quad::new(
                agent_graph::model::BlankNode::new("x").unwrap(),
                NamedNode::new("urn:test:blank").unwrap(),
                Literal::from(n as i64),
                graph,
            );
            store.insert(vec![quad]).await
        }
    };
    for inserted in futures::future::join_all((0..6).map(blank)).await {
        inserted.unwrap();
    }
    assert_eq!(
        count("SELECT (COUNT(DISTINCT ?s) AS ?n) WHERE { GRAPH <urn:graph:batch-test> { ?s <urn:test:blank> ?o } }").await,
        counted(6)
    );
}

/// A stranger's query whose `SERVICE` call hides in a `\u` escape is refused, as one written
/// plainly is, and Apache Jena Fuseki calls nothing. (Fuseki 5.6 reads the escape inside the
/// string, as our parser does, so it made no call before the check read escapes as SPARQL 1.1
/// has a server read them; see `nested.rs::a_service_call_hidden_in_an_escape_is_not_sent_to_a_sparql_server`.)
/// The URL would be a listener of this test's.
#[tokio::test]
async fn a_service_call_hidden_in_an_escape_does_not_reach_out_from_fuseki() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_over(
        &broker,
        Some(SparqlServer::start(Kind::Fuseki)),
        &["--config-token", TOKEN],
    );
    let inside = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    inside.set_nonblocking(true).unwrap();
    let target = format!("http://{}/sparql", inside.local_addr().unwrap());
    let hidden =
        format!(r#"SELECT * WHERE {{ ?s ?p "a\u0022 . SERVICE <{target}> {{ ?x ?y ?z }} }} #" }}"#);
    let plain = format!("SELECT * WHERE {{ SERVICE <{target}> {{ ?x ?y ?z }} }}");
    let stranger = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();
    let ask = |query: String| {
        stranger
            .post(format!("{}/query", aggregator.endpoint))
            .header("content-type", "application/sparql-query")
            .header("accept", "application/sparql-results+json")
            .body(query)
            .send()
    };
    // Written plainly or hidden, the call is refused before the server sees it.
    for query in [plain, hidden] {
        let refused = ask(query).await.unwrap();
        assert_eq!(refused.status(), 400, "{:?}", refused.text().await);
    }
    // Long enough for a call the server made to have reached the listener.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        matches!(inside.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "Fuseki called the URL"
    );
    // Escapes that hide nothing are answered.
    let harmless = ask(r#"SELECT * WHERE { ?s ?p "caf\u00e9" }"#.to_owned())
        .await
        .unwrap();
    assert_eq!(harmless.status(), 200, "{:?}", harmless.text().await);
}
