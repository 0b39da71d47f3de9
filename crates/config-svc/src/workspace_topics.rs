//! The config request topics of single workspaces: TrustGraph 2.11's API gateway sends a
//! workspace's config calls to `{config request topic}:{workspace}` and reads the answers on
//! `{config response topic}:{workspace}`, the workspace told by the topic, never by the body (the
//! gateway lets a caller reach only the workspaces it may). Its config service answers there for
//! every workspace listed in `__workspaces__`, taking a workspace's topic up or dropping it as the
//! list changes; so does this one, and for the default workspace, which it seeds, listed or not.
//! Without them, every config call through TrustGraph's gateway in front of config-svc timed out.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use agent_bus::{run_consumer, Bus, ConsumerStats, Delivery, Publisher};
use agent_schema::{
    operation, ConfigRequest, ConfigResponse, ErrorInfo, WORKSPACES_NAMESPACE, WORKSPACE_TYPE,
};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::store::ConfigStore;
use crate::{Pusher, DEFAULT_WORKSPACE};

/// How often the topics served are checked against the list without a change to it: a
/// workspace whose subscription failed (the broker was down) is taken up again then.
const RECHECK: Duration = Duration::from_secs(5);

/// How long a workspace's consumer is given to drain when it is dropped or the service stops
/// (its drain deadline, and a margin): while the broker is down it may still be making its
/// dead-letter producer, which does not watch for a stop, and neither the other workspaces nor
/// the service's stop wait on it past this.
const STOP_WITHIN: Duration = Duration::from_secs(10);

/// A workspace's request topic.
pub fn request_topic(config_request: &str, workspace: &str) -> String {
    format!("{config_request}:{workspace}")
}

/// A workspace's response topic.
pub fn response_topic(config_response: &str, workspace: &str) -> String {
    format!("{config_response}:{workspace}")
}

/// Whether `workspace` can be part of a topic's name (Pulsar takes letters, digits and
/// `-_=.:` there): a listed workspace named otherwise cannot be given a topic.
fn nameable(workspace: &str) -> bool {
    !workspace.is_empty()
        && workspace
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_=.:".contains(c))
}

/// The workspaces to answer for: the default one and every one listed.
fn wanted(store: &ConfigStore) -> Option<BTreeSet<String>> {
    match store.values_of(WORKSPACES_NAMESPACE, WORKSPACE_TYPE) {
        Ok((_, listed)) => Some(
            std::iter::once(DEFAULT_WORKSPACE.to_owned())
                .chain(listed.into_keys())
                .collect(),
        ),
        Err(e) => {
            // Only a poisoned lock: what is served stays as it was.
            tracing::error!(error = %e, "cannot read the workspaces listed; their config topics stay as they are");
            None
        }
    }
}

/// Where a workspace's topics are served.
pub struct Topics {
    pub config_request: String,
    pub config_response: String,
}

struct Served {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// Answers on the topics of each workspace wanted until `shutdown`, taking one up or dropping it
/// when `listed` says the list was written (and every [`RECHECK`]). Returns once every
/// workspace's consumer has drained.
pub async fn serve(
    bus: Bus,
    topics: Topics,
    store: Arc<ConfigStore>,
    pusher: Pusher,
    listed: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
) {
    let topics = Arc::new(topics);
    let mut served: BTreeMap<String, Served> = BTreeMap::new();
    let mut unnameable = BTreeSet::new();
    loop {
        if let Some(wanted) = wanted(&store) {
            // A workspace's consumer that ended by itself (it could not subscribe) is started again.
            served.retain(|_, served| !served.task.is_finished());
            let gone: Vec<String> = served
                .keys()
                .filter(|workspace| !wanted.contains(*workspace))
                .cloned()
                .collect();
            for workspace in gone {
                if let Some(dropped) = served.remove(&workspace) {
                    tracing::info!(%workspace, "workspace no longer listed: not answering on its config topic");
                    dropped.stopped().await;
                }
            }
            for workspace in wanted {
                if served.contains_key(&workspace) {
                    continue;
                }
                if !nameable(&workspace) {
                    if unnameable.insert(workspace.clone()) {
                        tracing::warn!(%workspace, "a listed workspace's name cannot be part of a topic's name; its config calls are answered only on the shared topic and over HTTP");
                    }
                    continue;
                }
                let stop = shutdown.child_token();
                let task = tokio::spawn(answer_for(
                    bus.clone(),
                    topics.clone(),
                    workspace.clone(),
                    store.clone(),
                    pusher.clone(),
                    stop.clone(),
                ));
                served.insert(workspace, Served { stop, task });
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = listed.notified() => {}
            _ = tokio::time::sleep(RECHECK) => {}
        }
    }
    // All told first, so that they drain together.
    for served in served.values() {
        served.stop.cancel();
    }
    for (_, served) in served {
        served.stopped().await;
    }
}

impl Served {
    /// Stops the consumer and waits for it to drain, at most [`STOP_WITHIN`].
    async fn stopped(mut self) {
        self.stop.cancel();
        if tokio::time::timeout(STOP_WITHIN, &mut self.task)
            .await
            .is_err()
        {
            tracing::warn!("a workspace's config consumer did not stop in time; left behind");
            self.task.abort();
        }
    }
}

/// Answers config calls on `workspace`'s topics until `stop`.
async fn answer_for(
    bus: Bus,
    topics: Arc<Topics>,
    workspace: String,
    store: Arc<ConfigStore>,
    pusher: Pusher,
    stop: CancellationToken,
) {
    let request_topic = request_topic(&topics.config_request, &workspace);
    // In a task of its own, never dropped midway (a producer given up on while it connects
    // leaves the crate's connection manager waiting on it), but not waited for past `stop`.
    let making = tokio::spawn({
        let (bus, topic) = (
            bus.clone(),
            response_topic(&topics.config_response, &workspace),
        );
        async move { Publisher::new(&bus, &topic).await }
    });
    let responses = tokio::select! {
        _ = stop.cancelled() => return,
        made = making => match made {
            Ok(Ok(responses)) => responses,
            Ok(Err(e)) => {
                tracing::warn!(%workspace, error = %e, "cannot answer on a workspace's config topic yet; trying again");
                return;
            }
            Err(e) => {
                tracing::error!(%workspace, error = %e, "making a workspace's config answers' producer failed");
                return;
            }
        },
    };
    // Dead letters of every workspace go with the shared topic's: a topic of their own, and the
    // subscription that keeps them, stayed on the broker after the workspace went.
    let subscription = crate::request_subscription(
        request_topic,
        agent_bus::dead_letter_of(&topics.config_request),
    );
    let scope = Arc::new(workspace.clone());
    let consumed = run_consumer(
        &bus,
        subscription,
        Arc::new(ConsumerStats::default()),
        stop,
        move |delivery: Delivery<ConfigRequest>| {
            let (store, responses, pusher) = (store.clone(), responses.clone(), pusher.clone());
            let scope = scope.clone();
            async move {
                if let Some(refusal) = refused_within(&delivery.payload, &scope) {
                    return crate::reply(&responses, &delivery.properties, &refusal, false).await;
                }
                let mut delivery = delivery;
                // The topic's workspace, whatever the body names: the topic is the caller's
                // permission (TrustGraph's gateway sends a caller's calls only to the workspaces
                // it may reach).
                delivery.payload.workspace = Some(scope.to_string());
                crate::answer(store, responses, pusher, delivery).await
            }
        },
    )
    .await;
    if let Err(e) = consumed {
        tracing::warn!(%workspace, error = %e, "a workspace's config topic is not answered; trying again");
    }
}

/// The refusal of `request` on `workspace`'s topic: an operation across workspaces (a caller
/// allowed one workspace must not read every workspace's values through it, and TrustGraph's
/// config service refuses them there too).
fn refused_within(request: &ConfigRequest, workspace: &str) -> Option<ConfigResponse> {
    let across = [operation::GET_VALUES_ALL_WS, operation::GET_KEYS_ALL_WS];
    across
        .contains(&request.operation.as_str())
        .then(|| ConfigResponse {
            error: Some(ErrorInfo {
                kind: crate::protocol::BAD_OPERATION.to_owned(),
                message: format!(
                    "'{}' reads every workspace: it is answered on the config request topic, not on workspace {workspace}'s",
                    request.operation
                ),
            }),
            ..ConfigResponse::default()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_across_workspaces_are_refused_on_a_workspaces_topic() {
        let call = |op: &str| ConfigRequest {
            operation: op.to_owned(),
            ..ConfigRequest::default()
        };
        for across in [operation::GET_VALUES_ALL_WS, operation::GET_KEYS_ALL_WS] {
            let refusal = refused_within(&call(across), "acme").and_then(|r| r.error);
            assert_eq!(
                refusal.map(|e| e.kind),
                Some(crate::protocol::BAD_OPERATION.to_owned())
            );
        }
        for within in [operation::GET, operation::PUT, operation::CONFIG] {
            assert_eq!(refused_within(&call(within), "acme"), None);
        }
    }

    #[test]
    fn a_workspace_named_as_no_topic_can_be_is_not_given_one() {
        assert!(nameable("acme"));
        assert!(nameable("team-1.prod_eu"));
        assert!(!nameable(""));
        assert!(!nameable("a/b"));
        assert!(!nameable("acme corp"));
    }
}
