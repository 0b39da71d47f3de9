//! Distributed traces: with `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP receiver the test
//! runs, one dialog's spans from the orchestrator (every iteration, routing included) and from the
//! aggregator (the writes of its provenance) arrive under one trace id, the aggregator's as children
//! of the iterations that explained themselves (the context travels in the `traceparent` property).
//! Sent as the OpenTelemetry SDKs send by default (binary protobuf), read back by OpenTelemetry's own
//! message classes in a collector that, like a hosted backend, takes only requests with its key;
//! and as JSON when `OTEL_EXPORTER_OTLP_PROTOCOL` asks for it; over gRPC; and over TLS to a collector
//! that requires a client certificate (mutual TLS), over HTTPS and gRPC.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
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
async fn json_collector() -> (String, Received) {
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

fn json_spans(received: &Received) -> Vec<Span> {
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

/// OpenTelemetry's collector as far as these tests need one (tests/otlp/collector.py): protobuf
/// read by the protocol's own classes, a key required. SIGKILLed on drop.
struct ProtobufCollector {
    child: Child,
    endpoint: String,
    /// A JSON line per span received, and per request refused.
    lines: Received,
}

impl ProtobufCollector {
    fn start(header: &str, key: &str) -> ProtobufCollector {
        Self::serving(header, key, &[], None)
    }

    /// OTLP's gRPC trace service instead of OTLP/HTTP.
    fn grpc(header: &str, key: &str) -> ProtobufCollector {
        Self::serving(header, key, &["grpc"], None)
    }

    /// Over TLS with the certificates in `tls` (`collector.pem`, `collector.key`), taking only
    /// clients with a certificate `ca.pem` there signed.
    fn serving(header: &str, key: &str, mode: &[&str], tls: Option<&Path>) -> ProtobufCollector {
        let python = installed_path("otlp-collector.sh").join("python");
        let script = repo_root().join("tests/otlp/collector.py");
        let mut child = agent_bus::orphans::owned(&mut Command::new(python))
            .arg(script)
            .args([header, key])
            .args(mode)
            .envs(tls.map(|dir| ("COLLECTOR_TLS", dir)))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let first: Value = serde_json::from_str(&out.next().unwrap().unwrap()).unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let endpoint = format!("{scheme}://127.0.0.1:{}", first["listening"]);
        let lines: Received = Arc::default();
        let kept = lines.clone();
        std::thread::spawn(move || {
            for line in out.map_while(Result::ok) {
                if let Ok(json) = serde_json::from_str::<Value>(&line) {
                    kept.lock().unwrap().push(json);
                }
            }
        });
        ProtobufCollector {
            child,
            endpoint,
            lines,
        }
    }

    fn spans(&self) -> Vec<Span> {
        let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.get("name").is_some())
            .map(|l| Span {
                service: text(&l["service"]),
                name: text(&l["name"]),
                trace: text(&l["trace"]),
                id: text(&l["id"]),
                parent: text(&l["parent"]),
                attributes: l["attributes"]
                    .as_object()
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), text(v)))
                    .collect(),
            })
            .collect()
    }

    fn lines(&self) -> Vec<Value> {
        self.lines.lock().unwrap().clone()
    }
}

impl Drop for ProtobufCollector {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The services read the standard variables, which their children inherit: one test at a time
/// sets them.
static EXPORT_VARIABLES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const EXPORT_VARIABLE_NAMES: [&str; 8] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_COMPRESSION",
    "OTEL_EXPORTER_OTLP_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
    "OTEL_EXPORTER_OTLP_CLIENT_KEY",
    "OTEL_RESOURCE_ATTRIBUTES",
];

/// The processes of a dialog run with an exporter: they go on exporting while this is kept.
struct Running {
    _broker: Broker,
    _aggregator: Aggregator,
    _llm: scripted_llm::ScriptedLlm,
    _orchestrator: Orchestrator,
}

/// Runs a three-step dialog with a child aggregator and orchestrator exporting as the variables
/// `set` say.
async fn a_dialog_run(set: &[(&str, &str)]) -> Running {
    for name in EXPORT_VARIABLE_NAMES {
        std::env::remove_var(name);
    }
    for (name, value) in set {
        std::env::set_var(name, value);
    }
    let broker = Broker::start().unwrap();
    // Children: the binaries install the exporter; the test process has none.
    let aggregator = Aggregator::start(Place::Child, &broker, &[]);
    let llm = scripted_llm(THREE_STEPS).await;
    let orchestrator = Orchestrator::child(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    client
        .send("t-1", &request("combine the parts", false))
        .await
        .unwrap();
    let dialog = collect_dialog(&mut client, "t-1", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(dialog.last().unwrap().content, "alpha and beta, combined.");
    Running {
        _broker: broker,
        _aggregator: aggregator,
        _llm: llm,
        _orchestrator: orchestrator,
    }
}

/// Runs a three-step dialog with a child aggregator and orchestrator exporting as the variables
/// `set` say, and checks the spans `received` gives: one trace, the iterations a chain under the
/// routing step, the aggregator's writes under the iterations.
async fn a_dialog_traced(set: &[(&str, &str)], received: impl Fn() -> Vec<Span>) -> Vec<Span> {
    let _running = a_dialog_run(set).await;

    // Routing, then three ReACT iterations; and the aggregator's writes of what they explained.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    let (iterations, writes, all) = loop {
        let all = received();
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
            break (iterations, writes, all);
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
    all
}

#[tokio::test]
async fn a_dialogs_spans_reach_a_collector_that_wants_a_key_as_protobuf_and_share_one_trace() {
    let _one_at_a_time = EXPORT_VARIABLES.lock().await;
    let collector = ProtobufCollector::start("x-api-key", "k-9f2");
    // The protocol left to its default (http/protobuf), the key percent-encoded as the variable
    // takes values, the body gzipped, and a resource attribute of the deployment's.
    let spans = a_dialog_traced(
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.endpoint),
            ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=k%2D9f2"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=e2e"),
        ],
        || collector.spans(),
    )
    .await;
    let lines = collector.lines();
    assert!(
        lines.iter().all(|l| l.get("refused").is_none()),
        "every export carried the key, as protobuf: {lines:#?}"
    );
    assert!(lines
        .iter()
        .filter(|l| l.get("name").is_some())
        .all(|l| l["gzip"] == true
            && l["resource"]["deployment.environment"] == "e2e"
            && l["scope"] == "pulsar-agents"
            && l["kind"] == 1
            && l["end"].as_u64() >= l["start"].as_u64()));
    assert!(!spans.is_empty());
}

#[tokio::test]
async fn a_dialogs_spans_reach_a_json_collector_when_the_protocol_asks_for_json() {
    let _one_at_a_time = EXPORT_VARIABLES.lock().await;
    let (endpoint, received) = json_collector().await;
    a_dialog_traced(
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ],
        || json_spans(&received),
    )
    .await;
}

#[tokio::test]
async fn a_dialogs_spans_reach_a_grpc_collector_that_wants_a_key() {
    let _one_at_a_time = EXPORT_VARIABLES.lock().await;
    let collector = ProtobufCollector::grpc("x-api-key", "k-9f2");
    // gRPC's endpoint is the collector alone (no `/v1/traces`); the message gzipped, as
    // `grpc-encoding` says.
    a_dialog_traced(
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.endpoint),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_HEADERS", "X-Api-Key=k-9f2"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=e2e"),
        ],
        || collector.spans(),
    )
    .await;
    let lines = collector.lines();
    assert!(
        lines.iter().all(|l| l.get("refused").is_none()),
        "every call carried the key: {lines:#?}"
    );
    assert!(lines
        .iter()
        .filter(|l| l.get("name").is_some())
        .all(|l| l["resource"]["deployment.environment"] == "e2e" && l["kind"] == 1));
}

/// A private CA, the collector's certificate for 127.0.0.1 it signed, and a client certificate
/// (with its key) it signed for the services, in a directory of their own.
fn mutual_tls_certificates(name: &str) -> (std::path::PathBuf, PrivateCa, (String, String)) {
    let dir = std::env::temp_dir().join(format!("otlp-mtls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let ca = PrivateCa::new(&dir);
    ca.issue(
        "collector",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    let (certificate, key) = ca.issue("exporter", "extendedKeyUsage=clientAuth\n");
    let path = |p: std::path::PathBuf| p.to_string_lossy().into_owned();
    (dir, ca, (path(certificate), path(key)))
}

/// Services given the CA and the client certificate reach a collector that requires one; given
/// the CA alone (what they had before `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` was read), their
/// handshake is refused and no span arrives while they run.
async fn spans_reach_a_mutual_tls_collector(mode: &[&str]) {
    let name = mode.first().copied().unwrap_or("http");
    let (dir, ca, (certificate, key)) = mutual_tls_certificates(name);
    let collector = ProtobufCollector::serving("x-api-key", "k-9f2", mode, Some(&dir));
    let ca_file = ca.certificate().to_string_lossy().into_owned();
    let protocol = if mode == ["grpc"] {
        "grpc"
    } else {
        "http/protobuf"
    };
    let common = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
        ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=k-9f2"),
        ("OTEL_EXPORTER_OTLP_CERTIFICATE", ca_file.as_str()),
    ];
    {
        let _running = a_dialog_run(&common).await;
        // The exporter sends twice a second: a few seconds is several tries.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            collector.spans().is_empty(),
            "spans arrived without a client certificate"
        );
    }
    let mut with_client = common.to_vec();
    with_client.push(("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", &certificate));
    with_client.push(("OTEL_EXPORTER_OTLP_CLIENT_KEY", &key));
    a_dialog_traced(&with_client, || collector.spans()).await;
    let lines = collector.lines();
    assert!(
        lines.iter().all(|l| l.get("refused").is_none()),
        "every export carried the key: {lines:#?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_dialogs_spans_reach_a_collector_that_requires_a_client_certificate_over_https() {
    let _one_at_a_time = EXPORT_VARIABLES.lock().await;
    spans_reach_a_mutual_tls_collector(&[]).await;
}

#[tokio::test]
async fn a_dialogs_spans_reach_a_grpc_collector_that_requires_a_client_certificate() {
    let _one_at_a_time = EXPORT_VARIABLES.lock().await;
    spans_reach_a_mutual_tls_collector(&["grpc"]).await;
}
