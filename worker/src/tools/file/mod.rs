//! The `file` toolset: `read_file`, `write_file`, `patch` and `search_files`, all confined to the
//! conversation's workspace (how, and against what, is the business of `confine.rs`).
//!
//! Each tool is one module with one `FileCall` type: the tool's name, description and argument
//! schema, how its arguments are read, and what a call does with them. `FileTool` turns any
//! `FileCall` into a [`Tool`]: arguments are checked before anything touches the disk, then the
//! call runs on the blocking pool — file I/O is plain `std::fs`, simple, and each call is bounded
//! by the limits.
//!
//! To add a file tool: write a module beside `read.rs` with a type that implements `FileCall`
//! (reaching every path through `confine`'s `resolve` and `open_confined`), add it to the `mod`
//! lines below, and register it with one line in [`tools`]. Its tests can use `fixture.rs`, a
//! workspace with every kind of way out of it.

pub(crate) mod confine;
#[cfg(test)]
mod fixture;
mod patch;
mod read;
mod search;
mod write;

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::{Tool, ToolContext, ToolFuture, ToolLimits, ToolOutcome, ToolSpec, Workspace};
use crate::spec::ToolsSpec;

pub const TOOLSET: &str = "file";

/// Longer lines are cut in `read_file` and `search_files` output: a minified bundle would
/// otherwise fill a whole page with one line.
const MAX_LINE_BYTES: usize = 2000;

/// The `path` argument of the tools that work on one file.
fn file_path_parameter() -> Value {
    json!({
        "type": "string",
        "description": "Path of the file, relative to the workspace directory."
    })
}

/// The toolset's tools, in the order the model is shown them.
pub fn tools(_config: &ToolsSpec) -> Vec<Arc<dyn Tool>> {
    vec![
        FileTool::<read::ReadFileCall>::shared(),
        FileTool::<write::WriteFileCall>::shared(),
        FileTool::<patch::PatchCall>::shared(),
        FileTool::<search::SearchFilesCall>::shared(),
    ]
}

/// One call of a file tool with its validated arguments, owned so it can move to the blocking
/// pool; the type also describes its tool.
trait FileCall: fmt::Debug + Send + Sized + 'static {
    const NAME: &'static str;
    const DESCRIPTION: &'static str;
    /// The tool never changes the workspace (see [`Tool::read_only`]).
    const READ_ONLY: bool;

    /// JSON schema of the arguments object.
    fn parameters() -> Value;

    /// Checks the arguments the model gave, without touching the disk.
    fn parse(args: &Map<String, Value>) -> Result<Self, String>;

    /// Does the work; the error is the message the model is shown.
    fn run(self, workspace: &Workspace, limits: &ToolLimits) -> Result<Value, String>;
}

/// The [`Tool`] of a [`FileCall`].
struct FileTool<Call> {
    spec: ToolSpec,
    // `fn() -> Call`: the tool holds no call, so it is `Send + Sync` whatever `Call` is.
    call: PhantomData<fn() -> Call>,
}

impl<Call: FileCall> FileTool<Call> {
    fn shared() -> Arc<dyn Tool> {
        Arc::new(Self {
            spec: ToolSpec {
                name: Call::NAME.to_owned(),
                description: Call::DESCRIPTION.to_owned(),
                parameters: Call::parameters(),
            },
            call: PhantomData,
        })
    }
}

impl<Call> fmt::Debug for FileTool<Call> {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("FileTool")
            .field("name", &self.spec.name)
            .finish_non_exhaustive()
    }
}

impl<Call: FileCall> Tool for FileTool<Call> {
    fn spec(&self) -> &ToolSpec {
        &self.spec
    }

    fn read_only(&self) -> bool {
        Call::READ_ONLY
    }

    fn call<'a>(&'a self, args: Map<String, Value>, ctx: &'a ToolContext) -> ToolFuture<'a> {
        let workspace = ctx.file_workspace();
        let limits = ctx.limits.clone();
        Box::pin(async move {
            let workspace = match workspace {
                Ok(workspace) => workspace,
                Err(message) => return ToolOutcome::Err(message),
            };
            let call = match Call::parse(&args) {
                Ok(call) => call,
                Err(message) => return ToolOutcome::Err(message),
            };
            match tokio::task::spawn_blocking(move || call.run(&workspace, &limits)).await {
                Ok(Ok(value)) => ToolOutcome::Ok(value),
                Ok(Err(message)) => ToolOutcome::Err(message),
                Err(err) => ToolOutcome::Err(format!("the tool failed internally: {err}")),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn file_toolset_offers_four_tools_with_object_schemas() {
        let tools = tools(&ToolsSpec::default());
        let names: Vec<_> = tools.iter().map(|tool| tool.spec().name.as_str()).collect();
        assert_eq!(names, ["read_file", "write_file", "patch", "search_files"]);
        for tool in &tools {
            let parameters = &tool.spec().parameters;
            assert_eq!(parameters["type"], "object");
            for required in parameters["required"].as_array().unwrap() {
                assert!(
                    parameters["properties"]
                        .get(required.as_str().unwrap())
                        .is_some()
                );
            }
        }
    }
}
