//! Text from the graph or the broker made safe to print: an LLM's or a tool's words must not move
//! the cursor, erase lines or retitle the terminal of whoever reads them.

/// Whether `c` would act on a terminal rather than be shown: a control character other than a
/// newline or a tab.
fn acts_on_terminal(c: char) -> bool {
    c.is_control() && c != '\n' && c != '\t'
}

/// `text` with every control character but newline and tab shown as U+FFFD.
pub fn clean_for_terminal(text: &mut String) {
    if text.chars().any(acts_on_terminal) {
        *text = text
            .chars()
            .map(|c| if acts_on_terminal(c) { '\u{fffd}' } else { c })
            .collect();
    }
}

/// [`clean_for_terminal`] of an owned text.
pub fn terminal_safe(mut text: String) -> String {
    clean_for_terminal(&mut text);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_returns_are_shown_not_acted_on() {
        let shown = terminal_safe("paid \u{1b}[1A\u{1b}[2Knothing\rnow\tand\nthen\u{7}".to_owned());
        assert_eq!(
            shown,
            "paid \u{fffd}[1A\u{fffd}[2Knothing\u{fffd}now\tand\nthen\u{fffd}"
        );
    }
}
