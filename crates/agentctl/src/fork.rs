//! `agentctl fork`: starts a new session from the recorded input of any step of a finished or
//! failed dialog, optionally with an edited question, observation, state, tool groups or pattern,
//! and follows it like `invoke`. The fork's root records where it came from and what its input
//! changes there (the orchestrator compares it with the recorded input itself), so `agentctl
//! explain` shows both branches. `--model` runs the fork on another configured model. `--reuse` gives recorded LLM answers to the very same questions
//! and recorded results of the same tool calls again instead of calling (no second charge).

use std::time::{Duration, Instant};

use agent_bus::{AgentClient, BrokerArgs, Properties};
use agent_core::fork::history_entry_mut;
use agent_graph::{recorded, GraphError, GraphStore};
use agent_schema::{
    AgentRequest, FORK_OF_PROPERTY, FORK_STEP_PROPERTY, MODEL_PROPERTY, REUSE_FROM_PROPERTY,
    REUSE_PROPERTY,
};
use anyhow::{bail, Context};

use crate::graph::StoreArgs;
use crate::invoke::{follow, Renderer};

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// Call every LLM and tool afresh.
    None,
    /// Give recorded LLM answers to the very same questions again.
    Llm,
    /// Give recorded results of the same tool with the same arguments again.
    Tools,
    /// Both.
    All,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ForkArgs {
    /// The session to fork (its id, or any node's IRI under it).
    pub session: String,
    /// The step to start from: the fork is given what this step was given (its iterations are
    /// numbered as `agentctl explain` shows them; 1 starts the dialog again).
    #[arg(long = "from")]
    pub from: usize,
    /// Ask another question.
    #[arg(long)]
    pub question: Option<String>,
    /// Replace an observation the step was given (by default the one just before it).
    #[arg(long)]
    pub observation: Option<String>,
    /// Which step's observation `--observation` replaces.
    #[arg(long, requires = "observation")]
    pub observation_step: Option<usize>,
    /// Another tool state.
    #[arg(long)]
    pub state: Option<String>,
    /// Other tool groups (repeat for several; `*` for all).
    #[arg(long = "group")]
    pub groups: Vec<String>,
    /// Another pattern (from step 1 only; empty lets the meta-router choose again).
    #[arg(long)]
    pub pattern: Option<String>,
    /// Another model for the fork's LLM calls (one config names: an `llm-model` entry, or a
    /// pattern's `models`); recorded on every call node as `tg:model`.
    #[arg(long)]
    pub model: Option<String>,
    /// What to give again from the source's record instead of calling.
    #[arg(long, value_enum, default_value_t = Reuse::None)]
    pub reuse: Reuse,
    /// Print every response as one JSON line.
    #[arg(long)]
    pub json: bool,
    /// Print the provenance triples as they arrive.
    #[arg(long)]
    pub explain: bool,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    #[command(flatten)]
    pub store: StoreArgs,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

/// The fork's first request: the recorded input with the edits asked for, under a new session.
pub fn edited(
    mut input: AgentRequest,
    args: &ForkArgs,
    session: &str,
) -> anyhow::Result<AgentRequest> {
    if let Some(question) = &args.question {
        input.question.clone_from(question);
    }
    if let Some(text) = &args.observation {
        let step = args.observation_step.unwrap_or(args.from.saturating_sub(1));
        if step == 0 || step >= args.from {
            bail!("step {} is given the observations of steps 1 to {}; --observation-step {step} is not one of them", args.from, args.from.saturating_sub(1));
        }
        let Some(entry) = history_entry_mut(&mut input.history, step) else {
            bail!("step {step}'s observation is folded into a summary in step {}'s input; fork from an earlier step to edit it", args.from);
        };
        entry.observation.clone_from(text);
    }
    if args.state.is_some() {
        input.state.clone_from(&args.state);
    }
    if !args.groups.is_empty() {
        input.group = Some(args.groups.clone());
    }
    if let Some(pattern) = &args.pattern {
        if args.from > 1 {
            bail!("--pattern applies to a fork from step 1: later steps continue their pattern's own state");
        }
        input.pattern.clone_from(pattern);
        if pattern.is_empty() {
            input.task_type.clear();
            input.framing.clear();
        }
    }
    // A fork is a dialog of its own: not a subagent of the source's supervisor, not a turn of
    // its conversation.
    input.session_id = session.to_owned();
    input.parent_session_id.clear();
    input.correlation_id.clear();
    input.subagent_goal.clear();
    input.expected_siblings = 0;
    input.conversation_id.clear();
    Ok(input)
}

/// How long a fork waits for its source's records to show in the graph. The aggregator writes
/// them after the source's client was answered, so a fork asked for on the answer would otherwise
/// find a step "not recorded", or, reusing, call again what the source's last steps recorded.
const SOURCE_SHOWN_WITHIN: Duration = Duration::from_secs(10);

/// The recorded input of step `from` of `source`, read once the graph shows it and, for a fork
/// that reuses recordings, once it shows the source ended (all it recorded is then there). A
/// source still running is forked after `patience` with what it recorded so far.
async fn source_input(
    store: &GraphStore,
    source: &str,
    from: usize,
    reuses: bool,
    patience: Duration,
) -> Result<Result<AgentRequest, String>, GraphError> {
    let deadline = Instant::now() + patience;
    let mut pause = Duration::from_millis(20);
    loop {
        // The end first: shown, the input read after it is there too.
        let concluded = recorded::concluded(store, source).await?;
        let input = recorded::step_input(store, source, from).await?;
        let waiting = Instant::now() + pause <= deadline;
        match &input {
            Ok(_) if concluded || !reuses => return Ok(input),
            Err(_) if concluded => return Ok(input),
            Ok(_) if !waiting => {
                eprintln!(
                    "note: {source} has not ended in the graph; what it has not recorded yet is \
                     called again, not reused"
                );
                return Ok(input);
            }
            Err(_) if !waiting => return Ok(input),
            _ => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(500));
    }
}

pub async fn run(args: ForkArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(args.from >= 1, "steps are numbered from 1");
    let source = agent_core::vocab::session_id_of(&args.session)
        .unwrap_or(&args.session)
        .to_owned();
    let store = args.store.open()?;
    // A store directory is read as it stands (no running stack writes it): nothing to wait for.
    let live = GraphStore::is_endpoint(&args.store.store);
    let patience = if live {
        SOURCE_SHOWN_WITHIN
    } else {
        Duration::ZERO
    };
    let reuses = args.reuse != Reuse::None;
    let input = source_input(&store, &source, args.from, reuses, patience)
        .await
        .with_context(|| format!("reading session {source} from the graph"))?
        .map_err(|why| anyhow::anyhow!("cannot fork step {} of {source}: {why}", args.from))?;
    let session = uuid::Uuid::new_v4().to_string();
    let request = edited(input, &args, &session)?;
    let mut properties = Properties::new();
    properties.insert(FORK_OF_PROPERTY.to_owned(), source.clone());
    properties.insert(FORK_STEP_PROPERTY.to_owned(), args.from.to_string());
    let reuse = match args.reuse {
        Reuse::None => None,
        Reuse::Llm => Some("llm"),
        Reuse::Tools => Some("tools"),
        Reuse::All => Some("all"),
    };
    if let Some(reuse) = reuse {
        properties.insert(REUSE_PROPERTY.to_owned(), reuse.to_owned());
        properties.insert(REUSE_FROM_PROPERTY.to_owned(), source.clone());
    }
    if let Some(model) = &args.model {
        properties.insert(MODEL_PROPERTY.to_owned(), model.clone());
    }
    let bus = args
        .broker
        .connect_within(crate::BROKER_PATIENCE)
        .await
        .with_context(|| format!("connecting to {}", args.broker.pulsar_url))?;
    let mut client = AgentClient::connect(&bus, &args.broker.topics()).await?;
    if !args.json {
        println!("forked {source} at step {} as session {session}", args.from);
    }
    let outcome = follow(
        &mut client,
        &request,
        &properties,
        Duration::from_secs(args.timeout),
        live.then_some(&store),
        &mut Renderer::new(args.json, args.explain),
    )
    .await?;
    Ok(outcome.exit_code())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        fork: ForkArgs,
    }

    fn args(line: &[&str]) -> ForkArgs {
        Cli::parse_from([&["agentctl"], line].concat()).fork
    }

    fn input() -> AgentRequest {
        let step = |n: usize| agent_schema::AgentStep {
            thought: format!("t{n}"),
            action: "llm".into(),
            observation: format!("o{n}"),
            ..Default::default()
        };
        AgentRequest {
            question: "q".into(),
            pattern: "react".into(),
            session_id: "source".into(),
            conversation_id: "c".into(),
            history: vec![step(1), step(2)],
            ..AgentRequest::default()
        }
    }

    #[test]
    fn an_observation_edit_replaces_the_one_before_the_step_unless_told_which() {
        let fork = edited(
            input(),
            &args(&["s", "--from", "3", "--observation", "new"]),
            "f",
        )
        .unwrap();
        assert_eq!(fork.history[1].observation, "new");
        assert_eq!(fork.history[0].observation, "o1");
        assert_eq!(
            (fork.session_id.as_str(), fork.conversation_id.as_str()),
            ("f", "")
        );
        let fork = edited(
            input(),
            &args(&[
                "s",
                "--from",
                "3",
                "--observation",
                "x",
                "--observation-step",
                "1",
            ]),
            "f",
        )
        .unwrap();
        assert_eq!(fork.history[0].observation, "x");
        assert!(edited(
            input(),
            &args(&[
                "s",
                "--from",
                "3",
                "--observation",
                "x",
                "--observation-step",
                "3"
            ]),
            "f"
        )
        .is_err());
        assert!(edited(
            input(),
            &args(&["s", "--from", "2", "--pattern", "plan"]),
            "f"
        )
        .is_err());
    }
}
