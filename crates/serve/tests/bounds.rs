//! The bounds `agent_serve::serve` puts on connections, seen from clients on the network: a server
//! takes no more connections than its bounds in all and per peer, answers one more 503, serves
//! again once others close, and does not count this machine's own connections. Clients here connect from the machine's
//! own network address, which is not loopback, as another host's would be counted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use agent_serve::HttpBounds;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

/// This machine's address on its network: where a datagram to the outside would leave from (none
/// is sent).
fn network_address() -> IpAddr {
    let socket = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    let routed = socket.connect("192.0.2.1:9");
    assert!(
        routed.is_ok(),
        "this machine has no route to a network (these tests need a network address): {routed:?}"
    );
    let address = socket.local_addr().unwrap().ip();
    assert!(
        !address.is_loopback() && !address.is_unspecified(),
        "this machine has no network address besides loopback: {address}"
    );
    address
}

async fn serving(bounds: HttpBounds) -> (u16, CancellationToken) {
    let listener = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let app = axum::Router::new().route("/healthz", get(|| async { "ok" }));
    let stop = CancellationToken::new();
    tokio::spawn(agent_serve::serve(
        "test",
        listener,
        app,
        bounds,
        Duration::from_secs(30),
        stop.clone(),
    ));
    (port, stop)
}

/// The status line a connection gets for a `GET /healthz` sent on it, or what ended it.
async fn status_of(stream: &mut TcpStream) -> String {
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
        .await
        .unwrap();
    let mut received = Vec::new();
    let mut buffer = [0; 1024];
    let reading = async {
        while !received.windows(2).any(|w| w == b"\r\n") {
            match stream.read(&mut buffer).await {
                Ok(0) => return "closed".to_owned(),
                Err(e) => return format!("failed: {e}"),
                Ok(n) => received.extend_from_slice(&buffer[..n]),
            }
        }
        let text = String::from_utf8_lossy(&received);
        text.lines().next().unwrap_or("").to_owned()
    };
    tokio::time::timeout(Duration::from_secs(5), reading)
        .await
        .unwrap_or_else(|_| "no answer within 5 s".to_owned())
}

/// `count` connections to `to`, each answered 200 (so each was taken).
async fn taken(to: impl tokio::net::ToSocketAddrs + Copy, count: usize) -> Vec<TcpStream> {
    let mut open = Vec::new();
    for _ in 0..count {
        let mut stream = TcpStream::connect(to).await.unwrap();
        assert_eq!(status_of(&mut stream).await, "HTTP/1.1 200 OK");
        open.push(stream);
    }
    open
}

/// The status one more connection to `to` gets.
async fn one_more(to: SocketAddr) -> String {
    let mut stream = TcpStream::connect(to).await.unwrap();
    status_of(&mut stream).await
}

#[tokio::test]
async fn connections_past_the_bounds_are_told_503_and_served_again_once_others_close() {
    let (port, stop) = serving(HttpBounds {
        http_max_connections: Some(3),
        http_max_connections_per_peer: 0,
        ..HttpBounds::default()
    })
    .await;
    let from_network = SocketAddr::new(network_address(), port);
    let mut open = taken(from_network, 3).await;
    assert_eq!(
        one_more(from_network).await,
        "HTTP/1.1 503 Service Unavailable"
    );
    // This machine's own connections are neither bounded nor counted.
    let _local = taken(("127.0.0.1", port), 1).await;
    drop(open.pop());
    let mut served = "not yet".to_owned();
    for _ in 0..50 {
        served = one_more(from_network).await;
        if served == "HTTP/1.1 200 OK" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served, "HTTP/1.1 200 OK", "served again once one closed");
    stop.cancel();
}

#[tokio::test]
async fn one_peer_gets_no_more_than_its_share() {
    let (port, stop) = serving(HttpBounds {
        http_max_connections: Some(100),
        http_max_connections_per_peer: 2,
        ..HttpBounds::default()
    })
    .await;
    let from_network = SocketAddr::new(network_address(), port);
    let _open = taken(from_network, 2).await;
    assert_eq!(
        one_more(from_network).await,
        "HTTP/1.1 503 Service Unavailable"
    );
    let _local = taken(("127.0.0.1", port), 5).await;
    stop.cancel();
}
