//! Knowledge over a collection: a named graph that users load RDF into (`agentctl load FILE
//! --collection NAME`), read by two tools. `knowledge-query` finds the entities whose literals
//! match a question's words and returns their neighbourhood as compact text; `sparql-query` runs a
//! read-only query the LLM wrote, confined to the collection. Neither builds much more text than
//! the observation limit lets through.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use agent_graph::model::Term;
use agent_graph::{GraphError, GraphStore, QueryAnswer};

/// Entities whose neighbourhood a knowledge query returns, best matches first.
const MAX_ENTITIES: usize = 8;
/// Triples read around those entities, before the text is cut to size.
const MAX_TRIPLES: usize = 400;
/// Rows (or triples) an LLM's SPARQL query may answer with.
pub const MAX_QUERY_ROWS: usize = 10_000;

/// The named graph of collection `name`.
pub fn collection_graph(name: &str) -> Result<String, String> {
    let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > 120 || !name.chars().all(safe) {
        return Err(format!(
            "'{name}' is not a collection name (letters, digits, '-', '_' and '.', at most 120)"
        ));
    }
    Ok(format!("urn:collection:{name}"))
}

/// The query `sparql` confined to `graph`: it must be a query (an update is refused) and may not
/// choose its own graphs. With the collection as its only default graph and no named graphs,
/// `GRAPH` patterns inside it reach nothing else (provenance, the journal, other collections).
pub fn confine_query(sparql: &str, graph: &str) -> Result<String, String> {
    // With stack enough for the parser, which an LLM's query nested deep enough would otherwise
    // take the process down in.
    agent_graph::nesting::with_stack_for(sparql, || confine_parsed(sparql, graph))?
}

/// [`confine_query`] on a thread with stack enough for `sparql`.
fn confine_parsed(sparql: &str, graph: &str) -> Result<String, String> {
    let mut query = match spargebra::SparqlParser::new().parse_query(sparql) {
        Ok(query) => query,
        Err(e) => {
            if spargebra::SparqlParser::new().parse_update(sparql).is_ok() {
                return Err(
                    "refused: this is a SPARQL update; the sparql-query tool runs read-only queries"
                        .to_owned(),
                );
            }
            return Err(format!("the query does not parse: {e}"));
        }
    };
    let dataset = match &mut query {
        spargebra::Query::Select { dataset, .. }
        | spargebra::Query::Construct { dataset, .. }
        | spargebra::Query::Describe { dataset, .. }
        | spargebra::Query::Ask { dataset, .. } => dataset,
    };
    if dataset.is_some() {
        return Err(
            "refused: the query may not choose its graphs (FROM / FROM NAMED); it runs on the tool's collection"
                .to_owned(),
        );
    }
    let graph = agent_graph::model::NamedNode::new(graph).map_err(|e| e.to_string())?;
    *dataset = Some(spargebra::algebra::QueryDataset {
        default: vec![graph],
        named: Some(Vec::new()),
    });
    Ok(query.to_string())
}

/// Runs `sparql` on collection `collection` within `time_limit` and renders the answer as text,
/// built up to about `max_bytes`. The query is an LLM's: it is stopped at the limit (or when the
/// step stops waiting for it), and an answer of more than [`MAX_QUERY_ROWS`] is refused rather
/// than gathered for an observation that shows a few hundred.
pub async fn sparql_query(
    store: &GraphStore,
    collection: &str,
    sparql: &str,
    max_bytes: usize,
    time_limit: std::time::Duration,
) -> Result<String, String> {
    let graph = collection_graph(collection)?;
    let confined = confine_query(sparql, &graph)?;
    let bounds = agent_graph::QueryBounds {
        timeout: time_limit,
        max_rows: MAX_QUERY_ROWS,
        max_bindings: agent_graph::QueryBounds::DEFAULT_MAX_BINDINGS,
    };
    let answer = store
        .query_bounded(confined, bounds)
        .await
        .map_err(|e| match e {
            GraphError::TooManyRows(most) => format!(
                "the query's answer has more than {most} rows: count them (COUNT) or ask for fewer (LIMIT)"
            ),
            GraphError::TooMuchWork(_) | GraphError::Http { status: 413, .. } => format!(
                "the query was stopped: {e}; join fewer patterns that share no variable, or narrow them"
            ),
            e => format!("the query failed: {e}"),
        })?;
    Ok(render_answer(&answer, max_bytes))
}

/// The words of `question` worth matching: lower case, three letters or more, not a stop word.
pub fn keywords(question: &str) -> Vec<String> {
    const STOP: &[&str] = &[
        "the", "and", "for", "are", "was", "were", "who", "what", "which", "when", "where", "why",
        "how", "does", "did", "has", "have", "had", "that", "this", "with", "from", "about",
        "into", "its", "their", "there", "them", "they", "you", "your", "can", "could", "would",
        "should", "will", "tell", "give", "list", "all", "any", "some", "not", "but", "our",
    ];
    let mut seen = BTreeSet::new();
    question
        .split(|c: char| !c.is_alphanumeric())
        .map(str::to_lowercase)
        .filter(|w| w.chars().count() >= 3 && !STOP.contains(&w.as_str()))
        .filter(|w| seen.insert(w.clone()))
        .take(12)
        .collect()
}

/// Answers `question` from collection `collection`: the entities whose literals match most of its
/// words, each with its labelled neighbourhood, as text built up to about `max_bytes`.
///
/// Both queries together are stopped at `time_limit` (the tool's timeout) and each within the
/// store's budget of work: the match reads every literal of the collection, and a query the step
/// has stopped waiting for must not keep a core busy. The second is given what the first left, so
/// that the store does not keep it waiting for a turn after the step has stopped waiting.
pub async fn knowledge_query(
    store: &GraphStore,
    collection: &str,
    question: &str,
    max_bytes: usize,
    time_limit: std::time::Duration,
) -> Result<String, String> {
    let deadline = tokio::time::Instant::now().checked_add(time_limit);
    let bounds = agent_graph::QueryBounds {
        timeout: time_limit,
        max_rows: MAX_QUERY_ROWS,
        max_bindings: agent_graph::QueryBounds::DEFAULT_MAX_BINDINGS,
    };
    let graph = collection_graph(collection)?;
    let words = keywords(question);
    if words.is_empty() {
        return Err("the question has no words to look up".to_owned());
    }
    let failed = |e: GraphError| format!("the knowledge query failed: {e}");
    let values: String = words.iter().map(|w| format!("\"{w}\" ")).collect();
    let matching = format!(
        "SELECT ?s (COUNT(DISTINCT ?k) AS ?score) WHERE {{
           GRAPH <{graph}> {{ ?s ?p ?o FILTER(isIRI(?s) && isLiteral(?o)) }}
           VALUES ?k {{ {values}}}
           FILTER(CONTAINS(LCASE(STR(?o)), ?k))
         }} GROUP BY ?s ORDER BY DESC(?score) STR(?s) LIMIT {MAX_ENTITIES}"
    );
    let rows = store
        .query_bounded(matching, bounds)
        .await
        .map_err(failed)?
        .rows();
    let entities: Vec<String> = rows
        .column("s")
        .into_iter()
        .flatten()
        .filter_map(|t| match t {
            Term::NamedNode(n) => Some(n.as_str().to_owned()),
            _ => None,
        })
        .collect();
    if entities.is_empty() {
        return Ok(format!(
            "Nothing in collection '{collection}' matches: {}",
            words.join(", ")
        ));
    }
    let listed: String = entities.iter().map(|e| format!("<{e}> ")).collect();
    let around = format!(
        "SELECT ?s ?p ?o ?sl ?ol WHERE {{ GRAPH <{graph}> {{
           {{ VALUES ?s {{ {listed}}} ?s ?p ?o }} UNION {{ VALUES ?o {{ {listed}}} ?s ?p ?o }}
           OPTIONAL {{ ?s <http://www.w3.org/2000/01/rdf-schema#label> ?sl }}
           OPTIONAL {{ ?o <http://www.w3.org/2000/01/rdf-schema#label> ?ol }}
         }} }} LIMIT {MAX_TRIPLES}"
    );
    let left = agent_graph::QueryBounds {
        timeout: deadline.map_or(time_limit, |deadline| {
            deadline.saturating_duration_since(tokio::time::Instant::now())
        }),
        ..bounds
    };
    if left.timeout.is_zero() {
        return Err(failed(GraphError::TimedOut(time_limit)));
    }
    let rows = store
        .query_bounded(around, left)
        .await
        .map_err(failed)?
        .rows();
    let column = |name: &str| rows.column(name);
    let (s, p, o, sl, ol) = (
        column("s"),
        column("p"),
        column("o"),
        column("sl"),
        column("ol"),
    );
    // One paragraph per entity, in match order; a fact is listed once, under its subject when
    // that is a matched entity.
    let mut facts: BTreeMap<&str, BTreeSet<String>> = BTreeMap::new();
    for i in 0..s.len() {
        // A remote endpoint may leave a variable out of its answer: its column is then empty.
        let (Some(subject), Some(predicate), Some(object)) = (
            s.get(i).copied().flatten(),
            p.get(i).copied().flatten(),
            o.get(i).copied().flatten(),
        ) else {
            continue;
        };
        let subject_text = label_or_name(subject, sl.get(i).copied().flatten());
        let object_text = label_or_name(object, ol.get(i).copied().flatten());
        let fact = format!("{subject_text} {} {object_text}", short(predicate));
        let owner = entities
            .iter()
            .find(|e| matches!(subject, Term::NamedNode(n) if n.as_str() == e.as_str()))
            .or_else(|| {
                entities
                    .iter()
                    .find(|e| matches!(object, Term::NamedNode(n) if n.as_str() == e.as_str()))
            });
        if let Some(owner) = owner {
            facts.entry(owner.as_str()).or_default().insert(fact);
        }
    }
    let mut text = format!("Facts from collection '{collection}':\n");
    let all = entities
        .iter()
        .flat_map(|entity| facts.get(entity.as_str()).into_iter().flatten());
    for fact in all {
        // The caller cuts the text exactly; this only stops building what would be cut.
        if text.len() > max_bytes {
            text.push_str("[more facts not shown]");
            break;
        }
        let _ = writeln!(text, "- {fact}");
    }
    Ok(text)
}

/// A term as the LLM should read it: its label when it has one, else its local name or value.
fn label_or_name(term: &Term, label: Option<&Term>) -> String {
    match (term, label) {
        (Term::NamedNode(_), Some(Term::Literal(l))) => l.value().to_owned(),
        (Term::Literal(l), _) => format!("\"{}\"", l.value()),
        _ => short(term),
    }
}

/// The local name of an IRI (after the last `#` or `/`), or the term's text.
fn short(term: &Term) -> String {
    match term {
        Term::NamedNode(n) => {
            let iri = n.as_str();
            let local = iri.rsplit(['#', '/']).next().unwrap_or(iri);
            if local.is_empty() {
                iri.to_owned()
            } else {
                local.to_owned()
            }
        }
        Term::Literal(l) => l.value().to_owned(),
        other => other.to_string(),
    }
}

/// A query answer as compact text: a header of variables and one tab-separated line per row, a
/// boolean, or one line per triple; building stops past `max_bytes` (the caller cuts exactly).
pub fn render_answer(answer: &QueryAnswer, max_bytes: usize) -> String {
    let mut text = String::new();
    match answer {
        QueryAnswer::Boolean(b) => text.push_str(if *b { "true" } else { "false" }),
        QueryAnswer::Rows(rows) => {
            let _ = writeln!(text, "{}", rows.variables.join("\t"));
            for row in &rows.rows {
                if text.len() > max_bytes {
                    text.push_str("[more rows not shown]\n");
                    break;
                }
                let cells: Vec<String> = row
                    .iter()
                    .map(|t| t.as_ref().map(short).unwrap_or_default())
                    .collect();
                let _ = writeln!(text, "{}", cells.join("\t"));
            }
            let _ = write!(text, "({} rows)", rows.rows.len());
        }
        QueryAnswer::Graph(triples) => {
            for t in triples {
                if text.len() > max_bytes {
                    text.push_str("[more triples not shown]");
                    break;
                }
                let _ = writeln!(
                    text,
                    "{} {} {}",
                    short(&t.subject.clone().into()),
                    short(&t.predicate.clone().into()),
                    short(&t.object)
                );
            }
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn updates_and_chosen_graphs_are_refused() {
        let g = "urn:collection:c";
        assert!(confine_query("DELETE WHERE { ?s ?p ?o }", g)
            .unwrap_err()
            .contains("refused"));
        assert!(confine_query("INSERT DATA { <a:a> <a:b> <a:c> }", g)
            .unwrap_err()
            .contains("read-only"));
        assert!(
            confine_query("SELECT * FROM <urn:graph:other> WHERE { ?s ?p ?o }", g)
                .unwrap_err()
                .contains("may not choose")
        );
        assert!(confine_query("SELEC nonsense", g)
            .unwrap_err()
            .contains("does not parse"));
        let confined = confine_query("SELECT ?s WHERE { ?s ?p ?o }", g).unwrap();
        assert!(confined.contains("FROM <urn:collection:c>"), "{confined}");
    }

    #[test]
    fn collection_names_are_checked() {
        assert_eq!(collection_graph("acme-1").unwrap(), "urn:collection:acme-1");
        assert!(collection_graph("a> <b").is_err());
        assert!(collection_graph("").is_err());
    }

    #[test]
    fn keywords_skip_short_and_stop_words() {
        assert_eq!(
            keywords("Who founded the Zorblax Company, and when?"),
            ["founded", "zorblax", "company"]
        );
    }

    #[tokio::test]
    async fn a_knowledge_query_returns_the_matching_neighbourhood_and_nothing_else() {
        let store = GraphStore::in_memory().unwrap();
        let data = br#"
            @prefix ex: <http://example.org/> .
            @prefix rdfs: <http://www.w3.org/2000/01/rdf-schema#> .
            ex:zorblax rdfs:label "Zorblax Company" ; ex:foundedBy ex:quentin ; ex:foundedIn "1987" .
            ex:quentin rdfs:label "Quentin Varga" .
            ex:other rdfs:label "Unrelated Thing" .
        "#;
        let graph = collection_graph("acme").unwrap();
        store
            .load(data.to_vec(), "text/turtle", Some(graph))
            .await
            .unwrap();
        store
            .load(
                br#"<http://example.org/zorblax> <http://example.org/secret> "elsewhere" ."#
                    .to_vec(),
                "application/n-triples",
                Some("urn:collection:other".into()),
            )
            .await
            .unwrap();
        let text = knowledge_query(
            &store,
            "acme",
            "Who founded Zorblax?",
            4096,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert!(
            text.contains("Zorblax Company foundedBy Quentin Varga"),
            "{text}"
        );
        assert!(text.contains("foundedIn \"1987\""), "{text}");
        assert!(
            !text.contains("Unrelated") && !text.contains("elsewhere"),
            "{text}"
        );
        let small = knowledge_query(
            &store,
            "acme",
            "Who founded Zorblax?",
            20,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
        assert!(small.ends_with("[more facts not shown]"), "{small}");

        let rows = sparql_query(
            &store,
            "acme",
            "SELECT ?o WHERE { GRAPH ?g { ?s <http://example.org/secret> ?o } }",
            4096,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        assert!(
            rows.contains("(0 rows)"),
            "other collections are out of reach: {rows}"
        );
        let founded = sparql_query(
            &store,
            "acme",
            "SELECT ?y WHERE { ?s <http://example.org/foundedIn> ?y }",
            4096,
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        assert!(founded.contains("1987"), "{founded}");
    }

    /// An LLM's query is stopped at its time limit (the store's evaluation with it) and one whose
    /// answer is too large is refused with what to do instead.
    #[tokio::test]
    async fn an_llms_runaway_query_is_stopped_and_a_huge_answer_refused() {
        let store = GraphStore::in_memory().unwrap();
        let graph = collection_graph("big").unwrap();
        let data: String = (0..300)
            .map(|i| format!("<urn:s:{i}> <urn:p:{}> \"{i}\" .\n", i % 7))
            .collect();
        store
            .load(data.into_bytes(), "text/turtle", Some(graph))
            .await
            .unwrap();
        let runaway = sparql_query(
            &store,
            "big",
            "SELECT (COUNT(*) AS ?n) WHERE { ?a ?b ?c . ?d ?e ?f . ?h ?i ?j . ?k ?l ?m }",
            4096,
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert!(runaway.contains("stopped"), "{runaway}");
        let huge = sparql_query(
            &store,
            "big",
            "SELECT * WHERE { ?a ?b ?c . ?d ?e ?f }",
            4096,
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
        assert!(
            huge.contains("more than 10000 rows") && huge.contains("LIMIT"),
            "{huge}"
        );
    }
}
