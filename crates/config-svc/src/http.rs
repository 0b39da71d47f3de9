//! The REST API for people: `GET /api/v1/config` (everything), `GET /api/v1/config/{type}` (the
//! type's keys and values), `GET|PUT|DELETE /api/v1/config/{type}/{key}`; writes need the bearer
//! token. Every write goes through the same store and push as the Pulsar protocol.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use agent_core::config::AgentConfig;

use crate::store::{ConfigStore, StoreError, Written};
use crate::Pusher;

#[derive(Clone)]
struct AppState {
    store: Arc<ConfigStore>,
    token: Option<String>,
    pusher: Pusher,
}

pub fn router(store: Arc<ConfigStore>, token: Option<String>, pusher: Pusher) -> Router {
    Router::new()
        .route("/api/v1/config", get(dump))
        .route("/api/v1/config/{kind}", get(of_type))
        .route(
            "/api/v1/config/{kind}/{key}",
            get(get_one).put(put_one).delete(delete_one),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .route("/metrics", get(metrics))
        .with_state(AppState {
            store,
            token,
            pusher,
        })
}

async fn metrics(State(state): State<AppState>) -> Response {
    if let Ok(version) = state.store.version() {
        agent_metrics::global().set(crate::protocol::VERSION, &[], version as f64);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        agent_metrics::global().render(),
    )
        .into_response()
}

fn store_error(e: StoreError) -> Response {
    let status = match e {
        StoreError::NotJson { .. } | StoreError::EmptyName => StatusCode::BAD_REQUEST,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, e.to_string()).into_response()
}

/// Stored text back to JSON for people (a value that somehow is not JSON is shown as a string).
fn as_json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_owned()))
}

async fn dump(State(state): State<AppState>) -> Response {
    match state.store.dump() {
        Ok((version, values)) => {
            let config: serde_json::Map<String, Value> = values
                .iter()
                .map(|(kind, entries)| {
                    let entries: serde_json::Map<String, Value> = entries
                        .iter()
                        .map(|(k, v)| (k.clone(), as_json(v)))
                        .collect();
                    (kind.clone(), Value::Object(entries))
                })
                .collect();
            Json(json!({"version": version, "config": config})).into_response()
        }
        Err(e) => store_error(e),
    }
}

async fn of_type(State(state): State<AppState>, Path(kind): Path<String>) -> Response {
    match (state.store.values_of(&kind), state.store.version()) {
        (Ok(values), Ok(version)) => {
            let values: serde_json::Map<String, Value> = values
                .iter()
                .map(|(k, v)| (k.clone(), as_json(v)))
                .collect();
            Json(json!({"version": version, "type": kind, "values": values})).into_response()
        }
        (Err(e), _) | (_, Err(e)) => store_error(e),
    }
}

async fn get_one(
    State(state): State<AppState>,
    Path((kind, key)): Path<(String, String)>,
) -> Response {
    match state.store.get(&[(kind.clone(), key.clone())]) {
        Ok(found) => match found.first() {
            Some((_, _, value)) => Json(as_json(value)).into_response(),
            None => (StatusCode::NOT_FOUND, format!("no config {kind}/{key}")).into_response(),
        },
        Err(e) => store_error(e),
    }
}

fn denied(state: &AppState, headers: &HeaderMap) -> Option<Response> {
    let Some(expected) = &state.token else {
        return Some(
            (
                StatusCode::UNAUTHORIZED,
                "config writes are disabled: no CONFIG_TOKEN is configured",
            )
                .into_response(),
        );
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    (!agent_bus::bearer_matches(given, expected))
        .then(|| (StatusCode::UNAUTHORIZED, "a valid bearer token is required").into_response())
}

/// Runs a write off the async workers, then announces it.
async fn write(
    state: &AppState,
    call: impl FnOnce(&ConfigStore) -> Result<Written, StoreError> + Send + 'static,
) -> Response {
    match crate::off_thread(&state.store, call).await {
        Ok(Ok(written)) => {
            let version = written.version;
            state.pusher.push(written, crate::DEFAULT_WORKSPACE).await;
            // The store takes any JSON (it is TrustGraph's general config store), but whoever
            // changes the agent config should learn at once that orchestrators will refuse it.
            let problems = agent_config_problems(&state.store);
            if problems.is_empty() {
                Json(json!({"version": version})).into_response()
            } else {
                Json(json!({"version": version, "agent_config_problems": problems})).into_response()
            }
        }
        Ok(Err(e)) => store_error(e),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// What the orchestrators will find wrong with the agent config now in the store.
fn agent_config_problems(store: &ConfigStore) -> Vec<String> {
    match store.dump() {
        Ok((_, values)) => match AgentConfig::from_texts(&values) {
            Ok(_) => Vec::new(),
            Err(problems) => problems.iter().map(ToString::to_string).collect(),
        },
        Err(e) => vec![format!("cannot read the store back: {e}")],
    }
}

async fn put_one(
    State(state): State<AppState>,
    Path((kind, key)): Path<(String, String)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(denied) = denied(&state, &headers) {
        return denied;
    }
    let Ok(text) = String::from_utf8(body.to_vec()) else {
        return (StatusCode::BAD_REQUEST, "the body is not UTF-8").into_response();
    };
    write(&state, move |store| store.put(&[(kind, key, text)])).await
}

async fn delete_one(
    State(state): State<AppState>,
    Path((kind, key)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = denied(&state, &headers) {
        return denied;
    }
    write(&state, move |store| store.delete(&[(kind, key)])).await
}
