//! MCP tool calls through `rmcp`: one session per server, reused across iterations and opened again
//! after the server restarts; arguments typed from the server's own input schema.
//!
//! A server is reached over streamable HTTP (with the config's `auth-token` as a bearer header) or
//! as a stdio child process. Sessions are shared by every in-flight iteration of this process: MCP
//! multiplexes requests on one session, and opening one (a child process, an `initialize` round
//! trip) costs far more than a call.

mod arguments;
mod bounded_http;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_core::config::McpServer;
use agent_core::tools::ToolArgument;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, CancelledNotificationParam,
    ClientRequest, RawContent, RequestId, ResourceContents, ServerResult, Tool,
};
use rmcp::service::{Peer, PeerRequestOptions, RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::ServiceExt;

pub use arguments::{schema_arguments, typed_arguments};

/// How a server is reached; sessions are keyed by it, so tools on one server share a session.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    Http {
        url: String,
        auth_token: Option<String>,
    },
    Stdio {
        command: String,
        args: Vec<String>,
        env: BTreeMap<String, String>,
    },
}

impl Endpoint {
    pub fn of(server: &McpServer) -> Result<Endpoint, String> {
        if let Some(problem) = server.problem() {
            return Err(problem);
        }
        Ok(match &server.command {
            Some(command) => Endpoint::Stdio {
                command: command.clone(),
                args: server.args.clone(),
                env: server.env.clone(),
            },
            None => Endpoint::Http {
                url: server.url.clone(),
                auth_token: server.auth_token.clone().filter(|t| !t.is_empty()),
            },
        })
    }

    /// Names the server in errors and logs, without its token or environment, and without what
    /// may carry a credential (errors reach the LLM, the client and the graph): a URL's user and
    /// query (hosted servers take keys there), and a stdio argument that names a secret or follows
    /// a flag that does (`--token x`, `--api-key=x`).
    pub fn describe(&self) -> String {
        match self {
            Endpoint::Http { url, .. } => agent_core::redact::without_credentials(url),
            Endpoint::Stdio { command, args, .. } => {
                let mut line = command.clone();
                for arg in agent_core::redact::shown_arguments(args) {
                    line.push(' ');
                    line.push_str(&arg);
                }
                line
            }
        }
    }
}

/// An open session and, once asked for, the server's tool list.
struct Session {
    peer: Peer<RoleClient>,
    /// The tools as last listed, when, and at which of the server's changes (see
    /// [`ToolListWatch`]).
    tools: tokio::sync::Mutex<Option<ListedTools>>,
    tools_changed: ToolListWatch,
    /// Calls under way on it, and when it last answered anything: a session busy or heard from
    /// just now is not pinged (a server that serves one request at a time cannot answer a ping
    /// while a long call runs, and would be taken for lost).
    in_flight: std::sync::atomic::AtomicUsize,
    answered_at: Mutex<std::time::Instant>,
    /// A call on it was given up on before it answered: the server may hang.
    suspect: std::sync::atomic::AtomicBool,
    /// A call on it was given up on, ever (an answer since does not clear it): over HTTP, its
    /// answer's stream stays open until the session ends (see [`McpPool::call`]).
    gave_up_on: std::sync::atomic::AtomicBool,
    // Dropping the service ends the session.
    _service: RunningService<RoleClient, ToolListWatch>,
    /// A stdio server's process, ended with the session.
    _child: Option<ServerProcess>,
}

/// A server's tools as listed on a session.
struct ListedTools {
    tools: Arc<Vec<Tool>>,
    at: std::time::Instant,
    /// The count of the server's "tool list changed" notices when they were listed.
    changes: u64,
}

/// Counts a server's notices that its tool list changed (`notifications/tools/list_changed`):
/// a session lives as long as it is used, and a server that adds a tool or changes a tool's
/// arguments while it runs says so, so the next step lists them again rather than prompt the LLM
/// with arguments the server no longer takes.
#[derive(Clone, Default)]
struct ToolListWatch(Arc<std::sync::atomic::AtomicU64>);

impl ToolListWatch {
    fn count(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl rmcp::ClientHandler for ToolListWatch {
    fn on_tool_list_changed(
        &self,
        _context: rmcp::service::NotificationContext<RoleClient>,
    ) -> impl std::future::Future<Output = ()> + Send + '_ {
        self.0.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        std::future::ready(())
    }
}

/// How long a session's tool list is used before it is listed again, for a server that changes
/// its tools without saying so (the notice is optional in MCP).
const TOOL_LIST_MAX_AGE: Duration = Duration::from_secs(300);

/// A stdio server's process. When its session is dropped (its input closes with the session's
/// transport) it has a few seconds to finish on its own, as rmcp's child transport gives it, and
/// is killed then; without a runtime to wait on, at once. It leads a process group of its own,
/// and whatever is left in the group then is killed too: a launcher's server (`npx`'s node,
/// `uvx`'s python, a shell's command) outlived the launcher before, one more each time the
/// session was replaced.
struct ServerProcess(Option<tokio::process::Child>);

/// Kills what is left of the process group `leader` led (nothing, when it is gone).
fn kill_group(leader: Option<u32>) {
    #[cfg(unix)]
    if let Some(group) = leader.and_then(|pid| i32::try_from(pid).ok()) {
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(group),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    #[cfg(not(unix))]
    let _ = leader;
}

/// How long a stdio server has to exit by itself once its session is dropped.
const SERVER_EXIT_GRACE: Duration = Duration::from_secs(3);

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let Some(mut child) = self.0.take() else {
            return;
        };
        let leader = child.id();
        // `kill_on_drop` ends it if the task never runs.
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                if tokio::time::timeout(SERVER_EXIT_GRACE, child.wait())
                    .await
                    .is_err()
                {
                    let _ = child.kill().await;
                }
                kill_group(leader);
            });
        } else {
            kill_group(leader);
        }
    }
}

impl Session {
    /// Whether to ask the session whether it still answers before a call: not while calls run on
    /// it, nor when it answered within [`FRESH`]; a session a call gave up on, always. Over HTTP
    /// too: a server may serve one request at a time (and `rmcp` sent one at a time until our
    /// client answered each apart, see [`bounded_http`]), so a ping queued behind a long call
    /// timed out, and a healthy session was dropped.
    fn worth_a_ping(&self) -> bool {
        if self.suspect.load(std::sync::atomic::Ordering::SeqCst) {
            return true;
        }
        let idle = self.in_flight.load(std::sync::atomic::Ordering::SeqCst) == 0;
        let heard = *self
            .answered_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        idle && heard.elapsed() >= FRESH
    }

    fn heard(&self) {
        self.suspect
            .store(false, std::sync::atomic::Ordering::SeqCst);
        *self
            .answered_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = std::time::Instant::now();
    }
}

/// How long after a session last answered a call on it goes without a ping first.
const FRESH: Duration = Duration::from_secs(2);

/// A call counted as under way on a session for as long as this lives.
/// One that ends without [`InFlight::finished`] (its step stopped waiting, at the tool's timeout)
/// leaves the session suspect: it is pinged before the next call, busy or not.
struct InFlight<'a> {
    session: &'a Session,
    finished: bool,
}

impl<'a> InFlight<'a> {
    fn enter(session: &'a Session) -> InFlight<'a> {
        session
            .in_flight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        InFlight {
            session,
            finished: false,
        }
    }

    fn finished(mut self) {
        self.finished = true;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.session
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if !self.finished {
            self.session
                .suspect
                .store(true, std::sync::atomic::Ordering::SeqCst);
            self.session
                .gave_up_on
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

/// A server's slot. Its async lock makes concurrent callers of a dead server wait for one
/// reconnection instead of each starting their own.
type Slot = Arc<tokio::sync::Mutex<SlotState>>;

#[derive(Default)]
struct SlotState {
    /// The session, if one is open.
    session: Option<Arc<Session>>,
    /// The last attempt to open one that failed: when it ended, and why. Callers that waited for
    /// the slot while it was made are given its failure rather than each trying again in turn: a
    /// server that accepts connections and never answers cost every one of them the whole
    /// connect timeout, one after another (four tools of one server, listed at once, took 60 s).
    failed: Option<(std::time::Instant, String)>,
}

/// A slot and when a caller last asked for it.
struct Kept {
    slot: Slot,
    used: std::time::Instant,
}

/// How long a server's session is kept with no call: the endpoint is read from the live config
/// at each call, so a config change (a token rotated, a server's arguments edited) leaves the old
/// endpoint's session unused for good, a stdio server's process among them.
const IDLE_SESSION: Duration = Duration::from_secs(600);

/// Which stdio servers this process may start. A stdio server is a program run with the
/// orchestrator's rights, so its definition must come from the operator: one the process's own
/// config directory defines (command, arguments and environment alike), or one whose program
/// `MCP_STDIO_COMMANDS` names (comma-separated; `*` for any). A definition that came only from
/// the config service, which anyone who can publish on the broker can write, starts nothing else.
#[derive(Clone, Default)]
pub struct StdioTrust {
    defined: std::collections::HashSet<Endpoint>,
    commands: std::collections::HashSet<String>,
}

impl StdioTrust {
    /// Trusts the stdio servers `defined` (the local config's) and the programs `commands` names.
    pub fn new(defined: impl IntoIterator<Item = Endpoint>, commands: &str) -> StdioTrust {
        StdioTrust {
            defined: defined
                .into_iter()
                .filter(|e| matches!(e, Endpoint::Stdio { .. }))
                .collect(),
            commands: commands
                .split(',')
                .map(str::trim)
                .filter(|c| !c.is_empty())
                .map(str::to_owned)
                .collect(),
        }
    }

    /// [`StdioTrust::new`] with the programs of `MCP_STDIO_COMMANDS`.
    pub fn from_env(defined: impl IntoIterator<Item = Endpoint>) -> StdioTrust {
        StdioTrust::new(
            defined,
            &std::env::var("MCP_STDIO_COMMANDS").unwrap_or_default(),
        )
    }

    /// Trusts every stdio server (tests, and tools that only ever read local config).
    pub fn any() -> StdioTrust {
        StdioTrust::new([], "*")
    }

    /// Why `endpoint` may not be started, if it may not.
    pub fn refusal(&self, endpoint: &Endpoint) -> Option<String> {
        let Endpoint::Stdio { command, .. } = endpoint else {
            return None;
        };
        if self.defined.contains(endpoint)
            || self.commands.contains(command)
            || self.commands.contains("*")
        {
            return None;
        }
        Some(format!(
            "the MCP server '{}' would start the program '{command}', which neither this orchestrator's own config directory defines so nor MCP_STDIO_COMMANDS allows; a server defined only by the config service starts no program here",
            endpoint.describe()
        ))
    }
}

/// The sessions of this process, by endpoint.
/// How long a server whose listing failed is not asked for its tools' arguments again.
const LIST_AGAIN_AFTER: Duration = Duration::from_secs(30);

pub struct McpPool {
    slots: Mutex<HashMap<Endpoint, Kept>>,
    /// Each tool's arguments as its server last listed them.
    known: Mutex<HashMap<(Endpoint, String), Vec<ToolArgument>>>,
    /// Servers whose last listing ran out of time or did not reach them: when, and why. Not
    /// asked again for [`LIST_AGAIN_AFTER`], so that a server that hangs costs one wait, not one
    /// each step.
    unlisted: Mutex<HashMap<Endpoint, (std::time::Instant, String)>>,
    idle: Duration,
    stdio: StdioTrust,
}

impl Default for McpPool {
    fn default() -> McpPool {
        McpPool::with_idle(IDLE_SESSION)
    }
}

impl McpPool {
    /// A pool that starts no stdio server (see [`McpPool::trusting`]).
    pub fn new() -> McpPool {
        McpPool::default()
    }

    /// A pool that drops a session no call used for `idle` (when it is next asked for another).
    pub fn with_idle(idle: Duration) -> McpPool {
        McpPool {
            slots: Mutex::default(),
            known: Mutex::default(),
            unlisted: Mutex::default(),
            idle,
            stdio: StdioTrust::default(),
        }
    }

    /// The pool, starting the stdio servers `stdio` trusts.
    pub fn trusting(mut self, stdio: StdioTrust) -> McpPool {
        self.stdio = stdio;
        self
    }

    /// Calls the tool `name` on the server with the LLM's `arguments` (strings, typed here from the
    /// tool's input schema) and returns its content as text. A result the server marks as an error
    /// is an `Err` with its text.
    ///
    /// A reused session is first asked whether it still answers (an MCP `ping`, which does
    /// nothing): one that does not (the server restarted, died, or hangs) is dropped and a new one
    /// opened, before anything is sent. The call itself is never sent twice: a transport failure
    /// after it was sent cannot tell whether the tool ran (a server that crashed after acting, a
    /// proxy's 502 after the server answered), and a tool with side effects must not run again
    /// for it. The failure is reported (the LLM sees it and decides) and the session dropped, so
    /// the next call connects again.
    pub async fn call(
        &self,
        endpoint: &Endpoint,
        name: &str,
        arguments: &BTreeMap<String, String>,
    ) -> Result<String, String> {
        let (mut session, reused) = self.session(endpoint).await?;
        // Over HTTP, a call given up on (at the tool's timeout) keeps its answer's stream open:
        // the server need not answer a cancelled call (the TypeScript SDK's never does), and the
        // transport ends the streams it reads only with the session. A ping kept the session, so
        // each timed-out call held a connection and a task for as long as it lived. The session
        // is ended instead (calls still under way on it finish first) and a new one opened.
        let over_http = matches!(endpoint, Endpoint::Http { .. });
        if reused && over_http && session.gave_up_on.load(std::sync::atomic::Ordering::SeqCst) {
            tracing::info!(server = %endpoint.describe(), "a call on the MCP session was given up on; opening a new one");
            self.forget(endpoint, &session).await;
            session = self.session(endpoint).await?.0;
        } else if reused && session.worth_a_ping() {
            if let Err(e) = ping(&session, endpoint).await {
                tracing::info!(server = %endpoint.describe(), error = %e, "MCP session lost; connecting again");
                self.forget(endpoint, &session).await;
                session = self.session(endpoint).await?.0;
            }
        }
        let result = {
            let in_flight = InFlight::enter(&session);
            let result = call_on(&session, endpoint, name, arguments).await;
            in_flight.finished();
            result
        };
        if result.is_ok() {
            session.heard();
        }
        self.settle(endpoint, &session, result)
            .await
            .map_err(|e| e.to_string())
    }

    /// The arguments of the tool `name` as the server describes them, for the prompt, asked for
    /// `within` at most: past it, or when the server fails, what it listed last. The bound is
    /// the pool's own so that the fallback still comes (a stdio server that hangs as it starts
    /// may take longer to give up on than a step can wait). A server that did not answer in time
    /// is not asked again for [`LIST_AGAIN_AFTER`].
    pub async fn arguments(
        &self,
        endpoint: &Endpoint,
        name: &str,
        within: Duration,
    ) -> Result<Vec<ToolArgument>, String> {
        let key = (endpoint.clone(), name.to_owned());
        let failed_lately = {
            let unlisted = self.unlisted.lock().unwrap_or_else(|p| p.into_inner());
            unlisted
                .get(endpoint)
                .filter(|(when, _)| when.elapsed() < LIST_AGAIN_AFTER)
                .map(|(_, why)| why.clone())
        };
        let fresh = match failed_lately {
            Some(why) => Err(why),
            None => {
                let asked =
                    tokio::time::timeout(within, self.fresh_arguments(endpoint, name)).await;
                let mut unlisted = self.unlisted.lock().unwrap_or_else(|p| p.into_inner());
                // A server that answers, even with an error (a tool it does not have), costs no
                // time to ask again. One not reached is remembered: out of time, or without a
                // session or a transport (a session that did not open in its own time limit,
                // a connection dropped unanswered), it cost a wait.
                let answered = match asked {
                    Ok(Ok(listed)) => Ok(Ok(listed)),
                    Ok(Err(CallError::Other(why))) => Ok(Err(why)),
                    Ok(Err(CallError::Transport(why))) => Err(Some(why)),
                    Err(_) => Err(None),
                };
                match answered {
                    Ok(answered) => {
                        unlisted.remove(endpoint);
                        answered
                    }
                    Err(why) => {
                        let why = why.unwrap_or_else(|| {
                            format!(
                                "{} did not list its tools within {within:?}",
                                endpoint.describe()
                            )
                        });
                        unlisted.insert(endpoint.clone(), (std::time::Instant::now(), why.clone()));
                        Err(why)
                    }
                }
            }
        };
        match fresh {
            Ok(listed) => {
                let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
                known.insert(key, listed.clone());
                Ok(listed)
            }
            // While the server is away the prompt keeps what it said last.
            Err(e) => {
                let known = self.known.lock().unwrap_or_else(|p| p.into_inner());
                known.get(&key).cloned().ok_or(e)
            }
        }
    }

    async fn fresh_arguments(
        &self,
        endpoint: &Endpoint,
        name: &str,
    ) -> Result<Vec<ToolArgument>, CallError> {
        let (session, _) = self.session(endpoint).await.map_err(CallError::Transport)?;
        let listed = remote_tool(&session, endpoint, name).await;
        self.settle(endpoint, &session, listed)
            .await
            .map(|tool| schema_arguments(&tool.input_schema))
    }

    /// Passes `result` on, first dropping `session` when the transport failed, so the next call
    /// connects again.
    async fn settle<T>(
        &self,
        endpoint: &Endpoint,
        session: &Arc<Session>,
        result: Result<T, CallError>,
    ) -> Result<T, CallError> {
        if matches!(result, Err(CallError::Transport(_))) {
            self.forget(endpoint, session).await;
        }
        result
    }

    /// The slot of `endpoint`; the slots no call asked for in `idle` are dropped first, and with
    /// them their sessions once no call holds one (a stdio server's process ends then).
    fn slot(&self, endpoint: &Endpoint) -> Slot {
        let now = std::time::Instant::now();
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        // The tools' arguments listed before stay (a few hundred bytes a tool): a server that is
        // down when it is next asked still shows them in the prompt.
        slots.retain(|kept, entry| kept == endpoint || now.duration_since(entry.used) < self.idle);
        let entry = slots.entry(endpoint.clone()).or_insert_with(|| Kept {
            slot: Slot::default(),
            used: now,
        });
        entry.used = now;
        entry.slot.clone()
    }

    /// The open session, or a new one; `true` when it was already open.
    async fn session(&self, endpoint: &Endpoint) -> Result<(Arc<Session>, bool), String> {
        if let Some(refusal) = self.stdio.refusal(endpoint) {
            return Err(refusal);
        }
        let slot = self.slot(endpoint);
        let asked = std::time::Instant::now();
        let mut open = slot.lock().await;
        if let Some(session) = open.session.as_ref() {
            if !session.peer.is_transport_closed() {
                return Ok((session.clone(), true));
            }
        }
        if let Some((_, why)) = open.failed.as_ref().filter(|(at, _)| *at >= asked) {
            return Err(why.clone());
        }
        let limit = match endpoint {
            Endpoint::Http { .. } => CONNECT_TIMEOUT_HTTP,
            Endpoint::Stdio { .. } => CONNECT_TIMEOUT_STDIO,
        };
        let connected = match tokio::time::timeout(limit, connect(endpoint)).await {
            Ok(connected) => connected,
            Err(_) => Err(format!(
                "the MCP server {} did not open a session within {} s",
                endpoint.describe(),
                limit.as_secs()
            )),
        };
        match connected {
            Ok(session) => {
                let session = Arc::new(session);
                *open = SlotState {
                    session: Some(session.clone()),
                    failed: None,
                };
                Ok((session, false))
            }
            Err(why) => {
                open.failed = Some((std::time::Instant::now(), why.clone()));
                Err(why)
            }
        }
    }

    /// Drops `session` from its slot, unless another caller has already replaced it.
    async fn forget(&self, endpoint: &Endpoint, session: &Arc<Session>) {
        let slot = self.slot(endpoint);
        let mut open = slot.lock().await;
        if open
            .session
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(s, session))
        {
            open.session = None;
        }
    }
}

/// Why a call failed: the transport (worth a new session) or anything else.
#[derive(Debug)]
enum CallError {
    Transport(String),
    Other(String),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Transport(e) | CallError::Other(e) => f.write_str(e),
        }
    }
}

/// Whether `error` is no answer of the server's but our HTTP client's, made when the server's
/// answer could not be read: a transport's failure. Only that client makes one.
fn made_here(endpoint: &Endpoint, error: &rmcp::model::ErrorData) -> bool {
    matches!(endpoint, Endpoint::Http { .. }) && bounded_http::unanswered(error)
}

fn service_error(endpoint: &Endpoint, what: &str, error: ServiceError) -> CallError {
    let server = endpoint.describe();
    match error {
        ServiceError::TransportSend(_) | ServiceError::TransportClosed => CallError::Transport(
            format!("the MCP server {server} could not be reached to {what} ({error})"),
        ),
        ServiceError::McpError(e) if made_here(endpoint, &e) => CallError::Transport(format!(
            "the MCP server {server} could not be reached to {what} ({})",
            e.message
        )),
        ServiceError::McpError(e) => CallError::Other(format!(
            "the MCP server {server} refused to {what}: {}",
            e.message
        )),
        other => CallError::Other(format!("the MCP server {server} failed to {what}: {other}")),
    }
}

async fn connect(endpoint: &Endpoint) -> Result<Session, String> {
    let server = endpoint.describe();
    let mut child = None;
    let watch = ToolListWatch::default();
    let service = match endpoint {
        Endpoint::Http { url, auth_token } => {
            let client = reqwest::Client::builder()
                .connect_timeout(Duration::from_secs(5))
                .build()
                .map_err(|e| format!("no HTTP client for the MCP server {server}: {e}"))?;
            let mut config = StreamableHttpClientTransportConfig::with_uri(url.as_str());
            if let Some(token) = auth_token {
                config = config.auth_header(token.clone());
            }
            let transport = StreamableHttpClientTransport::with_client(
                bounded_http::BoundedHttp::new(client.clone(), MAX_MESSAGE_BYTES),
                config,
            );
            match watch.clone().serve(transport).await {
                Ok(service) => Ok(service),
                Err(e) => {
                    let status = http_refusal(&client, url, auth_token.as_deref()).await;
                    return Err(format!(
                        "the MCP server {server} did not open a session: {}",
                        status.unwrap_or_else(|| e.to_string())
                    ));
                }
            }
        }
        Endpoint::Stdio { command, args, env } => {
            let mut command = tokio::process::Command::new(command);
            command
                .env_clear()
                .envs(passed_environment())
                .args(args)
                .envs(env)
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true);
            // A group of its own, for what it starts to be ended with it (see `ServerProcess`).
            #[cfg(unix)]
            command.process_group(0);
            let mut started = command
                .spawn()
                .map_err(|e| format!("the MCP server '{server}' could not be started: {e}"))?;
            let (Some(stdin), Some(stdout)) = (started.stdin.take(), started.stdout.take()) else {
                return Err(format!(
                    "the MCP server '{server}' has no pipes to talk over"
                ));
            };
            if let Some(stderr) = started.stderr.take() {
                tokio::spawn(log_stderr(server.clone(), stderr));
            }
            // Held as a server process from here: a start given up on (a timeout dropped this
            // future, or the session failed to open) ends what the server started too, not only
            // its launcher, which is all `kill_on_drop` ends.
            child = Some(ServerProcess(Some(started)));
            watch
                .clone()
                .serve((LineCap::new(stdout, MAX_MESSAGE_BYTES), stdin))
                .await
        }
    }
    .map_err(|e| format!("the MCP server {server} did not open a session: {e}"))?;
    tracing::info!(server = %server, "MCP session open");
    Ok(Session {
        peer: service.peer().clone(),
        tools: tokio::sync::Mutex::new(None),
        tools_changed: watch,
        in_flight: std::sync::atomic::AtomicUsize::new(0),
        answered_at: Mutex::new(std::time::Instant::now()),
        suspect: std::sync::atomic::AtomicBool::new(false),
        gave_up_on: std::sync::atomic::AtomicBool::new(false),
        _service: service,
        _child: child,
    })
}

/// The longest message a server may send: one JSON-RPC line on stdio; over HTTP a JSON answer,
/// or a line of an event stream. What the LLM reads of a result is cut far shorter
/// (`max_observation_bytes`), but only once the whole message is read: a server that wrote a
/// message without end would otherwise grow this process's memory until it died. Past it the
/// call fails (on stdio the session ends, and the next call starts the server again).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;

/// A reader that fails once a line runs past its bound before its newline.
struct LineCap<R> {
    inner: R,
    most: usize,
    /// Bytes read since the last newline.
    open_line: usize,
}

impl<R> LineCap<R> {
    fn new(inner: R, most: usize) -> LineCap<R> {
        LineCap {
            inner,
            most,
            open_line: 0,
        }
    }

    /// Takes note of `fresh` bytes read; an error when they carry a line past the bound.
    fn saw(&mut self, fresh: &[u8]) -> std::io::Result<()> {
        let mut line = self.open_line;
        for piece in fresh.split(|&b| b == b'\n') {
            line += piece.len();
            if line > self.most {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("a message longer than {} bytes", self.most),
                ));
            }
            line = 0;
        }
        // The last piece is the line still open (empty when `fresh` ended with a newline).
        self.open_line = match fresh.iter().rposition(|&b| b == b'\n') {
            Some(at) => fresh.len() - at - 1,
            None => self.open_line + fresh.len(),
        };
        Ok(())
    }
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for LineCap<R> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match std::pin::Pin::new(&mut this.inner).poll_read(cx, buf) {
            std::task::Poll::Ready(Ok(())) => {
                std::task::Poll::Ready(this.saw(&buf.filled()[before..]))
            }
            other => other,
        }
    }
}

/// Tells the server a call was given up on (the step's tool timeout, or the step stopped), unless
/// disarmed by its answer: the server may stop the work, and the session forgets the call rather
/// than keep its entry until the session ends.
struct CancelUnanswered {
    peer: Peer<RoleClient>,
    id: Option<RequestId>,
}

impl CancelUnanswered {
    fn answered(mut self) {
        self.id = None;
    }
}

impl Drop for CancelUnanswered {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let peer = self.peer.clone();
        runtime.spawn(async move {
            let cancelled = CancelledNotificationParam {
                request_id: id,
                reason: Some("the caller stopped waiting (tool timeout)".to_owned()),
            };
            let _ = tokio::time::timeout(PING_TIMEOUT, peer.notify_cancelled(cancelled)).await;
        });
    }
}

/// The variables of this process's environment a stdio server is started with (besides those its
/// config sets): what a program and the usual launchers (`npx`, `uvx`, `docker`) need to run and
/// find their files, certificates, proxies and registries, and those named in `MCP_STDIO_PASS_ENV`
/// (comma-separated). Not the rest: the orchestrator's environment holds its secrets (the LLM's
/// key, the broker's and the services' tokens), and a server is often a third party's package
/// fetched at start.
fn passed_environment() -> Vec<(std::ffi::OsString, std::ffi::OsString)> {
    const NAMES: &[&str] = &[
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TERM",
        "TMPDIR",
        "TEMP",
        "TMP",
        "TZ",
        "LD_LIBRARY_PATH",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "NO_PROXY",
        "ALL_PROXY",
        "http_proxy",
        "https_proxy",
        "no_proxy",
        "all_proxy",
        "VIRTUAL_ENV",
        "PYTHONPATH",
        "PYTHONHOME",
        "DOCKER_HOST",
        "DOCKER_CONFIG",
        "DOCKER_CERT_PATH",
        "DOCKER_TLS_VERIFY",
        "SYSTEMROOT",
        "SYSTEMDRIVE",
        "WINDIR",
        "COMSPEC",
        "PATHEXT",
        "APPDATA",
        "LOCALAPPDATA",
        "USERPROFILE",
        "PROGRAMDATA",
        "PROGRAMFILES",
    ];
    const PREFIXES: &[&str] = &[
        "LC_",
        "XDG_",
        "NODE_",
        "NPM_CONFIG_",
        "npm_config_",
        "UV_",
        "PIP_",
        "CONDA_",
    ];
    let extra = std::env::var("MCP_STDIO_PASS_ENV").unwrap_or_default();
    let named: Vec<&str> = extra
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .collect();
    std::env::vars_os()
        .filter(|(name, _)| {
            let Some(name) = name.to_str() else {
                return false;
            };
            // A launcher's own credentials (`NODE_AUTH_TOKEN`, `UV_INDEX_..._PASSWORD`) go only
            // when named.
            NAMES.contains(&name)
                || named.contains(&name)
                || (PREFIXES.iter().any(|prefix| name.starts_with(prefix))
                    && !agent_core::redact::names_secret(name))
        })
        .collect()
}

/// Why an HTTP server refused a session, when it said so with a status (a wrong token is a 401):
/// rmcp reports only the body it could not read. One plain `initialize` POST asks again.
async fn http_refusal(client: &reqwest::Client, url: &str, token: Option<&str>) -> Option<String> {
    let initialize = serde_json::json!({
        "jsonrpc": "2.0", "id": 0, "method": "initialize",
        "params": {"protocolVersion": "2025-03-26", "capabilities": {},
                   "clientInfo": {"name": "agent-orchestrator", "version": env!("CARGO_PKG_VERSION")}}
    });
    let mut probe = client
        .post(url)
        .header("accept", "application/json, text/event-stream")
        .json(&initialize)
        .timeout(Duration::from_secs(5));
    if let Some(token) = token {
        probe = probe.bearer_auth(token);
    }
    let response = probe.send().await.ok()?;
    let status = response.status();
    if status.is_success() {
        return None;
    }
    // Its start only: a body without end is not read.
    let mut response = response;
    let mut body = Vec::new();
    while body.len() < 1024 {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            _ => break,
        }
    }
    let body: String = String::from_utf8_lossy(&body).chars().take(200).collect();
    Some(format!("it answered HTTP {status}: {}", body.trim()))
}

/// A stdio server's own log lines go to ours, at debug level.
/// Logs what a stdio server writes to its standard error, a line at a time, until it closes it.
/// Read as bytes: a line that is not UTF-8 must not end the reading (the pipe would close, and the
/// server's next write to it fail or kill it), and a line is kept to 4 KiB, the rest of it read
/// and dropped, so a server that never writes a newline does not grow this without bound.
async fn log_stderr(server: String, stderr: tokio::process::ChildStderr) {
    use tokio::io::AsyncReadExt;
    const MOST: usize = 4096;
    let mut stderr = stderr;
    let mut line: Vec<u8> = Vec::new();
    let mut cut = false;
    let mut buffer = [0u8; 4096];
    loop {
        let read = match stderr.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        for &byte in &buffer[..read] {
            if byte == b'\n' {
                let suffix = if cut { " [cut]" } else { "" };
                tracing::debug!(server = %server, "{}{suffix}", String::from_utf8_lossy(&line));
                line.clear();
                cut = false;
            } else if line.len() < MOST {
                line.push(byte);
            } else {
                cut = true;
            }
        }
    }
    if !line.is_empty() {
        tracing::debug!(server = %server, "{}", String::from_utf8_lossy(&line));
    }
}

async fn remote_tool(
    session: &Session,
    endpoint: &Endpoint,
    name: &str,
) -> Result<Tool, CallError> {
    let tools = listed_tools(session, endpoint).await?;
    tools
        .iter()
        .find(|t| t.name == name)
        .cloned()
        .ok_or_else(|| {
            let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
            CallError::Other(format!(
                "the MCP server {} has no tool '{name}' (it has: {})",
                endpoint.describe(),
                names.join(", ")
            ))
        })
}

/// The tools of `session`'s server: as listed before, unless the server said since that they
/// changed or the list is older than [`TOOL_LIST_MAX_AGE`].
async fn listed_tools(session: &Session, endpoint: &Endpoint) -> Result<Arc<Vec<Tool>>, CallError> {
    let mut listed = session.tools.lock().await;
    // Read before listing: a notice that comes while the list is read makes the next look list
    // them again, since the list may have been read before the change.
    let changes = session.tools_changed.count();
    if let Some(known) = listed.as_ref() {
        if known.changes == changes && known.at.elapsed() < TOOL_LIST_MAX_AGE {
            return Ok(known.tools.clone());
        }
    }
    let tools = Arc::new(list_all_tools(session, endpoint).await?);
    *listed = Some(ListedTools {
        tools: tools.clone(),
        at: std::time::Instant::now(),
        changes,
    });
    Ok(tools)
}

/// The most pages of a server's tool list read, and the most tools taken from it.
const MOST_TOOL_PAGES: usize = 100;
const MOST_TOOLS: usize = 10_000;
/// The most bytes of tool definitions (as JSON) taken from a server's whole list: what one message
/// may be. The list is held for the session, and each page may be [`MAX_MESSAGE_BYTES`], so pages
/// and tools alone let one server's list hold 1.6 GB; no model's prompt takes a list that long.
const MOST_TOOL_LIST_BYTES: usize = MAX_MESSAGE_BYTES;
/// How long reading a server's whole tool list may take.
const TOOL_LIST_WITHIN: Duration = Duration::from_secs(30);

/// How long `tools` are as JSON, counted without writing them anywhere.
fn json_len(tools: &[Tool]) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(buf.len());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    // What cannot be written is not held either: counted as far as it got.
    let _ = serde_json::to_writer(&mut counter, tools);
    counter.0
}

/// Every page of the server's tool list. `rmcp`'s own loop reads pages for as long as the server
/// names a next one: a server that always did (a repeated cursor is a common bug) grew the list
/// without end, under the session's tool-list lock that every call to it waits on.
async fn list_all_tools(session: &Session, endpoint: &Endpoint) -> Result<Vec<Tool>, CallError> {
    let server = endpoint.describe();
    let listing = async {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        let mut cursors = std::collections::HashSet::new();
        let mut bytes = 0usize;
        for _ in 0..MOST_TOOL_PAGES {
            let page = session
                .peer
                .list_tools(Some(rmcp::model::PaginatedRequestParams {
                    meta: None,
                    cursor: cursor.take(),
                }))
                .await
                .map_err(|e| service_error(endpoint, "list its tools", e))?;
            bytes = bytes.saturating_add(json_len(&page.tools));
            if bytes > MOST_TOOL_LIST_BYTES {
                return Err(CallError::Other(format!(
                    "the MCP server {server} lists tools of more than {MOST_TOOL_LIST_BYTES} bytes"
                )));
            }
            tools.extend(page.tools);
            if tools.len() > MOST_TOOLS {
                return Err(CallError::Other(format!(
                    "the MCP server {server} lists more than {MOST_TOOLS} tools"
                )));
            }
            match page.next_cursor {
                None => return Ok(tools),
                Some(next) if !cursors.insert(next.clone()) => {
                    return Err(CallError::Other(format!(
                        "the MCP server {server} names the page of its tools '{}' again",
                        next.chars().take(64).collect::<String>()
                    )))
                }
                Some(next) => cursor = Some(next),
            }
        }
        Err(CallError::Other(format!(
            "the MCP server {server} lists its tools in more than {MOST_TOOL_PAGES} pages"
        )))
    };
    tokio::time::timeout(TOOL_LIST_WITHIN, listing)
        .await
        .unwrap_or_else(|_| {
            Err(CallError::Transport(format!(
                "the MCP server {server} did not list its tools within {} s",
                TOOL_LIST_WITHIN.as_secs()
            )))
        })
}

/// How long a reused session has to answer a `ping` before it is taken for lost.
const PING_TIMEOUT: Duration = Duration::from_secs(5);

/// How long opening a session (reaching a server, or starting a child process, and the
/// `initialize` round trip) may take: a server that accepts and never answers must not hold every
/// step that lists or calls its tools. A stdio server's first start may download it (`npx -y`,
/// `uvx`, `docker run`), so it has longer; the step waits for it no longer than the tool's timeout
/// (`tool_timeout_secs`), which ends the start too.
const CONNECT_TIMEOUT_HTTP: Duration = Duration::from_secs(15);
const CONNECT_TIMEOUT_STDIO: Duration = Duration::from_secs(120);

/// Whether `session` still answers: an MCP `ping`, within [`PING_TIMEOUT`].
async fn ping(session: &Session, endpoint: &Endpoint) -> Result<(), CallError> {
    let request = rmcp::model::ClientRequest::PingRequest(rmcp::model::PingRequest {
        method: Default::default(),
        extensions: Default::default(),
    });
    match tokio::time::timeout(PING_TIMEOUT, session.peer.send_request(request)).await {
        Ok(Ok(_)) => {
            session.heard();
            Ok(())
        }
        // A server that does not know `ping` still answered: the session is alive.
        Ok(Err(ServiceError::McpError(e))) if !made_here(endpoint, &e) => {
            session.heard();
            Ok(())
        }
        Ok(Err(e)) => Err(service_error(endpoint, "answer a ping", e)),
        Err(_) => Err(CallError::Transport(format!(
            "the MCP server {} did not answer a ping within {} s",
            endpoint.describe(),
            PING_TIMEOUT.as_secs()
        ))),
    }
}

async fn call_on(
    session: &Session,
    endpoint: &Endpoint,
    name: &str,
    arguments: &BTreeMap<String, String>,
) -> Result<String, CallError> {
    let tool = remote_tool(session, endpoint, name).await?;
    let typed = typed_arguments(&tool.input_schema, arguments).map_err(CallError::Other)?;
    let params = CallToolRequestParams {
        meta: None,
        name: name.to_owned().into(),
        arguments: Some(typed),
        task: None,
    };
    let failed = |e| service_error(endpoint, &format!("run '{name}'"), e);
    let request = ClientRequest::CallToolRequest(CallToolRequest {
        method: Default::default(),
        params,
        extensions: Default::default(),
    });
    let handle = session
        .peer
        .send_cancellable_request(request, PeerRequestOptions::no_options())
        .await
        .map_err(failed)?;
    let unanswered = CancelUnanswered {
        peer: handle.peer.clone(),
        id: Some(handle.id.clone()),
    };
    let answer = handle.await_response().await;
    unanswered.answered();
    let result = match answer.map_err(failed)? {
        ServerResult::CallToolResult(result) => result,
        _ => return Err(failed(ServiceError::UnexpectedResponse)),
    };
    let text = result_text(&result);
    if result.is_error == Some(true) {
        return Err(CallError::Other(format!("'{name}' failed: {text}")));
    }
    Ok(text)
}

/// The result as the LLM reads it: text as given, structured content as JSON, and binary content
/// named by its type and size rather than pasted in as base64.
pub fn result_text(result: &CallToolResult) -> String {
    let mut parts: Vec<String> = result
        .content
        .iter()
        .map(|content| match &content.raw {
            RawContent::Text(text) => text.text.clone(),
            RawContent::Image(image) => {
                format!(
                    "[image {}, {} bytes of base64]",
                    image.mime_type,
                    image.data.len()
                )
            }
            RawContent::Audio(audio) => {
                format!(
                    "[audio {}, {} bytes of base64]",
                    audio.mime_type,
                    audio.data.len()
                )
            }
            RawContent::Resource(embedded) => match &embedded.resource {
                ResourceContents::TextResourceContents { uri, text, .. } => {
                    format!("[resource {uri}]\n{text}")
                }
                ResourceContents::BlobResourceContents { uri, blob, .. } => {
                    format!("[resource {uri}, {} bytes of base64]", blob.len())
                }
            },
            RawContent::ResourceLink(link) => {
                format!("[resource link {} ({})]", link.uri, link.name)
            }
        })
        .collect();
    if parts.is_empty() {
        if let Some(structured) = &result.structured_content {
            parts.push(structured.to_string());
        }
    }
    parts.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error answer our HTTP client made for a call whose own answer could not be read is a
    /// transport's failure (the session is dropped); a server's own error answer, a mark it
    /// makes up, or the mark on a stdio session is the server's refusal.
    #[test]
    fn only_our_http_clients_error_answers_are_transport_failures() {
        let http = Endpoint::Http {
            url: "http://127.0.0.1:1/mcp".to_owned(),
            auth_token: None,
        };
        let stdio = Endpoint::Stdio {
            command: "server".to_owned(),
            args: Vec::new(),
            env: BTreeMap::new(),
        };
        let answer = |data: Option<serde_json::Value>| {
            ServiceError::McpError(rmcp::model::ErrorData::new(
                rmcp::model::ErrorCode::INTERNAL_ERROR,
                "connection refused",
                data,
            ))
        };
        let ours = || {
            answer(Some(serde_json::json!({
                "pulsar-agents-unanswered": bounded_http::unanswered_mark()
            })))
        };
        let made_up = answer(Some(serde_json::json!({"pulsar-agents-unanswered": true})));
        assert!(matches!(
            service_error(&http, "run 'x'", ours()),
            CallError::Transport(_)
        ));
        for (endpoint, error) in [(&stdio, ours()), (&http, made_up), (&http, answer(None))] {
            assert!(matches!(
                service_error(endpoint, "run 'x'", error),
                CallError::Other(_)
            ));
        }
    }

    /// A line may come in any number of reads; one longer than the bound fails the read that
    /// carries it past, wherever its newline falls.
    #[test]
    fn a_line_past_the_bound_fails_the_read() {
        let mut cap = LineCap::new((), 10);
        assert!(cap.saw(b"0123456789\n01234").is_ok());
        assert!(cap.saw(b"56789\nabc").is_ok(), "ten bytes, then a newline");
        assert!(cap.saw(b"defghij").is_ok());
        assert!(cap.saw(b"k").is_err(), "eleven bytes and no newline");
        let mut cap = LineCap::new((), 10);
        assert!(cap.saw(b"01234567").is_ok());
        assert!(
            cap.saw(b"890\nshort\n").is_err(),
            "the newline came too late"
        );
        let mut cap = LineCap::new((), 10);
        assert!(cap.saw(b"a\nb\nc\n").is_ok());
        assert!(cap.saw(b"0123456789").is_ok(), "a newline resets the count");
    }

    /// A stdio MCP server (Python, no SDK) whose tool list always names a next page: the same
    /// cursor, or a new one each time when `fresh_cursors`.
    fn endless_pages(fresh_cursors: bool) -> Endpoint {
        pages_of(fresh_cursors, 0)
    }

    /// As [`endless_pages`], each tool's description `description_bytes` long.
    fn pages_of(fresh_cursors: bool, description_bytes: usize) -> Endpoint {
        let script = r#"
import json, sys
page = 0
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    if m["method"] == "initialize":
        r = {"protocolVersion": m["params"]["protocolVersion"], "capabilities": {"tools": {}},
             "serverInfo": {"name": "endless", "version": "1"}}
    elif m["method"] == "tools/list":
        page += 1
        r = {"tools": [{"name": "t%d" % page, "description": "x" * FILLER,
                        "inputSchema": {"type": "object"}}],
             "nextCursor": ("c%d" % page) if FRESH else "again"}
    else:
        r = {}
    print(json.dumps({"jsonrpc": "2.0", "id": m["id"], "result": r}), flush=True)
"#
        .replace("FRESH", if fresh_cursors { "True" } else { "False" })
        .replace("FILLER", &description_bytes.to_string());
        Endpoint::Stdio {
            command: "python3".to_owned(),
            args: vec!["-c".to_owned(), script],
            env: BTreeMap::new(),
        }
    }

    /// An HTTP server that takes connections and never answers (a load balancer with no healthy
    /// backend): how many connections it has taken, and its endpoint.
    async fn never_answering() -> (Arc<std::sync::atomic::AtomicUsize>, Endpoint) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/mcp", listener.local_addr().unwrap());
        let taken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = taken.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((connection, _)) = listener.accept().await {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                held.push(connection);
            }
        });
        let endpoint = Endpoint::Http {
            url,
            auth_token: None,
        };
        (taken, endpoint)
    }

    /// A server that never answers costs one attempt to open a session, however many ask at
    /// once and whoever asks soon after. Callers that waited for the slot each tried again in
    /// turn (four tools of one server listed at once waited 15 s each, 60 s in all, a step's whole
    /// tool timeout), and the failure, which came before the caller's own time limit, was not
    /// remembered, so the next step paid again.
    #[tokio::test]
    async fn a_server_that_never_answers_is_tried_once_by_those_who_wait_for_it() {
        let (taken, endpoint) = never_answering().await;
        let connections = || taken.load(std::sync::atomic::Ordering::SeqCst);
        let within = Duration::from_secs(60);
        let pool = McpPool::new();
        let first = pool.arguments(&endpoint, "a", within).await;
        assert!(first.is_err(), "{first:?}");
        let one_attempt = connections();
        assert!(one_attempt > 0);
        // The next steps, soon after, do not ask it again.
        for _ in 0..2 {
            let again = pool.arguments(&endpoint, "a", within).await;
            assert!(again.is_err(), "{again:?}");
        }
        assert_eq!(connections(), one_attempt, "connections after asking again");
        // Four tools listed at once, by a process that has not met the server yet.
        let fresh = McpPool::new();
        let at_once = futures::future::join_all(
            ["a", "b", "c", "d"].map(|tool| fresh.arguments(&endpoint, tool, within)),
        )
        .await;
        assert!(at_once.iter().all(Result::is_err), "{at_once:?}");
        assert_eq!(
            connections(),
            2 * one_attempt,
            "connections after asking four at once"
        );
    }

    /// A server that hangs as it starts is given up on within the time asked, and the prompt
    /// keeps the arguments the server listed last. Before, the step's own timeout dropped the
    /// lookup before its fallback, and the tool was shown with no arguments.
    #[tokio::test]
    async fn a_server_that_hangs_as_it_starts_gives_the_arguments_it_listed_last() {
        let hanging = Endpoint::Stdio {
            command: "sleep".to_owned(),
            args: vec!["30".to_owned()],
            env: BTreeMap::new(),
        };
        let pool = McpPool::new().trusting(StdioTrust::any());
        let listed = vec![ToolArgument {
            name: "city".to_owned(),
            kind: "string".to_owned(),
            description: "where".to_owned(),
        }];
        pool.known
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((hanging.clone(), "weather".to_owned()), listed.clone());
        let asked = std::time::Instant::now();
        let arguments = pool
            .arguments(&hanging, "weather", Duration::from_millis(500))
            .await;
        assert_eq!(arguments, Ok(listed.clone()));
        assert!(
            asked.elapsed() < Duration::from_secs(20),
            "{:?}",
            asked.elapsed()
        );
        // Asked again soon after, it is not waited for: each step would otherwise wait out
        // its tool timeout (60 s by default) for a server known to hang.
        let again = tokio::time::timeout(
            Duration::from_secs(20),
            pool.arguments(&hanging, "weather", Duration::from_secs(60)),
        )
        .await;
        assert!(
            matches!(&again, Ok(Ok(a)) if a[..] == listed[..]),
            "{again:?}"
        );
        let unknown = pool
            .arguments(&hanging, "forecast", Duration::from_millis(500))
            .await;
        assert!(unknown.is_err_and(|e| e.contains("did not list its tools within")));
    }

    #[tokio::test]
    async fn a_tool_list_without_end_is_given_up_on() {
        let pool = McpPool::new().trusting(StdioTrust::any());
        let repeated = pool
            .arguments(&endless_pages(false), "t1", Duration::from_secs(60))
            .await;
        let Err(repeated) = repeated else {
            panic!("a list whose next page is always the same was read to its end")
        };
        assert!(repeated.contains("'again' again"), "{repeated}");
        let endless = pool
            .arguments(&endless_pages(true), "t1", Duration::from_secs(60))
            .await;
        let Err(endless) = endless else {
            panic!("a list without end was read to its end")
        };
        assert!(endless.contains("more than 100 pages"), "{endless}");
    }

    /// A list whose pages each are within a message's bound but whose whole is not (here a
    /// tool of 1 MiB a page) is given up on past [`MOST_TOOL_LIST_BYTES`]: pages and tools alone
    /// let it reach 100 pages of 16 MiB, held for the session.
    #[tokio::test]
    async fn a_tool_list_past_its_bytes_is_given_up_on() {
        let pool = McpPool::new().trusting(StdioTrust::any());
        let long = pool
            .arguments(&pages_of(true, 1024 * 1024), "t1", Duration::from_secs(60))
            .await;
        let Err(long) = long else {
            panic!("a list of 100 MiB was read to its end")
        };
        assert!(
            long.contains(&format!("tools of more than {MOST_TOOL_LIST_BYTES} bytes")),
            "{long}"
        );
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn what_a_stdio_server_started_ends_with_its_session() {
        // A server that starts a process of its own (as a launcher starts the real server) and
        // says where it is.
        let pid_file = std::env::temp_dir().join(format!("mcp-child-{:016x}", rand_suffix()));
        let script = format!(
            r#"
import json, subprocess, sys
child = subprocess.Popen(["sleep", "1000"])
open({path:?}, "w").write(str(child.pid))
for line in sys.stdin:
    m = json.loads(line)
    if "id" not in m:
        continue
    r = {{}}
    if m["method"] == "initialize":
        r = {{"protocolVersion": m["params"]["protocolVersion"], "capabilities": {{"tools": {{}}}},
             "serverInfo": {{"name": "launcher", "version": "1"}}}}
    elif m["method"] == "tools/list":
        r = {{"tools": [{{"name": "t", "inputSchema": {{"type": "object"}}}}]}}
    print(json.dumps({{"jsonrpc": "2.0", "id": m["id"], "result": r}}), flush=True)
"#,
            path = pid_file.display().to_string()
        );
        let endpoint = Endpoint::Stdio {
            command: "python3".to_owned(),
            args: vec!["-c".to_owned(), script],
            env: BTreeMap::new(),
        };
        let pool = McpPool::new().trusting(StdioTrust::any());
        assert!(pool
            .arguments(&endpoint, "t", Duration::from_secs(60))
            .await
            .is_ok());
        let pid: u32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(running(pid));
        drop(pool);
        let deadline = std::time::Instant::now() + SERVER_EXIT_GRACE + Duration::from_secs(10);
        while running(pid) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = std::fs::remove_file(&pid_file);
        assert!(
            !running(pid),
            "the server's own process {pid} outlived its session"
        );
    }

    /// A server given up on as it starts (it waits on something before it reads a line, and the
    /// caller stops waiting) is ended with what it started: only the session's end killed the
    /// process group, so a launcher's server outlived every start given up on, one more each time.
    #[cfg(unix)]
    #[tokio::test]
    async fn a_stdio_server_given_up_on_as_it_starts_leaves_nothing_running() {
        let pid_file = std::env::temp_dir().join(format!("mcp-hung-{:016x}", rand_suffix()));
        let script = format!(
            r#"
import subprocess, time
child = subprocess.Popen(["sleep", "1000"])
open({path:?}, "w").write(str(child.pid))
time.sleep(1000)
"#,
            path = pid_file.display().to_string()
        );
        let endpoint = Endpoint::Stdio {
            command: "python3".to_owned(),
            args: vec!["-c".to_owned(), script],
            env: BTreeMap::new(),
        };
        let pool = McpPool::new().trusting(StdioTrust::any());
        let started = tokio::time::timeout(
            Duration::from_secs(2),
            pool.call(&endpoint, "t", &BTreeMap::new()),
        )
        .await;
        assert!(started.is_err(), "{started:?}");
        let pid: u32 = std::fs::read_to_string(&pid_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let deadline = std::time::Instant::now() + SERVER_EXIT_GRACE + Duration::from_secs(10);
        while running(pid) && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let _ = std::fs::remove_file(&pid_file);
        assert!(
            !running(pid),
            "the process {pid} the server started outlived the start given up on"
        );
    }

    /// Running, not a zombie waiting for whoever adopted it to reap it.
    fn running(pid: u32) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
            stat.rsplit(')')
                .next()
                .is_some_and(|s| !s.trim_start().starts_with('Z'))
        })
    }

    fn rand_suffix() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
            ^ u64::from(std::process::id())
    }

    #[test]
    fn a_server_is_named_without_what_may_carry_a_credential() {
        let http = Endpoint::Http {
            url: "https://user:pw@mcp.example:8443/v1/mcp?api_key=abc#frag".to_owned(),
            auth_token: Some("t".to_owned()),
        };
        assert_eq!(http.describe(), "https://mcp.example:8443/v1/mcp");
        let stdio = Endpoint::Stdio {
            command: "npx".to_owned(),
            args: [
                "@modelcontextprotocol/server-github",
                "--token",
                "ghp_abc",
                "--api-key=sk-1",
                "--verbose",
                "SECRET_VALUE_x",
                "postgresql://app:pw@db:5432/app?sslmode=require",
                "stdio",
            ]
            .map(str::to_owned)
            .to_vec(),
            env: Default::default(),
        };
        assert_eq!(
            stdio.describe(),
            "npx @modelcontextprotocol/server-github --token *** --api-key=*** --verbose *** postgresql://db:5432/app stdio"
        );
    }
}
