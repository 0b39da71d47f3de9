//! What one step of a dialog works with ([`Turn`]: its request, its output, the configuration and
//! clients) and what its LLM calls cost.

use std::collections::BTreeMap;
use std::time::Duration;

use agent_core::config::AgentConfig;
use agent_core::prompt::{render, PromptTemplate};
use agent_core::provenance::{self, CallStats, SessionUris, ToolStats};
use agent_core::tools::{Scope, ToolDef};
use agent_llm::{CallOptions, ChatMessage, Completion, LlmClient};
use agent_schema::{AgentRequest, AgentStep, MessageType};

use crate::budget;
use crate::emit::DialogOutput;
use crate::patterns::react;
use crate::tools;

/// The inputs of one step of a dialog.
pub struct Turn<'a> {
    pub request: &'a AgentRequest,
    pub session_id: &'a str,
    pub uris: &'a SessionUris,
    pub out: &'a DialogOutput<'a>,
    pub config: &'a AgentConfig,
    pub llm: &'a LlmClient,
    /// The graph store the knowledge tools read, when one is shared.
    pub knowledge: Option<&'a agent_graph::GraphStore>,
    /// Where long texts are kept as documents (claim-check), when anywhere.
    pub documents: Option<&'a crate::documents::DocumentStore>,
    /// This process's MCP sessions.
    pub mcp: &'a agent_mcp::McpPool,
    /// Tokens the dialog used before this step.
    pub tokens_before: budget::Tokens,
    /// Tokens the whole run (the root request and every subagent) used before this step.
    pub run_tokens: u64,
    /// Iterations the whole run took before this step (see `Limits::max_run_iterations`).
    pub run_iterations: usize,
    /// A subagent whose fan-out (or one above it) was answered without it: it stops.
    pub abandoned: bool,
    /// The key that seals subagent requests, fan-outs and completions, when one is configured.
    pub seal: Option<&'a agent_bus::seal::SealKey>,
    /// Time since the run's first message was taken up.
    pub elapsed: std::time::Duration,
    /// Whether an outage may still park this step (its window is open).
    pub may_park: bool,
    /// The cancel of this dialog's run (or of a supervisor above it), if one was heard: the step
    /// only ends the dialog.
    pub cancelled: Option<std::sync::Arc<crate::cancel::Cancel>>,
    /// The properties the step's message came with (kept with a step parked for approval, which
    /// resumes as that message).
    pub delivered: &'a agent_bus::Properties,
    /// The step's record of its LLM calls, and the recorded results a replay gives again.
    pub replay: &'a crate::replay::StepReplay,
    /// The documents this step has kept (see [`Turn::check_in`]).
    pub kept_documents: std::sync::Mutex<std::collections::BTreeSet<String>>,
    /// LLM calls this step made whose own nodes record their cost (the step critic's verdicts)
    /// and that the dialog's tokens count only where the step goes on: a step that fails after
    /// them counts them in its closing (see `finish::fail`).
    pub recorded_calls: std::sync::Mutex<CallStats>,
}

impl Turn<'_> {
    /// The tools this request may see, as its prompts describe them: an MCP tool configured
    /// without arguments is shown with those its server lists.
    pub async fn visible_tools(&self, scope: &Scope) -> Vec<ToolDef> {
        let limit = Duration::from_secs(self.config.limits.tool_timeout_secs);
        // Asked all at once: servers that do not answer cost the step one wait, not one each.
        let described = scope.visible(&self.config.tools).into_iter().map(|tool| async move {
            let mut tool = tool.clone();
            if tool.kind == agent_core::tools::MCP_TOOL && tool.arguments.is_empty() {
                match tools::mcp_arguments(self, &tool, limit).await {
                    Ok(arguments) => tool.arguments = arguments,
                    Err(e) => {
                        tracing::warn!(tool = %tool.name, error = %e, "the MCP tool's arguments are not known")
                    }
                }
            }
            tool
        });
        futures::future::join_all(described).await
    }

    /// Options of a call whose answer must be a JSON object: the server's JSON mode where the
    /// model's options say the server has one.
    pub fn json_call(&self) -> CallOptions {
        CallOptions {
            json_object: self.config.model_options(self.llm.model()).json_mode,
            ..CallOptions::default()
        }
    }

    /// Options of a call answered in the ReACT text protocol: the stop sequence at an imagined
    /// observation, where the model's options allow it.
    pub fn react_call(&self) -> CallOptions {
        let stop = if self.config.model_options(self.llm.model()).stop_sequences {
            vec![react::OBSERVATION_STOP.to_owned()]
        } else {
            Vec::new()
        };
        CallOptions {
            stop,
            ..CallOptions::default()
        }
    }

    /// Which budget (tokens, iterations or wall time) the run has used up before this step, if
    /// any.
    pub fn spent_budget(&self) -> Option<agent_core::config::SpentBudget> {
        self.config
            .limits
            .spent_budget(self.run_tokens, self.run_iterations, self.elapsed)
    }

    /// One LLM call on a configured prompt filled with `vars`, and what it cost. `None` when the
    /// call failed: the dialog has then ended (iteration `n`) with that error, or the step was
    /// parked by an outage.
    pub async fn ask(
        &self,
        n: usize,
        template: &PromptTemplate,
        vars: &BTreeMap<&str, String>,
        options: &CallOptions,
    ) -> Result<Option<(Completion, CallStats)>, agent_bus::BusError> {
        self.ask_checked(n, template, vars, options, Ok).await
    }

    /// [`Turn::ask`], its answer passed through `check` first (a refusal is a failed call).
    async fn ask_checked(
        &self,
        n: usize,
        template: &PromptTemplate,
        vars: &BTreeMap<&str, String>,
        options: &CallOptions,
        check: fn(Completion) -> Result<Completion, agent_llm::LlmError>,
    ) -> Result<Option<(Completion, CallStats)>, agent_bus::BusError> {
        let messages = [
            ChatMessage::system(template.system.clone()),
            ChatMessage::user(render(&template.template, vars)),
        ];
        match self
            .llm
            .complete_with(&messages, options)
            .await
            .and_then(check)
        {
            Ok(completion) => {
                let stats = call_stats(&completion);
                Ok(Some((completion, stats)))
            }
            Err(e) => {
                crate::finish::llm_failed(self, n, &e).await?;
                Ok(None)
            }
        }
    }
}

impl Turn<'_> {
    /// [`Turn::ask`] for what the dialog gives as an answer (or a draft of one): a reply with no
    /// text is a failed call (see [`answer_text`]).
    pub async fn ask_for_answer(
        &self,
        n: usize,
        template: &PromptTemplate,
        vars: &BTreeMap<&str, String>,
        options: &CallOptions,
    ) -> Result<Option<(Completion, CallStats)>, agent_bus::BusError> {
        self.ask_checked(n, template, vars, options, |completion| {
            answer_text(Ok(completion))
        })
        .await
    }

    /// Claim-check (see `GraphStore::check_in`) through the step's document store; without one
    /// the text stays whole. A text this step has already kept is not written again (a plan step's
    /// result is also its observation): one store write per document and step.
    pub async fn check_in(&self, text: String) -> String {
        use agent_core::documents::{
            document_uri, excerpt_with_reference, reference, wants_check_in,
        };
        let Some(store) = self.documents else {
            return text;
        };
        if !wants_check_in(&text) {
            return text;
        }
        let uri = document_uri(&text);
        if crate::emit::locked(&self.kept_documents).contains(&uri) {
            return excerpt_with_reference(&text, &uri);
        }
        let carried = store.check_in_as(text, &uri).await;
        if reference(&carried).is_some() {
            crate::emit::locked(&self.kept_documents).insert(uri);
        }
        carried
    }

    /// Publishes iteration `n`'s observation (a chunk to the client; provenance, with `extra`
    /// triples about it) and queues the next iteration with `step` added to the history and, when
    /// given, `next_state` as its state.
    pub async fn observe_and_continue(
        &self,
        n: usize,
        step: AgentStep,
        tool: ToolStats,
        extra: Vec<agent_schema::Triple>,
        next_state: Option<String>,
        tokens: budget::Tokens,
    ) -> Result<(), agent_bus::BusError> {
        let observation = self.uris.observation(n);
        // Held for the commit unless the document store is written first (a claim-check, a fold):
        // the client would wait for those writes too, where sent now its receipt overlaps them.
        let stores_first = self.documents.is_some()
            && (agent_core::documents::wants_check_in(&step.observation)
                || agent_core::documents::long_enough_to_fold(
                    &self.request.history,
                    1,
                    agent_core::documents::FOLD_KEEP,
                ));
        if stores_first {
            self.out
                .chunk(
                    MessageType::Observation,
                    &step.observation,
                    &observation,
                    true,
                )
                .await?;
        } else {
            self.out
                .chunk_with_outcome(
                    MessageType::Observation,
                    &step.observation,
                    &observation,
                    true,
                )
                .await?;
        }
        let mut triples = provenance::observation(self.uris, n, &step.observation, tool);
        triples.extend(extra);
        self.out.explain(&observation, triples)?;
        // The client and the graph have the whole observation; the next message may carry an
        // excerpt of it (see `documents`).
        let mut step = step;
        step.observation = self.check_in(step.observation).await;
        let mut next = self.request.clone();
        next.history.push(step);
        if let Some(store) = self.documents {
            next.history = crate::documents::fold(store, next.history).await;
        }
        if next_state.is_some() {
            next.state = next_state;
        }
        next.session_id = self.session_id.to_owned();
        self.out.next(&next, tokens, &[])
    }
}

/// What an LLM call cost, for provenance.
/// A reply the dialog is to give as its answer (a synthesis, a reconciliation, a plan's or a
/// writer's answer or draft), without a reasoning model's `<think>` block, and refused when it
/// has no text: a server that answers `content: ""`
/// (a content filter, a model that spent its length on reasoning, a stream that ended at once)
/// gave the client an empty answer, recorded as the dialog's conclusion. Asking again would most
/// likely give the same, so it ends the dialog as any call that failed does, saying why.
pub fn answer_text(
    completion: Result<Completion, agent_llm::LlmError>,
) -> Result<Completion, agent_llm::LlmError> {
    let mut completion = completion?;
    // A reasoning model's `<think>` block is not the answer (nor, alone, is it one).
    let answer = agent_core::react::without_think(&completion.text);
    if answer.len() != completion.text.len() {
        completion.text = answer.to_owned();
    }
    if completion.text.trim().is_empty() {
        return Err(agent_llm::LlmError::NoContent(format!(
            "an empty answer{}",
            if completion.cut_off {
                " (stopped at its length limit)"
            } else {
                ""
            }
        )));
    }
    Ok(completion)
}

pub fn call_stats(completion: &Completion) -> CallStats {
    let mut stats = CallStats::default();
    add_call(&mut stats, completion);
    stats
}

/// The dialog's tokens after this iteration's LLM calls (`stats`) and tool run (`tool`).
pub fn tokens_after(turn: &Turn<'_>, stats: &CallStats, tool: &ToolStats) -> budget::Tokens {
    turn.tokens_before
        .plus(stats.in_token, stats.out_token)
        .plus(tool.in_token, tool.out_token)
}

/// Adds an LLM call's cost to `stats` (an iteration that asks more than once).
pub fn add_call(stats: &mut CallStats, completion: &Completion) {
    stats.duration_ms += completion.duration.as_millis() as u64;
    // Saturating: the counts are the LLM server's to say.
    stats.in_token = stats.in_token.saturating_add(completion.in_token);
    stats.out_token = stats.out_token.saturating_add(completion.out_token);
    stats.model.clone_from(&completion.model);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server's usage of `u64::MAX` for each of an iteration's two calls (the meta-router asks
    /// twice) overflowed the sum: a panic in debug builds, wrapped counts in release.
    #[test]
    fn an_iterations_calls_add_up_without_overflow() {
        let huge = Completion {
            in_token: u64::MAX,
            out_token: u64::MAX,
            ..Completion::default()
        };
        let mut stats = CallStats::default();
        add_call(&mut stats, &huge);
        add_call(&mut stats, &huge);
        assert_eq!((stats.in_token, stats.out_token), (u64::MAX, u64::MAX));
    }
}
