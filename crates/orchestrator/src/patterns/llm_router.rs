//! One LLM-as-router step, with no reasoning loop: one constrained choice among the tools the
//! request may use and the other patterns (the meta-router's machinery: only a configured
//! candidate is ever taken; anything else falls back to ReACT, and the graph says why), recorded,
//! then carried out. A tool's answer is the dialog's answer; a pattern is handed the request as
//! its first iteration.

use agent_bus::BusError;
use agent_core::pattern::{Pattern, Termination};
use agent_core::provenance::{self, CallStats};
use agent_core::router::{self, Dispatch};
use agent_core::tools::Scope;
use agent_schema::AgentRequest;

use crate::finish::conclude_if_limited;
use crate::router::ROUTED_PROPERTY;
use crate::tools::run_scoped_tool;
use crate::turn::{tokens_after, Turn};

pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    let Turn {
        request,
        uris,
        out,
        config,
        ..
    } = turn;
    // A dispatched pattern runs under its own name, so a history here was not made by this
    // pattern: the dialog goes on as ReACT would.
    if !request.history.is_empty() {
        return super::react::iterate(turn).await;
    }
    if let Some(done) = conclude_if_limited(turn).await {
        return done;
    }
    let scope = Scope::new(request.group.as_deref(), request.state.as_deref());
    let visible = turn.visible_tools(&scope).await;
    let may_fan_out = agent_core::supervisor::may_fan_out(request, config.limits.max_fanout_depth);
    let candidates = router::dispatch_candidates(config, &visible, may_fan_out);
    let (system, user) = router::dispatch_prompt(
        &config.prompts.llm_router,
        &request.question,
        &request.framing,
        &candidates,
    );
    let fallback = Dispatch::Pattern(Pattern::React).name();
    let mut cost = CallStats::default();
    let (choice, answer) =
        crate::router::ask_answered(turn, system, user, &candidates, &fallback, &mut cost).await;
    if out.parked().is_some() {
        return Ok(());
    }
    let dispatch = Dispatch::parse(&choice.selected).unwrap_or(Dispatch::Pattern(Pattern::React));
    let tokens = turn.tokens_before.plus(cost.in_token, cost.out_token);
    match dispatch {
        Dispatch::Pattern(pattern) => {
            out.explain(
                &uris.dispatch(),
                provenance::dispatch_decision(uris, &choice, "", &cost),
            )?;
            let next = AgentRequest {
                pattern: pattern.name().to_owned(),
                session_id: turn.session_id.to_owned(),
                ..(*request).clone()
            };
            out.dispatch(&next, tokens, &[(ROUTED_PROPERTY, "true")])
        }
        Dispatch::Tool(tool) => {
            // The tool's arguments as the LLM gave them; any it left out get the request itself.
            let mut arguments = router::dispatch_arguments(answer.as_deref().unwrap_or(""));
            if let Some(def) = config.tool_by_name(&tool) {
                for argument in &def.arguments {
                    arguments
                        .entry(argument.name.clone())
                        .or_insert_with(|| request.question.clone());
                }
            }
            let arguments_json = serde_json::to_string(&arguments).unwrap_or_default();
            out.explain(
                &uris.dispatch(),
                provenance::dispatch_decision(uris, &choice, &arguments_json, &cost),
            )?;
            let names: Vec<&str> = visible.iter().map(|t| t.name.as_str()).collect();
            let (run, _) = run_scoped_tool(turn, &scope, &tool, &arguments, &names, false).await;
            if out.parked().is_some() {
                return Ok(());
            }
            let stats = run.stats();
            // The tool's call is iteration 1, derived from the choice that made it.
            let mut triples = provenance::tool_iteration(
                uris,
                1,
                "",
                &tool,
                &arguments_json,
                &names,
                &CallStats::default(),
            );
            triples.extend(provenance::derived_from(
                &uris.iteration(1),
                &uris.dispatch(),
            ));
            out.explain(&uris.iteration(1), triples)?;
            let tokens = tokens_after(turn, &CallStats::default(), &stats)
                .plus(cost.in_token, cost.out_token);
            if !run.outcome.answered() {
                // A tool that failed is no answer: the dialog goes on as ReACT, which sees the
                // failure and may try again or otherwise.
                let step = agent_schema::AgentStep {
                    action: tool,
                    arguments,
                    observation: run.observation,
                    ..agent_schema::AgentStep::default()
                };
                return turn
                    .observe_and_continue(1, step, stats, Vec::new(), None, tokens)
                    .await;
            }
            out.explain(
                &uris.observation(1),
                provenance::observation(uris, 1, &run.observation, stats),
            )?;
            out.explain(
                &uris.conclusion(),
                provenance::conclusion(
                    uris,
                    2,
                    "",
                    &run.observation,
                    Termination::Answer,
                    &[],
                    &CallStats::default(),
                ),
            )?;
            if request.streaming {
                out.chunk_with_outcome(
                    agent_schema::MessageType::Answer,
                    &run.observation,
                    &uris.conclusion(),
                    false,
                )
                .await?;
            }
            crate::finish::answer(turn, &run.observation, tokens, &cost.model).await
        }
    }
}
