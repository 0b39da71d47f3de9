//! config-svc end to end on a real broker: the REST API and its token, TrustGraph's config
//! protocol over Pulsar, change pushes, seeding, and durability across a SIGKILL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::{Bus, ConfigClient, ConfigPushes, Topics};
use agent_e2e::{seed_dir, Broker, ConfigSvc};
use agent_schema::{operation, ConfigKey, ConfigRequest};
use serde_json::{json, Value};

const ANSWER: Duration = Duration::from_secs(10);

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

    let seeded: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
    assert!(seeded["max_iterations"].is_number(), "{seeded}");
    let version = |v: &Value| v["version"].as_u64().unwrap();
    let before: Value = http
        .get(format!("{}/api/v1/config", svc.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();

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
    let after: Value = http
        .get(format!("{}/api/v1/config", svc.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
    let kept: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(kept, changed);
    let all: Value = http
        .get(format!("{}/api/v1/config", svc.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
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
