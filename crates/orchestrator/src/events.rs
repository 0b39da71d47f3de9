//! What the orchestrator tells about itself, as typed events: each one is logged and counted by
//! one call, so a log line and its metric cannot drift apart (the idea of vector's
//! `internal_events`). Metric names and help texts are in [`crate::metrics`].

use std::time::Duration;

use agent_metrics::global;

use crate::metrics::{
    APPROVAL_ANSWERS, CONTINUED, DIALOGS_FINISHED, DIALOGS_STARTED, GIVEN_UP, ITERATIONS,
    ITERATION_LATENCY, PARKED, RELEASED, TOOL_CALLS, TOOL_LATENCY, UNSEALED_CONTROL,
    WAITED_FOR_CHAIN,
};

/// A control message without this service's seal, acted on (`--control-seals warn`) or not.
pub struct UnsealedControl<'a> {
    pub operation: &'a str,
    pub session: &'a str,
    pub acted_on: bool,
}

impl UnsealedControl<'_> {
    /// Counted each time; logged the first time and then at each power of two, so a flood of
    /// forgeries cannot flood the log (the counter says how many, and when they stop).
    pub fn emit(&self) {
        static SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        global().inc(
            UNSEALED_CONTROL,
            &[("acted_on", if self.acted_on { "true" } else { "false" })],
        );
        let seen = SEEN.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if seen.is_power_of_two() {
            let operation = agent_core::documents::prefix(self.operation, 64).escape_debug();
            let session = agent_core::logged::client_text(self.session);
            tracing::warn!(%operation, %session, seen, acted_on = self.acted_on, "a control message without this service's seal (sent without AGENT_SEAL_KEY or with another key, or forged); acted on only under --control-seals warn; logged again at {} of them", seen.saturating_mul(2));
        }
    }
}

/// An outage set a step aside; it runs again after `retry_in`.
pub struct StepParked<'a> {
    pub cause: &'a str,
    /// How long the outage has lasted for this step.
    pub outage: Duration,
    pub retry_in: Duration,
}

impl StepParked<'_> {
    pub fn emit(&self) {
        global().inc(PARKED, &[]);
        tracing::warn!(
            cause = %self.cause,
            outage_secs = self.outage.as_secs(),
            retry_in_ms = self.retry_in.as_millis() as u64,
            "an outage parks this step"
        );
    }
}

/// A dialog's next step runs in this process, after the step recorded as `entry`.
pub struct StepContinued<'a> {
    pub entry: &'a str,
}

impl StepContinued<'_> {
    pub fn emit(&self) {
        global().inc(CONTINUED, &[]);
        tracing::debug!(after = %self.entry, "the dialog's next step runs here");
    }
}

/// A message of a step recorded by a chain that still runs (see `chains`): it waits for the
/// chain to publish the step.
pub struct CopyWaitsForChain<'a> {
    pub entry: &'a str,
}

impl CopyWaitsForChain<'_> {
    pub fn emit(&self) {
        global().inc(WAITED_FOR_CHAIN, &[]);
        tracing::info!(entry = %self.entry, "the chain that recorded this step still runs; waiting for it");
    }
}

/// A step that cannot run: its dialog ends with `why`.
pub struct StepGivenUp<'a> {
    pub why: &'a str,
}

impl StepGivenUp<'_> {
    pub fn emit(&self) {
        global().inc(GIVEN_UP, &[]);
        tracing::error!(why = %self.why, "giving up on a step; its dialog ends with an error");
    }
}

/// A step handed back to the broker: its journal entry is another build's (`why` says which).
pub struct StepReleased<'a> {
    pub why: &'a str,
}

impl StepReleased<'_> {
    pub fn emit(&self) {
        global().inc(RELEASED, &[]);
        tracing::warn!(why = %self.why, "this step's journal entry is another build's; nacked for a replica that can read it");
    }
}

/// An answer to a call parked for approval was taken up; its step resumes (unless an earlier
/// answer won).
pub struct ApprovalAnswered<'a> {
    pub session: &'a str,
    pub step: u64,
    pub operation: &'a str,
}

impl ApprovalAnswered<'_> {
    pub fn emit(&self) {
        // The operation was checked to be one of three: a bounded label.
        global().inc(APPROVAL_ANSWERS, &[("operation", self.operation)]);
        tracing::info!(session = %self.session, step = self.step, operation = %self.operation, "an approval was answered");
    }
}

/// A step committed: everything it caused is on the broker.
pub struct StepCommitted<'a> {
    /// A bounded label: a configured or built-in pattern, `router`, `refused`, `given-up`.
    pub pattern: &'a str,
    /// The dialog's first pattern iteration.
    pub first_iteration: bool,
    /// How the dialog ended in this step (`answer` or `error`), if it did.
    pub ended: Option<&'a str>,
    pub took: Duration,
}

impl StepCommitted<'_> {
    pub fn emit(&self) {
        let registry = global();
        let pattern = [("pattern", self.pattern)];
        registry.inc(ITERATIONS, &pattern);
        registry.observe(ITERATION_LATENCY, &pattern, self.took);
        if self.first_iteration {
            registry.inc(DIALOGS_STARTED, &pattern);
        }
        if let Some(outcome) = self.ended {
            registry.inc(
                DIALOGS_FINISHED,
                &[("pattern", self.pattern), ("outcome", outcome)],
            );
        }
        tracing::debug!(
            pattern = self.pattern,
            ended = self.ended.unwrap_or(""),
            took_us = self.took.as_micros() as u64,
            "step committed"
        );
    }
}

/// A tool ran (or was refused).
pub struct ToolCalled<'a> {
    /// A configured tool's name, or `unknown`: never what the LLM wrote.
    pub tool: &'a str,
    /// `ok`, `error`, `timeout` or `refused`.
    pub outcome: &'a str,
    pub took: Duration,
}

impl ToolCalled<'_> {
    pub fn emit(&self) {
        let registry = global();
        registry.inc(
            TOOL_CALLS,
            &[("tool", self.tool), ("outcome", self.outcome)],
        );
        registry.observe(TOOL_LATENCY, &[("tool", self.tool)], self.took);
        tracing::debug!(
            tool = self.tool,
            outcome = self.outcome,
            took_ms = self.took.as_millis() as u64,
            "tool called"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of the series of `name` whose labels include every one of `labels`.
    fn count(name: &str, labels: &[&str]) -> f64 {
        let text = global().render();
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")) && labels.iter().all(|x| l.contains(x)))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }

    #[test]
    fn an_event_counts_what_it_logs() {
        crate::metrics::describe();
        let before = count(
            TOOL_CALLS,
            &[r#"outcome="refused""#, r#"tool="events-test""#],
        );
        ToolCalled {
            tool: "events-test",
            outcome: "refused",
            took: Duration::ZERO,
        }
        .emit();
        let after = count(
            TOOL_CALLS,
            &[r#"outcome="refused""#, r#"tool="events-test""#],
        );
        assert_eq!(after, before + 1.0);
    }
}
