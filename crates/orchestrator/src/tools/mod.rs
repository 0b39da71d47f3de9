//! Every tool the orchestrator runs, in one place: the LLM's choice checked against its scope,
//! then the tool run (an LLM call, the knowledge tools over the graph, an MCP server's tool). Every
//! failure becomes an `Error: ...` observation so the loop goes on. Which tools exist and who may
//! see them is configuration (`agent_core::tools`).

pub mod knowledge;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agent_core::config::AgentConfig;
use agent_core::prompt::{render, PromptTemplate};
use agent_core::provenance::ToolStats;
use agent_core::tools::{Scope, ToolArgument, ToolDef, MCP_TOOL};
use agent_graph::GraphStore;
use agent_llm::{ChatMessage, LlmClient};
use agent_mcp::{Endpoint, McpPool};

use crate::turn::Turn;

/// What a tool may use besides its arguments.
pub struct ToolContext<'a> {
    pub config: &'a AgentConfig,
    pub llm: &'a LlmClient,
    /// The prompt that wraps an LLM-backed tool's request.
    pub wrapper: &'a PromptTemplate,
    /// The graph store holding the collections `knowledge-query` and `sparql-query` read.
    pub knowledge: Option<&'a GraphStore>,
    pub mcp: &'a McpPool,
    /// Longest observation, in bytes.
    pub max_bytes: usize,
    /// Where an LLM-backed tool that meets a provider outage parks the step (while the outage
    /// window is open): an outage is not the tool's answer.
    pub parks: Option<&'a crate::emit::DialogOutput<'a>>,
}

/// How a tool run went. The observation says it to the LLM in words; this says it to the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolOutcome {
    /// The tool answered.
    Answered,
    /// The tool was called and failed.
    Failed,
    /// The tool did not answer within the tool timeout.
    TimedOut,
    /// The request may not use a tool of that name, or there is none: nothing was called.
    Refused,
}

impl ToolOutcome {
    /// The label of the `agent_tool_calls_total` metric.
    pub fn label(self) -> &'static str {
        match self {
            ToolOutcome::Answered => "ok",
            ToolOutcome::Failed => "error",
            ToolOutcome::TimedOut => "timeout",
            ToolOutcome::Refused => "refused",
        }
    }

    pub fn answered(self) -> bool {
        self == ToolOutcome::Answered
    }
}

/// The outcome recorded for a call the LLM asked for that was not made: a person denied it, or it
/// needed one and the step could not wait (`tg:toolOutcome`).
pub const NOT_RUN: &str = "not-run";

/// What a tool run produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolRun {
    pub outcome: ToolOutcome,
    pub observation: String,
    pub duration: Duration,
    pub in_token: u64,
    pub out_token: u64,
}

impl ToolRun {
    /// What the run cost and how it went, as its observation records it.
    pub fn stats(&self) -> ToolStats {
        ToolStats {
            duration_ms: self.duration.as_millis() as u64,
            in_token: self.in_token,
            out_token: self.out_token,
            outcome: Some(self.outcome.label()),
        }
    }
}

/// Runs the tool the LLM named, if the request may use it, and returns what it produced and the
/// dialog's state after it. Scoping is enforced here, not only in the prompt: a tool the request may
/// not see is refused even when the LLM names it. `visible` names the tools the request could see.
/// So is approval: a tool that `requires-approval` runs only when `approved` (a person answered
/// its parked call), whichever pattern asks for it. The dialog moves to the tool's `state` only
/// when the tool answered, as TrustGraph's does: a failed or timed-out call must not open the
/// tools gated on the state it would have reached.
pub async fn run_scoped_tool(
    turn: &Turn<'_>,
    scope: &Scope,
    action: &str,
    arguments: &BTreeMap<String, String>,
    visible: &[&str],
    approved: bool,
) -> (ToolRun, String) {
    run_scoped_tool_parking(
        turn,
        scope,
        (action, arguments),
        visible,
        approved,
        turn.may_park,
    )
    .await
}

/// [`run_scoped_tool`], parking the step on an outage of the tool's LLM only when `may_park`: a
/// call beside others (a research round's) must not, since the step parked runs every call of it
/// again, and a tool with effects would act once more each time.
pub async fn run_scoped_tool_parking(
    turn: &Turn<'_>,
    scope: &Scope,
    (action, arguments): (&str, &BTreeMap<String, String>),
    visible: &[&str],
    approved: bool,
    may_park: bool,
) -> (ToolRun, String) {
    let (run, next_state) = run_scoped(
        turn,
        scope,
        (action, arguments),
        visible,
        approved,
        may_park,
    )
    .await;
    if run.outcome == ToolOutcome::Answered {
        (run, next_state)
    } else {
        (run, scope.state().to_owned())
    }
}

async fn run_scoped(
    turn: &Turn<'_>,
    scope: &Scope,
    (action, arguments): (&str, &BTreeMap<String, String>),
    visible: &[&str],
    approved: bool,
    may_park: bool,
) -> (ToolRun, String) {
    let config = turn.config;
    let limits = &config.limits;
    match config.tool_by_name(action) {
        Some(tool) if scope.allows(tool) && config.needs_approval(tool) && !approved => {
            crate::events::ToolCalled {
                tool: &tool.name,
                outcome: ToolOutcome::Refused.label(),
                took: Duration::ZERO,
            }
            .emit();
            let run = ToolRun {
                outcome: ToolOutcome::Refused,
                observation: format!("Error: the tool '{action}' runs only with a person's approval, which this step cannot wait for; it was not run"),
                duration: Duration::ZERO,
                in_token: 0,
                out_token: 0,
            };
            (run, scope.state().to_owned())
        }
        Some(tool) if scope.allows(tool) => {
            // A replay gives the recorded result of the same call again: the tool is not run.
            let arguments_json = serde_json::to_string(arguments).unwrap_or_default();
            if let Some(recorded) = turn.replay.tool_result(&tool.name, &arguments_json) {
                crate::events::ToolCalled {
                    tool: &tool.name,
                    outcome: "reused",
                    took: Duration::ZERO,
                }
                .emit();
                // A recorded failure is reused as the failure it was, not as an answer: a plan
                // would mark its step completed, and the router give the error as the dialog's
                // answer. A record older than outcomes says it only in words (every failure is
                // observed as an `Error:`).
                let outcome = match recorded.outcome.as_deref() {
                    Some("ok") => ToolOutcome::Answered,
                    Some("timeout") => ToolOutcome::TimedOut,
                    Some(_) => ToolOutcome::Failed,
                    None if recorded.text.starts_with("Error:") => ToolOutcome::Failed,
                    None => ToolOutcome::Answered,
                };
                let run = ToolRun {
                    outcome,
                    observation: recorded.text,
                    duration: Duration::ZERO,
                    in_token: 0,
                    out_token: 0,
                };
                return (run, scope.next_state(tool));
            }
            let context = ToolContext {
                config,
                llm: turn.llm,
                wrapper: &config.prompts.tool_call,
                knowledge: turn.knowledge,
                mcp: turn.mcp,
                max_bytes: limits.max_observation_bytes,
                parks: may_park.then_some(turn.out),
            };
            let run = run_tool(
                &context,
                tool,
                arguments,
                Duration::from_secs(limits.tool_timeout_secs),
            )
            .await;
            (run, scope.next_state(tool))
        }
        found => {
            // The name the LLM wrote is not a label: only configured names are.
            let label = found.map_or("unknown", |t| t.name.as_str());
            crate::events::ToolCalled {
                tool: label,
                outcome: ToolOutcome::Refused.label(),
                took: Duration::ZERO,
            }
            .emit();
            let why = if found.is_some() {
                format!(
                    "Error: the tool '{action}' is not available to this request (group or state)"
                )
            } else {
                format!("Error: there is no tool named '{action}'")
            };
            let available = if visible.is_empty() {
                "none".to_owned()
            } else {
                visible.join(", ")
            };
            let run = ToolRun {
                outcome: ToolOutcome::Refused,
                observation: format!("{why}; available tools: {available}"),
                duration: Duration::ZERO,
                in_token: 0,
                out_token: 0,
            };
            (run, scope.state().to_owned())
        }
    }
}

/// Runs `tool` with `arguments`, bounded by `timeout`, and cuts the observation to the context's
/// `max_bytes`.
pub async fn run_tool(
    context: &ToolContext<'_>,
    tool: &ToolDef,
    arguments: &BTreeMap<String, String>,
    timeout: Duration,
) -> ToolRun {
    let started = Instant::now();
    let outcome = tokio::time::timeout(timeout, call(context, tool, arguments)).await;
    let fate = match &outcome {
        Ok(Ok(reply)) if reply.whole => ToolOutcome::Answered,
        Ok(_) => ToolOutcome::Failed,
        Err(_) => ToolOutcome::TimedOut,
    };
    crate::events::ToolCalled {
        tool: &tool.name,
        outcome: fate.label(),
        took: started.elapsed(),
    }
    .emit();
    let (observation, in_token, out_token) = match outcome {
        Ok(Ok(Reply {
            text,
            in_token,
            out_token,
            whole,
        })) => {
            let text = if whole {
                text
            } else {
                format!("Error: {text}")
            };
            (text, in_token, out_token)
        }
        Ok(Err(message)) => (format!("Error: {message}"), 0, 0),
        Err(_) => (
            format!(
                "Error: the tool '{}' timed out after {timeout:?}",
                tool.name
            ),
            0,
            0,
        ),
    };
    ToolRun {
        outcome: fate,
        observation: truncate(observation, context.max_bytes),
        duration: started.elapsed(),
        in_token,
        out_token,
    }
}

/// The argument `name`, or the only one given (LLMs rename arguments).
fn argument<'a>(
    tool: &ToolDef,
    arguments: &'a BTreeMap<String, String>,
    name: &str,
) -> Result<&'a String, String> {
    arguments
        .get(name)
        .or_else(|| {
            (arguments.len() == 1)
                .then(|| arguments.values().next())
                .flatten()
        })
        .ok_or_else(|| format!("the tool '{}' needs a '{name}' argument", tool.name))
}

/// The collection a knowledge tool reads (`collection` in its config, default `default`) and the
/// store that holds it.
fn collection<'a>(
    context: &ToolContext<'a>,
    tool: &'a ToolDef,
) -> Result<(&'a GraphStore, &'a str), String> {
    let store = context.knowledge.ok_or_else(|| {
        format!(
            "the tool '{}' reads the graph store, and this orchestrator has none (GRAPH_STORE as an http(s) SPARQL endpoint)",
            tool.name
        )
    })?;
    let name = tool
        .settings
        .get("collection")
        .and_then(|c| c.as_str())
        .unwrap_or("default");
    Ok((store, name))
}

/// The server an `mcp-tool` calls and the tool's name there (`remote-name`, else the `mcp` key).
fn mcp_target<'a>(config: &'a AgentConfig, tool: &ToolDef) -> Result<(Endpoint, &'a str), String> {
    let (key, server) = config.mcp_server_for(tool).ok_or_else(|| {
        format!(
            "the MCP tool '{}' names no server in the mcp config",
            tool.name
        )
    })?;
    let endpoint = Endpoint::of(server)
        .map_err(|e| format!("the MCP server of '{}' is misconfigured: {e}", tool.name))?;
    Ok((endpoint, server.remote_name.as_deref().unwrap_or(key)))
}

/// The arguments an MCP tool takes, as its server describes them.
pub async fn mcp_arguments(
    turn: &Turn<'_>,
    tool: &ToolDef,
    within: Duration,
) -> Result<Vec<ToolArgument>, String> {
    let (endpoint, remote) = mcp_target(turn.config, tool)?;
    turn.mcp.arguments(&endpoint, remote, within).await
}

/// What a tool gave: its text, the tokens its LLM spent, and whether the text is its whole answer
/// (an LLM-backed tool's model can stop at its length limit, or say nothing).
struct Reply {
    text: String,
    in_token: u64,
    out_token: u64,
    whole: bool,
}

impl Reply {
    fn whole(text: String) -> Reply {
        Reply {
            text,
            in_token: 0,
            out_token: 0,
            whole: true,
        }
    }
}

async fn call(
    context: &ToolContext<'_>,
    tool: &ToolDef,
    arguments: &BTreeMap<String, String>,
) -> Result<Reply, String> {
    let prompt = match tool.kind.as_str() {
        MCP_TOOL => {
            let (endpoint, remote) = mcp_target(context.config, tool)?;
            let text = context.mcp.call(&endpoint, remote, arguments).await?;
            return Ok(Reply::whole(text));
        }
        "knowledge-query" => {
            let (store, name) = collection(context, tool)?;
            let question = argument(tool, arguments, "question")?;
            let time_limit = Duration::from_secs(context.config.limits.tool_timeout_secs);
            let text =
                knowledge::knowledge_query(store, name, question, context.max_bytes, time_limit)
                    .await?;
            return Ok(Reply::whole(text));
        }
        "sparql-query" => {
            let (store, name) = collection(context, tool)?;
            let query = argument(tool, arguments, "query")?;
            let time_limit = Duration::from_secs(context.config.limits.tool_timeout_secs);
            let text =
                knowledge::sparql_query(store, name, query, context.max_bytes, time_limit).await?;
            return Ok(Reply::whole(text));
        }
        // TrustGraph's text-completion tool passes its one argument to the LLM as the prompt.
        "text-completion" => argument(tool, arguments, "question")?.clone(),
        "prompt" => {
            let template = tool
                .settings
                .get("template")
                .and_then(|t| t.as_str())
                .ok_or_else(|| format!("the prompt tool '{}' has no template", tool.name))?;
            // In TrustGraph's config `template` names one of its prompt service's templates; a
            // text that names none is the template itself.
            let template = context
                .config
                .prompt_templates
                .get(template)
                .map_or(template, String::as_str);
            let vars = arguments
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect();
            render(template, &vars)
        }
        other => {
            return Err(format!(
                "the tool '{}' has type '{other}', which this orchestrator cannot run yet",
                tool.name
            ))
        }
    };
    let vars = [("prompt", prompt)].into_iter().collect();
    let messages = [
        ChatMessage::system(context.wrapper.system.clone()),
        ChatMessage::user(render(&context.wrapper.template, &vars)),
    ];
    let completion = context.llm.complete(&messages).await.map_err(|e| {
        if let (true, Some(out)) = (e.is_outage(), context.parks) {
            out.park(crate::emit::Park {
                cause: format!(
                    "the LLM behind the tool '{}' is unavailable: {e}",
                    tool.name
                ),
                retry_after: e.retry_after(),
            });
        }
        format!("the tool '{}' failed: {e}", tool.name)
    })?;
    // Half a reply, or none, is no answer: a router would give it as the dialog's answer and a
    // plan would mark its step done. It is a failure that shows what the model wrote, so a
    // reasoning loop can still use it or ask again, and the tokens it cost are counted.
    let (text, whole) = if completion.text.trim().is_empty() {
        let stopped = if completion.cut_off {
            " (it stopped at its length limit)"
        } else {
            ""
        };
        (
            format!(
                "the tool '{}' got an empty reply from its model{stopped}",
                tool.name
            ),
            false,
        )
    } else if completion.cut_off {
        (
            format!(
                "the reply of the tool '{}' was cut off at the model's length limit before it ended; what it wrote: {}",
                tool.name, completion.text
            ),
            false,
        )
    } else {
        (completion.text, true)
    };
    Ok(Reply {
        text,
        in_token: completion.in_token,
        out_token: completion.out_token,
        whole,
    })
}

/// Cuts `text` to at most `max_bytes` on a character boundary and says so.
pub fn truncate(text: String, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text;
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n[output cut at {max_bytes} of {} bytes]",
        &text[..end],
        text.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_char_boundaries() {
        let cut = truncate("ééé".to_owned(), 3);
        assert!(cut.starts_with('é') && cut.contains("cut at 3 of 6"));
        assert_eq!(truncate("abc".to_owned(), 3), "abc");
    }
}
