//! MCP servers as toolsets (`spec.tools.mcp`), through the official Rust SDK (`rmcp`).
//!
//! ```text
//!  plan:  discover() ── tools/list ──► FrozenServer {server, tools} ──► manifest.json
//!  batch: manifest ──► McpTool (one per frozen tool) ──► McpServer (one session per process)
//!                                                         └── tools/call ──► the server
//! ```
//!
//! A server's tools are listed once, by `plan`, and frozen into the manifest: every batch pod, and
//! so every record of a run, sees the same tools (and `tool_stats` keys), whatever the server
//! lists later. A batch calls the frozen tools; one the server no longer has is a tool error
//! (the server's own). The model sees each tool as `mcp__<server>__<tool>` with the server's
//! description and input schema, as hermes-agent offers them, and results in hermes-agent's shape:
//! `{"result": text}` (text blocks joined by newlines), `{"result": text, "structuredContent": v}`
//! or `{"result": v}` when there is structured content, `{"error": text}` when the server says
//! `isError`.
//!
//! Every failure is a tool error, never a crash or a hang: a call has a time limit; a server
//! that died is reconnected (a stdio one started again) once per call, then the call fails; JSON-RPC
//! errors and garbage are reported. The session is shared by every conversation of the process
//! (the SDK multiplexes requests).
//!
//! A stdio server gets an environment of `PATH` plus what the spec lists: never the worker's
//! own, which holds the model's API key. Where it runs:
//! - in a pod (the worker has `TRAJ_SANDBOX_SOCKET`: a generation pod, or a plan pod of a run
//!   with stdio servers), in the sandbox container, through a session of its executor
//!   ([`Sandbox::start_session`]): confined like a command (no capabilities, Landlock with the
//!   system read-only and a private directory of its own), beside neither the worker's secrets
//!   nor its storage. Its stdin and stdout are the session's stream, its stderr is kept for
//!   error messages, and closing the session ends it with everything it started;
//! - locally, as a child of the worker in its own process group (killed whole with its
//!   session). Not under the local executor: a server installed under the home directory (npx's
//!   cache, a virtualenv) would be refused its own files by Landlock.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use process_wrap::tokio::{CommandWrap, ProcessGroup};
use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock, ResourceContents};
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::{StreamableHttpClientTransport, TokioChildProcess};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};
use tokio::time::{Instant, timeout_at};
use tracing::{info, warn};

use super::http::{cut_text, resolve_value};
use super::sandbox::{Sandbox, SessionEnd};
use super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::McpServerSpec;

/// Tools one server may list; more is a misbehaving server, refused at discovery.
const MAX_TOOLS_PER_SERVER: usize = 256;

/// Characters kept of an error text a server sends.
const MAX_ERROR_CHARS: usize = 2000;

/// Used when the worker itself has no `PATH`.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// What discovery found on one server, as the manifest keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FrozenServer {
    /// The server's `name` in the spec (its toolset).
    pub server: String,
    pub tools: Vec<FrozenTool>,
}

/// One tool as the server listed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FrozenTool {
    /// The server's own name of the tool (what `tools/call` sends).
    pub name: String,
    pub description: String,
    pub input_schema: Value,
}

/// Why a server could not be reached or listed.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    #[error("spec.tools.mcp {server:?}: {message}")]
    Server { server: String, message: String },
}

type Session = RunningService<RoleClient, ()>;

/// One declared server and the process's session with it (opened on first use).
pub struct McpServer {
    spec: McpServerSpec,
    /// Where a stdio server runs: in this sandbox's sessions, or (none) as the worker's child.
    sandbox: Option<Sandbox>,
    session: tokio::sync::Mutex<Option<Arc<Session>>>,
}

impl fmt::Debug for McpServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpServer")
            .field("name", &self.spec.name)
            .finish_non_exhaustive()
    }
}

/// `mcp__<server>__<tool>`, every character outside `[A-Za-z0-9_]` written `_` (hermes-agent's
/// `mcp_prefixed_tool_name`).
pub fn offered_name(server: &str, tool: &str) -> String {
    let clean = |text: &str| -> String {
        text.chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect()
    };
    format!("mcp__{}__{}", clean(server), clean(tool))
}

impl McpServer {
    /// A server whose stdio program (if it is one) is a child of the worker.
    pub fn new(spec: McpServerSpec) -> Self {
        Self::in_sandbox(spec, None)
    }

    /// A server whose stdio program runs in `sandbox`'s sessions (when given).
    pub fn in_sandbox(spec: McpServerSpec, sandbox: Option<Sandbox>) -> Self {
        Self {
            spec,
            sandbox,
            session: tokio::sync::Mutex::new(None),
        }
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    fn error(&self, message: impl Into<String>) -> McpError {
        McpError::Server {
            server: self.spec.name.clone(),
            message: message.into(),
        }
    }

    /// Lists the server's tools (for the plan).
    pub async fn discover(&self) -> Result<FrozenServer, McpError> {
        let deadline = Instant::now() + Duration::from_secs(self.spec.connect_timeout_seconds);
        let listed = timeout_at(deadline, async {
            let session = self.session().await.map_err(|err| self.error(err))?;
            session
                .peer()
                .list_all_tools()
                .await
                .map_err(|err| self.error(format!("listing its tools failed: {err}")))
        })
        .await
        .map_err(|_| {
            self.error(format!(
                "did not start and list its tools within connectTimeoutSeconds ({})",
                self.spec.connect_timeout_seconds
            ))
        })??;
        if listed.len() > MAX_TOOLS_PER_SERVER {
            return Err(self.error(format!(
                "lists {} tools, more than the {MAX_TOOLS_PER_SERVER} a server may offer",
                listed.len()
            )));
        }
        let tools = listed
            .into_iter()
            .map(|tool| FrozenTool {
                description: tool.description.as_deref().map_or_else(
                    || format!("MCP tool {} from {}", tool.name, self.spec.name),
                    strip_unicode_tags,
                ),
                input_schema: normalise_schema(Value::Object((*tool.input_schema).clone())),
                name: tool.name.into_owned(),
            })
            .collect();
        Ok(FrozenServer {
            server: self.spec.name.clone(),
            tools,
        })
    }

    /// The open session, or a new one.
    async fn session(&self) -> Result<Arc<Session>, String> {
        let mut current = self.session.lock().await;
        if let Some(session) = current.as_ref()
            && !session.is_closed()
        {
            return Ok(Arc::clone(session));
        }
        let session = Arc::new(connect(&self.spec, self.sandbox.as_ref()).await?);
        info!(server = %self.spec.name, "MCP session opened");
        *current = Some(Arc::clone(&session));
        Ok(session)
    }

    /// Forgets `dead` (unless another call already replaced it), so the next call reconnects.
    async fn forget(&self, dead: &Arc<Session>) {
        let mut current = self.session.lock().await;
        if current
            .as_ref()
            .is_some_and(|session| Arc::ptr_eq(session, dead))
        {
            *current = None;
        }
    }

    /// Calls `tool` (the server's name of it); every failure becomes a tool error.
    pub async fn call(&self, tool: &str, arguments: Map<String, Value>) -> ToolOutcome {
        let name = &self.spec.name;
        let limit = self.spec.timeout_seconds;
        let connect_limit = Duration::from_secs(self.spec.connect_timeout_seconds);
        let timed_out = || {
            ToolOutcome::Err(format!(
                "the MCP server {name:?} did not answer within {limit} seconds"
            ))
        };
        // A server that died is started (or reconnected) again once per call. Starting it is
        // bounded by connectTimeoutSeconds, the call itself by timeoutSeconds.
        for attempt in 0..2 {
            let session = match tokio::time::timeout(connect_limit, self.session()).await {
                Err(_) => {
                    return ToolOutcome::Err(format!(
                        "the MCP server {name:?} did not start within {} seconds",
                        connect_limit.as_secs()
                    ));
                }
                Ok(Err(error)) => {
                    return ToolOutcome::Err(format!(
                        "the MCP server {name:?} is unavailable: {error}"
                    ));
                }
                Ok(Ok(session)) => session,
            };
            let params =
                CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments.clone());
            let deadline = Instant::now() + Duration::from_secs(limit);
            match timeout_at(deadline, session.peer().call_tool(params)).await {
                Err(_) => return timed_out(),
                Ok(Ok(result)) => return render(result, self.max_result_bytes()),
                Ok(Err(ServiceError::McpError(error))) => {
                    return ToolOutcome::Err(format!(
                        "the MCP server {name:?} refused the call: {}",
                        cut_chars(&error.message, MAX_ERROR_CHARS)
                    ));
                }
                Ok(Err(error)) => {
                    warn!(server = %name, attempt, "MCP call failed: {error}");
                    self.forget(&session).await;
                    if attempt == 1 {
                        return ToolOutcome::Err(format!(
                            "the MCP server {name:?} failed: {}",
                            cut_chars(&error.to_string(), MAX_ERROR_CHARS)
                        ));
                    }
                }
            }
        }
        unreachable!("the second attempt always returns")
    }

    fn max_result_bytes(&self) -> usize {
        usize::try_from(self.spec.max_result_bytes).unwrap_or(usize::MAX)
    }

    /// Closes the session (a stdio server is stopped).
    pub async fn close(&self) {
        if let Some(session) = self.session.lock().await.take()
            && let Ok(mut session) = Arc::try_unwrap(session)
        {
            let _ = session.close_with_timeout(Duration::from_secs(5)).await;
        }
    }
}

/// Opens a session: starts the stdio server (in `sandbox` when given), or connects to the HTTP
/// one, and initialises it.
async fn connect(spec: &McpServerSpec, sandbox: Option<&Sandbox>) -> Result<Session, String> {
    if let Some(http) = &spec.streamable_http {
        let mut headers = HashMap::new();
        for header in &http.headers {
            let value = resolve_value(header)?;
            let name = reqwest::header::HeaderName::try_from(header.name.as_str())
                .map_err(|_| format!("{:?} is not a valid header name", header.name))?;
            let value = reqwest::header::HeaderValue::try_from(value)
                .map_err(|_| format!("the value of header {:?} is not valid", header.name))?;
            headers.insert(name, value);
        }
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(spec.connect_timeout_seconds))
            .build()
            .map_err(|err| format!("cannot build an HTTP client: {err}"))?;
        let config = StreamableHttpClientTransportConfig::with_uri(http.url.as_str())
            .custom_headers(headers)
            // Larger answers are refused by the SDK before they are decoded; the model is shown
            // at most maxResultBytes of what fits.
            .max_json_response_size(
                usize::try_from(spec.max_result_bytes)
                    .unwrap_or(usize::MAX)
                    .saturating_mul(16)
                    .max(1 << 20),
            );
        let transport = StreamableHttpClientTransport::with_client(client, config);
        return ().serve(transport).await.map_err(|err| err.to_string());
    }
    let Some(stdio) = &spec.stdio else {
        return Err("no transport is set (streamableHttp or stdio)".to_owned());
    };
    if let Some(sandbox) = sandbox {
        let mut env = std::collections::BTreeMap::new();
        for variable in &stdio.env {
            env.insert(variable.name.clone(), resolve_value(variable)?);
        }
        let argv = std::iter::once(stdio.command.clone())
            .chain(stdio.args.iter().cloned())
            .collect();
        let session = sandbox
            .start_session(&sandbox.session_request(argv, env))
            .await
            .map_err(|err| format!("cannot start {:?} in the sandbox: {err}", stdio.command))?;
        let end = session.end.clone();
        return ().serve(tokio::io::split(session.stdio))
            .await
            .map_err(|err| with_stderr(&err.to_string(), &end));
    }
    let mut command = tokio::process::Command::new(&stdio.command);
    command.args(&stdio.args).env_clear().env(
        "PATH",
        std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into()),
    );
    for variable in &stdio.env {
        command.env(&variable.name, resolve_value(variable)?);
    }
    command.kill_on_drop(true);
    let mut wrapped = CommandWrap::from(command);
    wrapped.wrap(ProcessGroup::leader());
    let (transport, _) = TokioChildProcess::builder(wrapped)
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|err| format!("cannot start {:?}: {err}", stdio.command))?;
    ().serve(transport).await.map_err(|err| err.to_string())
}

/// `message`, with why the sandboxed server ended if it did (its exit code and the end of its
/// standard error: a missing program, a crash at start-up).
fn with_stderr(message: &str, end: &SessionEnd) -> String {
    let Some(ended) = end.ended() else {
        return message.to_owned();
    };
    let stderr = end.stderr_tail();
    let stderr = cut_chars(stderr.trim(), MAX_ERROR_CHARS);
    format!("{message} (the server ended: {ended:?}; its stderr: {stderr:?})")
}

/// The tool response: hermes-agent's shape, cut to `max_bytes`.
fn render(result: CallToolResult, max_bytes: usize) -> ToolOutcome {
    let text: Vec<String> = result.content.iter().map(block_text).collect();
    let text = cut_text(&text.join("\n"), max_bytes);
    if result.is_error == Some(true) {
        return ToolOutcome::Err(if text.is_empty() {
            "the tool reported an error without a message".to_owned()
        } else {
            text
        });
    }
    let structured = result.structured_content.map(|value| {
        let serialised = value.to_string();
        if serialised.len() > max_bytes {
            Value::String(cut_text(&serialised, max_bytes))
        } else {
            value
        }
    });
    ToolOutcome::Ok(match structured {
        Some(structured) if !text.is_empty() => {
            json!({"result": text, "structuredContent": structured})
        }
        Some(structured) => json!({ "result": structured }),
        None => json!({ "result": text }),
    })
}

/// A content block as text: text as it is, other kinds named (their bytes are no use to a
/// text model and would flood its context).
fn block_text(block: &ContentBlock) -> String {
    match block {
        ContentBlock::Text(text) => text.text.clone(),
        ContentBlock::Image(image) => format!("[image: {}]", image.mime_type),
        ContentBlock::Audio(audio) => format!("[audio: {}]", audio.mime_type),
        ContentBlock::Resource(resource) => match &resource.resource {
            ResourceContents::TextResourceContents { text, .. } => text.clone(),
            ResourceContents::BlobResourceContents { uri, .. } => format!("[resource: {uri}]"),
            _ => "[resource]".to_owned(),
        },
        ContentBlock::ResourceLink(link) => format!("[resource link: {}]", link.uri),
        // Kinds of a later protocol version.
        _ => "[content]".to_owned(),
    }
}

/// Removes Unicode tag characters (U+E0000 to U+E007F): invisible text a server could hide
/// instructions in (hermes-agent strips them too).
fn strip_unicode_tags(text: &str) -> String {
    text.chars()
        .filter(|c| !('\u{E0000}'..='\u{E007F}').contains(c))
        .collect()
}

/// An input schema every provider accepts: an object schema with `properties`.
fn normalise_schema(schema: Value) -> Value {
    match schema {
        Value::Object(mut map) if !map.is_empty() => {
            if map.get("type").is_none_or(Value::is_null) {
                map.insert("type".into(), "object".into());
            }
            if map.get("type") == Some(&Value::from("object")) && !map.contains_key("properties") {
                map.insert("properties".into(), json!({}));
            }
            Value::Object(map)
        }
        _ => json!({"type": "object", "properties": {}}),
    }
}

fn cut_chars(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// Lists the tools of every server, each through a session of its own (its stdio program in
/// `sandbox`, when given), closed afterwards.
pub async fn discover_all(
    specs: &[McpServerSpec],
    sandbox: Option<&Sandbox>,
) -> Result<Vec<FrozenServer>, McpError> {
    let mut frozen = Vec::with_capacity(specs.len());
    for spec in specs {
        let server = McpServer::in_sandbox(spec.clone(), sandbox.cloned());
        let result = server.discover().await;
        server.close().await;
        let found = result?;
        info!(server = %spec.name, tools = found.tools.len(), "MCP tools discovered");
        frozen.push(found);
    }
    Ok(frozen)
}

/// [`discover_all`] from synchronous code (the plan), on a runtime of its own in a thread of
/// its own: the plan may run inside another runtime's blocking pool, or outside any.
pub fn discover_blocking(
    specs: &[McpServerSpec],
    sandbox: Option<&Sandbox>,
) -> Result<Vec<FrozenServer>, McpError> {
    if specs.is_empty() {
        return Ok(Vec::new());
    }
    let specs = specs.to_vec();
    let failed = |message: String| McpError::Server {
        server: specs.first().map(|s| s.name.clone()).unwrap_or_default(),
        message,
    };
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|err| failed(format!("cannot start a runtime: {err}")))?;
                runtime.block_on(discover_all(&specs, sandbox))
            })
            .join()
            .unwrap_or_else(|_| Err(failed("discovery panicked".to_owned())))
    })
}

/// One frozen tool of a server.
#[derive(Debug)]
pub struct McpTool {
    spec: ToolSpec,
    remote_name: String,
    server: Arc<McpServer>,
}

impl McpTool {
    pub fn new(server: Arc<McpServer>, frozen: &FrozenTool) -> Self {
        Self {
            spec: ToolSpec {
                name: offered_name(server.name(), &frozen.name),
                description: frozen.description.clone(),
                parameters: frozen.input_schema.clone(),
            },
            remote_name: frozen.name.clone(),
            server,
        }
    }
}

impl Tool for McpTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn call<'a>(&'a self, args: Map<String, Value>, _ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(self.server.call(&self.remote_name, args))
    }

    /// An MCP server keeps its state outside the workspace.
    fn read_only(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offered_names_follow_hermes_agent() {
        assert_eq!(
            offered_name("time", "get_current_time"),
            "mcp__time__get_current_time"
        );
        assert_eq!(
            offered_name("my-server.v2", "a-b"),
            "mcp__my_server_v2__a_b"
        );
    }

    #[test]
    fn results_take_hermes_agents_shape() {
        let text = |t: &str| ContentBlock::Text(rmcp::model::TextContent::new(t));
        let mut result = CallToolResult::success(vec![text("a"), text("b")]);
        assert_eq!(
            render(result.clone(), 100),
            ToolOutcome::Ok(json!({"result": "a\nb"}))
        );
        result.structured_content = Some(json!({"n": 1}));
        assert_eq!(
            render(result.clone(), 100),
            ToolOutcome::Ok(json!({"result": "a\nb", "structuredContent": {"n": 1}}))
        );
        result.content.clear();
        assert_eq!(
            render(result, 100),
            ToolOutcome::Ok(json!({"result": {"n": 1}}))
        );
        let error = CallToolResult::error(vec![text("no such city")]);
        assert_eq!(
            render(error, 100),
            ToolOutcome::Err("no such city".to_owned())
        );
    }

    #[test]
    fn schemas_are_made_object_schemas() {
        assert_eq!(
            normalise_schema(json!({})),
            json!({"type": "object", "properties": {}})
        );
        assert_eq!(
            normalise_schema(json!({"required": []})),
            json!({"required": [], "type": "object", "properties": {}})
        );
        assert_eq!(strip_unicode_tags("a\u{E0041}b"), "ab");
    }
}
