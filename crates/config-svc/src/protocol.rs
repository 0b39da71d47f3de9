//! TrustGraph's config operations on the store: one request in, one response out, and the write
//! to announce when it changed something.

use agent_schema::{operation, ConfigRequest, ConfigResponse, ConfigValue, ErrorInfo};

use crate::store::{ConfigStore, StoreError, Written};

/// The error types TrustGraph clients see.
pub const CONFIG_ERROR: &str = "config-error";
pub const BAD_OPERATION: &str = "bad-operation";

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

/// The workspace a request works in. TrustGraph 2.x's service refuses a request without one; a
/// TrustGraph 1.x client never names one, and is answered from the default workspace.
pub fn workspace_of(request: &ConfigRequest) -> &str {
    named_or_default(request.workspace.as_deref())
}

/// A workspace as named, or the default one when none (or an empty one) is named.
pub fn named_or_default(workspace: Option<&str>) -> &str {
    workspace
        .filter(|w| !w.is_empty())
        .unwrap_or(crate::DEFAULT_WORKSPACE)
}

/// Whether `request` may write (and announce what it wrote).
pub fn writes(request: &ConfigRequest) -> bool {
    matches!(
        request.operation.as_str(),
        operation::PUT | operation::DELETE
    )
}

/// Answers `request`; a write that changed something also returns what it wrote.
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
        operation::GET_VALUES_ALL_WS,
        operation::GET_KEYS_ALL_WS,
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
    let workspace = workspace_of(request);
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
        workspace: Some(workspace.to_owned()),
    };
    let response = match request.operation.as_str() {
        // As TrustGraph's service: a key that is not there is simply not among the values (its
        // CLI reads keys that may not exist before it writes).
        operation::GET => {
            let (version, found) = store.get(workspace, &keys()).map_err(failed)?;
            ConfigResponse {
                version: Some(version),
                values: Some(found.into_iter().map(value).collect()),
                ..ConfigResponse::default()
            }
        }
        operation::LIST => {
            let (version, values) = store.values_of(workspace, &kind()?).map_err(failed)?;
            ConfigResponse {
                version: Some(version),
                directory: Some(values.into_keys().collect()),
                ..ConfigResponse::default()
            }
        }
        operation::GET_VALUES => {
            let kind = kind()?;
            let (version, values) = store.values_of(workspace, &kind).map_err(failed)?;
            ConfigResponse {
                version: Some(version),
                values: Some(
                    values
                        .into_iter()
                        .map(|(key, v)| value((kind.clone(), key, v)))
                        .collect(),
                ),
                ..ConfigResponse::default()
            }
        }
        operation::GET_VALUES_ALL_WS | operation::GET_KEYS_ALL_WS => {
            let kind = kind()?;
            let with_values = request.operation == operation::GET_VALUES_ALL_WS;
            let (version, values) = store.values_everywhere(&kind).map_err(failed)?;
            ConfigResponse {
                version: Some(version),
                values: Some(
                    values
                        .into_iter()
                        .map(|(workspace, key, value)| ConfigValue {
                            kind: kind.clone(),
                            key,
                            value: if with_values { value } else { String::new() },
                            workspace: Some(workspace),
                        })
                        .collect(),
                ),
                ..ConfigResponse::default()
            }
        }
        operation::CONFIG => {
            let (version, config) = store.dump(workspace).map_err(failed)?;
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
            return written(store.put(workspace, &entries));
        }
        operation::DELETE => return written(store.delete(workspace, &keys())),
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

    /// Each read's version is the version of the values it gives: a read while a write lands
    /// never pairs the old values with the new version (a client that skips pushes of versions it
    /// has seen would then never apply the write).
    #[test]
    fn a_read_during_writes_gives_the_version_of_its_values() {
        let (store, dir) = store();
        let store = std::sync::Arc::new(store);
        let writer = {
            let store = store.clone();
            std::thread::spawn(move || {
                for n in 1..=300u64 {
                    let entries = [("tool".to_owned(), "n".to_owned(), n.to_string())];
                    assert_eq!(
                        store
                            .put(crate::DEFAULT_WORKSPACE, &entries)
                            .unwrap()
                            .version,
                        n
                    );
                }
            })
        };
        let mut reads = 0;
        let mut values = request(operation::GET_VALUES);
        values.kind = Some("tool".into());
        let mut get = request(operation::GET);
        get.keys = vec![ConfigKey {
            kind: "tool".into(),
            key: "n".into(),
        }];
        while !writer.is_finished() {
            for asked in [&values, &get] {
                let (r, _) = handle(&store, asked);
                let value = r
                    .values
                    .unwrap_or_default()
                    .first()
                    .map_or(0, |v| v.value.parse::<u64>().unwrap());
                assert_eq!(r.version, Some(value), "read {reads}");
                reads += 1;
            }
        }
        writer.join().unwrap();
        assert!(reads > 0);
        std::fs::remove_dir_all(dir).ok();
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
        assert_eq!(r.error, None);
        assert_eq!(r.values, Some(vec![]));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn workspaces_as_trustgraph_2_scopes_them() {
        let (store, dir) = store();
        let put_in = |workspace: Option<&str>, key: &str| {
            let mut put = request(operation::PUT);
            put.workspace = workspace.map(Into::into);
            put.values = vec![ConfigValue {
                kind: "tool".into(),
                key: key.into(),
                value: "{}".into(),
                workspace: None,
            }];
            handle(&store, &put)
        };
        // A request naming no workspace (TrustGraph 1.x) works in the default one.
        assert_eq!(put_in(None, "a").0.error, None);
        assert_eq!(put_in(Some("team"), "b").0.error, None);
        let config_of = |workspace: &str| {
            let mut all = request(operation::CONFIG);
            all.workspace = Some(workspace.into());
            handle(&store, &all).0.config.unwrap()
        };
        assert!(config_of("default")["tool"].contains_key("a"));
        assert!(!config_of("default")["tool"].contains_key("b"));
        assert_eq!(config_of("team")["tool"].len(), 1);
        assert!(config_of("elsewhere").is_empty());

        let mut everywhere = request(operation::GET_VALUES_ALL_WS);
        everywhere.kind = Some("tool".into());
        let values = handle(&store, &everywhere).0.values.unwrap();
        let places: Vec<_> = values
            .iter()
            .map(|v| (v.workspace.clone().unwrap(), v.key.clone(), v.value.clone()))
            .collect();
        assert_eq!(
            places,
            vec![
                ("default".into(), "a".into(), "{}".into()),
                ("team".into(), "b".into(), "{}".into())
            ]
        );
        let mut keys = request(operation::GET_KEYS_ALL_WS);
        keys.kind = Some("tool".into());
        let values = handle(&store, &keys).0.values.unwrap();
        assert!(values.iter().all(|v| v.value.is_empty()));
        assert_eq!(values.len(), 2);
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
