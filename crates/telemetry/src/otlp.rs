//! How spans leave the process: the OTLP exporter's settings, read from the standard
//! `OTEL_EXPORTER_OTLP_*` variables as the OpenTelemetry SDKs read them (endpoint, protocol,
//! headers, compression, timeout, CA certificate, client certificate and key, resource
//! attributes), the two bodies OTLP/HTTP
//! takes (binary protobuf, the default, and JSON; gRPC carries the same protobuf, see
//! [`crate::grpc`]), and the sending, with retries where the collector asks for them and a warning
//! when spans are lost.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;

use crate::trace::Finished;

/// The body OTLP/HTTP is sent as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// `http/protobuf`: the OpenTelemetry default, which every OTLP/HTTP receiver reads.
    Protobuf,
    /// `http/json`.
    Json,
    /// `grpc`: the trace service's `Export` call over HTTP/2 ([`crate::grpc`]).
    Grpc,
}

/// Where and how spans are exported.
#[derive(Clone, PartialEq, Eq)]
pub struct ExportSettings {
    /// The full URL spans are posted to (`…/v1/traces`).
    pub url: String,
    pub protocol: Protocol,
    /// Sent with every export (a hosted backend's key, an `Authorization`).
    pub headers: Vec<(String, String)>,
    pub gzip: bool,
    /// How long one export may take, retries included.
    pub timeout: Duration,
    /// A PEM file of the CA certificates an `https` collector is checked against, besides the
    /// system's.
    pub certificate: Option<String>,
    /// The certificate (PEM, its chain after it) and private key (PEM) shown to a collector that
    /// asks for one (mutual TLS): `OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE` and `_CLIENT_KEY`.
    pub client: Option<ClientIdentity>,
    /// The resource the spans come from: `service.name` first, then `OTEL_RESOURCE_ATTRIBUTES`.
    pub resource: Vec<(String, String)>,
}

/// The files of the certificate an exporter shows a collector, and of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    pub certificate: String,
    pub key: String,
}

impl ExportSettings {
    /// The URL as logs show it: without a user and password (reqwest sends them as Basic
    /// authentication, so they are a backend's key) and without a query, which may hold one.
    pub fn shown_url(&self) -> String {
        match reqwest::Url::parse(&self.url) {
            Ok(mut url) => {
                let _ = url.set_username("");
                let _ = url.set_password(None);
                url.set_query(None);
                url.set_fragment(None);
                url.to_string()
            }
            Err(_) => "(not a URL)".to_owned(),
        }
    }
}

/// Without the headers' values, which are secrets (a backend's key), nor the URL's credentials.
impl std::fmt::Debug for ExportSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<&str> = self.headers.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("ExportSettings")
            .field("url", &self.shown_url())
            .field("protocol", &self.protocol)
            .field("headers", &headers)
            .field("gzip", &self.gzip)
            .field("timeout", &self.timeout)
            .field("certificate", &self.certificate)
            .field("client", &self.client)
            .field("resource", &self.resource)
            .finish()
    }
}

/// What the variables ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Export {
    /// No endpoint set, or exporting switched off (`OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER=none`).
    Off,
    /// Export, with what was wrong in the variables and left out (each a sentence to log).
    To(ExportSettings, Vec<String>),
    /// Asked for something this exporter cannot do; nothing is exported, for this reason.
    Refused(String),
}

/// The export the variables `var` gives ask for, for spans of `service` (a default that
/// `OTEL_SERVICE_NAME` and `service.name` in `OTEL_RESOURCE_ATTRIBUTES` override, in that order).
/// A signal's own variable (`OTEL_EXPORTER_OTLP_TRACES_*`) wins over the general one.
pub fn settings_from(var: impl Fn(&str) -> Option<String>, service: &str) -> Export {
    let var = |name: &str| {
        var(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    };
    let traces_or_all = |suffix: &str| {
        var(&format!("OTEL_EXPORTER_OTLP_TRACES_{suffix}"))
            .or_else(|| var(&format!("OTEL_EXPORTER_OTLP_{suffix}")))
    };
    if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
    {
        return Export::Off;
    }
    let mut problems = Vec::new();
    let protocol = match traces_or_all("PROTOCOL").as_deref() {
        None | Some("http/protobuf") => Protocol::Protobuf,
        Some("http/json") => Protocol::Json,
        Some("grpc") => Protocol::Grpc,
        Some(other) => {
            return Export::Refused(format!(
                "unknown OTLP protocol {other:?} (http/protobuf, http/json, grpc); spans are not exported"
            ))
        }
    };
    // Over HTTP the general endpoint is a base the signal's path goes after; gRPC's names the
    // collector alone, whose service has one path.
    let url = match (
        var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        var("OTEL_EXPORTER_OTLP_ENDPOINT"),
    ) {
        (Some(url), _) => url,
        (None, Some(base)) if protocol == Protocol::Grpc => base,
        (None, Some(base)) => format!("{}/v1/traces", base.trim_end_matches('/')),
        (None, None) => return Export::Off,
    };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Export::Refused(format!(
            "the OTLP endpoint {url} is not an http(s) URL; spans are not exported"
        ));
    }
    let mut headers = Vec::new();
    for name in [
        "OTEL_EXPORTER_OTLP_HEADERS",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    ] {
        if let Some(list) = var(name) {
            let (parsed, bad) = key_values(&list);
            // One that is no HTTP header would fail every export, each retried for seconds.
            let (parsed, not_headers): (Vec<_>, Vec<_>) =
                parsed.into_iter().partition(|(key, value)| {
                    reqwest::header::HeaderName::from_bytes(key.as_bytes()).is_ok()
                        && reqwest::header::HeaderValue::from_str(value).is_ok()
                });
            if !not_headers.is_empty() {
                let names: Vec<&str> = not_headers.iter().map(|(k, _)| k.as_str()).collect();
                problems.push(format!(
                    "{} entries of {name} are not HTTP headers and were left out: {}",
                    not_headers.len(),
                    names.join(", ").escape_debug()
                ));
            }
            // The signal's own headers are read second and replace the general ones of a name.
            for (key, value) in parsed {
                headers.retain(|(k, _): &(String, String)| !k.eq_ignore_ascii_case(&key));
                headers.push((key, value));
            }
            if bad > 0 {
                problems.push(format!(
                    "{bad} entries of {name} are not key=value and were left out"
                ));
            }
        }
    }
    let gzip = match traces_or_all("COMPRESSION").as_deref() {
        None | Some("none") => false,
        Some("gzip") => true,
        Some(other) => {
            problems.push(format!(
                "unknown OTLP compression {other:?} (gzip, none); spans are sent uncompressed"
            ));
            false
        }
    };
    let timeout = match traces_or_all("TIMEOUT") {
        None => DEFAULT_TIMEOUT,
        Some(ms) => match ms.parse::<u64>() {
            Ok(ms) if ms > 0 => Duration::from_millis(ms.min(MAX_TIMEOUT_MS)),
            _ => {
                problems.push(format!(
                    "OTLP timeout {ms:?} is not a number of milliseconds over 0; {} ms is used",
                    DEFAULT_TIMEOUT.as_millis()
                ));
                DEFAULT_TIMEOUT
            }
        },
    };
    let mut resource = Vec::new();
    if let Some(list) = var("OTEL_RESOURCE_ATTRIBUTES") {
        let (parsed, bad) = key_values(&list);
        for (key, value) in parsed {
            resource.retain(|(k, _): &(String, String)| *k != key);
            resource.push((key, value));
        }
        if bad > 0 {
            problems.push(format!(
                "{bad} entries of OTEL_RESOURCE_ATTRIBUTES are not key=value and were left out"
            ));
        }
    }
    let client = match (
        traces_or_all("CLIENT_CERTIFICATE"),
        traces_or_all("CLIENT_KEY"),
    ) {
        (Some(certificate), Some(key)) => Some(ClientIdentity { certificate, key }),
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            problems.push(
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE and OTEL_EXPORTER_OTLP_CLIENT_KEY go together; \
                 with one of them only, no client certificate is shown"
                    .to_owned(),
            );
            None
        }
    };
    let named = resource
        .iter()
        .position(|(k, _)| k == "service.name")
        .map(|i| resource.remove(i).1);
    let service = var("OTEL_SERVICE_NAME")
        .or(named)
        .unwrap_or_else(|| service.to_owned());
    resource.insert(0, ("service.name".to_owned(), service));
    Export::To(
        ExportSettings {
            url,
            protocol,
            headers,
            gzip,
            timeout,
            certificate: traces_or_all("CERTIFICATE"),
            client,
            resource,
        },
        problems,
    )
}

/// As the OpenTelemetry SDKs wait for one export by default.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// A timeout past this is taken as this: an export that waits longer holds every span behind it.
const MAX_TIMEOUT_MS: u64 = 120_000;

/// The `key=value` pairs of a comma-separated list (W3C Baggage's form, as `OTEL_EXPORTER_OTLP_HEADERS`
/// and `OTEL_RESOURCE_ATTRIBUTES` take them: values percent-encoded), and how many entries were
/// not one.
pub fn key_values(list: &str) -> (Vec<(String, String)>, usize) {
    let mut pairs = Vec::new();
    let mut bad = 0;
    for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        match entry.split_once('=') {
            Some((key, value)) if !key.trim().is_empty() => {
                match (percent_decoded(key.trim()), percent_decoded(value.trim())) {
                    (Some(key), Some(value)) => pairs.push((key, value)),
                    _ => bad += 1,
                }
            }
            _ => bad += 1,
        }
    }
    (pairs, bad)
}

pub(crate) fn percent_decoded(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn nanos(t: SystemTime) -> u64 {
    u64::try_from(t.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()).unwrap_or(u64::MAX)
}

/// OTLP's span kind for every span we export: work inside the service.
const SPAN_KIND_INTERNAL: u64 = 1;

/// The OTLP/HTTP JSON body for a batch of spans.
pub(crate) fn json_body(resource: &[(String, String)], spans: &[Finished]) -> Vec<u8> {
    let attributes = |pairs: &[(String, String)]| -> Vec<serde_json::Value> {
        pairs
            .iter()
            .map(|(k, v)| serde_json::json!({"key": k, "value": {"stringValue": v}}))
            .collect()
    };
    let spans: Vec<serde_json::Value> = spans
        .iter()
        .map(|s| {
            let mut span = serde_json::json!({
                "traceId": format!("{:032x}", s.ids.trace_id),
                "spanId": format!("{:016x}", s.ids.span_id),
                "name": s.name,
                "kind": SPAN_KIND_INTERNAL,
                "startTimeUnixNano": nanos(s.start).to_string(),
                "endTimeUnixNano": nanos(s.end).to_string(),
                "attributes": attributes(&s.attributes),
            });
            if let Some(parent) = s.parent {
                span["parentSpanId"] = serde_json::json!(format!("{parent:016x}"));
            }
            span
        })
        .collect();
    serde_json::json!({"resourceSpans": [{
        "resource": {"attributes": attributes(resource)},
        "scopeSpans": [{"scope": {"name": SCOPE}, "spans": spans}]
    }]})
    .to_string()
    .into_bytes()
}

/// The instrumentation scope our spans are under.
const SCOPE: &str = "pulsar-agents";

/// Protocol Buffers' wire form, as much of it as OTLP's trace messages use.
mod proto {
    pub fn varint(out: &mut Vec<u8>, mut value: u64) {
        while value >= 0x80 {
            out.push((value as u8) | 0x80);
            value >>= 7;
        }
        out.push(value as u8);
    }

    fn tag(out: &mut Vec<u8>, field: u32, wire_type: u8) {
        varint(out, (u64::from(field) << 3) | u64::from(wire_type));
    }

    /// A length-delimited field: bytes, a string or an embedded message.
    pub fn bytes(out: &mut Vec<u8>, field: u32, value: &[u8]) {
        tag(out, field, 2);
        varint(out, value.len() as u64);
        out.extend_from_slice(value);
    }

    pub fn message(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
        let mut inner = Vec::new();
        write(&mut inner);
        bytes(out, field, &inner);
    }

    pub fn fixed64(out: &mut Vec<u8>, field: u32, value: u64) {
        tag(out, field, 1);
        out.extend_from_slice(&value.to_le_bytes());
    }

    pub fn uint(out: &mut Vec<u8>, field: u32, value: u64) {
        tag(out, field, 0);
        varint(out, value);
    }
}

/// `opentelemetry.proto.common.v1.KeyValue` with a string `AnyValue`, as field `field`.
fn key_value(out: &mut Vec<u8>, field: u32, key: &str, value: &str) {
    proto::message(out, field, |kv| {
        proto::bytes(kv, 1, key.as_bytes());
        proto::message(kv, 2, |any| proto::bytes(any, 1, value.as_bytes()));
    });
}

/// The OTLP/HTTP protobuf body (`ExportTraceServiceRequest`) for a batch of spans.
pub(crate) fn protobuf_body(resource: &[(String, String)], spans: &[Finished]) -> Vec<u8> {
    let mut out = Vec::new();
    // ExportTraceServiceRequest.resource_spans = 1
    proto::message(&mut out, 1, |resource_spans| {
        // ResourceSpans.resource = 1; Resource.attributes = 1
        proto::message(resource_spans, 1, |r| {
            for (k, v) in resource {
                key_value(r, 1, k, v);
            }
        });
        // ResourceSpans.scope_spans = 2
        proto::message(resource_spans, 2, |scope_spans| {
            // ScopeSpans.scope = 1; InstrumentationScope.name = 1
            proto::message(scope_spans, 1, |scope| {
                proto::bytes(scope, 1, SCOPE.as_bytes())
            });
            for s in spans {
                // ScopeSpans.spans = 2
                proto::message(scope_spans, 2, |span| {
                    proto::bytes(span, 1, &s.ids.trace_id.to_be_bytes());
                    proto::bytes(span, 2, &s.ids.span_id.to_be_bytes());
                    if let Some(parent) = s.parent {
                        proto::bytes(span, 4, &parent.to_be_bytes());
                    }
                    proto::bytes(span, 5, s.name.as_bytes());
                    proto::uint(span, 6, SPAN_KIND_INTERNAL);
                    proto::fixed64(span, 7, nanos(s.start));
                    proto::fixed64(span, 8, nanos(s.end));
                    for (k, v) in &s.attributes {
                        key_value(span, 9, k, v);
                    }
                });
            }
        });
    });
    out
}

/// Why an export failed, and whether to try it again (after at least how long).
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) why: String,
    pub(crate) again: Option<Duration>,
}

/// How exports reach the collector.
pub(crate) enum Transport {
    Http(reqwest::Client),
    Grpc(crate::grpc::Channel),
}

impl Transport {
    async fn send(&mut self, settings: &ExportSettings, body: &[u8]) -> Result<(), Failure> {
        match self {
            Transport::Http(http) => {
                let content_type = match settings.protocol {
                    Protocol::Json => "application/json",
                    _ => "application/x-protobuf",
                };
                post(http, settings, content_type, body).await
            }
            Transport::Grpc(channel) => channel.export(settings, body).await,
        }
    }
}

/// One export of `body` to the collector: `Ok` once it took it.
async fn post(
    http: &reqwest::Client,
    settings: &ExportSettings,
    content_type: &str,
    body: &[u8],
) -> Result<(), Failure> {
    let mut request = http
        .post(&settings.url)
        .header(reqwest::header::CONTENT_TYPE, content_type);
    for (key, value) in &settings.headers {
        request = request.header(key.as_str(), value.as_str());
    }
    if settings.gzip {
        request = request.header(reqwest::header::CONTENT_ENCODING, "gzip");
    }
    let response = request
        .body(body.to_vec())
        .send()
        .await
        .map_err(|e| Failure {
            // Its URL is the log line's, shown without credentials.
            why: format!("{:#}", e.without_url()),
            // Unreachable, refused, cut off: the collector may be restarting.
            again: Some(Duration::ZERO),
        })?;
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    // OTLP/HTTP's retryable answers; the collector may say when (`Retry-After`, in seconds).
    let retryable = matches!(status.as_u16(), 429 | 502 | 503 | 504);
    let after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let text = response.text().await.unwrap_or_default();
    let text: String = text.chars().filter(|c| !c.is_control()).take(200).collect();
    Err(Failure {
        why: format!("the collector answered {status}: {text}"),
        again: retryable.then(|| after.unwrap_or(Duration::ZERO)),
    })
}

/// Exports one batch's `body`, trying again (backing off) while the collector asks for it and
/// the export's timeout lasts.
async fn export_batch(
    transport: &mut Transport,
    settings: &ExportSettings,
    body: &[u8],
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + settings.timeout;
    let mut pause = Duration::from_millis(250);
    loop {
        let tried = tokio::time::timeout_at(deadline, transport.send(settings, body)).await;
        let failure = match tried {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(failure)) => failure,
            Err(_) => {
                return Err(format!(
                    "no answer within {} ms (OTEL_EXPORTER_OTLP_TIMEOUT)",
                    settings.timeout.as_millis()
                ))
            }
        };
        let Some(asked) = failure.again else {
            return Err(failure.why);
        };
        let wait = asked.max(pause);
        if tokio::time::Instant::now() + wait >= deadline {
            return Err(failure.why);
        }
        tokio::time::sleep(wait).await;
        pause = (pause * 2).min(Duration::from_secs(4));
    }
}

/// Spans the layer could not queue (the exporter behind), counted where both see them.
pub(crate) type Dropped = std::sync::Arc<std::sync::atomic::AtomicU64>;

/// Posts finished spans to the collector in batches, at least twice a second. A failure is
/// logged at warning level the first time and then at each power of two of the batches lost in a
/// row, so a collector that refuses us (a wrong key, a gRPC port) is seen in the service's log
/// without flooding it; spans dropped because the queue was full are said the same way.
/// A request to export every span queued so far at once; answered once that export is done.
pub(crate) type Flush = tokio::sync::oneshot::Sender<()>;

pub(crate) async fn export(
    settings: ExportSettings,
    mut finished: mpsc::Receiver<Finished>,
    dropped: Dropped,
    mut flushes: mpsc::Receiver<Flush>,
) {
    let transport = match settings.protocol {
        Protocol::Grpc => crate::grpc::Channel::new(&settings).map(Transport::Grpc),
        Protocol::Protobuf | Protocol::Json => http_client(&settings).map(Transport::Http),
    };
    let mut transport = match transport {
        Ok(transport) => transport,
        Err(why) => {
            tracing::error!(%why, "cannot export spans; they are not exported");
            return;
        }
    };
    let mut batch = Vec::new();
    let mut failed_in_a_row = 0u64;
    let mut dropped_said = 0u64;
    let mut flushed: Vec<Flush> = Vec::new();
    loop {
        let deadline = tokio::time::sleep(Duration::from_millis(500));
        tokio::pin!(deadline);
        let open = loop {
            tokio::select! {
                next = finished.recv() => match next {
                    Some(span) => {
                        batch.push(span);
                        if batch.len() >= 512 { break true; }
                    }
                    None => break false,
                },
                Some(flush) = flushes.recv() => {
                    while let Ok(span) = finished.try_recv() {
                        batch.push(span);
                    }
                    flushed.push(flush);
                    break true;
                }
                _ = &mut deadline => break true,
            }
        };
        if !batch.is_empty() {
            let mut body = match settings.protocol {
                Protocol::Protobuf | Protocol::Grpc => protobuf_body(&settings.resource, &batch),
                Protocol::Json => json_body(&settings.resource, &batch),
            };
            if settings.gzip {
                body = gzipped(&body);
            }
            let spans = batch.len();
            batch.clear();
            match export_batch(&mut transport, &settings, &body).await {
                Ok(()) => {
                    if failed_in_a_row > 0 {
                        tracing::info!(url = %settings.shown_url(), failed_before = failed_in_a_row, "exporting spans again");
                    }
                    failed_in_a_row = 0;
                }
                Err(why) => {
                    failed_in_a_row += 1;
                    if failed_in_a_row.is_power_of_two() {
                        tracing::warn!(url = %settings.shown_url(), spans, failed_in_a_row, %why, "could not export spans; they are lost");
                    }
                }
            }
        }
        for flush in flushed.drain(..) {
            // One who stopped waiting no longer wants the word.
            let _ = flush.send(());
        }
        let dropped_now = dropped.load(std::sync::atomic::Ordering::Relaxed);
        if dropped_now > dropped_said
            && (dropped_said == 0 || dropped_now.ilog2() > dropped_said.ilog2())
        {
            tracing::warn!(dropped = dropped_now, "spans dropped since the start: the exporter's queue was full (the collector slow or away)");
            dropped_said = dropped_now;
        }
        if !open {
            return;
        }
    }
}

/// The HTTP client of OTLP/HTTP, trusting `settings.certificate`'s CAs too, and showing the
/// client certificate when there is one.
fn http_client(settings: &ExportSettings) -> Result<reqwest::Client, String> {
    let mut http = reqwest::Client::builder();
    if let Some(client) = &settings.client {
        // reqwest takes the key and the certificates as one PEM bundle.
        let mut pem = read_pem(&client.key, "client key")?;
        pem.push(b'\n');
        pem.extend(read_pem(&client.certificate, "client certificate")?);
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| {
            format!(
                "the OTLP client certificate {} and key {}: {e}",
                client.certificate, client.key
            )
        })?;
        http = http.identity(identity);
    }
    if let Some(path) = &settings.certificate {
        let pem = read_pem(path, "CA certificate")?;
        let certificates = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("the OTLP CA certificate file {path}: {e}"))?;
        for certificate in certificates {
            http = http.add_root_certificate(certificate);
        }
    }
    http.build()
        .map_err(|e| format!("the OTLP exporter's HTTP client: {e}"))
}

fn read_pem(path: &str, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("the OTLP {what} file {path}: {e}"))
}

fn gzipped(body: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    // Writing to a Vec cannot fail.
    let _ = encoder.write_all(body);
    encoder.finish().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(vars: &[(&str, &str)]) -> Export {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        settings_from(|name| vars.get(name).cloned(), "agent-orchestrator")
    }

    /// A collector's credentials in its URL (sent as Basic authentication) are not in what the
    /// logs show of the URL, nor in the settings' debug form. Before, every service logged the
    /// URL whole at start ("exporting spans over OTLP").
    #[test]
    fn the_urls_credentials_are_not_shown() {
        let Export::To(s, _) = settings(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "https://team:s3cret@collector.example:4318/v1/traces?key=k3y",
        )]) else {
            panic!("not exported");
        };
        assert!(s.url.contains("s3cret"), "sent as given: {}", s.url);
        assert_eq!(s.shown_url(), "https://collector.example:4318/v1/traces");
        let debug = format!("{s:?}");
        assert!(
            !debug.contains("s3cret") && !debug.contains("k3y"),
            "{debug}"
        );
    }

    #[test]
    fn a_header_that_is_no_http_header_is_left_out_and_said() {
        let Export::To(s, problems) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "bad key=v,x-line=a%0Ab,x-good=ok",
            ),
        ]) else {
            panic!("not exported");
        };
        assert_eq!(s.headers, vec![("x-good".to_owned(), "ok".to_owned())]);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("2 entries") && p.contains("not HTTP headers")),
            "{problems:?}"
        );
    }

    #[test]
    fn the_standard_variables_set_the_endpoint_protocol_headers_and_resource() {
        assert_eq!(settings(&[]), Export::Off);
        assert_eq!(
            settings(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
                ("OTEL_SDK_DISABLED", "true")
            ]),
            Export::Off
        );
        let Export::To(s, problems) =
            settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318/")])
        else {
            panic!("not exported");
        };
        assert!(problems.is_empty());
        assert_eq!(s.url, "http://c:4318/v1/traces");
        assert_eq!(s.protocol, Protocol::Protobuf, "the spec's default");
        assert_eq!(s.timeout, DEFAULT_TIMEOUT);
        assert_eq!(
            s.resource,
            vec![("service.name".to_owned(), "agent-orchestrator".to_owned())]
        );

        let Export::To(s, problems) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://t.example/otlp/traces",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "x-key=a%3Db , Authorization=Basic%20xyz, broken",
            ),
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "X-KEY=traces"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "deployment.environment=prod,service.name=from-attrs",
            ),
        ]) else {
            panic!("not exported");
        };
        assert_eq!(
            s.url, "https://t.example/otlp/traces",
            "the signal's own, as is"
        );
        assert_eq!(s.protocol, Protocol::Json);
        assert_eq!(
            s.headers,
            vec![
                ("Authorization".to_owned(), "Basic xyz".to_owned()),
                ("X-KEY".to_owned(), "traces".to_owned()),
            ]
        );
        assert!(s.gzip);
        assert_eq!(s.timeout, Duration::from_millis(2500));
        assert_eq!(
            s.resource,
            vec![
                ("service.name".to_owned(), "from-attrs".to_owned()),
                ("deployment.environment".to_owned(), "prod".to_owned()),
            ]
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("OTEL_EXPORTER_OTLP_HEADERS"));
        assert!(
            !format!("{s:?}").contains("Basic xyz"),
            "a key is never shown"
        );

        let Export::To(s, _) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_SERVICE_NAME", "agents-eu"),
            ("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs"),
        ]) else {
            panic!("not exported");
        };
        assert_eq!(s.resource[0].1, "agents-eu", "OTEL_SERVICE_NAME wins");

        let Export::To(s, problems) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318"),
            ("OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "/all/client.pem"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
                "/traces/client.pem",
            ),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/all/client.key"),
        ]) else {
            panic!("not exported");
        };
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(
            s.client,
            Some(ClientIdentity {
                certificate: "/traces/client.pem".into(),
                key: "/all/client.key".into(),
            })
        );
        let Export::To(s, problems) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4318"),
            ("OTEL_EXPORTER_OTLP_CLIENT_KEY", "/all/client.key"),
        ]) else {
            panic!("not exported");
        };
        assert_eq!(s.client, None);
        assert!(problems[0].contains("go together"), "{problems:?}");
    }

    #[test]
    fn what_cannot_be_exported_is_refused_with_a_reason() {
        let Export::To(s, _) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]) else {
            panic!("grpc refused");
        };
        assert_eq!(
            s.url, "http://c:4317",
            "gRPC's endpoint is the collector alone"
        );
        assert_eq!(s.protocol, Protocol::Grpc);
        assert!(matches!(
            settings(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "thrift")
            ]),
            Export::Refused(_)
        ));
        assert!(matches!(
            settings(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "c:4318")]),
            Export::Refused(_)
        ));
        let Export::To(s, problems) = settings(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4318"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "soon"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "brotli"),
        ]) else {
            panic!("not exported");
        };
        assert_eq!((s.timeout, s.gzip), (DEFAULT_TIMEOUT, false));
        assert_eq!(problems.len(), 2, "{problems:?}");
    }

    #[test]
    fn percent_encoded_values_decode_and_bad_escapes_are_refused() {
        assert_eq!(
            key_values("a=1,b=x%2Cy%20z, c = 3 "),
            (
                vec![
                    ("a".into(), "1".into()),
                    ("b".into(), "x,y z".into()),
                    ("c".into(), "3".into())
                ],
                0
            )
        );
        assert_eq!(key_values("a=%G1,=b,c").1, 3);
    }

    #[test]
    fn varints_are_little_endian_groups_of_seven_bits() {
        let mut out = Vec::new();
        proto::varint(&mut out, 300);
        assert_eq!(out, [0xac, 0x02]);
        out.clear();
        proto::varint(&mut out, u64::MAX);
        assert_eq!(out.len(), 10);
    }

    /// A minimal reader of the wire form, enough to walk the body back.
    fn fields(mut buf: &[u8]) -> Vec<(u64, Vec<u8>)> {
        fn varint(buf: &mut &[u8]) -> u64 {
            let mut value = 0u64;
            let mut shift = 0;
            loop {
                let byte = buf[0];
                *buf = &buf[1..];
                value |= u64::from(byte & 0x7f) << shift;
                if byte < 0x80 {
                    return value;
                }
                shift += 7;
            }
        }
        let mut out = Vec::new();
        while !buf.is_empty() {
            let tag = varint(&mut buf);
            let value = match tag & 7 {
                0 => varint(&mut buf).to_le_bytes().to_vec(),
                1 => {
                    let v = buf[..8].to_vec();
                    buf = &buf[8..];
                    v
                }
                2 => {
                    let len = varint(&mut buf) as usize;
                    let v = buf[..len].to_vec();
                    buf = &buf[len..];
                    v
                }
                other => panic!("wire type {other}"),
            };
            out.push((tag >> 3, value));
        }
        out
    }

    #[test]
    fn a_span_is_written_at_otlps_field_numbers() {
        let start = UNIX_EPOCH + Duration::from_nanos(1_700_000_000_000_000_001);
        let span = Finished {
            name: "iteration",
            ids: crate::trace::SpanIds {
                trace_id: 0x0102030405060708090a0b0c0d0e0f10,
                span_id: 0x1112131415161718,
            },
            parent: Some(0x2122232425262728),
            start,
            end: start + Duration::from_nanos(5),
            attributes: vec![("session".into(), "s-1".into())],
        };
        let body = protobuf_body(&[("service.name".into(), "svc".into())], &[span]);
        let request = fields(&body);
        assert_eq!(request.len(), 1);
        assert_eq!(request[0].0, 1);
        let resource_spans = fields(&request[0].1);
        let resource = fields(&resource_spans[0].1);
        let kv = fields(&resource[0].1);
        assert_eq!(kv[0], (1, b"service.name".to_vec()));
        assert_eq!(fields(&kv[1].1)[0], (1, b"svc".to_vec()));
        let scope_spans = fields(&resource_spans[1].1);
        assert_eq!(fields(&scope_spans[0].1)[0], (1, SCOPE.as_bytes().to_vec()));
        let span = fields(&scope_spans[1].1);
        let field = |n: u64| span.iter().find(|(f, _)| *f == n).map(|(_, v)| v.clone());
        assert_eq!(field(1).unwrap(), (1u8..=16).collect::<Vec<u8>>());
        assert_eq!(field(2).unwrap(), (0x11u8..=0x18).collect::<Vec<u8>>());
        assert_eq!(field(4).unwrap(), (0x21u8..=0x28).collect::<Vec<u8>>());
        assert_eq!(field(5).unwrap(), b"iteration");
        assert_eq!(field(6).unwrap()[0], 1);
        assert_eq!(
            u64::from_le_bytes(field(7).unwrap().try_into().unwrap()),
            1_700_000_000_000_000_001
        );
        assert_eq!(
            u64::from_le_bytes(field(8).unwrap().try_into().unwrap()),
            1_700_000_000_000_000_006
        );
        let attribute = fields(&field(9).unwrap());
        assert_eq!(attribute[0], (1, b"session".to_vec()));
    }

    /// A collector on loopback that answers each connection with the next of `answers` (a
    /// status line and headers), and the requests it read.
    async fn collector(
        answers: Vec<&'static str>,
    ) -> (String, tokio::task::JoinHandle<Vec<String>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/traces", listener.local_addr().unwrap());
        let served = tokio::spawn(async move {
            let mut requests = Vec::new();
            for answer in answers {
                let (mut socket, _) = listener.accept().await.unwrap();
                let mut read = Vec::new();
                let mut buf = [0u8; 4096];
                // Headers and the short bodies these tests send arrive before the answer goes.
                loop {
                    let n = socket.read(&mut buf).await.unwrap();
                    read.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&read);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap())
                            })
                            .unwrap_or(0);
                        if read.len() >= end + 4 + length {
                            break;
                        }
                    }
                }
                requests.push(String::from_utf8_lossy(&read).into_owned());
                let reply = format!("{answer}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nno");
                socket.write_all(reply.as_bytes()).await.unwrap();
            }
            requests
        });
        (url, served)
    }

    fn to(url: &str, timeout: Duration) -> ExportSettings {
        ExportSettings {
            url: url.to_owned(),
            protocol: Protocol::Json,
            headers: vec![("x-api-key".into(), "k".into())],
            gzip: false,
            timeout,
            certificate: None,
            client: None,
            resource: Vec::new(),
        }
    }

    #[tokio::test]
    async fn an_export_the_collector_asks_to_retry_is_sent_again_and_a_refusal_is_not() {
        let (url, served) = collector(vec![
            "HTTP/1.1 503 Service Unavailable",
            "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 0",
            "HTTP/1.1 200 OK",
        ])
        .await;
        let mut http = Transport::Http(reqwest::Client::new());
        let settings = to(&url, Duration::from_secs(20));
        export_batch(&mut http, &settings, b"{}").await.unwrap();
        let requests = served.await.unwrap();
        assert_eq!(requests.len(), 3);
        assert!(
            requests.iter().all(|r| r.contains("x-api-key: k")),
            "{requests:?}"
        );

        let (url, served) = collector(vec!["HTTP/1.1 401 Unauthorized"]).await;
        let why = export_batch(&mut http, &to(&url, Duration::from_secs(20)), b"{}")
            .await
            .unwrap_err();
        assert!(why.contains("401"), "{why}");
        assert_eq!(
            served.await.unwrap().len(),
            1,
            "a refusal is not sent again"
        );
    }

    /// A flush exports what is queued at once, and says so when the collector has it: a service
    /// stopping flushes its last spans, which waited for the next half-second tick and were lost
    /// with the process.
    #[tokio::test]
    async fn a_flush_exports_the_queued_spans_at_once() {
        let (url, served) = collector(vec!["HTTP/1.1 200 OK"]).await;
        let (spans, finished) = mpsc::channel(16);
        let (flush, flushes) = mpsc::channel(1);
        let exporter = tokio::spawn(export(
            to(&url, Duration::from_secs(20)),
            finished,
            Dropped::default(),
            flushes,
        ));
        let start = SystemTime::now();
        // Past the first tick, so that only the flush sends it before the next.
        tokio::time::sleep(Duration::from_millis(600)).await;
        spans
            .send(Finished {
                name: "the-last-span",
                ids: crate::trace::SpanIds {
                    trace_id: 1,
                    span_id: 2,
                },
                parent: None,
                start,
                end: start,
                attributes: Vec::new(),
            })
            .await
            .unwrap();
        let (done, exported) = tokio::sync::oneshot::channel();
        flush.send(done).await.unwrap();
        tokio::time::timeout(Duration::from_millis(400), exported)
            .await
            .expect("the flush waited for the tick")
            .unwrap();
        let requests = tokio::time::timeout(Duration::from_millis(100), served)
            .await
            .expect("the collector did not have it when the flush said so")
            .unwrap();
        assert!(requests[0].contains("the-last-span"), "{requests:?}");
        exporter.abort();
    }

    #[tokio::test]
    async fn a_retry_asked_for_past_the_exports_timeout_is_not_waited_for() {
        let (url, served) =
            collector(vec!["HTTP/1.1 503 Service Unavailable\r\nRetry-After: 30"]).await;
        let mut http = Transport::Http(reqwest::Client::new());
        let why = export_batch(&mut http, &to(&url, Duration::from_secs(2)), b"{}")
            .await
            .unwrap_err();
        // Waiting the 30 s asked for, it would have found the collector gone (its one answer
        // given) and failed on that instead.
        assert!(why.contains("503"), "{why}");
        assert_eq!(served.await.unwrap().len(), 1);
    }
}
