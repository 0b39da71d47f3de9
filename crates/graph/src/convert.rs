//! Conversion between the wire's `Triple`/`Term` (TrustGraph's JSON shape) and typed RDF quads.
//! Invalid IRIs, blank node ids or language tags are rejected here, before anything reaches a store.

use agent_schema::{Term as WireTerm, Triple as WireTriple};
use oxigraph::model::{BlankNode, GraphName, Literal, NamedNode, NamedOrBlankNode, Quad, Term};

/// Why a wire triple is not valid RDF.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {what}: {message}")]
pub struct TermError {
    pub what: &'static str,
    pub message: String,
}

fn err(what: &'static str, e: impl std::fmt::Display) -> TermError {
    TermError {
        what,
        message: e.to_string(),
    }
}

fn term(t: &WireTerm) -> Result<Term, TermError> {
    match t.kind.as_str() {
        "i" => Ok(NamedNode::new(&t.iri).map_err(|e| err("IRI", e))?.into()),
        "b" => Ok(BlankNode::new(&t.id)
            .map_err(|e| err("blank node", e))?
            .into()),
        "l" if !t.language.is_empty() => {
            Ok(Literal::new_language_tagged_literal(&t.value, &t.language)
                .map_err(|e| err("language tag", e))?
                .into())
        }
        "l" if !t.datatype.is_empty() => {
            let datatype = NamedNode::new(&t.datatype).map_err(|e| err("datatype", e))?;
            Ok(Literal::new_typed_literal(&t.value, datatype).into())
        }
        "l" => Ok(Literal::new_simple_literal(&t.value).into()),
        other => Err(err("term type", format!("'{other}' is not supported"))),
    }
}

/// Converts one wire triple; `g` names the graph (None or empty = the default graph).
pub fn to_quad(t: &WireTriple) -> Result<Quad, TermError> {
    let subject: NamedOrBlankNode = match term(&t.s)? {
        Term::NamedNode(n) => n.into(),
        Term::BlankNode(b) => b.into(),
        _ => return Err(err("subject", "a literal cannot be a subject")),
    };
    let predicate = match term(&t.p)? {
        Term::NamedNode(n) => n,
        _ => return Err(err("predicate", "a predicate must be an IRI")),
    };
    let object = term(&t.o)?;
    let graph = match t.g.as_deref() {
        None | Some("") => GraphName::DefaultGraph,
        Some(g) => NamedNode::new(g).map_err(|e| err("graph", e))?.into(),
    };
    Ok(Quad::new(subject, predicate, object, graph))
}

/// Converts every triple, failing on the first invalid one.
pub fn to_quads(triples: &[WireTriple]) -> Result<Vec<Quad>, TermError> {
    triples.iter().map(to_quad).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_keep_hostile_text_verbatim() {
        let text = "\"} ; DROP ALL ; {\" <script>\nline two";
        let t = WireTriple {
            s: WireTerm::iri("urn:a"),
            p: WireTerm::iri("urn:p"),
            o: WireTerm::literal(text),
            g: Some(agent_core::vocab::PROVENANCE_GRAPH.into()),
        };
        let quad = to_quad(&t).unwrap();
        match quad.object {
            Term::Literal(l) => assert_eq!(l.value(), text),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn invalid_iris_are_rejected() {
        let t = WireTriple {
            s: WireTerm::iri("urn:a> <urn:b"),
            p: WireTerm::iri("urn:p"),
            o: WireTerm::literal("x"),
            g: None,
        };
        assert_eq!(to_quad(&t).unwrap_err().what, "IRI");
    }
}
