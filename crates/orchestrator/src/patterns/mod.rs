//! The patterns a dialog can work with. Each module holds only its own decisions (what to ask the
//! LLM, what to do with the answer); how a step reads its input ([`crate::turn`]), streams
//! ([`crate::stream`]), emits effects ([`crate::emit`]) and ends ([`crate::finish`]) is shared.

pub mod llm_router;
pub mod plan;
pub mod react;
pub mod reflexion;
pub mod supervisor;
#[cfg(test)]
mod tests;

use agent_bus::BusError;
use agent_core::pattern::Pattern;

use crate::turn::Turn;

/// Runs one iteration of the pattern the request names (ReACT when it names none it knows; it was
/// checked on the way in).
pub async fn iterate(turn: &Turn<'_>) -> Result<(), BusError> {
    match Pattern::from_name(&turn.request.pattern) {
        Some(Pattern::PlanThenExecute) => plan::iterate(turn).await,
        Some(Pattern::LlmRouter) => llm_router::iterate(turn).await,
        Some(Pattern::Reflexion) => reflexion::iterate(turn).await,
        // Past the depth limit a supervisor works alone (see `router::requested`).
        Some(Pattern::Supervisor)
            if agent_core::supervisor::may_fan_out(
                turn.request,
                turn.config.limits.max_fanout_depth,
            ) =>
        {
            supervisor::iterate(turn).await
        }
        _ => react::iterate(turn).await,
    }
}
