//! The operator's endpoints: `/healthz` (the process serves), `/readyz` (it is consuming from the
//! broker and, when it journals or reads knowledge, reaches the graph store) and Prometheus
//! `/metrics`. They listen before the broker is reached, so a probe sees "not ready" rather than
//! nothing while the broker is down.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use agent_bus::ConsumerStats;
use agent_graph::GraphStore;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

/// What the endpoints report on: the request consumer (it says when it is subscribed) and the
/// graph store the orchestrator needs, if any.
pub struct OpsState {
    pub stats: Arc<ConsumerStats>,
    pub store: Option<GraphStore>,
    /// `/readyz`'s probes of the store: one a second at most, whoever asks.
    pub store_probe: agent_serve::probe::Probe,
}

impl OpsState {
    pub fn new(stats: Arc<ConsumerStats>, store: Option<GraphStore>) -> OpsState {
        OpsState {
            stats,
            store,
            store_probe: agent_serve::probe::Probe::new(
                Duration::from_secs(1),
                Duration::from_secs(2),
            ),
        }
    }
}

pub fn router(state: Arc<OpsState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// Serves the endpoints on `listener` until the process ends (the task is aborted).
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<OpsState>,
    bounds: agent_serve::HttpBounds,
) {
    let served = agent_serve::serve(
        "orchestrator",
        listener,
        router(state),
        bounds,
        agent_serve::SMALL_ANSWERS_STALL,
        tokio_util::sync::CancellationToken::new(),
    );
    if let Err(e) = served.await {
        tracing::error!(error = %e, "the health and metrics endpoint stopped");
    }
}

async fn ready(State(state): State<Arc<OpsState>>) -> Response {
    if !state.stats.consuming.load(Ordering::SeqCst) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not consuming from the broker",
        )
            .into_response();
    }
    if let Some(store) = state.store.clone() {
        let ask = || async move { store.answers().await };
        if let Err(e) = state.store_probe.answer(ask).await {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("the graph store fails: {e}"),
            )
                .into_response();
        }
    }
    "ready".into_response()
}

async fn metrics(State(state): State<Arc<OpsState>>) -> Response {
    crate::metrics::consumer(&state.stats);
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        agent_metrics::global().render(),
    )
        .into_response()
}
