//! What a log shows of text a client sent (a session id, a pattern's name): its start, escaped,
//! so that a client can neither flood a log with one field nor forge a line of it.

/// The most bytes of one client-sent field a log line shows.
pub const MOST_SHOWN_BYTES: usize = 240;

/// `text` as a log shows it: its first [`MOST_SHOWN_BYTES`] (cut on a character), with line
/// breaks and other control characters escaped.
pub fn client_text(text: &str) -> std::str::EscapeDebug<'_> {
    crate::documents::prefix(text, MOST_SHOWN_BYTES).escape_debug()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forged_line_stays_on_its_own() {
        let forged = "s1\n2026-12-04T00:00:00Z  INFO all is well";
        let shown = client_text(forged).to_string();
        assert!(!shown.contains('\n'), "{shown}");
        assert!(shown.starts_with("s1\\n"));
        let long = "é".repeat(200);
        let shown = client_text(&long).to_string();
        assert_eq!(shown.len(), 240);
    }
}
