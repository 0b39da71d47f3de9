//! The chains this process is running (dialogs continued in process, see `emit::CHAIN_PROPERTY`),
//! and the beat that tells the journal's owner so: a copy of a chain's root handed to another
//! replica waits while the chain beats, and takes the dialog over once the beats stop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_graph::journal::MAX_CHAINS_HELD;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::emit::locked;
use crate::journal::Journal;

/// How often a process that runs chains beats.
pub const BEAT_EVERY: Duration = Duration::from_secs(1);

/// The longest a beat may take: one stuck longer is given up, and the next tried, well within
/// a beat's hold.
const BEAT_TIMEOUT: Duration = Duration::from_secs(2);

/// A chain's step recorded this recently may belong to a chain whose first beat is still on its
/// way (a chain is held from just before its first step is recorded, and named by the next beat,
/// at most [`LEAST_BETWEEN_BEATS`] later): it counts as held.
pub const FIRST_BEAT_GRACE: Duration = Duration::from_secs(2);

/// The least time between two beats, however often chains start.
const LEAST_BETWEEN_BEATS: Duration = Duration::from_millis(200);

/// What a chain is held as: its dialog's session and its root's message id. A message id alone is
/// unique only on its topic (a client's topic, partitions, another broker behind the same owner).
pub fn key(session: &str, root: &str) -> String {
    format!("{session} {root}")
}

/// The roots of the chains running here, each with how many runs of it are in hand (a root's
/// redelivery waits for the first here, so one; counted all the same).
#[derive(Default)]
pub struct HeldChains {
    roots: Mutex<HashMap<String, usize>>,
    started: Notify,
}

impl HeldChains {
    /// Holds `root` until the guard is dropped; the next beat names it.
    pub fn hold(self: &Arc<Self>, root: String) -> Holding {
        *locked(&self.roots).entry(root.clone()).or_default() += 1;
        self.started.notify_one();
        Holding {
            chains: self.clone(),
            root,
        }
    }

    fn roots(&self) -> Vec<String> {
        locked(&self.roots)
            .keys()
            .take(MAX_CHAINS_HELD)
            .cloned()
            .collect()
    }
}

/// A chain held while it runs.
pub struct Holding {
    chains: Arc<HeldChains>,
    root: String,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let mut roots = locked(&self.chains.roots);
        if let Some(runs) = roots.get_mut(&self.root) {
            *runs -= 1;
            if *runs == 0 {
                roots.remove(&self.root);
            }
        }
    }
}

/// Beats while chains run here, at once when one starts (at most every
/// [`LEAST_BETWEEN_BEATS`]), every [`BEAT_EVERY`] while any runs, and once more with none when
/// the last ends; after `shutdown`, until the chains still running have ended. A beat that fails
/// is logged once until one succeeds: meanwhile another replica may take a chain over, which
/// costs steps run twice, never a second outcome.
pub async fn beat(journal: Journal, lease: Duration, shutdown: CancellationToken) {
    let chains = journal.chains().clone();
    let mut told_any = false;
    let mut failing = false;
    loop {
        let holding = chains.roots();
        if shutdown.is_cancelled() && holding.is_empty() && !told_any {
            return;
        }
        if !holding.is_empty() || told_any {
            let none = holding.is_empty();
            let told = tokio::time::timeout(BEAT_TIMEOUT, journal.beat(holding, lease))
                .await
                .unwrap_or_else(|_| {
                    Err(agent_graph::GraphError::Transport(format!(
                        "no answer within {BEAT_TIMEOUT:?}"
                    )))
                });
            match told {
                Ok(()) => {
                    told_any = !none;
                    if failing {
                        tracing::info!("the journal's owner hears this process's chains again");
                    }
                    failing = false;
                }
                Err(e) => {
                    if !failing {
                        tracing::warn!(error = %e, "cannot tell the journal's owner which chains run here; a copy of one may be run elsewhere meanwhile");
                    }
                    failing = true;
                }
            }
        }
        tokio::time::sleep(LEAST_BETWEEN_BEATS).await;
        tokio::select! {
            _ = tokio::time::sleep(BEAT_EVERY - LEAST_BETWEEN_BEATS) => {}
            _ = chains.started.notified() => {}
            _ = shutdown.cancelled(), if !shutdown.is_cancelled() => {}
        }
    }
}
