//! Any SPARQL 1.1 endpoint over HTTP: the Protocol for queries and updates, the Graph Store Protocol
//! for bulk loads. The base URL serves `/query`, `/update` and `/store` (Oxigraph server's layout, and
//! the aggregator's).

use std::collections::BTreeMap;
use std::time::Duration;

use oxigraph::model::{GraphName, Quad};
use oxigraph::sparql::results::{QueryResultsFormat, QueryResultsParser};

use crate::{collect, GraphError, QueryAnswer};

/// A remote SPARQL endpoint.
pub struct RemoteSparql {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl RemoteSparql {
    pub fn new(base: &str, token: Option<String>) -> Result<RemoteSparql, GraphError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| GraphError::Transport(e.to_string()))?;
        Ok(RemoteSparql {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token: token.filter(|t| !t.is_empty()),
        })
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let request = self.http.post(format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    async fn send(request: reqwest::RequestBuilder) -> Result<Body, GraphError> {
        let response = request
            .send()
            .await
            .map_err(|e| GraphError::Transport(e.to_string()))?;
        let status = response.status();
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let body = response
            .bytes()
            .await
            .map_err(|e| GraphError::Transport(e.to_string()))?;
        if !status.is_success() {
            return Err(GraphError::Http {
                status: status.as_u16(),
                body: String::from_utf8_lossy(&body).chars().take(500).collect(),
            });
        }
        Ok(Body {
            content_type,
            bytes: body.to_vec(),
        })
    }

    pub async fn query(&self, sparql: &str) -> Result<QueryAnswer, GraphError> {
        let request = self
            .post("/query")
            .header(reqwest::header::CONTENT_TYPE, "application/sparql-query")
            .header(
                reqwest::header::ACCEPT,
                "application/sparql-results+json, application/n-triples;q=0.9",
            )
            .body(sparql.to_owned());
        let body = Self::send(request).await?;
        if body.content_type.starts_with("application/n-triples") {
            let parser = oxigraph::io::RdfParser::from_format(oxigraph::io::RdfFormat::NTriples);
            let triples = parser
                .for_slice(&body.bytes)
                .map(|q| q.map(oxigraph::model::Triple::from))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| GraphError::Malformed(e.to_string()))?;
            return Ok(QueryAnswer::Graph(triples));
        }
        let parsed = QueryResultsParser::from_format(QueryResultsFormat::Json)
            .for_slice(&body.bytes)
            .map_err(|e| GraphError::Malformed(e.to_string()))?;
        collect(parsed.into())
    }

    pub async fn update(&self, sparql: &str) -> Result<(), GraphError> {
        let request = self
            .post("/update")
            .header(reqwest::header::CONTENT_TYPE, "application/sparql-update")
            .body(sparql.to_owned());
        Self::send(request).await.map(|_| ())
    }

    /// Bulk load through the Graph Store Protocol, one request per named graph.
    pub async fn insert(&self, quads: &[Quad]) -> Result<(), GraphError> {
        let mut by_graph: BTreeMap<Option<String>, String> = BTreeMap::new();
        for quad in quads {
            let graph = match &quad.graph_name {
                GraphName::NamedNode(n) => Some(n.as_str().to_owned()),
                _ => None,
            };
            let body = by_graph.entry(graph).or_default();
            body.push_str(&format!(
                "{} {} {} .\n",
                quad.subject, quad.predicate, quad.object
            ));
        }
        for (graph, body) in by_graph {
            self.load(body.into_bytes(), "application/n-triples", graph.as_deref())
                .await?;
        }
        Ok(())
    }

    pub async fn load(
        &self,
        data: Vec<u8>,
        format: &str,
        graph: Option<&str>,
    ) -> Result<(), GraphError> {
        let request = self.post("/store");
        let request = match graph {
            Some(g) => request.query(&[("graph", g)]),
            None => request.query(&[("default", "")]),
        };
        let request = request
            .header(reqwest::header::CONTENT_TYPE, format.to_owned())
            .body(data);
        Self::send(request).await.map(|_| ())
    }
}

/// A successful response.
struct Body {
    content_type: String,
    bytes: Vec<u8>,
}
