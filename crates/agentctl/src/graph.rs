//! `agentctl explain` and `agentctl sparql`: read the provenance graph, from the aggregator's SPARQL
//! endpoint or from a store directory that no running process owns.

use std::path::Path;

use agent_graph::explain::{
    render_dot, render_mermaid, render_tree, render_tree_full, session_view, SessionView,
};
use agent_graph::model::Term;
use agent_graph::{queries, GraphStore, QueryAnswer};
use anyhow::{bail, Context};

use crate::terminal::terminal_safe;

#[derive(clap::Args, Debug, Clone)]
pub struct StoreArgs {
    /// The graph store: the aggregator's endpoint (`http://127.0.0.1:7878`) or a store directory.
    #[arg(long = "store", env = "GRAPH_STORE", default_value = ".data/graph")]
    pub store: String,
    #[arg(long, env = "CONFIG_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

impl StoreArgs {
    pub fn open(&self) -> anyhow::Result<GraphStore> {
        if GraphStore::is_endpoint(&self.store) {
            return Ok(GraphStore::open(&self.store, self.token.clone())?);
        }
        let dir = Path::new(&self.store);
        if !dir.is_dir() {
            bail!(
                "no graph store at {}: run a dialog first (scripts/demo.sh), or point GRAPH_STORE at the aggregator's endpoint",
                dir.display()
            );
        }
        // A directory is read only when no process owns it; a running stack is read through its endpoint.
        GraphStore::open_read_only(dir).with_context(|| {
            format!(
                "opening {} (if `agentctl up` or an aggregator is running, use GRAPH_STORE=http://127.0.0.1:7878)",
                dir.display()
            )
        })
    }
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Tree,
    Json,
    Dot,
    Mermaid,
}

#[derive(clap::Args, Debug)]
pub struct ExplainArgs {
    /// The session id (or its `urn:trustgraph:agent:...` URI).
    session: Option<String>,
    /// Explain the most recently started session.
    #[arg(long)]
    last: bool,
    /// Explain every session of a conversation (its `conversation_id`), oldest first.
    #[arg(long, conflicts_with_all = ["session", "last"])]
    conversation: Option<String>,
    #[arg(long, value_enum, default_value = "tree")]
    format: Format,
    /// Print every text whole (thoughts, observations, answers, kept as documents when long);
    /// the tree otherwise cuts each to a line. `--format json` always has them whole.
    #[arg(long)]
    full: bool,
    /// Read long texts back from TrustGraph's librarian on the broker (orchestrators run with
    /// `DOCUMENT_STORE=librarian` keep them there; the graph holds their excerpts).
    #[arg(long)]
    librarian: bool,
    #[command(flatten)]
    store: StoreArgs,
    #[command(flatten)]
    broker: agent_bus::BrokerArgs,
}

/// Reads one session's view from the store.
pub async fn load_session(store: &GraphStore, session: &str) -> anyhow::Result<SessionView> {
    load_session_with(store, session, None).await
}

/// [`load_session`], with the texts kept in `librarian` read back whole.
async fn load_session_with(
    store: &GraphStore,
    session: &str,
    librarian: Option<&agent_bus::Librarian>,
) -> anyhow::Result<SessionView> {
    let node = queries::session_node(session)?;
    let mut rows = store.query(queries::session_triples(&node)).await?.rows();
    if rows.rows.is_empty() {
        bail!("the graph holds nothing about {node}");
    }
    if let Some(librarian) = librarian {
        read_back_whole(&mut rows, librarian).await?;
    }
    Ok(session_view(node.as_str(), &rows))
}

/// Replaces each excerpt that names a document by the document's whole text from the librarian
/// (one that it does not have stays an excerpt).
async fn read_back_whole(
    rows: &mut agent_graph::Rows,
    librarian: &agent_bus::Librarian,
) -> anyhow::Result<()> {
    for row in &mut rows.rows {
        for term in row.iter_mut().flatten() {
            let Term::Literal(literal) = term else {
                continue;
            };
            let Some((uri, _)) = agent_core::documents::reference(literal.value()) else {
                continue;
            };
            if let Some(whole) = librarian.read(uri).await? {
                *term = Term::Literal(agent_graph::model::Literal::new_simple_literal(whole));
            }
        }
    }
    Ok(())
}

pub async fn last_session(store: &GraphStore) -> anyhow::Result<String> {
    let rows = store.query(queries::last_session()).await?.rows();
    match rows.column("s").first().copied().flatten() {
        Some(Term::NamedNode(n)) => Ok(n.as_str().to_owned()),
        _ => bail!("the graph holds no session yet"),
    }
}

pub fn render(view: &SessionView, format: Format, full: bool) -> anyhow::Result<String> {
    // What an LLM or a tool wrote is in the tree whole: shown, never acted on by the terminal
    // (an escape that erased the line of a payment's call, or wrote a conclusion of its own).
    // JSON escapes most control characters itself; [`json_for_terminal`] the rest.
    Ok(match format {
        Format::Tree if full => terminal_safe(render_tree_full(view)),
        Format::Tree => terminal_safe(render_tree(view)),
        Format::Json => json_for_terminal(&serde_json::to_string_pretty(view)?) + "\n",
        Format::Dot => terminal_safe(render_dot(view)),
        Format::Mermaid => terminal_safe(render_mermaid(view)),
    })
}

pub async fn explain(args: ExplainArgs) -> anyhow::Result<i32> {
    let store = args.store.open()?;
    let librarian = match args.librarian {
        true => {
            let bus = args.broker.connect().await?;
            let timeout = std::time::Duration::from_secs(30);
            Some(agent_bus::Librarian::connect(&bus, &args.broker.topics(), timeout).await?)
        }
        false => None,
    };
    let librarian = librarian.as_ref();
    if let Some(conversation) = &args.conversation {
        let rows = store
            .query(queries::conversation_sessions(conversation))
            .await?
            .rows();
        let sessions: Vec<String> = rows
            .column("s")
            .into_iter()
            .filter_map(|t| match t {
                Some(Term::NamedNode(n)) => Some(n.as_str().to_owned()),
                _ => None,
            })
            .collect();
        if sessions.is_empty() {
            bail!("the graph holds no session of conversation {conversation}");
        }
        let mut out = String::new();
        for session in sessions {
            let view = load_session_with(&store, &session, librarian).await?;
            out.push_str(&render(&view, args.format, args.full)?);
        }
        return write_out(&out);
    }
    let session = match (&args.session, args.last) {
        (Some(s), _) => s.clone(),
        (None, true) => last_session(&store).await?,
        (None, false) => bail!("name a session id, or use --last"),
    };
    let view = load_session_with(&store, &session, librarian).await?;
    write_out(&render(&view, args.format, args.full)?)
}

#[derive(clap::Args, Debug)]
pub struct SparqlArgs {
    /// The SPARQL query.
    query: String,
    /// Print the SPARQL JSON results instead of a table.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    store: StoreArgs,
}

fn cell(term: Option<&Term>) -> String {
    match term {
        None => String::new(),
        Some(Term::Literal(l)) => terminal_safe(l.value().replace('\n', "\\n")),
        Some(Term::NamedNode(n)) => n.as_str().to_owned(),
        Some(other) => other.to_string(),
    }
}

pub async fn sparql(args: SparqlArgs) -> anyhow::Result<i32> {
    let store = args.store.open()?;
    let answer = store.query(args.query.clone()).await?;
    if args.json {
        let (body, _) = agent_graph::serialize_answer(&answer)?;
        return write_out(&(json_for_terminal(&String::from_utf8_lossy(&body)) + "\n"));
    }
    let mut out = String::new();
    match answer {
        QueryAnswer::Boolean(b) => out = format!("{b}\n"),
        QueryAnswer::Graph(triples) => {
            for t in triples {
                out.push_str(&terminal_safe(format!("{t} .\n")));
            }
        }
        QueryAnswer::Rows(rows) => {
            let cells: Vec<Vec<String>> = rows
                .rows
                .iter()
                .map(|r| r.iter().map(|t| cell(t.as_ref())).collect())
                .collect();
            let mut widths: Vec<usize> = rows.variables.iter().map(|v| v.len() + 1).collect();
            for row in &cells {
                for (w, c) in widths.iter_mut().zip(row) {
                    *w = (*w).max(c.chars().count()).min(80);
                }
            }
            let line = |values: Vec<String>| {
                values
                    .iter()
                    .zip(&widths)
                    .map(|(v, w)| {
                        let v: String = v.chars().take(*w).collect();
                        format!("{v:<w$}")
                    })
                    .collect::<Vec<_>>()
                    .join(" | ")
            };
            out.push_str(&line(
                rows.variables.iter().map(|v| format!("?{v}")).collect(),
            ));
            out.push('\n');
            out.push_str(
                &widths
                    .iter()
                    .map(|w| "-".repeat(*w))
                    .collect::<Vec<_>>()
                    .join("-+-"),
            );
            out.push('\n');
            for row in cells {
                out.push_str(&line(row));
                out.push('\n');
            }
            out.push_str(&format!("({} rows)\n", rows.rows.len()));
        }
    }
    write_out(&out)
}

/// Writes `text` to stdout. A reader that has gone (`| head`) ends the command quietly, as it
/// ends other tools: `println!` panicked at the closed pipe, and the command exited 101.
fn write_out(text: &str) -> anyhow::Result<i32> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => Ok(0),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(0),
        Err(e) => Err(anyhow::anyhow!("writing to stdout: {e}")),
    }
}

/// JSON text with the control characters JSON leaves unescaped (DEL, and U+0080 to U+009F, among
/// them an 8-bit CSI) written as `\u` escapes: the same JSON, which a terminal does not act on.
/// They are only ever inside strings, where the escape means the same character.
fn json_for_terminal(json: &str) -> String {
    let mut shown = String::with_capacity(json.len());
    for c in json.chars() {
        if c.is_control() && c != '\n' && c != '\t' && c != '\r' {
            shown.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            shown.push(c);
        }
    }
    shown
}

#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    /// An RDF file: Turtle (`.ttl`), N-Triples (`.nt`) or RDF/XML (`.rdf`, `.owl`, `.xml`).
    file: std::path::PathBuf,
    /// The collection to load it into (the `collection` of `knowledge-query` and `sparql-query`
    /// tools); its named graph is `urn:collection:NAME`.
    #[arg(long)]
    collection: String,
    #[command(flatten)]
    store: StoreArgs,
}

/// The RDF media type of a file a collection can hold (one graph: no quad formats).
fn triple_format(file: &Path) -> anyhow::Result<&'static str> {
    let extension = file
        .extension()
        .and_then(|e| e.to_str())
        .unwrap_or_default()
        .to_ascii_lowercase();
    Ok(match extension.as_str() {
        "ttl" => "text/turtle",
        "nt" => "application/n-triples",
        "rdf" | "owl" | "xml" => "application/rdf+xml",
        "nq" | "trig" => bail!(
            "{} holds quads; a collection is one graph: load Turtle, N-Triples or RDF/XML",
            file.display()
        ),
        _ => bail!(
            "cannot tell the RDF format of {} from its extension (.ttl, .nt, .rdf)",
            file.display()
        ),
    })
}

/// Loads an RDF file into a collection, through the aggregator's endpoint or into a store
/// directory no process owns.
pub async fn load(args: LoadArgs) -> anyhow::Result<i32> {
    let graph = agent_orchestrator::tools::knowledge::collection_graph(&args.collection)
        .map_err(|e| anyhow::anyhow!(e))?;
    let format = triple_format(&args.file)?;
    let data =
        std::fs::read(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let store = GraphStore::open(&args.store.store, args.store.token.clone())
        .with_context(|| format!("opening the graph store {}", args.store.store))?;
    match store.load(data, format, Some(graph.clone())).await {
        Err(agent_graph::GraphError::Http { status: 413, .. }) => bail!(
            "loading {}: the endpoint refused a file this large in one request (the aggregator \
             takes up to 256 MB): split it and load each part",
            args.file.display()
        ),
        loaded => loaded.with_context(|| format!("loading {}", args.file.display()))?,
    }
    let counted = store
        .query(format!(
            "SELECT (COUNT(*) AS ?n) WHERE {{ GRAPH <{graph}> {{ ?s ?p ?o }} }}"
        ))
        .await?
        .rows();
    let triples = match counted.first("n") {
        Some(Term::Literal(l)) => l.value().to_owned(),
        _ => "?".to_owned(),
    };
    println!(
        "loaded {} into collection '{}' (<{graph}>, now {triples} triples)",
        args.file.display(),
        args.collection
    );
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tree_shows_what_an_llm_wrote_without_the_terminal_acting_on_it() {
        let view = SessionView {
            session: "s".to_owned(),
            question: "pay \u{1b}[1A\u{1b}[2Kthe invoice\rdone".to_owned(),
            ..SessionView::default()
        };
        for format in [Format::Tree, Format::Dot, Format::Mermaid] {
            for full in [false, true] {
                let shown = render(&view, format, full).unwrap_or_default();
                assert!(
                    !shown
                        .chars()
                        .any(|c| c.is_control() && c != '\n' && c != '\t'),
                    "{format:?}: {shown:?}"
                );
            }
        }
    }

    /// JSON leaves DEL and the C1 controls (an 8-bit CSI among them) unescaped; shown, they are
    /// written as `\u` escapes, and the JSON still reads back as the same text.
    #[test]
    fn json_shows_the_controls_json_leaves_raw_as_escapes() {
        let view = SessionView {
            session: "s".to_owned(),
            question: "pay \u{9b}2J\u{7f} now \u{1b}[1A".to_owned(),
            ..SessionView::default()
        };
        let shown = render(&view, Format::Json, false).unwrap_or_default();
        assert!(
            !shown
                .chars()
                .any(|c| c.is_control() && c != '\n' && c != '\t'),
            "{shown:?}"
        );
        let read: serde_json::Value = serde_json::from_str(&shown).unwrap_or_default();
        assert_eq!(read["question"], view.question, "{shown}");
    }
}
