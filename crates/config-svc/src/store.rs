//! The config store: workspace -> type -> key -> JSON value plus one version (as TrustGraph 2.x
//! scopes config by workspace), kept in one file that is replaced atomically and fsynced before a write is acknowledged, so a SIGKILL after an acknowledged write
//! loses nothing and a SIGKILL during one leaves the previous state.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use agent_schema::{TEMPLATE_WORKSPACE, WORKSPACES_NAMESPACE, WORKSPACE_TYPE};
use serde::{Deserialize, Serialize};

/// type -> key -> value (JSON text, as TrustGraph keeps it).
pub type Values = BTreeMap<String, BTreeMap<String, String>>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("config store {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("config store {path} is corrupt: {message}")]
    Corrupt { path: String, message: String },
    #[error("{kind}/{key}: the value is not JSON: {message}")]
    NotJson {
        kind: String,
        key: String,
        message: String,
    },
    #[error("a config type and key must not be empty")]
    EmptyName,
    #[error("the config store lock was poisoned")]
    Poisoned,
    #[error(
        "config store {path} is in use by another process ({holder}); one config service a store"
    )]
    InUse { path: String, holder: String },
}

#[derive(Debug, Default, Clone, Serialize, Deserialize)]
struct Snapshot {
    version: u64,
    /// A store written before workspaces existed: read into [`LEGACY_WORKSPACE`] at open.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    values: Values,
    #[serde(default)]
    workspaces: BTreeMap<String, Values>,
    /// workspace -> every type it has held a key of, kept after the last key goes, so that a
    /// push meaning "everything" names a deletion too (see [`ConfigStore::every_type`]); what
    /// the workspaces no longer hold is forgotten at a write once every change before it was
    /// announced (see [`ConfigStore::announced_through`]).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    held: BTreeMap<String, std::collections::BTreeSet<String>>,
    /// Workspaces taken off the list whose removal may not have been announced: the start's push
    /// says them removed, as it says every listed one made (deleting a key already gone writes
    /// nothing, so a removal whose push was owed at a stop was never said again). Forgotten as
    /// `held` is.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    unlisted: BTreeSet<String>,
}

/// Where a store written before workspaces keeps its values.
const LEGACY_WORKSPACE: &str = "default";

impl Snapshot {
    /// The workspaces listed in [`WORKSPACES_NAMESPACE`].
    fn listed(&self) -> BTreeSet<String> {
        self.of(WORKSPACES_NAMESPACE)
            .and_then(|values| values.get(WORKSPACE_TYPE))
            .map(|listed| listed.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// Fills each workspace listed now and not in `before` with the template's keys it lacks,
    /// as TrustGraph's config service does (a value already there is the workspace's own).
    /// Returns, for each workspace it added keys to, every type that workspace now holds: what
    /// TrustGraph's config service then announces, so that a service taking the workspace up
    /// reads all it holds, the template's and its own.
    fn provision(&mut self, before: &BTreeSet<String>) -> BTreeMap<String, Vec<String>> {
        let mut provisioned = BTreeMap::new();
        // Reserved workspaces are storage only: the list itself, listed by mistake, would be
        // filled with the template's keys.
        let made: Vec<String> = self
            .listed()
            .difference(before)
            .filter(|workspace| !workspace.starts_with('_'))
            .cloned()
            .collect();
        if made.is_empty() {
            return provisioned;
        }
        let Some(template) = self.of(TEMPLATE_WORKSPACE).cloned() else {
            return provisioned;
        };
        for workspace in made {
            let values = self.workspaces.entry(workspace.clone()).or_default();
            let mut added = false;
            for (kind, entries) in &template {
                let into = values.entry(kind.clone()).or_default();
                for (key, value) in entries {
                    if !into.contains_key(key) {
                        into.insert(key.clone(), value.clone());
                        added = true;
                    }
                }
            }
            values.retain(|_, entries| !entries.is_empty());
            let held: Vec<String> = values.keys().cloned().collect();
            if values.is_empty() {
                self.workspaces.remove(&workspace);
            }
            if added {
                provisioned.insert(workspace, held);
            }
        }
        provisioned
    }

    /// See [`ConfigStore::every_type`].
    fn every_type(&self) -> BTreeMap<String, Vec<String>> {
        let mut types: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (workspace, kinds) in &self.held {
            if workspace.starts_with('_') {
                continue;
            }
            for kind in kinds {
                types
                    .entry(kind.clone())
                    .or_default()
                    .push(workspace.clone());
            }
        }
        types
    }

    fn of(&self, workspace: &str) -> Option<&Values> {
        self.workspaces.get(workspace)
    }
}

/// The result of a write: the new version and the types it touched (for the change push).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub version: u64,
    /// type -> keys changed, in order.
    pub changes: BTreeMap<String, Vec<String>>,
    /// workspace -> the types the template filled in it: workspaces this write listed (see
    /// [`TEMPLATE_WORKSPACE`]).
    pub provisioned: BTreeMap<String, Vec<String>>,
}

/// What a push meaning "everything" says (see [`ConfigStore::everything`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Everything {
    pub version: u64,
    /// type -> every workspace holding it or having held it.
    pub types: BTreeMap<String, Vec<String>>,
    pub listed: Vec<String>,
    pub unlisted: Vec<String>,
}

/// A `(type, key, value)`, or a `(workspace, key, value)` of one type.
pub type Entry = (String, String, String);

/// One owning process per file (held to it by a lock on `config.lock` beside it); every call is
/// short (the file is small), so a mutex is enough.
/// Writes take their turn on a mutex of their own and hold the state's only to copy it and to
/// put the new one in place: a reader (on an async worker) never waits out a write's fsync,
/// which on a slow disk held every worker that read and froze the service's other work.
pub struct ConfigStore {
    path: PathBuf,
    state: Mutex<Snapshot>,
    writing: Mutex<()>,
    /// Up to which version every change was announced by a push naming it, as this process's
    /// pusher said (nothing at its start).
    announced: std::sync::atomic::AtomicU64,
    /// A push went out cut down (over the broker's limit): what it left out was never said, and
    /// a later push naming its own changes does not say it either, so from then on nothing is
    /// taken as announced (until a restart, whose push says everything again).
    cut: std::sync::atomic::AtomicBool,
    /// Held while the store is open: the lock goes with the file's closing, a crash's too.
    _owner: std::fs::File,
}

/// The file beside the store that its owning process holds a lock on, and writes its pid into.
const OWNER_FILE: &str = "config.lock";

/// Takes the lock that makes this process the store's only owner. Two processes on one store
/// each kept their own copy in memory and replaced the file with it: each lost the other's
/// writes, and both counted versions from the same number, so two different changes went out
/// under one version, which TrustGraph's clients take as one already seen.
fn own(dir: &Path) -> Result<std::fs::File, StoreError> {
    let path = dir.join(OWNER_FILE);
    let io = |source| StoreError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io)?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = std::io::Read::read_to_string(&mut file, &mut holder);
            let holder = match holder.trim() {
                "" => "its pid not written yet".to_owned(),
                pid => format!("pid {}", pid.chars().take(20).collect::<String>()),
            };
            return Err(StoreError::InUse {
                path: dir.display().to_string(),
                holder,
            });
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(io(e)),
    }
    // Only said, never relied on: the lock is what keeps a second process out.
    file.set_len(0).map_err(io)?;
    file.write_all(std::process::id().to_string().as_bytes())
        .map_err(io)?;
    Ok(file)
}

impl ConfigStore {
    /// Opens (or creates) the store kept in `dir/config.json`, or says that another process
    /// has it open ([`StoreError::InUse`]).
    pub fn open(dir: &Path) -> Result<ConfigStore, StoreError> {
        let io = |source| StoreError::Io {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        let owner = own(dir)?;
        let path = dir.join("config.json");
        let state = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
                path: path.display().to_string(),
                message: e.to_string(),
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Snapshot::default(),
            Err(e) => return Err(io(e)),
        };
        let mut state: Snapshot = state;
        let legacy = std::mem::take(&mut state.values);
        if !legacy.is_empty() {
            let default = state
                .workspaces
                .entry(LEGACY_WORKSPACE.to_owned())
                .or_default();
            for (kind, entries) in legacy {
                let into = default.entry(kind).or_default();
                for (key, value) in entries {
                    into.entry(key).or_insert(value);
                }
            }
        }
        // A store written before `held` was kept: what it holds now is what is known.
        for (workspace, values) in &state.workspaces {
            let held = state.held.entry(workspace.clone()).or_default();
            held.extend(values.keys().cloned());
        }
        Ok(ConfigStore {
            path,
            state: Mutex::new(state),
            writing: Mutex::new(()),
            announced: std::sync::atomic::AtomicU64::new(0),
            cut: std::sync::atomic::AtomicBool::new(false),
            _owner: owner,
        })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Snapshot>, StoreError> {
        self.state.lock().map_err(|_| StoreError::Poisoned)
    }

    pub fn version(&self) -> Result<u64, StoreError> {
        Ok(self.lock()?.version)
    }

    // The reads below give the store's version read under the same lock as their values: read
    // apart, a write between them paired old values with the new version, and a client that
    // skips pushes of a version it has seen (TrustGraph's do) never applied that write.

    /// The value of each `(type, key)` of `workspace` that exists, in the order asked (once
    /// however often asked), with the store's version. Each key asked again was copied again: one
    /// anonymous request naming a 20 KB value 130,000 times made the service copy 2.6 GB, under
    /// the lock every other read waits on. Once each, an answer is at most the store.
    pub fn get(
        &self,
        workspace: &str,
        keys: &[(String, String)],
    ) -> Result<(u64, Vec<Entry>), StoreError> {
        let mut asked = std::collections::HashSet::new();
        let keys: Vec<&(String, String)> = keys.iter().filter(|k| asked.insert(*k)).collect();
        let state = self.lock()?;
        let found = keys
            .into_iter()
            .filter_map(|(kind, key)| {
                let value = state.of(workspace)?.get(kind)?.get(key)?;
                Some((kind.clone(), key.clone(), value.clone()))
            })
            .collect();
        Ok((state.version, found))
    }

    /// Every key and value of one type in `workspace`, with the store's version.
    pub fn values_of(
        &self,
        workspace: &str,
        kind: &str,
    ) -> Result<(u64, BTreeMap<String, String>), StoreError> {
        let state = self.lock()?;
        let values = state
            .of(workspace)
            .and_then(|values| values.get(kind))
            .cloned()
            .unwrap_or_default();
        Ok((state.version, values))
    }

    /// `(workspace, key, value)` of every entry of one type in every workspace, with the store's
    /// version.
    pub fn values_everywhere(&self, kind: &str) -> Result<(u64, Vec<Entry>), StoreError> {
        let state = self.lock()?;
        let everywhere = state
            .workspaces
            .iter()
            .flat_map(|(workspace, values)| {
                values.get(kind).into_iter().flat_map(move |entries| {
                    entries
                        .iter()
                        .map(move |(key, value)| (workspace.clone(), key.clone(), value.clone()))
                })
            })
            .collect();
        Ok((state.version, everywhere))
    }

    /// Every type the store holds or has held, with the workspaces it was in (reserved ones, `_`
    /// first, left out: they are never announced), and the store's version: what a push that
    /// means "everything" names. TrustGraph's services ignore a push that names nothing (none of
    /// their handlers' types is in it), so "everything" has to be spelled out to reach them; a
    /// type whose last key was deleted is named too, so that they drop what they hold of it.
    pub fn every_type(&self) -> Result<(u64, BTreeMap<String, Vec<String>>), StoreError> {
        let state = self.lock()?;
        Ok((state.version, state.every_type()))
    }

    /// What a push meaning "everything" says, read at once: the version, every type (see
    /// [`ConfigStore::every_type`]), the workspaces listed, and those taken off the list whose
    /// removal may not have been announced yet.
    pub fn everything(&self) -> Result<Everything, StoreError> {
        let state = self.lock()?;
        let listed = state.listed();
        Ok(Everything {
            version: state.version,
            types: state.every_type(),
            unlisted: state
                .unlisted
                .iter()
                .filter(|workspace| !listed.contains(*workspace))
                .cloned()
                .collect(),
            listed: listed.into_iter().collect(),
        })
    }

    /// Every change up to `version` was announced by a push naming it: at the next write, what
    /// "everything" names shrinks to what the workspaces hold (and that write's types). Kept
    /// for ever, the deleted types of workspaces made and emptied again were named in every
    /// start's push, however many came and went, until it was too large to send.
    pub fn announced_through(&self, version: u64) {
        if self.cut.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        self.announced
            .fetch_max(version, std::sync::atomic::Ordering::Relaxed);
    }

    /// A push went out without some of what it was to say (see [`ConfigStore::announced_through`]).
    pub fn announced_in_part(&self) {
        self.cut.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Everything in `workspace`, with the store's version.
    pub fn dump(&self, workspace: &str) -> Result<(u64, Values), StoreError> {
        let state = self.lock()?;
        Ok((
            state.version,
            state.of(workspace).cloned().unwrap_or_default(),
        ))
    }

    /// Sets every `(type, key, value)` of `workspace` at once (values must be JSON); one version
    /// bump.
    pub fn put(
        &self,
        workspace: &str,
        entries: &[(String, String, String)],
    ) -> Result<Written, StoreError> {
        if workspace.is_empty() {
            return Err(StoreError::EmptyName);
        }
        for (kind, key, value) in entries {
            if kind.is_empty() || key.is_empty() {
                return Err(StoreError::EmptyName);
            }
            if let Err(e) = serde_json::from_str::<serde_json::Value>(value) {
                return Err(StoreError::NotJson {
                    kind: kind.clone(),
                    key: key.clone(),
                    message: e.to_string(),
                });
            }
        }
        self.write(workspace, |values, changes| {
            for (kind, key, value) in entries {
                values
                    .entry(kind.clone())
                    .or_default()
                    .insert(key.clone(), value.clone());
                changes.entry(kind.clone()).or_default().push(key.clone());
            }
        })
    }

    /// Sets only the keys that do not exist yet (seeding never overwrites a user's change).
    pub fn put_missing(
        &self,
        workspace: &str,
        entries: &[(String, String, String)],
    ) -> Result<Written, StoreError> {
        let missing: Vec<_> = {
            let state = self.lock()?;
            entries
                .iter()
                .filter(|(kind, key, _)| {
                    !state
                        .of(workspace)
                        .and_then(|values| values.get(kind))
                        .is_some_and(|m| m.contains_key(key))
                })
                .cloned()
                .collect()
        };
        if missing.is_empty() {
            return Ok(Written {
                version: self.version()?,
                changes: BTreeMap::new(),
                provisioned: BTreeMap::new(),
            });
        }
        self.put(workspace, &missing)
    }

    /// Removes every `(type, key)`; deleting a missing key is not an error. One version bump when
    /// anything was removed.
    pub fn delete(
        &self,
        workspace: &str,
        keys: &[(String, String)],
    ) -> Result<Written, StoreError> {
        self.write(workspace, |values, changes| {
            for (kind, key) in keys {
                if let Some(map) = values.get_mut(kind) {
                    if map.remove(key).is_some() {
                        changes.entry(kind.clone()).or_default().push(key.clone());
                    }
                    if map.is_empty() {
                        values.remove(kind);
                    }
                }
            }
        })
    }

    /// Applies `change` to a copy, persists it, and only then makes it the state: a failed write
    /// leaves memory and disk as they were.
    fn write(
        &self,
        workspace: &str,
        change: impl FnOnce(&mut Values, &mut BTreeMap<String, Vec<String>>),
    ) -> Result<Written, StoreError> {
        let _turn = self.writing.lock().map_err(|_| StoreError::Poisoned)?;
        // Only writes change the state, and they wait for this turn: the copy stays current.
        let mut next = self.lock()?.clone();
        let listing = workspace == WORKSPACES_NAMESPACE;
        let listed_before = match listing {
            true => next.listed(),
            false => BTreeSet::new(),
        };
        let mut changes = BTreeMap::new();
        let values = next.workspaces.entry(workspace.to_owned()).or_default();
        change(values, &mut changes);
        if values.is_empty() {
            next.workspaces.remove(workspace);
        }
        if changes.is_empty() {
            return Ok(Written {
                version: next.version,
                changes,
                provisioned: BTreeMap::new(),
            });
        }
        // In the same write as the listing: a crash between the two left a workspace listed and
        // never filled (TrustGraph's config service fills it on hearing its own push).
        let provisioned = match listing {
            true => next.provision(&listed_before),
            false => BTreeMap::new(),
        };
        // Every change before this one announced, deletions too: a crash from here owes at most
        // this write's push, so "everything" need only name what is held now, and its types.
        if self.announced.load(std::sync::atomic::Ordering::Relaxed) >= next.version {
            next.held = next
                .workspaces
                .iter()
                .map(|(workspace, values)| (workspace.clone(), values.keys().cloned().collect()))
                .collect();
            next.unlisted.clear();
        }
        if listing {
            let listed = next.listed();
            next.unlisted
                .extend(listed_before.difference(&listed).cloned());
            next.unlisted
                .retain(|workspace| !listed.contains(workspace));
        }
        let held = next.held.entry(workspace.to_owned()).or_default();
        held.extend(changes.keys().cloned());
        for (made, kinds) in &provisioned {
            let held = next.held.entry(made.clone()).or_default();
            held.extend(kinds.iter().cloned());
        }
        next.version += 1;
        self.persist(&next)?;
        let version = next.version;
        *self.lock()? = next;
        Ok(Written {
            version,
            changes,
            provisioned,
        })
    }

    fn persist(&self, snapshot: &Snapshot) -> Result<(), StoreError> {
        let io = |source| StoreError::Io {
            path: self.path.display().to_string(),
            source,
        };
        let bytes = serde_json::to_vec_pretty(snapshot).map_err(|e| StoreError::Corrupt {
            path: self.path.display().to_string(),
            message: e.to_string(),
        })?;
        let temporary = self.path.with_extension("json.tmp");
        // It holds credentials (an MCP server's `auth-token` and `env`): readable by this user
        // alone, or as the file it replaces was set (before, each write made it 0644 by the
        // umask, whatever an operator had set).
        let _ = std::fs::remove_file(&temporary);
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        let mut file = options.open(&temporary).map_err(io)?;
        if let Ok(existing) = std::fs::metadata(&self.path) {
            file.set_permissions(existing.permissions()).map_err(io)?;
        }
        file.write_all(&bytes).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        std::fs::rename(&temporary, &self.path).map_err(io)?;
        // The rename itself must reach the disk before the write is acknowledged.
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys of one type in `workspace` (the protocol's `list` reads them with the version).
    fn keys(store: &ConfigStore, workspace: &str, kind: &str) -> Vec<String> {
        store
            .values_of(workspace, kind)
            .unwrap()
            .1
            .into_keys()
            .collect()
    }

    const WS: &str = "default";

    fn temp_dir() -> PathBuf {
        std::env::temp_dir().join(format!("config-store-{:016x}", rand::random::<u64>()))
    }

    fn entry(kind: &str, key: &str, value: &str) -> (String, String, String) {
        (kind.into(), key.into(), value.into())
    }

    /// A workspace listed for the first time gets the template's keys it lacks, in the listing's
    /// own write, and every type it then holds is named; its own values stay, and one listed
    /// again is not filled again (a key its owner removed stays removed).
    #[test]
    fn a_workspace_listed_is_filled_from_the_template_once() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        store
            .put(
                TEMPLATE_WORKSPACE,
                &[
                    entry("prompt", "greeting", "\"hi\""),
                    entry("prompt", "farewell", "\"bye\""),
                    entry("flow-blueprint", "basic", "{}"),
                ],
            )
            .unwrap();
        store
            .put(
                "acme",
                &[
                    entry("prompt", "greeting", "\"mine\""),
                    entry("tool", "search", "{}"),
                ],
            )
            .unwrap();
        let list = |name: &str| [entry(WORKSPACE_TYPE, name, "{}")];
        let before = store.version().unwrap();
        let written = store.put(WORKSPACES_NAMESPACE, &list("acme")).unwrap();
        assert_eq!(written.version, before + 1, "one write");
        assert_eq!(
            written.provisioned,
            BTreeMap::from([(
                "acme".to_owned(),
                vec![
                    "flow-blueprint".to_owned(),
                    "prompt".to_owned(),
                    "tool".to_owned()
                ]
            )])
        );
        let (_, acme) = store.dump("acme").unwrap();
        assert_eq!(acme["prompt"]["greeting"], "\"mine\"");
        assert_eq!(acme["prompt"]["farewell"], "\"bye\"");
        assert_eq!(acme["flow-blueprint"]["basic"], "{}");
        store
            .delete("acme", &[("prompt".into(), "farewell".into())])
            .unwrap();
        let again = store.put(WORKSPACES_NAMESPACE, &list("acme")).unwrap();
        assert!(again.provisioned.is_empty(), "{again:?}");
        assert_eq!(keys(&store, "acme", "prompt"), ["greeting"]);
        // Reserved workspaces are storage only: the list itself is never filled.
        let reserved = store
            .put(WORKSPACES_NAMESPACE, &list(WORKSPACES_NAMESPACE))
            .unwrap();
        assert!(reserved.provisioned.is_empty(), "{reserved:?}");
        assert_eq!(
            keys(&store, WORKSPACES_NAMESPACE, "prompt"),
            Vec::<String>::new()
        );
        // A workspace listed when there is no template: nothing to fill.
        store
            .delete(
                TEMPLATE_WORKSPACE,
                &[("flow-blueprint".into(), "basic".into())],
            )
            .unwrap();
        store
            .delete(
                TEMPLATE_WORKSPACE,
                &[
                    ("prompt".into(), "greeting".into()),
                    ("prompt".into(), "farewell".into()),
                ],
            )
            .unwrap();
        let bare = store.put(WORKSPACES_NAMESPACE, &list("beta")).unwrap();
        assert!(bare.provisioned.is_empty(), "{bare:?}");
        // Survives a reopen, as any write.
        drop(store);
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(keys(&store, "acme", "flow-blueprint"), ["basic"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A workspace taken off the list is kept as maybe unannounced, across a reopen, until a
    /// write after every change was announced (not the write that takes it off); listed again,
    /// it is not. After a push that went out cut down, nothing is taken as announced.
    #[test]
    fn a_workspace_taken_off_the_list_is_remembered_until_announced() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        let unlisted = |store: &ConfigStore| store.everything().unwrap().unlisted;
        let list = |name: &str| [entry(WORKSPACE_TYPE, name, "{}")];
        let unlist = |name: &str| [(WORKSPACE_TYPE.to_owned(), name.to_owned())];
        for name in ["acme", "beta"] {
            store.put(WORKSPACES_NAMESPACE, &list(name)).unwrap();
            store.delete(WORKSPACES_NAMESPACE, &unlist(name)).unwrap();
        }
        store.put(WORKSPACES_NAMESPACE, &list("beta")).unwrap();
        assert_eq!(unlisted(&store), ["acme"]);
        let all = store.everything().unwrap();
        assert_eq!(all.listed, ["beta"]);
        drop(store);
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(unlisted(&store), ["acme"]);
        // Everything announced, then beta taken off: beta's removal is not yet.
        store.announced_through(store.version().unwrap());
        store.delete(WORKSPACES_NAMESPACE, &unlist("beta")).unwrap();
        assert_eq!(unlisted(&store), ["beta"]);
        // A push cut down: announcing later versions forgets nothing.
        store.announced_in_part();
        store.announced_through(store.version().unwrap());
        store.put(WS, &[entry("memo", "a", "1")]).unwrap();
        assert_eq!(unlisted(&store), ["beta"]);
        drop(store);
        // A new process: its start's push said everything.
        let store = ConfigStore::open(&dir).unwrap();
        store.announced_through(store.version().unwrap());
        store.put(WS, &[entry("memo", "b", "1")]).unwrap();
        assert!(unlisted(&store).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_asked_many_times_is_answered_once() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        store
            .put(
                WS,
                &[entry(
                    "flow-class",
                    "big",
                    &format!("\"{}\"", "v".repeat(20_000)),
                )],
            )
            .unwrap();
        let big = ("flow-class".to_owned(), "big".to_owned());
        let missing = ("flow-class".to_owned(), "none".to_owned());
        let mut asked = vec![big.clone(); 100_000];
        asked.insert(1, missing);
        asked.push(("tool".to_owned(), "absent".to_owned()));
        let (_, found) = store.get(WS, &asked).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(
            (found[0].0.as_str(), found[0].1.as_str()),
            ("flow-class", "big")
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_store_open_in_one_place_is_not_opened_in_another_until_let_go() {
        let dir = temp_dir();
        let first = ConfigStore::open(&dir).unwrap();
        // The lock is the open file's, so a second open in this process meets it as another
        // process's would.
        match ConfigStore::open(&dir) {
            Err(StoreError::InUse { holder, .. }) => {
                assert_eq!(holder, format!("pid {}", std::process::id()))
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("a second owner of one store"),
        }
        drop(first);
        let again = ConfigStore::open(&dir).unwrap();
        assert_eq!(again.version().unwrap(), 0);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn writes_bump_the_version_and_survive_a_reopen() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(store.version().unwrap(), 0);
        let w = store
            .put(
                WS,
                &[
                    entry("tool", "a", r#"{"name":"a"}"#),
                    entry("tool", "b", "{}"),
                ],
            )
            .unwrap();
        assert_eq!(w.version, 1);
        assert_eq!(w.changes["tool"], vec!["a", "b"]);
        store.delete(WS, &[("tool".into(), "b".into())]).unwrap();
        drop(store);
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(store.version().unwrap(), 2);
        assert_eq!(keys(&store, WS, "tool"), vec!["a"]);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[cfg(unix)]
    #[test]
    fn the_file_is_readable_by_its_user_alone_or_as_an_operator_set_it() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        let file = dir.join("config.json");
        let mode = || std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        store
            .put(WS, &[entry("mcp", "a", r#"{"auth-token":"s"}"#)])
            .unwrap();
        assert_eq!(mode(), 0o600);
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        store.put(WS, &[entry("mcp", "a", "{}")]).unwrap();
        assert_eq!(mode(), 0o640, "a write keeps the mode an operator set");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn refuses_values_that_are_not_json_and_changes_nothing() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        let e = store
            .put(
                WS,
                &[entry("tool", "a", "{}"), entry("tool", "b", "{not json")],
            )
            .unwrap_err();
        assert!(e.to_string().contains("tool/b"));
        assert_eq!(store.version().unwrap(), 0);
        assert!(keys(&store, WS, "tool").is_empty());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn seeding_never_overwrites() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        store
            .put(WS, &[entry("prompt", "react", r#""mine""#)])
            .unwrap();
        let w = store
            .put_missing(
                WS,
                &[
                    entry("prompt", "react", r#""seed""#),
                    entry("prompt", "plan", r#""seed""#),
                ],
            )
            .unwrap();
        assert_eq!(w.changes["prompt"], vec!["plan"]);
        let (_, got) = store.get(WS, &[("prompt".into(), "react".into())]).unwrap();
        assert_eq!(got[0].2, r#""mine""#);
        // Nothing missing: no version bump.
        let again = store
            .put_missing(WS, &[entry("prompt", "plan", "1")])
            .unwrap();
        assert_eq!(again.version, w.version);
        assert!(again.changes.is_empty());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn every_type_names_each_workspace_that_holds_or_held_it_but_the_reserved() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        assert!(store.every_type().unwrap().1.is_empty());
        store.put(WS, &[entry("prompt", "react", "1")]).unwrap();
        store
            .put(
                "team",
                &[entry("prompt", "plan", "1"), entry("tool", "calc", "1")],
            )
            .unwrap();
        store
            .put("__template__", &[entry("flow", "f", "1")])
            .unwrap();
        store.put(WS, &[entry("gone", "k", "1")]).unwrap();
        let w = store.delete(WS, &[("gone".into(), "k".into())]).unwrap();
        let expected = BTreeMap::from([
            ("gone".to_owned(), vec![WS.to_owned()]),
            ("prompt".to_owned(), vec![WS.to_owned(), "team".to_owned()]),
            ("tool".to_owned(), vec!["team".to_owned()]),
        ]);
        assert_eq!(store.every_type().unwrap(), (w.version, expected.clone()));
        // A deleted type is still named after a restart.
        drop(store);
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(store.every_type().unwrap(), (w.version, expected));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Workspaces made and emptied again are named until every change up to their emptying was
    /// announced, then forgotten at the next write: not named in every start's push for ever.
    #[test]
    fn what_is_no_longer_held_is_forgotten_once_every_change_was_announced() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        store.put(WS, &[entry("prompt", "react", "1")]).unwrap();
        for tenant in ["t1", "t2", "t3"] {
            store.put(tenant, &[entry("tool", "calc", "1")]).unwrap();
            store
                .delete(tenant, &[("tool".into(), "calc".into())])
                .unwrap();
        }
        let named = |store: &ConfigStore| {
            let (_, types) = store.every_type().unwrap();
            types
        };
        let tenants = vec!["t1".to_owned(), "t2".to_owned(), "t3".to_owned()];
        assert_eq!(named(&store)["tool"], tenants);
        // Announced up to a version before the last deletion: still owed to someone, kept.
        let last = store.version().unwrap();
        store.announced_through(last - 1);
        store.put(WS, &[entry("prompt", "plan", "1")]).unwrap();
        assert_eq!(named(&store)["tool"], tenants);
        // Everything before the next write announced: only what is held, and its own types.
        store.announced_through(store.version().unwrap());
        store
            .delete(WS, &[("prompt".into(), "plan".into())])
            .unwrap();
        assert_eq!(
            named(&store),
            BTreeMap::from([("prompt".to_owned(), vec![WS.to_owned()])])
        );
        // The write's own deletion stays named until a later write after its announcement.
        let w = store
            .delete(WS, &[("prompt".into(), "react".into())])
            .unwrap();
        assert_eq!(
            named(&store),
            BTreeMap::from([("prompt".to_owned(), vec![WS.to_owned()])])
        );
        drop(store);
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(
            store.every_type().unwrap(),
            (
                w.version,
                BTreeMap::from([("prompt".to_owned(), vec![WS.to_owned()])])
            )
        );
        store.announced_through(w.version);
        store.put("t4", &[entry("tool", "calc", "1")]).unwrap();
        assert_eq!(
            named(&store),
            BTreeMap::from([("tool".to_owned(), vec!["t4".to_owned()])])
        );
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn deleting_nothing_is_not_a_write() {
        let dir = temp_dir();
        let store = ConfigStore::open(&dir).unwrap();
        let w = store.delete(WS, &[("tool".into(), "nope".into())]).unwrap();
        assert_eq!(w.version, 0);
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn workspaces_are_apart_and_a_store_from_before_them_is_the_default_workspace() {
        let dir = temp_dir();
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"version": 4, "values": {"tool": {"old": "{}"}}}"#,
        )
        .unwrap();
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(store.version().unwrap(), 4);
        assert_eq!(keys(&store, "default", "tool"), vec!["old"]);
        store.put("team", &[entry("tool", "theirs", "{}")]).unwrap();
        assert_eq!(keys(&store, "default", "tool"), vec!["old"]);
        assert_eq!(keys(&store, "team", "tool"), vec!["theirs"]);
        assert!(store.dump("nobody").unwrap().1.is_empty());
        let (_, everywhere) = store.values_everywhere("tool").unwrap();
        assert_eq!(
            everywhere,
            vec![
                ("default".into(), "old".into(), "{}".into()),
                ("team".into(), "theirs".into(), "{}".into())
            ]
        );
        // Deleting a workspace's last entry leaves no empty workspace behind; reopening keeps all.
        store
            .delete("team", &[("tool".into(), "theirs".into())])
            .unwrap();
        drop(store);
        let store = ConfigStore::open(&dir).unwrap();
        assert_eq!(store.values_everywhere("tool").unwrap().1.len(), 1);
        assert_eq!(store.version().unwrap(), 6);
        let _ = std::fs::remove_dir_all(dir);
    }
}
