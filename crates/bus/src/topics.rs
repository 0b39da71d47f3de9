//! Topic names. Defaults follow TrustGraph's scheme so this service is a drop-in. Requests are
//! taken on two topics: TrustGraph's own (non-persistent, where its clients publish) and a
//! persistent one that carries every later iteration, which must survive a broker or process
//! restart.

/// The topics of one workspace and flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    /// Where iterations go (and durable clients may publish): persistent.
    pub request: String,
    /// Where TrustGraph's clients publish a dialog's first message (its non-persistent request
    /// topic); empty when not consumed.
    pub client_request: String,
    pub response: String,
    pub explainability: String,
    pub dead_letter: String,
    /// The config service's protocol (one per deployment, as in TrustGraph, not per flow).
    pub config_request: String,
    pub config_response: String,
    /// Change notifications after every config write (TrustGraph 2.x: `notify:tg:config`).
    pub config_push: String,
    /// Run control (cancel): non-persistent, heard by every orchestrator replica, each on its
    /// own subscription; the durable record of a control is the provenance graph.
    pub control: String,
    /// Answers to approvals: persistent, taken up by one orchestrator replica.
    pub control_request: String,
    /// TrustGraph's librarian (its document store), per workspace: non-persistent, as TrustGraph's.
    pub librarian_request: String,
    pub librarian_response: String,
}

impl Topics {
    /// TrustGraph's names for `workspace`/`flow` (`{class}:tg:{service}:{workspace}:{flow}`).
    ///
    /// ```
    /// let t = agent_bus::Topics::trustgraph("default", "default");
    /// assert_eq!(t.request, "persistent://tg/request/agent:default:default");
    /// assert_eq!(t.client_request, "non-persistent://tg/request/agent:default:default");
    /// assert_eq!(t.response, "non-persistent://tg/response/agent:default:default");
    /// ```
    pub fn trustgraph(workspace: &str, flow: &str) -> Topics {
        Topics {
            request: format!("persistent://tg/request/agent:{workspace}:{flow}"),
            client_request: format!("non-persistent://tg/request/agent:{workspace}:{flow}"),
            response: format!("non-persistent://tg/response/agent:{workspace}:{flow}"),
            explainability: format!("persistent://tg/flow/triples-store:{workspace}:{flow}"),
            dead_letter: format!("persistent://tg/dead-letter/agent:{workspace}:{flow}"),
            config_request: "non-persistent://tg/request/config".to_owned(),
            config_response: "non-persistent://tg/response/config".to_owned(),
            config_push: "non-persistent://tg/notify/config".to_owned(),
            control: format!("non-persistent://tg/notify/agent-control:{workspace}:{flow}"),
            control_request: format!("persistent://tg/request/agent-control:{workspace}:{flow}"),
            librarian_request: format!("non-persistent://tg/request/librarian:{workspace}"),
            librarian_response: format!("non-persistent://tg/response/librarian:{workspace}"),
        }
    }
}

/// Where a service dead-letters what it takes from `topic`: a persistent topic (a broker keeps
/// nothing of a non-persistent one) of the same name in its tenant's `dead-letter` namespace,
/// whose dead letters the deployments keep a week (pulsar-init's message TTL there); a name of
/// another shape gets `-dead-letter` after it.
///
/// ```
/// use agent_bus::dead_letter_of;
/// assert_eq!(
///     dead_letter_of("persistent://tg/flow/triples-store:default:default"),
///     "persistent://tg/dead-letter/triples-store:default:default"
/// );
/// assert_eq!(dead_letter_of("non-persistent://tg/request/config"), "persistent://tg/dead-letter/config");
/// assert_eq!(dead_letter_of("my-topic"), "persistent://my-topic-dead-letter");
/// ```
pub fn dead_letter_of(topic: &str) -> String {
    let name = topic.split_once("://").map_or(topic, |(_, name)| name);
    match name.split('/').collect::<Vec<_>>()[..] {
        [tenant, _namespace, local] => format!("persistent://{tenant}/dead-letter/{local}"),
        _ => format!("persistent://{name}-dead-letter"),
    }
}
