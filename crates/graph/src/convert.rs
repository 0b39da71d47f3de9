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

/// Converts a term, moving its text into the RDF term rather than copying it (the aggregator
/// converts every term of every explainability message it writes).
fn term(t: WireTerm) -> Result<Term, TermError> {
    let WireTerm {
        kind,
        iri,
        id,
        value,
        datatype,
        language,
        ..
    } = t;
    match kind.as_str() {
        "i" => Ok(NamedNode::new(iri).map_err(|e| err("IRI", e))?.into()),
        "b" => Ok(BlankNode::new(id).map_err(|e| err("blank node", e))?.into()),
        "l" if !language.is_empty() => Ok(Literal::new_language_tagged_literal(value, language)
            .map_err(|e| err("language tag", e))?
            .into()),
        "l" if !datatype.is_empty() => {
            let datatype = NamedNode::new(datatype).map_err(|e| err("datatype", e))?;
            Ok(Literal::new_typed_literal(value, datatype).into())
        }
        "l" => Ok(Literal::new_simple_literal(value).into()),
        other => Err(err("term type", format!("'{other}' is not supported"))),
    }
}

/// Converts one wire triple; `g` names the graph (None or empty = the default graph).
pub fn into_quad(t: WireTriple) -> Result<Quad, TermError> {
    let WireTriple { s, p, o, g } = t;
    let subject: NamedOrBlankNode = match term(s)? {
        Term::NamedNode(n) => n.into(),
        Term::BlankNode(b) => b.into(),
        _ => return Err(err("subject", "a literal cannot be a subject")),
    };
    let predicate = match term(p)? {
        Term::NamedNode(n) => n,
        _ => return Err(err("predicate", "a predicate must be an IRI")),
    };
    let object = term(o)?;
    let graph = match g {
        None => GraphName::DefaultGraph,
        Some(g) if g.is_empty() => GraphName::DefaultGraph,
        Some(g) => NamedNode::new(g).map_err(|e| err("graph", e))?.into(),
    };
    Ok(Quad::new(subject, predicate, object, graph))
}

/// Converts every triple, failing on the first invalid one.
pub fn into_quads(triples: Vec<WireTriple>) -> Result<Vec<Quad>, TermError> {
    triples.into_iter().map(into_quad).collect()
}

/// Converts every triple that is valid RDF and tells which are not: each one left out, by its place
/// among `triples`, with why.
pub fn into_valid_quads(triples: Vec<WireTriple>) -> (Vec<Quad>, Vec<(usize, TermError)>) {
    let mut quads = Vec::with_capacity(triples.len());
    let mut invalid = Vec::new();
    for (place, triple) in triples.into_iter().enumerate() {
        match into_quad(triple) {
            Ok(quad) => quads.push(quad),
            Err(e) => invalid.push((place, e)),
        }
    }
    (quads, invalid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_triples_that_are_not_rdf_are_left_out() {
        let triple = |s: &str| WireTriple {
            s: WireTerm::iri(s),
            p: WireTerm::iri("urn:p"),
            o: WireTerm::literal("x"),
            g: None,
        };
        let (quads, invalid) = into_valid_quads(vec![
            triple("urn:a"),
            triple("not an iri"),
            triple("urn:b"),
            triple("urn:c d"),
        ]);
        let subjects: Vec<String> = quads.iter().map(|q| q.subject.to_string()).collect();
        assert_eq!(subjects, ["<urn:a>", "<urn:b>"]);
        let places: Vec<usize> = invalid.iter().map(|(place, _)| *place).collect();
        assert_eq!(places, [1, 3]);
        assert!(invalid.iter().all(|(_, e)| e.what == "IRI"), "{invalid:?}");
    }

    #[test]
    fn literals_keep_hostile_text_verbatim() {
        let text = "\"} ; DROP ALL ; {\" <script>\nline two";
        let t = WireTriple {
            s: WireTerm::iri("urn:a"),
            p: WireTerm::iri("urn:p"),
            o: WireTerm::literal(text),
            g: Some(agent_core::vocab::PROVENANCE_GRAPH.into()),
        };
        let quad = into_quad(t).unwrap();
        match quad.object {
            Term::Literal(l) => assert_eq!(l.value(), text),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn each_triple_keeps_its_own_graph_and_a_bad_graph_is_rejected() {
        let in_graph = |g: Option<&str>| WireTriple {
            s: WireTerm::iri("urn:a"),
            p: WireTerm::iri("urn:p"),
            o: WireTerm::literal("x"),
            g: g.map(str::to_owned),
        };
        let quads = into_quads(vec![
            in_graph(Some("urn:g1")),
            in_graph(Some("urn:g1")),
            in_graph(Some("urn:g2")),
            in_graph(None),
            in_graph(Some("")),
            in_graph(Some("urn:g1")),
        ])
        .unwrap();
        let graphs: Vec<String> = quads.iter().map(|q| q.graph_name.to_string()).collect();
        assert_eq!(
            graphs,
            ["<urn:g1>", "<urn:g1>", "<urn:g2>", "DEFAULT", "DEFAULT", "<urn:g1>"]
        );
        let refused = into_quads(vec![in_graph(Some("urn:g1")), in_graph(Some("urn:g1> x"))]);
        assert_eq!(refused.unwrap_err().what, "graph");
    }

    #[test]
    fn blank_nodes_tagged_and_typed_literals_convert_and_bad_ones_are_rejected() {
        let with = |s: WireTerm, o: WireTerm| WireTriple {
            s,
            p: WireTerm::iri("urn:p"),
            o,
            g: None,
        };
        let blank = |id: &str| WireTerm {
            kind: "b".to_owned(),
            id: id.to_owned(),
            ..WireTerm::default()
        };
        let tagged = |value: &str, language: &str, datatype: &str| WireTerm {
            kind: "l".to_owned(),
            value: value.to_owned(),
            language: language.to_owned(),
            datatype: datatype.to_owned(),
            ..WireTerm::default()
        };
        let typed = WireTerm::typed_literal("7", "http://www.w3.org/2001/XMLSchema#integer");
        let quads = into_quads(vec![
            with(blank("b1"), tagged("chat", "FR", "")),
            // A language tag is what the literal is, whatever datatype is also sent.
            with(WireTerm::iri("urn:a"), tagged("cat", "en", "urn:ignored")),
            with(WireTerm::iri("urn:a"), typed),
        ])
        .unwrap();
        let written: Vec<String> = quads
            .iter()
            .map(|q| format!("{} {}", q.subject, q.object))
            .collect();
        assert_eq!(
            written,
            [
                "_:b1 \"chat\"@fr",
                "<urn:a> \"cat\"@en",
                "<urn:a> \"7\"^^<http://www.w3.org/2001/XMLSchema#integer>",
            ]
        );
        let refused = |t: WireTriple| into_quad(t).unwrap_err().what;
        assert_eq!(
            refused(with(blank("no spaces"), WireTerm::literal("x"))),
            "blank node"
        );
        assert_eq!(
            refused(with(WireTerm::iri("urn:a"), tagged("x", "not a tag", ""))),
            "language tag"
        );
        assert_eq!(
            refused(with(
                WireTerm::iri("urn:a"),
                WireTerm::typed_literal("x", "no iri")
            )),
            "datatype"
        );
        assert_eq!(
            refused(with(WireTerm::literal("x"), WireTerm::literal("y"))),
            "subject"
        );
    }

    #[test]
    fn invalid_iris_are_rejected() {
        let t = WireTriple {
            s: WireTerm::iri("urn:a> <urn:b"),
            p: WireTerm::iri("urn:p"),
            o: WireTerm::literal("x"),
            g: None,
        };
        assert_eq!(into_quad(t).unwrap_err().what, "IRI");
    }
}
