//! The budget of a run: a root request and every subagent it starts, at every depth, share one
//! token, wall-time and iteration budget. Its start and totals never come from a client: a
//! client's first message starts the run now and at zero, a subagent takes them from the fan-out
//! the graph holds for it, and the run's tokens and iterations are counted from the graph, where
//! every LLM call is recorded.

use std::time::Duration;

use agent_core::provenance::SessionUris;
use agent_core::supervisor::place_of;
use agent_graph::model::{NamedNode, Term};
use agent_graph::{queries, GraphError, GraphStore, QueryAnswer};
use agent_schema::AgentRequest;

/// A dialog's tokens so far: what its LLM calls (and LLM-backed tools) read and wrote. Carried
/// from step to step in message properties, summed in one way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
}

impl Tokens {
    /// These tokens and a call's (or a tool run's) `input` and `output`.
    pub fn plus(self, input: u64, output: u64) -> Tokens {
        // Saturating: the counts come in message properties, which a client can set.
        Tokens {
            input: self.input.saturating_add(input),
            output: self.output.saturating_add(output),
        }
    }

    pub fn total(self) -> u64 {
        self.input.saturating_add(self.output)
    }

    /// As the provenance builders take them.
    pub fn pair(self) -> (u64, u64) {
        (self.input, self.output)
    }
}

/// How long a subagent's first step polls for its fan-out to be written to the graph (it is
/// published before the subagent, but written by the aggregator in its own time); past it the
/// step is parked and tried again, up to the outage window.
const FANOUT_WAIT: Duration = Duration::from_secs(3);

pub use agent_core::supervisor::run_of;

/// What the fan-out that started a subagent says about its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inherited {
    /// When the run started (Unix milliseconds).
    pub started_ms: u64,
    /// The supervisor's tokens when it fanned out.
    pub tokens: u64,
}

/// The fan-out that started the subagent `request` (session `session_id`), waiting a while for it
/// to be written. `None`: no fan-out of this service started it.
pub async fn fanout_of(
    store: &GraphStore,
    request: &AgentRequest,
    session_id: &str,
) -> Result<Option<Inherited>, GraphError> {
    let fanout = SessionUris::new(&request.parent_session_id).fanout(&request.correlation_id);
    let session = SessionUris::new(session_id).session();
    let (Ok(fanout), Ok(session)) = (NamedNode::new(fanout), NamedNode::new(session)) else {
        return Ok(None);
    };
    let query = queries::fanout_of_subagent(&fanout, &session);
    let deadline = tokio::time::Instant::now() + FANOUT_WAIT;
    loop {
        if let QueryAnswer::Rows(rows) = store.query(query.clone()).await? {
            if !rows.rows.is_empty() {
                let number = |name: &str| number(rows.first(name));
                return Ok(Some(Inherited {
                    started_ms: number("started"),
                    tokens: number("in").saturating_add(number("out")),
                }));
            }
        }
        if tokio::time::Instant::now() >= deadline {
            return Ok(None);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether a fan-out above the subagent `session_id` (its own, or any of its supervisor's, up to
/// the root) has been answered without waiting for it: a timed-out fan-out's subagents stop rather
/// than go on spending for a synthesis that has been written.
pub async fn abandoned(store: &GraphStore, session_id: &str) -> Result<bool, GraphError> {
    let mut fanouts = Vec::new();
    let mut session = session_id;
    while let Some(place) = place_of(session) {
        let fanout = SessionUris::new(place.supervisor).fanout(place.correlation_id);
        if let Ok(node) = NamedNode::new(fanout) {
            fanouts.push(node);
        }
        session = place.supervisor;
    }
    if fanouts.is_empty() {
        return Ok(false);
    }
    Ok(matches!(
        store.query(queries::any_fanout_answered(&fanouts)).await?,
        QueryAnswer::Boolean(true)
    ))
}

/// What the graph holds of a run's spend, read by one of its sessions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordedSpend {
    /// The tokens of every recorded LLM call (and LLM-backed tool run) of the run.
    pub tokens: u64,
    /// Of those, the ones recorded under the reading session or a subagent nested below it.
    pub under_session: u64,
}

impl RecordedSpend {
    /// The run's tokens as a step of the session counts them, `own` being what the session knows
    /// it has spent (its calls, and its subagents' that came back with their results). The graph
    /// is written behind the steps: a session's own last call is often not in it yet when its
    /// next step asks, and siblings stepping together would each miss theirs, running a round
    /// past the budget. What lies outside the session is still read from the graph. Where the
    /// graph holds spend under the session that `own` does not count (a subagent still running
    /// after its fan-out timed out), the larger of the two sums stands, which may miss the smaller
    /// of that spend and the session's own unrecorded last call: never less than the graph says.
    pub fn with_own(self, own: u64) -> u64 {
        let outside = self.tokens.saturating_sub(self.under_session);
        self.tokens.max(outside.saturating_add(own))
    }
}

/// What every recorded LLM call of `run` (a session URI) has used, and how much of it was
/// recorded under `session` (a session URI) and its subagents.
pub async fn run_tokens(
    store: &GraphStore,
    run: &str,
    session: &str,
) -> Result<RecordedSpend, GraphError> {
    let (Ok(run), Ok(session)) = (NamedNode::new(run), NamedNode::new(session)) else {
        return Ok(RecordedSpend::default());
    };
    Ok(
        match store.query(queries::run_tokens(&run, &session)).await? {
            QueryAnswer::Rows(rows) => RecordedSpend {
                tokens: number(rows.first("tokens")),
                under_session: number(rows.first("under")),
            },
            _ => RecordedSpend::default(),
        },
    )
}

/// The iterations of `run` (a session URI) that called the LLM, as the graph records them.
pub async fn run_iterations(store: &GraphStore, run: &str) -> Result<usize, GraphError> {
    let Ok(run) = NamedNode::new(run) else {
        return Ok(0);
    };
    Ok(match store.query(queries::run_iterations(&run)).await? {
        QueryAnswer::Rows(rows) => {
            usize::try_from(number(rows.first("iterations"))).unwrap_or(usize::MAX)
        }
        _ => 0,
    })
}

fn number(term: Option<&Term>) -> u64 {
    match term {
        Some(Term::Literal(l)) => l
            .value()
            .parse::<f64>()
            .map(|v| v.max(0.0) as u64)
            .unwrap_or(0),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Three sibling subagents of a supervisor that spent 300 on its split; `s0` asks.
    async fn siblings(recorded: &[(&str, u64)]) -> RecordedSpend {
        let store = GraphStore::in_memory().unwrap();
        let run = SessionUris::new("r").session();
        let mut quads = String::new();
        for (node, tokens) in recorded {
            quads.push_str(&format!(
                "<{run}{node}> <{tg}run> <{run}> ; <{tg}inToken> {tokens} ; <{tg}outToken> 0 .\n",
                tg = agent_core::vocab::TG,
            ));
        }
        store
            .update(format!(
                "INSERT DATA {{ GRAPH <{}> {{ {quads} }} }}",
                agent_core::vocab::PROVENANCE_GRAPH
            ))
            .await
            .unwrap();
        let session = SessionUris::new("r-f1-s0").session();
        run_tokens(&store, &run, &session).await.unwrap()
    }

    #[tokio::test]
    async fn a_sessions_own_spend_is_counted_whether_or_not_the_graph_has_it_yet() {
        let split = ("/fanout/r-f1", 300);
        // Each branch's first call recorded, s0's second (its last) not yet.
        let recorded = siblings(&[
            split,
            ("-f1-s0/i1", 100),
            ("-f1-s1/i1", 100),
            ("-f1-s10/i1", 100),
            ("-f1-s0-f2-s0/i1", 40),
        ])
        .await;
        assert_eq!(
            recorded,
            RecordedSpend {
                tokens: 640,
                under_session: 140
            },
            "-s10 is not below -s0; -s0-f2-s0 is"
        );
        // s0 knows its two calls and its subagent's: 100 + 150 + 40.
        assert_eq!(recorded.with_own(290), 300 + 100 + 100 + 290);
        // What it knows is never less than the graph says, which may be ahead of it (a
        // subagent of its own still spending after its supervisor stopped waiting).
        assert_eq!(recorded.with_own(0), 640);
        assert_eq!(siblings(&[]).await.with_own(0), 0);
    }
}
