//! Seals on what only this service may send: a subagent's first request and the fan-outs and
//! completions that drive fan-in, a dialog's later steps, the agent's records, and control
//! messages (cancels, answers to approvals). A seal is an HMAC-SHA256 over the fields that
//! matter, keyed by a secret the orchestrators and aggregators share (`AGENT_SEAL_KEY`). Anyone
//! who can publish to the request, explainability or control topics can still send a message,
//! but not one that starts a subagent, joins someone's fan-in, resumes a supervisor, cancels a
//! run or answers an approval.

use ring::hmac;

/// The environment variable holding the shared secret.
pub const SEAL_KEY_ENV: &str = "AGENT_SEAL_KEY";
/// The message property carrying a subagent request's seal as builds before 2026-12-02 made it
/// (who it is and what it inherits, not what it asks), still sent so that they take up this
/// build's subagents during a rolling upgrade; believed only under `AGENT_SUBAGENT_SEALS=warn`.
pub const SEAL_PROPERTY: &str = "agent-seal";
/// The message property carrying a subagent request's seal over the whole of it (see
/// `agent_core::supervisor::subagent_seal_parts`).
pub const SUBAGENT_SEAL_PROPERTY: &str = "agent-subagent-seal";
/// The property carrying the seal of a dialog's later step (see [`step_parts`]).
pub const STEP_SEAL_PROPERTY: &str = "agent-step-seal";
/// The property carrying the seal of an explainability message the agent's services sent: only
/// a sealed message may write the agent's own records (its sessions' nodes and documents), which
/// the services read back and act on.
pub const EXPLAIN_SEAL_PROPERTY: &str = "agent-explain-seal";
/// The property carrying the seal of a control message (a cancel, an approval's answer): its
/// payload as sent, sealed by whoever holds the key (the services, `agentctl` given it).
pub const CONTROL_SEAL_PROPERTY: &str = "agent-control-seal";
/// The property carrying the seal of an owner's announcement (a journal's, a config store's; see
/// `owner_fence`): a forged one would stand the running owner down.
pub const OWNER_SEAL_PROPERTY: &str = "agent-owner-seal";

/// The properties of a later step's request that its seal covers besides the payload: who gets
/// its messages, what its run has spent and since when, its model, and whose recorded answers it
/// may reuse (a step believes them all).
const SEALED_STEP_PROPERTIES: [&str; 8] = [
    agent_schema::ID_PROPERTY,
    agent_schema::IN_TOKEN_PROPERTY,
    agent_schema::OUT_TOKEN_PROPERTY,
    agent_schema::STARTED_PROPERTY,
    agent_schema::RUN_TOKENS_PROPERTY,
    agent_schema::MODEL_PROPERTY,
    agent_schema::REUSE_PROPERTY,
    agent_schema::REUSE_FROM_PROPERTY,
];

/// What the seal of a dialog's later step covers: the request as encoded (the orchestrator's
/// encoding of a request is the same each time, which the journal's keys rely on too) and the
/// properties a step believes.
pub fn step_parts(payload: &[u8], properties: &crate::Properties) -> Vec<String> {
    let mut parts = vec![
        "step".to_owned(),
        String::from_utf8_lossy(payload).into_owned(),
    ];
    parts.extend(
        SEALED_STEP_PROPERTIES
            .iter()
            .map(|name| properties.get(*name).cloned().unwrap_or_default()),
    );
    parts
}

/// The example settings the project publishes (`.env.example`): their secrets are known to all.
const PUBLISHED_EXAMPLE: &str = include_str!("../../../.env.example");

/// Refuses a secret setting left at the value `.env.example` gives it: copied as the compose
/// file's header says and never changed, the config token would let anyone write tools and
/// provenance, and the seal key anyone forge fan-outs, completions and approvals. `settings`:
/// each setting's name and value.
pub fn refuse_published_secrets(settings: &[(&str, Option<&str>)]) -> Result<(), String> {
    for (name, value) in settings {
        let Some(value) = value.map(str::trim).filter(|v| !v.is_empty()) else {
            continue;
        };
        let published = PUBLISHED_EXAMPLE.lines().any(|line| {
            line.split_once('=')
                .is_some_and(|(key, example)| key.trim() == *name && example.trim() == value)
        });
        if published {
            return Err(format!(
                "{name} is the example value .env.example publishes; set it to a long random string of your own (openssl rand -hex 32)"
            ));
        }
    }
    Ok(())
}

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
                tracing::warn!(service, "no {SEAL_KEY_ENV}: subagent requests, fan-outs, completions and control messages are not sealed, so anyone who can publish to the request, explainability or control topics can forge them");
                None
            }
        }
    }

    /// The seal of `parts`, as hex. Each part is length-prefixed, so no two lists share one.
    pub fn seal(&self, parts: &[&str]) -> String {
        let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
        self.seal_bytes(&parts)
    }

    fn seal_bytes(&self, parts: &[&[u8]]) -> String {
        let tag = hmac::sign(&self.0, &framed(parts));
        tag.as_ref().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The [`EXPLAIN_SEAL_PROPERTY`] of an explainability message: its payload as sent.
    pub fn seal_explain(&self, payload: &[u8]) -> String {
        self.seal_bytes(&[b"explain", payload])
    }

    /// Whether `properties` carry the seal of the explainability message `payload` (the bytes as
    /// they came off the wire).
    pub fn verify_explain(&self, payload: &[u8], properties: &crate::Properties) -> bool {
        self.verify_payload(b"explain", EXPLAIN_SEAL_PROPERTY, payload, properties)
    }

    /// The [`CONTROL_SEAL_PROPERTY`] of a control message: its payload as sent.
    pub fn seal_control(&self, payload: &[u8]) -> String {
        self.seal_bytes(&[b"control", payload])
    }

    /// Whether `properties` carry the seal of the control message `payload` (the bytes as they
    /// came off the wire).
    pub fn verify_control(&self, payload: &[u8], properties: &crate::Properties) -> bool {
        self.verify_payload(b"control", CONTROL_SEAL_PROPERTY, payload, properties)
    }

    /// The [`OWNER_SEAL_PROPERTY`] of an owner's announcement (see `owner_fence`): its payload
    /// as sent, sealed as `kind` (its role's: "owner" for a journal's, as builds before the
    /// config service's fence sealed it).
    pub fn seal_announcement(&self, kind: &str, payload: &[u8]) -> String {
        self.seal_bytes(&[kind.as_bytes(), payload])
    }

    /// Whether `properties` carry the seal of the owner's announcement `payload`, sealed as
    /// `kind`.
    pub fn verify_announcement(
        &self,
        kind: &str,
        payload: &[u8],
        properties: &crate::Properties,
    ) -> bool {
        self.verify_payload(kind.as_bytes(), OWNER_SEAL_PROPERTY, payload, properties)
    }

    /// Whether `properties` carry, under `property`, the seal of `payload` sealed as `kind`.
    fn verify_payload(
        &self,
        kind: &[u8],
        property: &str,
        payload: &[u8],
        properties: &crate::Properties,
    ) -> bool {
        let Some(tag) = properties.get(property).and_then(|s| unhex(s)) else {
            return false;
        };
        hmac::verify(&self.0, &framed(&[kind, payload]), &tag).is_ok()
    }

    /// Seals a dialog's later step: its [`STEP_SEAL_PROPERTY`] for `properties`.
    pub fn seal_step(&self, payload: &[u8], properties: &crate::Properties) -> String {
        let parts = step_parts(payload, properties);
        self.seal(&parts.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// Whether `properties` carry the seal of this step.
    pub fn verify_step(&self, payload: &[u8], properties: &crate::Properties) -> bool {
        let Some(seal) = properties.get(STEP_SEAL_PROPERTY) else {
            return false;
        };
        let parts = step_parts(payload, properties);
        self.verify(&parts.iter().map(String::as_str).collect::<Vec<_>>(), seal)
    }

    /// Whether `seal` is the seal of `parts` (compared in constant time).
    pub fn verify(&self, parts: &[&str], seal: &str) -> bool {
        let Some(tag) = unhex(seal) else {
            return false;
        };
        let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
        hmac::verify(&self.0, &framed(&parts), &tag).is_ok()
    }
}

/// The properties to send a message with: `property` carrying the seal `seal` makes with `key`,
/// or none without a key (an unkeyed deployment sends nothing sealed).
pub fn sealed_properties(
    key: Option<&SealKey>,
    property: &str,
    seal: impl FnOnce(&SealKey) -> String,
) -> crate::Properties {
    key.map(|key| [(property.to_owned(), seal(key))].into())
        .unwrap_or_default()
}

fn framed(parts: &[&[u8]]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.len() + 8).sum());
    for part in parts {
        bytes.extend_from_slice(&(part.len() as u64).to_be_bytes());
        bytes.extend_from_slice(part);
    }
    bytes
}

/// Hex digits only: `from_str_radix` also takes a sign, so a seal had more than one spelling.
fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
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
    fn a_step_seal_covers_the_payload_and_what_a_step_believes() {
        let key = SealKey::new(b"k");
        let mut properties = crate::Properties::new();
        properties.insert(agent_schema::IN_TOKEN_PROPERTY.into(), "10".into());
        properties.insert("traceparent".into(), "00-a-b-01".into());
        let payload = br#"{"question":"q"}"#;
        let seal = key.seal_step(payload, &properties);
        properties.insert(STEP_SEAL_PROPERTY.into(), seal);
        assert!(key.verify_step(payload, &properties));
        // What it does not cover may change; what it covers may not.
        properties.insert("traceparent".into(), "00-c-d-01".into());
        assert!(key.verify_step(payload, &properties));
        assert!(!key.verify_step(br#"{"question":"Q"}"#, &properties));
        let mut spent = properties.clone();
        spent.insert(agent_schema::IN_TOKEN_PROPERTY.into(), "0".into());
        assert!(!key.verify_step(payload, &spent));
        let mut reused = properties.clone();
        reused.insert(agent_schema::REUSE_FROM_PROPERTY.into(), "urn:x".into());
        assert!(!key.verify_step(payload, &reused));
        assert!(!SealKey::new(b"other").verify_step(payload, &properties));
        properties.remove(STEP_SEAL_PROPERTY);
        assert!(!key.verify_step(payload, &properties));
    }

    #[test]
    fn an_explain_seal_covers_the_payload_as_sent() {
        let key = SealKey::new(b"k");
        let payload = br#"{"metadata":{"id":"urn:x"},"triples":[]}"#;
        let mut properties = crate::Properties::new();
        assert!(!key.verify_explain(payload, &properties));
        properties.insert(EXPLAIN_SEAL_PROPERTY.into(), key.seal_explain(payload));
        assert!(key.verify_explain(payload, &properties));
        assert!(!key.verify_explain(br#"{"metadata":{"id":"urn:y"},"triples":[]}"#, &properties));
        assert!(!SealKey::new(b"other").verify_explain(payload, &properties));
        // An explain seal does not pass for a step's.
        let mut step = crate::Properties::new();
        step.insert(STEP_SEAL_PROPERTY.into(), key.seal_explain(payload));
        assert!(!key.verify_step(payload, &step));
    }

    #[test]
    fn a_control_seal_covers_the_payload_and_passes_for_no_other_seal() {
        let key = SealKey::new(b"k");
        let payload = br#"{"operation":"approve","session_id":"s","step":1}"#;
        let mut properties = crate::Properties::new();
        assert!(!key.verify_control(payload, &properties));
        properties.insert(CONTROL_SEAL_PROPERTY.into(), key.seal_control(payload));
        assert!(key.verify_control(payload, &properties));
        assert!(!key.verify_control(
            br#"{"operation":"approve","session_id":"t","step":1}"#,
            &properties
        ));
        assert!(!SealKey::new(b"other").verify_control(payload, &properties));
        // An explain seal of the same bytes is not a control seal.
        let mut explain = crate::Properties::new();
        explain.insert(CONTROL_SEAL_PROPERTY.into(), key.seal_explain(payload));
        assert!(!key.verify_control(payload, &explain));
    }

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
        // One spelling: a byte under 0x10 written with a sign instead of its 0 is no seal.
        let mut signed = None;
        for n in 0..64u8 {
            let seal = key.seal(&["a", &n.to_string()]);
            if let Some(at) = (0..seal.len()).step_by(2).find(|&i| &seal[i..i + 1] == "0") {
                signed = Some((n, format!("{}+{}", &seal[..at], &seal[at + 1..])));
                break;
            }
        }
        let (n, signed) = signed.unwrap_or_default();
        assert!(!key.verify(&["a", &n.to_string()], &signed), "{signed}");
        assert!(SealKey::configured(Some("  "), "test").is_none());
        assert!(
            refuse_published_secrets(&[("CONFIG_TOKEN", Some("change-me"))])
                .is_err_and(|why| why.contains("CONFIG_TOKEN") && why.contains(".env.example"))
        );
        assert!(refuse_published_secrets(&[("AGENT_SEAL_KEY", Some(" change-me-too "))]).is_err());
        assert!(refuse_published_secrets(&[
            ("CONFIG_TOKEN", Some("a0c1e9f5d2b8")),
            ("AGENT_SEAL_KEY", None),
            ("PULSAR_TOKEN", Some("")),
        ])
        .is_ok());
        assert!(SealKey::configured(Some("k"), "test").is_some());
    }
}
