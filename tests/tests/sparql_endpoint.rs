//! The aggregator's SPARQL endpoint, as shipped (it owns the store; docker-compose and Kubernetes
//! point every other service at it): no write without the services' token. And its read side
//! cannot be used to take the service down: anonymous runaway
//! queries (a four-way cross product) are stopped at the query time limit, or as soon as their
//! client goes, a few run at a time and the rest are told to come back; the orchestrators' own
//! queries (the journal, fan-in) carry the services' token and never queue behind them, so dialogs
//! go on, a supervisor's fan-in among them; a read token, when set, closes the endpoint to strangers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use agent_e2e::*;

const TOKEN: &str = "sparql-reads-service-token";
const DIALOG_TIMEOUT: Duration = Duration::from_secs(60);
const QUERY_TIMEOUT_SECS: u64 = 8;
const RUNAWAY: &str =
    "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?a ?b ?c . ?d ?e ?f . ?h ?i ?j . ?k ?l ?m } }";
const SCRIPT: &str = r#"{"rules": [
  {"match": "Request to split: Split while attacked", "reply": "[{\"goal\": \"first half\"}, {\"goal\": \"second half\"}]"},
  {"match": "Request to answer from the subagents: Split while attacked", "reply": "both halves answered"},
  {"match": "Observation: looked", "reply": "Thought: done.\nFinal Answer: still answering"},
  {"match": "look", "exact": true, "reply": "looked"},
  {"match": "Question: ", "reply": "Thought: look first.\nAction: llm\nArgs: {\"question\": \"look\"}"}
]}"#;

fn runaway(http: &reqwest::Client, endpoint: &str, patience: Duration) -> reqwest::RequestBuilder {
    http.post(format!("{endpoint}/query"))
        .header("content-type", "application/sparql-query")
        .body(RUNAWAY)
        .timeout(patience)
}

/// Two journaled dialogs, and their provenance in the store (at least 200 triples): what a
/// runaway's cross product multiplies.
async fn fill_the_store(client: &mut agent_bus::AgentClient, aggregator: &Aggregator) {
    for before in ["before-1", "before-2"] {
        client
            .send(before, &request("fill the store", false))
            .await
            .unwrap();
        let answered = collect_dialog(client, before, DIALOG_TIMEOUT)
            .await
            .unwrap();
        assert_eq!(answered.last().unwrap().content, "still answering");
    }
    // The dialog's provenance lands a moment after its answer.
    let quads = "SELECT ?s WHERE { GRAPH ?g { ?s ?p ?o } }";
    let triples = count_reaching(&aggregator.store(), quads.into(), 200).await;
    println!("{triples} triples in the store");
    assert!(triples >= 200, "{triples}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runaway_queries_are_stopped_and_dialogs_go_on() {
    let broker = Broker::start().unwrap();
    let timeout = QUERY_TIMEOUT_SECS.to_string();
    let aggregator = Aggregator::start(
        Place::Child,
        &broker,
        &[
            "--config-token",
            TOKEN,
            "--query-timeout-secs",
            &timeout,
            "--max-queries",
            "1",
            // The time limit is what is tested here: the runaway would reach the budget of
            // bindings first (refused, 413; `crates/graph/tests/in_memory.rs`).
            "--max-query-bindings",
            "1000000000000000",
        ],
    );
    let llm = scripted_llm(SCRIPT).await;
    let _orchestrator = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let mut client = client(&broker).await;
    fill_the_store(&mut client, &aggregator).await;

    // Four anonymous runaways at once, their clients willing to wait two minutes.
    let http = reqwest::Client::new();
    let started = Instant::now();
    let attacks: Vec<_> = (0..4)
        .map(|_| {
            tokio::spawn(runaway(&http, &aggregator.endpoint, Duration::from_secs(120)).send())
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Meanwhile a journaled dialog (its lookups and marks are queries and updates with the
    // services' token) runs to its answer, and so does a supervisor whose fan-in is the
    // aggregator's own queries of the graph.
    client
        .send("during", &request("answer while attacked", false))
        .await
        .unwrap();
    client
        .send(
            "during-fan-in",
            &agent_schema::AgentRequest {
                pattern: "supervisor".into(),
                ..request("Split while attacked", false)
            },
        )
        .await
        .unwrap();
    // A knowledge tool's query (the services' token, a budget of bindings) is answered while
    // the strangers hold the one turn they have. Until 2026-12-04 it waited for that turn and was
    // refused (503), so an agent's tools failed while anyone ran slow queries.
    let tools_query = http
        .post(format!("{}/query", aggregator.endpoint))
        .header("content-type", "application/sparql-query")
        .header("authorization", format!("Bearer {TOKEN}"))
        .header(agent_graph::BINDINGS_HEADER, "100000")
        .body("ASK { ?s ?p ?o }")
        .send()
        .await
        .unwrap();
    assert_eq!(
        tools_query.status().as_u16(),
        200,
        "{:?}",
        tools_query.text().await
    );
    let mut both = collect_dialogs(&mut client, &["during", "during-fan-in"], DIALOG_TIMEOUT).await;
    let during = both.remove("during").unwrap();
    assert_eq!(
        during.last().unwrap().content,
        "still answering",
        "{during:#?}"
    );
    let fanned = both.remove("during-fan-in").unwrap();
    assert_eq!(
        fanned.last().unwrap().content,
        "both halves answered",
        "{fanned:#?}"
    );
    let mut statuses = Vec::new();
    for attack in attacks {
        statuses.push(attack.await.unwrap().unwrap().status().as_u16());
    }
    let answered_within = started.elapsed();
    println!("runaways answered {statuses:?} within {answered_within:?}");
    assert!(statuses.iter().all(|s| *s == 503), "{statuses:?}");
    assert!(answered_within < Duration::from_secs(QUERY_TIMEOUT_SECS + 15));
    // The core is free again: nothing runs on after the limit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = cpu_share(aggregator.pid(), Duration::from_secs(1)).await;
    println!(
        "aggregator CPU after the limit: {:.0}% of a core",
        idle * 100.0
    );
    assert!(idle < 0.3, "still busy after the time limit: {idle:.2}");

    // A client that gives up after three seconds: its query, busy until then, stops with it,
    // long before the time limit.
    let gone = tokio::spawn(runaway(&http, &aggregator.endpoint, Duration::from_secs(3)).send());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let busy = cpu_share(aggregator.pid(), Duration::from_secs(1)).await;
    println!(
        "aggregator CPU while a runaway runs: {:.0}% of a core",
        busy * 100.0
    );
    // Above the idle ceiling checked after it (the suite runs a real model beside this test).
    assert!(busy > 0.3, "the runaway did not run: {busy:.2}");
    assert!(gone.await.unwrap().is_err(), "the runaway answered");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = cpu_share(aggregator.pid(), Duration::from_secs(1)).await;
    println!(
        "aggregator CPU after its client went: {:.0}% of a core",
        idle * 100.0
    );
    assert!(idle < 0.3, "still busy after its client went: {idle:.2}");

    // A long text is refused before it is parsed (a sort by thousands of conditions); the
    // services' own queries may be long.
    let long = format!(
        "SELECT ?s WHERE {{ ?s ?p ?o }} ORDER BY {}",
        "?s ".repeat(12_000)
    );
    let refused = http
        .post(format!("{}/query", aggregator.endpoint))
        .header("content-type", "application/sparql-query")
        .body(long.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status().as_u16(), 413);
    let said = refused.text().await.unwrap();
    assert!(said.contains("AGGREGATOR_MAX_QUERY_BYTES"), "{said}");
    let long_and_ours = format!(
        "SELECT ?s WHERE {{ VALUES ?s {{ {} }} }} LIMIT 1",
        "<urn:x> ".repeat(6_000)
    );
    let served = http
        .post(format!("{}/query", aggregator.endpoint))
        .header("content-type", "application/sparql-query")
        .bearer_auth(TOKEN)
        .body(long_and_ours)
        .send()
        .await
        .unwrap();
    assert_eq!(served.status().as_u16(), 200);

    let metrics = scrape(&aggregator.endpoint).await;
    let refused = |reason: &str| {
        sample(
            &metrics,
            &format!("agent_sparql_queries_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert!(refused("timeout") >= 1.0);
    assert!(refused("busy") >= 1.0);
    assert!(refused("too_long") >= 1.0);
}

/// A knowledge tool's query (the services' token, a budget of bindings, through the same client
/// as the tools') waits for its turn while another tool's query holds every one, and is answered
/// once that one ends. Until 2026-12-07 it waited a second and was refused (503, "too many queries
/// at once"): with the default two turns, a third dialog's knowledge query failed whenever two
/// others' ran for a second or more, and its LLM read an error instead of the knowledge. It waits
/// no longer than its caller does (`agent_graph::WITHIN_HEADER`): a query whose step gave up is
/// let go then, rather than keep its place and run for nobody ahead of the queries still wanted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tools_query_waits_for_its_turn_behind_another_tools() {
    const LIMIT_SECS: u64 = 4;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::start(
        Place::Child,
        &broker,
        &[
            "--config-token",
            TOKEN,
            "--query-timeout-secs",
            &LIMIT_SECS.to_string(),
            "--max-queries",
            "1",
            "--max-query-bindings",
            "1000000000000000",
        ],
    );
    let tools =
        agent_graph::GraphStore::open(&aggregator.endpoint, Some(TOKEN.to_owned())).unwrap();
    // What the long queries' cross product multiplies.
    use agent_graph::model::{Literal, NamedNode, Quad};
    let quads = (0..300)
        .map(|n| {
            Quad::new(
                NamedNode::new_unchecked(format!("urn:tools:s{n}")),
                NamedNode::new_unchecked("urn:tools:p"),
                Literal::new_simple_literal(format!("o{n}")),
                NamedNode::new_unchecked("urn:tools:graph"),
            )
        })
        .collect();
    tools.insert(quads).await.unwrap();
    let patient = agent_graph::QueryBounds {
        timeout: Duration::from_secs(60),
        max_rows: 10_000,
        max_bindings: 1_000_000_000_000,
    };
    let started = Instant::now();
    let long = tokio::spawn({
        let tools = tools.clone();
        async move { tools.query_bounded(RUNAWAY.to_owned(), patient).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    // A step that waits a second for its query, first in line for the turn.
    let hasty = agent_graph::QueryBounds {
        timeout: Duration::from_secs(1),
        ..patient
    };
    let gone = tokio::spawn({
        let tools = tools.clone();
        async move { tools.query_bounded(RUNAWAY.to_owned(), hasty).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let asked = started.elapsed();
    let answered = tools
        .query_bounded("ASK { ?s ?p ?o }".to_owned(), patient)
        .await;
    let answered_at = started.elapsed();
    let long = long.await.unwrap();
    let gone = gone.await.unwrap();
    println!(
        "the tool's query, asked at {asked:?}, answered at {answered_at:?}; the long one: {long:?}; the one given up on: {gone:?}"
    );
    assert!(answered.is_ok(), "at {answered_at:?}: {answered:?}");
    // It did wait for the long one, stopped at the time limit.
    assert!(
        matches!(long, Err(agent_graph::GraphError::Http { status: 503, .. })),
        "{long:?}"
    );
    assert!(answered_at >= Duration::from_secs(3), "{answered_at:?}");
    assert!(gone.is_err(), "the query given up on answered: {gone:?}");
    // The one given up on was let go at its caller's limit, not run after the long one.
    let metrics = scrape(&aggregator.endpoint).await;
    let busy = sample(
        &metrics,
        "agent_sparql_queries_refused_total{reason=\"busy\"}",
    );
    assert!(busy >= 1.0, "no query was let go while it waited: {busy}");
}

/// An operator's runaway update (with the services' token: a cleanup that joins the graph with
/// itself) is stopped at the time limit and writes nothing of itself, and the updates every other
/// writer of the store waits behind go on: a supervisor's fan-in claims its synthesis with one.
/// Before, `/update` had no limit, and the runaway held the store's one turn for updates for as
/// long as it ran (a five-way cross product of 200 triples: hours), the fan-in with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runaway_update_is_stopped_writes_nothing_and_fan_in_goes_on() {
    let broker = Broker::start().unwrap();
    let timeout = QUERY_TIMEOUT_SECS.to_string();
    let aggregator = Aggregator::start(
        Place::Child,
        &broker,
        &[
            "--config-token",
            TOKEN,
            "--query-timeout-secs",
            &timeout,
            // The time limit is what is tested: the budget would stop it too.
            "--max-query-bindings",
            "1000000000000000",
        ],
    );
    let llm = scripted_llm(SCRIPT).await;
    let _orchestrator = Orchestrator::spawn_journaled(&broker, &llm, &aggregator, TOKEN, &[]);
    let mut client = client(&broker).await;
    fill_the_store(&mut client, &aggregator).await;

    // One transaction: a marker, then a delete of whatever a five-way cross product finds (its
    // filter, checked once all five are bound, holds for no row).
    let runaway = "INSERT DATA { GRAPH <urn:test:runaway> { <urn:test:marker> <urn:test:left> \"by the runaway\" } } ;
DELETE { GRAPH ?g { ?a ?b ?c } } WHERE {
  GRAPH ?g { ?a ?b ?c . ?d ?e ?f . ?h ?i ?j . ?k ?l ?m . ?n ?o ?p }
  FILTER(STRLEN(STR(?c)) + STRLEN(STR(?p)) < 0)
}";
    let http = reqwest::Client::new();
    let update = |text: &str| {
        http.post(format!("{}/update", aggregator.endpoint))
            .header("content-type", "application/sparql-update")
            .bearer_auth(TOKEN)
            .body(text.to_owned())
            .timeout(Duration::from_secs(300))
            .send()
    };
    let started = Instant::now();
    let stopped = tokio::spawn(update(runaway));
    tokio::time::sleep(Duration::from_millis(500)).await;
    client
        .send(
            "fan-in-during",
            &agent_schema::AgentRequest {
                pattern: "supervisor".into(),
                ..request("Split while attacked", false)
            },
        )
        .await
        .unwrap();
    let fanned = collect_dialog(&mut client, "fan-in-during", DIALOG_TIMEOUT)
        .await
        .unwrap();
    assert_eq!(
        fanned.last().unwrap().content,
        "both halves answered",
        "{fanned:#?}"
    );
    let answer = stopped.await.unwrap().unwrap();
    let answered_within = started.elapsed();
    let status = answer.status().as_u16();
    let said = answer.text().await.unwrap();
    println!("the runaway update answered {status} ({said}) within {answered_within:?}");
    assert_eq!(status, 503, "{said}");
    assert!(answered_within < Duration::from_secs(QUERY_TIMEOUT_SECS + 15));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let idle = cpu_share(aggregator.pid(), Duration::from_secs(1)).await;
    println!(
        "aggregator CPU after the limit: {:.0}% of a core",
        idle * 100.0
    );
    assert!(idle < 0.3, "still busy after the time limit: {idle:.2}");

    // Nothing of it was written, and the turn is free: a small update goes at once.
    let ask = |text: &'static str| {
        let http = http.clone();
        let endpoint = aggregator.endpoint.clone();
        async move {
            http.post(format!("{endpoint}/query"))
                .header("content-type", "application/sparql-query")
                .header("accept", "application/sparql-results+json")
                .bearer_auth(TOKEN)
                .body(text)
                .send()
                .await
                .unwrap()
                .json::<serde_json::Value>()
                .await
                .unwrap()["boolean"]
                .as_bool()
        }
    };
    let marked = "ASK { GRAPH <urn:test:runaway> { ?s ?p ?o } }";
    assert_eq!(
        ask(marked).await,
        Some(false),
        "the stopped update wrote its marker"
    );
    let small =
        "INSERT DATA { GRAPH <urn:test:runaway> { <urn:test:marker> <urn:test:left> \"after\" } }";
    let quick = Instant::now();
    assert_eq!(update(small).await.unwrap().status().as_u16(), 204);
    assert!(quick.elapsed() < Duration::from_secs(5));
    assert_eq!(ask(marked).await, Some(true));
    let metrics = scrape(&aggregator.endpoint).await;
    assert!(
        sample(
            &metrics,
            "agent_sparql_queries_refused_total{reason=\"update_timeout\"}"
        ) >= 1.0
    );
}

#[tokio::test]
async fn a_read_token_closes_the_endpoint_to_strangers() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &["--config-token", TOKEN, "--query-token", "reader-token"],
    );
    let http = reqwest::Client::new();
    let ask = |token: Option<&str>| {
        let mut request = http
            .post(format!("{}/query", aggregator.endpoint))
            .header("content-type", "application/sparql-query")
            .body("ASK { ?s ?p ?o }");
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    assert_eq!(ask(None).await.unwrap().status(), 401);
    assert_eq!(ask(Some("wrong")).await.unwrap().status(), 401);
    assert_eq!(ask(Some("reader-token")).await.unwrap().status(), 200);
    assert_eq!(ask(Some(TOKEN)).await.unwrap().status(), 200);
}

/// A replica forwards a stranger's query to the store's owner with the services' token (its only
/// way in), so the owner took it for the services' own and held it to nothing but the time limit.
/// Now the replica asks the owner to hold it to the stranger's budget, and a stranger's answer is
/// held to `--max-answer-bytes` when written out; the services' own queries are not.
#[tokio::test]
async fn a_strangers_query_through_a_replica_keeps_the_strangers_bounds() {
    let broker = Broker::start().unwrap();
    let owner = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let replica = Aggregator::replica_with(
        &broker,
        &owner,
        TOKEN,
        &["--max-query-bindings", "1000", "--max-answer-bytes", "4000"],
    );
    let http = reqwest::Client::new();
    let ask = |sparql: String, token: Option<&str>| {
        let mut request = http
            .post(format!("{}/query", replica.endpoint))
            .header("content-type", "application/sparql-query")
            .body(sparql);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        async move {
            let response = request.send().await.unwrap();
            (response.status().as_u16(), response.text().await.unwrap())
        }
    };
    let hundred: Vec<String> = (0..100).map(|i| i.to_string()).collect();
    let crossed = format!(
        "SELECT * WHERE {{ VALUES ?a {{ {0} }} VALUES ?b {{ {0} }} }}",
        hundred.join(" ")
    );
    let (status, why) = ask(crossed.clone(), None).await;
    assert_eq!(status, 413, "{why}");
    assert!(why.contains("1000 bindings"), "{why}");
    let long = format!("SELECT ?s WHERE {{ BIND(\"{}\" AS ?s) }}", "x".repeat(5000));
    let (status, why) = ask(long.clone(), None).await;
    assert_eq!(status, 413, "{why}");
    assert!(why.contains("4000 bytes"), "{why}");
    let (status, why) = ask("SELECT ?a WHERE { VALUES ?a { 1 2 3 } }".into(), None).await;
    assert_eq!(status, 200, "{why}");
    // The services' own: neither bound.
    for query in [crossed, long] {
        let (status, why) = ask(query, Some(TOKEN)).await;
        assert_eq!(status, 200, "{}", &why[..why.len().min(300)]);
    }
}

/// A replica passes its owner's refusal of a write on as the owner said it: an update that does
/// not parse is the client's 400, not a 500 to try again for ever, and a load the owner cannot
/// read the same. Both were answered 500.
#[tokio::test]
async fn a_replica_passes_its_owners_refusal_of_a_write_on() {
    let broker = Broker::start().unwrap();
    let owner = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let replica = Aggregator::replica_with(&broker, &owner, TOKEN, &[]);
    let http = reqwest::Client::new();
    let write = |path: &str, content_type: &str, body: &str| {
        http.post(format!("{}{path}", replica.endpoint))
            .bearer_auth(TOKEN)
            .header("content-type", content_type)
            .body(body.to_owned())
            .send()
    };
    let refused = write(
        "/update",
        "application/sparql-update",
        "INSERT DATA { <urn:s> <urn:p> }",
    )
    .await
    .unwrap();
    assert_eq!(refused.status(), 400, "{:?}", refused.text().await);
    let refused = write(
        "/store?graph=urn:g:x",
        "application/n-triples",
        "<urn:s> <urn:p> .\n",
    )
    .await
    .unwrap();
    assert_eq!(refused.status(), 400, "{:?}", refused.text().await);
    // What the owner takes, the replica writes.
    let taken = write(
        "/update",
        "application/sparql-update",
        "INSERT DATA { GRAPH <urn:g:x> { <urn:s> <urn:p> \"ok\" } }",
    )
    .await
    .unwrap();
    assert_eq!(taken.status(), 204);
    let written = "SELECT ?o WHERE { GRAPH ?g { <urn:s> <urn:p> ?o } }";
    assert_eq!(count(&owner.store(), written.into()).await, 1);
}

/// The shipped topology's store (the aggregator's embedded store, `scripts/check-deploy.sh` checks
/// nothing else is shipped): an update or a load without the services' token, or with another, is
/// refused and changes nothing; with it, both work.
#[tokio::test]
async fn the_shipped_store_refuses_unauthenticated_writes() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(&broker, &["--config-token", TOKEN]);
    let http = reqwest::Client::new();
    let update = |token: Option<&str>| {
        let mut request = http
            .post(format!("{}/update", aggregator.endpoint))
            .header("content-type", "application/sparql-update")
            .body("INSERT DATA { GRAPH <urn:g:forged> { <urn:s> <urn:p> \"forged\" } }");
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    let load = |token: Option<&str>| {
        let mut request = http
            .post(format!("{}/store?graph=urn:g:loaded", aggregator.endpoint))
            .header("content-type", "application/n-triples")
            .body("<urn:s> <urn:p> \"loaded\" .\n");
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    for token in [None, Some("not-the-token")] {
        assert_eq!(update(token).await.unwrap().status(), 401);
        assert_eq!(load(token).await.unwrap().status(), 401);
    }
    let written = "SELECT ?o WHERE { GRAPH ?g { <urn:s> <urn:p> ?o } }";
    assert_eq!(count(&aggregator.store(), written.into()).await, 0);
    assert_eq!(update(Some(TOKEN)).await.unwrap().status(), 204);
    assert_eq!(load(Some(TOKEN)).await.unwrap().status(), 204);
    assert_eq!(count(&aggregator.store(), written.into()).await, 2);
}

/// A stranger who asks for a long answer and does not take it: its query's turn stays held while
/// the answer waits (another stranger is told to come back), until the connection has taken
/// nothing for the query's time limit and is closed; then the turn is free again. Before, the
/// turn was given back once the answer was written into memory, and the answer (up to
/// `--max-answer-bytes`) stayed held for as long as the client kept its connection open:
/// a few such clients filled the memory.
#[tokio::test]
async fn a_client_that_does_not_take_its_answer_is_cut_off_and_its_turn_freed() {
    use tokio::io::AsyncReadExt;
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &[
            "--config-token",
            TOKEN,
            "--query-timeout-secs",
            "3",
            "--max-queries",
            "1",
        ],
    );
    // 60 x 50 rows of 10 KB each: about 30 MB of JSON, more than loopback buffers hold, and
    // cheap to evaluate (a debug build, beside other tests).
    let numbers = |n: usize| (0..n).map(|i| i.to_string()).collect::<Vec<_>>().join(" ");
    let long = format!(
        "SELECT * WHERE {{ VALUES ?a {{ {} }} VALUES ?b {{ {} }} BIND(CONCAT(STR(?a), STR(?b), \"{}\") AS ?c) }}",
        numbers(60),
        numbers(50),
        "x".repeat(10_000)
    );
    let address = aggregator.endpoint.trim_start_matches("http://").to_owned();
    let mut idle = posted(&address, "/query", "", long.len(), &long).await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let http = reqwest::Client::new();
    let ask = || {
        http.post(format!("{}/query", aggregator.endpoint))
            .header("content-type", "application/sparql-query")
            .body("ASK { ?s ?p ?o }")
            .send()
    };
    let meanwhile = ask().await.unwrap().status();
    assert_eq!(meanwhile, 503, "the untaken answer's turn is held");
    let started = Instant::now();
    let freed = loop {
        let status = ask().await.unwrap().status();
        if status == 200 || started.elapsed() > Duration::from_secs(30) {
            break status;
        }
    };
    assert_eq!(
        freed, 200,
        "the turn is free once the idle client is cut off"
    );

    // What the idle client gets, read now: the part of the answer that was on its way, then the
    // end of the connection, short of the length announced.
    let mut received = Vec::new();
    let mut buffer = vec![0; 1 << 16];
    loop {
        let read = tokio::time::timeout(Duration::from_secs(10), idle.read(&mut buffer)).await;
        match read {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => received.extend_from_slice(&buffer[..n]),
            Err(_) => panic!(
                "the connection is still open after {} bytes",
                received.len()
            ),
        }
    }
    let text = String::from_utf8_lossy(&received);
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let announced: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length: ")
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap();
    assert!(announced > 20_000_000, "{announced}");
    assert!(body.len() < announced, "{} of {announced}", body.len());
}

/// A connection on which a SPARQL query was POSTed to `path`, with `headers` (each line ending
/// in CRLF), a `Content-Length` of `length` and `body`: all of it, or its first bytes.
async fn posted(
    address: &str,
    path: &str,
    headers: &str,
    length: usize,
    body: &str,
) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/sparql-query\r\n{headers}Content-Length: {length}\r\n\r\n{body}"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// The status a request gets after sending only its head and a few bytes of a body it says is
/// 2 MB long, or `None` if none comes within five seconds (the server waits for the body).
async fn status_before_the_body(address: &str, path: &str, headers: &str) -> Option<String> {
    use tokio::io::AsyncReadExt;
    let mut stream = posted(address, path, headers, 2_000_000, "SELECT").await;
    let mut received = Vec::new();
    let mut buffer = [0; 1024];
    let reading = async {
        while !received.windows(2).any(|w| w == b"\r\n") {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(5), reading)
        .await
        .ok()?;
    let text = String::from_utf8_lossy(&received);
    text.lines().next().map(str::to_owned)
}

/// A write, or a query, that will be refused is refused before its body is read: the endpoint
/// read up to 2 MB of it first (a connection each, for as long as its sender liked to take).
#[tokio::test]
async fn requests_refused_anyway_are_refused_before_their_bodies_are_read() {
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &["--config-token", TOKEN, "--query-token", "reader-token"],
    );
    let address = aggregator.endpoint.trim_start_matches("http://").to_owned();
    // Every journal call is refused there too: the route layer is its only check of the token.
    let journal = [
        "/journal/entries",
        "/journal/takings",
        "/journal/records",
        "/journal/marks",
        "/journal/chains/beat",
        "/journal/chains/held",
        "/journal/turns",
    ];
    for path in ["/update", "/store", "/query", "/sparql"]
        .into_iter()
        .chain(journal)
    {
        let status = status_before_the_body(&address, path, "").await;
        assert_eq!(
            status.as_deref(),
            Some("HTTP/1.1 401 Unauthorized"),
            "{path}"
        );
    }
    // A reader's query: a body longer than a query text can be is refused as it is announced.
    let reader = "Authorization: Bearer reader-token\r\n";
    let status = status_before_the_body(&address, "/query", reader).await;
    assert_eq!(status.as_deref(), Some("HTTP/1.1 413 Payload Too Large"));
    // The services' own queries may be long: theirs is read (and waits for the rest).
    let service = format!("Authorization: Bearer {TOKEN}\r\n");
    assert_eq!(
        status_before_the_body(&address, "/query", &service).await,
        None
    );
}

/// A client that sends a request's head a byte at a time keeps its connection no longer than
/// the head's time limit, and one that announces a body and does not send it, no longer than the
/// body's. Before, axum's server set no timer on a connection: a few thousand such clients held
/// every file descriptor the process had, its store's and its broker's included. (The bounds on
/// connections in all and per peer do not apply to loopback: `crates/serve/tests/bounds.rs`.)
#[tokio::test]
async fn slow_heads_and_bodies_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let broker = Broker::start().unwrap();
    let aggregator = Aggregator::spawn_with(
        &broker,
        &[
            "--config-token",
            TOKEN,
            "--http-head-timeout-secs",
            "5",
            "--http-body-timeout-secs",
            "3",
        ],
    );
    let address = aggregator.endpoint.trim_start_matches("http://").to_owned();

    let started = Instant::now();
    let slow = tokio::net::TcpStream::connect(&address).await.unwrap();
    let (mut from_server, mut to_server) = slow.into_split();
    let head = format!("GET /readyz HTTP/1.1\r\nHost: {address}\r\nX-Slow: ");
    let dripping = tokio::spawn(async move {
        to_server.write_all(head.as_bytes()).await.unwrap();
        for _ in 0..120 {
            tokio::time::sleep(Duration::from_millis(250)).await;
            if to_server.write_all(b"x").await.is_err() {
                break;
            }
        }
    });
    let mut buffer = [0; 1024];
    let closed = tokio::time::timeout(Duration::from_secs(25), from_server.read(&mut buffer)).await;
    let lasted = started.elapsed();
    println!("waited {lasted:?} for a head sent a byte at a time to be cut off");
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "the slow head's connection is still open after {lasted:?}: {closed:?}"
    );
    // The limit given, 5 s, not the default of 10.
    assert!(
        lasted >= Duration::from_secs(4) && lasted < Duration::from_secs(9),
        "{lasted:?}"
    );
    dripping.abort();

    // The services' queries are read whatever their length: this one says 1,000 bytes and sends
    // six.
    let service = format!("Authorization: Bearer {TOKEN}\r\n");
    let started = Instant::now();
    let mut held_back = posted(&address, "/query", &service, 1_000, "SELECT").await;
    let mut received = Vec::new();
    let reading = async {
        loop {
            match held_back.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
    };
    let ended = tokio::time::timeout(Duration::from_secs(25), reading).await;
    let lasted = started.elapsed();
    let text = String::from_utf8_lossy(&received);
    println!(
        "a body held back ended after {lasted:?} with {:?}",
        text.lines().next()
    );
    assert!(
        ended.is_ok(),
        "the held-back body's connection is still open after {lasted:?}"
    );
    // A timeout the services' clients try again, not a bad request.
    assert_eq!(text.lines().next(), Some("HTTP/1.1 408 Request Timeout"));
    assert!(
        lasted >= Duration::from_millis(2_500) && lasted < Duration::from_secs(9),
        "{lasted:?}"
    );
}
