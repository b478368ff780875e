//! The `file` toolset: `read_file`, `write_file`, `patch` and `search_files`.
//!
//! The calls themselves are [`trajectory_sandbox::files`]': they run where the conversation's
//! files are. Usually that is the worker, on the conversation's workspace directory, confined to
//! it by path checks (on the blocking pool: file I/O is plain `std::fs`). For a conversation in
//! a task container it is that container: the call goes to the container's executor, which runs
//! it under the conversation's Landlock rules on the image's filesystem, where absolute paths
//! (`/testbed/src/app.py`) are the normal case and the container is the confinement.
//!
//! To add a file tool, see [`trajectory_sandbox::files`]; it shows up here by itself.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde_json::{Map, Value};
use trajectory_sandbox::files::{self, FileToolSpec};
use trajectory_sandbox::protocol::FileRequest;

use super::sandbox::{Place, TaskDir, run_file_in_pod};
use super::{Tool, ToolContext, ToolFuture, ToolOutcome, ToolSpec};
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "file";

/// The toolset's tools, in the order the model is shown them.
pub fn tools(_config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    files::specs()
        .into_iter()
        .map(|spec| Arc::new(FileTool::from(spec)) as Arc<dyn Tool>)
        .collect()
}

/// The [`Tool`] of one file tool.
struct FileTool {
    spec: ToolSpec,
    read_only: bool,
}

impl From<FileToolSpec> for FileTool {
    fn from(spec: FileToolSpec) -> Self {
        Self {
            spec: ToolSpec {
                name: spec.name.to_owned(),
                description: spec.description.to_owned(),
                parameters: spec.parameters,
            },
            read_only: spec.read_only,
        }
    }
}

impl fmt::Debug for FileTool {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("FileTool")
            .field("name", &self.spec.name)
            .finish_non_exhaustive()
    }
}

impl Tool for FileTool {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        Box::pin(async move {
            let outcome = match (&ctx.sandbox.task, &ctx.sandbox.place) {
                (Some(task), Place::Pod { socket }) => {
                    self.in_task_container(args, ctx, task, socket).await
                }
                _ => self.here(args, ctx).await,
            };
            match outcome {
                Ok(value) => ToolOutcome::Ok(value),
                Err(message) => ToolOutcome::Err(message),
            }
        })
    }
}

impl FileTool {
    /// The call on the conversation's workspace, in this process.
    async fn here(&self, args: Map<String, Value>, ctx: &ToolContext) -> Result<Value, String> {
        let workspace = ctx.file_workspace()?;
        let (name, limits) = (self.spec.name.clone(), ctx.limits.files());
        tokio::task::spawn_blocking(move || files::call(&name, &args, &workspace, &limits))
            .await
            .unwrap_or_else(|err| Err(format!("the tool failed internally: {err}")))
    }

    /// The call in the conversation's task container: relative paths start where its shell is,
    /// or, before any command, where its commands start (the row's `cwd`, or the image's working
    /// directory). Bounded by the command timeout; a call cut short is ended there.
    async fn in_task_container(
        &self,
        args: Map<String, Value>,
        ctx: &ToolContext,
        task: &TaskDir,
        socket: &Path,
    ) -> Result<Value, String> {
        let workspace = ctx.terminal.cwd().map_or_else(
            || task.workspace().to_owned(),
            |cwd| cwd.display().to_string(),
        );
        let request = FileRequest {
            workspace,
            tool: self.spec.name.clone(),
            args,
            landlock: ctx.sandbox.landlock,
            limits: ctx.limits.files(),
        };
        let timeout = ctx.limits.command_timeout;
        tokio::time::timeout(timeout, run_file_in_pod(socket, &request))
            .await
            .map_err(|_| {
                format!(
                    "the call did not finish within {} s in the task's container",
                    timeout.as_secs()
                )
            })?
            .map_err(|err| format!("the task's container did not answer: {err}"))?
    }
}
