//! The provenance vocabulary, defined once: the namespaces, the named graphs, the URI prefix of
//! sessions and the terms that more than one crate writes or queries. Fan-in, the journal, the
//! explain tools and the tests agree on a term because they all name it from here.

/// TrustGraph's namespace (`tg:`).
pub const TG: &str = "https://trustgraph.ai/ns/";
/// PROV-O (`prov:`).
pub const PROV: &str = "http://www.w3.org/ns/prov#";
pub const RDF_TYPE: &str = "http://www.w3.org/1999/02/22-rdf-syntax-ns#type";
pub const RDFS_LABEL: &str = "http://www.w3.org/2000/01/rdf-schema#label";
pub const XSD_INTEGER: &str = "http://www.w3.org/2001/XMLSchema#integer";
pub const XSD_DECIMAL: &str = "http://www.w3.org/2001/XMLSchema#decimal";
pub const XSD_BOOLEAN: &str = "http://www.w3.org/2001/XMLSchema#boolean";
pub const XSD_DATETIME: &str = "http://www.w3.org/2001/XMLSchema#dateTime";

/// The named graph that holds provenance (TrustGraph's retrieval graph).
pub const PROVENANCE_GRAPH: &str = "urn:graph:retrieval";
/// Where the orchestrators' journal of step outcomes lives: kept apart from the provenance, which
/// people query.
pub const JOURNAL_GRAPH: &str = "urn:graph:agent-journal";

/// The named graph of documents: long texts that left the messages (claim-check), each under its
/// content's digest.
pub const DOCUMENTS_GRAPH: &str = "urn:graph:agent-documents";

/// A document's IRI is this prefix and the SHA-256 of its text, in hex.
pub const DOCUMENT_PREFIX: &str = "urn:trustgraph:doc:sha256:";

/// Every session's URI is this followed by its id (TrustGraph's agent URIs).
pub const SESSION_PREFIX: &str = "urn:trustgraph:agent:";

/// The `PREFIX` lines for `prov:`, `tg:` and `rdfs:`, for SPARQL written against this vocabulary.
pub const SPARQL_PREFIXES: &str = "PREFIX prov: <http://www.w3.org/ns/prov#>\nPREFIX tg: <https://trustgraph.ai/ns/>\nPREFIX rdfs: <http://www.w3.org/2000/01/rdf-schema#>\n";

/// A `tg:` term's IRI, at compile time.
macro_rules! tg_term {
    ($local:literal) => {
        concat!("https://trustgraph.ai/ns/", $local)
    };
}

/// `tg:` terms named outside the provenance builders.
pub mod tg {
    /// A node that records what an LLM call cost.
    pub const IN_TOKEN: &str = tg_term!("inToken");
    /// The run (root session) a costed node belongs to.
    pub const RUN: &str = tg_term!("run");
    /// The `conversation_id` of the request that created a node.
    pub const CONVERSATION: &str = tg_term!("conversation");
    /// A supervisor's fan-out node (class).
    pub const FAN_OUT: &str = tg_term!("FanOut");
    /// The correlation id a fan-out and its completions share.
    pub const CORRELATION_ID: &str = tg_term!("correlationId");
    /// A journal entry's recorded outcome.
    pub const OUTCOME: &str = tg_term!("outcome");
    /// Whether a journal entry's outcome is on the broker.
    pub const PUBLISHED: &str = tg_term!("published");
    /// A document's whole text.
    pub const CONTENT: &str = tg_term!("content");
    /// What resuming a step parked for approval needs (its message and decision, as JSON).
    pub const CONTINUATION: &str = tg_term!("continuation");
    /// A node's seal: what only this service may have written.
    pub const SEAL: &str = tg_term!("seal");
}

/// The IRI of a session's root node.
pub fn session_uri(session_id: &str) -> String {
    if session_id.starts_with(SESSION_PREFIX) {
        session_id.to_owned()
    } else {
        format!("{SESSION_PREFIX}{session_id}")
    }
}

/// The session id inside a session node's IRI (or any node under it), if it is one.
pub fn session_id_of(iri: &str) -> Option<&str> {
    let rest = iri.strip_prefix(SESSION_PREFIX)?;
    Some(rest.split('/').next().unwrap_or(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_and_prefixes_agree_with_the_namespaces() {
        for term in [
            tg::IN_TOKEN,
            tg::RUN,
            tg::CONVERSATION,
            tg::FAN_OUT,
            tg::CORRELATION_ID,
            tg::OUTCOME,
            tg::PUBLISHED,
        ] {
            assert!(term.starts_with(TG), "{term}");
        }
        assert!(SPARQL_PREFIXES.contains(&format!("tg: <{TG}>")));
        assert!(SPARQL_PREFIXES.contains(&format!("prov: <{PROV}>")));
    }

    #[test]
    fn session_uris_round_trip() {
        assert_eq!(session_uri("abc"), "urn:trustgraph:agent:abc");
        assert_eq!(
            session_uri("urn:trustgraph:agent:abc"),
            "urn:trustgraph:agent:abc"
        );
        assert_eq!(
            session_id_of("urn:trustgraph:agent:abc/i1/thought"),
            Some("abc")
        );
        assert_eq!(session_id_of("urn:other:abc"), None);
    }
}
