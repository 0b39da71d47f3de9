//! Provenance triples in TrustGraph's vocabulary (PROV-O plus `tg:`), built from typed terms.
//!
//! The URIs are deterministic functions of the session id and the iteration number, so a replayed
//! iteration names the same nodes; the texts (thoughts, observations, answers) are stored in the
//! graph, short ones as literals beside their nodes and long ones as documents named by their
//! digest, so the graph alone explains a run.

use agent_schema::{Term, Triple};

use crate::documents;
use crate::pattern::Termination;
use crate::router::{Choice, Decision, Method};

use oxrdf::NamedNodeRef;

use crate::vocab::{
    prov, session_uri, tg, DOCUMENTS_GRAPH, PROVENANCE_GRAPH as GRAPH, RDFS_LABEL, RDF_TYPE,
    XSD_BOOLEAN, XSD_DATETIME, XSD_INTEGER,
};

/// Node URIs of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionUris {
    base: String,
}

impl SessionUris {
    pub fn new(session_id: &str) -> SessionUris {
        SessionUris {
            base: session_uri(session_id),
        }
    }

    pub fn session(&self) -> String {
        self.base.clone()
    }
    pub fn iteration(&self, n: usize) -> String {
        format!("{}/i{n}", self.base)
    }
    pub fn thought(&self, n: usize) -> String {
        format!("{}/i{n}/thought", self.base)
    }
    pub fn observation(&self, n: usize) -> String {
        format!("{}/i{n}/observation", self.base)
    }
    /// Step `index` of the plan made at iteration `n`.
    pub fn plan_step(&self, n: usize, index: usize) -> String {
        format!("{}/i{n}/step/{index}", self.base)
    }
    pub fn fanout(&self, correlation_id: &str) -> String {
        format!("{}/fanout/{correlation_id}", self.base)
    }
    /// The tool call of iteration `n` parked for a person's approval.
    pub fn approval(&self, n: usize) -> String {
        format!("{}/i{n}/approval", self.base)
    }
    /// The answer to it (approve, deny, or expire).
    pub fn approval_answer(&self, n: usize) -> String {
        format!("{}/i{n}/approval/answer", self.base)
    }
    /// The record of what step `n` was given (see [`crate::fork`]).
    pub fn input(&self, n: usize) -> String {
        format!("{}/input/{n}", self.base)
    }
    /// An LLM call of this session: step `n`'s call asking what `digest` names, the
    /// `repeat`-th (0 the first) of that step's calls asking it (see [`crate::replay`]). Until
    /// 2026-12-03 a call was `{session}/llm/{digest}`, one node for every call of the session
    /// that asked the same, with as many answers and no telling which step had which.
    pub fn llm_call(&self, n: usize, repeat: usize, digest: &str) -> String {
        match repeat {
            0 => format!("{}/llm/{n}/{digest}", self.base),
            k => format!("{}/llm/{n}/{digest}/{k}", self.base),
        }
    }
    /// Where a cancel of this session is recorded: who asked, when and why.
    pub fn cancellation(&self) -> String {
        format!("{}/cancellation", self.base)
    }
    pub fn completion(&self) -> String {
        format!("{}/completion", self.base)
    }
    pub fn synthesis(&self, correlation_id: &str) -> String {
        format!("{}/synthesis/{correlation_id}", self.base)
    }
    pub fn pattern_decision(&self) -> String {
        format!("{}/pattern-decision", self.base)
    }
    pub fn conclusion(&self) -> String {
        format!("{}/final", self.base)
    }
    /// The LLM-as-router's one choice.
    pub fn dispatch(&self) -> String {
        format!("{}/dispatch", self.base)
    }
    pub fn answer_document(&self) -> String {
        format!("{}/answer", self.base)
    }
    /// The node the next node derives from, after `completed` iterations. Every dialog has a
    /// pattern decision (routed or requested), and its first iteration derives from it.
    pub fn previous(&self, completed: usize) -> String {
        match completed {
            0 => self.pattern_decision(),
            n => self.observation(n),
        }
    }
}

/// Collects the triples of one node.
#[derive(Debug, Default)]
pub struct NodeBuilder {
    triples: Vec<Triple>,
}

impl NodeBuilder {
    fn add(&mut self, s: &str, p: NamedNodeRef<'_>, o: Term) -> &mut Self {
        self.triples.push(Triple {
            s: Term::iri(s),
            p: Term::iri(p.as_str()),
            o,
            g: Some(GRAPH.to_owned()),
        });
        self
    }
    fn types(&mut self, s: &str, types: &[NamedNodeRef<'_>]) -> &mut Self {
        self.add(s, RDF_TYPE, Term::iri(prov::ENTITY.as_str()));
        for t in types {
            self.add(s, RDF_TYPE, Term::iri(t.as_str()));
        }
        self
    }
    /// A `tg:` fact (any term of [`tg`]).
    fn tg(&mut self, s: &str, p: NamedNodeRef<'_>, o: Term) -> &mut Self {
        self.add(s, p, o)
    }
    fn label(&mut self, s: &str, label: &str) -> &mut Self {
        self.add(s, RDFS_LABEL, Term::literal(label))
    }
    fn derived(&mut self, s: &str, from: &str) -> &mut Self {
        self.add(s, prov::WAS_DERIVED_FROM, Term::iri(from))
    }
    /// The text the node stands for, kept in the graph (TrustGraph keeps it in its librarian). A
    /// short text is a literal of `doc` beside the node; a long one is a document of its own,
    /// named by its digest in the documents graph, so the store holds it once however many
    /// messages, nodes and redeliveries carry it (see [`crate::documents`]).
    fn document(&mut self, s: &str, doc: &str, text: &str) -> &mut Self {
        if documents::is_long(text) {
            let doc = documents::document_uri(text);
            self.tg(s, tg::DOCUMENT, Term::iri(&doc));
            self.triples.push(Triple {
                s: Term::iri(&doc),
                p: Term::iri(tg::CONTENT.as_str()),
                o: Term::literal(text),
                g: Some(DOCUMENTS_GRAPH.to_owned()),
            });
            return self;
        }
        self.tg(s, tg::DOCUMENT, Term::iri(doc));
        self.tg(doc, tg::CONTENT, Term::literal(text))
    }
    /// What the LLM calls behind a node cost: duration, tokens and the model, if known.
    fn cost(&mut self, s: &str, stats: &CallStats) -> &mut Self {
        let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
        self.tg(s, tg::LLM_DURATION_MS, integer(stats.duration_ms))
            .tg(s, tg::IN_TOKEN, integer(stats.in_token))
            .tg(s, tg::OUT_TOKEN, integer(stats.out_token));
        if !stats.model.is_empty() {
            self.tg(s, tg::MODEL, Term::literal(&stats.model));
        }
        self
    }
    pub fn build(self) -> Vec<Triple> {
        self.triples
    }
}

/// Whether `triples` hold a fan-out or a subagent's completion: the events the aggregator's
/// fan-in answers to, found by the correlation id in the graph message that carries them. The
/// orchestrator gives each such node a graph message of its own, so that id is the node's.
pub fn drives_fan_in(triples: &[Triple]) -> bool {
    triples.iter().any(|t| {
        t.p.iri == RDF_TYPE.as_str()
            && (t.o.iri == tg::FAN_OUT.as_str() || t.o.iri == tg::SUBAGENT_COMPLETION.as_str())
    })
}

/// The session node: the question as asked, and the client's `id` of the request that asked it
/// (empty: none), which tells that dialog from another a client starts under the same session id.
pub fn session(
    uris: &SessionUris,
    question: &str,
    started_at: &str,
    client_id: &str,
) -> Vec<Triple> {
    let s = uris.session();
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::QUESTION, tg::AGENT_QUESTION])
        .label(&s, "Agent Question")
        .add(
            &s,
            prov::STARTED_AT_TIME,
            Term::typed_literal(started_at, XSD_DATETIME.as_str()),
        )
        .tg(&s, tg::QUERY, Term::literal(question));
    if !client_id.is_empty() {
        b.tg(&s, tg::CLIENT_ID, Term::literal(client_id));
    }
    b.build()
}

/// A cancel of the session of `uris` (and so of every subagent under it): who asked, when (an RFC
/// 3339 time) and why. The session is invalidated by it, in PROV's terms.
pub fn cancellation(uris: &SessionUris, by: &str, at: &str, reason: &str) -> Vec<Triple> {
    let s = uris.cancellation();
    let session = uris.session();
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::CANCELLATION])
        .label(&s, "Cancellation")
        .derived(&s, &session)
        .tg(&s, tg::CANCELLED_BY, Term::literal(by))
        .add(
            &s,
            prov::AT_TIME,
            Term::typed_literal(at, XSD_DATETIME.as_str()),
        )
        .add(&session, prov::WAS_INVALIDATED_BY, Term::iri(&s));
    if !reason.is_empty() {
        b.tg(&s, tg::REASON, Term::literal(reason));
    }
    b.build()
}

/// A cancel an orchestrator acted on although it came without the services' seal, recorded by
/// that orchestrator: [`cancellation`], marked `tg:controlSealed false` so that whoever audits it
/// knows who and why are what the sender said, unchecked.
pub fn unsealed_cancellation(uris: &SessionUris, by: &str, at: &str, reason: &str) -> Vec<Triple> {
    let mut triples = cancellation(uris, by, at, reason);
    let mut b = NodeBuilder::default();
    b.tg(
        &uris.cancellation(),
        tg::CONTROL_SEALED,
        Term::typed_literal("false", XSD_BOOLEAN.as_str()),
    );
    triples.extend(b.build());
    triples
}

/// A tool call parked for a person's approval at iteration `n`: the tool, its arguments, the
/// thought that chose it, when it was asked and until when an answer is taken.
#[allow(clippy::too_many_arguments)]
pub fn approval_request(
    uris: &SessionUris,
    n: usize,
    tool: &str,
    arguments_json: &str,
    thought: &str,
    asked_at: &str,
    deadline: &str,
) -> Vec<Triple> {
    let s = uris.approval(n);
    let t = format!("{s}/thought");
    let time = |v: &str| Term::typed_literal(v, XSD_DATETIME.as_str());
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::APPROVAL_REQUEST])
        .label(&s, &format!("Approval needed: {tool}"))
        .derived(&s, &uris.previous(n - 1))
        .tg(
            &s,
            tg::STEP,
            Term::typed_literal(n.to_string(), XSD_INTEGER.as_str()),
        )
        .tg(&s, tg::ACTION, Term::literal(tool))
        .tg(&s, tg::ARGUMENTS, Term::literal(arguments_json))
        .add(&s, prov::STARTED_AT_TIME, time(asked_at))
        .tg(&s, tg::DEADLINE, time(deadline))
        .tg(&s, tg::THOUGHT_LINK, Term::iri(&t));
    b.types(&t, &[tg::REFLECTION, tg::THOUGHT])
        .label(&t, "Thought")
        .derived(&t, &s)
        .document(&t, &t, thought);
    b.build()
}

/// The answer to the approval of iteration `n`: `decision` (approve, deny or expire), who gave it,
/// when, why, and the arguments it put in place of the agent's (empty: none).
pub fn approval_answer(
    uris: &SessionUris,
    n: usize,
    decision: &str,
    by: &str,
    at: &str,
    reason: &str,
    edited_arguments_json: &str,
) -> Vec<Triple> {
    let s = uris.approval_answer(n);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::APPROVAL_ANSWER])
        .label(&s, &format!("Approval: {decision}"))
        .derived(&s, &uris.approval(n))
        .tg(&s, tg::DECISION, Term::literal(decision))
        .tg(&s, tg::ANSWERED_BY, Term::literal(by));
    if !at.is_empty() {
        b.add(
            &s,
            prov::AT_TIME,
            Term::typed_literal(at, XSD_DATETIME.as_str()),
        );
    }
    if !reason.is_empty() {
        b.tg(&s, tg::REASON, Term::literal(reason));
    }
    if !edited_arguments_json.is_empty() {
        b.tg(
            &s,
            tg::EDITED_ARGUMENTS,
            Term::literal(edited_arguments_json),
        );
    }
    b.build()
}

/// Links a dialog's session to the earlier dialogs of its conversation it was told about.
pub fn follows(uris: &SessionUris, earlier: &[String]) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    for session in earlier {
        b.tg(&uris.session(), tg::FOLLOWS, Term::iri(session));
    }
    b.build()
}

/// A step input larger than this (as JSON; only a history that could not be folded grows so) is
/// not kept, only its size: its graph message must stay within the broker's limit.
pub const MAX_RECORDED_INPUT_BYTES: usize = 1024 * 1024;

/// The record of step `input.step`'s input: the request as JSON (only its new history steps when
/// it continues an earlier step's input, which it then names). Not derived from anything: the
/// explain tree shows what was done, and this is what a fork or replay starts from.
pub fn step_input(uris: &SessionUris, input: &crate::fork::RecordedInput) -> Vec<Triple> {
    let s = uris.input(input.step);
    let integer = |v: usize| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    b.add(&s, RDF_TYPE, Term::iri(tg::STEP_INPUT.as_str()))
        .tg(&s, tg::STEP, integer(input.step));
    let json = String::from_utf8_lossy(&agent_schema::encode(&input.request)).into_owned();
    if json.len() <= MAX_RECORDED_INPUT_BYTES {
        b.tg(&s, tg::REQUEST, Term::literal(json));
    } else {
        b.tg(&s, tg::REQUEST_BYTES, integer(json.len()));
    }
    if let Some((from, kept)) = input.continues {
        b.tg(&s, tg::CONTINUES_INPUT, Term::iri(uris.input(from)))
            .tg(&s, tg::CONTINUED_STEPS, integer(kept));
    }
    b.build()
}

/// A fork's root: which session and step it was forked from, what its input changed there, and
/// the node it derives from (the source's node its first step followed), so the source's explain
/// tree shows the fork as a branch.
pub fn fork(
    uris: &SessionUris,
    source: &SessionUris,
    step: usize,
    edits: &[String],
    reuse: &str,
) -> Vec<Triple> {
    let s = uris.session();
    let integer = |v: usize| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let from = if step <= 1 {
        source.session()
    } else {
        source.previous(step - 1)
    };
    let mut b = NodeBuilder::default();
    b.add(&s, RDF_TYPE, Term::iri(tg::FORK.as_str()))
        .tg(&s, tg::FORKED_FROM, Term::iri(source.session()))
        .tg(&s, tg::FORKED_AT_STEP, integer(step))
        .derived(&s, &from);
    for edit in edits {
        b.tg(&s, tg::FORK_EDIT, Term::literal(edit));
    }
    if !reuse.is_empty() {
        b.tg(&s, tg::REUSES, Term::literal(reuse));
    }
    b.build()
}

/// In a fork from step `n + 1`, the observation its first step follows: step `n`'s as the fork's
/// input has it (edited or not), standing for the source's, and derived from the fork's root.
pub fn fork_observation(
    uris: &SessionUris,
    source: &SessionUris,
    n: usize,
    text: &str,
) -> Vec<Triple> {
    let s = uris.observation(n);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::OBSERVATION])
        .label(&s, "Observation")
        .derived(&s, &uris.session())
        .tg(&s, tg::FORKED_FROM, Term::iri(source.observation(n)))
        .document(&s, &s, text);
    b.build()
}

/// An LLM answer longer than this (as JSON) is not kept for replays: its size is recorded, and a
/// replay asks again. Answers are seldom near it; one that is must not make a step's graph
/// message outgrow the broker's limit.
pub const MAX_RECORDED_COMPLETION_BYTES: usize = 64 * 1024;

/// One LLM call: the digest of what it asked and what it answered (as JSON), tagged with its
/// run, so a replay can give the same answer to the same question without a second charge (an
/// answer over [`MAX_RECORDED_COMPLETION_BYTES`] only has its size recorded).
/// `reused_from` names the recorded call it took its answer from, when it was not made.
pub fn llm_call(
    uris: &SessionUris,
    (n, repeat): (usize, usize),
    digest: &str,
    completion: &str,
    run: &str,
    reused_from: Option<&str>,
) -> Vec<Triple> {
    let s = uris.llm_call(n, repeat, digest);
    let mut b = NodeBuilder::default();
    b.tg(&s, tg::PROMPT_DIGEST, Term::literal(digest))
        .tg(&s, tg::RUN, Term::iri(run));
    if completion.len() <= MAX_RECORDED_COMPLETION_BYTES {
        b.tg(&s, tg::COMPLETION, Term::literal(completion));
    } else {
        let bytes = Term::typed_literal(completion.len().to_string(), XSD_INTEGER.as_str());
        b.tg(&s, tg::COMPLETION_BYTES, bytes);
    }
    if let Some(source) = reused_from {
        b.tg(&s, tg::REUSED_FROM, Term::iri(source));
    }
    b.build()
}

/// `node` took its content from the recorded `source` instead of running again (a replay).
pub fn reused(node: &str, source: &str) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.tg(node, tg::REUSED_FROM, Term::iri(source));
    b.build()
}

/// Links iteration `n` to the approval its tool call waited for.
pub fn approved_iteration(uris: &SessionUris, n: usize) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.tg(
        &uris.iteration(n),
        tg::APPROVAL,
        Term::iri(uris.approval(n)),
    );
    b.build()
}

/// Links a dialog's conclusion to the cancellation (its own session's, or a supervisor's above it)
/// that ended it.
pub fn cancelled_by(uris: &SessionUris, cancellation: &str) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.tg(
        &uris.conclusion(),
        tg::CANCELLATION_LINK,
        Term::iri(cancellation),
    );
    b.build()
}

/// What an iteration's LLM call cost.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CallStats {
    pub duration_ms: u64,
    pub in_token: u64,
    pub out_token: u64,
    pub model: String,
}

/// One ReACT iteration that chose a tool: the analysis node and its thought.
pub fn tool_iteration(
    uris: &SessionUris,
    n: usize,
    thought: &str,
    action: &str,
    arguments_json: &str,
    candidates: &[&str],
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.iteration(n);
    let t = uris.thought(n);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::ANALYSIS, tg::TOOL_USE])
        .label(&s, &format!("Analysis: {action}"))
        .tg(&s, tg::ACTION, Term::literal(action))
        .tg(&s, tg::ARGUMENTS, Term::literal(arguments_json))
        .derived(&s, &uris.previous(n - 1))
        .tg(&s, tg::THOUGHT_LINK, Term::iri(&t));
    iteration_facts(&mut b, &s, n, candidates, stats);
    b.types(&t, &[tg::REFLECTION, tg::THOUGHT])
        .label(&t, "Thought")
        .derived(&t, &s)
        .document(&t, &t, thought);
    b.build()
}

/// How much of an iteration's LLM text a bounded excerpt keeps in `tg:discardedText`.
pub const DISCARDED_EXCERPT_CHARS: usize = 2000;

/// What the LLM wrote after its first decision (an imagined observation, a premature answer,
/// further actions) and the parser dropped: its length (`tg:discardedChars`) and a bounded excerpt
/// (`tg:discardedText`) on iteration `n`, so an auditor sees that the answer did not come from
/// it. Nothing when nothing was dropped.
pub fn discarded(uris: &SessionUris, n: usize, text: &str) -> Vec<Triple> {
    if text.is_empty() {
        return Vec::new();
    }
    let s = uris.iteration(n);
    let chars = text.chars().count();
    let excerpt: String = text.chars().take(DISCARDED_EXCERPT_CHARS).collect();
    let mut b = NodeBuilder::default();
    b.tg(
        &s,
        tg::DISCARDED_CHARS,
        Term::typed_literal(chars.to_string(), XSD_INTEGER.as_str()),
    )
    .tg(&s, tg::DISCARDED_TEXT, Term::literal(&excerpt));
    b.build()
}

fn iteration_facts(b: &mut NodeBuilder, s: &str, n: usize, candidates: &[&str], stats: &CallStats) {
    b.tg(
        s,
        tg::STEP,
        Term::typed_literal(n.to_string(), XSD_INTEGER.as_str()),
    )
    .cost(s, stats);
    for c in candidates {
        b.tg(s, tg::TOOL_CANDIDATE, Term::literal(*c));
    }
}

/// A deep-research round (iteration `n`): its gap check (`tg:researchComplete`, a `tg:gap` per
/// gap, the thought) and the tools it could choose from; each call it ran is a node of its own
/// ([`research_call`]).
pub fn research_round(
    uris: &SessionUris,
    n: usize,
    round: &crate::deep_research::Round,
    candidates: &[&str],
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.iteration(n);
    let t = uris.thought(n);
    let mut b = NodeBuilder::default();
    let action = if round.complete {
        crate::deep_research::COMPLETE_ACTION
    } else {
        crate::deep_research::RESEARCH_ACTION
    };
    b.types(&s, &[tg::ANALYSIS, tg::RESEARCH_ROUND])
        .label(&s, &format!("Research round: {action}"))
        .tg(&s, tg::ACTION, Term::literal(action))
        .tg(
            &s,
            tg::RESEARCH_COMPLETE,
            Term::typed_literal(round.complete.to_string(), XSD_BOOLEAN.as_str()),
        )
        .derived(&s, &uris.previous(n - 1))
        .tg(&s, tg::THOUGHT_LINK, Term::iri(&t));
    for gap in &round.gaps {
        b.tg(&s, tg::GAP, Term::literal(gap));
    }
    if round.dropped > 0 {
        b.tg(
            &s,
            tg::DROPPED_CALLS,
            Term::typed_literal(round.dropped.to_string(), XSD_INTEGER.as_str()),
        );
    }
    if let Some(why) = &round.unreadable {
        b.tg(&s, tg::UNREADABLE_REASON, Term::literal(why));
    }
    iteration_facts(&mut b, &s, n, candidates, stats);
    b.types(&t, &[tg::REFLECTION, tg::THOUGHT])
        .label(&t, "Thought")
        .derived(&t, &s)
        .document(&t, &t, &round.thought);
    b.build()
}

/// Call `k` (from 1) of deep-research round `n`: the tool, its arguments, how it went and how
/// long it took, and the note it gave (`tg:note`, its number among the dialog's notes).
pub fn research_call(
    uris: &SessionUris,
    n: usize,
    k: usize,
    call: &crate::deep_research::Call,
    tool: ToolStats,
    note: usize,
) -> Vec<Triple> {
    let round = uris.iteration(n);
    let s = format!("{round}/call/{k}");
    let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::TOOL_USE])
        .label(&s, &format!("Call {k}: {}", call.tool))
        .tg(&s, tg::ACTION, Term::literal(&call.tool))
        .tg(
            &s,
            tg::ARGUMENTS,
            Term::literal(serde_json::to_string(&call.arguments).unwrap_or_default()),
        )
        .tg(
            &s,
            tg::TOOL_OUTCOME,
            Term::literal(tool.outcome.unwrap_or_default()),
        )
        .tg(&s, tg::TOOL_DURATION_MS, integer(tool.duration_ms))
        .tg(&s, tg::NOTE, integer(note as u64))
        .derived(&s, &round);
    b.build()
}

/// A plan a Plan-then-Execute iteration made or revised.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PlanRecord<'a> {
    /// 0 for the first plan, then one more per revision.
    pub version: usize,
    pub steps: &'a [agent_schema::PlanStep],
    /// The LLM's reason for the plan, or for the revision.
    pub rationale: &'a str,
    /// What the client was shown as the iteration's thought.
    pub thought: &'a str,
    /// Plans the LLM gave that were refused, each with why, before this one.
    pub rejected: &'a [(String, String)],
    /// For a revision: what went wrong, and the old step numbers it dropped.
    pub revision_of: Option<(&'a str, &'a [usize])>,
    /// Why the LLM's plan was not used and a one-step plan stands in, if so.
    pub fallback: Option<&'a str>,
    /// What was repaired in the LLM's plan before it was used ([`crate::plan::repair`]).
    pub repairs: &'a [String],
}

/// A planning iteration: the plan (each step a node with its goal, tool hint and dependencies),
/// the refused attempts, and for a revision what changed and why.
pub fn plan_iteration(
    uris: &SessionUris,
    n: usize,
    plan: &PlanRecord<'_>,
    candidates: &[&str],
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.iteration(n);
    let integer = |v: usize| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    let (action, types): (&str, &[NamedNodeRef<'_>]) = match plan.revision_of {
        Some(_) => ("replan", &[tg::ANALYSIS, tg::PLAN, tg::PLAN_REVISION]),
        None => ("plan", &[tg::ANALYSIS, tg::PLAN]),
    };
    b.types(&s, types)
        .label(
            &s,
            &format!("Plan v{}: {} steps", plan.version, plan.steps.len()),
        )
        .tg(&s, tg::ACTION, Term::literal(action))
        .tg(&s, tg::PLAN_VERSION, integer(plan.version))
        .derived(&s, &uris.previous(n - 1));
    if !plan.rationale.is_empty() {
        b.tg(&s, tg::RATIONALE, Term::literal(plan.rationale));
    }
    if let Some((problem, dropped)) = plan.revision_of {
        b.tg(&s, tg::REVISION_REASON, Term::literal(problem));
        for d in dropped {
            b.tg(&s, tg::DROPPED_STEP, integer(*d));
        }
    }
    if let Some(why) = plan.fallback {
        b.tg(&s, tg::PLAN_FALLBACK_REASON, Term::literal(why));
    }
    for repair in plan.repairs {
        b.tg(&s, tg::PLAN_REPAIR, Term::literal(repair));
    }
    if !plan.thought.is_empty() {
        let t = uris.thought(n);
        b.tg(&s, tg::THOUGHT_LINK, Term::iri(&t));
        b.types(&t, &[tg::REFLECTION, tg::THOUGHT])
            .label(&t, "Thought")
            .derived(&t, &s)
            .document(&t, &t, plan.thought);
    }
    for (answer, why) in plan.rejected {
        b.tg(&s, tg::REJECTED_PLAN, Term::literal(answer)).tg(
            &s,
            tg::REJECTION_REASON,
            Term::literal(why),
        );
    }
    plan_step_nodes(&mut b, uris, n, &s, plan.steps);
    iteration_facts(&mut b, &s, n, candidates, stats);
    b.build()
}

/// The nodes of a plan's steps, named after iteration `n` (whose node `s` has them).
fn plan_step_nodes(
    b: &mut NodeBuilder,
    uris: &SessionUris,
    n: usize,
    s: &str,
    steps: &[agent_schema::PlanStep],
) {
    let integer = |v: usize| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    for (i, step) in steps.iter().enumerate() {
        let node = uris.plan_step(n, i);
        b.tg(s, tg::HAS_STEP, Term::iri(&node));
        b.types(&node, &[tg::PLAN_STEP])
            .label(&node, &format!("Step {i}: {}", step.goal))
            .tg(&node, tg::STEP_INDEX, integer(i))
            .tg(&node, tg::GOAL, Term::literal(&step.goal))
            .tg(&node, tg::STEP_STATUS, Term::literal(&step.status))
            .derived(&node, s);
        if !step.tool_hint.is_empty() {
            b.tg(&node, tg::TOOL_HINT, Term::literal(&step.tool_hint));
        }
        if !step.result.is_empty() {
            b.tg(&node, tg::RESULT, Term::literal(&step.result));
        }
        for d in &step.depends_on {
            b.tg(
                &node,
                tg::DEPENDS_ON,
                Term::typed_literal(d.to_string(), XSD_INTEGER.as_str()),
            );
        }
    }
}

/// An iteration that carried out one plan step: like a tool iteration, plus which step of which
/// plan it executed. `plan_step` is that step's node.
#[allow(clippy::too_many_arguments)]
pub fn step_execution(
    uris: &SessionUris,
    n: usize,
    plan_step: &str,
    index: usize,
    lessons: &[String],
    thought: &str,
    action: &str,
    arguments_json: &str,
    candidates: &[&str],
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.iteration(n);
    let mut triples = tool_iteration(uris, n, thought, action, arguments_json, candidates, stats);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::STEP_EXECUTION])
        .tg(&s, tg::EXECUTES_STEP, Term::iri(plan_step))
        .tg(
            &s,
            tg::STEP_INDEX,
            Term::typed_literal(index.to_string(), XSD_INTEGER.as_str()),
        );
    // A rerun says which of the critic's lessons it was given.
    for lesson in lessons {
        b.tg(&s, tg::LESSON_APPLIED, Term::literal(lesson));
    }
    triples.extend(b.build());
    triples
}

/// Reflexion's self-critique at iteration `n`: the lesson the agent carries into its next steps
/// (also its observation's content), derived from the action it reflects on.
pub fn reflection(uris: &SessionUris, n: usize, lesson: &str, stats: &CallStats) -> Vec<Triple> {
    let s = uris.iteration(n);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::ANALYSIS, tg::CRITIQUE])
        .label(&s, "Reflection")
        .tg(&s, tg::ACTION, Term::literal("reflect"))
        .tg(&s, tg::LESSON, Term::literal(lesson))
        .derived(&s, &uris.previous(n - 1));
    iteration_facts(&mut b, &s, n, &[], stats);
    b.build()
}

/// An iteration that wrote a draft answer for the critic to review (its text is the iteration's
/// observation).
pub fn draft_answer(uris: &SessionUris, n: usize, stats: &CallStats) -> Vec<Triple> {
    let s = uris.iteration(n);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::ANALYSIS, tg::SYNTHESIS])
        .label(&s, "Draft answer")
        .tg(&s, tg::ACTION, Term::literal("synthesise"))
        .derived(&s, &uris.previous(n - 1));
    iteration_facts(&mut b, &s, n, &[], stats);
    b.build()
}

/// The outcome of a plan step on its observation node: `completed` or `failed`.
pub fn step_status(uris: &SessionUris, n: usize, status: &str) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.tg(&uris.observation(n), tg::STEP_STATUS, Term::literal(status));
    b.build()
}

/// The critic's verdict on a plan step, recorded on iteration `n`: which execution it judged, the
/// status, evaluation and lesson, what it caused (steps run again, sub-steps, a used-up life
/// cycle), and the request's retries after it.
#[allow(clippy::too_many_arguments)]
pub fn evaluation(
    uris: &SessionUris,
    n: usize,
    judged: &str,
    index: Option<usize>,
    thought: &str,
    verdict: &crate::critic::Evaluation,
    applied: &crate::critic::Applied,
    retries: usize,
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.iteration(n);
    let integer = |v: usize| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    let what = match index {
        Some(i) => format!("step {i}"),
        None => "the plan".to_owned(),
    };
    b.types(&s, &[tg::ANALYSIS, tg::EVALUATION])
        .label(
            &s,
            &format!("Evaluation of {what}: {}", verdict.status.as_str()),
        )
        .tg(&s, tg::ACTION, Term::literal("evaluate"))
        .tg(&s, tg::EVALUATES, Term::iri(judged))
        .tg(
            &s,
            tg::EVALUATION_STATUS,
            Term::literal(verdict.status.as_str()),
        )
        .tg(&s, tg::RETRY_COUNT, integer(retries))
        .derived(&s, &uris.previous(n - 1));
    if let Some(i) = index {
        b.tg(&s, tg::STEP_INDEX, integer(i));
    }
    if !thought.is_empty() {
        let t = uris.thought(n);
        b.tg(&s, tg::THOUGHT_LINK, Term::iri(&t));
        b.types(&t, &[tg::REFLECTION, tg::THOUGHT])
            .label(&t, "Thought")
            .derived(&t, &s)
            .document(&t, &t, thought);
    }
    if !verdict.evaluation.is_empty() {
        b.tg(&s, tg::EVALUATION_TEXT, Term::literal(&verdict.evaluation));
    }
    if !verdict.lesson.is_empty() {
        b.tg(&s, tg::LESSON, Term::literal(&verdict.lesson));
    }
    if let Some(why) = &verdict.unreadable {
        b.tg(&s, tg::EVALUATION_UNREADABLE, Term::literal(why));
    }
    for i in &applied.rerun {
        b.tg(&s, tg::RERUN_STEP, integer(*i));
    }
    for goal in &applied.sub_goals {
        b.tg(&s, tg::SUB_STEP, Term::literal(goal));
    }
    if !applied.sub_goals.is_empty() {
        // A split changes the plan's shape: this iteration names its steps from now on.
        plan_step_nodes(&mut b, uris, n, &s, &applied.plan);
    }
    if applied.life_cycle_exhausted {
        b.tg(
            &s,
            tg::LIFE_CYCLE_EXHAUSTED,
            Term::typed_literal("true", XSD_BOOLEAN.as_str()),
        );
    }
    iteration_facts(&mut b, &s, n, &[], stats);
    b.build()
}

/// What a tool run cost: its duration and the tokens of any LLM call it made; and how it went.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolStats {
    pub duration_ms: u64,
    pub in_token: u64,
    pub out_token: u64,
    /// How the call went (`tg:toolOutcome`: `ok`, `error`, `timeout`, `refused`, or `not-run`
    /// when a person denied it or it could not wait for one), where a tool was asked for. A
    /// replay gives again only the results of calls that ran.
    pub outcome: Option<&'static str>,
}

/// The observation of iteration `n`: what the tool returned (or the error) and what it cost, so the
/// tokens in the graph add up to the dialog's.
pub fn observation(uris: &SessionUris, n: usize, text: &str, tool: ToolStats) -> Vec<Triple> {
    let s = uris.observation(n);
    let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::OBSERVATION])
        .label(&s, "Observation")
        .derived(&s, &uris.iteration(n))
        .tg(&s, tg::TOOL_DURATION_MS, integer(tool.duration_ms))
        .tg(&s, tg::IN_TOKEN, integer(tool.in_token))
        .tg(&s, tg::OUT_TOKEN, integer(tool.out_token))
        .document(&s, &s, text);
    if let Some(outcome) = tool.outcome {
        b.tg(&s, tg::TOOL_OUTCOME, Term::literal(outcome));
    }
    b.build()
}

/// What the fan-out `node` carries on to the requests the aggregator sends for it (see
/// [`tg::CARRIES`]): message properties, as a JSON object.
pub fn carried(node: &str, properties_json: &str) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.tg(node, tg::CARRIES, Term::literal(properties_json));
    b.build()
}

/// A seal on `node` (see `agent_bus::seal`): the aggregator lets only sealed fan-outs and
/// completions drive fan-in.
pub fn sealed(node: &str, seal: &str) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.tg(node, tg::SEAL, Term::literal(seal));
    b.build()
}

/// Which budget ended a run (`limit`: `max_tokens` or `max_wall_secs`) and the run's totals at
/// that moment, on the conclusion node of the dialog that stopped for it.
pub fn budget_spent(
    uris: &SessionUris,
    limit: &str,
    run_tokens: u64,
    run_elapsed_ms: u64,
) -> Vec<Triple> {
    let s = uris.conclusion();
    let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    b.tg(&s, tg::BUDGET_SPENT, Term::literal(limit))
        .tg(&s, tg::RUN_TOKENS, integer(run_tokens))
        .tg(&s, tg::RUN_ELAPSED_MS, integer(run_elapsed_ms));
    b.build()
}

/// The conclusion: the final thought (as iteration `n`'s thought), the answer and why the dialog ended.
pub fn conclusion(
    uris: &SessionUris,
    n: usize,
    thought: &str,
    answer: &str,
    termination: Termination,
    candidates: &[&str],
    stats: &CallStats,
) -> Vec<Triple> {
    conclusion_from(
        uris,
        &uris.previous(n - 1),
        n,
        thought,
        answer,
        termination,
        candidates,
        stats,
    )
}

/// The conclusion, derived from `from` (a synthesis, rather than the previous observation).
#[allow(clippy::too_many_arguments)]
pub fn conclusion_from(
    uris: &SessionUris,
    from: &str,
    n: usize,
    thought: &str,
    answer: &str,
    termination: Termination,
    candidates: &[&str],
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.conclusion();
    let doc = uris.answer_document();
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::CONCLUSION, tg::ANSWER])
        .label(&s, "Conclusion")
        .derived(&s, from)
        .tg(
            &s,
            tg::TERMINATION_REASON,
            Term::literal(termination.as_str()),
        )
        .document(&s, &doc, answer);
    if !thought.is_empty() {
        let t = uris.thought(n);
        b.tg(&s, tg::THOUGHT_LINK, Term::iri(&t));
        b.types(&t, &[tg::REFLECTION, tg::THOUGHT])
            .label(&t, "Thought")
            .derived(&t, &s)
            .document(&t, &t, thought);
    }
    iteration_facts(&mut b, &s, n, candidates, stats);
    b.build()
}

/// The meta-router's decision: the task type and pattern chosen, what they were chosen among, how
/// (LLM, only candidate, requested, or fallback with its reason) and the LLM's rationale.
pub fn pattern_decision(uris: &SessionUris, decision: &Decision, stats: &CallStats) -> Vec<Triple> {
    let s = uris.pattern_decision();
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::PATTERN_DECISION])
        .label(&s, &format!("Pattern: {}", decision.pattern.selected))
        .derived(&s, &uris.session())
        .tg(&s, tg::PATTERN, Term::literal(&decision.pattern.selected));
    if !decision.task_type.selected.is_empty() {
        b.tg(
            &s,
            tg::TASK_TYPE,
            Term::literal(&decision.task_type.selected),
        );
    }
    // A request that named its pattern but no task type has no task type facts.
    if !decision.task_type.selected.is_empty() {
        choice_facts(&mut b, &s, &TASK_TYPE_CHOICE, &decision.task_type);
    }
    choice_facts(&mut b, &s, &PATTERN_CHOICE, &decision.pattern);
    for name in &decision.unavailable_patterns {
        b.tg(&s, tg::PATTERN_UNAVAILABLE, Term::literal(name));
    }
    let rationale: Vec<&str> = [&decision.task_type, &decision.pattern]
        .iter()
        .map(|c| c.rationale.as_str())
        .filter(|r| !r.is_empty())
        .collect();
    if !rationale.is_empty() {
        b.tg(&s, tg::RATIONALE, Term::literal(rationale.join(" ")));
    }
    let fallback = matches!(decision.task_type.method, Method::Fallback(_))
        || matches!(decision.pattern.method, Method::Fallback(_));
    b.tg(
        &s,
        tg::FALLBACK,
        Term::typed_literal(fallback.to_string(), XSD_BOOLEAN.as_str()),
    );
    if !decision.framing.is_empty() {
        b.tg(&s, tg::FRAMING, Term::literal(&decision.framing));
    }
    b.cost(&s, stats);
    b.build()
}

/// The facts of one choice, under predicates named after what was chosen (`taskType...`,
/// `pattern...`).
/// The LLM-as-router's choice, recorded as the meta-router's are: every candidate offered (tools as
/// `tool:<name>`, patterns as `pattern:<name>`), the one selected, how, why, what it cost, and any
/// tool arguments; derived from the pattern decision that chose the LLM-as-router.
pub fn dispatch_decision(
    uris: &SessionUris,
    choice: &Choice,
    arguments_json: &str,
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.dispatch();
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::DISPATCH_DECISION])
        .label(&s, &format!("Dispatch: {}", choice.selected))
        .derived(&s, &uris.pattern_decision())
        .tg(&s, tg::DISPATCH, Term::literal(&choice.selected));
    choice_facts(&mut b, &s, &DISPATCH_CHOICE, choice);
    if !arguments_json.is_empty() {
        b.tg(&s, tg::ARGUMENTS, Term::literal(arguments_json));
    }
    b.cost(&s, stats);
    b.build()
}

/// The predicates of one kind of choice's facts.
struct ChoiceTerms {
    candidate: NamedNodeRef<'static>,
    method: NamedNodeRef<'static>,
    rationale: NamedNodeRef<'static>,
    fallback_reason: NamedNodeRef<'static>,
    answer: NamedNodeRef<'static>,
}

const TASK_TYPE_CHOICE: ChoiceTerms = ChoiceTerms {
    candidate: tg::TASK_TYPE_CANDIDATE,
    method: tg::TASK_TYPE_METHOD,
    rationale: tg::TASK_TYPE_RATIONALE,
    fallback_reason: tg::TASK_TYPE_FALLBACK_REASON,
    answer: tg::TASK_TYPE_ANSWER,
};

const PATTERN_CHOICE: ChoiceTerms = ChoiceTerms {
    candidate: tg::PATTERN_CANDIDATE,
    method: tg::PATTERN_METHOD,
    rationale: tg::PATTERN_RATIONALE,
    fallback_reason: tg::PATTERN_FALLBACK_REASON,
    answer: tg::PATTERN_ANSWER,
};

const DISPATCH_CHOICE: ChoiceTerms = ChoiceTerms {
    candidate: tg::DISPATCH_CANDIDATE,
    method: tg::DISPATCH_METHOD,
    rationale: tg::DISPATCH_RATIONALE,
    fallback_reason: tg::DISPATCH_FALLBACK_REASON,
    answer: tg::DISPATCH_ANSWER,
};

fn choice_facts(b: &mut NodeBuilder, s: &str, terms: &ChoiceTerms, choice: &Choice) {
    for c in &choice.candidates {
        b.tg(s, terms.candidate, Term::literal(c));
    }
    b.tg(s, terms.method, Term::literal(choice.method.as_str()));
    if !choice.rationale.is_empty() {
        b.tg(s, terms.rationale, Term::literal(&choice.rationale));
    }
    if let Method::Fallback(reason) = &choice.method {
        b.tg(s, terms.fallback_reason, Term::literal(reason));
    }
    if let Some(raw) = &choice.raw_answer {
        b.tg(s, terms.answer, Term::literal(raw));
    }
}

/// One `prov:wasDerivedFrom` link.
pub fn derived_from(node: &str, source: &str) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    b.derived(node, source);
    b.build()
}

/// A supervisor's fan-out: the goals, the subagents' sessions, how many completions make it whole,
/// and what the aggregator needs to resume the supervisor (its request as JSON and the client's
/// `id`). It derives from `after`: the iteration before it, or the synthesis that asked for another
/// round.
#[allow(clippy::too_many_arguments)]
pub fn fanout(
    uris: &SessionUris,
    n: usize,
    correlation_id: &str,
    after: &str,
    goals: &[(String, String)],
    continuation_json: &str,
    client_id: &str,
    started_at: &str,
    dialog: DialogSoFar,
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.fanout(correlation_id);
    let integer = |v: usize| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::FAN_OUT])
        .label(&s, &format!("Fan-out to {} subagents", goals.len()))
        .tg(&s, tg::CORRELATION_ID, Term::literal(correlation_id))
        .tg(&s, tg::EXPECTED_SIBLINGS, integer(goals.len()))
        .tg(&s, tg::CONTINUATION, Term::literal(continuation_json))
        .tg(&s, tg::CLIENT_ID, Term::literal(client_id))
        .add(
            &s,
            prov::STARTED_AT_TIME,
            Term::typed_literal(started_at, XSD_DATETIME.as_str()),
        )
        .tg(&s, tg::STEP, integer(n))
        .derived(&s, after);
    for (goal, session) in goals {
        b.tg(&s, tg::SUBAGENT_GOAL, Term::literal(goal)).tg(
            &s,
            tg::SUBAGENT_SESSION,
            Term::iri(SessionUris::new(session).session()),
        );
    }
    let integer64 = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    b.tg(&s, tg::LLM_DURATION_MS, integer64(stats.duration_ms))
        .tg(&s, tg::IN_TOKEN, integer64(stats.in_token))
        .tg(&s, tg::OUT_TOKEN, integer64(stats.out_token))
        .tg(&s, tg::DIALOG_IN_TOKEN, integer64(dialog.in_token))
        .tg(&s, tg::DIALOG_OUT_TOKEN, integer64(dialog.out_token))
        .tg(&s, tg::DIALOG_STARTED_MS, integer64(dialog.started_ms));
    b.build()
}

/// What a fan-out's waiting subagents need: `tg:needs` from each waiting subagent's session to
/// the sessions whose results it starts with. `needs`: subagent session, and the sessions it needs.
pub fn subagent_needs(needs: &[(String, Vec<String>)]) -> Vec<Triple> {
    let mut b = NodeBuilder::default();
    for (session, prerequisites) in needs {
        let s = SessionUris::new(session).session();
        for prerequisite in prerequisites {
            b.tg(
                &s,
                tg::NEEDS,
                Term::iri(SessionUris::new(prerequisite).session()),
            );
        }
    }
    b.build()
}

/// Where a dialog stands when it fans out: its tokens so far (this iteration's included) and when
/// it started, which the synthesis request carries on with the subagents' tokens added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DialogSoFar {
    pub in_token: u64,
    pub out_token: u64,
    pub started_ms: u64,
}

/// A subagent's end, for its supervisor's fan-in: which fan-out, which goal, whether it answered
/// or failed, and the result. Derived from the subagent's conclusion.
pub fn completion(
    uris: &SessionUris,
    correlation_id: &str,
    parent_session: &str,
    goal: &str,
    status: &str,
    result: &str,
    tokens: (u64, u64),
) -> Vec<Triple> {
    let s = uris.completion();
    let integer64 = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let doc = format!("{s}/result");
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::SUBAGENT_COMPLETION])
        .label(&s, &format!("Completion ({status}): {goal}"))
        .tg(&s, tg::CORRELATION_ID, Term::literal(correlation_id))
        .tg(
            &s,
            tg::PARENT_SESSION,
            Term::iri(SessionUris::new(parent_session).session()),
        )
        .tg(&s, tg::GOAL, Term::literal(goal))
        .tg(&s, tg::COMPLETION_STATUS, Term::literal(status))
        .derived(&s, &uris.conclusion())
        .tg(&s, tg::DIALOG_IN_TOKEN, integer64(tokens.0))
        .tg(&s, tg::DIALOG_OUT_TOKEN, integer64(tokens.1))
        .document(&s, &doc, result);
    b.build()
}

/// An ensemble's reconciliation, on its synthesis node: `tg:Reconciliation`, each point the agents
/// agreed on (`tg:agreement`) and disagreed on (`tg:disagreement`), and whether the reconciler's
/// reply could be read as such (`tg:reconciliationRead`; when not, nothing is claimed about
/// agreement).
pub fn reconciliation(
    uris: &SessionUris,
    correlation_id: &str,
    reconciliation: &crate::ensemble::Reconciliation,
) -> Vec<Triple> {
    let s = uris.synthesis(correlation_id);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::RECONCILIATION]).tg(
        &s,
        tg::RECONCILIATION_READ,
        Term::typed_literal(reconciliation.read.to_string(), XSD_BOOLEAN.as_str()),
    );
    for point in &reconciliation.agreed {
        b.tg(&s, tg::AGREEMENT, Term::literal(point));
    }
    for point in &reconciliation.disagreed {
        b.tg(&s, tg::DISAGREEMENT, Term::literal(point));
    }
    b.build()
}

/// A supervisor's critic on one subagent's result: `{S}/fanout/{cid}/evaluation/{index}`
/// (`tg:Evaluation`), derived from the subagent's completion, with its status, what it found and the
/// lesson.
pub fn subagent_evaluation(
    uris: &SessionUris,
    correlation_id: &str,
    index: usize,
    completion: &str,
    verdict: &crate::critic::Evaluation,
    stats: &CallStats,
) -> Vec<Triple> {
    let s = subagent_evaluation_node(uris, correlation_id, index);
    let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER.as_str());
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::EVALUATION])
        .label(
            &s,
            &format!(
                "Evaluation of subagent {index}: {}",
                verdict.status.as_str()
            ),
        )
        .tg(&s, tg::EVALUATES, Term::iri(completion))
        .tg(&s, tg::STEP_INDEX, integer(index as u64))
        .tg(
            &s,
            tg::EVALUATION_STATUS,
            Term::literal(verdict.status.as_str()),
        )
        .tg(&s, tg::LLM_DURATION_MS, integer(stats.duration_ms))
        .tg(&s, tg::IN_TOKEN, integer(stats.in_token))
        .tg(&s, tg::OUT_TOKEN, integer(stats.out_token))
        .derived(&s, completion);
    if !verdict.evaluation.is_empty() {
        b.tg(&s, tg::EVALUATION_TEXT, Term::literal(&verdict.evaluation));
    }
    if !verdict.lesson.is_empty() {
        b.tg(&s, tg::LESSON, Term::literal(&verdict.lesson));
    }
    // An unreadable verdict lets the result stand unchecked: said, not hidden.
    if let Some(why) = &verdict.unreadable {
        b.tg(&s, tg::UNREADABLE_REASON, Term::literal(why));
    }
    b.build()
}

/// The node of [`subagent_evaluation`].
pub fn subagent_evaluation_node(uris: &SessionUris, correlation_id: &str, index: usize) -> String {
    format!("{}/evaluation/{index}", uris.fanout(correlation_id))
}

/// The supervisor's synthesis of a fan-out: derived from the fan-out and from the completions it
/// was given. A partial one (the fan-out timed out) says so and names the subagent sessions whose
/// results never came; a completion that arrives later does not derive it.
pub fn synthesis(
    uris: &SessionUris,
    correlation_id: &str,
    completions: &[String],
    missing: &[String],
    stats: &CallStats,
) -> Vec<Triple> {
    let s = uris.synthesis(correlation_id);
    let mut b = NodeBuilder::default();
    b.types(&s, &[tg::SYNTHESIS])
        .label(&s, "Synthesis")
        .tg(&s, tg::CORRELATION_ID, Term::literal(correlation_id))
        .derived(&s, &uris.fanout(correlation_id));
    for c in completions {
        b.derived(&s, c);
    }
    if !missing.is_empty() {
        b.tg(
            &s,
            tg::PARTIAL,
            Term::typed_literal("true", "http://www.w3.org/2001/XMLSchema#boolean"),
        );
        for session in missing {
            b.tg(&s, tg::MISSING_SUBAGENT, Term::iri(session));
        }
    }
    b.cost(&s, stats);
    b.build()
}

/// Renders a triple list as N-Triples-like lines for people (the CLI's provenance view).
pub fn describe(triples: &[Triple]) -> Vec<String> {
    fn term(t: &Term) -> String {
        match t.kind.as_str() {
            "i" => shorten(&t.iri),
            "l" => {
                let mut v = t.value.replace('\n', "\\n");
                if v.chars().count() > 80 {
                    v = v.chars().take(77).collect::<String>() + "...";
                }
                format!("{v:?}")
            }
            "b" => format!("_:{}", t.id),
            _ => "<<triple>>".to_owned(),
        }
    }
    fn shorten(iri: &str) -> String {
        if iri == RDF_TYPE {
            return "a".to_owned();
        }
        if iri == RDFS_LABEL {
            return "rdfs:label".to_owned();
        }
        for (prefix, short) in [(crate::vocab::TG, "tg:"), (crate::vocab::PROV, "prov:")] {
            if let Some(rest) = iri.strip_prefix(prefix) {
                return format!("{short}{rest}");
            }
        }
        format!("<{iri}>")
    }
    triples
        .iter()
        .map(|t| format!("{} {} {}", term(&t.s), term(&t.p), term(&t.o)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_follow_trustgraph() {
        let u = SessionUris::new("abc");
        assert_eq!(u.iteration(2), "urn:trustgraph:agent:abc/i2");
        assert_eq!(u.thought(2), "urn:trustgraph:agent:abc/i2/thought");
        assert_eq!(u.previous(0), "urn:trustgraph:agent:abc/pattern-decision");
        assert_eq!(u.previous(1), "urn:trustgraph:agent:abc/i1/observation");
    }

    #[test]
    fn an_llm_answer_too_long_to_keep_only_has_its_size_recorded() {
        let uris = SessionUris::new("abc");
        let predicates = |completion: &str| -> Vec<String> {
            llm_call(
                &uris,
                (1, 0),
                "d1",
                completion,
                "urn:trustgraph:agent:abc",
                None,
            )
            .into_iter()
            .map(|t| t.p.iri)
            .collect()
        };
        assert!(predicates("short").contains(&tg::COMPLETION.as_str().to_owned()));
        let long = "x".repeat(MAX_RECORDED_COMPLETION_BYTES + 1);
        let kept = predicates(&long);
        assert!(!kept.contains(&tg::COMPLETION.as_str().to_owned()));
        assert!(kept.contains(&tg::COMPLETION_BYTES.as_str().to_owned()));
    }

    #[test]
    fn iteration_derives_from_the_previous_observation_and_keeps_user_text_literal() {
        let u = SessionUris::new("s");
        let triples = tool_iteration(
            &u,
            2,
            "\"> DROP",
            "llm",
            "{}",
            &["llm"],
            &CallStats::default(),
        );
        assert!(triples.iter().any(|t| t.p.iri.ends_with("wasDerivedFrom")
            && t.s.iri == u.iteration(2)
            && t.o.iri == u.observation(1)));
        let content = triples
            .iter()
            .find(|t| t.p.iri == tg::CONTENT.as_str())
            .unwrap();
        assert_eq!(content.o.kind, "l");
        assert_eq!(content.o.value, "\"> DROP");
        assert!(triples.iter().all(|t| t.g.as_deref() == Some(GRAPH)));
    }

    #[test]
    fn a_long_text_is_a_document_of_its_own_named_by_its_digest() {
        let u = SessionUris::new("s");
        let long = "word ".repeat(2000);
        let node = |text: &str| observation(&u, 1, text, ToolStats::default());
        let triples = node(&long);
        let doc = crate::documents::document_uri(&long);
        let pointer: Vec<_> = triples
            .iter()
            .filter(|t| t.p.iri == tg::DOCUMENT.as_str())
            .collect();
        assert_eq!(pointer.len(), 1);
        assert_eq!(
            (pointer[0].s.iri.as_str(), pointer[0].o.iri.as_str()),
            (u.observation(1).as_str(), doc.as_str())
        );
        let content: Vec<_> = triples
            .iter()
            .filter(|t| t.p.iri == tg::CONTENT.as_str())
            .collect();
        assert_eq!(content.len(), 1, "the text once, on the document");
        assert_eq!(content[0].s.iri, doc);
        assert_eq!(content[0].o.value, long);
        assert_eq!(content[0].g.as_deref(), Some(DOCUMENTS_GRAPH));
        // The same text elsewhere (another node, a redelivery) names the same document.
        assert_eq!(node(&long), triples);
        let short = node("short");
        assert!(short
            .iter()
            .any(|t| t.s.iri == u.observation(1) && t.p.iri == tg::CONTENT.as_str()));
        assert!(short.iter().all(|t| t.g.as_deref() == Some(GRAPH)));
    }

    #[test]
    fn describe_shortens_known_prefixes() {
        let lines = describe(&session(
            &SessionUris::new("s"),
            "Q",
            "2026-01-01T00:00:00Z",
            "",
        ));
        assert!(lines.contains(&"<urn:trustgraph:agent:s> a tg:Question".to_owned()));
        assert!(lines.contains(&"<urn:trustgraph:agent:s> tg:query \"Q\"".to_owned()));
    }
}
