//! The agent orchestrator: consumes `AgentRequest`s on a Shared subscription, runs one step per
//! message (routing a new dialog, or one iteration of its pattern), and publishes responses,
//! provenance and the `next` request before acking. No dialog state lives in the process, so any
//! replica can take any step.

pub mod approval;
pub mod budget;
pub mod cancel;
pub mod chains;
pub mod control_seals;
pub mod conversation;
pub mod documents;
pub mod emit;
mod engine;
pub mod events;
pub mod finish;
pub mod journal;
pub mod live_config;
pub mod metrics;
pub mod ops;
pub mod patterns;
pub mod replay;
pub mod review;
pub mod router;
mod service;
pub mod settings;
mod step;
pub mod stream;
pub mod tools;
pub mod turn;
mod validate;

pub use crate::engine::{Engine, StepError};
pub use crate::service::run;
pub use crate::settings::{check_config_dir, load_config_dir, Settings};
pub use crate::step::session_id_for;

/// The stack each worker thread of a runtime that runs steps gets. A step is a deep future (a
/// pattern's state, the librarian's calls, the commit), and a debug build overflowed a worker's
/// default 2 MiB more than once as layers were added (the step is boxed where it is entered for
/// that reason). Only the pages a thread touches are ever backed, so room costs nothing unused.
pub const WORKER_STACK_BYTES: usize = 8 << 20;

/// The runtime a process that runs steps should use: tokio's multi-threaded one with
/// [`WORKER_STACK_BYTES`] for each worker.
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_stack_size(WORKER_STACK_BYTES)
        .build()
}
