//! The fan-in's reads follow what a fan-out holds, not the whole graph: with many documents in
//! the store (every step's long text is one), reading a fan-out's completions, or a run's
//! recorded tool results, makes a few bindings, not one per document. Counted in bindings (the
//! store's budget of work), so the check holds on a machine of any speed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_graph::{queries, GraphStore, QueryBounds};

/// Documents beside the fan-out's: each a `tg:content` triple, as kept texts are.
const OTHER_DOCUMENTS: usize = 20_000;

/// Far fewer bindings than one per document.
fn budget() -> QueryBounds {
    QueryBounds {
        timeout: Duration::from_secs(60),
        max_rows: 1_000,
        max_bindings: 2_000,
    }
}

async fn store_with_a_fan_out_among_documents() -> GraphStore {
    let store = GraphStore::in_memory().unwrap();
    let mut data = String::from(
        "PREFIX tg: <https://trustgraph.ai/ns/>\nPREFIX prov: <http://www.w3.org/ns/prov#>\nINSERT DATA {\n",
    );
    for i in 0..OTHER_DOCUMENTS {
        data.push_str(&format!(
            "GRAPH <urn:graph:agent-documents> {{ <urn:trustgraph:doc:sha256:{i}> tg:content \"text {i}\" }}\n"
        ));
    }
    let (run, sub) = ("urn:trustgraph:agent:run", "urn:trustgraph:agent:run-f1-s0");
    data.push_str(&format!(
        "GRAPH <urn:graph:retrieval> {{
  <{run}/fanout/1> a tg:FanOut ; tg:correlationId \"run-f1\" ; tg:subagentSession <{sub}> .
  <{sub}/completion> a tg:SubagentCompletion ; tg:correlationId \"run-f1\" ; tg:goal \"price\" ;
    tg:completionStatus \"completed\" ; tg:document <urn:trustgraph:doc:sha256:answer> .
  <{run}/i1> tg:run <{run}> ; tg:action \"llm\" ; tg:arguments \"{{}}\" .
  <{run}/i1/observation> prov:wasDerivedFrom <{run}/i1> ; a tg:Observation ;
    tg:document <urn:trustgraph:doc:sha256:observed> .
}}
GRAPH <urn:graph:agent-documents> {{
  <urn:trustgraph:doc:sha256:answer> tg:content \"alpha costs 1\" .
  <urn:trustgraph:doc:sha256:observed> tg:content \"alpha-result\" .
}}
GRAPH <urn:graph:retrieval> {{
  <urn:trustgraph:agent:run/fanout/2> a tg:FanOut ; tg:correlationId \"run-f2\" ;
    tg:subagentSession <urn:trustgraph:agent:run-f2-s0> .
  <urn:trustgraph:agent:run-f2-s0/completion> a tg:SubagentCompletion ;
    tg:correlationId \"run-f2\" ; tg:goal \"short\" ; tg:completionStatus \"answer\" ;
    tg:document <urn:trustgraph:agent:run-f2-s0/final> .
  <urn:trustgraph:agent:run-f2-s0/final> tg:content \"beta costs 2\" .
}}
}}"
    ));
    store.update(data).await.unwrap();
    store
}

#[tokio::test]
async fn a_fan_outs_completions_are_read_without_reading_every_document() {
    let store = store_with_a_fan_out_among_documents().await;
    let rows = store
        .query_bounded(queries::completions("run-f1"), budget())
        .await
        .unwrap()
        .rows();
    assert_eq!(rows.rows.len(), 1);
    let result = rows.first("result").unwrap().to_string();
    assert!(result.contains("alpha costs 1"), "{result}");
    // A short result kept beside its node, in the provenance graph itself.
    let beside = store
        .query_bounded(queries::completions("run-f2"), budget())
        .await
        .unwrap()
        .rows();
    assert_eq!(beside.rows.len(), 1);
    let result = beside.first("result").unwrap().to_string();
    assert!(result.contains("beta costs 2"), "{result}");
}

#[tokio::test]
async fn a_runs_tool_results_are_read_without_reading_every_document() {
    let store = store_with_a_fan_out_among_documents().await;
    let run = agent_graph::model::NamedNode::new("urn:trustgraph:agent:run").unwrap();
    let rows = store
        .query_bounded(queries::recorded_tool_results(&run), budget())
        .await
        .unwrap()
        .rows();
    assert_eq!(rows.rows.len(), 1);
    let text = rows.first("text").unwrap().to_string();
    assert!(text.contains("alpha-result"), "{text}");
}
