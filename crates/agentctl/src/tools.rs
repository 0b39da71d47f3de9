//! `agentctl tools list`: which tools a request with a given group and state would see, and why
//! each of the others is hidden, from a config directory.

use std::path::PathBuf;

use agent_core::tools::{Scope, ToolDef, DEFAULT_GROUP};

#[derive(clap::Args, Debug)]
pub struct ToolsArgs {
    #[command(subcommand)]
    command: ToolsCommand,
}

#[derive(clap::Subcommand, Debug)]
enum ToolsCommand {
    /// The tools a request would see, and the hidden ones with the reason.
    List {
        /// The request's groups, comma-separated (`*` for all); none means `default`.
        #[arg(long, value_delimiter = ',')]
        group: Option<Vec<String>>,
        /// The request's state; none means `undefined`.
        #[arg(long)]
        state: Option<String>,
        /// Directory of `<config type>.json` files.
        #[arg(long, env = "AGENT_CONFIG_DIR", default_value = "config-seed")]
        config_dir: PathBuf,
    },
}

pub async fn run(args: ToolsArgs) -> anyhow::Result<i32> {
    let ToolsCommand::List {
        group,
        state,
        config_dir,
    } = args.command;
    let config = match agent_orchestrator::check_config_dir(&config_dir) {
        Ok(config) => config,
        Err(problems) => {
            for problem in problems {
                eprintln!("{problem}");
            }
            return Ok(1);
        }
    };
    let scope = Scope::new(group.as_deref(), state.as_deref());
    let groups = group.unwrap_or_else(|| vec![DEFAULT_GROUP.to_owned()]);
    println!(
        "a request in group(s) {} and state '{}' sees:",
        groups.join(", "),
        scope.state()
    );
    let (visible, hidden): (Vec<&ToolDef>, Vec<&ToolDef>) =
        config.tools.values().partition(|t| scope.allows(t));
    for tool in &visible {
        let arguments: Vec<String> = tool
            .arguments
            .iter()
            .map(|a| format!("{}: {}", a.name, a.kind))
            .collect();
        let next = scope.next_state(tool);
        let moves = if next == scope.state() {
            String::new()
        } else {
            format!(" -> state '{next}'")
        };
        println!(
            "  {} ({}) [{}]{moves}: {}",
            tool.name,
            tool.kind,
            arguments.join(", "),
            tool.description
        );
    }
    if visible.is_empty() {
        println!("  no tool");
    }
    for tool in hidden {
        let groups = tool
            .group
            .clone()
            .unwrap_or_else(|| vec![DEFAULT_GROUP.to_owned()]);
        let states = tool
            .applicable_states
            .clone()
            .unwrap_or_else(|| vec!["*".to_owned()]);
        println!(
            "  hidden: {} (groups {}; states {})",
            tool.name,
            groups.join(", "),
            states.join(", ")
        );
    }
    Ok(0)
}
