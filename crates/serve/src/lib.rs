//! Serves a service's HTTP API (the aggregator's SPARQL endpoint and journal, the config REST API,
//! the orchestrator's health and metrics) to clients that may not play fair. `axum::serve` sets no
//! timer on its connections and takes every connection offered, so a client that sends a
//! request's head or body a byte at a time kept a connection for as long as it liked, and enough
//! of them took every file descriptor the process had, the store's and the broker's included.
//! Here a request's head must come whole within a time limit and its body within another (408
//! past it), connections from other hosts are bounded in all and per peer (a connection past a
//! bound is told 503 and closed), and a connection whose writes make no progress for a while is
//! closed.

pub mod admission;
pub mod body;
pub mod probe;
pub mod stall;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agent_metrics::{global, Kind};
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower_service::Service;

pub use admission::{Admission, Refusal};
pub use stall::StallBoundedIo;

/// How long a connection may take nothing written to it before it is closed, for a server whose
/// answers are small (the aggregator's may be 64 MiB, and it gives its query time limit).
pub const SMALL_ANSWERS_STALL: Duration = Duration::from_secs(30);

/// Connections refused, by server and reason.
pub const CONNECTIONS_REFUSED: &str = "agent_http_connections_refused_total";
/// Connections open, by server.
pub const CONNECTIONS_OPEN: &str = "agent_http_connections_open";

/// How much of a server one client, or all of them, may hold.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct HttpBounds {
    /// Seconds a client has to send a request's head (its request line and headers) once it
    /// connects or its previous answer is written; past it the connection is closed. So it is also
    /// how long an idle kept-alive connection stays open. At least 5 (the services' own clients
    /// let a connection idle for 4 s at most before they stop using it).
    #[arg(
        long,
        env = "HTTP_HEAD_TIMEOUT_SECS",
        default_value_t = DEFAULT_HEAD_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u64).range(5..=3_600)
    )]
    pub http_head_timeout_secs: u64,
    /// Seconds a request's body has to come whole, from its head; past it the request fails and
    /// its connection is closed.
    #[arg(
        long,
        env = "HTTP_BODY_TIMEOUT_SECS",
        default_value_t = DEFAULT_BODY_TIMEOUT_SECS,
        value_parser = clap::value_parser!(u64).range(1..=86_400)
    )]
    pub http_body_timeout_secs: u64,
    /// Connections open at once from other hosts; one more is answered 503 and closed. By
    /// default a quarter of the process's limit of open files (`ulimit -n`), between 64 and
    /// 8,192: the store and the broker need theirs.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS", value_parser = clap::value_parser!(u64).range(1..))]
    pub http_max_connections: Option<u64>,
    /// Connections open at once from one address (an IPv6 one by its /64); 0 for no bound. Behind
    /// a NAT or a proxy every client shares its address.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS_PER_PEER", default_value_t = DEFAULT_MAX_PER_PEER)]
    pub http_max_connections_per_peer: u64,
}

const DEFAULT_HEAD_TIMEOUT_SECS: u64 = 10;
const DEFAULT_BODY_TIMEOUT_SECS: u64 = 60;
const DEFAULT_MAX_PER_PEER: u64 = 128;

impl Default for HttpBounds {
    /// As the command line gives them.
    fn default() -> HttpBounds {
        HttpBounds {
            http_head_timeout_secs: DEFAULT_HEAD_TIMEOUT_SECS,
            http_body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            http_max_connections: None,
            http_max_connections_per_peer: DEFAULT_MAX_PER_PEER,
        }
    }
}

impl HttpBounds {
    fn max_connections(&self) -> usize {
        let most = self
            .http_max_connections
            .unwrap_or_else(|| (open_files_limit().unwrap_or(1_024) / 4).clamp(64, 8_192));
        usize::try_from(most).unwrap_or(usize::MAX)
    }
}

/// The process's soft limit of open files (Linux: `/proc/self/limits`).
fn open_files_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let soft = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .next()?;
    match soft {
        "unlimited" => Some(u64::MAX),
        number => number.parse().ok(),
    }
}

/// What a connection past a bound is told before it is closed.
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

/// Refused connections kept open at once a moment after their 503, so that the client reads it
/// rather than a reset; past it one is closed at once.
const MOST_LINGERING: usize = 256;

/// What a request's head (and the buffer a body is read through) may take: heads here are small.
const MOST_READ_BUFFER: usize = 64 * 1024;

pub fn describe_metrics() {
    let registry = global();
    registry.describe(
        CONNECTIONS_REFUSED,
        Kind::Counter,
        "HTTP connections refused as they were opened, by server and reason: full (as many open as the server takes), peer_full (as many open from one address as a peer may have).",
    );
    registry.describe(
        CONNECTIONS_OPEN,
        Kind::Gauge,
        "HTTP connections open from other hosts, by server.",
    );
}

/// Serves `app` on `listener` until `shutdown` (`server` names it in logs and metrics), then
/// lets the requests under way finish (each connection is told to close once its request is
/// answered) and returns once every connection has closed. `write_stall` is how long a
/// connection's write may wait before it is closed. Accepting fails for one connection at a
/// time, never for good, so this returns no error; the `Result` is for `agent_bus::http_stopped`.
pub async fn serve(
    server: &'static str,
    listener: TcpListener,
    app: axum::Router,
    bounds: HttpBounds,
    write_stall: Duration,
    shutdown: CancellationToken,
) -> io::Result<()> {
    describe_metrics();
    let admission = Admission::new(
        server,
        bounds.max_connections(),
        usize::try_from(bounds.http_max_connections_per_peer).unwrap_or(usize::MAX),
    );
    tracing::debug!(server, ?bounds, "serving HTTP");
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(bounds.http_head_timeout_secs))
        .max_buf_size(MOST_READ_BUFFER);
    let builder = Arc::new(builder);
    let body_within = Duration::from_secs(bounds.http_body_timeout_secs);
    let connections = TaskTracker::new();
    let lingering = Arc::new(AtomicUsize::new(0));
    let mut last_warned: Option<std::time::Instant> = None;
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                if !gone_before_taken(&e) {
                    // Out of file descriptors, most likely: others will close.
                    if last_warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(1)) {
                        tracing::warn!(server, error = %e, "accepting a connection failed");
                        last_warned = Some(std::time::Instant::now());
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(100)) => {}
                    }
                }
                continue;
            }
        };
        let admitted = match admission.admit(peer.ip()) {
            Ok(admitted) => admitted,
            Err(refusal) => {
                refuse(server, stream, peer, refusal, &lingering);
                continue;
            }
        };
        // The services' calls (the journal's) are small requests and answers: not held back
        // for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(StallBoundedIo::new(stream, write_stall));
        let app = app.clone();
        let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
            let deadline = tokio::time::Instant::now() + body_within;
            let late = Arc::new(AtomicBool::new(false));
            let request = request.map(|body| {
                Body::new(body::DeadlineBody::new(
                    Body::new(body),
                    deadline,
                    late.clone(),
                ))
            });
            let answered = app.clone().call(request);
            async move {
                let response = match answered.await {
                    Ok(response) => response,
                    Err(never) => match never {},
                };
                if late.load(Ordering::Relaxed) {
                    // What the client may try again (the services' clients do), not a bad request.
                    let late_body = (
                        axum::http::StatusCode::REQUEST_TIMEOUT,
                        "the request's body did not come whole in time",
                    );
                    let late = axum::response::IntoResponse::into_response(late_body);
                    return Ok::<_, std::convert::Infallible>(late);
                }
                Ok(response)
            }
        });
        let builder = builder.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let connection = builder.serve_connection(io, service);
            let mut connection = std::pin::pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(server, %peer, error = %e, "connection ended");
            }
            drop(admitted);
        });
    }
    // New connections are refused by the system from now on, not left waiting in its backlog.
    drop(listener);
    connections.close();
    connections.wait().await;
    Ok(())
}

/// Errors of one connection that went before it was taken; any other is the listener's.
fn gone_before_taken(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Tells a connection past a bound 503 and closes it. What the client sent meanwhile is read
/// and let go of for a moment first: closed with it unread, the connection would be reset, and
/// the client might see that instead of the 503.
fn refuse(
    server: &'static str,
    mut stream: TcpStream,
    peer: SocketAddr,
    refusal: Refusal,
    lingering: &Arc<AtomicUsize>,
) {
    global().inc(
        CONNECTIONS_REFUSED,
        &[("server", server), ("reason", refusal.reason())],
    );
    tracing::debug!(server, %peer, reason = refusal.reason(), "connection refused");
    // A fresh socket's buffer takes these few bytes at once.
    let _ = stream.try_write(REFUSED);
    if lingering.fetch_add(1, Ordering::Relaxed) >= MOST_LINGERING {
        lingering.fetch_sub(1, Ordering::Relaxed);
        return;
    }
    let lingering = lingering.clone();
    tokio::spawn(async move {
        let _ = stream.shutdown().await;
        let mut sink = [0; 4096];
        let mut taken = 0;
        let reading = async {
            while taken < 64 * 1024 {
                match stream.read(&mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => taken += n,
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), reading).await;
        lingering.fetch_sub(1, Ordering::Relaxed);
    });
}
