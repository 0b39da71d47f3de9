//! One delivered request taken up: where it stands in its run, its journal slot, its
//! conversation, then its pattern's step, committed before the message is acked.

use std::borrow::Cow;
use std::time::Duration;

use agent_bus::Delivery;
use agent_core::config::{AgentConfig, ConversationPolicy};
use agent_core::documents::steps_taken;
use agent_core::pattern::Pattern;
use agent_core::provenance::{self, CallStats, SessionUris};
use agent_graph::turns;
use agent_schema::{AgentRequest, AgentResponse, ID_PROPERTY};
use tracing::Instrument;

use crate::emit::{
    DialogOutput, JournalSlot, Recorder, IN_TOKEN_PROPERTY, OUT_TOKEN_PROPERTY,
    RUN_TOKENS_PROPERTY, STARTED_PROPERTY,
};
use crate::engine::{Attempt, Engine, Settled, StepError};
use crate::turn::Turn;
use crate::validate::validate;
use crate::{
    approval, budget, conversation, emit, events, finish, journal, patterns, replay, router,
};

/// Where a step stands in its run (see [`Engine::standing`]).
pub(crate) struct Standing {
    /// The dialog's tokens before this step.
    tokens_before: budget::Tokens,
    /// When the run's first message was taken up.
    started_ms: u64,
    /// The run's tokens outside this dialog when it started.
    run_base: u64,
    run_uri: String,
    /// The whole run's tokens before this step.
    run_tokens: u64,
    /// The whole run's iterations before this step: this dialog's, or the LLM calls the graph
    /// records for the run when the dialog shares it with others.
    run_iterations: usize,
    /// A subagent whose supervisor stopped waiting for it.
    abandoned: bool,
    elapsed: Duration,
}

/// A delivered request taken up (see [`Engine::admit`]): all a step's turn is built from.
pub(crate) struct Admitted<'e> {
    request: AgentRequest,
    properties: agent_bus::Properties,
    /// The client's message id (`ID_PROPERTY`), carried by every message of the dialog.
    id: Option<String>,
    session_id: String,
    uris: SessionUris,
    config: std::sync::Arc<AgentConfig>,
    new_dialog: bool,
    /// Whether a refused request is this service's own step: sealed by it (or no seal key is
    /// set), or resumed from the graph by an answer (false for one not refused: not checked).
    /// Only such a step, refused, ends its dialog in the graph: a client's unsealed step naming
    /// another's session must not.
    ours: bool,
    /// Why the request is refused, if it is.
    verdict: Result<(), String>,
    standing: Standing,
    /// The model the request asks for, when config lists it.
    model: Option<String>,
    out: DialogOutput<'e>,
    slot: Option<JournalSlot<'e>>,
}

impl Admitted<'_> {
    /// A new dialog that names its pattern is not routed: it takes the pattern's decision, and
    /// its task type's framing, here.
    fn take_requested_pattern(&mut self) -> Option<agent_core::router::Decision> {
        if !self.new_dialog || self.request.pattern.is_empty() {
            return None;
        }
        let config: &AgentConfig = &self.config;
        let decision = router::requested(&self.request, config);
        self.request.framing.clone_from(&decision.framing);
        self.request.pattern.clone_from(&decision.pattern.selected);
        Some(decision)
    }

    /// The step's turn: what its pattern reads and where it writes.
    fn turn<'t>(
        &'t self,
        engine: &'t Engine,
        llm: &'t agent_llm::LlmClient,
        replay: &'t replay::StepReplay,
        attempt: Attempt<'_>,
    ) -> Turn<'t> {
        let standing = &self.standing;
        Turn {
            request: &self.request,
            session_id: &self.session_id,
            uris: &self.uris,
            out: &self.out,
            config: &self.config,
            llm,
            knowledge: engine.knowledge.as_ref(),
            documents: engine.documents.as_ref(),
            mcp: &engine.mcp,
            tokens_before: standing.tokens_before,
            run_tokens: standing.run_tokens,
            run_iterations: standing.run_iterations,
            abandoned: standing.abandoned,
            seal: engine.seal.as_ref(),
            elapsed: standing.elapsed,
            may_park: matches!(attempt, Attempt::Run { may_park: true, .. }),
            cancelled: engine.cancellations.of(&self.session_id),
            delivered: &self.properties,
            replay,
            kept_documents: Default::default(),
            recorded_calls: Default::default(),
        }
    }
}

impl Engine {
    /// Where a step stands in its run: its tokens and start (carried by the message, never taken
    /// from a client), a subagent's checked against its seal or the graph's fan-out (a forged one
    /// is refused through `verdict`), and what the run has spent. `Ok(Err(park))` when the graph
    /// may only be behind.
    // What the step was taken up with, each once; `limits` is the snapshot its turn runs under.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn standing(
        &self,
        request: &mut AgentRequest,
        (properties, raw): (&agent_bus::Properties, &[u8]),
        session_id: &str,
        (new_dialog, answering): (bool, bool),
        verdict: &mut Result<(), String>,
        attempt: Attempt<'_>,
        limits: &agent_core::config::Limits,
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
        // An answer to a parked call resumes its step with the properties kept in the graph,
        // where the run's start was written as it parked (a client's first step has none of its
        // own): the wait for the answer counts against the run's wall time.
        let started_from = if answering {
            token(STARTED_PROPERTY)
        } else {
            carried(STARTED_PROPERTY)
        };
        let mut started_ms = match started_from {
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
        // An answer resumes a step from its continuation, which this service sealed as the step
        // parked, once the step had passed what follows: checked again, its request (changed by
        // the step before it parked: its framing, a pattern past the depth limit) would not
        // verify against the seal of the message as sent.
        if new_dialog && subagent && verdict.is_ok() && !answering {
            if let Some(key) = &self.seal {
                // Sealed by the supervisor that spawned it: its start and budget are ours.
                let text = |name: &str| properties.get(name).map_or("", String::as_str);
                let parts = emit::subagent_seal_parts(
                    request,
                    raw,
                    token(STARTED_PROPERTY),
                    token(RUN_TOKENS_PROPERTY),
                    text(agent_schema::MODEL_PROPERTY),
                    text(ID_PROPERTY),
                );
                let sealed_with = |property: &str, parts: &[&str]| {
                    properties
                        .get(property)
                        .is_some_and(|seal| key.verify(parts, seal))
                };
                let whole = agent_bus::seal::SUBAGENT_SEAL_PROPERTY;
                let mut sealed = sealed_with(whole, &parts.each_ref().map(String::as_str));
                if !sealed && self.subagent_seals == crate::settings::SealRule::Warn {
                    // A start of a build before the whole seal, or a copy of any start with its
                    // whole seal taken off: believed only while a rolling upgrade asks for it.
                    let legacy = emit::legacy_subagent_seal_parts(
                        request,
                        token(STARTED_PROPERTY),
                        token(RUN_TOKENS_PROPERTY),
                    );
                    sealed = sealed_with(
                        agent_bus::seal::SEAL_PROPERTY,
                        &legacy.each_ref().map(String::as_str),
                    );
                    if sealed {
                        tracing::warn!(session = %agent_core::logged::client_text(session_id), "running a subagent whose start carries only the older seal (AGENT_SUBAGENT_SEALS=warn)");
                    }
                }
                if !sealed {
                    tracing::warn!(session = %agent_core::logged::client_text(session_id), "refusing an unsealed subagent request");
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
                    None if matches!(attempt, Attempt::Run { may_park: true, .. }) => {
                        return Ok(Err(emit::Park {
                            cause: "the fan-out that started this subagent is not in the graph; a request that names a fan-out this service did not record is refused".to_owned(),
                            retry_after: None,
                        }));
                    }
                    None => {
                        tracing::warn!(session = %agent_core::logged::client_text(session_id), "refusing a subagent request that no recorded fan-out started");
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
        let mut run_tokens = run_base.saturating_add(tokens_before.total());
        let mut run_iterations = steps_taken(&request.history);
        let mut abandoned = false;
        // A subagent's siblings (and cousins) spend from the same budget: their calls are in the
        // graph, tagged with the run. And a subagent whose supervisor stopped waiting stops too.
        // A root's subagents bring their tokens back with their results, but not their
        // iterations: a root that has fanned out counts those from the graph too.
        let counts_run_iterations = limits.max_run_iterations > 0;
        let shares_run = run != session_id
            || (counts_run_iterations
                && agent_core::supervisor::last_decompose(&request.history).is_some());
        if shares_run && verdict.is_ok() {
            if let Some(store) = store {
                let session_uri = SessionUris::new(session_id).session();
                let recorded = budget::run_tokens(store, &run_uri, &session_uri).await?;
                run_tokens = run_tokens.max(recorded.with_own(tokens_before.total()));
                if counts_run_iterations {
                    let counted = budget::run_iterations(store, &run_uri).await?;
                    run_iterations = run_iterations.max(counted);
                }
                abandoned = subagent && budget::abandoned(store, session_id).await?;
            }
        }
        Ok(Ok(Standing {
            tokens_before,
            started_ms,
            run_base,
            run_uri,
            run_tokens,
            run_iterations,
            abandoned,
            elapsed,
        }))
    }

    /// Takes up one delivered request: admits it, joins its conversation if it starts a dialog,
    /// then refuses it, gives it up or runs its step, and commits what it caused before the
    /// message is acked.
    /// `aside`: the delivery's place aside while it waited for its conversation, given back as it
    /// is let start. `kept_start`: its start in its conversation once let start, kept by the
    /// caller across parks.
    pub(crate) async fn handle_inner(
        &self,
        delivery: Delivery<AgentRequest>,
        attempt: Attempt<'_>,
        answer: Option<&approval::Answer>,
        aside: &mut Option<agent_bus::AsideLease>,
        kept_start: &mut Option<crate::conversation::KeptStart>,
    ) -> Result<Settled, StepError> {
        let taken = std::time::Instant::now();
        let mut step = match self.admit(delivery, attempt, answer.is_some()).await? {
            Ok(step) => step,
            Err(settled) => return Ok(settled),
        };
        if step.new_dialog
            && step.verdict.is_ok()
            && answer.is_none()
            && matches!(attempt, Attempt::Run { .. })
        {
            if let Some(problem) = self
                .session_of_another_dialog(&step.request, &step.uris, step.id.as_deref())
                .await?
            {
                step.verdict = Err(problem);
            }
        }
        let joins_conversation = step.new_dialog
            && step.verdict.is_ok()
            && answer.is_none()
            && matches!(attempt, Attempt::Run { .. });
        if joins_conversation {
            let joined = self
                .join_conversation(
                    &mut step.request,
                    &step.session_id,
                    &step.uris,
                    &step.config,
                    &step.out,
                )
                .await?;
            if !matches!(joined, Joined::Queued(_)) {
                *aside = None;
            }
            match joined {
                Joined::Go(kept) => *kept_start = kept,
                // A start kept from an earlier try (parked, its start lapsed meanwhile) is not
                // renewed for a dialog now refused or queued.
                Joined::Refused(problem) => {
                    *kept_start = None;
                    step.verdict = Err(problem);
                }
                Joined::Queued(why) => {
                    *kept_start = None;
                    return Ok(Settled::Queued(Queued {
                        why,
                        conversation: step.request.conversation_id.clone(),
                        session: step.session_id.clone(),
                    }));
                }
            }
        }
        let requested = step.take_requested_pattern();
        let running = matches!(attempt, Attempt::Run { .. }) && step.verdict.is_ok();
        let replay::StepStart {
            reuse,
            replay: step_replay,
            fork,
        } = replay::StepStart::read(
            &step.properties,
            &step.request,
            &step.session_id,
            self.knowledge.as_ref(),
            &self.replays,
            running,
        )
        .await?;
        let llm = match &step.model {
            Some(model) => self.llm.for_model(model),
            None => self.llm.clone(),
        };
        let most = step.config.model_options(llm.model()).max_output_tokens;
        let llm = llm
            .with_max_output_tokens(most)
            .taped(step_replay.tape.clone());
        let span = iteration_span(
            &step.request,
            &step.session_id,
            step.id.as_deref(),
            &step.properties,
        );
        carry_forward(&mut step.out, reuse.as_ref(), &span);
        let turn = step.turn(self, &llm, &step_replay, attempt);
        let n = steps_taken(&step.request.history) + 1;
        if let Err(problem) = &step.verdict {
            if let Some(answer) = answer {
                approval::record_answer(&turn, answer)?;
            }
            // A first step resumed by an answer (parked for an approval) has started its dialog.
            let ends_dialog = !(step.new_dialog && answer.is_none()) && step.ours;
            refuse(&turn, problem, ends_dialog, answer.map(|a| &a.decision)).await?;
            step.out.commit(step.slot.as_ref()).await?;
            committed(&step.out, "refused", false, taken);
            return Ok(Settled::Done);
        }
        if let Attempt::GiveUp(why) = attempt {
            if let Some(answer) = answer {
                approval::record_answer(&turn, answer)?;
            }
            // A conversation sees its dialogs by their questions: without one, a dialog given up
            // at its first step would still count as let start (see `agent_graph::turns`), and
            // hold its conversation up, until its start lapsed.
            if step.new_dialog && answer.is_none() && !step.request.conversation_id.is_empty() {
                record_question(&turn)?;
            }
            // A step resumed by an answer counts the call that chose the parked tool.
            finish::fail_parked(&turn, n, why, answer.map(|a| &a.decision)).await?;
            step.out.commit(step.slot.as_ref()).await?;
            committed(&step.out, "given-up", false, taken);
            return Ok(Settled::Done);
        }
        let start = Start {
            new_dialog: step.new_dialog,
            requested: requested.as_ref(),
            fork: fork.as_ref().map(|(f, edits)| (f, edits.as_slice())),
            reuse: reuse.as_ref(),
        };
        let run_uri = &step.standing.run_uri;
        self.run_unless_cancelled(&turn, answer, start, span, n, run_uri)
            .await?;
        if let Some(park) = step.out.parked() {
            return Ok(Settled::Parked(park));
        }
        // Everything this message caused must be on the broker before it is acked.
        step.out.commit(step.slot.as_ref()).await?;
        let routing = step.new_dialog && requested.is_none();
        let pattern = metrics_label(&step.request, &step.config, routing);
        let first_iteration = !routing && step.request.history.is_empty();
        committed(&step.out, pattern, first_iteration, taken);
        match step.out.take_continuation() {
            Some(continuation) => Ok(Settled::Continued(Box::new(continuation))),
            None => Ok(Settled::Done),
        }
    }

    /// Admits a delivered request: who it is, whether it is valid, where it stands in its run, its
    /// output and its journal slot. `Err` settles it here: parked while the graph may only be
    /// behind, or done when its outcome was recorded before (and has been settled from the entry).
    async fn admit(
        &self,
        delivery: Delivery<AgentRequest>,
        attempt: Attempt<'_>,
        answering: bool,
    ) -> Result<Result<Admitted<'_>, Settled>, StepError> {
        let Delivery {
            payload: mut request,
            properties,
            message_id,
            payload_bytes,
            raw,
            aside: _,
        } = delivery;
        let id = properties.get(ID_PROPERTY).cloned();
        // A first request with no id of its client's is named after the broker's id of its
        // message, which its redeliveries share: a fresh session each time would run it again.
        let seed = match id.as_deref() {
            Some(id) if !id.is_empty() => Cow::Borrowed(id),
            _ => Cow::Owned(format!("message:{message_id}")),
        };
        let session_id = session_id_for(&request, Some(&seed));
        let uris = SessionUris::new(&session_id);
        let config = self.config.current();
        let new_dialog = is_new_dialog(&request, &properties);
        // A dialog's later step is this service's (sealed as it was queued) or a client's (a
        // fork, a TrustGraph client's history). A subagent's never is a client's: unsealed, it
        // could put a result of its sender's into its supervisor's fan-in, so nothing is made of
        // it at all. (An answer to a parked call resumes from the graph, sealed there.)
        if !new_dialog && !answering && agent_core::supervisor::is_subagent(&request) {
            if let Some(key) = &self.seal {
                if !key.verify_step(&raw, &properties) {
                    let session = agent_core::logged::client_text(&session_id);
                    let why = format!("a later step of subagent session {session} without this service's seal; only the orchestrator continues a subagent's dialog");
                    if self.step_seals == crate::settings::SealRule::Require {
                        return Ok(Err(Settled::Forged(why)));
                    }
                    tracing::warn!(%why, "running it all the same (--step-seals warn)");
                }
            }
        }
        // Checked before anything is named after the request's ids: a hostile id must earn the
        // client an error, not fail to name a journal entry until the message is dead-lettered.
        let mut verdict = validate(&request, &properties, &config, new_dialog, payload_bytes);
        let standing = match self
            .standing(
                &mut request,
                (&properties, &raw),
                &session_id,
                (new_dialog, answering),
                &mut verdict,
                attempt,
                &config.limits,
            )
            .await?
        {
            Ok(standing) => standing,
            Err(park) => return Ok(Err(Settled::Parked(park))),
        };
        // Checked only for a refused request: a seal's check is an HMAC over the whole message.
        let ours = verdict.is_err()
            && (answering
                || self
                    .seal
                    .as_ref()
                    .is_none_or(|key| key.verify_step(&raw, &properties)));
        let model = asked_model(&properties, &config).map(str::to_owned);
        // A step of a chain is its root delivery's (see `emit::CHAIN_PROPERTY`); a new dialog
        // belongs to no chain, whatever its sender put on it.
        // A chain's id is a message id, short: a longer one is no chain of ours, and the
        // journal's owner would refuse it (with the other steps of its batch).
        let delivery_id = properties
            .get(emit::CHAIN_PROPERTY)
            .filter(|chain| !new_dialog && chain.len() <= agent_graph::journal::MAX_TAKING_NAME)
            .cloned()
            .unwrap_or(message_id);
        // Only a step that runs its pattern may hold its next request back: every other path
        // (a refusal, giving up, an answer to an approval) settles its delivery when it returns.
        let chain = (self.continue_in_process
            && self.journal.is_some()
            && matches!(attempt, Attempt::Run { .. })
            && !answering
            && verdict.is_ok())
        .then(|| delivery_id.clone());
        let out = DialogOutput::new(
            &self.outputs,
            id.as_deref(),
            &request.collection,
            &uris.session(),
            standing.started_ms,
        )
        .for_step(
            &request,
            &standing.run_uri,
            standing.run_base,
            config.limits.max_message_bytes,
        )
        .with_model(model.as_deref())
        .sealing_steps_with(self.seal.as_ref())
        .keeping_documents_in(self.documents.as_ref())
        .journaled(self.journal.is_some())
        .giving_up(matches!(attempt, Attempt::GiveUp(_)))
        .continuing_in(chain)
        .stopping_on(&self.shutdown);
        let lookup = self
            .journal_slot(
                &out,
                &request,
                &uris,
                new_dialog,
                verdict.is_err(),
                answering,
                match attempt {
                    Attempt::Run { taker, .. } => Some(taker),
                    Attempt::GiveUp(_) => None,
                },
                delivery_id,
            )
            .await?;
        let Lookup::Fresh(slot) = lookup else {
            return Ok(Err(Settled::Done));
        };
        // Not when giving the answer up: that must end the dialog even with the store out of reach.
        if answering && matches!(attempt, Attempt::Run { .. }) {
            if self.answered_before(&request, &uris).await? {
                return Ok(Err(Settled::Done));
            }
            // The answer may come days after the run began, longer than a replica remembers a
            // cancel (`cancel::MEMORY`): what the graph records of its run is read first.
            if let Some(store) = &self.knowledge {
                crate::cancel::load_for(store, &self.cancellations, &session_id)
                    .await
                    .map_err(anyhow::Error::from)?;
            }
        }
        Ok(Ok(Admitted {
            request,
            properties,
            id,
            session_id,
            uris,
            config,
            new_dialog,
            ours,
            verdict,
            standing,
            model,
            out,
            slot,
        }))
    }

    /// Why a new dialog is refused that names, as its client's `session_id`, a session where the
    /// graph holds another dialog's question; `None` to go on. Every node of a session is named
    /// after its id, so the new dialog's would be the earlier one's: a second thought on the same
    /// iteration, and a fan-out on a node already synthesised, which resumes nobody, so that a
    /// supervisor's dialog never ended. The same dialog asked again (a redelivery, a client's
    /// retry under the same `id`) goes on. Two dialogs started under one session id in the same
    /// instant both find it free: the graph shows a dialog only once its first step is written.
    async fn session_of_another_dialog(
        &self,
        request: &AgentRequest,
        uris: &SessionUris,
        id: Option<&str>,
    ) -> Result<Option<String>, StepError> {
        let Some(store) = &self.knowledge else {
            return Ok(None);
        };
        if request.session_id.is_empty() || agent_core::supervisor::is_subagent(request) {
            return Ok(None);
        }
        let Ok(session) = agent_graph::model::NamedNode::new(uris.session()) else {
            return Ok(None);
        };
        let agent_graph::QueryAnswer::Rows(rows) = store
            .query(agent_graph::queries::session_asked(&session))
            .await?
        else {
            return Ok(None);
        };
        let text = |term: Option<&agent_graph::model::Term>| match term {
            Some(agent_graph::model::Term::Literal(l)) => Some(l.value().to_owned()),
            _ => None,
        };
        let queries = rows.column("query");
        let clients = rows.column("client");
        if queries.is_empty() {
            return Ok(None);
        }
        let id = id.unwrap_or("");
        let same_client = clients
            .iter()
            .any(|client| !id.is_empty() && text(*client).as_deref() == Some(id));
        // A question recorded without a client's id (a request that carried none, or one an
        // earlier build recorded) is told apart by its text alone.
        let same_question = clients.iter().all(Option::is_none)
            && queries
                .iter()
                .all(|query| text(*query).as_deref() == Some(request.question.as_str()));
        if same_client || same_question {
            return Ok(None);
        }
        let session = agent_core::logged::client_text(&request.session_id);
        Ok(Some(format!(
            "session id {session} already names another dialog; a new dialog needs a session id \
             of its own (or none: one is made from its id), and a conversation_id joins it to \
             the dialogs before it"
        )))
    }

    /// A new dialog of a conversation is told what was asked and answered before, and is not run
    /// beside another dialog of the same conversation unless the policy says so.
    async fn join_conversation(
        &self,
        request: &mut AgentRequest,
        session_id: &str,
        uris: &SessionUris,
        config: &AgentConfig,
        out: &DialogOutput<'_>,
    ) -> Result<Joined, StepError> {
        let (Some(store), false, false) = (
            &self.knowledge,
            request.conversation_id.is_empty(),
            agent_core::supervisor::is_subagent(request),
        ) else {
            return Ok(Joined::Go(None));
        };
        let conversation = &request.conversation_id;
        let policy = config.limits.conversation_policy;
        let mut line = self.turns.hold(conversation).await;
        // A cancelled request does not wait for its turn: its step ends it at once. One let start
        // before goes on (its first step was parked, or handed back), told the same.
        let cancelled = self.cancellations.of(session_id).is_some();
        let ahead = match (policy, cancelled) {
            (ConversationPolicy::Queue, false) => line.ahead_of(session_id),
            _ => None,
        };
        let mut earlier = conversation::earlier(store, conversation, session_id).await?;
        // A dialog past its wall-time budget ends at its next step, but the step under way when
        // the budget ran out still finishes (a tool call, its LLM calls, a supervisor's fan-in
        // answered at the fan-out timeout): until then it still runs, and the next dialog of the
        // conversation must not start beside it and see it unanswered.
        let max_wall = match config.limits.max_wall_secs {
            0 => Duration::ZERO,
            secs => Duration::from_secs(
                secs.saturating_add(config.limits.tool_timeout_secs)
                    .saturating_add(STEP_PAST_THE_WALL_SECS),
            ),
        };
        let mut running: Vec<String> = earlier
            .iter()
            .filter(|d| d.running(max_wall))
            .map(|d| d.session_id().to_owned())
            .filter(|other| other != session_id)
            .collect();
        // Whether it may start, and its start, in one question to the journal's owner, which
        // every replica asks: a dialog another replica let start a moment ago is not in the graph
        // yet.
        let mut asked = turns::TurnAsked {
            conversation: conversation.clone(),
            session: session_id.to_owned(),
            shown: earlier
                .iter()
                .map(|d| d.session_id().to_owned())
                .take(turns::MAX_SHOWN)
                .collect(),
            shown_running: !running.is_empty(),
            running: Some(running.clone()),
            for_ms: Some(u64::try_from(self.start_lease.as_millis()).unwrap_or(u64::MAX)),
            start: match (policy, cancelled || ahead.is_some()) {
                (ConversationPolicy::Queue | ConversationPolicy::Reject, false) => {
                    turns::StartIf::Clear
                }
                // An interrupt asks first and starts once the others are interrupted (below).
                _ => turns::StartIf::Never,
            },
        };
        let mut turn = self.take_turn(&asked).await?;
        // Ended, the journal says, though the graph does not show it yet (a client sends its next
        // question on the closing): it runs no longer.
        let mut ended = std::mem::take(&mut turn.ended);
        running.retain(|dialog| !ended.contains(dialog));
        // The others are interrupted before this dialog's start is kept, so a step tried again
        // after an interrupt failed interrupts them again. One let start before (its step handed
        // back) interrupts nothing: a newer dialog may have interrupted it, and that cancel may
        // not have reached this replica yet.
        if policy == ConversationPolicy::Interrupt && !cancelled && !turn.started_before {
            running.append(&mut turn.unseen);
            for dialog in &running {
                self.interrupt(dialog, session_id, out).await?;
            }
            asked.start = turns::StartIf::Anyway;
            turn = self.take_turn(&asked).await?;
            ended.append(&mut turn.ended);
            // Let start by another replica in between: interrupted too.
            for dialog in std::mem::take(&mut turn.unseen) {
                if !running.contains(&dialog) {
                    self.interrupt(&dialog, session_id, out).await?;
                    running.push(dialog);
                }
            }
        }
        let goes_on = cancelled || turn.started_before;
        if let (Some(ahead), false) = (&ahead, goes_on) {
            line.wait(session_id);
            return Ok(Joined::Queued(format!(
                "dialog {ahead} of conversation {conversation} waits for its turn before it"
            )));
        }
        running.extend(turn.unseen);
        if !goes_on && !turn.started {
            let other = running
                .first()
                .map_or("another dialog", String::as_str)
                .to_owned();
            match policy {
                ConversationPolicy::Reject => {
                    line.leave(session_id);
                    return Ok(Joined::Refused(format!("dialog {other} of conversation {conversation} is still running; this conversation takes one request at a time (conversation_policy: reject)")));
                }
                // Not reached under `interrupt`, which starts unless it was let start before (and
                // then goes on) or cancelled; were it reached, waiting is the safe answer.
                ConversationPolicy::Queue | ConversationPolicy::Interrupt => {
                    line.wait(session_id);
                    return Ok(Joined::Queued(format!(
                        "dialog {other} of conversation {conversation} is still running"
                    )));
                }
            }
        }
        line.leave(session_id);
        drop(line);
        // Renewed at once if it was let start before: its lease may be near its end.
        let kept = (!cancelled).then(|| {
            conversation::KeptStart::renewing(
                self.journal.clone(),
                conversation,
                session_id,
                self.start_lease,
                turn.started_before,
                self.cancellations.clone(),
            )
        });
        if !ended.is_empty() {
            // Told their answers once the graph shows them, its start renewed meanwhile.
            earlier =
                conversation::once_shown_ended(store, conversation, session_id, earlier, &ended)
                    .await?;
        }
        let summary = conversation::context(&earlier);
        request.framing = conversation::framed(&request.framing, &summary);
        let follows: Vec<String> = earlier.iter().map(|d| d.session_uri.clone()).collect();
        out.explain(&uris.session(), provenance::follows(uris, &follows))?;
        Ok(Joined::Go(kept))
    }

    /// A new dialog's question to its conversation (see [`agent_graph::turns`]).
    async fn take_turn(&self, asked: &turns::TurnAsked) -> Result<turns::Turn, StepError> {
        match &self.journal {
            Some(journal) => Ok(journal.take_turn(asked.clone()).await?),
            // A knowledge store always comes with its journal; were it not so, this replica
            // would judge alone.
            None => Ok(turns::take_turn_here("", asked)),
        }
    }

    /// Runs the step (its pattern's, or the resumption of a parked call with its `answer`),
    /// unless its run is cancelled. A cancelled run's step is not run: it only ends its dialog. A
    /// cancel heard while the step works abandons it (an LLM stream in flight, a tool call not
    /// yet made): what it held is dropped, and the same.
    async fn run_unless_cancelled(
        &self,
        turn: &Turn<'_>,
        answer: Option<&approval::Answer>,
        start: Start<'_>,
        span: tracing::Span,
        n: usize,
        run_uri: &str,
    ) -> Result<(), StepError> {
        let new_dialog = start.new_dialog;
        let work = Box::pin(
            async {
                match answer {
                    Some(answer) => Box::pin(approval::resume(turn, answer)).await,
                    None => Box::pin(begin_or_continue(turn, start)).await,
                }
            }
            .instrument(span),
        );
        let overtaken = match turn.cancelled.clone() {
            Some(cancel) => Some(cancel),
            None => tokio::select! {
                done = work => {
                    done?;
                    turn.replay.record(turn.out, turn.uris, n, run_uri);
                    None
                }
                cancel = self.cancellations.cancelled(turn.session_id) => Some(cancel),
            },
        };
        if let Some(cancel) = overtaken {
            turn.out.discard();
            // The nodes that recorded these calls (a step critic's verdicts) went with the rest:
            // the closing must not count what the graph will never show.
            *crate::emit::locked(&turn.recorded_calls) = Default::default();
            // A parked first step's question was recorded as it parked.
            if new_dialog && answer.is_none() {
                record_question(turn)?;
            }
            if let Some(answer) = answer {
                approval::record_answer(turn, answer)?;
            }
            finish::cancelled(turn, &cancel, answer.map(|a| &a.decision)).await?;
        }
        Ok(())
    }

    /// Where the step stands in the journal: its slot (none without a journal, nor when giving up
    /// finds the journal out of reach: the store may be what is down, and the dialog must still
    /// end), or [`Lookup::Recorded`] when its outcome was recorded already and has now been
    /// settled from the entry (an error must never follow an answer). A step's `taker` is
    /// counted by the journal's owner while no entry stands; past [`Engine::max_takings`] its
    /// message is given up.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn journal_slot<'e>(
        &'e self,
        out: &DialogOutput<'_>,
        request: &AgentRequest,
        uris: &SessionUris,
        new_dialog: bool,
        refused: bool,
        answering: bool,
        taker: Option<&str>,
        delivery: String,
    ) -> Result<Lookup<'e>, StepError> {
        let Some(journal) = &self.journal else {
            return Ok(Lookup::Fresh(None));
        };
        let giving_up = out.is_given_up();
        let client = out.client_id();
        let mut key = journal::key(request, new_dialog, client);
        // A parked step's resumption has a slot of its own, which the first answer takes.
        if answering {
            key.push_str("-answer");
        }
        let node = match journal::entry_node(&uris.session(), &key) {
            // The owner refuses a taking whose entry is longer than it takes, and with it every
            // other taking of its batch: those steps (other dialogs' too) failed. A session id
            // long enough for that is refused (at most 240 bytes run).
            Ok(node) if node.as_str().len() > agent_graph::journal::MAX_TAKING_NAME => {
                if refused || giving_up {
                    return Ok(Lookup::Fresh(None));
                }
                return Err(StepError::Fault(anyhow::anyhow!(
                    "the step's journal entry is longer than the journal takes ({} bytes)",
                    node.as_str().len()
                )));
            }
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
            session: uris.session(),
        };
        // Giving up reads the journal only if it can reach it; an entry it cannot read is
        // another build's outcome, which giving up must not add to.
        let looked_up = if let Some(taker) = taker {
            slot.journal.take(&slot.node, &slot.delivery, taker).await
        } else {
            slot.journal.entry(&slot.node).await.map(|entry| (entry, 0))
        };
        let (recorded, takings) = match looked_up {
            Ok(found) => found,
            Err(e) if giving_up && !e.is::<journal::UnreadableEntry>() => {
                tracing::warn!(entry = %slot.node.as_str(), error = %e, "giving up without the journal, which does not answer");
                return Ok(Lookup::Fresh(None));
            }
            Err(e) => return Err(e.into()),
        };
        if let Some(entry) = recorded {
            out.settle(&slot, entry, Recorder::Unknown).await?;
            return Ok(Lookup::Recorded);
        }
        if let Some(max) = self.max_takings.filter(|&max| takings > max) {
            return Err(StepError::Fault(TakenTooOften { takings, max }.into()));
        }
        if takings > 1 {
            tracing::warn!(entry = %slot.node.as_str(), message = %slot.delivery, takings, "a step taken up again without an outcome (each handling of its message before stopped short)");
        }
        Ok(Lookup::Fresh(Some(slot)))
    }

    /// Whether the call an answer resumes was answered before, though no journal entry stands
    /// for its resumption: the entry was pruned (`JOURNAL_RETENTION_SECS` after its dialog ended)
    /// and this is an answer sent again, or a captured one played again. The answer's record in
    /// the graph is never pruned; resumed again, the step would make its call a second time.
    async fn answered_before(
        &self,
        request: &AgentRequest,
        uris: &SessionUris,
    ) -> Result<bool, StepError> {
        let Some(store) = &self.knowledge else {
            return Ok(false);
        };
        let n = steps_taken(&request.history) + 1;
        let Ok(answer) = agent_graph::model::NamedNode::new(uris.approval_answer(n)) else {
            return Ok(false);
        };
        let found = store
            .query(agent_graph::queries::node_exists(&answer))
            .await
            .map_err(anyhow::Error::from)?;
        let answered = matches!(found, agent_graph::QueryAnswer::Boolean(true));
        if answered {
            tracing::warn!(session = %request.session_id, step = n, "an answer to a call answered before, whose resumption is no longer in the journal; dropped (the call is not made again)");
        }
        Ok(answered)
    }
}

/// Why a step is given up when a delivery takes it up again: every delivery before it stopped
/// short of an outcome, most likely because the step crashes the process that runs it. (Apache
/// Pulsar does not count a consumer that died as a redelivery, so without this such a message
/// would go round the replicas for ever.)
#[derive(Debug, thiserror::Error)]
#[error("the step was taken up {takings} times from its message without an outcome: each process that took it stopped before it was recorded (does it crash the orchestrator?); {max} is the most allowed (--max-redeliveries)")]
pub(crate) struct TakenTooOften {
    takings: u32,
    max: u32,
}

/// A step's journal lookup.
pub(crate) enum Lookup<'e> {
    /// Not recorded yet: run it, recording in the slot when there is one.
    Fresh(Option<JournalSlot<'e>>),
    /// Recorded before, and settled from the entry now.
    Recorded,
}

/// What joining its conversation makes of a new dialog.
enum Joined {
    /// Run it (told what the conversation asked and answered before), its start kept while the
    /// step runs (a dialog of no conversation has none).
    Go(Option<crate::conversation::KeptStart>),
    /// Refuse it (`conversation_policy: reject` while another dialog runs).
    Refused(String),
    /// Wait for the running dialog (`conversation_policy: queue`).
    Queued(String),
}

/// A new dialog waiting for its conversation's running dialog, or for its turn after others that
/// wait (`conversation_policy: queue`).
#[derive(Debug)]
pub(crate) struct Queued {
    pub why: String,
    pub conversation: String,
    pub session: String,
}

/// The model a request asks for ([`agent_schema::MODEL_PROPERTY`], set on an ensemble's agents),
/// if config lists it for a pattern's agents: a message cannot make the service call a model
/// config does not name.
fn asked_model<'p>(
    properties: &'p agent_bus::Properties,
    config: &agent_core::config::AgentConfig,
) -> Option<&'p str> {
    let asked = properties.get(agent_schema::MODEL_PROPERTY)?;
    if config.lists_model(asked) {
        Some(asked.as_str())
    } else {
        tracing::warn!(model = %asked, "ignoring a request's model that no pattern's config lists");
        None
    }
}

/// Whether a request starts a dialog. The router's mark is honoured only on what the router
/// queues: a first iteration with its pattern and session set. Anything else without history is a
/// new dialog.
fn is_new_dialog(request: &AgentRequest, properties: &agent_bus::Properties) -> bool {
    let routed = properties.contains_key(router::ROUTED_PROPERTY)
        && !request.pattern.is_empty()
        && !request.session_id.is_empty();
    request.history.is_empty() && !routed
}

/// What every message of the step carries on: a replay's reuse (its next steps and subagents
/// reuse too), and the step's span, so that the next step (in any replica) and the aggregator
/// continue the same trace.
fn carry_forward(out: &mut DialogOutput<'_>, reuse: Option<&replay::Reuse>, span: &tracing::Span) {
    if let Some(reuse) = reuse {
        out.set_property(agent_schema::REUSE_PROPERTY, reuse.label().to_owned());
        // The session the replay started from, not only its run: a later step maps its place
        // in the replay to the source's from it.
        out.set_property(agent_schema::REUSE_FROM_PROPERTY, reuse.source.clone());
    }
    if let Some(context) = agent_telemetry::trace::traceparent(span) {
        out.set_property(agent_telemetry::trace::TRACEPARENT_PROPERTY, context);
    }
}

/// Answers an invalid request: a refused subagent is a failed completion for its supervisor, not
/// the end of the client's dialog; anyone else gets an error response. A refused step of a
/// dialog that has started (`ends_dialog`: this service's own later step, its history outgrown a
/// limit or a limit lowered while it ran, or a first step resumed by an approval) ends that
/// dialog in the graph too, as any error does: a dialog without its conclusion counts as running,
/// and would hold its conversation's next dialogs up until its wall-time budget lapsed (for ever
/// with none). Not for a request whose ids may not name nodes. `parked`: the decision of a call
/// parked for approval that the refused step was resumed to answer; the closing (a subagent's
/// completion) and the conclusion count the LLM call that reached it, which no other node records.
pub(crate) async fn refuse(
    turn: &Turn<'_>,
    problem: &str,
    ends_dialog: bool,
    parked: Option<&crate::approval::ToolDecision>,
) -> Result<(), agent_bus::BusError> {
    tracing::warn!(session = %agent_core::logged::client_text(turn.session_id), %problem, "refusing an invalid request");
    let subagent = agent_core::supervisor::is_subagent(turn.request);
    // A subagent resumed by an answer has a conclusion to write; any other only completes.
    if ends_dialog
        && crate::validate::ids_name_nodes(turn.request)
        && (parked.is_some() || !subagent)
    {
        let n = steps_taken(&turn.request.history) + 1;
        finish::fail_parked(turn, n, problem, parked).await
    } else if subagent {
        finish::error(turn, problem).await
    } else {
        turn.out
            .respond_ending_nothing(&AgentResponse::error(problem.to_owned()))
    }
}

/// Logs and counts a committed step.
pub(crate) fn committed(
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

/// The session of a dialog. A first request gets one derived from its `id` property (or, without
/// one, from its message's id: see `admit`), so that a redelivered first message names the same
/// provenance nodes instead of starting a second session.
pub fn session_id_for(request: &AgentRequest, id: Option<&str>) -> String {
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

/// The journal entry a request will be taken up as, as [`Engine::journal_slot`] names it from
/// the message (its sender has its encoding at hand): `None` where that names no node.
pub(crate) fn entry_of_request(
    request: &AgentRequest,
    properties: &agent_bus::Properties,
    encoded: &[u8],
) -> Option<String> {
    let session_id = session_id_for(request, properties.get(ID_PROPERTY).map(String::as_str));
    let client = properties.get(ID_PROPERTY).map_or("", String::as_str);
    let key = journal::key_of_encoded(request, is_new_dialog(request, properties), client, encoded);
    journal::entry_node(&SessionUris::new(&session_id).session(), &key)
        .ok()
        .map(|node| node.as_str().to_owned())
}

/// The step's span, in the trace its message came with (the client's, or the previous step's).
pub(crate) fn iteration_span(
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
        // Cut: the fields are what a client sent, and are printed with every event of the step.
        session = %agent_core::logged::client_text(session_id),
        iteration = steps_taken(&request.history) + 1,
        id = %agent_core::logged::client_text(id.unwrap_or("")),
        pattern = %agent_core::logged::client_text(&request.pattern),
        correlation = %agent_core::logged::client_text(&request.correlation_id),
        traceparent = traceparent,
    )
}

/// A new dialog's first node: the question as asked (a subagent's hanging off its supervisor's
/// fan-out, so the run is one DAG from the root).
pub(crate) fn record_question(turn: &Turn<'_>) -> Result<(), agent_bus::BusError> {
    let Turn {
        request,
        uris,
        out,
        delivered,
        ..
    } = turn;
    let started = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    // A root's client id tells its dialog from another started under the same session id.
    let client = match agent_core::supervisor::is_subagent(request) {
        true => "",
        false => delivered.get(ID_PROPERTY).map_or("", String::as_str),
    };
    let mut question = provenance::session(uris, &request.question, &started, client);
    if agent_core::supervisor::is_subagent(request) {
        question.extend(provenance::derived_from(
            &uris.session(),
            &SessionUris::new(&request.parent_session_id).fanout(&request.correlation_id),
        ));
    }
    out.explain(&uris.session(), question)
}

/// How a step's message starts its work.
pub(crate) struct Start<'s> {
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
pub(crate) async fn begin_or_continue(
    turn: &Turn<'_>,
    start: Start<'_>,
) -> Result<(), agent_bus::BusError> {
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
pub(crate) fn metrics_label<'a>(
    request: &'a AgentRequest,
    config: &AgentConfig,
    routing: bool,
) -> &'a str {
    match request.pattern.as_str() {
        _ if routing => "router",
        "" => Pattern::React.name(),
        named if config.patterns.contains_key(named) || Pattern::runs(named) => named,
        _ => "other",
    }
}

/// How long past its wall-time budget (and a tool's timeout) a dialog's last step may still run:
/// LLM calls, and a supervisor's fan-in answered at the fan-out timeout (300 s by default).
const STEP_PAST_THE_WALL_SECS: u64 = 300;

#[cfg(test)]
mod tests {
    use super::*;

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
    fn only_what_the_router_queued_continues_a_dialog_without_history() {
        let marked: agent_bus::Properties =
            [(router::ROUTED_PROPERTY.to_owned(), "1".to_owned())].into();
        let fresh = AgentRequest {
            question: "q".into(),
            ..AgentRequest::default()
        };
        assert!(is_new_dialog(&fresh, &agent_bus::Properties::new()));
        // A client's mark on a request without its pattern and session is not believed.
        assert!(is_new_dialog(&fresh, &marked));
        let queued = AgentRequest {
            pattern: "react".into(),
            session_id: "s".into(),
            ..fresh.clone()
        };
        assert!(!is_new_dialog(&queued, &marked));
        assert!(is_new_dialog(&queued, &agent_bus::Properties::new()));
        let later = AgentRequest {
            history: vec![agent_schema::AgentStep::default()],
            ..fresh
        };
        assert!(!is_new_dialog(&later, &agent_bus::Properties::new()));
    }
}
