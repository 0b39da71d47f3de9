//! What every long-running process of the service needs besides the broker and its telemetry
//! (`agent-telemetry`): a cancellation token that SIGINT or SIGTERM trips, a bounded stop of its
//! HTTP server, and bearer-token checks on its HTTP endpoints.

use tokio_util::sync::CancellationToken;

use crate::shutdown_signal;

/// A token cancelled on SIGINT or SIGTERM: the process then drains and stops.
pub fn stop_on_signal() -> CancellationToken {
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        trigger.cancel();
    });
    shutdown
}

/// How long a stopping process lets its HTTP connections finish what they are doing.
pub const HTTP_DRAIN: std::time::Duration = std::time::Duration::from_secs(10);

/// Waits for an HTTP server told to stop gracefully, for at most `within`, then stops waiting: a
/// client that sent half a request and went quiet (or holds a body back) would otherwise keep the
/// process from exiting on SIGTERM for good. The server's accept loop is aborted; a connection
/// still open lives on in its own task until the process's runtime is dropped, as it is when a
/// service's `main` returns.
pub async fn http_stopped(
    mut server: tokio::task::JoinHandle<std::io::Result<()>>,
    within: std::time::Duration,
) -> std::io::Result<()> {
    match tokio::time::timeout(within, &mut server).await {
        Ok(Ok(served)) => served,
        Ok(Err(e)) => Err(std::io::Error::other(e)),
        Err(_) => {
            tracing::warn!(
                ?within,
                "HTTP connections still open after the shutdown's grace; stopping without them"
            );
            server.abort();
            Ok(())
        }
    }
}

/// Whether an `Authorization` header value carries `Bearer {expected}`. The comparison takes the
/// same time wherever the first difference is, so response times do not leak the token.
pub fn bearer_matches(authorization: Option<&str>, expected: &str) -> bool {
    let Some(given) = authorization.and_then(|v| v.strip_prefix("Bearer ")) else {
        return false;
    };
    given.len() == expected.len()
        && given
            .bytes()
            .zip(expected.bytes())
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::bearer_matches;

    #[test]
    fn bearer_tokens() {
        assert!(bearer_matches(Some("Bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(Some("Bearer s3cres"), "s3cret"));
        assert!(!bearer_matches(Some("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(Some("s3cret"), "s3cret"));
        assert!(!bearer_matches(None, "s3cret"));
    }
}
