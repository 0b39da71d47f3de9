//! Turns explainability messages into graph writes. Every message is written in one transaction and
//! acked only after it committed; RDF set semantics make a redelivered message change nothing. A
//! triple that is not valid RDF is left out and its message dead-lettered once the rest is written
//! (a fan-out or a completion, which drive fan-in, is dead-lettered with none of it written).
//! Only a message the orchestrators sealed may write the agent's own records; none may write what
//! the aggregator alone writes.

use agent_bus::{Delivery, Disposition, Publisher};
use agent_graph::convert::{into_quads, into_valid_quads};
use agent_graph::GraphStore;
use agent_schema::Triples;

/// The consumer's handler. Fan-in runs after the write, when the graph already holds the event.
pub struct Writer {
    store: GraphStore,
    /// Where synthesis requests go (the agent request topic); `None` writes only.
    requests: Option<Publisher>,
    /// Only fan-outs and completions sealed with it drive fan-in, when there is one.
    seal: Option<agent_bus::seal::SealKey>,
    /// Whether a message without the explain seal may write the agent's records (with a key).
    explain_seals: crate::ExplainSeals,
    /// Where long subagent results are kept, when the deployment keeps documents in TrustGraph's
    /// librarian.
    librarian: Option<std::sync::Arc<agent_bus::Librarian>>,
}

impl Writer {
    pub fn new(
        store: GraphStore,
        requests: Option<Publisher>,
        seal: Option<agent_bus::seal::SealKey>,
        explain_seals: crate::ExplainSeals,
        librarian: Option<std::sync::Arc<agent_bus::Librarian>>,
    ) -> Writer {
        Writer {
            store,
            requests,
            seal,
            explain_seals,
            librarian,
        }
    }

    pub async fn handle(&self, delivery: Delivery<Triples>) -> Disposition {
        use tracing::Instrument;
        // In the trace of the step that explained itself, so a dialog's trace shows its writes and
        // its fan-in next to its iterations.
        let traceparent = delivery
            .properties
            .get(agent_telemetry::trace::TRACEPARENT_PROPERTY)
            .cloned()
            .unwrap_or_default();
        let span = tracing::info_span!(
            "explain",
            node = %delivery.payload.metadata.id,
            traceparent = traceparent.as_str(),
        );
        self.write(delivery).instrument(span).await
    }

    async fn write(&self, delivery: Delivery<Triples>) -> Disposition {
        // Checked over the bytes as they came off the wire; with no key nothing is sealed.
        let sealed = self
            .seal
            .as_ref()
            .is_none_or(|key| key.verify_explain(&delivery.raw, &delivery.properties));
        let message = delivery.payload;
        // Read before the triples are converted, which moves their text into the quads.
        let correlation = crate::fanin::correlation_of(&message);
        let drives_fan_in = agent_core::provenance::drives_fan_in(&message.triples);
        let Triples { metadata, triples } = message;
        let total = triples.len();
        let (quads, invalid) = if drives_fan_in {
            // A fan-out or a completion is written whole or not at all: written short, it could
            // resume a supervisor on a wrong count of subagents or a result without its status.
            match into_quads(triples) {
                Ok(quads) => (quads, Vec::new()),
                Err(e) => {
                    return Disposition::DeadLetter(format!(
                        "triples of {} are not valid RDF (a fan-out or a completion, so none is written): {e}",
                        metadata.id
                    ))
                }
            }
        } else {
            // A step's nodes share one message (and other services' triples, on TrustGraph's
            // triples-store topic, come hundreds at once): a triple that is not valid RDF, which
            // will never be writable, must not keep the valid ones out of the graph.
            into_valid_quads(triples)
        };
        // The journal's graphs are written by its owner alone (a planted entry would be
        // re-emitted, as this service's own, for the step it names), and fan-in's marks by the
        // aggregator alone: whatever a message puts there is left out, and the message
        // dead-lettered to be seen.
        let before = quads.len();
        let quads: Vec<_> = quads.into_iter().filter(|q| !internal(q)).collect();
        let refused = before - quads.len();
        if refused > 0 && drives_fan_in {
            return Disposition::DeadLetter(format!(
                "{refused} triples of {} are in the journal's graphs or fan-in's marks, which only the aggregator writes (a fan-out or a completion, so none is written)",
                metadata.id
            ));
        }
        // The agent's records are read back and acted on (a conversation's running dialog, a
        // cancellation, a fork's input, recorded LLM answers a replay reuses, the node that lets
        // the journal prune a session, an approval's continuation): only the orchestrators, which
        // seal what they send, may write them. Other services' triples on the same topic (on
        // TrustGraph's triples-store, knowledge and retrieval records) are not the agent's.
        let (quads, unsealed) = if sealed {
            (quads, 0)
        } else {
            let (agents, others): (Vec<_>, Vec<_>) = quads.into_iter().partition(agent_record);
            match self.explain_seals {
                // What drives fan-in is the agent's whatever it names.
                crate::ExplainSeals::Require if drives_fan_in => {
                    return Disposition::DeadLetter(format!(
                        "{} is a fan-out or a completion without the orchestrators' seal; none of it is written",
                        metadata.id
                    ))
                }
                _ if agents.is_empty() => (others, 0),
                crate::ExplainSeals::Warn => {
                    tracing::warn!(
                        id = %metadata.id,
                        "an explainability message without the orchestrators' seal writes the agent's records (--explain-seals warn)"
                    );
                    (agents.into_iter().chain(others).collect(), 0)
                }
                crate::ExplainSeals::Require => (others, agents.len()),
            }
        };
        let count = quads.len();
        if count > 0 {
            // Marked in the same transaction, so the sweeps can find every fan-out and approval
            // that waits from the marks alone.
            let mut quads = if drives_fan_in {
                typed_last(quads)
            } else {
                quads
            };
            quads.extend(agent_graph::waiting::marks_for(&quads));
            match insert_in_parts(&self.store, quads).await {
                Ok(()) => tracing::debug!(id = %metadata.id, quads = count, "written"),
                Err(e) if e.retryable() || refused_by_the_store(&e) => {
                    return Disposition::Nack(e.to_string())
                }
                Err(e) => return Disposition::DeadLetter(e.to_string()),
            }
        }
        // The whole message goes to the dead-letter topic, to be seen, saying every reason a
        // triple of it was left out; the triples written from it are written again, unchanged,
        // if it is ever replayed.
        let first_invalid = invalid
            .first()
            .map(|(place, e)| (invalid.len(), place + 1, e.to_string()));
        let left_out = LeftOut {
            invalid: first_invalid,
            refused,
            unsealed,
        };
        if let Some(reason) = left_out.reason(&metadata.id, total, count) {
            return Disposition::DeadLetter(reason);
        }
        if count == 0 {
            return Disposition::Ack;
        }
        self.fan_in(correlation).await
    }

    /// After a completion or fan-out (whose correlation id is `correlation`) was written: the
    /// fan-in check. A failure is retried by redelivery; the write before it and the claim are
    /// idempotent for the same message.
    async fn fan_in(&self, correlation: Option<String>) -> Disposition {
        let (Some(requests), Some(cid)) = (&self.requests, correlation) else {
            return Disposition::Ack;
        };
        let librarian = self.librarian.as_deref();
        let seal = self.seal.as_ref();
        match crate::fanin::check(&self.store, requests, seal, librarian, &cid, None).await {
            Ok(()) => Disposition::Ack,
            Err(e) => Disposition::Nack(format!("fan-in of {cid}: {e}")),
        }
    }
}

/// The triples of a message that were left out of the graph, by why.
struct LeftOut {
    /// How many are not valid RDF, and the first of them (counting from 1) with its error.
    invalid: Option<(usize, usize, String)>,
    /// How many are in graphs only the aggregator writes.
    refused: usize,
    /// How many are the agent's records in a message without the orchestrators' seal.
    unsealed: usize,
}

impl LeftOut {
    /// The dead-letter reason of message `id` of `total` triples, `written` of them written; none
    /// when nothing was left out.
    fn reason(&self, id: &str, total: usize, written: usize) -> Option<String> {
        let mut why: Vec<(usize, String)> = Vec::new();
        if let Some((count, first, error)) = &self.invalid {
            why.push((
                *count,
                format!("are not valid RDF (the first, triple {first} counting from 1: {error})"),
            ));
        }
        if self.refused > 0 {
            why.push((
                self.refused,
                "are in the journal's graphs or fan-in's marks, which only the aggregator writes"
                    .to_owned(),
            ));
        }
        if self.unsealed > 0 {
            why.push((
                self.unsealed,
                "are the agent's records and the message does not carry the orchestrators' seal"
                    .to_owned(),
            ));
        }
        let mut parts = why.into_iter();
        let (count, what) = parts.next()?;
        let mut reason = format!("{count} of the {total} triples of {id} {what}");
        for (count, what) in parts {
            reason.push_str(&format!("; {count} more {what}"));
        }
        reason.push_str(&format!(
            "; they were left out, the other {written} written"
        ));
        Some(reason)
    }
}

/// Whether `quad` is one of the agent's records: about one of its sessions (their nodes are
/// named under [`agent_core::vocab::SESSION_PREFIX`], as TrustGraph's agent names them), one of
/// the long texts they refer to, or in its documents graph.
/// Whether the store refused a write for a reason of its own, not the message's: no access (401,
/// 403: a token being rotated) or no such endpoint (404: a store being moved). Waited out, as an
/// outage is: dead-lettered, a fan-out never reached the graph, no sweep ever timed it out, and
/// its supervisor waited for ever.
fn refused_by_the_store(e: &agent_graph::GraphError) -> bool {
    matches!(
        e,
        agent_graph::GraphError::Http {
            status: 401 | 403 | 404,
            ..
        }
    )
}

/// Writes `quads`, in halves (and theirs) for as long as the store says a write is too large
/// (413): a replica writing through the owner's endpoint meets that endpoint's bound on an update,
/// which a message the broker took can pass. RDF writes are sets, so a part written before a
/// failure is written again unchanged when the message comes back.
async fn insert_in_parts(
    store: &GraphStore,
    quads: Vec<oxigraph::model::Quad>,
) -> Result<(), agent_graph::GraphError> {
    // An embedded store takes a write of any size: not copied to be tried again.
    if store.is_embedded() {
        return store.insert(quads).await;
    }
    let mut parts = vec![quads];
    while let Some(mut part) = parts.pop() {
        match store.insert(part.clone()).await {
            Err(agent_graph::GraphError::Http { status: 413, .. }) if part.len() > 1 => {
                let second = part.split_off(part.len() / 2);
                parts.push(second);
                parts.push(part);
            }
            written => written?,
        }
    }
    Ok(())
}

/// `quads` with their types last, in the order they came otherwise. Written in parts (see
/// [`insert_in_parts`]) and failing before the last, a fan-out or a completion must not be read:
/// fan-in knows one by its type (and a fan-out's mark of waiting, which follows its type), so
/// whatever of it was written stays inert, and it is written whole when the message comes back.
/// Typed first, a fan-out written without its continuation stayed marked as waiting and was never
/// answered, its supervisor never resumed.
fn typed_last(quads: Vec<oxigraph::model::Quad>) -> Vec<oxigraph::model::Quad> {
    let (types, mut rest): (Vec<_>, Vec<_>) = quads
        .into_iter()
        .partition(|q| q.predicate.as_str() == agent_core::vocab::RDF_TYPE.as_str());
    rest.extend(types);
    rest
}

fn agent_record(quad: &oxigraph::model::Quad) -> bool {
    use oxigraph::model::GraphName;
    let documents = matches!(&quad.graph_name, GraphName::NamedNode(g) if g.as_str() == agent_core::vocab::DOCUMENTS_GRAPH);
    documents || names_agents(&quad.subject, &quad.object)
}

/// Whether a triple's subject or object is one of the agent's nodes.
fn names_agents(
    subject: &oxigraph::model::NamedOrBlankNode,
    object: &oxigraph::model::Term,
) -> bool {
    use oxigraph::model::{NamedOrBlankNode, Term};
    let agents = |iri: &str| {
        iri.starts_with(agent_core::vocab::SESSION_PREFIX)
            || iri.starts_with(agent_core::vocab::DOCUMENT_PREFIX)
    };
    matches!(subject, NamedOrBlankNode::NamedNode(n) if agents(n.as_str()))
        || matches!(object, Term::NamedNode(n) if agents(n.as_str()))
}

/// Whether `quad` is one only the aggregator writes: anything in the journal's graphs or in the
/// index of what waits (a planted mark would be read at every sweep), and the
/// marks of a fan-out's synthesis and of a waiting subagent's start (a planted claim dated ahead
/// would hold a fan-in for good, a planted "requested" would hide it and stop its subagents), and
/// the sweep's hold of a fan-out (one dated ahead would keep it from timing out).
fn internal(quad: &oxigraph::model::Quad) -> bool {
    use agent_core::vocab::tg;
    let in_journal = match &quad.graph_name {
        oxigraph::model::GraphName::NamedNode(g) => matches!(
            g.as_str(),
            agent_core::vocab::JOURNAL_GRAPH
                | agent_core::vocab::JOURNAL_OWNERS_GRAPH
                | agent_core::vocab::WAITING_GRAPH
        ),
        _ => false,
    };
    let marks = [
        &tg::SYNTHESIS_CLAIM,
        &tg::CLAIMED_AT,
        &tg::SYNTHESIS_REQUESTED,
        &tg::FAN_IN_REFUSED,
        &tg::START_CLAIM,
        &tg::START_CLAIMED_AT,
        &tg::START_REQUESTED,
        &tg::HELD_UNTIL,
    ];
    in_journal
        || marks
            .iter()
            .any(|mark| quad.predicate.as_str() == mark.as_str())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A SPARQL endpoint that refuses an update over `most` bytes (413) and keeps the rest.
    async fn refusing_long_updates(most: usize) -> (String, Arc<std::sync::Mutex<Vec<String>>>) {
        let kept: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
        let app = axum::Router::new().route(
            "/update",
            axum::routing::post({
                let kept = kept.clone();
                move |body: String| {
                    let kept = kept.clone();
                    async move {
                        if body.len() > most {
                            return axum::http::StatusCode::PAYLOAD_TOO_LARGE;
                        }
                        kept.lock().unwrap_or_else(|p| p.into_inner()).push(body);
                        axum::http::StatusCode::NO_CONTENT
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let url = format!(
            "http://{}",
            listener.local_addr().unwrap_or_else(|e| panic!("{e}"))
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, kept)
    }

    #[tokio::test]
    async fn a_write_too_large_for_the_endpoint_goes_in_parts() {
        use oxigraph::model::{GraphName, Literal, NamedNode, Quad};
        let (url, kept) = refusing_long_updates(4_000).await;
        let store = GraphStore::open(&url, None).unwrap_or_else(|e| panic!("{e}"));
        let quads: Vec<Quad> = (0..40)
            .map(|n| {
                Quad::new(
                    NamedNode::new_unchecked(format!("urn:test:s{n}")),
                    NamedNode::new_unchecked("urn:test:p"),
                    Literal::new_simple_literal("x".repeat(200)),
                    GraphName::DefaultGraph,
                )
            })
            .collect();
        insert_in_parts(&store, quads)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let kept = kept.lock().unwrap_or_else(|p| p.into_inner());
        assert!(kept.len() > 1, "written in {} part(s)", kept.len());
        for n in 0..40 {
            let subject = format!("<urn:test:s{n}>");
            assert_eq!(
                kept.iter().filter(|body| body.contains(&subject)).count(),
                1,
                "{subject}"
            );
        }
    }

    /// A fan-out whose write fails part-way (one literal over the endpoint's bound on an update,
    /// which no halving brings under it) leaves nothing fan-in reads: its type and its mark of
    /// waiting were to be written last. Typed first, it stayed marked as waiting without its
    /// continuation, never answered by the sweep.
    #[tokio::test]
    async fn a_fan_out_written_part_way_is_not_typed() {
        use agent_core::vocab::tg;
        let (url, kept) = refusing_long_updates(4_000).await;
        let store = GraphStore::open(&url, None).unwrap_or_else(|e| panic!("{e}"));
        let fanout = "urn:trustgraph:agent:s/fanout/1";
        let triple = |p: &str, o: agent_schema::Term| agent_schema::Triple {
            s: agent_schema::Term::iri(fanout),
            p: agent_schema::Term::iri(p),
            o,
            g: Some(agent_core::vocab::PROVENANCE_GRAPH.into()),
        };
        let message = Triples {
            metadata: agent_schema::Metadata {
                id: "urn:test:fanout-message".into(),
                root: String::new(),
                collection: "default".into(),
            },
            triples: vec![
                triple(
                    agent_core::vocab::RDF_TYPE.as_str(),
                    agent_schema::Term::iri(tg::FAN_OUT.as_str()),
                ),
                triple(
                    tg::CORRELATION_ID.as_str(),
                    agent_schema::Term::literal("s-f1"),
                ),
                triple(
                    tg::EXPECTED_SIBLINGS.as_str(),
                    agent_schema::Term::literal("2"),
                ),
                triple(
                    tg::CONTINUATION.as_str(),
                    agent_schema::Term::literal("x".repeat(5_000)),
                ),
            ],
        };
        let writer = Writer::new(store, None, None, crate::ExplainSeals::Warn, None);
        let raw: Arc<[u8]> = Arc::from(agent_schema::encode(&message).as_slice());
        let delivery = Delivery {
            payload: message,
            properties: Default::default(),
            message_id: "urn:test:fanout-message".to_owned(),
            payload_bytes: raw.len(),
            raw,
            aside: Default::default(),
        };
        let disposition = writer.write(delivery).await;
        assert!(
            matches!(disposition, Disposition::DeadLetter(_)),
            "{disposition:?}"
        );
        let kept = kept.lock().unwrap_or_else(|p| p.into_inner());
        assert!(
            !kept.is_empty(),
            "nothing was written: the test shows nothing"
        );
        assert!(
            kept.iter()
                .all(|update| !update.contains(tg::FAN_OUT.as_str())
                    && !update.contains(tg::AWAITS.as_str())),
            "{kept:#?}"
        );
    }

    /// A hold planted dated ahead would keep a fan-out from ever timing out.
    #[test]
    fn a_sweeps_hold_of_a_fan_out_is_written_by_the_aggregator_alone() {
        use agent_core::vocab::tg;
        let quad = |predicate: oxigraph::model::NamedNodeRef<'_>| {
            oxigraph::model::Quad::new(
                oxigraph::model::NamedNode::new_unchecked("urn:trustgraph:agent:s/fanout"),
                predicate,
                oxigraph::model::Literal::new_simple_literal("9999-01-01T00:00:00Z"),
                oxigraph::model::GraphName::NamedNode(oxigraph::model::NamedNode::new_unchecked(
                    agent_core::vocab::PROVENANCE_GRAPH,
                )),
            )
        };
        assert!(internal(&quad(tg::HELD_UNTIL)));
        assert!(!internal(&quad(tg::STARTED_AT)));
    }

    #[test]
    fn a_dead_letter_says_every_reason_its_triples_were_left_out() {
        let nothing = LeftOut {
            invalid: None,
            refused: 0,
            unsealed: 0,
        };
        assert_eq!(nothing.reason("urn:m", 3, 3), None);
        let all = LeftOut {
            invalid: Some((1, 2, "bad IRI".to_owned())),
            refused: 2,
            unsealed: 3,
        };
        let reason = all.reason("urn:m", 10, 4).unwrap();
        assert_eq!(
            reason,
            "1 of the 10 triples of urn:m are not valid RDF (the first, triple 2 counting from 1: \
             bad IRI); 2 more are in the journal's graphs or fan-in's marks, which only the \
             aggregator writes; 3 more are the agent's records and the message does not carry \
             the orchestrators' seal; they were left out, the other 4 written"
        );
        let refused_only = LeftOut {
            invalid: None,
            refused: 2,
            unsealed: 0,
        };
        assert_eq!(
            refused_only.reason("urn:m", 3, 1).unwrap(),
            "2 of the 3 triples of urn:m are in the journal's graphs or fan-in's marks, which \
             only the aggregator writes; they were left out, the other 1 written"
        );
    }
}
