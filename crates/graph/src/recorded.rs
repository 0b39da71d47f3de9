//! What the graph recorded of a run that a fork or a replay starts from: step `n`'s input, rebuilt
//! from the records each step leaves (see `agent_core::fork`), the LLM calls' answers by the
//! digest of what they asked, and the tool calls' observations by tool and arguments (each with
//! where it was made, for a question asked more than once); and the
//! answer a dialog concluded with, for a client whose streamed copy of it is not whole.

use std::collections::{BTreeMap, HashMap};

use agent_core::fork::{rebuild, RecordedInput};
use agent_core::replay::{CallPlace, Placed};
use agent_schema::AgentRequest;
use oxigraph::model::Term;

use crate::{queries, GraphError, GraphStore};

fn text(term: Option<&Term>) -> Option<String> {
    match term {
        Some(Term::Literal(l)) => Some(l.value().to_owned()),
        Some(Term::NamedNode(n)) => Some(n.as_str().to_owned()),
        _ => None,
    }
}

/// Step `n`'s whole input in `session`: `Ok(Err(why))` when the graph does not hold enough to
/// rebuild it (a record missing, or one that does not decode).
pub async fn step_input(
    store: &GraphStore,
    session: &str,
    n: usize,
) -> Result<Result<AgentRequest, String>, GraphError> {
    let node = queries::session_node(session)?;
    let mut records = Vec::new();
    for first in (1..=n).step_by(queries::STEP_INPUTS_PAGE) {
        let last = first.saturating_add(queries::STEP_INPUTS_PAGE - 1).min(n);
        let rows = store
            .query(queries::step_inputs(&node, first..=last))
            .await?
            .rows();
        if let Err(why) = add_records(&rows, &mut records) {
            return Ok(Err(why));
        }
    }
    Ok(rebuild(&records, n))
}

/// The request recorded whole as step `n`'s input in `session` (not as a continuation of an
/// earlier step's), if one is: `None` when none is, or only its size (over the recorded bound),
/// or it does not decode.
pub async fn recorded_request(
    store: &GraphStore,
    session: &str,
    n: usize,
) -> Result<Option<AgentRequest>, GraphError> {
    let node = queries::session_node(session)?;
    let rows = store
        .query(queries::step_inputs(&node, n..=n))
        .await?
        .rows();
    let mut records = Vec::new();
    if add_records(&rows, &mut records).is_err() {
        return Ok(None);
    }
    Ok(records
        .into_iter()
        .find(|r| r.step == n && r.continues.is_none())
        .map(|r| r.request))
}

/// The step inputs in `rows` (see [`queries::step_inputs`]) added to `records`; `Err(why)` when
/// one does not decode.
fn add_records(rows: &crate::Rows, records: &mut Vec<RecordedInput>) -> Result<(), String> {
    let columns = ["step", "request", "from", "kept"].map(|c| rows.column(c));
    for i in 0..rows.rows.len() {
        let cell = |c: usize| text(columns[c].get(i).copied().flatten());
        let number = |c: usize| cell(c).and_then(|v| v.parse::<usize>().ok());
        let (Some(step), Some(json)) = (number(0), cell(1)) else {
            continue;
        };
        let request = match serde_json::from_str::<AgentRequest>(&json) {
            Ok(request) => request,
            Err(e) => return Err(format!("the input of step {step} does not decode: {e}")),
        };
        let from = cell(2).and_then(|iri| iri.rsplit('/').next()?.parse::<usize>().ok());
        let continues = from.zip(number(3));
        records.push(RecordedInput {
            step,
            continues,
            request,
        });
    }
    Ok(())
}

/// The answer `session` concluded with (its conclusion's document), once the graph records it.
pub async fn concluded_answer(
    store: &GraphStore,
    session: &str,
) -> Result<Option<String>, GraphError> {
    let node = queries::session_node(session)?;
    let rows = store.query(queries::dialog_answer(&node)).await?.rows();
    Ok(match rows.first("answer") {
        Some(Term::Literal(text)) => Some(text.value().to_owned()),
        _ => None,
    })
}

/// Whether the graph shows that `session` ended: its conclusion is written with its last step's
/// records, so once it shows, everything the dialog recorded does.
pub async fn concluded(store: &GraphStore, session: &str) -> Result<bool, GraphError> {
    let conclusion = queries::session_node(&format!("{session}/final"))?;
    Ok(matches!(
        store.query(queries::node_exists(&conclusion)).await?,
        crate::QueryAnswer::Boolean(true)
    ))
}

/// What a run recorded that a replay may give again instead of calling. A question may have been
/// asked more than once in a run, with different answers: each is kept, with where it was asked
/// (see [`agent_core::replay`]).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Recordings {
    /// The digest of what an LLM call asked -> each call that asked it (its node, its answer as
    /// JSON), in the order of their nodes.
    pub llm_calls: HashMap<String, Placed<(String, String)>>,
    /// (tool, arguments as JSON) -> what each call of it gave, in the order of their nodes.
    pub tool_results: BTreeMap<(String, String), Placed<RecordedToolResult>>,
}

/// What a recorded tool call gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedToolResult {
    /// The observation's node.
    pub node: String,
    pub text: String,
    /// How the call went (`ok`, `error` or `timeout`); `None` in a record older than outcomes.
    pub outcome: Option<String>,
}

/// The LLM calls and tool results recorded in `run` (its root session), subagents included.
pub async fn recordings(
    store: &GraphStore,
    run: &str,
    llm: bool,
    tools: bool,
) -> Result<Recordings, GraphError> {
    let run = queries::session_node(run)?;
    let mut found = Recordings::default();
    if llm {
        let rows = store.query(queries::recorded_llm_calls(&run)).await?.rows();
        let columns = ["call", "digest", "completion"].map(|c| rows.column(c));
        for i in 0..rows.rows.len() {
            let cell = |c: usize| text(columns[c].get(i).copied().flatten());
            if let (Some(call), Some(digest), Some(completion)) = (cell(0), cell(1), cell(2)) {
                let place = CallPlace::of_llm_call(&call);
                found
                    .llm_calls
                    .entry(digest)
                    .or_default()
                    .push((place, (call, completion)));
            }
        }
        // The order of a query's rows is the store's: the nodes' order does not change with it.
        for calls in found.llm_calls.values_mut() {
            calls.sort_by(|a, b| a.1 .0.cmp(&b.1 .0));
        }
    }
    if tools {
        let rows = store
            .query(queries::recorded_tool_results(&run))
            .await?
            .rows();
        let columns =
            ["action", "arguments", "observation", "text", "outcome"].map(|c| rows.column(c));
        for i in 0..rows.rows.len() {
            let cell = |c: usize| text(columns[c].get(i).copied().flatten());
            if let (Some(action), Some(arguments), Some(node), Some(text)) =
                (cell(0), cell(1), cell(2), cell(3))
            {
                let place = CallPlace::of_observation(&node);
                found
                    .tool_results
                    .entry((action, arguments))
                    .or_default()
                    .push((
                        place,
                        RecordedToolResult {
                            node,
                            text,
                            outcome: cell(4),
                        },
                    ));
            }
        }
        for results in found.tool_results.values_mut() {
            results.sort_by(|a, b| a.1.node.cmp(&b.1.node));
        }
    }
    Ok(found)
}
