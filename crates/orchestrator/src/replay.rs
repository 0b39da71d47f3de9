//! Forks and replays in a step. A fork's first step records where it was forked from and what
//! its input changed; every step records the LLM calls it made (what was asked, by digest, and the
//! answer), so a later replay can give the same answer to the same question; a replay's steps give
//! recorded answers and tool results again instead of calling, where the request asks for it,
//! and record what they reused.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use agent_core::fork::RecordedInput;
use agent_core::provenance::{self, SessionUris};
use agent_core::replay::{CallPlace, Placed};
use agent_graph::recorded::{self, RecordedToolResult, Recordings};
use agent_graph::{GraphError, GraphStore};
use agent_llm::tape::{AnswersByRepeat, Recorded, RecordedAnswers, Tape};
use agent_schema::{
    AgentRequest, FORK_OF_PROPERTY, FORK_STEP_PROPERTY, REUSE_FROM_PROPERTY, REUSE_PROPERTY,
};

use crate::emit::DialogOutput;

/// What a replay gives again instead of calling, and from which run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reuse {
    /// The recorded run's root session id.
    pub from: String,
    /// The session the replay was started from (the run's root, or one of its subagents): the
    /// replay's root takes its place (see [`agent_core::replay::CallPlace::in_source`]).
    pub source: String,
    pub llm: bool,
    pub tools: bool,
}

impl Reuse {
    /// The reuse a message asks for, if any (`agent-reuse` and `agent-reuse-from`).
    pub fn asked(properties: &agent_bus::Properties) -> Option<Reuse> {
        let from = properties.get(REUSE_FROM_PROPERTY)?;
        let (llm, tools) = match properties.get(REUSE_PROPERTY)?.as_str() {
            "llm" => (true, false),
            "tools" => (false, true),
            "all" => (true, true),
            _ => return None,
        };
        let source = agent_core::vocab::session_id_of(from).unwrap_or(from);
        // Recorded calls name the root session of their run, a subagent's too: a fork of a
        // subagent's session reuses from its run.
        let from = crate::budget::run_of(source);
        (!from.is_empty()).then(|| Reuse {
            from: from.to_owned(),
            source: source.to_owned(),
            llm,
            tools,
        })
    }

    /// Its words in the graph and in the message properties.
    pub fn label(&self) -> &'static str {
        match (self.llm, self.tools) {
            (true, true) => "all",
            (true, false) => "llm",
            _ => "tools",
        }
    }
}

/// What a step learns from its message about forks and replays before it works.
pub struct StepStart {
    /// The reuse its message asks for.
    pub reuse: Option<Reuse>,
    /// Its record of LLM calls, with the recorded answers the reuse may give.
    pub replay: StepReplay,
    /// The fork its message starts, and what the fork's input changes in the source's.
    pub fork: Option<(Fork, Vec<String>)>,
}

impl StepStart {
    /// Reads what the message (of `session_id`) asks for; the graph is read only for a step that
    /// will run (`running`: not refused, not given up).
    pub async fn read(
        properties: &agent_bus::Properties,
        request: &AgentRequest,
        session_id: &str,
        store: Option<&GraphStore>,
        kept: &KeptRecords,
        running: bool,
    ) -> Result<StepStart, GraphError> {
        let reuse = Reuse::asked(properties);
        let replay = match (&reuse, store, running) {
            (Some(reuse), Some(store), true) => {
                let step = agent_core::fork::step_of(request);
                let place = CallPlace::in_source(&reuse.source, session_id, step);
                StepReplay::load(store, reuse, place, kept).await?
            }
            _ => StepReplay::recording(),
        };
        let fork = match Fork::started_by(properties, request) {
            Some(fork) if running => {
                let edits = fork.edits(store, request).await?;
                Some((fork, edits))
            }
            _ => None,
        };
        Ok(StepStart {
            reuse,
            replay,
            fork,
        })
    }
}

/// The answers a step at `place` may give again from `source`, looked up as its calls ask (see
/// [`RecordedAnswers`]): the record is shared, not copied into each step.
struct StepAnswers {
    place: CallPlace,
    source: Arc<SourceRecord>,
}

impl RecordedAnswers for StepAnswers {
    fn answers(&self, digest: &str) -> AnswersByRepeat {
        self.source
            .llm_calls
            .get(digest)
            .map(|calls| agent_core::replay::by_repeat(calls, &self.place))
            .unwrap_or_default()
    }
}

/// What a source run recorded that its replay may give again, its LLM answers decoded.
pub struct SourceRecord {
    llm_calls: HashMap<String, Placed<(String, Recorded)>>,
    tool_results: BTreeMap<(String, String), Placed<RecordedToolResult>>,
    /// The text it holds, as read (answers as JSON, results, nodes): what keeping it costs.
    bytes: usize,
}

/// How many ended runs' records are kept, how many bytes of text they may hold together, and for
/// how long. A record counts the text of every answer and result it holds (each up to 64 KiB): a
/// long run's may be tens of MiB, so the count alone would not bound the memory. A record larger
/// than the whole bound is not kept (its replay reads it at each step, as a running one's).
const KEPT_RUNS: usize = 8;
const KEPT_BYTES: usize = 32 << 20;
const KEPT_FOR: Duration = Duration::from_secs(300);

/// The records of runs that replays read, kept a while once their run has ended: every step of a
/// replay reads its source's whole record, which does not change once the source has ended (its
/// conclusion is written with its last step's records), so a long replay of a long run read it
/// again at every step.
pub struct KeptRecords {
    kept: Mutex<VecDeque<KeptRecord>>,
    max_bytes: usize,
}

impl Default for KeptRecords {
    fn default() -> Self {
        KeptRecords {
            kept: Mutex::default(),
            max_bytes: KEPT_BYTES,
        }
    }
}

struct KeptRecord {
    reuse: (String, bool, bool),
    read_at: Instant,
    record: Arc<SourceRecord>,
}

impl KeptRecords {
    /// What `reuse`'s source run recorded: kept, or read from the graph (and kept when the run
    /// had ended by then).
    async fn read(
        &self,
        store: &GraphStore,
        reuse: &Reuse,
    ) -> Result<Arc<SourceRecord>, GraphError> {
        let key = (reuse.from.clone(), reuse.llm, reuse.tools);
        if let Some(record) = self.kept(&key) {
            return Ok(record);
        }
        // Whether it ended is read first: then what is read after it is all it recorded.
        let ended = recorded::concluded(store, &reuse.from).await?;
        let Recordings {
            llm_calls,
            tool_results,
        } = recorded::recordings(store, &reuse.from, reuse.llm, reuse.tools).await?;
        let answer_bytes: usize = llm_calls
            .values()
            .flatten()
            .map(|(_, (node, json))| node.len() + json.len())
            .sum();
        let result_bytes: usize = tool_results
            .iter()
            .map(|((tool, arguments), results)| {
                tool.len()
                    + arguments.len()
                    + results
                        .iter()
                        .map(|(_, r)| r.node.len() + r.text.len())
                        .sum::<usize>()
            })
            .sum();
        let llm_calls = llm_calls
            .into_iter()
            .map(|(digest, calls)| {
                let calls: Placed<(String, Recorded)> = calls
                    .into_iter()
                    .filter_map(|(at, (node, json))| {
                        let answer = serde_json::from_str::<Recorded>(&json).ok()?;
                        Some((at, (node, answer)))
                    })
                    .collect();
                (digest, calls)
            })
            .collect();
        let record = Arc::new(SourceRecord {
            llm_calls,
            tool_results,
            bytes: answer_bytes + result_bytes,
        });
        if ended && record.bytes <= self.max_bytes {
            let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
            while kept.len() >= KEPT_RUNS
                || kept.iter().map(|k| k.record.bytes).sum::<usize>() + record.bytes
                    > self.max_bytes
            {
                if kept.pop_front().is_none() {
                    break;
                }
            }
            kept.push_back(KeptRecord {
                reuse: key,
                read_at: Instant::now(),
                record: record.clone(),
            });
        }
        Ok(record)
    }

    fn kept(&self, key: &(String, bool, bool)) -> Option<Arc<SourceRecord>> {
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        kept.retain(|k| k.read_at.elapsed() < KEPT_FOR);
        kept.iter()
            .find(|k| k.reuse == *key)
            .map(|k| k.record.clone())
    }
}

/// One step's record of its calls, and what it may give again.
pub struct StepReplay {
    pub tape: Arc<Tape>,
    /// When this step replays a run: where it is in that run, and what the run recorded.
    source: Option<(CallPlace, Arc<SourceRecord>)>,
    /// The recorded observations given again, by the node they came from.
    reused_tools: Mutex<Vec<String>>,
}

impl StepReplay {
    /// A step that records its calls and reuses nothing.
    pub fn recording() -> StepReplay {
        StepReplay {
            tape: Arc::new(Tape::recording()),
            source: None,
            reused_tools: Mutex::new(Vec::new()),
        }
    }

    /// A step of a replay, at `place` in the source run: what `reuse` asks for, read from the
    /// graph (or from `kept`, for a source that had ended when it was read).
    pub async fn load(
        store: &GraphStore,
        reuse: &Reuse,
        place: CallPlace,
        kept: &KeptRecords,
    ) -> Result<StepReplay, GraphError> {
        let source = kept.read(store, reuse).await?;
        let answers = StepAnswers {
            place: place.clone(),
            source: source.clone(),
        };
        Ok(StepReplay {
            tape: Arc::new(Tape::replaying(answers)),
            source: Some((place, source)),
            reused_tools: Mutex::new(Vec::new()),
        })
    }

    /// What the recorded call of `tool` with `arguments_json` gave (the one made at this step's
    /// place in the source, else the earliest), if the replay reuses it; noted as reused.
    pub fn tool_result(&self, tool: &str, arguments_json: &str) -> Option<RecordedToolResult> {
        let (place, source) = self.source.as_ref()?;
        let recorded = source
            .tool_results
            .get(&(tool.to_owned(), arguments_json.to_owned()))?;
        let recorded = agent_core::replay::choose(recorded, place)?;
        self.reused_tools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(recorded.node.clone());
        Some(recorded.clone())
    }

    /// Records in the graph (not for the client) the LLM calls step `n` made or reused, and the
    /// tool results it reused.
    pub fn record(&self, out: &DialogOutput<'_>, uris: &SessionUris, n: usize, run: &str) {
        let mut triples = Vec::new();
        for call in self.tape.take() {
            let answer =
                String::from_utf8_lossy(&agent_schema::encode(&call.recorded)).into_owned();
            triples.extend(provenance::llm_call(
                uris,
                (n, call.repeat),
                &call.digest,
                &answer,
                run,
                call.reused_from.as_deref(),
            ));
        }
        let reused = std::mem::take(
            &mut *self
                .reused_tools
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for source in reused {
            triples.extend(provenance::reused(&uris.observation(n), &source));
        }
        out.keep(triples);
    }
}

/// Where a fork's first message says it was forked from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fork {
    pub source: String,
    pub step: usize,
}

impl Fork {
    /// The fork a message starts, if it is a fork's first (its step is the one it names).
    pub fn started_by(properties: &agent_bus::Properties, request: &AgentRequest) -> Option<Fork> {
        let source = properties.get(FORK_OF_PROPERTY)?;
        let source = agent_core::vocab::session_id_of(source).unwrap_or(source);
        let step = properties.get(FORK_STEP_PROPERTY)?.parse::<usize>().ok()?;
        let first = step == agent_core::fork::step_of(request)
            && !source.is_empty()
            && !agent_core::supervisor::is_subagent(request);
        first.then(|| Fork {
            source: source.to_owned(),
            step,
        })
    }

    /// What the fork's input changes in the source's recorded input of the same step, read from
    /// the graph: the graph says what was changed, not the client.
    pub async fn edits(
        &self,
        store: Option<&GraphStore>,
        request: &AgentRequest,
    ) -> Result<Vec<String>, GraphError> {
        let Some(store) = store else {
            return Ok(vec!["unknown: no graph to compare with".to_owned()]);
        };
        Ok(
            match recorded::step_input(store, &self.source, self.step).await? {
                Ok(original) => agent_core::fork::edits(&original, request),
                Err(why) => vec![format!("unknown: {why}")],
            },
        )
    }

    /// Records the fork on its session's root: where it came from, what its input changes there,
    /// what it reuses; and, in a fork past step 1, the observation its first step follows.
    pub fn record(
        &self,
        out: &DialogOutput<'_>,
        uris: &SessionUris,
        request: &AgentRequest,
        edits: &[String],
        reuse: Option<&Reuse>,
    ) {
        let source = SessionUris::new(&self.source);
        let reused = reuse.map_or("", Reuse::label);
        out.keep(provenance::fork(uris, &source, self.step, edits, reused));
        if let Some(last) = request.history.last() {
            let n = self.step.saturating_sub(1);
            out.keep(provenance::fork_observation(
                uris,
                &source,
                n,
                &last.observation,
            ));
        }
    }
}

/// Records step `n`'s own input whole: a dialog's first step that no step of this service queued
/// (a request that names its pattern, a subagent's, a fork's).
pub fn record_own_input(out: &DialogOutput<'_>, uris: &SessionUris, request: &AgentRequest) {
    let input = RecordedInput {
        step: agent_core::fork::step_of(request),
        continues: None,
        request: request.clone(),
    };
    out.keep(provenance::step_input(uris, &input));
}

#[cfg(test)]
mod tests {
    use super::*;
    use agent_core::vocab::SPARQL_PREFIXES;

    /// Records in `store` that step `n` of run `r` asked `digest` and was answered `text`.
    async fn record_call(store: &GraphStore, n: usize, text: &str) {
        let node = agent_core::provenance::SessionUris::new("r").llm_call(n, 0, "d");
        store
            .update(format!(
                "{SPARQL_PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{
                   <{node}> tg:run <urn:trustgraph:agent:r> ; tg:promptDigest \"d\" ;
                     tg:completion \"{{\\\"text\\\":\\\"{text}\\\"}}\" }} }}"
            ))
            .await
            .unwrap();
    }

    async fn calls(kept: &KeptRecords, store: &GraphStore, reuse: &Reuse) -> usize {
        let record = kept.read(store, reuse).await.unwrap();
        record.llm_calls.get("d").map_or(0, Vec::len)
    }

    #[tokio::test]
    async fn an_ended_runs_record_is_kept_and_a_running_ones_read_again() {
        let store = GraphStore::in_memory().unwrap();
        let kept = KeptRecords::default();
        let reuse = Reuse {
            from: "r".into(),
            source: "r".into(),
            llm: true,
            tools: true,
        };
        record_call(&store, 1, "3").await;
        assert_eq!(calls(&kept, &store, &reuse).await, 1);
        // Still running: what it records next is read.
        record_call(&store, 2, "5").await;
        assert_eq!(calls(&kept, &store, &reuse).await, 2);
        store
            .update(format!(
                "{SPARQL_PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{
                   <urn:trustgraph:agent:r/final> a tg:Conclusion }} }}"
            ))
            .await
            .unwrap();
        assert_eq!(calls(&kept, &store, &reuse).await, 2);
        // Ended and kept: the graph is not read again (a call added after the end, which an
        // ended run cannot make, would not show).
        record_call(&store, 3, "6").await;
        assert_eq!(calls(&kept, &store, &reuse).await, 2);
        // Another reuse of the same run is read on its own.
        let llm_only = Reuse {
            tools: false,
            ..reuse.clone()
        };
        assert_eq!(calls(&kept, &store, &llm_only).await, 3);
    }

    #[tokio::test]
    async fn the_records_kept_stay_within_their_bytes() {
        let store = GraphStore::in_memory().unwrap();
        let reuse = |run: &str| Reuse {
            from: run.into(),
            source: run.into(),
            llm: true,
            tools: true,
        };
        for run in ["a", "b", "c", "e"] {
            let node = agent_core::provenance::SessionUris::new(run).llm_call(1, 0, "d");
            let answer = "x".repeat(if run == "c" { 5_000 } else { 400 });
            store
                .update(format!(
                    "{SPARQL_PREFIXES}INSERT DATA {{ GRAPH <urn:graph:retrieval> {{
                       <{node}> tg:run <urn:trustgraph:agent:{run}> ; tg:promptDigest \"d\" ;
                         tg:completion \"{{\\\"text\\\":\\\"{answer}\\\"}}\" .
                       <urn:trustgraph:agent:{run}/final> a tg:Conclusion }} }}"
                ))
                .await
                .unwrap();
        }
        let kept = KeptRecords {
            max_bytes: 1_000,
            ..KeptRecords::default()
        };
        let held = |kept: &KeptRecords| -> Vec<String> {
            let kept = kept.kept.lock().unwrap();
            kept.iter().map(|k| k.reuse.0.clone()).collect()
        };
        kept.read(&store, &reuse("a")).await.unwrap();
        kept.read(&store, &reuse("b")).await.unwrap();
        assert_eq!(held(&kept), ["a", "b"]);
        // Too large for the bound on its own: read, given, not kept, and nothing put out for it.
        let c = kept.read(&store, &reuse("c")).await.unwrap();
        assert!(c.bytes > 1_000);
        assert_eq!(c.llm_calls.get("d").map_or(0, Vec::len), 1);
        assert_eq!(held(&kept), ["a", "b"]);
        // Room is made for one that fits by putting out the oldest: three do not fit together.
        kept.read(&store, &reuse("e")).await.unwrap();
        assert_eq!(held(&kept), ["b", "e"]);
        let total: usize = kept
            .kept
            .lock()
            .unwrap()
            .iter()
            .map(|k| k.record.bytes)
            .sum();
        assert!(total <= 1_000);
    }
}
