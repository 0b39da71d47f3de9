//! Seals on what only this service may send: a subagent's first request and the fan-outs and
//! completions that drive fan-in. A seal is an HMAC-SHA256 over the fields that matter, keyed by a
//! secret the orchestrators and aggregators share (`AGENT_SEAL_KEY`). Anyone who can publish to
//! the request or explainability topic can still send a message, but not one that starts a
//! subagent, joins someone's fan-in or resumes a supervisor.

use ring::hmac;

/// The environment variable holding the shared secret.
pub const SEAL_KEY_ENV: &str = "AGENT_SEAL_KEY";
/// The message property carrying a subagent request's seal.
pub const SEAL_PROPERTY: &str = "agent-seal";

/// The shared secret, ready to seal and check.
#[derive(Clone)]
pub struct SealKey(hmac::Key);

impl std::fmt::Debug for SealKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SealKey(..)")
    }
}

impl SealKey {
    pub fn new(secret: &[u8]) -> SealKey {
        SealKey(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }

    /// The key from `secret` (a flag or `AGENT_SEAL_KEY`), if one is set; logs what runs
    /// unsealed when not.
    pub fn configured(secret: Option<&str>, service: &str) -> Option<SealKey> {
        match secret.map(str::trim).filter(|s| !s.is_empty()) {
            Some(secret) => Some(SealKey::new(secret.as_bytes())),
            None => {
                tracing::warn!(service, "no {SEAL_KEY_ENV}: subagent requests, fan-outs and completions are not sealed, so anyone who can publish to the request or explainability topic can forge them");
                None
            }
        }
    }

    /// The seal of `parts`, as hex. Each part is length-prefixed, so no two lists share one.
    pub fn seal(&self, parts: &[&str]) -> String {
        let tag = hmac::sign(&self.0, &framed(parts));
        tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Whether `seal` is the seal of `parts` (compared in constant time).
    pub fn verify(&self, parts: &[&str], seal: &str) -> bool {
        let Some(tag) = unhex(seal) else {
            return false;
        };
        hmac::verify(&self.0, &framed(parts), &tag).is_ok()
    }
}

fn framed(parts: &[&str]) -> Vec<u8> {
    let mut bytes = Vec::new();
    for part in parts {
        bytes.extend_from_slice(&(part.len() as u64).to_be_bytes());
        bytes.extend_from_slice(part.as_bytes());
    }
    bytes
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seal_holds_only_for_its_parts_and_key() {
        let key = SealKey::new(b"secret");
        let seal = key.seal(&["a", "bc"]);
        assert!(key.verify(&["a", "bc"], &seal));
        assert!(!key.verify(&["ab", "c"], &seal), "parts are framed");
        assert!(!key.verify(&["a", "bd"], &seal));
        assert!(!SealKey::new(b"other").verify(&["a", "bc"], &seal));
        assert!(!key.verify(&["a", "bc"], "zz"));
        assert!(!key.verify(&["a", "bc"], ""));
        assert!(SealKey::configured(Some("  "), "test").is_none());
        assert!(SealKey::configured(Some("k"), "test").is_some());
    }
}
