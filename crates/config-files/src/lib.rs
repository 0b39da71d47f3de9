//! Config directories on disk: `<type>.json` files, each an object of key -> JSON value
//! (`config-seed/` is one). Read by `config-svc --seed`, `agentctl config seed|validate` and the
//! orchestrator when it runs without a config service.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use agent_core::config::ConfigValues;

/// One problem with a file, located by path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct FileError {
    pub path: String,
    pub message: String,
}

/// Reads every `*.json` in `dir`; every unreadable or malformed file is reported, all at once.
pub fn read_dir(dir: &Path) -> Result<ConfigValues, Vec<FileError>> {
    let (values, errors) = read_dir_all(dir);
    if errors.is_empty() {
        Ok(values)
    } else {
        Err(errors)
    }
}

/// What could be read, and every file that could not (so a validator can check the rest too).
pub fn read_dir_all(dir: &Path) -> (ConfigValues, Vec<FileError>) {
    let mut values = ConfigValues::new();
    let mut entries: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect(),
        Err(e) => {
            let error = FileError {
                path: dir.display().to_string(),
                message: e.to_string(),
            };
            return (values, vec![error]);
        }
    };
    entries.sort();
    let mut errors = Vec::new();
    for path in entries {
        let kind = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let parsed = std::fs::read_to_string(&path)
            .map_err(|e| e.to_string())
            .and_then(|text| {
                serde_json::from_str::<BTreeMap<String, serde_json::Value>>(&text)
                    .map_err(|e| format!("not an object of key -> JSON value: {e}"))
            });
        match parsed {
            Ok(map) => {
                values.insert(kind, map);
            }
            Err(message) => errors.push(FileError {
                path: path.display().to_string(),
                message,
            }),
        }
    }
    (values, errors)
}

/// The values as store entries `(type, key, JSON text)`.
pub fn entries(values: &ConfigValues) -> Vec<(String, String, String)> {
    values
        .iter()
        .flat_map(|(kind, map)| {
            map.iter()
                .map(move |(key, value)| (kind.clone(), key.clone(), value.to_string()))
        })
        .collect()
}
