//! The engine: what every in-flight message shares, and the one place a step's result becomes a
//! disposition (ack, wait out an outage, wait behind a conversation, or give up with an error).

use std::sync::Arc;
use std::time::Duration;

use agent_bus::{Delivery, Disposition, Publisher};
use agent_core::provenance::{self, SessionUris};
use agent_llm::LlmClient;
use agent_schema::AgentRequest;
use tokio_util::sync::CancellationToken;

use crate::emit::{DialogOutput, Outputs};
use crate::journal::Journal;
use crate::live_config::LiveConfig;
use crate::{approval, cancel, emit, events};

/// What an iteration needs, shared by every in-flight message.
pub struct Engine {
    pub config: Arc<LiveConfig>,
    pub llm: LlmClient,
    pub outputs: Outputs,
    /// Without one, iterations are at-least-once: a redelivery runs the step again.
    pub journal: Option<Journal>,
    /// The shared graph store, for the knowledge tools.
    pub knowledge: Option<agent_graph::GraphStore>,
    /// Ended runs' records that replays read, kept a while.
    pub replays: crate::replay::KeptRecords,
    /// Where long texts are kept as documents (claim-check), when anywhere.
    pub documents: Option<crate::documents::DocumentStore>,
    pub mcp: agent_mcp::McpPool,
    /// Cancelled when the process is to stop: a parked step then leaves its message for another
    /// replica instead of waiting on.
    pub shutdown: CancellationToken,
    /// Seals what only this service may send (subagent requests, fan-outs, completions, control
    /// messages), and checks control messages.
    pub seal: Option<agent_bus::seal::SealKey>,
    /// The cancelled runs this replica has heard of.
    pub cancellations: Arc<cancel::Cancellations>,
    /// Answers to parked calls being taken up, one per call at a time.
    pub answering: approval::OneAtATime,
    /// Where this service sends a cancel itself (a conversation's `interrupt` policy).
    pub control: Option<Publisher>,
    /// Whether a journaled dialog's next step runs here rather than through the broker (see
    /// [`emit::CHAIN_PROPERTY`]).
    pub continue_in_process: bool,
    /// The deliveries this process is handling, by broker message id (see [`Engine::handle`]).
    pub handling: Handling,
    /// A step whose message its journal's owner saw taken up by this many processes (or
    /// handlings) without an outcome, each stopping short (a message that crashes its process),
    /// is given up at its next taking, whether or not the broker counts crashes as redeliveries
    /// (`--max-redeliveries`; `None`: never).
    pub max_takings: Option<u32>,
    /// Whose turn it is in each conversation, as far as this replica knows.
    pub turns: crate::conversation::Turns,
    /// How long a new dialog's start in its conversation is kept for it at a time (see
    /// [`agent_graph::turns`]).
    pub start_lease: std::time::Duration,
    /// Answers to parked calls handed back while their calls are not found.
    pub answers_waiting: AnswersWaiting,
    /// Whether a subagent's later step without the step seal is dead-lettered (or only logged).
    pub step_seals: crate::settings::SealRule,
    pub subagent_seals: crate::settings::SealRule,
    /// Whether a control message without this service's seal is ignored (or only logged).
    pub control_seals: crate::settings::SealRule,
}

/// A request's place in its conversation's line, left when dropped (it went, or stopped waiting).
struct InLine<'t> {
    turns: &'t crate::conversation::Turns,
    conversation: String,
    session: String,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.turns.leave(&self.conversation, &self.session);
    }
}

/// Deliveries in hand, each with where its disposition will be told.
pub type Handling = std::sync::Mutex<
    std::collections::HashMap<String, tokio::sync::watch::Receiver<Option<Disposition>>>,
>;

/// What a redelivery waiting for the first is told when that first one's handler stopped short.
const FIRST_HANDLER_STOPPED: &str = "the first delivery's handler stopped";

/// Forgets a delivery in hand once its handler is done (or dropped), telling its disposition to
/// any redelivery of it waiting meanwhile.
struct InHand<'e> {
    handling: &'e Handling,
    message_id: String,
    told: tokio::sync::watch::Sender<Option<Disposition>>,
}

impl InHand<'_> {
    fn done(self, disposition: &Disposition) {
        self.told.send_replace(Some(disposition.clone()));
    }
}

impl Drop for InHand<'_> {
    fn drop(&mut self) {
        emit::locked(self.handling).remove(&self.message_id);
        // Dropped before `done` (its handler cancelled): a waiting redelivery runs on its own.
        if self.told.borrow().is_none() {
            self.told
                .send_replace(Some(Disposition::Nack(FIRST_HANDLER_STOPPED.to_owned())));
        }
    }
}

/// How a delivery is taken up.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Attempt<'a> {
    /// Run the step; `may_park`: an outage may still set it aside (its window is open);
    /// `taker`: this process's token for its handling of the message, the same on every retry
    /// of it here, by which the journal's owner counts its takers (see [`Engine::max_takings`]).
    Run { may_park: bool, taker: &'a str },
    /// The step cannot be run (an outage outlasted its window, a fault that will not pass, a
    /// message the broker gave up on): end the dialog with this error, unless the step's outcome
    /// is already journaled.
    GiveUp(&'a str),
}

/// What became of a delivery.
#[derive(Debug)]
pub(crate) enum Settled {
    Done,
    /// Done, and its dialog's next step is to run in this process.
    Continued(Box<emit::Continuation>),
    /// Set aside by an outage; nothing was committed.
    Parked(emit::Park),
    /// Waiting for another dialog of its conversation to end (`conversation_policy: queue`);
    /// nothing was committed.
    Queued(crate::step::Queued),
    /// Not this service's message, though it says so: nothing is made of it.
    Forged(String),
}

/// The most bytes of edited arguments an approval may carry (names and values).
const MOST_EDITED_BYTES: usize = 64 * 1024;

/// How long an answer to an approval is tried again while the graph does not show its parked
/// call (the aggregator may be behind); past it, the answer is dropped.
const ANSWER_WAIT: Duration = Duration::from_secs(120);

/// How often a dialog queued behind its conversation looks again.
const QUEUE_PAUSE: Duration = Duration::from_millis(500);

/// The shortest and longest pause between tries of a parked step.
const PARK_PAUSE: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// How long a parked step waits before it is tried again: the provider's `Retry-After` or the
/// growing pause, within [`PARK_PAUSE`], and up to a quarter more at random. Every step one outage
/// parked (on every replica) otherwise asked the provider again in the same instant it came back,
/// and again together at each pause after, as one burst.
fn park_wait(retry_after: Option<Duration>, pause: Duration) -> Duration {
    let wait = retry_after
        .unwrap_or(pause)
        .clamp(PARK_PAUSE.0, PARK_PAUSE.1);
    agent_llm::spread(wait)
}

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
    /// Not for this process to finish: the step's journal entry is in a form this build cannot
    /// read (another build recorded it), or the process is stopping while the step waits for the
    /// delivery that recorded it. The message goes back to the broker for another replica.
    #[error("{0:#}")]
    HandedBack(anyhow::Error),
}

impl From<anyhow::Error> for StepError {
    fn from(e: anyhow::Error) -> StepError {
        if e.is::<crate::journal::UnreadableEntry>() || e.is::<emit::StoppedWaiting>() {
            return StepError::HandedBack(e);
        }
        let passes = if let Some(graph) = e.downcast_ref::<agent_graph::GraphError>() {
            graph.retryable()
        } else if let Some(librarian) = e.downcast_ref::<agent_bus::LibrarianError>() {
            librarian.passes()
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
pub(crate) enum Next {
    /// Its effects are on the broker (or there were none to make): ack it.
    Ack,
    /// Its next step runs here: ack it once the chain it starts is done.
    Continue(Box<emit::Continuation>),
    /// Wait out an outage, then run the step again.
    Park(emit::Park),
    /// Wait for the conversation's running dialog, then run the step again (not an outage: it
    /// does not count against the outage window).
    Queue(crate::step::Queued),
    /// End its dialog with this error; then ack, or nack if even that cannot be published.
    GiveUp(String),
    /// Nack it, for another replica: the step is not this build's to settle.
    Release(String),
    /// Dead-letter it, with why: nothing is made of it.
    DeadLetter(String),
}

/// The one place a step's result becomes a decision. `window` is the outage window, for the
/// error that says it was outlasted; `may_park` whether it is still open.
pub(crate) fn next_after(
    result: Result<Settled, StepError>,
    may_park: bool,
    window: Duration,
) -> Next {
    match result {
        Ok(Settled::Done) => Next::Ack,
        Ok(Settled::Continued(continuation)) => Next::Continue(continuation),
        Ok(Settled::Parked(park)) => Next::Park(park),
        Ok(Settled::Queued(queued)) => Next::Queue(queued),
        Ok(Settled::Forged(why)) => Next::DeadLetter(why),
        Err(StepError::Outage(e)) if may_park => Next::Park(emit::Park {
            cause: format!("{e:#}"),
            retry_after: None,
        }),
        Err(StepError::Outage(e)) => Next::GiveUp(format!(
            "a service this step needs stayed unavailable past the outage window of {} s (max_outage_secs): {e:#}",
            window.as_secs()
        )),
        Err(StepError::Fault(e)) => Next::GiveUp(format!("the step failed: {e:#}")),
        Err(StepError::HandedBack(e)) => Next::Release(format!("{e:#}")),
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
    ///
    /// A message this process is handling already can come again: a broker that restarts, or a
    /// connection that drops, hands back what the consumer held unacked, possibly to this same
    /// process. Run beside the first, it would ask the LLM again for a step whose outcome is not
    /// recorded yet (and a dialog continued in process holds its first message for the whole
    /// dialog); so it waits for the first and takes its disposition (a nack of either comes
    /// back later). The bus's consumer keeps such a copy from its handler already (`agent_bus`'s
    /// `redelivered`); this stays as a second guard, should the copy come by another way.
    pub async fn handle(&self, delivery: Delivery<AgentRequest>) -> Disposition {
        let waiting = {
            let mut handling = emit::locked(&self.handling);
            match handling.get(&delivery.message_id) {
                Some(first) => Err(first.clone()),
                None => {
                    let (told, first) = tokio::sync::watch::channel(None);
                    handling.insert(delivery.message_id.clone(), first);
                    Ok(InHand {
                        handling: &self.handling,
                        message_id: delivery.message_id.clone(),
                        told,
                    })
                }
            }
        };
        let in_hand = match waiting {
            Ok(in_hand) => in_hand,
            Err(mut first) => {
                tracing::info!(message = %delivery.message_id, "this message is being handled here already; waiting for that");
                // Only waiting: after a reconnect every queued request comes back at once, and
                // copies holding places would stop the consumer as the requests themselves did.
                let _aside = delivery.aside.step_aside(delivery.payload_bytes);
                let disposition = first
                    .wait_for(Option::is_some)
                    .await
                    .ok()
                    .and_then(|d| d.clone());
                // `InHand` always tells before it goes; should the channel close untold all the
                // same, the redelivery is handed back rather than run beside the first.
                return disposition
                    .unwrap_or_else(|| Disposition::Nack(FIRST_HANDLER_STOPPED.to_owned()));
            }
        };
        // Boxed, as the step is inside (see `run_step`): this future holds the chain's too, and a
        // debug build's worker stack overflowed with the librarian's calls in a step.
        let (disposition, continuation) = Box::pin(self.run_step(delivery, None)).await;
        let disposition = match continuation {
            Some(first) => Box::pin(self.continue_chain(first)).await,
            None => disposition,
        };
        in_hand.done(&disposition);
        disposition
    }

    /// Runs a dialog's next steps here, one after another, while each continues the dialog (see
    /// [`emit::CHAIN_PROPERTY`]), then settles the delivery that started the chain: acked once
    /// every message the chain sent is on the broker and its entries are marked published;
    /// nacked when that fails, so its redelivery re-emits the chain from the journal. A step the
    /// chain cannot finish here (the process is stopping, a step handed back) has its request put
    /// on the broker, for whichever replica takes it.
    async fn continue_chain(&self, first: emit::Continuation) -> Disposition {
        // Held (from before its first step was recorded) until its root is settled: its steps
        // are published only then. Each step's hold is kept to the end.
        let mut holds = Vec::new();
        let mut receipts = Vec::new();
        let mut continued = Vec::new();
        let mut link = first;
        let spill = loop {
            receipts.append(&mut link.receipts);
            let emit::Continuation {
                request,
                node,
                journal,
                held,
                ..
            } = link;
            holds.push(held);
            continued.push((journal, node));
            if self.shutdown.is_cancelled() {
                break Some(request);
            }
            let delivery = match agent_schema::decode::<AgentRequest>(request.payload.as_bytes()) {
                Ok(payload) => Delivery {
                    payload,
                    payload_bytes: request.payload.len(),
                    message_id: request
                        .properties
                        .get(agent_schema::EFFECT_ID_PROPERTY)
                        .cloned()
                        .unwrap_or_default(),
                    properties: request.properties.clone(),
                    raw: std::sync::Arc::from(request.payload.as_bytes()),
                    // A continued step is never a new dialog's, so it never waits aside.
                    aside: agent_bus::Aside::default(),
                },
                // What this build encoded, it decodes; should it not, a replica's consumer
                // judges the message as it would any other.
                Err(_) => break Some(request),
            };
            events::StepContinued {
                entry: continued
                    .last()
                    .map(|(_, node)| node.as_str())
                    .unwrap_or(""),
            }
            .emit();
            match Box::pin(self.run_step(delivery, None)).await {
                (Disposition::Ack, Some(next)) => link = next,
                (Disposition::Ack, None) => break None,
                // Not finished here: its request goes to the broker, as it would have without
                // the chain.
                (_, _) => break Some(request),
            }
        };
        if let Some(request) = spill {
            match self.outputs.publish_effect(&request).await {
                Ok(Some(receipt)) => receipts.push(receipt),
                Ok(None) => {}
                Err(e) => {
                    return Disposition::Nack(format!(
                        "putting a chained step's request on the broker: {e}"
                    ))
                }
            }
        }
        for receipt in receipts {
            if let Err(e) = receipt.wait().await {
                return Disposition::Nack(format!("a chained step's message: {e}"));
            }
        }
        // Every request the chain held back was run here or is on the broker now: a later copy
        // of any of its steps drops. Awaited, unlike a single step's mark: a process stopping
        // right after would leave a whole chain's entries unmarked, which pruning never removes.
        // Failing to mark still acks (a copy would re-emit the same effects, which consumers drop).
        let marked = futures::future::join_all(
            continued
                .iter()
                .map(|(journal, node)| journal.mark_published(node)),
        )
        .await;
        for (result, (_, node)) in marked.into_iter().zip(&continued) {
            if let Err(e) = result {
                tracing::warn!(entry = %node.as_str(), error = %e, "published, but not marked in the journal");
            }
        }
        // Published and marked: a copy now drops rather than waits.
        drop(holds);
        Disposition::Ack
    }

    /// [`Engine::handle`] for a step that is either the one its message asks for, or (`answer`)
    /// the resumption of that step, parked for approval, with the answer it got.
    async fn run_step(
        &self,
        delivery: Delivery<AgentRequest>,
        answer: Option<&approval::Answer>,
    ) -> (Disposition, Option<emit::Continuation>) {
        let mut outage: Option<std::time::Instant> = None;
        let mut pause = PARK_PAUSE.0;
        let taker = uuid::Uuid::new_v4().simple().to_string();
        // Held while the step waits for its conversation (given back as it is let start): its
        // place among the consumer's handlers goes meanwhile to the messages it may wait for.
        let mut aside = None;
        // Its place in its conversation's line, once it queued: left however the step ends.
        let mut in_line: Option<InLine<'_>> = None;
        // Its start in its conversation, once let start: renewed while it runs and while it is
        // parked, until the step is settled here.
        let mut kept_start = None;
        loop {
            let window = Duration::from_secs(self.config.current().limits.max_outage_secs);
            let may_park = outage.map_or(!window.is_zero(), |since| since.elapsed() < window);
            // Boxed: a step's future is large (every pattern's state), and a worker's stack is
            // not (a debug build overflowed it once resumption joined the step).
            let attempt = Attempt::Run {
                may_park,
                taker: &taker,
            };
            let result = Box::pin(self.handle_inner(
                delivery.clone(),
                attempt,
                answer,
                &mut aside,
                &mut kept_start,
            ))
            .await;
            let park = match next_after(result, may_park, window) {
                Next::Ack => return (Disposition::Ack, None),
                Next::Continue(continuation) => return (Disposition::Ack, Some(*continuation)),
                Next::Queue(queued) => {
                    tracing::debug!(why = %queued.why, "queued behind its conversation");
                    if in_line.is_none() {
                        in_line = Some(InLine {
                            turns: &self.turns,
                            conversation: queued.conversation.clone(),
                            session: queued.session.clone(),
                        });
                    }
                    if aside.is_none() {
                        aside = delivery.aside.step_aside(delivery.payload_bytes);
                        if aside.is_none() {
                            let why = format!("{}; as many requests as this replica holds wait for their conversations already", queued.why);
                            return (self.give_up(delivery, &why, answer).await, None);
                        }
                    }
                    tokio::select! {
                        _ = self.shutdown.cancelled() => {
                            return (Disposition::Nack("shutting down while queued".to_owned()), None)
                        }
                        _ = self.turns.until_first(&queued.conversation, &queued.session, QUEUE_PAUSE) => {}
                        // Cancelled while it waits: its step ends it without waiting its turn.
                        _ = self.cancellations.cancelled(&queued.session) => {}
                    }
                    // Waiting its turn is not an outage: a park before it (a blip of the
                    // journal) must not leave its window running while the dialog ahead runs,
                    // or the step's first outage after it ended the dialog at once.
                    outage = None;
                    pause = PARK_PAUSE.0;
                    continue;
                }
                // Waiting out an outage, it waits as any step does, in its place.
                Next::Park(park) => {
                    aside = None;
                    park
                }
                Next::GiveUp(why) => return (self.give_up(delivery, &why, answer).await, None),
                Next::Release(why) => {
                    events::StepReleased { why: &why }.emit();
                    return (Disposition::Nack(why), None);
                }
                Next::DeadLetter(why) => {
                    tracing::warn!(%why, "dead-lettering a forged step");
                    return (Disposition::DeadLetter(why), None);
                }
            };
            let since = *outage.get_or_insert_with(std::time::Instant::now);
            let wait = park_wait(park.retry_after, pause);
            pause = (pause * 2).min(PARK_PAUSE.1);
            events::StepParked {
                cause: &park.cause,
                outage: since.elapsed(),
                retry_in: wait,
            }
            .emit();
            tokio::select! {
                _ = self.shutdown.cancelled() => {
                    return (Disposition::Nack("shutting down while parked".to_owned()), None)
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
        match Box::pin(self.handle_inner(
            delivery,
            Attempt::GiveUp(why),
            answer,
            &mut None,
            &mut None,
        ))
        .await
        {
            Ok(_) => Disposition::Ack,
            Err(e) => Disposition::Nack(e.to_string()),
        }
    }

    /// Cancels the conversation's running dialog `session_id` for the new dialog `by` (policy
    /// `interrupt`): the cancel is recorded with this step's effects and heard by every replica
    /// now, as `agentctl cancel` does it.
    pub(crate) async fn interrupt(
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
        // Recorded now, before the cancel goes out: held with this step's effects, it was lost
        // when the step parked (its retry, let start before, interrupts nothing again), and the
        // interrupted dialog's end linked to a cancellation the graph never had (nor did the
        // approvals sweep, which expires a cancelled run's parked calls, know of it).
        out.record_now(
            &uris.cancellation(),
            provenance::cancellation(&uris, &control.by, &control.at, &control.reason),
        )
        .await?;
        if let Some(cancel) = cancel::from_control(&control) {
            self.cancellations.record(cancel);
        }
        if let Some(publisher) = &self.control {
            let (payload, properties) = agent_bus::sealed_control(&control, self.seal.as_ref());
            publisher.send(payload, &properties).await?;
        }
        Ok(())
    }

    /// Takes up an answer to a call parked for approval: resumes that step, as its message was
    /// delivered, with the decision it reached and the answer. The first answer wins (the
    /// resumption's journal slot); another changes nothing. An answer the graph has no parked call
    /// for yet is tried again for a while (the aggregator may be behind), then dropped.
    pub async fn answer(&self, delivery: Delivery<agent_schema::AgentControl>) -> Disposition {
        let message_id = delivery.message_id.clone();
        let disposition = self.take_up_answer(delivery).await;
        if matches!(disposition, Disposition::Nack(_)) {
            self.answers_waiting.handed_back(&message_id);
        } else {
            self.answers_waiting.forget(&message_id);
        }
        disposition
    }

    /// [`Engine::answer`], but for remembering how long a handed-back answer has waited.
    async fn take_up_answer(&self, delivery: Delivery<agent_schema::AgentControl>) -> Disposition {
        let waited = self.answers_waiting.waited(&delivery.message_id);
        if !crate::control_seals::sealed_as_required(
            self.seal.as_ref(),
            self.control_seals,
            &delivery.payload,
            &delivery.raw,
            &delivery.properties,
        ) {
            return Disposition::Ack;
        }
        let mut control = delivery.payload;
        // Recorded in the graph, and a denial's reason goes into every later prompt.
        for text in [&mut control.by, &mut control.at, &mut control.reason] {
            *text = cancel::bounded(text);
        }
        let edited_bytes: usize = control
            .arguments
            .iter()
            .flatten()
            .map(|(k, v)| k.len() + v.len())
            .sum();
        if control.operation == agent_schema::control_operation::APPROVE
            && edited_bytes > MOST_EDITED_BYTES
        {
            tracing::warn!(session = %agent_core::logged::client_text(&control.session_id), edited_bytes, "an approval whose edited arguments are over {MOST_EDITED_BYTES} bytes; the answer is dropped");
            return Disposition::Ack;
        }
        if !approval::is_answer(&control) {
            let session = agent_core::logged::client_text(&control.session_id);
            let operation = agent_core::logged::client_text(&control.operation);
            tracing::warn!(%operation, %session, "ignoring a control request that answers no parked call");
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
            Ok(approval::ParkedCall::Found(continuation)) => {
                let mut continuation = *continuation;
                // A first request with neither an id nor a session was named after its own
                // message; resumed by this one, it would be named after the answer's. It was
                // found under the session the answer names, which is its own.
                if continuation.request.session_id.is_empty() {
                    continuation
                        .request
                        .session_id
                        .clone_from(&control.session_id);
                }
                continuation
            }
            Ok(approval::ParkedCall::Unsealed) => {
                // No replica will resume it: asking again would only hold a slot.
                tracing::warn!(session = %control.session_id, step, "the call parked for approval does not carry this service's seal; the answer is dropped");
                return Disposition::Ack;
            }
            Ok(approval::ParkedCall::Unreadable(why)) => {
                // Another build (a rolling upgrade) may read it: handed back while answers wait.
                if waited_out(&control, waited) {
                    tracing::warn!(session = %control.session_id, step, error = %why, "the call parked for approval cannot be read by this build; the answer is dropped");
                    return Disposition::Ack;
                }
                return Disposition::Nack(format!(
                    "the parked call cannot be read by this build: {why}"
                ));
            }
            Ok(approval::ParkedCall::Missing) => {
                if waited_out(&control, waited) {
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
        // Dropped unanswered: the person's answer to this call may still come.
        if approval::given_before_asked(&control, &continuation.asked) {
            tracing::warn!(session = %control.session_id, step, at = %control.at, asked = %continuation.asked, "an answer given before the call was asked (an earlier call's, sent again); dropped");
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
        let raw: std::sync::Arc<[u8]> = agent_schema::encode(&continuation.request).into();
        let resumed = Delivery {
            payload: continuation.request,
            properties: continuation.properties,
            message_id: delivery.message_id,
            payload_bytes: raw.len(),
            raw,
            aside: delivery.aside,
        };
        let answer = approval::Answer {
            control,
            decision: continuation.decision,
            deadline: continuation.deadline,
        };
        Box::pin(self.run_step(resumed, Some(&answer))).await.0
    }
}

/// Whether the answer `control` was given more than [`ANSWER_WAIT`] ago: long enough for a parked
/// call that may yet appear (or be read by another build) to have done so. Its sender's `at`
/// says so, or the time it has waited here (`waited`) does: an `at` that does not parse, or lies
/// in the future, would otherwise have it handed back for ever.
fn waited_out(control: &agent_schema::AgentControl, waited: Duration) -> bool {
    let age = chrono::DateTime::parse_from_rfc3339(&control.at)
        .map(|at| chrono::Utc::now().signed_duration_since(at))
        .unwrap_or_default();
    age > chrono::Duration::seconds(ANSWER_WAIT.as_secs() as i64) || waited > ANSWER_WAIT
}

/// When this process first handed back each answer it holds back, by message id.
#[derive(Debug, Default)]
pub struct AnswersWaiting(std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>);

/// The most answers remembered; past it, the one remembered longest is forgotten (another
/// replica may have taken it up since), and at worst an answer waits twice as long.
const ANSWERS_REMEMBERED: usize = 1024;

impl AnswersWaiting {
    /// How long ago this process first handed back the message `message_id` (zero if never).
    fn waited(&self, message_id: &str) -> Duration {
        emit::locked(&self.0)
            .get(message_id)
            .map_or(Duration::ZERO, std::time::Instant::elapsed)
    }

    /// Remembers that `message_id` was handed back, if it is not remembered already.
    fn handed_back(&self, message_id: &str) {
        let mut seen = emit::locked(&self.0);
        if seen.contains_key(message_id) {
            return;
        }
        if seen.len() >= ANSWERS_REMEMBERED {
            let oldest = seen
                .iter()
                .min_by_key(|(_, first)| **first)
                .map(|(id, _)| id.clone());
            if let Some(oldest) = oldest {
                seen.remove(&oldest);
            }
        }
        seen.insert(message_id.to_owned(), std::time::Instant::now());
    }

    fn forget(&self, message_id: &str) {
        emit::locked(&self.0).remove(message_id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A parked step waits at least what the provider asked (within the bounds), and steps
    /// parked together are spread over the next quarter of it rather than woken as one.
    #[test]
    fn parked_steps_wait_what_was_asked_and_are_spread() {
        let asked = Duration::from_secs(4);
        let waits: std::collections::BTreeSet<Duration> = (0..50)
            .map(|_| park_wait(Some(asked), PARK_PAUSE.0))
            .collect();
        assert!(waits.len() > 10, "{waits:?}");
        assert!(waits
            .iter()
            .all(|w| *w >= asked && *w <= asked.mul_f64(1.25)));
        let first = park_wait(None, Duration::ZERO);
        assert!(first >= PARK_PAUSE.0 && first <= PARK_PAUSE.0.mul_f64(1.25));
        let longest = park_wait(Some(Duration::from_secs(3600)), PARK_PAUSE.0);
        assert!(longest >= PARK_PAUSE.1 && longest <= PARK_PAUSE.1.mul_f64(1.25));
    }

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
    fn an_answer_waits_for_its_call_a_bounded_time_whatever_its_at_says() {
        let answer = |at: &str| agent_schema::AgentControl {
            at: at.to_owned(),
            ..Default::default()
        };
        let long_ago = (chrono::Utc::now() - chrono::Duration::minutes(5)).to_rfc3339();
        let just_now = chrono::Utc::now().to_rfc3339();
        let far_ahead = "9999-01-01T00:00:00Z";
        assert!(waited_out(&answer(&long_ago), Duration::ZERO));
        assert!(!waited_out(&answer(&just_now), Duration::ZERO));
        for at in ["", "yesterday", far_ahead] {
            assert!(!waited_out(&answer(at), Duration::from_secs(1)), "{at}");
            assert!(
                waited_out(&answer(at), ANSWER_WAIT + Duration::from_secs(1)),
                "{at}"
            );
        }
        // How long an answer waited here is remembered from its first handing back, until
        // forgotten, for a bounded number of answers.
        let waiting = AnswersWaiting::default();
        assert_eq!(waiting.waited("m1"), Duration::ZERO);
        let long_ago = std::time::Instant::now()
            .checked_sub(ANSWER_WAIT * 2)
            .unwrap();
        emit::locked(&waiting.0).insert("m1".to_owned(), long_ago);
        waiting.handed_back("m1");
        assert!(waiting.waited("m1") > ANSWER_WAIT);
        waiting.forget("m1");
        assert_eq!(waiting.waited("m1"), Duration::ZERO);
        emit::locked(&waiting.0).insert("oldest".to_owned(), long_ago);
        for i in 0..ANSWERS_REMEMBERED + 10 {
            waiting.handed_back(&format!("m{i}"));
        }
        assert_eq!(emit::locked(&waiting.0).len(), ANSWERS_REMEMBERED);
        assert_eq!(waiting.waited("oldest"), Duration::ZERO);
    }

    #[test]
    fn a_step_whose_entry_this_build_cannot_read_goes_back_to_the_broker() {
        let unreadable = || {
            StepError::from(anyhow::Error::from(crate::journal::UnreadableEntry {
                entry: "urn:s/journal/i2-x".to_owned(),
                reason: "unknown form".to_owned(),
            }))
        };
        assert!(matches!(unreadable(), StepError::HandedBack(_)));
        // Whether or not the outage window is open: it is no outage, and no fault of the dialog.
        for may_park in [true, false] {
            assert!(matches!(
                next_after(Err(unreadable()), may_park, Duration::from_secs(60)),
                Next::Release(why) if why.contains("urn:s/journal/i2-x") && why.contains("cannot read")
            ));
        }
    }
}
