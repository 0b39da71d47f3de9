//! The HTTP APIs. For people: `GET /api/v1/config` (everything), `GET /api/v1/config/{type}` (the
//! type's keys and values), `GET|PUT|DELETE /api/v1/config/{type}/{key}`, each in `?workspace=`
//! (default `default`). For TrustGraph's CLI and `trustgraph.api`: `POST /api/v1/config` takes a
//! config request as TrustGraph's API gateway does. Writes need the bearer token. Every write goes
//! through the same store and push as the Pulsar protocol.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use agent_core::config::AgentConfig;

use agent_schema::{operation, ConfigRequest};

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
        .route("/api/v1/config", get(dump).post(gateway))
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

/// The workspace a REST call works in.
#[derive(serde::Deserialize)]
struct Scope {
    workspace: Option<String>,
}

impl Scope {
    fn name(&self) -> String {
        crate::protocol::named_or_default(self.workspace.as_deref()).to_owned()
    }
}

/// A config request as TrustGraph's API gateway takes it (`trustgraph.api.Config`, the `tg-*`
/// config commands): the protocol's JSON in, its answer out with empty fields left out (the
/// client reads any `error` key as a failure). Writes need the bearer token.
async fn gateway(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let request: ConfigRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return Json(json!({"error": {"type": crate::protocol::BAD_OPERATION,
                "message": format!("not a config request: {e}")}}))
            .into_response()
        }
    };
    let writes = [operation::PUT, operation::DELETE].contains(&request.operation.as_str());
    if writes {
        if let Some(denied) = denied(&state, &headers) {
            return denied;
        }
        if request.values.iter().any(|v| v.value.contains(HIDDEN)) {
            return Json(json!({"error": {"type": crate::protocol::BAD_OPERATION,
                "message": HIDDEN_WRITTEN_BACK}}))
            .into_response();
        }
    }
    let trusted = trusted(&state, &headers);
    match crate::answer_and_announce(&state.store, &state.pusher, request).await {
        Ok(mut response) => {
            if !trusted {
                hide_credentials(&mut response);
            }
            let mut body = serde_json::to_value(&response).unwrap_or_default();
            if let Value::Object(fields) = &mut body {
                fields.retain(|_, v| !v.is_null());
            }
            Json(body).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

async fn dump(
    State(state): State<AppState>,
    Query(scope): Query<Scope>,
    headers: HeaderMap,
) -> Response {
    let trusted = trusted(&state, &headers);
    match state.store.dump(&scope.name()) {
        Ok((version, values)) => {
            let config: serde_json::Map<String, Value> = values
                .iter()
                .map(|(kind, entries)| {
                    let entries: serde_json::Map<String, Value> = entries
                        .iter()
                        .map(|(k, v)| (k.clone(), as_json(&shown(kind, v, trusted))))
                        .collect();
                    (kind.clone(), Value::Object(entries))
                })
                .collect();
            Json(json!({"version": version, "config": config})).into_response()
        }
        Err(e) => store_error(e),
    }
}

async fn of_type(
    State(state): State<AppState>,
    Path(kind): Path<String>,
    Query(scope): Query<Scope>,
    headers: HeaderMap,
) -> Response {
    let trusted = trusted(&state, &headers);
    match state.store.values_of(&scope.name(), &kind) {
        Ok((version, values)) => {
            let values: serde_json::Map<String, Value> = values
                .iter()
                .map(|(k, v)| (k.clone(), as_json(&shown(&kind, v, trusted))))
                .collect();
            Json(json!({"version": version, "type": kind, "values": values})).into_response()
        }
        Err(e) => store_error(e),
    }
}

async fn get_one(
    State(state): State<AppState>,
    Path((kind, key)): Path<(String, String)>,
    Query(scope): Query<Scope>,
    headers: HeaderMap,
) -> Response {
    let trusted = trusted(&state, &headers);
    match state
        .store
        .get(&scope.name(), &[(kind.clone(), key.clone())])
    {
        Ok((_, found)) => match found.first() {
            Some((_, _, value)) => Json(as_json(&shown(&kind, value, trusted))).into_response(),
            None => (StatusCode::NOT_FOUND, format!("no config {kind}/{key}")).into_response(),
        },
        Err(e) => store_error(e),
    }
}

/// Whether the request bears the services' token: a reader without it is not shown credentials.
fn trusted(state: &AppState, headers: &HeaderMap) -> bool {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    state
        .token
        .as_ref()
        .is_some_and(|expected| agent_bus::bearer_matches(given, expected))
}

/// What a reader without the token is shown in place of a credential.
const HIDDEN: &str = "(hidden: read with the config token to see it)";

/// Why a write holding [`HIDDEN`] is refused: it was read without the token and would replace the
/// credential with the placeholder.
const HIDDEN_WRITTEN_BACK: &str = "the value holds a credential's placeholder (it was read without the config token); read it with the token and write that";

/// A stored value of type `kind` as a reader is shown it: whole with the token; otherwise an `mcp`
/// entry's `auth-token` and the values of its `env` hidden (the config API answers anyone who
/// reaches it, and those are the credentials the orchestrators use; they read the config over
/// the broker, whole).
fn shown(kind: &str, text: &str, trusted: bool) -> String {
    if trusted || kind != "mcp" {
        return text.to_owned();
    }
    let Ok(Value::Object(mut entry)) = serde_json::from_str::<Value>(text) else {
        return text.to_owned();
    };
    let mut hidden = false;
    if let Some(token) = entry.get_mut("auth-token") {
        if !token.is_null() {
            *token = Value::String(HIDDEN.to_owned());
            hidden = true;
        }
    }
    if let Some(Value::Object(env)) = entry.get_mut("env") {
        for value in env.values_mut() {
            *value = Value::String(HIDDEN.to_owned());
            hidden = true;
        }
    }
    // A URL's user and query, and arguments that carry a secret (`--token x`, a connection
    // string's password), as errors and logs show them. What they are cut to does not hold the
    // placeholder, so the entry says so beside them: written back as it was read, it is refused
    // like any other placeholder, instead of replacing the credentials with their cut form.
    let mut cut = false;
    if let Some(Value::String(url)) = entry.get_mut("url") {
        let shown = agent_core::redact::without_credentials(url);
        if shown != *url {
            *url = shown;
            cut = true;
        }
    }
    if let Some(Value::Array(args)) = entry.get_mut("args") {
        let given: Vec<String> = args
            .iter()
            .map(|a| a.as_str().map_or_else(|| a.to_string(), str::to_owned))
            .collect();
        let shown = agent_core::redact::shown_arguments(&given);
        if shown != given {
            *args = shown.into_iter().map(Value::String).collect();
            cut = true;
        }
    }
    if cut {
        entry.insert(
            "credentials".to_owned(),
            Value::String(format!("cut from the url or args {HIDDEN}")),
        );
        hidden = true;
    }
    if !hidden {
        return text.to_owned();
    }
    Value::Object(entry).to_string()
}

/// [`shown`] over every value of a gateway answer.
fn hide_credentials(response: &mut agent_schema::ConfigResponse) {
    if let Some(values) = &mut response.values {
        for value in values.iter_mut() {
            value.value = shown(&value.kind, &value.value, false);
        }
    }
    if let Some(config) = &mut response.config {
        for (kind, entries) in config.iter_mut() {
            for value in entries.values_mut() {
                *value = shown(kind, value, false);
            }
        }
    }
}

fn denied(state: &AppState, headers: &HeaderMap) -> Option<Response> {
    if state.token.is_none() {
        return Some(
            (
                StatusCode::UNAUTHORIZED,
                "config writes are disabled: no CONFIG_TOKEN is configured",
            )
                .into_response(),
        );
    }
    (!trusted(state, headers))
        .then(|| (StatusCode::UNAUTHORIZED, "a valid bearer token is required").into_response())
}

/// Runs a write in `workspace` off the async workers, then announces it.
async fn write(
    state: &AppState,
    workspace: String,
    call: impl FnOnce(&ConfigStore, &str) -> Result<Written, StoreError> + Send + 'static,
) -> Response {
    let (store, pusher) = (state.store.clone(), state.pusher.clone());
    // One task, as in `answer_and_announce`: a client gone before its answer must not leave the
    // write saved and unannounced.
    let written = tokio::spawn(async move {
        let _turn = pusher.turn().await;
        let scope = workspace.clone();
        let written = crate::off_thread(&store, move |store| call(store, &scope)).await?;
        Ok::<_, tokio::task::JoinError>(match written {
            Ok(written) => {
                let version = written.version;
                pusher.push(written, &workspace).await;
                Ok((version, workspace))
            }
            Err(e) => Err(e),
        })
    });
    match written.await.and_then(|written| written) {
        Ok(Ok((version, workspace))) => {
            // The store takes any JSON (it is TrustGraph's general config store), but whoever
            // changes the agent config should learn at once that orchestrators will refuse it.
            let problems = agent_config_problems(&state.store, &workspace);
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
fn agent_config_problems(store: &ConfigStore, workspace: &str) -> Vec<String> {
    match store.dump(workspace) {
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
    Query(scope): Query<Scope>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(denied) = denied(&state, &headers) {
        return denied;
    }
    let Ok(text) = String::from_utf8(body.to_vec()) else {
        return (StatusCode::BAD_REQUEST, "the body is not UTF-8").into_response();
    };
    if text.contains(HIDDEN) {
        return (StatusCode::BAD_REQUEST, HIDDEN_WRITTEN_BACK).into_response();
    }
    write(&state, scope.name(), move |store, workspace| {
        store.put(workspace, &[(kind, key, text)])
    })
    .await
}

async fn delete_one(
    State(state): State<AppState>,
    Path((kind, key)): Path<(String, String)>,
    Query(scope): Query<Scope>,
    headers: HeaderMap,
) -> Response {
    if let Some(denied) = denied(&state, &headers) {
        return denied;
    }
    write(&state, scope.name(), move |store, workspace| {
        store.delete(workspace, &[(kind, key)])
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reader_without_the_token_is_not_shown_an_mcp_servers_credentials() {
        let entry = r#"{"url": "https://mcp.example/mcp", "auth-token": "s3cret", "env": {"API_KEY": "k"}, "remote-name": "x"}"#;
        let hidden = shown("mcp", entry, false);
        assert!(
            !hidden.contains("s3cret") && !hidden.contains("\"k\""),
            "{hidden}"
        );
        assert!(hidden.contains("https://mcp.example/mcp") && hidden.contains("API_KEY"));
        assert_eq!(shown("mcp", entry, true), entry);
        assert_eq!(shown("tool", entry, false), entry);
        let args = r#"{"command": "npx", "args": ["server-postgres", "postgresql://app:pw@db/app", "--token", "t0k"]}"#;
        let hidden = shown("mcp", args, false);
        assert!(
            !hidden.contains("pw@") && !hidden.contains("t0k"),
            "{hidden}"
        );
        assert!(hidden.contains("postgresql://db/app"), "{hidden}");
        // Cut, not replaced by the placeholder: the entry holds it beside them, so a write of it
        // back is refused as any other placeholder is.
        assert!(hidden.contains(HIDDEN), "{hidden}");
        let query = shown("mcp", r#"{"url": "https://h/mcp?api_key=K"}"#, false);
        assert!(
            !query.contains("api_key=K") && query.contains(HIDDEN),
            "{query}"
        );
        let plain = r#"{"url": "https://mcp.example/mcp"}"#;
        assert_eq!(shown("mcp", plain, false), plain);
        assert_eq!(shown("mcp", "not json", false), "not json");
    }
}
