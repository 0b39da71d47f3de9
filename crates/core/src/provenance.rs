//! Provenance triples in TrustGraph's vocabulary (PROV-O plus `tg:`), built from typed terms.
//!
//! The URIs are deterministic functions of the session id and the iteration number, so a replayed
//! iteration names the same nodes; the texts (thoughts, observations, answers) are stored on the
//! nodes as literals so the graph alone explains a run.

use agent_schema::{Term, Triple};

use crate::router::{Choice, Decision, Method};

pub const TG: &str = "https://trustgraph.ai/ns/";
pub const PROV: &str = "http://www.w3.org/ns/prov#";
pub const RDF_TYPE: &str = "http://www.w3.org/1999/02/22-rdf-syntax-ns#type";
pub const RDFS_LABEL: &str = "http://www.w3.org/2000/01/rdf-schema#label";
pub const XSD_INTEGER: &str = "http://www.w3.org/2001/XMLSchema#integer";
pub const XSD_DECIMAL: &str = "http://www.w3.org/2001/XMLSchema#decimal";
pub const XSD_BOOLEAN: &str = "http://www.w3.org/2001/XMLSchema#boolean";
pub const XSD_DATETIME: &str = "http://www.w3.org/2001/XMLSchema#dateTime";
/// The named graph that holds provenance.
pub const GRAPH: &str = "urn:graph:retrieval";

/// Node URIs of one session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionUris {
    base: String,
}

impl SessionUris {
    pub fn new(session_id: &str) -> SessionUris {
        SessionUris {
            base: format!("urn:trustgraph:agent:{session_id}"),
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
    pub fn pattern_decision(&self) -> String {
        format!("{}/pattern-decision", self.base)
    }
    pub fn conclusion(&self) -> String {
        format!("{}/final", self.base)
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
    fn add(&mut self, s: &str, p: &str, o: Term) -> &mut Self {
        self.triples.push(Triple {
            s: Term::iri(s),
            p: Term::iri(p),
            o,
            g: Some(GRAPH.to_owned()),
        });
        self
    }
    fn types(&mut self, s: &str, types: &[&str]) -> &mut Self {
        self.add(s, RDF_TYPE, Term::iri(format!("{PROV}Entity")));
        for t in types {
            self.add(s, RDF_TYPE, Term::iri(format!("{TG}{t}")));
        }
        self
    }
    fn tg(&mut self, s: &str, p: &str, o: Term) -> &mut Self {
        self.add(s, &format!("{TG}{p}"), o)
    }
    fn label(&mut self, s: &str, label: &str) -> &mut Self {
        self.add(s, RDFS_LABEL, Term::literal(label))
    }
    fn derived(&mut self, s: &str, from: &str) -> &mut Self {
        self.add(s, &format!("{PROV}wasDerivedFrom"), Term::iri(from))
    }
    /// The text the node stands for, kept in the graph (TrustGraph keeps it in its librarian).
    fn document(&mut self, s: &str, doc: &str, text: &str) -> &mut Self {
        self.tg(s, "document", Term::iri(doc));
        self.tg(doc, "content", Term::literal(text))
    }
    pub fn build(self) -> Vec<Triple> {
        self.triples
    }
}

/// The session node: the question as asked.
pub fn session(uris: &SessionUris, question: &str, started_at: &str) -> Vec<Triple> {
    let s = uris.session();
    let mut b = NodeBuilder::default();
    b.types(&s, &["Question", "AgentQuestion"])
        .label(&s, "Agent Question")
        .add(
            &s,
            &format!("{PROV}startedAtTime"),
            Term::typed_literal(started_at, XSD_DATETIME),
        )
        .tg(&s, "query", Term::literal(question));
    b.build()
}

/// What an iteration's LLM call cost.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    b.types(&s, &["Analysis", "ToolUse"])
        .label(&s, &format!("Analysis: {action}"))
        .tg(&s, "action", Term::literal(action))
        .tg(&s, "arguments", Term::literal(arguments_json))
        .derived(&s, &uris.previous(n - 1))
        .tg(&s, "thought", Term::iri(&t));
    iteration_facts(&mut b, &s, n, candidates, stats);
    b.types(&t, &["Reflection", "Thought"])
        .label(&t, "Thought")
        .derived(&t, &s)
        .document(&t, &t, thought);
    b.build()
}

fn iteration_facts(b: &mut NodeBuilder, s: &str, n: usize, candidates: &[&str], stats: &CallStats) {
    b.tg(s, "step", Term::typed_literal(n.to_string(), XSD_INTEGER))
        .tg(
            s,
            "llmDurationMs",
            Term::typed_literal(stats.duration_ms.to_string(), XSD_INTEGER),
        )
        .tg(
            s,
            "inToken",
            Term::typed_literal(stats.in_token.to_string(), XSD_INTEGER),
        )
        .tg(
            s,
            "outToken",
            Term::typed_literal(stats.out_token.to_string(), XSD_INTEGER),
        );
    if !stats.model.is_empty() {
        b.tg(s, "model", Term::literal(&stats.model));
    }
    for c in candidates {
        b.tg(s, "toolCandidate", Term::literal(*c));
    }
}

/// What a tool run cost: its duration and the tokens of any LLM call it made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ToolStats {
    pub duration_ms: u64,
    pub in_token: u64,
    pub out_token: u64,
}

/// The observation of iteration `n`: what the tool returned (or the error) and what it cost, so the
/// tokens in the graph add up to the dialog's.
pub fn observation(uris: &SessionUris, n: usize, text: &str, tool: ToolStats) -> Vec<Triple> {
    let s = uris.observation(n);
    let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER);
    let mut b = NodeBuilder::default();
    b.types(&s, &["Observation"])
        .label(&s, "Observation")
        .derived(&s, &uris.iteration(n))
        .tg(&s, "toolDurationMs", integer(tool.duration_ms))
        .tg(&s, "inToken", integer(tool.in_token))
        .tg(&s, "outToken", integer(tool.out_token))
        .document(&s, &s, text);
    b.build()
}

/// How a dialog ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    Answer,
    MaxIterations,
    /// A token or wall-time budget was used up.
    Budget,
    Error,
}

impl Termination {
    pub fn as_str(self) -> &'static str {
        match self {
            Termination::Answer => "answer",
            Termination::MaxIterations => "max-iterations",
            Termination::Budget => "budget",
            Termination::Error => "error",
        }
    }
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
    let s = uris.conclusion();
    let doc = uris.answer_document();
    let mut b = NodeBuilder::default();
    b.types(&s, &["Conclusion", "Answer"])
        .label(&s, "Conclusion")
        .derived(&s, &uris.previous(n - 1))
        .tg(&s, "terminationReason", Term::literal(termination.as_str()))
        .document(&s, &doc, answer);
    if !thought.is_empty() {
        let t = uris.thought(n);
        b.tg(&s, "thought", Term::iri(&t));
        b.types(&t, &["Reflection", "Thought"])
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
    b.types(&s, &["PatternDecision"])
        .label(&s, &format!("Pattern: {}", decision.pattern.selected))
        .derived(&s, &uris.session())
        .tg(&s, "pattern", Term::literal(&decision.pattern.selected));
    if !decision.task_type.selected.is_empty() {
        b.tg(&s, "taskType", Term::literal(&decision.task_type.selected));
    }
    // A request that named its pattern but no task type has no task type facts.
    if !decision.task_type.selected.is_empty() {
        choice_facts(&mut b, &s, "taskType", &decision.task_type);
    }
    choice_facts(&mut b, &s, "pattern", &decision.pattern);
    for name in &decision.unavailable_patterns {
        b.tg(&s, "patternUnavailable", Term::literal(name));
    }
    let rationale: Vec<&str> = [&decision.task_type, &decision.pattern]
        .iter()
        .map(|c| c.rationale.as_str())
        .filter(|r| !r.is_empty())
        .collect();
    if !rationale.is_empty() {
        b.tg(&s, "rationale", Term::literal(rationale.join(" ")));
    }
    let fallback = matches!(decision.task_type.method, Method::Fallback(_))
        || matches!(decision.pattern.method, Method::Fallback(_));
    b.tg(
        &s,
        "fallback",
        Term::typed_literal(fallback.to_string(), XSD_BOOLEAN),
    );
    if !decision.framing.is_empty() {
        b.tg(&s, "framing", Term::literal(&decision.framing));
    }
    let integer = |v: u64| Term::typed_literal(v.to_string(), XSD_INTEGER);
    b.tg(&s, "llmDurationMs", integer(stats.duration_ms))
        .tg(&s, "inToken", integer(stats.in_token))
        .tg(&s, "outToken", integer(stats.out_token));
    if !stats.model.is_empty() {
        b.tg(&s, "model", Term::literal(&stats.model));
    }
    b.build()
}

/// The facts of one choice, under predicates named after what was chosen (`taskType...`,
/// `pattern...`).
fn choice_facts(b: &mut NodeBuilder, s: &str, what: &str, choice: &Choice) {
    for c in &choice.candidates {
        b.tg(s, &format!("{what}Candidate"), Term::literal(c));
    }
    b.tg(
        s,
        &format!("{what}Method"),
        Term::literal(choice.method.as_str()),
    );
    if !choice.rationale.is_empty() {
        b.tg(
            s,
            &format!("{what}Rationale"),
            Term::literal(&choice.rationale),
        );
    }
    if let Method::Fallback(reason) = &choice.method {
        b.tg(s, &format!("{what}FallbackReason"), Term::literal(reason));
    }
    if let Some(raw) = &choice.raw_answer {
        b.tg(s, &format!("{what}Answer"), Term::literal(raw));
    }
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
        for (prefix, short) in [(TG, "tg:"), (PROV, "prov:")] {
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
            .find(|t| t.p.iri == format!("{TG}content"))
            .unwrap();
        assert_eq!(content.o.kind, "l");
        assert_eq!(content.o.value, "\"> DROP");
        assert!(triples.iter().all(|t| t.g.as_deref() == Some(GRAPH)));
    }

    #[test]
    fn describe_shortens_known_prefixes() {
        let lines = describe(&session(
            &SessionUris::new("s"),
            "Q",
            "2026-01-01T00:00:00Z",
        ));
        assert!(lines.contains(&"<urn:trustgraph:agent:s> a tg:Question".to_owned()));
        assert!(lines.contains(&"<urn:trustgraph:agent:s> tg:query \"Q\"".to_owned()));
    }
}
