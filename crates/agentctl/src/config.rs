//! `agentctl config`: list, get, put and delete through config-svc's REST API (writes carry
//! `CONFIG_TOKEN`), seed a directory's missing keys, and validate a directory locally, reporting
//! every problem at once with its file and key.

use std::path::{Path, PathBuf};

use agent_config_files as seed;
use agent_core::config::AgentConfig;
use agent_core::prompt::Prompts;
use agent_orchestrator::check_config_dir;
use anyhow::Context;
use serde_json::Value;

#[derive(clap::Args, Debug)]
pub struct ConfigArgs {
    /// config-svc's REST API.
    #[arg(long, env = "CONFIG_URL", default_value = "http://127.0.0.1:8088")]
    url: String,
    /// Bearer token for writes.
    #[arg(long, env = "CONFIG_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The workspace to read and write, as the services' `AGENT_WORKSPACE` names theirs.
    #[arg(
        long,
        env = "AGENT_WORKSPACE",
        default_value = "default",
        global = true
    )]
    workspace: String,
    #[command(subcommand)]
    command: ConfigCommand,
}

#[derive(clap::Subcommand, Debug)]
enum ConfigCommand {
    /// The keys and values of one type.
    List { kind: String },
    /// One value.
    Get { kind: String, key: String },
    /// Set one value: JSON text, or @FILE.
    Put {
        kind: String,
        key: String,
        value: String,
    },
    /// Remove one value.
    Delete { kind: String, key: String },
    /// Add the keys of DIR's `<type>.json` files that the service does not have (never overwrites).
    Seed { dir: PathBuf },
    /// Check DIR's files without a service: bad JSON, missing fields, unknown references.
    Validate { dir: PathBuf },
}

/// How long a call may take to connect, and in all: a service that accepts the connection and
/// never answers must not hold the command (and a script that runs it) for ever.
const CONNECT_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);
const ANSWER_WITHIN: std::time::Duration = std::time::Duration::from_secs(60);

/// The URL of `parts` under config-svc's `/api/v1/config` at `base`, in `workspace`. Each part is
/// one path segment, percent-encoded: a key with a `/`, `?`, `#`, `%` or a space names that key,
/// not another path or a query.
fn endpoint(base: &reqwest::Url, workspace: &str, parts: &[&str]) -> anyhow::Result<reqwest::Url> {
    let mut url = base.clone();
    url.path_segments_mut()
        .map_err(|()| anyhow::anyhow!("{base} is not a URL a path can follow"))?
        .pop_if_empty()
        .extend(["api", "v1", "config"])
        .extend(parts);
    url.set_query(None);
    url.query_pairs_mut().append_pair("workspace", workspace);
    Ok(url)
}

pub async fn run(args: ConfigArgs) -> anyhow::Result<i32> {
    let http = reqwest::Client::builder()
        .connect_timeout(CONNECT_WITHIN)
        .timeout(ANSWER_WITHIN)
        .build()?;
    let service = reqwest::Url::parse(&args.url)
        .with_context(|| format!("--url {} is not a URL", args.url))?;
    let workspace = args.workspace.clone();
    let at = |parts: &[&str]| endpoint(&service, &workspace, parts);
    let token = args.token.clone().filter(|t| !t.is_empty());
    // Reads carry the token too when there is one: without it an MCP server's credentials come
    // back hidden, and a value read so and written back would be refused.
    let authorized = |request: reqwest::RequestBuilder| match &token {
        Some(t) => request.bearer_auth(t),
        None => request,
    };
    match args.command {
        ConfigCommand::List { kind } => print(authorized(http.get(at(&[&kind])?))).await,
        ConfigCommand::Get { kind, key } => print(authorized(http.get(at(&[&kind, &key])?))).await,
        ConfigCommand::Put { kind, key, value } => {
            let text = match value.strip_prefix('@') {
                Some(file) => {
                    std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
                }
                None => value,
            };
            serde_json::from_str::<Value>(&text).context("the value is not JSON")?;
            print(authorized(http.put(at(&[&kind, &key])?)).body(text)).await
        }
        ConfigCommand::Delete { kind, key } => {
            print(authorized(http.delete(at(&[&kind, &key])?))).await
        }
        ConfigCommand::Validate { dir } => Ok(if report(&dir) { 0 } else { 1 }),
        ConfigCommand::Seed { dir } => {
            if !report(&dir) {
                return Ok(1);
            }
            let values = seed::read_dir(&dir).map_err(|e| anyhow::anyhow!("{e:?}"))?;
            let current: Value = authorized(http.get(at(&[])?))
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            let mut added = 0;
            for (kind, key, text) in seed::entries(&values) {
                if current["config"][&kind].get(&key).is_some() {
                    continue;
                }
                let response = authorized(http.put(at(&[&kind, &key])?))
                    .body(text)
                    .send()
                    .await?;
                if !response.status().is_success() {
                    anyhow::bail!(
                        "{kind}/{key}: {} {}",
                        response.status(),
                        response.text().await.unwrap_or_default()
                    );
                }
                added += 1;
            }
            println!("added {added} missing keys from {}", dir.display());
            Ok(0)
        }
    }
}

async fn print(request: reqwest::RequestBuilder) -> anyhow::Result<i32> {
    let response = request.send().await?;
    let status = response.status();
    let text = response.text().await?;
    if status.is_success() {
        match serde_json::from_str::<Value>(&text) {
            Ok(v) => println!("{}", serde_json::to_string_pretty(&v)?),
            Err(_) => println!("{text}"),
        }
        Ok(0)
    } else {
        eprintln!("agentctl: {status}: {text}");
        Ok(1)
    }
}

/// Prints every problem of `dir` with its file and key; true when there is none.
fn report(dir: &Path) -> bool {
    let (values, _) = seed::read_dir_all(dir);
    for key in AgentConfig::unread_prompt_keys(&values) {
        eprintln!(
            "warning: {}/prompt.json: prompt/{key} is ignored: no LLM call of the orchestrator uses it (they use {}) and it is not one of TrustGraph's prompt entries",
            dir.display(),
            Prompts::KEYS.join(", ")
        );
    }
    match check_config_dir(dir) {
        Ok(_) => {
            println!("{}: valid", dir.display());
            true
        }
        Err(problems) => {
            for p in problems {
                eprintln!("{p}");
            }
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_one_path_segment_whatever_it_holds() {
        let base = reqwest::Url::parse("http://svc:8088/").unwrap();
        let url = endpoint(&base, "team b", &["tool", "ops review/v2 #1?x=%"]).unwrap();
        assert_eq!(
            url.as_str(),
            "http://svc:8088/api/v1/config/tool/ops%20review%2Fv2%20%231%3Fx=%25?workspace=team+b"
        );
        // Behind a proxy's prefix, with or without its last slash.
        for base in ["http://gw/config-svc", "http://gw/config-svc/"] {
            let base = reqwest::Url::parse(base).unwrap();
            assert_eq!(
                endpoint(&base, "default", &[]).unwrap().as_str(),
                "http://gw/config-svc/api/v1/config?workspace=default"
            );
        }
    }
}
