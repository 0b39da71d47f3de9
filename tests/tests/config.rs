//! config-svc end to end on a real broker: the REST API and its token, TrustGraph's config
//! protocol over Pulsar, change pushes, seeding, and durability across a SIGKILL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::{Bus, ConfigClient, ConfigPushes, Topics};
use agent_e2e::{
    client, collect_dialog, request as agent_request, scripted_llm, seed_dir, Broker, ConfigSvc,
    Orchestrator,
};
use agent_schema::{operation, ConfigKey, ConfigRequest};
use serde_json::{json, Value};

const ANSWER: Duration = Duration::from_secs(10);

async fn get_json(http: &reqwest::Client, url: &str) -> Value {
    http.get(url).send().await.unwrap().json().await.unwrap()
}

fn request(op: &str) -> ConfigRequest {
    ConfigRequest {
        operation: op.into(),
        ..ConfigRequest::default()
    }
}

#[tokio::test]
async fn rest_writes_need_the_token_survive_a_kill_and_are_pushed() {
    let broker = Broker::start().unwrap();
    let mut svc = ConfigSvc::spawn(&broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    let url = format!("{}/api/v1/config/agent-limits/default", svc.url);

    let seeded: Value = get_json(&http, &url).await;
    assert!(seeded["max_iterations"].is_number(), "{seeded}");
    let version = |v: &Value| v["version"].as_u64().unwrap();
    let before: Value = get_json(&http, &format!("{}/api/v1/config", svc.url)).await;

    // Without the token, or with a wrong one: 401 and nothing changes.
    let changed = json!({"max_iterations": 3});
    let refused = http.put(&url).json(&changed).send().await.unwrap();
    assert_eq!(refused.status(), 401);
    let wrong = http
        .put(&url)
        .bearer_auth("not-the-token")
        .json(&changed)
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    let deleted = http.delete(&url).send().await.unwrap();
    assert_eq!(deleted.status(), 401);
    let after: Value = get_json(&http, &format!("{}/api/v1/config", svc.url)).await;
    assert_eq!(before, after);

    // Not JSON: refused.
    let bad = http
        .put(&url)
        .bearer_auth(&svc.token)
        .body("{max_iterations: 3")
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);

    // With the token: written, versioned, pushed.
    let ok = http
        .put(&url)
        .bearer_auth(&svc.token)
        .json(&changed)
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let written: Value = ok.json().await.unwrap();
    assert_eq!(version(&written), version(&before) + 1);
    let push = tokio::time::timeout(ANSWER, pushes.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(push.version, version(&written));
    assert_eq!(push.changes["agent-limits"], vec!["default"]);

    // SIGKILL straight after the acknowledged write; a restart with the seed again keeps it.
    svc.kill_and_restart();
    // The old client's pooled connection died with the process.
    let http = reqwest::Client::new();
    let kept: Value = get_json(&http, &url).await;
    assert_eq!(kept, changed);
    let all: Value = get_json(&http, &format!("{}/api/v1/config", svc.url)).await;
    assert_eq!(version(&all), version(&written));
}

#[tokio::test]
async fn the_trustgraph_protocol_over_pulsar() {
    let broker = Broker::start().unwrap();
    let _svc = ConfigSvc::spawn(&broker, None);
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();

    let empty = client
        .call(&request(operation::CONFIG), ANSWER)
        .await
        .unwrap();
    assert_eq!(empty.version, Some(0));
    assert_eq!(empty.error, None);

    let mut put = request(operation::PUT);
    put.values = vec![
        agent_schema::ConfigValue {
            kind: "tool".into(),
            key: "calc".into(),
            value: r#"{"name":"calc","description":"adds","type":"text-completion"}"#.into(),
            workspace: None,
        },
        agent_schema::ConfigValue {
            kind: "tool".into(),
            key: "llm".into(),
            value: r#"{"name":"llm","description":"asks","type":"text-completion"}"#.into(),
            workspace: None,
        },
    ];
    let written = client.call(&put, ANSWER).await.unwrap();
    assert_eq!(written.error, None);
    assert_eq!(written.version, Some(1));
    let push = tokio::time::timeout(ANSWER, pushes.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(push.changes["tool"], vec!["default"]);

    let mut list = request(operation::LIST);
    list.kind = Some("tool".into());
    let listed = client.call(&list, ANSWER).await.unwrap();
    assert_eq!(listed.directory, Some(vec!["calc".into(), "llm".into()]));

    let mut get = request(operation::GET);
    get.keys = vec![ConfigKey {
        kind: "tool".into(),
        key: "calc".into(),
    }];
    let got = client.call(&get, ANSWER).await.unwrap();
    assert!(got.values.unwrap()[0].value.contains("adds"));

    let mut values = request(operation::GET_VALUES);
    values.kind = Some("tool".into());
    assert_eq!(
        client
            .call(&values, ANSWER)
            .await
            .unwrap()
            .values
            .unwrap()
            .len(),
        2
    );

    let mut delete = request(operation::DELETE);
    delete.keys = get.keys.clone();
    assert_eq!(client.call(&delete, ANSWER).await.unwrap().version, Some(2));
    let missing = client.call(&get, ANSWER).await.unwrap();
    assert_eq!(missing.error.unwrap().message, "key not found: tool/calc");

    // A request that makes no sense is answered with an error, and the service goes on.
    let nonsense = client
        .call(&request("drop-everything"), ANSWER)
        .await
        .unwrap();
    assert!(nonsense.error.is_some());
    let all = client
        .call(&request(operation::CONFIG), ANSWER)
        .await
        .unwrap();
    assert_eq!(all.version, Some(2));
    assert!(all.config.unwrap()["tool"].contains_key("llm"));
}

/// Sends `question` as dialog `id` and returns the error it ended with, if any.
async fn dialog_error(
    client: &mut agent_bus::AgentClient,
    id: &str,
    question: &str,
) -> Option<String> {
    client
        .send(id, &agent_request(question, false))
        .await
        .unwrap();
    let responses = collect_dialog(client, id, Duration::from_secs(30))
        .await
        .unwrap();
    responses
        .iter()
        .find_map(|r| r.error.as_ref().map(|e| e.message.clone()))
}

/// The orchestrator follows the config service: a change through the REST API applies to the next
/// request without a restart, and an invalid config is refused while the last good one stays.
#[tokio::test]
async fn the_orchestrator_applies_config_changes_without_a_restart() {
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::spawn(&broker, Some(&seed_dir()));
    let llm = scripted_llm(
        r#"{"rules": [{"match": "", "reply": "Thought: easy.\nFinal Answer: done"}]}"#,
    )
    .await;
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let question = "Is this question longer than forty bytes? It is.";
    assert_eq!(dialog_error(&mut client, "before", question).await, None);

    let http = reqwest::Client::new();
    let limits = format!("{}/api/v1/config/agent-limits/default", svc.url);
    let small = json!({"max_question_bytes": 40});
    let put = http
        .put(&limits)
        .bearer_auth(&svc.token)
        .json(&small)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let mut refused = None;
    for attempt in 0..50 {
        refused = dialog_error(&mut client, &format!("after-{attempt}"), question).await;
        if refused.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let refused = refused.expect("the new limit never applied");
    assert!(refused.contains("40"), "{refused}");

    // Invalid (max_iterations 0): refused by the orchestrator, the previous limits stay.
    let invalid = json!({"max_question_bytes": 4000, "max_iterations": 0});
    let put = http
        .put(&limits)
        .bearer_auth(&svc.token)
        .json(&invalid)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = dialog_error(&mut client, "after-invalid", question).await;
    assert!(
        still.is_some_and(|e| e.contains("40")),
        "the invalid config was applied"
    );
}
