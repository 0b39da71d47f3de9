//! Distributed traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP receiver the test
//! runs, one dialog's spans from the orchestrator (every iteration, routing included) and from the
//! aggregator (the writes of its provenance) arrive under one trace id, the aggregator's as children
//! of the iterations that explained themselves (the context travels in the `traceparent` property).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_e2e::*;
use axum::extract::State;
use serde_json::Value;

type Received = Arc<Mutex<Vec<Value>>>;

async fn receive(State(received): State<Received>, body: axum::body::Bytes) -> &'static str {
    if let Ok(json) = serde_json::from_slice::<Value>(&body) {
        received.lock().unwrap().push(json);
    }
    "{}"
}

/// A stand-in collector: `POST /v1/traces` with OTLP JSON, kept as received.
async fn collector() -> (String, Received) {
    let received: Received = Arc::default();
    let app = axum::Router::new()
        .route("/v1/traces", axum::routing::post(receive))
        .with_state(received.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, received)
}

/// A received span: service, name, trace id, span id, parent span id, attributes.
#[derive(Debug, Clone)]
struct Span {
    service: String,
    name: String,
    trace: String,
    id: String,
    parent: String,
    attributes: Vec<(String, String)>,
}

impl Span {
    fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

fn spans(received: &Received) -> Vec<Span> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    let mut out = Vec::new();
    for body in received.lock().unwrap().iter() {
        for resource in body["resourceSpans"].as_array().into_iter().flatten() {
            let service = resource["resource"]["attributes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|a| a["key"] == "service.name")
                .map(|a| text(&a["value"]["stringValue"]))
                .unwrap_or_default();
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                for span in scope["spans"].as_array().into_iter().flatten() {
                    let attributes = span["attributes"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|a| (text(&a["key"]), text(&a["value"]["stringValue"])))
                        .collect();
                    out.push(Span {
                        service: service.clone(),
                        name: text(&span["name"]),
                        trace: text(&span["traceId"]),
                        id: text(&span["spanId"]),
                        parent: text(&span["parentSpanId"]),
                        attributes,
                    });
                }
            }
        }
    }
    out
}

#[tokio::test]
async fn a_dialogs_spans_from_orchestrator_and_aggregator_share_one_trace() {
    let (endpoint, received) = collector().await;
    // The services read the standard variable; this test binary holds only this test, so setting
    // it for the children it spawns touches no other test.
    std::env::set_var("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint);
    let broker = Broker::start().unwrap();
    // Children: the binaries install the exporter; the test process has none.
    let _aggregator = Aggregator::start(Place::Child, &broker, &[]);
    let llm = scripted_llm(THREE_STEPS).await;
    let _orchestrator = Orchestrator::child(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("t-1", &request("combine the parts", false))
        .await
        .unwrap();
    let dialog = collect_dialog(&mut client, "t-1", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(dialog.last().unwrap().content, "alpha and beta, combined.");

    // Routing, then three ReACT iterations; and the aggregator's writes of what they explained.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let (iterations, writes) = loop {
        let all = spans(&received);
        let iterations: Vec<Span> = all
            .iter()
            .filter(|s| s.service == "agent-orchestrator" && s.name == "iteration")
            .filter(|s| s.attribute("id") == Some("t-1"))
            .cloned()
            .collect();
        let traces: BTreeSet<&str> = iterations.iter().map(|s| s.trace.as_str()).collect();
        let writes: Vec<Span> = all
            .iter()
            .filter(|s| s.service == "agent-aggregator" && s.name == "explain")
            .filter(|s| traces.contains(s.trace.as_str()))
            .cloned()
            .collect();
        if iterations.len() >= 4 && writes.len() >= 4 {
            break (iterations, writes);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "spans missing: {iterations:#?} {writes:#?} of {all:#?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let traces: BTreeSet<&str> = iterations.iter().map(|s| s.trace.as_str()).collect();
    assert_eq!(traces.len(), 1, "one dialog, one trace: {iterations:#?}");
    let trace = traces.iter().next().unwrap();
    assert_eq!(trace.len(), 32);
    // Each step is the child of the one that queued it: one root (routing), a chain after it.
    let ids: BTreeSet<&str> = iterations.iter().map(|s| s.id.as_str()).collect();
    let roots = iterations.iter().filter(|s| s.parent.is_empty()).count();
    assert_eq!(roots, 1, "{iterations:#?}");
    assert!(iterations
        .iter()
        .all(|s| s.parent.is_empty() || ids.contains(s.parent.as_str())));
    assert!(iterations.iter().all(|s| s.attribute("session").is_some()));
    // The aggregator's spans hang under the iterations whose provenance they wrote.
    assert!(
        writes.iter().all(|w| ids.contains(w.parent.as_str())),
        "{writes:#?}"
    );
}
