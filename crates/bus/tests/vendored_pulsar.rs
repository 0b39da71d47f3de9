//! Guards the TCP_NODELAY half of our patch of the `pulsar` crate (patches/): every connection it
//! opens to a broker on Tokio, with TLS or without, on native-tls or rustls, turns Nagle's algorithm
//! off. Without it a round trip waits for the broker's delayed ACK (~44 ms instead of well under
//! one). The branch that runs depends on the crate's features, so when we changed them (native-tls to
//! rustls) the branch we then ran had lost the setting and only a benchmark noticed; this reads the
//! source, so it holds whichever branch the features pick.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[test]
fn every_tokio_connection_to_a_broker_sets_nodelay() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../.vendor/pulsar/src/connection.rs"
    );
    let source = std::fs::read_to_string(path).unwrap();
    let lines: Vec<&str> = source.lines().collect();
    let mut connections = 0;
    for (at, line) in lines.iter().enumerate() {
        if !line.contains("tokio::net::TcpStream::connect(&address)") {
            continue;
        }
        connections += 1;
        // The next statement (a few lines: it may be split, as rustfmt does) sets it.
        let next: String = lines[at..(at + 4).min(lines.len())].join("\n");
        assert!(
            next.contains("set_nodelay(true)"),
            "the connection at {path}:{} does not set TCP_NODELAY:\n{next}",
            at + 1
        );
    }
    // Two for native-tls (TLS, plain), two for rustls (TLS, plain).
    assert_eq!(connections, 4, "connections to a broker in {path}");
}
