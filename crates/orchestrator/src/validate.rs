//! The checks a request passes before any work is done for it.

use agent_core::config::AgentConfig;
use agent_core::documents::steps_taken;
use agent_core::pattern::Pattern;
use agent_schema::AgentRequest;

/// Checks a request before any work; the message is the error the client gets. `new_dialog`: the
/// first message of a dialog, not one the router queued; `payload_bytes`: the message's size.
pub(crate) fn validate(
    request: &AgentRequest,
    config: &AgentConfig,
    new_dialog: bool,
    payload_bytes: usize,
) -> Result<(), String> {
    if request.question.trim().is_empty() {
        return Err("the request has an empty question".to_owned());
    }
    let max = config.limits.max_message_bytes;
    if payload_bytes > max {
        let what = if request.history.is_empty() {
            "the request message"
        } else {
            "the dialog's history"
        };
        return Err(format!(
            "{what} is {payload_bytes} bytes, more than the limit of {max} (max_message_bytes)"
        ));
    }
    let max = config.limits.max_question_bytes;
    if request.question.len() > max {
        return Err(format!(
            "the question is {} bytes, more than the limit of {max} (max_question_bytes)",
            request.question.len()
        ));
    }
    let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    // These name provenance nodes; a supervisor's ids grow by a short suffix per fan-out.
    for (field, value) in [
        ("session_id", &request.session_id),
        ("correlation_id", &request.correlation_id),
        ("parent_session_id", &request.parent_session_id),
    ] {
        if !value.chars().all(safe) || value.len() > 240 {
            return Err(format!(
                "{field} may only hold letters, digits, '-', '_', '.' and ':' (at most 240)"
            ));
        }
    }
    let pattern = request.pattern.as_str();
    if !pattern.is_empty() && !Pattern::runs(pattern) {
        return Err(format!(
            "the pattern '{pattern}' is not available; this orchestrator runs: {}",
            Pattern::all_names()
        ));
    }
    // A task type is checked where a dialog starts; once routed, the dialog keeps it even if config
    // changes.
    if new_dialog && !request.task_type.is_empty() {
        let task_types = config.task_types_or_general();
        if !task_types.iter().any(|t| t.name == request.task_type) {
            let names: Vec<&str> = task_types.iter().map(|t| t.name.as_str()).collect();
            return Err(format!(
                "the task type '{}' is not configured; the task types are: {}",
                request.task_type,
                names.join(", ")
            ));
        }
    }
    // One more than the limit is the iteration that reports reaching it; anything longer was not
    // produced by this service.
    let steps = steps_taken(&request.history);
    if steps > config.limits.max_iterations {
        return Err(format!(
            "the history has {steps} steps, more than max_iterations ({})",
            config.limits.max_iterations
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_requests_are_refused_with_a_reason() {
        let config = AgentConfig::default();
        let ok = AgentRequest {
            question: "Why?".into(),
            ..AgentRequest::default()
        };
        assert!(validate(&ok, &config, true, 100).is_ok());
        let empty = AgentRequest::default();
        assert!(validate(&empty, &config, true, 100)
            .unwrap_err()
            .contains("empty question"));
        let huge = AgentRequest {
            question: "x".repeat(config.limits.max_question_bytes + 1),
            ..AgentRequest::default()
        };
        assert!(validate(&huge, &config, true, 100)
            .unwrap_err()
            .contains("max_question_bytes"));
        let big_message = config.limits.max_message_bytes + 1;
        assert!(validate(&ok, &config, true, big_message)
            .unwrap_err()
            .contains("the request message is"));
        let grown = AgentRequest {
            history: vec![agent_schema::AgentStep::default()],
            ..ok.clone()
        };
        assert!(validate(&grown, &config, false, big_message)
            .unwrap_err()
            .contains("the dialog's history is"));
        let injected = AgentRequest {
            session_id: "x> <y".into(),
            ..ok.clone()
        };
        assert!(validate(&injected, &config, true, 100).is_err());
        let pattern = AgentRequest {
            pattern: "telepathy".into(),
            ..ok.clone()
        };
        assert!(validate(&pattern, &config, true, 100)
            .unwrap_err()
            .contains("telepathy"));
        let task_type = AgentRequest {
            task_type: "astrology".into(),
            ..ok.clone()
        };
        assert!(validate(&task_type, &config, true, 100)
            .unwrap_err()
            .contains("'astrology' is not configured"));
        let general = AgentRequest {
            task_type: "general".into(),
            ..ok
        };
        assert!(validate(&general, &config, true, 100).is_ok());
        // A routed dialog keeps its task type even if config no longer has it.
        let routed = AgentRequest {
            task_type: "astrology".into(),
            pattern: "react".into(),
            ..general
        };
        assert!(validate(&routed, &config, false, 100).is_ok());
    }
}
