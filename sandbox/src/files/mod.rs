//! The `file` toolset's calls: `read_file`, `write_file`, `patch` and `search_files`, on a
//! [`Workspace`] (how paths are confined to it, and against what, is the business of
//! `confine.rs`).
//!
//! They live here, beside the executor, because they run in two places: in the worker, on the
//! conversation's workspace directory, and, for a conversation in a task container, in that
//! container, where the executor runs them under the conversation's Landlock rules
//! ([`crate::file`]) on the container's own filesystem.
//!
//! Each tool is one module with one `FileCall` type: the tool's name, description and argument
//! schema, how its arguments are read, and what a call does with them. File I/O is plain
//! `std::fs`, simple, and each call is bounded by the [`FileLimits`].
//!
//! To add a file tool: write a module beside `read.rs` with a type that implements `FileCall`
//! (reaching every path through `confine`'s `resolve` and `open_confined`), add it to the `mod`
//! lines below and to [`CALLS`]. Its tests can use `fixture.rs`, a workspace with every kind of
//! way out of it.

pub mod confine;
#[cfg(test)]
mod fixture;
mod patch;
mod read;
mod search;
mod workspace;
mod write;

use serde_json::{Map, Value, json};

pub use workspace::{Workspace, WorkspaceError};

/// Longer lines are cut in `read_file` and `search_files` output: a minified bundle would
/// otherwise fill a whole page with one line.
const MAX_LINE_BYTES: usize = 2000;

/// What one file call may return or take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileLimits {
    /// Lines returned by one `read_file` page.
    pub max_read_lines: usize,
    /// Bytes `write_file` accepts in one call.
    pub max_write_bytes: usize,
    /// Matches returned by one `search_files` call.
    pub max_search_results: usize,
}

impl Default for FileLimits {
    fn default() -> Self {
        Self {
            max_read_lines: 500,
            max_write_bytes: 1024 * 1024,
            max_search_results: 100,
        }
    }
}

/// The `path` argument of the tools that work on one file.
fn file_path_parameter() -> Value {
    json!({
        "type": "string",
        "description": "Path of the file, relative to the working directory."
    })
}

/// What the model is told about one file tool.
#[derive(Debug, Clone, PartialEq)]
pub struct FileToolSpec {
    pub name: &'static str,
    pub description: &'static str,
    /// JSON schema of the arguments object.
    pub parameters: Value,
    /// The tool never changes a file.
    pub read_only: bool,
}

/// One call of a file tool with its validated arguments; the type also describes its tool.
trait FileCall: Sized {
    const NAME: &'static str;
    const DESCRIPTION: &'static str;
    /// The tool never changes the workspace.
    const READ_ONLY: bool;

    /// JSON schema of the arguments object.
    fn parameters() -> Value;

    /// Checks the arguments the model gave, without touching the disk.
    fn parse(args: &Map<String, Value>) -> Result<Self, String>;

    /// Does the work; the error is the message the model is shown.
    fn run(self, workspace: &Workspace, limits: &FileLimits) -> Result<Value, String>;
}

/// A file tool's call with the model's arguments, its type erased.
type ErasedCall = fn(&Map<String, Value>, &Workspace, &FileLimits) -> Result<Value, String>;

/// One file tool.
struct Entry {
    spec: fn() -> FileToolSpec,
    call: ErasedCall,
}

impl Entry {
    const fn of<Call: FileCall>() -> Self {
        Self {
            spec: || FileToolSpec {
                name: Call::NAME,
                description: Call::DESCRIPTION,
                parameters: Call::parameters(),
                read_only: Call::READ_ONLY,
            },
            call: |args, workspace, limits| Call::parse(args)?.run(workspace, limits),
        }
    }
}

/// The toolset's tools, in the order the model is shown them.
const CALLS: [Entry; 4] = [
    Entry::of::<read::ReadFileCall>(),
    Entry::of::<write::WriteFileCall>(),
    Entry::of::<patch::PatchCall>(),
    Entry::of::<search::SearchFilesCall>(),
];

/// The file tools, in the order the model is shown them.
pub fn specs() -> Vec<FileToolSpec> {
    CALLS.iter().map(|entry| (entry.spec)()).collect()
}

/// Calls the file tool `tool` with the model's `args`: arguments are checked before anything
/// touches the disk. The error is the message the model is shown.
pub fn call(
    tool: &str,
    args: &Map<String, Value>,
    workspace: &Workspace,
    limits: &FileLimits,
) -> Result<Value, String> {
    let entry = CALLS
        .iter()
        .find(|entry| (entry.spec)().name == tool)
        .ok_or_else(|| format!("no file tool is called {tool}"))?;
    (entry.call)(args, workspace, limits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_toolset_offers_four_tools_with_object_schemas() {
        let specs = specs();
        let names: Vec<_> = specs.iter().map(|spec| spec.name).collect();
        assert_eq!(names, ["read_file", "write_file", "patch", "search_files"]);
        for spec in &specs {
            assert_eq!(spec.parameters["type"], "object");
            for required in spec.parameters["required"].as_array().unwrap() {
                assert!(
                    spec.parameters["properties"]
                        .get(required.as_str().unwrap())
                        .is_some()
                );
            }
        }
    }
}
