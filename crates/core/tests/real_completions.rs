//! The parsers against completions real models wrote (`tests/fixtures/real-completions/`): each
//! fixture holds the prompt, the model's exact completion and what the parser must make of it.
//! Small models rarely follow a protocol; the parsers must take only what the model decided first,
//! refuse what it did not decide, and never turn an invented result into an answer.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use agent_core::react::{self, ReactTurn};
use agent_core::router::{self, Candidate};
use agent_core::{plan, supervisor};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
struct Fixture {
    /// The model that wrote it, or where the completion was seen.
    model: String,
    completion: String,
    expect: Expect,
}

/// What a parser must make of a completion.
#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
enum Expect {
    /// ReACT: this action, with these arguments, and this text after it discarded.
    Action {
        action: String,
        arguments: BTreeMap<String, String>,
        discarded: String,
    },
    /// ReACT: this final answer.
    Final { answer: String },
    /// ReACT: no decision can be read; the error names this.
    Unparsable { error: String },
    /// A plan of this many steps, after this many repairs, that validates.
    Plan { steps: usize, repairs: usize },
    /// A plan that is refused; the reason contains this.
    PlanRefused { reason: String },
    /// The router's choice among `candidates`, and how it was made.
    Route {
        candidates: Vec<String>,
        choice: String,
        method: String,
    },
    /// The supervisor's goals: this many, or refused (0).
    Goals { count: usize },
}

fn fixtures() -> Vec<(String, Fixture)> {
    let dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/real-completions");
    let mut out: Vec<(String, Fixture)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let fixture: Fixture =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, fixture)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn check(name: &str, fixture: &Fixture) -> Result<(), String> {
    let text = &fixture.completion;
    match &fixture.expect {
        Expect::Action {
            action,
            arguments,
            discarded,
        } => match react::parse(text) {
            Ok(ReactTurn::Action {
                action: a,
                arguments: args,
                discarded: d,
                ..
            }) if (&a, &args, &d) == (action, arguments, discarded) => Ok(()),
            other => Err(format!(
                "expected action {action} {arguments:?} discarding {discarded:?}, got {other:?}"
            )),
        },
        Expect::Final { answer } => match react::parse(text) {
            Ok(ReactTurn::Final { answer: a, .. }) if &a == answer => Ok(()),
            other => Err(format!("expected final answer {answer:?}, got {other:?}")),
        },
        Expect::Unparsable { error } => match react::parse(text) {
            Err(e) if e.to_string().contains(error.as_str()) => Ok(()),
            other => Err(format!("expected an error naming {error:?}, got {other:?}")),
        },
        Expect::Plan { steps, repairs } => {
            let (mut parsed, _) = plan::parse(text)?;
            let made = plan::repair(&mut parsed, 0);
            plan::validate(&parsed, 10)?;
            if (parsed.len(), made.len()) == (*steps, *repairs) {
                Ok(())
            } else {
                Err(format!(
                    "expected {steps} steps after {repairs} repairs, got {parsed:?} after {made:?}"
                ))
            }
        }
        Expect::PlanRefused { reason } => {
            let outcome = plan::parse(text).and_then(|(mut parsed, _)| {
                plan::repair(&mut parsed, 0);
                plan::validate(&parsed, 10)
            });
            match outcome {
                Err(e) if e.contains(reason.as_str()) => Ok(()),
                other => Err(format!(
                    "expected a refusal naming {reason:?}, got {other:?}"
                )),
            }
        }
        Expect::Route {
            candidates,
            choice,
            method,
        } => {
            let candidates: Vec<Candidate> = candidates
                .iter()
                .map(|c| Candidate {
                    name: c.clone(),
                    description: String::new(),
                })
                .collect();
            let fallback = candidates[0].name.clone();
            let decided = router::decide(Ok(text), &candidates, &fallback);
            if (&decided.selected, decided.method.as_str()) == (choice, method.as_str()) {
                Ok(())
            } else {
                Err(format!("expected {choice} by {method}, got {decided:?}"))
            }
        }
        Expect::Goals { count } => {
            let got = supervisor::parse_goals(text, 5, false).map_or(0, |g| g.len());
            if got == *count {
                Ok(())
            } else {
                Err(format!("expected {count} goals, got {got}"))
            }
        }
    }
    .map_err(|e| format!("{name} ({}): {e}", fixture.model))
}

/// Every recorded completion is read as its fixture says, and none panics a parser.
#[test]
fn real_model_completions_are_read_as_recorded() {
    let all = fixtures();
    assert!(all.len() >= 12, "only {} fixtures", all.len());
    let failures: Vec<String> = all
        .iter()
        .filter_map(|(name, fixture)| check(name, fixture).err())
        .collect();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
