//! TrustGraph's config operations on the store: one request in, one response out, and the write
//! to announce when it changed something.

use agent_schema::{operation, ConfigRequest, ConfigResponse, ConfigValue, ErrorInfo};

use crate::store::{ConfigStore, StoreError, Written};

/// The error types TrustGraph clients see.
pub const CONFIG_ERROR: &str = "config-error";
pub const BAD_OPERATION: &str = "bad-operation";

/// Answers `request`; a write that changed something also returns what it wrote.
/// Metric of config requests over the broker by operation and outcome (ok, error).
pub const REQUESTS: &str = "agent_config_requests_total";
/// Metric of the store's version.
pub const VERSION: &str = "agent_config_version";

/// Declares config-svc's metrics in the process registry.
pub fn describe_metrics() {
    let registry = agent_metrics::global();
    registry.describe(
        REQUESTS,
        agent_metrics::Kind::Counter,
        "Config requests over the broker by operation (unknown ones as other) and outcome (ok, error).",
    );
    registry.describe(
        VERSION,
        agent_metrics::Kind::Gauge,
        "The config store's version (raised by every write).",
    );
}

pub fn handle(store: &ConfigStore, request: &ConfigRequest) -> (ConfigResponse, Option<Written>) {
    let answered = answer(store, request);
    // The operation is the client's text: only the known ones are label values.
    let known = [
        operation::GET,
        operation::LIST,
        operation::GET_VALUES,
        operation::PUT,
        operation::DELETE,
        operation::CONFIG,
    ];
    let label = known
        .into_iter()
        .find(|o| *o == request.operation)
        .unwrap_or("other");
    let outcome = if answered.is_ok() { "ok" } else { "error" };
    agent_metrics::global().inc(REQUESTS, &[("operation", label), ("outcome", outcome)]);
    match answered {
        Ok(pair) => pair,
        Err((kind, message)) => (
            ConfigResponse {
                error: Some(ErrorInfo {
                    kind: kind.to_owned(),
                    message,
                }),
                ..ConfigResponse::default()
            },
            None,
        ),
    }
}

type Failure = (&'static str, String);

fn answer(
    store: &ConfigStore,
    request: &ConfigRequest,
) -> Result<(ConfigResponse, Option<Written>), Failure> {
    let failed = |e: StoreError| (CONFIG_ERROR, e.to_string());
    let version = || store.version().map_err(failed);
    let kind = || {
        request
            .kind
            .clone()
            .filter(|k| !k.is_empty())
            .ok_or_else(|| {
                (
                    CONFIG_ERROR,
                    format!("operation '{}' needs a type", request.operation),
                )
            })
    };
    let keys = || {
        request
            .keys
            .iter()
            .map(|k| (k.kind.clone(), k.key.clone()))
            .collect::<Vec<_>>()
    };
    let value = |(kind, key, value): (String, String, String)| ConfigValue {
        kind,
        key,
        value,
        workspace: request.workspace.clone(),
    };
    let response = match request.operation.as_str() {
        operation::GET => {
            let wanted = keys();
            let found = store.get(&wanted).map_err(failed)?;
            if let Some((kind, key)) = wanted
                .iter()
                .find(|(kind, key)| !found.iter().any(|(k, n, _)| k == kind && n == key))
            {
                return Err((CONFIG_ERROR, format!("key not found: {kind}/{key}")));
            }
            ConfigResponse {
                version: Some(version()?),
                values: Some(found.into_iter().map(value).collect()),
                ..ConfigResponse::default()
            }
        }
        operation::LIST => ConfigResponse {
            version: Some(version()?),
            directory: Some(store.list(&kind()?).map_err(failed)?),
            ..ConfigResponse::default()
        },
        operation::GET_VALUES => {
            let kind = kind()?;
            let values = store.values_of(&kind).map_err(failed)?;
            ConfigResponse {
                version: Some(version()?),
                values: Some(
                    values
                        .into_iter()
                        .map(|(key, v)| value((kind.clone(), key, v)))
                        .collect(),
                ),
                ..ConfigResponse::default()
            }
        }
        operation::CONFIG => {
            let (version, config) = store.dump().map_err(failed)?;
            ConfigResponse {
                version: Some(version),
                config: Some(config),
                ..ConfigResponse::default()
            }
        }
        operation::PUT => {
            let entries: Vec<_> = request
                .values
                .iter()
                .map(|v| (v.kind.clone(), v.key.clone(), v.value.clone()))
                .collect();
            return written(store.put(&entries));
        }
        operation::DELETE => return written(store.delete(&keys())),
        other => return Err((BAD_OPERATION, format!("Bad operation '{other}'"))),
    };
    Ok((response, None))
}

fn written(
    result: Result<Written, StoreError>,
) -> Result<(ConfigResponse, Option<Written>), Failure> {
    let written = result.map_err(|e| (CONFIG_ERROR, e.to_string()))?;
    Ok((
        ConfigResponse {
            version: Some(written.version),
            ..ConfigResponse::default()
        },
        (!written.changes.is_empty()).then_some(written),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use agent_schema::ConfigKey;

    fn store() -> (ConfigStore, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("config-proto-{:016x}", rand::random::<u64>()));
        (ConfigStore::open(&dir).unwrap(), dir)
    }

    fn request(op: &str) -> ConfigRequest {
        ConfigRequest {
            operation: op.into(),
            ..ConfigRequest::default()
        }
    }

    #[test]
    fn every_operation() {
        let (store, dir) = store();
        let mut put = request(operation::PUT);
        put.values = vec![ConfigValue {
            kind: "tool".into(),
            key: "llm".into(),
            value: r#"{"name":"llm"}"#.into(),
            workspace: None,
        }];
        let (r, push) = handle(&store, &put);
        assert_eq!(r.error, None);
        assert_eq!(r.version, Some(1));
        assert_eq!(push.unwrap().changes["tool"], vec!["llm"]);

        let mut list = request(operation::LIST);
        list.kind = Some("tool".into());
        assert_eq!(handle(&store, &list).0.directory, Some(vec!["llm".into()]));

        let mut get = request(operation::GET);
        get.keys = vec![ConfigKey {
            kind: "tool".into(),
            key: "llm".into(),
        }];
        let (r, push) = handle(&store, &get);
        assert!(push.is_none());
        assert_eq!(r.values.unwrap()[0].value, r#"{"name":"llm"}"#);

        let mut values = request(operation::GET_VALUES);
        values.kind = Some("tool".into());
        assert_eq!(handle(&store, &values).0.values.unwrap().len(), 1);

        let all = handle(&store, &request(operation::CONFIG)).0;
        assert_eq!(all.version, Some(1));
        assert!(all.config.unwrap()["tool"].contains_key("llm"));

        let mut delete = request(operation::DELETE);
        delete.keys = get.keys.clone();
        let (r, push) = handle(&store, &delete);
        assert_eq!(r.version, Some(2));
        assert!(push.is_some());
        let (r, _) = handle(&store, &get);
        assert_eq!(r.error.unwrap().message, "key not found: tool/llm");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn bad_requests_get_errors_not_panics() {
        let (store, dir) = store();
        for op in ["", "drop", operation::LIST, operation::GET_VALUES] {
            let (r, push) = handle(&store, &request(op));
            assert!(r.error.is_some(), "{op}");
            assert!(push.is_none());
        }
        let mut put = request(operation::PUT);
        put.values = vec![ConfigValue {
            kind: "tool".into(),
            key: "x".into(),
            value: "not json".into(),
            workspace: None,
        }];
        assert!(handle(&store, &put).0.error.is_some());
        assert_eq!(store.version().unwrap(), 0);
        let _ = std::fs::remove_dir_all(dir);
    }
}
