//! Tools the agent can call, grouped into toolsets.
//!
//! A [`Tool`] is a name, a description, a JSON schema for its arguments and an async handler. Tools
//! are grouped into toolsets (`terminal`, `file`, ...) because distributions sample toolsets, not
//! tools. The [`Registry`] knows every toolset name the reference's distributions use; the ones this
//! build cannot serve are *known but unavailable*, so a run that could draw them is refused before
//! any work starts, naming the toolset and what would enable it (the reference silently dropped them).
//!
//! Every conversation gets its own [`Workspace`] directory; file tools are confined to it by path
//! checks (they run inside the worker, which needs the storage, so the worker itself cannot be
//! put under Landlock), and the terminal runs its commands inside it under the [`sandbox`].
//!
//! To add a tool to a toolset, see that toolset's module ([`file`] says how for a file tool). To
//! add a toolset: a module with its `TOOLSET` name and a `tools(&ToolsSpec)` list, registered in
//! [`Registry::builtin`] and in [`crate::toolsets::SHIPPED`] (taken off `NOT_YET_SHIPPED` if a
//! distribution already names it), so that a spec naming it validates.
//! Arguments are read with the `args` helpers, output is cut on character boundaries by `text`.
//!
//! Besides the built-in toolsets, a spec declares toolsets of its own: MCP servers ([`mcp`],
//! whose tools `plan` discovers and freezes into the manifest, see [`Registry::with_frozen_mcp`])
//! and HTTP tools ([`http`]). They are registered after the built-in ones, in declaration order.

pub mod browser;
mod endpoint;
pub mod file;
pub mod http;
pub mod image_gen;
pub mod mcp;
pub mod sandbox;
pub mod terminal;
pub mod vision;
pub mod web;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;

use std::pin::Pin;
use std::sync::Arc;

use serde_json::{Map, Value};

pub use endpoint::EndpointError;
pub use trajectory_sandbox::files::{Workspace, WorkspaceError};
use trajectory_sandbox::{args, text};

use crate::model::{ToolCall, ToolMessage};
use crate::spec::ToolsSpec;
use crate::toolsets;

/// The future a tool handler returns.
pub type ToolFuture<'a> = Pin<Box<dyn Future<Output = ToolOutcome> + Send + 'a>>;

/// What the model is told about a tool (the `function` of an `OpenAI` tool definition).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON schema of the arguments object.
    pub parameters: Value,
}

/// The result of one tool call, before it is rendered into the `tool` message content.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutcome {
    /// The tool ran; the value is its JSON result (an object, as the reference's tools return).
    Ok(Value),
    /// The tool refused or failed; the message goes back to the model as `{"error": message}`.
    Err(String),
}

impl ToolOutcome {
    /// Renders the outcome as the `content` string of a `tool` message. Errors use the
    /// `{"error": ...}` convention that the reference's tool statistics classify as failures.
    pub fn into_content(self) -> String {
        match self {
            Self::Ok(Value::String(text)) => text,
            Self::Ok(value) => value.to_string(),
            Self::Err(message) => serde_json::json!({ "error": message }).to_string(),
        }
    }
}

/// A callable tool.
pub trait Tool: Send + Sync + fmt::Debug {
    fn spec(&self) -> &ToolSpec;
    /// Runs the tool with already-parsed arguments inside the conversation's context.
    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a>;
    /// The tool never changes anything in the workspace, so a workspace in which only such tools
    /// ran is still empty and can be handed to the next conversation. When in doubt: `false`.
    fn read_only(&self) -> bool {
        false
    }
    /// What a conversation resumed from the turn log does with this tool's earlier calls. By
    /// default a tool that changes nothing keeps its recorded output ([`ResumeRule::Recorded`])
    /// and any other runs again and must answer as it did ([`ResumeRule::RerunExact`]).
    fn on_resume(&self) -> ResumeRule {
        if self.read_only() {
            ResumeRule::Recorded
        } else {
            ResumeRule::RerunExact
        }
    }
}

/// How a resumed conversation brings back what a tool's earlier calls did, so that the
/// environment is where the conversation left it (see `docs/storage.md`, "The turn log").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResumeRule {
    /// The call left nothing in the conversation's environment (or left it outside, where it
    /// still is: an MCP server's, a web service's): its recorded output stands and it does not
    /// run again.
    Recorded,
    /// The call runs again in the fresh environment; an output that differs from the recorded
    /// one (a time, a process id, a random number) is noted in the record's divergences and the
    /// conversation goes on, its transcript keeping what the model saw.
    RerunKeepGoing,
    /// The call runs again and must answer exactly as recorded; otherwise the environment is
    /// not the one the conversation saw and it starts over from its prompt.
    RerunExact,
    /// What the call left cannot be brought back (a browser page): a conversation that made it
    /// starts over from its prompt.
    StartOver,
}

/// Per-conversation state shared by every tool call of that conversation.
#[derive(Debug)]
pub struct ToolContext {
    pub workspace: Workspace,
    pub limits: ToolLimits,
    /// How terminal commands are confined.
    pub sandbox: sandbox::Sandbox,
    /// The conversation's browser context, opened by its first browser call and disposed with
    /// this context.
    pub browser: browser::ConversationBrowser,
    /// The conversation's shell, background jobs and working directory; ended by
    /// [`ToolContext::close`].
    pub terminal: terminal::Terminal,
}

impl ToolContext {
    /// A context for one conversation in `workspace`.
    pub fn new(workspace: Workspace, limits: ToolLimits, sandbox: sandbox::Sandbox) -> Self {
        Self {
            workspace,
            limits,
            sandbox,
            browser: browser::ConversationBrowser::default(),
            terminal: terminal::Terminal::default(),
        }
    }

    /// Ends what the conversation left running (its shell, its background jobs) and waits until
    /// it is gone, so that nothing of it touches the workspace afterwards.
    pub async fn close(&self) {
        self.terminal.close().await;
    }

    /// The workspace as the file tools see it: relative paths start in the terminal's working
    /// directory, as hermes-agent's file tools do. (In a task container the file tools run in
    /// the container instead: [`file`].)
    pub fn file_workspace(&self) -> Result<Workspace, String> {
        let base = terminal::file_base(&self.terminal, self.workspace.root())?;
        Ok(self.workspace.clone().starting_in(base))
    }
}

/// Caps that keep a misbehaving model from producing unbounded work or output.
#[derive(Debug, Clone)]
pub struct ToolLimits {
    /// Wall-clock limit of a terminal command that names none (and the longest `process`
    /// `wait`); what the command started is killed after it.
    pub command_timeout: std::time::Duration,
    /// Bytes of a command's output shown (head and tail are kept, the middle elided).
    pub max_output_bytes: usize,
    /// Lines returned by one `read_file` page.
    pub max_read_lines: usize,
    /// Bytes `write_file` accepts in one call.
    pub max_write_bytes: usize,
    /// Matches returned by one `search_files` call.
    pub max_search_results: usize,
}

impl ToolLimits {
    /// The limits of one file call.
    pub fn files(&self) -> trajectory_sandbox::files::FileLimits {
        trajectory_sandbox::files::FileLimits {
            max_read_lines: self.max_read_lines,
            max_write_bytes: self.max_write_bytes,
            max_search_results: self.max_search_results,
        }
    }
}

impl Default for ToolLimits {
    fn default() -> Self {
        Self {
            command_timeout: std::time::Duration::from_secs(180),
            max_output_bytes: 50_000,
            max_read_lines: 500,
            max_write_bytes: 1024 * 1024,
            max_search_results: 100,
        }
    }
}

/// Whether a toolset can be served by this build and configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Availability {
    Available,
    /// Known name, but it cannot be served; the text says what would enable it.
    Unavailable(String),
}

/// A named group of tools.
#[derive(Debug, Clone)]
pub struct Toolset {
    /// A built-in name, or one the spec declares.
    pub name: Cow<'static, str>,
    pub availability: Availability,
    pub tools: Vec<Arc<dyn Tool>>,
}

/// Every toolset this build knows, in a fixed order (which is also the catalog order).
#[derive(Debug, Clone)]
pub struct Registry {
    toolsets: Vec<Toolset>,
    /// The declared MCP servers, whose sessions the tools of every [`Registry::with_frozen_mcp`]
    /// copy share: one session per server and process.
    mcp_servers: Vec<Arc<mcp::McpServer>>,
}

/// A toolset whose tools need a backend: available with its tools, or unavailable saying why.
fn backed_toolset<E: fmt::Display>(
    name: &'static str,
    tools: Result<Vec<Arc<dyn Tool>>, E>,
) -> Toolset {
    match tools {
        Ok(tools) => Toolset {
            name: name.into(),
            availability: Availability::Available,
            tools,
        },
        Err(error) => Toolset {
            name: name.into(),
            availability: Availability::Unavailable(error.to_string()),
            tools: Vec::new(),
        },
    }
}

impl Registry {
    /// The built-in toolsets, configured from the run's `tools` spec; their long-lived
    /// programs (MCP stdio servers, Chromium) are the worker's children.
    pub fn builtin(config: &ToolsSpec) -> Self {
        Self::builtin_with(config, None)
    }

    /// [`Registry::builtin`], with the long-lived programs started in `sessions` when given
    /// (the pod's sandbox container: [`sandbox::Sandbox::for_sessions`]).
    pub fn builtin_with(config: &ToolsSpec, sessions: Option<&sandbox::Sandbox>) -> Self {
        let mut toolsets = vec![
            Toolset {
                name: terminal::TOOLSET.into(),
                availability: Availability::Available,
                tools: terminal::tools(config),
            },
            Toolset {
                name: file::TOOLSET.into(),
                availability: Availability::Available,
                tools: file::tools(config),
            },
            backed_toolset(web::TOOLSET, web::tools(config)),
            backed_toolset(web::SEARCH_TOOLSET, web::search_tools(config)),
            backed_toolset(browser::TOOLSET, browser::tools(config, sessions)),
            backed_toolset(vision::TOOLSET, vision::tools(config)),
            backed_toolset(image_gen::TOOLSET, image_gen::tools(config)),
        ];
        toolsets.extend(
            toolsets::NOT_YET_SHIPPED
                .iter()
                .map(|(name, hint)| Toolset {
                    name: (*name).into(),
                    availability: Availability::Unavailable((*hint).to_owned()),
                    tools: Vec::new(),
                }),
        );
        let mcp_servers: Vec<Arc<mcp::McpServer>> = config
            .mcp
            .iter()
            .map(|server| {
                Arc::new(mcp::McpServer::in_sandbox(
                    server.clone(),
                    sessions.cloned(),
                ))
            })
            .collect();
        // An MCP toolset has its tools once the frozen list is known (`with_frozen_mcp`).
        toolsets.extend(mcp_servers.iter().map(|server| Toolset {
            name: server.name().to_owned().into(),
            availability: Availability::Available,
            tools: Vec::new(),
        }));
        toolsets.extend(config.http.iter().map(|group| Toolset {
            name: group.toolset.clone().into(),
            availability: Availability::Available,
            tools: http::tools(group),
        }));
        Self {
            toolsets,
            mcp_servers,
        }
    }

    /// This registry with the MCP toolsets holding the tools `plan` froze (a server the spec
    /// no longer declares is ignored; a declared one missing from `frozen` has no tools).
    #[must_use]
    pub fn with_frozen_mcp(&self, frozen: &[mcp::FrozenServer]) -> Self {
        let mut registry = self.clone();
        for server in &self.mcp_servers {
            let tools: Vec<Arc<dyn Tool>> = frozen
                .iter()
                .filter(|entry| entry.server == server.name())
                .flat_map(|entry| entry.tools.iter())
                .map(|tool| Arc::new(mcp::McpTool::new(Arc::clone(server), tool)) as Arc<dyn Tool>)
                .collect();
            if let Some(toolset) = registry
                .toolsets
                .iter_mut()
                .find(|toolset| toolset.name == server.name())
            {
                toolset.tools = tools;
            }
        }
        registry
    }

    /// Lists the tools of every declared MCP server now (a run without a plan: `prompt`).
    pub async fn discover_mcp(&self) -> Result<Vec<mcp::FrozenServer>, mcp::McpError> {
        let mut frozen = Vec::with_capacity(self.mcp_servers.len());
        for server in &self.mcp_servers {
            frozen.push(server.discover().await?);
        }
        Ok(frozen)
    }

    pub fn toolset(&self, name: &str) -> Option<&Toolset> {
        self.toolsets.iter().find(|toolset| toolset.name == name)
    }

    pub fn toolset_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.toolsets.iter().map(|toolset| toolset.name.as_ref())
    }

    /// The tools of the given toolsets, in registry order, without duplicates.
    pub fn tools_for(&self, toolsets: &[String]) -> Vec<Arc<dyn Tool>> {
        let mut seen = std::collections::BTreeSet::new();
        self.toolsets
            .iter()
            .filter(|toolset| toolsets.iter().any(|name| *name == toolset.name))
            .flat_map(|toolset| toolset.tools.iter())
            .filter(|tool| seen.insert(tool.spec().name.clone()))
            .cloned()
            .collect()
    }

    /// The frozen tool catalog of a run: every tool of the given toolsets, in registry order.
    /// `tool_stats` of every record are normalised over it, so every line has the same keys.
    pub fn catalog(&self, toolsets: &[String]) -> Vec<String> {
        self.tools_for(toolsets)
            .iter()
            .map(|tool| tool.spec().name.clone())
            .collect()
    }

    /// Tool name → toolset name, for the tools of available toolsets.
    pub fn tool_to_toolset(&self) -> BTreeMap<String, &str> {
        self.toolsets
            .iter()
            .flat_map(|toolset| {
                toolset
                    .tools
                    .iter()
                    .map(move |tool| (tool.spec().name.clone(), toolset.name.as_ref()))
            })
            .collect()
    }
}

/// Runs one tool call; unknown tools and invalid arguments go back to the model as tool errors.
pub async fn execute(call: &ToolCall, tools: &[Arc<dyn Tool>], ctx: &ToolContext) -> ToolMessage {
    let outcome = match (
        tools.iter().find(|tool| tool.spec().name == call.name),
        &call.arguments,
    ) {
        (None, _) => {
            let available: Vec<_> = tools.iter().map(|tool| tool.spec().name.as_str()).collect();
            ToolOutcome::Err(format!(
                "unknown tool {:?}; available tools: {}",
                call.name,
                if available.is_empty() {
                    "none".to_owned()
                } else {
                    available.join(", ")
                }
            ))
        }
        (Some(_), Err(reason)) => {
            ToolOutcome::Err(format!("invalid arguments for {}: {reason}", call.name))
        }
        (Some(tool), Ok(arguments)) => {
            let started = std::time::Instant::now();
            let outcome = tool.call(arguments.clone(), ctx).await;
            tracing::debug!(tool = %call.name, elapsed_ms = started.elapsed().as_millis(), "tool call finished");
            outcome
        }
    };
    ToolMessage {
        tool_call_id: call.id.clone(),
        name: call.name.clone(),
        content: outcome.into_content(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_outcome_renders_as_error_object() {
        assert_eq!(
            ToolOutcome::Err("boom".into()).into_content(),
            r#"{"error":"boom"}"#
        );
        assert_eq!(
            ToolOutcome::Ok(serde_json::json!({"a": 1})).into_content(),
            r#"{"a":1}"#
        );
    }

    #[test]
    fn the_registry_serves_every_shipped_toolset_in_catalog_order() {
        let registry = Registry::builtin(&ToolsSpec::default());
        let names: Vec<&str> = registry.toolset_names().collect();
        assert_eq!(names, toolsets::SHIPPED);
    }

    #[test]
    fn search_offers_web_search_alone_and_the_browser_does_not_offer_it() {
        let config: ToolsSpec = serde_json::from_value(serde_json::json!({
            "web": {"search": {"url": "http://127.0.0.1:1"}},
            "browser": {},
        }))
        .unwrap();
        let registry = Registry::builtin(&config);
        let names = |toolset: &str| registry.catalog(&[toolset.to_owned()]);
        assert_eq!(names(web::SEARCH_TOOLSET), ["web_search"]);
        assert_eq!(names(web::TOOLSET), ["web_search", "web_extract"]);
        assert!(!names(browser::TOOLSET).is_empty());
        assert!(
            !names(browser::TOOLSET)
                .iter()
                .any(|tool| tool == "web_search"),
            "{:?}",
            names(browser::TOOLSET)
        );
        // Drawn together, `web_search` is offered once.
        assert_eq!(
            registry.catalog(&["search".to_owned(), "web".to_owned()]),
            ["web_search", "web_extract"]
        );
        let without_backend = Registry::builtin(&ToolsSpec::default());
        assert_eq!(
            without_backend
                .toolset(web::SEARCH_TOOLSET)
                .map(|toolset| &toolset.availability),
            Some(&Availability::Unavailable(
                "spec.tools.web.search is not set: configure a search backend".to_owned()
            ))
        );
    }
}
