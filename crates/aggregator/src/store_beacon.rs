//! The journal owners' beacon in the SPARQL server they share. The broker's beacon
//! (`owner_fence`) reaches only owners on the same explainability subscription of the same
//! broker; two aggregators owning one server from different subscriptions, or from either side
//! of a broker partition, would each decide the journal. So owners of a server also meet there:
//! each keeps a record of itself with a beat counter, and one whose counter moves is alive,
//! whatever the clocks say.
//!
//! Only a process that is not yet sure writes: a newcomer beats while it listens, and an owner
//! beats only while it sees another record moving (a newcomer knocking), so that it is heard. An
//! owner alone only reads. (Beating for ever cost Apache Jena Fuseki, whose TDB2 storage keeps
//! every write transaction's copy of the blocks it changed until compacted, 23 MB of disk a
//! minute at four writes a second; reads cost nothing.)

use std::collections::HashMap;
use std::time::Duration;

use agent_graph::queries::{self, OwnerRecord};
use agent_graph::GraphStore;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use agent_bus::owner_fence::{Owner, Reports, SharedBeacon, BEAT};

/// Rounds (a write and a read, one a [`BEAT`]) before a newcomer has listened long enough: an
/// owner that only reads sees the newcomer's counter move within two rounds and beats from the
/// next. A record that has not moved by then is watched until [`SILENT_AFTER`] before it is taken
/// for a dead owner's, so an owner whose beats are late is not missed.
const ROUNDS_TO_LISTEN: u32 = 8;
/// Failed rounds in a row after which the beacon says so at warning level (a store that refuses
/// this process's updates keeps it from owning the journal).
const FAILURES_TO_WARN: u32 = 8;
/// A counter that has not moved for this long is not beating (an owner that stopped, or one
/// alone that only reads); an owner that heard a newcomer beats this long after it last moved.
const SILENT_AFTER: Duration = Duration::from_secs(3);
/// A record silent for this long is removed (its owner died without removing it).
const FORGET_AFTER: Duration = Duration::from_secs(120);

/// The SPARQL server `store` as a place where its journal owners meet: the beacon reports owners
/// it hears alive there, and that it has listened once it has for [`ROUNDS_TO_LISTEN`] rounds
/// and no record it has seen is still undecided (not moved, watched for less than
/// [`SILENT_AFTER`]).
pub fn shared(store: GraphStore) -> SharedBeacon {
    SharedBeacon {
        place: "the SPARQL server they share (its journal owners' records)".to_owned(),
        start: Box::new(move |me, owning, reports, stop| {
            tokio::spawn(beat(store, me, owning, reports, stop))
        }),
    }
}

/// What one owner's counter has done while this process watched it.
struct Watched {
    beat: u64,
    moved: Option<Instant>,
    seen_since: Instant,
}

/// Beats `me` into `store` while it listens or hears another owner beating, reads the others'
/// records every beat and reports those heard alive, until `stop`; then removes this process's
/// record. `owning` follows this process's standing.
async fn beat(
    store: GraphStore,
    me: Owner,
    owning: watch::Receiver<bool>,
    reports: Reports,
    stop: CancellationToken,
) {
    let mut record = OwnerRecord {
        id: me.id.clone(),
        started_ms: me.started_ms,
        store: me.store.clone(),
        beat: 0,
        owning: false,
    };
    let mut watched: HashMap<String, Watched> = HashMap::new();
    let mut rounds = 0u32;
    let mut failures = 0u32;
    // Until when this process, owning, beats to be heard by another that beats.
    let mut heard_until: Option<Instant> = None;
    let mut beats = tokio::time::interval(BEAT);
    beats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    'beating: loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = beats.tick() => {}
        }
        record.owning = *owning.borrow();
        let speaking = !record.owning || heard_until.is_some_and(|until| Instant::now() < until);
        if speaking {
            record.beat += 1;
        }
        let written = speaking.then_some(&record);
        // A store that does not answer within a beat costs a beat, not the loop.
        match tokio::time::timeout(BEAT * 4, round(&store, written)).await {
            Ok(Ok(others)) => {
                rounds += 1;
                let now = Instant::now();
                // A record removed from the store (a refused newcomer removes its own) is
                // watched no more; should it come back, it is watched afresh.
                watched.retain(|id, _| others.iter().any(|o| &o.id == id));
                for other in others.into_iter().filter(|o| o.id != me.id) {
                    let seen = watched.entry(other.id.clone()).or_insert(Watched {
                        beat: other.beat,
                        moved: None,
                        seen_since: now,
                    });
                    if seen.beat != other.beat {
                        seen.beat = other.beat;
                        seen.moved = Some(now);
                    }
                    let alive = seen
                        .moved
                        .is_some_and(|at| now.duration_since(at) < SILENT_AFTER);
                    if alive {
                        heard_until = Some(now + SILENT_AFTER);
                        let heard = Owner {
                            id: other.id,
                            started_ms: other.started_ms,
                            store: other.store,
                            owning: other.owning,
                        };
                        if reports.heard.send(heard).await.is_err() {
                            // The fence has settled against this process and stopped listening.
                            break 'beating;
                        }
                    } else if now.duration_since(seen.moved.unwrap_or(seen.seen_since))
                        > FORGET_AFTER
                    {
                        forget(&store, &other.id).await;
                        watched.remove(&other.id);
                    }
                }
                failures = 0;
                let undecided = watched
                    .values()
                    .any(|w| w.moved.is_none() && now.duration_since(w.seen_since) < SILENT_AFTER);
                if rounds >= ROUNDS_TO_LISTEN && !undecided && !*reports.listened.borrow() {
                    reports.listened.send_replace(true);
                }
            }
            Ok(Err(e)) => failed(&mut failures, &e.to_string()),
            Err(_) => failed(&mut failures, "no answer within four beats"),
        }
    }
    // Gone on a clean stop; a killed owner's record stops beating and is forgotten later.
    let _ = tokio::time::timeout(Duration::from_secs(2), forget(&store, &me.id)).await;
}

/// Counts a failed round; says so at warning level when they persist.
fn failed(failures: &mut u32, why: &str) {
    *failures += 1;
    if failures.is_multiple_of(FAILURES_TO_WARN) {
        tracing::warn!(failures = *failures, error = why, "a journal owner's beats in the SPARQL server keep failing; until one succeeds this aggregator neither owns the journal nor hears other owners there");
    } else {
        tracing::debug!(error = why, "a journal owner's beat in the store failed");
    }
}

/// Writes this beat of `record`, if any, and reads every owner's.
async fn round(
    store: &GraphStore,
    record: Option<&OwnerRecord>,
) -> Result<Vec<OwnerRecord>, agent_graph::GraphError> {
    if let Some(record) = record {
        store.update_own(queries::owner_beat(record)?).await?;
    }
    let rows = store.query(queries::owner_records()).await?.rows();
    Ok(queries::owner_records_of(&rows))
}

async fn forget(store: &GraphStore, id: &str) {
    let removed = match queries::forget_owner(id) {
        Ok(update) => store.update_own(update).await,
        Err(e) => Err(e),
    };
    if let Err(e) = removed {
        tracing::debug!(owner = id, error = %e, "a journal owner's record was not removed");
    }
}
