//! TLS to the broker for real: Apache Pulsar's standalone broker serving `pulsar+ssl://` with a
//! certificate from a private CA. The orchestrator, given the CA (`PULSAR_TLS_CA_FILE`), serves a
//! dialog over TLS; a client that does not trust the CA is refused at the handshake, as is one
//! that reaches the broker by a name its certificate does not carry. Always on Apache Pulsar
//! (pulsar-lite has no TLS).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use agent_bus::{AgentClient, Bus, Topics};
use agent_e2e::apache::ApacheBroker;
use agent_e2e::*;

/// A private CA and a broker certificate it signed for `127.0.0.1`, made with the `openssl` tool.
struct Certificates {
    ca: PathBuf,
    broker_certificate: PathBuf,
    broker_key: PathBuf,
}

fn certificates(dir: &Path) -> Certificates {
    let ca = PrivateCa::new(dir);
    let (broker_certificate, broker_key) = ca.issue(
        "broker",
        "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
    );
    Certificates {
        ca: ca.certificate(),
        broker_certificate,
        broker_key,
    }
}

#[tokio::test]
async fn services_given_the_ca_work_over_tls_and_clients_without_it_are_refused() {
    let dir = std::env::temp_dir().join(format!("pulsar-tls-{}", std::process::id()));
    let certs = certificates(&dir);
    let tls_port = agent_bus::embedded::free_port().unwrap();
    let broker = ApacheBroker::start_with(
        0,
        None,
        &[
            format!("brokerServicePortTls={tls_port}"),
            format!(
                "tlsCertificateFilePath={}",
                certs.broker_certificate.display()
            ),
            format!("tlsKeyFilePath={}", certs.broker_key.display()),
            format!("tlsTrustCertsFilePath={}", certs.ca.display()),
        ],
    )
    .unwrap();
    let tls_url = format!("pulsar+ssl://127.0.0.1:{tls_port}");
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: ping", "reply": "Thought: easy\nFinal Answer: pong"}]}"#,
    )
    .await;
    let ca = certs.ca.display().to_string();
    let _orchestrator = Orchestrator::spawn_on_url(
        &tls_url,
        &llm,
        &seed_dir(),
        &[],
        &[("PULSAR_TLS_CA_FILE", ca.as_str())],
    );
    let topics = Topics::trustgraph("default", "default");

    // The whole dialog travels over TLS: the client's request, the orchestrator's consumer and
    // producers (their lookups answer with the broker's TLS address), the streamed response.
    let bus = Bus::connect_tls(&tls_url, None, Some(&certs.ca))
        .await
        .unwrap();
    let mut client = AgentClient::connect(&bus, &topics).await.unwrap();
    client.send("tls-1", &request("ping", false)).await.unwrap();
    let responses = collect_dialog(&mut client, "tls-1", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, "pong");

    // Without the CA, only the public roots are trusted: the handshake fails, at once (a
    // certificate error is not retried). The same broker, port and client with the CA worked
    // above, so what is refused here is the certificate.
    let untrusted = tokio::time::timeout(Duration::from_secs(30), Bus::connect(&tls_url, None))
        .await
        .expect("a refused handshake returns within 30 s");
    let refusal = untrusted.err().expect("a client without the CA was let in");
    println!("without the CA: {refusal}");

    // The CA is trusted, but the certificate is for 127.0.0.1, not for `localhost`.
    let misnamed = tokio::time::timeout(
        Duration::from_secs(30),
        Bus::connect_tls(
            &format!("pulsar+ssl://localhost:{tls_port}"),
            None,
            Some(&certs.ca),
        ),
    )
    .await
    .expect("a refused handshake returns within 30 s");
    let refusal = misnamed
        .err()
        .expect("a certificate for another name was accepted");
    println!("by another name: {refusal}");
    drop(broker);
    let _ = std::fs::remove_dir_all(&dir);
}
