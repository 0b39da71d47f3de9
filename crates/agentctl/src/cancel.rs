//! `agentctl cancel`: stops a running dialog and every subagent under it. The cancel is recorded in
//! the provenance graph (who, when, why) and heard by every orchestrator replica on the control
//! topic; the dialog then ends with one `cancelled` error for its client.

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
    #[command(flatten)]
    pub broker: BrokerArgs,
}

pub async fn run(args: CancelArgs) -> anyhow::Result<i32> {
    let session = agent_core::vocab::session_id_of(&args.session)
        .unwrap_or(&args.session)
        .to_owned();
    anyhow::ensure!(!session.is_empty(), "no session to cancel");
    let by = args.by.clone().unwrap_or_else(|| {
        std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| "agentctl".to_owned())
    });
    let at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let bus = args
        .broker
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.broker.pulsar_url))?;
    let topics = args.broker.topics();
    let control = AgentControl {
        operation: control_operation::CANCEL.to_owned(),
        session_id: session.clone(),
        by,
        reason: args.reason.clone(),
        at,
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
    Publisher::new(&bus, &topics.explainability)
        .await?
        .send(agent_schema::encode(&record), &Properties::new())
        .await
        .context("recording the cancel in the graph")?;
    send_control(&bus, &topics, &control)
        .await
        .context("sending the cancel to the orchestrators")?;
    println!(
        "cancelled session {session} (by {}, at {}); its client gets one closing 'cancelled' error",
        control.by, control.at
    );
    Ok(0)
}
