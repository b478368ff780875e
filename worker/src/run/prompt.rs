//! `prompt`: one prompt end to end, printed as its record (for trying a setup and debugging).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::batch::Engine;
use super::{RunError, RunFile};
use crate::agent::run_conversation;
use crate::hermes::{RecordContext, trajectory_record};
use crate::tools::sandbox::Sandbox;
use crate::tools::{ToolContext, ToolSpec, Workspace};

/// Runs `prompt` with the run file's model and tools and returns the trajectory record.
pub async fn run_prompt(
    run_file: &Path,
    prompt: &str,
    toolsets: Option<Vec<String>>,
    workspace_root: PathBuf,
    sandbox: Sandbox,
) -> Result<Map<String, Value>, RunError> {
    let run_file = RunFile::load(run_file)?;
    let spec = &run_file.spec;
    let mut engine = Engine::new(spec, workspace_root)?;
    engine.keep_limits(spec, 1);
    engine.sandbox = sandbox;
    // No plan froze the MCP tools of a single prompt: they are listed now.
    let frozen = engine
        .registry
        .discover_mcp()
        .await
        .map_err(|err| RunError::Spec(err.to_string()))?;
    engine.registry = engine.registry.with_frozen_mcp(&frozen);
    let toolsets = match toolsets {
        Some(names) => {
            if let Some(unknown) = names
                .iter()
                .find(|name| engine.registry.toolset(name).is_none())
            {
                return Err(RunError::Spec(format!(
                    "--toolsets: unknown toolset {unknown:?}"
                )));
            }
            names
        }
        None => engine.distribution.sample(spec.seed, 0, 0),
    };
    let tools = engine.registry.tools_for(&toolsets);
    let offered: Vec<ToolSpec> = tools.iter().map(|tool| tool.spec().clone()).collect();
    let catalog = engine
        .registry
        .catalog(&engine.distribution.possible_toolsets());
    let dir = tempfile::Builder::new()
        .prefix("prompt-")
        .tempdir_in(&engine.workspace_root)
        .map_err(|err| RunError::Internal(format!("cannot create a workspace: {err}")))?;
    let workspace =
        Workspace::new(dir.path()).map_err(|err| RunError::Internal(err.to_string()))?;
    let context = ToolContext {
        workspace,
        limits: engine.limits.clone(),
        sandbox: engine.sandbox.clone(),
        browser: crate::tools::browser::ConversationBrowser::default(),
        terminal: crate::tools::terminal::Terminal::default(),
    };
    let started_at = chrono::Utc::now();
    let conversation =
        run_conversation(&engine.client, &tools, &context, prompt, &engine.agent).await;
    context.close().await;
    let conversation = conversation.map_err(|err| {
        if err.is_model_missing() {
            RunError::ModelNotFound(err.to_string())
        } else if err.is_permanent() {
            RunError::ModelConfiguration(err.to_string())
        } else if err.is_transient() {
            RunError::ModelUnavailable(err.to_string())
        } else {
            RunError::Internal(err.to_string())
        }
    })?;
    let source = Map::new();
    let record_context = RecordContext {
        id: "prompt-0-0",
        prompt_index: 0,
        sample: 0,
        batch: 0,
        model: &spec.model.name,
        toolsets_used: &toolsets,
        tools_offered: &offered,
        system_turn: None,
        catalog: &catalog,
        started_at,
        finished_at: chrono::Utc::now(),
        source: &source,
        verification: None,
        discarded_by: None,
    };
    Ok(trajectory_record(&conversation, &record_context))
}
