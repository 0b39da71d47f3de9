//! The patterns a dialog can work with. Each module holds only its own decisions (what to ask the
//! LLM, what to do with the answer); how a step reads its input ([`crate::turn`]), streams
//! ([`crate::stream`]), emits effects ([`crate::emit`]) and ends ([`crate::finish`]) is shared.

pub mod deep_research;
pub mod ensemble;
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
    // Each boxed: a step's future would otherwise be as large as the largest pattern's, on a
    // worker's stack (a debug build overflowed it once patterns went beyond five).
    match Pattern::from_name(&turn.request.pattern) {
        Some(Pattern::PlanThenExecute) => Box::pin(plan::iterate(turn)).await,
        Some(Pattern::LlmRouter) => Box::pin(llm_router::iterate(turn)).await,
        Some(Pattern::Reflexion) => Box::pin(reflexion::iterate(turn)).await,
        Some(Pattern::DeepResearch) => Box::pin(deep_research::iterate(turn)).await,
        // Past the depth limit a supervisor or an ensemble works alone (see `router::requested`).
        Some(pattern)
            if pattern.fans_out()
                && !agent_core::supervisor::may_fan_out(
                    turn.request,
                    turn.config.limits.max_fanout_depth,
                ) =>
        {
            Box::pin(react::iterate(turn)).await
        }
        Some(Pattern::Supervisor) => Box::pin(supervisor::iterate(turn)).await,
        Some(Pattern::Ensemble) => Box::pin(ensemble::iterate(turn)).await,
        _ => Box::pin(react::iterate(turn)).await,
    }
}
