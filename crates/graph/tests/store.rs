//! The graph store on both embedded backends (memory and RocksDB on disk): idempotent writes, hostile
//! literals, the session query and the explain view.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use agent_core::pattern::Termination;
use agent_core::provenance::{self, CallStats, SessionUris, ToolStats};
use agent_core::router::{Choice, Decision, Method};
use agent_graph::convert::into_quads;
use agent_graph::explain::{render_mermaid, render_tree, session_view};
use agent_graph::{queries, GraphStore, QueryAnswer};

fn session_triples(session: &str, question: &str) -> Vec<agent_schema::Triple> {
    let uris = SessionUris::new(session);
    let stats = CallStats {
        duration_ms: 10,
        in_token: 100,
        out_token: 20,
        model: "m".into(),
    };
    let mut t = provenance::session(&uris, question, "2026-01-01T00:00:00Z", "");
    let decision = Decision {
        task_type: Choice {
            candidates: vec!["general".into(), "research".into()],
            selected: "research".into(),
            method: Method::Llm,
            rationale: "asks for sources".into(),
            raw_answer: None,
        },
        pattern: Choice {
            candidates: vec!["react".into()],
            selected: "react".into(),
            method: Method::OnlyCandidate,
            rationale: String::new(),
            raw_answer: None,
        },
        unavailable_patterns: vec!["plan-then-execute".into()],
        framing: "Research it.".into(),
    };
    let routing = CallStats {
        duration_ms: 3,
        in_token: 30,
        out_token: 4,
        model: "m".into(),
    };
    t.extend(provenance::pattern_decision(&uris, &decision, &routing));
    t.extend(provenance::tool_iteration(
        &uris,
        1,
        "look it up",
        "llm",
        "{\"question\":\"x\"}",
        &["llm", "calc"],
        &stats,
    ));
    t.extend(provenance::observation(
        &uris,
        1,
        "366",
        ToolStats {
            duration_ms: 5,
            in_token: 7,
            out_token: 3,
            outcome: Some("ok"),
        },
    ));
    t.extend(provenance::conclusion(
        &uris,
        2,
        "done",
        "8784",
        Termination::Answer,
        &["llm"],
        &stats,
    ));
    t
}

/// `explain --last` shows the dialog a client (or a fork) started last, not a subagent of it,
/// whose question starts after its supervisor's.
#[tokio::test]
async fn the_last_session_is_a_dialog_not_its_subagent() {
    let store = GraphStore::in_memory().unwrap();
    let mut triples =
        provenance::session(&SessionUris::new("root"), "q", "2026-01-01T00:00:00Z", "");
    let sub = SessionUris::new("root-f1-s0");
    triples.extend(provenance::session(
        &sub,
        "part",
        "2026-01-01T00:00:05Z",
        "",
    ));
    triples.extend(provenance::derived_from(
        &sub.session(),
        &SessionUris::new("root").fanout("root-f1"),
    ));
    store.insert(into_quads(triples).unwrap()).await.unwrap();
    let last = |store: GraphStore| async move {
        let rows = store.query(queries::last_session()).await.unwrap().rows();
        match rows.first("s") {
            Some(agent_graph::model::Term::NamedNode(n)) => n.as_str().to_owned(),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(
        last(store.clone()).await,
        SessionUris::new("root").session()
    );
    // A fork started later is a dialog of its own, though it derives from its source.
    let fork = SessionUris::new("fork-1");
    let mut forked = provenance::session(&fork, "q again", "2026-01-01T00:00:09Z", "");
    forked.extend(provenance::fork(
        &fork,
        &SessionUris::new("root"),
        1,
        &[],
        "",
    ));
    store.insert(into_quads(forked).unwrap()).await.unwrap();
    assert_eq!(last(store).await, fork.session());
}

async fn scenario(store: GraphStore) {
    let hostile = "a \"quote\" <tag> \n new line \"} ; DROP ALL ; {\"";
    let triples = session_triples("s1", hostile);
    store
        .insert(into_quads(triples.clone()).unwrap())
        .await
        .unwrap();
    store
        .insert(into_quads(session_triples("s2", "other")).unwrap())
        .await
        .unwrap();
    let total = store.count().await.unwrap();

    // Writing the same message again changes nothing.
    store
        .insert(into_quads(triples.clone()).unwrap())
        .await
        .unwrap();
    assert_eq!(store.count().await.unwrap(), total);

    let node = queries::session_node("s1").unwrap();
    let rows = store
        .query(queries::session_triples(&node))
        .await
        .unwrap()
        .rows();
    assert_eq!(
        rows.rows.len(),
        triples.len(),
        "exactly the session's triples, not s2's"
    );
    let view = session_view(node.as_str(), &rows);
    assert_eq!(view.question, hostile);
    assert_eq!(view.iterations.len(), 1);
    assert_eq!(view.iterations[0].observation, "366");
    assert_eq!(view.iterations[0].candidates, ["calc", "llm"]);
    // The routing call's tokens count too.
    assert_eq!((view.in_token, view.out_token), (237, 47));
    let decision = view.decision.as_ref().unwrap();
    assert_eq!(decision.task_type, "research");
    assert_eq!(decision.task_type_candidates, ["general", "research"]);
    assert_eq!(decision.pattern, "react");
    assert_eq!(decision.pattern_unavailable, ["plan-then-execute"]);
    assert_eq!(decision.rationale, "asks for sources");
    let tree = render_tree(&view);
    assert!(
        tree.contains("routed: task type research (llm), pattern react (only-candidate)"),
        "{tree}"
    );
    assert_eq!(view.conclusion.as_ref().unwrap().answer, "8784");
    assert!(render_tree(&view).contains("iteration 1"));
    assert!(render_mermaid(&view).contains("-->|wasDerivedFrom|"));

    let last = store.query(queries::last_session()).await.unwrap().rows();
    assert_eq!(last.rows.len(), 1);
    assert!(matches!(
        store.query(queries::node_exists(&node)).await.unwrap(),
        QueryAnswer::Boolean(true)
    ));
    // The hostile text is a literal and did not drop anything.
    assert_eq!(store.count().await.unwrap(), total);
}

#[tokio::test]
async fn in_memory() {
    scenario(GraphStore::in_memory().unwrap()).await;
}

#[tokio::test]
async fn on_disk() {
    let dir = std::env::temp_dir().join(format!("agent-graph-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    scenario(GraphStore::open(dir.to_str().unwrap(), None).unwrap()).await;
    let reopened = GraphStore::open_read_only(&dir).unwrap();
    assert!(reopened.count().await.unwrap() > 0);
    assert!(reopened.insert(vec![]).await.is_err());
    let read_only = |r: Result<(), agent_graph::GraphError>| {
        matches!(r, Err(agent_graph::GraphError::ReadOnly))
    };
    assert!(read_only(reopened.update("CLEAR ALL".into()).await));
    assert!(read_only(reopened.bulk_load(vec![]).await));
    assert!(read_only(
        reopened
            .load(b"".to_vec(), "application/n-triples", None)
            .await
    ));
    drop(reopened);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Claims on a fan-out's synthesis are a compare-and-set: of many claims made at once exactly one
/// holds, a fresh claim is not taken over, and a stale one (its holder died) is.
#[tokio::test]
async fn synthesis_claims_have_one_winner() {
    let store = GraphStore::in_memory().unwrap();
    let fanout = oxigraph::model::NamedNode::new("urn:trustgraph:agent:s/fanout/s-f1").unwrap();
    store
        .update(format!(
            "INSERT DATA {{ GRAPH <urn:graph:retrieval> {{ {fanout} a <https://trustgraph.ai/ns/FanOut> }} }}"
        ))
        .await
        .unwrap();
    let claims = (0..16).map(|i| {
        let store = store.clone();
        let fanout = fanout.clone();
        tokio::spawn(async move {
            store
                .update(queries::claim_synthesis(
                    &fanout,
                    &format!("claimer-{i}"),
                    "2026-01-01T00:00:10Z",
                    "2026-01-01T00:00:00Z",
                ))
                .await
                .unwrap();
        })
    });
    for claim in claims.collect::<Vec<_>>() {
        claim.await.unwrap();
    }
    let holders = |store: GraphStore, fanout: oxigraph::model::NamedNode| async move {
        match store
            .query(queries::synthesis_claim(&fanout))
            .await
            .unwrap()
        {
            QueryAnswer::Rows(rows) => rows.rows.len(),
            _ => 0,
        }
    };
    assert_eq!(holders(store.clone(), fanout.clone()).await, 1);
    // A fresh claim stands; a stale one is taken over.
    store
        .update(queries::claim_synthesis(
            &fanout,
            "late",
            "2026-01-01T00:00:20Z",
            "2026-01-01T00:00:05Z",
        ))
        .await
        .unwrap();
    let who = |store: GraphStore, fanout: oxigraph::model::NamedNode| async move {
        match store
            .query(queries::synthesis_claim(&fanout))
            .await
            .unwrap()
        {
            QueryAnswer::Rows(rows) => rows.rows[0][0].as_ref().unwrap().to_string(),
            _ => String::new(),
        }
    };
    assert_ne!(who(store.clone(), fanout.clone()).await, "\"late\"");
    store
        .update(queries::claim_synthesis(
            &fanout,
            "takeover",
            "2026-01-01T00:01:00Z",
            "2026-01-01T00:00:30Z",
        ))
        .await
        .unwrap();
    assert_eq!(who(store.clone(), fanout.clone()).await, "\"takeover\"");
    assert_eq!(holders(store, fanout).await, 1);
}

/// Long texts are documents in their own graph: the session's triples and a fan-out's completions
/// still read them whole, and a second writer of the same text adds nothing.
#[tokio::test]
async fn long_texts_are_read_whole_through_their_documents() {
    let store = GraphStore::in_memory().unwrap();
    let long = |tag: &str| format!("{tag} {}", "many words ".repeat(800));
    let (observation, result) = (long("observed"), long("found"));
    let parent = SessionUris::new("boss");
    let sub = SessionUris::new("boss-sub1");
    let mut triples = provenance::session(&parent, "q", "2026-01-01T00:00:00Z", "");
    triples.extend(provenance::observation(
        &parent,
        1,
        &observation,
        ToolStats::default(),
    ));
    triples.extend(provenance::derived_from(
        &parent.observation(1),
        &parent.session(),
    ));
    triples.extend(provenance::fanout(
        &parent,
        2,
        "c1",
        &parent.observation(1),
        &[("goal one".into(), "boss-sub1".into())],
        "{}",
        "client",
        "2026-01-01T00:00:01Z",
        provenance::DialogSoFar::default(),
        &CallStats::default(),
    ));
    triples.extend(provenance::completion(
        &sub,
        "c1",
        "boss",
        "goal one",
        "completed",
        &result,
        (1, 2),
    ));
    store.insert(into_quads(triples).unwrap()).await.unwrap();
    let total = store.count().await.unwrap();
    // The subagent's result was also checked in by a step (the same quad): nothing new.
    store
        .insert(
            into_quads(provenance::completion(
                &sub,
                "c1",
                "boss",
                "goal one",
                "completed",
                &result,
                (1, 2),
            ))
            .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(store.count().await.unwrap(), total);

    let node = queries::session_node("boss").unwrap();
    let rows = store
        .query(queries::session_triples(&node))
        .await
        .unwrap()
        .rows();
    let view = session_view(node.as_str(), &rows);
    assert_eq!(
        view.iterations.len(),
        0,
        "no analysis node, only an observation"
    );
    let texts: Vec<String> = rows
        .column("o")
        .into_iter()
        .flatten()
        .filter_map(|t| match t {
            oxigraph::model::Term::Literal(l) => Some(l.value().to_owned()),
            _ => None,
        })
        .collect();
    assert!(texts.contains(&observation), "the observation, whole");

    let completions = store
        .query(queries::completions("c1"))
        .await
        .unwrap()
        .rows();
    assert_eq!(completions.rows.len(), 1);
    match completions.first("result") {
        Some(oxigraph::model::Term::Literal(l)) => assert_eq!(l.value(), result),
        other => panic!("{other:?}"),
    }
}

/// A journal owner's record: each beat replaces the last, every owner's reads back, and a
/// forgotten one is gone.
#[tokio::test]
async fn journal_owner_records_are_replaced_each_beat() {
    use agent_graph::queries::{
        forget_owner, owner_beat, owner_records, owner_records_of, OwnerRecord,
    };
    let store = GraphStore::in_memory().unwrap();
    let mut first = OwnerRecord {
        id: "a1".into(),
        started_ms: 1_700_000_000_000,
        store: "http://fuseki:3030/ds \"quoted\"".into(),
        beat: 1,
        owning: false,
    };
    let second = OwnerRecord {
        id: "b2".into(),
        beat: 7,
        owning: true,
        ..first.clone()
    };
    store.update(owner_beat(&first).unwrap()).await.unwrap();
    store.update(owner_beat(&second).unwrap()).await.unwrap();
    first.beat = 2;
    first.owning = true;
    store.update(owner_beat(&first).unwrap()).await.unwrap();
    let read = |store: GraphStore| async move {
        let mut records = owner_records_of(&store.query(owner_records()).await.unwrap().rows());
        records.sort_by(|a, b| a.id.cmp(&b.id));
        records
    };
    assert_eq!(
        read(store.clone()).await,
        vec![first.clone(), second.clone()]
    );
    // Two beats of one owner side by side (a server that ran them at once): its highest counts.
    store
        .update(
            "INSERT DATA { GRAPH <urn:graph:agent-journal-owners> { <urn:trustgraph:agent:journal-owner:b2> <https://trustgraph.ai/ns/ownerBeat> 6 } }"
                .to_owned(),
        )
        .await
        .unwrap();
    assert_eq!(
        read(store.clone()).await,
        vec![first.clone(), second.clone()]
    );
    store.update(forget_owner("a1").unwrap()).await.unwrap();
    assert_eq!(read(store.clone()).await, vec![second]);
    assert!(owner_beat(&OwnerRecord {
        id: "not an id>".into(),
        ..first
    })
    .is_err());
}

/// Inserts go to the store's own writer thread in group commit: many at once all land, and the
/// writer does not die with the runtime whose task made the first insert (services in one process
/// run on runtimes of their own and share an embedded store's handle).
#[test]
fn concurrent_inserts_all_land_and_outlive_the_first_callers_runtime() {
    use oxigraph::model::{GraphName, Literal, NamedNode, Quad};
    let dir = std::env::temp_dir().join(format!(
        "agent-graph-group-commit-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    let quad = |i: usize| {
        Quad::new(
            NamedNode::new(format!("urn:test:s{i}")).unwrap(),
            NamedNode::new("urn:test:p").unwrap(),
            Literal::from(i as i64),
            GraphName::NamedNode(NamedNode::new("urn:test:g").unwrap()),
        )
    };
    let count = |store: &GraphStore, runtime: &tokio::runtime::Runtime| {
        let answer = runtime
            .block_on(store.query(
                "SELECT (COUNT(*) AS ?n) WHERE { GRAPH <urn:test:g> { ?s ?p ?o } }".to_owned(),
            ))
            .unwrap();
        match answer.rows().first("n") {
            Some(oxigraph::model::Term::Literal(n)) => n.value().parse::<usize>().unwrap(),
            other => panic!("no count: {other:?}"),
        }
    };
    {
        let store = GraphStore::open(dir.to_str().unwrap(), None).unwrap();
        let first = tokio::runtime::Runtime::new().unwrap();
        first.block_on(store.insert(vec![quad(0)])).unwrap();
        drop(first);
        let second = tokio::runtime::Runtime::new().unwrap();
        let inserts = (1..300).map(|i| {
            let store = store.clone();
            second.spawn(async move { store.insert(vec![quad(i), quad(i + 1000)]).await })
        });
        let handles: Vec<_> = inserts.collect();
        for handle in handles {
            second.block_on(handle).unwrap().unwrap();
        }
        assert_eq!(count(&store, &second), 1 + 2 * 299);
    }
    // The last handle gone, the directory is free again at once.
    let reopened = GraphStore::open(dir.to_str().unwrap(), None).unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(count(&reopened, &runtime), 1 + 2 * 299);
    drop(reopened);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Our patch of oxigraph (patches/oxigraph-*.patch) writes a transaction's keys to RocksDB sorted and
/// each exact repeat once: every index must still hold every quad, the dictionary every term (read
/// back after reopening), and a removal must still remove.
#[test]
fn a_batch_with_repeats_and_removals_reads_back_as_written() {
    use oxigraph::model::{GraphName, Literal, NamedNode, Quad, QuadRef, Term};
    use oxigraph::store::Store;

    let dir = std::env::temp_dir().join(format!("agent-graph-batch-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let node = |name: &str| NamedNode::new(format!("urn:test:a-long-enough-name/{name}")).unwrap();
    let graphs = [
        GraphName::NamedNode(node("graph-one")),
        GraphName::NamedNode(node("graph-two")),
        GraphName::DefaultGraph,
    ];
    let mut quads = Vec::new();
    for i in 0..300 {
        let object: Term = if i % 3 == 0 {
            node(&format!("object-{}", i % 7)).into()
        } else {
            Literal::new_simple_literal(format!("a literal longer than sixteen bytes, {i}")).into()
        };
        quads.push(Quad::new(
            node(&format!("subject-{}", i % 11)),
            node(&format!("predicate-{}", i % 5)),
            object,
            graphs[i % 3].clone(),
        ));
    }
    let mut with_repeats = quads.clone();
    with_repeats.extend(quads.iter().rev().step_by(2).cloned());
    let expected: std::collections::BTreeSet<String> =
        quads.iter().map(|q| q.to_string()).collect();

    let read_back = |store: &Store| {
        let all: std::collections::BTreeSet<String> =
            store.iter().map(|q| q.unwrap().to_string()).collect();
        assert_eq!(all, expected);
        // Each index answers for every quad: a pattern bound on each position finds it.
        for quad in &quads {
            let q = quad.as_ref();
            let by = |s, p, o, g| store.quads_for_pattern(s, p, o, g).count();
            assert_eq!(by(Some(q.subject), None, None, Some(q.graph_name)), {
                quads
                    .iter()
                    .filter(|x| x.subject == quad.subject && x.graph_name == quad.graph_name)
                    .map(|x| x.to_string())
                    .collect::<std::collections::BTreeSet<_>>()
                    .len()
            });
            assert!(by(None, Some(q.predicate), Some(q.object), None) >= 1);
            assert!(by(None, None, Some(q.object), Some(q.graph_name)) >= 1);
            assert!(by(None, Some(q.predicate), None, Some(q.graph_name)) >= 1);
            assert!(store.contains(q).unwrap());
        }
        let mut named: Vec<String> = store
            .named_graphs()
            .map(|g| g.unwrap().to_string())
            .collect();
        named.sort();
        assert_eq!(named.len(), 2);
    };

    let store = Store::open(&dir).unwrap();
    store.extend(with_repeats.clone()).unwrap();
    assert_eq!(store.len().unwrap(), expected.len());
    read_back(&store);
    // Inserted again (all repeats), nothing changes.
    store.extend(with_repeats).unwrap();
    assert_eq!(store.len().unwrap(), expected.len());

    let gone = quads[0].clone();
    store.remove(QuadRef::from(&gone)).unwrap();
    assert!(!store.contains(&gone).unwrap());
    store.insert(&gone).unwrap();
    drop(store);

    let reopened = Store::open(&dir).unwrap();
    read_back(&reopened);
    drop(reopened);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Our patch of oxigraph writes a quad of a named graph under its graph-first indexes only (gspo,
/// gpos, gosp) and reads a pattern whose graph is not given once per named graph. Every such
/// pattern must find what oxigraph's own in-memory store finds (which keeps all its indexes): on
/// disk, after removals, after reopening, and inside a SPARQL update reading its own writes.
#[test]
fn patterns_without_a_graph_find_every_named_graphs_quads() {
    use oxigraph::model::{
        BlankNode, GraphName, Literal, NamedNode, NamedOrBlankNodeRef, Quad, QuadRef, Term,
    };
    use oxigraph::sparql::{QueryResults, SparqlEvaluator};
    use oxigraph::store::Store;
    use std::collections::BTreeSet;

    let dir = std::env::temp_dir().join(format!("agent-graph-unbound-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let node = |name: &str| NamedNode::new(format!("urn:test:unbound/{name}")).unwrap();
    let graphs = [
        GraphName::DefaultGraph,
        GraphName::NamedNode(node("graph-a")),
        GraphName::NamedNode(node("graph-b")),
        GraphName::BlankNode(BlankNode::new("graphc").unwrap()),
        GraphName::NamedNode(node("graph-d")),
    ];
    let mut quads = Vec::new();
    for i in 0..400 {
        let object: Term = match i % 4 {
            0 => node(&format!("subject-{}", i % 13)).into(),
            1 => Literal::new_simple_literal(format!("short {}", i % 3)).into(),
            _ => Literal::new_simple_literal(format!("a literal longer than sixteen bytes {i}"))
                .into(),
        };
        quads.push(Quad::new(
            node(&format!("subject-{}", i % 13)),
            node(&format!("predicate-{}", i % 6)),
            object,
            graphs[i % graphs.len()].clone(),
        ));
    }

    let on_disk = Store::open(&dir).unwrap();
    let in_memory = Store::new().unwrap();
    for store in [&on_disk, &in_memory] {
        store.extend(quads.clone()).unwrap();
        // A named graph with no quads: a scan of every graph passes it by.
        store
            .insert_named_graph(NamedOrBlankNodeRef::from(node("graph-empty").as_ref()))
            .unwrap();
        for quad in quads.iter().step_by(7) {
            store.remove(quad).unwrap();
        }
    }

    let same_answers = |store: &Store, reference: &Store| {
        let set = |store: &Store, s, p, o| -> BTreeSet<String> {
            store
                .quads_for_pattern(s, p, o, None)
                .map(|q| q.unwrap().to_string())
                .collect()
        };
        let mut checked = 0;
        for quad in &quads {
            let (s, p, o) = (
                quad.subject.as_ref(),
                quad.predicate.as_ref(),
                quad.object.as_ref(),
            );
            for (s, p, o) in [
                (Some(s), None, None),
                (Some(s), Some(p), None),
                (Some(s), Some(p), Some(o)),
                (Some(s), None, Some(o)),
                (None, Some(p), None),
                (None, Some(p), Some(o)),
                (None, None, Some(o)),
            ] {
                let found = set(store, s, p, o);
                assert_eq!(found, set(reference, s, p, o), "pattern {s:?} {p:?} {o:?}");
                checked += usize::from(!found.is_empty());
            }
        }
        assert!(checked > 1000, "the patterns found quads ({checked})");
        assert_eq!(
            set(store, None, None, None),
            set(reference, None, None, None)
        );
        let count = |store: &Store, query: &str| -> String {
            let QueryResults::Solutions(mut rows) = SparqlEvaluator::new()
                .parse_query(query)
                .unwrap()
                .on_store(store)
                .execute()
                .unwrap()
            else {
                panic!("not a SELECT");
            };
            rows.next().unwrap().unwrap().get("n").unwrap().to_string()
        };
        for query in [
            "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?s ?p ?o } }",
            "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { <urn:test:unbound/subject-3> ?p ?o } }",
            "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?s <urn:test:unbound/predicate-2> ?o } }",
            "SELECT (COUNT(*) AS ?n) WHERE { GRAPH ?g { ?s ?p \"short 1\" } }",
            "SELECT (COUNT(DISTINCT ?g) AS ?n) WHERE { GRAPH ?g { ?s ?p ?o } }",
        ] {
            assert_eq!(count(store, query), count(reference, query), "{query}");
        }
    };
    same_answers(&on_disk, &in_memory);

    // An update whose WHERE reads every graph, inside its own transaction.
    let update = "INSERT { GRAPH <urn:test:unbound/copies> { ?s <urn:test:unbound/copied> ?o } } \
                  WHERE { GRAPH ?g { ?s <urn:test:unbound/predicate-1> ?o } }";
    for store in [&on_disk, &in_memory] {
        SparqlEvaluator::new()
            .parse_update(update)
            .unwrap()
            .on_store(store)
            .execute()
            .unwrap();
    }
    same_answers(&on_disk, &in_memory);
    assert!(on_disk
        .quads_for_pattern(None, Some(node("copied").as_ref()), None, None)
        .next()
        .is_some());
    drop(on_disk);

    let reopened = Store::open(&dir).unwrap();
    same_answers(&reopened, &in_memory);
    assert!(reopened.contains(QuadRef::from(&quads[1])).unwrap());
    drop(reopened);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A waiting subagent's start is recorded once, however many claimers publish it (one that
/// crashed before marking it, and the next): one `tg:startedAt`, one `tg:startRequested`.
#[tokio::test]
async fn a_dependent_start_is_recorded_once() {
    let store = GraphStore::in_memory().unwrap();
    let session = agent_graph::queries::session_node("sup-f1-s1").unwrap();
    let after =
        [agent_graph::model::NamedNode::new(SessionUris::new("sup-f1-s0").completion()).unwrap()];
    for at in ["2026-12-04T10:00:00Z", "2026-12-04T10:00:07Z"] {
        store
            .update(agent_graph::queries::record_dependent_start(
                &session, &after, at,
            ))
            .await
            .unwrap();
    }
    let recorded = format!(
        "{}SELECT ?at ?after ?requested WHERE {{ GRAPH ?g {{ {session} tg:startedAt ?at ;
           tg:startedAfter ?after ; tg:startRequested ?requested }} }}",
        agent_core::vocab::SPARQL_PREFIXES
    );
    let agent_graph::QueryAnswer::Rows(rows) = store.query(recorded).await.unwrap() else {
        panic!("not rows");
    };
    assert_eq!(rows.rows.len(), 1, "{rows:?}");
    let at = rows
        .first("at")
        .map(ToString::to_string)
        .unwrap_or_default();
    assert!(at.contains("10:00:00"), "{at}");
}
