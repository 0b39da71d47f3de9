//! Tool calls that wait for a person. A tool configured with `requires-approval` is not run when
//! the LLM chooses it: the step records the pending call (tool, arguments, thought, deadline) in
//! the graph with what resuming it needs, tells the client, and ends. Nothing is held in memory
//! and no consumer waits. An answer (`agentctl approve` / `deny`, or the aggregator's `expire`
//! once the deadline passed or the run was cancelled) is taken up by any replica, which resumes exactly that step from the
//! graph; the journal lets the first answer win, so a duplicate or late one changes nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use agent_bus::BusError;
use agent_core::provenance::{self, CallStats};
use agent_core::tools::Scope;
use agent_core::vocab::{tg, NamedNodeRef, DOCUMENTS_GRAPH};
use agent_graph::model::{NamedNode, Term};
use agent_graph::{queries, GraphError, GraphStore, QueryAnswer};
use agent_schema::{control_operation, AgentControl, AgentRequest, AgentResponse, MessageType};
use serde::{Deserialize, Serialize};

use crate::budget::Tokens;
use crate::patterns::react;
use crate::turn::Turn;

/// A ReACT iteration's decision to call a tool, with what it cost: what a parked call resumes with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolDecision {
    pub thought: String,
    pub action: String,
    pub arguments: BTreeMap<String, String>,
    /// What the LLM wrote after its decision, dropped unread (kept for provenance).
    pub discarded: String,
    /// The tools it chose among.
    pub candidates: Vec<String>,
    pub stats: CallStats,
    /// The dialog's tokens with the call that decided.
    pub tokens: Tokens,
}

/// The longest an approval is waited for, whatever the config says.
const LONGEST_APPROVAL_WAIT_SECS: u64 = 10 * 365 * 24 * 3600;

/// When an approval asked at `now` is no longer taken: `wait_secs` later, at most ten years
/// ("never" in a config; a date past chrono's range would panic the step).
fn deadline_after(
    now: chrono::DateTime<chrono::Utc>,
    wait_secs: u64,
) -> chrono::DateTime<chrono::Utc> {
    let wait = Duration::from_secs(wait_secs.min(LONGEST_APPROVAL_WAIT_SECS));
    chrono::Duration::from_std(wait)
        .ok()
        .and_then(|wait| now.checked_add_signed(wait))
        .unwrap_or(now)
}

/// What resuming a parked step needs, kept in the graph while it waits: the step's message as it
/// was delivered and the decision it reached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Continuation {
    pub request: AgentRequest,
    pub properties: BTreeMap<String, String>,
    pub decision: ToolDecision,
    /// Until when an answer is taken (RFC 3339).
    pub deadline: String,
    /// When the call was parked (RFC 3339); empty in a continuation of an earlier build.
    #[serde(default)]
    pub asked: String,
}

/// An answer to a parked call, with the decision it answers.
#[derive(Debug, Clone)]
pub struct Answer {
    pub control: AgentControl,
    pub decision: ToolDecision,
    /// Until when the parked call took an answer (RFC 3339), as the request showed it.
    pub deadline: String,
}

/// How much earlier than the call was parked an answer may say it was given: the approver's clock
/// and the orchestrator's need not agree, and a step parked again (its first park's answer
/// handed back while the store was away) records a later time. An answer older than that was given
/// to another call: one of a dialog whose journal was pruned, which takes a day at the least.
const CLOCKS_DISAGREE_BY: chrono::Duration = chrono::Duration::hours(1);

impl Answer {
    /// Whether it approves, or denies, after the deadline the request showed (by its sealed time
    /// of sending): the sweep's expiry may not have come first (it runs every few seconds, and not
    /// while the aggregator is down), and such an answer must not make the call. An answer whose
    /// time does not read as one cannot show it came in time, and counts as late.
    fn too_late(&self) -> bool {
        let parsed = |t: &str| chrono::DateTime::parse_from_rfc3339(t).ok();
        match (parsed(&self.control.at), parsed(&self.deadline)) {
            (Some(at), Some(deadline)) => at > deadline,
            _ => true,
        }
    }
}

/// Whether `control` was given before the call it answers was asked (`asked`, beyond what two
/// clocks may disagree by): a sealed answer to an earlier call of the same session and step, sent
/// again. A session's id is its client's to choose, so once the earlier dialog's journal is
/// pruned a new dialog under the same id could park a call there, and a person's old approval,
/// copied off the control topic, would make it. A continuation of an earlier build says nothing
/// of when it was asked.
pub fn given_before_asked(control: &AgentControl, asked: &str) -> bool {
    let parsed = |t: &str| chrono::DateTime::parse_from_rfc3339(t).ok();
    match (parsed(&control.at), parsed(asked)) {
        (Some(at), Some(asked)) => at < asked - CLOCKS_DISAGREE_BY,
        _ => false,
    }
}

/// Whether calling `action` (in `scope`) must wait for a person's approval.
pub fn needed(turn: &Turn<'_>, scope: &Scope, action: &str) -> bool {
    turn.config
        .tool_by_name(action)
        .is_some_and(|tool| turn.config.needs_approval(tool) && scope.allows(tool))
}

/// Parks iteration `n`'s call for approval: the pending call in the provenance graph, the
/// continuation beside it (sealed, when a seal key is configured), and a message to the client.
/// Without a shared graph store there is nowhere to wait: the call is not run, and the agent is
/// told so.
pub async fn park(turn: &Turn<'_>, n: usize, decision: ToolDecision) -> Result<(), BusError> {
    if turn.knowledge.is_none() {
        let observation = format!(
            "Error: the tool '{}' runs only with a person's approval, and this deployment has no shared graph store (GRAPH_STORE) to wait in; it was not run.",
            decision.action
        );
        return react::not_run(turn, n, decision, observation).await;
    }
    let Turn { uris, out, .. } = turn;
    let now = chrono::Utc::now();
    let deadline = deadline_after(now, turn.config.limits.approval_timeout_secs);
    let time =
        |t: chrono::DateTime<chrono::Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let (asked_at, deadline) = (time(now), time(deadline));
    let node = uris.approval(n);
    let arguments_json = serde_json::to_string(&decision.arguments).unwrap_or_default();
    out.explain(
        &node,
        provenance::approval_request(
            uris,
            n,
            &decision.action,
            &arguments_json,
            &decision.thought,
            &asked_at,
            &deadline,
        ),
    )?;
    // The run's start, for the resumed step (see `Engine::standing`): a client's first step
    // carries none of its own (nor may it bring one). A subagent's first step keeps what it was
    // delivered with, which its seal covers and is checked against again as it resumes.
    let mut properties = turn.delivered.clone();
    if !agent_core::supervisor::is_subagent(turn.request) {
        properties.insert(
            agent_schema::STARTED_PROPERTY.to_owned(),
            out.started_ms().to_string(),
        );
    }
    let continuation = Continuation {
        request: turn.request.clone(),
        properties,
        decision,
        deadline: deadline.clone(),
        asked: now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    };
    let text = serde_json::to_string(&continuation).unwrap_or_default();
    let mut kept = vec![triple(&node, tg::CONTINUATION, &text)];
    if let Some(key) = turn.seal {
        kept.push(triple(&node, tg::SEAL, &key.seal(&[&node, &text])));
    }
    out.record(&node, kept)?;
    let session = turn.session_id;
    let mut asking = AgentResponse::new(
        MessageType::Observation,
        format!(
            "Waiting for approval to call '{}' with {arguments_json} (step {n}); answer before {deadline} with: agentctl approve {session} {n}  (or: agentctl deny {session} {n}), given the services' AGENT_SEAL_KEY (--unsealed under agentctl up without one)",
            continuation.decision.action
        ),
    );
    asking.message_id = node;
    asking.end_of_message = true;
    out.respond(&asking)
}

fn triple(node: &str, predicate: NamedNodeRef<'_>, value: &str) -> agent_schema::Triple {
    agent_schema::Triple {
        s: agent_schema::Term::iri(node),
        p: agent_schema::Term::iri(predicate.as_str()),
        o: agent_schema::Term::literal(value),
        g: Some(DOCUMENTS_GRAPH.to_owned()),
    }
}

/// What the graph holds for a call parked for approval.
pub enum ParkedCall {
    Found(Box<Continuation>),
    /// Nothing yet: the aggregator may be behind, or no call was parked there.
    Missing,
    /// A continuation this build cannot read (another build's, in a rolling upgrade, may).
    Unreadable(String),
    /// A continuation without this service's seal: another seal key, or written by someone else.
    /// No replica will resume it.
    Unsealed,
}

/// The continuation of the call parked at iteration `step` of `session_id`, if the graph holds
/// one (and, with a seal key, one this service sealed).
pub async fn continuation(
    store: &GraphStore,
    seal: Option<&agent_bus::seal::SealKey>,
    session_id: &str,
    step: u64,
) -> Result<ParkedCall, GraphError> {
    let node = agent_core::provenance::SessionUris::new(session_id).approval(step as usize);
    let Ok(named) = NamedNode::new(node.clone()) else {
        return Ok(ParkedCall::Missing);
    };
    let QueryAnswer::Rows(rows) = store.query(queries::continuation_of(&named)).await? else {
        return Ok(ParkedCall::Missing);
    };
    // Each row a continuation and a seal: a step parked twice holds two of each, and only the
    // pairs a row makes can verify.
    let literal = |term: Option<&Term>| match term {
        Some(Term::Literal(l)) => Some(l.value().to_owned()),
        _ => None,
    };
    let continuations = rows.column("continuation");
    let mut seals = rows.column("seal");
    seals.resize(continuations.len(), None);
    let pairs: Vec<(String, Option<String>)> = continuations
        .into_iter()
        .zip(seals)
        .filter_map(|(kept, seal)| Some((literal(kept)?, literal(seal))))
        .collect();
    let Some(first) = pairs.first() else {
        return Ok(ParkedCall::Missing);
    };
    let kept = match seal {
        None => first.0.clone(),
        Some(key) => {
            let sealed = pairs.iter().find(|(kept, seal)| {
                seal.as_deref()
                    .is_some_and(|s| key.verify(&[&node, kept], s))
            });
            match sealed {
                Some((kept, _)) => kept.clone(),
                None => return Ok(ParkedCall::Unsealed),
            }
        }
    };
    match serde_json::from_str(&kept) {
        Ok(continuation) => Ok(ParkedCall::Found(Box::new(continuation))),
        Err(e) => Ok(ParkedCall::Unreadable(e.to_string())),
    }
}

/// Records `answer` to the call parked at this step: what the approvals sweep looks for, so that
/// an answer taken up, whatever became of the step (resumed, its run cancelled, given up), is not
/// followed by expiries for ever.
pub fn record_answer(turn: &Turn<'_>, answer: &Answer) -> Result<(), BusError> {
    let Turn { uris, out, .. } = turn;
    let n = agent_core::documents::steps_taken(&turn.request.history) + 1;
    let control = &answer.control;
    let edited = match (&control.operation[..], &control.arguments) {
        (control_operation::APPROVE, Some(arguments))
            if *arguments != answer.decision.arguments =>
        {
            serde_json::to_string(arguments).unwrap_or_default()
        }
        _ => String::new(),
    };
    out.explain(
        &uris.approval_answer(n),
        provenance::approval_answer(
            uris,
            n,
            &control.operation,
            &control.by,
            &control.at,
            &control.reason,
            &edited,
        ),
    )
}

/// Resumes the parked step with `answer`: the call runs (with edited arguments, if given), or the
/// agent is told it was denied and goes on, or (expired) the dialog ends with a clear message, a
/// subagent's as a completion its supervisor synthesises around.
pub async fn resume(turn: &Turn<'_>, answer: &Answer) -> Result<(), BusError> {
    let Turn { uris, out, .. } = turn;
    let n = agent_core::documents::steps_taken(&turn.request.history) + 1;
    let control = &answer.control;
    let mut decision = answer.decision.clone();
    record_answer(turn, answer)?;
    if control.operation != control_operation::EXPIRE && answer.too_late() {
        let why = format!(
            "{} answered the call of '{}' at {}, after its deadline {} (approval_timeout_secs); it was not run, and the dialog ends here.",
            control.by, decision.action, control.at, answer.deadline
        );
        return crate::finish::fail_parked(turn, n, &why, Some(&decision)).await;
    }
    match control.operation.as_str() {
        control_operation::APPROVE => {
            // Approved after its supervisor answered without this branch: the call is not made.
            // The client was already told the branch gave no result, and a payment made now
            // would be one no answer accounts for. The answer stays recorded above. (A run whose
            // budget was spent while the call waited makes the call it was approved within the
            // deadline it showed, and stops at its next step.)
            if let Some(ended) = crate::finish::end_if_abandoned(turn, Some(&decision)).await {
                return ended;
            }
            if let Some(arguments) = &control.arguments {
                decision.arguments.clone_from(arguments);
            }
            out.explain(&uris.iteration(n), provenance::approved_iteration(uris, n))?;
            react::act(turn, n, decision, true).await
        }
        control_operation::DENY => {
            let mut observation = format!(
                "Error: {} did not approve calling '{}'; it was not run",
                control.by, decision.action
            );
            if !control.reason.is_empty() {
                observation.push_str(&format!(" ({})", control.reason));
            }
            observation.push_str(". Go on without it.");
            react::not_run(turn, n, decision, observation).await
        }
        _ => {
            let why = format!(
                "No one approved calling '{}' within {} s (approval_timeout_secs); the dialog ends here.",
                decision.action, turn.config.limits.approval_timeout_secs
            );
            crate::finish::fail_parked(turn, n, &why, Some(&decision)).await
        }
    }
}

/// Answers to the same parked call taken up one after another, never side by side: the first
/// commits its outcome to the journal, and a copy that follows finds it there and changes nothing
/// (two copies run at once would both call the tool). With the answers' subscription consumed by
/// one replica at a time (Failover), this holds across replicas too.
#[derive(Default)]
pub struct OneAtATime {
    held:
        std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<tokio::sync::Mutex<()>>>>,
}

impl OneAtATime {
    /// Waits for the call `key` to be free and holds it until the guard drops.
    pub async fn hold(&self, key: &str) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = {
            let mut held = self
                .held
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Forgets the calls no one holds or waits for.
            held.retain(|_, lock| std::sync::Arc::strong_count(lock) > 1);
            held.entry(key.to_owned()).or_default().clone()
        };
        lock.lock_owned().await
    }
}

/// Whether `control` answers a parked call (and names its step). Its session id must be one a
/// request may have (validate.rs): no other names a parked call, and one of megabytes made a
/// query the store refused, so the answer was handed back for ever and held a place among the few
/// answers taken up at once.
pub fn is_answer(control: &AgentControl) -> bool {
    matches!(
        control.operation.as_str(),
        control_operation::APPROVE | control_operation::DENY | control_operation::EXPIRE
    ) && !control.session_id.is_empty()
        && crate::validate::names_a_node(&control.session_id)
        && control.step.is_some_and(|s| s > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_answer_naming_a_session_a_request_may_have_is_an_answer() {
        let answer = |session: &str| AgentControl {
            operation: control_operation::APPROVE.to_owned(),
            session_id: session.to_owned(),
            step: Some(2),
            ..AgentControl::default()
        };
        assert!(is_answer(&answer("s-1")));
        assert!(is_answer(&answer(&"s".repeat(240))));
        assert!(!is_answer(&answer(&"s".repeat(241))));
        assert!(!is_answer(&answer(&"a".repeat(3 << 20))));
        assert!(!is_answer(&answer("s 1")));
        assert!(!is_answer(&answer("s>1")));
        assert!(!is_answer(&answer("")));
    }

    #[test]
    fn an_approval_waited_for_ever_has_a_deadline_in_ten_years() {
        let now = chrono::Utc::now();
        assert_eq!(
            deadline_after(now, 300),
            now + chrono::Duration::seconds(300)
        );
        // It panicked the step (a date past chrono's range) for a wait this long.
        for never in [u64::MAX, 10_000_000_000_000] {
            let deadline = deadline_after(now, never);
            let years = (deadline - now).num_days() / 365;
            assert_eq!(years, 10, "{deadline}");
        }
    }
}
