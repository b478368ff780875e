//! The `web` toolset: `web_search` (through the search backend of `spec.tools.web.search`) and
//! `web_extract` (the worker fetches each page itself, takes its main text by Readability and
//! writes it as Markdown); and the `search` toolset, `web_search` alone, as the reference's (its
//! `browser_tasks` draws it with `browser`, which does not carry `web_search`).
//!
//! Names, argument schemas, descriptions and result shapes are hermes-agent's
//! (`tools/web_tools.py`), so that trajectories of both mix in one training set: a search answers
//! `{"success": true, "data": {"web": [{title, url, description, position}]}}`, an extraction
//! `{"results": [{url, title, content, error}]}`, both as two-space-indented JSON as the reference
//! prints them. Every failure of a backend or a page (down, garbage, too slow, too big, a redirect
//! loop, a binary or PDF body) is a tool error the model reads; nothing here panics or waits
//! without a limit.
//!
//! ```text
//! web_search ─ query ─▶ backend (searxng | json) ─▶ results by JSON pointers ─▶ first N
//! web_extract ─ urls ─▶ guard (scheme, address) ─▶ fetch (time, bytes, redirects)
//!               ─▶ html: Readability → Markdown │ text: as is │ PDF, binary: refused ─▶ cap
//! ```

mod extract;
pub(crate) mod guard;
mod search;

use std::sync::Arc;

use super::Tool;
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "web";
/// The toolset of `web_search` alone.
pub const SEARCH_TOOLSET: &str = "search";

/// Why the toolset cannot be built from a run's settings (the run is refused before it starts).
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    #[error("spec.tools.web.search is not set: configure a search backend")]
    NotConfigured,
    #[error("spec.tools.web.search.apiKeyEnv names the environment variable {0}, which is not set")]
    MissingKey(String),
    #[error("the API key of spec.tools.web.search holds characters no HTTP header may carry")]
    BadKey,
    #[error("spec.tools.web.search.apiKeyHeader: {0:?} is not a valid HTTP header name")]
    BadHeader(String),
    #[error("cannot build the HTTP client of the web tools: {0}")]
    Client(#[source] reqwest::Error),
}

/// The toolset's tools, in the order the model is shown them (the reference's).
pub fn tools(config: &ToolsSpec) -> Result<Vec<Arc<dyn Tool>>, WebError> {
    let search = config.web.search.as_ref().ok_or(WebError::NotConfigured)?;
    Ok(vec![
        Arc::new(search::WebSearch::new(search)?),
        Arc::new(extract::WebExtract::new(&config.web.extract)?),
    ])
}

/// The `search` toolset's one tool, `web_search`, on the same backend as `web`'s.
pub fn search_tools(config: &ToolsSpec) -> Result<Vec<Arc<dyn Tool>>, WebError> {
    let search = config.web.search.as_ref().ok_or(WebError::NotConfigured)?;
    Ok(vec![Arc::new(search::WebSearch::new(search)?)])
}

/// Pretty JSON as the reference's `json.dumps(..., indent=2, ensure_ascii=False)` writes it.
pub(crate) fn reference_json(value: &serde_json::Value) -> String {
    // Serialising a `Value` cannot fail: its keys are strings.
    serde_json::to_string_pretty(value).expect("a JSON value serialises")
}

/// An error with its causes, as the model is shown it (reqwest's top-level message alone is
/// often just "error sending request").
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = cause.source();
    }
    message
}

/// Reads at most `limit` bytes of a response body; `true` when the body was longer.
pub(crate) async fn read_capped(
    response: &mut reqwest::Response,
    limit: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = limit - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}
