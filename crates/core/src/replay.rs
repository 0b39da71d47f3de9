//! Which recorded call a replayed call is given: the one the source made at the same place (the
//! same session of the run, the same step, the same repeat of the question within the step),
//! else the earliest the source made. A question asked twice in a run (a die rolled twice, a
//! price read twice) has two recorded answers, and a replay that gave either one for both would
//! not be the run it replays.

use crate::vocab::{session_id_of, SESSION_PREFIX};

/// Recorded calls, each with where it was made (`None` for a record older than places).
pub type Placed<T> = Vec<(Option<CallPlace>, T)>;

/// Where a call was made: the session (its id), the step, and among the step's calls that asked
/// the same (the same prompt, or the same tool with the same arguments) which one, 0 the first.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CallPlace {
    pub session: String,
    pub step: usize,
    pub repeat: usize,
}

impl CallPlace {
    /// The place in the source run of a call made at `step` of the replay's session
    /// `replay_session`, whose run replays `source` (the session the replay was started from,
    /// whose place the replay's root takes): a subagent's session of the replay maps to the
    /// subagent's session of the source by the part of its id after the run's root.
    pub fn in_source(source: &str, replay_session: &str, step: usize) -> CallPlace {
        let source = session_id_of(source).unwrap_or(source);
        let replay_session = session_id_of(replay_session).unwrap_or(replay_session);
        let root = crate::supervisor::run_of(replay_session);
        let below_root = replay_session.get(root.len()..).unwrap_or_default();
        CallPlace {
            session: format!("{source}{below_root}"),
            step,
            repeat: 0,
        }
    }

    /// The place of a recorded LLM call, from its node (`{session}/llm/{step}/{digest}`, and
    /// `/{repeat}` after it past the first); `None` for a node recorded before places were
    /// (`{session}/llm/{digest}`).
    pub fn of_llm_call(node: &str) -> Option<CallPlace> {
        let rest = node.strip_prefix(SESSION_PREFIX)?;
        let (session, place) = rest.split_once("/llm/")?;
        let mut parts = place.split('/');
        let step = parts.next()?.parse::<usize>().ok()?;
        let _digest = parts.next()?;
        let repeat = match parts.next() {
            Some(k) => k.parse::<usize>().ok()?,
            None => 0,
        };
        Some(CallPlace {
            session: session.to_owned(),
            step,
            repeat,
        })
    }

    /// The place of a recorded tool call, from its observation's node
    /// (`{session}/i{step}/observation`); a step makes one tool call.
    pub fn of_observation(node: &str) -> Option<CallPlace> {
        let rest = node.strip_prefix(SESSION_PREFIX)?;
        let iteration = rest.strip_suffix("/observation")?;
        let (session, step) = iteration.rsplit_once("/i")?;
        Some(CallPlace {
            session: session.to_owned(),
            step: step.parse().ok()?,
            repeat: 0,
        })
    }
}

/// The recorded call a call at `wanted` is given among `recorded` (each with its place, `None`
/// for a record older than places): the one at that very place; else the first repeat at that
/// session and step; else the earliest (the lowest step, then session, then repeat; records
/// without a place last, by their order in `recorded`).
pub fn choose<'a, T>(recorded: &'a [(Option<CallPlace>, T)], wanted: &CallPlace) -> Option<&'a T> {
    let at_step = |p: &CallPlace| p.session == wanted.session && p.step == wanted.step;
    let placed = || recorded.iter().filter_map(|(p, t)| Some((p.as_ref()?, t)));
    placed()
        .find(|(p, _)| *p == wanted)
        .or_else(|| {
            placed()
                .filter(|(p, _)| at_step(p))
                .min_by_key(|(p, _)| p.repeat)
        })
        .or_else(|| placed().min_by_key(|(p, _)| (p.step, &p.session, p.repeat)))
        .map(|(_, t)| t)
        .or_else(|| recorded.first().map(|(_, t)| t))
}

/// What a step gives the 1st, 2nd, ... call asking the same, among `recorded`: the answer for
/// each repeat the source made at `step_place` (its `repeat` ignored), then the answer for any
/// repeat past those (the last element). Empty when nothing is recorded.
pub fn by_repeat<T: Clone>(recorded: &[(Option<CallPlace>, T)], step_place: &CallPlace) -> Vec<T> {
    let repeats_here = recorded
        .iter()
        .filter_map(|(p, _)| p.as_ref())
        .filter(|p| p.session == step_place.session && p.step == step_place.step)
        .map(|p| p.repeat.saturating_add(1))
        .max()
        .unwrap_or(0)
        // A step's calls are numbered from 0 without gaps: a number past the calls recorded is
        // not one the source made (a planted node), and must not size this.
        .min(recorded.len());
    (0..=repeats_here)
        .filter_map(|repeat| {
            let wanted = CallPlace {
                repeat,
                ..step_place.clone()
            };
            choose(recorded, &wanted).cloned()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(session: &str, step: usize, repeat: usize) -> CallPlace {
        CallPlace {
            session: session.into(),
            step,
            repeat,
        }
    }

    #[test]
    fn a_repeat_number_past_the_calls_recorded_sizes_nothing() {
        let recorded = [(Some(place("r", 1, 1 << 40)), "x")];
        let answers = by_repeat(&recorded, &place("r", 1, 0));
        assert!(answers.len() <= 2, "{answers:?}");
        let recorded = [(Some(place("r", 1, usize::MAX)), "x")];
        assert!(by_repeat(&recorded, &place("r", 1, 0)).len() <= 2);
    }

    #[test]
    fn places_read_back_from_the_nodes_that_record_them() {
        let uris = crate::provenance::SessionUris::new("run-f2-s0");
        assert_eq!(
            CallPlace::of_llm_call(&uris.llm_call(3, 0, "ab12")),
            Some(place("run-f2-s0", 3, 0))
        );
        assert_eq!(
            CallPlace::of_llm_call(&uris.llm_call(3, 2, "ab12")),
            Some(place("run-f2-s0", 3, 2))
        );
        assert_eq!(
            CallPlace::of_llm_call("urn:trustgraph:agent:run/llm/ab12"),
            None
        );
        assert_eq!(
            CallPlace::of_observation(&uris.observation(4)),
            Some(place("run-f2-s0", 4, 0))
        );
        assert_eq!(CallPlace::of_observation("urn:x:i4/observation"), None);
    }

    #[test]
    fn a_replays_subagent_maps_to_the_sources_subagent() {
        assert_eq!(
            CallPlace::in_source("src", "fork-f2-s1", 3),
            place("src-f2-s1", 3, 0)
        );
        assert_eq!(
            CallPlace::in_source("urn:trustgraph:agent:src-f1-s0", "fork", 2),
            place("src-f1-s0", 2, 0)
        );
    }

    #[test]
    fn the_call_at_the_same_place_is_given_else_the_earliest() {
        let recorded = vec![
            (Some(place("r", 3, 0)), "third step"),
            (Some(place("r", 1, 0)), "first step"),
            (Some(place("r", 2, 1)), "second step, again"),
            (Some(place("r", 2, 0)), "second step"),
            (None, "old"),
        ];
        assert_eq!(choose(&recorded, &place("r", 3, 0)), Some(&"third step"));
        assert_eq!(
            choose(&recorded, &place("r", 2, 1)),
            Some(&"second step, again")
        );
        assert_eq!(choose(&recorded, &place("r", 2, 5)), Some(&"second step"));
        assert_eq!(choose(&recorded, &place("r", 7, 0)), Some(&"first step"));
        assert_eq!(
            choose(&recorded, &place("r-f1-s0", 3, 0)),
            Some(&"first step")
        );
        assert_eq!(choose(&[(None, "old")], &place("r", 1, 0)), Some(&"old"));
        assert_eq!(choose::<&str>(&[], &place("r", 1, 0)), None);
        assert_eq!(
            by_repeat(&recorded, &place("r", 2, 0)),
            vec!["second step", "second step, again", "second step"]
        );
        assert_eq!(by_repeat(&recorded, &place("r", 9, 0)), vec!["first step"]);
    }
}
