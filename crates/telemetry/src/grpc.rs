//! OTLP over gRPC: the trace service's one unary call (`TraceService/Export`) on an HTTP/2
//! connection of our own, cleartext (`http://`, as a collector's `:4317` usually listens) or TLS
//! (`https://`, ALPN `h2`), kept open between exports and opened again after a failure. A small
//! client of our own rather than tonic: one call, one message type, already written by hand.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http2::SendRequest;
use tokio_rustls::rustls;

use crate::otlp::{ExportSettings, Failure};

/// The method OTLP's trace service is called at.
const EXPORT_PATH: &str = "/opentelemetry.proto.collector.trace.v1.TraceService/Export";
/// An answer is a count of rejected spans and a message: far less than this.
const MAX_ANSWER_BYTES: usize = 1024 * 1024;

/// A channel to one collector.
pub(crate) struct Channel {
    scheme: String,
    host: String,
    port: u16,
    tls: Option<tokio_rustls::TlsConnector>,
    open: Option<SendRequest<Full<Bytes>>>,
}

impl Channel {
    /// A channel to the collector at `settings.url` (`http(s)://host[:port]`, 4317 by default);
    /// not connected until the first export.
    pub(crate) fn new(settings: &ExportSettings) -> Result<Channel, String> {
        let url = reqwest::Url::parse(&settings.url)
            .map_err(|e| format!("the OTLP endpoint {} is not a URL: {e}", settings.url))?;
        let host = url
            .host_str()
            .ok_or_else(|| format!("the OTLP endpoint {} names no host", settings.url))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let tls = match url.scheme() {
            "https" => Some(tls_connector(settings)?),
            _ => None,
        };
        Ok(Channel {
            scheme: url.scheme().to_owned(),
            host,
            port: port_of(&settings.url, &url),
            tls,
            open: None,
        })
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>, String> {
        let tcp = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
            .await
            .map_err(|e| format!("connecting to {}:{}: {e}", self.host, self.port))?;
        let _ = tcp.set_nodelay(true);
        let executor = hyper_util::rt::TokioExecutor::new();
        match &self.tls {
            None => {
                let (sender, connection) = hyper::client::conn::http2::handshake(
                    executor,
                    hyper_util::rt::TokioIo::new(tcp),
                )
                .await
                .map_err(|e| format!("HTTP/2 with {}:{}: {e}", self.host, self.port))?;
                tokio::spawn(connection);
                Ok(sender)
            }
            Some(tls) => {
                let name = rustls::pki_types::ServerName::try_from(self.host.clone())
                    .map_err(|e| format!("{} as a TLS server name: {e}", self.host))?;
                let stream = tls
                    .connect(name, tcp)
                    .await
                    .map_err(|e| format!("TLS with {}:{}: {e}", self.host, self.port))?;
                let (sender, connection) = hyper::client::conn::http2::handshake(
                    executor,
                    hyper_util::rt::TokioIo::new(stream),
                )
                .await
                .map_err(|e| format!("HTTP/2 with {}:{}: {e}", self.host, self.port))?;
                tokio::spawn(connection);
                Ok(sender)
            }
        }
    }

    /// One `Export` call carrying `message` (an `ExportTraceServiceRequest`, gzipped when
    /// `settings.gzip`), on the open connection or a new one.
    pub(crate) async fn export(
        &mut self,
        settings: &ExportSettings,
        message: &[u8],
    ) -> Result<(), Failure> {
        let mut sender = match self.open.take() {
            Some(sender) if !sender.is_closed() => sender,
            _ => self.connect().await.map_err(|why| Failure {
                why,
                // Unreachable or refused: the collector may be restarting.
                again: Some(Duration::ZERO),
            })?,
        };
        let answer = call(&mut sender, self, settings, message).await;
        // A connection still open serves the next call, whatever this one's answer.
        if !sender.is_closed() {
            self.open = Some(sender);
        }
        answer
    }
}

async fn call(
    sender: &mut SendRequest<Full<Bytes>>,
    channel: &Channel,
    settings: &ExportSettings,
    message: &[u8],
) -> Result<(), Failure> {
    let lost = |why: String| Failure {
        why,
        again: Some(Duration::ZERO),
    };
    // gRPC's length-prefixed message: compressed or not, then its length, big-endian.
    let mut framed = Vec::with_capacity(message.len() + 5);
    framed.push(u8::from(settings.gzip));
    framed.extend_from_slice(
        &u32::try_from(message.len())
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    framed.extend_from_slice(message);
    let authority = if channel.host.contains(':') {
        format!("[{}]:{}", channel.host, channel.port)
    } else {
        format!("{}:{}", channel.host, channel.port)
    };
    let mut request =
        hyper::Request::post(format!("{}://{authority}{EXPORT_PATH}", channel.scheme))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header(
                "grpc-timeout",
                format!("{}m", settings.timeout.as_millis().max(1)),
            );
    if settings.gzip {
        request = request.header("grpc-encoding", "gzip");
    }
    for (key, value) in &settings.headers {
        // gRPC metadata keys are lower case.
        request = request.header(key.to_ascii_lowercase(), value.as_str());
    }
    let request = request
        .body(Full::new(Bytes::from(framed)))
        .map_err(|e| Failure {
            why: format!("an export request: {e}"),
            again: None,
        })?;
    sender
        .ready()
        .await
        .map_err(|e| lost(format!("the connection: {e}")))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| lost(format!("the call: {e}")))?;
    let (head, body) = response.into_parts();
    if head.status != hyper::StatusCode::OK {
        // Not gRPC's answer: a proxy's, or an HTTP server that is not a collector.
        return Err(Failure {
            why: format!("the collector answered HTTP {}", head.status),
            again: matches!(head.status.as_u16(), 429 | 502 | 503 | 504).then_some(Duration::ZERO),
        });
    }
    let collected = Limited::new(body, MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| lost(format!("the answer: {e}")))?;
    let trailers = collected.trailers().cloned();
    // The status comes in the trailers, or in the headers of an answer that is only trailers.
    let field = |name: &str| {
        trailers
            .as_ref()
            .and_then(|t| t.get(name))
            .or_else(|| head.headers.get(name))
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let Some(status) = field("grpc-status") else {
        return Err(lost("an answer without a gRPC status".to_owned()));
    };
    let code = status.trim().parse::<u32>().unwrap_or(2);
    if code == 0 {
        return Ok(());
    }
    let message = field("grpc-message")
        .map(|m| percent_decoded(&m))
        .unwrap_or_default();
    let message: String = message
        .chars()
        .filter(|c| !c.is_control())
        .take(200)
        .collect();
    Err(Failure {
        why: format!(
            "the collector answered gRPC status {code} ({}): {message}",
            code_name(code)
        ),
        // The codes OTLP says to try again on.
        again: matches!(code, 1 | 4 | 8 | 10 | 11 | 14 | 15).then_some(Duration::ZERO),
    })
}

fn code_name(code: u32) -> &'static str {
    match code {
        1 => "CANCELLED",
        2 => "UNKNOWN",
        3 => "INVALID_ARGUMENT",
        4 => "DEADLINE_EXCEEDED",
        5 => "NOT_FOUND",
        7 => "PERMISSION_DENIED",
        8 => "RESOURCE_EXHAUSTED",
        10 => "ABORTED",
        11 => "OUT_OF_RANGE",
        12 => "UNIMPLEMENTED",
        13 => "INTERNAL",
        14 => "UNAVAILABLE",
        15 => "DATA_LOSS",
        16 => "UNAUTHENTICATED",
        _ => "other",
    }
}

/// `grpc-message` is percent-encoded; what does not decode is shown as it came.
fn percent_decoded(text: &str) -> String {
    // Whole: read as a list, a message with a comma lost what came before it.
    crate::otlp::percent_decoded(text).unwrap_or_else(|| text.to_owned())
}

/// The port `written` names, or OTLP's gRPC port (4317) where it names none. The parsed `url`
/// drops a port that is its scheme's default: `https://collector:443` would otherwise be dialled
/// at 4317, and every span lost.
fn port_of(written: &str, url: &reqwest::Url) -> u16 {
    let authority = written
        .split_once("://")
        .map_or(written, |(_, rest)| rest)
        .split(['/', '?', '#'])
        .next()
        .unwrap_or_default();
    let host_and_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    // After an IPv6 address's closing bracket, or anywhere in a name.
    let after_host = host_and_port
        .rsplit_once(']')
        .map_or(host_and_port, |(_, p)| p);
    match after_host.contains(':') {
        true => url.port_or_known_default().unwrap_or(4317),
        false => 4317,
    }
}

/// TLS to a collector: the public CAs (as `reqwest` trusts them) and those of the settings'
/// `certificate`, a PEM file; the client certificate shown when there is one; HTTP/2 asked for
/// by ALPN.
fn tls_connector(settings: &ExportSettings) -> Result<tokio_rustls::TlsConnector, String> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = &settings.certificate {
        let certificates = rustls::pki_types::CertificateDer::pem_file_iter(path)
            .map_err(|e| format!("the OTLP CA certificate file {path}: {e}"))?;
        for certificate in certificates {
            let certificate =
                certificate.map_err(|e| format!("the OTLP CA certificate file {path}: {e}"))?;
            roots
                .add(certificate)
                .map_err(|e| format!("a certificate of {path}: {e}"))?;
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| format!("TLS settings: {e}"))?
    .with_root_certificates(roots);
    let mut config = match &settings.client {
        None => config.with_no_client_auth(),
        Some(client) => {
            let (path, key_path) = (&client.certificate, &client.key);
            let chain = rustls::pki_types::CertificateDer::pem_file_iter(path)
                .and_then(|certificates| certificates.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("the OTLP client certificate file {path}: {e}"))?;
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(key_path)
                .map_err(|e| format!("the OTLP client key file {key_path}: {e}"))?;
            config.with_client_auth_cert(chain, key).map_err(|e| {
                format!("the OTLP client certificate {path} and key {key_path}: {e}")
            })?
        }
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(written: &str) -> u16 {
        port_of(written, &reqwest::Url::parse(written).unwrap())
    }

    #[test]
    fn a_collectors_message_is_decoded_whole() {
        assert_eq!(
            percent_decoded("invalid key, see docs"),
            "invalid key, see docs"
        );
        assert_eq!(percent_decoded("bad, x=y%20z"), "bad, x=y z");
    }

    #[test]
    fn a_port_written_is_the_port_dialled_even_the_schemes_own() {
        assert_eq!(port("https://collector.example:443"), 443);
        assert_eq!(port("http://collector.example:80/v1/traces"), 80);
        assert_eq!(port("https://collector.example:4318"), 4318);
        assert_eq!(port("https://user:secret@collector.example:443"), 443);
        assert_eq!(port("http://[::1]:443"), 443);
        // None written: OTLP's gRPC port.
        assert_eq!(port("https://collector.example"), 4317);
        assert_eq!(port("http://[::1]/v1/traces"), 4317);
        assert_eq!(port("https://user:secret@collector.example"), 4317);
    }
}
