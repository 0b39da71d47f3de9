//! Run control from the command line. `agentctl cancel` stops a running dialog and every subagent
//! under it: the cancel is recorded in the provenance graph (who, when, why) and heard by every
//! orchestrator replica on the control topic; the dialog then ends with one `cancelled` error for
//! its client (a call of it parked for approval is expired by the aggregator's sweep). A dialog the
//! graph shows ended, with no subagents that could still run, is not cancelled. `agentctl
//! approve` and `deny` answer a tool call parked for approval; one replica takes the answer up
//! and resumes that step. Each is sealed with the services' key, without which orchestrators
//! that have one ignore it.

use agent_bus::{send_control, BrokerArgs, Properties, Publisher};
use agent_core::provenance::{self, SessionUris};
use agent_schema::{control_operation, AgentControl, Metadata, Triples};
use anyhow::Context;

#[derive(clap::Args, Debug, Clone)]
pub struct CancelArgs {
    /// The session to stop (shown by `agentctl invoke` and in every message id:
    /// `urn:trustgraph:agent:{session}/...`); a subagent's stops only that branch.
    pub session: String,
    /// Who cancels, as the graph records it (default: the user running this command).
    #[arg(long)]
    pub by: Option<String>,
    /// Why, as the graph records it and the client is told.
    #[arg(long, default_value = "")]
    pub reason: String,
    /// The collection the dialog's provenance is in.
    #[arg(long, default_value = "default")]
    pub collection: String,
    /// The secret the services share: orchestrators with a seal key act only on a cancel sealed
    /// with it, and the cancel is recorded in the graph only sealed with it.
    #[arg(long, env = "AGENT_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<String>,
    /// Send it unsealed, without a key: only for orchestrators that take unsealed control
    /// messages (`agentctl up` without AGENT_SEAL_KEY, `--control-seals warn`, or no seal key).
    #[arg(long)]
    pub unsealed: bool,
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// Where to look first whether the dialog already ended (skipped when it cannot be read).
    #[command(flatten)]
    pub store: crate::graph::StoreArgs,
}

/// How long `agentctl cancel` gives the graph to say whether the dialog ended: no longer, since a
/// cancel that matters is urgent, and a graph that cannot say is no reason not to send.
const GRAPH_PATIENCE: std::time::Duration = std::time::Duration::from_secs(2);

/// What the graph at `store` shows of `session`, read within [`GRAPH_PATIENCE`].
#[derive(Debug, PartialEq, Eq)]
enum Shown {
    /// Running, not shown yet, or the graph could not be read.
    NotEnded,
    /// Ended, having started subagents (which may run past their supervisor's answer).
    EndedWithSubagents,
    Ended,
}

async fn shown(store: &crate::graph::StoreArgs, session: &str) -> Shown {
    let read = async {
        let store = store.open().ok()?;
        if !agent_graph::recorded::concluded(&store, session)
            .await
            .ok()?
        {
            return Some(Shown::NotEnded);
        }
        let node = agent_graph::queries::session_node(session).ok()?;
        Some(
            match store.query(agent_graph::queries::fanned_out(&node)).await {
                Ok(agent_graph::QueryAnswer::Boolean(false)) => Shown::Ended,
                _ => Shown::EndedWithSubagents,
            },
        )
    };
    match tokio::time::timeout(GRAPH_PATIENCE, read).await {
        Ok(Some(shown)) => shown,
        _ => Shown::NotEnded,
    }
}

/// The session named by `given` (an id, or any node's IRI under it).
fn session_of(given: &str) -> anyhow::Result<String> {
    let session = agent_core::vocab::session_id_of(given).unwrap_or(given);
    anyhow::ensure!(!session.is_empty(), "no session given");
    Ok(session.to_owned())
}

/// The services' key from `secret` (`--seal-key`, `AGENT_SEAL_KEY`); without one, an error
/// unless `unsealed` says the control message may go unsealed (it would otherwise be sent, said
/// done, and ignored by every orchestrator that has a key).
fn seal_key(
    secret: Option<&str>,
    unsealed: bool,
) -> anyhow::Result<Option<agent_bus::seal::SealKey>> {
    match secret.map(str::trim).filter(|k| !k.is_empty()) {
        Some(secret) => Ok(Some(agent_bus::seal::SealKey::new(secret.as_bytes()))),
        None if unsealed => Ok(None),
        None => anyhow::bail!("no AGENT_SEAL_KEY: orchestrators that have the services' seal key ignore an unsealed control message. Set AGENT_SEAL_KEY (or --seal-key) to the services' key, or pass --unsealed for a stack that takes unsealed ones (agentctl up without AGENT_SEAL_KEY)"),
    }
}

/// Who is asking: `--by`, else the user running the command.
fn asker(by: Option<&str>) -> String {
    by.map(str::to_owned).unwrap_or_else(|| {
        std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| "agentctl".to_owned())
    })
}

fn now() -> String {
    chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

pub async fn cancel(args: CancelArgs) -> anyhow::Result<i32> {
    let session = session_of(&args.session)?;
    let key = seal_key(args.seal_key.as_deref(), args.unsealed)?;
    let shown = shown(&args.store, &session).await;
    if shown == Shown::Ended {
        eprintln!("session {session} has already ended (the graph holds its conclusion): nothing to cancel, nothing sent");
        return Ok(1);
    }
    let by = asker(args.by.as_deref());
    let at = now();
    let bus = args
        .broker
        .connect_within(crate::BROKER_PATIENCE)
        .await
        .with_context(|| format!("connecting to {}", args.broker.pulsar_url))?;
    let topics = args.broker.topics();
    let control = AgentControl {
        operation: control_operation::CANCEL.to_owned(),
        session_id: session.clone(),
        by,
        reason: args.reason.clone(),
        at,
        ..AgentControl::default()
    };
    // The record first: a replica that starts after the control message was sent reads it there.
    let uris = SessionUris::new(&session);
    let record = Triples {
        metadata: Metadata {
            id: uris.cancellation(),
            root: uris.session(),
            collection: args.collection.clone(),
        },
        triples: provenance::cancellation(&uris, &control.by, &control.at, &control.reason),
    };
    // Only a sealed record is written (the aggregator leaves the agent's records out of anything
    // else): without the key there is no record to make here, only the control message, and an
    // orchestrator that acts on it records it instead.
    if let Some(key) = &key {
        let payload = agent_schema::encode(&record);
        let seal = key.seal_explain(&payload);
        let properties: Properties =
            [(agent_bus::seal::EXPLAIN_SEAL_PROPERTY.to_owned(), seal)].into();
        Publisher::new(&bus, &topics.explainability)
            .await?
            .send(payload, &properties)
            .await
            .context("recording the cancel in the graph")?;
    }
    send_control(&bus, &topics, &control, key.as_ref())
        .await
        .context("sending the cancel to the orchestrators")?;
    if key.is_none() {
        eprintln!(
            "sent unsealed: only orchestrators that take unsealed control messages act on it, and those record it in the graph (marked tg:controlSealed false); orchestrators with a seal key that require it sealed ignore it, and then nothing is recorded"
        );
    }
    if shown == Shown::EndedWithSubagents {
        println!(
            "cancelled session {session} (by {}, at {}): it had already answered; its subagents that still run stop",
            control.by, control.at
        );
    } else {
        println!(
            "cancelled session {session} (by {}, at {}): if it still runs, it stops and its client gets one closing 'cancelled' error",
            control.by, control.at
        );
    }
    Ok(0)
}

#[derive(clap::Args, Debug, Clone)]
pub struct ApproveArgs {
    /// The session whose call waits (as the approval message names it).
    pub session: String,
    /// The step (iteration) whose call waits.
    pub step: u64,
    /// Run the tool with these arguments instead (a JSON object of strings).
    #[arg(long)]
    pub arguments: Option<String>,
    /// Who approves, as the graph records it (default: the user running this command).
    #[arg(long)]
    pub by: Option<String>,
    /// Why, as the graph records it.
    #[arg(long, default_value = "")]
    pub reason: String,
    /// The secret the services share: an orchestrator with a seal key takes up only an answer
    /// sealed with it.
    #[arg(long, env = "AGENT_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<String>,
    /// Send it unsealed, without a key (see `agentctl cancel --unsealed`).
    #[arg(long)]
    pub unsealed: bool,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

#[derive(clap::Args, Debug, Clone)]
pub struct DenyArgs {
    /// The session whose call waits (as the approval message names it).
    pub session: String,
    /// The step (iteration) whose call waits.
    pub step: u64,
    /// Who denies, as the graph records it (default: the user running this command).
    #[arg(long)]
    pub by: Option<String>,
    /// Why, as the graph records it and the agent is told.
    #[arg(long, default_value = "")]
    pub reason: String,
    /// The secret the services share: an orchestrator with a seal key takes up only an answer
    /// sealed with it.
    #[arg(long, env = "AGENT_SEAL_KEY", hide_env_values = true)]
    pub seal_key: Option<String>,
    /// Send it unsealed, without a key (see `agentctl cancel --unsealed`).
    #[arg(long)]
    pub unsealed: bool,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

pub async fn approve(args: ApproveArgs) -> anyhow::Result<i32> {
    let arguments = match &args.arguments {
        Some(json) => Some(
            serde_json::from_str::<std::collections::BTreeMap<String, String>>(json)
                .context("--arguments must be a JSON object of strings")?,
        ),
        None => None,
    };
    let control = AgentControl {
        operation: control_operation::APPROVE.to_owned(),
        session_id: session_of(&args.session)?,
        by: asker(args.by.as_deref()),
        reason: args.reason.clone(),
        at: now(),
        step: Some(args.step),
        arguments,
    };
    answer(
        &args.broker,
        &control,
        seal_key(args.seal_key.as_deref(), args.unsealed)?,
    )
    .await
}

pub async fn deny(args: DenyArgs) -> anyhow::Result<i32> {
    let control = AgentControl {
        operation: control_operation::DENY.to_owned(),
        session_id: session_of(&args.session)?,
        by: asker(args.by.as_deref()),
        reason: args.reason.clone(),
        at: now(),
        step: Some(args.step),
        arguments: None,
    };
    answer(
        &args.broker,
        &control,
        seal_key(args.seal_key.as_deref(), args.unsealed)?,
    )
    .await
}

async fn answer(
    broker: &BrokerArgs,
    control: &AgentControl,
    key: Option<agent_bus::seal::SealKey>,
) -> anyhow::Result<i32> {
    anyhow::ensure!(
        control.step.is_some_and(|s| s > 0),
        "steps are numbered from 1"
    );
    let bus = broker
        .connect_within(crate::BROKER_PATIENCE)
        .await
        .with_context(|| format!("connecting to {}", broker.pulsar_url))?;
    send_control(&bus, &broker.topics(), control, key.as_ref())
        .await
        .context("sending the answer")?;
    if key.is_none() {
        eprintln!(
            "sent unsealed: only orchestrators that take unsealed control messages act on it"
        );
    }
    println!(
        "{} step {} of session {} (by {}); the first answer to a call is the one that counts",
        if control.operation == control_operation::APPROVE {
            "approved"
        } else {
            "denied"
        },
        control.step.unwrap_or_default(),
        control.session_id,
        control.by
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_key_a_control_message_goes_only_when_told_unsealed() {
        let refused = seal_key(None, false).map(|_| ()).unwrap_err().to_string();
        assert!(refused.contains("--unsealed"), "{refused}");
        assert!(seal_key(Some("  "), false).is_err());
        assert!(seal_key(None, true).is_ok_and(|key| key.is_none()));
        assert!(seal_key(Some("k"), false).is_ok_and(|key| key.is_some()));
    }
}
