//! The provenance vocabulary, defined once: the namespaces, the named graphs, the URI prefix of
//! sessions and every term the services write or query, as `NamedNodeRef` constants (like
//! `oxrdf::vocab`). The writers name terms only from here, so a term misspelt is a compile error; the
//! SPARQL texts name them as `tg:` and `prov:` prefixed names, which a test checks against this list
//! (`every_prefixed_name_in_the_sources_is_a_term_of_the_vocabulary`).

pub use oxrdf::vocab::{rdf, rdfs, xsd};
pub use oxrdf::NamedNodeRef;

/// TrustGraph's namespace (`tg:`).
pub const TG: &str = "https://trustgraph.ai/ns/";
/// PROV-O (`prov:`).
pub const PROV: &str = "http://www.w3.org/ns/prov#";
pub const RDF_TYPE: NamedNodeRef<'static> = rdf::TYPE;
pub const RDFS_LABEL: NamedNodeRef<'static> = rdfs::LABEL;
pub const XSD_INTEGER: NamedNodeRef<'static> = xsd::INTEGER;
pub const XSD_DECIMAL: NamedNodeRef<'static> = xsd::DECIMAL;
pub const XSD_BOOLEAN: NamedNodeRef<'static> = xsd::BOOLEAN;
pub const XSD_DATETIME: NamedNodeRef<'static> = xsd::DATE_TIME;

/// The named graph that holds provenance (TrustGraph's retrieval graph).
pub const PROVENANCE_GRAPH: &str = "urn:graph:retrieval";
/// Where the orchestrators' journal of step outcomes lives: kept apart from the provenance, which
/// people query.
pub const JOURNAL_GRAPH: &str = "urn:graph:agent-journal";

/// Where the aggregators that own a SPARQL server's journal keep a record of themselves, each
/// beating, so that two owners of one server find each other even when the broker cannot tell
/// them apart (different subscriptions, or a partition between them).
pub const JOURNAL_OWNERS_GRAPH: &str = "urn:graph:agent-journal-owners";

/// What the aggregator's sweeps look at instead of every fan-out and approval ever recorded: a
/// fan-out still waiting for its synthesis, or a call parked for approval still waiting for its
/// answer, is named here (`<node> tg:awaits tg:Synthesis` or `tg:ApprovalAnswer`) until it is
/// answered. Written by the aggregator alone; an index, never the record.
pub const WAITING_GRAPH: &str = "urn:graph:agent-waiting";

/// The named graph of documents: long texts that left the messages (claim-check), each under its
/// content's digest.
pub const DOCUMENTS_GRAPH: &str = "urn:graph:agent-documents";

/// A document's IRI is this prefix and the SHA-256 of its text, in hex.
pub const DOCUMENT_PREFIX: &str = "urn:trustgraph:doc:sha256:";

/// Every session's URI is this followed by its id (TrustGraph's agent URIs).
pub const SESSION_PREFIX: &str = "urn:trustgraph:agent:";

/// The `PREFIX` lines for `prov:`, `tg:` and `rdfs:`, for SPARQL written against this vocabulary.
pub const SPARQL_PREFIXES: &str = "PREFIX prov: <http://www.w3.org/ns/prov#>\nPREFIX tg: <https://trustgraph.ai/ns/>\nPREFIX rdfs: <http://www.w3.org/2000/01/rdf-schema#>\n";

/// Constants for the terms of one namespace, and `ALL` of them for checks.
macro_rules! vocabulary {
    ($namespace:literal; $($(#[$doc:meta])* $name:ident = $local:literal;)*) => {
        $(
            $(#[$doc])*
            pub const $name: NamedNodeRef<'static> =
                NamedNodeRef::new_unchecked(concat!($namespace, $local));
        )*
        /// Every term of the namespace defined here.
        pub const ALL: &[NamedNodeRef<'static>] = &[$($name),*];
    };
}

/// TrustGraph's terms (`tg:`): the classes of provenance nodes, then their properties.
pub mod tg {
    use oxrdf::NamedNodeRef;

    vocabulary! { "https://trustgraph.ai/ns/";
        // Classes.
        AGENT_QUESTION = "AgentQuestion";
        ANALYSIS = "Analysis";
        ANSWER = "Answer";
        APPROVAL_ANSWER = "ApprovalAnswer";
        APPROVAL_REQUEST = "ApprovalRequest";
        CANCELLATION = "Cancellation";
        CONCLUSION = "Conclusion";
        CRITIQUE = "Critique";
        DISPATCH_DECISION = "DispatchDecision";
        EVALUATION = "Evaluation";
        /// A supervisor's fan-out node.
        FAN_OUT = "FanOut";
        FORK = "Fork";
        OBSERVATION = "Observation";
        PATTERN_DECISION = "PatternDecision";
        PLAN = "Plan";
        PLAN_REVISION = "PlanRevision";
        PLAN_STEP = "PlanStep";
        QUESTION = "Question";
        RECONCILIATION = "Reconciliation";
        REFLECTION = "Reflection";
        RESEARCH_ROUND = "ResearchRound";
        STEP_EXECUTION = "StepExecution";
        STEP_INPUT = "StepInput";
        SUBAGENT_COMPLETION = "SubagentCompletion";
        SYNTHESIS = "Synthesis";
        THOUGHT = "Thought";
        TOOL_USE = "ToolUse";
        // Properties.
        ACTION = "action";
        AGREEMENT = "agreement";
        ANSWERED_BY = "answeredBy";
        APPROVAL = "approval";
        ARGUMENTS = "arguments";
        ATTEMPT = "attempt";
        /// What a node in [`crate::vocab::WAITING_GRAPH`] still waits for (a class).
        AWAITS = "awaits";
        BUDGET_SPENT = "budgetSpent";
        /// The cancellation that ended a dialog (the class is [`CANCELLATION`]).
        CANCELLATION_LINK = "cancellation";
        CANCELLED_BY = "cancelledBy";
        /// What a fan-out's later requests carry on from the step that fanned out (a replay's
        /// reuse, the model the dialog asks for), as a JSON object of message properties: the
        /// aggregator sends its synthesis request and the subagents it starts with them.
        CARRIES = "carries";
        CLAIMED_AT = "claimedAt";
        CLIENT_ID = "clientId";
        /// The journal entry of the step that ended a dialog (on the dialog's session node): where
        /// a client that lost the closing message finds the very bytes that were published.
        CLOSING_ENTRY = "closingEntry";
        COMPLETION = "completion";
        COMPLETION_BYTES = "completionBytes";
        COMPLETION_STATUS = "completionStatus";
        CONFIG = "config";
        /// A document's whole text.
        CONTENT = "content";
        /// What resuming a step parked for approval needs (its message and decision, as JSON).
        CONTINUATION = "continuation";
        CONTINUED_STEPS = "continuedSteps";
        /// `false` on a cancellation an orchestrator acted on without the services' seal (no seal
        /// key, or `--control-seals warn`) and recorded itself: who and when are the sender's claim.
        CONTROL_SEALED = "controlSealed";
        CONTINUES_INPUT = "continuesInput";
        /// The `conversation_id` of the request that created a node.
        CONVERSATION = "conversation";
        /// The correlation id a fan-out and its completions share.
        CORRELATION_ID = "correlationId";
        DEADLINE = "deadline";
        DECISION = "decision";
        DELIVERY = "delivery";
        DEPENDS_ON = "dependsOn";
        DIALOG_IN_TOKEN = "dialogInToken";
        DIALOG_OUT_TOKEN = "dialogOutToken";
        DIALOG_STARTED_MS = "dialogStartedMs";
        DISAGREEMENT = "disagreement";
        DISCARDED_CHARS = "discardedChars";
        DISCARDED_TEXT = "discardedText";
        DISPATCH = "dispatch";
        DISPATCH_ANSWER = "dispatchAnswer";
        DISPATCH_CANDIDATE = "dispatchCandidate";
        DISPATCH_FALLBACK_REASON = "dispatchFallbackReason";
        DISPATCH_METHOD = "dispatchMethod";
        DISPATCH_RATIONALE = "dispatchRationale";
        DOCUMENT = "document";
        DROPPED_CALLS = "droppedCalls";
        DROPPED_STEP = "droppedStep";
        EDITED_ARGUMENTS = "editedArguments";
        EVALUATES = "evaluates";
        /// A critic's evaluation, as text (the class is [`EVALUATION`]).
        EVALUATION_TEXT = "evaluation";
        EVALUATION_STATUS = "evaluationStatus";
        EVALUATION_UNREADABLE = "evaluationUnreadable";
        EXECUTES_STEP = "executesStep";
        EXPECTED_SIBLINGS = "expectedSiblings";
        FALLBACK = "fallback";
        FOLLOWS = "follows";
        FORK_EDIT = "forkEdit";
        FORKED_AT_STEP = "forkedAtStep";
        FORKED_FROM = "forkedFrom";
        FRAMING = "framing";
        GAP = "gap";
        GOAL = "goal";
        HAS_STEP = "hasStep";
        /// Until when the timeout sweep holds a fan-out back, past its deadline, for the answers
        /// of nested fan-outs found due with it: kept in the graph so that every aggregator, and
        /// one restarted, keeps the same hold.
        HELD_UNTIL = "heldUntil";
        /// What an LLM call read, in tokens (also marks a node that records a cost).
        IN_TOKEN = "inToken";
        LESSON = "lesson";
        LESSON_APPLIED = "lessonApplied";
        LIFE_CYCLE_EXHAUSTED = "lifeCycleExhausted";
        LLM_DURATION_MS = "llmDurationMs";
        MISSING_SUBAGENT = "missingSubagent";
        MODEL = "model";
        NEEDS = "needs";
        NOTE = "note";
        OUT_TOKEN = "outToken";
        /// A journal owner's beat counter, rewritten every beat while it runs.
        OWNER_BEAT = "ownerBeat";
        /// A journal owner's process id (random for each start).
        OWNER_ID = "ownerId";
        /// Whether a journal owner has passed its listening window.
        OWNER_OWNING = "ownerOwning";
        /// When a journal owner started, in milliseconds since the epoch.
        OWNER_STARTED_MS = "ownerStartedMs";
        /// The store a journal owner owns, as it names it (without credentials).
        OWNER_STORE = "ownerStore";
        /// A journal entry's recorded outcome.
        OUTCOME = "outcome";
        PARENT_SESSION = "parentSession";
        PARTIAL = "partial";
        PATTERN = "pattern";
        PATTERN_ANSWER = "patternAnswer";
        PATTERN_CANDIDATE = "patternCandidate";
        PATTERN_FALLBACK_REASON = "patternFallbackReason";
        PATTERN_METHOD = "patternMethod";
        PATTERN_RATIONALE = "patternRationale";
        PATTERN_UNAVAILABLE = "patternUnavailable";
        PLAN_FALLBACK_REASON = "planFallbackReason";
        PLAN_REPAIR = "planRepair";
        PLAN_VERSION = "planVersion";
        PROMPT_DIGEST = "promptDigest";
        /// Whether a journal entry's outcome is on the broker.
        PUBLISHED = "published";
        QUERY = "query";
        RATIONALE = "rationale";
        REASON = "reason";
        RECONCILIATION_READ = "reconciliationRead";
        RECORDED_AT = "recordedAt";
        REJECTED_PLAN = "rejectedPlan";
        REJECTION_REASON = "rejectionReason";
        REQUEST = "request";
        REQUEST_BYTES = "requestBytes";
        RERUN_STEP = "rerunStep";
        RESEARCH_COMPLETE = "researchComplete";
        RESULT = "result";
        RETRY_COUNT = "retryCount";
        REUSED_FROM = "reusedFrom";
        REUSES = "reuses";
        REVISION_REASON = "revisionReason";
        /// The run (root session) a costed node belongs to.
        RUN = "run";
        RUN_ELAPSED_MS = "runElapsedMs";
        RUN_TOKENS = "runTokens";
        /// A node's seal: what only this service may have written.
        SEAL = "seal";
        START_CLAIM = "startClaim";
        START_CLAIMED_AT = "startClaimedAt";
        START_REQUESTED = "startRequested";
        STARTED_AFTER = "startedAfter";
        STARTED_AT = "startedAt";
        STEP = "step";
        STEP_INDEX = "stepIndex";
        STEP_STATUS = "stepStatus";
        SUB_STEP = "subStep";
        SUBAGENT_GOAL = "subagentGoal";
        SUBAGENT_SESSION = "subagentSession";
        SYNTHESIS_CLAIM = "synthesisClaim";
        SYNTHESIS_REQUESTED = "synthesisRequested";
        /// Why the aggregator will never synthesise a fan-out (no valid seal, a continuation it
        /// cannot read): its timeout sweep stops looking at it.
        FAN_IN_REFUSED = "fanInRefused";
        TASK_TYPE = "taskType";
        TASK_TYPE_ANSWER = "taskTypeAnswer";
        TASK_TYPE_CANDIDATE = "taskTypeCandidate";
        TASK_TYPE_FALLBACK_REASON = "taskTypeFallbackReason";
        TASK_TYPE_METHOD = "taskTypeMethod";
        TASK_TYPE_RATIONALE = "taskTypeRationale";
        TERMINATION_REASON = "terminationReason";
        /// The thought an approval request or tool use came from (the class is [`THOUGHT`]).
        THOUGHT_LINK = "thought";
        TOOL_CANDIDATE = "toolCandidate";
        TOOL_DURATION_MS = "toolDurationMs";
        TOOL_HINT = "toolHint";
        TOOL_OUTCOME = "toolOutcome";
        UNREADABLE_REASON = "unreadableReason";
    }
}

/// The PROV-O terms the provenance uses (`prov:`).
pub mod prov {
    use oxrdf::NamedNodeRef;

    vocabulary! { "http://www.w3.org/ns/prov#";
        ENTITY = "Entity";
        WAS_DERIVED_FROM = "wasDerivedFrom";
        WAS_INVALIDATED_BY = "wasInvalidatedBy";
        STARTED_AT_TIME = "startedAtTime";
        AT_TIME = "atTime";
    }
}

/// The IRI of a session's root node.
pub fn session_uri(session_id: &str) -> String {
    if session_id.starts_with(SESSION_PREFIX) {
        session_id.to_owned()
    } else {
        format!("{SESSION_PREFIX}{session_id}")
    }
}

/// The session id inside a session node's IRI (or any node under it), if it is one.
pub fn session_id_of(iri: &str) -> Option<&str> {
    let rest = iri.strip_prefix(SESSION_PREFIX)?;
    Some(rest.split('/').next().unwrap_or(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terms_and_prefixes_agree_with_the_namespaces() {
        for term in tg::ALL {
            assert!(term.as_str().starts_with(TG), "{term}");
        }
        for term in prov::ALL {
            assert!(term.as_str().starts_with(PROV), "{term}");
        }
        assert!(SPARQL_PREFIXES.contains(&format!("tg: <{TG}>")));
        assert!(SPARQL_PREFIXES.contains(&format!("prov: <{PROV}>")));
    }

    /// The `tg:` and `prov:` prefixed names in the workspace's sources and documents: SPARQL in
    /// the services and tests, and the tables in `docs/` (a name after `:` or `/`, as in topic
    /// names, is not one).
    fn prefixed_names() -> Vec<(String, String)> {
        fn walk(dir: &std::path::Path, found: &mut Vec<(String, String)>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                let name = entry.file_name().to_string_lossy().into_owned();
                if path.is_dir() {
                    if !name.starts_with('.') && name != "target" {
                        walk(&path, found);
                    }
                } else if name.ends_with(".rs") || name.ends_with(".md") {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    for prefix in ["tg:", "prov:"] {
                        for (at, _) in text.match_indices(prefix) {
                            let before = text[..at].chars().next_back();
                            if before.is_some_and(|c| c.is_alphanumeric() || "_:/-".contains(c)) {
                                continue;
                            }
                            let local: String = text[at + prefix.len()..]
                                .chars()
                                .take_while(|c| c.is_ascii_alphabetic())
                                .collect();
                            if !local.is_empty() {
                                found
                                    .push((format!("{prefix}{local}"), path.display().to_string()));
                            }
                        }
                    }
                }
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut found = Vec::new();
        walk(&root, &mut found);
        found
    }

    #[test]
    fn every_prefixed_name_in_the_sources_is_a_term_of_the_vocabulary() {
        let known: Vec<String> = tg::ALL
            .iter()
            .map(|t| t.as_str().replace(TG, "tg:"))
            .chain(prov::ALL.iter().map(|t| t.as_str().replace(PROV, "prov:")))
            .collect();
        let found = prefixed_names();
        assert!(found.len() > 100, "the sources were not found: {found:?}");
        let unknown: Vec<&(String, String)> = found
            .iter()
            .filter(|(name, _)| !known.contains(name))
            .collect();
        assert!(unknown.is_empty(), "not in the vocabulary: {unknown:?}");
    }

    #[test]
    fn session_uris_round_trip() {
        assert_eq!(session_uri("abc"), "urn:trustgraph:agent:abc");
        assert_eq!(
            session_uri("urn:trustgraph:agent:abc"),
            "urn:trustgraph:agent:abc"
        );
        assert_eq!(
            session_id_of("urn:trustgraph:agent:abc/i1/thought"),
            Some("abc")
        );
        assert_eq!(session_id_of("urn:other:abc"), None);
    }
}
