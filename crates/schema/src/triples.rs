//! `Triples`: RDF statements as TrustGraph carries them on the explainability topic.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A batch of triples about one provenance node.
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
