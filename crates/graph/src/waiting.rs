//! The index of what still waits on the aggregator: fan-outs not yet synthesised and calls parked
//! for approval not yet answered, each named in [`WAITING_GRAPH`]. The sweeps (fan-out timeouts,
//! approval expiries, the count of open fan-outs) start from it instead of from every fan-out and
//! approval the store ever recorded, so their work grows with what is open, not with history.
//!
//! It is an index, never the record: a node is marked when the message recording it is written
//! (in the same transaction), the sweeps still check the record itself (a mark whose node was
//! answered is skipped), and marks of answered nodes are removed by the sweep of their kind. A
//! message written again after its node was answered marks it again, to be removed again.

use oxigraph::model::{GraphName, NamedNode, NamedNodeRef, NamedOrBlankNode, Quad, Term};

use agent_core::vocab::{
    tg, PROVENANCE_GRAPH, SESSION_PREFIX, SPARQL_PREFIXES as PREFIXES, WAITING_GRAPH,
};

use crate::{GraphError, GraphStore, QueryAnswer};

/// What a node waits for: a fan-out its synthesis, a parked call its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waits {
    Synthesis,
    ApprovalAnswer,
}

impl Waits {
    /// The class a mark names as awaited.
    fn class(self) -> NamedNodeRef<'static> {
        match self {
            Waits::Synthesis => tg::SYNTHESIS,
            Waits::ApprovalAnswer => tg::APPROVAL_ANSWER,
        }
    }

    /// What a node of class `class` waits for, if anything.
    fn of_class(class: &str) -> Option<Waits> {
        if class == tg::FAN_OUT.as_str() {
            Some(Waits::Synthesis)
        } else if class == tg::APPROVAL_REQUEST.as_str() {
            Some(Waits::ApprovalAnswer)
        } else {
            None
        }
    }
}

/// How many marks one update adds or removes.
const PAGE: usize = 1_000;

fn waiting() -> NamedNode {
    NamedNode::new_unchecked(WAITING_GRAPH)
}

fn provenance() -> NamedNode {
    NamedNode::new_unchecked(PROVENANCE_GRAPH)
}

/// The mark that says `node` waits for `what`.
fn mark(node: NamedNode, what: Waits) -> Quad {
    Quad::new(
        node,
        tg::AWAITS,
        what.class(),
        GraphName::NamedNode(waiting()),
    )
}

/// The marks to write beside `quads` (one explainability message): one for each of the agent's
/// fan-outs and approval requests they type in the provenance graph, where the sweeps read them.
pub fn marks_for(quads: &[Quad]) -> Vec<Quad> {
    let mut marks: Vec<Quad> = Vec::new();
    for quad in quads {
        let (NamedOrBlankNode::NamedNode(node), Term::NamedNode(class)) =
            (&quad.subject, &quad.object)
        else {
            continue;
        };
        let in_provenance =
            matches!(&quad.graph_name, GraphName::NamedNode(g) if g.as_str() == PROVENANCE_GRAPH);
        if !in_provenance
            || quad.predicate.as_str() != agent_core::vocab::RDF_TYPE.as_str()
            || !node.as_str().starts_with(SESSION_PREFIX)
        {
            continue;
        }
        if let Some(what) = Waits::of_class(class.as_str()) {
            let mark = mark(node.clone(), what);
            if !marks.contains(&mark) {
                marks.push(mark);
            }
        }
    }
    marks
}

/// The graph pattern that finds `?n`, marked as waiting for `what`, already answered.
fn answered_pattern(what: Waits) -> String {
    match what {
        Waits::Synthesis => {
            "{ ?n tg:synthesisRequested ?done } UNION { ?n tg:fanInRefused ?why }".to_owned()
        }
        // From the request to its answer, then the answer's type: planned inside a NOT EXISTS,
        // the two patterns as one join read every answer for each request.
        Waits::ApprovalAnswer => {
            "?answer prov:wasDerivedFrom ?n FILTER EXISTS { ?answer a tg:ApprovalAnswer }"
                .to_owned()
        }
    }
}

/// The nodes marked as waiting for `what` that were answered since (`?n`).
pub fn answered(what: Waits) -> String {
    let (w, g, class) = (waiting(), provenance(), what.class());
    format!(
        "{PREFIXES}SELECT DISTINCT ?n WHERE {{ GRAPH {w} {{ ?n tg:awaits {class} }}
  GRAPH {g} {{ {answered} }} }}",
        answered = answered_pattern(what)
    )
}

/// The agent's nodes that wait for something and carry no mark (`?n ?what`), at most `limit` of
/// them: a store written before the index was kept, or by an aggregator of an earlier build.
pub fn unmarked(limit: usize) -> String {
    let (w, g) = (waiting(), provenance());
    let (synthesis, answer) = (Waits::Synthesis.class(), Waits::ApprovalAnswer.class());
    format!(
        "{PREFIXES}SELECT ?n ?what WHERE {{
  GRAPH {g} {{
    {{ ?n a tg:FanOut . BIND ({synthesis} AS ?what)
      FILTER NOT EXISTS {{ {fanouts_answered} }} }}
    UNION
    {{ ?n a tg:ApprovalRequest . BIND ({answer} AS ?what)
      FILTER NOT EXISTS {{ {approvals_answered} }} }}
    FILTER (STRSTARTS(STR(?n), \"{SESSION_PREFIX}\")) }}
  FILTER NOT EXISTS {{ GRAPH {w} {{ ?n tg:awaits ?what }} }} }} LIMIT {limit}",
        fanouts_answered = answered_pattern(Waits::Synthesis),
        approvals_answered = answered_pattern(Waits::ApprovalAnswer),
    )
}

/// Removes the marks of answered nodes waiting for `what`; how many went.
pub async fn tidy(store: &GraphStore, what: Waits) -> Result<usize, GraphError> {
    let QueryAnswer::Rows(rows) = store.query(answered(what)).await? else {
        return Ok(0);
    };
    let nodes: Vec<String> = rows
        .column("n")
        .into_iter()
        .filter_map(|n| match n {
            Some(Term::NamedNode(n)) => Some(n.to_string()),
            _ => None,
        })
        .collect();
    let (w, class) = (waiting(), what.class());
    for page in nodes.chunks(PAGE) {
        let marks: Vec<String> = page
            .iter()
            .map(|node| format!("{node} {} {class} .", tg::AWAITS))
            .collect();
        store
            .update(format!(
                "DELETE DATA {{ GRAPH {w} {{ {} }} }}",
                marks.join("\n")
            ))
            .await?;
    }
    Ok(nodes.len())
}

/// How long one page of [`mark_unmarked`]'s reading may take, and how much work it may make: it
/// reads every fan-out and approval ever recorded, which a large store may not allow within the
/// bounds of a query from a client.
fn unmarked_bounds() -> crate::QueryBounds {
    crate::QueryBounds {
        timeout: std::time::Duration::from_secs(600),
        max_rows: PAGE,
        max_bindings: crate::QueryBounds::DEFAULT_MAX_BINDINGS,
    }
}

/// Marks every node that waits and carries no mark (a store written before the index was kept,
/// or by an aggregator of an earlier build); how many it marked. It reads the whole record, a
/// page of marks at a time (what it marked is not read again); dropped, it stops the reading.
pub async fn mark_unmarked(store: &GraphStore) -> Result<usize, GraphError> {
    let mut count = 0;
    loop {
        let QueryAnswer::Rows(rows) = store
            .query_bounded(unmarked(PAGE), unmarked_bounds())
            .await?
        else {
            return Ok(count);
        };
        let marks: Vec<Quad> = rows
            .column("n")
            .into_iter()
            .zip(rows.column("what"))
            .filter_map(|(n, what)| match (n, what) {
                (Some(Term::NamedNode(n)), Some(Term::NamedNode(what))) => {
                    let what = if what.as_str() == tg::SYNTHESIS.as_str() {
                        Waits::Synthesis
                    } else {
                        Waits::ApprovalAnswer
                    };
                    Some(mark(n.clone(), what))
                }
                _ => None,
            })
            .collect();
        // A page none of whose rows made a mark would be read again for ever.
        let last_page = rows.rows.len() < PAGE || marks.is_empty();
        count += marks.len();
        if !marks.is_empty() {
            store.insert(marks).await?;
        }
        if last_page {
            return Ok(count);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn literal(text: &str) -> oxigraph::model::Literal {
        oxigraph::model::Literal::new_simple_literal(text)
    }

    fn typed(node: &str, class: NamedNodeRef<'_>, graph: &str) -> Quad {
        Quad::new(
            NamedNode::new_unchecked(node),
            agent_core::vocab::RDF_TYPE,
            class,
            GraphName::NamedNode(NamedNode::new_unchecked(graph)),
        )
    }

    #[test]
    fn only_the_agents_fan_outs_and_approval_requests_in_the_provenance_graph_are_marked() {
        let fanout = "urn:trustgraph:agent:s/fanout/1";
        let approval = "urn:trustgraph:agent:s/i1/approval";
        let quads = vec![
            typed(fanout, tg::FAN_OUT, PROVENANCE_GRAPH),
            typed(fanout, tg::FAN_OUT, PROVENANCE_GRAPH),
            typed(approval, tg::APPROVAL_REQUEST, PROVENANCE_GRAPH),
            typed("urn:someone:else", tg::FAN_OUT, PROVENANCE_GRAPH),
            typed(
                "urn:trustgraph:agent:s/fanout/2",
                tg::FAN_OUT,
                "urn:graph:other",
            ),
            typed("urn:trustgraph:agent:s/i1", tg::THOUGHT, PROVENANCE_GRAPH),
            Quad::new(
                NamedNode::new_unchecked(fanout),
                tg::CORRELATION_ID,
                literal("s-f1"),
                GraphName::NamedNode(provenance()),
            ),
        ];
        let marks = marks_for(&quads);
        assert_eq!(
            marks,
            vec![
                mark(NamedNode::new_unchecked(fanout), Waits::Synthesis),
                mark(NamedNode::new_unchecked(approval), Waits::ApprovalAnswer),
            ]
        );
    }
}
