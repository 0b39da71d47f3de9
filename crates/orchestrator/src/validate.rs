//! The checks a request passes before any work is done for it.

use agent_core::config::AgentConfig;
use agent_core::documents::steps_taken;
use agent_core::pattern::Pattern;
use agent_schema::AgentRequest;

/// The most properties a request may carry, and their bytes (names and values).
const MAX_PROPERTIES: usize = 64;
const MAX_PROPERTY_BYTES: usize = 16 * 1024;
/// The longest client id (well under the properties' bound, so a dialog's later steps, which
/// carry a few properties more, are taken as its first was).
const MAX_ID_BYTES: usize = 1024;

/// Whether `id` may name a provenance node (as a request's session, correlation or parent id):
/// at most 240 bytes of letters, digits, '-', '_', '.' and ':'. A supervisor's ids grow by a
/// short suffix per fan-out.
pub(crate) fn names_a_node(id: &str) -> bool {
    let safe = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':');
    id.len() <= 240 && id.chars().all(safe)
}

/// The first of the request's ids that may not name a provenance node, if any.
fn id_that_names_no_node(request: &AgentRequest) -> Option<&'static str> {
    [
        ("session_id", &request.session_id),
        ("correlation_id", &request.correlation_id),
        ("parent_session_id", &request.parent_session_id),
    ]
    .into_iter()
    .find(|(_, value)| !names_a_node(value))
    .map(|(field, _)| field)
}

/// Whether the request's ids may all name provenance nodes (whatever else is wrong with it).
pub(crate) fn ids_name_nodes(request: &AgentRequest) -> bool {
    id_that_names_no_node(request).is_none()
}

/// Checks a request before any work; the message is the error the client gets. `new_dialog`: the
/// first message of a dialog, not one the router queued; `payload_bytes`: the message's size.
pub(crate) fn validate(
    request: &AgentRequest,
    properties: &agent_bus::Properties,
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
    if let Some(field) = id_that_names_no_node(request) {
        return Err(format!(
            "{field} may only hold letters, digits, '-', '_', '.' and ':' (at most 240)"
        ));
    }
    // A session named as a subagent's is read as one wherever a session's place is read from its
    // name (its run's budget, a cancel of the supervisor above it, the fan-out depth): a client's
    // `x-f1-s0` would spend from, and be cancelled with, run `x`.
    if !agent_core::supervisor::is_subagent(request)
        && agent_core::supervisor::place_of(&request.session_id).is_some()
    {
        return Err("session_id ends as a subagent's does (-f{n}-s{i}), which is kept for the subagents the orchestrator starts; choose another (or none: one is made from the request's id)".to_owned());
    }
    // A conversation's id keys what this replica keeps of its line and goes into the graph; it
    // is the client's to choose (any text a TrustGraph client sends), so only bounded.
    if request.conversation_id.len() > 240 || request.conversation_id.contains(char::is_control) {
        return Err(
            "conversation_id may hold at most 240 bytes and no control characters".to_owned(),
        );
    }
    // Properties are copied onto every message the dialog sends (its id onto every streamed
    // chunk), and max_message_bytes counts only the payload.
    let property_bytes: usize = properties.iter().map(|(k, v)| k.len() + v.len()).sum();
    let id_bytes = properties
        .get(agent_schema::ID_PROPERTY)
        .map_or(0, String::len);
    if id_bytes > MAX_ID_BYTES {
        return Err(format!(
            "the message's id is {id_bytes} bytes; at most {MAX_ID_BYTES} are taken"
        ));
    }
    if properties.len() > MAX_PROPERTIES || property_bytes > MAX_PROPERTY_BYTES {
        return Err(format!(
            "the message has {} properties of {property_bytes} bytes; at most {MAX_PROPERTIES} of {MAX_PROPERTY_BYTES} bytes are taken",
            properties.len()
        ));
    }
    // A plan in the history is not one this service checked as it made it (it lists each
    // dependency once, a plan of an earlier build maybe twice): a step may not list more distinct
    // dependencies than the plan has steps, nor more than four times that in all (each listing
    // is written to the graph and the prompts that describe the plan).
    for plan in request.history.iter().filter_map(|step| step.plan.as_ref()) {
        let distinct = |step: &agent_schema::PlanStep| {
            step.depends_on
                .iter()
                .collect::<std::collections::BTreeSet<_>>()
                .len()
        };
        let too_many = |step: &agent_schema::PlanStep| {
            distinct(step) > plan.len() || step.depends_on.len() > 4 * plan.len()
        };
        if plan.iter().any(too_many) {
            return Err(format!(
                "a plan in the history lists more distinct dependencies for a step than its {} steps, or more than {} listings",
                plan.len(),
                4 * plan.len()
            ));
        }
    }
    // What a prompt resolves and describes grows with these: no plan this service makes is
    // longer than twice its cap (a split may pass it once), and no fan-in step holds more results
    // than its rounds of subagents can bring.
    let most_plan = 2 * agent_core::plan::MAX_PLAN_STEPS;
    if let Some(plan) = request
        .history
        .iter()
        .filter_map(|step| step.plan.as_ref())
        .find(|plan| plan.len() > most_plan)
    {
        return Err(format!(
            "a plan in the history has {} steps; at most {most_plan} are taken",
            plan.len()
        ));
    }
    let most_results = config
        .limits
        .max_subagents
        .max(agent_core::plan::MAX_PLAN_STEPS)
        .saturating_mul(config.limits.max_iterations.saturating_add(1));
    if let Some(results) = request
        .history
        .iter()
        .filter_map(|step| step.subagent_results.as_ref())
        .find(|results| results.len() > most_results)
    {
        return Err(format!(
            "a step in the history carries {} subagent results; at most {most_results} are taken",
            results.len()
        ));
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

    /// [`validate`] of a request with no properties.
    fn validate_plain(
        request: &AgentRequest,
        config: &AgentConfig,
        new_dialog: bool,
        payload_bytes: usize,
    ) -> Result<(), String> {
        validate(
            request,
            &Default::default(),
            config,
            new_dialog,
            payload_bytes,
        )
    }

    #[test]
    fn what_a_request_carries_beside_its_question_is_bounded() {
        let config = AgentConfig::default();
        let ok = AgentRequest {
            question: "Why?".into(),
            conversation_id: "chat with: Ann 😀".into(),
            ..AgentRequest::default()
        };
        assert!(validate_plain(&ok, &config, true, 100).is_ok());
        for conversation_id in ["x".repeat(241), "a\nb".to_owned()] {
            let bad = AgentRequest {
                conversation_id,
                ..ok.clone()
            };
            assert!(validate_plain(&bad, &config, true, 100)
                .unwrap_err()
                .contains("conversation_id"));
        }
        let mut properties = agent_bus::Properties::new();
        properties.insert("id".into(), "x".repeat(MAX_ID_BYTES + 1));
        assert!(validate(&ok, &properties, &config, true, 100)
            .unwrap_err()
            .contains("id is"));
        properties.insert("id".into(), "x".repeat(MAX_ID_BYTES));
        assert!(validate(&ok, &properties, &config, true, 100).is_ok());
        properties.insert("note".into(), "x".repeat(MAX_PROPERTY_BYTES));
        assert!(validate(&ok, &properties, &config, true, 100)
            .unwrap_err()
            .contains("properties"));
        let many: agent_bus::Properties = (0..=MAX_PROPERTIES)
            .map(|i| (format!("p{i}"), String::new()))
            .collect();
        assert!(validate(&ok, &many, &config, true, 100).is_err());
        let listed_over_and_over = agent_schema::PlanStep {
            goal: "b".into(),
            depends_on: (0..1000).collect(),
            ..Default::default()
        };
        let history = vec![agent_schema::AgentStep {
            step_type: "plan".into(),
            plan: Some(vec![listed_over_and_over]),
            ..Default::default()
        }];
        let planned = AgentRequest {
            history,
            ..ok.clone()
        };
        assert!(validate_plain(&planned, &config, false, 100)
            .unwrap_err()
            .contains("dependencies"));
        // One listed twice is taken (a plan of an earlier build may), one listed over and over not.
        let mut repeated = planned.clone();
        for (times, taken) in [(4, true), (1000, false)] {
            if let Some(plan) = repeated.history[0].plan.as_mut() {
                plan[0].depends_on = vec![0; times];
            }
            assert_eq!(
                validate_plain(&repeated, &config, false, 100).is_ok(),
                taken
            );
        }
    }

    #[test]
    fn a_history_with_an_overlong_plan_or_too_many_results_is_refused() {
        let config = AgentConfig::default();
        let step = |plan: Option<Vec<agent_schema::PlanStep>>, results: usize| AgentRequest {
            question: "q".into(),
            history: vec![agent_schema::AgentStep {
                plan,
                subagent_results: (results > 0).then(|| {
                    (0..results)
                        .map(|i| (format!("{i:03}"), "r".to_owned()))
                        .collect()
                }),
                ..agent_schema::AgentStep::default()
            }],
            ..AgentRequest::default()
        };
        let plan = |len: usize| Some(vec![agent_schema::PlanStep::default(); len]);
        let most_plan = 2 * agent_core::plan::MAX_PLAN_STEPS;
        assert_eq!(
            validate_plain(&step(plan(most_plan), 0), &config, false, 100),
            Ok(())
        );
        assert!(validate_plain(&step(plan(most_plan + 1), 0), &config, false, 100).is_err());
        assert_eq!(validate_plain(&step(None, 20), &config, false, 100), Ok(()));
        assert!(validate_plain(&step(None, 8_000), &config, false, 100)
            .is_err_and(|e| e.contains("subagent results")));
    }

    #[test]
    fn invalid_requests_are_refused_with_a_reason() {
        let config = AgentConfig::default();
        let ok = AgentRequest {
            question: "Why?".into(),
            ..AgentRequest::default()
        };
        assert!(validate_plain(&ok, &config, true, 100).is_ok());
        let empty = AgentRequest::default();
        assert!(validate_plain(&empty, &config, true, 100)
            .unwrap_err()
            .contains("empty question"));
        let huge = AgentRequest {
            question: "x".repeat(config.limits.max_question_bytes + 1),
            ..AgentRequest::default()
        };
        assert!(validate_plain(&huge, &config, true, 100)
            .unwrap_err()
            .contains("max_question_bytes"));
        let big_message = config.limits.max_message_bytes + 1;
        assert!(validate_plain(&ok, &config, true, big_message)
            .unwrap_err()
            .contains("the request message is"));
        let grown = AgentRequest {
            history: vec![agent_schema::AgentStep::default()],
            ..ok.clone()
        };
        assert!(validate_plain(&grown, &config, false, big_message)
            .unwrap_err()
            .contains("the dialog's history is"));
        let injected = AgentRequest {
            session_id: "x> <y".into(),
            ..ok.clone()
        };
        assert!(validate_plain(&injected, &config, true, 100).is_err());
        // A client's session named as a subagent's; the subagent itself is taken.
        let posing = AgentRequest {
            session_id: "x-f1-s0".into(),
            ..ok.clone()
        };
        assert!(validate_plain(&posing, &config, true, 100)
            .unwrap_err()
            .contains("subagent"));
        let subagent = AgentRequest {
            parent_session_id: "x".into(),
            correlation_id: "x-f1".into(),
            subagent_goal: "part".into(),
            expected_siblings: 1,
            ..posing.clone()
        };
        assert!(validate_plain(&subagent, &config, true, 100).is_ok());
        let named_like_one = AgentRequest {
            session_id: "report-f2".into(),
            ..ok.clone()
        };
        assert!(validate_plain(&named_like_one, &config, true, 100).is_ok());
        let pattern = AgentRequest {
            pattern: "telepathy".into(),
            ..ok.clone()
        };
        assert!(validate_plain(&pattern, &config, true, 100)
            .unwrap_err()
            .contains("telepathy"));
        let task_type = AgentRequest {
            task_type: "astrology".into(),
            ..ok.clone()
        };
        assert!(validate_plain(&task_type, &config, true, 100)
            .unwrap_err()
            .contains("'astrology' is not configured"));
        let general = AgentRequest {
            task_type: "general".into(),
            ..ok
        };
        assert!(validate_plain(&general, &config, true, 100).is_ok());
        // A routed dialog keeps its task type even if config no longer has it.
        let routed = AgentRequest {
            task_type: "astrology".into(),
            pattern: "react".into(),
            ..general
        };
        assert!(validate_plain(&routed, &config, false, 100).is_ok());
    }
}
