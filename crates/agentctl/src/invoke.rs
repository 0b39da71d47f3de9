//! `agentctl invoke`: sends one request and renders its response stream for a person (or as JSON lines).

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use agent_bus::{AgentClient, BrokerArgs};
use agent_core::provenance::describe;
use agent_core::vocab::{tg, NamedNodeRef};
use agent_schema::{AgentRequest, AgentResponse, MessageType, Triple};
use anyhow::Context;

use crate::terminal::clean_for_terminal;

#[derive(clap::Args, Debug, Clone)]
pub struct InvokeArgs {
    /// The question.
    #[arg(short, long)]
    pub question: String,
    /// The pattern to run (default: chosen by the service).
    #[arg(long, default_value = "")]
    pub pattern: String,
    /// Tool groups the agent may use (repeat for several; `*` for all).
    #[arg(long = "group")]
    pub groups: Vec<String>,
    /// The initial tool state.
    #[arg(long)]
    pub state: Option<String>,
    /// Ask for whole messages instead of streamed chunks.
    #[arg(long)]
    pub no_streaming: bool,
    /// Print every response as one JSON line.
    #[arg(long)]
    pub json: bool,
    /// Print the provenance triples as they arrive.
    #[arg(long)]
    pub explain: bool,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// The aggregator's endpoint (`http://127.0.0.1:7878`): should the closing message not come
    /// (the response topic is non-persistent, and a broker drops what a reader that falls behind
    /// has no room for), it is read back from the journal after a silence. A store directory is
    /// not read here.
    #[arg(long = "graph-store", env = "GRAPH_STORE")]
    pub graph_store: Option<String>,
    /// A token the endpoint takes for queries: the services' (`CONFIG_TOKEN`) or its read token
    /// (`AGGREGATOR_QUERY_TOKEN`). An endpoint that requires one refuses the read-back without.
    #[arg(long = "graph-token", env = "CONFIG_TOKEN", hide_env_values = true)]
    pub graph_token: Option<String>,
    #[command(flatten)]
    pub broker: BrokerArgs,
}

impl InvokeArgs {
    pub fn request(&self) -> AgentRequest {
        AgentRequest {
            question: self.question.clone(),
            state: self.state.clone(),
            group: (!self.groups.is_empty()).then(|| self.groups.clone()),
            collection: "default".to_owned(),
            streaming: !self.no_streaming,
            pattern: self.pattern.clone(),
            ..AgentRequest::default()
        }
    }
}

pub async fn run(args: InvokeArgs) -> anyhow::Result<i32> {
    let bus = args
        .broker
        .connect_within(crate::BROKER_PATIENCE)
        .await
        .with_context(|| format!("connecting to {}", args.broker.pulsar_url))?;
    let topics = args.broker.topics();
    let mut client = AgentClient::connect(&bus, &topics).await?;
    let outcome = invoke(
        &mut client,
        &args,
        &mut Renderer::new(args.json, args.explain),
    )
    .await?;
    Ok(outcome.exit_code())
}

/// How a dialog ended, for the exit status and the provenance summary.
pub struct Outcome {
    pub failed: bool,
    /// The answer's text is known to lack a part (a chunk the broker dropped) and the graph could
    /// not give it whole.
    pub incomplete: bool,
    pub provenance: Vec<(String, Vec<Triple>)>,
}

impl Outcome {
    /// 2: the dialog ended in an error; 3: it answered, but the answer shown lacks a part.
    pub fn exit_code(&self) -> i32 {
        if self.failed {
            2
        } else if self.incomplete {
            3
        } else {
            0
        }
    }
}

/// Sends the request and renders responses until the end of the dialog.
pub async fn invoke(
    client: &mut AgentClient,
    args: &InvokeArgs,
    renderer: &mut Renderer,
) -> anyhow::Result<Outcome> {
    let properties = agent_bus::Properties::new();
    let timeout = Duration::from_secs(args.timeout);
    let journal = match args.graph_store.as_deref() {
        Some(url) if agent_graph::GraphStore::is_endpoint(url) => Some(
            agent_graph::GraphStore::open(url, args.graph_token.clone())?,
        ),
        _ => None,
    };
    follow(
        client,
        &args.request(),
        &properties,
        timeout,
        journal.as_ref(),
        renderer,
    )
    .await
}

/// A read of a dialog's closing from the journal, bounded by the dialog's deadline.
type ClosingRead<'a> = std::pin::Pin<
    Box<
        dyn std::future::Future<
                Output = Result<Option<agent_bus::Received>, tokio::time::error::Elapsed>,
            > + Send
            + 'a,
    >,
>;

/// How long a dialog is silent before its closing is looked for in the journal.
const RECOVERY_SILENCE: Duration = Duration::from_secs(10);

/// Sends `request` (with our `properties`, if any) and renders its responses until the end of the
/// dialog or `timeout`. With a `journal` (the aggregator's store), a closing that never arrives is
/// read back from it after [`RECOVERY_SILENCE`].
pub async fn follow(
    client: &mut AgentClient,
    request: &AgentRequest,
    properties: &agent_bus::Properties,
    timeout: Duration,
    journal: Option<&agent_graph::GraphStore>,
    renderer: &mut Renderer,
) -> anyhow::Result<Outcome> {
    let id = uuid::Uuid::new_v4().to_string();
    let started = Instant::now();
    client.send_with(&id, request, properties).await?;
    // A timeout past what an Instant can hold waits as good as for ever, not panics.
    let now = tokio::time::Instant::now();
    let deadline = now
        .checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400));
    let mut outcome = Outcome {
        failed: false,
        incomplete: false,
        provenance: Vec::new(),
    };
    let session = agent_orchestrator::session_id_for(request, Some(&id));
    let mut heard_at = tokio::time::Instant::now();
    let mut streamed = agent_bus::StreamedAnswer::default();
    // The attempt each streamed message (a thought, the answer) came from last.
    let mut streaming_attempts: HashMap<String, Option<String>> = HashMap::new();
    let mut noticed: std::collections::HashSet<Option<String>> = Default::default();
    // One receive at a time, kept across the silences that read the journal: dropped at a
    // timeout, a receive that was subscribing again after a broker restart left the `pulsar`
    // crate's connection half made, and every later subscription waited on it for good.
    let responses = futures::stream::unfold(client, |client| async move {
        let received = client.receive().await;
        Some((received, client))
    });
    let mut responses = std::pin::pin!(responses);
    // The journal's read of the closing, once a silence began one. Kept while other dialogs'
    // responses come (the topic is every client's): dropped at each, a read never finished while
    // they came faster than it, and a closing the broker dropped was waited for to the deadline.
    let mut reading: Option<ClosingRead<'_>> = None;
    loop {
        let look_back_at = (heard_at + RECOVERY_SILENCE).min(deadline);
        let next = futures::StreamExt::next(&mut responses);
        let received = tokio::select! {
            heard = tokio::time::timeout_at(look_back_at, next) => match heard {
                Ok(Some(next)) => next?,
                Ok(None) => anyhow::bail!("the responses ended"),
                Err(_) if look_back_at >= deadline => {
                    anyhow::bail!("no end of dialog within {} s", timeout.as_secs())
                }
                Err(_) => {
                    heard_at = tokio::time::Instant::now();
                    // A streamed answer's closing read back counts its chunks like one heard:
                    // text that did not come is read from the graph below. Within the dialog's
                    // time limit: a store that does not answer must not hold the client past it.
                    // What the broker brings meanwhile is taken as it comes: a slow store held a
                    // closing that had arrived until the read gave up.
                    if reading.is_none() {
                        reading = Some(Box::pin(tokio::time::timeout_at(
                            deadline,
                            recovered(journal, &session, &id),
                        )));
                    }
                    continue;
                }
            },
            found = async {
                match reading.as_mut() {
                    Some(read) => read.await,
                    None => std::future::pending().await,
                }
            } => {
                reading = None;
                match found {
                    Ok(Some(closing)) => closing,
                    _ => continue,
                }
            }
        };
        let agent_bus::Received {
            id: rid,
            response,
            attempt,
            answer_chunk: place,
            answer_chunks: chunks,
        } = received;
        if rid != id {
            continue;
        }
        // The dialog is heard from: what the journal would give is on its way here.
        reading = None;
        heard_at = tokio::time::Instant::now();
        let answer_text = kind(&response) == MessageType::Answer && !response.content.is_empty();
        let streaming = !response.end_of_dialog
            && !response.content.is_empty()
            && matches!(kind(&response), MessageType::Answer | MessageType::Thought);
        if streaming {
            // A thought or answer streamed again under another attempt: its step was cut short
            // (or a copy of it runs beside it), and what follows starts from the beginning.
            let before = streaming_attempts.insert(response.message_id.clone(), attempt.clone());
            if before.as_ref().is_some_and(|before| *before != attempt) {
                // A subagent's text gathered so far is the other attempt's: this one's starts over.
                renderer.forget_gathered(&response.message_id);
            }
            // Said once for an attempt, before the first of its messages that came before.
            if before.is_some_and(|before| before != attempt) && noticed.insert(attempt.clone()) {
                renderer.note(
                    "(the step ran again, cut short by a crash or as a copy beside it: its text from the start)",
                );
            }
            // A copy of a chunk already shown (the broker delivered it twice) is not shown again.
            if answer_text && !streamed.push(attempt.as_deref(), place, &response.content) {
                continue;
            }
        }
        if response.end_of_dialog
            && response.error.is_none()
            && kind(&response) == MessageType::Answer
        {
            let closing = (attempt.as_deref(), chunks, !response.content.is_empty());
            let at_hand =
                settle_streamed_answer(&streamed, closing, journal, &session, renderer).await;
            if !at_hand {
                // Said where a JSON reader sees it too, and in the exit status.
                eprintln!("agentctl: the answer shown lacks a part that never reached this client, and the graph did not give it (--graph-store)");
                outcome.incomplete = true;
            }
        }
        renderer.show(&response);
        if let (Some(node), MessageType::Explain) = (&response.explain_id, kind(&response)) {
            outcome
                .provenance
                .push((node.clone(), response.explain_triples.clone()));
        }
        if kind(&response) == MessageType::Error || response.error.is_some() {
            outcome.failed = true;
        }
        if response.end_of_dialog {
            renderer.finish(&response, started.elapsed());
            // A closing that names the conclusion has one in the graph; a refusal has none.
            let conclusion = agent_core::provenance::SessionUris::new(&session).conclusion();
            if response.message_id == conclusion {
                until_shown_ended(journal, &session).await;
            }
            return Ok(outcome);
        }
    }
}

/// How long a client that reads the graph waits, after the closing, for the graph to show the
/// dialog's end: the aggregator writes the records after the client was answered.
const RECORDS_PATIENCE: Duration = Duration::from_secs(5);

/// Returns once the graph shows that `session` ended (or after [`RECORDS_PATIENCE`], saying so),
/// so that what a script runs next (`agentctl explain --last`, a fork, a SPARQL query) finds the
/// dialog's records: `--last` otherwise showed the session before.
async fn until_shown_ended(journal: Option<&agent_graph::GraphStore>, session: &str) {
    let Some(store) = journal else {
        return;
    };
    let deadline = tokio::time::Instant::now() + RECORDS_PATIENCE;
    let mut pause = Duration::from_millis(10);
    loop {
        let shown = agent_graph::recorded::concluded(store, session);
        match tokio::time::timeout_at(deadline, shown).await {
            Ok(Ok(true)) => return,
            Ok(Ok(false)) if tokio::time::Instant::now() + pause < deadline => {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(250));
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not read the graph for the dialog's end");
                return;
            }
            _ => {
                eprintln!(
                    "(the graph does not show this dialog's end yet: `agentctl explain` may show it in part)"
                );
                return;
            }
        }
    }
}

/// The dialog's closing as the journal recorded it, when it ended without this client hearing
/// of it. A failed read is only reported: the client goes on waiting.
async fn recovered(
    journal: Option<&agent_graph::GraphStore>,
    session: &str,
    id: &str,
) -> Option<agent_bus::Received> {
    let journal = journal?;
    match agent_orchestrator::journal::recorded_closing_received(journal, session, id).await {
        Ok(Some(closing)) => {
            eprintln!(
                "(the closing message never reached this client; read back from the journal)"
            );
            Some(closing)
        }
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(error = %e, "could not read the journal for the closing");
            None
        }
    }
}

/// A closing names the attempt whose streamed text is the answer (see
/// [`agent_schema::ATTEMPT_PROPERTY`]) and how many chunks it streamed
/// ([`agent_schema::ANSWER_CHUNKS_PROPERTY`]). When a chunk of it never came (the broker dropped
/// it), the answer shown is the one the graph records. When the text shown last is another
/// attempt's (a copy that lost, a step cut short whose rerun's chunks were lost), or two copies'
/// chunks came interleaved, the answer is shown again: that attempt's text. A closing without a
/// count (journaled by an earlier build) whose answer text never came is answered from the graph
/// too. JSON lines stay the responses as they came, but for an answer none of which came (and a
/// chunk that came twice, which neither form shows twice).
///
/// False when the answer is known to lack text (a chunk never came, or none of it did) and the
/// graph did not give it: the client shows what it has and says so, in its exit status too.
async fn settle_streamed_answer(
    streamed: &agent_bus::StreamedAnswer,
    (closing, chunks, with_text): (Option<&str>, Option<u64>, bool),
    journal: Option<&agent_graph::GraphStore>,
    session: &str,
    renderer: &mut Renderer,
) -> bool {
    let Some(closing) = closing else {
        return true;
    };
    let whole = streamed.whole(Some(closing), chunks);
    let heard = streamed.answer(Some(closing));
    let none_came = heard.is_empty() && !with_text && chunks != Some(0);
    if renderer.json {
        // The lines stay the responses as they came; the answer the graph records follows them
        // where what came is known to lack text.
        if none_came || whole == Some(false) {
            return show_concluded_answer(journal, session, renderer).await;
        }
        return true;
    }
    if whole == Some(false) {
        renderer.note(
            "(text of the answer did not reach this client: a chunk of it was lost on the way)",
        );
        return show_concluded_answer(journal, session, renderer).await;
    }
    if none_came && streamed.latest().is_none() {
        return show_concluded_answer(journal, session, renderer).await;
    }
    let Some(latest) = streamed.latest() else {
        return true;
    };
    if latest == Some(closing) && !streamed.interleaved() {
        return true;
    }
    renderer.note("(the text above was not the standing answer alone; the answer:)");
    if heard.is_empty() {
        show_concluded_answer(journal, session, renderer).await
    } else {
        renderer.show_answer(&heard);
        true
    }
}

/// How long a client waits for the graph to record a dialog's conclusion it read a closing of:
/// the graph's writer may still be behind the response.
const CONCLUSION_PATIENCE: Duration = Duration::from_secs(10);

/// Shows the answer the graph records for the dialog, in place of streamed text that is not it;
/// false when the graph did not give it.
async fn show_concluded_answer(
    journal: Option<&agent_graph::GraphStore>,
    session: &str,
    renderer: &mut Renderer,
) -> bool {
    let not_at_hand = "(the answer is not at hand: `agentctl explain` shows it from the graph)";
    let Some(store) = journal else {
        renderer.note(not_at_hand);
        return false;
    };
    let deadline = tokio::time::Instant::now() + CONCLUSION_PATIENCE;
    let answer = loop {
        let asked = agent_graph::recorded::concluded_answer(store, session);
        let Ok(read) = tokio::time::timeout_at(deadline, asked).await else {
            tracing::warn!("the graph did not answer in time for the answer");
            break None;
        };
        match read {
            Ok(Some(answer)) => break Some(answer),
            Ok(None) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Ok(None) => break None,
            Err(e) => {
                tracing::warn!(error = %e, "could not read the answer from the graph");
                break None;
            }
        }
    };
    let Some(answer) = answer else {
        renderer.note(not_at_hand);
        return false;
    };
    renderer.note("(the answer, as the graph records it:)");
    renderer.show_answer(&answer);
    if let Some((document, _)) = agent_core::documents::reference(&answer) {
        renderer.note(&format!(
            "(the graph holds an excerpt of it: the whole is {document} in the librarian, which \
             `agentctl explain --librarian` reads)"
        ));
    }
    true
}

/// The answer the dialog concluded with, as the graph records it.
pub(crate) async fn concluded_answer(
    journal: Option<&agent_graph::GraphStore>,
    session: &str,
) -> Option<String> {
    agent_graph::recorded::concluded_answer(journal?, session)
        .await
        .inspect_err(|e| tracing::warn!(error = %e, "could not read the answer from the graph"))
        .ok()
        .flatten()
}

fn kind(r: &AgentResponse) -> MessageType {
    r.kind().unwrap_or(MessageType::Observation)
}

/// `r` as the terminal may be given it: the text in it is the model's, a tool's or anyone's on the
/// broker, and a control character in it (an escape sequence) would be the terminal's to obey:
/// recolour, move the cursor over earlier lines, retitle the window. Each but a newline and a tab
/// shows as U+FFFD.
fn terminal_safe(r: &AgentResponse) -> AgentResponse {
    fn clean_term(term: &mut agent_schema::Term) {
        clean_for_terminal(&mut term.iri);
        clean_for_terminal(&mut term.value);
        if let Some(inner) = term.triple.as_deref_mut() {
            clean_term(&mut inner.s);
            clean_term(&mut inner.p);
            clean_term(&mut inner.o);
        }
    }
    let mut r = r.clone();
    // The message id is a key here and never printed (its session is, from the explain id).
    clean_for_terminal(&mut r.content);
    if let Some(error) = r.error.as_mut() {
        clean_for_terminal(&mut error.message);
    }
    if let Some(node) = r.explain_id.as_mut() {
        clean_for_terminal(node);
    }
    for triple in &mut r.explain_triples {
        clean_term(&mut triple.s);
        clean_term(&mut triple.p);
        clean_term(&mut triple.o);
    }
    r
}

/// One line on how the dialog was routed, from its pattern decision's triples.
fn routing_line(triples: &[Triple]) -> String {
    let fact = |predicate: NamedNodeRef<'_>| {
        triples
            .iter()
            .find(|t| t.p.iri == predicate.as_str())
            .map(|t| t.o.value.as_str())
            .unwrap_or("")
    };
    let task_type = match fact(tg::TASK_TYPE) {
        "" => String::new(),
        t => format!("task type {t} ({}), ", fact(tg::TASK_TYPE_METHOD)),
    };
    let mut line = format!(
        "{task_type}pattern {} ({})",
        fact(tg::PATTERN),
        fact(tg::PATTERN_METHOD)
    );
    for why in [
        fact(tg::RATIONALE),
        fact(tg::TASK_TYPE_FALLBACK_REASON),
        fact(tg::PATTERN_FALLBACK_REASON),
    ] {
        if !why.is_empty() {
            line.push_str(&format!("; {why}"));
        }
    }
    line
}

/// The session a message id belongs to (`urn:trustgraph:agent:{session}/...`).
fn session_of(message_id: &str) -> &str {
    agent_core::vocab::session_id_of(message_id).unwrap_or_default()
}

/// The subagents a fan-out observation lists (`{i}. {goal} ({pattern})` lines under the message id
/// `.../fanout/{correlation id}`), as subagent session -> goal.
fn fanout_goals(message_id: &str, listing: &str) -> Vec<(String, String)> {
    let Some((_, cid)) = message_id.rsplit_once("/fanout/") else {
        return Vec::new();
    };
    listing
        .lines()
        .filter_map(|line| {
            let (index, rest) = line.split_once(". ")?;
            let index: usize = index.trim().parse().ok()?;
            let goal = rest.rsplit_once(" (").map_or(rest, |(goal, _)| goal);
            Some((format!("{cid}-s{index}"), goal.to_owned()))
        })
        .collect()
}

/// `[goal] ` when the message comes from a supervisor's subagent whose fan-out was seen, else
/// `[subagent 2.0] ` (its place in each fan-out, outermost first); empty for the supervisor's own.
fn subagent_prefix(message_id: &str, goals: &HashMap<String, String>) -> String {
    let session = session_of(message_id);
    if let Some(goal) = goals.get(session) {
        let short: String = goal.chars().take(48).collect();
        let cut = if short.len() < goal.len() { "..." } else { "" };
        return format!("[{short}{cut}] ");
    }
    let path = agent_core::supervisor::subagent_path(session);
    if path.is_empty() {
        return String::new();
    }
    let path: Vec<String> = path.iter().map(usize::to_string).collect();
    format!("[subagent {}] ", path.join("."))
}

/// Turns response chunks into readable terminal output.
pub struct Renderer {
    json: bool,
    explain: bool,
    color: bool,
    open: Option<(String, String)>,
    /// Subagent session -> goal, from the fan-outs seen so far.
    goals: HashMap<String, String>,
    /// Subagents' streamed text, gathered by message until it ends: branches stream side by
    /// side, and each of their thoughts is printed as one line rather than interleaved pieces.
    gathering: Vec<((String, String), String)>,
}

impl Renderer {
    pub fn new(json: bool, explain: bool) -> Renderer {
        Renderer {
            json,
            explain,
            color: std::io::stdout().is_terminal(),
            open: None,
            goals: HashMap::new(),
            gathering: Vec::new(),
        }
    }

    fn paint(&self, code: &str, text: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    fn close_line(&mut self, out: &mut impl Write) {
        if self.open.take().is_some() {
            let _ = writeln!(out);
        }
    }

    /// A line about the stream itself (not a message of the dialog), on its own line.
    pub fn note(&mut self, note: &str) {
        if self.json {
            return;
        }
        let mut out = std::io::stdout().lock();
        self.close_line(&mut out);
        let _ = writeln!(out, "{}", self.paint("2", note));
        let _ = out.flush();
    }

    /// A whole answer this client did not see streamed (read from the graph, or the standing
    /// attempt's text shown again), as one message.
    pub fn show_answer(&mut self, answer: &str) {
        let mut text = AgentResponse::new(MessageType::Answer, answer);
        text.end_of_message = true;
        self.show(&text);
    }

    pub fn show(&mut self, r: &AgentResponse) {
        let mut out = std::io::stdout().lock();
        self.render(r, &mut out);
        let _ = out.flush();
    }

    fn label(&self, kind: MessageType) -> String {
        if kind == MessageType::Thought {
            self.paint("36", "Thought:")
        } else {
            self.paint("1;32", "Answer:")
        }
    }

    /// Drops a subagent's text gathered for `message_id` (another attempt's, cut short).
    pub fn forget_gathered(&mut self, message_id: &str) {
        self.gathering.retain(|((_, id), _)| id != message_id);
    }

    /// A subagent's chunk: kept until its message ends, then printed whole on its own line.
    fn gather(&mut self, r: &AgentResponse, key: (String, String), out: &mut impl Write) {
        let at = match self.gathering.iter().position(|(k, _)| *k == key) {
            Some(at) => at,
            None => {
                self.gathering.push((key, String::new()));
                self.gathering.len() - 1
            }
        };
        self.gathering[at].1.push_str(&r.content);
        if r.end_of_message {
            let (_, text) = self.gathering.remove(at);
            self.print_gathered(&r.message_id, kind(r), &text, "", out);
        }
    }

    fn print_gathered(
        &mut self,
        message_id: &str,
        kind: MessageType,
        text: &str,
        note: &str,
        out: &mut impl Write,
    ) {
        if text.is_empty() {
            return;
        }
        self.close_line(out);
        let prefix = subagent_prefix(message_id, &self.goals);
        let _ = writeln!(out, "{prefix}{} {text}{note}", self.label(kind));
    }

    fn render(&mut self, r: &AgentResponse, out: &mut impl Write) {
        if self.json {
            let _ = writeln!(out, "{}", String::from_utf8_lossy(&agent_schema::encode(r)));
            return;
        }
        let cleaned = terminal_safe(r);
        let r = &cleaned;
        let key = (r.message_type.clone(), r.message_id.clone());
        match kind(r) {
            MessageType::Thought | MessageType::Answer
                if agent_core::supervisor::place_of(session_of(&r.message_id)).is_some() =>
            {
                self.gather(r, key, out);
            }
            MessageType::Thought | MessageType::Answer => {
                if r.content.is_empty() && self.open.as_ref() != Some(&key) {
                    return;
                }
                if self.open.as_ref() != Some(&key) {
                    self.close_line(out);
                    let label = self.label(kind(r));
                    let prefix = subagent_prefix(&r.message_id, &self.goals);
                    let _ = write!(out, "{prefix}{label} ");
                    self.open = Some(key);
                }
                let _ = write!(out, "{}", r.content);
                if r.end_of_message {
                    self.close_line(out);
                }
            }
            MessageType::Observation => {
                self.close_line(out);
                self.goals.extend(fanout_goals(&r.message_id, &r.content));
                let text: String = r.content.chars().take(600).collect();
                let _ = writeln!(
                    out,
                    "{}{} {text}",
                    subagent_prefix(&r.message_id, &self.goals),
                    self.paint("33", "Observation:")
                );
            }
            MessageType::Error => {
                self.close_line(out);
                let message = r
                    .error
                    .as_ref()
                    .map(|e| e.message.as_str())
                    .unwrap_or(&r.content);
                let _ = writeln!(out, "{} {message}", self.paint("1;31", "Error:"));
            }
            MessageType::Explain => {
                let node = r.explain_id.as_deref().unwrap_or_default();
                if node.ends_with("/pattern-decision") {
                    self.close_line(out);
                    let mut line = routing_line(&r.explain_triples);
                    let session = session_of(node);
                    if agent_core::supervisor::place_of(session).is_none() {
                        line.push_str(&format!("; session {session}"));
                    }
                    let _ = writeln!(out, "{} {line}", self.paint("35", "Routed:"));
                }
                if self.explain {
                    self.close_line(out);
                    let node = r.explain_id.clone().unwrap_or_default();
                    let _ = writeln!(out, "{}", self.paint("2", &format!("  provenance {node}")));
                    for line in describe(&r.explain_triples) {
                        let _ = writeln!(out, "{}", self.paint("2", &format!("    {line}")));
                    }
                }
            }
        }
    }

    pub fn finish(&mut self, last: &AgentResponse, elapsed: Duration) {
        if self.json {
            return;
        }
        let mut out = std::io::stdout().lock();
        // What a branch was still writing when the dialog ended (a cancel, a timeout).
        for ((kind_name, message_id), text) in std::mem::take(&mut self.gathering) {
            let kind = MessageType::parse(&kind_name).unwrap_or(MessageType::Thought);
            self.print_gathered(&message_id, kind, &text, " (cut off)", &mut out);
        }
        self.close_line(&mut out);
        let mut model = last.model.clone().unwrap_or_else(|| "-".to_owned());
        clean_for_terminal(&mut model);
        let summary = format!(
            "(tokens in/out: {}/{}, model: {model}, {:.2} s)",
            last.in_token.unwrap_or(0),
            last.out_token.unwrap_or(0),
            elapsed.as_secs_f64()
        );
        let _ = writeln!(out, "{}", self.paint("2", &summary));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(kind: &str, message_id: &str, content: &str, end: bool) -> AgentResponse {
        let mut r = AgentResponse::new(MessageType::parse(kind).unwrap(), content);
        r.message_id = message_id.to_owned();
        r.end_of_message = end;
        r
    }

    /// An escape sequence in the model's text (or an error's, or provenance's) reaches the
    /// terminal as text to read, not as a command to obey.
    #[test]
    fn control_characters_are_shown_not_sent_to_the_terminal() {
        let mut renderer = Renderer::new(false, false);
        renderer.color = false;
        let mut out = Vec::new();
        let id = "urn:trustgraph:agent:abc/i1/answer";
        renderer.render(
            &chunk(
                "answer",
                id,
                "paid\u{1b}]0;owned\u{7}\u{1b}[2J\nnext\tline",
                true,
            ),
            &mut out,
        );
        let mut error = chunk("error", id, "", true);
        error.error = Some(agent_schema::ErrorInfo {
            kind: "agent-error".into(),
            message: "bad\u{9b}31m".into(),
        });
        renderer.render(&error, &mut out);
        let shown = String::from_utf8(out).unwrap();
        assert!(
            !shown
                .chars()
                .any(|c| c.is_control() && c != '\n' && c != '\t'),
            "{shown:?}"
        );
        assert!(
            shown.contains("paid\u{fffd}]0;owned\u{fffd}\u{fffd}[2J\nnext\tline"),
            "{shown:?}"
        );
        assert!(shown.contains("bad\u{fffd}31m"), "{shown:?}");
    }

    /// Two subagents' thoughts streamed side by side come out one line each, when each ends;
    /// the dialog's own answer streams as it comes.
    #[test]
    fn streamed_branches_print_a_line_per_message() {
        let mut renderer = Renderer::new(false, false);
        renderer.color = false;
        let mut out = Vec::new();
        let owls = "urn:trustgraph:agent:abc-f1-s0/i1/thought";
        let larks = "urn:trustgraph:agent:abc-f1-s1/i1/thought";
        for r in [
            chunk("thought", owls, "the owls ", false),
            chunk("thought", larks, "the larks ", false),
            chunk("thought", owls, "roost", false),
            chunk("thought", larks, "sing", true),
            chunk("thought", owls, "", true),
            chunk("answer", "urn:trustgraph:agent:abc/final", "Eleven ", false),
            chunk("answer", "urn:trustgraph:agent:abc/final", "owls.", false),
        ] {
            renderer.render(&r, &mut out);
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[subagent 1] Thought: the larks sing\n[subagent 0] Thought: the owls roost\nAnswer: Eleven owls."
        );
    }

    /// A subagent's thought cut short by a crash and streamed again from the start: the line is
    /// the second attempt's text alone (`follow` forgets the first's when the attempt changes),
    /// not the two glued together.
    #[test]
    fn a_subagent_thought_streamed_again_prints_the_second_attempt_alone() {
        let mut renderer = Renderer::new(false, false);
        renderer.color = false;
        let mut out = Vec::new();
        let owls = "urn:trustgraph:agent:abc-f1-s0/i1/thought";
        renderer.render(&chunk("thought", owls, "I should look", false), &mut out);
        renderer.forget_gathered(owls);
        for r in [
            chunk("thought", owls, "I should look ", false),
            chunk("thought", owls, "up owls", true),
        ] {
            renderer.render(&r, &mut out);
        }
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "[subagent 0] Thought: I should look up owls\n"
        );
    }

    #[test]
    fn subagent_messages_are_labelled_by_goal_or_place() {
        let mut goals = HashMap::new();
        let none = HashMap::new();
        assert_eq!(
            subagent_prefix("urn:trustgraph:agent:abc-f1-s2/i1/thought", &none),
            "[subagent 2] "
        );
        assert_eq!(
            subagent_prefix("urn:trustgraph:agent:abc-f1-s10-f3-s0/final", &none),
            "[subagent 10.0] "
        );
        assert_eq!(
            subagent_prefix("urn:trustgraph:agent:my-session/i1/thought", &none),
            ""
        );
        assert_eq!(
            subagent_prefix("urn:trustgraph:agent:abc-f1/final", &none),
            ""
        );
        goals.extend(fanout_goals(
            "urn:trustgraph:agent:abc/fanout/abc-f1",
            "0. price of alpha (react)\n1. price (in euros) of beta (plan-then-execute)",
        ));
        assert_eq!(
            subagent_prefix("urn:trustgraph:agent:abc-f1-s1/i1/thought", &goals),
            "[price (in euros) of beta] "
        );
        assert_eq!(
            subagent_prefix("urn:trustgraph:agent:abc-f1-s0/final", &goals),
            "[price of alpha] "
        );
    }
}
