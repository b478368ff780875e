//! `web_search`: one GET to the configured backend, its results picked out by JSON pointers and
//! shown in the reference's shape.

use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use serde_json::{Map, Value, json};

use super::super::args::non_empty_string_arg;
use super::super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use super::{WebError, error_chain, read_capped, reference_json};
use crate::contract::env;
use crate::spec::{WebSearchBackend, WebSearchSpec};

/// A backend's answer larger than this is garbage for a list of a few results.
const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;

/// Longest query passed on: a search box, not a document.
const MAX_QUERY_CHARS: usize = 2000;

/// The reference's description, word for word.
const DESCRIPTION: &str = "Search the web for information on any topic. Returns up to 5 relevant results with titles, URLs, and descriptions.";

/// A backend's API key. Its `Debug` never shows the value.
struct Key {
    header: HeaderName,
    value: HeaderValue,
    plain: String,
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({}: <redacted>)", self.header)
    }
}

#[derive(Debug)]
pub(super) struct WebSearch {
    spec: ToolSpec,
    config: WebSearchSpec,
    client: reqwest::Client,
    key: Option<Key>,
}

impl WebSearch {
    pub(super) fn new(config: &WebSearchSpec) -> Result<Self, WebError> {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.timeout_seconds))
            .redirect(reqwest::redirect::Policy::limited(3))
            .user_agent(concat!("trajectory-worker/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(WebError::Client)?;
        Ok(Self {
            spec: ToolSpec {
                name: "web_search".to_owned(),
                description: DESCRIPTION.to_owned(),
                parameters: json!({
                    "type": "object",
                    "properties": {
                        "query": {
                            "type": "string",
                            "description": "The search query to look up on the web"
                        }
                    },
                    "required": ["query"]
                }),
            },
            key: key(config)?,
            config: config.clone(),
            client,
        })
    }

    /// The request URL of a query.
    fn request_url(&self, query: &str) -> Result<url::Url, String> {
        let limit = self.config.max_results.to_string();
        let url = match self.config.backend {
            WebSearchBackend::Searxng => {
                let base = self.config.url.trim_end_matches('/');
                let mut url = url::Url::parse(&format!("{base}/search"))
                    .map_err(|err| format!("spec.tools.web.search.url is not a URL: {err}"))?;
                url.query_pairs_mut()
                    .append_pair("q", query)
                    .append_pair("format", "json");
                url
            }
            WebSearchBackend::Json => {
                let encoded: String =
                    url::form_urlencoded::byte_serialize(query.as_bytes()).collect();
                let text = self
                    .config
                    .url
                    .replace("{query}", &encoded)
                    .replace("{limit}", &limit);
                url::Url::parse(&text)
                    .map_err(|err| format!("spec.tools.web.search.url is not a URL: {err}"))?
            }
        };
        Ok(url)
    }

    async fn search(&self, query: &str) -> Result<Value, String> {
        let url = self.request_url(query)?;
        let mut request = self
            .client
            .get(url)
            .header(reqwest::header::ACCEPT, "application/json");
        if let Some(key) = &self.key {
            request = request.header(key.header.clone(), key.value.clone());
        }
        let mut response = request.send().await.map_err(|err| error_chain(&err))?;
        let status = response.status();
        let (body, cut) = read_capped(&mut response, MAX_ANSWER_BYTES)
            .await
            .map_err(|err| error_chain(&err))?;
        if !status.is_success() {
            return Err(format!(
                "the search backend answered HTTP {status}: {}",
                excerpt(&body)
            ));
        }
        if cut {
            return Err(format!(
                "the search backend's answer is larger than {MAX_ANSWER_BYTES} bytes"
            ));
        }
        let answer: Value = serde_json::from_slice(&body).map_err(|err| {
            format!(
                "the search backend's answer is not JSON ({err}): {}",
                excerpt(&body)
            )
        })?;
        let results = answer
            .pointer(&self.config.results_pointer)
            .and_then(Value::as_array)
            .ok_or_else(|| {
                format!(
                    "the search backend's answer has no result list at {:?}",
                    self.config.results_pointer
                )
            })?;
        let field = |result: &Value, pointer: &str| match result.pointer(pointer) {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Null) | None => String::new(),
            Some(other) => other.to_string(),
        };
        let web: Vec<Value> = results
            .iter()
            .map(|result| {
                (
                    field(result, &self.config.title_pointer),
                    field(result, &self.config.url_pointer),
                    field(result, &self.config.snippet_pointer),
                )
            })
            .filter(|(_, url, _)| !url.is_empty())
            .take(self.config.max_results as usize)
            .enumerate()
            .map(|(index, (title, url, description))| {
                json!({"title": title, "url": url, "description": description, "position": index + 1})
            })
            .collect();
        Ok(json!({"success": true, "data": {"web": web}}))
    }

    /// Removes the key from a message, in case a backend echoes it back.
    fn redact(&self, message: String) -> String {
        match &self.key {
            Some(key) if !key.plain.is_empty() && message.contains(&key.plain) => {
                message.replace(&key.plain, "<redacted>")
            }
            _ => message,
        }
    }
}

impl Tool for WebSearch {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn read_only(&self) -> bool {
        true
    }

    fn call<'a>(&'a self, args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            let query = match non_empty_string_arg(&args, "query") {
                Ok(query) => query,
                Err(message) => return ToolOutcome::Err(message),
            };
            if query.chars().count() > MAX_QUERY_CHARS {
                return ToolOutcome::Err(format!(
                    "argument `query` is longer than {MAX_QUERY_CHARS} characters"
                ));
            }
            match self.search(query).await {
                Ok(value) => ToolOutcome::Ok(Value::String(reference_json(&value))),
                Err(message) => {
                    tracing::debug!(tool = "web_search", error = %self.redact(message.clone()), "search failed");
                    ToolOutcome::Err(self.redact(format!("Error searching web: {message}")))
                }
            }
        })
    }
}

/// The backend's key, by the rules of the model's: the variable the spec names (local runs),
/// else the contract's variable, which the operator fills from `apiKeySecretRef`.
fn key(config: &WebSearchSpec) -> Result<Option<Key>, WebError> {
    let plain = if let Some(name) = &config.api_key_env {
        match std::env::var(name) {
            Ok(key) if !key.trim().is_empty() => Some(key.trim().to_owned()),
            _ => return Err(WebError::MissingKey(name.clone())),
        }
    } else {
        std::env::var(env::WEB_SEARCH_API_KEY)
            .ok()
            .map(|key| key.trim().to_owned())
            .filter(|key| !key.is_empty())
    };
    let Some(plain) = plain else {
        return Ok(None);
    };
    let (header, text) = match &config.api_key_header {
        Some(name) => (
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| WebError::BadHeader(name.clone()))?,
            plain.clone(),
        ),
        None => (reqwest::header::AUTHORIZATION, format!("Bearer {plain}")),
    };
    let mut value = HeaderValue::from_str(&text).map_err(|_| WebError::BadKey)?;
    value.set_sensitive(true);
    Ok(Some(Key {
        header,
        value,
        plain,
    }))
}

/// The start of a body, for an error message.
fn excerpt(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(&body[..body.len().min(200)]);
    let text: String = text.chars().filter(|c| !c.is_control()).collect();
    if body.len() > 200 {
        format!("{text}…")
    } else {
        text
    }
}
