//! `Triples`: RDF statements as TrustGraph carries them on the explainability topic.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A batch of triples: a step's provenance nodes (the orchestrator sends a step's nodes in one,
/// a fan-out or a completion in one of its own), `metadata.id` naming the first.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct Triples {
    pub metadata: Metadata,
    pub triples: Vec<Triple>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct Metadata {
    pub id: String,
    pub root: String,
    pub collection: String,
}

/// One statement; `g` is the named graph (`urn:graph:retrieval` for provenance).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct Triple {
    pub s: Term,
    pub p: Term,
    pub o: Term,
    pub g: Option<String>,
}

/// An RDF term: `type` is `i` (IRI), `b` (blank node), `l` (literal) or `t` (quoted triple).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(default)]
pub struct Term {
    #[serde(rename = "type")]
    pub kind: String,
    pub iri: String,
    pub id: String,
    pub value: String,
    pub datatype: String,
    pub language: String,
    pub triple: Option<Box<Triple>>,
}

impl Term {
    pub fn iri(iri: impl Into<String>) -> Term {
        Term {
            kind: "i".to_owned(),
            iri: iri.into(),
            ..Term::default()
        }
    }

    /// A plain (`xsd:string`) literal, written with an empty datatype as TrustGraph does.
    pub fn literal(value: impl Into<String>) -> Term {
        Term {
            kind: "l".to_owned(),
            value: value.into(),
            ..Term::default()
        }
    }

    pub fn typed_literal(value: impl Into<String>, datatype: impl Into<String>) -> Term {
        Term {
            kind: "l".to_owned(),
            value: value.into(),
            datatype: datatype.into(),
            ..Term::default()
        }
    }
}

/// `encoded` (a [`Triples`] message as [`crate::encode`] writes it) with `more` added to its
/// triples, without parsing it: its triples are its last field, so the new ones go before its
/// closing `]}`. `None` when `encoded` does not end so (not written by [`crate::encode`]); the
/// caller then parses it. A step's nodes and graph-only records join its shared graph message
/// this way: parsing and writing again a message of 10-15 KB was a few percent of a busy
/// orchestrator.
pub fn append_triples(encoded: &str, more: &[Triple]) -> Option<String> {
    append_triples_below(encoded, more, usize::MAX)
}

/// [`append_triples`], or `None` when the message would then be `limit` bytes or more.
pub fn append_triples_below(encoded: &str, more: &[Triple], limit: usize) -> Option<String> {
    let body = encoded.strip_suffix("]}")?;
    if more.is_empty() {
        return Some(encoded.to_owned());
    }
    let added = crate::encode(&more);
    let added = std::str::from_utf8(&added).ok()?;
    let items = added.strip_prefix('[')?.strip_suffix(']')?;
    if encoded.len() + items.len() + 1 >= limit {
        return None;
    }
    let separator = if body.ends_with('[') { "" } else { "," };
    Some(format!("{body}{separator}{items}]}}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(triples: Vec<Triple>) -> Triples {
        Triples {
            metadata: Metadata {
                id: "urn:n".into(),
                root: "urn:r".into(),
                collection: "default".into(),
            },
            triples,
        }
    }

    fn triple(n: usize) -> Triple {
        Triple {
            s: Term::iri(format!("urn:s{n}")),
            p: Term::iri("urn:p"),
            o: Term::literal(format!("a \"quoted\" ]}} value {n}")),
            g: Some("urn:graph:retrieval".into()),
        }
    }

    /// Appending gives the very bytes of the message written with all its triples, whether it had
    /// triples before or none, and adding none changes nothing.
    #[test]
    fn appended_triples_read_as_if_written_together() {
        for (before, more) in [(2, 3), (0, 2), (3, 0), (0, 0)] {
            let first: Vec<Triple> = (0..before).map(triple).collect();
            let added: Vec<Triple> = (before..before + more).map(triple).collect();
            let encoded = String::from_utf8(crate::encode(&message(first.clone()))).unwrap();
            let appended = append_triples(&encoded, &added).unwrap();
            let together = crate::encode(&message(first.into_iter().chain(added).collect()));
            assert_eq!(
                appended.as_bytes(),
                together.as_slice(),
                "{before} + {more}"
            );
        }
    }

    /// A limit refuses exactly the messages that would reach it.
    #[test]
    fn appending_below_a_limit_refuses_what_would_reach_it() {
        let encoded = String::from_utf8(crate::encode(&message(vec![triple(0)]))).unwrap();
        let together = crate::encode(&message(vec![triple(0), triple(1)])).len();
        assert_eq!(append_triples_below(&encoded, &[triple(1)], together), None);
        let appended = append_triples_below(&encoded, &[triple(1)], together + 1).unwrap();
        assert_eq!(appended.len(), together);
    }

    #[test]
    fn a_message_not_ending_in_its_triples_is_left_to_the_caller() {
        assert_eq!(
            append_triples(r#"{"triples":[],"metadata":{}}"#, &[triple(1)]),
            None
        );
        assert_eq!(append_triples("", &[triple(1)]), None);
    }
}
