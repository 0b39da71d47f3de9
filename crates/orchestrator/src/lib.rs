//! The agent orchestrator: consumes `AgentRequest`s on a Shared subscription, runs one step per
//! message (routing a new dialog, or one iteration of its pattern), and publishes responses,
//! provenance and the `next` request before acking. No dialog state lives in the process, so any
//! replica can take any step.

pub mod approval;
pub mod budget;
pub mod cancel;
pub mod conversation;
pub mod documents;
pub mod emit;
pub mod events;
pub mod finish;
pub mod journal;
pub mod live_config;
pub mod metrics;
pub mod ops;
pub mod patterns;
pub mod replay;
pub mod review;
pub mod router;
pub mod settings;
pub mod stream;
pub mod tools;
pub mod turn;

use std::sync::Arc;
use std::time::Duration;

use agent_bus::{
    run_consumer, ConsumerStats, Delivery, Disposition, Publisher, SubscriptionConfig,
};
use agent_core::config::{AgentConfig, ConversationPolicy};
use agent_core::documents::steps_taken;
use agent_core::pattern::Pattern;
use agent_core::provenance::{self, CallStats, SessionUris};
use agent_llm::LlmClient;
use agent_schema::{AgentRequest, AgentResponse, ID_PROPERTY};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::emit::{
    DialogOutput, JournalSlot, Outputs, Publishers, Recorder, IN_TOKEN_PROPERTY,
    OUT_TOKEN_PROPERTY, RUN_TOKENS_PROPERTY, STARTED_PROPERTY,
};
use crate::journal::Journal;
use crate::live_config::LiveConfig;
pub use crate::settings::{check_config_dir, load_config_dir, Settings};
use crate::turn::Turn;

/// What an iteration needs, shared by every in-flight message.
pub struct Engine {
    pub config: Arc<LiveConfig>,
    pub llm: LlmClient,
    pub outputs: Outputs,
    /// Without one, iterations are at-least-once: a redelivery runs the step again.
    pub journal: Option<Journal>,
    /// The shared graph store, for the knowledge tools.
    pub knowledge: Option<agent_graph::GraphStore>,
    pub mcp: agent_mcp::McpPool,
    /// Cancelled when the process is to stop: a parked step then leaves its message for another
    /// replica instead of waiting on.
    pub shutdown: CancellationToken,
    /// Seals what only this service may send (subagent requests, fan-outs, completions).
    pub seal: Option<agent_bus::seal::SealKey>,
    /// The cancelled runs this replica has heard of.
    pub cancellations: Arc<cancel::Cancellations>,
    /// Answers to parked calls being taken up, one per call at a time.
    pub answering: approval::OneAtATime,
    /// Where this service sends a cancel itself (a conversation's `interrupt` policy).
    pub control: Option<Publisher>,
}

/// How a delivery is taken up.
#[derive(Debug, Clone, Copy)]
enum Attempt<'a> {
    /// Run the step; `may_park`: an outage may still set it aside (its window is open).
    Run { may_park: bool },
    /// The step cannot be run (an outage outlasted its window, a fault that will not pass, a
    /// message the broker gave up on): end the dialog with this error, unless the step's outcome
    /// is already journaled.
    GiveUp(&'a str),
}

/// What became of a delivery.
#[derive(Debug)]
enum Settled {
    Done,
    /// Set aside by an outage; nothing was committed.
    Parked(emit::Park),
    /// Waiting for another dialog of its conversation to end (`conversation_policy: queue`);
    /// nothing was committed.
    Queued(String),
}

/// Where a step stands in its run (see [`Engine::standing`]).
struct Standing {
    /// The dialog's tokens before this step.
    tokens_before: budget::Tokens,
    /// When the run's first message was taken up.
    started_ms: u64,
    /// The run's tokens outside this dialog when it started.
    run_base: u64,
    run_uri: String,
    /// The whole run's tokens before this step.
    run_tokens: u64,
    /// A subagent whose supervisor stopped waiting for it.
    abandoned: bool,
    elapsed: Duration,
}

/// How long an answer to an approval is tried again while the graph does not show its parked
/// call (the aggregator may be behind); past it, the answer is dropped.
const ANSWER_WAIT: Duration = Duration::from_secs(120);

/// How often a dialog queued behind its conversation looks again.
const QUEUE_PAUSE: Duration = Duration::from_millis(500);

/// The shortest and longest pause between tries of a parked step.
const PARK_PAUSE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// Why a step could not complete. Its kind decides what becomes of the message, in one place
/// ([`Engine::handle`]): an outage is waited out, a fault ends the dialog with an error.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// Something the step needs is unavailable for now (the broker, the store or the journal
    /// unreachable or busy): the step is set aside and tried again while the outage window lasts.
    #[error("{0:#}")]
    Outage(anyhow::Error),
    /// A fault that would recur on every try: the dialog ends with it.
    #[error("{0:#}")]
    Fault(anyhow::Error),
}

impl From<anyhow::Error> for StepError {
    fn from(e: anyhow::Error) -> StepError {
        let passes = if let Some(graph) = e.downcast_ref::<agent_graph::GraphError>() {
            graph.retryable()
        } else {
            e.downcast_ref::<agent_bus::BusError>()
                .is_some_and(agent_bus::BusError::passes)
        };
        if passes {
            StepError::Outage(e)
        } else {
            StepError::Fault(e)
        }
    }
}

impl From<agent_bus::BusError> for StepError {
    fn from(e: agent_bus::BusError) -> StepError {
        anyhow::Error::from(e).into()
    }
}

impl From<agent_graph::GraphError> for StepError {
    fn from(e: agent_graph::GraphError) -> StepError {
        anyhow::Error::from(e).into()
    }
}

/// What the engine does next with a delivery, given how its step went.
#[derive(Debug)]
enum Next {
    /// Its effects are on the broker (or there were none to make): ack it.
    Ack,
    /// Wait out an outage, then run the step again.
    Park(emit::Park),
    /// Wait for the conversation's running dialog, then run the step again (not an outage: it
    /// does not count against the outage window).
    Queue(String),
    /// End its dialog with this error; then ack, or nack if even that cannot be published.
    GiveUp(String),
}

/// The one place a step's result becomes a decision. `window` is the outage window, for the
/// error that says it was outlasted; `may_park` whether it is still open.
fn next_after(result: Result<Settled, StepError>, may_park: bool, window: Duration) -> Next {
    match result {
        Ok(Settled::Done) => Next::Ack,
        Ok(Settled::Parked(park)) => Next::Park(park),
        Ok(Settled::Queued(why)) => Next::Queue(why),
        Err(StepError::Outage(e)) if may_park => Next::Park(emit::Park {
            cause: format!("{e:#}"),
            retry_after: None,
        }),
        Err(StepError::Outage(e)) => Next::GiveUp(format!(
            "a service this step needs stayed unavailable past the outage window of {} s (max_outage_secs): {e:#}",
            window.as_secs()
        )),
        Err(StepError::Fault(e)) => Next::GiveUp(format!("the step failed: {e:#}")),
    }
}

impl Engine {
    /// Handles one delivered request; the returned disposition decides ack or nack.
    ///
    /// An outage (the LLM, the store or the broker unavailable) parks the step: it is tried again
    /// with growing pauses (the provider's `Retry-After` honoured up to 30 s) while the outage window
    /// (`max_outage_secs`) lasts; past it, or on a fault that will not pass, the dialog ends with
    /// an error naming the cause. The message is never nacked for an outage, so the broker's
    /// redelivery limit counts crashes, not waiting.
    pub async fn handle(&self, delivery: Delivery<AgentRequest>) -> Disposition {
        self.run_step(delivery, None).await
    }

    /// [`Engine::handle`] for a step that is either the one its message asks for, or (`answer`)
    /// the resumption of that step, parked for approval, with the answer it got.
    async fn run_step(
        &self,
        delivery: Delivery<AgentRequest>,
        answer: Option<&approval::Answer>,
    ) -> Disposition {
        let mut outage: Option<std::time::Instant> = None;
        let mut pause = PARK_PAUSE.0;
        loop {
            let window = Duration::from_secs(self.config.current().limits.max_outage_secs);
            let may_park = outage.map_or(!window.is_zero(), |since| since.elapsed() < window);
            // Boxed: a step's future is large (every pattern's state), and a worker's stack is
            // not (a debug build overflowed it once resumption joined the step).
            let result =
                Box::pin(self.handle_inner(delivery.clone(), Attempt::Run { may_park }, answer))
                    .await;
            let park = match next_after(result, may_park, window) {
                Next::Ack => return Disposition::Ack,
                Next::Queue(why) => {
                    tracing::debug!(%why, "queued behind its conversation");
                    tokio::select! {
                        _ = self.shutdown.cancelled() => {
                            return Disposition::Nack("shutting down while queued".to_owned())
                        }
                        _ = tokio::time::sleep(QUEUE_PAUSE) => {}
                    }
                    continue;
                }
                Next::Park(park) => park,
                Next::GiveUp(why) => return self.give_up(delivery, &why, answer).await,
            };
            let since = *outage.get_or_insert_with(std::time::Instant::now);
            let wait = park
                .retry_after
                .unwrap_or(pause)
                .clamp(PARK_PAUSE.0, PARK_PAUSE.1);
            pause = (pause * 2).min(PARK_PAUSE.1);
            events::StepParked {
                cause: &park.cause,
                outage: since.elapsed(),
                retry_in: wait,
            }
            .emit();
            tokio::select! {
                _ = self.shutdown.cancelled() => {
                    return Disposition::Nack("shutting down while parked".to_owned())
                }
                _ = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Ends the dialog of `delivery` with the error `why` (a subagent's as a failed completion, so
    /// its supervisor is not left waiting). Nacked only when even that cannot be published.
    pub async fn give_up(
        &self,
        delivery: Delivery<AgentRequest>,
        why: &str,
        answer: Option<&approval::Answer>,
    ) -> Disposition {
        events::StepGivenUp { why }.emit();
        match Box::pin(self.handle_inner(delivery, Attempt::GiveUp(why), answer)).await {
            Ok(_) => Disposition::Ack,
            Err(e) => Disposition::Nack(e.to_string()),
        }
    }

    /// Cancels the conversation's running dialog `session_id` for the new dialog `by` (policy
    /// `interrupt`): the cancel is recorded with this step's effects and heard by every replica
    /// now, as `agentctl cancel` does it.
    async fn interrupt(
        &self,
        session_id: &str,
        by: &str,
        out: &DialogOutput<'_>,
    ) -> Result<(), StepError> {
        let control = agent_schema::AgentControl {
            operation: agent_schema::control_operation::CANCEL.to_owned(),
            session_id: session_id.to_owned(),
            by: format!("dialog {by}"),
            reason: "a newer request of its conversation interrupted it (conversation_policy: interrupt)".to_owned(),
            at: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            ..agent_schema::AgentControl::default()
        };
        let uris = SessionUris::new(session_id);
        out.record(
            &uris.cancellation(),
            provenance::cancellation(&uris, &control.by, &control.at, &control.reason),
        )?;
        if let Some(cancel) = cancel::from_control(&control) {
            self.cancellations.record(cancel);
        }
        if let Some(publisher) = &self.control {
            publisher
                .send(
                    agent_schema::encode(&control),
                    &agent_bus::Properties::new(),
                )
                .await?;
        }
        Ok(())
    }

    /// Takes up an answer to a call parked for approval: resumes that step, as its message was
    /// delivered, with the decision it reached and the answer. The first answer wins (the
    /// resumption's journal slot); another changes nothing. An answer the graph has no parked call
    /// for yet is tried again for a while (the aggregator may be behind), then dropped.
    pub async fn answer(&self, delivery: Delivery<agent_schema::AgentControl>) -> Disposition {
        let control = delivery.payload;
        if !approval::is_answer(&control) {
            tracing::warn!(operation = %control.operation, session = %control.session_id, "ignoring a control request that answers no parked call");
            return Disposition::Ack;
        }
        let Some(store) = &self.knowledge else {
            tracing::warn!(session = %control.session_id, "an approval's answer needs the shared graph store (GRAPH_STORE) its call waits in; dropped");
            return Disposition::Ack;
        };
        let step = control.step.unwrap_or_default();
        let continuation = match approval::continuation(
            store,
            self.seal.as_ref(),
            &control.session_id,
            step,
        )
        .await
        {
            Ok(Some(continuation)) => continuation,
            Ok(None) => {
                let age = chrono::DateTime::parse_from_rfc3339(&control.at)
                    .map(|at| chrono::Utc::now().signed_duration_since(at))
                    .unwrap_or_default();
                if age > chrono::Duration::seconds(ANSWER_WAIT.as_secs() as i64) {
                    tracing::warn!(session = %control.session_id, step, "no call is parked for approval there; the answer is dropped");
                    return Disposition::Ack;
                }
                return Disposition::Nack("the parked call is not in the graph yet".to_owned());
            }
            Err(e) => return Disposition::Nack(format!("reading the parked call: {e}")),
        };
        if !continuation.request.session_id.is_empty()
            && continuation.request.session_id != control.session_id
        {
            tracing::warn!(session = %control.session_id, "the parked call belongs to another session; the answer is dropped");
            return Disposition::Ack;
        }
        events::ApprovalAnswered {
            session: &control.session_id,
            step,
            operation: &control.operation,
        }
        .emit();
        let _only_this_answer = self
            .answering
            .hold(&format!("{}/{step}", control.session_id))
            .await;
        let payload_bytes = agent_schema::encode(&continuation.request).len();
        let resumed = Delivery {
            payload: continuation.request,
            properties: continuation.properties,
            message_id: delivery.message_id,
            payload_bytes,
        };
        let answer = approval::Answer {
            control,
            decision: continuation.decision,
        };
        self.run_step(resumed, Some(&answer)).await
    }

    /// Where a step stands in its run: its tokens and start (carried by the message, never taken
    /// from a client), a subagent's checked against its seal or the graph's fan-out (a forged one
    /// is refused through `verdict`), and what the run has spent. `Ok(Err(park))` when the graph
    /// may only be behind.
    async fn standing(
        &self,
        request: &mut AgentRequest,
        properties: &agent_bus::Properties,
        session_id: &str,
        new_dialog: bool,
        verdict: &mut Result<(), String>,
        attempt: Attempt<'_>,
    ) -> Result<Result<Standing, emit::Park>, StepError> {
        let token = |key: &str| {
            properties
                .get(key)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let now_ms = chrono::Utc::now().timestamp_millis().max(0) as u64;
        // Limits are never taken from a client: a dialog's first message starts its run now and
        // at zero, whatever properties it carries.
        let subagent = agent_core::supervisor::is_subagent(request);
        let from_client = new_dialog && !subagent;
        let carried = |key: &str| if from_client { 0 } else { token(key) };
        let tokens_before = budget::Tokens {
            input: carried(IN_TOKEN_PROPERTY),
            output: carried(OUT_TOKEN_PROPERTY),
        };
        let mut started_ms = match carried(STARTED_PROPERTY) {
            0 => now_ms,
            started => started.min(now_ms),
        };
        let mut run_base = carried(RUN_TOKENS_PROPERTY);
        // A subagent's first message is believed only if the graph holds the fan-out that started
        // it; the run's start and the supervisor's tokens then come from there.
        // Giving up reads nothing from the store, which may be what is down.
        let store = match attempt {
            Attempt::Run { .. } => self.knowledge.as_ref(),
            Attempt::GiveUp(_) => None,
        };
        if new_dialog && subagent && verdict.is_ok() {
            if let Some(key) = &self.seal {
                // Sealed by the supervisor that spawned it: its start and budget are ours.
                let parts = emit::subagent_seal_parts(
                    request,
                    token(STARTED_PROPERTY),
                    token(RUN_TOKENS_PROPERTY),
                );
                let sealed = properties
                    .get(agent_bus::seal::SEAL_PROPERTY)
                    .is_some_and(|seal| key.verify(&parts.each_ref().map(String::as_str), seal));
                if !sealed {
                    tracing::warn!(session = %session_id, "refusing an unsealed subagent request");
                    request.parent_session_id.clear();
                    request.correlation_id.clear();
                    *verdict = Err("the request names a fan-out (parent_session_id and correlation_id) without this service's seal; only the orchestrator starts subagents".to_owned());
                    started_ms = now_ms;
                    run_base = 0;
                }
            } else if let Some(store) = store {
                match budget::fanout_of(store, request, session_id).await? {
                    Some(inherited) => {
                        if inherited.started_ms > 0 {
                            started_ms = inherited.started_ms.min(now_ms);
                        }
                        run_base = run_base.max(inherited.tokens);
                    }
                    // The aggregator may only be behind (restarting, catching up after the
                    // broker came back): wait, as for an outage, before calling it forged.
                    None if matches!(attempt, Attempt::Run { may_park: true }) => {
                        return Ok(Err(emit::Park {
                            cause: "the fan-out that started this subagent is not in the graph; a request that names a fan-out this service did not record is refused".to_owned(),
                            retry_after: None,
                        }));
                    }
                    None => {
                        tracing::warn!(session = %session_id, "refusing a subagent request that no recorded fan-out started");
                        // Not a subagent: its refusal goes to whoever sent it, not into a fan-out.
                        request.parent_session_id.clear();
                        request.correlation_id.clear();
                        *verdict = Err("the request names a fan-out (parent_session_id and correlation_id) that this service did not record; only the orchestrator starts subagents".to_owned());
                        started_ms = now_ms;
                        run_base = 0;
                    }
                }
            }
        }
        let elapsed = std::time::Duration::from_millis(now_ms.saturating_sub(started_ms));
        // Only a subagent (checked above) shares a run: a client that names its session like a
        // subagent's must not spend from someone else's budget.
        let run = if subagent {
            budget::run_of(session_id).to_owned()
        } else {
            session_id.to_owned()
        };
        let run_uri = SessionUris::new(&run).session();
        let mut run_tokens = run_base + tokens_before.total();
        let mut abandoned = false;
        // A subagent's siblings (and cousins) spend from the same budget: their calls are in the
        // graph, tagged with the run. And a subagent whose supervisor stopped waiting stops too.
        if run != session_id && verdict.is_ok() {
            if let Some(store) = store {
                run_tokens = run_tokens.max(budget::run_tokens(store, &run_uri).await?);
                abandoned = subagent && budget::abandoned(store, session_id).await?;
            }
        }
        Ok(Ok(Standing {
            tokens_before,
            started_ms,
            run_base,
            run_uri,
            run_tokens,
            abandoned,
            elapsed,
        }))
    }

    async fn handle_inner(
        &self,
        delivery: Delivery<AgentRequest>,
        attempt: Attempt<'_>,
        answer: Option<&approval::Answer>,
    ) -> Result<Settled, StepError> {
        let taken = std::time::Instant::now();
        let Delivery {
            payload: mut request,
            properties,
            message_id,
            payload_bytes,
        } = delivery;
        let id = properties.get(ID_PROPERTY).map(String::as_str);
        let session_id = session_id_for(&request, id);
        let uris = SessionUris::new(&session_id);
        let config = self.config.current();
        // The router's mark is honoured only on what the router queues: a first iteration with its
        // pattern and session set. Anything else without history is a new dialog.
        let routed = properties.contains_key(router::ROUTED_PROPERTY)
            && request.history.is_empty()
            && !request.pattern.is_empty()
            && !request.session_id.is_empty();
        let new_dialog = request.history.is_empty() && !routed;
        // Checked before anything is named after the request's ids: a hostile id must earn the
        // client an error, not fail to name a journal entry until the message is dead-lettered.
        let mut verdict = validate(&request, &config, new_dialog, payload_bytes);
        let standing = match self
            .standing(
                &mut request,
                &properties,
                &session_id,
                new_dialog,
                &mut verdict,
                attempt,
            )
            .await?
        {
            Ok(standing) => standing,
            Err(park) => return Ok(Settled::Parked(park)),
        };
        let Standing {
            tokens_before,
            started_ms,
            run_base,
            run_uri,
            run_tokens,
            abandoned,
            elapsed,
        } = standing;
        let mut out = DialogOutput::new(
            &self.outputs,
            id,
            &request.collection,
            &uris.session(),
            started_ms,
        );
        out.set_run(&run_uri, run_base);
        out.set_conversation(&request.conversation_id);
        out.set_input_history(&request.history);
        out.limit_requests(config.limits.max_message_bytes);
        let giving_up = matches!(attempt, Attempt::GiveUp(_));
        let slot = match self
            .journal_slot(
                &out,
                &request,
                &uris,
                new_dialog,
                verdict.is_err(),
                giving_up,
                answer.is_some(),
                message_id,
            )
            .await?
        {
            Lookup::Recorded => return Ok(Settled::Done),
            Lookup::Fresh(slot) => slot,
        };
        // A new dialog of a conversation: told what was asked and answered before, and not run
        // beside another of the same conversation unless the policy says so.
        let joins_conversation = new_dialog
            && verdict.is_ok()
            && answer.is_none()
            && !request.conversation_id.is_empty()
            && !agent_core::supervisor::is_subagent(&request)
            && matches!(attempt, Attempt::Run { .. });
        if let (true, Some(store)) = (joins_conversation, &self.knowledge) {
            let earlier =
                conversation::earlier(store, &request.conversation_id, &session_id).await?;
            let max_wall = Duration::from_secs(config.limits.max_wall_secs);
            let running: Vec<&conversation::Earlier> =
                earlier.iter().filter(|d| d.running(max_wall)).collect();
            if let Some(first) = running.first() {
                let conversation = &request.conversation_id;
                let other = first.session_id();
                match config.limits.conversation_policy {
                    ConversationPolicy::Queue => {
                        return Ok(Settled::Queued(format!(
                            "dialog {other} of conversation {conversation} is still running"
                        )))
                    }
                    ConversationPolicy::Reject => {
                        verdict = Err(format!("dialog {other} of conversation {conversation} is still running; this conversation takes one request at a time (conversation_policy: reject)"));
                    }
                    ConversationPolicy::Interrupt => {
                        for dialog in &running {
                            self.interrupt(dialog.session_id(), &session_id, &out)
                                .await?;
                        }
                    }
                }
            }
            if verdict.is_ok() {
                let summary = conversation::context(&earlier);
                request.framing = conversation::framed(&request.framing, &summary);
                let follows: Vec<String> = earlier.iter().map(|d| d.session_uri.clone()).collect();
                out.explain(&uris.session(), provenance::follows(&uris, &follows))?;
            }
        }
        // A request that names its pattern is not routed, but gets its task type's framing.
        let requested = (new_dialog && !request.pattern.is_empty())
            .then(|| router::requested(&request, &config));
        if let Some(decision) = &requested {
            request.framing.clone_from(&decision.framing);
            request.pattern.clone_from(&decision.pattern.selected);
        }
        let n = steps_taken(&request.history) + 1;
        let replay::StepStart {
            reuse,
            replay: step_replay,
            fork,
        } = replay::StepStart::read(
            &properties,
            &request,
            self.knowledge.as_ref(),
            matches!(attempt, Attempt::Run { .. }) && verdict.is_ok(),
        )
        .await?;
        if let Some(reuse) = &reuse {
            // Its next steps and subagents reuse too.
            out.set_property(agent_schema::REUSE_PROPERTY, reuse.label().to_owned());
            out.set_property(agent_schema::REUSE_FROM_PROPERTY, reuse.from.clone());
        }
        let llm = self.llm.taped(step_replay.tape.clone());
        let span = iteration_span(&request, &session_id, id, &properties);
        // Everything this step sends carries the step's span, so the next step (in any replica)
        // and the aggregator continue the same trace.
        if let Some(context) = agent_telemetry::trace::traceparent(&span) {
            out.set_property(agent_telemetry::trace::TRACEPARENT_PROPERTY, context);
        }
        let turn = Turn {
            request: &request,
            session_id: &session_id,
            uris: &uris,
            out: &out,
            config: &config,
            llm: &llm,
            knowledge: self.knowledge.as_ref(),
            mcp: &self.mcp,
            tokens_before,
            run_tokens,
            abandoned,
            seal: self.seal.as_ref(),
            elapsed,
            may_park: matches!(attempt, Attempt::Run { may_park: true }),
            cancelled: self.cancellations.of(&session_id),
            delivered: &properties,
            replay: &step_replay,
        };
        if let Err(problem) = verdict {
            refuse(&turn, &problem).await?;
            out.commit(slot.as_ref()).await?;
            committed(&out, "refused", false, taken);
            return Ok(Settled::Done);
        }
        if let Attempt::GiveUp(why) = attempt {
            finish::fail(&turn, n, why).await?;
            out.commit(None).await?;
            committed(&out, "given-up", false, taken);
            return Ok(Settled::Done);
        }
        let work = Box::pin(
            async {
                match answer {
                    Some(answer) => Box::pin(approval::resume(&turn, answer)).await,
                    None => {
                        let start = Start {
                            new_dialog,
                            requested: requested.as_ref(),
                            fork: fork.as_ref().map(|(f, edits)| (f, edits.as_slice())),
                            reuse: reuse.as_ref(),
                        };
                        Box::pin(begin_or_continue(&turn, start)).await
                    }
                }
            }
            .instrument(span),
        );
        // A cancelled run's step is not run: it only ends its dialog. A cancel heard while the
        // step works abandons it (an LLM stream in flight, a tool call not yet made): what it held
        // is dropped, and the same.
        let overtaken = match turn.cancelled.clone() {
            Some(cancel) => Some(cancel),
            None => tokio::select! {
                done = work => {
                    done?;
                    step_replay.record(&out, &uris, n, &run_uri);
                    None
                }
                cancel = self.cancellations.cancelled(&session_id) => Some(cancel),
            },
        };
        if let Some(cancel) = overtaken {
            out.discard();
            if new_dialog {
                record_question(&turn)?;
            }
            finish::cancelled(&turn, &cancel).await?;
        }
        if let Some(park) = out.parked() {
            return Ok(Settled::Parked(park));
        }
        // Everything this message caused must be on the broker before it is acked.
        out.commit(slot.as_ref()).await?;
        let routing = new_dialog && requested.is_none();
        let pattern = metrics_label(&request, &config, routing);
        let first_iteration = !routing && request.history.is_empty();
        committed(&out, pattern, first_iteration, taken);
        Ok(Settled::Done)
    }

    /// Where the step stands in the journal: its slot (none without a journal, or when giving up,
    /// which publishes without the journal since the store may be what is down), or
    /// [`Lookup::Recorded`] when its outcome was recorded already and has now been settled from the
    /// entry (an error must never follow an answer).
    #[allow(clippy::too_many_arguments)]
    async fn journal_slot<'e>(
        &'e self,
        out: &DialogOutput<'_>,
        request: &AgentRequest,
        uris: &SessionUris,
        new_dialog: bool,
        refused: bool,
        giving_up: bool,
        answering: bool,
        delivery: String,
    ) -> Result<Lookup<'e>, StepError> {
        let Some(journal) = &self.journal else {
            return Ok(Lookup::Fresh(None));
        };
        let mut key = journal::key(request, new_dialog && request.pattern.is_empty());
        // A parked step's resumption has a slot of its own, which the first answer takes.
        if answering {
            key.push_str("-answer");
        }
        let node = match journal::entry_node(&uris.session(), &key) {
            Ok(node) => node,
            // Only a refused request has ids that name no node; its refusal is a pure function
            // of the message, so a repeat of it is harmless.
            Err(_) if refused || giving_up => return Ok(Lookup::Fresh(None)),
            Err(e) => return Err(e.into()),
        };
        let slot = JournalSlot {
            journal,
            node,
            delivery,
        };
        // Giving up reads the journal only if it can.
        let recorded = match slot.journal.entry(&slot.node).await {
            Ok(entry) => entry,
            Err(_) if giving_up => None,
            Err(e) => return Err(e.into()),
        };
        if let Some(entry) = recorded {
            out.settle(&slot, entry, Recorder::Unknown).await?;
            return Ok(Lookup::Recorded);
        }
        Ok(Lookup::Fresh((!giving_up).then_some(slot)))
    }
}

/// A step's journal lookup.
enum Lookup<'e> {
    /// Not recorded yet: run it, recording in the slot when there is one.
    Fresh(Option<JournalSlot<'e>>),
    /// Recorded before, and settled from the entry now.
    Recorded,
}

/// Answers an invalid request: a refused subagent is a failed completion for its supervisor, not
/// the end of the client's dialog; anyone else gets an error response.
async fn refuse(turn: &Turn<'_>, problem: &str) -> Result<(), agent_bus::BusError> {
    tracing::warn!(session = %turn.session_id, %problem, "refusing an invalid request");
    if agent_core::supervisor::is_subagent(turn.request) {
        finish::error(turn, problem).await
    } else {
        turn.out.respond(&AgentResponse::error(problem.to_owned()))
    }
}

/// Logs and counts a committed step.
fn committed(
    out: &DialogOutput<'_>,
    pattern: &str,
    first_iteration: bool,
    taken: std::time::Instant,
) {
    events::StepCommitted {
        pattern,
        first_iteration,
        ended: out.ended(),
        took: taken.elapsed(),
    }
    .emit();
}

/// The session of a dialog. A first request gets one derived from its `id` property, so that a
/// redelivered first message names the same provenance nodes instead of starting a second session.
fn session_id_for(request: &AgentRequest, id: Option<&str>) -> String {
    if !request.session_id.is_empty() {
        return request.session_id.clone();
    }
    match id {
        Some(id) if !id.is_empty() => {
            uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, id.as_bytes()).to_string()
        }
        _ => uuid::Uuid::new_v4().to_string(),
    }
}

/// The step's span, in the trace its message came with (the client's, or the previous step's).
fn iteration_span(
    request: &AgentRequest,
    session_id: &str,
    id: Option<&str>,
    properties: &agent_bus::Properties,
) -> tracing::Span {
    let traceparent = properties
        .get(agent_telemetry::trace::TRACEPARENT_PROPERTY)
        .map_or("", String::as_str);
    tracing::info_span!(
        "iteration",
        session = %session_id,
        iteration = steps_taken(&request.history) + 1,
        id = id.unwrap_or(""),
        pattern = %request.pattern,
        correlation = %request.correlation_id,
        traceparent = traceparent,
    )
}

/// A new dialog's first node: the question as asked (a subagent's hanging off its supervisor's
/// fan-out, so the run is one DAG from the root).
fn record_question(turn: &Turn<'_>) -> Result<(), agent_bus::BusError> {
    let Turn {
        request, uris, out, ..
    } = turn;
    let started = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let mut question = provenance::session(uris, &request.question, &started);
    if agent_core::supervisor::is_subagent(request) {
        question.extend(provenance::derived_from(
            &uris.session(),
            &SessionUris::new(&request.parent_session_id).fanout(&request.correlation_id),
        ));
    }
    out.explain(&uris.session(), question)
}

/// How a step's message starts its work.
struct Start<'s> {
    /// A dialog's first message from outside (a client's, a subagent's, a fork's from step 1).
    new_dialog: bool,
    /// The pattern decision of a request that named its pattern.
    requested: Option<&'s agent_core::router::Decision>,
    /// A fork's first message: where from, and what its input changes there.
    fork: Option<(&'s replay::Fork, &'s [String])>,
    reuse: Option<&'s replay::Reuse>,
}

/// The step's own work: a new dialog's first node (and, unless its request named a pattern, the
/// meta-router's step), a fork's record of where it came from, then one iteration of its pattern.
async fn begin_or_continue(turn: &Turn<'_>, start: Start<'_>) -> Result<(), agent_bus::BusError> {
    let Turn { uris, out, .. } = turn;
    if start.new_dialog || start.fork.is_some() {
        record_question(turn)?;
    }
    if let Some((fork, edits)) = start.fork {
        fork.record(out, uris, turn.request, edits, start.reuse);
    }
    if start.new_dialog {
        let Some(decision) = start.requested else {
            // The router's step records the input it queues for the first iteration.
            return router::route(turn).await;
        };
        out.explain(
            &uris.pattern_decision(),
            provenance::pattern_decision(uris, decision, &CallStats::default()),
        )?;
    }
    // A first step no step of this service queued records its own input.
    if start.new_dialog || start.fork.is_some() {
        replay::record_own_input(out, uris, turn.request);
    }
    patterns::iterate(turn).await
}

/// The pattern a step is counted under in the metrics (a bounded set of labels).
fn metrics_label<'a>(request: &'a AgentRequest, config: &AgentConfig, routing: bool) -> &'a str {
    match request.pattern.as_str() {
        _ if routing => "router",
        "" => Pattern::React.name(),
        named if config.patterns.contains_key(named) || Pattern::runs(named) => named,
        _ => "other",
    }
}

/// Checks a request before any work; the message is the error the client gets. `new_dialog`: the
/// first message of a dialog, not one the router queued; `payload_bytes`: the message's size.
fn validate(
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

/// Runs the orchestrator until `shutdown`; in-flight iterations finish (or are left for redelivery)
/// within the drain deadline.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let config = load_config_dir(&settings.config_dir)?;
    let llm = LlmClient::new(settings.llm_config())?;
    let topics = settings.topics();
    metrics::describe();
    let stats = Arc::new(ConsumerStats::default());
    let knowledge = settings.shared_store()?;
    let ops = Arc::new(ops::OpsState {
        stats: stats.clone(),
        store: knowledge.clone(),
    });
    let listener = tokio::net::TcpListener::bind(settings.http_addr)
        .await
        .map_err(|e| {
            anyhow::anyhow!("cannot listen on {} (--http-addr): {e}", settings.http_addr)
        })?;
    tracing::info!(addr = %listener.local_addr()?, "health and metrics endpoint listening");
    let ops_server = tokio::spawn(ops::serve(listener, ops));
    let Some(bus) = connect_until_up(&settings, &shutdown).await else {
        ops_server.abort();
        return Ok(());
    };
    let publishers = Publishers {
        responses: Publisher::new(&bus, &topics.response).await?,
        requests: Publisher::new(&bus, &topics.request).await?,
        explainability: Publisher::new(&bus, &topics.explainability).await?,
    };
    // The dead letters' forwarder republishes requests as they are.
    let forward_requests = publishers.requests.clone();
    let outputs = Outputs::Broker(publishers);
    let live = Arc::new(LiveConfig::new(config));
    let first_read = Arc::new(tokio::sync::Notify::new());
    let follower = tokio::spawn(live_config::follow(
        live.clone(),
        bus.clone(),
        topics.clone(),
        settings.broker.workspace.clone(),
        first_read.clone(),
        shutdown.clone(),
    ));
    // The deployment's tools and prompts are in force before the first request is handled. The
    // subscriptions are made at once all the same: pulsar-lite has been seen to stall handing a
    // subscription made late a backlog of hundreds.
    let (config_read, config_ready) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(live_config::FIRST_READ_WAIT, first_read.notified()).await;
        let _ = config_read.send(true);
    });
    let journal = knowledge
        .as_ref()
        .map(|store| Journal::new(store.journal()));
    match &journal {
        None => tracing::warn!("no shared graph store (GRAPH_STORE as an http(s) SPARQL endpoint): iterations are at-least-once"),
        // A SPARQL server that is not an aggregator cannot decide who wins a record: refusing to
        // start beats a guarantee that silently does not hold.
        Some(journal) => match journal.check().await {
            Err(e @ agent_graph::GraphError::NoJournal(_)) => return Err(e.into()),
            // Refused, the journal would fail every step: better said once, at start.
            Err(e @ agent_graph::GraphError::Http { status: 401 | 403, .. }) => {
                anyhow::bail!("the aggregator at GRAPH_STORE refuses this orchestrator's CONFIG_TOKEN for its journal: {e}")
            }
            Err(e) => tracing::warn!(error = %e, "the journal does not answer yet; steps wait for it"),
            Ok(()) => {}
        },
    }
    // Cancels are heard from now on; those sent before are read from the graph after subscribing,
    // so none falls between the two.
    let cancellations = Arc::new(cancel::Cancellations::default());
    let subscribed = match agent_bus::ControlListener::subscribe(&bus, &topics).await {
        Ok(listener) => Some(listener),
        Err(e) => {
            tracing::warn!(error = %e, "cannot hear the control topic yet; trying again");
            None
        }
    };
    let hearing = tokio::spawn(cancel::listen(
        bus.clone(),
        topics.clone(),
        subscribed,
        cancellations.clone(),
        shutdown.clone(),
    ));
    if let Some(store) = &knowledge {
        match cancel::load(store, &cancellations).await {
            Ok(0) => {}
            Ok(loaded) => tracing::info!(loaded, "cancelled runs read from the graph"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read earlier cancels from the graph; only those heard from now on apply")
            }
        }
    }
    let engine = Arc::new(Engine {
        config: live,
        llm,
        outputs,
        journal,
        knowledge,
        mcp: agent_mcp::McpPool::new(),
        shutdown: shutdown.clone(),
        seal: agent_bus::seal::SealKey::configured(
            settings.seal_key.as_deref(),
            "agent-orchestrator",
        ),
        cancellations,
        answering: approval::OneAtATime::default(),
        control: Some(Publisher::new(&bus, &topics.control).await?),
    });
    let subscription = SubscriptionConfig {
        topic: topics.request.clone(),
        subscription: settings.subscription.clone(),
        max_in_flight: settings.max_in_flight,
        max_redeliveries: Some(settings.max_redeliveries).filter(|&n| n > 0),
        dead_letter_topic: topics.dead_letter.clone(),
        drain_deadline: std::time::Duration::from_secs(settings.drain_secs),
        nack_delay: std::time::Duration::from_secs(1),
        one_at_a_time: false,
    };
    let answering = tokio::spawn(answer_dead_letters(
        bus.clone(),
        engine.clone(),
        topics.dead_letter.clone(),
        format!("{}-dead-letters", settings.subscription),
        settings.max_redeliveries,
        shutdown.clone(),
    ));
    // TrustGraph's clients publish on its non-persistent request topic: first messages are taken
    // there too, and everything they cause goes on the persistent one.
    let from_clients =
        (!topics.client_request.is_empty() && topics.client_request != topics.request).then(|| {
            let config = SubscriptionConfig {
                topic: topics.client_request.clone(),
                subscription: format!("{}-clients", settings.subscription),
                max_in_flight: settings.max_in_flight,
                // Non-persistent: nothing is redelivered, so no delivery count.
                max_redeliveries: None,
                dead_letter_topic: topics.dead_letter.clone(),
                drain_deadline: std::time::Duration::from_secs(settings.drain_secs),
                nack_delay: std::time::Duration::from_secs(1),
                one_at_a_time: false,
            };
            // Forwarded at once to the persistent topic and only then acked: a message of a
            // non-persistent topic is never redelivered, so it must not wait (park) there.
            let requests = forward_requests.clone();
            spawn_consumer(
                &bus,
                config,
                &shutdown,
                "taking requests on the client topic stopped",
                move |delivery: Delivery<AgentRequest>| {
                    let requests = requests.clone();
                    async move {
                        let payload = agent_schema::encode(&delivery.payload);
                        match requests.send(payload, &delivery.properties).await {
                            Ok(()) => Disposition::Ack,
                            Err(e) => Disposition::Nack(format!(
                                "forwarding a client's request to the request topic: {e}"
                            )),
                        }
                    }
                },
            )
        });
    // Answers to approvals: one replica takes each up, whichever parked the call.
    let answering_approvals = {
        let config = SubscriptionConfig {
            topic: topics.control_request.clone(),
            subscription: format!("{}-control", settings.subscription),
            max_in_flight: 4,
            max_redeliveries: None,
            dead_letter_topic: String::new(),
            drain_deadline: std::time::Duration::from_secs(settings.drain_secs),
            nack_delay: std::time::Duration::from_secs(1),
            // One replica takes answers up at a time, so two copies of one never run side by side.
            one_at_a_time: true,
        };
        let engine = engine.clone();
        spawn_consumer(
            &bus,
            config,
            &shutdown,
            "taking answers to approvals stopped",
            move |delivery: Delivery<agent_schema::AgentControl>| {
                let engine = engine.clone();
                async move { engine.answer(delivery).await }
            },
        )
    };
    tracing::info!(request = %topics.request, client_request = %topics.client_request, response = %topics.response, "agent-orchestrator ready");
    let consumed = run_consumer(
        &bus,
        subscription,
        stats,
        shutdown.clone(),
        move |delivery| {
            let engine = engine.clone();
            let mut ready = config_ready.clone();
            async move {
                // Resolves at once after the first read (the value stays true).
                let _ = ready.wait_for(|read| *read).await;
                engine.handle(delivery).await
            }
        },
    )
    .await;
    // The follower stops with the consumer, so its subscriptions close before the process ends.
    shutdown.cancel();
    let _ = follower.await;
    let _ = answering.await;
    let _ = hearing.await;
    let _ = answering_approvals.await;
    if let Some(from_clients) = from_clients {
        let _ = from_clients.await;
    }
    ops_server.abort();
    consumed?;
    Ok(())
}

/// Runs a consumer beside the main one until `shutdown`, logging `stopped` if it fails.
fn spawn_consumer<T, F, Fut>(
    bus: &agent_bus::Bus,
    config: SubscriptionConfig,
    shutdown: &CancellationToken,
    stopped: &'static str,
    handler: F,
) -> tokio::task::JoinHandle<()>
where
    T: serde::de::DeserializeOwned + Send + 'static,
    F: Fn(Delivery<T>) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Disposition> + Send + 'static,
{
    let bus = bus.clone();
    let shutdown = shutdown.clone();
    tokio::spawn(async move {
        let taken = run_consumer(
            &bus,
            config,
            Arc::new(ConsumerStats::default()),
            shutdown,
            handler,
        )
        .await;
        if let Err(e) = taken {
            tracing::error!(error = %e, "{stopped}");
        }
    })
}

/// Answers for requests the broker moved to the dead-letter topic (its redelivery limit: a step
/// that crashed its process, or was handed to lost consumers, `max_redeliveries` times): each
/// ends its dialog with an error, or fails its subagent's completion, so no client or supervisor
/// waits forever. A step whose outcome was journaled goes out as recorded instead. What does not
/// decode is acked and dropped here (it stays in the topic for other readers): it never was a
/// dialog.
async fn answer_dead_letters(
    bus: agent_bus::Bus,
    engine: Arc<Engine>,
    topic: String,
    subscription: String,
    max_redeliveries: usize,
    shutdown: CancellationToken,
) {
    let config = SubscriptionConfig {
        topic,
        subscription,
        max_in_flight: 4,
        max_redeliveries: None,
        dead_letter_topic: String::new(),
        drain_deadline: Duration::from_secs(5),
        nack_delay: Duration::from_secs(1),
        one_at_a_time: false,
    };
    let answered = run_consumer(
        &bus,
        config,
        Arc::new(ConsumerStats::default()),
        shutdown,
        move |delivery: Delivery<AgentRequest>| {
            let engine = engine.clone();
            async move {
                let why = match delivery.properties.get(agent_bus::DEAD_LETTER_REASON) {
                    Some(reason) => format!("the step was given up on: {reason}"),
                    None => format!("the step did not finish in {max_redeliveries} deliveries (its process crashed or lost its broker connection each time); it was moved to the dead-letter topic"),
                };
                engine.give_up(delivery, &why, None).await
            }
        },
    )
    .await;
    if let Err(e) = answered {
        tracing::error!(error = %e, "answering dead-lettered requests stopped");
    }
}

/// The broker connection, tried again with backoff until it is up (a pod may start before its
/// broker); `None` when shut down first.
async fn connect_until_up(
    settings: &Settings,
    shutdown: &CancellationToken,
) -> Option<agent_bus::Bus> {
    let mut wait = Duration::from_millis(250);
    loop {
        match settings.broker.connect().await {
            Ok(bus) => return Some(bus),
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "the broker is not reachable yet");
                tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    _ = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(Duration::from_secs(5));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outage_is_waited_out_while_its_window_is_open_and_a_fault_ends_the_dialog() {
        let window = Duration::from_secs(60);
        let outage = || {
            StepError::from(agent_graph::GraphError::Transport(
                "connection refused".to_owned(),
            ))
        };
        assert!(matches!(outage(), StepError::Outage(_)));
        assert!(matches!(
            next_after(Err(outage()), true, window),
            Next::Park(park) if park.cause.contains("connection refused")
        ));
        assert!(matches!(
            next_after(Err(outage()), false, window),
            Next::GiveUp(why) if why.contains("outage window of 60 s") && why.contains("connection refused")
        ));
        let fault = StepError::from(agent_graph::GraphError::Syntax("not a node".to_owned()));
        assert!(matches!(fault, StepError::Fault(_)));
        assert!(matches!(
            next_after(Err(fault), true, window),
            Next::GiveUp(why) if why.starts_with("the step failed") && why.contains("not a node")
        ));
        assert!(matches!(
            next_after(Ok(Settled::Done), true, window),
            Next::Ack
        ));
    }

    #[test]
    fn first_requests_get_a_stable_session_per_id() {
        let req = AgentRequest::default();
        assert_eq!(
            session_id_for(&req, Some("abc")),
            session_id_for(&req, Some("abc"))
        );
        assert_ne!(
            session_id_for(&req, Some("abc")),
            session_id_for(&req, Some("abd"))
        );
        let later = AgentRequest {
            session_id: "s-1".into(),
            ..AgentRequest::default()
        };
        assert_eq!(session_id_for(&later, Some("abc")), "s-1");
    }

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

#[cfg(test)]
mod seed_tests {
    /// Every file in `config-seed/` loads into a valid config.
    #[test]
    fn the_seed_directory_loads() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config-seed");
        let config = crate::load_config_dir(&dir).unwrap();
        assert!(config.tool_by_name("llm").is_some());
        assert_eq!(config.prompts, agent_core::prompt::Prompts::default());
        for task in config.task_types.values() {
            let (runnable, _) = agent_core::router::pattern_candidates(&config, task);
            assert!(
                !runnable.is_empty(),
                "{} has no runnable pattern",
                task.name
            );
        }
        for name in ["general", "research", "risk-assessment", "summarisation"] {
            assert!(config.task_types.contains_key(name), "{name} is not seeded");
        }
        for name in ["react", "plan-then-execute", "supervisor", "llm-router"] {
            assert!(config.patterns.contains_key(name), "{name} is not seeded");
        }
        assert_eq!(config.limits, agent_core::config::Limits::default());
    }
}
