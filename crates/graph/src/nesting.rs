//! How deeply a SPARQL text nests its brackets, read before it is parsed. The parser (spargebra,
//! inside oxigraph too) descends once per level of `(`, `{` or `[` with no limit of its own, so a
//! query of a hundred thousand parentheses (100 KB, within any body limit) overflows its thread's
//! stack, and a stack overflow aborts the whole process: one anonymous `POST /query` would take
//! the aggregator down, one LLM-written query the orchestrator. A text nested deeper than
//! [`MOST_NESTING`] is refused instead.

/// The deepest nesting of brackets a query or update may have: far beyond what a person or the
/// agent writes (the service's own queries nest less than ten deep), far below what overflows a
/// 2 MiB thread stack in a debug build.
pub const MOST_NESTING: usize = 64;

/// Refuses `sparql` if its brackets nest deeper than [`MOST_NESTING`], saying so.
pub fn check(sparql: &str) -> Result<(), String> {
    let depth = nesting(sparql);
    if depth > MOST_NESTING {
        return Err(format!(
            "the query nests its brackets {depth} deep; at most {MOST_NESTING} are accepted"
        ));
    }
    Ok(())
}

/// The deepest nesting of `(`, `{` and `[` in `sparql`, not counting those inside string
/// literals, IRIs and comments, which the parser does not descend into either. Linear in the text.
pub fn nesting(sparql: &str) -> usize {
    let text = sparql.as_bytes();
    let (mut depth, mut deepest, mut at) = (0usize, 0usize, 0usize);
    while let Some(&byte) = text.get(at) {
        match byte {
            b'(' | b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
                at += 1;
            }
            b')' | b'}' | b']' => {
                depth = depth.saturating_sub(1);
                at += 1;
            }
            b'#' => at = end_of_comment(text, at),
            b'"' | b'\'' => at = end_of_string(text, at, byte),
            b'<' => at = end_of_iri(text, at).unwrap_or(at + 1),
            _ => at += 1,
        }
    }
    deepest
}

/// Where the comment starting at `at` ends: after its line.
fn end_of_comment(text: &[u8], at: usize) -> usize {
    text[at..]
        .iter()
        .position(|&b| b == b'\n' || b == b'\r')
        .map_or(text.len(), |line_end| at + line_end + 1)
}

/// Where the string literal opened by `quote` at `at` ends: a long one (three quotes) at its
/// three closing quotes, a short one at its closing quote; a backslash escapes the byte after it.
/// An unterminated literal runs to the end (the parser refuses it anyway).
fn end_of_string(text: &[u8], at: usize, quote: u8) -> usize {
    let long = text.get(at..at + 3) == Some(&[quote, quote, quote][..]);
    let mut i = if long { at + 3 } else { at + 1 };
    while let Some(&byte) = text.get(i) {
        if byte == b'\\' {
            i += 2;
        } else if byte == quote && (!long || text.get(i..i + 3) == Some(&[quote, quote, quote][..]))
        {
            return i + if long { 3 } else { 1 };
        } else {
            i += 1;
        }
    }
    text.len()
}

/// Where the IRI opened at `at` ends, if a `<` there opens one (an IRI's characters up to `>`, as
/// SPARQL's IRIREF; otherwise the `<` is a comparison).
fn end_of_iri(text: &[u8], at: usize) -> Option<usize> {
    for (offset, &byte) in text[at + 1..].iter().enumerate() {
        match byte {
            b'>' => return Some(at + offset + 2),
            b'<' | b'"' | b'{' | b'}' | b'|' | b'^' | b'`' | b'\\' | 0..=0x20 => return None,
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brackets_are_counted_outside_literals_iris_and_comments() {
        assert_eq!(nesting("SELECT * WHERE { ?s ?p ?o }"), 1);
        assert_eq!(
            nesting("ASK { FILTER((1 + (2)) > 0) OPTIONAL { [ <urn:p> ?o ] } }"),
            4
        );
        assert_eq!(nesting(r#"ASK { FILTER(?x = "((((" ) }"#), 2);
        assert_eq!(nesting(r#"ASK { FILTER(?x = """ " (( """) }"#), 2);
        assert_eq!(nesting(r#"ASK { FILTER(?x = 'a\'((') }"#), 2);
        assert_eq!(nesting("ASK { <urn:a(((> ?p ?o }"), 1);
        assert_eq!(nesting("ASK { # (((\n ?s ?p ?o }"), 1);
        // A comparison, not an IRI: the brackets after it count.
        assert_eq!(nesting("ASK { FILTER(?a < (?b)) }"), 3);
    }

    #[test]
    fn closing_brackets_hidden_in_literals_do_not_hide_the_real_depth() {
        // Each level opened for the parser and "closed" inside a literal: the parser still
        // descends a level each time.
        let deep = format!(
            "ASK {{ FILTER({}1{}) }}",
            "(\")\" + ".repeat(100),
            ")".repeat(100)
        );
        assert!(nesting(&deep) > 100, "{}", nesting(&deep));
        assert!(check(&deep).is_err());
        let fine = format!("ASK {{ FILTER({}1{}) }}", "(".repeat(60), ")".repeat(60));
        assert!(check(&fine).is_ok());
    }

    #[test]
    fn unterminated_literals_and_iris_end_the_count_without_panicking() {
        assert_eq!(nesting("ASK { \"(((("), 1);
        assert_eq!(nesting("ASK { '''((("), 1);
        assert_eq!(nesting("ASK { FILTER(?a <"), 2);
        assert_eq!(nesting("ASK { \"\\"), 1);
        assert_eq!(nesting("#"), 0);
    }
}
