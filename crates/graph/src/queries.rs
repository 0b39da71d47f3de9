//! The SPARQL the system runs, built from typed terms: IRIs are validated `NamedNode`s and values are
//! `Literal`s, whose `Display` escapes them, so user text can never change a query's shape.

use oxigraph::model::NamedNode;

use crate::GraphError;

use agent_core::vocab::{
    session_uri, tg, NamedNodeRef, DOCUMENTS_GRAPH, JOURNAL_GRAPH, JOURNAL_OWNERS_GRAPH,
    PROVENANCE_GRAPH, SPARQL_PREFIXES as PREFIXES, WAITING_GRAPH,
};

/// The URI of a session's root node.
///
/// Always under the agent's prefix, as the orchestrator names it: a node of another name (which
/// anyone who can publish explainability messages may write) is never read as a session's.
pub fn session_node(session_id: &str) -> Result<NamedNode, GraphError> {
    NamedNode::new(session_uri(session_id))
        .map_err(|e| GraphError::Syntax(format!("not a session id: {e}")))
}

/// Keeps `?var` to the agent's own nodes: a query that finds its nodes by a value (a correlation
/// or conversation id) must not find one someone else named.
fn agents_only(var: &str) -> String {
    format!(
        "FILTER (STRSTARTS(STR(?{var}), \"{}\"))",
        agent_core::vocab::SESSION_PREFIX
    )
}

fn graph() -> NamedNode {
    NamedNode::new_unchecked(PROVENANCE_GRAPH)
}

/// Where the fan-outs and approvals that still wait are marked (see [`crate::waiting`]).
fn waiting() -> NamedNode {
    NamedNode::new_unchecked(WAITING_GRAPH)
}

/// Where long texts are kept (see `agent_core::documents`); short ones stay in [`graph`].
fn documents() -> NamedNode {
    NamedNode::new_unchecked(DOCUMENTS_GRAPH)
}

/// Every triple of one session: the nodes derived (transitively) from its root, and the documents
/// they point to (beside them, or in the documents graph). Its cost follows the size of the
/// session, not of the graph: the path starts at a bound node and walks the object index.
///
/// Each graph a document may be in is named in a branch of its own. Written as `VALUES ?h { .. }
/// GRAPH ?h { ?s ?p ?o }`, oxigraph's planner read both graphs whole before joining: 20 s in a
/// debug build for a 100-step dialog with 5 MB of documents, 18 ms this way.
pub fn session_triples(session: &NamedNode) -> String {
    let g = graph();
    let documents_of_session = format!(
        "GRAPH {g} {{ ?n prov:wasDerivedFrom* {session} . ?n tg:document ?s . FILTER(?s != ?n) }}"
    );
    format!(
        "{PREFIXES}SELECT ?s ?p ?o WHERE {{
  {{ GRAPH {g} {{ ?s prov:wasDerivedFrom* {session} . ?s ?p ?o }} }}
  UNION
  {{ {documents_of_session} GRAPH {g} {{ ?s ?p ?o }} }}
  UNION
  {{ {documents_of_session} GRAPH {docs} {{ ?s ?p ?o }} }}
}}",
        docs = documents()
    )
}

/// The most recently started dialog of a client's (or a fork's): not a subagent's, whose question
/// derives from its supervisor's fan-out and starts after the dialog that ran it.
pub fn last_session() -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?s WHERE {{ GRAPH {g} {{ ?s a tg:AgentQuestion ; prov:startedAtTime ?t {only}
  FILTER NOT EXISTS {{ ?s prov:wasDerivedFrom ?from FILTER NOT EXISTS {{ ?s tg:forkedFrom ?source }} }} }} }} ORDER BY DESC(?t) LIMIT 1",
        only = agents_only("s")
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

/// The fan-out `correlation_id` names, while no synthesis was requested for it: its node, expected
/// count, the supervisor's continuation, the client's id and when it was recorded.
pub fn open_fanout(correlation_id: &str) -> String {
    let g = graph();
    let cid = oxigraph::model::Literal::new_simple_literal(correlation_id);
    format!(
        "{PREFIXES}SELECT ?f ?expected ?continuation ?client ?in ?out ?started ?recorded ?seal ?carries WHERE {{ GRAPH {g} {{
  ?f a tg:FanOut ; tg:correlationId {cid} ; tg:expectedSiblings ?expected ;
     tg:continuation ?continuation ; tg:clientId ?client .
  OPTIONAL {{ ?f tg:seal ?seal }}
  OPTIONAL {{ ?f tg:carries ?carries }}
  OPTIONAL {{ ?f tg:dialogInToken ?in ; tg:dialogOutToken ?out ; tg:dialogStartedMs ?started }}
  OPTIONAL {{ ?f prov:startedAtTime ?recorded }}
  {only}
  FILTER NOT EXISTS {{ ?f tg:synthesisRequested ?done }}
  FILTER NOT EXISTS {{ ?f tg:fanInRefused ?why }} }} }}",
        only = agents_only("f")
    )
}

/// The fan-out `fanout` as a subagent `session` sees it, if that fan-out started that subagent:
/// when the run started and the supervisor's tokens at the fan-out. No row: not (yet) recorded,
/// or not this service's fan-out.
pub fn fanout_of_subagent(fanout: &NamedNode, session: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?started ?in ?out WHERE {{ GRAPH {g} {{
  {fanout} a tg:FanOut ; tg:subagentSession {session} .
  OPTIONAL {{ {fanout} tg:dialogStartedMs ?started ; tg:dialogInToken ?in ; tg:dialogOutToken ?out }} }} }}"
    )
}

/// The continuation of the call parked for approval at `approval` (and its seal, if any).
pub fn continuation_of(approval: &NamedNode) -> String {
    let docs = NamedNode::new_unchecked(DOCUMENTS_GRAPH);
    format!(
        "{PREFIXES}SELECT ?continuation ?seal WHERE {{ GRAPH {docs} {{
  {approval} tg:continuation ?continuation . OPTIONAL {{ {approval} tg:seal ?seal }} }} }}"
    )
}

/// Calls parked for approval that no answer reached yet: the approval node, its step, its
/// deadline and (a call parked since 2026-12-02) when it was asked. Only calls marked as waiting
/// (see [`crate::waiting`]) are looked at, so the sweep's work does not grow with every call ever
/// parked.
pub fn unanswered_approvals() -> String {
    let g = graph();
    let w = waiting();
    format!(
        "{PREFIXES}SELECT ?a ?step ?deadline ?asked WHERE {{ GRAPH {w} {{ ?a tg:awaits tg:ApprovalAnswer }}
  GRAPH {g} {{ ?a a tg:ApprovalRequest ; tg:deadline ?deadline ; tg:step ?step . }}
  FILTER NOT EXISTS {{ GRAPH {g} {{ ?answer prov:wasDerivedFrom ?a
    FILTER EXISTS {{ ?answer a tg:ApprovalAnswer }} }} }}
  OPTIONAL {{ GRAPH {g} {{ ?a prov:startedAtTime ?asked }} }} }}"
    )
}

/// Whether `session` recorded a fan-out (it started subagents, which may outlive its answer).
pub fn fanned_out(session: &NamedNode) -> String {
    let g = graph();
    let prefix =
        oxigraph::model::Literal::new_simple_literal(format!("{}/fanout/", session.as_str()));
    format!(
        "{PREFIXES}ASK {{ GRAPH {g} {{ ?f a tg:FanOut . FILTER(STRSTARTS(STR(?f), {prefix})) }} }}"
    )
}

/// Cancellations recorded at or after `since` (an RFC 3339 time): the node, who, when and why.
pub fn cancellations_since(since: &str) -> String {
    let g = graph();
    let since =
        oxigraph::model::Literal::new_typed_literal(since, oxigraph::model::vocab::xsd::DATE_TIME);
    format!(
        "{PREFIXES}SELECT ?c ?by ?at ?reason WHERE {{ GRAPH {g} {{
  ?c a tg:Cancellation ; tg:cancelledBy ?by ; prov:atTime ?at .
  OPTIONAL {{ ?c tg:reason ?reason }}
  FILTER (?at >= {since}) }} }}"
    )
}

/// What the graph records of the dialog a session node started: `?query` (its question) and, where
/// its first request carried one, `?client` (the client's `id` of that request). A client that
/// names a session of its own is told when another dialog already ran under it.
pub fn session_asked(session: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?query ?client WHERE {{ GRAPH {g} {{ {session} tg:query ?query .
  OPTIONAL {{ {session} tg:clientId ?client }} }} }} LIMIT 16"
    )
}

/// The cancels recorded at `nodes` (cancellation nodes: a session's and its supervisors'), at
/// any age: `?c ?by ?at ?reason`, as [`cancellations_since`] has them.
pub fn cancellations_at(nodes: &[NamedNode]) -> String {
    let g = graph();
    let nodes: Vec<String> = nodes.iter().map(ToString::to_string).collect();
    format!(
        "{PREFIXES}SELECT ?c ?by ?at ?reason WHERE {{ VALUES ?c {{ {} }} GRAPH {g} {{
  ?c a tg:Cancellation ; tg:cancelledBy ?by ; prov:atTime ?at .
  OPTIONAL {{ ?c tg:reason ?reason }} }} }}",
        nodes.join(" ")
    )
}

/// The tokens (input plus output) every recorded LLM call of a run has used, as `?tokens`: the
/// nodes the orchestrator tagged `tg:run run`, at every depth of its subagents. And, as
/// `?under`, the part of them recorded under `session` or a subagent nested below it
/// (`{session}/..`, `{session}-..`), which the step asking knows without the graph.
pub fn run_tokens(run: &NamedNode, session: &NamedNode) -> String {
    let g = graph();
    let under = |separator: &str| {
        oxigraph::model::Literal::new_simple_literal(format!("{}{separator}", session.as_str()))
    };
    let (own, nested) = (under("/"), under("-"));
    format!(
        "{PREFIXES}SELECT (SUM(?i + ?o) AS ?tokens)
  (SUM(IF(STRSTARTS(STR(?n), {own}) || STRSTARTS(STR(?n), {nested}), ?i + ?o, 0)) AS ?under)
WHERE {{ GRAPH {g} {{ ?n tg:run {run} ; tg:inToken ?i ; tg:outToken ?o . }} }}"
    )
}

/// The iterations of a run that called the LLM: the nodes tagged `tg:run run` that record a
/// cost, at every depth of its subagents. A tool's observation records its own cost (0, or an
/// LLM-backed tool's) beside its iteration's, and a node made without a call (a conclusion at a
/// limit, a pattern the request named) records none: neither is an iteration of its own.
pub fn run_iterations(run: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT (COUNT(DISTINCT ?n) AS ?iterations) WHERE {{ GRAPH {g} {{
  ?n tg:run {run} ; tg:inToken ?i ; tg:outToken ?o .
  FILTER (?i + ?o > 0)
  FILTER NOT EXISTS {{ ?n a tg:Observation }} }} }}"
    )
}

/// The text `?{document}` holds, as `?{text}`, wherever it was kept (beside its node, or in the
/// documents graph): a branch for each graph, so that the lookup starts from the bound document.
/// Written as `VALUES ?h {{ .. }} GRAPH ?h {{ ?d tg:content ?text }}`, the planner started from the
/// two-row `VALUES` and read every document in the store before the join (a fan-in check, once a
/// completion, grew with the whole graph; `tests/fan_in_queries.rs`).
fn content_of(document: &str, text: &str) -> String {
    format!(
        "{{ GRAPH {g} {{ ?{document} tg:content ?{text} }} }} UNION {{ GRAPH {docs} {{ ?{document} tg:content ?{text} }} }}",
        g = graph(),
        docs = documents()
    )
}

/// The completions of a fan-out: goal, status and result of each, and the subagent session it
/// came from. Only completions of a session the fan-out started count: one that merely names the
/// correlation id is not its subagent's.
pub fn completions(correlation_id: &str) -> String {
    let g = graph();
    let cid = oxigraph::model::Literal::new_simple_literal(correlation_id);
    format!(
        "{PREFIXES}SELECT DISTINCT ?c ?s ?goal ?status ?result ?in ?out ?seal WHERE {{ GRAPH {g} {{
  ?f a tg:FanOut ; tg:correlationId {cid} ; tg:subagentSession ?s .
  ?c a tg:SubagentCompletion ; tg:correlationId {cid} ; tg:goal ?goal ;
     tg:completionStatus ?status ; tg:document ?d .
}}
  {content}
  FILTER (STR(?c) = CONCAT(STR(?s), \"/completion\"))
  {only_f} {only_s}
  OPTIONAL {{ GRAPH {g} {{ ?c tg:seal ?seal }} }}
  OPTIONAL {{ GRAPH {g} {{ ?c tg:dialogInToken ?in ; tg:dialogOutToken ?out }} }} }}",
        content = content_of("d", "result"),
        only_f = agents_only("f"),
        only_s = agents_only("s")
    )
}

/// Claims a fan-out's synthesis for `claimer` at time `now` (an xsd:dateTime), unless someone
/// holds a claim made after `stale_before`: a claim whose holder died before publishing is taken
/// over once it is stale. Check and write are one update (see `GraphStore::update`).
pub fn claim_synthesis(fanout: &NamedNode, claimer: &str, now: &str, stale_before: &str) -> String {
    claim(
        fanout,
        &format!("{fanout} a tg:FanOut ."),
        (tg::SYNTHESIS_CLAIM, tg::CLAIMED_AT, tg::SYNTHESIS_REQUESTED),
        claimer,
        (now, stale_before),
    )
}

/// Who holds a fan-out's synthesis claim.
pub fn synthesis_claim(fanout: &NamedNode) -> String {
    let g = graph();
    format!("{PREFIXES}SELECT ?who WHERE {{ GRAPH {g} {{ {fanout} tg:synthesisClaim ?who }} }}")
}

/// Marks a fan-out's synthesis request as published.
pub fn synthesis_requested(fanout: &NamedNode) -> String {
    let g = graph();
    format!("{PREFIXES}INSERT DATA {{ GRAPH {g} {{ {fanout} tg:synthesisRequested true }} }}")
}

/// Claims the start of a subagent that waited for others (its `session`, which its fan-out lists
/// as `tg:subagentSession`), as [`claim_synthesis`] claims a synthesis: one start however many
/// checks see its prerequisites complete.
pub fn claim_start(session: &NamedNode, claimer: &str, now: &str, stale_before: &str) -> String {
    claim(
        session,
        &format!("?fanout tg:subagentSession {session} ."),
        (tg::START_CLAIM, tg::START_CLAIMED_AT, tg::START_REQUESTED),
        claimer,
        (now, stale_before),
    )
}

/// Who holds a waiting subagent's start claim (`?who`), and whether its start was published
/// (`?started`).
pub fn start_claim(session: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?who ?started WHERE {{ GRAPH {g} {{ {session} tg:startClaim ?who .
  OPTIONAL {{ {session} tg:startRequested ?started }} }} }}"
    )
}

/// Records a waiting subagent's start once it is published: `tg:startedAfter` each completion it
/// waited for (`after`), when (`tg:startedAt`, an RFC 3339 time) and `tg:startRequested`, in one
/// update, and only if no start is recorded yet. Written in two updates, unconditionally, a
/// crash between the publish and the mark (or between the two writes) had the next claimer
/// publish again (a copy the orchestrator's journal drops) and record a second `tg:startedAt`.
pub fn record_dependent_start(session: &NamedNode, after: &[NamedNode], at: &str) -> String {
    let g = graph();
    let at =
        oxigraph::model::Literal::new_typed_literal(at, oxigraph::model::vocab::xsd::DATE_TIME);
    let after: String = after
        .iter()
        .map(|completion| format!(" tg:startedAfter {completion} ;"))
        .collect();
    format!(
        "{PREFIXES}INSERT {{ GRAPH {g} {{ {session}{after} tg:startedAt {at} ; tg:startRequested true }} }}
WHERE {{ FILTER NOT EXISTS {{ GRAPH {g} {{ {session} tg:startRequested ?started }} }} }}"
    )
}

/// A first-writer-wins claim on `node`, which `anchor` (a triple pattern) must find in the graph:
/// its claim and claim time predicates, and the mark that says the claimed work is done (no claim
/// after it).
fn claim(
    node: &NamedNode,
    anchor: &str,
    (claim, at, done): (NamedNodeRef<'_>, NamedNodeRef<'_>, NamedNodeRef<'_>),
    claimer: &str,
    (now, stale_before): (&str, &str),
) -> String {
    let g = graph();
    let who = oxigraph::model::Literal::new_simple_literal(claimer);
    let datetime = |v: &str| {
        oxigraph::model::Literal::new_typed_literal(v, oxigraph::model::vocab::xsd::DATE_TIME)
    };
    let (now, stale) = (datetime(now), datetime(stale_before));
    format!(
        "{PREFIXES}DELETE {{ GRAPH {g} {{ {node} {claim} ?old ; {at} ?at }} }}
INSERT {{ GRAPH {g} {{ {node} {claim} {who} ; {at} {now} }} }}
WHERE {{ GRAPH {g} {{ {anchor}
  FILTER NOT EXISTS {{ {node} {done} ?done }}
  OPTIONAL {{ {node} {claim} ?old ; {at} ?at }}
  FILTER (!BOUND(?at) || ?at < {stale}) }} }}"
    )
}

/// How many fan-outs are still waiting for their synthesis (`?n`), of those marked as waiting
/// (see [`crate::waiting`]).
pub fn open_fanouts() -> String {
    let g = graph();
    let w = waiting();
    format!(
        "{PREFIXES}SELECT (COUNT(DISTINCT ?f) AS ?n) WHERE {{
  GRAPH {w} {{ ?f tg:awaits tg:Synthesis }}
  GRAPH {g} {{
    ?f a tg:FanOut ; tg:expectedSiblings ?expected ; tg:continuation ?continuation ;
       tg:clientId ?client . }}
  {only}
  FILTER NOT EXISTS {{ GRAPH {g} {{ ?f tg:synthesisRequested ?done }} }}
  FILTER NOT EXISTS {{ GRAPH {g} {{ ?f tg:fanInRefused ?why }} }} }}",
        only = agents_only("f")
    )
}

/// Fan-outs still waiting for their synthesis that started before `cutoff` (an xsd:dateTime):
/// those [`open_fanout`] reads (a node without its continuation or client is not one). Oldest
/// first: a supervisor's fan-out starts before those of its nested supervisors, and answered
/// first it tells them (resumed in the same sweep) that no one waits for their synthesis. The
/// timeout sweep asks for all of them (`cutoff` now), since a nested one may be due before its
/// own timeout. Only fan-outs marked as waiting (see [`crate::waiting`]) are looked at, so the
/// sweep's work does not grow with every fan-out ever answered. `?held`: until when a sweep holds
/// it back (see [`fanout_held`]), if one does.
pub fn overdue_fanouts(cutoff: &str) -> String {
    let g = graph();
    let cutoff =
        oxigraph::model::Literal::new_typed_literal(cutoff, oxigraph::model::vocab::xsd::DATE_TIME);
    let w = waiting();
    format!(
        "{PREFIXES}SELECT DISTINCT ?cid ?t ?held WHERE {{ GRAPH {w} {{ ?f tg:awaits tg:Synthesis }}
  GRAPH {g} {{
    ?f a tg:FanOut ; tg:correlationId ?cid ; prov:startedAtTime ?t ;
       tg:expectedSiblings ?expected ; tg:continuation ?continuation ; tg:clientId ?client . }}
  OPTIONAL {{ GRAPH {g} {{ ?f tg:heldUntil ?held }} }}
  FILTER NOT EXISTS {{ GRAPH {g} {{ ?f tg:synthesisRequested ?done }} }}
  FILTER NOT EXISTS {{ GRAPH {g} {{ ?f tg:fanInRefused ?why }} }}
  FILTER (?t < {cutoff}) {only} }} ORDER BY ?t",
        only = agents_only("f")
    )
}

/// Records that the timeout sweep holds the fan-out `correlation_id` back until `until` (an
/// xsd:dateTime), unless a hold is recorded already: the first sweep to hold it sets the time,
/// which every later sweep, on any aggregator, reads back with [`overdue_fanouts`].
pub fn fanout_held(correlation_id: &str, until: &str) -> String {
    let g = graph();
    let id = oxigraph::model::Literal::new_simple_literal(correlation_id);
    let until =
        oxigraph::model::Literal::new_typed_literal(until, oxigraph::model::vocab::xsd::DATE_TIME);
    format!(
        "{PREFIXES}INSERT {{ GRAPH {g} {{ ?f tg:heldUntil {until} }} }}
WHERE {{ GRAPH {g} {{ ?f a tg:FanOut ; tg:correlationId {id} .
  FILTER NOT EXISTS {{ ?f tg:heldUntil ?held }} }} {only} }}",
        only = agents_only("f")
    )
}

/// When each of the agents' fan-outs `correlation_ids` started (`?cid ?started`), answered or not.
pub fn fanout_starts<'a>(correlation_ids: impl IntoIterator<Item = &'a str>) -> String {
    let g = graph();
    let ids: Vec<String> = correlation_ids
        .into_iter()
        .map(|id| oxigraph::model::Literal::new_simple_literal(id).to_string())
        .collect();
    format!(
        "{PREFIXES}SELECT ?cid (MIN(?t) AS ?started) WHERE {{ GRAPH {g} {{
  VALUES ?cid {{ {ids} }}
  ?f a tg:FanOut ; tg:correlationId ?cid ; prov:startedAtTime ?t .
  FILTER (DATATYPE(?t) = <http://www.w3.org/2001/XMLSchema#dateTime>) {only} }} }} GROUP BY ?cid",
        ids = ids.join(" "),
        only = agents_only("f")
    )
}

/// Marks a fan-out that will never be synthesised, saying why.
pub fn fan_in_refused(fanout: &NamedNode, why: &str) -> String {
    let g = graph();
    let why = oxigraph::model::Literal::new_simple_literal(why);
    format!("{PREFIXES}INSERT DATA {{ GRAPH {g} {{ {fanout} tg:fanInRefused {why} }} }}")
}

/// The client dialogs of a conversation, oldest first: not their subagents' nor their forks'
/// sessions, which each dialog's tree shows (listed too, they were shown twice).
pub fn conversation_sessions(conversation_id: &str) -> String {
    let g = graph();
    let id = oxigraph::model::Literal::new_simple_literal(conversation_id);
    format!(
        "{PREFIXES}SELECT DISTINCT ?s WHERE {{ GRAPH {g} {{
  ?s a tg:AgentQuestion ; tg:conversation {id} ; prov:startedAtTime ?t {only}
  FILTER NOT EXISTS {{ ?s prov:wasDerivedFrom ?from }} }} }} ORDER BY ?t ?s",
        only = agents_only("s")
    )
}

/// The client dialogs of a conversation other than `current` (subagents' are not theirs), newest
/// first, at most `most`: the session, its question, when it started and, once it ended, its
/// answer (or error) and why it ended.
pub fn conversation_dialogs(conversation_id: &str, current: &NamedNode, most: usize) -> String {
    let g = graph();
    let id = oxigraph::model::Literal::new_simple_literal(conversation_id);
    format!(
        "{PREFIXES}SELECT ?s ?question ?started ?answer ?ended WHERE {{
  GRAPH {g} {{
    ?s a tg:AgentQuestion ; tg:conversation {id} ; tg:query ?question ; prov:startedAtTime ?started .
    FILTER (?s != {current}) {only}
    FILTER NOT EXISTS {{ ?s prov:wasDerivedFrom ?fanout }}
    BIND (IRI(CONCAT(STR(?s), \"/final\")) AS ?final)
  }}
  OPTIONAL {{
    GRAPH {g} {{ ?final tg:terminationReason ?ended ; tg:document ?d . }}
    OPTIONAL {{ VALUES ?dg {{ {g} {docs} }} GRAPH ?dg {{ ?d tg:content ?answer }} }}
  }}
}} ORDER BY DESC(?started) LIMIT {most}",
        only = agents_only("s"),
        docs = documents()
    )
}

/// The client dialogs of a conversation other than `current` that have not ended, newest first,
/// at most `most`: the session, its question and when it started. Whether one still runs is told
/// from these, not from the newest few dialogs, which five that ended after it would fill.
pub fn conversation_unended(conversation_id: &str, current: &NamedNode, most: usize) -> String {
    let g = graph();
    let id = oxigraph::model::Literal::new_simple_literal(conversation_id);
    format!(
        "{PREFIXES}SELECT ?s ?question ?started WHERE {{
  GRAPH {g} {{
    ?s a tg:AgentQuestion ; tg:conversation {id} ; tg:query ?question ; prov:startedAtTime ?started .
    FILTER (?s != {current}) {only}
    FILTER NOT EXISTS {{ ?s prov:wasDerivedFrom ?fanout }}
    BIND (IRI(CONCAT(STR(?s), \"/final\")) AS ?final)
    FILTER NOT EXISTS {{ ?final tg:terminationReason ?ended }}
  }}
}} ORDER BY DESC(?started) LIMIT {most}",
        only = agents_only("s")
    )
}

/// The answer a dialog concluded with (its conclusion's document's text, kept beside it or in
/// the documents graph), once it has ended.
pub fn dialog_answer(session: &NamedNode) -> String {
    let (g, d) = (graph(), documents());
    let conclusion = NamedNode::new_unchecked(format!("{}/final", session.as_str()));
    format!(
        "{PREFIXES}SELECT ?answer WHERE {{
  GRAPH {g} {{ {conclusion} tg:document ?document }}
  {{ GRAPH {g} {{ ?document tg:content ?answer }} }} UNION {{ GRAPH {d} {{ ?document tg:content ?answer }} }}
}} LIMIT 1"
    )
}

/// The subagent sessions a fan-out started.
pub fn fanout_sessions(fanout: &NamedNode) -> String {
    let g = graph();
    format!("{PREFIXES}SELECT ?s WHERE {{ GRAPH {g} {{ {fanout} tg:subagentSession ?s }} }}")
}

/// What the LLM calls recorded so far under each of `sessions` (subagent sessions of `fanout`, at
/// every depth below them) have used, as `?in` and `?out`: the nodes tagged with the fan-out's
/// run whose name is the session's or a nested subagent's (`{session}/..`, `{session}-..`).
pub fn spent_under(fanout: &NamedNode, sessions: &[String]) -> String {
    let g = graph();
    let below = below_sessions("n", sessions);
    format!(
        "{PREFIXES}SELECT (SUM(?i) AS ?in) (SUM(?o) AS ?out) WHERE {{ GRAPH {g} {{
  {fanout} tg:run ?run .
  ?n tg:run ?run ; tg:inToken ?i ; tg:outToken ?o .
  {below}
}} }}"
    )
}

/// The continuations of the calls parked for approval, and not answered yet, under each of
/// `sessions` (as [`spent_under`] reads them): the LLM call that chose each is recorded on no
/// node until the call is answered, and its continuation holds its cost.
pub fn parked_under(sessions: &[String]) -> String {
    let (g, w, docs) = (graph(), waiting(), documents());
    let below = below_sessions("a", sessions);
    format!(
        "{PREFIXES}SELECT ?continuation WHERE {{
  GRAPH {w} {{ ?a tg:awaits tg:ApprovalAnswer }}
  {below}
  FILTER NOT EXISTS {{ GRAPH {g} {{ ?answer prov:wasDerivedFrom ?a
    FILTER EXISTS {{ ?answer a tg:ApprovalAnswer }} }} }}
  GRAPH {docs} {{ ?a tg:continuation ?continuation }} }}"
    )
}

/// Keeps the `?{node}` named under one of `sessions` or under a subagent nested below one
/// (`{session}/..`, `{session}-..`; `-s1-` is not a prefix of `-s10`).
fn below_sessions(node: &str, sessions: &[String]) -> String {
    let values: Vec<String> = sessions
        .iter()
        .map(|s| oxigraph::model::Literal::new_simple_literal(s).to_string())
        .collect();
    format!(
        "VALUES ?s {{ {} }}
  FILTER(STRSTARTS(STR(?{node}), CONCAT(?s, \"/\")) || STRSTARTS(STR(?{node}), CONCAT(?s, \"-\")))",
        values.join(" ")
    )
}

/// Whether any of `fanouts` has had its synthesis requested (or will never have it): a subagent
/// below one of them is no longer waited for.
pub fn any_fanout_answered(fanouts: &[NamedNode]) -> String {
    let g = graph();
    let values: Vec<String> = fanouts.iter().map(ToString::to_string).collect();
    format!(
        "{PREFIXES}ASK {{ GRAPH {g} {{ VALUES ?f {{ {} }} ?f tg:synthesisRequested|tg:fanInRefused ?done }} }}",
        values.join(" ")
    )
}

fn journal_graph() -> NamedNode {
    NamedNode::new_unchecked(JOURNAL_GRAPH)
}

/// Up to `limit` journal entries that may go: published ones recorded before `finished_before`
/// with their dialog concluded (its `/final` node is in the graph), and any recorded before
/// `any_before`, whatever became of it, marked published or not (a process stopped or killed
/// between a step's ack and its mark leaves its entry unmarked for good). Their quads are deleted
/// by [`journal_delete`], a page at a time.
pub fn journal_prunable(finished_before: &str, any_before: &str, limit: usize) -> String {
    let g = journal_graph();
    let literal = |t: &str| {
        oxigraph::model::Literal::new_typed_literal(t, oxigraph::model::vocab::xsd::DATE_TIME)
    };
    let (finished_before, any_before) = (literal(finished_before), literal(any_before));
    format!(
        "{PREFIXES}SELECT DISTINCT ?e WHERE {{
  GRAPH {g} {{ ?e tg:recordedAt ?at }}
  FILTER(isIRI(?e) && ?at < {finished_before})
  BIND(IRI(CONCAT(STRBEFORE(STR(?e), \"/journal/\"), \"/final\")) AS ?final)
  FILTER(?at < {any_before} || EXISTS {{ GRAPH {g} {{ ?e tg:published true }} GRAPH ?h {{ ?final ?fp ?fo }} }})
}} LIMIT {limit}"
    )
}

/// Deletes every quad of the journal `entries`.
pub fn journal_delete(entries: &[NamedNode]) -> String {
    let g = journal_graph();
    let values: String = entries
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "DELETE {{ GRAPH {g} {{ ?e ?p ?o }} }} WHERE {{ VALUES ?e {{ {values} }} GRAPH {g} {{ ?e ?p ?o }} }}"
    )
}

/// The recorded inputs of a session's `steps` (see `agent_core::fork`): each one's step, request,
/// and the input it continues with how many of its steps. Looked up by node, so its cost follows
/// the steps asked, not the graph; a caller asks for [`STEP_INPUTS_PAGE`] at a time, so that the
/// text stays within what an endpoint takes from a stranger (32 KiB: about 450 steps' nodes).
pub fn step_inputs(session: &NamedNode, steps: std::ops::RangeInclusive<usize>) -> String {
    let g = graph();
    let nodes: String = steps
        .map(|n| format!("<{}/input/{n}>", session.as_str()))
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "{PREFIXES}SELECT ?step ?request ?from ?kept WHERE {{ VALUES ?i {{ {nodes} }}
  GRAPH {g} {{ ?i tg:step ?step ; tg:request ?request .
    OPTIONAL {{ ?i tg:continuesInput ?from ; tg:continuedSteps ?kept }} }} }}"
    )
}

/// Records a step's input (`quads`, describing `node`) unless one is recorded there already: the
/// first writer's stands. A second attempt at the same step (its first stopped between recording
/// and publishing, or its claim lapsed) may have built another input (more results in, another
/// excerpt), and reads the first back instead of adding a second beside it.
pub fn record_step_input_once(node: &NamedNode, quads: &[oxigraph::model::Quad]) -> String {
    let g = graph();
    format!(
        "{PREFIXES}INSERT {{\n{}}}\nWHERE {{ FILTER NOT EXISTS {{ GRAPH {g} {{ {node} tg:step ?recorded }} }} }}",
        quads_by_graph(quads.iter())
    )
}

/// `quads` as the triples of a SPARQL update's data or template, grouped by graph.
pub(crate) fn quads_by_graph<'q>(quads: impl Iterator<Item = &'q oxigraph::model::Quad>) -> String {
    let mut by_graph: std::collections::BTreeMap<Option<String>, String> =
        std::collections::BTreeMap::new();
    for quad in quads {
        let graph = match &quad.graph_name {
            oxigraph::model::GraphName::NamedNode(n) => Some(n.to_string()),
            _ => None,
        };
        let body = by_graph.entry(graph).or_default();
        body.push_str(&format!(
            "{} {} {} .\n",
            quad.subject, quad.predicate, quad.object
        ));
    }
    let mut text = String::new();
    for (graph, triples) in by_graph {
        match graph {
            Some(g) => text.push_str(&format!("GRAPH {g} {{\n{triples}}}\n")),
            None => text.push_str(&triples),
        }
    }
    text
}

/// How many steps' inputs [`step_inputs`] is asked for at once.
pub const STEP_INPUTS_PAGE: usize = 200;

/// The LLM calls recorded in a run (its root session's node): each call's node, the digest of
/// what it asked and its answer (JSON).
pub fn recorded_llm_calls(run: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?call ?digest ?completion WHERE {{ GRAPH {g} {{
  ?call tg:run {run} ; tg:promptDigest ?digest ; tg:completion ?completion }} }}"
    )
}

/// The tool calls recorded in a run that ran: each iteration's action and arguments, and its
/// observation's node, text (beside it, or in the documents graph) and outcome (`?outcome`, unbound
/// in a record older than outcomes). A call that was refused (not available to the request, or
/// needing an approval the step could not wait for) or not run (a person denied it) is not
/// among them: a replay must not give its refusal again as if the tool had answered it.
pub fn recorded_tool_results(run: &NamedNode) -> String {
    let g = graph();
    format!(
        "{PREFIXES}SELECT ?action ?arguments ?observation ?text ?outcome WHERE {{
  GRAPH {g} {{ ?it tg:run {run} ; tg:action ?action ; tg:arguments ?arguments .
    ?observation prov:wasDerivedFrom ?it ; a tg:Observation ; tg:document ?d }}
  {content}
  OPTIONAL {{ GRAPH {g} {{ ?observation tg:toolOutcome ?outcome }} }}
  FILTER (!BOUND(?outcome) || ?outcome IN (\"ok\", \"error\", \"timeout\"))
}}",
        content = content_of("d", "text")
    )
}

fn journal_owners_graph() -> NamedNode {
    NamedNode::new_unchecked(JOURNAL_OWNERS_GRAPH)
}

/// What a journal owner writes of itself each beat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerRecord {
    pub id: String,
    pub started_ms: u64,
    pub store: String,
    pub beat: u64,
    pub owning: bool,
}

/// The node of the owner whose process id is `id`.
pub fn owner_node(id: &str) -> Result<NamedNode, GraphError> {
    NamedNode::new(format!("urn:trustgraph:agent:journal-owner:{id}"))
        .map_err(|e| GraphError::Syntax(format!("not an owner id: {e}")))
}

/// Replaces the owner's record with `record` (one update: what it wrote last beat goes).
pub fn owner_beat(record: &OwnerRecord) -> Result<String, GraphError> {
    use oxigraph::model::Literal;
    let node = owner_node(&record.id)?;
    let g = journal_owners_graph();
    let id = Literal::new_simple_literal(&record.id);
    let store = Literal::new_simple_literal(&record.store);
    let started = Literal::from(i64::try_from(record.started_ms).unwrap_or(i64::MAX));
    let beat = Literal::from(i64::try_from(record.beat).unwrap_or(i64::MAX));
    let owning = Literal::from(record.owning);
    Ok(format!(
        "{PREFIXES}DELETE WHERE {{ GRAPH {g} {{ {node} ?p ?o }} }};
INSERT DATA {{ GRAPH {g} {{ {node} tg:ownerId {id} ; tg:ownerStartedMs {started} ; tg:ownerStore {store} ;
  tg:ownerBeat {beat} ; tg:ownerOwning {owning} }} }}"
    ))
}

/// Every owner's record, as it stands.
pub fn owner_records() -> String {
    let g = journal_owners_graph();
    format!(
        "{PREFIXES}SELECT ?id ?started ?store ?beat ?owning WHERE {{ GRAPH {g} {{
  ?o tg:ownerId ?id ; tg:ownerStartedMs ?started ; tg:ownerStore ?store ; tg:ownerBeat ?beat ;
     tg:ownerOwning ?owning }} }}"
    )
}

/// Removes the record of the owner `id` (it stopped, or stopped beating long ago).
pub fn forget_owner(id: &str) -> Result<String, GraphError> {
    let node = owner_node(id)?;
    let g = journal_owners_graph();
    Ok(format!(
        "{PREFIXES}DELETE WHERE {{ GRAPH {g} {{ {node} ?p ?o }} }}"
    ))
}

/// The owners' records in the rows of [`owner_records`]; a row that does not read as one is left
/// out.
pub fn owner_records_of(rows: &crate::Rows) -> Vec<OwnerRecord> {
    use oxigraph::model::Term;
    let text = |t: Option<&Term>| match t {
        Some(Term::Literal(l)) => Some(l.value().to_owned()),
        _ => None,
    };
    let column = |name: &str| rows.variables.iter().position(|v| v == name);
    let (Some(id), Some(started), Some(store), Some(beat), Some(owning)) = (
        column("id"),
        column("started"),
        column("store"),
        column("beat"),
        column("owning"),
    ) else {
        return Vec::new();
    };
    let records = rows.rows.iter().filter_map(|row| {
        let at = |i: usize| text(row.get(i).and_then(Option::as_ref));
        Some(OwnerRecord {
            id: at(id)?,
            started_ms: at(started)?.parse().ok()?,
            store: at(store)?,
            beat: at(beat)?.parse().ok()?,
            owning: at(owning)?.parse().ok()?,
        })
    });
    // One record per owner, its highest beat: a store that ran two of its beats side by side
    // may hold two, and rows alternating between them must not look like a counter moving.
    let mut highest: std::collections::BTreeMap<String, OwnerRecord> = Default::default();
    for record in records {
        match highest.get(&record.id) {
            Some(kept) if (kept.beat, kept.owning) >= (record.beat, record.owning) => {}
            _ => {
                highest.insert(record.id.clone(), record);
            }
        }
    }
    highest.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page of step inputs stays within what the aggregator takes from a stranger (32 KiB), for
    /// a subagent's session three levels deep, at steps in the thousands: a fork of a long dialog
    /// asked for all of them in one query, and past about 450 steps was refused (413).
    #[test]
    fn a_page_of_step_inputs_stays_within_a_strangers_query_text() {
        let session =
            session_node("0b9e6f2a-51c4-4d38-9a7e-2f1c3d4e5a6b-f12-s3-f4-s10-f2-s7").unwrap();
        let page = step_inputs(&session, 9_801..=9_800 + STEP_INPUTS_PAGE);
        assert!(page.len() < 32 * 1024, "{} bytes", page.len());
    }
}
