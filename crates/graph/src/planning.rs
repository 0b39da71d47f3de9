//! Whether a query is small enough for the store's optimizer, and for the store at all. Oxigraph
//! reorders a query's joins before it evaluates anything, greedily, at a cost that grows with
//! about the fourth power of the patterns joined (in a debug build 64 took 0.3 s, 100 took 1.1 s,
//! 200 took 18 s), and that step never looks at the cancellation token: an anonymous query of a
//! few thousand patterns (`?s ?p ?o OPTIONAL {...} OPTIONAL {...} ...`) kept a core busy for
//! minutes past its time limit. Unplanned, such a query joins by cartesian products whose rows
//! are as wide as its variables, in memory, checking the token only between rows read from the
//! store: two thousand patterns still ran twenty seconds past a limit of two.
//!
//! So a query of up to [`MOST_PLANNED`] operands is optimized, one of up to [`MOST_OPERANDS`]
//! runs as written, and a larger one is refused. So is one whose expressions expand past
//! [`MOST_EXPRESSION_NODES`] (see there).

use spargebra::algebra::{
    AggregateExpression, Expression, GraphPattern, OrderExpression, PropertyPathExpression,
};
use spargebra::Query;

/// The most operands (see [`operands`]) a query may have and still be optimized: enough for the
/// system's own queries and any a person writes by hand, and planned within milliseconds in a
/// release build.
pub const MOST_PLANNED: usize = 64;

/// The most operands a query may have at all on an embedded store.
pub const MOST_OPERANDS: usize = 256;

/// The most nodes a query's expressions may come to once the store has expanded them. It reads
/// `x IN (a, b, ...)` as `x = a || x = b || ...`, a copy of `x` for each element, before anything
/// is evaluated and without looking at the time limit: `IN` nested in the left of `IN` doubles
/// the tree a level, and thirty-four levels of `(... IN (1, 1))`, 400 bytes of text, come to
/// 2^34 nodes. A query's text alone (32 KiB from strangers) makes far fewer.
pub const MOST_EXPRESSION_NODES: usize = 100_000;

/// The most steps the optimizer's size estimates of a query's property paths may take, each time
/// it weighs them, for the query to be optimized; past it the query runs as written. The estimate
/// of a sequence (`<p>/<q>`) looks at each side twice, so a chain of n links takes 2^n steps, and
/// never looks at the time limit: sixty links inside `|` (a chain outside one is split into
/// patterns as it is parsed), 500 bytes, would have kept a core busy for good.
pub const MOST_PATH_ESTIMATES: usize = 4_096;

/// How a query will be evaluated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Its joins ordered by the optimizer.
    Optimized,
    /// As written: too many operands to order in time.
    AsWritten,
}

/// How `query` is to be evaluated, or why it is refused.
pub fn plan(query: &Query) -> Result<Plan, String> {
    let size = measure(query);
    if size.expression_nodes > MOST_EXPRESSION_NODES {
        return Err(format!(
            "the query's expressions come to {} nodes once IN is expanded; at most \
             {MOST_EXPRESSION_NODES} are taken here",
            size.expression_nodes
        ));
    }
    match size.operands {
        n if n <= MOST_PLANNED && size.path_estimates <= MOST_PATH_ESTIMATES => Ok(Plan::Optimized),
        n if n <= MOST_OPERANDS => Ok(Plan::AsWritten),
        n => Err(format!(
            "the query has {n} patterns and operators; at most {MOST_OPERANDS} are taken here"
        )),
    }
}

/// How an update's patterns are to be evaluated (the plan of its largest, as [`plan`] gives it),
/// and the operands of them all (for the stack its evaluation needs); or why it is refused.
pub fn plan_update(update: &spargebra::Update) -> Result<(Plan, usize), String> {
    let mut planned = (Plan::Optimized, 0usize);
    for operation in &update.operations {
        let spargebra::GraphUpdateOperation::DeleteInsert { pattern, .. } = operation else {
            continue;
        };
        let query = Query::Select {
            dataset: None,
            pattern: (**pattern).clone(),
            base_iri: None,
        };
        if plan(&query)? == Plan::AsWritten {
            planned.0 = Plan::AsWritten;
        }
        planned.1 = planned.1.saturating_add(operands(&query));
    }
    Ok(planned)
}

/// How many operands the optimizer may have to order in `query`: every node of its algebra,
/// those of the patterns its expressions hold (`EXISTS`, which the optimizer normalizes and the
/// store evaluates, a basic graph pattern there as deep a join as anywhere) included, and every
/// triple pattern (a basic graph pattern's are joined one by one), each as many times as the
/// store copies it (see [`MOST_EXPRESSION_NODES`]).
pub fn operands(query: &Query) -> usize {
    measure(query).operands
}

/// What the store makes of a query before it evaluates it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size {
    /// See [`operands`].
    pub operands: usize,
    /// The nodes of its expressions, `IN` expanded.
    pub expression_nodes: usize,
    /// The steps the optimizer's size estimates of its property paths take (see
    /// [`MOST_PATH_ESTIMATES`]).
    pub path_estimates: usize,
    /// Its `SERVICE` clauses: calls the store would make to other endpoints.
    pub services: usize,
}

/// `query`'s [`Size`]. Counted without recursion: the tree may be as deep as the text is long.
/// Each part carries how many copies of it the store makes: the left of an `IN` of n elements
/// is copied n times, and so is everything inside it, an `EXISTS`'s pattern included.
pub fn measure(query: &Query) -> Size {
    let (Query::Select { pattern, .. }
    | Query::Construct { pattern, .. }
    | Query::Describe { pattern, .. }
    | Query::Ask { pattern, .. }) = query;
    let mut size = Size {
        operands: 0,
        expression_nodes: 0,
        path_estimates: 0,
        services: 0,
    };
    let mut to_visit = vec![(Part::Pattern(pattern), 1usize)];
    while let Some((part, copies)) = to_visit.pop() {
        match part {
            Part::Pattern(pattern) => {
                size.operands = size.operands.saturating_add(copies);
                match pattern {
                    GraphPattern::Path { path, .. } => {
                        size.path_estimates = size
                            .path_estimates
                            .saturating_add(path_estimates(path).saturating_mul(copies));
                    }
                    GraphPattern::Service { .. } => size.services = size.services.saturating_add(1),
                    _ => {}
                }
                visit_pattern(pattern, copies, &mut size.operands, &mut to_visit);
            }
            Part::Expression(expression) => {
                size.expression_nodes = size.expression_nodes.saturating_add(copies);
                visit_expression(expression, copies, &mut to_visit);
            }
        }
    }
    size
}

/// The steps the optimizer's estimate of `path`'s size takes: one a node, each side of a sequence
/// weighed twice (bound and unbound in the middle), so each node counts 2^(the sequences above
/// it). Counted without recursion.
fn path_estimates(path: &PropertyPathExpression) -> usize {
    let mut steps = 0usize;
    let mut to_visit = vec![(path, 1usize)];
    while let Some((path, weight)) = to_visit.pop() {
        steps = steps.saturating_add(weight);
        match path {
            PropertyPathExpression::NamedNode(_)
            | PropertyPathExpression::NegatedPropertySet(_) => {}
            PropertyPathExpression::Sequence(a, b) => {
                let twice = weight.saturating_mul(2);
                to_visit.push((a, twice));
                to_visit.push((b, twice));
            }
            PropertyPathExpression::Alternative(a, b) => {
                to_visit.push((a, weight));
                to_visit.push((b, weight));
            }
            PropertyPathExpression::Reverse(p)
            | PropertyPathExpression::ZeroOrMore(p)
            | PropertyPathExpression::OneOrMore(p)
            | PropertyPathExpression::ZeroOrOne(p) => to_visit.push((p, weight)),
        }
    }
    steps
}

/// A part of a query's algebra still to count.
enum Part<'q> {
    Pattern(&'q GraphPattern),
    Expression(&'q Expression),
}

/// The parts still to count, each with how many copies of it the store makes.
type ToVisit<'q> = Vec<(Part<'q>, usize)>;

fn visit_pattern<'q>(
    pattern: &'q GraphPattern,
    copies: usize,
    count: &mut usize,
    to_visit: &mut ToVisit<'q>,
) {
    let pattern_part = |p: &'q GraphPattern| (Part::Pattern(p), copies);
    let expression_part = |e: &'q Expression| (Part::Expression(e), copies);
    match pattern {
        GraphPattern::Bgp { patterns } => {
            *count = count.saturating_add(patterns.len().saturating_mul(copies));
        }
        GraphPattern::Path { .. } | GraphPattern::Values { .. } => {}
        GraphPattern::Join { left, right }
        | GraphPattern::Lateral { left, right }
        | GraphPattern::Union { left, right }
        | GraphPattern::Minus { left, right } => {
            to_visit.push(pattern_part(left));
            to_visit.push(pattern_part(right));
        }
        GraphPattern::LeftJoin {
            left,
            right,
            expression,
        } => {
            to_visit.push(pattern_part(left));
            to_visit.push(pattern_part(right));
            to_visit.extend(expression.iter().map(expression_part));
        }
        GraphPattern::Filter { expr, inner } => {
            to_visit.push(pattern_part(inner));
            to_visit.push(expression_part(expr));
        }
        GraphPattern::Extend {
            inner, expression, ..
        } => {
            to_visit.push(pattern_part(inner));
            to_visit.push(expression_part(expression));
        }
        GraphPattern::OrderBy { inner, expression } => {
            // Each condition is evaluated again in every comparison of the sort.
            *count = count.saturating_add(expression.len().saturating_mul(copies));
            to_visit.push(pattern_part(inner));
            to_visit.extend(expression.iter().map(|order| match order {
                OrderExpression::Asc(e) | OrderExpression::Desc(e) => expression_part(e),
            }));
        }
        GraphPattern::Group {
            inner,
            aggregates,
            variables,
        } => {
            // Each group holds a key of its variables and an accumulator per aggregate.
            *count = count.saturating_add(
                variables
                    .len()
                    .saturating_add(aggregates.len())
                    .saturating_mul(copies),
            );
            to_visit.push(pattern_part(inner));
            to_visit.extend(
                aggregates
                    .iter()
                    .filter_map(|(_, aggregate)| match aggregate {
                        AggregateExpression::FunctionCall { expr, .. } => {
                            Some(expression_part(expr))
                        }
                        AggregateExpression::CountSolutions { .. } => None,
                    }),
            );
        }
        GraphPattern::Graph { inner, .. }
        | GraphPattern::Project { inner, .. }
        | GraphPattern::Distinct { inner }
        | GraphPattern::Reduced { inner }
        | GraphPattern::Slice { inner, .. }
        | GraphPattern::Service { inner, .. } => to_visit.push(pattern_part(inner)),
    }
}

/// Queues what `expression` holds: its operands, and the pattern of an `EXISTS`.
fn visit_expression<'q>(expression: &'q Expression, copies: usize, to_visit: &mut ToVisit<'q>) {
    let part = |e: &'q Expression| (Part::Expression(e), copies);
    match expression {
        Expression::NamedNode(_)
        | Expression::Literal(_)
        | Expression::Variable(_)
        | Expression::Bound(_) => {}
        Expression::Or(a, b)
        | Expression::And(a, b)
        | Expression::Equal(a, b)
        | Expression::SameTerm(a, b)
        | Expression::Greater(a, b)
        | Expression::GreaterOrEqual(a, b)
        | Expression::Less(a, b)
        | Expression::LessOrEqual(a, b)
        | Expression::Add(a, b)
        | Expression::Subtract(a, b)
        | Expression::Multiply(a, b)
        | Expression::Divide(a, b) => {
            to_visit.push(part(a));
            to_visit.push(part(b));
        }
        Expression::UnaryPlus(a) | Expression::UnaryMinus(a) | Expression::Not(a) => {
            to_visit.push(part(a));
        }
        Expression::If(a, b, c) => {
            to_visit.extend([a, b, c].map(|e| part(e)));
        }
        Expression::In(a, list) => {
            // The left is copied into a comparison with each element.
            let left_copies = copies.saturating_mul(list.len().max(1));
            to_visit.push((Part::Expression(a), left_copies));
            to_visit.extend(list.iter().map(part));
        }
        Expression::Coalesce(list) | Expression::FunctionCall(_, list) => {
            to_visit.extend(list.iter().map(part));
        }
        Expression::Exists(pattern) => to_visit.push((Part::Pattern(pattern), copies)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(sparql: &str) -> Query {
        spargebra::SparqlParser::new()
            .parse_query(sparql)
            .unwrap_or_else(|e| panic!("{sparql}: {e}"))
    }

    #[test]
    fn operands_count_patterns_and_the_nodes_joining_them() {
        // Project over a basic graph pattern of two triples.
        assert_eq!(
            operands(&parsed("SELECT * WHERE { ?s ?p ?o . ?o ?q ?r }")),
            4
        );
        let chained = format!("ASK {{ ?s ?p ?o {} }}", "OPTIONAL { ?s ?p ?o } ".repeat(60));
        assert!(operands(&parsed(&chained)) > MOST_PLANNED);
        assert_eq!(plan(&parsed(&chained)), Ok(Plan::AsWritten));
        let longer = chained.replace("?o }", "?o } OPTIONAL { ?s ?p ?o }");
        assert!(plan(&parsed(&longer)).unwrap_err().contains("at most 256"));
        // Patterns inside expressions count as anywhere.
        let exists = |n: usize| {
            let triples: String = (0..n).map(|i| format!("?s ?p ?o{i} . ")).collect();
            format!("ASK {{ ?a ?b ?c FILTER(?c > 0 && NOT EXISTS {{ {triples} }}) }}")
        };
        assert_eq!(plan(&parsed(&exists(10))), Ok(Plan::Optimized));
        assert!(plan(&parsed(&exists(300)))
            .unwrap_err()
            .contains("at most 256"));
        let bound = |n: usize| {
            let triples: String = (0..n).map(|i| format!("?s ?p ?o{i} . ")).collect();
            format!("SELECT (MAX(IF(EXISTS {{ {triples} }}, 1, 0)) AS ?m) WHERE {{ ?a ?b ?c }} ORDER BY (EXISTS {{ ?a ?b ?c }})")
        };
        assert!(plan(&parsed(&bound(300)))
            .unwrap_err()
            .contains("at most 256"));
        // So do the conditions of a sort and the keys of a grouping (a sort evaluates every
        // condition in each comparison; a group holds a key as wide as its variables).
        let sorted = format!(
            "SELECT ?a WHERE {{ ?a ?b ?c }} ORDER BY {}",
            "?a ".repeat(300)
        );
        assert!(plan(&parsed(&sorted)).unwrap_err().contains("at most 256"));
        let grouped = format!(
            "SELECT (COUNT(*) AS ?n) WHERE {{ ?a ?b ?c }} GROUP BY {}",
            "?a ".repeat(300)
        );
        assert!(plan(&parsed(&grouped)).unwrap_err().contains("at most 256"));
    }

    #[test]
    fn a_long_sequence_in_a_path_runs_as_written() {
        let chain = |links: usize| {
            format!(
                "SELECT * WHERE {{ ?s ?p ?o . ?o {}<urn:p>|<urn:q> ?x }}",
                "<urn:p>/".repeat(links)
            )
        };
        assert_eq!(plan(&parsed(&chain(5))), Ok(Plan::Optimized));
        let long = measure(&parsed(&chain(60)));
        assert!(long.path_estimates > 1 << 60);
        assert_eq!(plan(&parsed(&chain(60))), Ok(Plan::AsWritten));
        // Split into patterns as it is parsed, a chain outside a path operator is planned.
        let split = format!(
            "SELECT * WHERE {{ ?s {}<urn:p> ?x }}",
            "<urn:p>/".repeat(30)
        );
        assert_eq!(plan(&parsed(&split)), Ok(Plan::Optimized));
    }

    #[test]
    fn in_is_counted_as_the_store_expands_it() {
        // Each IN of two copies what it tests twice: 2^34 nodes from 400 bytes.
        let doubling = |levels: usize| {
            format!(
                "ASK {{ FILTER({}1{}) }}",
                "(".repeat(levels),
                " IN (1, 1))".repeat(levels)
            )
        };
        let small = measure(&parsed(&doubling(3)));
        // 1 copied 8 times, each IN's left 2, 4 and 8 times, each element once a copy of its IN.
        assert_eq!(
            small.expression_nodes,
            8 + (2 + 4 + 8) / 2 + (1 + 2 + 4) * 2
        );
        assert_eq!(plan(&parsed(&doubling(10))), Ok(Plan::Optimized));
        let refused = plan(&parsed(&doubling(34))).unwrap_err();
        assert!(refused.contains("once IN is expanded"), "{refused}");
        // A long list is not refused: its elements are not copied.
        let list: Vec<String> = (0..5_000).map(|i| i.to_string()).collect();
        let long = format!("ASK {{ ?s ?p ?o FILTER(?o IN ({})) }}", list.join(", "));
        assert_eq!(plan(&parsed(&long)), Ok(Plan::Optimized));
        // The patterns of an EXISTS copied by IN count once a copy.
        let exists_in = |n: usize| {
            format!(
                "ASK {{ FILTER((EXISTS {{ ?s ?p ?o . ?o ?q ?r }}) IN ({})) }}",
                vec!["true"; n].join(", ")
            )
        };
        assert!(operands(&parsed(&exists_in(100))) > MOST_OPERANDS);
    }

    #[test]
    fn the_systems_own_queries_are_optimized() {
        use crate::queries::*;
        let session = session_node("s-1").unwrap();
        let node = session_node("s-2").unwrap();
        let many: Vec<_> = (0..200)
            .map(|i| session_node(&format!("f-{i}")).unwrap())
            .collect();
        let now = "\"2026-12-01T00:00:00Z\"^^xsd:dateTime";
        for query in [
            session_triples(&session),
            last_session(),
            node_exists(&node),
            derivation_closure(&node),
            open_fanout("c-1"),
            fanout_of_subagent(&node, &session),
            continuation_of(&node),
            unanswered_approvals(),
            fanned_out(&session),
            cancellations_since(now),
            run_tokens(&node, &session),
            run_iterations(&node),
            completions("c-1"),
            synthesis_claim(&node),
            start_claim(&session),
            open_fanouts(),
            overdue_fanouts(now),
            fanout_starts(["c-1", "c-2", "c-3"]),
            conversation_sessions("c-1"),
            conversation_dialogs("c-1", &session, 50),
            dialog_answer(&session),
            fanout_sessions(&node),
            any_fanout_answered(&many),
            step_inputs(&session, 1..=STEP_INPUTS_PAGE),
            recorded_llm_calls(&node),
            recorded_tool_results(&node),
            cancellations_at(std::slice::from_ref(&node)),
            owner_records(),
            crate::waiting::answered(crate::waiting::Waits::Synthesis),
            crate::waiting::answered(crate::waiting::Waits::ApprovalAnswer),
            crate::waiting::unmarked(1_000),
        ] {
            let operands = operands(&parsed(&query));
            assert_eq!(
                plan(&parsed(&query)),
                Ok(Plan::Optimized),
                "{operands}: {query}"
            );
        }
    }
}
