//! One owner of what must not be split between two processes: an aggregator's journal, a
//! config service's store. An owner announces itself on the broker, and one that hears an elder
//! owner of the same thing refuses to run: a StatefulSet scaled past one replica, or a second
//! process started by hand, each with a store of its own on the same subscription, would
//! otherwise split the decisions (the journal's; the config's writes and their versions) between
//! two stores, and what they promise would silently stop holding.
//!
//! Before it acts, a new owner listens for a few beats, counted only while it hears its own (so
//! that a broker down meanwhile does not count as silence); the elder (earlier start, then the
//! smaller id) stays. With the services' seal key, an announcement counts only sealed with it and
//! sent within [`FRESH`]: anyone who can publish on the broker could otherwise stand the running
//! owner down with one forged "elder", or with an old owner's announcement played again.

use std::time::Duration;

use crate::seal::SealKey;
use crate::{Bus, Listener, Properties, Publisher};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// What a fence keeps to one process, as its logs, its refusal and the broker name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Role {
    /// What is owned, as a sentence names it: "the journal".
    pub owned: &'static str,
    /// Who owns it: "aggregator".
    pub service: &'static str,
    /// The beacon topic's suffix before the subscription, and the listeners' subscription:
    /// "journal-owner".
    pub beacon: &'static str,
    /// What the seal of an announcement is made as (see [`SealKey::seal_announcement`]), so
    /// that one role's announcement cannot be played on another's beacon.
    pub sealed_as: &'static str,
    /// What to run instead, ending a refusal.
    pub advice: &'static str,
}

/// How often an owner announces itself.
pub const BEAT: Duration = Duration::from_millis(250);

/// How far from this process's clock an announcement's time may be, either way, to count under
/// a seal key: beats are sent every [`BEAT`], so a copy older than this was played again (the
/// owners' clocks are taken to agree within it).
pub const FRESH: Duration = Duration::from_secs(30);

/// The longest break between two of its own announcements heard (by when they were sent) over
/// which a newcomer still counts itself as listening: a longer one means it was deaf meanwhile
/// (the broker down, or its beats lost), and an elder's announcements would have gone unheard too.
const HEARD_OWN_GAP: Duration = Duration::from_millis(1_000);

/// An owner as it announces itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Owner {
    /// Random for each start of a process.
    pub id: String,
    pub started_ms: u64,
    /// The store it owns (a directory or an endpoint), for the operator reading a refusal.
    pub store: String,
    /// Whether it has passed its listening window and owns what it announces: a newcomer always gives
    /// way to one that does, whatever the two clocks say.
    #[serde(default)]
    pub owning: bool,
}

impl Owner {
    /// This process, started now, owning `store`.
    pub fn this_process(store: &str) -> Owner {
        Owner {
            id: format!("{:032x}", rand::random::<u128>()),
            started_ms: now_ms(),
            store: store.to_owned(),
            owning: false,
        }
    }

    /// Whether `self`, hearing `other`, must give way: a newcomer to an owner, and of two
    /// newcomers (or two owners that could not hear each other) the later started.
    fn gives_way_to(&self, other: &Owner) -> bool {
        match (self.owning, other.owning) {
            (false, true) => true,
            (true, false) => false,
            _ => other.precedes(self),
        }
    }

    /// Whether `self` came first, and so keeps what both own: the earlier start, ties broken by id.
    pub fn precedes(&self, other: &Owner) -> bool {
        (self.started_ms, &self.id) < (other.started_ms, &other.id)
    }
}

/// An announcement on the broker: the owner, and when it was sent (an earlier build sent none).
#[derive(Debug, Serialize, Deserialize)]
struct Announcement {
    #[serde(flatten)]
    owner: Owner,
    #[serde(default)]
    sent_ms: u64,
}

/// Why an announcement heard does not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disbelief {
    Undecodable,
    /// Without the seal of this process's key (forged, or from a build or a deployment without
    /// it).
    Unsealed,
    /// Sealed, but sent further than [`FRESH`] from now: a copy played again.
    Stale,
}

impl Disbelief {
    fn says(self) -> &'static str {
        match self {
            Disbelief::Undecodable => "does not decode",
            Disbelief::Unsealed => "does not carry this deployment's seal (AGENT_SEAL_KEY): forged, or from a build or deployment without it",
            Disbelief::Stale => "was sent more than 30 s from now by this clock: an old announcement sent again, or clocks that disagree",
        }
    }
}

/// The owner an announcement heard on the broker names, if it counts: with `seal`, only one
/// sealed with it and sent within [`FRESH`] of `now_ms`. (Not also "sent after this process
/// started": a newcomer whose clock runs ahead of a live owner's would then believe none of its
/// announcements and own beside it. So a copy of a dead owner's announcement, played
/// within 30 s of its sending, can stand its successor down once; restarted, it is past.)
fn believed(
    role: &Role,
    seal: Option<&SealKey>,
    payload: &[u8],
    properties: &Properties,
    now_ms: u64,
) -> Result<Announcement, Disbelief> {
    let announcement: Announcement =
        serde_json::from_slice(payload).map_err(|_| Disbelief::Undecodable)?;
    let Some(key) = seal else {
        return Ok(announcement);
    };
    if !key.verify_announcement(role.sealed_as, payload, properties) {
        return Err(Disbelief::Unsealed);
    }
    if now_ms.abs_diff(announcement.sent_ms) > FRESH.as_millis() as u64 {
        return Err(Disbelief::Stale);
    }
    Ok(announcement)
}

/// For how long a newcomer has heard its own announcements without a break: the time its
/// listening window counts. A clock alone would count time in which it heard nothing (a broker
/// restart, through which the client may keep the subscription by itself and report no error),
/// and admit it deaf to an elder that announced all along.
#[derive(Debug, Default)]
struct HeardOwn {
    /// When the first of the unbroken run was sent.
    since_ms: Option<u64>,
    last_ms: Option<u64>,
}

impl HeardOwn {
    /// Notes one of its own announcements, sent at `sent_ms`; how long the run now lasts.
    fn heard(&mut self, sent_ms: u64) -> Duration {
        let unbroken = self.last_ms.is_some_and(|last| {
            sent_ms >= last && sent_ms - last <= HEARD_OWN_GAP.as_millis() as u64
        });
        if !unbroken {
            self.since_ms = Some(sent_ms);
        }
        self.last_ms = Some(sent_ms);
        let since = *self.since_ms.get_or_insert(sent_ms);
        Duration::from_millis(sent_ms.saturating_sub(since))
    }

    /// Starts over: nothing heard before counts (its subscription was made again).
    fn forget(&mut self) {
        *self = HeardOwn::default();
    }
}

/// The time now, as announcements carry it.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// Where the owners in `role` of `subscription` on `topic` announce themselves: a non-persistent
/// topic beside it (announcements are only worth anything while they are fresh).
pub fn beacon_topic(role: &Role, topic: &str, subscription: &str) -> String {
    // A short name is Pulsar's `public/default` namespace's.
    let path = match topic.split_once("://") {
        Some((_, path)) => path.to_owned(),
        None => format!("public/default/{topic}"),
    };
    // Letters, digits and '-' stay; every other byte becomes '_' and its two hex digits, so two
    // subscriptions never share a beacon ("a.b" and "a_b" would have under a plain '_').
    let subscription: String = subscription
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b == b'-' {
                char::from(b).to_string()
            } else {
                format!("_{b:02x}")
            }
        })
        .collect();
    format!("non-persistent://{path}.{}.{subscription}", role.beacon)
}

/// Where this process stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Standing {
    Listening,
    Owner,
    /// An elder owner was heard: this process must not decide anything.
    Refused(String),
}

/// Whether this process may act as the owner. Cloned into everything that must wait for it.
#[derive(Clone)]
pub struct Fence {
    role: Role,
    standing: watch::Receiver<Standing>,
}

impl Fence {
    /// A fence that is always open (an aggregator that owns no journal).
    pub fn open(role: Role) -> Fence {
        let (_, standing) = watch::channel(Standing::Owner);
        Fence { role, standing }
    }

    /// Waits out the listening beats; `Err` says why this process must not act as the owner.
    pub async fn admitted(&self) -> Result<(), String> {
        let mut standing = self.standing.clone();
        let settled = standing
            .wait_for(|s| *s != Standing::Listening)
            .await
            .map(|s| s.clone());
        match settled {
            Ok(Standing::Refused(why)) => Err(why),
            Ok(_) => Ok(()),
            // The watcher is gone: it stopped with the service.
            Err(_) => Err(format!("the {} is stopping", self.role.service)),
        }
    }

    /// [`Fence::admitted`], waiting at most `limit` (a broker that does not answer keeps the
    /// listening window open).
    pub async fn admitted_within(&self, limit: Duration) -> Result<(), String> {
        tokio::time::timeout(limit, self.admitted())
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "still listening for another owner of {} (is the broker up?)",
                    self.role.owned
                ))
            })
    }

    /// Why this process was refused, if it was.
    pub fn refusal(&self) -> Option<String> {
        match &*self.standing.borrow() {
            Standing::Refused(why) => Some(why.clone()),
            _ => None,
        }
    }
}

/// A fence in `role` that admits nothing yet, and what will settle it once the broker is
/// reached; with `seal`, announcements are sealed and only sealed ones are heard.
pub fn listening(role: Role, seal: Option<SealKey>) -> (Fence, Announcer) {
    let (standing, fence) = watch::channel(Standing::Listening);
    (
        Fence {
            role,
            standing: fence,
        },
        Announcer {
            role,
            standing,
            seal,
        },
    )
}

/// Settles a [`Fence`] by announcing this owner and listening for others.
pub struct Announcer {
    role: Role,
    standing: watch::Sender<Standing>,
    seal: Option<SealKey>,
}

/// A second place where owners meet besides the broker (the SPARQL server aggregators share):
/// a newcomer is admitted only once it has listened there too.
pub struct SharedBeacon {
    /// Where, as a refusal names it.
    pub place: String,
    /// Starts beating there as `Owner` (whether it owns follows the receiver), reporting to
    /// [`Reports`], until the token is cancelled.
    #[allow(clippy::type_complexity)] // One call, made once.
    pub start: Box<
        dyn FnOnce(
                Owner,
                watch::Receiver<bool>,
                Reports,
                CancellationToken,
            ) -> tokio::task::JoinHandle<()>
            + Send,
    >,
}

/// Where a [`SharedBeacon`] reports.
pub struct Reports {
    /// Owners heard alive there, each round they are.
    pub heard: mpsc::Sender<Owner>,
    /// Set once this process has listened there long enough.
    pub listened: watch::Sender<bool>,
}

impl Announcer {
    /// Starts announcing `me` on `topic` and listening for other owners, until `stop`: until it
    /// has heard its own announcements for `listen` without a break nothing is admitted; then
    /// this process owns unless an elder was heard.
    /// An elder heard later (both started at once, or its beats were lost) refuses this process
    /// too, and `service` is cancelled so the service stops rather than go on deciding beside it.
    /// With `shared`, it also beats there and is not admitted before it has listened there too.
    #[allow(clippy::too_many_arguments)] // What the fence is started with, each once.
    pub async fn start(
        self,
        bus: &Bus,
        topic: &str,
        me: Owner,
        listen: Duration,
        shared: Option<SharedBeacon>,
        stop: CancellationToken,
        service: CancellationToken,
    ) -> anyhow::Result<tokio::task::JoinHandle<()>> {
        let role = self.role;
        let announcements = Publisher::new(bus, topic).await?;
        let heard = Listener::subscribe(bus, topic, role.beacon).await?;
        tracing::info!(topic = %topic, listen_ms = listen.as_millis() as u64, "listening for another owner of {} before owning it", role.owned);
        let (bus, topic) = (bus.clone(), topic.to_owned());
        Ok(tokio::spawn(async move {
            watch_owners(
                bus,
                topic,
                announcements,
                heard,
                me,
                Listening {
                    role,
                    window: listen,
                    shared,
                    seal: self.seal,
                },
                self.standing,
                stop,
                service,
            )
            .await;
        }))
    }
}

/// How a newcomer listens before it owns.
struct Listening {
    role: Role,
    window: Duration,
    /// Where the owners also beat.
    shared: Option<SharedBeacon>,
    /// The services' key: announcements are sealed with it, and only sealed ones heard.
    seal: Option<SealKey>,
}

#[allow(clippy::too_many_arguments)] // One loop over what the announcer was started with.
async fn watch_owners(
    bus: Bus,
    topic: String,
    announcements: Publisher,
    mut heard: Listener,
    mut me: Owner,
    listening: Listening,
    standing: watch::Sender<Standing>,
    stop: CancellationToken,
    service: CancellationToken,
) {
    let mut beats = tokio::time::interval(BEAT);
    let (owning, owning_seen) = watch::channel(false);
    let (in_store, mut heard_in_store) = mpsc::channel::<Owner>(16);
    let (store_listened, listened_in_store) = watch::channel(listening.shared.is_none());
    let role = listening.role;
    let shared_place = listening.shared.as_ref().map(|shared| shared.place.clone());
    let store_beacon = listening.shared.map(|shared| {
        let reports = Reports {
            heard: in_store,
            listened: store_listened,
        };
        (shared.start)(me.clone(), owning_seen, reports, stop.clone())
    });
    // The window on the broker, counted while this process hears its own announcements there,
    // then as many rounds in the store as it takes to hear a live owner there (a store that does
    // not answer keeps this process listening, and a beacon stopped before it had listened never
    // admits it).
    let window = listening.window;
    let seal = listening.seal;
    let mut disbelieved = 0u64;
    let mut heard_own = HeardOwn::default();
    let mut listening_again: Option<
        std::pin::Pin<Box<dyn std::future::Future<Output = Listener> + Send>>,
    > = None;
    let refusal = loop {
        // Biased: an owner heard in the same instant as the window closes is heard first.
        let other = tokio::select! {
            biased;
            _ = stop.cancelled() => break None,
            Some(other) = heard_in_store.recv() => Heard {
                owner: other,
                on: shared_place.clone().unwrap_or_default(),
            },
            again = async {
                match listening_again.as_mut() {
                    Some(again) => again.await,
                    None => std::future::pending().await,
                }
            }, if listening_again.is_some() => {
                heard = again;
                listening_again = None;
                // A window that ran out while this process was deaf to them would admit it the
                // moment it heard again, before an elder's next announcement came.
                heard_own.forget();
                continue;
            }
            message = heard.next_with_properties(), if listening_again.is_none() => match message {
                Ok((payload, properties)) => {
                    match believed(&role, seal.as_ref(), &payload, &properties, now_ms()) {
                        Ok(own) if own.owner.id == me.id => {
                            let listened = heard_own.heard(own.sent_ms) >= window;
                            if !me.owning && listened && *listened_in_store.borrow() {
                                me.owning = true;
                                owning.send_replace(true);
                                standing.send_replace(Standing::Owner);
                                tracing::info!(topic = %topic, "no other owner of {} heard: this {} owns it", role.owned, role.service);
                            }
                            continue;
                        }
                        Ok(other) => Heard {
                            owner: other.owner,
                            on: format!("the subscription's owners' announcements on {topic}"),
                        },
                        Err(why) => {
                            disbelieved += 1;
                            // The first, then at each power of two: a flood cannot flood the log.
                            if disbelieved.is_power_of_two() {
                                tracing::warn!(times = disbelieved, topic = %topic, "ignoring an announcement of an owner of {} that {}", role.owned, why.says());
                            }
                            continue;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "lost the announcements of the owners of {}; listening again", role.owned);
                    // Made beside the loop, which goes on beating and hearing owners in the store
                    // while the broker refuses (held up here, it would fill the store beacon's
                    // queue and stop its beats too).
                    listening_again = Some(Box::pin(
                        heard.subscription_again(&bus, "the owners' announcements"),
                    ));
                    continue;
                }
            },
            _ = beats.tick() => {
                // A beat that is not out within a beat is only a lost beat: the next one follows,
                // and nothing here waits on a broker that does not answer.
                let announcement = agent_schema::encode(&Announcement {
                    owner: me.clone(),
                    sent_ms: now_ms(),
                });
                let properties = crate::seal::sealed_properties(
                    seal.as_ref(),
                    crate::seal::OWNER_SEAL_PROPERTY,
                    |key| key.seal_announcement(role.sealed_as, &announcement),
                );
                let sent = announcements.send(announcement, &properties);
                match tokio::time::timeout(BEAT, sent).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "an owner's announcement was not sent"),
                    Err(_) => tracing::debug!("an owner's announcement was not sent in time"),
                }
                continue;
            }
        };
        if other.owner.id == me.id {
            continue;
        }
        if me.gives_way_to(&other.owner) {
            if me.owning {
                tracing::error!(other = %other.owner.store, "this {} owned {} until an elder owner was heard; what it consumed and decided meanwhile is in its own store", role.service, role.owned);
            }
            break Some(other.refusal(&role));
        }
        tracing::warn!(other = %other.owner.store, on = %other.on, "another {} claims {} of this deployment; it will stand down", role.service, role.owned);
    };
    drop(listening_again);
    if let Some(why) = refusal {
        tracing::error!("{why}");
        standing.send_replace(Standing::Refused(why));
        service.cancel();
    }
    if let Some(beacon) = store_beacon {
        // It stops with `stop`; a refused process removes its record as it goes.
        drop(heard_in_store);
        let _ = beacon.await;
    }
}

/// Another owner, and where it was heard.
struct Heard {
    owner: Owner,
    on: String,
}

impl Heard {
    /// Why this process, which must give way to it, refuses to run.
    fn refusal(&self, role: &Role) -> String {
        let other = &self.owner;
        let since = i64::try_from(other.started_ms)
            .ok()
            .and_then(chrono::DateTime::from_timestamp_millis)
            .map_or_else(|| other.started_ms.to_string(), |t| t.to_rfc3339());
        format!(
            "another {} (running since {since}, store {}) already owns {} of this deployment (heard on {}); {}",
            role.service, other.store, role.owned, self.on, role.advice
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The aggregator's, as it names it (its beacon and seal as before this module served two).
    const JOURNAL: Role = Role {
        owned: "the journal",
        service: "aggregator",
        beacon: "journal-owner",
        sealed_as: "owner",
        advice: "run one",
    };
    const CONFIG: Role = Role {
        owned: "the config",
        service: "config service",
        beacon: "config-owner",
        sealed_as: "config-owner",
        advice: "run one",
    };

    #[test]
    fn the_elder_owner_keeps_the_journal() {
        let first = Owner {
            id: "b".into(),
            started_ms: 10,
            store: "one".into(),
            owning: false,
        };
        let later = Owner {
            id: "a".into(),
            started_ms: 11,
            store: "two".into(),
            owning: false,
        };
        assert!(first.precedes(&later) && !later.precedes(&first));
        assert!(later.gives_way_to(&first) && !first.gives_way_to(&later));
        let tie = Owner {
            started_ms: 10,
            ..later.clone()
        };
        assert!(tie.precedes(&first) && !first.precedes(&tie));
        // An owner is not displaced by a newcomer whose clock says it started earlier.
        let owning = Owner {
            owning: true,
            ..later.clone()
        };
        let skewed = Owner {
            id: "c".into(),
            started_ms: 1,
            store: "three".into(),
            owning: false,
        };
        assert!(skewed.gives_way_to(&owning) && !owning.gives_way_to(&skewed));
    }

    #[test]
    fn with_a_key_only_a_fresh_sealed_announcement_counts() {
        let key = SealKey::new(b"services");
        let elder = Owner {
            id: "elder".into(),
            started_ms: 0,
            store: "s".into(),
            owning: true,
        };
        let now = 1_000_000_000;
        let sent_as = |role: &Role, at: u64, by: Option<&SealKey>| {
            let payload = agent_schema::encode(&Announcement {
                owner: elder.clone(),
                sent_ms: at,
            });
            let properties =
                crate::seal::sealed_properties(by, crate::seal::OWNER_SEAL_PROPERTY, |k| {
                    k.seal_announcement(role.sealed_as, &payload)
                });
            (payload, properties)
        };
        let sent = |at: u64, by: Option<&SealKey>| sent_as(&JOURNAL, at, by);
        let heard = |seal: Option<&SealKey>, (payload, properties): (Vec<u8>, Properties)| {
            believed(&JOURNAL, seal, &payload, &properties, now).map(|heard| heard.owner)
        };
        // One role's announcement, sealed, played on another's beacon: not believed there.
        assert_eq!(
            heard(Some(&key), sent_as(&CONFIG, now, Some(&key))),
            Err(Disbelief::Unsealed)
        );
        let (payload, properties) = sent_as(&CONFIG, now, Some(&key));
        assert_eq!(
            believed(&CONFIG, Some(&key), &payload, &properties, now).map(|heard| heard.owner),
            Ok(elder.clone())
        );
        assert_eq!(
            heard(Some(&key), sent(now - 200, Some(&key))),
            Ok(elder.clone())
        );
        assert_eq!(
            heard(Some(&key), sent(now + 2_000, Some(&key))),
            Ok(elder.clone())
        );
        assert_eq!(heard(Some(&key), sent(now, None)), Err(Disbelief::Unsealed));
        let mallory = SealKey::new(b"mallory");
        assert_eq!(
            heard(Some(&key), sent(now, Some(&mallory))),
            Err(Disbelief::Unsealed)
        );
        let a_minute_ago = now - 60_000;
        assert_eq!(
            heard(Some(&key), sent(a_minute_ago, Some(&key))),
            Err(Disbelief::Stale)
        );
        // Edited after sealing (sent again with a new time): the seal no longer holds.
        let (_, properties) = sent(a_minute_ago, Some(&key));
        let (edited, _) = sent(now, None);
        assert_eq!(
            heard(Some(&key), (edited, properties)),
            Err(Disbelief::Unsealed)
        );
        assert_eq!(
            heard(Some(&key), (b"{".to_vec(), Properties::new())),
            Err(Disbelief::Undecodable)
        );
        // Without a key (none configured anywhere), as before: an earlier build's announcement,
        // with no time, counts.
        assert_eq!(heard(None, sent(now, None)), Ok(elder.clone()));
        let earlier_build = serde_json::to_vec(&elder).unwrap();
        assert_eq!(heard(None, (earlier_build, Properties::new())), Ok(elder));
    }

    #[test]
    fn a_newcomer_listens_only_while_it_hears_itself() {
        let mut heard = HeardOwn::default();
        assert_eq!(heard.heard(10_000), Duration::ZERO);
        assert_eq!(heard.heard(10_250), Duration::from_millis(250));
        // A beat lost or two is not deafness.
        assert_eq!(heard.heard(11_000), Duration::from_millis(1_000));
        // Five seconds with none heard (a broker restart): the run starts over.
        assert_eq!(heard.heard(16_000), Duration::ZERO);
        assert_eq!(heard.heard(16_900), Duration::from_millis(900));
        // A beat sent before the last heard (clocks set back) starts over too.
        assert_eq!(heard.heard(16_500), Duration::ZERO);
        heard.forget();
        assert_eq!(heard.heard(17_000), Duration::ZERO);
    }

    #[test]
    fn the_beacon_sits_beside_the_subscription() {
        assert_eq!(
            beacon_topic(
                &JOURNAL,
                "persistent://tg/flow/triples-store:default:default",
                "agent-aggregator"
            ),
            "non-persistent://tg/flow/triples-store:default:default.journal-owner.agent-aggregator"
        );
        assert_eq!(
            beacon_topic(&JOURNAL, "persistent://tg/flow/x", "odd name/1"),
            "non-persistent://tg/flow/x.journal-owner.odd_20name_2f1"
        );
        assert_eq!(
            beacon_topic(&JOURNAL, "short", "s"),
            "non-persistent://public/default/short.journal-owner.s"
        );
        assert_ne!(
            beacon_topic(&JOURNAL, "persistent://tg/flow/x", "a.b"),
            beacon_topic(&JOURNAL, "persistent://tg/flow/x", "a_b")
        );
        assert_eq!(
            beacon_topic(&CONFIG, "non-persistent://tg/request/config", "config-svc"),
            "non-persistent://tg/request/config.config-owner.config-svc"
        );
    }
}
