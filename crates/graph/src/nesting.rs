//! Stack enough for a SPARQL query, however deeply it nests. The parser (spargebra, inside
//! oxigraph too) descends once per `(`, `{`, `[` or `!` with no limit of its own, and what it
//! builds is a tree one level deeper per operator of a chain (`1+1+...`, `<p>/<p>/...`, `a||b||...`),
//! which converting, evaluating, printing and dropping it descend again; a stack overflow aborts
//! the whole process. So one anonymous `POST /query` of a hundred thousand parentheses (100 KB,
//! within any body limit) took the aggregator down, and one LLM-written query the orchestrator.
//!
//! How deep a text nests cannot be told from its characters alone: whether `<` opens an IRI or
//! compares depends on where the parser stands, and a misjudged quote or `#` turns code into a
//! literal or a comment. So the bound is every character that may make a level, wherever it
//! stands: the query goes no deeper than their count. A query with few runs where it is; one with
//! more runs on a thread of its own with a stack sized for them all; one with more than
//! [`MOST_OPENERS`] is refused.
//!
//! A ground-data update (`INSERT DATA` or `DELETE DATA`, alone) is the exception: in its data
//! block `<` only ever opens an IRI and a quote a literal, so what they hold is no level and is
//! not counted ([`update_levels`]). Counted, the brackets and dashes of a long literal (a tool's
//! code, a document) refused a replica's write of a message of a few hundred KB.

/// The most characters that may make a level (see [`openers`]) a query may hold: a `VALUES` list
/// of ten thousand IRIs still fits, and the deepest descent it allows takes a stack of
/// `MOST_OPENERS * STACK_PER_OPENER` (a thread's stack is reserved, and only what is used is
/// touched).
pub const MOST_OPENERS: usize = 100_000;

/// Openers a query may hold and still run on the calling thread: even nested one in another they
/// fit in the 2 MiB of a Tokio worker or blocking thread (a debug build's frames are the largest).
const IN_PLACE_OPENERS: usize = 96;

/// The stack one level of nesting may take, parsing, evaluating and dropping, with room to spare
/// (in a debug build a level of brackets overflowed at 3 KB and held at 6; see `tests/bounded.rs`).
const STACK_PER_OPENER: usize = 16 * 1024;

/// The stack of a thread made for a deep text, besides its levels.
const BASE_STACK: usize = 2 * 1024 * 1024;

/// Every character of `sparql` that may make a level, wherever it stands: brackets and `!`, which
/// the parser descends, and the operators that chain (`+ - * / | & ^`), each a level of the tree
/// it builds.
pub fn openers(sparql: &str) -> usize {
    sparql
        .bytes()
        .filter(|b| {
            matches!(
                b,
                b'(' | b'{' | b'[' | b'!' | b'+' | b'-' | b'*' | b'/' | b'|' | b'&' | b'^'
            )
        })
        .count()
}

/// The levels of descent `update` may make: [`openers`] outside its IRIs, literals and comments
/// when it is a ground-data update alone (see the module's note), every opener otherwise.
pub fn update_levels(update: &str) -> usize {
    data_update_openers(update).unwrap_or_else(|| openers(update))
}

/// The openers of a text that is one `INSERT DATA` or `DELETE DATA` and nothing else, outside its
/// IRIs, literals and comments; `None` for any other text, or one this reading cannot follow
/// (which the parser would refuse anyway), so that every opener of it counts.
fn data_update_openers(update: &str) -> Option<usize> {
    let text = update.trim_start().as_bytes();
    let head = text.get(..11)?;
    if !head.eq_ignore_ascii_case(b"INSERT DATA") && !head.eq_ignore_ascii_case(b"DELETE DATA") {
        return None;
    }
    let (mut at, mut count, mut depth, mut closed) = (11, 0usize, 0usize, false);
    while let Some(&b) = text.get(at) {
        if b == b'#' {
            at = text[at..]
                .iter()
                .position(|&c| c == b'\n')
                .map_or(text.len(), |n| at + n);
            continue;
        }
        if closed {
            // Only blanks and comments after the data block: a second operation could use `<`
            // as an operator.
            if !b.is_ascii_whitespace() {
                return None;
            }
            at += 1;
            continue;
        }
        match b {
            b'"' | b'\'' => at = end_of_literal(text, at)?,
            b'<' => at = end_of_iri(text, at)?,
            b'{' => {
                depth += 1;
                count += 1;
                at += 1;
            }
            b'}' => {
                depth = depth.checked_sub(1)?;
                closed = depth == 0;
                at += 1;
            }
            b'(' | b'[' | b'!' | b'+' | b'-' | b'*' | b'/' | b'|' | b'&' | b'^' => {
                count += 1;
                at += 1;
            }
            _ => at += 1,
        }
    }
    closed.then_some(count)
}

/// Where the literal opening at `at` ends (past its closing quote): a short one on its line, a
/// long one (three quotes) across lines, a backslash escaping the character after it.
fn end_of_literal(text: &[u8], at: usize) -> Option<usize> {
    let quote = text[at];
    let long = text.get(at..at + 3) == Some(&[quote, quote, quote][..]);
    let mut i = if long { at + 3 } else { at + 1 };
    while let Some(&c) = text.get(i) {
        match c {
            b'\\' => i += 2,
            _ if c == quote && !long => return Some(i + 1),
            _ if c == quote && text.get(i..i + 3) == Some(&[quote, quote, quote][..]) => {
                return Some(i + 3)
            }
            b'\n' | b'\r' if !long => return None,
            _ => i += 1,
        }
    }
    None
}

/// Where the IRI opening at `at` ends (past its `>`), as SPARQL's `IRIREF` reads it: no blanks or
/// `<"{}|^`\``, a backslash only as `\u` or `\U`.
fn end_of_iri(text: &[u8], at: usize) -> Option<usize> {
    let mut i = at + 1;
    while let Some(&c) = text.get(i) {
        match c {
            b'>' => return Some(i + 1),
            b'\\' if matches!(text.get(i + 1), Some(b'u' | b'U')) => i += 2,
            b'<' | b'"' | b'{' | b'}' | b'|' | b'^' | b'`' | b'\\' => return None,
            _ if c <= b' ' => return None,
            _ => i += 1,
        }
    }
    None
}

/// Runs `work`, which parses `sparql` (and may evaluate it), where the parser has stack for the
/// deepest descent `sparql` allows: on this thread when it has few openers, on a thread of its own
/// sized for them otherwise. A text with more than [`MOST_OPENERS`] is refused, saying so.
pub fn with_stack_for<T: Send>(sparql: &str, work: impl FnOnce() -> T + Send) -> Result<T, String> {
    with_stack_for_levels(openers(sparql), work)
}

/// Runs `work` where it has stack for `levels` levels of descent: here when they are few, on a
/// thread of its own otherwise; more than [`MOST_OPENERS`] are refused. A parsed query's basic
/// graph patterns are flat, but the store evaluates one of `n` triples as `n` joins, one in
/// another: its levels are its openers and its patterns (see `planning::operands`).
pub fn with_stack_for_levels<T: Send>(
    levels: usize,
    work: impl FnOnce() -> T + Send,
) -> Result<T, String> {
    if levels <= IN_PLACE_OPENERS {
        return Ok(work());
    }
    if levels > MOST_OPENERS {
        return Err(format!(
            "the query holds {levels} brackets, operators and patterns; at most {MOST_OPENERS} are taken"
        ));
    }
    std::thread::scope(|scope| {
        let deep = std::thread::Builder::new()
            .name("sparql-deep".to_owned())
            .stack_size(BASE_STACK + levels * STACK_PER_OPENER)
            .spawn_scoped(scope, work)
            .map_err(|e| format!("no thread to parse a deeply nested query on: {e}"))?;
        deep.join()
            .map_err(|_| "parsing or evaluating the query failed".to_owned())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_opener_counts_wherever_it_stands() {
        assert_eq!(openers("SELECT * WHERE { ?s ?p ?o }"), 2);
        assert_eq!(openers(r#"ASK { FILTER(!(?x = "((")) } # ["#), 7);
        assert_eq!(openers("ASK { <urn:a(> ?p ?o }"), 2);
        assert_eq!(
            openers("ASK { FILTER(1+2-3*4/5 || ?a && ?b) ?s ^<p>|<q> ?o }"),
            12
        );
    }

    #[test]
    fn few_openers_run_here_many_on_a_thread_of_their_own_too_many_not_at_all() {
        let here = std::thread::current().id();
        let ran_on = |text: &str| with_stack_for(text, || std::thread::current().id());
        assert_eq!(ran_on("ASK { }"), Ok(here));
        let many = "(".repeat(IN_PLACE_OPENERS + 1);
        assert!(matches!(ran_on(&many), Ok(id) if id != here));
        let too_many = "!".repeat(MOST_OPENERS + 1);
        assert!(ran_on(&too_many).unwrap_err().contains("at most 100000"));
    }

    #[test]
    fn a_data_update_counts_no_opener_in_its_literals_iris_or_comments() {
        let data = r#"INSERT DATA { GRAPH <urn:g/a-b> { <urn:s(1)> <urn:p> "f(x) - {y} / [z] \" (" ,
            """long ( "" [ ""","x"^^<urn:t> ; <urn:q> ( 1 -2 [ <urn:r> '(it)' ] ) . } } # ((("#;
        assert_eq!(update_levels(data), 7, "two braces, ^^, (, - and [");
        assert!(openers(data) > 20);
        // Deep in its data block (collections, blank nodes), it is counted all the same.
        let deep = format!(
            "insert data {{ <urn:s> <urn:p> {}1{} }}",
            "(".repeat(500),
            ")".repeat(500)
        );
        assert_eq!(update_levels(&deep), 501);
    }

    #[test]
    fn any_other_update_or_one_not_followed_counts_every_opener() {
        for text in [
            // Anything after the data block: another operation may use `<` as an operator.
            r#"INSERT DATA { <urn:s> <urn:p> "((" } ; DELETE WHERE { ?s ?p ?o FILTER(?o<((1>) }"#,
            r#"DELETE { ?s ?p "(((" } WHERE { ?s ?p ?o }"#,
            // What the parser refuses: a literal across a line, an IRI with a blank, no end.
            "INSERT DATA { <urn:s> <urn:p> \"a\n((\" }",
            r#"INSERT DATA { <urn:s ((> <urn:p> 1 }"#,
            r#"INSERT DATA { <urn:s> <urn:p> "((" "#,
            r#"INSERT DATA { <urn:s> <urn:p> 1 } }"#,
        ] {
            assert_eq!(update_levels(text), openers(text), "{text}");
        }
    }
}
