//! Long texts as documents (claim-check): the names, excerpts and references that let a message or
//! a provenance node carry a long text's start and where the whole of it is kept.
//!
//! A document is named by its text's SHA-256, so whoever writes it (the step that checks an
//! observation in, the aggregator storing provenance, a redelivered copy of either) writes the
//! same quad: the store holds each text once and no writer needs a compare-and-set.

use sha2::{Digest, Sha256};

use crate::vocab::DOCUMENT_PREFIX;

/// Texts longer than this are kept as documents, apart from the messages and nodes that cite them.
pub const CHECK_IN_OVER: usize = 4096;
/// How much of a checked-in text a message keeps.
pub const EXCERPT_BYTES: usize = 1024;

/// Starts the line that ends an excerpt: `[claim-check: {bytes} bytes in {uri}]`.
const MARK: &str = "\n[claim-check: ";

/// Whether `text` is long enough to be kept as a document.
pub fn is_long(text: &str) -> bool {
    text.len() > CHECK_IN_OVER
}

/// The IRI of the document holding `text`.
pub fn document_uri(text: &str) -> String {
    let digest = Sha256::digest(text.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{DOCUMENT_PREFIX}{hex}")
}

/// The first `max` bytes of `text`, cut at a character boundary.
pub fn prefix(text: &str, max: usize) -> &str {
    let mut end = max.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// What a message keeps of a checked-in text: its start, and where the rest is.
pub fn excerpt_with_reference(text: &str, uri: &str) -> String {
    format!(
        "{}…{MARK}{} bytes in {uri}]",
        prefix(text, EXCERPT_BYTES),
        text.len()
    )
}

/// The document an excerpt refers to, and the whole text's length.
pub fn reference(excerpt: &str) -> Option<(&str, usize)> {
    let at = excerpt.rfind(MARK)?;
    let line = excerpt[at + MARK.len()..].strip_suffix(']')?;
    let (bytes, uri) = line.split_once(" bytes in ")?;
    let uri = uri.trim();
    if !uri.starts_with(DOCUMENT_PREFIX) || uri.contains(char::is_whitespace) {
        return None;
    }
    Some((uri, bytes.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_excerpt_names_its_document_and_length() {
        let text = "é".repeat(3000);
        let uri = document_uri(&text);
        assert!(uri.starts_with(DOCUMENT_PREFIX) && uri.len() == DOCUMENT_PREFIX.len() + 64);
        let excerpt = excerpt_with_reference(&text, &uri);
        assert!(excerpt.len() < EXCERPT_BYTES + 200);
        assert_eq!(reference(&excerpt), Some((uri.as_str(), 6000)));
        assert_eq!(reference("an observation\n[claim-check: x]"), None);
        assert_eq!(
            reference("[claim-check: 5 bytes in <urn:other> ]"),
            None,
            "only our documents"
        );
    }

    #[test]
    fn the_name_is_the_texts_sha256() {
        assert_eq!(
            document_uri("abc"),
            format!(
                "{DOCUMENT_PREFIX}ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
            )
        );
        assert_eq!(prefix("aé", 2), "a");
    }
}
