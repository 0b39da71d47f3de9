//! TrustGraph's librarian protocol (trustgraph-base 2.11, `schema/documents.py`): the part this
//! service uses as a client, to keep a long text as a document and read it back. Requests go to
//! `non-persistent://tg/request/librarian:{workspace}`, answers come on the response topic with the
//! request's `id` property. `content` is base64 both ways.

use serde::{Deserialize, Serialize};

use crate::ErrorInfo;

/// Operations of [`LibrarianRequest`] this service sends.
pub mod librarian_operation {
    pub const ADD_DOCUMENT: &str = "add-document";
    pub const GET_DOCUMENT_CONTENT: &str = "get-document-content";
}

/// A request to the librarian; fields it does not need are left out.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LibrarianRequest {
    pub operation: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub document_metadata: Option<DocumentMetadata>,
    /// The document's bytes, base64.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// What the librarian knows of a document. Its `id` is the document's IRI.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct DocumentMetadata {
    pub id: String,
    /// Seconds since the epoch.
    pub time: u64,
    /// The MIME type.
    pub kind: String,
    pub title: String,
    pub comments: String,
    pub tags: Vec<String>,
}

/// The librarian's answer, correlated by the `id` property.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LibrarianResponse {
    pub error: Option<ErrorInfo>,
    pub document_metadata: Option<DocumentMetadata>,
    /// The document's bytes, base64.
    pub content: Option<String>,
}
