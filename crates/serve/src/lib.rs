//! Serves a service's HTTP API (the aggregator's SPARQL endpoint and journal, the config REST API,
//! the orchestrator's health and metrics) to clients that may not play fair. `axum::serve` sets no
//! timer on its connections and takes every connection offered, so a client that sends a
//! request's head a byte at a time kept a connection for as long as it liked, and enough of them
//! took every file descriptor the process had, the store's and the broker's included. Here a
//! request's head must come whole within a time limit, connections are bounded in all and per
//! peer (a connection past a bound is told 503 and closed), and a connection whose writes make no
//! progress for a while is closed.

pub mod admission;
pub mod probe;
pub mod stall;

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use agent_metrics::{global, Kind};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use admission::{Admission, Refusal};
pub use stall::StallBoundedIo;

/// Connections refused, by reason.
pub const CONNECTIONS_REFUSED: &str = "agent_http_connections_refused_total";

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
        default_value_t = 10,
        value_parser = clap::value_parser!(u64).range(5..)
    )]
    pub http_head_timeout_secs: u64,
    /// Connections open at once; one more is answered 503 and closed. Keep it well under the
    /// process's file descriptor limit (`ulimit -n`): the store and the broker need theirs.
    #[arg(
        long,
        env = "HTTP_MAX_CONNECTIONS",
        default_value_t = 1024,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub http_max_connections: u64,
    /// Connections open at once from one address (an IPv6 one by its /64); 0 for no bound.
    /// Addresses of this machine (loopback) are not bounded: they are the host's own services.
    #[arg(long, env = "HTTP_MAX_CONNECTIONS_PER_PEER", default_value_t = 256)]
    pub http_max_connections_per_peer: u64,
}

impl Default for HttpBounds {
    fn default() -> Self {
        HttpBounds {
            http_head_timeout_secs: 10,
            http_max_connections: 1024,
            http_max_connections_per_peer: 256,
        }
    }
}

/// What a connection past a bound is told before it is closed.
const REFUSED: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

pub fn describe_metrics() {
    global().describe(
        CONNECTIONS_REFUSED,
        Kind::Counter,
        "HTTP connections refused as they were opened, by reason: full (as many open as the server takes), peer_full (as many open from one address as a peer may have).",
    );
}

/// Serves `app` on `listener` until `shutdown`, then lets the requests under way finish (each
/// connection is told to close once its request is answered) and returns once every connection
/// has closed. `write_stall` is how long a connection's write may wait before it is closed.
/// Accepting fails for one connection at a time, never for good, so this returns no error;
/// the `Result` is for `agent_bus::http_stopped`.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    bounds: HttpBounds,
    write_stall: Duration,
    shutdown: CancellationToken,
) -> io::Result<()> {
    describe_metrics();
    let to_usize = |n: u64| usize::try_from(n).unwrap_or(usize::MAX);
    let admission = Admission::new(
        to_usize(bounds.http_max_connections),
        to_usize(bounds.http_max_connections_per_peer),
    );
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(bounds.http_head_timeout_secs));
    let builder = Arc::new(builder);
    let connections = TaskTracker::new();
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
                    tracing::warn!(error = %e, "accepting a connection failed");
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
                refuse(&stream, peer, refusal);
                continue;
            }
        };
        // The services' calls (the journal's) are small requests and answers: not held back
        // for Nagle's algorithm.
        let _ = stream.set_nodelay(true);
        let io = TokioIo::new(StallBoundedIo::new(stream, write_stall));
        let service = TowerToHyperService::new(app.clone());
        let builder = builder.clone();
        let stop = shutdown.clone();
        connections.spawn(async move {
            let _admitted = admitted;
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
                tracing::debug!(%peer, error = %e, "connection ended");
            }
        });
    }
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

fn refuse(stream: &TcpStream, peer: SocketAddr, refusal: Refusal) {
    global().inc(CONNECTIONS_REFUSED, &[("reason", refusal.reason())]);
    // A fresh socket's buffer takes these few bytes at once; a client still sending its request
    // may see the connection reset instead, as the server closes with it unread.
    let _ = stream.try_write(REFUSED);
    tracing::debug!(%peer, reason = refusal.reason(), "connection refused");
}
