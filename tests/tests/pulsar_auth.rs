//! Token authentication for real: Apache Pulsar's standalone broker with JWT authentication and
//! authorization on. The orchestrator, given its token (`PULSAR_TOKEN`), serves a dialog; a client
//! without a token cannot connect, and one whose role was granted nothing cannot publish a request.
//! Always on Apache Pulsar (pulsar-lite has no authentication).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::{AgentClient, Bus, Publisher, Topics};
use agent_e2e::apache::{ApacheBroker, TokenAuth};
use agent_e2e::*;

#[tokio::test]
async fn services_with_the_token_work_and_clients_without_it_are_refused() {
    let auth = TokenAuth::new();
    let broker = ApacheBroker::start(0, Some(auth.clone())).unwrap();
    let token = broker.admin_token().unwrap();
    let llm = scripted_llm(
        r#"{"rules": [{"match": "Question: ping", "reply": "Thought: easy\nFinal Answer: pong"}]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn_on_url(
        &broker.url(),
        &llm,
        &seed_dir(),
        &[],
        &[("PULSAR_TOKEN", token.as_str())],
    );
    let topics = Topics::trustgraph("default", "default");

    // The services' token works end to end.
    let bus = Bus::connect(&broker.url(), Some(&token)).await.unwrap();
    let mut client = AgentClient::connect(&bus, &topics).await.unwrap();
    client
        .send("auth-1", &request("ping", false))
        .await
        .unwrap();
    let responses = collect_dialog(&mut client, "auth-1", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(responses.last().unwrap().content, "pong");

    // No token: the broker refuses the connection (or its first use).
    let anonymous = match Bus::connect(&broker.url(), None).await {
        Ok(bus) => Publisher::new(&bus, &topics.request).await.err(),
        Err(e) => Some(e),
    };
    let refusal = anonymous.expect("a client without a token was let in");
    println!("without a token: {refusal}");

    // A valid token for a role that was granted nothing: authenticated, not authorized.
    let stranger = Bus::connect(&broker.url(), Some(&auth.token("stranger")))
        .await
        .unwrap();
    let refused = Publisher::new(&stranger, &topics.request).await;
    let refusal = refused
        .err()
        .expect("a role without permissions may publish");
    assert!(
        refusal.to_string().to_lowercase().contains("authoriz"),
        "{refusal}"
    );
    // A token signed with another key is refused too.
    let forged = TokenAuth::new().token("admin");
    let forged = match Bus::connect(&broker.url(), Some(&forged)).await {
        Ok(bus) => Publisher::new(&bus, &topics.request).await.err(),
        Err(e) => Some(e),
    };
    assert!(
        forged.is_some(),
        "a token signed with another key was accepted"
    );
}
