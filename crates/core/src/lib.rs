//! Agent logic with no I/O: the meta-router's choices, the ReACT protocol parser, plan DAGs, tool
//! scoping, prompts, config and provenance builders. The orchestrator drives these; unit tests
//! drive them directly.

pub mod config;
pub mod critic;
pub mod deep_research;
pub mod documents;
pub mod ensemble;
pub mod fork;
pub mod logged;
pub mod pattern;
pub mod plan;
pub mod plan_then_execute;
pub mod prompt;
pub mod provenance;
pub mod react;
pub mod redact;
pub mod replay;
pub mod router;
pub mod supervisor;
pub mod tools;
pub mod vocab;
