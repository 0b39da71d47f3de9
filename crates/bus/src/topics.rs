//! Topic names. Defaults follow TrustGraph's scheme so this service is a drop-in, except that the
//! request topic is persistent: an iteration in flight must survive a broker or process restart.

/// The topics of one workspace and flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topics {
    pub request: String,
    pub response: String,
    pub explainability: String,
    pub dead_letter: String,
    /// The config service's protocol (one per deployment, as in TrustGraph, not per flow).
    pub config_request: String,
    pub config_response: String,
    /// Change notifications after every config write (TrustGraph 2.x: `notify:tg:config`).
    pub config_push: String,
}

impl Topics {
    /// TrustGraph's names for `workspace`/`flow` (`{class}:tg:{service}:{workspace}:{flow}`).
    ///
    /// ```
    /// let t = agent_bus::Topics::trustgraph("default", "default");
    /// assert_eq!(t.request, "persistent://tg/request/agent:default:default");
    /// assert_eq!(t.response, "non-persistent://tg/response/agent:default:default");
    /// ```
    pub fn trustgraph(workspace: &str, flow: &str) -> Topics {
        Topics {
            request: format!("persistent://tg/request/agent:{workspace}:{flow}"),
            response: format!("non-persistent://tg/response/agent:{workspace}:{flow}"),
            explainability: format!("persistent://tg/flow/triples-store:{workspace}:{flow}"),
            dead_letter: format!("persistent://tg/dead-letter/agent:{workspace}:{flow}"),
            config_request: "non-persistent://tg/request/config".to_owned(),
            config_response: "non-persistent://tg/response/config".to_owned(),
            config_push: "non-persistent://tg/notify/config".to_owned(),
        }
    }
}
