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

/// The tokens every recorded LLM call of `run` (a session URI) has used.
pub async fn run_tokens(store: &GraphStore, run: &str) -> Result<u64, GraphError> {
    let Ok(run) = NamedNode::new(run) else {
        return Ok(0);
    };
    Ok(match store.query(queries::run_tokens(&run)).await? {
        QueryAnswer::Rows(rows) => number(rows.first("tokens")),
        _ => 0,
    })
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
