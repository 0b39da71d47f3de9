//! config-svc end to end on a real broker: the REST API and its token, TrustGraph's config
//! protocol over Pulsar, change pushes, seeding, and durability across a SIGKILL.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::Duration;

use agent_bus::{Bus, ConfigClient, ConfigPushes, Topics};
use agent_config_files as seed;
use agent_e2e::{
    binary, client, collect_dialog, config_dir, installed_path, repo_root,
    request as agent_request, sample, scrape, scripted_llm, seed_dir, seed_with, Broker, ConfigSvc,
    Orchestrator, Place,
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
    let mut svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
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

/// One store, one config service: a second started on the store of one that runs waits a while
/// for it to let go, then exits saying who holds it, having changed nothing; one that starts as
/// the holder dies (a restart's predecessor) takes the store over with what was written. Before,
/// both served it, each from its own copy: each write replaced the other's, and both went out
/// under the same version numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_config_service_on_one_store_waits_for_the_first_or_refuses() {
    let broker = Broker::start().unwrap();
    let mut first = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    let url = format!("{}/api/v1/config/agent-limits/default", first.url);
    let changed = json!({"max_iterations": 4});
    let written: Value = http
        .put(&url)
        .bearer_auth(&first.token)
        .json(&changed)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let version = written["version"].as_u64().unwrap();
    let second = |port: u16| another_config_service(&broker, first.data_dir(), port, None);
    let stderr = refusal_of(
        second(0),
        "a second config service ran on one store for 30 s",
    )
    .await;
    assert!(
        stderr.contains("in use by another process")
            && stderr.contains(&format!("pid {}", first.pid())),
        "{stderr}"
    );
    let kept: Value = get_json(&http, &url).await;
    assert_eq!(kept, changed);

    // A successor started while the first still holds the store, which then dies.
    let port = agent_bus::embedded::KeptPort::choose(&[]).unwrap();
    let mut successor = second(port.port());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        successor.try_wait().unwrap().is_none(),
        "the successor did not wait"
    );
    first.kill();
    let successor_url = format!("http://127.0.0.1:{}", port.port());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let all = loop {
        if let Ok(answer) = http
            .get(format!("{successor_url}/api/v1/config"))
            .send()
            .await
        {
            break answer.json::<Value>().await.unwrap();
        }
        assert!(
            successor.try_wait().unwrap().is_none(),
            "the successor exited instead of taking the store over"
        );
        assert!(
            tokio::time::Instant::now() < deadline,
            "the successor never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(all["version"].as_u64().unwrap(), version);
    let _ = successor.kill();
    let _ = successor.wait();
}

/// One config service on a deployment's subscription: a second with a store of its own (the
/// StatefulSet scaled to two replicas, each with its volume) hears the first announce itself on
/// the broker and exits before it answers, seeds, pushes or serves anything; the first goes on
/// answering and pushing. Before, both took the config requests (one Shared subscription spreads
/// them), each answered and wrote from its own store, and each pushed versions of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_config_service_with_a_store_of_its_own_refuses_to_serve() {
    let broker = Broker::start().unwrap();
    let first = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    let own_store = std::env::temp_dir().join(format!(
        "agent-e2e-config-second-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let port = agent_bus::embedded::KeptPort::choose(&[]).unwrap();
    let second = another_config_service(&broker, &own_store, port.port(), Some(&seed_dir()));
    let stderr = refusal_of(
        second,
        "a second config service with a store of its own ran for 30 s",
    )
    .await;
    assert!(
        stderr.contains("already owns the config")
            && stderr.contains(&first.data_dir().display().to_string()),
        "{stderr}"
    );
    // Seeded and started, it would have pushed its store's version naming the seed's types.
    let heard = tokio::time::timeout(Duration::from_millis(500), pushes.next()).await;
    assert!(heard.is_err(), "a push while the second ran: {heard:?}");
    let _ = std::fs::remove_dir_all(&own_store);

    // The first answers over Pulsar and over HTTP, and pushes its writes.
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let mut put = request(operation::PUT);
    put.values = vec![agent_schema::ConfigValue {
        kind: "agent-limits".into(),
        key: "default".into(),
        value: r#"{"max_iterations":4}"#.into(),
        workspace: None,
    }];
    let written = client.call(&put, ANSWER).await.unwrap();
    assert_eq!(written.error, None);
    let push = tokio::time::timeout(ANSWER, pushes.next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(Some(push.version), written.version);
    let http = reqwest::Client::new();
    let url = format!("{}/api/v1/config/agent-limits/default", first.url);
    let kept: Value = get_json(&http, &url).await;
    assert_eq!(kept, json!({"max_iterations": 4}));
}

/// Writes made at once are pushed in the order of their versions: TrustGraph's receivers take a
/// push only above the version they hold, so one overtaken by a later push was dropped there and
/// its change never applied.
#[tokio::test]
async fn writes_at_once_are_pushed_in_the_order_of_their_versions() {
    const WRITES: usize = 40;
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    let writes = (0..WRITES).map(|n| {
        let (http, svc_url, token) = (http.clone(), svc.url.clone(), svc.token.clone());
        async move {
            let url = format!("{svc_url}/api/v1/config/note/n{}", n % 4);
            let answer = http
                .put(&url)
                .bearer_auth(&token)
                .json(&json!({"n": n}))
                .send()
                .await
                .unwrap();
            assert_eq!(answer.status(), 200);
        }
    });
    futures::future::join_all(writes).await;
    let mut versions = Vec::new();
    while versions.len() < WRITES {
        let push = tokio::time::timeout(ANSWER, pushes.next())
            .await
            .unwrap()
            .unwrap();
        // The start's push of everything may come first.
        if push.changes.contains_key("note") {
            versions.push(push.version);
        }
    }
    assert!(
        versions.windows(2).all(|pair| pair[0] < pair[1]),
        "pushed out of order: {versions:?}"
    );
}

/// A workspace taken off the list while the broker was down, the service then stopped before
/// the push was sent: its next start says it removed. TrustGraph's services drop a workspace's
/// queues only on hearing that, and the start's push said only the listed ones made (deleting
/// the key again writes nothing, so nothing would ever say it), so they served a removed
/// workspace until they restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_removal_owed_when_the_service_died_is_said_by_its_next_start() {
    let mut broker = Broker::start().unwrap();
    let mut svc = ConfigSvc::start(Place::Child, &broker, None);
    let http = reqwest::Client::new();
    let acme = format!(
        "{}/api/v1/config/workspace/acme?workspace=__workspaces__",
        svc.url
    );
    let listed = http
        .put(&acme)
        .bearer_auth(&svc.token)
        .json(&json!({"id": "acme"}))
        .send()
        .await
        .unwrap();
    assert_eq!(listed.status(), 200);
    broker.stop();
    // Its push waits for the broker; the write is on disk first, which is all this needs. (Given
    // up on sooner, a loaded server can see the client gone before it writes.)
    let _ = http
        .delete(&acme)
        .bearer_auth(&svc.token)
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    stored_once(&svc, "the removal", |store| {
        store["version"].as_u64() > Some(1) && store["workspaces"]["__workspaces__"].is_null()
    })
    .await;
    let push = start_push_after_a_kill(&mut svc, &mut broker).await;
    let said = push.workspace_changes.clone().unwrap_or_default();
    assert_eq!(said.deleted, ["acme"], "{push:?}");
    assert!(said.created.is_empty(), "{push:?}");
}

/// The store's file once `reached` holds of it (within 20 s), for a write made while the broker
/// was down, whose answer waits for its push.
async fn stored_once(svc: &ConfigSvc, what: &str, reached: impl Fn(&Value) -> bool) -> Value {
    let stored = svc.data_dir().join("config.json");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let store: Value = std::fs::read(&stored)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        if reached(&store) {
            return store;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what} never reached the store: {store}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kills `svc` (its push still owed to the stopped broker), brings the broker back and restarts
/// it: its start's push.
async fn start_push_after_a_kill(
    svc: &mut ConfigSvc,
    broker: &mut Broker,
) -> agent_schema::ConfigPush {
    svc.kill();
    broker.restart().unwrap();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    // Off the runtime's threads: the listener's permits go to the broker from a task of its own,
    // and a non-persistent topic drops what finds none.
    tokio::task::block_in_place(|| svc.kill_and_restart());
    tokio::time::timeout(Duration::from_secs(30), pushes.next())
        .await
        .expect("the restarted service pushed nothing")
        .unwrap()
}

/// A write whose client goes away before the answer is still announced: the store keeps it
/// either way, and TrustGraph's services re-read a type only when a push names it, so a write
/// saved without its push was never applied there. Both write paths: REST and the gateway's.
#[tokio::test]
async fn a_write_whose_client_goes_away_is_still_pushed() {
    use tokio::io::AsyncWriteExt;
    const WRITES: usize = 6;
    const ROUNDS: usize = 8;
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    let dump = format!("{}/api/v1/config", svc.url);
    let version = |v: &Value| v["version"].as_u64().unwrap();
    let before = version(&get_json(&http, &dump).await);
    let addr = svc.url.trim_start_matches("http://").to_owned();
    // The server may see the client gone before its handler reaches the write (then nothing is
    // written, which is allowed); on a loaded machine a whole round can go that way. Each round
    // holds its connections a little longer before dropping them, until a write lands.
    let mut after = before;
    for round in 0..ROUNDS {
        for n in (round * WRITES)..((round + 1) * WRITES) {
            let (path, body) = match n % 2 {
                0 => (format!("/api/v1/config/note/n{n}"), json!({"n": n})),
                _ => (
                    "/api/v1/config".to_owned(),
                    json!({"operation": "put", "values": [
                        {"type": "note", "key": format!("n{n}"), "value": format!("{{\"n\":{n}}}")}
                    ]}),
                ),
            };
            let method = if n % 2 == 0 { "PUT" } else { "POST" };
            let body = body.to_string();
            let raw = format!(
                "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer {}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                svc.token,
                body.len()
            );
            let mut stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
            stream.write_all(raw.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(round as u64 * 3)).await;
            // Gone before any answer.
            drop(stream);
        }
        // The abandoned writes land (or not) in their own time.
        tokio::time::sleep(Duration::from_secs(2)).await;
        after = version(&get_json(&http, &dump).await);
        if after > before {
            break;
        }
    }
    assert!(
        after > before,
        "no abandoned write landed in {ROUNDS} rounds: nothing tested"
    );
    let mut pushed = Vec::new();
    let deadline = tokio::time::Instant::now() + ANSWER;
    while pushed.len() < (after - before) as usize {
        let Ok(push) = tokio::time::timeout_at(deadline, pushes.next()).await else {
            panic!(
                "the store went from version {before} to {after}, and only these were pushed: {pushed:?}"
            );
        };
        let push = push.unwrap();
        if push.changes.contains_key("note") {
            pushed.push(push.version);
        }
    }
    assert_eq!(pushed, ((before + 1)..=after).collect::<Vec<_>>());
}

/// Pushes the broker did not take (it was down when the writes landed) are sent once the broker
/// is back: TrustGraph's services re-read a type only when a push names it, so a lost push left
/// them on the old values until the next write, however long that took. A second write in the
/// outage goes with the first's push.
#[tokio::test]
async fn a_push_the_broker_did_not_take_is_sent_once_it_is_back() {
    let mut broker = Broker::start().unwrap();
    let svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    broker.stop();
    let mut written = 0;
    for (kind, key) in [("note", "away"), ("memo", "later")] {
        let asked = std::time::Instant::now();
        let answer = http
            .put(format!("{}/api/v1/config/{kind}/{key}", svc.url))
            .bearer_auth(&svc.token)
            .json(&json!({"n": 1}))
            .timeout(Duration::from_secs(150))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 200);
        written = answer.json::<Value>().await.unwrap()["version"]
            .as_u64()
            .unwrap();
        eprintln!("{kind}/{key} was answered in {:?}", asked.elapsed());
    }
    // Held still until this test listens: the topic is not persistent, so a push sent before
    // would pass unheard.
    svc.freeze(true);
    broker.restart().unwrap();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    svc.freeze(false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let Ok(push) = tokio::time::timeout_at(deadline, pushes.next()).await else {
            panic!(
                "versions up to {written} were written while the broker was down and never pushed"
            );
        };
        let push = push.unwrap();
        // A push naming nothing would not do: TrustGraph's services skip it.
        let names = |kind: &str| {
            push.changes
                .get(kind)
                .is_some_and(|spaces| spaces.iter().any(|s| s == "default"))
        };
        if push.version >= written {
            assert!(
                names("note") && names("memo"),
                "a push after the outage left out a write of it: {push:?}"
            );
            break;
        }
    }
}

/// A write whose push was still owed when the service was killed (the broker was away) reaches
/// TrustGraph's services through the start's push of the next run: it names every type the store
/// holds or has held, so a service behind re-reads each, a type whose last key was deleted too.
/// TrustGraph's start push names none, and its services skip a push naming no type of theirs
/// (trustgraph-base 2.11.1, `AsyncProcessor.on_config_notify`), so they kept the old value until
/// they restarted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_owed_when_the_service_died_is_named_by_its_next_start() {
    let mut broker = Broker::start().unwrap();
    let mut svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    let memo = format!("{}/api/v1/config/memo/only", svc.url);
    let put = http
        .put(&memo)
        .bearer_auth(&svc.token)
        .json(&json!({"n": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    broker.stop();
    // The type's last key goes; its push waits for the broker, the write is on disk first,
    // which is all this needs. (Given up on sooner, a loaded server can see the client gone
    // before it writes.)
    let _ = http
        .delete(&memo)
        .bearer_auth(&svc.token)
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    let store = stored_once(&svc, "the write", |store| {
        store["workspaces"]["default"]["memo"].is_null()
            && store["workspaces"]["default"]["agent-limits"].is_object()
    })
    .await;
    let written = store["version"].as_u64().unwrap();
    let push = start_push_after_a_kill(&mut svc, &mut broker).await;
    assert_eq!(push.version, written, "{push:?}");
    for kind in ["memo", "agent-limits"] {
        assert!(
            push.changes
                .get(kind)
                .is_some_and(|spaces| spaces == &["default"]),
            "the start's push does not name {kind} in the default workspace: {push:?}"
        );
    }
}

/// What "everything" names stays what the store holds: workspaces made and emptied again, their
/// deletions announced, are not named by the next start's push. Before, each type a workspace
/// had ever held was named at every start for ever, however many workspaces came and went.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workspaces_made_and_emptied_are_not_named_at_every_start() {
    let broker = Broker::start().unwrap();
    let mut svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let http = reqwest::Client::new();
    for tenant in ["t1", "t2", "t3"] {
        let url = format!("{}/api/v1/config/note/n?workspace={tenant}", svc.url);
        let put = http
            .put(&url)
            .bearer_auth(&svc.token)
            .json(&json!({"n": 1}));
        assert_eq!(put.send().await.unwrap().status(), 200);
        let deleted = http.delete(&url).bearer_auth(&svc.token).send().await;
        assert_eq!(deleted.unwrap().status(), 200);
    }
    // A write after those deletions were announced: the store forgets them.
    let limits = format!("{}/api/v1/config/agent-limits/default", svc.url);
    let put = http
        .put(&limits)
        .bearer_auth(&svc.token)
        .json(&json!({"max_iterations": 4}));
    assert_eq!(put.send().await.unwrap().status(), 200);
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut pushes = ConfigPushes::subscribe(&bus, &topics).await.unwrap();
    // Off the runtime's threads (see `a_write_owed_when_the_service_died_is_named_by_its_next_start`).
    tokio::task::block_in_place(|| svc.kill_and_restart());
    let push = tokio::time::timeout(Duration::from_secs(30), pushes.next())
        .await
        .expect("the restarted service pushed nothing")
        .unwrap();
    assert!(
        push.changes["agent-limits"] == ["default"],
        "the start's push does not name what the store holds: {push:?}"
    );
    assert!(
        !push.changes.contains_key("note"),
        "the start's push names the emptied workspaces' type: {push:?}"
    );
}

/// A workspace made or removed through config-svc (a key of type `workspace` in `__workspaces__`,
/// where TrustGraph 2.11 lists them) reaches TrustGraph's own services: the push says so
/// (`workspace_changes`), and a TrustGraph workspace service (trustgraph-base 2.11.1's push
/// handling: tests/trustgraph/workspace_events.py) takes the workspace up, then drops it. Before,
/// a write to that reserved workspace was never announced: TrustGraph's services took a workspace
/// made while they ran up only when they restarted, and kept serving a removed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trustgraphs_services_hear_of_a_workspace_made_and_removed() {
    use tokio::io::AsyncBufReadExt;
    let broker = Broker::start().unwrap();
    let _svc = ConfigSvc::start(Place::Child, &broker, None);
    let python = installed_path("trustgraph-client.sh").join("python");
    let mut service = tokio::process::Command::new(python)
        .arg(repo_root().join("tests/trustgraph/workspace_events.py"))
        .args(["--pulsar-host", &broker.url(), "--seconds", "90"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut heard = tokio::io::BufReader::new(service.stdout.take().unwrap()).lines();
    let mut said = Vec::new();
    said_until(&mut heard, &mut said, json!({"ready": true})).await;
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let mut made = request(operation::PUT);
    made.workspace = Some("__workspaces__".into());
    made.values = vec![agent_schema::ConfigValue {
        kind: "workspace".into(),
        key: "acme".into(),
        value: r#"{"id":"acme","name":"Acme"}"#.into(),
        workspace: None,
    }];
    assert_eq!(client.call(&made, ANSWER).await.unwrap().error, None);
    said_until(&mut heard, &mut said, json!({"created": "acme"})).await;
    let mut removed = request(operation::DELETE);
    removed.workspace = Some("__workspaces__".into());
    removed.keys = vec![ConfigKey {
        kind: "workspace".into(),
        key: "acme".into(),
    }];
    assert_eq!(client.call(&removed, ANSWER).await.unwrap().error, None);
    said_until(&mut heard, &mut said, json!({"deleted": "acme"})).await;
}

/// A workspace made through config-svc is filled from `__template__` (where TrustGraph's
/// bootstrapper keeps the default flows and prompts), as TrustGraph's config service fills it:
/// the template's keys it lacks, never over its own, in the listing's write, whose push names
/// every type it then holds. A TrustGraph service (trustgraph-base 2.11.1's push handling and config
/// fetch: tests/trustgraph/workspace_events.py) takes it up and reads them. Before, a workspace
/// made through config-svc stayed empty but for what was written to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_made_is_filled_from_the_template() {
    use tokio::io::AsyncBufReadExt;
    let broker = Broker::start().unwrap();
    let _svc = ConfigSvc::start(Place::Child, &broker, None);
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let put = |workspace: &str, entries: &[(&str, &str, &str)]| {
        let mut put = request(operation::PUT);
        put.workspace = Some(workspace.into());
        put.values = entries
            .iter()
            .map(|(kind, key, value)| agent_schema::ConfigValue {
                kind: (*kind).into(),
                key: (*key).into(),
                value: (*value).into(),
                workspace: None,
            })
            .collect();
        put
    };
    let template = put(
        "__template__",
        &[
            ("prompt", "greeting", r#""hi""#),
            ("prompt", "farewell", r#""bye""#),
            ("flow-blueprint", "basic", r#"{"class":"basic"}"#),
        ],
    );
    let own = put(
        "acme",
        &[
            ("prompt", "greeting", r#""mine""#),
            ("tool", "search", "{}"),
        ],
    );
    for call in [&template, &own] {
        assert_eq!(client.call(call, ANSWER).await.unwrap().error, None);
    }
    let python = installed_path("trustgraph-client.sh").join("python");
    let mut service = tokio::process::Command::new(python)
        .arg(repo_root().join("tests/trustgraph/workspace_events.py"))
        .args(["--pulsar-host", &broker.url(), "--seconds", "90"])
        .args(["--types", "prompt", "flow-blueprint", "tool"])
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut heard = tokio::io::BufReader::new(service.stdout.take().unwrap()).lines();
    let mut said = Vec::new();
    said_until(&mut heard, &mut said, json!({"ready": true})).await;
    let listed = put(
        "__workspaces__",
        &[("workspace", "acme", r#"{"id":"acme"}"#)],
    );
    assert_eq!(client.call(&listed, ANSWER).await.unwrap().error, None);
    said_until(&mut heard, &mut said, json!({"created": "acme"})).await;
    said_until(
        &mut heard,
        &mut said,
        json!({"config": {"workspace": "acme", "values": {
            "prompt": {"greeting": r#""mine""#, "farewell": r#""bye""#},
            "flow-blueprint": {"basic": r#"{"class":"basic"}"#},
            "tool": {"search": "{}"},
        }}}),
    )
    .await;
}

/// Reads what `workspace_events.py` says into `said` until it says `wanted`; anything but a push
/// heard before it fails the test.
async fn said_until(
    heard: &mut tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
    said: &mut Vec<Value>,
    wanted: Value,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let line = tokio::time::timeout_at(deadline, heard.next_line())
            .await
            .unwrap_or_else(|_| panic!("TrustGraph's service never said {wanted}: {said:?}"))
            .unwrap()
            .unwrap_or_else(|| panic!("TrustGraph's service ended: {said:?}"));
        let line: Value = serde_json::from_str(&line).unwrap();
        said.push(line.clone());
        if line == wanted {
            return;
        }
        assert!(
            line.get("push").is_some(),
            "TrustGraph's service said {line} before {wanted}: {said:?}"
        );
    }
}

/// TrustGraph 2.11's API gateway sends a workspace's config calls to that workspace's own request
/// topic (`request/config:<workspace>`) and reads the answers on `response/config:<workspace>`
/// (tests/trustgraph/gateway_config.py makes them with trustgraph-base's client and translators,
/// as the gateway does). config-svc answers there for the default workspace and for each one
/// listed in `__workspaces__`: taken up when listed and at start, dropped when taken off. The
/// workspace is the topic's whatever the body names, and calls across workspaces are refused
/// there. Before, every config call through TrustGraph's gateway went unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trustgraphs_gateway_reaches_each_workspace_on_its_own_topic() {
    let broker = Broker::start().unwrap();
    let mut svc = ConfigSvc::start(Place::Child, &broker, Some(&seed_dir()));
    let mut gateway = GatewayCalls::start(&broker).await;
    // The default workspace, listed or not: its seeded values. (Its topic is taken up a moment
    // after the REST API answers, and a call on a non-persistent topic before is lost.)
    gateway
        .answered_within("default", Duration::from_secs(30))
        .await;
    let seeded = gateway
        .answered(
            "default",
            json!({"operation": "getvalues", "type": "agent-limits"}),
        )
        .await;
    assert!(
        seeded["answer"]["values"]
            .as_array()
            .is_some_and(|values| values.iter().any(|v| v["key"] == "default")),
        "the default workspace's seeded agent-limits: {seeded}"
    );
    // Listed as TrustGraph's IAM lists a workspace it makes: on the shared topic.
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let listing = |op: &str, workspace: &str| {
        let mut listing = request(op);
        listing.workspace = Some("__workspaces__".into());
        match op {
            operation::PUT => {
                listing.values = vec![agent_schema::ConfigValue {
                    kind: "workspace".into(),
                    key: workspace.into(),
                    value: json!({"id": workspace}).to_string(),
                    workspace: None,
                }]
            }
            _ => {
                listing.keys = vec![ConfigKey {
                    kind: "workspace".into(),
                    key: workspace.into(),
                }]
            }
        }
        listing
    };
    let answer = client.call(&listing(operation::PUT, "acme"), ANSWER).await;
    assert_eq!(answer.unwrap().error, None);
    // Taken up a moment after the write (as TrustGraph's own service does, on hearing its push).
    gateway
        .answered_within("acme", Duration::from_secs(30))
        .await;
    // The body names another workspace: the topic's is the one written.
    gateway
        .answered(
            "acme",
            json!({"operation": "put", "workspace": "default",
                   "values": [{"type": "prompt", "key": "greeting", "value": "\"hello\""}]}),
        )
        .await;
    let read = |workspace: &str| {
        let mut get = request(operation::GET);
        get.workspace = Some(workspace.into());
        get.keys = vec![ConfigKey {
            kind: "prompt".into(),
            key: "greeting".into(),
        }];
        get
    };
    let in_acme = client.call(&read("acme"), ANSWER).await.unwrap();
    assert_eq!(
        in_acme.values.unwrap_or_default().len(),
        1,
        "the put on acme's topic is in acme"
    );
    let in_default = client.call(&read("default"), ANSWER).await.unwrap();
    assert_eq!(
        in_default.values.unwrap_or_default(),
        vec![],
        "a put on acme's topic naming default in its body wrote in default"
    );
    let got = gateway
        .answered("acme", json!({"operation": "config"}))
        .await;
    assert_eq!(
        got["answer"]["config"]["prompt"]["greeting"], "\"hello\"",
        "{got}"
    );
    // Every workspace's values are not read through one workspace's topic.
    let across = gateway
        .call(
            "acme",
            json!({"operation": "getvalues-all-ws", "type": "agent-limits"}),
            20,
        )
        .await;
    assert_eq!(across["error"]["type"], "bad-operation", "{across}");
    assert_eq!(across["answer"].get("values"), None, "{across}");
    // A listed workspace is answered from the start.
    tokio::task::block_in_place(|| svc.kill_and_restart());
    gateway
        .answered_within("acme", Duration::from_secs(30))
        .await;
    // Taken off the list (over REST: the restarted service's shared topic may not be consumed
    // yet, and a write on it is sent once): no longer answered, twice running.
    let removed = reqwest::Client::new()
        .delete(format!(
            "{}/api/v1/config/workspace/acme?workspace=__workspaces__",
            svc.url
        ))
        .bearer_auth(&svc.token)
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 200);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut unanswered = 0;
    while unanswered < 2 {
        let probe = gateway.call("acme", probe(), 3).await;
        unanswered = if probe["timeout"] == true {
            unanswered + 1
        } else {
            0
        };
        assert!(
            tokio::time::Instant::now() < deadline,
            "workspace acme was still answered 30 s after it was taken off the list: {probe}"
        );
    }
    // The default workspace still is.
    gateway.answered("default", probe()).await;
}

/// A call that reads nothing much.
fn probe() -> Value {
    json!({"operation": "list", "type": "prompt"})
}

/// Config calls made as TrustGraph's API gateway makes them (tests/trustgraph/gateway_config.py).
struct GatewayCalls {
    _child: tokio::process::Child,
    calls: tokio::process::ChildStdin,
    answers: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl GatewayCalls {
    async fn start(broker: &Broker) -> GatewayCalls {
        use tokio::io::AsyncBufReadExt;
        let python = installed_path("trustgraph-client.sh").join("python");
        let mut child = tokio::process::Command::new(python)
            .arg(repo_root().join("tests/trustgraph/gateway_config.py"))
            .args(["--pulsar-host", &broker.url()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let calls = child.stdin.take().unwrap();
        let mut answers = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        let ready = tokio::time::timeout(Duration::from_secs(60), answers.next_line())
            .await
            .expect("the gateway's client did not start")
            .unwrap();
        assert_eq!(ready.as_deref(), Some(r#"{"ready": true}"#));
        GatewayCalls {
            _child: child,
            calls,
            answers,
        }
    }

    /// What the call in `workspace` was answered (`answer`, `error`), or `{"timeout": true}`.
    async fn call(&mut self, workspace: &str, request: Value, timeout_secs: u64) -> Value {
        use tokio::io::AsyncWriteExt;
        let line = json!({"workspace": workspace, "request": request, "timeout": timeout_secs});
        self.calls
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        let answered = tokio::time::timeout(
            Duration::from_secs(timeout_secs + 30),
            self.answers.next_line(),
        )
        .await
        .expect("the gateway's client did not say how its call went")
        .unwrap()
        .expect("the gateway's client ended");
        serde_json::from_str(&answered).unwrap()
    }

    /// What the call in `workspace` was answered, which must be without error.
    async fn answered(&mut self, workspace: &str, request: Value) -> Value {
        let answered = self.call(workspace, request.clone(), 20).await;
        assert!(
            answered["timeout"] != true && answered["error"] == Value::Null,
            "{request} in {workspace}: {answered}"
        );
        answered
    }

    /// Waits until calls in `workspace` are answered.
    async fn answered_within(&mut self, workspace: &str, patience: Duration) {
        let deadline = tokio::time::Instant::now() + patience;
        loop {
            let probe = self.call(workspace, probe(), 2).await;
            if probe["timeout"] != true {
                assert_eq!(probe["error"], Value::Null, "{probe}");
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "workspace {workspace}'s config topic was not answered within {patience:?}"
            );
        }
    }
}

/// The config API answers anyone who reaches it: an MCP server's credentials (`auth-token`, the
/// values of `env`) are shown only to a reader with the token, over REST and through the gateway
/// TrustGraph's CLI uses; the orchestrators read them whole over the broker.
#[tokio::test]
async fn an_mcp_servers_credentials_are_shown_only_with_the_token() {
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::start(Place::Child, &broker, None);
    let http = reqwest::Client::new();
    let url = format!("{}/api/v1/config/mcp/tickets", svc.url);
    let entry = json!({"url": "https://mcp.example/mcp", "auth-token": "s3cret-mcp-token",
                       "env": {"API_KEY": "k3y-value"}});
    let put = http
        .put(&url)
        .bearer_auth(&svc.token)
        .json(&entry)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
    let secrets = |text: &str| text.contains("s3cret-mcp-token") || text.contains("k3y-value");
    for read in [
        url.clone(),
        format!("{}/api/v1/config/mcp", svc.url),
        format!("{}/api/v1/config", svc.url),
    ] {
        let anonymous = http.get(&read).send().await.unwrap().text().await.unwrap();
        assert!(!secrets(&anonymous), "{read}: {anonymous}");
        assert!(anonymous.contains("https://mcp.example/mcp"), "{anonymous}");
        let trusted = http
            .get(&read)
            .bearer_auth(&svc.token)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(secrets(&trusted), "{read}: {trusted}");
    }
    let gateway = format!("{}/api/v1/config", svc.url);
    for body in [
        json!({"operation": "getvalues", "type": "mcp"}),
        json!({"operation": "get", "keys": [{"type": "mcp", "key": "tickets"}]}),
        json!({"operation": "config"}),
    ] {
        let anonymous = http
            .post(&gateway)
            .json(&body)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(!secrets(&anonymous), "{body}: {anonymous}");
        assert!(anonymous.contains("mcp.example"), "{body}: {anonymous}");
    }
    // A value read without the token and written back would store the placeholder: refused.
    let read_hidden = http.get(&url).send().await.unwrap().text().await.unwrap();
    let written_back = http
        .put(&url)
        .bearer_auth(&svc.token)
        .body(read_hidden)
        .send()
        .await
        .unwrap();
    assert_eq!(written_back.status(), 400);
    let kept = http
        .get(&url)
        .bearer_auth(&svc.token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(secrets(&kept), "{kept}");
    // Over the broker, as the orchestrators read it: whole.
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let whole = client
        .call(&request(operation::CONFIG), ANSWER)
        .await
        .unwrap();
    let text = serde_json::to_string(&whole).unwrap();
    assert!(secrets(&text), "{text}");
}

/// The config topics are non-persistent: a request sent before the service subscribed is dropped
/// by the broker. A read is asked again, so a client that starts first still gets its answer.
#[tokio::test]
async fn a_read_sent_before_the_service_listens_is_answered() {
    let broker = Broker::start().unwrap();
    let bus = Bus::connect(&broker.url(), None).await.unwrap();
    let topics = Topics::trustgraph("default", "default");
    let mut client = ConfigClient::connect(&bus, &topics).await.unwrap();
    let asked = tokio::spawn(async move {
        client
            .call(&request(operation::CONFIG), Duration::from_secs(9))
            .await
    });
    // The first copy is out, with nobody subscribed to take it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _svc = ConfigSvc::spawn(&broker, None);
    let answer = asked.await.unwrap().unwrap();
    assert_eq!(answer.error, None);
    assert_eq!(answer.version, Some(0));
}

#[tokio::test]
async fn the_trustgraph_protocol_over_pulsar() {
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::start(Place::Child, &broker, None);
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
    // As TrustGraph's service: a key that is not there is not among the values, and no error.
    let missing = client.call(&get, ANSWER).await.unwrap();
    assert_eq!(missing.error, None);
    assert_eq!(missing.values, Some(vec![]));

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

    // What the operator sees: every request by operation and outcome, the nonsense as `other`.
    let metrics = scrape(&svc.url).await;
    let requests = |operation: &str, outcome: &str| {
        sample(
            &metrics,
            &format!(
                "agent_config_requests_total{{operation=\"{operation}\",outcome=\"{outcome}\"}}"
            ),
        )
    };
    assert_eq!(requests("config", "ok"), 2.0);
    assert_eq!(requests("put", "ok"), 1.0);
    assert_eq!(requests("get", "ok"), 2.0);
    assert_eq!(requests("other", "error"), 1.0);
    assert_eq!(sample(&metrics, "agent_config_version"), 2.0);
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

/// A question over 40 bytes, refused once `max_question_bytes` is 40.
const LONG_QUESTION: &str = "Is this question longer than forty bytes? It is.";

/// A config service with the seed, and an orchestrator following it whose model (kept running
/// while the caller holds it) answers "done" to everything; the client has run one dialog.
async fn following(
    broker: &Broker,
) -> (
    ConfigSvc,
    scripted_llm::ScriptedLlm,
    Orchestrator,
    agent_bus::AgentClient,
) {
    let svc = ConfigSvc::spawn(broker, Some(&seed_dir()));
    let llm = scripted_llm(
        r#"{"rules": [{"match": "", "reply": "Thought: easy.\nFinal Answer: done"}]}"#,
    )
    .await;
    let orchestrator = Orchestrator::spawn(broker, &llm, &seed_dir(), &[]);
    let mut client = client(broker).await;
    assert_eq!(
        dialog_error(&mut client, "before", LONG_QUESTION).await,
        None
    );
    (svc, llm, orchestrator, client)
}

/// Writes `limits` as the default agent limits through the REST API.
async fn put_limits(svc: &ConfigSvc, limits: Value) {
    let put = reqwest::Client::new()
        .put(format!("{}/api/v1/config/agent-limits/default", svc.url))
        .bearer_auth(&svc.token)
        .json(&limits)
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200);
}

/// The orchestrator follows the config service: a change through the REST API applies to the next
/// request without a restart, and an invalid config is refused while the last good one stays.
#[tokio::test]
async fn the_orchestrator_applies_config_changes_without_a_restart() {
    let broker = Broker::start().unwrap();
    let (svc, _llm, _orchestrator, mut client) = following(&broker).await;

    put_limits(&svc, json!({"max_question_bytes": 40})).await;
    refused_within(&mut client, LONG_QUESTION, "40", Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("the new limit did not apply: {e}"));

    // Invalid (max_iterations 0): refused by the orchestrator, the previous limits stay.
    put_limits(
        &svc,
        json!({"max_question_bytes": 4000, "max_iterations": 0}),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = dialog_error(&mut client, "after-invalid", LONG_QUESTION).await;
    assert!(
        still.is_some_and(|e| e.contains("40")),
        "the invalid config was applied"
    );
}

/// A config service whose store was emptied and seeded again counts its versions from the start:
/// the orchestrator reads its config when it comes back, and puts it in force although its
/// version is the one already in force. Until 2026-12-02 an equal version was taken for the same
/// config, and the new one went unheard until some later write.
#[tokio::test]
async fn a_config_service_seeded_again_is_followed_at_the_same_version() {
    let broker = Broker::start().unwrap();
    let (svc, _llm, _orchestrator, mut client) = following(&broker).await;
    drop(svc);
    let limits = seed_with(
        "seeded-again",
        &[(
            "agent-limits",
            &serde_json::json!({"default": {"max_question_bytes": 40}}).to_string(),
        )],
    );
    let _again = ConfigSvc::spawn(&broker, Some(&limits));
    refused_within(&mut client, LONG_QUESTION, "40", Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("the service's new config did not apply: {e}"));
}

/// A stdio MCP server defined only by the config service (anyone who can publish on the broker can
/// write it) starts no program: the tool's call is refused, saying why, and the program never ran.
/// The orchestrator's own config directory, or `MCP_STDIO_COMMANDS`, decides what may start. Until
/// 2026-12-02 the config service's definition was started as it stood.
#[tokio::test]
async fn a_stdio_mcp_server_defined_only_by_the_config_service_starts_no_program() {
    let marker = std::env::temp_dir().join(format!(
        "agent-e2e-stdio-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mcp = json!({
        "planted": {"remote-name": "anything", "command": "sh",
                    "args": ["-c", format!("touch {}", marker.display())]}
    });
    let tools = json!({
        "planted": {"name": "planted", "description": "A tool the config service planted",
                    "type": "mcp-tool", "mcp-tool": "planted",
                    "arguments": [{"name": "x", "type": "string"}]}
    });
    let planted = seed_with(
        "planted-stdio",
        &[("mcp", &mcp.to_string()), ("tool", &tools.to_string())],
    );
    let broker = Broker::start().unwrap();
    let _svc = ConfigSvc::spawn(&broker, Some(&planted));
    let llm = scripted_llm(
        r#"{"rules": [
      {"match": "starts no program here", "reply": "Thought: refused.\nFinal Answer: refused"},
      {"match": "no tool named", "reply": "Thought: not yet.\nFinal Answer: no such tool yet"},
      {"match": "Question: run the planted tool", "reply": "Thought: run it.\nAction: planted\nArgs: {\"x\": \"1\"}"}
    ]}"#,
    )
    .await;
    // Its own directory is the seed, which defines no stdio server.
    let _orchestrator = Orchestrator::spawn(&broker, &llm, &seed_dir(), &[]);
    let mut client = client(&broker).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut answers = Vec::new();
    for attempt in 0.. {
        let id = format!("planted-{attempt}");
        client
            .send(&id, &agent_request("run the planted tool", false))
            .await
            .unwrap();
        let responses = collect_dialog(&mut client, &id, Duration::from_secs(30))
            .await
            .unwrap();
        let answer = responses.last().unwrap().content.clone();
        // Until the service's config is applied, the tool is not known yet.
        if answer == "refused" || std::time::Instant::now() > deadline {
            answers.push(answer);
            break;
        }
        answers.push(answer);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(
        answers.last().map(String::as_str),
        Some("refused"),
        "after {} dialogs",
        answers.len()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!marker.exists(), "the planted program ran");
}

/// How long the broker stays down in the outage test: past the `pulsar` crate's connection
/// retries (about 40 s), after which it ends the streams of every subscription on it.
const LONG_OUTAGE: Duration = Duration::from_secs(50);

/// Sends `question` as a new dialog until one ends with an error that names `limit`, for up to
/// `within`.
async fn refused_within(
    client: &mut agent_bus::AgentClient,
    question: &str,
    limit: &str,
    within: Duration,
) -> Result<(), String> {
    let deadline = std::time::Instant::now() + within;
    for attempt in 0.. {
        let id = format!("refused-{attempt}-{:x}", rand::random::<u32>());
        if let Some(error) = dialog_error(client, &id, question).await {
            return if error.contains(limit) {
                Ok(())
            } else {
                Err(error)
            };
        }
        if std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Err(format!("no dialog was refused within {within:?}"))
}

/// After a broker outage long enough to end the orchestrator's subscriptions to the config
/// service's pushes and answers, it follows the config service again: a change made once the
/// broker is back applies within seconds, not at its next restart.
#[tokio::test]
async fn the_orchestrator_follows_config_again_after_a_long_broker_outage() {
    let mut broker = Broker::start().unwrap();
    let (svc, _llm, _orchestrator, mut client) = following(&broker).await;

    broker.stop();
    tokio::time::sleep(LONG_OUTAGE).await;
    broker.restart().unwrap();
    // Served again (the request consumer subscribes again by itself), on the config of before.
    assert_eq!(dialog_error(&mut client, "back", LONG_QUESTION).await, None);

    put_limits(&svc, json!({"max_question_bytes": 40})).await;
    // Well within the minute of the periodic re-read, which would fail too with the answers'
    // subscription lost.
    refused_within(&mut client, LONG_QUESTION, "40", Duration::from_secs(20))
        .await
        .unwrap_or_else(|e| panic!("the config change did not apply after the outage: {e}"));
}

/// Runs `agentctl` with `args`; returns its exit code, stdout and stderr.
fn agentctl(args: &[&str], token: Option<&str>) -> (i32, String, String) {
    let mut command = std::process::Command::new(binary("agentctl"));
    command.args(args).env_remove("CONFIG_TOKEN");
    if let Some(t) = token {
        command.env("CONFIG_TOKEN", t);
    }
    let out = command.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `agentctl config validate` reports every problem of a directory at once, each with its file and
/// key: bad JSON, a missing field, an unknown pattern in `valid_patterns`, a limit that cannot work.
#[test]
fn validate_reports_every_problem_with_file_and_key() {
    let dir = config_dir(
        "invalid",
        &[
            ("tool", "{\"broken\": "),
            (
                "agent-task-type",
                r#"{"research": {"description": "d", "valid_patterns": ["react", "telepathy"]},
                    "vague": {"valid_patterns": ["react"]}}"#,
            ),
            ("agent-limits", r#"{"default": {"max_iterations": 0}}"#),
            (
                "prompt",
                r#"{"reactt": {"system": "s", "template": "t"}, "template.agent-react": {"prompt": "TrustGraph's own"}}"#,
            ),
        ],
    );
    let (code, _, stderr) = agentctl(&["config", "validate", dir.to_str().unwrap()], None);
    assert_eq!(code, 1, "{stderr}");
    assert!(!stderr.contains("template.agent-react"), "{stderr}");
    for expected in [
        "tool.json: not an object",
        "agent-task-type.json: agent-task-type/research: valid_patterns names the unknown pattern 'telepathy'",
        "agent-task-type.json: agent-task-type/vague: missing field `description`",
        "agent-limits.json: agent-limits/default: max_iterations must be at least 1",
        "prompt.json: prompt/reactt is ignored: no LLM call of the orchestrator uses it",
    ] {
        assert!(stderr.contains(expected), "missing '{expected}' in:\n{stderr}");
    }
    let (code, stdout, _) = agentctl(&["config", "validate", seed_dir().to_str().unwrap()], None);
    assert_eq!(code, 0);
    assert!(stdout.contains("valid"));
}

/// `agentctl config seed` adds only missing keys (a changed value survives a second seed); `put`
/// takes JSON or @file, `get` and `list` read, `delete` removes, and writes without the token fail.
#[tokio::test]
async fn agentctl_config_seeds_missing_keys_and_edits_values() {
    let broker = Broker::start().unwrap();
    let svc = ConfigSvc::spawn(&broker, None);
    let url = svc.url.clone();
    let token = svc.token.clone();
    let seed = seed_dir();
    let run = move |args: Vec<String>, token: Option<String>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let mut all = vec!["config".to_owned(), "--url".to_owned(), url];
            all.extend(args);
            let refs: Vec<&str> = all.iter().map(String::as_str).collect();
            agentctl(&refs, token.as_deref())
        })
    };
    let args = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let seed_arg = seed.to_str().unwrap();

    let (code, _, stderr) = run(args(&["seed", seed_arg]), None).await.unwrap();
    assert_ne!(code, 0, "seeding without the token must fail");
    assert!(stderr.contains("401"), "{stderr}");

    let (code, stdout, stderr) = run(args(&["seed", seed_arg]), Some(token.clone()))
        .await
        .unwrap();
    assert_eq!(code, 0, "{stderr}");
    let seeded: usize = seed::entries(&seed::read_dir(&seed).unwrap()).len();
    assert!(
        stdout.contains(&format!("added {seeded} missing keys")),
        "{stdout}"
    );

    let file = std::env::temp_dir().join(format!("agentctl-put-{}.json", std::process::id()));
    std::fs::write(
        &file,
        r#"{"description": "Mine.", "valid_patterns": ["react"]}"#,
    )
    .unwrap();
    let at_file = format!("@{}", file.display());
    let (code, _, stderr) = run(
        args(&["put", "agent-task-type", "general", &at_file]),
        Some(token.clone()),
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{stderr}");
    let (_, stdout, _) = run(args(&["seed", seed_arg]), Some(token.clone()))
        .await
        .unwrap();
    assert!(stdout.contains("added 0 missing keys"), "{stdout}");
    let (code, stdout, _) = run(args(&["get", "agent-task-type", "general"]), None)
        .await
        .unwrap();
    assert_eq!(code, 0);
    assert!(
        stdout.contains("Mine."),
        "the seed overwrote a changed value: {stdout}"
    );

    let (code, _, _) = run(
        args(&[
            "put",
            "agent-task-type",
            "extra",
            r#"{"description": "x", "valid_patterns": ["react"]}"#,
        ]),
        Some(token.clone()),
    )
    .await
    .unwrap();
    assert_eq!(code, 0);
    let (_, stdout, _) = run(args(&["list", "agent-task-type"]), None).await.unwrap();
    for name in [
        "extra",
        "general",
        "research",
        "risk-assessment",
        "summarisation",
    ] {
        assert!(stdout.contains(name), "{name} missing from {stdout}");
    }
    let (code, _, _) = run(args(&["delete", "agent-task-type", "extra"]), None)
        .await
        .unwrap();
    assert_ne!(code, 0, "a delete without the token must fail");
    let (code, _, _) = run(
        args(&["delete", "agent-task-type", "extra"]),
        Some(token.clone()),
    )
    .await
    .unwrap();
    assert_eq!(code, 0);
    let (code, _, _) = run(args(&["get", "agent-task-type", "extra"]), None)
        .await
        .unwrap();
    assert_ne!(code, 0, "the deleted key is still there");
    let _ = std::fs::remove_file(file);

    // A key is one path segment whatever it holds, and --workspace names the workspace: before,
    // `/`, `#` and `?` in a key sent another path (404, or the key cut short), and every call
    // went to the default workspace.
    let odd = "ops review/v2 #1?x=%";
    let value = r#"{"description": "odd", "valid_patterns": ["react"]}"#;
    let in_team = |list: &[&str]| {
        let mut all = args(list);
        all.extend(["--workspace".to_owned(), "team-b".to_owned()]);
        all
    };
    let (code, _, stderr) = run(
        in_team(&["put", "agent-task-type", odd, value]),
        Some(token.clone()),
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{stderr}");
    let (code, stdout, stderr) = run(in_team(&["get", "agent-task-type", odd]), None)
        .await
        .unwrap();
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("odd"), "{stdout}");
    let (_, stdout, _) = run(in_team(&["list", "agent-task-type"]), None)
        .await
        .unwrap();
    assert!(stdout.contains(odd), "{stdout}");
    let (code, _, _) = run(args(&["get", "agent-task-type", odd]), None)
        .await
        .unwrap();
    assert_ne!(code, 0, "written in team-b, found in default");
    let (code, _, _) = run(
        in_team(&["delete", "agent-task-type", odd]),
        Some(token.clone()),
    )
    .await
    .unwrap();
    assert_eq!(code, 0);
    let (code, _, _) = run(in_team(&["get", "agent-task-type", odd]), None)
        .await
        .unwrap();
    assert_ne!(code, 0, "the deleted key is still there");
}

/// A service given a secret at the value `.env.example` publishes does not start: copied as the
/// compose file's header says and never changed, `CONFIG_TOKEN` let anyone write tools and
/// provenance, and `AGENT_SEAL_KEY` anyone forge fan-outs, completions and approvals.
#[test]
fn the_services_refuse_the_secrets_env_example_publishes() {
    // Refused before anything is opened, so nothing is made here (removed all the same).
    let data = std::env::temp_dir().join(format!("agent-e2e-refused-{}", std::process::id()));
    let cases = [
        ("config-svc", "CONFIG_TOKEN", "change-me"),
        ("config-svc", "AGENT_SEAL_KEY", "change-me-too"),
        ("agent-aggregator", "CONFIG_TOKEN", "change-me"),
        ("agent-aggregator", "AGENT_SEAL_KEY", "change-me-too"),
        ("agent-orchestrator", "AGENT_SEAL_KEY", "change-me-too"),
        ("agent-orchestrator", "CONFIG_TOKEN", "change-me"),
    ];
    for (service, setting, example) in cases {
        let out = std::process::Command::new(binary(service))
            .env_remove("CONFIG_TOKEN")
            .env_remove("AGENT_SEAL_KEY")
            .env(setting, example)
            // Nothing listens there: a service that started would not end by itself soon.
            .env("PULSAR_URL", "pulsar://127.0.0.1:9")
            .env("CONFIG_DATA", data.join("config"))
            .env("GRAPH_STORE", data.join("graph"))
            .env("CONFIG_HTTP_ADDR", "127.0.0.1:0")
            .env("AGGREGATOR_HTTP_ADDR", "127.0.0.1:0")
            .env("AGENT_HTTP_ADDR", "127.0.0.1:0")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = exited_within(
            out,
            Duration::from_secs(20),
            &format!("{service} started with {setting}={example}"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "{service} exited 0 with {setting}={example}"
        );
        assert!(
            stderr.contains(setting) && stderr.contains(".env.example"),
            "{service}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&data);
}

/// A config service started as a child beside the test's own, on `broker`, keeping its store in
/// `data` and serving on `port` (0: any), sealed as the harness seals, seeded from `seed`; what it
/// writes to its standard error is piped.
fn another_config_service(
    broker: &Broker,
    data: &std::path::Path,
    port: u16,
    seed: Option<&std::path::Path>,
) -> std::process::Child {
    let mut command = std::process::Command::new(binary("config-svc"));
    if let Some(seed) = seed {
        command.arg("--seed").arg(seed);
    }
    command
        .env(
            "CONFIG_TOKEN",
            format!("{:032x}", uuid::Uuid::new_v4().as_u128()),
        )
        .env("AGENT_SEAL_KEY", agent_e2e::SEAL_KEY)
        .env("PULSAR_URL", broker.url())
        .env("CONFIG_DATA", data)
        .env("CONFIG_HTTP_ADDR", format!("127.0.0.1:{port}"))
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}

/// What `child` wrote to its standard error, having exited refusing to run (not 0) within 30 s;
/// the test fails saying `ran` if it still runs then.
async fn refusal_of(child: std::process::Child, ran: &'static str) -> String {
    let out =
        tokio::task::spawn_blocking(move || exited_within(child, Duration::from_secs(30), ran))
            .await
            .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{ran}; it exited 0: {stderr}");
    stderr
}

/// The output of `child` once it has exited; past `within` it is killed and the test fails
/// saying `still_running`.
fn exited_within(
    mut child: std::process::Child,
    within: Duration,
    still_running: &str,
) -> std::process::Output {
    let deadline = std::time::Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("{still_running}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}
