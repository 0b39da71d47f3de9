//! The sweeps' queries (fan-out timeouts, approval expiries, the count of open fan-outs) read
//! what still waits, not every fan-out and approval ever recorded: with thousands answered in the
//! store they make a few bindings (the store's budget of work, so the check holds on a machine of
//! any speed). And the index they start from is kept: a store written before it marks what
//! waits once, and answered nodes lose their marks.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_graph::waiting::{self, Waits};
use agent_graph::{queries, GraphStore, QueryBounds};

/// Fan-outs and approvals answered long ago, beside the few that wait.
const ANSWERED: usize = 5_000;

/// Far fewer bindings than one per answered node.
fn budget() -> QueryBounds {
    QueryBounds {
        timeout: Duration::from_secs(60),
        max_rows: 1_000,
        max_bindings: 2_000,
    }
}

const PREFIXES: &str = "PREFIX tg: <https://trustgraph.ai/ns/>\nPREFIX prov: <http://www.w3.org/ns/prov#>\nPREFIX xsd: <http://www.w3.org/2001/XMLSchema#>\n";

/// A fan-out as the orchestrator records it, and, if `answered`, its synthesis requested.
fn fan_out(name: &str, answered: bool) -> String {
    let node = format!("urn:trustgraph:agent:{name}/fanout/1");
    let mut text = format!(
        "<{node}> a tg:FanOut ; tg:correlationId \"{name}-f1\" ;
  prov:startedAtTime \"2026-01-01T00:00:00Z\"^^xsd:dateTime ; tg:expectedSiblings 2 ;
  tg:continuation \"{{}}\" ; tg:clientId \"client\" .\n"
    );
    if answered {
        text.push_str(&format!("<{node}> tg:synthesisRequested true .\n"));
    }
    text
}

/// A call parked for approval, its deadline passed, and, if `answered`, its answer.
fn approval(name: &str, answered: bool) -> String {
    let node = format!("urn:trustgraph:agent:{name}/i1/approval");
    let mut text = format!(
        "<{node}> a tg:ApprovalRequest ; tg:deadline \"2026-01-01T00:00:00Z\"^^xsd:dateTime ;
  tg:step 1 .\n"
    );
    if answered {
        text.push_str(&format!(
            "<{node}/answer> a tg:ApprovalAnswer ; prov:wasDerivedFrom <{node}> .\n"
        ));
    }
    text
}

/// A store written before the index was kept: many answered, one of each kind waiting.
async fn store_with_history() -> GraphStore {
    let store = GraphStore::in_memory().unwrap();
    let mut data = format!("{PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{\n");
    for i in 0..ANSWERED {
        data.push_str(&fan_out(&format!("old-{i}"), true));
        data.push_str(&approval(&format!("old-{i}"), true));
    }
    data.push_str(&fan_out("open", false));
    data.push_str(&approval("open", false));
    data.push_str("} }");
    store.update(data).await.unwrap();
    store
}

async fn waiting_now(store: &GraphStore) -> (usize, usize, usize) {
    let now = "2026-06-01T00:00:00Z";
    let overdue = store
        .query_bounded(queries::overdue_fanouts(now), budget())
        .await
        .unwrap()
        .rows();
    let expired = store
        .query_bounded(queries::unanswered_approvals(), budget())
        .await
        .unwrap()
        .rows();
    let open = store
        .query_bounded(queries::open_fanouts(), budget())
        .await
        .unwrap()
        .rows();
    let open: usize = match open.first("n") {
        Some(agent_graph::model::Term::Literal(n)) => n.value().parse().unwrap(),
        other => panic!("{other:?}"),
    };
    (overdue.rows.len(), expired.rows.len(), open)
}

#[tokio::test]
async fn the_sweeps_read_what_waits_not_the_whole_history() {
    let store = store_with_history().await;
    // Nothing is marked yet: the sweeps see nothing (and read next to nothing).
    assert_eq!(waiting_now(&store).await, (0, 0, 0));
    // An earlier build's store is marked once, at the aggregator's start: what waits, only.
    assert_eq!(waiting::mark_unmarked(&store).await.unwrap(), 2);
    assert_eq!(waiting::mark_unmarked(&store).await.unwrap(), 0);
    // Within a budget of bindings far below one per answered node.
    assert_eq!(waiting_now(&store).await, (1, 1, 1));
    // So is what each sweep reads to tidy the index (the marks of nodes answered since).
    for what in [Waits::Synthesis, Waits::ApprovalAnswer] {
        let answered = store
            .query_bounded(waiting::answered(what), budget())
            .await
            .unwrap()
            .rows();
        assert!(answered.rows.is_empty(), "{what:?}");
    }
}

#[tokio::test]
async fn more_waiting_than_a_page_of_marks_is_all_marked() {
    // Written by an earlier build: 2,500 fan-outs open (marks are added a thousand at a time).
    let store = GraphStore::in_memory().unwrap();
    let mut data = format!("{PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{\n");
    for i in 0..2_500 {
        data.push_str(&fan_out(&format!("open-{i}"), false));
    }
    data.push_str("} }");
    store.update(data).await.unwrap();
    assert_eq!(waiting::mark_unmarked(&store).await.unwrap(), 2_500);
    assert_eq!(waiting::mark_unmarked(&store).await.unwrap(), 0);
    let open = store.query(queries::open_fanouts()).await.unwrap().rows();
    assert_eq!(
        open.first("n").unwrap().to_string(),
        "\"2500\"^^<http://www.w3.org/2001/XMLSchema#integer>"
    );
}

#[tokio::test]
async fn answered_nodes_lose_their_marks_and_new_ones_are_marked_as_written() {
    let store = store_with_history().await;
    waiting::mark_unmarked(&store).await.unwrap();
    // A new fan-out and approval written as the aggregator writes a message: marked with it.
    let mut quads = Vec::new();
    for text in [fan_out("new", false), approval("new", false)] {
        let parsed = oxigraph_quads(&text);
        quads.extend(parsed);
    }
    let marks = waiting::marks_for(&quads);
    assert_eq!(marks.len(), 2);
    quads.extend(marks);
    store.insert(quads).await.unwrap();
    assert_eq!(waiting_now(&store).await, (2, 2, 2));
    // Nothing answered yet: nothing to tidy.
    assert_eq!(waiting::tidy(&store, Waits::Synthesis).await.unwrap(), 0);
    assert_eq!(
        waiting::tidy(&store, Waits::ApprovalAnswer).await.unwrap(),
        0
    );
    // One fan-out synthesised, one refused, one approval answered.
    store
        .update(format!(
            "{PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{
  <urn:trustgraph:agent:new/fanout/1> tg:synthesisRequested true .
  <urn:trustgraph:agent:open/fanout/1> tg:fanInRefused \"sealed with another key\" .
  <urn:trustgraph:agent:new/i1/approval/answer> a tg:ApprovalAnswer ;
    prov:wasDerivedFrom <urn:trustgraph:agent:new/i1/approval> . }} }}"
        ))
        .await
        .unwrap();
    // The sweeps skip them at once (the record decides), and remove their marks.
    assert_eq!(waiting_now(&store).await, (0, 1, 0));
    assert_eq!(waiting::tidy(&store, Waits::Synthesis).await.unwrap(), 2);
    assert_eq!(
        waiting::tidy(&store, Waits::ApprovalAnswer).await.unwrap(),
        1
    );
    assert_eq!(waiting::tidy(&store, Waits::Synthesis).await.unwrap(), 0);
    let marks = store
        .query(
            "SELECT (COUNT(*) AS ?n) WHERE { GRAPH <urn:graph:agent-waiting> { ?s ?p ?o } }"
                .to_owned(),
        )
        .await
        .unwrap()
        .rows();
    assert_eq!(
        marks.first("n").unwrap().to_string(),
        "\"1\"^^<http://www.w3.org/2001/XMLSchema#integer>"
    );
    assert_eq!(waiting_now(&store).await, (0, 1, 0));
}

/// `text` (Turtle statements with [`PREFIXES`]) as quads in the provenance graph.
fn oxigraph_quads(text: &str) -> Vec<agent_graph::model::Quad> {
    let turtle = PREFIXES
        .replace("PREFIX ", "@prefix ")
        .replace(">\n", "> .\n")
        + text;
    let graph = agent_graph::model::NamedNode::new("urn:graph:retrieval").unwrap();
    oxigraph::io::RdfParser::from_format(oxigraph::io::RdfFormat::Turtle)
        .for_reader(turtle.as_bytes())
        .map(|quad| {
            let quad = quad.unwrap();
            agent_graph::model::Quad::new(quad.subject, quad.predicate, quad.object, graph.clone())
        })
        .collect()
}
