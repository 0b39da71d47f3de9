//! The orchestrator's Prometheus metrics: dialogs, iterations, tool calls and the consumer's message
//! fates. Label values come from config or from a fixed set, never from a request, so a client
//! cannot grow the number of series. What counts them is [`crate::events`].

use agent_bus::ConsumerStats;
use agent_metrics::{global, Kind};

pub const DIALOGS_STARTED: &str = "agent_dialogs_started_total";
pub const DIALOGS_FINISHED: &str = "agent_dialogs_finished_total";
pub const ITERATIONS: &str = "agent_iterations_total";
pub const ITERATION_LATENCY: &str = "agent_iteration_duration_seconds";
pub const TOOL_CALLS: &str = "agent_tool_calls_total";
pub const TOOL_LATENCY: &str = "agent_tool_call_duration_seconds";
pub const MESSAGES: &str = "agent_request_messages_total";
pub const PARKED: &str = "agent_steps_parked_total";
pub const GIVEN_UP: &str = "agent_steps_given_up_total";
pub const RELEASED: &str = "agent_steps_released_total";
pub const APPROVAL_ANSWERS: &str = "agent_approval_answers_total";
pub const CONTINUED: &str = "agent_steps_continued_total";
pub const WAITED_FOR_CHAIN: &str = "agent_chain_copies_waited_total";
pub const UNSEALED_CONTROL: &str = "agent_control_messages_unsealed_total";

/// Declares every family this process reports, so `/metrics` lists them from the start.
pub fn describe() {
    let registry = global();
    registry.describe(
        DIALOGS_STARTED,
        Kind::Counter,
        "Dialogs whose first pattern iteration ran, by pattern.",
    );
    registry.describe(
        DIALOGS_FINISHED,
        Kind::Counter,
        "Dialogs that ended, by pattern and outcome (answer, error).",
    );
    registry.describe(ITERATIONS, Kind::Counter, "Steps run and committed, by pattern (router: the routing step; refused: an invalid request).");
    registry.describe(
        ITERATION_LATENCY,
        Kind::Histogram,
        "Time from taking a request message to committing its step, by pattern.",
    );
    registry.describe(
        TOOL_CALLS,
        Kind::Counter,
        "Tool calls by tool and outcome (ok, error, timeout, refused).",
    );
    registry.describe(TOOL_LATENCY, Kind::Histogram, "Tool call duration by tool.");
    registry.describe(
        MESSAGES,
        Kind::Counter,
        "Request messages by fate: received, acked, nacked (to be redelivered), dead-lettered, again (delivered again while in hand or just handled: not handled again).",
    );
    registry.describe(
        PARKED,
        Kind::Counter,
        "Times a step was set aside by an outage (LLM, store or broker) to be tried again.",
    );
    registry.describe(
        GIVEN_UP,
        Kind::Counter,
        "Steps that could not run (an outage past its window, or a fault), whose dialog ended with an error.",
    );
    registry.describe(
        RELEASED,
        Kind::Counter,
        "Steps handed back to the broker for another replica: their journal entry is in a form this build cannot read (recorded by another build, as in a rolling upgrade).",
    );
    registry.describe(
        APPROVAL_ANSWERS,
        Kind::Counter,
        "Answers to tool calls parked for approval taken up, by operation (approve, deny, expire); a repeated answer is counted and changes nothing.",
    );
    registry.describe(
        CONTINUED,
        Kind::Counter,
        "Steps run in the process that recorded the step before them, without their request going through the broker (--continue-in-process).",
    );
    registry.describe(
        WAITED_FOR_CHAIN,
        Kind::Counter,
        "Messages of a step recorded by a chain still running elsewhere (a root handed to another replica), which waited for it instead of running the rest of the dialog a second time.",
    );
    registry.describe(
        UNSEALED_CONTROL,
        Kind::Counter,
        "Deliveries of control messages (cancels, answers to approvals) without this service's seal, by whether they were acted on (true only under --control-seals warn); an answer handed back is counted again at each delivery.",
    );
    agent_llm::describe_metrics();
}

/// Copies the consumer's counters into the registry (at scrape time: they are kept by the bus).
pub fn consumer(stats: &ConsumerStats) {
    stats.report(MESSAGES);
}
