//! Declared HTTP tools (`spec.tools.http`): a team's own service as a tool, without an MCP
//! server. Each tool is a name, a description and a JSON schema the model sees, and a request
//! template: method, URL, JSON body and headers ([`crate::validate`] checks them when the spec is
//! validated).
//!
//! A call substitutes the arguments into the templates (percent-encoded in the URL, with their
//! JSON type in the body), sends the request with the tool's time limit, and reads at most
//! `maxResponseBytes` of the answer. The model sees `{"status": 200, "result": <the body>}`, the
//! body parsed when the service says it is JSON, as text otherwise. A missing required argument,
//! a service that is down, an error status, a body too large or JSON that does not parse are
//! tool errors. Header values come from the environment (a Secret on a cluster) and appear in no
//! record, log or error.

use std::sync::Arc;
use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use serde_json::{Map, Value, json};

use super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::{HttpMethod, HttpToolSpec, HttpToolsetSpec, NamedValue};
use crate::template::{Segment, parse_template};

/// What stays unencoded in a substituted URL argument: RFC 3986's unreserved characters. `/`,
/// `?`, `&`, `#` and `=` are encoded, so an argument cannot add path segments or query
/// parameters of its own.
const URL_ARGUMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// Redirects an HTTP tool follows (a loop is a tool error, not a hang).
const MAX_REDIRECTS: usize = 5;

/// Characters of an error body shown to the model.
const ERROR_BODY_CHARS: usize = 500;

/// The tools of one declared toolset.
pub fn tools(group: &HttpToolsetSpec) -> Vec<Arc<dyn Tool>> {
    // Building fails only without a TLS backend, which this build always links.
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::limited(MAX_REDIRECTS))
        .build()
        .unwrap_or_default();
    group
        .tools
        .iter()
        .map(|tool| Arc::new(HttpTool::new(tool.clone(), client.clone())) as Arc<dyn Tool>)
        .collect()
}

/// The value of a header or environment variable: its constant, or the environment variable
/// its `valueFrom` names (an error names the variable, never a value).
pub(crate) fn resolve_value(named: &NamedValue) -> Result<String, String> {
    if let Some(value) = &named.value {
        return Ok(value.clone());
    }
    let variable = named
        .value_from
        .as_ref()
        .and_then(crate::spec::ValueSource::env_var)
        .ok_or_else(|| format!("{:?} has neither value nor valueFrom", named.name))?;
    std::env::var(&variable).map_err(|_| {
        format!(
            "{:?} needs the environment variable {variable}, which is not set",
            named.name
        )
    })
}

/// Checks that every header and variable the declared tools read from the environment is set,
/// so that a run missing one stops before its first conversation (naming the field and the
/// variable), not with a tool error in every call.
pub fn check_values(tools: &crate::spec::ToolsSpec) -> Result<(), String> {
    let mcp = tools.mcp.iter().enumerate().flat_map(|(index, server)| {
        let headers = server.streamable_http.iter().flat_map(|http| &http.headers);
        let env = server.stdio.iter().flat_map(|stdio| &stdio.env);
        headers
            .chain(env)
            .map(move |value| (format!("spec.tools.mcp[{index}]"), value))
    });
    let http = tools.http.iter().enumerate().flat_map(|(index, group)| {
        group
            .tools
            .iter()
            .enumerate()
            .flat_map(move |(tool, spec)| {
                spec.headers
                    .iter()
                    .map(move |value| (format!("spec.tools.http[{index}].tools[{tool}]"), value))
            })
    });
    for (field, value) in mcp.chain(http) {
        resolve_value(value).map_err(|err| format!("{field}: {err}"))?;
    }
    Ok(())
}

/// `text` cut to at most `max_bytes` (on a character boundary), with a marker saying how much
/// was left out.
pub(crate) fn cut_text(text: &str, max_bytes: usize) -> String {
    if text.len() <= max_bytes {
        return text.to_owned();
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}\n[… cut: {} more bytes]", &text[..end], text.len() - end)
}

#[derive(Debug)]
struct HttpTool {
    spec: ToolSpec,
    declaration: HttpToolSpec,
    required: Vec<String>,
    client: reqwest::Client,
}

impl HttpTool {
    fn new(declaration: HttpToolSpec, client: reqwest::Client) -> Self {
        let required = declaration
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|names| {
                names
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default();
        Self {
            spec: ToolSpec {
                name: declaration.name.clone(),
                description: declaration.description.clone(),
                parameters: declaration.parameters.clone(),
            },
            declaration,
            required,
            client,
        }
    }

    async fn run(&self, args: &Map<String, Value>) -> Result<Value, String> {
        if let Some(missing) = self
            .required
            .iter()
            .find(|name| args.get(*name).is_none_or(Value::is_null))
        {
            return Err(format!("missing required argument `{missing}`"));
        }
        let url = substitute_url(&self.declaration.url, args);
        let method = match self.declaration.method {
            HttpMethod::Get => reqwest::Method::GET,
            HttpMethod::Post => reqwest::Method::POST,
            HttpMethod::Put => reqwest::Method::PUT,
            HttpMethod::Patch => reqwest::Method::PATCH,
            HttpMethod::Delete => reqwest::Method::DELETE,
        };
        let mut request = self
            .client
            .request(method, &url)
            .timeout(Duration::from_secs(self.declaration.timeout_seconds));
        for header in &self.declaration.headers {
            request = request.header(&header.name, resolve_value(header)?);
        }
        if let Some(body) = &self.declaration.body {
            request = request.json(&substitute_body(body, args));
        }
        // The URL holds arguments only, never a secret; it is still left out of errors, which
        // name the tool instead.
        let mut response = request
            .send()
            .await
            .map_err(|err| format!("the service did not answer: {}", without_url(&err)))?;
        let status = response.status();
        let is_json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|value| value.to_str().ok())
            .is_some_and(|value| value.contains("json"));
        let limit = usize::try_from(self.declaration.max_response_bytes).unwrap_or(usize::MAX);
        let mut body = Vec::new();
        while let Some(chunk) = response
            .chunk()
            .await
            .map_err(|err| format!("reading the answer failed: {}", without_url(&err)))?
        {
            if body.len() + chunk.len() > limit {
                return Err(format!(
                    "the answer is larger than maxResponseBytes ({limit} bytes)"
                ));
            }
            body.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&body);
        if !status.is_success() {
            let head: String = text.chars().take(ERROR_BODY_CHARS).collect();
            return Err(format!(
                "the service answered HTTP {}: {head}",
                status.as_u16()
            ));
        }
        let result = if is_json {
            serde_json::from_slice(&body)
                .map_err(|err| format!("the service answered invalid JSON: {err}"))?
        } else {
            Value::String(text.into_owned())
        };
        Ok(json!({"status": status.as_u16(), "result": result}))
    }
}

impl Tool for HttpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            match self.run(&args).await {
                Ok(value) => ToolOutcome::Ok(value),
                Err(message) => ToolOutcome::Err(format!("{}: {message}", self.spec.name)),
            }
        })
    }

    /// The service keeps its state outside the workspace.
    fn read_only(&self) -> bool {
        true
    }
}

/// reqwest's error text without the URL it names.
fn without_url(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    if let Some(url) = error.url() {
        text = text.replace(url.as_str(), "<url>");
    }
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// An argument as text: a string as it is, anything else as its JSON, absent as nothing.
fn argument_text(args: &Map<String, Value>, name: &str) -> String {
    match args.get(name) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(text)) => text.clone(),
        Some(other) => other.to_string(),
    }
}

fn substitute_url(template: &str, args: &Map<String, Value>) -> String {
    parse_template(template)
        .into_iter()
        .map(|segment| match segment {
            Segment::Literal(text) => text.to_owned(),
            Segment::Placeholder(name) => {
                utf8_percent_encode(&argument_text(args, name), URL_ARGUMENT).to_string()
            }
        })
        .collect()
}

fn substitute_body(template: &Value, args: &Map<String, Value>) -> Value {
    match template {
        Value::String(text) => match parse_template(text).as_slice() {
            [Segment::Placeholder(name)] => args.get(*name).cloned().unwrap_or(Value::Null),
            segments => Value::String(
                segments
                    .iter()
                    .map(|segment| match segment {
                        Segment::Literal(text) => (*text).to_owned(),
                        Segment::Placeholder(name) => argument_text(args, name),
                    })
                    .collect(),
            ),
        },
        Value::Array(items) => Value::Array(
            items
                .iter()
                .map(|item| substitute_body(item, args))
                .collect(),
        ),
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(key, item)| (key.clone(), substitute_body(item, args)))
                .collect(),
        ),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(value: Value) -> Map<String, Value> {
        let Value::Object(map) = value else {
            panic!("arguments are an object")
        };
        map
    }

    #[test]
    fn url_arguments_are_percent_encoded_and_cannot_add_segments() {
        let given = args(json!({"q": "a b/../c?d=1&e#f", "n": 3, "flag": true}));
        assert_eq!(
            substitute_url("http://svc/x/{q}?n={n}&f={flag}&o={absent}", &given),
            "http://svc/x/a%20b%2F..%2Fc%3Fd%3D1%26e%23f?n=3&f=true&o="
        );
    }

    #[test]
    fn body_placeholders_keep_their_json_type() {
        let given = args(json!({"id": 7, "tags": ["a"], "name": "x\"y"}));
        let body = json!({"id": "{id}", "tags": "{tags}", "label": "item {id}: {name}",
                          "missing": "{absent}", "fixed": [1, "{name}"]});
        assert_eq!(
            substitute_body(&body, &given),
            json!({"id": 7, "tags": ["a"], "label": "item 7: x\"y", "missing": null,
                   "fixed": [1, "x\"y"]})
        );
    }

    #[test]
    fn text_is_cut_on_a_character_boundary() {
        assert_eq!(cut_text("héllo", 2), "h\n[… cut: 5 more bytes]");
        assert_eq!(cut_text("abc", 3), "abc");
    }
}
