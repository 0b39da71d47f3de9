//! A session's provenance as a tree people can read: question, the pattern decision, each
//! iteration's thought, action, arguments and observation, a supervisor's fan-outs with each
//! subagent's own session, completion and the synthesis, the conclusion, tokens and durations; and
//! the same DAG as JSON, Graphviz DOT or Mermaid.

use std::collections::{BTreeMap, BTreeSet};

use oxigraph::model::Term;
use serde::Serialize;

use crate::Rows;
use agent_core::vocab::{prov, tg, NamedNodeRef, RDF_TYPE};

/// One session, read back from the graph.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SessionView {
    pub session: String,
    pub question: String,
    pub started_at: String,
    pub decision: Option<DecisionView>,
    pub iterations: Vec<IterationView>,
    pub conclusion: Option<ConclusionView>,
    /// A supervisor's fan-outs, in step order, each with its subagents' sessions.
    pub fanouts: Vec<FanOutView>,
    /// The LLM-as-router's one choice, when it ran.
    pub dispatch: Option<DispatchView>,
    /// Where this session was forked from, when it is a fork.
    pub forked_from: Option<ForkOrigin>,
    /// Forks of this session (`agentctl fork`), each a session of its own, by the step they start at.
    pub forks: Vec<ForkView>,
    /// Derivation edges (node, derived from), for the graph formats; on the root view only, and
    /// covering the subagents' nodes too.
    pub edges: Vec<(String, String)>,
    pub in_token: u64,
    pub out_token: u64,
}

/// The meta-router's decision (or the pattern the request named).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DecisionView {
    pub node: String,
    pub task_type: String,
    pub task_type_candidates: Vec<String>,
    pub task_type_method: String,
    pub pattern: String,
    pub pattern_candidates: Vec<String>,
    pub pattern_unavailable: Vec<String>,
    pub pattern_method: String,
    pub rationale: String,
    /// Why a fallback was taken, for the task type and the pattern.
    pub fallback_reasons: Vec<String>,
    pub framing: String,
    pub in_token: u64,
    pub out_token: u64,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct IterationView {
    pub node: String,
    pub step: u64,
    pub thought: String,
    pub action: String,
    pub arguments: String,
    pub candidates: Vec<String>,
    pub observation: String,
    pub model: String,
    pub llm_ms: u64,
    pub tool_ms: u64,
    pub in_token: u64,
    pub out_token: u64,
}

/// One fan-out of a supervisor.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FanOutView {
    pub node: String,
    pub step: u64,
    pub correlation_id: String,
    pub expected: u64,
    pub subagents: Vec<SubagentView>,
    /// The synthesis node that answered it (or asked for another round), once there is one.
    pub synthesis: String,
    /// The subagent sessions whose results the synthesis was made without (it timed out before
    /// they came): a partial synthesis.
    pub missing: Vec<String>,
    /// Why it is never to be synthesised, when the aggregator refused it.
    pub refused: String,
    /// An ensemble's reconciliation: the points its agents agreed and disagreed on.
    pub agreed: Vec<String>,
    pub disagreed: Vec<String>,
    pub in_token: u64,
    pub out_token: u64,
}

/// The LLM-as-router's choice: what it handed the request to, among what, how and why.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DispatchView {
    pub node: String,
    pub selected: String,
    pub candidates: Vec<String>,
    pub method: String,
    pub rationale: String,
    pub fallback_reason: String,
    pub arguments: String,
    pub in_token: u64,
    pub out_token: u64,
}

/// Where a fork came from: the source session, the step it started at, what its input changed
/// there, and what it reused of the source's record.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ForkOrigin {
    pub session: String,
    pub step: u64,
    pub edits: Vec<String>,
    pub reuses: String,
    /// The observation its first step followed (node, text), when it started past step 1.
    pub observation: Option<(String, String)>,
}

/// A fork of a session, as its source's view shows it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ForkView {
    pub step: u64,
    pub run: SessionView,
}

/// One subagent of a fan-out: its completion, and its run as a session of its own.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SubagentView {
    /// `answer`, `error`, or empty while it has not completed.
    pub status: String,
    pub result: String,
    /// The subagents (by index) whose results it waited for.
    pub needs: Vec<usize>,
    /// The supervisor's critic on its result (`STATUS: lesson`), when it judged it.
    pub verdict: String,
    pub run: SessionView,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ConclusionView {
    pub node: String,
    pub step: u64,
    pub thought: String,
    pub answer: String,
    pub termination: String,
    pub llm_ms: u64,
    pub in_token: u64,
    pub out_token: u64,
}

/// Subject -> predicate -> objects, and, for `prov:wasDerivedFrom`, source -> what derives from
/// it (each view asks that of every node: read off the whole index each time, a run of a few
/// thousand nodes took seconds).
struct Index(
    BTreeMap<String, BTreeMap<String, Vec<Term>>>,
    BTreeMap<String, Vec<String>>,
);

fn text(t: &Term) -> String {
    match t {
        Term::NamedNode(n) => n.as_str().to_owned(),
        Term::BlankNode(b) => b.as_str().to_owned(),
        Term::Literal(l) => l.value().to_owned(),
        #[allow(unreachable_patterns)]
        _ => t.to_string(),
    }
}

impl Index {
    fn from_rows(rows: &Rows) -> Index {
        let mut map: BTreeMap<String, BTreeMap<String, Vec<Term>>> = BTreeMap::new();
        let (s, p, o) = (rows.column("s"), rows.column("p"), rows.column("o"));
        for i in 0..rows.rows.len() {
            if let (Some(Some(s)), Some(Some(p)), Some(Some(o))) = (s.get(i), p.get(i), o.get(i)) {
                map.entry(text(s))
                    .or_default()
                    .entry(text(p))
                    .or_default()
                    .push((*o).clone());
            }
        }
        let derived = prov::WAS_DERIVED_FROM.as_str();
        let mut sources: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (subject, predicates) in &map {
            for source in predicates.get(derived).into_iter().flatten() {
                let derivations = sources.entry(text(source)).or_default();
                if derivations.last() != Some(subject) {
                    derivations.push(subject.clone());
                }
            }
        }
        Index(map, sources)
    }

    fn all(&self, node: &str, predicate: NamedNodeRef<'_>) -> Vec<String> {
        self.0
            .get(node)
            .and_then(|m| m.get(predicate.as_str()))
            .map(|v| v.iter().map(text).collect())
            .unwrap_or_default()
    }

    fn one(&self, node: &str, predicate: NamedNodeRef<'_>) -> String {
        self.all(node, predicate)
            .into_iter()
            .next()
            .unwrap_or_default()
    }

    fn number(&self, node: &str, predicate: NamedNodeRef<'_>) -> u64 {
        self.one(node, predicate).parse().unwrap_or(0)
    }

    fn has_type(&self, node: &str, class: NamedNodeRef<'_>) -> bool {
        self.all(node, RDF_TYPE).iter().any(|t| t == class.as_str())
    }

    /// The text a node stands for, through its `tg:document`.
    fn document_text(&self, node: &str) -> String {
        let doc = self.one(node, tg::DOCUMENT);
        self.one(&doc, tg::CONTENT)
    }

    /// The nodes derived from `source`, in the order of their names.
    fn derived_from(&self, source: &str) -> Vec<String> {
        self.1.get(source).cloned().unwrap_or_default()
    }
}

/// Builds the view of `session` from the rows of [`crate::queries::session_triples`].
pub fn session_view(session: &str, rows: &Rows) -> SessionView {
    let index = Index::from_rows(rows);
    // The rows hold every session the root's run reaches (a supervisor's subagents derive from its
    // fan-outs); each node belongs to the session whose URI is its longest prefix.
    let mut sessions: Vec<String> = index
        .0
        .keys()
        .filter(|n| index.has_type(n, tg::AGENT_QUESTION))
        .cloned()
        .collect();
    if !sessions.iter().any(|s| s == session) {
        sessions.push(session.to_owned());
    }
    let mut view = view_of(&index, session, &sessions, 0, &BTreeSet::new());
    let derived = prov::WAS_DERIVED_FROM.as_str();
    for (node, preds) in &index.0 {
        for source in preds.get(derived).into_iter().flatten() {
            view.edges.push((node.clone(), text(source)));
        }
    }
    view.edges.sort();
    view
}

/// The session among `sessions` that `node` belongs to.
fn owner<'a>(node: &str, sessions: &'a [String]) -> Option<&'a str> {
    sessions
        .iter()
        .filter(|s| {
            node.strip_prefix(s.as_str())
                .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
        })
        .max_by_key(|s| s.len())
        .map(String::as_str)
}

/// Fan-outs nest at most this deep in a view, whatever the graph says (it could hold a cycle).
const MAX_VIEW_DEPTH: usize = 8;

/// The view of `session`, `depth` fan-outs (or forks) below the root, whose sessions above it are
/// `above`: a session the graph names again below itself (a cycle, which only a forged record
/// makes) is shown without what is under it. Bounded by depth alone, a few sessions whose
/// fan-outs each named all of them made billions of views.
fn view_of(
    index: &Index,
    session: &str,
    sessions: &[String],
    depth: usize,
    above: &BTreeSet<String>,
) -> SessionView {
    let mut path = above.clone();
    path.insert(session.to_owned());
    let above = &path;
    let mut view = SessionView {
        session: session.to_owned(),
        question: index.one(session, tg::QUERY),
        started_at: index.one(session, prov::STARTED_AT_TIME),
        ..SessionView::default()
    };
    let nodes = index
        .0
        .keys()
        .filter(|n| owner(n, sessions) == Some(session));
    for node in nodes {
        if index.has_type(node, tg::FAN_OUT) && depth < MAX_VIEW_DEPTH {
            let fanout = fanout_view(index, node, sessions, depth, above);
            view.in_token = view.in_token.saturating_add(fanout.in_token);
            view.out_token = view.out_token.saturating_add(fanout.out_token);
            view.fanouts.push(fanout);
        } else if index.has_type(node, tg::ANALYSIS) {
            let thought_node = index.one(node, tg::THOUGHT_LINK);
            let observation = index
                .derived_from(node)
                .into_iter()
                .find(|n| index.has_type(n, tg::OBSERVATION))
                .unwrap_or_default();
            let iteration = IterationView {
                node: node.clone(),
                step: index.number(node, tg::STEP),
                thought: index.document_text(&thought_node),
                action: index.one(node, tg::ACTION),
                arguments: index.one(node, tg::ARGUMENTS),
                candidates: index.all(node, tg::TOOL_CANDIDATE),
                observation: index.document_text(&observation),
                model: index.one(node, tg::MODEL),
                llm_ms: index.number(node, tg::LLM_DURATION_MS),
                tool_ms: index.number(&observation, tg::TOOL_DURATION_MS),
                in_token: index
                    .number(node, tg::IN_TOKEN)
                    .saturating_add(index.number(&observation, tg::IN_TOKEN)),
                out_token: index
                    .number(node, tg::OUT_TOKEN)
                    .saturating_add(index.number(&observation, tg::OUT_TOKEN)),
            };
            view.in_token = view.in_token.saturating_add(iteration.in_token);
            view.out_token = view.out_token.saturating_add(iteration.out_token);
            view.iterations.push(iteration);
        } else if index.has_type(node, tg::PATTERN_DECISION) {
            let sorted = |p: NamedNodeRef<'_>| {
                let mut v = index.all(node, p);
                v.sort();
                v
            };
            let decision = DecisionView {
                node: node.clone(),
                task_type: index.one(node, tg::TASK_TYPE),
                task_type_candidates: sorted(tg::TASK_TYPE_CANDIDATE),
                task_type_method: index.one(node, tg::TASK_TYPE_METHOD),
                pattern: index.one(node, tg::PATTERN),
                pattern_candidates: sorted(tg::PATTERN_CANDIDATE),
                pattern_unavailable: sorted(tg::PATTERN_UNAVAILABLE),
                pattern_method: index.one(node, tg::PATTERN_METHOD),
                rationale: index.one(node, tg::RATIONALE),
                fallback_reasons: [tg::TASK_TYPE_FALLBACK_REASON, tg::PATTERN_FALLBACK_REASON]
                    .into_iter()
                    .map(|p| index.one(node, p))
                    .filter(|r| !r.is_empty())
                    .collect(),
                framing: index.one(node, tg::FRAMING),
                in_token: index.number(node, tg::IN_TOKEN),
                out_token: index.number(node, tg::OUT_TOKEN),
            };
            view.in_token = view.in_token.saturating_add(decision.in_token);
            view.out_token = view.out_token.saturating_add(decision.out_token);
            view.decision = Some(decision);
        } else if index.has_type(node, tg::DISPATCH_DECISION) {
            let mut candidates = index.all(node, tg::DISPATCH_CANDIDATE);
            candidates.sort();
            let dispatch = DispatchView {
                node: node.clone(),
                selected: index.one(node, tg::DISPATCH),
                candidates,
                method: index.one(node, tg::DISPATCH_METHOD),
                rationale: index.one(node, tg::DISPATCH_RATIONALE),
                fallback_reason: index.one(node, tg::DISPATCH_FALLBACK_REASON),
                arguments: index.one(node, tg::ARGUMENTS),
                in_token: index.number(node, tg::IN_TOKEN),
                out_token: index.number(node, tg::OUT_TOKEN),
            };
            view.in_token = view.in_token.saturating_add(dispatch.in_token);
            view.out_token = view.out_token.saturating_add(dispatch.out_token);
            view.dispatch = Some(dispatch);
        } else if index.has_type(node, tg::CONCLUSION) {
            let conclusion = ConclusionView {
                node: node.clone(),
                step: index.number(node, tg::STEP),
                thought: index.document_text(&index.one(node, tg::THOUGHT_LINK)),
                answer: index.document_text(node),
                termination: index.one(node, tg::TERMINATION_REASON),
                llm_ms: index.number(node, tg::LLM_DURATION_MS),
                in_token: index.number(node, tg::IN_TOKEN),
                out_token: index.number(node, tg::OUT_TOKEN),
            };
            view.in_token = view.in_token.saturating_add(conclusion.in_token);
            view.out_token = view.out_token.saturating_add(conclusion.out_token);
            view.conclusion = Some(conclusion);
        }
    }
    let source = index.one(session, tg::FORKED_FROM);
    if !source.is_empty() {
        let step = index.number(session, tg::FORKED_AT_STEP);
        let mut edits = index.all(session, tg::FORK_EDIT);
        edits.sort();
        let observation = index
            .derived_from(session)
            .into_iter()
            .find(|n| index.has_type(n, tg::OBSERVATION))
            .map(|n| {
                let text = index.document_text(&n);
                (n, text)
            });
        view.forked_from = Some(ForkOrigin {
            session: source,
            step,
            edits,
            reuses: index.one(session, tg::REUSES),
            observation,
        });
    }
    if depth < MAX_VIEW_DEPTH {
        for fork in sessions {
            if !above.contains(fork) && index.one(fork, tg::FORKED_FROM) == session {
                view.forks.push(ForkView {
                    step: index.number(fork, tg::FORKED_AT_STEP),
                    run: view_of(index, fork, sessions, depth + 1, above),
                });
            }
        }
    }
    view.forks
        .sort_by(|a, b| (a.step, &a.run.started_at).cmp(&(b.step, &b.run.started_at)));
    view.iterations.sort_by_key(|i| i.step);
    view.fanouts.sort_by_key(|f| f.step);
    // A graph is a set: candidates come back in store order, so give them a stable one.
    for it in &mut view.iterations {
        it.candidates.sort();
    }
    view
}

fn fanout_view(
    index: &Index,
    node: &str,
    sessions: &[String],
    depth: usize,
    above: &BTreeSet<String>,
) -> FanOutView {
    let mut subagent_sessions = index.all(node, tg::SUBAGENT_SESSION);
    // In the order the supervisor listed them: `...-s{i}`.
    subagent_sessions.sort_by_key(|s| {
        s.rsplit_once("-s")
            .and_then(|(_, i)| i.parse::<usize>().ok())
            .unwrap_or(usize::MAX)
    });
    let index_of = |session: &str| {
        session
            .rsplit_once("-s")
            .and_then(|(_, i)| i.parse::<usize>().ok())
    };
    let (mut critic_in, mut critic_out) = (0u64, 0u64);
    let subagents = subagent_sessions
        .iter()
        .map(|sub| {
            let completion = format!("{sub}/completion");
            let mut run = if above.contains(sub) {
                SessionView {
                    session: sub.clone(),
                    question: index.one(sub, tg::QUERY),
                    ..SessionView::default()
                }
            } else {
                view_of(index, sub, sessions, depth + 1, above)
            };
            if run.question.is_empty() {
                run.question = index.one(&completion, tg::GOAL);
            }
            let mut needs: Vec<usize> = index
                .all(sub, tg::NEEDS)
                .iter()
                .filter_map(|n| index_of(n))
                .collect();
            needs.sort_unstable();
            let evaluation = index_of(sub)
                .map(|i| format!("{node}/evaluation/{i}"))
                .unwrap_or_default();
            let status = index.one(&evaluation, tg::EVALUATION_STATUS);
            let lesson = index.one(&evaluation, tg::LESSON);
            critic_in = critic_in.saturating_add(index.number(&evaluation, tg::IN_TOKEN));
            critic_out = critic_out.saturating_add(index.number(&evaluation, tg::OUT_TOKEN));
            SubagentView {
                status: index.one(&completion, tg::COMPLETION_STATUS),
                result: index.document_text(&completion),
                needs,
                verdict: match (status.is_empty(), lesson.is_empty()) {
                    (true, _) => String::new(),
                    (false, true) => status,
                    (false, false) => format!("{status}: {lesson}"),
                },
                run,
            }
        })
        .collect();
    let synthesis = index
        .derived_from(node)
        .into_iter()
        .find(|n| index.has_type(n, tg::SYNTHESIS))
        .unwrap_or_default();
    let mut missing = index.all(&synthesis, tg::MISSING_SUBAGENT);
    missing.sort();
    let mut agreed = index.all(&synthesis, tg::AGREEMENT);
    let mut disagreed = index.all(&synthesis, tg::DISAGREEMENT);
    agreed.sort();
    disagreed.sort();
    FanOutView {
        node: node.to_owned(),
        step: index.number(node, tg::STEP),
        correlation_id: index.one(node, tg::CORRELATION_ID),
        expected: index.number(node, tg::EXPECTED_SIBLINGS),
        subagents,
        in_token: index
            .number(node, tg::IN_TOKEN)
            .saturating_add(index.number(&synthesis, tg::IN_TOKEN))
            .saturating_add(critic_in),
        out_token: index
            .number(node, tg::OUT_TOKEN)
            .saturating_add(index.number(&synthesis, tg::OUT_TOKEN))
            .saturating_add(critic_out),
        synthesis,
        missing,
        refused: index.one(node, tg::FAN_IN_REFUSED),
        agreed,
        disagreed,
    }
}

fn or_none(text: &str) -> &str {
    if text.is_empty() {
        "(none)"
    } else {
        text
    }
}

fn trim(text: &str, max: usize) -> String {
    let one_line = text.replace('\n', " ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        one_line.chars().take(max).collect::<String>() + "..."
    }
}

/// The session as an indented tree for a terminal, long texts cut to a line.
pub fn render_tree(view: &SessionView) -> String {
    tree(view, false)
}

/// The session as an indented tree with every text whole (documents resolved): what a run's
/// auditor reads.
pub fn render_tree_full(view: &SessionView) -> String {
    tree(view, true)
}

fn tree(view: &SessionView, full: bool) -> String {
    let trim = |text: &str, max: usize| {
        if full {
            text.to_owned()
        } else {
            trim(text, max)
        }
    };
    let mut out = format!("{}\n", view.session);
    out.push_str(&format!("├─ question: {}\n", trim(&view.question, 200)));
    out.push_str(&format!("├─ started:  {}\n", view.started_at));
    if let Some(origin) = &view.forked_from {
        out.push_str(&format!(
            "├─ forked from: {} at step {} (changed: {}{})\n",
            origin.session,
            origin.step,
            or_none(&origin.edits.join(", ")),
            if origin.reuses.is_empty() {
                String::new()
            } else {
                format!("; reuses recorded {}", origin.reuses)
            }
        ));
        if let Some((_, text)) = &origin.observation {
            out.push_str(&format!(
                "│  └─ given observation {}: {}\n",
                origin.step.saturating_sub(1),
                trim(text, 200)
            ));
        }
    }
    if let Some(d) = &view.decision {
        let task_type = if d.task_type.is_empty() {
            String::new()
        } else {
            format!("task type {} ({}), ", d.task_type, d.task_type_method)
        };
        out.push_str(&format!(
            "├─ routed: {task_type}pattern {} ({}), tokens {}/{}\n",
            d.pattern, d.pattern_method, d.in_token, d.out_token
        ));
        if !d.task_type_candidates.is_empty() {
            out.push_str(&format!(
                "│  ├─ task types offered: {}\n",
                d.task_type_candidates.join(", ")
            ));
        }
        out.push_str(&format!(
            "│  ├─ patterns offered:   {}{}\n",
            or_none(&d.pattern_candidates.join(", ")),
            if d.pattern_unavailable.is_empty() {
                String::new()
            } else {
                format!(" (not run here: {})", d.pattern_unavailable.join(", "))
            }
        ));
        for reason in &d.fallback_reasons {
            out.push_str(&format!("│  ├─ fallback: {}\n", trim(reason, 200)));
        }
        if !d.framing.is_empty() {
            out.push_str(&format!("│  ├─ framing: {}\n", trim(&d.framing, 200)));
        }
        out.push_str(&format!(
            "│  └─ rationale: {}\n",
            or_none(&trim(&d.rationale, 300))
        ));
    }
    if let Some(d) = &view.dispatch {
        out.push_str(&format!(
            "├─ dispatched: {} ({}), tokens {}/{}\n",
            d.selected, d.method, d.in_token, d.out_token
        ));
        out.push_str(&format!(
            "│  ├─ offered:   {}\n",
            or_none(&d.candidates.join(", "))
        ));
        if !d.arguments.is_empty() {
            out.push_str(&format!("│  ├─ arguments: {}\n", trim(&d.arguments, 160)));
        }
        if !d.fallback_reason.is_empty() {
            out.push_str(&format!(
                "│  ├─ fallback:  {}\n",
                trim(&d.fallback_reason, 200)
            ));
        }
        out.push_str(&format!(
            "│  └─ rationale: {}\n",
            or_none(&trim(&d.rationale, 300))
        ));
    }
    for it in &view.iterations {
        out.push_str(&format!(
            "├─ iteration {} ({} ms LLM, {} ms tool, tokens {}/{}, {})\n",
            it.step, it.llm_ms, it.tool_ms, it.in_token, it.out_token, it.model
        ));
        out.push_str(&format!("│  ├─ thought:     {}\n", trim(&it.thought, 200)));
        out.push_str(&format!(
            "│  ├─ could use:   {}\n",
            it.candidates.join(", ")
        ));
        out.push_str(&format!(
            "│  ├─ action:      {} {}\n",
            it.action,
            trim(&it.arguments, 160)
        ));
        out.push_str(&format!(
            "│  └─ observation: {}\n",
            trim(&it.observation, 200)
        ));
    }
    for f in &view.fanouts {
        out.push_str(&format!(
            "├─ fan-out {} (step {}, {} subagents, tokens {}/{})\n",
            f.correlation_id, f.step, f.expected, f.in_token, f.out_token
        ));
        for (i, sub) in f.subagents.iter().enumerate() {
            let late = if f.missing.contains(&sub.run.session) {
                " (came after the synthesis: not in it)"
            } else {
                ""
            };
            let status = if sub.status.is_empty() {
                "not completed".to_owned()
            } else {
                format!("{}: {}{late}", sub.status, trim(&sub.result, 160))
            };
            let after = if sub.needs.is_empty() {
                String::new()
            } else {
                let listed: Vec<String> = sub.needs.iter().map(usize::to_string).collect();
                format!(" (after {})", listed.join(", "))
            };
            out.push_str(&format!(
                "│  ├─ subagent {i}: {}{after} -> {status}\n",
                trim(&sub.run.question, 120)
            ));
            if !sub.verdict.is_empty() {
                out.push_str(&format!("│  │  critic: {}\n", trim(&sub.verdict, 200)));
            }
            for line in tree(&sub.run, full).lines().skip(1) {
                out.push_str(&format!("│  │  {line}\n"));
            }
        }
        let synthesis = match () {
            _ if f.synthesis.is_empty() && !f.refused.is_empty() => {
                format!("refused: {}", trim(&f.refused, 200))
            }
            _ if f.synthesis.is_empty() => "(waiting for the subagents)".to_owned(),
            _ if f.missing.is_empty() => "derived from every completion".to_owned(),
            // A fan-out that timed out: the answer was made without these results.
            _ => format!(
                "partial, without {} of the subagents' results (they had not come when the fan-out timed out)",
                f.missing.len()
            ),
        };
        out.push_str(&format!("│  └─ synthesis: {synthesis}\n"));
        for (label, points) in [("agreed", &f.agreed), ("disagreed", &f.disagreed)] {
            if !points.is_empty() {
                out.push_str(&format!(
                    "│     {label}: {}\n",
                    trim(&points.join("; "), 300)
                ));
            }
        }
    }
    for fork in &view.forks {
        let ended = fork
            .run
            .conclusion
            .as_ref()
            .map_or("(no conclusion yet)".to_owned(), |c| {
                format!("{}: {}", c.termination, trim(&c.answer, 120))
            });
        out.push_str(&format!(
            "├─ fork at step {}: {} -> {ended}\n",
            fork.step, fork.run.session
        ));
        for line in tree(&fork.run, full).lines().skip(1) {
            out.push_str(&format!("│  {line}\n"));
        }
    }
    match &view.conclusion {
        Some(c) => {
            out.push_str(&format!(
                "└─ conclusion ({}; step {}, {} ms LLM, tokens {}/{})\n",
                c.termination, c.step, c.llm_ms, c.in_token, c.out_token
            ));
            if !c.thought.is_empty() {
                out.push_str(&format!("   ├─ thought: {}\n", trim(&c.thought, 200)));
            }
            out.push_str(&format!("   └─ answer:  {}\n", trim(&c.answer, 400)));
        }
        None => out.push_str("└─ (no conclusion yet)\n"),
    }
    out.push_str(&format!(
        "tokens in/out for the session: {}/{}\n",
        view.in_token, view.out_token
    ));
    out
}

/// Short labels for the graph formats.
fn labels(view: &SessionView) -> Vec<(String, String)> {
    let mut all = vec![(
        view.session.clone(),
        format!("Question: {}", trim(&view.question, 60)),
    )];
    if let Some(d) = &view.decision {
        all.push((
            d.node.clone(),
            format!("Pattern: {} ({})", d.pattern, or_none(&d.task_type)),
        ));
    }
    for it in &view.iterations {
        all.push((
            it.node.clone(),
            format!("i{}: {} {}", it.step, it.action, trim(&it.arguments, 40)),
        ));
        all.push((
            format!("{}/observation", it.node),
            format!("Observation: {}", trim(&it.observation, 50)),
        ));
    }
    if let Some(c) = &view.conclusion {
        all.push((
            c.node.clone(),
            format!("Conclusion ({}): {}", c.termination, trim(&c.answer, 60)),
        ));
    }
    if let Some(d) = &view.dispatch {
        all.push((d.node.clone(), format!("Dispatch: {}", d.selected)));
    }
    if let Some((node, text)) = view
        .forked_from
        .as_ref()
        .and_then(|o| o.observation.as_ref())
    {
        all.push((
            node.clone(),
            format!("Observation (fork): {}", trim(text, 50)),
        ));
    }
    for fork in &view.forks {
        all.extend(labels(&fork.run));
    }
    for f in &view.fanouts {
        all.push((
            f.node.clone(),
            format!("Fan-out {} to {} subagents", f.correlation_id, f.expected),
        ));
        if !f.synthesis.is_empty() {
            all.push((f.synthesis.clone(), "Synthesis".to_owned()));
        }
        for sub in &f.subagents {
            all.extend(labels(&sub.run));
            if !sub.status.is_empty() {
                all.push((
                    format!("{}/completion", sub.run.session),
                    format!("Completion ({}): {}", sub.status, trim(&sub.result, 50)),
                ));
            }
        }
    }
    all
}

/// Graphviz DOT of the derivation DAG.
pub fn render_dot(view: &SessionView) -> String {
    let mut out = String::from(
        "digraph provenance {\n  rankdir=BT;\n  node [shape=box, fontname=\"Helvetica\"];\n",
    );
    let all = labels(view);
    // Labelled once: built again for every edge, a run of a few thousand nodes took minutes.
    let known: BTreeSet<&str> = all.iter().map(|(n, _)| n.as_str()).collect();
    for (node, label) in &all {
        out.push_str(&format!("  {:?} [label={:?}];\n", node, label));
    }
    for (from, to) in &view.edges {
        if known.contains(from.as_str()) && known.contains(to.as_str()) {
            out.push_str(&format!(
                "  {:?} -> {:?} [label=\"wasDerivedFrom\"];\n",
                from, to
            ));
        }
    }
    out.push_str("}\n");
    out
}

/// Mermaid flowchart of the derivation DAG.
pub fn render_mermaid(view: &SessionView) -> String {
    let all = labels(view);
    let mut ids: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, (node, _)) in all.iter().enumerate() {
        ids.entry(node.as_str()).or_insert(i);
    }
    let id = |node: &str| ids.get(node).map(|i| format!("n{i}"));
    let mut out = String::from("flowchart BT\n");
    for (i, (_, label)) in all.iter().enumerate() {
        let safe: String = label
            .chars()
            .map(|c| match c {
                '"' => '\'',
                '[' | ']' | '{' | '}' | '<' | '>' | '|' => ' ',
                c => c,
            })
            .collect();
        out.push_str(&format!("  n{i}[\"{safe}\"]\n"));
    }
    for (from, to) in &view.edges {
        if let (Some(a), Some(b)) = (id(from), id(to)) {
            out.push_str(&format!("  {a} -->|wasDerivedFrom| {b}\n"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sessions whose fan-outs name each other (only a forged record makes such a graph) are
    /// shown once per path: bounded by depth alone, two sessions with four fan-outs naming both
    /// made (4 * 2)^8 views, and `explain` did not return.
    #[test]
    fn sessions_whose_fan_outs_name_each_other_are_shown_once_per_path() {
        let iri = |s: &str| {
            Some(Term::NamedNode(oxigraph::model::NamedNode::new_unchecked(
                s,
            )))
        };
        let (a, b) = ("urn:trustgraph:agent:a", "urn:trustgraph:agent:b");
        let mut rows = Vec::new();
        for session in [a, b] {
            rows.push(vec![
                iri(session),
                iri(RDF_TYPE.as_str()),
                iri(tg::AGENT_QUESTION.as_str()),
            ]);
            for f in 0..4 {
                let fanout = format!("{session}/fanout/{session}-f{f}");
                rows.push(vec![
                    iri(&fanout),
                    iri(RDF_TYPE.as_str()),
                    iri(tg::FAN_OUT.as_str()),
                ]);
                for sub in [a, b] {
                    rows.push(vec![
                        iri(&fanout),
                        iri(tg::SUBAGENT_SESSION.as_str()),
                        iri(sub),
                    ]);
                }
            }
        }
        let rows = Rows {
            variables: ["s", "p", "o"].map(str::to_owned).to_vec(),
            rows,
        };
        fn views(view: &SessionView) -> usize {
            1 + view
                .fanouts
                .iter()
                .flat_map(|f| &f.subagents)
                .map(|s| views(&s.run))
                .sum::<usize>()
        }
        let view = session_view(a, &rows);
        assert_eq!(view.fanouts.len(), 4);
        // a: 4 fan-outs of a (shown, not opened) and b (opened: 4 fan-outs of a and b, neither
        // opened again).
        assert_eq!(views(&view), 1 + 4 * (1 + (1 + 4 * 2)));
    }

    /// Token counts the graph gives as large as a number can be (a forged record, a broken LLM
    /// proxy's) add up to that number, not past it: an iteration's with its observation's, a
    /// fan-out's with its judge's. Before, `explain` panicked in a debug build ("attempt to add
    /// with overflow") and wrapped to a small total in a release one.
    #[test]
    fn token_counts_from_the_graph_add_up_without_overflow() {
        let iri = |s: &str| {
            Some(Term::NamedNode(oxigraph::model::NamedNode::new_unchecked(
                s,
            )))
        };
        let most = Some(Term::Literal(oxigraph::model::Literal::new_simple_literal(
            u64::MAX.to_string(),
        )));
        let session = "urn:trustgraph:agent:s";
        let (iteration, observation) =
            (format!("{session}/i1"), format!("{session}/i1/observation"));
        let fanout = format!("{session}/fanout/s-f1");
        let synthesis = format!("{fanout}/synthesis");
        let subagents = [
            "urn:trustgraph:agent:s-f1-s0",
            "urn:trustgraph:agent:s-f1-s1",
        ];
        let mut rows = vec![
            vec![
                iri(session),
                iri(RDF_TYPE.as_str()),
                iri(tg::AGENT_QUESTION.as_str()),
            ],
            vec![
                iri(&iteration),
                iri(RDF_TYPE.as_str()),
                iri(tg::ANALYSIS.as_str()),
            ],
            vec![
                iri(&observation),
                iri(RDF_TYPE.as_str()),
                iri(tg::OBSERVATION.as_str()),
            ],
            vec![
                iri(&observation),
                iri(prov::WAS_DERIVED_FROM.as_str()),
                iri(&iteration),
            ],
            vec![
                iri(&fanout),
                iri(RDF_TYPE.as_str()),
                iri(tg::FAN_OUT.as_str()),
            ],
            vec![
                iri(&synthesis),
                iri(RDF_TYPE.as_str()),
                iri(tg::SYNTHESIS.as_str()),
            ],
            vec![
                iri(&synthesis),
                iri(prov::WAS_DERIVED_FROM.as_str()),
                iri(&fanout),
            ],
        ];
        let mut counted = vec![
            iteration.clone(),
            observation.clone(),
            fanout.clone(),
            synthesis,
        ];
        for (i, sub) in subagents.iter().enumerate() {
            rows.push(vec![
                iri(&fanout),
                iri(tg::SUBAGENT_SESSION.as_str()),
                iri(sub),
            ]);
            counted.push(format!("{fanout}/evaluation/{i}"));
        }
        for node in &counted {
            for predicate in [tg::IN_TOKEN, tg::OUT_TOKEN] {
                rows.push(vec![iri(node), iri(predicate.as_str()), most.clone()]);
            }
        }
        let rows = Rows {
            variables: ["s", "p", "o"].map(str::to_owned).to_vec(),
            rows,
        };
        let view = session_view(session, &rows);
        assert_eq!(view.iterations.len(), 1);
        assert_eq!(view.iterations[0].in_token, u64::MAX);
        assert_eq!(view.iterations[0].out_token, u64::MAX);
        assert_eq!(view.fanouts.len(), 1);
        assert_eq!(view.fanouts[0].subagents.len(), 2);
        assert_eq!(view.fanouts[0].in_token, u64::MAX);
        assert_eq!(view.fanouts[0].out_token, u64::MAX);
        assert_eq!(view.in_token, u64::MAX);
    }

    fn subagent(session: &str, status: &str) -> SubagentView {
        SubagentView {
            status: status.to_owned(),
            result: format!("{session}'s result"),
            needs: Vec::new(),
            verdict: String::new(),
            run: SessionView {
                session: session.to_owned(),
                question: format!("{session}'s part"),
                ..SessionView::default()
            },
        }
    }

    #[test]
    fn a_partial_synthesis_and_a_refused_fan_out_say_so() {
        let fanout = FanOutView {
            node: "urn:f".to_owned(),
            correlation_id: "s-f1".to_owned(),
            expected: 2,
            subagents: vec![subagent("urn:a", "answer"), subagent("urn:b", "answer")],
            synthesis: "urn:synthesis".to_owned(),
            missing: vec!["urn:b".to_owned()],
            ..FanOutView::default()
        };
        let view = SessionView {
            session: "urn:s".to_owned(),
            fanouts: vec![fanout.clone()],
            ..SessionView::default()
        };
        let tree = render_tree(&view);
        assert!(!tree.contains("every completion"), "{tree}");
        assert!(
            tree.contains("partial, without 1 of the subagents' results"),
            "{tree}"
        );
        let late: Vec<&str> = tree.lines().filter(|l| l.contains("not in it")).collect();
        assert_eq!(late.len(), 1, "{tree}");
        assert!(late[0].contains("urn:b's part"), "{tree}");

        let refused = SessionView {
            fanouts: vec![FanOutView {
                synthesis: String::new(),
                missing: Vec::new(),
                refused: "timed out with no completion".to_owned(),
                ..fanout
            }],
            ..view
        };
        let tree = render_tree(&refused);
        assert!(
            tree.contains("refused: timed out with no completion"),
            "{tree}"
        );
        assert!(!tree.contains("waiting for the subagents"), "{tree}");
    }
}
