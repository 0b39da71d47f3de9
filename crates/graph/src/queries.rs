//! The SPARQL the system runs, built from typed terms: IRIs are validated `NamedNode`s and values are
//! `Literal`s, whose `Display` escapes them, so user text can never change a query's shape.

use oxigraph::model::NamedNode;

use crate::GraphError;

pub const PROV: &str = "http://www.w3.org/ns/prov#";
pub const TG: &str = "https://trustgraph.ai/ns/";
/// The named graph holding provenance.
pub const PROVENANCE_GRAPH: &str = "urn:graph:retrieval";

const PREFIXES: &str = "PREFIX prov: <http://www.w3.org/ns/prov#>\nPREFIX tg: <https://trustgraph.ai/ns/>\nPREFIX rdfs: <http://www.w3.org/2000/01/rdf-schema#>\n";

/// The URI of a session's root node.
pub fn session_node(session_id: &str) -> Result<NamedNode, GraphError> {
    let iri = if session_id.starts_with("urn:") {
        session_id.to_owned()
    } else {
        format!("urn:trustgraph:agent:{session_id}")
    };
    NamedNode::new(iri).map_err(|e| GraphError::Syntax(format!("not a session id: {e}")))
}

fn graph() -> NamedNode {
    NamedNode::new_unchecked(PROVENANCE_GRAPH)
}

/// Every triple of one session: the nodes derived (transitively) from its root, and the documents
/// they point to. Its cost follows the size of the session, not of the graph: the path starts at a
/// bound node and walks the object index.
pub fn session_triples(session: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?s ?p ?o WHERE {{ GRAPH {g} {{
  {{ ?s prov:wasDerivedFrom* {session} . ?s ?p ?o }}
  UNION
  {{ ?n prov:wasDerivedFrom* {session} . ?n tg:document ?s . FILTER(?s != ?n) ?s ?p ?o }}
}} }}"
    )
}

/// The most recently started session.
pub fn last_session() -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?s WHERE {{ GRAPH {g} {{ ?s a tg:AgentQuestion ; prov:startedAtTime ?t }} }} ORDER BY DESC(?t) LIMIT 1"
    )
}

/// Whether a node exists in the provenance graph (used to wait for a dialog's record to land).
pub fn node_exists(node: &NamedNode) -> String {
    let g = graph();
    format!("ASK {{ GRAPH {g} {{ {node} ?p ?o }} }}")
}

/// Everything reachable from `start` by following derivation and thought links towards the root.
pub fn derivation_closure(start: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT DISTINCT ?n WHERE {{ GRAPH {g} {{ {start} (prov:wasDerivedFrom|tg:thought)* ?n }} }}"
    )
}
