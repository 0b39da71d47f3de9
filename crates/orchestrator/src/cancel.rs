//! Cancelled runs as this replica knows them: heard on the control topic (every replica hears
//! every cancel), and read from the graph at start and after each time the control topic was
//! lost, for cancels sent while this replica could not hear them. A step
//! checks its session and every supervisor above it before it runs, and watches them while it
//! runs, so an LLM stream or a tool call in flight is abandoned as soon as the cancel is heard.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agent_bus::{Bus, ControlListener, Topics};
use agent_core::provenance::SessionUris;
use agent_core::supervisor::place_of;
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore, QueryAnswer};
use agent_schema::{control_operation, AgentControl};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long a cancel is remembered: longer than any run may last under its wall-time budget.
pub const MEMORY: Duration = Duration::from_secs(24 * 3600);
/// The most cancels remembered at once; past it the oldest are forgotten first.
const MOST: usize = 100_000;

/// One cancel: of which session, by whom, when and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    pub session_id: String,
    pub by: String,
    pub at: String,
    pub reason: String,
}

impl Cancel {
    /// Its node in the provenance graph (written by whoever sent it).
    pub fn node(&self) -> String {
        SessionUris::new(&self.session_id).cancellation()
    }

    /// What the client is told.
    pub fn message(&self) -> String {
        let mut message = format!("cancelled by {} at {}", self.by, self.at);
        if !self.reason.is_empty() {
            message.push_str(": ");
            message.push_str(&self.reason);
        }
        message
    }
}

/// The cancels this replica knows, by session.
pub struct Cancellations {
    known: Mutex<Known>,
    /// The most remembered at once ([`MOST`]; smaller in tests).
    most: usize,
    /// Bumped on every new cancel, so a running step re-checks its sessions.
    heard: watch::Sender<u64>,
}

/// The cancels by session, and the order they were heard in, so that forgetting the oldest
/// (a day old, or pushed out at [`MOST`]) takes one step, not a scan of every one under the lock
/// that each step's check takes: a flood of cancels at the cap made each cost a scan of 100,000.
#[derive(Default)]
struct Known {
    by_session: HashMap<String, (Instant, Arc<Cancel>)>,
    /// When each was heard, oldest first; an item whose session was heard again since (after
    /// [`MEMORY`]) no longer matches its time there and is skipped.
    heard_in_order: VecDeque<(Instant, String)>,
}

impl Known {
    /// Forgets the oldest cancel still remembered; whether there was one.
    fn forget_oldest(&mut self) -> bool {
        while let Some((heard, session)) = self.heard_in_order.pop_front() {
            if self.is_current(heard, &session) {
                self.by_session.remove(&session);
                return true;
            }
        }
        false
    }

    fn is_current(&self, heard: Instant, session: &str) -> bool {
        self.by_session
            .get(session)
            .is_some_and(|(at, _)| *at == heard)
    }

    /// Forgets what was heard longer ago than [`MEMORY`], and the order's stale items before it.
    fn forget_lapsed(&mut self) {
        while let Some((heard, session)) = self.heard_in_order.front() {
            let (heard, current) = (*heard, self.is_current(*heard, session));
            if current && heard.elapsed() < MEMORY {
                return;
            }
            if current {
                let session = session.clone();
                self.by_session.remove(&session);
            }
            self.heard_in_order.pop_front();
        }
    }
}

impl Default for Cancellations {
    fn default() -> Self {
        Cancellations::remembering(MOST)
    }
}

impl Cancellations {
    fn remembering(most: usize) -> Self {
        Cancellations {
            known: Mutex::new(Known::default()),
            most: most.max(1),
            heard: watch::channel(0).0,
        }
    }

    /// Remembers `cancel`; the first record of a session stands. Whether it was new here.
    pub fn record(&self, cancel: Cancel) -> bool {
        let Ok(mut known) = self.known.lock() else {
            return false;
        };
        // One forgotten (heard longer ago than [`MEMORY`]) is heard again.
        if known
            .by_session
            .get(&cancel.session_id)
            .is_some_and(|(heard, _)| heard.elapsed() < MEMORY)
        {
            return false;
        }
        known.forget_lapsed();
        while known.by_session.len() >= self.most && known.forget_oldest() {}
        tracing::info!(session = %cancel.session_id, by = %cancel.by, "run cancelled");
        let now = Instant::now();
        known
            .heard_in_order
            .push_back((now, cancel.session_id.clone()));
        known
            .by_session
            .insert(cancel.session_id.clone(), (now, Arc::new(cancel)));
        drop(known);
        self.heard.send_modify(|n| *n += 1);
        true
    }

    /// The cancel that applies to `session_id`: its own, or that of a supervisor above it.
    pub fn of(&self, session_id: &str) -> Option<Arc<Cancel>> {
        let known = self.known.lock().ok()?;
        if known.by_session.is_empty() {
            return None;
        }
        let mut session = session_id;
        loop {
            if let Some((heard, cancel)) = known.by_session.get(session) {
                if heard.elapsed() < MEMORY {
                    return Some(cancel.clone());
                }
            }
            session = place_of(session)?.supervisor;
        }
    }

    /// Resolves with the cancel of `session_id` once one is heard.
    pub async fn cancelled(&self, session_id: &str) -> Arc<Cancel> {
        let mut heard = self.heard.subscribe();
        loop {
            if let Some(cancel) = self.of(session_id) {
                return cancel;
            }
            if heard.changed().await.is_err() {
                // The sender lives as long as `self`: never reached while it is borrowed.
                std::future::pending::<()>().await;
            }
        }
    }
}

/// The cancel a control message asks for, if it is one.
pub fn from_control(control: &AgentControl) -> Option<Cancel> {
    // No request with a longer session id is admitted (validate.rs), so such a cancel names none.
    if control.operation != control_operation::CANCEL
        || control.session_id.is_empty()
        || control.session_id.len() > MOST_SESSION_ID_BYTES
    {
        return None;
    }
    // Kept for a day, up to [`MOST`] of them: what a publisher writes is bounded here, not by the
    // broker's message size.
    Some(Cancel {
        session_id: control.session_id.clone(),
        by: bounded(&control.by),
        at: bounded(&control.at),
        reason: bounded(&control.reason),
    })
}

/// The longest session id a request may have.
const MOST_SESSION_ID_BYTES: usize = 240;

/// The longest `by`, `at` or `reason` a cancel keeps; the rest is cut, at a character boundary.
const MOST_TEXT_BYTES: usize = 1024;

pub(crate) fn bounded(text: &str) -> String {
    if text.len() <= MOST_TEXT_BYTES {
        return text.to_owned();
    }
    let mut end = MOST_TEXT_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &text[..end])
}

/// Hears the control topic until `shutdown` on `subscribed` (made by the caller, so that what
/// it reads from the graph afterwards leaves no gap), recording every cancel sealed as `seals`
/// requires. A lost subscription is made again after a pause; the control topic keeps nothing
/// for a subscription that is not there, so each one this makes is followed by a read of the
/// graph (`store`, the durable record) for cancels sent meanwhile (see [`catch_up`]).
pub async fn listen(
    bus: Bus,
    topics: Topics,
    (mut subscribed, store): (Option<ControlListener>, Option<GraphStore>),
    cancellations: Arc<Cancellations>,
    seals: (Option<agent_bus::seal::SealKey>, crate::settings::SealRule),
    shutdown: CancellationToken,
) {
    const FIRST_PAUSE: Duration = Duration::from_millis(200);
    let mut pause = FIRST_PAUSE;
    let mut catching_up: Option<tokio::task::JoinHandle<()>> = None;
    let (unsealed, to_record) = tokio::sync::mpsc::channel(UNSEALED_RECORDS_WAITING);
    let recorder = tokio::spawn(record_unsealed(
        bus.clone(),
        topics.clone(),
        seals.0.clone(),
        to_record,
    ));
    let _recorder = tokio_util::task::AbortOnDropHandle::new(recorder);
    let _reading_again = store.clone().map(|store| {
        tokio_util::task::AbortOnDropHandle::new(tokio::spawn(keep_reading_recent(
            store,
            cancellations.clone(),
            shutdown.clone(),
        )))
    });
    let mut records_dropped = 0u64;
    loop {
        let mut listening_since = None;
        let heard = async {
            let mut listener = match subscribed.take() {
                Some(listener) => listener,
                None => {
                    let listener = ControlListener::subscribe(&bus, &topics).await?;
                    if let Some(store) = &store {
                        if let Some(earlier) = catching_up.take() {
                            earlier.abort();
                        }
                        catching_up = Some(tokio::spawn(catch_up(
                            store.clone(),
                            cancellations.clone(),
                            shutdown.clone(),
                        )));
                    }
                    listener
                }
            };
            listening_since = Some(tokio::time::Instant::now());
            loop {
                let heard = listener.next().await?;
                if crate::emit::fault::control_dropped() {
                    continue;
                }
                let control = heard.control;
                if !crate::control_seals::sealed_as_required(
                    seals.0.as_ref(),
                    seals.1,
                    &control,
                    &heard.raw,
                    &heard.properties,
                ) {
                    continue;
                }
                match from_control(&control) {
                    Some(cancel) => {
                        let sealed = seals
                            .0
                            .as_ref()
                            .is_some_and(|key| key.verify_control(&heard.raw, &heard.properties));
                        if sealed {
                            cancellations.record(cancel);
                        } else {
                            let cancel = Cancel {
                                at: vouched_time(&cancel.at, chrono::Utc::now()),
                                ..cancel
                            };
                            if cancellations.record(cancel.clone())
                                && unsealed.try_send(cancel).is_err()
                            {
                                records_dropped += 1;
                                if records_dropped.is_power_of_two() {
                                    tracing::warn!(records_dropped, "unsealed cancels come faster than they can be recorded in the graph; acted on, not recorded");
                                }
                            }
                        }
                    }
                    None => {
                        tracing::warn!(operation = %control.operation, "ignoring a control message this service does not know")
                    }
                }
            }
        };
        let stopped: Result<(), agent_bus::BusError> = tokio::select! {
            _ = shutdown.cancelled() => return,
            stopped = heard => stopped,
        };
        if let Err(e) = stopped {
            tracing::warn!(error = %e, "the control topic was lost; subscribing again");
        }
        // A subscription that lasted was not one that ends at once: no reason to wait long.
        if listening_since.is_some_and(|since| since.elapsed() > Duration::from_secs(30)) {
            pause = FIRST_PAUSE;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(Duration::from_secs(10));
    }
}

/// The most a cancel's time may be off this replica's clock to be recorded as its sender says.
const CLAIMED_TIME_SLACK: chrono::TimeDelta = chrono::TimeDelta::minutes(5);

/// The time to record for a cancel that came unsealed: the one it claims, if that is an RFC 3339
/// time within [`CLAIMED_TIME_SLACK`] of `now`, else `now`. The approvals sweep and the replicas
/// that catch up read cancels by this time, so a claim far off (or not a time) must not place
/// the cancel where they would not count it.
fn vouched_time(claimed: &str, now: chrono::DateTime<chrono::Utc>) -> String {
    match chrono::DateTime::parse_from_rfc3339(claimed) {
        Ok(at) if (now - at.with_timezone(&chrono::Utc)).abs() <= CLAIMED_TIME_SLACK => {
            claimed.to_owned()
        }
        _ => now.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    }
}

/// How many unsealed cancels may wait to be recorded; past it one is acted on and not recorded
/// (a flood of them, which only a sender without the seal key can make, must not cost a task and
/// a producer each).
const UNSEALED_RECORDS_WAITING: usize = 1024;

/// Records in the graph, one after another on one producer, each cancel this replica acted on
/// although it came without the services' seal (no seal key, or `--control-seals warn`, as under
/// `agentctl up`): its sender's record, if it made one, was not sealed, so the aggregator left it
/// out (or, with no key anywhere, the sender had none to make). Without a record the approvals
/// sweep cannot see the cancel (a run parked for approval would wait for its call's deadline) and
/// no audit shows who stopped the run. Every replica that hears it records the same triples,
/// which the graph keeps once; the record is sealed with this replica's key, if it has one, and
/// marked as taken unsealed.
async fn record_unsealed(
    bus: Bus,
    topics: Topics,
    key: Option<agent_bus::seal::SealKey>,
    mut to_record: tokio::sync::mpsc::Receiver<Cancel>,
) {
    let mut producer: Option<agent_bus::Publisher> = None;
    while let Some(cancel) = to_record.recv().await {
        let uris = SessionUris::new(&cancel.session_id);
        let record = agent_schema::Triples {
            metadata: agent_schema::Metadata {
                id: uris.cancellation(),
                root: uris.session(),
                collection: "default".to_owned(),
            },
            triples: agent_core::provenance::unsealed_cancellation(
                &uris,
                &cancel.by,
                &cancel.at,
                &cancel.reason,
            ),
        };
        let payload = agent_schema::encode(&record);
        let mut properties = agent_bus::Properties::new();
        if let Some(key) = &key {
            properties.insert(
                agent_bus::seal::EXPLAIN_SEAL_PROPERTY.to_owned(),
                key.seal_explain(&payload),
            );
        }
        let sent = async {
            let publisher = match producer.take() {
                Some(publisher) => publisher,
                None => agent_bus::Publisher::new(&bus, &topics.explainability).await?,
            };
            let sent = publisher.send(payload, &properties).await;
            // Kept for the next record unless it failed, when the next one makes a new one.
            if sent.is_ok() {
                producer = Some(publisher);
            }
            sent
        };
        if let Err(e) = sent.await {
            tracing::warn!(session = %cancel.session_id, error = %e, "an unsealed cancel was acted on but could not be recorded in the graph");
        }
    }
}

/// How long after a cancel's message its record may reach the graph: the sender publishes the
/// record to the aggregator just before the message, and the aggregator writes it a moment later.
const RECORD_LAG: Duration = Duration::from_secs(5);

/// Reads the graph's cancels into `cancellations` until a read succeeds (the store may be down
/// while the stack restarts: steps of a cancelled run must not go on for that), backing off up
/// to 30 s, and once more [`RECORD_LAG`] later, for a cancel whose message came before this
/// replica subscribed and whose record came after the first read.
pub async fn catch_up(
    store: GraphStore,
    cancellations: Arc<Cancellations>,
    shutdown: CancellationToken,
) {
    let reading = async {
        let mut pause = Duration::from_secs(1);
        let mut failed = 0u32;
        loop {
            match load(&store, &cancellations).await {
                Ok(loaded) => {
                    if failed > 0 {
                        tracing::info!(loaded, "cancelled runs read from the graph at last");
                    }
                    break;
                }
                Err(e) => {
                    failed += 1;
                    if failed.is_power_of_two() {
                        tracing::warn!(error = %e, failed, "cannot read cancels from the graph; trying again");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(30));
                }
            }
        }
        tokio::time::sleep(RECORD_LAG).await;
        if let Err(e) = load(&store, &cancellations).await {
            tracing::debug!(error = %e, "reading cancels from the graph again");
        }
    };
    tokio::select! {
        _ = shutdown.cancelled() => {}
        _ = reading => {}
    }
}

/// How often the graph's recent cancels are read again while the control topic is heard. A
/// broker drops a message on a non-persistent topic for a consumer whose connection has too much
/// waiting to be written to it, and a cancel dropped so was never acted on by this replica: the
/// steps of that run it took went on to their answer, tools called.
const READ_AGAIN_EVERY: Duration = Duration::from_secs(5);

/// How far back each of those reads looks: past the time a cancel's record takes to reach the
/// graph, not so far that each read grows with every cancel of the day.
const READ_AGAIN_WITHIN: Duration = Duration::from_secs(600);

/// Reads the cancels of the last [`READ_AGAIN_WITHIN`] into `cancellations` every
/// [`READ_AGAIN_EVERY`] until `stop`.
async fn keep_reading_recent(
    store: GraphStore,
    cancellations: Arc<Cancellations>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(READ_AGAIN_EVERY) => {}
        }
        match load_within(&store, &cancellations, READ_AGAIN_WITHIN).await {
            Ok(0) => {}
            Ok(learnt) => tracing::warn!(
                learnt,
                "cancels read from the graph that the control topic did not bring"
            ),
            Err(e) => tracing::debug!(error = %e, "reading recent cancels from the graph again"),
        }
    }
}

/// Reads the cancels of the last [`MEMORY`] from the graph into `cancellations`; how many this
/// replica did not know.
pub async fn load(
    store: &GraphStore,
    cancellations: &Cancellations,
) -> Result<usize, agent_graph::GraphError> {
    load_within(store, cancellations, MEMORY).await
}

/// Reads the cancels of the last `within` from the graph into `cancellations`; how many this
/// replica did not know.
async fn load_within(
    store: &GraphStore,
    cancellations: &Cancellations,
    within: Duration,
) -> Result<usize, agent_graph::GraphError> {
    let since = chrono::Utc::now() - chrono::Duration::seconds(within.as_secs() as i64);
    let since = since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let QueryAnswer::Rows(rows) = store.query(queries::cancellations_since(&since)).await? else {
        return Ok(0);
    };
    Ok(record_rows(&rows, cancellations))
}

/// Reads into `cancellations` the cancels of `session_id` and of every supervisor above it that
/// the graph records, however long ago: for a step resumed long after its run began (an answer to
/// a call parked for approval may come days later), whose cancel this replica may have forgotten
/// or never heard.
pub async fn load_for(
    store: &GraphStore,
    cancellations: &Cancellations,
    session_id: &str,
) -> Result<usize, agent_graph::GraphError> {
    let mut nodes = Vec::new();
    let mut session = session_id;
    loop {
        if let Ok(node) =
            agent_graph::model::NamedNode::new(SessionUris::new(session).cancellation())
        {
            nodes.push(node);
        }
        match place_of(session) {
            Some(place) => session = place.supervisor,
            None => break,
        }
    }
    if nodes.is_empty() {
        return Ok(0);
    }
    let QueryAnswer::Rows(rows) = store.query(queries::cancellations_at(&nodes)).await? else {
        return Ok(0);
    };
    Ok(record_rows(&rows, cancellations))
}

/// Records the cancels of `rows` (`?c ?by ?at ?reason`); how many.
fn record_rows(rows: &agent_graph::Rows, cancellations: &Cancellations) -> usize {
    let text = |term: Option<&Option<Term>>| match term {
        Some(Some(Term::Literal(l))) => l.value().to_owned(),
        _ => String::new(),
    };
    let at = |name: &str| rows.variables.iter().position(|v| v == name);
    let (Some(c), Some(by), Some(when), Some(why)) = (at("c"), at("by"), at("at"), at("reason"))
    else {
        return 0;
    };
    let mut loaded = 0;
    for row in &rows.rows {
        let Some(Some(Term::NamedNode(node))) = row.get(c) else {
            continue;
        };
        let Some(session) = node
            .as_str()
            .strip_suffix("/cancellation")
            .and_then(agent_core::vocab::session_id_of)
        else {
            continue;
        };
        let learnt = cancellations.record(Cancel {
            session_id: session.to_owned(),
            by: text(row.get(by)),
            at: text(row.get(when)),
            reason: text(row.get(why)),
        });
        loaded += usize::from(learnt);
    }
    loaded
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cancel(session: &str) -> Cancel {
        Cancel {
            session_id: session.into(),
            by: "ops".into(),
            at: "2026-11-25T10:00:00Z".into(),
            reason: String::new(),
        }
    }

    #[test]
    fn an_unsealed_cancel_keeps_its_time_only_near_this_clock() {
        let now = chrono::DateTime::parse_from_rfc3339("2026-12-03T12:00:00Z")
            .unwrap()
            .with_timezone(&chrono::Utc);
        let mine = "2026-12-03T12:00:00.000Z";
        assert_eq!(
            vouched_time("2026-12-03T11:58:30.250Z", now),
            "2026-12-03T11:58:30.250Z"
        );
        assert_eq!(
            vouched_time("2026-12-03T12:04:00+00:00", now),
            "2026-12-03T12:04:00+00:00"
        );
        // Far behind (the sweep would not count it), ahead, or not a time: this clock's.
        assert_eq!(vouched_time("2026-12-02T12:00:00Z", now), mine);
        assert_eq!(vouched_time("2026-12-03T12:06:00Z", now), mine);
        assert_eq!(vouched_time("yesterday", now), mine);
        assert_eq!(vouched_time("", now), mine);
    }

    #[test]
    fn a_cancel_reaches_every_subagent_below_and_nothing_beside() {
        let known = Cancellations::default();
        known.record(cancel("run-f1-s0"));
        assert!(known.of("run-f1-s0").is_some());
        assert!(known.of("run-f1-s0-f2-s3").is_some());
        assert!(known.of("run").is_none());
        assert!(known.of("run-f1-s1").is_none());
        known.record(cancel("run"));
        assert_eq!(known.of("run-f1-s1").unwrap().session_id, "run");
        // A session merely named like a subagent's of another run is not under it.
        assert!(known.of("other-f1-s0").is_none());
    }

    #[test]
    fn what_a_cancel_keeps_is_bounded() {
        let control = |session: &str, reason: &str| AgentControl {
            operation: control_operation::CANCEL.to_owned(),
            session_id: session.to_owned(),
            by: "ops".to_owned(),
            reason: reason.to_owned(),
            ..AgentControl::default()
        };
        let long = "é".repeat(4000);
        let kept = from_control(&control("run", &long)).unwrap();
        assert!(
            kept.reason.len() <= MOST_TEXT_BYTES + 3,
            "{}",
            kept.reason.len()
        );
        assert!(kept.reason.starts_with("éé") && kept.reason.ends_with("..."));
        assert_eq!(
            from_control(&control("run", "wrong invoice"))
                .unwrap()
                .reason,
            "wrong invoice"
        );
        assert!(from_control(&control(&"s".repeat(241), "")).is_none());
        assert!(from_control(&control(&"s".repeat(240), "")).is_some());
    }

    #[test]
    fn past_the_most_remembered_the_oldest_is_forgotten_first() {
        let known = Cancellations::remembering(3);
        for session in ["a", "b", "c"] {
            assert!(known.record(cancel(session)));
        }
        assert!(!known.record(cancel("b")), "b is remembered");
        assert!(known.record(cancel("d")));
        assert!(known.of("a").is_none(), "a was the oldest");
        for session in ["b", "c", "d"] {
            assert!(known.of(session).is_some(), "{session} is remembered");
        }
        // A forgotten cancel heard again is remembered as new, and pushes out the next oldest.
        assert!(known.record(cancel("a")));
        assert!(known.of("a").is_some() && known.of("b").is_none());
        let guard = known.known.lock().unwrap();
        assert_eq!(guard.by_session.len(), 3);
        assert_eq!(guard.heard_in_order.len(), 3);
    }

    #[test]
    fn a_flood_of_cancels_at_the_cap_keeps_the_newest() {
        let known = Cancellations::default();
        // Each past the cap forgets one in a step: a scan of the map each, as before, took this
        // test 484 s (debug build) instead of a few.
        for n in 0..MOST + 50_000 {
            known.record(cancel(&format!("run-{n}")));
        }
        assert!(known.of("run-0").is_none() && known.of("run-49999").is_none());
        assert!(known.of("run-50000").is_some());
        assert!(known.of(&format!("run-{}", MOST + 49_999)).is_some());
        assert_eq!(known.known.lock().unwrap().by_session.len(), MOST);
    }

    #[test]
    fn the_first_record_of_a_session_stands() {
        let known = Cancellations::default();
        known.record(cancel("run"));
        known.record(Cancel {
            by: "someone else".into(),
            ..cancel("run")
        });
        assert_eq!(known.of("run").unwrap().by, "ops");
    }

    #[tokio::test]
    async fn a_waiting_step_hears_a_later_cancel() {
        let known = Arc::new(Cancellations::default());
        let waiting = {
            let known = known.clone();
            tokio::spawn(async move { known.cancelled("run-f1-s0").await })
        };
        tokio::task::yield_now().await;
        known.record(cancel("unrelated"));
        known.record(cancel("run"));
        let heard = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(heard.session_id, "run");
    }

    /// A cancel whose record reaches the graph after the catch-up's first read (the aggregator
    /// writes it a moment after its message was on the control topic) is read the second time.
    #[tokio::test]
    async fn a_cancel_recorded_just_after_the_catch_up_read_is_still_caught() {
        let store = GraphStore::in_memory().unwrap();
        let known = Arc::new(Cancellations::default());
        let catching_up = tokio::spawn(catch_up(
            store.clone(),
            known.clone(),
            CancellationToken::new(),
        ));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(known.of("late-run").is_none());
        let at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
        let uris = SessionUris::new("late-run");
        let triples = agent_core::provenance::cancellation(&uris, "ops", &at, "wrong invoice")
            .into_iter()
            .map(|t| agent_schema::Triple {
                g: Some(agent_core::vocab::PROVENANCE_GRAPH.to_owned()),
                ..t
            })
            .collect();
        let quads = agent_graph::convert::into_quads(triples).unwrap();
        store.insert(quads).await.unwrap();
        tokio::time::timeout(RECORD_LAG * 2, catching_up)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(known.of("late-run").unwrap().by, "ops");
    }

    #[test]
    fn only_cancels_with_a_session_are_taken() {
        let mut control = AgentControl {
            operation: "cancel".into(),
            session_id: "s".into(),
            ..AgentControl::default()
        };
        assert!(from_control(&control).is_some());
        control.session_id.clear();
        assert!(from_control(&control).is_none());
        control.session_id = "s".into();
        control.operation = "pause".into();
        assert!(from_control(&control).is_none());
    }
}
