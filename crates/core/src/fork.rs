//! Forks and replays, as pure logic: the form in which each step records the input it queues (only
//! what it adds to the input it was given), step `n`'s whole input rebuilt from those records, and
//! what a fork's input changes in the one it was forked from.

use std::collections::BTreeMap;

use agent_schema::{AgentRequest, AgentStep};

use crate::documents::steps_taken;

/// The input of one step of a session, as its record holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedInput {
    /// The step it is the input of (`i{step}`).
    pub step: usize,
    /// When the record keeps only new steps: the step whose input it continues, and how many of
    /// that input's history steps come before its own.
    pub continues: Option<(usize, usize)>,
    /// The request, without the continued steps when `continues` is set.
    pub request: AgentRequest,
}

/// The step a request is the input of: one more than the steps its history stands for.
pub fn step_of(request: &AgentRequest) -> usize {
    steps_taken(&request.history) + 1
}

/// How a step records the request `next` it queues, given the history of its own input (step
/// `input_step`'s): if `next` continues that history, only the steps it adds, so a record is the
/// size of its step and not of the dialog.
pub fn record(
    input_step: usize,
    input_history: &[AgentStep],
    next: &AgentRequest,
) -> RecordedInput {
    let step = step_of(next);
    let n = input_history.len();
    if n == 0 || next.history.len() < n || next.history[..n] != *input_history {
        return RecordedInput {
            step,
            continues: None,
            request: next.clone(),
        };
    }
    let mut request = next.clone();
    request.history.drain(..n);
    RecordedInput {
        step,
        continues: Some((input_step, n)),
        request,
    }
}

/// Step `n`'s whole input, rebuilt from a session's records. Fails naming the step whose record
/// is missing (a step of a version that did not record inputs, or one the store lost).
pub fn rebuild(records: &[RecordedInput], n: usize) -> Result<AgentRequest, String> {
    let by_step: BTreeMap<usize, &RecordedInput> =
        records.iter().rev().map(|r| (r.step, r)).collect();
    let mut chain = Vec::new();
    let mut at = n;
    // Each record continues an earlier step's input, so the chain is at most `n` long; the bound
    // also stops a forged record that continues itself.
    for _ in 0..=n {
        let Some(record) = by_step.get(&at) else {
            return Err(format!("the input of step {at} was not recorded"));
        };
        chain.push(*record);
        match record.continues {
            Some((from, _)) if from < at => at = from,
            Some((from, _)) => {
                return Err(format!(
                    "the record of step {at} continues step {from}, which is not before it"
                ))
            }
            None => break,
        }
    }
    let Some(first) = chain.pop() else {
        return Err(format!("the input of step {n} was not recorded"));
    };
    if first.continues.is_some() {
        return Err(format!("the inputs before step {n} form a cycle"));
    }
    let mut request = first.request.clone();
    while let Some(record) = chain.pop() {
        let Some((from, kept)) = record.continues else {
            break;
        };
        let Some(prefix) = request.history.get(..kept) else {
            return Err(format!(
                "the record of step {} continues {kept} steps of step {from}'s input, which has {}",
                record.step,
                request.history.len()
            ));
        };
        let mut next = record.request.clone();
        next.history = prefix.iter().cloned().chain(next.history).collect();
        request = next;
    }
    Ok(request)
}

/// What `fork` changes in `original` (the input it was forked from), in words the graph keeps:
/// the fields a request is run with, and each history step's parts, named by the step they
/// record. Ids and the fields a fork must clear (its session, its supervisor) are not edits.
pub fn edits(original: &AgentRequest, fork: &AgentRequest) -> Vec<String> {
    let mut edits = Vec::new();
    let fields: [(&str, String, String); 8] = [
        ("question", original.question.clone(), fork.question.clone()),
        (
            "state",
            original.state.clone().unwrap_or_default(),
            fork.state.clone().unwrap_or_default(),
        ),
        (
            "group",
            format!("{:?}", original.group),
            format!("{:?}", fork.group),
        ),
        ("pattern", original.pattern.clone(), fork.pattern.clone()),
        (
            "task_type",
            original.task_type.clone(),
            fork.task_type.clone(),
        ),
        ("framing", original.framing.clone(), fork.framing.clone()),
        (
            "collection",
            original.collection.clone(),
            fork.collection.clone(),
        ),
        (
            "streaming",
            original.streaming.to_string(),
            fork.streaming.to_string(),
        ),
    ];
    for (name, before, after) in fields {
        if before != after {
            edits.push(name.to_owned());
        }
    }
    if original.history.len() != fork.history.len() {
        edits.push(format!(
            "history ({} steps, was {})",
            fork.history.len(),
            original.history.len()
        ));
    }
    let mut step = 0;
    for (before, after) in original.history.iter().zip(&fork.history) {
        step += steps_taken(std::slice::from_ref(before));
        let parts = [
            ("thought", before.thought != after.thought),
            ("action", before.action != after.action),
            ("arguments", before.arguments != after.arguments),
            ("observation", before.observation != after.observation),
            (
                "plan",
                before.plan != after.plan || before.subagent_results != after.subagent_results,
            ),
        ];
        for (part, changed) in parts {
            if changed {
                edits.push(format!("{part} of step {step}"));
            }
        }
    }
    edits
}

/// The history entry that records step `step` (1-based, as iterations are numbered), if the
/// history holds it whole (a folded step stands for several and is not one step's).
pub fn history_entry_mut(history: &mut [AgentStep], step: usize) -> Option<&mut AgentStep> {
    let mut at = 0;
    for entry in history.iter_mut() {
        let stands_for = steps_taken(std::slice::from_ref(entry));
        at += stands_for;
        if at == step && stands_for == 1 {
            return Some(entry);
        }
        if at >= step {
            return None;
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn step(n: usize) -> AgentStep {
        AgentStep {
            thought: format!("thought {n}"),
            action: "llm".into(),
            observation: format!("seen {n}"),
            ..AgentStep::default()
        }
    }

    fn request(steps: usize) -> AgentRequest {
        AgentRequest {
            question: "q".into(),
            pattern: "react".into(),
            session_id: "s".into(),
            history: (1..=steps).map(step).collect(),
            ..AgentRequest::default()
        }
    }

    /// The records a three-step dialog leaves: the first whole, each next one only its new step.
    fn dialog() -> Vec<RecordedInput> {
        let mut records = vec![record(0, &[], &request(0))];
        for n in 1..3 {
            let input = request(n - 1);
            records.push(record(n, &input.history, &request(n)));
        }
        records
    }

    #[test]
    fn each_record_keeps_only_its_new_step_and_every_input_rebuilds_exactly() {
        let records = dialog();
        assert_eq!(records[0].continues, None);
        assert_eq!(records[2].continues, Some((2, 1)));
        assert_eq!(records[2].request.history, vec![step(2)]);
        for n in 1..=3 {
            assert_eq!(rebuild(&records, n).unwrap(), request(n - 1), "step {n}");
        }
    }

    #[test]
    fn a_missing_or_self_continuing_record_is_named_not_guessed() {
        let mut records = dialog();
        records.remove(1);
        assert_eq!(
            rebuild(&records, 3).unwrap_err(),
            "the input of step 2 was not recorded"
        );
        assert!(rebuild(&records, 4).is_err());
        let mut looped = dialog();
        looped[2].continues = Some((3, 1));
        assert!(rebuild(&looped, 3).unwrap_err().contains("not before it"));
    }

    #[test]
    fn a_history_that_does_not_continue_the_input_is_recorded_whole() {
        let input = request(2);
        let mut rewritten = request(3);
        rewritten.history[0].observation = "folded".into();
        let recorded = record(3, &input.history, &rewritten);
        assert_eq!(recorded.continues, None);
        assert_eq!(recorded.request, rewritten);
    }

    #[test]
    fn edits_name_each_changed_field_and_history_part_by_its_step() {
        let original = request(2);
        let mut fork = original.clone();
        fork.session_id = "other".into();
        assert!(edits(&original, &fork).is_empty(), "ids are not edits");
        history_entry_mut(&mut fork.history, 1).unwrap().observation = "edited".into();
        fork.question = "q2".into();
        assert_eq!(
            edits(&original, &fork),
            ["question", "observation of step 1"]
        );
        assert!(history_entry_mut(&mut fork.history, 3).is_none());
    }
}
