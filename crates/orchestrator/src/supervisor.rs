//! One Supervisor iteration: split the request into goals and start one subagent per goal (then
//! stop: the aggregator resumes the supervisor when every subagent has completed), or, resumed with
//! the subagents' results, answer from them.

use agent_bus::BusError;
use agent_core::prompt::{describe_tools, framing_block};
use agent_core::provenance::{self, CallStats, SessionUris, Termination, ToolStats};
use agent_core::supervisor::{self as supervising, Goal};
use agent_core::tools::Scope;
use agent_schema::{AgentStep, MessageType, StepType};

use crate::react::conclude_if_limited;
use crate::Turn;

/// `arguments` key of the decompose step that names its fan-out.
const CORRELATION_KEY: &str = "correlation_id";
/// `arguments` key of the decompose step that says how many subagents it started.
const EXPECTED_KEY: &str = "expected";

pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let n = turn.request.history.len() + 1;
    // Subagents' results are answered from whatever the limits say: their work is already done.
    if let Some(results) = supervising::pending_synthesis(&turn.request.history) {
        return synthesise(turn, n, results.clone()).await;
    }
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    decompose(turn, n).await
}

async fn decompose(turn: &Turn<'_>, n: usize) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        session_id,
        ..
    } = turn;
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = scope.visible(&config.tools);
    let max = config.limits.max_subagents;
    let template = &config.prompts.supervisor_decompose;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("max_subagents", max.to_string()),
        ("tools", describe_tools(&visible)),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn.ask(n, template, &vars).await? else {
        return Ok(());
    };
    let goals = supervising::parse_goals(&completion.text, max).unwrap_or_else(|why| {
        tracing::info!(%why, "no usable goals; the whole request goes to one subagent");
        vec![Goal {
            goal: request.question.clone(),
            pattern: agent_core::router::REACT.to_owned(),
            group: None,
        }]
    });
    let cid = supervising::correlation_id(session_id, n);
    let listing: Vec<String> = goals
        .iter()
        .enumerate()
        .map(|(i, g)| format!("{i}. {} ({})", g.goal, g.pattern))
        .collect();
    let thought = format!("Splitting the request into {} goals.", goals.len());
    let mut continuation = (*request).clone();
    continuation.session_id = session_id.to_string();
    continuation.history.push(AgentStep {
        thought: thought.clone(),
        action: "decompose".to_owned(),
        arguments: [
            (CORRELATION_KEY.to_owned(), cid.clone()),
            (EXPECTED_KEY.to_owned(), goals.len().to_string()),
        ]
        .into(),
        observation: listing.join("\n"),
        step_type: StepType::Decompose.as_str().to_owned(),
        ..AgentStep::default()
    });
    let sessions: Vec<(String, String)> = goals
        .iter()
        .enumerate()
        .map(|(i, g)| (g.goal.clone(), supervising::subagent_session(&cid, i)))
        .collect();
    out.chunk(MessageType::Thought, &thought, &uris.thought(n), true)
        .await?;
    out.chunk(
        MessageType::Observation,
        &listing.join("\n"),
        &uris.fanout(&cid),
        true,
    )
    .await?;
    // The fan-out is recorded (with what resumes the supervisor) before any subagent exists.
    out.explain(
        &uris.fanout(&cid),
        provenance::fanout(
            uris,
            n,
            &cid,
            &sessions,
            &String::from_utf8_lossy(&agent_schema::encode(&continuation)),
            out.client_id(),
            &chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
            provenance::DialogSoFar {
                in_token: turn.tokens_before.0 + stats.in_token,
                out_token: turn.tokens_before.1 + stats.out_token,
                started_ms: out.started_ms(),
            },
            &stats,
        ),
    )
    .await?;
    out.flush().await?;
    for (i, goal) in goals.iter().enumerate() {
        let sub = supervising::subagent_request(request, session_id, &cid, i, goal, goals.len());
        out.spawn(&sub).await?;
    }
    Ok(())
}

async fn synthesise(
    turn: &Turn<'_>,
    n: usize,
    results: std::collections::BTreeMap<String, String>,
) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    // The fan-out being answered: the last decompose step names it and its size.
    let decompose = request
        .history
        .iter()
        .rev()
        .find(|s| StepType::parse(&s.step_type) == Some(StepType::Decompose));
    let argument = |key: &str| decompose.and_then(|s| s.arguments.get(key)).cloned();
    let cid = argument(CORRELATION_KEY).unwrap_or_default();
    let lines: Vec<String> = results
        .iter()
        .map(|(goal, result)| format!("- {goal}: {result}"))
        .collect();
    let template = &config.prompts.supervisor_synthesise;
    let vars = [
        ("framing", framing_block(&request.framing)),
        ("question", request.question.clone()),
        ("results", lines.join("\n")),
    ]
    .into_iter()
    .collect();
    let Some((completion, stats)) = turn.ask(n, template, &vars).await? else {
        return Ok(());
    };
    let answer = completion.text.trim().to_owned();
    let expected = argument(EXPECTED_KEY)
        .and_then(|e| e.parse::<usize>().ok())
        .unwrap_or(results.len())
        .min(agent_core::plan::MAX_PLAN_STEPS.max(config.limits.max_subagents));
    let completions: Vec<String> = (0..expected)
        .map(|i| SessionUris::new(&supervising::subagent_session(&cid, i)).completion())
        .collect();
    out.explain(
        &uris.synthesis(&cid),
        provenance::synthesis(uris, &cid, &completions, &stats),
    )
    .await?;
    if request.streaming {
        out.chunk(MessageType::Answer, &answer, &uris.conclusion(), false)
            .await?;
    }
    out.explain(
        &uris.conclusion(),
        provenance::conclusion_from(
            uris,
            &uris.synthesis(&cid),
            n,
            "",
            &answer,
            Termination::Answer,
            &[],
            &CallStats::default(),
        ),
    )
    .await?;
    let tokens = crate::tokens_after(turn, &stats, &ToolStats::default());
    crate::finish::answer(turn, &answer, tokens, &completion.model).await
}
