//! config-svc: the config API. TrustGraph 2.x's config protocol over Pulsar (`get`, `list`,
//! `getvalues`, `put`, `delete`, `config` within a workspace; `getvalues-all-ws`,
//! `getkeys-all-ws`) on the shared request topic, and within one workspace on each listed
//! workspace's own (where TrustGraph's API gateway sends them); the same operations over HTTP
//! where TrustGraph's API gateway serves them (so its CLI works), a REST API for people with
//! bearer-token writes, a `ConfigPush` after every write that changed something, and an
//! embedded durable store.
//! One process owns a store directory, and one config service serves a deployment's config
//! subscription (a second, with a store of its own, hears the first on the broker and exits).

pub mod http;
pub mod protocol;
use agent_config_files as seed;
pub mod store;
pub mod workspace_topics;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agent_bus::owner_fence::{self, Owner, Role};
use agent_bus::{
    run_consumer, BrokerArgs, ConsumerStats, Delivery, Disposition, Properties, Publisher,
    SubscriptionConfig,
};
use agent_schema::{
    ConfigPush, ConfigRequest, WorkspaceChanges, ID_PROPERTY, WORKSPACES_NAMESPACE, WORKSPACE_TYPE,
};
use anyhow::Context;
use tokio_util::sync::CancellationToken;

use crate::store::{ConfigStore, Written};

#[derive(clap::Args, Debug, Clone)]
pub struct ConfigSvcSettings {
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Where the store lives (`config.json` inside).
    #[arg(long, env = "CONFIG_DATA", default_value = ".data/config")]
    pub data_dir: PathBuf,
    /// Where to serve the REST API.
    #[arg(long, env = "CONFIG_HTTP_ADDR", default_value = "127.0.0.1:8088")]
    pub http_addr: SocketAddr,
    /// Bearer token that REST writes must carry; without one they are refused.
    #[arg(long, env = "CONFIG_TOKEN", hide_env_values = true)]
    pub config_token: Option<String>,
    /// A directory of `<type>.json` files whose missing keys are added at start (never overwriting).
    #[arg(long)]
    pub seed: Option<PathBuf>,
    #[command(flatten)]
    pub http: agent_serve::HttpBounds,
    /// Secret shared with the other services: this service's announcements to other config
    /// services are sealed with it, and only sealed ones are heard (a forged one would stand it
    /// down).
    #[arg(long, env = "AGENT_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<String>,
    /// How long a config service listens on the broker for another one serving the same
    /// subscription before it serves (counted while it hears its own announcements).
    #[arg(long, env = "CONFIG_OWNER_LISTEN_MS", default_value_t = 1_000)]
    pub owner_listen_ms: u64,
}

/// The subscription config-svc answers the config request topic on.
pub const SUBSCRIPTION: &str = "config-svc";

/// The config, kept to one config service on [`SUBSCRIPTION`] (`agent_bus::owner_fence`): two,
/// each with a store of its own (a StatefulSet scaled past one replica, each with its volume),
/// would each answer some of the requests and writes from their own values, and push versions
/// of their own, which TrustGraph's services take in whatever order they come.
pub const CONFIG_OWNERS: Role = Role {
    owned: "the config",
    service: "config service",
    beacon: "config-owner",
    sealed_as: "config-owner",
    advice: "run one config service (one replica: the orchestrators keep their last good config while it restarts)",
};

/// Publishes a [`ConfigPush`] for a write that changed something. A push the broker does not
/// take is owed: what it announced is sent again, with what later writes announce meanwhile (see
/// [`Pusher::resend_owed`]). TrustGraph's services re-read a type only when a push names it, so a
/// push lost to a broker outage left them on the old values until the next write, however long.
#[derive(Clone)]
pub struct Pusher {
    publisher: Publisher,
    /// Held from a write until its push is sent, so pushes leave in the order of their versions:
    /// TrustGraph's receivers take a push only if its version is above the one they hold, so a
    /// push overtaken by a later one was dropped, and the change it announced never applied.
    in_order: Arc<tokio::sync::Mutex<()>>,
    /// What pushes that were not published announced, touched only by the holder of a turn.
    owed: Arc<std::sync::Mutex<Option<News>>>,
    /// Wakes [`Pusher::resend_owed`] when a push fails.
    failed: Arc<tokio::sync::Notify>,
    /// What is announced: told what went (see [`ConfigStore::announced_through`]).
    store: Arc<ConfigStore>,
    /// Told of every write to the list of workspaces, whose config topics are answered
    /// ([`workspace_topics::serve`]).
    listed: Arc<tokio::sync::Notify>,
}

/// A push's changes: config type -> workspaces. Empty: everything may have changed.
type Changes = std::collections::BTreeMap<String, Vec<String>>;

/// What one push announces, or what several owed do together.
#[derive(Debug, Clone, Default, PartialEq)]
struct News {
    /// The types changed (empty: everything); none when it only says that workspaces were made
    /// or removed.
    changes: Option<Changes>,
    /// Workspaces made or removed (TrustGraph 2.11's services take up a workspace's queues, and
    /// drop them, on hearing this; they never re-read the list while they run).
    workspaces: WorkspaceChanges,
}

impl News {
    fn everything() -> News {
        News {
            changes: Some(Changes::new()),
            workspaces: WorkspaceChanges::default(),
        }
    }

    fn is_nothing(&self) -> bool {
        self.changes.is_none() && self.workspaces.is_empty()
    }

    /// `self`, then `later`, as one.
    fn then(self, later: News) -> News {
        News {
            changes: match (self.changes, later.changes) {
                (Some(earlier), Some(later)) => Some(together(earlier, later)),
                (earlier, later) => earlier.or(later),
            },
            workspaces: self.workspaces.then(later.workspaces),
        }
    }

    /// As TrustGraph's services read it, at `version`: no types named when it only says that
    /// workspaces were made or removed, as TrustGraph's config service sends that.
    fn at(&self, version: u64) -> ConfigPush {
        ConfigPush {
            version,
            changes: self.changes.clone().unwrap_or_default(),
            workspace_changes: (!self.workspaces.is_empty()).then(|| self.workspaces.clone()),
        }
    }
}

/// The first pause before owed changes are sent again, and the longest.
const RESEND_FIRST: Duration = Duration::from_secs(1);
const RESEND_MOST: Duration = Duration::from_secs(10);

/// The workspace of a request that names none.
pub const DEFAULT_WORKSPACE: &str = "default";

impl Pusher {
    pub fn new(publisher: Publisher, store: Arc<ConfigStore>) -> Pusher {
        Pusher {
            publisher,
            in_order: Arc::default(),
            owed: Arc::default(),
            failed: Arc::default(),
            store,
            listed: Arc::default(),
        }
    }

    /// Woken by every write to the list of workspaces.
    pub(crate) fn listed(&self) -> Arc<tokio::sync::Notify> {
        self.listed.clone()
    }

    /// A write's turn: held until its push is sent (see [`Pusher::push`]).
    pub(crate) async fn turn(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.in_order.lock().await
    }

    /// Announces `written` (in `workspace`) when it changed something. As in TrustGraph, a
    /// reserved workspace (`_` first, such as `__template__`) is storage only: its values are
    /// never announced; but a workspace listed in `__workspaces__` or taken off it is, as
    /// TrustGraph 2.11's config service announces it (without, its services took up a workspace
    /// made while they ran only once they restarted), with the types the template filled in it.
    pub async fn push(&self, written: Written, workspace: &str) {
        if written.changes.is_empty() {
            return;
        }
        let mut named = Changes::new();
        if !workspace.starts_with('_') {
            for kind in written.changes.keys() {
                named.insert(kind.clone(), vec![workspace.to_owned()]);
            }
        }
        // A workspace the listing made and filled from the template, with every type it holds:
        // TrustGraph's services take a workspace up first, then read the types a push names.
        for (made, kinds) in &written.provisioned {
            if made.starts_with('_') {
                continue;
            }
            for kind in kinds {
                named.entry(kind.clone()).or_default().push(made.clone());
            }
        }
        let news = News {
            changes: (!named.is_empty()).then_some(named),
            workspaces: self.workspaces_changed(&written, workspace),
        };
        if workspace == WORKSPACES_NAMESPACE {
            self.listed.notify_one();
        }
        if !news.is_nothing() {
            self.announce(written.version, news).await;
        }
    }

    /// The workspaces `written` in `workspace` made or removed: read under the write's turn, so
    /// the list is as the write left it. A key listed now was made (TrustGraph calls every put of
    /// one a creation), one gone was removed.
    fn workspaces_changed(&self, written: &Written, workspace: &str) -> WorkspaceChanges {
        let mut changed = WorkspaceChanges::default();
        let Some(keys) = written
            .changes
            .get(WORKSPACE_TYPE)
            .filter(|_| workspace == WORKSPACES_NAMESPACE)
        else {
            return changed;
        };
        let listed = match self.store.values_of(WORKSPACES_NAMESPACE, WORKSPACE_TYPE) {
            Ok((_, listed)) => listed,
            Err(e) => {
                // Only a lock poisoned by a panic. Whether they were made or removed cannot be
                // told: saying the wrong one would have TrustGraph's services serve a removed
                // workspace, or drop a live one.
                tracing::error!(error = %e, keys = ?keys, "cannot read the workspaces a write changed; not announcing them");
                return changed;
            }
        };
        for key in keys {
            if listed.contains_key(key) {
                changed.created.push(key.clone());
            } else {
                changed.deleted.push(key.clone());
            }
        }
        changed
    }

    /// "Everything may have changed", sent at start as TrustGraph does, but naming every type in
    /// every workspace the store holds. TrustGraph's services skip a push that names no type of
    /// theirs, so TrustGraph's own start push (which names none) is for its readers no news: a
    /// change whose push was still owed when the service stopped (the broker was away) reached
    /// them only when they restarted. Named, a service behind re-reads each type; one that has
    /// seen this version skips it as before. Every workspace listed is said made too: a service
    /// takes up only one it does not serve yet, so one made while the last run still owed its
    /// push is taken up now; and every one taken off the list whose removal may not have been
    /// announced is said removed (a service drops only one it serves).
    pub async fn push_all(&self) {
        match self.everything() {
            Ok((version, news)) => self.announce(version, news).await,
            // The store was read a moment ago (seeded, or opened): a lock poisoned since by a
            // panic, which no write leaves half done. Owed, it goes with the next resend.
            Err(e) => {
                tracing::error!(error = %e, "cannot read the config store for the start's push; it is sent again");
                self.owe(News::everything());
            }
        }
    }

    /// Sends `news` at `version` (the caller holds a turn), or, while an earlier push is owed,
    /// adds it to what is owed for [`Pusher::resend_owed`] to send: during a broker outage each
    /// write waited out a send of its own (30 s), and with the resend's before it went past its
    /// client's time (`agentctl config` gives up after 60 s) though the write was saved.
    async fn announce(&self, version: u64, news: News) {
        if self.owed_nothing() {
            self.send(version, news).await;
        } else {
            self.owe(news);
        }
    }

    /// "Everything" as a push says it, read at once: every type (see [`ConfigStore::every_type`]),
    /// every listed workspace made, and every one taken off the list whose removal may not have
    /// been announced removed.
    fn everything(&self) -> Result<(u64, News), store::StoreError> {
        let all = self.store.everything()?;
        let news = News {
            changes: Some(all.types),
            workspaces: WorkspaceChanges {
                created: all.listed,
                deleted: all.unlisted,
            },
        };
        Ok((all.version, news))
    }

    /// Publishes `news` at `version` (the caller holds a turn); if the broker does not take it,
    /// it is owed. Refused as too large (it never will be taken), the push naming no type goes
    /// instead, with the workspaces made or removed if that is small enough, else naming
    /// nothing: our orchestrators take it as everything (TrustGraph's services skip the types,
    /// and re-read at their next start), rather than owing what can never be sent.
    async fn send(&self, version: u64, news: News) -> bool {
        let mut push = news.at(version);
        let mut whole = true;
        loop {
            match self
                .publisher
                .send(agent_schema::encode(&push), &Properties::new())
                .await
            {
                Ok(()) => {
                    // Every change up to this version was in it or in a push before it (a push
                    // goes only when nothing is owed, and what is owed goes at the latest
                    // version); sent naming nothing, TrustGraph's services heard none of it.
                    if whole {
                        self.store.announced_through(push.version);
                    } else {
                        self.store.announced_in_part();
                    }
                    return true;
                }
                Err(agent_bus::BusError::TooLarge { bytes, max, .. })
                    if !push.changes.is_empty() || push.workspace_changes.is_some() =>
                {
                    whole = false;
                    let dropped = smaller(&mut push);
                    tracing::warn!(
                        version = push.version,
                        bytes,
                        max,
                        "a config push is larger than the broker takes; sending it without {dropped}"
                    );
                }
                Err(e) => {
                    tracing::error!(error = %e, version = push.version, "config push not published; it is sent again once the broker takes it");
                    self.owe(news);
                    return false;
                }
            }
        }
    }

    /// Adds `news` to what is owed, and wakes the resend.
    fn owe(&self, news: News) {
        let mut owed = self.owed();
        *owed = Some(match owed.take() {
            Some(earlier) => earlier.then(news),
            None => news,
        });
        drop(owed);
        self.failed.notify_one();
    }

    /// What is owed; every holder leaves it whole, so a poisoned lock's value stands.
    fn owed(&self) -> std::sync::MutexGuard<'_, Option<News>> {
        self.owed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sends what failed pushes owe, at `store`'s version, until `shutdown`: after a pause of a
    /// second, doubling up to ten while the broker still does not take it. Under a turn, so the
    /// version read is the latest and nothing is pushed meanwhile: owed changes never go under a
    /// version older than a push that went. "Everything" owed is sent naming every type the
    /// store holds (see [`Pusher::push_all`]).
    pub async fn resend_owed(self, shutdown: CancellationToken) {
        let store = self.store.clone();
        let mut pause = RESEND_FIRST;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = self.failed.notified() => {}
            }
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(pause) => {}
                }
                let _turn = self.turn().await;
                let Some(owed) = self.owed().take() else {
                    pause = RESEND_FIRST;
                    break;
                };
                let read = match &owed.changes {
                    // The store's lists are the latest word on which workspaces came and went.
                    Some(changes) if changes.is_empty() => {
                        self.everything().map(|(version, all)| {
                            let named = News {
                                changes: all.changes,
                                workspaces: owed.workspaces.clone().then(all.workspaces),
                            };
                            (version, named)
                        })
                    }
                    _ => store.version().map(|version| (version, owed.clone())),
                };
                let (version, news) = match read {
                    Ok(read) => read,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot read the config store to send the changes owed");
                        self.owe(owed);
                        pause = (pause * 2).min(RESEND_MOST);
                        continue;
                    }
                };
                if self.send(version, news).await {
                    tracing::info!(
                        version,
                        "the config changes owed since a push failed are announced"
                    );
                    pause = RESEND_FIRST;
                    break;
                }
                pause = (pause * 2).min(RESEND_MOST);
            }
            if shutdown.is_cancelled() {
                break;
            }
        }
        if !self.owed_nothing() {
            tracing::warn!("stopping with config changes never announced: readers see them at their next full read");
        }
    }

    fn owed_nothing(&self) -> bool {
        self.owed().is_none()
    }
}

/// Makes `push`, refused as larger than the broker takes, smaller; what it left out. The types
/// first: the start's push names every type of every workspace, while the workspaces made or
/// removed are few, and only a push says them.
fn smaller(push: &mut ConfigPush) -> &'static str {
    if !push.changes.is_empty() {
        push.changes = Changes::new();
        "the types it names"
    } else {
        push.workspace_changes = None;
        "the workspaces made or removed it names"
    }
}

/// The changes of two pushes as one: every type with every workspace named for it, or everything
/// when either says everything.
fn together(mut owed: Changes, changes: Changes) -> Changes {
    if owed.is_empty() || changes.is_empty() {
        return Changes::new();
    }
    for (kind, workspaces) in changes {
        let into = owed.entry(kind).or_default();
        for workspace in workspaces {
            if !into.contains(&workspace) {
                into.push(workspace);
            }
        }
    }
    owed
}

/// Runs a store call on the blocking pool: writes fsync, which must not hold up async workers.
pub(crate) async fn off_thread<T: Send + 'static>(
    store: &Arc<ConfigStore>,
    call: impl FnOnce(&ConfigStore) -> T + Send + 'static,
) -> Result<T, tokio::task::JoinError> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || call(&store)).await
}

/// How long a start waits for another process to let go of the store before it gives up: a
/// restart's predecessor may still be closing it (a container replaced, a service restarted by
/// its supervisor while the old process exits).
const STORE_IN_USE_WAIT: Duration = Duration::from_secs(10);

/// The store in `dir`, waiting [`STORE_IN_USE_WAIT`] for another process that holds it.
async fn open_store(
    dir: &std::path::Path,
    shutdown: &CancellationToken,
) -> anyhow::Result<ConfigStore> {
    let deadline = tokio::time::Instant::now() + STORE_IN_USE_WAIT;
    let mut said = false;
    loop {
        match ConfigStore::open(dir) {
            Err(store::StoreError::InUse { holder, .. })
                if tokio::time::Instant::now() < deadline && !shutdown.is_cancelled() =>
            {
                if !said {
                    tracing::warn!(dir = %dir.display(), %holder, "the config store is in use by another process; waiting for it to let go");
                    said = true;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            opened => {
                return opened
                    .with_context(|| format!("opening the config store in {}", dir.display()))
            }
        }
    }
}

/// Runs until `shutdown`: seeding, the REST API and the Pulsar protocol.
pub async fn run(settings: ConfigSvcSettings, shutdown: CancellationToken) -> anyhow::Result<()> {
    agent_bus::seal::refuse_published_secrets(&[
        ("CONFIG_TOKEN", settings.config_token.as_deref()),
        ("AGENT_SEAL_KEY", settings.seal_key.as_deref()),
    ])
    .map_err(anyhow::Error::msg)?;
    // Its start, first: of two started on one subscription, the first started keeps it.
    let owner = Owner::this_process(&store_name(&settings.data_dir));
    let store = Arc::new(open_store(&settings.data_dir, &shutdown).await?);
    let bus = settings.broker.connect().await?;
    let topics = settings.broker.topics();
    // Nothing is written, pushed or served before this process knows it is the only one.
    let seal = settings
        .seal_key
        .as_deref()
        .map(str::trim)
        .filter(|key| !key.is_empty())
        .map(|key| agent_bus::seal::SealKey::new(key.as_bytes()));
    if seal.is_none() {
        tracing::warn!("no AGENT_SEAL_KEY: this config service's announcements to other config services are not sealed, and one that has the key does not hear them (so neither stands down); anyone who can publish on the broker can stand it down with a forged one");
    }
    let (fence, announcer) = owner_fence::listening(CONFIG_OWNERS, seal);
    // The announcements stop whenever this returns, on any path: a process that failed must not
    // go on claiming the config.
    let announcing_stops = shutdown.child_token();
    let _stop_announcing = announcing_stops.clone().drop_guard();
    let announcing = announcer
        .start(
            &bus,
            &owner_fence::beacon_topic(&CONFIG_OWNERS, &topics.config_request, SUBSCRIPTION),
            owner,
            Duration::from_millis(settings.owner_listen_ms),
            None,
            announcing_stops.clone(),
            shutdown.clone(),
        )
        .await?;
    if let Err(why) = fence.admitted().await {
        // Not refused: asked to stop, or the fence's task ended by itself (which must not pass
        // for a clean stop).
        if fence.refusal().is_none() && shutdown.is_cancelled() {
            // Asked to stop while it listened.
            return Ok(());
        }
        anyhow::bail!(why);
    }
    let pusher = Pusher::new(
        Publisher::new(&bus, &topics.config_push).await?,
        store.clone(),
    );
    tokio::spawn(pusher.clone().resend_owed(shutdown.clone()));
    // The start's pushes take a turn as writes do: what is owed is touched only under one.
    let start_turn = pusher.turn().await;
    if let Some(dir) = &settings.seed {
        let values = seed::read_dir(dir).map_err(|errors| {
            let lines: Vec<String> = errors.iter().map(|e| format!("  {e}")).collect();
            anyhow::anyhow!("invalid seed files:\n{}", lines.join("\n"))
        })?;
        let written = store.put_missing(DEFAULT_WORKSPACE, &seed::entries(&values))?;
        let added: usize = written.changes.values().map(Vec::len).sum();
        tracing::info!(dir = %dir.display(), added, version = written.version, "seeded");
    }
    // One push for the seed and whatever the last run still owed: a push of the seed's types
    // alone at this version would have TrustGraph's services skip this one, of the same version.
    pusher.push_all().await;
    drop(start_turn);

    let token = settings.config_token.clone().filter(|t| !t.is_empty());
    let listener = tokio::net::TcpListener::bind(settings.http_addr)
        .await
        .with_context(|| format!("binding {}", settings.http_addr))?;
    tracing::info!(addr = %listener.local_addr()?, "serving the config REST API");
    protocol::describe_metrics();
    let app = http::router(store.clone(), token, pusher.clone());
    let server = tokio::spawn(agent_serve::serve(
        "config",
        listener,
        app,
        settings.http.clone(),
        // Its answers are a workspace's values at most.
        agent_serve::SMALL_ANSWERS_STALL,
        shutdown.clone(),
    ));

    // Stopped on any path out, as the announcements are.
    let workspaces_stop = shutdown.child_token();
    let _stop_workspaces = workspaces_stop.clone().drop_guard();
    let workspaces = tokio::spawn(workspace_topics::serve(
        bus.clone(),
        workspace_topics::Topics {
            config_request: topics.config_request.clone(),
            config_response: topics.config_response.clone(),
        },
        store.clone(),
        pusher.clone(),
        pusher.listed(),
        workspaces_stop,
    ));
    let responses = Publisher::new(&bus, &topics.config_response).await?;
    let subscription = request_subscription(
        topics.config_request.clone(),
        // Persistent, so that the broker keeps what is dead-lettered (TrustGraph's request topics
        // are not): on a non-persistent topic it was gone unless someone read it as it came.
        agent_bus::dead_letter_of(&topics.config_request),
    );
    let handler_store = store.clone();
    let consumed = run_consumer(
        &bus,
        subscription,
        Arc::new(ConsumerStats::default()),
        shutdown.clone(),
        move |delivery: Delivery<ConfigRequest>| {
            let store = handler_store.clone();
            let responses = responses.clone();
            let pusher = pusher.clone();
            async move { answer(store, responses, pusher, delivery).await }
        },
    )
    .await;
    shutdown.cancel();
    let _ = workspaces.await;
    let http = agent_bus::http_stopped(server, agent_bus::HTTP_DRAIN).await;
    let _ = announcing.await;
    if let Some(why) = fence.refusal() {
        anyhow::bail!(why);
    }
    http?;
    consumed?;
    Ok(())
}

/// How config-svc consumes a config request topic (the shared one, or a workspace's).
fn request_subscription(topic: String, dead_letter_topic: String) -> SubscriptionConfig {
    SubscriptionConfig {
        topic,
        dead_letter_topic,
        subscription: SUBSCRIPTION.to_owned(),
        max_in_flight: 1,
        max_redeliveries: Some(5),
        drain_deadline: Duration::from_secs(5),
        nack_delay: Duration::from_millis(200),
        one_at_a_time: false,
    }
}

/// The store in `dir` as another config service's refusal names it: with the host, since the
/// replicas of one deployment all keep it at the same path.
fn store_name(dir: &std::path::Path) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|host| host.trim().to_owned())
        .filter(|host| !host.is_empty());
    match host {
        Some(host) => format!("{} on {host}", dir.display()),
        None => dir.display().to_string(),
    }
}

/// Answers `request` off the async workers and announces what it wrote: the same for a request
/// over Pulsar and one over HTTP.
pub(crate) async fn answer_and_announce(
    store: &Arc<ConfigStore>,
    pusher: &Pusher,
    request: ConfigRequest,
) -> Result<agent_schema::ConfigResponse, tokio::task::JoinError> {
    answer_and_tell(store, pusher, request)
        .await
        .map(|(response, _)| response)
}

/// [`answer_and_announce`], saying whether it wrote.
async fn answer_and_tell(
    store: &Arc<ConfigStore>,
    pusher: &Pusher,
    request: ConfigRequest,
) -> Result<(agent_schema::ConfigResponse, bool), tokio::task::JoinError> {
    let (store, pusher) = (store.clone(), pusher.clone());
    // The write and its push are one task: a caller dropped between them (an HTTP client gone
    // before its answer) left the write saved and never announced, and TrustGraph's services
    // re-read a type only when a push names it.
    tokio::spawn(async move {
        let workspace = protocol::workspace_of(&request).to_owned();
        let _turn = match protocol::writes(&request) {
            true => Some(pusher.turn().await),
            false => None,
        };
        let (response, written) =
            off_thread(&store, move |store| protocol::handle(store, &request)).await?;
        let wrote = written.is_some();
        if let Some(written) = written {
            pusher.push(written, &workspace).await;
        }
        Ok((response, wrote))
    })
    .await?
}

async fn answer(
    store: Arc<ConfigStore>,
    responses: Publisher,
    pusher: Pusher,
    delivery: Delivery<ConfigRequest>,
) -> Disposition {
    let (response, wrote) = match answer_and_tell(&store, &pusher, delivery.payload).await {
        Ok(answered) => answered,
        Err(e) => return Disposition::Nack(format!("config handler failed: {e}")),
    };
    reply(&responses, &delivery.properties, &response, wrote).await
}

/// Sends `response` to the call whose properties are `asked` (`wrote`: whether the call wrote).
async fn reply(
    responses: &Publisher,
    asked: &Properties,
    response: &agent_schema::ConfigResponse,
    wrote: bool,
) -> Disposition {
    // A write is committed whether or not its answer goes: handled again (the consumer does
    // that for a nack on a non-persistent topic) it would be written again, over anything
    // written meanwhile. Its sender, unanswered, asks again.
    let failed = |e: String| {
        if wrote {
            tracing::warn!(error = %e, "the answer to a config write was not sent; the write stands");
            Disposition::Ack
        } else {
            Disposition::Nack(e)
        }
    };
    let mut properties = Properties::new();
    if let Some(id) = asked.get(ID_PROPERTY) {
        properties.insert(ID_PROPERTY.to_owned(), id.clone());
    }
    match responses
        .send(agent_schema::encode(response), &properties)
        .await
    {
        Ok(()) => Disposition::Ack,
        // An answer over the broker's limit will never go: sent again it fails again, and the
        // reader only ever sees no answer (an orchestrator takes that for no config service, and
        // keeps the config it read last without a word). It is told why instead.
        Err(e @ agent_bus::BusError::TooLarge { .. }) => {
            tracing::warn!(error = %e, "a config answer is over the broker's message limit; answering with an error");
            let refusal = agent_schema::ConfigResponse {
                version: response.version,
                error: Some(agent_schema::ErrorInfo {
                    kind: "too-large".to_owned(),
                    message: format!(
                        "the answer is over the broker's message limit ({e}): ask for fewer types, or keep large values out of the config"
                    ),
                }),
                ..agent_schema::ConfigResponse::default()
            };
            match responses
                .send(agent_schema::encode(&refusal), &properties)
                .await
            {
                Ok(()) => Disposition::Ack,
                Err(e) => failed(e.to_string()),
            }
        }
        Err(e) => failed(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(entries: &[(&str, &[&str])]) -> Changes {
        entries
            .iter()
            .map(|(kind, spaces)| {
                (
                    (*kind).to_owned(),
                    spaces.iter().map(|s| (*s).to_owned()).collect(),
                )
            })
            .collect()
    }

    #[test]
    fn owed_changes_go_with_the_next_push_and_everything_stays_everything() {
        assert_eq!(
            together(
                changes(&[("tool", &["a"]), ("prompt", &["a"])]),
                changes(&[("tool", &["b", "a"])])
            ),
            changes(&[("tool", &["a", "b"]), ("prompt", &["a"])])
        );
        assert!(together(Changes::new(), changes(&[("tool", &["a"])])).is_empty());
        assert!(together(changes(&[("tool", &["a"])]), Changes::new()).is_empty());
    }

    #[test]
    fn a_workspace_made_alone_names_no_type_and_is_not_everything_when_owed() {
        let named = News {
            changes: Some(changes(&[("tool", &["a"])])),
            workspaces: WorkspaceChanges::default(),
        };
        let made = News {
            changes: None,
            workspaces: WorkspaceChanges {
                created: vec!["acme".into()],
                deleted: vec![],
            },
        };
        // As TrustGraph's config service sends it: no types, the workspace made.
        assert_eq!(
            made.at(7),
            ConfigPush {
                version: 7,
                changes: Changes::new(),
                workspace_changes: Some(made.workspaces.clone()),
            }
        );
        assert_eq!(named.at(7).workspace_changes, None);
        // Owed together, either way round: the named types, and the workspace.
        for both in [
            made.clone().then(named.clone()),
            named.clone().then(made.clone()),
        ] {
            assert_eq!(both.changes, named.changes);
            assert_eq!(both.workspaces, made.workspaces);
        }
        assert_eq!(
            made.clone().then(made.clone()).at(8).changes,
            Changes::new()
        );
        assert_eq!(made.then(News::everything()).changes, Some(Changes::new()));
        assert!(News::default().is_nothing());
    }

    #[test]
    fn a_push_too_large_leaves_out_its_types_before_its_workspaces() {
        let made = WorkspaceChanges {
            created: vec!["acme".into()],
            deleted: vec![],
        };
        let mut push = ConfigPush {
            version: 3,
            changes: changes(&[("tool", &["a"])]),
            workspace_changes: Some(made.clone()),
        };
        assert_eq!(smaller(&mut push), "the types it names");
        assert_eq!(push.changes, Changes::new());
        assert_eq!(push.workspace_changes, Some(made));
        assert_eq!(
            smaller(&mut push),
            "the workspaces made or removed it names"
        );
        assert_eq!(push.workspace_changes, None);
    }
}
