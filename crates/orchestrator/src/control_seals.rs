//! Which control messages (cancels, answers to approvals) an orchestrator acts on: with the
//! services' seal key, only those sealed with it, so whoever can publish to the control topics
//! without the key can neither cancel a run nor approve a tool call.

use agent_schema::AgentControl;

use crate::settings::SealRule;

/// Whether a control message may be acted on: with a seal key, only one sealed with it (or any,
/// counted and logged, under [`SealRule::Warn`]); without a key, any (the services then say at
/// start that nothing is sealed).
pub fn sealed_as_required(
    key: Option<&agent_bus::seal::SealKey>,
    rule: SealRule,
    control: &AgentControl,
    raw: &[u8],
    properties: &agent_bus::Properties,
) -> bool {
    let Some(key) = key else {
        return true;
    };
    if key.verify_control(raw, properties) {
        return true;
    }
    let acted_on = rule == SealRule::Warn;
    crate::events::UnsealedControl {
        operation: &control.operation,
        session: &control.session_id,
        acted_on,
    }
    .emit();
    acted_on
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_message_sealed_with_the_key_passes_unless_the_rule_warns() {
        let key = agent_bus::seal::SealKey::new(b"services");
        let control = AgentControl {
            operation: "approve".into(),
            session_id: "s".into(),
            step: Some(1),
            ..AgentControl::default()
        };
        let (raw, sealed) = agent_bus::sealed_control(&control, Some(&key));
        let (_, unsealed) = agent_bus::sealed_control(&control, None);
        let other = agent_bus::seal::SealKey::new(b"mallory");
        let (_, forged) = agent_bus::sealed_control(&control, Some(&other));
        let passes = |key: Option<&agent_bus::seal::SealKey>, rule, properties| {
            sealed_as_required(key, rule, &control, &raw, properties)
        };
        assert!(passes(Some(&key), SealRule::Require, &sealed));
        assert!(!passes(Some(&key), SealRule::Require, &unsealed));
        assert!(!passes(Some(&key), SealRule::Require, &forged));
        assert!(passes(Some(&key), SealRule::Warn, &unsealed));
        assert!(passes(None, SealRule::Require, &unsealed));
        // Sealed over other bytes: an edited message fails.
        let edited = AgentControl {
            step: Some(2),
            ..control.clone()
        };
        let (edited_raw, _) = agent_bus::sealed_control(&edited, None);
        assert!(!sealed_as_required(
            Some(&key),
            SealRule::Require,
            &edited,
            &edited_raw,
            &sealed
        ));
    }
}
