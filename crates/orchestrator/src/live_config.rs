//! The config in force. It starts from the config directory, then follows the config service: a
//! full read of this workspace's config (TrustGraph 2.x scopes config by workspace) at start, after
//! every push that may concern it and once a minute (pushes are not persistent), and again at
//! once whenever a lost subscription to the pushes or the answers is back. A config
//! that does not validate is refused with a logged error and the last good one stays in force;
//! iterations read a snapshot, so a change never lands in the middle of one.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use agent_bus::{Bus, BusError, ConfigClient, ConfigPushes, Topics};
use agent_core::config::{AgentConfig, ConfigError};
use agent_schema::{operation, ConfigPush, ConfigRequest};
use tokio_util::sync::CancellationToken;

const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
const REREAD_EVERY: Duration = Duration::from_secs(60);
/// How soon a lost subscription (pushes or answers) is tried again, and the config read with it.
const RETRY_EVERY: Duration = Duration::from_secs(5);
/// The first pause before the pushes' subscription is made again, and the longest.
const RESUBSCRIBE_PAUSE: Duration = Duration::from_secs(1);
const RESUBSCRIBE_PAUSE_MAX: Duration = Duration::from_secs(30);

pub struct LiveConfig {
    in_force: RwLock<InForce>,
    /// The config directory's, which sets a floor under the service's (see
    /// [`AgentConfig::under_local_floor`]).
    local: Arc<AgentConfig>,
}

/// The config and the config service's version it came from (None: the local config).
struct InForce {
    version: Option<u64>,
    config: Arc<AgentConfig>,
}

impl LiveConfig {
    pub fn new(local: AgentConfig) -> LiveConfig {
        let local = Arc::new(local);
        LiveConfig {
            in_force: RwLock::new(InForce {
                version: None,
                config: local.clone(),
            }),
            local,
        }
    }

    fn read<T>(&self, f: impl FnOnce(&InForce) -> T) -> T {
        match self.in_force.read() {
            Ok(guard) => f(&guard),
            // A writer never panics while holding the lock; if one did, the value is still whole.
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }

    /// A snapshot for one iteration.
    pub fn current(&self) -> Arc<AgentConfig> {
        self.read(|in_force| in_force.config.clone())
    }

    /// The config service's version in force, if any.
    pub fn version(&self) -> Option<u64> {
        self.read(|in_force| in_force.version)
    }

    /// Validates `values` (type -> key -> JSON text, as the service keeps them) and puts them in
    /// force over the local config's floor, or leaves the current config and returns every
    /// problem.
    pub fn apply(
        &self,
        version: u64,
        values: &BTreeMap<String, BTreeMap<String, String>>,
    ) -> Result<(), Vec<ConfigError>> {
        self.apply_if_changed(version, values).map(|_| ())
    }

    /// [`LiveConfig::apply`], telling whether anything changed: the version, or the config under
    /// the same version (a config service whose store was emptied and seeded again counts its
    /// versions from the start, so an equal version is not the same config).
    pub fn apply_if_changed(
        &self,
        version: u64,
        values: &BTreeMap<String, BTreeMap<String, String>>,
    ) -> Result<bool, Vec<ConfigError>> {
        let sets_limits = values
            .get(agent_core::config::LIMITS_TYPE)
            .is_some_and(|limits| limits.contains_key("default"));
        let config = AgentConfig::from_texts(values)?.under_local_floor(&self.local, sets_limits);
        if self.version() == Some(version) && *self.current() == config {
            return Ok(false);
        }
        let in_force = InForce {
            version: Some(version),
            config: Arc::new(config),
        };
        match self.in_force.write() {
            Ok(mut guard) => *guard = in_force,
            Err(poisoned) => *poisoned.into_inner() = in_force,
        }
        Ok(true)
    }
}

/// Whether a push may change `workspace`'s config: it names the workspace under some type, or it
/// names nothing ("everything", as sent when a config service starts).
fn concerns(push: &ConfigPush, workspace: &str) -> bool {
    push.changes.is_empty()
        || push
            .changes
            .values()
            .any(|workspaces| workspaces.iter().any(|w| w == workspace))
}

/// How long a starting orchestrator waits for its first read of the config service before it
/// handles requests (a request must not run on the local config when a service has another). A
/// service answers in milliseconds; without one (the config requests go nowhere) the first
/// requests wait this long, and a slower answer still applies when it comes.
pub const FIRST_READ_WAIT: Duration = Duration::from_secs(2);

/// Follows `workspace`'s config in the config service until `shutdown`. Without a config service
/// nothing changes: the directory's config (or the built-in defaults) stays in force.
/// `first_read` is notified once the first read has been answered, refused or timed out.
///
/// The pushes and the answers come over subscriptions that a broker may end (an outage past the
/// client's retries, a topic unloaded and its subscribing refused). Lost answers are subscribed
/// again by the next read, tried every [`RETRY_EVERY`]; lost pushes are subscribed again beside
/// the reads, with a pause that grows while they keep ending, and the config is read at once when
/// they are back, since pushes sent meanwhile were lost: a replica never keeps a stale config
/// for good.
pub async fn follow(
    live: Arc<LiveConfig>,
    bus: Bus,
    topics: Topics,
    workspace: String,
    first_read: Arc<tokio::sync::Notify>,
    shutdown: CancellationToken,
) {
    let mut pushes = PushFollower::new(&bus, &topics);
    // A moment for the pushes' subscription, so that the first read comes after it and no push
    // falls between them; a broker that is slow to take it does not hold the first read up.
    tokio::select! {
        _ = shutdown.cancelled() => return,
        _ = pushes.settle() => {}
        _ = tokio::time::sleep(FIRST_READ_WAIT / 2) => {}
    }
    let mut client: Option<ConfigClient> = None;
    let mut announced_absence = false;
    // Whether the service answered a read yet, and whether it has been silent since it last did.
    let mut read_once = false;
    let mut silent_since_read = false;
    let mut troubled = false;
    let mut read_now = true;
    let mut next_read = tokio::time::Instant::now();
    loop {
        if read_now {
            let read = tokio::select! {
                _ = shutdown.cancelled() => return,
                read = read_config(&live, &mut client, &bus, &topics, &workspace) => read,
            };
            let was_troubled = troubled;
            troubled = match read {
                Ok(()) => {
                    if was_troubled || silent_since_read {
                        tracing::info!("the config service is read again");
                    }
                    read_once = true;
                    silent_since_read = false;
                    false
                }
                // No answer: most likely no config service runs, which is a deployment, not a
                // fault.
                Err(BusError::Timeout { .. }) => {
                    if read_once {
                        // It answered before: this is not a deployment without one, and the
                        // config read last may be stale.
                        if !silent_since_read {
                            tracing::warn!("the config service answered before and does not now; keeping the config read last");
                            silent_since_read = true;
                        }
                    } else if !announced_absence {
                        tracing::info!("no config service answered; using the local config");
                        announced_absence = true;
                    }
                    false
                }
                Err(e) => {
                    if was_troubled {
                        tracing::debug!(error = %e, "cannot read the config service yet");
                    } else {
                        tracing::warn!(error = %e, "cannot read the config service; trying again every {RETRY_EVERY:?}");
                    }
                    true
                }
            };
            // A permit is kept until the waiter comes; later reads add nothing to wait for.
            first_read.notify_one();
            let wait = if troubled || !pushes.following() {
                RETRY_EVERY
            } else {
                REREAD_EVERY
            };
            next_read = tokio::time::Instant::now() + wait;
        }
        read_now = tokio::select! {
            _ = shutdown.cancelled() => return,
            change = pushes.next_change(&workspace) => change,
            _ = tokio::time::sleep_until(next_read) => true,
        };
        if !pushes.following() {
            // Pushes lost since the last read: read on the shorter schedule until they are back.
            next_read = next_read.min(tokio::time::Instant::now() + RETRY_EVERY);
        }
    }
}

/// A subscription to config pushes on its way.
type Subscribing = Pin<Box<dyn Future<Output = Result<ConfigPushes, BusError>> + Send>>;

/// The subscription to config pushes, made again whenever it ends.
struct PushFollower {
    bus: Bus,
    topics: Topics,
    pushes: Option<ConfigPushes>,
    /// The subscription being made, after its pause.
    subscribing: Option<Subscribing>,
    /// When the subscription in hand was made, and the pause before the next try.
    subscribed_at: tokio::time::Instant,
    pause: Duration,
    /// The subscription was lost or refused since it last worked (said once, until it is back).
    lost: bool,
}

impl PushFollower {
    fn new(bus: &Bus, topics: &Topics) -> PushFollower {
        let mut follower = PushFollower {
            bus: bus.clone(),
            topics: topics.clone(),
            pushes: None,
            subscribing: None,
            subscribed_at: tokio::time::Instant::now(),
            pause: Duration::ZERO,
            lost: false,
        };
        follower.subscribe_after(Duration::ZERO);
        follower
    }

    fn following(&self) -> bool {
        self.pushes.is_some()
    }

    fn subscribe_after(&mut self, pause: Duration) {
        let (bus, topics) = (self.bus.clone(), self.topics.clone());
        self.subscribing = Some(Box::pin(async move {
            tokio::time::sleep(pause).await;
            ConfigPushes::subscribe(&bus, &topics).await
        }));
    }

    /// Waits for the subscription being made, if any.
    async fn settle(&mut self) {
        if let Some(subscribing) = self.subscribing.as_mut() {
            let subscribed = subscribing.await;
            self.subscribing = None;
            self.took(subscribed);
        }
    }

    fn took(&mut self, subscribed: Result<ConfigPushes, BusError>) {
        match subscribed {
            Ok(pushes) => {
                if self.lost {
                    tracing::info!("following config pushes again");
                    self.lost = false;
                }
                self.pushes = Some(pushes);
                self.subscribed_at = tokio::time::Instant::now();
            }
            Err(e) => {
                if self.lost {
                    tracing::debug!(error = %e, "cannot follow config pushes yet");
                } else {
                    tracing::warn!(error = %e, "cannot follow config pushes; reading the config every {RETRY_EVERY:?} until they are back");
                    self.lost = true;
                }
                self.pause = self.next_pause();
                self.subscribe_after(self.pause);
            }
        }
    }

    /// The pause before subscribing again: a second, doubling while subscriptions keep ending
    /// soon after they are made (so that one that ends at once does not spin), back to a second
    /// after one that lasted.
    fn next_pause(&self) -> Duration {
        if self.pushes.is_some() && self.subscribed_at.elapsed() > RESUBSCRIBE_PAUSE_MAX * 2 {
            RESUBSCRIBE_PAUSE
        } else {
            (self.pause * 2).clamp(RESUBSCRIBE_PAUSE, RESUBSCRIBE_PAUSE_MAX)
        }
    }

    /// Waits for something that calls for a read: a push that may concern `workspace` (true),
    /// or the subscription made again after it was lost (true). A lost subscription or a refused
    /// try answers false: nothing new to read.
    async fn next_change(&mut self, workspace: &str) -> bool {
        if let Some(pushes) = self.pushes.as_mut() {
            loop {
                match pushes.next().await {
                    Ok(push) if !concerns(&push, workspace) => continue,
                    Ok(_) => return true,
                    Err(e) => {
                        tracing::warn!(error = %e, "config pushes stopped; subscribing again");
                        self.lost = true;
                        self.pause = self.next_pause();
                        self.pushes = None;
                        self.subscribe_after(self.pause);
                        return false;
                    }
                }
            }
        }
        match self.subscribing.as_mut() {
            Some(subscribing) => {
                let subscribed = subscribing.await;
                self.subscribing = None;
                let made = subscribed.is_ok();
                self.took(subscribed);
                made
            }
            None => std::future::pending().await,
        }
    }
}

/// One full read of `workspace`'s config, put in force when it is new and valid. An answer the
/// service gives (a refusal, an invalid config) is logged here; a failure to get one is returned.
async fn read_config(
    live: &LiveConfig,
    client: &mut Option<ConfigClient>,
    bus: &Bus,
    topics: &Topics,
    workspace: &str,
) -> Result<(), BusError> {
    if client.is_none() {
        *client = Some(ConfigClient::connect(bus, topics).await?);
    }
    let Some(client) = client.as_mut() else {
        return Ok(());
    };
    let response = client
        .call(
            &ConfigRequest {
                operation: operation::CONFIG.to_owned(),
                workspace: Some(workspace.to_owned()),
                ..ConfigRequest::default()
            },
            ANSWER_TIMEOUT,
        )
        .await?;
    if let Some(error) = response.error {
        tracing::warn!(?error, "the config service refused to answer");
        return Ok(());
    }
    let version = response.version.unwrap_or(0);
    let values = response.config.unwrap_or_default();
    let known = live.version() == Some(version);
    match live.apply_if_changed(version, &values) {
        Ok(false) => {}
        Ok(true) if known => tracing::warn!(
            version,
            "the config service answered another config under the version in force (its store was emptied and seeded again?); it is in force now"
        ),
        Ok(true) => tracing::info!(version, "config in force"),
        Err(errors) => {
            let lines: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            tracing::error!(
                version,
                kept = ?live.version(),
                problems = %lines.join("; "),
                "refusing an invalid config; the last good one stays in force"
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(entries: &[(&str, &str, &str)]) -> BTreeMap<String, BTreeMap<String, String>> {
        let mut map: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
        for (kind, key, value) in entries {
            map.entry((*kind).into())
                .or_default()
                .insert((*key).into(), (*value).into());
        }
        map
    }

    #[test]
    fn only_pushes_that_may_concern_the_workspace_cause_a_read() {
        let push = |changes: &[(&str, &[&str])]| ConfigPush {
            version: 1,
            changes: changes
                .iter()
                .map(|(kind, spaces)| {
                    (
                        (*kind).to_owned(),
                        spaces.iter().map(|s| (*s).to_owned()).collect(),
                    )
                })
                .collect(),
            workspace_changes: None,
        };
        assert!(concerns(&push(&[]), "default"));
        assert!(concerns(
            &push(&[("tool", &["team", "default"])]),
            "default"
        ));
        assert!(!concerns(&push(&[("tool", &["team"])]), "default"));
    }

    /// TrustGraph's own config service knows nothing of `agent-limits`: its config must not put
    /// the built-in limits (no approval groups) in place of the operator's, nor a value of a type
    /// the orchestrator never reads stop its config from being read.
    #[test]
    fn the_services_config_keeps_the_local_limits_and_approvals() {
        let mut local = AgentConfig::from_texts(&values(&[
            (
                "agent-limits",
                "default",
                r#"{"max_iterations": 4, "approval_groups": ["payments"]}"#,
            ),
            (
                "tool",
                "pay",
                r#"{"name": "pay", "description": "d", "type": "llm", "group": ["payments"]}"#,
            ),
        ]))
        .unwrap();
        local.limits.max_tokens = 77;
        let live = LiveConfig::new(local);
        let pay_ungrouped = r#"{"name": "pay", "description": "Pays", "type": "llm"}"#;
        live.apply(
            1,
            &values(&[
                ("tool", "pay", pay_ungrouped),
                ("flow", "default", "not json at all"),
            ]),
        )
        .unwrap();
        let config = live.current();
        assert_eq!(config.limits.max_iterations, 4);
        assert_eq!(config.limits.max_tokens, 77);
        assert!(config.needs_approval(&config.tools["pay"]));
        // The service sets limits of its own: they apply, and the local approval groups with them.
        live.apply(
            2,
            &values(&[
                ("tool", "pay", pay_ungrouped),
                (
                    "agent-limits",
                    "default",
                    r#"{"max_iterations": 6, "approval_groups": ["ops"]}"#,
                ),
            ]),
        )
        .unwrap();
        let config = live.current();
        assert_eq!(config.limits.max_iterations, 6);
        assert_eq!(config.limits.approval_groups, ["ops", "payments"]);
        assert!(config.needs_approval(&config.tools["pay"]));
    }

    #[test]
    fn a_bad_config_is_refused_and_the_last_good_one_stays() {
        let live = LiveConfig::new(AgentConfig::default());
        live.apply(
            3,
            &values(&[("agent-limits", "default", r#"{"max_iterations": 4}"#)]),
        )
        .unwrap();
        assert_eq!(live.current().limits.max_iterations, 4);
        let errors = live
            .apply(
                4,
                &values(&[
                    ("agent-limits", "default", r#"{"max_iterations": 0}"#),
                    ("tool", "x", "{not json"),
                ]),
            )
            .unwrap_err();
        // Every problem at once: the text that is not JSON and the limit that cannot work.
        assert_eq!(errors.len(), 2, "{errors:?}");
        assert!(errors.iter().any(|e| e.message.starts_with("not JSON")));
        let errors = live
            .apply(
                5,
                &values(&[("agent-limits", "default", r#"{"max_iterations": 0}"#)]),
            )
            .unwrap_err();
        assert!(errors[0].to_string().contains("max_iterations"));
        assert_eq!(live.current().limits.max_iterations, 4);
        assert_eq!(live.version(), Some(3));
    }
}
